//! `replyd worker` with SQS Standard as its source (`worker.source = "sqs"`), end to end: real
//! worker processes receiving from a queue of the SQS-compatible server `deploy/infra.sh`
//! starts, the real PostgreSQL, and the mock provider over HTTP. Each test names what it
//! provokes (duplicates, bad messages, a kill, a stall past the lease and the visibility, a
//! call longer than the visibility) and checks the invariants from the durable state and the
//! queue's.

use std::time::Duration;

use aws_sdk_sqs::types::MessageSystemAttributeName;
use prost::Message as _;
use replyd::sqs::message::{attributes, encode_body};
use replyd_core::domain::{ChatMessage, Role, TaskId, TaskSpec};
use replyd_lab::mock_provider::MockSettings;
use replyd_lab::produce::demo_task;

use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{unique, wait_until};

const LIMIT: Duration = Duration::from_secs(120);
/// Receives before the server moves a message to the dead-letter queue: far above what these
/// tests' redeliveries and hand-backs reach, so a move would be a finding.
const MAX_RECEIVES: u32 = 50;

fn tasks(count: usize, conversations: usize) -> Vec<TaskSpec> {
    let workspace = unique("ws");
    (0..count)
        .map(|n| demo_task(&workspace, n, conversations, 0))
        .collect()
}

fn ids(tasks: &[TaskSpec]) -> Vec<TaskId> {
    tasks.iter().map(|t| t.task_id).collect()
}

/// A provider that honours `Idempotency-Key`, as in the Kafka scenarios: a call cut off by a
/// kill or a takeover and sent again finds the first generation.
fn mock(latency_ms: u64) -> MockSettings {
    MockSettings {
        latency_ms,
        honour_idempotency_key: true,
        ..MockSettings::default()
    }
}

async fn send(app: &TestApp, tasks: &[TaskSpec], copies: usize) {
    let sqs = app.on_sqs();
    replyd_lab::sqs::send_tasks(&sqs.client(), &sqs.queues.url, tasks, copies)
        .await
        .expect("sent");
}

/// Waits until the queue holds no message in any state: every message was deleted.
async fn wait_until_drained(app: &TestApp) {
    let sqs = app.on_sqs();
    let client = sqs.client();
    wait_until("the queue is drained", LIMIT, || async {
        client
            .depth(&sqs.queues.url)
            .await
            .is_ok_and(|d| d.total() == 0)
    })
    .await;
}

/// The checker's verdict: one reply per task (I1), no task handed to the queue left without a
/// message (I3), attempts within budget (I7).
async fn assert_invariants(app: &TestApp, completed: i64) -> replyd::check::Report {
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.duplicate_replies, 0, "{report:#?}");
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.completed, completed, "{report:#?}");
    assert_eq!(report.pending, 0, "{report:#?}");
    report
}

