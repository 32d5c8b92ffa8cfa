//! `POST /v1/replies` (a new message and its reply task, idempotent by `Idempotency-Key`) and
//! `GET /v1/replies/{task_id}` (its state, scoped to the caller's workspace).
//!
//! Keeps I6: the same key with the same inputs returns the existing task (`Idempotent-Replayed:
//! true`), never a second message, task or outbox row, also when two first requests race; the
//! same key with other inputs is a `422` naming the fields. Bad input is a `4xx` and writes
//! nothing.

use axum::Json;
use axum::body::{Body, to_bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::auth::Caller;
use super::path::PathParam;
use super::problem::{Problem, ProblemDetails, ProblemKind};
use super::state::ApiState;
use crate::store::cancels::CancelOutcome;
use crate::store::intake::{Submission, Submitted, provider_request, task_spec};
use replyd_core::domain::limits::{
    MAX_CONVERSATION_ID_BYTES, MAX_DOCUMENT_VERSION_BYTES, MAX_MODEL_BYTES,
};
use replyd_core::domain::{
    AttemptRecord, ChatMessage, Role, StoredTask, TaskId, TaskStatus, TokenUsage,
};
use replyd_core::history::{self, Budget, KeptError, drop_oldest_turn, regenerate_parts};
use replyd_core::idempotency::{BoundInputs, IdempotencyKey, Operation};
use replyd_core::prompt_policy::{prompt_bytes, system_turns};
use replyd_core::workspace_policy::{Admitted, PolicyRefusal, WorkspacePolicy};

/// The body of `POST /v1/replies`: a JSON object. Every field is bound to the
/// `Idempotency-Key`: a retry with the same key must send the same values. No text may
/// contain NUL (U+0000). Lengths are in bytes of UTF-8 (the schema's `maxLength` counts
/// characters, so it is the loose side of the same bound). The task's Kafka record, which
/// carries all of them, must also fit `kafka.max_record_bytes`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateReply {
    /// The conversation the message belongs to (not blank; at most 256 bytes: it is also the
    /// task's Kafka record key).
    #[schema(min_length = 1, max_length = 256, pattern = r"\S")]
    pub conversation_id: String,
    /// The user's message (not blank; with `context`, at most `worker.max_prompt_bytes`).
    #[schema(min_length = 1, pattern = r"\S")]
    pub message: String,
    /// The document version the question is about (empty when none; at most 256 bytes).
    #[serde(default)]
    #[schema(max_length = 256)]
    pub document_version: String,
    /// The model to ask; the provider's default when absent (at most 256 bytes).
    #[schema(max_length = 256)]
    pub model: Option<String>,
    /// A system prompt for this reply, sent before the workspace's own. With an end user's
    /// token only where the workspace allows it (`end_user_context`).
    pub context: Option<String>,
    /// The most tokens the reply may have.
    #[schema(minimum = 1, maximum = 1_000_000)]
    pub max_output_tokens: Option<u32>,
    /// Which answer the user kept of an earlier message that has several (after a
    /// Regenerate): the task ids of those replies, at most one per message and 100 in all. An
    /// earlier message not named is sent with its newest completed reply. The model is asked
    /// with the conversation's earlier messages and these replies (oldest dropped first past
    /// `api.history_max_tokens`), fixed when the task is created; the list (not the history it
    /// picks) is bound to the key, so a retry after a new turn elsewhere is the same task.
    #[schema(max_items = 100, value_type = Option<Vec<uuid::Uuid>>)]
    pub kept_replies: Option<Vec<TaskId>>,
}

/// Where a task is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ReplyStatus {
    /// Waiting for a worker.
    Pending,
    /// A worker is asking the provider.
    Running,
    /// The reply is saved (terminal).
    Completed,
    /// No reply will come (terminal); `failure` says why.
    Failed,
    /// Stopped by `POST /v1/replies/{task_id}/cancel` (terminal): no reply will come, and the
    /// task is not charged.
    Cancelled,
}

