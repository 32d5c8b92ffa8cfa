//! `replyd check` must fail when an invariant is broken, naming it: the harness's verdicts are
//! only worth something if the checker can say no. Each test breaks one invariant by hand in
//! the durable state and runs the real binary.

use std::time::Duration;

use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::unique;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use replyd_lab::mock_provider::MockSettings;
use replyd_lab::produce::demo_task;

fn check(app: &TestApp) -> (Option<i32>, serde_json::Value) {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
        .args(["check", "--json", "--config"])
        .arg(app.settings_file())
        .args(["--mock-url", &app.mock.base_url()])
        .output()
        .unwrap();
    let report = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "check printed no JSON ({e}): {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (output.status.code(), report)
}

async fn app_with_completed_tasks(count: usize) -> (TestApp, Vec<replyd_core::domain::TaskSpec>) {
    let app = TestApp::start(
        1,
        MockSettings {
            latency_ms: 10,
            ..MockSettings::default()
        },
        WorkerConfig::default(),
    )
    .await;
    let workspace = unique("ws");
    let tasks: Vec<_> = (0..count).map(|n| demo_task(&workspace, n, 1, 0)).collect();
    app.produce_tasks(&tasks, 1).await;
    app.spawn_worker("w1");
    let ids: Vec<_> = tasks.iter().map(|t| t.task_id).collect();
    app.wait_until_terminal(&ids, Duration::from_secs(120))
        .await;
    app.wait_until_committed_to_end(Duration::from_secs(120))
        .await;
    app.terminate("w1").await;
    (app, tasks)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_healthy_run_passes_and_a_second_accepted_reply_fails_as_i1() {
    let (app, tasks) = app_with_completed_tasks(3).await;
    let (code, report) = check(&app);
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(report["duplicate_replies"], 0);

    // A second accepted attempt for one task, as a broken store would write it.
    app.db
        .raw_client()
        .await
        .execute(
            "INSERT INTO reply_attempts (task_id, attempt_no, assignment_version, worker, lease_until, outcome) \
             VALUES ($1, 2, 99, 'intruder', clock_timestamp(), 'accepted')",
            &[&tasks[0].task_id.as_uuid()],
        )
        .await
        .unwrap();
    let (code, report) = check(&app);
    assert_eq!(code, Some(3), "{report:#}");
    assert_eq!(report["duplicate_replies"], 1);
    let violations = report["violations"].to_string();
    assert!(violations.contains("I1"), "{violations}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offset_committed_past_an_unfinished_task_fails_as_i3() {
    let (app, tasks) = app_with_completed_tasks(3).await;
    // One more record, never processed, committed past by hand.
    let unfinished = demo_task(&unique("ws"), 9, 1, 0);
    app.produce_tasks(std::slice::from_ref(&unfinished), 1)
        .await;
    let (bootstrap, group, topic) = (app.bootstrap.clone(), app.group.clone(), app.topic.clone());
    tokio::task::spawn_blocking(move || {
        let consumer: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", &group)
            .set("enable.auto.commit", "false")
            .create()
            .unwrap();
        let mut list = TopicPartitionList::new();
        list.add_partition_offset(&topic, 0, Offset::Offset(4))
            .unwrap();
        consumer.commit(&list, CommitMode::Sync).unwrap();
    })
    .await
    .unwrap();
    let (code, report) = check(&app);
    assert_eq!(code, Some(3), "{report:#}");
    assert_eq!(report["lost"], 1, "{report:#}");
    assert!(report["violations"].to_string().contains("I3"));
    assert_eq!(tasks.len(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attempts_beyond_the_budget_fail_as_i7() {
    let (app, tasks) = app_with_completed_tasks(1).await;
    let client = app.db.raw_client().await;
    // As many extra attempt rows as the budget: one more attempt than it allows in all.
    let budget: i32 = client
        .query_one(
            "SELECT max_attempts FROM reply_tasks WHERE task_id = $1",
            &[&tasks[0].task_id.as_uuid()],
        )
        .await
        .unwrap()
        .get(0);
    for version in 10..10 + budget {
        client
            .execute(
                "INSERT INTO reply_attempts (task_id, attempt_no, assignment_version, worker, lease_until, outcome) \
                 VALUES ($1, 2, $2, 'intruder', clock_timestamp(), 'abandoned')",
                &[&tasks[0].task_id.as_uuid(), &(version as i64)],
            )
            .await
            .unwrap();
    }
    let (code, report) = check(&app);
    assert_eq!(code, Some(3), "{report:#}");
    assert_eq!(report["max_attempts_exceeded"], 1);
    assert!(report["violations"].to_string().contains("I7"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_task_for_one_submission_fails_as_i6() {
    let (app, tasks) = app_with_completed_tasks(1).await;
    let client = app.db.raw_client().await;
    // Two submissions of one message, each with its own key and task, as an intake that
    // turned a retry into new work would leave them (the first with its outbox row).
    let task = tasks[0].task_id.as_uuid();
    let second = uuid::Uuid::new_v4();
    client
        .batch_execute(&format!(
            "INSERT INTO workspaces VALUES ('{ws}'); \
             INSERT INTO reply_tasks (task_id, workspace_id, conversation_id, message_id, request, max_attempts) \
               SELECT '{second}', workspace_id, conversation_id, message_id, request, max_attempts \
               FROM reply_tasks WHERE task_id = '{task}'; \
             INSERT INTO idempotency_keys (workspace_id, operation, idempotency_key, request_hash, request, task_id, expires_at) VALUES \
               ('{ws}', 'create_reply', 'press-1', 'h', '{{}}', '{task}', clock_timestamp() + interval '1 day'), \
               ('{ws}', 'create_reply', 'press-1-again', 'h', '{{}}', '{second}', clock_timestamp() + interval '1 day'); \
             INSERT INTO outbox (task_id, record_key, payload, published_at) \
               VALUES ('{task}', 'k', '\\x00', clock_timestamp());",
            ws = tasks[0].workspace_id,
        ))
        .await
        .unwrap();
    let (code, report) = check(&app);
    assert_eq!(code, Some(3), "{report:#}");
    assert_eq!(report["duplicate_tasks"], 1, "{report:#}");
    assert_eq!(report["tasks_without_one_outbox_row"], 1, "{report:#}");
    assert!(report["violations"].to_string().contains("I6"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_outbox_row_is_missed_only_within_the_relays_retention() {
    let (app, tasks) = app_with_completed_tasks(1).await;
    let client = app.db.raw_client().await;
    // An API task whose published outbox row the relay deleted after `relay.retention_ms`
    // (1 h by default): older than that, a missing row is the purge, not an I6 violation.
    let task = tasks[0].task_id.as_uuid();
    client
        .batch_execute(&format!(
            "INSERT INTO workspaces VALUES ('{ws}'); \
             INSERT INTO idempotency_keys (workspace_id, operation, idempotency_key, request_hash, request, task_id, created_at, expires_at) VALUES \
               ('{ws}', 'create_reply', 'press-1', 'h', '{{}}', '{task}', clock_timestamp() - interval '2 hours', clock_timestamp() + interval '1 day');",
            ws = tasks[0].workspace_id,
        ))
        .await
        .unwrap();
    let (code, report) = check(&app);
    assert_eq!(code, Some(0), "{report:#}");
    assert_eq!(report["tasks_without_one_outbox_row"], 0, "{report:#}");
    // The same task submitted a minute ago cannot have lost its row to the purge.
    client
        .execute(
            "UPDATE idempotency_keys SET created_at = clock_timestamp() - interval '1 minute'",
            &[],
        )
        .await
        .unwrap();
    let (code, report) = check(&app);
    assert_eq!(code, Some(3), "{report:#}");
    assert_eq!(report["tasks_without_one_outbox_row"], 1, "{report:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_task_without_its_charge_fails_as_i8() {
    let (app, tasks) = app_with_completed_tasks(2).await;
    let client = app.db.raw_client().await;
    // Two completed tasks given reservations by hand: one charged as the trigger would have
    // done it, one left reserved past its TTL (a completion that skipped the charge), and a
    // counter that does not know about the open one.
    let ws = &tasks[0].workspace_id;
    client
        .batch_execute(&format!(
            "INSERT INTO workspaces VALUES ('{ws}') ON CONFLICT DO NOTHING; \
             INSERT INTO quota_reservations (task_id, workspace_id, operation, idempotency_key, expires_at, charge_on_failure, state, settled_at, tokens_charged) VALUES \
               ('{a}', '{ws}', 'create_reply', 'k-a', clock_timestamp() + interval '1 hour', false, 'charged', clock_timestamp(), replyd_tokens_to_charge('{a}', 'charged', 0)), \
               ('{b}', '{ws}', 'create_reply', 'k-b', clock_timestamp() - interval '1 second', false, 'reserved', NULL, NULL);",
            a = tasks[0].task_id.as_uuid(),
            b = tasks[1].task_id.as_uuid(),
        ))
        .await
        .unwrap();
    let (code, report) = check(&app);
    assert_eq!(code, Some(3), "{report:#}");
    assert_eq!(report["reservations_charged"], 1, "{report:#}");
    assert_eq!(report["reservations_unsettled"], 1, "{report:#}");
    assert_eq!(report["completed_without_charge"], 1, "{report:#}");
    assert_eq!(report["quota_counter_mismatches"], 1, "{report:#}");
    assert_eq!(report["charges_without_reply"], 0, "{report:#}");
    assert_eq!(report["token_charge_mismatches"], 0, "{report:#}");
    assert!(report["violations"].to_string().contains("I8"));
}

/// A charge whose tokens are not the saved reply's reported usage (nor, with none reported,
/// the ceiling) is named as I8, from durable state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_charge_other_than_the_reported_usage_fails_as_i8() {
    let (app, tasks) = app_with_completed_tasks(1).await;
    let client = app.db.raw_client().await;
    let ws = &tasks[0].workspace_id;
    let a = tasks[0].task_id.as_uuid();
    let insert = |tokens: &str| {
        format!(
            "INSERT INTO workspaces VALUES ('{ws}') ON CONFLICT DO NOTHING; \
             DELETE FROM quota_reservations; \
             INSERT INTO quota_reservations (task_id, workspace_id, operation, idempotency_key, expires_at, charge_on_failure, state, settled_at, token_ceiling, tokens_charged) VALUES \
               ('{a}', '{ws}', 'create_reply', 'k-a', clock_timestamp() + interval '1 hour', false, 'charged', clock_timestamp(), 5000, {tokens});"
        )
    };
    client
        .batch_execute(&insert(&format!(
            "replyd_tokens_to_charge('{a}', 'charged', 5000)"
        )))
        .await
        .unwrap();
    let (code, report) = check(&app);
    assert_eq!(code, Some(0), "the rule's own charge is clean: {report:#}");
    client
        .batch_execute(&insert(&format!(
            "replyd_tokens_to_charge('{a}', 'charged', 5000) + 1"
        )))
        .await
        .unwrap();
    let (code, report) = check(&app);
    assert_eq!(code, Some(3), "{report:#}");
    assert_eq!(report["token_charge_mismatches"], 1, "{report:#}");
    assert!(report["violations"].to_string().contains("token charge"));
}
