//! `POST /v1/replies` (a new message and its reply task, idempotent by `Idempotency-Key`) and
//! `GET /v1/replies/{task_id}` (its state, scoped to the caller's workspace).
//!
//! Keeps I6: the same key with the same inputs returns the existing task (`Idempotent-Replayed:
//! true`), never a second message, task or outbox row, also when two first requests race; the
//! same key with other inputs is a `422` naming the fields. Bad input is a `4xx` and writes
//! nothing.
//!
//! The handlers are here; the rooms they use are beside them: [`super::reply_input`] (the body
//! and its checks), `reply_history` (the turns a reply is asked with), `reply_intake` (the
//! key, the policy's verdict and the intake's answer) and [`super::reply_view`] (what the API
//! shows of a task).

use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};

use super::auth::Caller;
use super::path::PathParam;
use super::problem::{Problem, ProblemKind};
use super::reply_history::{history_of, regenerate_inputs};
use super::reply_input::{check_record_size, parse_body};
use super::reply_intake::{judge, key_of, policy_of, submit};
use super::state::ApiState;
use crate::store::cancels::CancelOutcome;
use crate::store::intake::Submission;
use replyd_core::domain::{Role, StoredTask, TaskId};
use replyd_core::history::drop_oldest_turn;
use replyd_core::idempotency::{BoundInputs, Operation};
use replyd_core::prompt_policy::system_turns;

// The OpenAPI document names the request and response types by this module's path, beside
// the handlers that take and answer them.
pub use super::reply_input::CreateReply;
pub use super::reply_view::{Accepted, AttemptUsageView, ReplyStatus, ReplyView, UsageView};

/// The `Idempotency-Key` request header, as the API documents it.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Header)]
#[allow(dead_code)] // read from the header map; this type only documents it
pub(super) struct IdempotencyKeyHeader {
    /// Made by the client once per press of Send and reused for every retry of that press.
    #[param(
        rename = "Idempotency-Key",
        min_length = 1,
        max_length = 255,
        pattern = r"^[\x20-\x7E]*[\x21-\x7E][\x20-\x7E]*$"
    )]
    idempotency_key: String,
}

/// The `{task_id}` path segment.
#[derive(utoipa::IntoParams)]
#[into_params(parameter_in = Path)]
#[allow(dead_code)] // parsed by `task_of`, which names a bad id; this type only documents it
pub(super) struct TaskIdPath {
    /// The task's id, as `POST /v1/replies` answered it.
    task_id: uuid::Uuid,
}

// The refusals of `task_of`, which every route that names a task answers. Each doc comment is
// the answer's description.

/// The task id is not a UUID
#[derive(utoipa::IntoResponses)]
#[response(status = 400)]
#[allow(dead_code)] // documents the answer; `task_of` gives it as a `Problem`
pub(super) struct BadTaskId;

/// No such task in the caller's workspace (for an end user's token, in its user's conversations)
#[derive(utoipa::IntoResponses)]
#[response(status = 404)]
#[allow(dead_code)] // documents the answer; `task_of` gives it as a `Problem`
pub(super) struct UnknownTask;

/// The refusals of a route that asks for new work (`submit`): its quota's `429` and a `503`
/// after which the same key may be sent again. Their long descriptions are given as
/// `description`: a doc comment's line breaks would be kept in them.
#[derive(utoipa::IntoResponses)]
#[allow(dead_code)] // documents the answers; the handlers give them as a `Problem`
pub(super) enum NewWorkRefusals {
    #[response(
        status = 429,
        description = "New work over the workspace's quota of generations or of tokens, or, with an end user's token, over the user's share of it (`end_user_share_percent`; `Retry-After` the window's end) (`quota_exceeded`; a token quota holds each request's ceiling until its reply's usage is known; nothing was written, and a replay of an admitted key is never refused; `detail` says what the wait is based on: the window's reset, how long recent reservations took to settle, the reconciler's next pass, or a limit of 0, which has no `Retry-After`: capacity returns only when an operator raises the limit), or the API key over its request rate (`rate_limited`, `api.rate_limit_per_second`)",
        headers(("Retry-After" = String, description = "Quota: seconds until the earliest time worth trying again (the window's end when charges fill it; when open reservations hold the capacity, an estimate of the first one's settlement from how long recent ones took, or the reconciler's next pass for one past its TTL); absent under a limit of 0. Rate: seconds until the key may ask again"))
    )]
    OverQuota,
    #[response(
        status = 503,
        description = "The database cannot be reached; retry with the same key"
    )]
    StoreUnavailable,
}

