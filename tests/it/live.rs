//! Live replies: the text of a running attempt on the task's event stream, as the provider
//! streams it, while the saved reply stays the only truth. Real processes (relay, workers),
//! the real broker and PostgreSQL, the mock provider streaming as the real APIs do.
//!
//! What each test proves from the followers' side: the pieces of one attempt arrive once each,
//! in order, to every follower alike; a reconnect with `Last-Event-ID` misses nothing; an
//! attempt that dies, is taken over or is cut has its text withdrawn before the next
//! attempt's starts; and whatever was streamed, the task ends with one saved reply, which the
//! `completed` state carries.

use std::time::Duration;

use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{api, wait_until};
use replyd::api::ApiState;
use replyd::api::reply_view::{Accepted, ReplyView};
use replyd::api::settings::ApiSettings;
use replyd_lab::mock_provider::MockSettings;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

const LIMIT: Duration = Duration::from_secs(120);

/// One event of a stream.
#[derive(Debug, Clone)]
struct Event {
    kind: String,
    id: String,
    data: Value,
}

/// What a follower saw, event by event.
#[derive(Debug, Default, Clone)]
struct Seen {
    events: Vec<Event>,
}

impl Seen {
    fn deltas(&self) -> Vec<&Event> {
        self.events.iter().filter(|e| e.kind == "delta").collect()
    }

    /// The text of attempt `version`, its pieces in the order they came.
    fn text_of(&self, version: i64) -> String {
        self.deltas()
            .iter()
            .filter(|e| e.data["assignment_version"] == version)
            .map(|e| e.data["text"].as_str().unwrap().to_owned())
            .collect()
    }

    fn versions(&self) -> Vec<i64> {
        let mut versions: Vec<i64> = self
            .deltas()
            .iter()
            .map(|e| e.data["assignment_version"].as_i64().unwrap())
            .collect();
        versions.dedup();
        versions
    }

    fn last(&self) -> &Event {
        self.events.last().expect("at least one event")
    }

    /// Each attempt's pieces are numbered 1, 2, … with no gap and no repeat, and no piece of
    /// an attempt comes after its withdrawal.
    fn assert_pieces_in_order(&self) {
        let mut next: std::collections::HashMap<i64, i64> = Default::default();
        let mut withdrawn = std::collections::HashSet::new();
        for event in &self.events {
            let version = event.data["assignment_version"].as_i64();
            match event.kind.as_str() {
                "delta" => {
                    let version = version.unwrap();
                    assert!(
                        !withdrawn.contains(&version),
                        "a piece of withdrawn attempt {version}: {self:#?}"
                    );
                    let expected = next.entry(version).or_insert(1);
                    assert_eq!(event.data["seq"], *expected, "{self:#?}");
                    assert_eq!(event.id, format!("live-{version}-{expected}"));
                    *expected += 1;
                }
                "withdrawn" => {
                    withdrawn.insert(version.unwrap());
                }
                _ => {}
            }
        }
    }
}

/// Reads a task's event stream as it comes.
struct Follower {
    response: reqwest::Response,
    buffer: String,
    seen: Seen,
}

impl Follower {
    async fn open(front: &Front, task: &Accepted, last_event_id: Option<&str>) -> Self {
        let mut request = front
            .client
            .get(format!("{}{}", front.base, task.events_url))
            .bearer_auth(&front.key);
        if let Some(id) = last_event_id {
            request = request.header("Last-Event-ID", id);
        }
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), 200);
        Self {
            response,
            buffer: String::new(),
            seen: Seen::default(),
        }
    }

    /// The next event, or None once the stream ended.
    async fn next(&mut self) -> Option<Event> {
        loop {
            while let Some(end) = self.buffer.find("\n\n") {
                let block: String = self.buffer.drain(..end + 2).collect();
                let field = |name: &str| {
                    block
                        .lines()
                        .find_map(|l| l.strip_prefix(name))
                        .map(str::to_owned)
                };
                let (Some(kind), Some(data)) = (field("event: "), field("data: ")) else {
                    continue; // a keep-alive comment
                };
                let event = Event {
                    kind,
                    id: field("id: ").unwrap_or_default(),
                    data: serde_json::from_str(&data).unwrap(),
                };
                self.seen.events.push(event.clone());
                return Some(event);
            }
            let chunk = tokio::time::timeout(LIMIT, self.response.chunk())
                .await
                .expect("the stream says something within the limit")
                .ok()??;
            self.buffer.push_str(std::str::from_utf8(&chunk).unwrap());
        }
    }

    /// Reads until `stop` says so of an event (true) or the stream ends (false).
    async fn until(&mut self, mut stop: impl FnMut(&Event) -> bool) -> bool {
        while let Some(event) = self.next().await {
            if stop(&event) {
                return true;
            }
        }
        false
    }

    /// Reads to the end of the stream.
    async fn read_to_end(mut self) -> Seen {
        while self.next().await.is_some() {}
        self.seen
    }
}

