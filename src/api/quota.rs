//! `GET /v1/quota`: the caller's generation quota and the policy it is kept under; and the
//! `429` a submission gets when the quota does not admit it (I8).

use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::auth::Workspace;
use super::problem::{Problem, ProblemKind};
use super::state::ApiState;
use crate::store::quota::{EndUserShare, QuotaRefusal, QuotaState};
use replyd_core::quota::{
    Limited, QuotaPolicy, RetryAdvice, SettleEstimate, Usage, advise_retry, format_period,
};
use replyd_core::workspace_policy::WorkspacePolicy;

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
    /// The same quota in tokens, in the same window.
    pub tokens: TokenQuotaView,
    /// What this workspace's requests may ask for.
    pub workspace_policy: WorkspacePolicyView,
    /// The share of each limit (generations and tokens) no one end user may pass in a window,
    /// in percent; absent: none. Counted over what was admitted for the user's tokens in the
    /// window and not released.
    pub end_user_share_percent: Option<i16>,
}

/// A workspace's quota in tokens. A reservation holds its request's ceiling (its prompt's
/// bytes, 8 tokens a message, and its output bound) and is settled to the usage its reply
/// reported (the ceiling when none was reported).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct TokenQuotaView {
    /// Tokens per period; absent: no limit.
    pub limit: Option<i64>,
    /// Charged in the current window.
    pub used: i64,
    /// Held by open reservations.
    pub reserved: i64,
    /// What may still be reserved now; absent: no limit.
    pub remaining: Option<i64>,
}

/// What a workspace's requests may ask for (`replyd workspace policy`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct WorkspacePolicyView {
    /// The models a request may name (an absent `model` is judged as the default); absent: any.
    pub allowed_models: Option<Vec<String>>,
    /// The most output tokens a request may ask for, and what one that names none asks for;
    /// absent: no cap.
    pub max_output_tokens: Option<u32>,
    /// The system prompt every new task of the workspace is asked with, fixed when the task is
    /// made (after the request's `context`, before the conversation's history); absent: none.
    pub system_prompt: Option<String>,
    /// Whether end users' tokens may send `context`.
    pub end_user_context: super::prompt_policy::EndUserContextView,
}

fn policy_view(policy: QuotaPolicy) -> PolicyView {
    PolicyView {
        charge_failed: policy.charge_failed,
        pending_reserves: policy.pending_reserves,
        reservation_ttl_ms: policy.reservation_ttl.as_millis() as u64,
        when_expired_unresolved: "extended while the task can still complete (its lease is live or its provider operation still runs); otherwise the task is failed and the reservation expires without a charge".into(),
    }
}

pub fn view(quota: &QuotaState, policy: QuotaPolicy, workspace: &WorkspacePolicy) -> QuotaView {
    let usage = quota.usage;
    let held = |usage: Usage| {
        if policy.pending_reserves {
            usage.reserved
        } else {
            0
        }
    };
    let tokens = quota.tokens;
    QuotaView {
        limit: usage.limit,
        used: usage.used,
        reserved: usage.reserved,
        remaining: usage
            .limit
            .map(|limit| (limit - usage.used - held(usage)).max(0)),
        period: format_period(quota.period_seconds.max(1) as u64),
        window_start: quota.window_start,
        resets_at: quota.resets_at,
        policy: policy_view(policy),
        tokens: TokenQuotaView {
            limit: tokens.limit,
            used: tokens.used,
            reserved: tokens.reserved,
            remaining: tokens
                .limit
                .map(|limit| (limit - tokens.used - held(tokens)).max(0)),
        },
        workspace_policy: WorkspacePolicyView {
            allowed_models: workspace.allowed_models.clone(),
            max_output_tokens: workspace.max_output_tokens,
            system_prompt: workspace.system_prompt.clone(),
            end_user_context: workspace.end_user_context.into(),
        },
        end_user_share_percent: quota.end_user_share_percent,
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
        (status = 403, description = "An end user's token: the quota is read with the workspace's key (`forbidden`)"),
    ),
    security(("api_key" = []))
)]
pub async fn show(State(state): State<ApiState>, Workspace(workspace): Workspace) -> Response {
    let read = async {
        futures_util::try_join!(
            state.store.quota(&workspace),
            state.store.workspace_policy(&workspace)
        )
    };
    match read.await {
        Ok((Some(quota), rules)) => {
            Json(view(&quota, state.quota, &rules.unwrap_or_default())).into_response()
        }
        Ok((None, _)) => {
            Problem::not_found(format!("workspace {workspace} has no quota")).into_response()
        }
        Err(e) => Problem::store_unavailable(e).into_response(),
    }
}

