//! Where a task's records came from, and forgetting tasks: retention deletes finished tasks
//! past their age, an erasure one conversation's or one workspace's data. What is deleted is
//! gone, nothing else is touched, a record of a forgotten task (still in the topic, or sent
//! again) is done without a call, and `replyd check` holds. Real processes, the real broker
//! and PostgreSQL, the mock provider over HTTP.

use std::collections::BTreeMap;
use std::time::Duration;

use replyd::api::reply_view::ReplyStatus;
use replyd::store::forgetting::ErasureScope;
use replyd_core::domain::{RecordSource, TaskId, TaskSpec};
use replyd_core::lease::ClaimOutcome;
use replyd_lab::mock_provider::MockSettings;
use serde_json::{Value, json};
use uuid::Uuid;

use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{TestDb, api, assert_config_refused, task_spec, wait_until};

const LIMIT: Duration = Duration::from_secs(120);

/// A slow reply: the mock holds this prompt's call for 8 s (under the 20 s request timeout).
const SLOW: &str = "[mock:latency_ms=8000] take your time";

fn mock() -> MockSettings {
    MockSettings {
        latency_ms: 20,
        ..MockSettings::default()
    }
}

/// Every row of the tables forgetting writes to, as JSON text, sorted, for the tasks `keep`
/// selects (a condition on `reply_tasks`) and what refers to them: what must be untouched.
async fn rows_of(client: &tokio_postgres::Client, keep: &str) -> Vec<String> {
    let mut all = Vec::new();
    for (table, scope) in [
        ("reply_tasks", keep.to_owned()),
        (
            "messages",
            format!("message_id::text IN (SELECT message_id FROM reply_tasks WHERE {keep})"),
        ),
        (
            "reply_attempts",
            format!("task_id IN (SELECT task_id FROM reply_tasks WHERE {keep})"),
        ),
        (
            "quota_reservations",
            format!("task_id IN (SELECT task_id FROM reply_tasks WHERE {keep})"),
        ),
        (
            "idempotency_keys",
            format!("task_id IN (SELECT task_id FROM reply_tasks WHERE {keep})"),
        ),
        (
            "outbox",
            format!("task_id IN (SELECT task_id FROM reply_tasks WHERE {keep})"),
        ),
    ] {
        let rows = client
            .query(
                &format!("SELECT '{table} ' || row_to_json(t)::text FROM {table} t WHERE {scope}"),
                &[],
            )
            .await
            .unwrap();
        all.extend(rows.iter().map(|r| r.get::<_, String>(0)));
    }
    all.sort();
    all
}

/// How many rows of each table still refer to `tasks`.
async fn left_of(client: &tokio_postgres::Client, tasks: &[Uuid]) -> BTreeMap<&'static str, i64> {
    let mut left = BTreeMap::new();
    for table in [
        "reply_tasks",
        "reply_attempts",
        "quota_reservations",
        "quota_decisions",
        "idempotency_keys",
        "outbox",
    ] {
        let n: i64 = client
            .query_one(
                &format!("SELECT count(*) FROM {table} WHERE task_id = ANY($1)"),
                &[&tasks],
            )
            .await
            .unwrap()
            .get(0);
        left.insert(table, n);
    }
    left
}

