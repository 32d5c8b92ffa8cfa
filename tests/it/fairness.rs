//! I10, fair shares: a workspace whose calls arrive behind another workspace's backlog is
//! granted the provider's capacity in turn with it, not after it, through the real budget in
//! PostgreSQL. (The windows' share of the fair order is the core's property test, `windows`
//! and `fair`; the whole chain is `make bench-fairness`.)

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::helpers::TestDb;
use replyd::capacity::{Capacity, CapacitySettings};

/// Bounds a wait that must end; how long it took is not what the test judges.
const MUST_END: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_behind_anothers_backlog_is_granted_capacity_in_turn_not_after_it() {
    let db = TestDb::new().await;
    let shutdown = CancellationToken::new();
    let settings = CapacitySettings {
        // 20 a second: the burst below takes 2 s of the budget.
        requests_per_minute: Some(1_200),
        adaptive: false,
        ..CapacitySettings::default()
    };
    let capacity = Capacity::new(db.store.clone(), settings, "w1".into(), shutdown.clone());
    let granted = Arc::new(AtomicUsize::new(0));
    let acquire = |workspace: &'static str| {
        let (capacity, granted) = (capacity.clone(), Arc::clone(&granted));
        tokio::spawn(async move {
            let never = CancellationToken::new();
            let permit = capacity
                .acquire("gpt-test", (workspace, 0), 100, &never, || {})
                .await
                .expect("granted");
            // The place of this permit among all the permits given.
            let place = granted.fetch_add(1, Ordering::SeqCst);
            drop(permit);
            place
        })
    };
    let burst: Vec<_> = (0..40).map(|_| acquire("ws-a")).collect();
    // The burst waits: once its first call has gone, all of it is queued at the budget.
    crate::helpers::wait_until("the burst's first permit", MUST_END, || async {
        granted.load(Ordering::SeqCst) > 0
    })
    .await;
    let before = granted.load(Ordering::SeqCst);
    assert!(
        before < 20,
        "setup: the burst must still wait when the newcomer arrives ({before} granted)"
    );
    let newcomer: Vec<_> = (0..3).map(|_| acquire("ws-b")).collect();
    let mut places = Vec::new();
    for task in newcomer {
        places.push(tokio::time::timeout(MUST_END, task).await.unwrap().unwrap());
    }
    for task in burst {
        tokio::time::timeout(MUST_END, task).await.unwrap().unwrap();
    }
    // In turn: the newcomer's 3 go within the next 3 turns of each (6 grants), give or take
    // the grant already scheduled when it arrived; behind the backlog they would be 37-39.
    let behind: Vec<usize> = places.iter().map(|p| p - before).collect();
    assert!(
        behind.iter().all(|b| *b < 15),
        "the newcomer's permits came {behind:?} grants after it arrived, with {} of the burst still waiting",
        40 - before
    );
    shutdown.cancel();
}