impl From<TaskStatus> for ReplyStatus {
    fn from(status: TaskStatus) -> Self {
        match status {
            TaskStatus::Pending => ReplyStatus::Pending,
            TaskStatus::Running => ReplyStatus::Running,
            TaskStatus::Completed => ReplyStatus::Completed,
            TaskStatus::Failed => ReplyStatus::Failed,
            TaskStatus::Cancelled => ReplyStatus::Cancelled,
        }
    }
}

/// The answer to a submission: where to follow the task.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct Accepted {
    #[schema(value_type = uuid::Uuid)]
    pub task_id: TaskId,
    /// New work is `pending`; a replay shows the task's current status.
    pub status: ReplyStatus,
    pub status_url: String,
    pub events_url: String,
    /// True when this answer is for an earlier request with the same key.
    pub replayed: bool,
}

/// A task as the API shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct ReplyView {
    #[schema(value_type = uuid::Uuid)]
    pub task_id: TaskId,
    pub status: ReplyStatus,
    /// The saved reply, once `completed`.
    pub reply: Option<String>,
    /// Why no reply will come, once `failed`.
    pub failure: Option<String>,
    /// Provider attempts so far.
    pub attempts: i32,
    pub max_attempts: u32,
    pub created_at: DateTime<Utc>,
    pub updated_at: DateTime<Utc>,
    pub finished_at: Option<DateTime<Utc>>,
    /// Tokens the provider reported, per attempt and in all (in `GET /v1/replies/{task_id}`;
    /// absent from the event stream's snapshots).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageView>,
}

/// Tokens the provider reported for a task. A number is what the provider said; `null` is
/// "not reported" (no answer came, or it carried no usage), never 0.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct UsageView {
    /// Prompt tokens over the attempts that reported usage; `null` when none did.
    pub prompt_tokens: Option<i64>,
    /// Completion tokens over the attempts that reported usage; `null` when none did.
    pub completion_tokens: Option<i64>,
    /// Finished attempts that may have reached the provider and reported nothing (an answer
    /// lost or refused by the lease, a timeout, an error): whatever they cost is not in the
    /// totals. Refused calls (`refused`), which the provider did not run, are not counted.
    pub unreported_attempts: u32,
    /// Every attempt, oldest first.
    pub attempts: Vec<AttemptUsageView>,
}

/// One attempt's usage.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, ToSchema)]
pub struct AttemptUsageView {
    /// 1 for the first claim of the task.
    pub attempt: i32,
    /// How the attempt ended (`accepted`, `timeout`, `refused`, ...); `null` while it runs.
    pub outcome: Option<String>,
    /// `null`: not reported.
    pub prompt_tokens: Option<i64>,
    /// `null`: not reported.
    pub completion_tokens: Option<i64>,
    /// How its streamed answer ended without a reply: `cut` (no final event: an ambiguous
    /// call), `error` (an error event after the first tokens), `cancelled`, `fenced` (its lease
    /// was lost); absent when it ended in a reply, was not streamed, or its worker died.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_end: Option<String>,
    /// Characters of text the attempt had received when its stream so ended.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub streamed_chars: Option<i32>,
}

impl UsageView {
    pub fn of(attempts: &[AttemptRecord]) -> Self {
        let total = TokenUsage::total_of(attempts.iter().map(|a| a.usage));
        let unreported = attempts.iter().filter(|a| a.reported_nothing()).count();
        Self {
            prompt_tokens: total.map(|t| t.prompt_tokens),
            completion_tokens: total.map(|t| t.completion_tokens),
            unreported_attempts: u32::try_from(unreported).unwrap_or(u32::MAX),
            attempts: attempts
                .iter()
                .map(|a| AttemptUsageView {
                    attempt: a.attempt_no,
                    outcome: a.outcome.map(|o| o.as_str().to_owned()),
                    prompt_tokens: a.usage.map(|u| u.prompt_tokens),
                    completion_tokens: a.usage.map(|u| u.completion_tokens),
                    stream_end: a.stream_end.map(|(end, _)| end.as_str().to_owned()),
                    streamed_chars: a.stream_end.map(|(_, chars)| chars),
                })
                .collect(),
        }
    }
}

