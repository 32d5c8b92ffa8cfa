//! Bad records: each kind lands in the dead-letter topic while the partition keeps moving, the
//! checker judges them by the worker's own prompt limit, and dead letters replayed after the
//! fix become one reply each.

use std::collections::BTreeSet;
use std::time::Duration;

use super::LIMIT;
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{demo_tasks, ids, key_honouring_mock, unique, wait_until};
use prost::Message as _;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use replyd_core::domain::{ChatMessage, Role};
use replyd_lab::produce::malformed_record;

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

/// The names of process `pid`'s threads (as the kernel keeps them: 15 bytes at most).
fn thread_names(pid: u32) -> Vec<String> {
    std::fs::read_dir(format!("/proc/{pid}/task"))
        .unwrap()
        .filter_map(|task| std::fs::read_to_string(task.ok()?.path().join("comm")).ok())
        .map(|name| name.trim_end().to_string())
        .collect()
}

/// rdkafka's producers poll on a thread of their own, which spins out the last millisecond
/// of every 100 ms: a worker makes its dead-letter producer at its first bad record, so one
/// that never meets one never pays for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dead_letter_producer_is_made_at_the_first_bad_record() {
    // rdkafka's name for the thread, cut to the kernel's 15 bytes.
    const POLLING: &str = "producer pollin";
    let app = TestApp::start(1, key_honouring_mock(20), WorkerConfig::default()).await;
    app.spawn_worker("w1");
    let good = demo_tasks(1, 1);
    app.produce_tasks(&good, 1).await;
    app.wait_until_terminal(&ids(&good), LIMIT).await;
    let pid = app.pid("w1");
    let before = thread_names(pid);
    assert!(
        before.iter().any(|name| name.starts_with("rdk:")),
        "the consumer's threads are seen: {before:?}"
    );
    assert!(!before.iter().any(|name| name == POLLING), "{before:?}");

    app.produce_raw(&[("k".to_string(), malformed_record(0).1)])
        .await;
    app.wait_until_committed_to_end(LIMIT).await;
    let (bootstrap, dlq) = (app.bootstrap.clone(), format!("{}.dlq", app.topic));
    let copies = tokio::task::spawn_blocking(move || dead_letters(&bootstrap, &dlq))
        .await
        .unwrap();
    assert_eq!(copies.len(), 1, "{copies:?}");
    let after = thread_names(pid);
    assert_eq!(
        after.iter().filter(|name| *name == POLLING).count(),
        1,
        "{after:?}"
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
