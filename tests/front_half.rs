//! The whole chain from HTTP: POST /v1/replies → one transaction (message, task, key, outbox
//! row) → `replyd relay` → Kafka → `replyd worker` → the saved reply shown by GET. Real
//! processes, the real broker and PostgreSQL, the mock provider over HTTP.

mod helpers;

use std::time::Duration;

use helpers::app::{TestApp, WorkerConfig};
use helpers::wait_until;
use replyd::api::replies::{Accepted, ReplyStatus, ReplyView};
use replyd::api::{ApiState, IntakeLimits, serve};
use replyd::api_key::issue;
use replyd::config::ApiSettings;
use replyd::mock_provider::MockSettings;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(120);

struct Front {
    base: String,
    key: String,
    client: reqwest::Client,
    _stop: tokio_util::sync::DropGuard,
}

async fn front(app: &TestApp) -> Front {
    let store = &app.db.store;
    store.create_workspace("acme").await.unwrap();
    let key = issue(&mut rand::rng());
    store.create_api_key("acme", &key).await.unwrap();
    let stop = CancellationToken::new();
    let state = ApiState::new(
        store.clone(),
        ApiSettings::default(),
        IntakeLimits {
            max_attempts: 3,
            max_prompt_bytes: 64 * 1024,
            ..IntakeLimits::default()
        },
    );
    state.changes.listen(app.db.settings.clone(), stop.clone());
    let (addr, _) = serve("127.0.0.1:0".parse().unwrap(), state, stop.clone())
        .await
        .unwrap();
    Front {
        base: format!("http://{addr}"),
        key: key.token,
        client: reqwest::Client::new(),
        _stop: stop.drop_guard(),
    }
}