impl ReplyView {
    pub fn of(task: &StoredTask) -> Self {
        Self {
            task_id: task.spec.task_id,
            status: task.status.into(),
            reply: task.saved_response.clone(),
            failure: task.failure.clone(),
            attempts: task.attempt_count,
            max_attempts: task.spec.max_attempts,
            created_at: task.created_at,
            updated_at: task.updated_at,
            finished_at: task.finished_at,
            usage: None,
        }
    }
}

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

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("application/json"))
}

/// A body over `api.max_body_bytes`: declared so (refused before it is read), or found so
/// while reading one of unknown length.
pub(super) fn body_too_large(limit: usize) -> Problem {
    Problem::new(
        StatusCode::PAYLOAD_TOO_LARGE,
        ProblemKind::BodyTooLarge,
        "Body too large",
        format!("the body is over the limit of {limit} bytes (api.max_body_bytes)"),
    )
}

/// A JSON object read as `T`, and no other JSON value. serde's derived structs also take an
/// array of their fields in order (`["c", "hello", "v1", null, null, 64]`), which the schema
/// does not allow: asking the deserializer for a map refuses every other value, and the map
/// is handed on to `T`'s own visitor, which keeps its refusals of duplicate and unknown
/// fields.
struct JsonObject<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for JsonObject<T> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ObjectOf<T>(std::marker::PhantomData<T>);

        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for ObjectOf<T> {
            type Value = T;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a JSON object")
            }

            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }

        deserializer
            .deserialize_map(ObjectOf(std::marker::PhantomData))
            .map(JsonObject)
    }
}

/// Reads and parses the body, each failure a problem naming it.
async fn parse_body(
    state: &ApiState,
    headers: &HeaderMap,
    body: Body,
) -> Result<CreateReply, Problem> {
    let create: CreateReply = parse_json(state, headers, body).await?;
    check_inputs(&create, state.limits.max_prompt_bytes)
        .map_err(|refusal| Problem::invalid_body(refusal.detail).with_fields(refusal.fields))?;
    Ok(create)
}

/// Reads a JSON object body of `T`: a `415` if not sent as JSON, `413` over
/// `api.max_body_bytes`, `400` if not JSON, `422` if not a `T`.
pub(super) async fn parse_json<T: serde::de::DeserializeOwned>(
    state: &ApiState,
    headers: &HeaderMap,
    body: Body,
) -> Result<T, Problem> {
    if !is_json(headers) {
        return Err(Problem::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ProblemKind::UnsupportedMediaType,
            "Unsupported media type",
            "send the body as JSON with `Content-Type: application/json`",
        ));
    }
    let limit = state.settings.max_body_bytes;
    let bytes = to_bytes(body, limit)
        .await
        .map_err(|_| body_too_large(limit))?;
    let JsonObject(parsed) = serde_json::from_slice::<JsonObject<T>>(&bytes).map_err(|e| {
        use serde_json::error::Category;
        let said = super::echo::message(&e.to_string());
        match e.classify() {
            Category::Syntax | Category::Eof | Category::Io => Problem::bad_request(
                ProblemKind::MalformedJson,
                format!("the body is not JSON: {said}"),
            ),
            Category::Data => Problem::invalid_body(format!(
                "the body does not match the request schema: {said}"
            )),
        }
    })?;
    Ok(parsed)
}

/// The largest `max_output_tokens` taken: far above what any model writes, low enough that a
/// typo (or an overflow in a client) is refused rather than passed on.
pub const MAX_OUTPUT_TOKENS: u32 = 1_000_000;

/// Why a well-formed body is refused: the fields at fault, and what is wrong with them.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Refusal {
    fields: Vec<&'static str>,
    detail: String,
}

impl Refusal {
    fn of(field: &'static str, detail: String) -> Self {
        Self {
            fields: vec![field],
            detail,
        }
    }
}