/// Submit a message for a reply: the message and its reply task are saved in one transaction.
#[utoipa::path(
    post,
    operation_id = "createReply",
    path = "/v1/replies",
    tag = "replies",
    params(IdempotencyKeyHeader),
    request_body(content = CreateReply, content_type = "application/json"),
    responses(
        (status = 202, description = "The task is saved (or, with `Idempotent-Replayed: true`, was saved by an earlier request with this key)", body = Accepted,
            headers(
                ("Location" = String, description = "The task's status URL"),
                ("Idempotent-Replayed" = String, description = "`true` when this answers an earlier request with the same key")
            ),
            links(
                ("GetReply" = (operation_id = "getReply", parameters(("task_id" = "$response.body#/task_id")))),
                ("FollowReply" = (operation_id = "followReply", parameters(("task_id" = "$response.body#/task_id")))),
                ("RegenerateReply" = (operation_id = "regenerateReply", parameters(("task_id" = "$response.body#/task_id")))),
            )),
        (status = 400, description = "No `Idempotency-Key`, one that is empty, over 255 bytes or not printable ASCII, or several different ones (`invalid_idempotency_key`); or a body that is not JSON (`malformed_json`)"),
        (status = 404, description = "An end user's token, in a conversation that is not its user's (another user's, or one begun with the workspace's key); nothing was written"),
        (status = 410, description = "The conversation (or its workspace) was erased: it takes no new messages (`conversation_erased`); nothing was written"),
        (status = 413, description = "The body is over `api.max_body_bytes` (`body_too_large`); a declared `Content-Length` over it is refused before the body is read (no `100 Continue`)"),
        (status = 415, description = "The body is not `application/json`"),
        (status = 422, description = "The body is not a JSON object or does not match the schema, a field is over its bound (`conversation_id`, `document_version` and `model` 256 bytes each; `message` with `context` `worker.max_prompt_bytes`), or the task's Kafka record would be over `kafka.max_record_bytes` (`invalid_body`; `fields` names the field, for the record its largest), or `kept_replies` names a task that is not a completed reply to an earlier message of the conversation, one twice, or two replies to one message (`invalid_body`; `fields` is `kept_replies`); or the key was used with other inputs (`idempotency_key_reused`; `fields` names them); or new work outside the workspace's policy: a `model` it may not use (an absent one is judged as the default), `max_output_tokens` over its cap, a request whose token ceiling is over its whole token quota, `context` from an end user's token where the workspace's `end_user_context` is `deny`, or `message` and `context` over `worker.max_prompt_bytes` with the workspace's system prompt (`outside_workspace_policy`; `fields` names them, `detail` the setting)"),
        NewWorkRefusals,
    ),
    security(("api_key" = []), ("end_user_token" = []))
)]
pub async fn create(
    State(state): State<ApiState>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Response {
    create_inner(&state, caller, &headers, body)
        .await
        .into_response()
}

async fn create_inner(
    state: &ApiState,
    caller: Caller,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let key = key_of(headers)?;
    let create = parse_body(state, headers, body).await?;
    let kept = create.kept_replies.unwrap_or_default();
    // Sorted, as the order of a set is no difference; none named is the same as absent.
    let mut kept_bound: Vec<String> = kept.iter().map(ToString::to_string).collect();
    kept_bound.sort();
    let inputs = BoundInputs {
        conversation_id: create.conversation_id,
        message: create.message,
        document_version: create.document_version,
        model: create.model,
        context: create.context,
        max_output_tokens: create.max_output_tokens,
        source_task: None,
        kept_replies: (!kept_bound.is_empty()).then_some(kept_bound),
    };
    let Caller {
        workspace,
        end_user,
        ..
    } = caller;
    let policy = policy_of(state, &workspace).await?;
    // The workspace's prompt goes first in the history: fixed with it when the task is made.
    let system = system_turns(&policy);
    let turn = super::prompt_policy::judge_turn(state, &policy, end_user.is_some(), &inputs);
    let alone = turn.and_then(|()| judge(state, &policy, &inputs, &system));
    let history = match &alone {
        // Refused whatever its history (unless it is a replay, which needs none).
        Err(_) => Ok(Vec::new()),
        Ok(admitted) => history_of(state, &workspace, &inputs, &kept, &policy, admitted)
            .await?
            .map(|turns| [system, turns].concat()),
    };
    let mut submission = Submission {
        workspace_id: workspace,
        operation: Operation::CreateReply,
        key,
        // Judged again below with the history that fits the record.
        verdict: alone.clone(),
        history,
        end_user: end_user.map(|u| u.id),
        inputs,
        max_attempts: state.limits.max_attempts,
        retention: state.settings.idempotency_retention(),
        existing_message: None,
        quota: state.quota,
        traceparent: crate::telemetry::trace::traceparent(&tracing::Span::current()),
    };
    // Each turn of history adds its framing to the record: past the record limit, the oldest
    // turns go first, as the budget drops them.
    while check_record_size(&submission, state.limits.max_record_bytes).is_err()
        && let Ok(turns) = &mut submission.history
        && turns.iter().any(|turn| turn.role != Role::System)
    {
        drop_oldest_turn(turns);
    }
    let turns = submission.history.as_deref().unwrap_or_default();
    submission.verdict = alone.and_then(|_| judge(state, &policy, &submission.inputs, turns));
    check_record_size(&submission, state.limits.max_record_bytes)
        .map_err(|refusal| Problem::invalid_body(refusal.detail).with_fields(refusal.fields))?;
    submit(state, submission).await
}

/// Ask for another answer to the same message: a new task with its own key; the old reply
/// stays.
#[utoipa::path(
    post,
    operation_id = "regenerateReply",
    path = "/v1/replies/{task_id}/regenerate",
    tag = "replies",
    params(TaskIdPath, IdempotencyKeyHeader),
    responses(
        (status = 202, description = "The new task is saved (or, with `Idempotent-Replayed: true`, was saved by an earlier request with this key)", body = Accepted,
            headers(
                ("Location" = String, description = "The new task's status URL"),
                ("Idempotent-Replayed" = String, description = "`true` when this answers an earlier request with the same key")
            )),
        (status = 400, description = "A bad task id, or a missing or bad `Idempotency-Key`, or several different ones (`invalid_idempotency_key`)"),
        UnknownTask,
        (status = 410, description = "The task's conversation (or its workspace) was erased while this was asked (`conversation_erased`); nothing was written"),
        (status = 422, description = "The key was used with other inputs (`idempotency_key_reused`; `fields` names them), or the new task's Kafka record would be over `kafka.max_record_bytes` (`record_too_large`, for a source task that came from Kafka with longer fields than the API takes; `fields` names the largest), or the source's model or output bound is outside the workspace's policy now (`outside_workspace_policy`)"),
        NewWorkRefusals,
    ),
    security(("api_key" = []), ("end_user_token" = []))
)]
pub async fn regenerate(
    State(state): State<ApiState>,
    caller: Caller,
    PathParam(task_id): PathParam,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let key = key_of(&headers)?;
        let source = task_of(&state, &caller, &task_id).await?;
        // Asked as the source was: the new answer is to the same conversation.
        let (inputs, turns) = regenerate_inputs(&source);
        let policy = policy_of(&state, &caller.workspace).await?;
        let verdict = judge(&state, &policy, &inputs, &turns);
        let submission = Submission {
            workspace_id: caller.workspace,
            operation: Operation::Regenerate,
            key,
            inputs,
            max_attempts: state.limits.max_attempts,
            retention: state.settings.idempotency_retention(),
            existing_message: Some(source.spec.message_id.clone()),
            quota: state.quota,
            traceparent: crate::telemetry::trace::traceparent(&tracing::Span::current()),
            verdict,
            history: Ok(turns),
            end_user: caller.end_user.map(|u| u.id),
        };
        // A task that came from Kafka was not held to the API's bounds, and the record
        // limit may have been lowered since.
        check_record_size(&submission, state.limits.max_record_bytes).map_err(|refusal| {
            Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                ProblemKind::RecordTooLarge,
                "Record too large",
                refusal.detail,
            )
            .with_fields(refusal.fields)
        })?;
        submit(&state, submission).await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// Stop a task: one that waits makes no call, one that runs has its call cut short and its
