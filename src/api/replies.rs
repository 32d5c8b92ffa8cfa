//! `POST /v1/replies` (a new message and its reply task, idempotent by `Idempotency-Key`) and
//! `GET /v1/replies/{task_id}` (its state, scoped to the caller's workspace).
//!
//! Keeps I6: the same key with the same inputs returns the existing task (`Idempotent-Replayed:
//! true`), never a second message, task or outbox row, also when two first requests race; the
//! same key with other inputs is a `422` naming the fields. Bad input is a `4xx` and writes
//! nothing.

use axum::Json;
use axum::body::{Body, to_bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use super::ApiState;
use super::auth::Workspace;
use super::problem::Problem;
use crate::domain::{Role, StoredTask, TaskId, TaskStatus};
use crate::idempotency::{BoundInputs, IdempotencyKey, Operation};
use crate::store::intake::{Submission, Submitted};

/// The body of `POST /v1/replies`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateReply {
    pub conversation_id: String,
    /// The user's message.
    pub message: String,
    /// The document version the question is about (empty when none).
    #[serde(default)]
    pub document_version: String,
    pub model: Option<String>,
    /// A system prompt for this reply.
    pub context: Option<String>,
    pub max_output_tokens: Option<u32>,
}

/// The answer to a submission: where to follow the task.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Accepted {
    pub task_id: TaskId,
    pub status: String,
    pub status_url: String,
    pub events_url: String,
    /// True when this answer is for an earlier request with the same key.
    pub replayed: bool,
}

/// A task as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct ReplyView {
    pub task_id: TaskId,
    pub status: String,
    pub reply: Option<String>,
    pub failure: Option<String>,
    pub attempts: i32,
    pub max_attempts: u32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
}

impl ReplyView {
    pub fn of(task: &StoredTask) -> Self {
        Self {
            task_id: task.spec.task_id,
            status: task.status.as_str().to_owned(),
            reply: task.saved_response.clone(),
            failure: task.failure.clone(),
            attempts: task.attempt_count,
            max_attempts: task.spec.max_attempts,
            created_at: task.created_at,
            updated_at: task.updated_at,
            finished_at: task.finished_at,
        }
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

/// Reads and parses the body, each failure a problem naming it.
async fn parse_body(
    state: &ApiState,
    headers: &HeaderMap,
    body: Body,
) -> Result<CreateReply, Problem> {
    if !is_json(headers) {
        return Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
            "Unsupported media type",
            "send the body as JSON with `Content-Type: application/json`",
        ));
    }
    let limit = state.settings.max_body_bytes;
    let bytes = to_bytes(body, limit).await.map_err(|_| {
        Problem::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
            "Body too large",
            format!("the body is over the limit of {limit} bytes (api.max_body_bytes)"),
        )
    })?;
    let create: CreateReply = serde_json::from_slice(&bytes).map_err(|e| {
        use serde_json::error::Category;
        match e.classify() {
            Category::Syntax | Category::Eof | Category::Io => {
                Problem::bad_request("malformed_json", format!("the body is not JSON: {e}"))
            }
            Category::Data => Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "invalid_body",
                "Invalid body",
                format!("the body does not match the request schema: {e}"),
            ),
        }
    })?;
    let invalid = |detail: String| {
        Problem::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
            "Invalid body",
            detail,
        )
    };
    if create.conversation_id.trim().is_empty() {
        return Err(invalid("`conversation_id` is empty".into()));
    }
    if create.message.trim().is_empty() {
        return Err(invalid("`message` is empty".into()));
    }
    let prompt = create.message.len() + create.context.as_ref().map_or(0, String::len);
    if prompt > state.max_prompt_bytes {
        return Err(invalid(format!(
            "`message` and `context` are {prompt} bytes, over the limit of {} (worker.max_prompt_bytes)",
            state.max_prompt_bytes
        )));
    }
    Ok(create)
}

fn key_of(headers: &HeaderMap) -> Result<IdempotencyKey, Problem> {
    IdempotencyKey::parse(headers.get("idempotency-key").map(|v| v.as_bytes()))
        .map_err(|e| Problem::bad_request("invalid_idempotency_key", e.to_string()))
}

fn urls(task_id: TaskId) -> (String, String) {
    (
        format!("/v1/replies/{task_id}"),
        format!("/v1/replies/{task_id}/events"),
    )
}

pub async fn create(
    State(state): State<ApiState>,
    Workspace(workspace): Workspace,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match create_inner(&state, workspace, &headers, body).await {
        Ok(response) => response,
        Err(problem) => problem.into_response(),
    }
}