async fn metric(app: &TestApp, worker: &str, name: &str) -> f64 {
    app.metric_total(worker, name).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_task_sent_three_times_to_two_workers_gets_one_reply_and_its_messages_are_deleted() {
    let app = TestApp::start_on_sqs(mock(50), WorkerConfig::default(), MAX_RECEIVES).await;
    app.spawn_worker("w1");
    app.spawn_worker("w2");
    app.wait_until_ready("w1").await;
    app.wait_until_ready("w2").await;
    let all = tasks(30, 10);
    send(&app, &all, 3).await;

    app.wait_until_terminal(&ids(&all), LIMIT).await;
    wait_until_drained(&app).await;
    let report = assert_invariants(&app, 30).await;
    // I5: the copies of a task cost no second call, whichever worker received them.
    assert_eq!(report.mock_requests, Some(30), "{report:#?}");
    assert_eq!(report.mock_generations, Some(30));
    assert_eq!(report.dead_lettered, 0, "{report:#?}");
    let received = metric(&app, "w1", "replyd_sqs_messages_received_total").await
        + metric(&app, "w2", "replyd_sqs_messages_received_total").await;
    let deleted = metric(&app, "w1", "replyd_sqs_messages_deleted_total").await
        + metric(&app, "w2", "replyd_sqs_messages_deleted_total").await;
    assert!(received >= 90.0, "{received} receives for 90 messages");
    assert_eq!(
        deleted, 90.0,
        "each message deleted once its task was terminal"
    );

    // The worker serves its probes: ready while it receives.
    let addr = app.observability_addr("w1").expect("observability address");
    let ready = reqwest::get(format!("http://{addr}/readyz")).await.unwrap();
    assert_eq!(ready.status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copies_of_a_task_another_worker_runs_are_handed_back_not_held() {
    // Each worker holds at most four messages: w1 is full with the four tasks' first copies
    // while their slow calls run, so w2 receives the other copies and finds each task leased
    // by w1.
    let config = WorkerConfig {
        partition_window: 4,
        global_window: 4,
        ..WorkerConfig::default()
    };
    let app = TestApp::start_on_sqs(mock(3_000), config, MAX_RECEIVES).await;
    app.spawn_worker("w1");
    app.wait_until_ready("w1").await;
    let all = tasks(4, 4);
    send(&app, &all, 1).await;
    wait_until("w1 runs the four calls", LIMIT, || async {
        app.mock.stats().in_flight == 4
    })
    .await;
    app.spawn_worker("w2");
    app.wait_until_ready("w2").await;
    send(&app, &all, 2).await;

    app.wait_until_terminal(&ids(&all), LIMIT).await;
    wait_until_drained(&app).await;
    let report = assert_invariants(&app, 4).await;
    // I5: a copy of a task leased elsewhere costs no call.
    assert_eq!(report.mock_generations, Some(4), "{report:#?}");
    assert_eq!(report.mock_requests, Some(4), "{report:#?}");
    let handed_back = metric(&app, "w2", "replyd_sqs_messages_handed_back_total").await;
    assert!(
        handed_back >= 1.0,
        "w2 hands back the copies whose tasks w1 holds, instead of waiting with them"
    );
    let deleted = metric(&app, "w1", "replyd_sqs_messages_deleted_total").await
        + metric(&app, "w2", "replyd_sqs_messages_deleted_total").await;
    assert_eq!(deleted, 12.0, "every copy deleted once its task was done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_messages_of_each_kind_land_in_the_dead_letter_queue_with_the_reason() {
    let config = WorkerConfig {
        max_prompt_bytes: 1_000,
        ..WorkerConfig::default()
    };
    let app = TestApp::start_on_sqs(mock(20), config, MAX_RECEIVES).await;
    let good = tasks(3, 3);
    let mut missing = tasks(1, 1).remove(0);
    missing.workspace_id.clear();
    let mut large = tasks(1, 1).remove(0);
    large.request.messages = vec![ChatMessage {
        role: Role::User,
        content: "x".repeat(5_000),
    }];
    let bodies = vec![
        "{\"prompt\": \"not a record\"}".to_owned(),
        encode_body(b"\x08\x96\x01 not protobuf \xff\xff"),
        encode_body(&missing.to_proto().encode_to_vec()),
        encode_body(&large.to_proto().encode_to_vec()),
    ];
    let sqs = app.on_sqs();
    let client = sqs.client();
    replyd_lab::sqs::send_bodies(&client, &sqs.queues.url, &bodies)
        .await
        .unwrap();
    send(&app, &good, 1).await;
    app.spawn_worker("w1");

    app.wait_until_terminal(&ids(&good), LIMIT).await;
    wait_until_drained(&app).await;
    let report = assert_invariants(&app, 3).await;
    assert_eq!(report.dead_lettered, 4, "{report:#?}");

    // Each copy says why, and where it came from.
    let mut kinds = Vec::new();
    for _ in 0..10 {
        let answer = client
            .client()
            .receive_message()
            .queue_url(&sqs.queues.dead_letter_url)
            .max_number_of_messages(10)
            .message_attribute_names("All")
            .message_system_attribute_names(MessageSystemAttributeName::All)
            .wait_time_seconds(1)
            .send()
            .await
            .unwrap();
        for message in answer.messages.unwrap_or_default() {
            let attrs = message.message_attributes.unwrap_or_default();
            let get = |name: &str| {
                attrs
                    .get(name)
                    .and_then(|v| v.string_value.clone())
                    .unwrap_or_default()
            };
            assert_eq!(get(attributes::SOURCE_QUEUE), app.topic);
            assert!(!get(attributes::SOURCE_MESSAGE_ID).is_empty());
            assert!(!get(attributes::ERROR_REASON).is_empty());
            kinds.push(get(attributes::ERROR_KIND));
        }
        if kinds.len() == 4 {
            break;
        }
    }
    assert_eq!(kinds.len(), 4, "{kinds:?}");
    assert!(kinds.contains(&"undecodable".to_owned()), "{kinds:?}");
    assert!(kinds.contains(&"prompt_too_large".to_owned()), "{kinds:?}");
    assert!(kinds.contains(&"missing_field".to_owned()), "{kinds:?}");
}
