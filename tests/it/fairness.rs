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
    let capacity = Capacity::new(
        db.store.clone(),
        settings,
        "w1".into(),
        replyd::capacity::Weights::default(),
        shutdown.clone(),
    );
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

/// A workspace's weight, set in the database, reaches a worker's capacity waiters: while both
/// wait, a workspace of weight 3 is granted three calls for each one of a workspace of weight 1.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspace_of_weight_three_is_granted_three_calls_for_each_of_weight_one() {
    let db = TestDb::new().await;
    let shutdown = CancellationToken::new();
    db.store.create_workspace("ws-heavy").await.unwrap();
    assert!(db.store.set_workspace_weight("ws-heavy", 3).await.unwrap());
    let weights = replyd::capacity::Weights::default();
    weights.keep_reading(db.store.clone(), shutdown.clone());
    crate::helpers::wait_until("the weights read", MUST_END, || {
        let weights = weights.clone();
        async move { weights.of("ws-heavy") == 3 }
    })
    .await;
    let settings = CapacitySettings {
        // 40 a second: the 120 calls below take 3 s of the budget.
        requests_per_minute: Some(2_400),
        adaptive: false,
        ..CapacitySettings::default()
    };
    let capacity = Capacity::new(
        db.store.clone(),
        settings,
        "w1".into(),
        weights,
        shutdown.clone(),
    );
    let order = Arc::new(std::sync::Mutex::new(Vec::new()));
    let acquire = |workspace: &'static str| {
        let (capacity, order) = (capacity.clone(), Arc::clone(&order));
        tokio::spawn(async move {
            let never = CancellationToken::new();
            let permit = capacity
                .acquire("gpt-test", (workspace, 0), 100, &never, || {})
                .await
                .expect("granted");
            order.lock().unwrap().push(workspace);
            drop(permit);
        })
    };
    let calls: Vec<_> = (0..60)
        .flat_map(|_| [acquire("ws-light"), acquire("ws-heavy")])
        .collect();
    for call in calls {
        tokio::time::timeout(MUST_END, call).await.unwrap().unwrap();
    }
    let order = order.lock().unwrap().clone();
    // Grants 20 to 60: both still wait (the heavy one's 60 are not done by then).
    let heavy = order[20..60].iter().filter(|w| **w == "ws-heavy").count();
    assert!(
        (26..=34).contains(&heavy),
        "of grants 20-60, {heavy} went to the workspace of weight 3 (30 expected): {order:?}"
    );
    shutdown.cancel();
}