struct Front {
    base: String,
    key: String,
    client: reqwest::Client,
    _stop: tokio_util::sync::DropGuard,
}

/// The API over the app's schema, listening for status changes and live text.
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
        client: reqwest::Client::new(),
        _stop: stop,
    }
}

impl Front {
    async fn send(&self, message: &str) -> Accepted {
        let response = api::press(
            &self.client,
            &self.base,
            &self.key,
            &uuid::Uuid::new_v4().to_string(),
            message,
        )
        .await;
        assert_eq!(response.status(), 202);
        response.json().await.unwrap()
    }

    async fn view(&self, task: &Accepted) -> ReplyView {
        self.client
            .get(format!("{}{}", self.base, task.status_url))
            .bearer_auth(&self.key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }
}

/// A provider streaming a reply of `chars` characters in pieces of 12, one every 20 ms (about
/// `chars / 600` seconds of text), after 50 ms to its first token: a fixed interval, so the
/// text lasts as long as the reply is long.
fn streaming_mock() -> MockSettings {
    MockSettings {
        latency_ms: 50,
        stream_chunk_chars: 12,
        stream_chunk_interval_ms: Some(20),
        ..MockSettings::default()
    }
}

/// A question whose answer the mock streams over `chars` characters.
fn long_question(chars: usize) -> String {
    format!("What are the key decisions in this document? [mock:reply_chars={chars}]")
}

/// The saved reply of a completed state event.
fn saved_reply(event: &Event) -> String {
    assert_eq!(event.kind, "status");
    assert_eq!(event.data["status"], "completed", "{event:#?}");
    event.data["reply"].as_str().unwrap().to_owned()
}

async fn assert_one_reply(app: &TestApp) {
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.duplicate_tasks, 0, "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_followers_see_the_same_pieces_once_each_in_order_then_the_saved_reply() {
    let app = TestApp::start(2, streaming_mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let task = front.send(&long_question(2_400)).await;
    let (a, b) = tokio::join!(
        Follower::open(&front, &task, None),
        Follower::open(&front, &task, None)
    );
    let (a, b) = tokio::join!(a.read_to_end(), b.read_to_end());
    for seen in [&a, &b] {
        seen.assert_pieces_in_order();
        assert_eq!(seen.versions().len(), 1, "one attempt: {seen:#?}");
        assert!(
            seen.deltas().len() >= 5,
            "the text came in pieces: {seen:#?}"
        );
        assert!(seen.events.iter().all(|e| e.kind != "withdrawn"));
    }
    let version = a.versions()[0];
    // Each saw every piece (the second may have joined after the first pieces: it read them).
    assert_eq!(a.text_of(version), b.text_of(version));
    let reply = saved_reply(a.last());
    assert_eq!(reply, saved_reply(b.last()));
    // The text is the saved reply as it was written: the last piece's text may not have been
    // forwarded before the reply was saved, which the completed state carries whole.
    let text = a.text_of(version);
    assert!(
        reply.starts_with(&text),
        "{text:?} is not the start of {reply:?}"
    );
    assert!(
        text.len() * 2 > reply.len(),
        "most of the reply was streamed"
    );
    assert_eq!(
        front.view(&task).await.reply.as_deref(),
        Some(reply.as_str())
    );
    // The pieces went with the task's end.
    let left: i64 = app
        .db
        .raw_client()
        .await
        .query_one("SELECT count(*) FROM reply_live_text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(left, 0);
    assert_one_reply(&app).await;
}

/// Without live text a streamed answer's text reaches no one: `provider.stream` left at
/// `"auto"` asks for whole answers then, and `true` streams all the same. Either way the
/// follower sees no piece, and the saved reply is the whole one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_live_text_the_worker_asks_for_whole_answers_unless_told_to_stream() {
    for (stream, streams) in [(None, 0), (Some(true), 1)] {
        let config = WorkerConfig {
            live_text_interval_ms: 0,
            stream,
            ..WorkerConfig::default()
        };
        let app = TestApp::start(2, streaming_mock(), config).await;
        let front = front(&app).await;
        app.spawn_relay("relay");
        app.spawn_worker("w1");
        let task = front.send(&long_question(600)).await;
        let seen = Follower::open(&front, &task, None)
            .await
            .read_to_end()
            .await;
        assert!(seen.deltas().is_empty(), "stream {stream:?}: {seen:#?}");
        let reply = saved_reply(seen.last());
        assert_eq!(reply.chars().count(), 600, "{reply:?}");
        let stats = app.mock.stats();
        assert_eq!(
            (stats.generations, stats.streams_started),
            (1, streams),
            "stream {stream:?}: one generation, streamed only when told: {stats:?}"
        );
        assert_one_reply(&app).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_follower_that_reconnects_with_last_event_id_misses_nothing_and_repeats_nothing() {
    let app = TestApp::start(2, streaming_mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let task = front.send(&long_question(3_000)).await;
    let whole = Follower::open(&front, &task, None).await;
    let mut cut = Follower::open(&front, &task, None).await;
    assert!(
        cut.until(|e| e.kind == "delta" && e.data["seq"] == 4).await,
        "four pieces before the end"
    );
    let last_id = cut.seen.last().id.clone();
    let before = cut.seen.clone();
    drop(cut);
    // Pieces are written while the follower is away.
    wait_until("three more pieces are written", LIMIT, || async {
        let written: Option<i32> = app
            .db
            .raw_client()
            .await
            .query_one(
                "SELECT max(seq) FROM reply_live_text WHERE task_id = $1",
                &[&task.task_id.as_uuid()],
            )
            .await
            .unwrap()
            .get(0);
        written.is_some_and(|n| n >= 7)
    })
    .await;
    let after = Follower::open(&front, &task, Some(&last_id))
        .await
        .read_to_end()
        .await;
    assert_eq!(
        after.events.first().map(|e| e.kind.as_str()),
        Some("delta"),
        "the running state is not sent again: {after:#?}"
    );
    assert_eq!(after.events[0].data["seq"], 5, "{after:#?}");
    let mut resumed = before.clone();
    resumed.events.extend(after.events.iter().cloned());
    resumed.assert_pieces_in_order();
    let whole = whole.read_to_end().await;
    let version = whole.versions()[0];
    assert_eq!(resumed.text_of(version), whole.text_of(version));
    assert_eq!(saved_reply(after.last()), saved_reply(whole.last()));
    assert_one_reply(&app).await;
}

/// The worker id of a running task's lease owner.
async fn holder(app: &TestApp, task: &Accepted) -> String {
    let deadline = tokio::time::Instant::now() + LIMIT;
    loop {
        let owner: Option<String> = app
            .db
            .raw_client()
            .await
            .query_opt(
                "SELECT lease_owner FROM reply_tasks WHERE task_id = $1 AND status = 'running'",
                &[&task.task_id.as_uuid()],
            )
            .await
            .unwrap()
            .and_then(|row| row.get(0));
        if let Some(owner) = owner {
            // `<worker_id>#<incarnation>`: the process is named by its worker id.
            return owner.split('#').next().unwrap_or_default().to_owned();
        }
        assert!(tokio::time::Instant::now() < deadline, "the task never ran");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Two workers with short leases, a reply of `chars` characters asked for, and a follower
/// that has read its first `pieces` pieces.
async fn two_workers_streaming(chars: usize, pieces: i64) -> (TestApp, Front, Accepted, Follower) {
    let config = WorkerConfig {
        lease_ms: 3_000,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(2, streaming_mock(), config).await;
    let front = front(&app).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    app.spawn_worker("w2");
    app.wait_until_assigned(&["w1", "w2"]).await;
    let task = front.send(&long_question(chars)).await;
    let mut follower = Follower::open(&front, &task, None).await;
    assert!(
        follower
            .until(|e| e.kind == "delta" && e.data["seq"] == pieces)
            .await
    );
    (app, front, task, follower)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_mid_stream_has_its_text_withdrawn_then_the_next_attempt_streams_and_saves_one_reply()
 {
    let (app, _front, task, follower) = two_workers_streaming(6_000, 3).await;
    let first = holder(&app, &task).await;
    app.kill(&first);
    let seen = follower.read_to_end().await;
    seen.assert_pieces_in_order();
    let versions = seen.versions();
    assert_eq!(versions.len(), 2, "two attempts streamed: {seen:#?}");
    let withdrawn: Vec<&Event> = seen
        .events
        .iter()
        .filter(|e| e.kind == "withdrawn")
        .collect();
    assert_eq!(withdrawn.len(), 1, "{seen:#?}");
    assert_eq!(withdrawn[0].data["assignment_version"], versions[0]);
    assert_eq!(withdrawn[0].data["reason"], "superseded");
    // The withdrawal comes before any piece of the next attempt.
    let withdrawal_at = seen
        .events
        .iter()
        .position(|e| e.kind == "withdrawn")
        .unwrap();
    let next_at = seen
        .events
        .iter()
        .position(|e| e.kind == "delta" && e.data["assignment_version"] == versions[1])
        .unwrap();
    assert!(withdrawal_at < next_at, "{seen:#?}");
    let reply = saved_reply(seen.last());
    assert!(reply.starts_with(&seen.text_of(versions[1])));
    // The killed attempt's stream is recorded as such.
    let (end, chars): (Option<String>, Option<i32>) = {
        let row = app
            .db
            .raw_client()
            .await
            .query_one(
                "SELECT stream_end, streamed_chars FROM reply_attempts \
                 WHERE task_id = $1 AND assignment_version = $2",
                &[&task.task_id.as_uuid(), &versions[0]],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    // A SIGKILL leaves nothing to record: its attempt is known by its lease's end.
    assert_eq!((end, chars), (None, None));
    assert_one_reply(&app).await;
    let report = app.check().await;
    assert_eq!(report.completed, 1, "{report:#?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_zombie_whose_stream_resumes_after_a_takeover_reaches_no_follower_and_its_reply_is_refused()
 {
    let (app, _front, task, mut follower) = two_workers_streaming(9_000, 2).await;
    let zombie = holder(&app, &task).await;
    app.stop(&zombie);
    // Past its lease, another worker takes the task over and streams its own text.
    let taken_over = follower.until(|e| e.kind == "withdrawn").await;
    assert!(taken_over, "the stalled attempt's text was withdrawn");
    assert!(follower.until(|e| e.kind == "delta").await);
    // The zombie wakes with its provider stream still open, and writes on.
    app.resume(&zombie);
    let seen = follower.read_to_end().await;
    // No piece of the zombie's attempt after its withdrawal (its rejoining the group may move
    // the partition again, and a third attempt stream after the second is withdrawn).
    seen.assert_pieces_in_order();
    let versions = seen.versions();
    assert!(versions.len() >= 2, "{seen:#?}");
    let reply = saved_reply(seen.last());
    assert!(reply.starts_with(&seen.text_of(*versions.last().unwrap())));
    // The zombie learned its attempt was over from the database, whichever way came first:
    // a piece refused, a renewal refused, its release refused (its partition revoked as it
    // woke), or its reply refused by the fence (taken over, or already saved by the taker).
    wait_until("the zombie's writes are refused", LIMIT, || async {
        let refused = |metric: &'static str| app.metric_total(&zombie, metric);
        let mut total = refused("replyd_live_text_pieces_total{outcome=\"fenced\"}").await
            + refused("replyd_lease_renewals_refused_total").await;
        for outcome in [
            "fenced_taken_over",
            "fenced_lease_expired",
            "already_saved",
            "not_found",
        ] {
            let metric = format!("replyd_completions_total{{outcome=\"{outcome}\"}}");
            total += app.metric_total(&zombie, &metric).await;
        }
        total > 0.0
    })
    .await;
    assert_one_reply(&app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_cut_mid_stream_is_an_ambiguous_call_whose_text_is_withdrawn_and_recorded() {
    let app = TestApp::start(2, streaming_mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    app.set_faults(json!({"stream_cut_rate": 1.0, "stream_fault_after_chunks": 20}))
        .await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let task = front.send(&long_question(2_400)).await;
    let mut follower = Follower::open(&front, &task, None).await;
    assert!(follower.until(|e| e.kind == "withdrawn").await);
    app.set_faults(json!({})).await;
    let seen = follower.read_to_end().await;
    seen.assert_pieces_in_order();
    let withdrawn = seen.events.iter().find(|e| e.kind == "withdrawn").unwrap();
    // Given back for a retry; or, read only once the retry ran, superseded by it.
    let reason = withdrawn.data["reason"].as_str().unwrap();
    assert!(["retrying", "superseded"].contains(&reason), "{seen:#?}");
    let reply = saved_reply(seen.last());
    let versions = seen.versions();
    assert!(versions.len() >= 2, "{seen:#?}");
    assert!(reply.starts_with(&seen.text_of(*versions.last().unwrap())));
    // The cut attempt: ambiguous, its stream cut with what it had, its usage not reported
    // (chat completions report usage only in their last chunk).
    let row = app
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT outcome, stream_end, streamed_chars, prompt_tokens, completion_tokens \
             FROM reply_attempts WHERE task_id = $1 ORDER BY attempt_no LIMIT 1",
            &[&task.task_id.as_uuid()],
        )
        .await
        .unwrap();
    let outcome: Option<String> = row.get(0);
    let end: Option<String> = row.get(1);
    let chars: Option<i32> = row.get(2);
    let usage: (Option<i64>, Option<i64>) = (row.get(3), row.get(4));
    assert_eq!(outcome.as_deref(), Some("ambiguous"));
    assert_eq!(end.as_deref(), Some("cut"));
    assert_eq!(chars, Some(20 * 12));
    assert_eq!(usage, (None, None), "not reported, never 0");
    // And so the API shows it.
    let usage = front.view(&task).await.usage.expect("a read shows usage");
    let first = &usage.attempts[0];
    assert_eq!(
        (
            first.stream_end.as_deref(),
            first.streamed_chars,
            first.prompt_tokens
        ),
        (Some("cut"), Some(20 * 12), None)
    );
    assert!(usage.unreported_attempts >= 1);
    assert_one_reply(&app).await;
}

/// A reply stopped after its followers were shown text is work the provider bills: its
/// reservation is charged, a generation and, in tokens, the prompt's bound and at least the
/// text shown. With a quota of 2 a day, two stopped replies use it up, where before four long
/// replies, each followed to 2,400 characters and then stopped, were all admitted and all
/// released.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reply_stopped_after_its_text_was_shown_is_charged_and_counts_against_the_quota() {
    let app = TestApp::start(2, streaming_mock(), WorkerConfig::default()).await;
    let front = front(&app).await;
    assert!(
        app.db
            .store
            .set_quota("acme", Some(2), 86_400)
            .await
            .unwrap()
    );
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    for _ in 0..2 {
        let task = front.send(&long_question(20_000)).await;
        let mut follower = Follower::open(&front, &task, None).await;
        let mut shown = 0;
        assert!(
            follower
                .until(|e| {
                    if e.kind == "delta" {
                        shown += e.data["text"].as_str().unwrap().len();
                    }
                    shown >= 600
                })
                .await,
            "the follower is shown text"
        );
        let stop = front
            .client
            .post(format!("{}/v1/replies/{}/cancel", front.base, task.task_id))
            .bearer_auth(&front.key)
            .send()
            .await
            .unwrap();
        assert_eq!(stop.status(), 200);
        let row = app
            .db
            .raw_client()
            .await
            .query_one(
                "SELECT state, tokens_charged, token_ceiling FROM quota_reservations \
                 WHERE task_id = $1",
                &[&task.task_id.as_uuid()],
            )
            .await
            .unwrap();
        let (state, charged, ceiling): (String, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let prompt = ceiling - replyd_core::workspace_policy::DEFAULT_OUTPUT_CEILING;
        assert_eq!(state, "charged");
        assert!(
            charged >= prompt + shown as i64 && charged <= ceiling,
            "charged {charged} for a prompt of {prompt} and {shown} bytes shown (ceiling {ceiling})"
        );
    }
    let refused = api::press(
        &front.client,
        &front.base,
        &front.key,
        "the third press",
        &long_question(20_000),
    )
    .await;
    assert_eq!(refused.status(), 429);
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("quota_exceeded"),
        "{problem}"
    );
    assert_one_reply(&app).await;
}
