//! `replyd worker` with SQS Standard as its source (`worker.source = "sqs"`), end to end: real
//! worker processes receiving from a queue of the SQS-compatible server `deploy/infra.sh`
//! starts, the real PostgreSQL, and the mock provider over HTTP. Each test names what it
//! provokes (duplicates, bad messages, a kill, a stall past the lease and the visibility, a
//! call longer than the visibility) and checks the invariants from the durable state and the
//! queue's.

use std::time::Duration;

use aws_sdk_sqs::types::MessageSystemAttributeName;
use prost::Message as _;
use replyd::transport::sqs::message::{attributes, encode_body};
use replyd_core::domain::{ChatMessage, Role, TaskSpec};

use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{demo_tasks, ids, key_honouring_mock, wait_until};

const LIMIT: Duration = Duration::from_secs(120);
/// Receives before the server moves a message to the dead-letter queue: far above what these
/// tests' redeliveries and hand-backs reach, so a move would be a finding.
const MAX_RECEIVES: u32 = 50;

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
    let app = TestApp::start_on_sqs(
        key_honouring_mock(50),
        WorkerConfig::default(),
        MAX_RECEIVES,
    )
    .await;
    app.spawn_worker("w1");
    app.spawn_worker("w2");
    app.wait_until_ready("w1").await;
    app.wait_until_ready("w2").await;
    let all = demo_tasks(30, 10);
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
    let app = TestApp::start_on_sqs(key_honouring_mock(3_000), config, MAX_RECEIVES).await;
    app.spawn_worker("w1");
    app.wait_until_ready("w1").await;
    let all = demo_tasks(4, 4);
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
    let app = TestApp::start_on_sqs(key_honouring_mock(20), config, MAX_RECEIVES).await;
    let good = demo_tasks(3, 3);
    let mut missing = demo_tasks(1, 1).remove(0);
    missing.workspace_id.clear();
    let mut large = demo_tasks(1, 1).remove(0);
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_call_has_its_messages_finished_elsewhere_with_one_generation_each() {
    // Four at a time, so the kill finds some tasks done, some in their calls, some waiting.
    let config = WorkerConfig {
        partition_window: 4,
        global_window: 4,
        ..WorkerConfig::default()
    };
    let app = TestApp::start_on_sqs(key_honouring_mock(1_000), config, MAX_RECEIVES).await;
    app.spawn_worker("w1");
    app.wait_until_ready("w1").await;
    let all = demo_tasks(30, 10);
    send(&app, &all, 1).await;

    // Kill while some tasks are done and others are in their calls.
    let client = app.db.raw_client().await;
    wait_until("some tasks completed and some running", LIMIT, || {
        let client = &client;
        async move {
            let row = client
                .query_one(
                    "SELECT count(*) FILTER (WHERE status = 'completed'), count(*) FILTER (WHERE status = 'running') FROM reply_tasks",
                    &[],
                )
                .await
                .unwrap();
            row.get::<_, i64>(0) >= 1 && row.get::<_, i64>(1) >= 2
        }
    })
    .await;
    app.kill("w1");
    // The killed worker's messages are hidden until their visibility runs out, then another
    // worker receives them and takes each task over once its lease has lapsed.
    app.spawn_worker("w2");
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    wait_until_drained(&app).await;
    let report = assert_invariants(&app, 30).await;
    // The cut-off calls were sent again under the same Idempotency-Key: one generation each.
    assert_eq!(report.mock_generations, Some(30), "{report:#?}");
    let took_over: i64 = client
        .query_one(
            "SELECT count(*) FROM reply_attempts WHERE worker LIKE 'w2#%' AND outcome = 'accepted'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(took_over > 0, "w2 finished what w1 held");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_stopped_past_its_lease_and_visibility_is_fenced_and_loses_no_message() {
    let config = WorkerConfig {
        lease_ms: 2_000,
        renew_interval_ms: 500,
        drain_timeout_ms: 1_000,
        sqs_visibility_seconds: 3,
        ..WorkerConfig::default()
    };
    let app = TestApp::start_on_sqs(key_honouring_mock(1_500), config, MAX_RECEIVES).await;
    app.spawn_worker("w1");
    app.spawn_worker("w2");
    app.wait_until_ready("w1").await;
    app.wait_until_ready("w2").await;
    let all = demo_tasks(40, 8);
    send(&app, &all, 1).await;

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
    // w1's messages reappear once their visibility runs out; w2 takes their tasks over once
    // the leases lapse. w1 comes back while w2 still runs some of them: the zombie must not
    // delete a message whose task is still running elsewhere.
    wait_until("w2 runs tasks w1 held", LIMIT, || {
        let client = &client;
        async move {
            client
                .query_one(
                    "SELECT count(*) FROM reply_tasks t WHERE status = 'running' AND lease_owner LIKE 'w2#%' \
                     AND EXISTS (SELECT 1 FROM reply_attempts a WHERE a.task_id = t.task_id AND a.worker LIKE 'w1#%')",
                    &[],
                )
                .await
                .unwrap()
                .get::<_, i64>(0)
                >= 2
        }
    })
    .await;
    app.resume("w1");
    app.wait_until_terminal(&ids(&all), LIMIT).await;

    // The zombie's completions are refused and recorded as fenced; its deletes use receipt
    // handles made stale by w2's receives, and cost nothing: every task is already done.
    // The zombie's late writes (a renewal or a completion, whichever it tries first) are
    // refused, and it lets go of every message it held: their tasks are done.
    wait_until("w1's late writes are refused", LIMIT, || async {
        app.log_lines_with("w1", &["lease renewal refused"])
            + app.log_lines_with("w1", &["fenced write refused"])
            > 0
    })
    .await;
    wait_until("w1 holds no message", LIMIT, || async {
        app.metric("w1", "replyd_in_flight_records").await == Some(0.0)
    })
    .await;
    wait_until_drained(&app).await;
    assert_invariants(&app, 40).await;
    let outcomes = app.attempt_outcomes().await;
    assert_eq!(outcomes.get("accepted"), Some(&40), "{outcomes:?}");
    // w1's taken-over attempts ended fenced (its write refused) or abandoned (taken over
    // before it tried), never accepted.
    let ended_elsewhere =
        outcomes.get("fenced").unwrap_or(&0) + outcomes.get("abandoned").unwrap_or(&0);
    assert!(ended_elsewhere >= 2, "{outcomes:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_longer_than_the_visibility_timeout_keeps_its_message_hidden() {
    let config = WorkerConfig {
        lease_ms: 3_000,
        renew_interval_ms: 500,
        sqs_visibility_seconds: 3,
        ..WorkerConfig::default()
    };
    // Three visibility timeouts long.
    let app = TestApp::start_on_sqs(key_honouring_mock(9_000), config, MAX_RECEIVES).await;
    app.spawn_worker("w1");
    app.wait_until_ready("w1").await;
    let all = demo_tasks(1, 1);
    send(&app, &all, 1).await;
    wait_until("w1's call is in flight", LIMIT, || async {
        app.mock.stats().in_flight == 1
    })
    .await;
    app.spawn_worker("w2");
    app.wait_until_ready("w2").await;

    app.wait_until_terminal(&ids(&all), LIMIT).await;
    wait_until_drained(&app).await;
    let report = assert_invariants(&app, 1).await;
    assert_eq!(report.mock_requests, Some(1), "{report:#?}");
    // Extended while the call ran, so neither worker saw the message again.
    assert!(metric(&app, "w1", "replyd_sqs_visibility_extensions_total").await >= 2.0);
    assert_eq!(
        metric(&app, "w2", "replyd_sqs_messages_received_total").await,
        0.0
    );
    assert_eq!(
        metric(&app, "w1", "replyd_sqs_duplicate_receives_total").await,
        0.0
    );
    assert_eq!(
        metric(&app, "w1", "replyd_sqs_messages_received_total").await,
        1.0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_to_start_without_a_dead_letter_queue_or_an_answering_endpoint() {
    let app = TestApp::start_on_sqs(
        key_honouring_mock(10),
        WorkerConfig::default(),
        MAX_RECEIVES,
    )
    .await;
    let sqs = app.on_sqs();
    // A queue with no RedrivePolicy, and no sqs.dead_letter_queue_url.
    let bare = sqs
        .client()
        .client()
        .create_queue()
        .queue_name(format!("{}-bare", app.topic))
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    app.route(crate::helpers::app::Routes {
        env: vec![("REPLYD_SQS__QUEUE_URL".into(), bare.clone())],
        ..Default::default()
    });
    app.spawn_worker("w1");
    assert!(
        !app.wait_for_exit("w1", LIMIT).await,
        "the worker must not run"
    );
    let log = app.log_of("w1");
    assert!(
        log.contains(&format!("queue `{bare}` has no dead-letter queue"))
            && log.contains("sqs.dead_letter_queue_url"),
        "{log}"
    );

    // An endpoint that does not answer is waited for within the start-up window, then named
    // with its setting.
    app.route(crate::helpers::app::Routes {
        env: vec![
            (
                "REPLYD_SQS__ENDPOINT_URL".into(),
                "http://127.0.0.1:1".into(),
            ),
            ("REPLYD_KAFKA__STARTUP_RETRY_MS".into(), "2000".into()),
        ],
        ..Default::default()
    });
    app.spawn_worker("w2");
    assert!(
        !app.wait_for_exit("w2", LIMIT).await,
        "the worker must not run"
    );
    let log = app.log_of("w2");
    assert!(
        log.contains("cannot reach SQS at http://127.0.0.1:1 (sqs.endpoint_url)"),
        "{log}"
    );
    assert!(log.contains("of retrying"), "{log}");

    // Settings SQS cannot honour are refused before anything connects, each named.
    app.route(crate::helpers::app::Routes {
        env: vec![
            ("REPLYD_SQS__BATCH_SIZE".into(), "11".into()),
            ("REPLYD_SQS__VISIBILITY_TIMEOUT_SECONDS".into(), "1".into()),
        ],
        ..Default::default()
    });
    app.spawn_worker("w3");
    assert!(
        !app.wait_for_exit("w3", LIMIT).await,
        "the worker must not run"
    );
    let log = app.log_of("w3");
    assert!(log.contains("sqs.batch_size"), "{log}");
    assert!(log.contains("sqs.visibility_timeout_seconds"), "{log}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_whole_chain_runs_on_sqs_for_browsers_that_lose_answers_and_double_click() {
    // replyd serve with relay.sink and worker.source on SQS: press → outbox → SQS → worker →
    // reply → the stream.
    let app = TestApp::start_on_sqs(
        key_honouring_mock(50),
        WorkerConfig::default(),
        MAX_RECEIVES,
    )
    .await;
    app.db.store.create_workspace("acme").await.unwrap();
    let key = replyd_core::api_key::issue(&mut rand::rng());
    app.db.store.create_api_key("acme", &key).await.unwrap();
    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;
    let run = tokio::process::Command::new(crate::helpers::lab_bin())
        .args(["browsers", "--api", &format!("http://{addr}")])
        .args(["--presses", "40", "--concurrency", "8"])
        .args(["--lose-share", "0.5", "--lose-timeout-ms", "3"])
        .args(["--double-click-share", "0.3", "--regenerate-share", "0.3"])
        .args(["--press-limit-s", "120", "--seed", "11"])
        .env("REPLYD_API_KEY", &key.token)
        .output()
        .await
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let browsers: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(browsers["presses"], 40, "{browsers}");
    assert_eq!(browsers["unfinished"], 0, "{browsers}");
    assert_eq!(browsers["answers_disagreeing"], 0, "{browsers}");
    let regenerates = browsers["regenerates"].as_i64().unwrap();

    wait_until_drained(&app).await;
    app.terminate("serve").await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    let tasks = 40 + regenerates;
    assert_eq!(
        (report.tasks, report.completed),
        (tasks, tasks),
        "{report:#?}"
    );
    assert_eq!(report.duplicate_replies, 0, "{report:#?}");
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.mock_generations, Some(tasks), "{report:#?}");
    assert_eq!(report.outbox_unpublished, 0, "{report:#?}");
    assert_eq!(
        (report.reservations_charged, report.reservations_open),
        (tasks, 0),
        "one charge per task, none open: {report:#?}"
    );
    assert!(!app.log_of("serve").contains(" ERROR "), "a clean shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_check_connect_reaches_the_queue_and_its_dead_letter_queue() {
    let app = TestApp::start_on_sqs(key_honouring_mock(10), WorkerConfig::default(), 7).await;
    let check = |env: Vec<(&str, String)>| {
        let out = app
            .operator_command(&["config", "check", "--connect"])
            .envs(replyd_lab::sqs::TEST_ENV)
            .envs(env)
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    let sqs = app.on_sqs();
    let (code, out) = check(Vec::new());
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains(&format!(
            "sqs: ok: {}: 0 visible, 0 in flight; dead-letter queue {} after 7 receives",
            sqs.queues.url, sqs.queues.dead_letter_url
        )),
        "{out}"
    );
    // On SQS alone nothing of Kafka is required or checked: brokers nobody answers at do not
    // fail the check, and it says nothing of them.
    let (code, out) = check(vec![(
        "REPLYD_KAFKA__BOOTSTRAP_SERVERS",
        "127.0.0.1:9".to_owned(),
    )]);
    assert_eq!(code, Some(0), "{out}");
    assert!(!out.contains("kafka"), "{out}");
    // A queue that does not exist is named with its setting.
    let missing = format!("{}/000000000000/no-such-queue", sqs.endpoint);
    let (code, out) = check(vec![("REPLYD_SQS__QUEUE_URL", missing.clone())]);
    assert_ne!(code, Some(0), "{out}");
    assert!(
        out.contains("sqs: FAILED") && out.contains(&format!("`{missing}` (sqs.queue_url)")),
        "{out}"
    );
}
