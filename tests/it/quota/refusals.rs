//! The `429` of a press over the quota and when it says to come back: when the first open
//! reservation is expected to settle, after the reconciler's next pass, when the window ends,
//! or never for a limit of zero.

use std::time::Duration;

use super::{policy, start};
use crate::helpers::api::Api;
use replyd::api::reply_view::Accepted;
use replyd_core::quota::QuotaPolicy;
use reqwest::StatusCode;
use serde_json::{Value, json};

/// The `429` of a press over the quota: its `Retry-After` in seconds (None: no header) and
/// its `detail`.
async fn refusal(api: &Api, key: &str) -> (Option<u64>, String) {
    let response = api.press(key, key).await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS, "{key}");
    let retry_after = response
        .headers()
        .get("retry-after")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    let problem: Value = response.json().await.unwrap();
    assert_eq!(
        problem["type"],
        "https://replyd.dev/problems/quota_exceeded"
    );
    (retry_after, problem["detail"].as_str().unwrap().to_owned())
}

/// The window's end is reached by moving the counter's window back one period rather than by
/// waiting for a short real one: a short window could end between any two steps of a loaded
/// run, and the refusal would then be an admission, or advice to try again now.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn capacity_returns_when_the_window_ends() {
    let api = start(policy()).await;
    api.daily_quota(1).await;
    let first: Accepted = api.press("w-1", "q").await.json().await.unwrap();
    api.finish(first.task_id, true).await;

    // Charged, not held: the refusal counts down to the end of the window the counter holds.
    let (retry_after, detail) = refusal(&api, "w-2").await;
    let retry_after = retry_after.expect("a Retry-After");
    assert!((1..=86_400).contains(&retry_after), "{retry_after}");
    let said = detail
        .split_once("the window resets at ")
        .and_then(|(_, rest)| rest.split_once(", in "))
        .unwrap_or_else(|| panic!("a window end and a wait in: {detail}"));
    let quota = api.quota().await;
    let resets_at = |at: &str| chrono::DateTime::parse_from_rfc3339(at).unwrap();
    assert_eq!(
        resets_at(said.0),
        resets_at(quota["resets_at"].as_str().unwrap()),
        "{detail} / {quota}"
    );
    assert_eq!(said.1, format!("{retry_after} s"), "{detail}");

    // A day later the counter's window has ended: the same press is admitted, against an
    // empty window that holds only its own reservation.
    api.db
        .raw_client()
        .await
        .execute(
            "UPDATE quota_counters SET window_start = window_start - interval '1 day' \
             WHERE workspace_id = 'acme'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(api.press("w-2", "q2").await.status(), StatusCode::ACCEPTED);
    let quota = api.quota().await;
    assert_eq!(
        (&quota["used"], &quota["reserved"]),
        (&json!(0), &json!(1)),
        "{quota}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quota_held_by_open_reservations_says_when_the_first_is_expected_to_settle() {
    let api = start(policy()).await;
    api.daily_quota(1).await;
    let first: Accepted = api.press("first", "q").await.json().await.unwrap();

    // Nothing has settled yet: a short default, not the reservation's hour-long TTL.
    let (retry_after, detail) = refusal(&api, "no-history").await;
    assert_eq!(
        retry_after,
        Some(replyd_core::quota::DEFAULT_SETTLE_WAIT.as_secs()),
        "{detail}"
    );
    assert!(
        detail.contains("no reservation of this workspace has settled yet"),
        "{detail}"
    );

    // The first took 20 s from admission to its charge; the next has been open 5 s.
    api.finish(first.task_id, true).await;
    let client = api.db.raw_client().await;
    client
        .execute(
            "UPDATE quota_reservations SET created_at = settled_at - interval '20 s' \
             WHERE task_id = $1",
            &[&first.task_id.as_uuid()],
        )
        .await
        .unwrap();
    api.daily_quota(2).await;
    let second: Accepted = api.press("second", "q").await.json().await.unwrap();
    client
        .execute(
            "UPDATE quota_reservations SET created_at = created_at - interval '5 s' \
             WHERE task_id = $1",
            &[&second.task_id.as_uuid()],
        )
        .await
        .unwrap();
    let (retry_after, detail) = refusal(&api, "with-history").await;
    let retry_after = retry_after.expect("a Retry-After");
    assert!((1..=15).contains(&retry_after), "{retry_after}: {detail}");
    assert!(
        detail.contains("based on how long recent reservations took to settle"),
        "{detail}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_behind_a_reservation_past_its_ttl_waits_for_the_reconcilers_next_pass() {
    let api = start(QuotaPolicy {
        reservation_ttl: Duration::from_millis(1),
        ..policy()
    })
    .await;
    api.daily_quota(1).await;
    let open: Accepted = api.press("open", "q").await.json().await.unwrap();
    let client = api.db.raw_client().await;
    crate::helpers::wait_until_sql(
        &client,
        "the open reservation is past its TTL",
        "SELECT expires_at < clock_timestamp() FROM quota_reservations WHERE task_id = $1",
        &[&open.task_id.as_uuid()],
    )
    .await;
    let (retry_after, detail) = refusal(&api, "behind-it").await;
    let retry_after = retry_after.expect("a Retry-After");
    assert!(
        (1..=replyd::reconcile::INTERVAL.as_secs()).contains(&retry_after),
        "{retry_after}: {detail}"
    );
    assert!(detail.contains("the reconciler's next pass"), "{detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_limit_of_zero_is_refused_without_a_time_to_retry() {
    let api = start(policy()).await;
    api.daily_quota(0).await;
    let (retry_after, detail) = refusal(&api, "never").await;
    assert_eq!(retry_after, None, "{detail}");
    assert!(detail.contains("the limit is 0"), "{detail}");
}
