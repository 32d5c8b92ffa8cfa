//! Leases of a lost holder: a zombie stopped past its lease and session is fenced when it
//! returns; a restarted worker or a survivor given the partition takes the tasks over before
//! their leases end; a duplicate in the same process parks and never takes over its own lease.

use super::{LIMIT, assert_invariants};
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{demo_tasks, ids, key_honouring_mock, wait_until};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_stopped_past_its_lease_and_session_is_fenced_when_it_returns() {
    // Whole answers: the zombie wakes with its reply in hand and tries to save it. A streamed
    // answer is still being read when its renewal is refused, which ends the call before it
    // can try (`live::a_zombie_whose_stream_resumes_…`).
    let config = WorkerConfig {
        stream: Some(false),
        lease_ms: 2_000,
        renew_interval_ms: 500,
        drain_timeout_ms: 1_000,
        session_timeout_ms: 3_000,
        partition_window: 8,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(2, key_honouring_mock(1_500), config).await;
    app.spawn_worker("w1");
    app.spawn_worker("w2");
    let all = demo_tasks(40, 8);
    app.produce_tasks(&all, 1).await;

    // Stop w1 while it holds leases with calls in flight.
    let client = app.db.raw_client().await;
    wait_until("w1 holds leases", LIMIT, || {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT count(*) FROM reply_tasks WHERE status = 'running' AND lease_owner LIKE 'w1#%'",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                >= 2
        }
    })
    .await;
    app.stop("w1");
    // The group moves w1's partitions to w2, which takes the tasks over once the leases lapse.
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    app.resume("w1");

    // The zombie is fenced whichever of its fenced writes it makes first: a late completion,
    // refused and recorded as fenced, or a renewal, refused, which stops the call before its
    // answer is read (the answer waits in the socket while the renewal's round trip runs; on
    // a loaded machine the renewal can win for every task).
    wait_until("w1's late writes are refused", LIMIT, || {
        let client = &client;
        let app = &app;
        async move {
            let fenced: i64 = client
                .query_one(
                    "SELECT count(*) FROM reply_attempts WHERE worker LIKE 'w1#%' AND outcome = 'fenced'",
                    &[],
                )
                .await
                .unwrap()
                .get(0);
            let renewals = app
                .metric("w1", "replyd_lease_renewals_refused_total")
                .await
                .unwrap_or(0.0);
            fenced > 0 || renewals > 0.0
        }
    })
    .await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = assert_invariants(&app, 40).await;
    let renewals = app
        .metric("w1", "replyd_lease_renewals_refused_total")
        .await
        .unwrap_or(0.0);
    assert!(report.fenced_rejections > 0 || renewals > 0.0, "{report:?}");
    let outcomes = app.attempt_outcomes().await;
    assert_eq!(outcomes.get("accepted"), Some(&40), "{outcomes:?}");
}

/// Long enough that no test waits it out: a task finished before it ends was taken over.
const LONG_LEASE_MS: u64 = 60_000;

/// Waits until `worker` holds at least `at_least` live leases, and answers when the last of
/// them ends (database time).
async fn leases_held_by(
    app: &TestApp,
    worker: &str,
    at_least: i64,
) -> chrono::DateTime<chrono::Utc> {
    let client = app.db.raw_client().await;
    let pattern = format!("{worker}#%");
    wait_until(&format!("{worker} holds leases"), LIMIT, || {
        let (client, pattern) = (&client, &pattern);
        async move {
            client
                .query_one(
                    "SELECT count(*) FROM reply_tasks WHERE status = 'running' \
                     AND lease_owner LIKE $1 AND lease_until > clock_timestamp()",
                    &[pattern],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                >= at_least
        }
    })
    .await;
    client
        .query_one(
            "SELECT max(lease_until) FROM reply_tasks WHERE status = 'running' \
             AND lease_owner LIKE $1",
            &[&pattern],
        )
        .await
        .unwrap()
        .get(0)
}

/// The claims of `worker` that took over a live lease of its partition's previous holder.
async fn took_over_by(app: &TestApp, worker: &str) -> f64 {
    app.metric(
        worker,
        "replyd_claims_total{outcome=\"took_over_from_previous_holder\"}",
    )
    .await
    .unwrap_or(0.0)
}

/// Whether the database clock is still before `until`.
async fn before_by_the_database_clock(app: &TestApp, until: chrono::DateTime<chrono::Utc>) -> bool {
    app.db
        .raw_client()
        .await
        .query_one("SELECT clock_timestamp() < $1", &[&until])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_call_and_restarted_under_its_id_takes_its_tasks_over_before_their_leases_end()
 {
    // Static membership: the restarted w1 gets its partition back at once, and its claims
    // (a new incarnation, `w1#<token>`) take over the leases its killed incarnation left.
    let config = WorkerConfig {
        static_membership: true,
        session_timeout_ms: 20_000,
        lease_ms: LONG_LEASE_MS,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, key_honouring_mock(2_000), config).await;
    app.spawn_worker("w1");
    let all = demo_tasks(8, 8);
    app.produce_tasks(&all, 1).await;
    let leases_end = leases_held_by(&app, "w1", 4).await;
    app.kill("w1");
    app.spawn_worker("w1");
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    assert!(
        before_by_the_database_clock(&app, leases_end).await,
        "every task finished while the killed incarnation's leases were still live"
    );
    app.wait_until_committed_to_end(LIMIT).await;
    let report = assert_invariants(&app, 8).await;
    assert_eq!(report.duplicate_replies, 0);
    let took_over = took_over_by(&app, "w1").await;
    assert!(took_over >= 1.0, "{took_over}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_survivor_given_a_killed_worker_s_partition_takes_its_tasks_over_before_their_leases_end()
{
    let config = WorkerConfig {
        lease_ms: LONG_LEASE_MS,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(2, key_honouring_mock(2_000), config).await;
    app.spawn_worker("w1");
    app.spawn_worker("w2");
    app.wait_until_assigned(&["w1", "w2"]).await;
    let all = demo_tasks(16, 16);
    app.produce_tasks(&all, 1).await;
    let leases_end = leases_held_by(&app, "w1", 2).await;
    app.kill("w1");
    // After the session timeout the group gives w1's partition to w2, whose claims take over
    // the leases w1 took for that partition's records.
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    assert!(
        before_by_the_database_clock(&app, leases_end).await,
        "every task finished while the killed worker's leases were still live"
    );
    app.wait_until_committed_to_end(LIMIT).await;
    assert_invariants(&app, 16).await;
    let took_over = took_over_by(&app, "w2").await;
    assert!(took_over >= 1.0, "{took_over}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_record_in_the_same_process_parks_and_never_takes_over_its_own_lease() {
    let config = WorkerConfig {
        lease_ms: LONG_LEASE_MS,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, key_honouring_mock(1_000), config).await;
    app.spawn_worker("w1");
    let all = demo_tasks(4, 4);
    // Each record twice, in the one partition: the copy's claim meets this process's own live
    // lease (same owner, same incarnation) and parks until the reply is saved.
    app.produce_tasks(&all, 2).await;
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = assert_invariants(&app, 4).await;
    assert_eq!(report.attempts, 4, "one attempt per task: {report:#?}");
    let took_over = took_over_by(&app, "w1").await;
    assert_eq!(took_over, 0.0);
}