impl Front {
    async fn send(&self, key: &str, message: &str) -> Accepted {
        self.client
            .post(format!("{}/v1/replies", self.base))
            .bearer_auth(&self.key)
            .header("Idempotency-Key", key)
            .json(&json!({"conversation_id": "conv-1", "message": message}))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn view(&self, accepted: &Accepted) -> ReplyView {
        self.client
            .get(format!("{}{}", self.base, accepted.status_url))
            .bearer_auth(&self.key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    async fn wait_until_completed(&self, accepted: &Accepted) -> ReplyView {
        wait_until("the reply is completed", LIMIT, || async {
            self.view(accepted).await.status == ReplyStatus::Completed
        })
        .await;
        self.view(accepted).await
    }
}

fn mock() -> MockSettings {
    MockSettings {
        latency_ms: 50,
        ..MockSettings::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_post_reaches_the_worker_through_the_outbox_and_its_reply_is_shown() {
    let app = TestApp::start(2, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let first = front.send("press-1", "What are the key decisions?").await;
    let retry = front.send("press-1", "What are the key decisions?").await;
    assert_eq!(retry.task_id, first.task_id);
    let done = front.wait_until_completed(&first).await;
    assert!(done.reply.is_some_and(|r| !r.is_empty()));
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (1, 1), "{report:#?}");
    assert_eq!(report.mock_generations, Some(1), "{report:#?}");
    // The worker's completion charged the task's reservation in the same transaction (I8).
    assert_eq!(
        (report.reservations_charged, report.reservations_open),
        (1, 0),
        "{report:#?}"
    );
    assert_eq!(
        (
            report.duplicate_tasks,
            report.tasks_without_one_outbox_row,
            report.outbox_unpublished
        ),
        (0, 0, 0),
        "{report:#?}"
    );
    let published: i64 = app
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT count(*) FROM outbox WHERE published_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(published, 1);

    // The relay's /readyz names the outbox lag; nothing is waiting.
    let relay = app
        .observability_addr("relay")
        .expect("the relay logs its address");
    let ready = reqwest::get(format!("http://{relay}/readyz"))
        .await
        .unwrap();
    assert_eq!(ready.status(), reqwest::StatusCode::OK);
    let text = ready.text().await.unwrap();
    assert!(
        text.starts_with("relay: ready: outbox: 0 unpublished"),
        "{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_publish_and_mark_republishes_and_still_one_reply() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    let client = app.db.raw_client().await;
    // Hold the relay between its publish and its mark: the mark's UPDATE sleeps in a trigger
    // of this test's schema.
    client
        .batch_execute(
            "CREATE FUNCTION hold_the_mark() RETURNS trigger LANGUAGE plpgsql AS \
             $$ BEGIN PERFORM pg_sleep(120); RETURN NEW; END $$; \
             CREATE TRIGGER hold_the_mark BEFORE UPDATE ON outbox \
             FOR EACH ROW EXECUTE FUNCTION hold_the_mark();",
        )
        .await
        .unwrap();
    app.spawn_relay("relay");
    let accepted = front.send("press-1", "q").await;
    wait_until("the record is published once", LIMIT, || async {
        app.end_offsets().await.values().sum::<i64>() == 1
    })
    .await;
    // Published, not marked: the relay dies there.
    app.kill("relay");
    // Its session sleeps on in the trigger (the server notices the lost client only when it
    // next talks to it): end it, as the server's idle timeout would, then lift the hold.
    let stuck = "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
                 WHERE query LIKE 'UPDATE outbox SET published_at%' AND pid <> pg_backend_pid()";
    wait_until("the dead relay's session is gone", LIMIT, || async {
        client.query_one(stuck, &[]).await.unwrap().get::<_, i64>(0) == 0
    })
    .await;
    client
        .batch_execute("DROP TRIGGER hold_the_mark ON outbox")
        .await
        .unwrap();
    let unpublished: i64 = client
        .query_one(
            "SELECT count(*) FROM outbox WHERE published_at IS NULL",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(unpublished, 1, "the mark died with the relay");

    app.spawn_relay("relay");
    app.spawn_worker("w1");
    wait_until("the record is published again", LIMIT, || async {
        app.end_offsets().await.values().sum::<i64>() == 2
    })
    .await;
    front.wait_until_completed(&accepted).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.records, report.tasks), (2, 1), "{report:#?}");
    assert_eq!(report.duplicate_replies, 0);
    assert_eq!(
        report.mock_generations,
        Some(1),
        "one generation for both records"
    );
}

/// A worker killed after the transaction that saved the reply and charged its reservation, and
/// before it committed the record's offset: the next worker gets the record again, finds the
/// task completed, and neither generates nor charges again (I8 with I1 and I3).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_between_saving_the_reply_and_committing_its_offset_charges_once() {
    let config = WorkerConfig {
        // No commit before the kill: the kill always lands between the save and the commit.
        commit_interval_ms: 600_000,
        ..WorkerConfig::default()
    };
    let mut app = TestApp::start(1, mock(), config).await;
    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let accepted = front.send("press-1", "q").await;
    let saved = front.wait_until_completed(&accepted).await;
    let usage = |app: &TestApp| {
        let store = app.db.store.clone();
        async move { store.quota("acme").await.unwrap().unwrap().usage }
    };
    assert_eq!((usage(&app).await.used, usage(&app).await.reserved), (1, 0));
    assert!(
        app.committed_offsets()
            .await
            .values()
            .all(|offset| *offset < 1),
        "nothing is committed before the kill"
    );
    app.kill("w1");

    app.config.commit_interval_ms = 200;
    app.spawn_worker("w2");
    // w2 commits past the record, so it was delivered to w2 again.
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (1, 1), "{report:#?}");
    assert_eq!(report.mock_generations, Some(1), "{report:#?}");
    assert_eq!(
        (report.reservations_charged, report.reservations_open),
        (1, 0),
        "{report:#?}"
    );
    assert_eq!((usage(&app).await.used, usage(&app).await.reserved), (1, 0));
    assert_eq!(front.view(&accepted).await.reply, saved.reply);
}

/// Reads an event stream until it ends (bounded by LIMIT); returns each status event's view.
async fn read_events(response: reqwest::Response) -> Vec<ReplyView> {
    read_events_with_ids(response)
        .await
        .into_iter()
        .map(|(_, view)| view)
        .collect()
}

/// Like `read_events`, with each event's id.
async fn read_events_with_ids(response: reqwest::Response) -> Vec<(String, ReplyView)> {
    assert_eq!(response.status(), reqwest::StatusCode::OK);
    assert_eq!(response.headers()["content-type"], "text/event-stream");
    let mut response = response;
    let mut text = String::new();
    tokio::time::timeout(LIMIT, async {
        while let Some(chunk) = response.chunk().await.unwrap() {
            text.push_str(&String::from_utf8_lossy(&chunk));
        }
    })
    .await
    .expect("the stream ends after the terminal state");
    text.split("\n\n")
        .filter(|event| event.lines().any(|l| l == "event: status"))
        .map(|event| {
            let field = |name: &str| {
                event
                    .lines()
                    .find_map(|l| l.strip_prefix(name))
                    .unwrap_or_default()
                    .to_owned()
            };
            (
                field("id: "),
                serde_json::from_str(&field("data: ")).unwrap(),
            )
        })
        .collect()
}

impl Front {
    async fn events(&self, accepted: &Accepted, last_event_id: Option<&str>) -> reqwest::Response {
        let mut request = self
            .client
            .get(format!("{}{}", self.base, accepted.events_url))
            .bearer_auth(&self.key);
        if let Some(id) = last_event_id {
            request = request.header("Last-Event-ID", id);
        }
        request.send().await.unwrap()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_event_stream_delivers_each_state_and_ends_at_completion() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    let accepted = front.send("press-1", "q").await;
    // Open before anything runs: the first event is the pending state.
    let stream = front.events(&accepted, None).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let views = read_events(stream).await;
    assert_eq!(views.first().map(|v| v.status), Some(ReplyStatus::Pending));
    let last = views.last().unwrap();
    assert_eq!(last.status, ReplyStatus::Completed);
    assert!(last.reply.is_some());

    // Opened after completion: the terminal state at once, then the end.
    let late = read_events_with_ids(front.events(&accepted, None).await).await;
    assert_eq!(late.len(), 1);
    assert_eq!(late[0].1.status, ReplyStatus::Completed);
    // A reconnect that already saw it (Last-Event-ID) gets nothing again, and the end.
    let resumed = read_events(front.events(&accepted, Some(&late[0].0)).await).await;
    assert!(resumed.is_empty(), "{resumed:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_whose_notifications_are_lost_still_ends() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    let accepted = front.send("press-1", "q").await;
    let stream = front.events(&accepted, None).await;
    // Kill the API's listening session while the task runs: its notifications are lost.
    let client = app.db.raw_client().await;
    let listener = format!(
        "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity \
         WHERE application_name = 'replyd-api-listener {}'",
        std::process::id()
    );
    wait_until("the API's listener was killed", LIMIT, || async {
        client
            .query_one(&listener, &[])
            .await
            .unwrap()
            .get::<_, i64>(0)
            > 0
    })
    .await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let views = read_events(stream).await;
    assert_eq!(views.last().map(|v| v.status), Some(ReplyStatus::Completed));
}

/// The whole chain as `replyd serve` (two partitions, the mock) and a key of workspace `acme`;
/// returns the app, the key and the API's address.
async fn serve_with_a_key() -> (TestApp, replyd::api_key::IssuedKey, String) {
    let app = TestApp::start(2, mock(), WorkerConfig::default()).await;
    app.db.store.create_workspace("acme").await.unwrap();
    let key = issue(&mut rand::rng());
    app.db.store.create_api_key("acme", &key).await.unwrap();
    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;
    (app, key, addr)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replyd_serve_runs_the_whole_chain_in_one_process_and_drains_on_sigterm() {
    let (app, key, addr) = serve_with_a_key().await;
    let front = Front {
        base: format!("http://{addr}"),
        key: key.token,
        client: reqwest::Client::new(),
        _stop: CancellationToken::new().drop_guard(),
    };
    let accepted = front.send("press-1", "q").await;
    let views = read_events(front.events(&accepted, None).await).await;
    assert_eq!(views.last().map(|v| v.status), Some(ReplyStatus::Completed));
    app.wait_until_committed_to_end(LIMIT).await;
    app.terminate("serve").await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (1, 1));
    assert!(!app.log_of("serve").contains(" ERROR "), "a clean shutdown");
}

/// schemathesis drives the live API from the document it serves: examples, boundary values and
/// random requests for every operation, then sequences along the document's links (create,
/// read, follow, regenerate). Every check it has must pass but `positive_data_acceptance`,
/// which cannot know that an `Idempotency-Key` it reuses with other inputs must be refused
/// (422, as documented). The whole chain runs (`replyd serve` with the mock provider), so the
/// streams it follows end, and afterwards the invariants hold over everything it made.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schemathesis_finds_no_server_error_and_no_answer_outside_the_document() {
    let (app, key, addr) = serve_with_a_key().await;

    let served = reqwest::get(format!("http://{addr}/openapi.json"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        served == include_str!("../docs/openapi.json"),
        "/openapi.json is not docs/openapi.json"
    );

    let dir = std::env::temp_dir().join(helpers::unique("schemathesis"));
    std::fs::create_dir_all(&dir).unwrap();
    let run = tokio::process::Command::new(helpers::infra("SCHEMATHESIS"))
        .current_dir(&dir)
        .args(["run", &format!("http://{addr}/openapi.json")])
        .args(["--header", &format!("Authorization: Bearer {}", key.token)])
        .args([
            "--checks",
            "all",
            "--exclude-checks",
            "positive_data_acceptance",
        ])
        .args(["--max-examples", "25", "--seed", "20261201"])
        .args(["--request-timeout", "30", "--workers", "2"])
        .args(["--suppress-health-check", "all", "--no-color"])
        .env("NO_COLOR", "1")
        .output()
        .await
        .expect("schemathesis runs (installed by `make infra-up`)");
    let report = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "schemathesis failed:\n{report}\n{}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(
        report.lines().any(|line| line.trim() == "✅ Stateful"),
        "the stateful phase ran:\n{report}"
    );

    app.wait_until_committed_to_end(LIMIT).await;
    app.terminate("serve").await;
    let check = app.check().await;
    assert_eq!(check.violations, Vec::<String>::new(), "{check:#?}");
    assert!(check.tasks > 0, "schemathesis made tasks");
    assert_eq!(
        check.tasks,
        check.completed + check.failed,
        "every task it made was settled: {check:#?}"
    );
}

/// `replyd browsers` (the demo's clients) against the whole chain: presses that lose their
/// first answer and retry with the same key, double clicks and regenerates. Every press ends
/// completed, both answers of a double click name one task, and the durable state has exactly
/// one task per press plus one per regenerate: no lost answer turned into a second task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browsers_that_lose_answers_and_double_click_make_one_task_per_press() {
    let (app, key, addr) = serve_with_a_key().await;
    let run = tokio::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
        .args(["browsers", "--api", &format!("http://{addr}")])
        .args(["--presses", "40", "--concurrency", "8"])
        .args(["--lose-share", "0.5", "--lose-timeout-ms", "3"])
        .args(["--double-click-share", "0.3", "--regenerate-share", "0.3"])
        .args(["--press-limit-s", "120", "--seed", "7"])
        .env("REPLYD_API_KEY", &key.token)
        .output()
        .await
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&run.stdout).unwrap();
    assert_eq!(report["presses"], 40, "{report}");
    assert_eq!(report["unfinished"], 0, "{report}");
    assert_eq!(report["answers_disagreeing"], 0, "{report}");
    assert!(report["lost_answers"].as_u64().unwrap() > 0, "{report}");
    assert!(report["regenerates"].as_u64().unwrap() > 0, "{report}");
    let regenerates = report["regenerates"].as_i64().unwrap();

    app.wait_until_committed_to_end(LIMIT).await;
    app.terminate("serve").await;
    let check = app.check().await;
    assert_eq!(check.violations, Vec::<String>::new(), "{check:#?}");
    assert_eq!(check.duplicate_tasks, 0, "{check:#?}");
    assert_eq!(
        (check.tasks, check.completed),
        (40 + regenerates, 40 + regenerates),
        "one task per press and per regenerate: {check:#?}"
    );
    assert_eq!(check.duplicate_replies, 0, "{check:#?}");
    assert_eq!(
        (check.reservations_charged, check.reservations_open),
        (40 + regenerates, 0),
        "one charge per task, none open: {check:#?}"
    );
}
