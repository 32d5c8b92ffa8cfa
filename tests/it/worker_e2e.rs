//! `replyd worker` end to end: real worker processes in a real consumer group on the real
//! broker, the real PostgreSQL, and the mock provider over HTTP. Each test names the failure it
//! provokes and the invariants it checks from the durable state afterwards.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use crate::helpers::app::{Routes, TestApp, WorkerConfig};
use crate::helpers::{demo_tasks, ids, key_honouring_mock, unique, wait_until};
use prost::Message as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use replyd_core::domain::{ChatMessage, Role, TaskId, TaskSpec};
use replyd_lab::produce::malformed_record;

const LIMIT: Duration = Duration::from_secs(120);

/// Asserts the invariants the checker reads back: one reply per task (I1), nothing committed
/// past unfinished work (I3), attempts within budget (I7).
async fn assert_invariants(app: &TestApp, tasks: usize) -> replyd::check::Report {
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.duplicate_replies, 0, "{report:#?}");
    assert_eq!(report.lost, 0, "{report:#?}");
    assert_eq!(report.completed, tasks as i64, "{report:#?}");
    assert_eq!(report.pending, 0, "{report:#?}");
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_record_published_three_times_gets_exactly_one_reply() {
    let app = TestApp::start(3, key_honouring_mock(50), WorkerConfig::default()).await;
    app.spawn_worker("w1");
    let tasks = demo_tasks(30, 10);
    app.produce_tasks(&tasks, 3).await;

    app.wait_until_terminal(&ids(&tasks), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = assert_invariants(&app, 30).await;
    assert_eq!(report.records, 90);
    // I5: a redelivered record of a completed task costs no provider call.
    assert_eq!(report.mock_requests, Some(30), "{report:#?}");
    assert_eq!(report.mock_generations, Some(30));
    assert_eq!(report.attempts, 30);

    // The worker serves its metrics and probes on the port it logged.
    let addr = app
        .observability_addr("w1")
        .expect("the worker logs its observability address");
    let get = |path: &str| reqwest::get(format!("http://{addr}{path}"));
    let metrics = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(metrics.contains("replyd_records_done_total"), "{metrics}");
    assert!(metrics.contains("replyd_completions_total"), "{metrics}");
    assert_eq!(get("/healthz").await.unwrap().status(), 200);
    assert_eq!(get("/readyz").await.unwrap().status(), 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn healthz_watches_the_worker_s_poll_loop_and_the_relay_s_loop() {
    // A short liveness timeout (its floor is 5 s above every bounded wait, all made short
    // here): a part whose loop did not beat would fail /healthz once it passed.
    let config = WorkerConfig {
        request_timeout_ms: 1_000,
        drain_timeout_ms: 1_000,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, key_honouring_mock(20), config).await;
    app.route(Routes {
        env: vec![
            (
                "REPLYD_OBSERVABILITY__LIVENESS_TIMEOUT_MS".into(),
                "6500".into(),
            ),
            (
                "REPLYD_DATABASE__STATEMENT_TIMEOUT_MS".into(),
                "1000".into(),
            ),
            ("REPLYD_RELAY__PUBLISH_TIMEOUT_MS".into(), "1000".into()),
        ],
        ..Routes::default()
    });
    app.spawn_worker("w1");
    app.spawn_relay("r1");
    app.wait_until_ready("w1").await;
    let mut addrs = Vec::new();
    for name in ["w1", "r1"] {
        wait_until(&format!("{name} serves its probes"), LIMIT, || async {
            app.observability_addr(name).is_some()
        })
        .await;
        addrs.push(app.observability_addr(name).unwrap());
    }
    // Longer than the liveness timeout: only loops that kept beating are still alive.
    tokio::time::sleep(Duration::from_millis(8_000)).await;
    for (addr, part) in addrs.iter().zip(["worker", "relay"]) {
        let answer = reqwest::get(format!("http://{addr}/healthz"))
            .await
            .unwrap();
        let status = answer.status();
        let body = answer.text().await.unwrap();
        assert_eq!(status, 200, "{body}");
        assert!(body.starts_with("ok\n"), "{body}");
        assert!(body.contains(&format!("{part}: its loop turned")), "{body}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_window_pauses_the_partition_so_in_flight_work_stays_bounded() {
    let config = WorkerConfig {
        partition_window: 3,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, key_honouring_mock(200), config).await;
    let all = demo_tasks(30, 1);
    app.produce_tasks(&all, 1).await;
    app.spawn_worker("w1");
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let stats = app.mock.stats();
    // The window was used (records of one partition ran concurrently) and never exceeded,
    // whatever the backlog behind it.
    assert_eq!(stats.max_in_flight, 3, "{stats:?}");
    assert_invariants(&app, 30).await;
}

#[tokio::test]
async fn a_worker_with_contradictory_settings_refuses_to_start_and_names_the_setting() {
    let dir = std::env::temp_dir().join(unique("bad-config"));
    std::fs::create_dir_all(&dir).unwrap();
    let cases = [
        (
            "[kafka]\nsession_timeout_ms = 6000\n[worker]\ndrain_timeout_ms = 6000\n",
            "worker.drain_timeout_ms",
        ),
        (
            "[worker]\nparition_window = 8\n",
            "did you mean `worker.partition_window`?",
        ),
        ("[kafka]\ngroup_protocol = \"eager\"\n", "group_protocol"),
        (
            "[kafka]\ngroup_protocol = \"consumer\"\nsession_timeout_ms = 10000\n",
            "kafka.session_timeout_ms",
        ),
        // Refused before anything connects: nothing listens at the default database URL, so
        // reaching the migrations would mean a minute of retries, not a prompt refusal.
        (
            "[kafka.librdkafka]\n\"fetch.wait.max.mss\" = \"50\"\n",
            "fetch.wait.max.mss",
        ),
    ];
    for (text, named) in cases {
        let path = dir.join("replyd.toml");
        std::fs::write(&path, text).unwrap();
        let output = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args(["worker", "--config"])
            .arg(&path)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{text}: {stderr}");
        assert!(stderr.contains(named), "{named} not named in: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "said once: {stderr}");
        assert!(!stderr.contains("default."), "{stderr}");
    }

    // `config check` names every problem at once; `config show` prints the effective settings
    // (file, then environment) without their secrets.
    let path = dir.join("many.toml");
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://u:hunter2@127.0.0.1:1/db\"\n[wroker]\nlease_ms = 1\n\
         [worker]\nrenew_interval_ms = 900000\n",
    )
    .unwrap();
    let run = |args: &[&str], config: &std::path::Path| {
        std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args(args)
            .arg("--config")
            .arg(config)
            .env("REPLYD_WORKER__PARTITION_WINDOW", "32")
            .output()
            .unwrap()
    };
    let checked = run(&["config", "check"], &path);
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert_eq!(checked.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("2 problems in the settings"), "{stderr}");
    assert!(stderr.contains("did you mean `worker`?"), "{stderr}");
    assert!(stderr.contains("worker.renew_interval_ms"), "{stderr}");
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://u:hunter2@127.0.0.1:1/db\"\n",
    )
    .unwrap();
    let shown = run(&["config", "show"], &path);
    let stdout = String::from_utf8_lossy(&shown.stdout);
    assert!(
        shown.status.success(),
        "{}",
        String::from_utf8_lossy(&shown.stderr)
    );
    assert!(stdout.contains("partition_window = 32"), "{stdout}");
    assert!(
        !stdout.contains("hunter2") && stdout.contains("url = \"***\""),
        "{stdout}"
    );
    assert!(run(&["config", "check"], &path).status.success());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_broker_is_named_with_its_setting_and_not_logged_per_attempt() {
    let db = crate::helpers::TestDb::new().await;
    let dir = std::env::temp_dir().join(unique("no-kafka"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("replyd.toml");
    std::fs::write(
        &path,
        format!(
            "[database]\nurl = \"{}\"\n[kafka]\nbootstrap_servers = \"127.0.0.1:1\"\nstartup_retry_ms = 8000\n[observability]\nlisten = \"127.0.0.1:0\"\n",
            db.settings.url.expose()
        ),
    )
    .unwrap();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args(["worker", "--config"])
            .arg(&path)
            .env("RUST_LOG", "info")
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot reach Kafka at 127.0.0.1:1 (kafka.bootstrap_servers)"),
        "{stderr}"
    );
    // librdkafka retries the connection several times a second for the 8 s; each distinct
    // line is logged once.
    let errors = stderr.lines().filter(|l| l.contains("ERROR")).count();
    assert!(errors <= 6, "{errors} ERROR lines in 8 s:\n{stderr}");
}

#[tokio::test]
async fn an_unreachable_database_is_named_with_its_setting_and_logged_once_per_failure() {
    let dir = std::env::temp_dir().join(unique("no-db"));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("replyd.toml");
    // Port 1: nothing listens. Short retry, so the test ends soon.
    std::fs::write(
        &path,
        "[database]\nurl = \"postgres://replyd:hunter2@127.0.0.1:1/replyd\"\nstartup_retry_ms = 3000\n[observability]\nlisten = \"127.0.0.1:0\"\n",
    )
    .unwrap();
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .args(["worker", "--config"])
            .arg(&path)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("cannot connect to PostgreSQL at 127.0.0.1:1/replyd (database.url)"),
        "{stderr}"
    );
    assert!(!stderr.contains("hunter2"), "{stderr}");
    let retries = stderr
        .lines()
        .filter(|l| l.contains("failed; retrying"))
        .count();
    assert_eq!(
        retries, 1,
        "one line per distinct failure, not per attempt: {stderr}"
    );
    let last = stderr.lines().last().unwrap_or_default();
    assert_eq!(
        last.matches("Connection refused").count(),
        1,
        "the cause is said once: {last}"
    );
}

/// Reads the dead-letter topic: (source offset, kind, reason) of each copy.
fn dead_letters(bootstrap: &str, topic: &str) -> Vec<(i64, String, String)> {
    let reader: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", unique("dlq-reader"))
        .create()
        .unwrap();
    let (_, high) = reader
        .fetch_watermarks(topic, 0, Duration::from_secs(10))
        .unwrap();
    let mut list = TopicPartitionList::new();
    list.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    reader.assign(&list).unwrap();
    let mut out = Vec::new();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while (out.len() as i64) < high && std::time::Instant::now() < deadline {
        if let Some(Ok(m)) = reader.poll(Duration::from_millis(200)) {
            let header = |name: &str| {
                m.headers()
                    .and_then(|h| h.iter().find(|h| h.key == name))
                    .and_then(|h| h.value)
                    .map(|v| String::from_utf8_lossy(v).into_owned())
                    .unwrap_or_default()
            };
            out.push((
                header("replyd.source.offset").parse().unwrap(),
                header("replyd.error.kind"),
                header("replyd.error.reason"),
            ));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_records_of_each_kind_land_in_the_dlq_and_the_partition_keeps_moving() {
    let app = TestApp::start(1, key_honouring_mock(20), WorkerConfig::default()).await;
    app.spawn_worker("w1");
    let good = demo_tasks(2, 1);
    let mut records = vec![("k".to_string(), good[0].to_proto().encode_to_vec())];
    for n in 0..replyd_lab::produce::MALFORMED_KINDS.len() {
        records.push(("k".to_string(), malformed_record(n).1));
    }
    app.produce_raw(&records).await;
    // Offset 6: a tombstone (no value at all).
    let producer = replyd_lab::produce::producer(&app.bootstrap).unwrap();
    replyd_lab::produce::publish_tombstone(&producer, &app.topic, "k")
        .await
        .unwrap();
    // Offset 7: a deadline written in seconds instead of milliseconds (January 1970).
    let mut in_seconds = demo_tasks(1, 1).remove(0);
    in_seconds.deadline = chrono::DateTime::from_timestamp_millis(chrono::Utc::now().timestamp());
    // Offset 8: a deadline that passed an hour ago: a task, failed at its first claim.
    let mut too_late = demo_tasks(1, 1).remove(0);
    too_late.deadline = Some(chrono::Utc::now() - chrono::TimeDelta::hours(1));
    app.produce_raw(&[
        ("k".to_string(), in_seconds.to_proto().encode_to_vec()),
        ("k".to_string(), too_late.to_proto().encode_to_vec()),
        ("k".to_string(), good[1].to_proto().encode_to_vec()),
    ])
    .await;

    app.wait_until_terminal(&ids(&good), LIMIT).await;
    app.wait_until_terminal(&[too_late.task_id], LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let (bootstrap, dlq) = (app.bootstrap.clone(), format!("{}.dlq", app.topic));
    let copies = tokio::task::spawn_blocking(move || dead_letters(&bootstrap, &dlq))
        .await
        .unwrap();
    let kinds: BTreeSet<(i64, String)> = copies.iter().map(|(o, k, _)| (*o, k.clone())).collect();
    assert_eq!(
        kinds,
        BTreeSet::from([
            (1, "undecodable".to_string()),
            (2, "missing_field".to_string()),
            (3, "unknown_schema_version".to_string()),
            (4, "prompt_too_large".to_string()),
            (5, "empty_record".to_string()),
            (6, "empty_record".to_string()),
            (7, "invalid_field".to_string()),
        ])
    );
    assert!(copies.iter().all(|(_, _, reason)| !reason.is_empty()));
    let reason_of = |offset: i64| {
        copies
            .iter()
            .find(|(o, _, _)| *o == offset)
            .map(|(_, _, r)| r.clone())
            .unwrap()
    };
    assert!(reason_of(6).contains("tombstone"), "{}", reason_of(6));
    assert!(
        reason_of(7).contains("milliseconds since the Unix epoch"),
        "{}",
        reason_of(7)
    );
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.completed, report.failed), (2, 1), "{report:#?}");
    assert_eq!(report.dead_lettered, 7);
    assert_eq!(report.bad_records, 7);
    assert!(
        app.log_of("w1").contains("dead-letter"),
        "the worker logs each bad record"
    );
    let warned = app.log_lines_with("w1", &["WARN", "task failed at claim", "deadline"]);
    assert_eq!(
        warned, 1,
        "the late task's failure is logged at WARN with its reason"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_checker_judges_records_by_the_workers_own_prompt_limit() {
    let config = WorkerConfig {
        max_prompt_bytes: 65_536,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, key_honouring_mock(10), config).await;
    app.spawn_worker("w1");
    let mut all = demo_tasks(3, 1);
    // One byte over this worker's limit, far under the built-in one.
    all[1].request.messages = vec![ChatMessage {
        role: Role::User,
        content: "x".repeat(65_537),
    }];
    app.produce_tasks(&all, 1).await;
    let good = [all[0].task_id, all[2].task_id];
    app.wait_until_terminal(&good, LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(
        (report.dead_lettered, report.bad_records),
        (1, 1),
        "{report:#?}"
    );
    assert_eq!(report.tasks, 2, "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_first_record_does_not_hold_back_later_ones_but_holds_the_commit_point() {
    let app = TestApp::start(1, key_honouring_mock(20), WorkerConfig::default()).await;
    let mut all = demo_tasks(11, 1);
    // The mock answers this one after 8 s (a directive it reads from the prompt).
    all[0].request.messages.push(ChatMessage {
        role: Role::User,
        content: "[mock:latency_ms=8000] take your time".into(),
    });
    app.produce_tasks(&all, 1).await;
    app.spawn_worker("w1");

    // The ten fast ones finish while the slow one is still running…
    app.wait_until_terminal(&ids(&all[1..]), LIMIT).await;
    let slow = app.db.store.read(all[0].task_id).await.unwrap().unwrap();
    assert_eq!(
        slow.status,
        replyd_core::domain::TaskStatus::Running,
        "setup: the slow one is still running"
    );
    // …and the commit point stays at the slow record: offset 0 is not committed past.
    let committed = app.committed_offsets().await;
    assert!(
        committed.get(&0).is_none_or(|&c| c <= 0),
        "committed {committed:?} past the unfinished record at offset 0"
    );
    app.wait_until_terminal(&ids(&all[..1]), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    assert_invariants(&app, 11).await;
}

/// For every partition, every record below the committed offset has a terminal task.
async fn committed_offsets_never_pass_unfinished_records(app: &TestApp, tasks: &[TaskSpec]) {
    let committed = app.committed_offsets().await;
    let (bootstrap, topic) = (app.bootstrap.clone(), app.topic.clone());
    let records: Vec<(i32, i64, String)> = tokio::task::spawn_blocking(move || {
        let reader: BaseConsumer = ClientConfig::new()
            .set("bootstrap.servers", &bootstrap)
            .set("group.id", unique("reader"))
            .create()
            .unwrap();
        let meta = reader
            .fetch_metadata(Some(&topic), Duration::from_secs(10))
            .unwrap();
        let mut list = TopicPartitionList::new();
        let mut total = 0;
        for p in meta.topics()[0].partitions() {
            list.add_partition_offset(&topic, p.id(), Offset::Beginning)
                .unwrap();
            total += reader
                .fetch_watermarks(&topic, p.id(), Duration::from_secs(10))
                .unwrap()
                .1;
        }
        reader.assign(&list).unwrap();
        let mut out = Vec::new();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while (out.len() as i64) < total && std::time::Instant::now() < deadline {
            if let Some(Ok(m)) = reader.poll(Duration::from_millis(200)) {
                let spec = TaskSpec::from_record(m.payload(), None, &Default::default()).unwrap();
                out.push((m.partition(), m.offset(), spec.task_id.to_string()));
            }
        }
        out
    })
    .await
    .unwrap();
    let statuses: HashMap<String, String> = app
        .db
        .raw_client()
        .await
        .query("SELECT task_id::text, status FROM reply_tasks", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert!(!tasks.is_empty());
    for (partition, offset, task) in records {
        if committed.get(&partition).is_some_and(|&c| offset < c) {
            let status = statuses.get(&task).map(String::as_str);
            assert!(
                matches!(status, Some("completed" | "failed")),
                "partition {partition} committed past offset {offset} whose task is {status:?}"
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_partition_loses_nothing_and_saves_one_reply_each() {
    let config = WorkerConfig {
        partition_window: 8,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(2, key_honouring_mock(300), config).await;
    let all = demo_tasks(60, 12);
    app.produce_tasks(&all, 1).await;
    app.spawn_worker("w1");

    // Kill while some tasks are done and others are in flight.
    let client = app.db.raw_client().await;
    wait_until("some tasks completed and some in flight", LIMIT, || {
        let client = &client;
        async move {
            let row = client
                .query_one(
                    "SELECT count(*) FILTER (WHERE status = 'completed'), count(*) FILTER (WHERE status = 'running') FROM reply_tasks",
                    &[],
                )
                .await
                .unwrap();
            row.get::<_, i64>(0) >= 10 && row.get::<_, i64>(1) >= 2
        }
    })
    .await;
    app.kill("w1");
    // At the kill, the committed offsets are never past an unfinished record.
    committed_offsets_never_pass_unfinished_records(&app, &all).await;

    app.spawn_worker("w1");
    app.wait_until_terminal(&ids(&all), LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = assert_invariants(&app, 60).await;
    // The calls cut off by the kill were sent again with the same Idempotency-Key, so the
    // provider generated once per task.
    assert_eq!(report.mock_generations, Some(60), "{report:#?}");
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_stopped_past_its_lease_and_session_is_fenced_when_it_returns() {
    // Whole answers: the zombie wakes with its reply in hand and tries to save it. A streamed
    // answer is still being read when its renewal is refused, which ends the call before it
    // can try (`live::a_zombie_whose_stream_resumes_…`).
    let config = WorkerConfig {
        stream: false,
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_check_connect_reaches_every_part_and_names_each_that_does_not_answer() {
    let app = TestApp::start(1, key_honouring_mock(10), WorkerConfig::default()).await;
    let check = |env: &[(&str, String)]| {
        let out = app
            .operator_command(&["config", "check", "--connect"])
            .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
            .output()
            .unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    };
    // Everything answers: the schema is current, both topics exist, the key lists models.
    let (code, out) = check(&[]);
    assert_eq!(code, Some(0), "{out}");
    let line = |out: &str, part: &str| {
        out.lines()
            .find(|l| l.starts_with(&format!("{part}: ")))
            .unwrap_or_else(|| panic!("no {part} line in {out}"))
            .to_owned()
    };
    assert!(
        line(&out, "database").contains("the schema has every migration"),
        "{out}"
    );
    assert!(line(&out, "kafka").contains(": 1 partitions"), "{out}");
    assert!(line(&out, "provider").contains("2 models listed"), "{out}");

    // Each part wrong in its own way: a port nobody listens on, a dead-letter topic nobody
    // made, a base URL that is not the API's root. All three are named, with their settings.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = closed.local_addr().unwrap().port();
    drop(closed);
    let (code, out) = check(&[
        (
            "REPLYD_DATABASE__URL",
            format!("postgres://replyd:replyd@127.0.0.1:{port}/replyd"),
        ),
        ("REPLYD_KAFKA__DEAD_LETTER_TOPIC", unique("nobody-made-it")),
        (
            "REPLYD_PROVIDER__BASE_URL",
            format!("{}/api", app.mock.base_url()),
        ),
    ]);
    assert_eq!(code, Some(5), "{out}");
    let database = line(&out, "database");
    assert!(
        database.starts_with("database: FAILED")
            && database.contains(&format!("127.0.0.1:{port}"))
            && database.contains("(database.url)"),
        "{out}"
    );
    let kafka = line(&out, "kafka");
    assert!(
        kafka.starts_with("kafka: FAILED")
            && kafka.contains("(kafka.dead_letter_topic)")
            && kafka.contains("replyd topics ensure"),
        "{out}"
    );
    let provider = line(&out, "provider");
    assert!(
        provider.starts_with("provider: FAILED")
            && provider.contains("404")
            && provider.contains("provider.base_url"),
        "{out}"
    );

    // Topics that keep records (the test brokers' default, a day) longer than a forgotten task
    // is remembered: a record of it could come back once its id is let go.
    let (code, out) = check(&[("REPLYD_RETENTION__FORGOTTEN_MS", "3600000".into())]);
    assert_eq!(code, Some(5), "{out}");
    let kafka = line(&out, "kafka");
    assert!(
        kafka.starts_with("kafka: FAILED")
            && kafka.contains(&format!(
                "topic {} keeps records 86400000 ms (retention.ms)",
                app.topic
            ))
            && kafka.contains("retention.forgotten_ms is 3600000 ms"),
        "{out}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_letters_replayed_after_the_fix_become_one_reply_each_and_bad_ones_come_back() {
    // A worker whose prompt limit is too tight dead-letters a good task; a broken producer's
    // record is dead-lettered too.
    let config = WorkerConfig {
        max_prompt_bytes: 1_000,
        ..WorkerConfig::default()
    };
    let mut app = TestApp::start(1, key_honouring_mock(10), config).await;
    let mut large = crate::helpers::task_spec(3);
    large.request.messages[0].content = "word ".repeat(400);
    let small = crate::helpers::task_spec(3);
    app.produce_tasks(&[large.clone(), small.clone()], 1).await;
    let (_, malformed) = replyd_lab::produce::malformed_record(1);
    app.produce_raw(&[("conv-bad".into(), malformed)]).await;
    app.spawn_worker("w1");
    app.wait_until_terminal(&[small.task_id], LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!((report.dead_lettered, report.tasks), (2, 1), "{report:#?}");

    // The limit is raised (for the worker and for the checker, which judges records by the
    // worker's rules); the operator replays what it refused, and only that.
    app.terminate("w1").await;
    app.config.max_prompt_bytes = 262_144;
    app.spawn_worker("w1");
    let replay = |args: &[&str]| {
        let out = app
            .operator_command(&["dead-letters", "replay", "--json"])
            .args(args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let dry = replay(&["--kind", "prompt_too_large", "--dry-run"]);
    assert_eq!(dry["replayed"]["prompt_too_large"], 1, "{dry}");
    let done = replay(&["--kind", "prompt_too_large"]);
    assert_eq!(
        (done["read"].as_u64(), done["not_selected"].as_u64()),
        (Some(2), Some(1)),
        "{done}"
    );
    app.wait_until_terminal(&[large.task_id], LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (2, 2), "{report:#?}");
    assert_eq!(report.mock_generations, Some(2), "{report:#?}");

    // Everything again: the malformed record is still bad and comes back; the large task's
    // record is answered from its saved reply, with no second generation.
    let all = replay(&[]);
    assert_eq!(
        all["replayed"]
            .as_object()
            .unwrap()
            .values()
            .map(|v| v.as_u64().unwrap())
            .sum::<u64>(),
        2,
        "{all}"
    );
    app.wait_until_committed_to_end(LIMIT).await;
    wait_until("the bad record is dead-lettered again", LIMIT, || async {
        app.check().await.dead_lettered == 3
    })
    .await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (2, 2), "{report:#?}");
    assert_eq!(report.mock_generations, Some(2), "{report:#?}");
    // Its copy says it was replayed once; with --max-replays 1 it is left where it is.
    let capped = replay(&["--kind", "missing_field", "--max-replays", "1", "--dry-run"]);
    assert_eq!(capped["exhausted"], 1, "{capped}");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_refuses_to_start_without_its_dead_letter_topic() {
    let config = WorkerConfig {
        dead_letter_topic: unique("missing-dlq"),
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, key_honouring_mock(10), config).await;
    // The topic is waited for within the start-up window (a topic made moments before may
    // not be in the metadata yet), then refused by name.
    app.route(Routes {
        kafka_toml: Some("startup_retry_ms = 2000".into()),
        ..Routes::default()
    });
    app.spawn_worker("w1");
    assert!(
        !app.wait_for_exit("w1", LIMIT).await,
        "the worker must not run"
    );
    let log = app.log_of("w1");
    assert!(
        log.contains("dead-letter topic") && log.contains("does not exist"),
        "{log}"
    );
    assert!(log.contains("of retrying"), "{log}");
    assert!(log.contains("replyd topics ensure"), "{log}");

    // What the error names: `replyd topics ensure` makes the missing topic, leaves the one
    // that exists as it is (naming its fewer partitions), and the worker then starts.
    let ensure = |partitions: &str| {
        let out = app
            .operator_command(&["topics", "ensure", "--partitions", partitions, "--json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout)
            .unwrap()
            .lines()
            .map(|line| serde_json::from_str::<serde_json::Value>(line).unwrap())
            .map(|r| {
                (
                    r["role"].as_str().unwrap().to_owned(),
                    r["state"].as_str().unwrap().to_owned(),
                    r["partitions"].as_i64().unwrap(),
                )
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(
        ensure("2"),
        vec![
            ("tasks".into(), "fewer_partitions".into(), 1),
            ("dead letters".into(), "created".into(), 2),
        ]
    );
    assert_eq!(
        ensure("2"),
        vec![
            ("tasks".into(), "fewer_partitions".into(), 1),
            ("dead letters".into(), "exists".into(), 2),
        ]
    );
    app.spawn_worker("w1");
    app.wait_until_ready("w1").await;
}

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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn produce_prints_a_summary_and_writes_the_ids_only_when_asked() {
    let app = TestApp::start(2, key_honouring_mock(10), WorkerConfig::default()).await;
    let ids_file = std::env::temp_dir().join(unique("ids"));
    let (config, ids) = (app.settings_file(), ids_file.clone());
    let output = tokio::task::spawn_blocking(move || {
        std::process::Command::new(crate::helpers::lab_bin())
            .args(["produce", "--count", "2000", "--config"])
            .arg(&config)
            .arg("--ids-file")
            .arg(&ids)
            .output()
            .unwrap()
    })
    .await
    .unwrap();
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let summary: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    assert_eq!(summary["tasks"], 2000);
    assert_eq!(summary["topic"], app.topic.as_str());
    assert!(
        output.stdout.len() < 512,
        "a summary, not the ids: {} bytes",
        output.stdout.len()
    );
    let written = std::fs::read_to_string(&ids_file).unwrap();
    assert_eq!(written.lines().count(), 2000);
    assert!(written.lines().all(|l| TaskId::parse(l).is_ok()));
    assert_eq!(app.end_offsets().await.values().sum::<i64>(), 2000);
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