/// answer refused, and either ends `cancelled` with its quota reservation released. Safe to
/// repeat: a second cancel answers as the first did.
#[utoipa::path(
    post,
    operation_id = "cancelReply",
    path = "/v1/replies/{task_id}/cancel",
    tag = "replies",
    params(TaskIdPath),
    responses(
        (status = 200, description = "The task is cancelled (by this request or an earlier one): no reply will come, a running call is cut short (its answer, if one still comes, is refused), its reservation is released, and its event stream ends with this status", body = ReplyView),
        BadTaskId,
        UnknownTask,
        (status = 409, description = "The task had already ended: its reply was saved before the cancel arrived, or it had failed (`task_finished`); nothing changed. Read the task for its reply"),
        (status = 503, description = "The database cannot be reached; cancelling again is safe"),
    ),
    security(("api_key" = []), ("end_user_token" = []))
)]
pub async fn cancel(
    State(state): State<ApiState>,
    caller: Caller,
    PathParam(task_id): PathParam,
) -> Response {
    let cancelled = async {
        let task = task_of(&state, &caller, &task_id).await?;
        let id = task.spec.task_id;
        let outcome = state
            .store
            .cancel(id)
            .await
            .map_err(Problem::store_unavailable)?;
        crate::telemetry::cancel(outcome.as_str());
        let finished = |detail: &str| {
            Problem::new(
                StatusCode::CONFLICT,
                ProblemKind::TaskFinished,
                "Task already finished",
                format!("task {id} {detail} before the cancel arrived; nothing changed"),
            )
        };
        match outcome {
            CancelOutcome::Cancelled | CancelOutcome::AlreadyCancelled => {
                match state
                    .store
                    .read(id)
                    .await
                    .map_err(Problem::store_unavailable)?
                {
                    Some(task) => Ok(ReplyView::of(&task)),
                    None => Err(Problem::not_found(format!("no task {id}"))),
                }
            }
            CancelOutcome::AlreadyCompleted => Err(finished("had its reply saved")),
            CancelOutcome::AlreadyFailed => Err(finished("had failed")),
            // Erased between the read and the cancel.
            CancelOutcome::NotFound => Err(Problem::not_found(format!("no task {id}"))),
        }
    };
    cancelled.await.map(Json).into_response()
}

