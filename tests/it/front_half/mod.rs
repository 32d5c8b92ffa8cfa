//! The whole chain from HTTP: POST /v1/replies → one transaction (message, task, key, outbox
//! row) → `replyd relay` → Kafka → `replyd worker` → the saved reply shown by GET. Real
//! processes, the real broker and PostgreSQL, the mock provider over HTTP.
//!
//! This file holds what the rooms share: the API in front of a test's app, the mock provider,
//! event streams as a client reads them, the operator's `replyd` commands and the quota's
//! reservations. The rooms: [`chain`] (a press through the chain), [`crashes`] (a relay or a
//! worker killed along it), [`charges`] (what each reply is charged), [`streams`] (the event
//! stream), [`serve`] (`replyd serve`, schemathesis and the simulated browsers) and
//! [`outages`] (a record the broker refuses, tasks retried after an outage).

mod chain;
mod charges;
mod crashes;
mod outages;
mod serve;
mod streams;

use std::time::Duration;

use crate::helpers::app::TestApp;
use crate::helpers::{api, wait_until};
use replyd::api::ApiState;
use replyd::api::reply_view::{Accepted, ReplyStatus, ReplyView};
use replyd::api::settings::ApiSettings;
use replyd_lab::mock_provider::MockSettings;
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

impl Front {
    async fn wait_until_status(&self, accepted: &Accepted, status: ReplyStatus) -> ReplyView {
        wait_until(&format!("the task is {status:?}"), LIMIT, || async {
            self.view(accepted).await.status == status
        })
        .await;
        self.view(accepted).await
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
