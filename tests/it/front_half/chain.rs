//! A press through the whole chain: its reply is shown, and a background generation longer
//! than the request timeout completes in one attempt.

use super::{LIMIT, front, mock};
use crate::helpers::app::{TestApp, WorkerConfig};

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