/// What the schema cannot say about a well-formed body, each refusal naming its field.
fn check_inputs(create: &CreateReply, max_prompt_bytes: usize) -> Result<(), Refusal> {
    if create.conversation_id.trim().is_empty() {
        return Err(Refusal::of(
            "conversation_id",
            "`conversation_id` is empty".into(),
        ));
    }
    if create.message.trim().is_empty() {
        return Err(Refusal::of("message", "`message` is empty".into()));
    }
    let bounded = [
        (
            "conversation_id",
            Some(&create.conversation_id),
            MAX_CONVERSATION_ID_BYTES,
        ),
        (
            "document_version",
            Some(&create.document_version),
            MAX_DOCUMENT_VERSION_BYTES,
        ),
        ("model", create.model.as_ref(), MAX_MODEL_BYTES),
    ];
    for (field, text, limit) in bounded {
        if let Some(text) = text
            && text.len() > limit
        {
            return Err(Refusal::of(
                field,
                format!(
                    "`{field}` is {} bytes, over the limit of {limit} bytes",
                    text.len()
                ),
            ));
        }
    }
    // PostgreSQL text cannot hold NUL; refused here, it can never fail the intake transaction.
    let texts = [
        ("conversation_id", Some(&create.conversation_id)),
        ("message", Some(&create.message)),
        ("document_version", Some(&create.document_version)),
        ("model", create.model.as_ref()),
        ("context", create.context.as_ref()),
    ];
    if let Some((field, _)) = texts
        .iter()
        .find(|(_, text)| text.is_some_and(|t| t.contains('\0')))
    {
        return Err(Refusal::of(
            field,
            format!("`{field}` contains a NUL character (U+0000)"),
        ));
    }
    if let Some(tokens) = create.max_output_tokens
        && !(1..=MAX_OUTPUT_TOKENS).contains(&tokens)
    {
        return Err(Refusal::of(
            "max_output_tokens",
            format!(
                "`max_output_tokens` is {tokens}; it must be between 1 and {MAX_OUTPUT_TOKENS}"
            ),
        ));
    }
    let prompt = create.message.len() + create.context.as_ref().map_or(0, String::len);
    if prompt > max_prompt_bytes {
        return Err(Refusal {
            fields: vec!["message", "context"],
            detail: format!(
                "`message` and `context` are {prompt} bytes, over the limit of {max_prompt_bytes} (worker.max_prompt_bytes)"
            ),
        });
    }
    Ok(())
}

/// Refuses a submission whose Kafka record would be over `kafka.max_record_bytes`, naming its
/// largest field: the relay could never publish it. The record is sized from the very task
/// the intake would write ([`task_spec`]), with ids of the length the intake makes.
fn check_record_size(submission: &Submission, max_record_bytes: usize) -> Result<(), Refusal> {
    let spec = task_spec(
        submission,
        TaskId::from(uuid::Uuid::nil()),
        uuid::Uuid::nil(),
    );
    let size = spec.record_bytes();
    if size <= max_record_bytes {
        return Ok(());
    }
    let inputs = &submission.inputs;
    let fields = [
        ("conversation_id", inputs.conversation_id.len()),
        ("message", inputs.message.len()),
        ("context", inputs.context.as_ref().map_or(0, String::len)),
        ("document_version", inputs.document_version.len()),
        ("model", inputs.model.as_ref().map_or(0, String::len)),
    ];
    let (field, bytes) = fields
        .into_iter()
        .max_by_key(|(_, bytes)| *bytes)
        .expect("a non-empty list");
    Err(Refusal::of(
        field,
        format!(
            "the task's Kafka record would be {size} bytes, over kafka.max_record_bytes ({max_record_bytes}); its largest field is `{field}` ({bytes} bytes)"
        ),
    ))
}