/// The `429` of a submission the quota does not admit: the earliest time worth trying again
/// (`Retry-After`, whole seconds, at least 1; none under a limit of 0, when no time will do)
/// and, in `detail`, where the quota stands and what that time is based on.
pub fn over_quota(refusal: &QuotaRefusal, policy: QuotaPolicy) -> Response {
    let advice = advise_retry(&refusal.facts(policy), policy, crate::reconcile::INTERVAL);
    let seconds = advice.after().map(super::problem::retry_after_seconds);
    let problem = refused(refusal_detail(
        &refusal.state,
        refusal.limited_by(policy),
        advice,
        seconds.unwrap_or_default(),
    ));
    match seconds {
        Some(seconds) => problem.with_retry_after(seconds),
        None => problem,
    }
    .into_response()
}

/// The `429` of a request over its end user's share of the workspace's quota: the share
/// frees only as the window ends (a reservation released sooner frees it sooner, but no
/// estimate of that is offered), so `Retry-After` is the window's end.
pub fn over_end_user_share(share: &EndUserShare, ceiling: i64) -> Response {
    let seconds = super::problem::retry_after_seconds(
        (share.resets_at - share.now).to_std().unwrap_or_default(),
    );
    let shown = |limit: Option<i64>, unit: &str| {
        limit.map_or_else(|| format!("no limit of {unit}"), |l| format!("{l} {unit}"))
    };
    let detail = format!(
        "this end user's share of the workspace's quota ({} % of each limit: {} and {} per window) is taken: {} generations and {} tokens admitted in this window, and this request may cost up to {ceiling} tokens; the window ends at {} (in {seconds} s)",
        share.percent,
        shown(share.generation_limit, "generations"),
        shown(share.token_limit, "tokens"),
        share.generations,
        share.tokens,
        share.resets_at.to_rfc3339(),
    );
    refused(detail).with_retry_after(seconds).into_response()
}

/// The `429 quota_exceeded` of new work the quota refuses, counted as a refusal.
fn refused(detail: String) -> Problem {
    crate::telemetry::quota_refused();
    Problem::new(
        StatusCode::TOO_MANY_REQUESTS,
        ProblemKind::QuotaExceeded,
        "Quota exceeded",
        detail,
    )
}

/// The refusal's `detail`: the quota as it stands, then what the wait is based on.
fn refusal_detail(
    quota: &QuotaState,
    limited: Limited,
    advice: RetryAdvice,
    seconds: u64,
) -> String {
    let period = format_period(quota.period_seconds.max(1) as u64);
    if let Limited::Tokens { asked } = limited {
        return token_refusal_detail(quota, asked, &period, advice, seconds);
    }
    let usage = quota.usage;
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

/// The refusal's `detail` when the token limit refused: the request's ceiling against what the
/// window has left, then what the wait is based on.
fn token_refusal_detail(
    quota: &QuotaState,
    asked: i64,
    period: &str,
    advice: RetryAdvice,
    seconds: u64,
) -> String {
    let tokens = quota.tokens;
    let limit = tokens.limit.unwrap_or_default();
    let taken = format!(
        "this request may cost up to {asked} tokens, and the workspace's quota of {limit} tokens per {period} has no room for it ({} charged, {} held by open reservations)",
        tokens.used, tokens.reserved
    );
    let resets_at = quota.resets_at.to_rfc3339();
    match advice {
        RetryAdvice::Never => format!(
            "{taken}; no window admits it (an operator can raise the limit: `replyd quota set --tokens`), so there is no Retry-After"
        ),
        RetryAdvice::Now => {
            format!("{taken} at the moment of the refusal, but has room again: try again")
        }
        RetryAdvice::WindowEnd { .. } => format!(
            "{taken}; capacity returns when the window resets at {resets_at}, in {seconds} s"
        ),
        RetryAdvice::FirstSettlement { .. } | RetryAdvice::ReconcilerPass { .. } => format!(
            "{taken}; open reservations hold the tokens, and each returns what its reply did not use when it settles: try again in {seconds} s"
        ),
    }
}
