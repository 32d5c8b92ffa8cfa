//! The whole chain from HTTP: POST /v1/replies → one transaction (message, task, key, outbox
//! row) → `replyd relay` → Kafka → `replyd worker` → the saved reply shown by GET. Real
//! processes, the real broker and PostgreSQL, the mock provider over HTTP.

use std::time::Duration;

use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{api, wait_until};
use replyd::api::ApiState;
use replyd::api::reply_view::{Accepted, ReplyStatus, ReplyView};
use replyd::api::settings::ApiSettings;
use replyd_core::api_key::issue;
use replyd_lab::mock_provider::MockSettings;
use serde_json::json;
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(120);

struct Front {
    base: String,
    key: String,
    /// The key's public id, to revoke it.
    key_id: String,
    client: reqwest::Client,
    _stop: tokio_util::sync::DropGuard,
}

async fn front(app: &TestApp) -> Front {
    let key = api::workspace_with_key(&app.db.store, "acme").await;
    let stop = CancellationToken::new();
    let state = ApiState::new(
        app.db.store.clone(),
        ApiSettings::default(),
        api::limits(64 * 1024),
    );
    state.changes.listen(app.db.settings.clone(), stop.clone());
    let (base, stop) = api::serve_on_loopback(state, stop).await;
    Front {
        base,
        key: key.token,
        key_id: key.key_id,
        client: reqwest::Client::new(),
        _stop: stop,
    }
}

impl Front {
    async fn send(&self, key: &str, message: &str) -> Accepted {
        api::press(&self.client, &self.base, &self.key, key, message)
            .await
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

/// A provider that honours `Idempotency-Key` (an opt-in: no real chat API documents it). These
/// scenarios lose answers and kill processes mid-call, and count a generation per press: a
/// call resent under the same key finds the first generation.
fn mock() -> MockSettings {
    MockSettings {
        latency_ms: 50,
        honour_idempotency_key: true,
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

/// The token quota under a kill mid-call: the killed worker's attempt reported no usage, the
/// next one's reply did, and the task's reservation is settled once, to that usage; what was
/// held for it (the ceiling) is given back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_call_is_charged_the_saved_replys_tokens_once() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    assert!(
        app.db
            .store
            .set_token_limit("acme", Some(100_000))
            .await
            .unwrap()
    );
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let press = front
        .send("press-1", "[mock:latency_ms=8000] how many tokens")
        .await;
    front.wait_until_status(&press, ReplyStatus::Running).await;
    let tokens = |app: &TestApp| {
        let store = app.db.store.clone();
        async move { store.quota("acme").await.unwrap().unwrap().tokens }
    };
    let held = tokens(&app).await;
    assert_eq!(held.used, 0);
    assert!(held.reserved > 4_096, "the ceiling is held: {held:?}");
    app.kill("w1");
    app.spawn_worker("w2");
    let view = front.wait_until_completed(&press).await;
    app.wait_until_committed_to_end(LIMIT).await;

    let usage = view.usage.expect("GET /v1/replies/{id} shows usage");
    assert!(usage.attempts.len() >= 2, "{usage:?}");
    assert_eq!(
        (
            usage.attempts[0].prompt_tokens,
            usage.attempts[0].completion_tokens
        ),
        (None, None),
        "the killed call reported nothing: {usage:?}"
    );
    assert!(usage.unreported_attempts >= 1, "{usage:?}");
    let last = usage.attempts.last().unwrap();
    assert_eq!(last.outcome.as_deref(), Some("accepted"));
    let (prompt, completion) = (last.prompt_tokens.unwrap(), last.completion_tokens.unwrap());
    assert!(prompt > 0 && completion > 0, "{usage:?}");
    assert_eq!(
        (usage.prompt_tokens, usage.completion_tokens),
        (Some(prompt), Some(completion))
    );
    let settled = tokens(&app).await;
    assert_eq!((settled.used, settled.reserved), (prompt + completion, 0));
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(
        (report.reservations_charged, report.token_charge_mismatches),
        (1, 0),
        "{report:#?}"
    );
}

/// A provider whose answers carry no usage (as some OpenAI-compatible servers do): the reply
/// shows "not reported" (null, never 0), and its charge is the request's ceiling.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_that_reports_no_usage_shows_null_and_is_charged_its_ceiling() {
    let silent = MockSettings {
        faults: replyd_lab::mock_provider::FaultSettings {
            omit_usage: true,
            ..Default::default()
        },
        ..mock()
    };
    let app = TestApp::start(1, silent, WorkerConfig::default()).await;
    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let press = front.send("press-1", "q").await;
    let view = front.wait_until_completed(&press).await;
    let usage = view.usage.expect("GET /v1/replies/{id} shows usage");
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.unreported_attempts
        ),
        (None, None, 1),
        "{usage:?}"
    );
    let shown = serde_json::to_value(&usage).unwrap();
    assert_eq!(
        shown["attempts"][0]["prompt_tokens"],
        serde_json::Value::Null
    );
    // "q": 1 byte, 8 for its message, and the default output ceiling.
    let tokens = app.db.store.quota("acme").await.unwrap().unwrap().tokens;
    assert_eq!(
        (tokens.used, tokens.reserved),
        (
            1 + 8 + replyd_core::workspace_policy::DEFAULT_OUTPUT_CEILING,
            0
        )
    );
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
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
    let mut stream = EventStream::of(response);
    let mut events = Vec::new();
    tokio::time::timeout(LIMIT, async {
        while let Some(event) = stream.next().await {
            events.push(event);
        }
    })
    .await
    .expect("the stream ends after the terminal state");
    events
}