fn key_of(headers: &HeaderMap) -> Result<IdempotencyKey, Problem> {
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
        (status = 400, description = "No `Idempotency-Key`, one that is empty, over 255 bytes or not printable ASCII, or several different ones (`invalid_idempotency_key`); or a body that is not JSON (`malformed_json`)", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 404, description = "An end user's token, in a conversation that is not its user's (another user's, or one begun with the workspace's key); nothing was written", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 410, description = "The conversation (or its workspace) was erased: it takes no new messages (`conversation_erased`); nothing was written", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 413, description = "The body is over `api.max_body_bytes` (`body_too_large`); a declared `Content-Length` over it is refused before the body is read (no `100 Continue`)", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 415, description = "The body is not `application/json`", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 422, description = "The body is not a JSON object or does not match the schema, a field is over its bound (`conversation_id`, `document_version` and `model` 256 bytes each; `message` with `context` `worker.max_prompt_bytes`), or the task's Kafka record would be over `kafka.max_record_bytes` (`invalid_body`; `fields` names the field, for the record its largest), or `kept_replies` names a task that is not a completed reply to an earlier message of the conversation, one twice, or two replies to one message (`invalid_body`; `fields` is `kept_replies`); or the key was used with other inputs (`idempotency_key_reused`; `fields` names them); or new work outside the workspace's policy: a `model` it may not use (an absent one is judged as the default), `max_output_tokens` over its cap, a request whose token ceiling is over its whole token quota, `context` from an end user's token where the workspace's `end_user_context` is `deny`, or `message` and `context` over `worker.max_prompt_bytes` with the workspace's system prompt (`outside_workspace_policy`; `fields` names them, `detail` the setting)", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 429, description = "New work over the workspace's quota of generations or of tokens, or, with an end user's token, over the user's share of it (`end_user_share_percent`; `Retry-After` the window's end) (`quota_exceeded`; a token quota holds each request's ceiling until its reply's usage is known; nothing was written, and a replay of an admitted key is never refused; `detail` says what the wait is based on: the window's reset, how long recent reservations took to settle, the reconciler's next pass, or a limit of 0, which has no `Retry-After`: capacity returns only when an operator raises the limit), or the API key over its request rate (`rate_limited`, `api.rate_limit_per_second`)", body = ProblemDetails, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Quota: seconds until the earliest time worth trying again (the window's end when charges fill it; when open reservations hold the capacity, an estimate of the first one's settlement from how long recent ones took, or the reconciler's next pass for one past its TTL); absent under a limit of 0. Rate: seconds until the key may ask again"))),
        (status = 503, description = "The database cannot be reached; retry with the same key", body = ProblemDetails, content_type = "application/problem+json"),
    ),
    security(("api_key" = []), ("end_user_token" = []))
)]
pub async fn create(
    State(state): State<ApiState>,
    caller: Caller,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match create_inner(&state, caller, &headers, body).await {
        Ok(response) => response,
        Err(problem) => problem.into_response(),
    }
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

/// The history a new message is asked with (`replyd_core::history`): the conversation's
/// earlier messages and the replies kept, within `api.history_max_tokens`, what is left of
/// `worker.max_prompt_bytes`, and what is left of the workspace's whole token quota, so
/// history alone never makes a request the policy refuses. Or why `kept_replies` cannot be
/// used.
async fn history_of(
    state: &ApiState,
    workspace: &str,
    inputs: &BoundInputs,
    kept: &[TaskId],
    policy: &WorkspacePolicy,
    alone: &Admitted,
) -> Result<Result<Vec<ChatMessage>, KeptError>, Problem> {
    let max_tokens = state.settings.history_max_tokens;
    if max_tokens == 0 && kept.is_empty() {
        return Ok(Ok(Vec::new()));
    }
    let earlier = state
        .store
        .earlier_messages(workspace, &inputs.conversation_id)
        .await
        .map_err(|e| Problem::unavailable(crate::telemetry::chain(&e)))?;
    let prompt = prompt_bytes(policy, &inputs.message, inputs.context.as_deref());
    let budget = Budget {
        tokens: i64::from(max_tokens).min(
            policy
                .token_limit
                .map_or(i64::MAX, |limit| limit - alone.token_ceiling),
        ),
        bytes: state.limits.max_prompt_bytes.saturating_sub(prompt),
    };
    let composed = history::compose(&earlier, kept, &inputs.document_version, budget);
    if let Ok(history) = &composed {
        crate::telemetry::history(history.turns.len(), history.dropped);
    }
    Ok(composed.map(|h| h.turns))
}

/// The inputs of a regenerate (the source task's question, bound to the source task) and the
/// turns before it: the source's, as it was asked (its system turns and history).
fn regenerate_inputs(source: &StoredTask) -> (BoundInputs, Vec<ChatMessage>) {
    let request = &source.spec.request;
    let (context, turns, message) = regenerate_parts(&request.messages);
    let inputs = BoundInputs {
        conversation_id: source.spec.conversation_id.clone(),
        message,
        document_version: source.spec.document_version.clone(),
        model: request.model.clone(),
        context,
        max_output_tokens: request.max_output_tokens,
        source_task: Some(source.spec.task_id.to_string()),
        kept_replies: None,
    };
    (inputs, turns)
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
        (status = 400, description = "A bad task id, or a missing or bad `Idempotency-Key`, or several different ones (`invalid_idempotency_key`)", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 404, description = "No such task in the caller's workspace (for an end user's token, in its user's conversations)", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 410, description = "The task's conversation (or its workspace) was erased while this was asked (`conversation_erased`); nothing was written", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 422, description = "The key was used with other inputs (`idempotency_key_reused`; `fields` names them), or the new task's Kafka record would be over `kafka.max_record_bytes` (`record_too_large`, for a source task that came from Kafka with longer fields than the API takes; `fields` names the largest), or the source's model or output bound is outside the workspace's policy now (`outside_workspace_policy`)", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 429, description = "New work over the workspace's quota of generations or of tokens, or, with an end user's token, over the user's share of it (`end_user_share_percent`; `Retry-After` the window's end) (`quota_exceeded`; a token quota holds each request's ceiling until its reply's usage is known; nothing was written, and a replay of an admitted key is never refused; `detail` says what the wait is based on: the window's reset, how long recent reservations took to settle, the reconciler's next pass, or a limit of 0, which has no `Retry-After`: capacity returns only when an operator raises the limit), or the API key over its request rate (`rate_limited`, `api.rate_limit_per_second`)", body = ProblemDetails, content_type = "application/problem+json",
            headers(("Retry-After" = String, description = "Quota: seconds until the earliest time worth trying again (the window's end when charges fill it; when open reservations hold the capacity, an estimate of the first one's settlement from how long recent ones took, or the reconciler's next pass for one past its TTL); absent under a limit of 0. Rate: seconds until the key may ask again"))),
        (status = 503, description = "The database cannot be reached; retry with the same key", body = ProblemDetails, content_type = "application/problem+json"),
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
        (status = 400, description = "The task id is not a UUID", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 404, description = "No such task in the caller's workspace (for an end user's token, in its user's conversations)", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 409, description = "The task had already ended: its reply was saved before the cancel arrived, or it had failed (`task_finished`); nothing changed. Read the task for its reply", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 503, description = "The database cannot be reached; cancelling again is safe", body = ProblemDetails, content_type = "application/problem+json"),
    ),
    security(("api_key" = []), ("end_user_token" = []))
)]
pub async fn cancel(
    State(state): State<ApiState>,
    caller: Caller,
    PathParam(task_id): PathParam,
) -> Response {
    let cancelled = async {
        let unavailable =
            |e: crate::store::StoreError| Problem::unavailable(crate::telemetry::chain(&e));
        let task = task_of(&state, &caller, &task_id).await?;
        let id = task.spec.task_id;
        let outcome = state.store.cancel(id).await.map_err(unavailable)?;
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
                match state.store.read(id).await.map_err(unavailable)? {
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
    match cancelled.await {
        Ok(view) => Json(view).into_response(),
        Err(problem) => problem.into_response(),
    }
}

/// The workspace's policy, read now, so an operator's change applies to the next request.
async fn policy_of(state: &ApiState, workspace: &str) -> Result<WorkspacePolicy, Problem> {
    Ok(state
        .store
        .workspace_policy(workspace)
        .await
        .map_err(|e| Problem::unavailable(crate::telemetry::chain(&e)))?
        .unwrap_or_default())
}

/// The workspace policy's verdict on a request, judged on the provider request it becomes
/// ([`provider_request`] with its history: its model and output bound, the length of each
/// message it sends).
fn judge(
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
async fn submit(state: &ApiState, submission: Submission) -> Result<Response, Problem> {
    let unavailable =
        |e: crate::store::StoreError| Problem::unavailable(crate::telemetry::chain(&e));
    let (task_id, replayed) = match state.store.submit(&submission).await.map_err(unavailable)? {
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
            .map_err(unavailable)?
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

/// Read a task: its state and, once completed, its reply.
#[utoipa::path(
    get,
    operation_id = "getReply",
    path = "/v1/replies/{task_id}",
    tag = "replies",
    params(TaskIdPath),
    responses(
        (status = 200, description = "The task", body = ReplyView),
        (status = 400, description = "The task id is not a UUID", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 404, description = "No such task in the caller's workspace (for an end user's token, in its user's conversations)", body = ProblemDetails, content_type = "application/problem+json"),
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
            .map_err(|e| Problem::unavailable(crate::telemetry::chain(&e)))?;
        Ok::<_, Problem>(ReplyView {
            usage: Some(UsageView::of(&attempts)),
            ..ReplyView::of(&task)
        })
    };
    match shown.await {
        Ok(view) => Json(view).into_response(),
        Err(problem) => problem.into_response(),
    }
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
    let unavailable =
        |e: crate::store::StoreError| Problem::unavailable(crate::telemetry::chain(&e));
    let not_found = || Problem::not_found(format!("no task {task_id}"));
    let task = match state.store.read(task_id).await.map_err(unavailable)? {
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
            .map_err(unavailable)?;
        if !caller.sees(owner.as_ref()) {
            return Err(not_found());
        }
    }
    Ok(task)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create() -> CreateReply {
        CreateReply {
            conversation_id: "conv-1".into(),
            message: "What changed?".into(),
            document_version: "v7".into(),
            model: None,
            context: Some("Be brief.".into()),
            max_output_tokens: Some(256),
            kept_replies: None,
        }
    }

    #[test]
    fn a_well_formed_body_passes() {
        assert_eq!(check_inputs(&create(), 1000), Ok(()));
    }

    #[test]
    fn each_refusal_names_its_field() {
        type Case = (&'static str, fn(&mut CreateReply), &'static str);
        let cases: [Case; 6] = [
            (
                "blank conversation",
                |c| c.conversation_id = " ".into(),
                "`conversation_id` is empty",
            ),
            (
                "blank message",
                |c| c.message = "\n".into(),
                "`message` is empty",
            ),
            (
                "NUL in context",
                |c| c.context = Some("a\0b".into()),
                "`context` contains a NUL",
            ),
            (
                "NUL in the version",
                |c| c.document_version = "\0".into(),
                "`document_version` contains a NUL",
            ),
            (
                "zero tokens",
                |c| c.max_output_tokens = Some(0),
                "`max_output_tokens` is 0",
            ),
            (
                "too many tokens",
                |c| c.max_output_tokens = Some(MAX_OUTPUT_TOKENS + 1),
                "`max_output_tokens` is 1000001",
            ),
        ];
        for (what, break_it, expected) in cases {
            let mut body = create();
            break_it(&mut body);
            let refused = check_inputs(&body, 1000).expect_err(what).detail;
            assert!(refused.starts_with(expected), "{what}: {refused}");
        }
    }

    #[test]
    fn the_prompt_limit_counts_message_and_context() {
        // "What changed?" (13) + "Be brief." (9) = 22 bytes.
        assert_eq!(check_inputs(&create(), 22), Ok(()));
        let refused = check_inputs(&create(), 21).unwrap_err().detail;
        assert!(
            refused.contains("22 bytes, over the limit of 21 (worker.max_prompt_bytes)"),
            "{refused}"
        );
    }

    #[test]
    fn a_field_over_its_bound_is_refused_naming_it_and_at_the_bound_taken() {
        type Case = (&'static str, fn(&mut CreateReply, String), usize);
        let cases: [Case; 3] = [
            (
                "conversation_id",
                |c, text| c.conversation_id = text,
                MAX_CONVERSATION_ID_BYTES,
            ),
            (
                "document_version",
                |c, text| c.document_version = text,
                MAX_DOCUMENT_VERSION_BYTES,
            ),
            ("model", |c, text| c.model = Some(text), MAX_MODEL_BYTES),
        ];
        for (field, set, limit) in cases {
            let mut body = create();
            set(&mut body, "é".repeat(limit / 2));
            assert_eq!(check_inputs(&body, 1000), Ok(()), "{field} at its bound");
            // One more byte: a bound in bytes, not characters.
            set(&mut body, format!("{}x", "é".repeat(limit / 2)));
            let refused = check_inputs(&body, 1000).expect_err(field);
            assert_eq!(refused.fields, [field]);
            assert_eq!(
                refused.detail,
                format!(
                    "`{field}` is {} bytes, over the limit of {limit} bytes",
                    limit + 1
                )
            );
        }
    }

    #[test]
    fn only_a_json_object_is_a_body_and_its_refusals_stay() {
        let parse = |text: &str| {
            serde_json::from_str::<JsonObject<CreateReply>>(text)
                .map(|JsonObject(c)| c.conversation_id)
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            parse(r#"{"conversation_id":"c","message":"m"}"#),
            Ok("c".to_owned())
        );
        for not_an_object in [r#"["c","hello","v1",null,null,64]"#, r#""c""#, "7", "null"] {
            let refused = parse(not_an_object).unwrap_err();
            assert!(refused.contains("expected a JSON object"), "{refused}");
        }
        let duplicate = parse(r#"{"conversation_id":"a","conversation_id":"b","message":"m"}"#);
        assert!(
            duplicate
                .unwrap_err()
                .contains("duplicate field `conversation_id`")
        );
        let unknown = parse(r#"{"conversation_id":"a","message":"m","x":1}"#);
        assert!(unknown.unwrap_err().contains("unknown field `x`"));
    }

    #[test]
    fn a_record_over_the_limit_is_refused_naming_its_largest_field() {
        let submission = |message: &str, context: Option<&str>| Submission {
            workspace_id: "acme".into(),
            operation: Operation::CreateReply,
            key: IdempotencyKey::parse(Some(b"k")).unwrap(),
            inputs: BoundInputs {
                conversation_id: "conv-1".into(),
                message: message.into(),
                document_version: "v7".into(),
                model: None,
                context: context.map(str::to_owned),
                max_output_tokens: None,
                source_task: None,
                kept_replies: None,
            },
            max_attempts: 3,
            retention: chrono::TimeDelta::hours(1),
            existing_message: None,
            quota: replyd_core::quota::QuotaSettings::default().policy(),
            traceparent: None,
            verdict: Ok(Admitted {
                max_output_tokens: None,
                token_ceiling: 0,
            }),
            history: Ok(Vec::new()),
            end_user: None,
        };
        let small = submission("q", Some("c"));
        let size = task_spec(&small, TaskId::new_random(), uuid::Uuid::new_v4()).record_bytes();
        assert_eq!(
            check_record_size(&small, size),
            Ok(()),
            "exactly at the limit"
        );
        let refused = check_record_size(&small, size - 1).unwrap_err();
        assert_eq!(refused.fields, ["conversation_id"], "{}", refused.detail);
        let long_context = submission("q", Some(&"c".repeat(100)));
        let refused = check_record_size(&long_context, size).unwrap_err();
        assert_eq!(refused.fields, ["context"]);
        assert!(
            refused.detail.contains("over kafka.max_record_bytes")
                && refused.detail.contains("`context` (100 bytes)"),
            "{}",
            refused.detail
        );
    }
}
