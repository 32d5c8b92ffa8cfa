//! Stop: `POST /v1/replies/{id}/cancel` before the claim (no call is ever made, nothing is
//! charged), during the call (the provider sees the call cut short, nothing is saved, and the
//! call that may have run is charged: a generation, and its prompt's tokens), after the
//! reply was saved (nothing changes, and the answer says so), and again (the same answer).
//! Real worker and relay processes, the real broker and PostgreSQL, the mock provider over
//! HTTP; `replyd check` holds after each.

use std::collections::BTreeMap;
use std::time::Duration;

use replyd::api::reply_view::{Accepted, ReplyStatus, ReplyView};
use replyd_lab::mock_provider::MockSettings;
use serde_json::Value;

use crate::helpers::api::{self, Front};
use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{provider, wait_until};

const LIMIT: Duration = Duration::from_secs(120);

/// A slow reply: the mock holds this prompt's call for 16 s, and its first token (when the
/// mock counts the generation) comes 4 s in, well after a cancel has cut the call short.
const SLOW: &str = "[mock:latency_ms=16000] take your time";

fn mock() -> MockSettings {
    MockSettings {
        latency_ms: 20,
        ..MockSettings::default()
    }
}

/// The task's reservation state and its attempts' outcomes, from the tables.
async fn ledger(app: &TestApp, accepted: &Accepted) -> (String, BTreeMap<String, i64>) {
    let client = app.db.raw_client().await;
    let id = accepted.task_id.as_uuid();
    let state: String = client
        .query_one(
            "SELECT state FROM quota_reservations WHERE task_id = $1",
            &[&id],
        )
        .await
        .unwrap()
        .get(0);
    let outcomes = client
        .query(
            "SELECT coalesce(outcome, 'open'), count(*) FROM reply_attempts WHERE task_id = $1 \
             GROUP BY 1",
            &[&id],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    (state, outcomes)
}

/// A cancel that must be answered `200` with the task cancelled.
async fn cancelled(front: &Front, accepted: &Accepted) -> ReplyView {
    let response = front.cancel("acme", &accepted.task_id.to_string()).await;
    assert_eq!(response.status(), 200);
    let view: ReplyView = response.json().await.unwrap();
    assert_eq!(view.status, ReplyStatus::Cancelled);
    assert_eq!(
        (view.reply.as_deref(), view.failure.as_deref()),
        (None, None)
    );
    view
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cancelled_before_its_claim_makes_no_call_and_its_record_is_done() {
    let app = TestApp::start(2, mock(), WorkerConfig::default()).await;
    let front = api::front(&app.db.store, &["acme", "globex"]).await;
    let stopped = front.send("acme", "c1", "never mind").await;
    let first = cancelled(&front, &stopped).await;
    // Again: the same answer, nothing changed.
    let again = cancelled(&front, &stopped).await;
    assert_eq!(first, again);
    assert_eq!(
        ledger(&app, &stopped).await,
        ("released".to_owned(), BTreeMap::new())
    );

    // Only the caller's workspace sees it; a bad id names itself.
    let other = front.cancel("globex", &stopped.task_id.to_string()).await;
    assert_eq!(other.status(), 404);
    let bad = front.cancel("acme", "not-a-task").await;
    assert_eq!(bad.status(), 400);

    // Its record still goes through Kafka: the worker finds it cancelled and calls nobody.
    let answered = front.send("acme", "c1", "and this one?").await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    front
        .wait_until("acme", &answered, ReplyStatus::Completed)
        .await;
    app.wait_until_committed_to_end(LIMIT).await;
    assert_eq!(provider::stats(&app.mock).await.requests, 1);
    assert_eq!(
        front.view("acme", &stopped).await.status,
        ReplyStatus::Cancelled
    );
    // The event stream of a cancelled task ends with its status.
    let events = front
        .client
        .get(format!("{}{}", front.base, stopped.events_url))
        .bearer_auth(&front.keys["acme"])
        .send()
        .await
        .unwrap();
    let body = tokio::time::timeout(LIMIT, events.text())
        .await
        .expect("the stream of a cancelled task ends")
        .unwrap();
    assert!(body.contains("\"status\":\"cancelled\""), "{body}");

    let report = app.check().await;
    assert!(report.violations.is_empty(), "{report:?}");
    assert_eq!((report.cancelled, report.completed), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_cancelled_during_its_call_cuts_the_call_short_saves_nothing_and_is_charged() {
    // Renewals far apart: the call (16 s) would end before the first one (20 s), so a call the
    // provider sees cut short was cut by the cancel's notification, not by a renewal.
    let config = WorkerConfig {
        lease_ms: 60_000,
        renew_interval_ms: 20_000,
        ..WorkerConfig::default()
    };
    let app = TestApp::start(2, mock(), config).await;
    let front = api::front(&app.db.store, &["acme"]).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let running = front.send("acme", "c1", SLOW).await;
    front
        .wait_until("acme", &running, ReplyStatus::Running)
        .await;
    wait_until("the mock holds the call", LIMIT, || async {
        provider::stats(&app.mock).await.in_flight == 1
    })
    .await;
    cancelled(&front, &running).await;
    wait_until("the mock sees the call cut short", LIMIT, || async {
        provider::stats(&app.mock).await.cancelled == 1
    })
    .await;
    app.wait_until_committed_to_end(LIMIT).await;

    let stats = provider::stats(&app.mock).await;
    assert_eq!((stats.requests, stats.generations), (1, 0), "{stats:?}");
    let view = front.view("acme", &running).await;
    assert_eq!(view.status, ReplyStatus::Cancelled);
    assert_eq!(view.reply, None);
    // The provider had the request: a call that may have run is charged (I8), in tokens its
    // prompt's bound, no text having been shown (the reply is not saved, so nothing else).
    assert_eq!(
        ledger(&app, &running).await,
        (
            "charged".to_owned(),
            BTreeMap::from([("cancelled".to_owned(), 1)])
        )
    );
    let tokens = app
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT tokens_charged, token_ceiling FROM quota_reservations WHERE task_id = $1",
            &[&running.task_id.as_uuid()],
        )
        .await
        .unwrap();
    let (charged, ceiling): (i64, i64) = (tokens.get(0), tokens.get(1));
    assert_eq!(
        charged,
        replyd_core::quota::stop_tokens(
            ceiling,
            replyd_core::workspace_policy::DEFAULT_OUTPUT_CEILING,
            0,
            0
        ),
        "the prompt's bound"
    );
    let quota: Value = front
        .client
        .get(format!("{}/v1/quota", front.base))
        .bearer_auth(&front.keys["acme"])
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        (&quota["used"], &quota["reserved"]),
        (&1.into(), &0.into()),
        "{quota}"
    );
    // Its streamed answer is recorded as cancelled, its usage as not reported (never 0).
    let attempt = app
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT stream_end, prompt_tokens FROM reply_attempts WHERE task_id = $1",
            &[&running.task_id.as_uuid()],
        )
        .await
        .unwrap();
    assert_eq!(
        (
            attempt.get::<_, Option<String>>(0).as_deref(),
            attempt.get::<_, Option<i64>>(1)
        ),
        (Some("cancelled"), None)
    );
    // The worker's record ended on the cancelled task.
    assert_eq!(
        app.metric("w1", "replyd_claims_total{outcome=\"already_cancelled\"}")
            .await,
        Some(1.0),
        "{}",
        app.log_of("w1")
    );
    let report = app.check().await;
    assert!(report.violations.is_empty(), "{report:?}");
    assert_eq!(report.cancelled, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_after_the_reply_was_saved_changes_nothing_and_says_so() {
    let app = TestApp::start(2, mock(), WorkerConfig::default()).await;
    let front = api::front(&app.db.store, &["acme"]).await;
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let answered = front.send("acme", "c1", "quick one").await;
    front
        .wait_until("acme", &answered, ReplyStatus::Completed)
        .await;
    let before = front.view("acme", &answered).await;
    let late = front.cancel("acme", &answered.task_id.to_string()).await;
    assert_eq!(late.status(), 409);
    assert_eq!(late.headers()["content-type"], "application/problem+json");
    let problem: Value = late.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/task_finished"),
        "{problem}"
    );
    assert!(
        problem["detail"].as_str().unwrap().contains("reply saved"),
        "{problem}"
    );
    let after = front.view("acme", &answered).await;
    assert_eq!(before, after);
    assert_eq!(ledger(&app, &answered).await.0, "charged");
    let report = app.check().await;
    assert!(report.violations.is_empty(), "{report:?}");
    assert_eq!((report.cancelled, report.completed), (0, 1));
}
