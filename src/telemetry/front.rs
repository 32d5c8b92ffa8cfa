//! Events of the front half: the API's answers and submissions, the outbox relay, the
//! housekeeping purges and the quota's refusals and reconciliation.

use std::time::Duration;

use metrics::{counter, gauge, histogram};

use super::catalogue::names::*;
use super::lines::{once_a_minute, shape_of};

/// An API request answered with a problem; `kind` is the problem's type, `status` its HTTP
/// status. Both are labels: one status covers several kinds (`rate_limited` and
/// `quota_exceeded` are both 429), and a dashboard tells the caller's mistakes (4xx) from the
/// service's own failures (5xx) by the status alone.
pub fn api_refused(kind: &'static str, status: u16) {
    tracing::debug!(kind, status, "API request refused");
    counter!(API_REFUSALS, "kind" => kind, "status" => status.to_string()).increment(1);
}

/// An API request answered: how long until its response's head was ready (for an event
/// stream, until the stream started), by `route`, the template of the route that took it
/// (`/v1/replies/{task_id}`, never the path as sent, so a label per task cannot happen),
/// `method` and `status`.
pub fn http_request(route: &str, method: &'static str, status: u16, took: Duration) {
    histogram!(
        HTTP_REQUEST_SECONDS,
        "route" => route.to_owned(),
        "method" => method,
        "status" => status.to_string()
    )
    .record(took.as_secs_f64());
}

/// A submission accepted: new work, or a replay of an earlier request with the same key.
pub fn submission(replayed: bool) {
    counter!(SUBMISSIONS, "replayed" => if replayed { "true" } else { "false" }).increment(1);
}

/// A cancel and what it did (`cancelled`, `already_completed`, ...).
pub fn cancel(outcome: &'static str) {
    counter!(CANCELS, "outcome" => outcome).increment(1);
}

/// A new message's history composed: `turns` messages sent before it, `dropped` earlier
/// messages left out by the budget (`api.history_max_tokens`), counted so an operator sees how
/// often conversations outgrow it.
pub fn history(turns: usize, dropped: usize) {
    if dropped > 0 {
        tracing::debug!(
            turns,
            dropped,
            "history over its budget: oldest messages left out"
        );
    }
    counter!(HISTORY_DROPPED).increment(dropped as u64);
}

/// A token issued for an end user (never the token itself).
pub fn end_user_token() {
    counter!(END_USER_TOKENS).increment(1);
}

/// A workspace's signing secret that does not open under `api.end_user_token_key` (the key
/// changed, or the row was tampered with): its tokens are refused until a rotation replaces it.
pub fn signing_key_unopened(workspace: &str, error: &dyn std::error::Error) {
    tracing::warn!(
        workspace,
        error = %error,
        "an end-user token signing secret does not open under api.end_user_token_key; run `replyd end-user-tokens rotate` for the workspace"
    );
}

pub fn outbox_published(rows: usize) {
    if rows > 0 {
        tracing::debug!(rows, "outbox rows published");
    }
    counter!(OUTBOX_PUBLISHED).increment(rows as u64);
}

pub fn outbox_publish_failed(outbox_id: i64, error: &str) {
    if once_a_minute(&format!("outbox:{}", shape_of(error))) {
        tracing::warn!(
            outbox_id,
            error,
            "publishing an outbox row failed; it stays for the next batch (repeats are held back for a minute)"
        );
    }
    counter!(OUTBOX_PUBLISH_ERRORS).increment(1);
}

/// A record the broker will never take: its outbox row is refused and its task failed.
pub fn outbox_refused(outbox_id: i64, task_id: &str, reason: &str) {
    tracing::error!(
        outbox_id,
        task_id,
        reason,
        "the broker refused an outbox row's record for good; its task fails with the reason"
    );
    counter!(OUTBOX_REFUSED).increment(1);
}

pub fn outbox_purged(rows: u64) {
    counter!(OUTBOX_PURGED).increment(rows);
}

/// One decision of the quota's reconciler (`decision`: `ExpiredDecision::label`).
pub fn quota_reconciled(decision: &'static str) {
    counter!(QUOTA_RECONCILED, "decision" => decision).increment(1);
}

/// A submission the quota did not admit.
pub fn quota_refused() {
    counter!(QUOTA_REFUSED).increment(1);
}

pub fn idempotency_keys_purged(rows: u64) {
    counter!(IDEMPOTENCY_KEYS_PURGED).increment(rows);
}

/// Tasks deleted and remembered as forgotten (`reason`: `retention` or `erasure`).
pub fn tasks_forgotten(reason: &'static str, tasks: u64) {
    counter!(TASKS_FORGOTTEN, "reason" => reason).increment(tasks);
}

/// Forgotten ids (and erased scopes) let go past `retention.forgotten_ms`.
pub fn forgotten_purged(rows: u64) {
    counter!(FORGOTTEN_PURGED).increment(rows);
}

pub fn outbox_lag(unpublished: i64, oldest_seconds: f64) {
    gauge!(OUTBOX_UNPUBLISHED).set(unpublished as f64);
    gauge!(OUTBOX_OLDEST_SECONDS).set(oldest_seconds);
}

/// Open reservations past their TTL after a reconciler pass.
pub fn reservations_overdue(count: i64) {
    gauge!(QUOTA_OVERDUE).set(count as f64);
}
