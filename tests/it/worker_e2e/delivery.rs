//! Records in and replies out: a record published three times gets one reply, a full window
//! pauses its partition, a slow record holds the commit point but not later records, a kill
//! mid-partition loses nothing, and the producer writes a summary and the ids only when asked.

use std::collections::HashMap;
use std::time::Duration;

use super::{LIMIT, assert_invariants};
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{demo_tasks, ids, key_honouring_mock, unique, wait_until};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::Message;
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use replyd_core::domain::{ChatMessage, Role, TaskId, TaskSpec};

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