/// Read a task: its state and, once completed, its reply.
#[utoipa::path(
    get,
    operation_id = "getReply",
    path = "/v1/replies/{task_id}",
    tag = "replies",
    params(TaskIdPath),
    responses(
        (status = 200, description = "The task", body = ReplyView),
        BadTaskId,
        UnknownTask,
    ),
    security(("api_key" = []), ("end_user_token" = []))
)]
pub async fn show(
    State(state): State<ApiState>,
    caller: Caller,
    PathParam(task_id): PathParam,
) -> Response {
    let shown = async {
        let task = task_of(&state, &caller, &task_id).await?;
        let attempts = state
            .store
            .attempts(task.spec.task_id)
            .await
            .map_err(Problem::store_unavailable)?;
        Ok::<_, Problem>(ReplyView {
            usage: Some(UsageView::of(&attempts)),
            ..ReplyView::of(&task)
        })
    };
    shown.await.map(Json).into_response()
}

/// The task a path names, if it is the caller's: a bad id is a `400`, and another workspace's
/// task is exactly as absent (`404`) as one that does not exist.
pub(super) async fn task_of(
    state: &ApiState,
    caller: &Caller,
    raw_id: &str,
) -> Result<StoredTask, Problem> {
    let task_id = TaskId::parse(raw_id).map_err(|_| {
        Problem::bad_request(
            ProblemKind::InvalidTaskId,
            format!("{} is not a task id (a UUID)", super::echo::quoted(raw_id)),
        )
    })?;
    let not_found = || Problem::not_found(format!("no task {task_id}"));
    let task = match state
        .store
        .read(task_id)
        .await
        .map_err(Problem::store_unavailable)?
    {
        Some(task) if task.spec.workspace_id == caller.workspace => task,
        _ => return Err(not_found()),
    };
    if caller.end_user.is_some() {
        // An end user sees the tasks of their own conversations only, and of those only the
        // ones of messages written through the API (a producer's record in a conversation of
        // the same id is the workspace's); another's is answered as a task of another
        // workspace is.
        let owner = state
            .store
            .task_owner(
                &caller.workspace,
                &task.spec.conversation_id,
                &task.spec.message_id,
            )
            .await
            .map_err(Problem::store_unavailable)?;
        if !caller.sees(owner.as_ref()) {
            return Err(not_found());
        }
    }
    Ok(task)
}