/// An event stream read as its events arrive.
struct EventStream {
    response: reqwest::Response,
    text: String,
}

impl EventStream {
    fn of(response: reqwest::Response) -> Self {
        assert_eq!(response.status(), reqwest::StatusCode::OK);
        assert_eq!(response.headers()["content-type"], "text/event-stream");
        Self {
            response,
            text: String::new(),
        }
    }

    /// The next status event (its id and view), or None once the stream ended.
    async fn next(&mut self) -> Option<(String, ReplyView)> {
        loop {
            while let Some(end) = self.text.find("\n\n") {
                let event: String = self.text.drain(..end + 2).collect();
                if !event.lines().any(|l| l == "event: status") {
                    continue; // a keep-alive comment
                }
                let field = |name: &str| {
                    event
                        .lines()
                        .find_map(|l| l.strip_prefix(name))
                        .unwrap_or_default()
                        .to_owned()
                };
                return Some((
                    field("id: "),
                    serde_json::from_str(&field("data: ")).unwrap(),
                ));
            }
            let chunk = self.response.chunk().await.unwrap()?;
            self.text.push_str(&String::from_utf8_lossy(&chunk));
        }
    }
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

/// Every listening session slows every notifying commit of the database, so a process listens
/// only while something of it waits for a notification: the API while a stream is open, the
/// worker while a record is parked (a running call checks its lease instead,
/// `worker.lease_check_ms`); the relay always. Once nothing has needed it for
/// `database.listen_idle_ms` the session ends, and the next need starts it again without
/// losing an event. (A parked record's listening: `worker_e2e`'s listener tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_listens_only_while_something_waits_for_notifications() {
    let config = WorkerConfig {
        listen_idle_ms: 300,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(2, mock(), config).await;
    app.db.store.create_workspace("acme").await.unwrap();
    let key = issue(&mut rand::rng());
    app.db.store.create_api_key("acme", &key).await.unwrap();
    app.spawn_process("serve", "serve");
    let addr = app.wait_for_api_addr("serve", LIMIT).await;
    let front = Front {
        base: format!("http://{addr}"),
        key: key.token,
        key_id: key.key_id,
        client: reqwest::Client::new(),
        _stop: CancellationToken::new().drop_guard(),
    };
    let client = app.db.raw_client().await;
    let pid = app.pid("serve").to_string();
    let sessions = || {
        let (client, pid) = (&client, &pid);
        async move {
            let rows = client
                .query(
                    "SELECT application_name FROM pg_stat_activity \
                     WHERE application_name LIKE 'replyd-%' AND application_name LIKE '% ' || $1",
                    &[pid],
                )
                .await
                .unwrap();
            let names: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
            let has = |prefix: &str| names.iter().any(|n| n.starts_with(prefix));
            (
                has("replyd-api-listener "),
                has("replyd-listener "),
                has("replyd-relay "),
            )
        }
    };
    wait_until("the relay listens", LIMIT, || async { sessions().await.2 }).await;
    assert_eq!(
        sessions().await,
        (false, false, true),
        "with no stream open and no work, only the relay listens"
    );

    for press in ["press-1", "press-2"] {
        // A call that lasts, so both needs overlap while the stream is read.
        let accepted = front.send(press, "[mock:latency_ms=1500] q").await;
        let stream = front.events(&accepted, None).await;
        wait_until("the API listens while the call runs", LIMIT, || async {
            let running: bool = client
                .query_one(
                    "SELECT status = 'running' FROM reply_tasks WHERE task_id = $1",
                    &[&accepted.task_id.as_uuid()],
                )
                .await
                .unwrap()
                .get(0);
            running && sessions().await.0
        })
        .await;
        // Longer than a session takes to connect here: a call that listened would be seen.
        tokio::time::sleep(Duration::from_millis(400)).await;
        assert!(
            !sessions().await.1,
            "{press}: the worker does not listen for its running call"
        );
        let views = read_events(stream).await;
        assert_eq!(
            views.last().map(|v| v.status),
            Some(ReplyStatus::Completed),
            "{press}: the stream heard the end (the second press starts a new session)"
        );
        wait_until("the API and the worker stop listening", LIMIT, || async {
            sessions().await == (false, false, true)
        })
        .await;
    }
    assert!(
        app.log_lines_with("serve", &["listening for task status notifications"]) >= 2,
        "each of the two presses started the API's session"
    );
}

/// The whole chain as `replyd serve` (two partitions, the mock) and a key of workspace `acme`;
/// returns the app, the key and the API's address.
async fn serve_with_a_key() -> (TestApp, replyd_core::api_key::IssuedKey, String) {
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
        key_id: key.key_id,
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
        served == include_str!("../../docs/openapi.json"),
        "/openapi.json is not docs/openapi.json"
    );

