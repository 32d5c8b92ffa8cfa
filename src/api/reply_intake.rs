//! A reply task's way into the intake transaction and the answer it gets: the
//! `Idempotency-Key`, the workspace policy's verdict, and the judgement of the transaction's
//! outcome (new work, a replay of the same key, the key reused with other inputs, a refusal).
//! Apart from the handlers because creating and regenerating share every step of it.

use axum::Json;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use super::problem::{Problem, ProblemKind};
use super::reply_view::Accepted;
use super::state::ApiState;
use crate::store::intake::{Submission, Submitted, provider_request};
use replyd_core::domain::{ChatMessage, TaskId, TaskStatus};
use replyd_core::idempotency::{BoundInputs, IdempotencyKey};
use replyd_core::workspace_policy::{Admitted, PolicyRefusal, WorkspacePolicy};

pub(super) fn key_of(headers: &HeaderMap) -> Result<IdempotencyKey, Problem> {
    let value = super::headers::one_value(headers, "idempotency-key").map_err(|distinct| {
        Problem::bad_request(
            ProblemKind::InvalidIdempotencyKey,
            format!(
                "the Idempotency-Key header is sent with {distinct} different values; send one key per request"
            ),
        )
    })?;
    IdempotencyKey::parse(value.map(|v| v.as_bytes()))
        .map_err(|e| Problem::bad_request(ProblemKind::InvalidIdempotencyKey, e.to_string()))
}

fn urls(task_id: TaskId) -> (String, String) {
    (
        format!("/v1/replies/{task_id}"),
        format!("/v1/replies/{task_id}/events"),
    )
}

/// The workspace's policy, read now, so an operator's change applies to the next request.
pub(super) async fn policy_of(
    state: &ApiState,
    workspace: &str,
) -> Result<WorkspacePolicy, Problem> {
    Ok(state
        .store
        .workspace_policy(workspace)
        .await
        .map_err(Problem::store_unavailable)?
        .unwrap_or_default())
}

/// The workspace policy's verdict on a request, judged on the provider request it becomes
/// ([`provider_request`] with its history: its model and output bound, the length of each
/// message it sends).
pub(super) fn judge(
    state: &ApiState,
    policy: &WorkspacePolicy,
    inputs: &BoundInputs,
    history: &[ChatMessage],
) -> Result<Admitted, PolicyRefusal> {
    let request = provider_request(inputs, history);
    let prompt_parts: Vec<usize> = request.messages.iter().map(|m| m.content.len()).collect();
    replyd_core::workspace_policy::judge(
        policy,
        request.model.as_deref(),
        &state.limits.default_model,
        request.max_output_tokens,
        &prompt_parts,
    )
}

/// Runs the intake transaction and answers: 202 with where to follow the task.
pub(super) async fn submit(state: &ApiState, submission: Submission) -> Result<Response, Problem> {
    let (task_id, replayed) = match state
        .store
        .submit(&submission)
        .await
        .map_err(Problem::store_unavailable)?
    {
        Submitted::Created { task_id } => (task_id, false),
        Submitted::Replayed { task_id } => (task_id, true),
        Submitted::OverQuota { quota } => return Ok(super::quota::over_quota(&quota, state.quota)),
        Submitted::Refused(refusal) => {
            return Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ProblemKind::OutsideWorkspacePolicy,
                "Outside the workspace's policy",
                refusal.detail,
            )
            .with_fields(refusal.fields));
        }
        Submitted::OverEndUserShare { share, ceiling } => {
            return Ok(super::quota::over_end_user_share(&share, ceiling));
        }
        Submitted::NotTheirs => {
            return Err(Problem::not_found(format!(
                "no conversation {} of this end user",
                super::echo::quoted(&submission.inputs.conversation_id)
            )));
        }
        Submitted::BadKeptReplies(bad) => {
            return Err(Problem::invalid_body(bad.to_string()).with_fields(vec!["kept_replies"]));
        }
        Submitted::Erased => {
            return Err(Problem::new(
                StatusCode::GONE,
                ProblemKind::ConversationErased,
                "Conversation erased",
                "this conversation (or its workspace) was erased; its data is gone and it takes no new messages: start a new conversation".to_owned(),
            ));
        }
        Submitted::Mismatch { fields } => {
            return Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ProblemKind::IdempotencyKeyReused,
                "Idempotency-Key reused with other inputs",
                format!(
                    "this Idempotency-Key was used for a request with other {}; make a new key for a new request",
                    fields.join(", ")
                ),
            )
            .with_fields(fields));
        }
    };
    // A replay shows the task's current status; new work is pending.
    let status = if replayed {
        state
            .store
            .read(task_id)
            .await
            .map_err(Problem::store_unavailable)?
            .map_or(TaskStatus::Pending, |t| t.status)
    } else {
        TaskStatus::Pending
    };
    crate::telemetry::submission(replayed);
    // On the request's server span (see `api::trace_request`).
    let span = tracing::Span::current();
    span.record("replyd.task_id", task_id.to_string());
    span.record("replyd.replayed", replayed);
    let (status_url, events_url) = urls(task_id);
    let mut response = (
        StatusCode::ACCEPTED,
        Json(Accepted {
            task_id,
            status: status.into(),
            status_url: status_url.clone(),
            events_url,
            replayed,
        }),
    )
        .into_response();
    let headers = response.headers_mut();
    // A URL path of ASCII characters is a valid header value.
    headers.insert(
        header::LOCATION,
        HeaderValue::from_str(&status_url).expect("an ASCII path"),
    );
    if replayed {
        headers.insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    Ok(response)
}
