//! Partitions moving between workers: one, two, then one worker under both group protocols, a
//! paused partition read again when it comes back, and static membership keeping a restart
//! from moving the other worker's partitions.

use super::{LIMIT, assert_invariants};
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{demo_tasks, ids, key_honouring_mock, wait_until};

async fn rebalance_one_two_one(protocol: &'static str) {
    let config = WorkerConfig {
        protocol,
        partition_window: 4,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(4, key_honouring_mock(200), config).await;
    // Half before w1 starts, half once w2 holds partitions: on a loaded machine w1 can read
    // every partition to its end before w2 has joined, and w2 must find work of its own.
    let all = demo_tasks(120, 24);
    let (first, second) = all.split_at(60);
    app.produce_tasks(first, 1).await;
    app.spawn_worker("w1");

    let client = app.db.raw_client().await;
    let completed_by = |worker: &'static str| {
        let client = &client;
        async move {
            client
                .query_one(
                    // The lease owner is the worker id and its run's incarnation.
                    "SELECT count(*) FROM reply_attempts WHERE worker LIKE $1 || '#%' \
                     AND outcome = 'accepted'",
                    &[&worker],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
        }
    };
    wait_until("w1 completed some tasks", LIMIT, || async {
        completed_by("w1").await >= 5
    })
    .await;
    app.spawn_worker("w2");
    app.wait_until_assigned(&["w1", "w2"]).await;
    app.produce_tasks(second, 1).await;
    wait_until("w2 took partitions and completed tasks", LIMIT, || async {
        completed_by("w2").await >= 5
    })
    .await;
    // Back to one: w2 leaves gracefully (drain, commit, leave) with work in flight.
    app.terminate("w2").await;
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    assert_invariants(&app, 120).await;
    // A clean shutdown is nothing to page on: no ERROR line, no warning about a commit that
    // the group refused because the worker was leaving.
    let w2 = app.log_of("w2");
    for noise in [
        " ERROR ",
        "BrokerDestroy",
        "WARN replyd::telemetry: offset commit failed",
    ] {
        assert!(
            !w2.contains(noise),
            "{noise:?} in the log of a clean shutdown:\n{w2}"
        );
    }
    assert!(
        app.log_of("w1").contains("rebalance"),
        "w1 saw the rebalances"
    );
}

/// librdkafka keeps a partition's pause across assignments. A partition paused for
/// back-pressure when it is revoked, and later assigned back to the same member, would never
/// be fetched again unless resumed: a stalled partition whose records are never done.
async fn a_partition_paused_when_revoked_is_read_again_when_it_comes_back(protocol: &'static str) {
    // One record in flight in all, at 500 ms each, and a pause at two queued: each partition
    // queues about ten records, so all four stay paused for many seconds after the first
    // fetch (a backlog drains by one record per four started).
    let config = WorkerConfig {
        protocol,
        partition_window: 1,
        global_window: 1,
        read_ahead: 2,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(4, key_honouring_mock(500), config).await;
    let all = demo_tasks(40, 40);
    app.produce_tasks(&all, 1).await;
    app.spawn_worker("w1");
    wait_until("w1 paused all its partitions", LIMIT, || async {
        app.metric("w1", "replyd_paused_partitions").await == Some(4.0)
    })
    .await;
    // w2 takes partitions from w1 (paused ones among them), then leaves: they come back.
    app.spawn_worker("w2");
    wait_until("w1 let go of a paused partition", LIMIT, || async {
        app.log_of("w1").contains("released while paused")
    })
    .await;
    app.terminate("w2").await;
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    assert_invariants(&app, 40).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_partition_revoked_and_assigned_back_is_read_again_classic() {
    a_partition_paused_when_revoked_is_read_again_when_it_comes_back("classic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_partition_revoked_and_assigned_back_is_read_again_consumer() {
    a_partition_paused_when_revoked_is_read_again_when_it_comes_back("consumer").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_one_two_one_under_the_classic_protocol() {
    rebalance_one_two_one("classic").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebalance_one_two_one_under_the_consumer_protocol() {
    rebalance_one_two_one("consumer").await;
}

/// Rebalance lines a worker logged (each assignment and revocation it saw).
fn rebalances_in(log: &str) -> usize {
    log.lines()
        .filter(|l| l.contains("rebalance") && l.contains("kind="))
        .count()
}

async fn restart_one_of_two(static_membership: bool) -> (usize, usize) {
    let config = WorkerConfig {
        static_membership,
        // Longer than a restart: the static member comes back within its session.
        session_timeout_ms: 20_000,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(2, key_honouring_mock(10), config).await;
    app.spawn_worker("w1");
    app.spawn_worker("w2");
    app.wait_until_assigned(&["w1", "w2"]).await;
    let before = rebalances_in(&app.log_of("w2"));
    app.terminate("w1").await;
    app.spawn_worker("w1");
    app.wait_until_assigned(&["w1", "w2"]).await;
    // The work still flows through both.
    let all = demo_tasks(20, 20);
    app.produce_tasks(&all, 1).await;
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    (before, rebalances_in(&app.log_of("w2")))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_static_membership_a_worker_restarts_without_moving_the_other_s_partitions() {
    // kafka.group_instance_id: w1 leaves and comes back as the same member within its
    // session, so the coordinator gives it its partitions back and w2 sees no rebalance.
    let (before, after) = restart_one_of_two(true).await;
    assert!(before > 0, "w2 was assigned its partition");
    assert_eq!(after, before, "w2 saw no rebalance while w1 restarted");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_static_membership_a_restart_moves_the_other_s_partitions() {
    // The contrast: a dynamic member's restart is a leave and a join, and w2 takes w1's
    // partition, then gives it back.
    let (before, after) = restart_one_of_two(false).await;
    assert!(
        after > before,
        "w2 rebalanced while w1 restarted: {before} → {after}"
    );
}