    let dir = std::env::temp_dir().join(crate::helpers::unique("schemathesis"));
    std::fs::create_dir_all(&dir).unwrap();
    let run = tokio::process::Command::new(crate::helpers::infra("SCHEMATHESIS"))
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
        check.completed + check.failed + check.cancelled,
        "every task it made ended (some it stopped): {check:#?}"
    );
}

/// `replyd-lab browsers` (the demo's clients) against the whole chain: presses that lose their
/// first answer and retry with the same key, double clicks and regenerates. Every press ends
/// completed, both answers of a double click name one task, and the durable state has exactly
/// one task per press plus one per regenerate: no lost answer turned into a second task.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn browsers_that_lose_answers_and_double_click_make_one_task_per_press() {
    let (app, key, addr) = serve_with_a_key().await;
    let run = tokio::process::Command::new(crate::helpers::lab_bin())
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

/// How many of this test's quota reservations are in each state: (reserved, charged,
/// released, expired).
async fn reservations(app: &TestApp) -> (i64, i64, i64, i64) {
    let row = app
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT count(*) FILTER (WHERE state = 'reserved'), \
             count(*) FILTER (WHERE state = 'charged'), \
             count(*) FILTER (WHERE state = 'released'), \
             count(*) FILTER (WHERE state = 'expired') FROM quota_reservations",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1), row.get(2), row.get(3))
}

/// Runs the `replyd` binary with the test's settings, as an operator would.
fn replyd(app: &TestApp, args: &[&str]) -> std::process::Output {
    app.operator_command(args).output().unwrap()
}

/// One pass of the quota's reconciler through the binary (`replyd reconcile`).
fn reconcile(app: &TestApp) {
    let pass = replyd(app, &["reconcile"]);
    assert!(
        pass.status.success(),
        "{}",
        String::from_utf8_lossy(&pass.stderr)
    );
}