async fn create_inner(
    state: &ApiState,
    workspace: String,
    headers: &HeaderMap,
    body: Body,
) -> Result<Response, Problem> {
    let key = key_of(headers)?;
    let create = parse_body(state, headers, body).await?;
    let submission = Submission {
        workspace_id: workspace,
        operation: Operation::CreateReply,
        key,
        inputs: BoundInputs {
            conversation_id: create.conversation_id,
            message: create.message,
            document_version: create.document_version,
            model: create.model,
            context: create.context,
            max_output_tokens: create.max_output_tokens,
            source_task: None,
        },
        max_attempts: state.max_attempts,
        retention: state.settings.idempotency_retention(),
        existing_message: None,
    };
    submit(state, submission).await
}

/// The inputs of a regenerate: the source task's question, bound to the source task.
fn regenerate_inputs(source: &StoredTask) -> BoundInputs {
    let request = &source.spec.request;
    let text_of = |role: Role| {
        request
            .messages
            .iter()
            .rev()
            .find(|m| m.role == role)
            .map(|m| m.content.clone())
    };
    BoundInputs {
        conversation_id: source.spec.conversation_id.clone(),
        message: text_of(Role::User).unwrap_or_default(),
        document_version: source.spec.document_version.clone(),
        model: request.model.clone(),
        context: text_of(Role::System),
        max_output_tokens: request.max_output_tokens,
        source_task: Some(source.spec.task_id.to_string()),
    }
}

/// `POST /v1/replies/{task_id}/regenerate`: another answer to the same message, as a new task
/// with its own key; the old reply stays.
pub async fn regenerate(
    State(state): State<ApiState>,
    Workspace(workspace): Workspace,
    Path(task_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    let result = async {
        let key = key_of(&headers)?;
        let source = task_of(&state, &workspace, &task_id).await?;
        let submission = Submission {
            workspace_id: workspace,
            operation: Operation::Regenerate,
            key,
            inputs: regenerate_inputs(&source),
            max_attempts: state.max_attempts,
            retention: state.settings.idempotency_retention(),
            existing_message: Some(source.spec.message_id.clone()),
        };
        submit(&state, submission).await
    }
    .await;
    result.unwrap_or_else(IntoResponse::into_response)
}

/// Runs the intake transaction and answers: 202 with where to follow the task.
async fn submit(state: &ApiState, submission: Submission) -> Result<Response, Problem> {
    let unavailable =
        |e: crate::store::StoreError| Problem::unavailable(crate::telemetry::chain(&e));
    let (task_id, replayed) = match state.store.submit(&submission).await.map_err(unavailable)? {
        Submitted::Created { task_id } => (task_id, false),
        Submitted::Replayed { task_id } => (task_id, true),
        Submitted::Mismatch { fields } => {
            return Err(Problem::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                "idempotency_key_reused",
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
            .map_err(unavailable)?
            .map_or(TaskStatus::Pending, |t| t.status)
    } else {
        TaskStatus::Pending
    };
    crate::telemetry::submission(replayed);
    let (status_url, events_url) = urls(task_id);
    let mut response = (
        StatusCode::ACCEPTED,
        Json(Accepted {
            task_id,
            status: status.as_str().to_owned(),
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

pub async fn show(
    State(state): State<ApiState>,
    Workspace(workspace): Workspace,
    Path(task_id): Path<String>,
) -> Response {
    match task_of(&state, &workspace, &task_id).await {
        Ok(task) => Json(ReplyView::of(&task)).into_response(),
        Err(problem) => problem.into_response(),
    }
}

/// The task a path names, if it is the caller's: a bad id is a `400`, and another workspace's
/// task is exactly as absent (`404`) as one that does not exist.
pub(super) async fn task_of(
    state: &ApiState,
    workspace: &str,
    raw_id: &str,
) -> Result<StoredTask, Problem> {
    let task_id = TaskId::parse(raw_id).map_err(|_| {
        Problem::bad_request(
            "invalid_task_id",
            format!("{raw_id:?} is not a task id (a UUID)"),
        )
    })?;
    match state.store.read(task_id).await {
        Ok(Some(task)) if task.spec.workspace_id == workspace => Ok(task),
        Ok(_) => Err(Problem::not_found(format!("no task {task_id}"))),
        Err(e) => Err(Problem::unavailable(crate::telemetry::chain(&e))),
    }
}
