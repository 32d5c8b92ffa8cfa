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
use crate::quota::{QuotaPolicy, format_period, retry_after};
use crate::store::quota::QuotaState;

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

/// The `429` of a submission the quota does not admit: when to try again (`Retry-After`, in
/// whole seconds, at least 1) and where the quota stands.
pub fn over_quota(quota: &QuotaState, policy: QuotaPolicy) -> Response {
    crate::telemetry::quota_refused();
    let wait = retry_after(
        quota.usage,
        policy,
        quota.until_reset(),
        quota.until_first_expiry(),
    );
    let seconds = super::problem::retry_after_seconds(wait);
    let usage = quota.usage;
    Problem::new(
        StatusCode::TOO_MANY_REQUESTS,
        "quota_exceeded",
        "Quota exceeded",
        format!(
            "the workspace's quota of {} generations per {} is taken ({} charged, {} reserved); capacity returns in {seconds} s at the latest (window resets at {})",
            usage.limit.unwrap_or_default(),
            format_period(quota.period_seconds.max(1) as u64),
            usage.used,
            usage.reserved,
            quota.resets_at.to_rfc3339(),
        ),
    )
    .with_retry_after(seconds)
    .into_response()
}