impl Front {
    async fn wait_until_status(&self, accepted: &Accepted, status: ReplyStatus) -> ReplyView {
        wait_until(&format!("the task is {status:?}"), LIMIT, || async {
            self.view(accepted).await.status == status
        })
        .await;
        self.view(accepted).await
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_renewal_is_no_event_and_a_resumed_stream_gets_only_what_it_lacks() {
    let config = WorkerConfig {
        lease_ms: 2_000,
        renew_interval_ms: 300,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, mock(), config).await;
    let front = front(&app).await;
    // A 3 s call: the lease is renewed about ten times while it runs.
    let accepted = front.send("press-1", "[mock:latency_ms=3000] q").await;
    let whole = tokio::spawn(read_events_with_ids(front.events(&accepted, None).await));
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    front
        .wait_until_status(&accepted, ReplyStatus::Running)
        .await;
    let mut mid_call = EventStream::of(front.events(&accepted, None).await);
    let (running_id, running) = mid_call.next().await.expect("the current state first");
    assert_eq!(running.status, ReplyStatus::Running);
    drop(mid_call);

    // A reconnect that has the running state gets the rest, not the same state again.
    let resumed = read_events(front.events(&accepted, Some(&running_id)).await).await;
    let statuses = |views: &[ReplyView]| views.iter().map(|v| v.status).collect::<Vec<_>>();
    assert_eq!(statuses(&resumed), [ReplyStatus::Completed], "{resumed:?}");
    let whole: Vec<ReplyView> = whole.await.unwrap().into_iter().map(|(_, v)| v).collect();
    assert_eq!(
        statuses(&whole),
        [
            ReplyStatus::Pending,
            ReplyStatus::Running,
            ReplyStatus::Completed
        ],
        "one event per state, whatever the renewals: {whole:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_opened_before_its_key_was_revoked_ends_and_its_reconnect_gets_401() {
    // No relay, no worker: the task stays pending and its stream would stay open for good.
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    let accepted = front.send("press-1", "q").await;
    let mut stream = EventStream::of(front.events(&accepted, None).await);
    let (_, pending) = stream.next().await.expect("the current state first");
    assert_eq!(pending.status, ReplyStatus::Pending);

    app.db.store.revoke_api_key(&front.key_id).await.unwrap();

    let rest = tokio::time::timeout(LIMIT, stream.next())
        .await
        .expect("the stream of a revoked key ends");
    assert!(rest.is_none(), "no state after the revocation: {rest:?}");
    let reconnect = front.events(&accepted, None).await;
    assert_eq!(reconnect.status(), reqwest::StatusCode::UNAUTHORIZED);
}

/// Three presses whose every provider answer is lost after the work (`api` chat completions or
/// background responses): the tasks fail, but the provider did the work, so the reservations
/// are held, then charged once each when nothing can tell (I8: charged = generations done).
async fn lost_answers_are_held_then_charged_once(api: &'static str) {
    let config = WorkerConfig {
        default_max_attempts: 3,
        provider_api: api,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, mock(), config).await;
    app.set_faults(json!({"drop_after_work_rate": 1.0})).await;
    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let mut presses = Vec::new();
    for i in 0..3 {
        presses.push(front.send(&format!("press-{i}"), &format!("q{i}")).await);
    }
    for press in &presses {
        let failed = front.wait_until_status(press, ReplyStatus::Failed).await;
        assert!(
            failed
                .failure
                .as_deref()
                .is_some_and(|f| f.contains("no complete answer")),
            "{failed:?}"
        );
    }
    assert_eq!(
        reservations(&app).await,
        (3, 0, 0, 0),
        "the provider may have done the work: nothing released"
    );
    let usage = app.db.store.quota("acme").await.unwrap().unwrap().usage;
    assert_eq!((usage.used, usage.reserved), (0, 3));

    // Past their TTL, with nothing that can tell, quota.charge_unresolved (true) charges them.
    crate::helpers::age_open_reservations(&app.db).await;
    reconcile(&app);
    assert_eq!(reservations(&app).await, (0, 3, 0, 0));
    let usage = app.db.store.quota("acme").await.unwrap().unwrap().usage;
    assert_eq!((usage.used, usage.reserved), (3, 0));
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.mock_generations, Some(3), "{report:#?}");
    assert_eq!(report.reservations_charged, 3, "charged = generations done");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_work_whose_answers_were_all_lost_is_held_then_charged_once() {
    lost_answers_are_held_then_charged_once("chat_completions").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn background_work_whose_answers_were_all_lost_is_held_then_charged_once() {
    lost_answers_are_held_then_charged_once("background_responses").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_generation_longer_than_the_request_timeout_completes_in_one_attempt() {
    let config = WorkerConfig {
        provider_api: "background_responses",
        request_timeout_ms: 1_000,
        default_max_attempts: 3,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, mock(), config).await;
    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    // Six times the request timeout: each poll ends in time, the wait goes on.
    let accepted = front.send("press-1", "[mock:latency_ms=6000] q").await;

    let done = front.wait_until_completed(&accepted).await;

    assert_eq!(done.attempts, 1, "waiting is not an attempt: {done:?}");
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.mock_generations, Some(1), "{report:#?}");
    assert_eq!(
        (report.reservations_charged, report.reservations_open),
        (1, 0)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_leaves_its_tasks_to_the_group_and_not_to_the_reconciler() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    // A TTL that covers a task's retries (5 × (4 s lease + 5 s backoff) here, and 1 s of
    // refusals) but not the time its record waits for redelivery is refused: it turns one crash
    // into failed replies.
    let short = app.dir_file(
        "short-ttl.toml",
        &format!(
            "{}\n[quota]\nreservation_ttl_ms = 50000\n",
            std::fs::read_to_string(app.settings_file()).unwrap()
        ),
    );
    let checked = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
        .args(["config", "check", "--config"])
        .arg(&short)
        .env("REPLYD_RETRY__REFUSAL_BUDGET_MS", "1000")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&checked.stderr);
    assert_eq!(checked.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("quota.reservation_ttl_ms") && stderr.contains("redelivery"),
        "{stderr}"
    );

    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let mut presses = Vec::new();
    for i in 0..3 {
        let press = front
            .send(
                &format!("press-{i}"),
                &format!("[mock:latency_ms=8000] q{i}"),
            )
            .await;
        presses.push(press);
    }
    for press in &presses {
        front.wait_until_status(press, ReplyStatus::Running).await;
    }
    app.kill("w1");
    let client = app.db.raw_client().await;
    crate::helpers::wait_until_sql(
        &client,
        "the killed worker's leases ran out",
        "SELECT bool_and(lease_until < clock_timestamp()) FROM reply_tasks",
        &[],
    )
    .await;
    // The reservations' TTL passes before the group has handed the records on.
    crate::helpers::age_open_reservations(&app.db).await;
    reconcile(&app);
    for press in &presses {
        let view = front.view(press).await;
        assert_ne!(view.status, ReplyStatus::Failed, "{view:?}");
    }
    assert_eq!(reservations(&app).await, (3, 0, 0, 0));

    app.spawn_worker("w2");
    for press in &presses {
        front.wait_until_completed(press).await;
    }
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!((report.tasks, report.completed), (3, 3), "{report:#?}");
    assert_eq!(report.reservations_charged, 3, "{report:#?}");
    assert_eq!(
        report.mock_generations,
        Some(3),
        "charged = generations done: {report:#?}"
    );
}

/// Sets the topic's `max.message.bytes`: records larger than `bytes` are refused by the broker.
async fn limit_record_size(app: &TestApp, bytes: usize) {
    use rdkafka::admin::{AdminClient, AdminOptions, AlterConfig, ResourceSpecifier};
    let admin: AdminClient<_> = rdkafka::ClientConfig::new()
        .set("bootstrap.servers", &app.bootstrap)
        .create()
        .unwrap();
    let limit = bytes.to_string();
    let altered = admin
        .alter_configs(
            &[AlterConfig::new(ResourceSpecifier::Topic(&app.topic))
                .set("max.message.bytes", &limit)],
            &AdminOptions::new().request_timeout(Some(Duration::from_secs(10))),
        )
        .await
        .unwrap();
    assert!(altered.iter().all(Result::is_ok), "{altered:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_the_broker_refuses_fails_its_task_and_holds_back_nothing_else() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    limit_record_size(&app, 4_000).await;
    let front = front(&app).await;
    // Two rows for one partition, in one relay batch: one the topic cannot take, one it can
    // (in another conversation: a message after the big one would carry it as history).
    let big = front.send("press-big", &"x".repeat(8_000)).await;
    let small: Accepted = front
        .client
        .post(format!("{}/v1/replies", front.base))
        .bearer_auth(&front.key)
        .header("Idempotency-Key", "press-small")
        .json(&json!({"conversation_id": "conv-2", "message": "q"}))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let stream = front.events(&big, None).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");

    front.wait_until_completed(&small).await;
    let views = read_events(stream).await;
    let last = views.last().expect("the stream told the end");
    assert_eq!(last.status, ReplyStatus::Failed, "{views:?}");
    assert!(
        last.failure.as_deref().is_some_and(|f| f
            .contains("the broker refused the task's record for good")
            && f.contains("max.message.bytes")),
        "{last:?}"
    );
    // Nothing ran for it: its reservation is released; its row is refused, not unpublished.
    assert_eq!(reservations(&app).await, (0, 1, 1, 0));
    let row = app
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT count(*) FILTER (WHERE refused_at IS NOT NULL), \
             count(*) FILTER (WHERE published_at IS NOT NULL) FROM outbox",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i64>(0), row.get::<_, i64>(1)), (1, 1));
    // The relay is ready: a refused row is not a lag.
    let addr = app.observability_addr("relay").expect("the relay's probes");
    wait_until("the relay is ready", LIMIT, || async {
        reqwest::get(format!("http://{addr}/readyz"))
            .await
            .is_ok_and(|r| r.status().is_success())
    })
    .await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.outbox_unpublished, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_tasks_retried_after_an_outage_get_one_new_reply_each_and_only_once() {
    // A provider outage: every call is a 500 until the budget is spent, so every task fails.
    // A 500 cannot say the provider did nothing, so the reservations stay held (I8).
    let config = WorkerConfig {
        default_max_attempts: 2,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(1, mock(), config).await;
    app.set_faults(json!({"error_rate": 1.0, "error_status": 500}))
        .await;
    let front = front(&app).await;
    assert!(
        app.db
            .store
            .set_quota("acme", Some(10), 86_400)
            .await
            .unwrap()
    );
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let mut presses = Vec::new();
    for i in 0..3 {
        presses.push(front.send(&format!("press-{i}"), &format!("q{i}")).await);
    }
    // And one a producer published straight to the topic (no API, no quota).
    let produced = crate::helpers::task_spec(2);
    app.produce_tasks(std::slice::from_ref(&produced), 1).await;
    for press in &presses {
        front.wait_until_status(press, ReplyStatus::Failed).await;
    }
    app.wait_until_terminal(&[produced.task_id], LIMIT).await;
    assert_eq!(reservations(&app).await, (3, 0, 0, 0));

    // The outage ends; the operator retries what failed during it.
    app.set_faults(json!({})).await;
    let retry = |args: &[&str]| {
        let mut all = vec!["tasks", "retry", "--json"];
        all.extend_from_slice(args);
        let out = replyd(&app, &all);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let dry = retry(&["--reason-contains", "500", "--dry-run"]);
    assert_eq!(
        (dry["selected"].as_u64(), dry["retried"].as_u64()),
        (Some(4), Some(4)),
        "{dry}"
    );
    let done = retry(&["--reason-contains", "500", "--max-attempts", "3"]);
    assert_eq!(done["retried"].as_u64(), Some(4), "{done}");
    let new_tasks: Vec<replyd_core::domain::TaskId> = done["tasks"]
        .as_object()
        .unwrap()
        .values()
        .map(|id| {
            replyd_core::domain::TaskId::from(id.as_str().unwrap().parse::<uuid::Uuid>().unwrap())
        })
        .collect();
    app.wait_until_terminal(&new_tasks, LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;

    // One new reply each; the failed tasks stay failed (their reservations still held, for
    // the reconciler); the new ones were admitted by the quota and charged once; nothing
    // breaks an invariant.
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(
        (report.tasks, report.completed, report.failed),
        (8, 4, 4),
        "{report:#?}"
    );
    assert_eq!(report.mock_generations, Some(4), "{report:#?}");
    assert_eq!(reservations(&app).await, (3, 3, 0, 0));
    for press in &presses {
        assert_eq!(front.view(press).await.status, ReplyStatus::Failed);
    }
    // A second run finds nothing left to retry.
    let again = retry(&["--reason-contains", "500"]);
    assert_eq!(
        (again["selected"].as_u64(), again["retried"].as_u64()),
        (Some(0), Some(0)),
        "{again}"
    );
}
