//! Records parked on a task leased elsewhere: woken when their twin completes, in the same
//! worker or another, still finished when the listening session is killed or without
//! notifications at the lease's end.

use std::time::Duration;

use super::{LIMIT, assert_invariants};
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{demo_tasks, ids, key_honouring_mock, wait_until};

/// Workers whose lease is far longer than the work: a record parked on a task leased elsewhere
/// can only finish early if it is woken when the task is done.
fn long_lease(listen: bool) -> WorkerConfig {
    WorkerConfig {
        lease_ms: 60_000,
        renew_interval_ms: 10_000,
        listen,
        ..WorkerConfig::default()
    }
}

/// Two workers holding one of two partitions each: a task published to both partitions is
/// raced for by both, and the loser parks on the winner's lease.
async fn two_workers_on_two_partitions(latency_ms: u64, config: WorkerConfig) -> TestApp {
    let app = TestApp::start(2, key_honouring_mock(latency_ms), config).await;
    app.spawn_worker("w1");
    app.spawn_worker("w2");
    app.wait_until_assigned(&["w1", "w2"]).await;
    app
}

/// Claims that found the task leased by another assignment, over both workers' logs.
fn parked_claims(app: &TestApp) -> usize {
    app.log_lines_with("w1", &["leased_by_other"]) + app.log_lines_with("w2", &["leased_by_other"])
}

/// How long a test waits for the commit point after the last task finished: far below the
/// 60 s lease, so only a woken record can meet it.
const WELL_BEFORE_THE_LEASE_ENDS: Duration = Duration::from_secs(20);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_in_the_same_worker_is_woken_when_its_twin_completes() {
    // No notifications: only the in-process wake-up can end the parking early.
    let app = TestApp::start(1, key_honouring_mock(500), long_lease(false)).await;
    app.spawn_worker("w1");
    app.wait_until_assigned(&["w1"]).await;
    let all = demo_tasks(20, 4);
    app.produce_tasks(&all, 3).await;

    app.wait_until_terminal(&ids(&all), LIMIT).await;
    app.wait_until_committed_to_end(WELL_BEFORE_THE_LEASE_ENDS)
        .await;
    assert!(
        app.log_lines_with("w1", &["leased_by_other"]) > 0,
        "no copy ever parked: the test proved nothing"
    );
    let report = assert_invariants(&app, 20).await;
    assert_eq!(report.mock_generations, Some(20), "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_on_another_worker_is_woken_by_the_completion_notification() {
    let app = two_workers_on_two_partitions(500, long_lease(true)).await;
    let all = demo_tasks(30, 6);
    app.produce_to_partitions(&all, &[0, 1]).await;

    app.wait_until_terminal(&ids(&all), LIMIT).await;
    app.wait_until_committed_to_end(WELL_BEFORE_THE_LEASE_ENDS)
        .await;
    assert!(
        parked_claims(&app) > 0,
        "no copy ever parked: the test proved nothing"
    );
    let report = assert_invariants(&app, 30).await;
    assert_eq!(report.mock_generations, Some(30), "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_listening_session_killed_parked_records_still_finish() {
    let config = WorkerConfig {
        lease_ms: 6_000,
        renew_interval_ms: 2_000,
        // A few records at a time, so the work (and its parking) lasts seconds, not one burst
        // that can end before the test sees both listeners.
        partition_window: 3,
        ..WorkerConfig::default()
    };
    let app = two_workers_on_two_partitions(800, config).await;
    let all = demo_tasks(30, 6);
    let client = app.db.raw_client().await;
    let listeners = format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name IN ('replyd-listener w1 {}', 'replyd-listener w2 {}')",
        app.pid("w1"),
        app.pid("w2")
    );
    app.produce_to_partitions(&all, &[0, 1]).await;
    // The listeners must exist before they can be killed: a worker listens once a record parks
    // (each task is on both partitions, so every task's second record parks).
    wait_until("both listeners are connected", LIMIT, || {
        let (client, sql) = (
            &client,
            listeners.replace("count(pg_terminate_backend(pid))", "count(*)"),
        );
        async move { client.query_one(&sql, &[]).await.unwrap().get::<_, i64>(0) == 2 }
    })
    .await;

    // Kill the listening sessions again and again while the work runs (bounded: until every
    // task is terminal, at most LIMIT): notifications are lost while they are down.
    let killed = std::sync::atomic::AtomicI64::new(0);
    wait_until(
        "every task is terminal while listeners are killed",
        LIMIT,
        || {
            let (client, listeners, ids, killed) = (&client, &listeners, ids(&all), &killed);
            async move {
                let n: i64 = client.query_one(listeners, &[]).await.unwrap().get(0);
                killed.fetch_add(n, std::sync::atomic::Ordering::Relaxed);
                let terminal: i64 = client
                    .query_one(
                        "SELECT count(*) FROM reply_tasks WHERE task_id = ANY($1) \
                     AND status IN ('completed', 'failed', 'cancelled')",
                        &[&ids.iter().map(|t| t.as_uuid()).collect::<Vec<_>>()],
                    )
                    .await
                    .unwrap()
                    .get(0);
                tokio::time::sleep(Duration::from_millis(200)).await;
                terminal == ids.len() as i64
            }
        },
    )
    .await;
    app.wait_until_committed_to_end(LIMIT).await;
    assert!(
        killed.into_inner() > 0,
        "no listener was killed: the test proved nothing"
    );
    let reconnects = app.log_lines_with("w1", &["listening for task status notifications"])
        + app.log_lines_with("w2", &["listening for task status notifications"]);
    assert!(reconnects > 2, "the listeners came back {reconnects} times");
    let report = assert_invariants(&app, 30).await;
    assert_eq!(report.mock_generations, Some(30), "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_notifications_parked_records_finish_at_the_lease_end() {
    let config = WorkerConfig {
        lease_ms: 5_000,
        renew_interval_ms: 2_000,
        listen: false,
        ..WorkerConfig::default()
    };
    let app = two_workers_on_two_partitions(500, config).await;
    let all = demo_tasks(10, 2);
    app.produce_to_partitions(&all, &[0, 1]).await;

    app.wait_until_terminal(&ids(&all), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    assert!(
        parked_claims(&app) > 0,
        "no copy ever parked: the test proved nothing"
    );
    assert_invariants(&app, 10).await;
}
