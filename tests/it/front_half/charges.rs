//! What each reply is charged: the saved reply's tokens once after a kill mid-call, the
//! ceiling when no usage is reported, and lost answers held then charged once.

use super::{LIMIT, front, mock, reconcile, reservations};
use crate::helpers::app::{TestApp, WorkerConfig};
use replyd::api::reply_view::ReplyStatus;
use replyd_lab::mock_provider::MockSettings;
use serde_json::json;

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