async fn forgotten(client: &tokio_postgres::Client, tasks: &[Uuid]) -> BTreeMap<String, i64> {
    client
        .query(
            "SELECT reason, count(*) FROM forgotten_tasks WHERE task_id = ANY($1) GROUP BY reason",
            &[&tasks],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_claim_names_its_record_and_the_stalled_partition_runbook_finds_the_oldest_open_task()
{
    let app = TestApp::start(2, mock(), WorkerConfig::default()).await;
    app.spawn_worker("w1");
    app.wait_until_assigned(&["w1"]).await;
    let quick = task_spec(3);
    let other = task_spec(3);
    let mut slow = task_spec(3);
    slow.request.messages[0].content = SLOW.into();
    // Offsets: quick is 0 of partition 0; other 0 and slow 1 of partition 1.
    app.produce_to_partitions(std::slice::from_ref(&quick), &[0])
        .await;
    app.produce_to_partitions(&[other.clone(), slow.clone()], &[1])
        .await;
    app.wait_until_terminal(&[quick.task_id, other.task_id], LIMIT)
        .await;
    let client = app.db.raw_client().await;
    wait_until("the slow task is running", LIMIT, || async {
        app.db
            .store
            .read(slow.task_id)
            .await
            .unwrap()
            .unwrap()
            .status
            == replyd_core::domain::TaskStatus::Running
    })
    .await;

    let source = |id: TaskId| {
        let client = &client;
        async move {
            let row = client
                .query_one(
                    "SELECT t.source_partition, t.source_offset, a.source_partition, a.source_offset \
                     FROM reply_tasks t JOIN reply_attempts a USING (task_id) \
                     WHERE task_id = $1 AND a.attempt_no = 1",
                    &[&id.as_uuid()],
                )
                .await
                .unwrap();
            let task: (Option<i32>, Option<i64>) = (row.get(0), row.get(1));
            let attempt: (Option<i32>, Option<i64>) = (row.get(2), row.get(3));
            assert_eq!(task, attempt, "the task and its attempt name one record");
            task
        }
    };
    assert_eq!(source(quick.task_id).await, (Some(0), Some(0)));
    assert_eq!(source(other.task_id).await, (Some(1), Some(0)));
    assert_eq!(source(slow.task_id).await, (Some(1), Some(1)));

    // The runbook's own query, as OPERATIONS.md prints it, finds the slow task on partition 1
    // and nothing open on partition 0.
    let runbook = runbook_query();
    let open_on = |partition: i32| {
        let (client, runbook) = (&client, &runbook);
        async move {
            client
                .query(runbook.as_str(), &[&partition])
                .await
                .unwrap()
                .iter()
                .map(|r| r.get::<_, Uuid>("task_id"))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(open_on(1).await, vec![slow.task_id.as_uuid()]);
    assert_eq!(open_on(0).await, Vec::<Uuid>::new());

    // `replyd inspect` shows where each attempt's record sits.
    let inspect = app
        .operator_command(&["inspect", &slow.task_id.to_string()])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&inspect.stdout);
    assert!(text.contains(" 1@1 "), "{text}");
    let inspect = app
        .operator_command(&["inspect", "--json", &slow.task_id.to_string()])
        .output()
        .unwrap();
    let shown: Value = serde_json::from_slice(&inspect.stdout).unwrap();
    assert_eq!(
        shown["attempts"][0]["source"],
        json!({"partition": 1, "offset": 1})
    );
    app.wait_until_terminal(&[slow.task_id], LIMIT).await;
}

/// The SQL block of the ReplydPartitionStalled runbook, with `:partition` as `$1`.
fn runbook_query() -> String {
    let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/OPERATIONS.md"))
        .unwrap();
    let section = &doc[doc.find("### ReplydPartitionStalled").expect("the runbook")..];
    let start = section.find("```sql\n").expect("an SQL block") + "```sql\n".len();
    let end = start + section[start..].find("```").unwrap();
    section[start..end]
        .trim()
        .trim_end_matches(';')
        .replace(":partition", "$1")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_forgets_old_finished_tasks_only_and_their_records_sent_again_cost_nothing() {
    // The relay's rounds keep finished tasks 30 days, and run every half second here.
    let config = WorkerConfig {
        extra_toml: "[retention]\ntasks_ms = 2592000000\ninterval_ms = 500\n".into(),
        ..WorkerConfig::default()
    };
    let app = TestApp::start(2, mock(), config).await;
    let front = api::front(&app.db.store, &["acme"]).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let mut sent = Vec::new();
    for i in 0..4 {
        sent.push(front.send("acme", "conv-1", &format!("question {i}")).await);
    }
    for accepted in &sent {
        front
            .wait_until("acme", accepted, ReplyStatus::Completed)
            .await;
    }
    app.wait_until_committed_to_end(LIMIT).await;
    let client = app.db.raw_client().await;
    let old: Vec<Uuid> = sent[..2].iter().map(|a| a.task_id.as_uuid()).collect();
    let recent: Vec<Uuid> = sent[2..].iter().map(|a| a.task_id.as_uuid()).collect();
    // Two finished (and charged) 40 days ago, their idempotency records expired since.
    client
        .execute(
            "UPDATE reply_tasks SET finished_at = finished_at - interval '40 days' \
             WHERE task_id = ANY($1)",
            &[&old],
        )
        .await
        .unwrap();
    client
        .execute(
            "UPDATE idempotency_keys SET expires_at = clock_timestamp() - interval '1 second' \
             WHERE task_id = ANY($1)",
            &[&old],
        )
        .await
        .unwrap();
    client
        .execute(
            "UPDATE quota_reservations SET created_at = created_at - interval '40 days', \
             settled_at = settled_at - interval '40 days' WHERE task_id = ANY($1)",
            &[&old],
        )
        .await
        .unwrap();
    // A third finished as long ago, its key expired too, but charged in the quota's current
    // window (a period change recounts the window from its reservations): it stays.
    client
        .execute(
            "UPDATE reply_tasks SET finished_at = finished_at - interval '40 days' \
             WHERE task_id = $1",
            &[&recent[0]],
        )
        .await
        .unwrap();
    client
        .execute(
            "UPDATE idempotency_keys SET expires_at = clock_timestamp() - interval '1 second' \
             WHERE task_id = $1",
            &[&recent[0]],
        )
        .await
        .unwrap();
    let message_ids: Vec<String> = client
        .query(
            "SELECT message_id FROM reply_tasks WHERE task_id = ANY($1)",
            &[&old],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    // Their records, to send again once they are forgotten.
    let records: Vec<(String, Vec<u8>)> = client
        .query(
            "SELECT record_key, payload FROM outbox WHERE task_id = ANY($1)",
            &[&old],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(records.len(), 2);
    let untouched = rows_of(
        &client,
        &format!("task_id IN ('{}', '{}')", recent[0], recent[1]),
    )
    .await;
    assert!(untouched.len() >= 10, "{untouched:#?}");

    // The relay's next round forgets the two old ones; the recent ones stay.
    wait_until(
        "the relay's retention forgets the old tasks",
        LIMIT,
        || async { forgotten(&client, &old).await.values().sum::<i64>() == 2 },
    )
    .await;
    assert_eq!(
        app.metric(
            "relay",
            "replyd_tasks_forgotten_total{reason=\"retention\"}"
        )
        .await,
        Some(2.0)
    );
    let again = app
        .db
        .store
        .forget_finished(Some(Duration::from_secs(30 * 86_400)), 100)
        .await
        .unwrap();
    assert_eq!(again.tasks, 0, "nothing is left to forget");
    let left = left_of(&client, &old).await;
    assert!(left.values().all(|n| *n == 0), "{left:?}");
    let messages_left: i64 = client
        .query_one(
            "SELECT count(*) FROM messages WHERE message_id::text = ANY($1)",
            &[&message_ids],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(messages_left, 0);
    assert_eq!(
        forgotten(&client, &old).await,
        BTreeMap::from([("retention".to_owned(), 2)])
    );
    assert_eq!(
        rows_of(
            &client,
            &format!("task_id IN ('{}', '{}')", recent[0], recent[1])
        )
        .await,
        untouched
    );
    assert_eq!(front.status("acme", &sent[0]).await, 404);

    // The forgotten tasks' records come back (a producer's retry, a replay): each is done,
    // with no call and no row, and the checker counts them as done.
    let generations = crate::helpers::provider::stats(&app.mock).await.generations;
    app.produce_raw(&records).await;
    app.wait_until_committed_to_end(LIMIT).await;
    assert_eq!(
        crate::helpers::provider::stats(&app.mock).await.generations,
        generations
    );
    let left = left_of(&client, &old).await;
    assert!(left.values().all(|n| *n == 0), "{left:?}");
    assert!(matches!(
        app.db
            .store
            .claim(sent[0].task_id, "operator", Duration::from_secs(5))
            .await
            .unwrap(),
        ClaimOutcome::Forgotten
    ));
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (2, 2), "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasing_a_conversation_ends_its_running_task_deletes_its_data_and_refuses_what_comes_later()
 {
    let app = TestApp::start(2, mock(), WorkerConfig::default()).await;
    let front = api::front(&app.db.store, &["acme", "globex"]).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let c1 = vec![
        front.send("acme", "c1", "first").await,
        front.send("acme", "c1", "second").await,
    ];
    let kept = [
        front.send("acme", "c2", "elsewhere").await,
        front.send("globex", "c1", "another workspace").await,
    ];
    for a in &c1 {
        front.wait_until("acme", a, ReplyStatus::Completed).await;
    }
    front
        .wait_until("acme", &kept[0], ReplyStatus::Completed)
        .await;
    front
        .wait_until("globex", &kept[1], ReplyStatus::Completed)
        .await;
    let requests_before_slow = crate::helpers::provider::stats(&app.mock).await.requests;
    let running = front.send("acme", "c1", SLOW).await;
    front
        .wait_until("acme", &running, ReplyStatus::Running)
        .await;
    let client = app.db.raw_client().await;
    let outside = "NOT (workspace_id = 'acme' AND conversation_id = 'c1')";
    let untouched = rows_of(&client, outside).await;

    let dry = app
        .operator_command(&[
            "erase",
            "--workspace",
            "acme",
            "--conversation",
            "c1",
            "--dry-run",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        dry.status.success(),
        "{}",
        String::from_utf8_lossy(&dry.stderr)
    );
    let plan: Value = serde_json::from_slice(&dry.stdout).unwrap();
    assert_eq!(
        (
            &plan["run"],
            &plan["tasks"],
            &plan["open_tasks"],
            &plan["messages"]
        ),
        (&json!("counted"), &json!(3), &json!(1), &json!(3)),
        "{plan}"
    );
    let in_scope: i64 = client
        .query_one(
            "SELECT count(*) FROM reply_tasks WHERE workspace_id = 'acme' AND conversation_id = 'c1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(in_scope, 3, "a dry run deletes nothing");

    let erased = app
        .operator_command(&[
            "erase",
            "--workspace",
            "acme",
            "--conversation",
            "c1",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        erased.status.success(),
        "{}",
        String::from_utf8_lossy(&erased.stderr)
    );
    let erased: Value = serde_json::from_slice(&erased.stdout).unwrap();
    // The running task's worker may be in its call: its reservation is charged, not released.
    assert_eq!(
        (
            &erased["tasks"],
            &erased["messages"],
            &erased["charged"],
            &erased["released"]
        ),
        (&json!(3), &json!(3), &json!(1), &json!(0)),
        "{erased}"
    );
    let ids: Vec<Uuid> = c1
        .iter()
        .chain([&running])
        .map(|a| a.task_id.as_uuid())
        .collect();
    let left = left_of(&client, &ids).await;
    assert!(left.values().all(|n| *n == 0), "{left:?}");
    let messages_left: i64 = client
        .query_one(
            "SELECT count(*) FROM messages WHERE workspace_id = 'acme' AND conversation_id = 'c1'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(messages_left, 0);
    assert_eq!(
        forgotten(&client, &ids).await,
        BTreeMap::from([("erasure".to_owned(), 3)])
    );
    assert_eq!(rows_of(&client, outside).await, untouched);

    // The running call ends; its completion finds no row, and its record is done as forgotten.
    app.wait_until_committed_to_end(LIMIT).await;
    let left = left_of(&client, &ids).await;
    assert!(left.values().all(|n| *n == 0), "{left:?}");

    // Later: the API refuses the conversation, and a record of it from a producer is done
    // without a call.
    let refused = front.post("acme", "c1", "are you there?").await;
    assert_eq!(refused.status(), 410);
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/conversation_erased"),
        "{problem}"
    );
    // The erased task's call was cut, but a provider finishes a left client's work: if its
    // request arrived, its generation is counted at its first token, whenever that comes.
    // Counted first, so that only what follows is compared.
    if crate::helpers::provider::stats(&app.mock).await.requests > requests_before_slow {
        let key = running.task_id.to_string();
        wait_until(
            "the mock counts the erased task's generation",
            LIMIT,
            || async {
                crate::helpers::provider::stats(&app.mock)
                    .await
                    .per_key
                    .get(&key)
                    .is_some_and(|n| *n >= 1)
            },
        )
        .await;
    }
    let generations = crate::helpers::provider::stats(&app.mock).await.generations;
    let mut late = task_spec(3);
    late.workspace_id = "acme".into();
    late.conversation_id = "c1".into();
    let mut elsewhere = task_spec(3);
    elsewhere.workspace_id = "acme".into();
    elsewhere.conversation_id = "c3".into();
    app.produce_tasks(&[late.clone(), elsewhere.clone()], 1)
        .await;
    app.wait_until_terminal(&[elsewhere.task_id], LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    assert_eq!(
        crate::helpers::provider::stats(&app.mock).await.generations,
        generations + 1,
        "only the other conversation's record was run"
    );
    assert_eq!(
        forgotten(&client, &[late.task_id.as_uuid()]).await,
        BTreeMap::from([("erasure".to_owned(), 1)])
    );
    assert_eq!(
        front.send("acme", "c2", "still here").await.status,
        ReplyStatus::Pending
    );

    // A whole workspace: its keys stop working, its row and counter go.
    let gone = app
        .operator_command(&[
            "erase",
            "--workspace",
            "globex",
            "--whole-workspace",
            "--json",
        ])
        .output()
        .unwrap();
    assert!(
        gone.status.success(),
        "{}",
        String::from_utf8_lossy(&gone.stderr)
    );
    let gone: Value = serde_json::from_slice(&gone.stdout).unwrap();
    assert_eq!(
        (&gone["tasks"], &gone["api_keys"], &gone["workspace"]),
        (&json!(1), &json!(1), &json!(true)),
        "{gone}"
    );
    assert_eq!(front.post("globex", "c1", "hello?").await.status(), 401);
    let rows: i64 = client
        .query_one(
            "SELECT (SELECT count(*) FROM workspaces WHERE workspace_id = 'globex') \
                  + (SELECT count(*) FROM quota_counters WHERE workspace_id = 'globex') \
                  + (SELECT count(*) FROM reply_tasks WHERE workspace_id = 'globex')",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);

    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_erasure_racing_new_records_of_its_conversation_leaves_none_of_them_behind() {
    let db = TestDb::new().await;
    let spec = |i: usize| TaskSpec {
        workspace_id: "ws-race".into(),
        conversation_id: "c-race".into(),
        message_id: format!("m-{i}"),
        ..task_spec(3)
    };
    let specs: Vec<TaskSpec> = (0..240).map(spec).collect();
    // Four claimers insert the conversation's new tasks while the erasure runs.
    let mut claimers = Vec::new();
    for chunk in specs.chunks(60) {
        let (store, chunk) = (db.store.clone(), chunk.to_vec());
        claimers.push(tokio::spawn(async move {
            let mut outcomes = Vec::new();
            for (i, s) in chunk.iter().enumerate() {
                let source = RecordSource {
                    partition: 0,
                    offset: i as i64,
                    held_alone: true,
                };
                let taken = store
                    .claim_task(
                        s.task_id,
                        "racer",
                        Duration::from_secs(30),
                        Some(s),
                        Some(source),
                    )
                    .await
                    .unwrap();
                outcomes.push(taken.claim.label());
                // Spread over the erasure's run.
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            outcomes
        }));
    }
    // Start the erasure once some tasks exist.
    let client = db.raw_client().await;
    wait_until("some tasks of the conversation exist", LIMIT, || async {
        client
            .query_one(
                "SELECT count(*) FROM reply_tasks WHERE workspace_id = 'ws-race'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
            >= 20
    })
    .await;
    let scope = ErasureScope {
        workspace_id: "ws-race".into(),
        conversation_id: Some("c-race".into()),
    };
    db.store.erase(&scope).await.unwrap();
    let mut labels = BTreeMap::<&str, usize>::new();
    for claimer in claimers {
        for label in claimer.await.unwrap() {
            *labels.entry(label).or_default() += 1;
        }
    }
    // Every claim either took a task the erasure then forgot, or found it forgotten.
    assert_eq!(labels.values().sum::<usize>(), specs.len(), "{labels:?}");
    assert!(
        labels.keys().all(|l| ["claimed", "forgotten"].contains(l)),
        "{labels:?}"
    );
    assert!(
        labels.get("forgotten").copied().unwrap_or(0) > 0,
        "{labels:?}"
    );
    let ids: Vec<Uuid> = specs.iter().map(|s| s.task_id.as_uuid()).collect();
    let left = left_of(&client, &ids).await;
    // A claimer still running after the erasure returned can only have been refused.
    assert_eq!(left["reply_tasks"], 0, "{left:?} {labels:?}");
    assert_eq!(
        forgotten(&client, &ids).await,
        BTreeMap::from([("erasure".to_owned(), specs.len() as i64)])
    );
}

#[test]
fn retention_shorter_than_the_idempotency_records_is_refused() {
    assert_config_refused(
        "[retention]\ntasks_ms = 60000\n",
        "retention.tasks_ms: 60000 must be 0 (keep forever) or at least api.idempotency_retention_ms",
    );
    assert_config_refused(
        "[retention]\nforgotten_ms = 0\n",
        "retention.forgotten_ms: must be positive",
    );
}
