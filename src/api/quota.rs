//! `GET /v1/quota`: the caller's generation quota and the policy it is kept under; and the
//! `429` a submission gets when the quota does not admit it (I8).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::ApiState;
use super::auth::Workspace;
use super::problem::{Problem, ProblemDetails};
use crate::quota::{QuotaPolicy, RetryAdvice, SettleEstimate, advise_retry, format_period};
use crate::store::quota::{QuotaRefusal, QuotaState};

/// The policy every reservation follows.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct PolicyView {
    /// Whether a task that ends failed is charged.
    pub charge_failed: bool,
    /// Whether open reservations count against the limit.
    pub pending_reserves: bool,
    /// How long a reservation stays open before it is reconciled.
    pub reservation_ttl_ms: u64,
    /// What an expired reservation becomes while its task is unresolved.
    pub when_expired_unresolved: String,
}

/// A workspace's quota now.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct QuotaView {
    /// Generations per period; absent: no limit.
    pub limit: Option<i64>,
    /// Charged in the current window.
    pub used: i64,
    /// Open reservations (work admitted, not yet settled).
    pub reserved: i64,
    /// What may still be admitted now; absent: no limit.
    pub remaining: Option<i64>,
    /// The period, e.g. `1d` (windows aligned to the Unix epoch, a day from 00:00 UTC).
    pub period: String,
    pub window_start: DateTime<Utc>,
    /// When the current window ends and `used` starts again from 0.
    pub resets_at: DateTime<Utc>,
    pub policy: PolicyView,
}

fn policy_view(policy: QuotaPolicy) -> PolicyView {
    PolicyView {
        charge_failed: policy.charge_failed,
        pending_reserves: policy.pending_reserves,
        reservation_ttl_ms: policy.reservation_ttl.as_millis() as u64,
        when_expired_unresolved: "extended while the task can still complete (its lease is live or its provider operation still runs); otherwise the task is failed and the reservation expires without a charge".into(),
    }
}

pub fn view(quota: &QuotaState, policy: QuotaPolicy) -> QuotaView {
    let usage = quota.usage;
    let held = if policy.pending_reserves {
        usage.reserved
    } else {
        0
    };
    QuotaView {
        limit: usage.limit,
        used: usage.used,
        reserved: usage.reserved,
        remaining: usage.limit.map(|limit| (limit - usage.used - held).max(0)),
        period: format_period(quota.period_seconds.max(1) as u64),
        window_start: quota.window_start,
        resets_at: quota.resets_at,
        policy: policy_view(policy),
    }
}

/// Read the caller's quota: limit, used, reserved, when it resets, and the policy.
#[utoipa::path(
    get,
    path = "/v1/quota",
    operation_id = "getQuota",
    tag = "quota",
    responses(
        (status = 200, description = "The caller's quota", body = QuotaView),
        (status = 401, description = "No API key, or an unknown or revoked one", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 431, description = "The request's headers are over `api.max_header_bytes`", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 429, description = "The API key is over its request rate (`rate_limited`, `api.rate_limit_per_second`)", body = ProblemDetails, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Seconds until the key may ask again"))),
        (status = 503, description = "The database cannot be reached", body = ProblemDetails, content_type = "application/problem+json"),
    ),
    security(("api_key" = []))
)]
pub async fn show(State(state): State<ApiState>, Workspace(workspace): Workspace) -> Response {
    match state.store.quota(&workspace).await {
        Ok(Some(quota)) => Json(view(&quota, state.quota)).into_response(),
        Ok(None) => {
            Problem::not_found(format!("workspace {workspace} has no quota")).into_response()
        }
        Err(e) => Problem::unavailable(crate::telemetry::chain(&e)).into_response(),
    }
}

/// The `429` of a submission the quota does not admit: the earliest time worth trying again
/// (`Retry-After`, whole seconds, at least 1; none under a limit of 0, when no time will do)
/// and, in `detail`, where the quota stands and what that time is based on.
pub fn over_quota(refusal: &QuotaRefusal, policy: QuotaPolicy) -> Response {
    crate::telemetry::quota_refused();
    let advice = advise_retry(&refusal.facts(), policy, crate::reconcile::INTERVAL);
    let seconds = advice.after().map(super::problem::retry_after_seconds);
    let problem = Problem::new(
        StatusCode::TOO_MANY_REQUESTS,
        "quota_exceeded",
        "Quota exceeded",
        refusal_detail(&refusal.state, advice, seconds.unwrap_or_default()),
    );
    match seconds {
        Some(seconds) => problem.with_retry_after(seconds),
        None => problem,
    }
    .into_response()
}

/// The refusal's `detail`: the quota as it stands, then what the wait is based on.
fn refusal_detail(quota: &QuotaState, advice: RetryAdvice, seconds: u64) -> String {
    let usage = quota.usage;
    let period = format_period(quota.period_seconds.max(1) as u64);
    let limit = usage.limit.unwrap_or_default();
    let taken = format!(
        "the workspace's quota of {limit} generations per {period} is taken ({} charged, {} reserved)",
        usage.used, usage.reserved
    );
    let resets_at = quota.resets_at.to_rfc3339();
    match advice {
        RetryAdvice::Never => format!(
            "the workspace's quota of 0 generations per {period} admits nothing: the limit is 0, and capacity returns only when an operator raises it (`replyd quota set --limit`), so there is no time to retry at and no Retry-After"
        ),
        RetryAdvice::Now => match usage.limit {
            Some(limit) => format!(
                "the workspace's quota of {limit} generations per {period} refused this request but has room again ({} charged, {} reserved): try again",
                usage.used, usage.reserved
            ),
            None => {
                "the workspace's quota refused this request but has no limit now: try again".into()
            }
        },
        RetryAdvice::WindowEnd { .. } => format!(
            "{taken}; capacity returns when the window resets at {resets_at}, in {seconds} s"
        ),
        RetryAdvice::FirstSettlement { basis, .. } => {
            let why = match basis {
                SettleEstimate::Recent {
                    recent, oldest_age, ..
                } => format!(
                    "the first is expected to settle in about {seconds} s, based on how long recent reservations took to settle (the last {recent}; the oldest open one has been open {} s)",
                    oldest_age.as_secs()
                ),
                SettleEstimate::Default { recent: 0, .. } => format!(
                    "no reservation of this workspace has settled yet to estimate from, so try again in {seconds} s (a default wait)"
                ),
                SettleEstimate::Default { recent, oldest_age } => format!(
                    "none of the last {recent} settled reservations took as long as the oldest open one has been open ({} s), so try again in {seconds} s (a default wait)",
                    oldest_age.as_secs()
                ),
            };
            format!(
                "{taken}; open reservations hold the capacity: {why}; a settlement that is charged keeps its unit until the window resets at {resets_at}"
            )
        }
        RetryAdvice::ReconcilerPass { overdue, .. } => format!(
            "{taken}; open reservations hold the capacity, and the first passed its TTL (quota.reservation_ttl_ms) {} s ago: the reconciler's next pass (one every {} s) decides it, in {seconds} s at the latest; a settlement that is charged keeps its unit until the window resets at {resets_at}",
            overdue.as_secs(),
            crate::reconcile::INTERVAL.as_secs()
        ),
    }
}
