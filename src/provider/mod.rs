//! The provider boundary: one LLM call, and a typed error that tells the caller what it may do
//! next.
//!
//! A [`Provider`] makes exactly one HTTP request per [`Provider::generate`] call and never
//! retries: retries, their budget (I7) and the recovery of ambiguous calls belong to the caller,
//! which is the only place that knows how many attempts a task has left. What the caller needs to
//! decide is whether the provider may have done (and billed) the work, so [`ProviderError`] is
//! split along that line: [`ProviderError::NotSent`] surely did nothing,
//! [`ProviderError::MaybeExecuted`] and [`ProviderError::Ambiguous`] may have. Every request
//! carries the task id as its idempotency key, so a provider that honours the key answers a
//! retried call with the first call's reply instead of generating (and billing) a second (I6).
//!
//! Cancellation is by dropping the future returned by `generate`: the caller selects it against
//! its cancellation signal, and dropping it aborts the in-flight HTTP request.
//!
//! Some providers can do better than an idempotency key after an ambiguous call: a
//! [`BackgroundProvider`] splits the call into [`BackgroundProvider::start`], which returns an
//! [`OperationId`] as soon as the provider has accepted the work, and
//! [`BackgroundProvider::wait`], which can be called again, by any process, with the stored id
//! instead of generating a second time (I6). [`Provider::recovery`] says which of these an
//! adapter offers, and [`Provider::as_background`] hands out the capability, so the caller can
//! hold one `Arc<dyn Provider>` whatever the adapter. [`build_provider`] picks the adapter from
//! the settings: OpenAI chat completions, OpenAI background responses, or Anthropic's Messages
//! API (which offers no recovery at all).
//!
//! Every answer, a reply or a refusal, carries the provider's own word on its capacity
//! ([`RateSignals`]: what is left of each limit, when it resets, how long to wait), so a caller
//! can pace itself by it (I9) without reading headers.

pub mod anthropic;
pub mod classify;
mod http;
pub mod openai;
pub mod responses;
pub mod settings;
pub mod signals;

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{ChatMessage, ProviderRan, TaskSpec};

pub use anthropic::AnthropicMessagesProvider;
pub use classify::classify_status;
pub use openai::{OpenAiBuildError, OpenAiChatProvider};
pub use responses::OpenAiResponsesProvider;
pub use settings::{OpenAiSettings, ProviderApi};
pub use signals::{RateSignals, RateWindow};

/// One call to make: what to ask, and the key under which the provider deduplicates it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GenerationRequest {
    /// The task id. Sent as `Idempotency-Key`, so every attempt of one task is one logical
    /// request to the provider (I6).
    pub idempotency_key: String,
    /// Model name, already resolved (never empty when built by [`GenerationRequest::for_task`]).
    pub model: String,
    pub messages: Vec<ChatMessage>,
    /// Upper bound on the reply's length in tokens; `None` leaves it to the provider.
    pub max_output_tokens: Option<u32>,
}

impl GenerationRequest {
    /// The request for `task`, with `default_model` standing in when the record names none.
    pub fn for_task(task: &TaskSpec, default_model: &str) -> Self {
        Self {
            idempotency_key: task.task_id.to_string(),
            model: task
                .request
                .model
                .clone()
                .unwrap_or_else(|| default_model.to_owned()),
            messages: task.request.messages.clone(),
            max_output_tokens: task.request.max_output_tokens,
        }
    }
}

/// A reply the provider produced.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Generation {
    pub text: String,
    /// The model that answered, as the provider names it (may differ from the one asked for).
    pub model: String,
    pub usage: Option<Usage>,
    /// The provider's id of the response (OpenAI's `id`), kept for support and audits.
    pub provider_response_id: Option<String>,
    /// What the answer that carried the reply said about the provider's capacity (empty when
    /// it said nothing).
    #[serde(default)]
    pub rate_signals: RateSignals,
}

/// Tokens a generation cost, as the provider reports them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub prompt_tokens: u32,
    pub completion_tokens: u32,
}

/// What an adapter can do to recover the reply of a call whose outcome it did not learn
/// (`Ambiguous`, `MaybeExecuted`), instead of paying for a second generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Recovery {
    /// Nothing: a retry may generate (and bill) a second reply.
    None,
    /// A retry sends the same `Idempotency-Key`; a provider that honours it answers with the
    /// first reply.
    IdempotencyKey,
    /// The adapter is a [`BackgroundProvider`]: store the [`OperationId`] that `start` returned
    /// and `wait` on it again.
    OperationId,
}

/// The provider's id of a background operation (OpenAI's response id, `resp_...`). Store it
/// durably between `start` and `wait`: it is what lets any later attempt pick up the reply.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct OperationId(pub String);

impl std::fmt::Display for OperationId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// An LLM provider. Implementations make one request per call and never retry.
#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// Asks for one reply. Dropping the returned future aborts the request.
    async fn generate(&self, request: &GenerationRequest) -> Result<Generation, ProviderError>;

    /// Short stable name for logs and metrics (`"openai"`).
    fn name(&self) -> &str;

    /// What this adapter can do about an ambiguous call. The default fits adapters that send
    /// the task id as `Idempotency-Key`, as [`OpenAiChatProvider`] does.
    fn recovery(&self) -> Recovery {
        Recovery::IdempotencyKey
    }

    /// This adapter as a [`BackgroundProvider`], when it is one.
    fn as_background(&self) -> Option<&dyn BackgroundProvider> {
        None
    }
}

/// A provider that runs a generation as a background operation with an id, so an attempt that
/// lost track of a call can find its reply again instead of generating another (I6).
///
/// Errors, for the caller's decision. From `start`: the same classes as
/// [`Provider::generate`]; an `Ambiguous` create may have started an operation whose id we never
/// saw, and re-sending `start` with the same idempotency key finds it on a provider that honours
/// the key. From `wait`:
/// - a failed poll (`NotSent`, `Retryable`, `Ambiguous`, `MaybeExecuted` with a 5xx status,
///   `MalformedResponse`) leaves the operation id valid: `wait` may be called again;
/// - `OperationGone`: the operation is gone (unknown id, cancelled, expired); only a new
///   `start` can produce a reply;
/// - the operation's own failure carries status 200, the status of the poll that reported it:
///   `MaybeExecuted { status: 200, .. }` when the provider calls it a server error (a new
///   `start` may be billed again), else `Fatal { status: 200, .. }`.
#[async_trait::async_trait]
pub trait BackgroundProvider: Provider {
    /// Creates the background operation and returns its id as soon as the provider has
    /// accepted it, without waiting for the generation. The request's idempotency key is sent
    /// with the create.
    async fn start(&self, request: &GenerationRequest) -> Result<OperationId, ProviderError>;

    /// Polls `operation` until it reaches a terminal status and returns its generation. A
    /// `failed` operation is `Fatal` with the provider's message, or `MaybeExecuted` when the
    /// provider says the failure was a server error; a cancelled, expired or unknown one is
    /// `OperationGone`. Dropping the future stops the polling.
    async fn wait(&self, operation: &OperationId) -> Result<Generation, ProviderError>;

    /// One look at `operation`, without waiting: its generation when it is done, `None` while
    /// it is queued or running. Errors as `wait`'s (`OperationGone` for an unknown one).
    async fn look_up(&self, operation: &OperationId) -> Result<Option<Generation>, ProviderError>;
}

/// The adapter `settings.api` names, behind the one trait the caller holds.
pub fn build_provider(settings: &OpenAiSettings) -> Result<Arc<dyn Provider>, OpenAiBuildError> {
    Ok(match settings.api {
        ProviderApi::ChatCompletions => Arc::new(OpenAiChatProvider::new(settings)?),
        ProviderApi::BackgroundResponses => Arc::new(OpenAiResponsesProvider::new(settings)?),
        ProviderApi::AnthropicMessages => Arc::new(AnthropicMessagesProvider::new(settings)?),
    })
}

/// Why a call produced no reply, split by what the caller may do next. `kind()` is the stable
/// label for metrics and the attempt history.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProviderError {
    /// The request never reached the provider (connection refused, DNS failure, connect
    /// timeout): surely not executed, safe to retry.
    #[error("request not sent: {message}")]
    NotSent { message: String },
    /// The provider refused the request for now (429, 503, Anthropic's 529) and did not
    /// execute it; retry, no sooner than `retry_after` when it says so. `signals` is what the
    /// refusal said about the provider's capacity (boxed: it is large, and errors travel far).
    #[error("provider asked to retry (status {status}, retry after {retry_after:?}): {message}")]
    Retryable {
        status: u16,
        retry_after: Option<Duration>,
        signals: Box<RateSignals>,
        message: String,
    },
    /// The provider failed after accepting the request (500, 502, 504): it may have generated
    /// (and billed) a reply that we never saw.
    #[error("provider failed and may have executed the request (status {status}): {message}")]
    MaybeExecuted { status: u16, message: String },
    /// The request was sent but no complete answer came back (timeout, connection reset, broken
    /// body): the provider may have executed it.
    #[error("no complete answer to a sent request: {message}")]
    Ambiguous { message: String },
    /// The provider will never accept this request (400, 401, 403, 404, 422, a content refusal).
    /// `status` is the HTTP status seen, or 0 when the request was refused before sending.
    #[error("provider refused the request (status {status}): {message}")]
    Fatal { status: u16, message: String },
    /// A success status whose body is not a completion (or response object) with a reply in it.
    #[error("malformed provider response: {message}")]
    MalformedResponse { message: String },
    /// A background operation the provider no longer has (unknown id, cancelled, expired):
    /// nothing runs for it, and only a new `start` can produce a reply.
    #[error("operation {operation} is gone: {why}; start a new one")]
    OperationGone { operation: String, why: String },
    /// A background operation the provider still reports as queued or running after the
    /// longest wait replyd allows (`provider.operation_max_wait_ms`). It may still finish (and
    /// be billed): waiting longer is not a new attempt, and starting another would pay twice.
    #[error(
        "operation {operation} still running after {waited_ms} ms (provider.operation_max_wait_ms); it may still finish"
    )]
    StillRunning { operation: String, waited_ms: u64 },
}

impl ProviderError {
    /// Whether the call that failed this way may have done (and billed) work at the provider:
    /// a sent request whose answer was lost or broken, a server error after the provider took
    /// it, a success whose body we could not read. A refusal (429, a 4xx), a request that never
    /// left and an operation the provider no longer has did none.
    pub fn ran(&self) -> ProviderRan {
        match self {
            ProviderError::MaybeExecuted { .. }
            | ProviderError::Ambiguous { .. }
            | ProviderError::MalformedResponse { .. }
            | ProviderError::StillRunning { .. } => ProviderRan::Maybe,
            ProviderError::NotSent { .. }
            | ProviderError::Retryable { .. }
            | ProviderError::Fatal { .. }
            | ProviderError::OperationGone { .. } => ProviderRan::No,
        }
    }

    /// Short stable label for metrics and the attempt history.
    pub fn kind(&self) -> &'static str {
        match self {
            ProviderError::NotSent { .. } => "not_sent",
            ProviderError::Retryable { .. } => "retryable",
            ProviderError::MaybeExecuted { .. } => "maybe_executed",
            ProviderError::Ambiguous { .. } => "ambiguous",
            ProviderError::Fatal { .. } => "fatal",
            ProviderError::MalformedResponse { .. } => "malformed_response",
            ProviderError::OperationGone { .. } => "operation_gone",
            ProviderError::StillRunning { .. } => "still_running",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{ProviderRequest, Role, TaskId};

    #[test]
    fn every_error_kind_has_a_distinct_label() {
        let errors = [
            ProviderError::NotSent { message: "".into() },
            ProviderError::Retryable {
                status: 429,
                retry_after: None,
                signals: Box::default(),
                message: "".into(),
            },
            ProviderError::MaybeExecuted {
                status: 500,
                message: "".into(),
            },
            ProviderError::Ambiguous { message: "".into() },
            ProviderError::Fatal {
                status: 400,
                message: "".into(),
            },
            ProviderError::MalformedResponse { message: "".into() },
            ProviderError::OperationGone {
                operation: "".into(),
                why: "".into(),
            },
            ProviderError::StillRunning {
                operation: "".into(),
                waited_ms: 0,
            },
        ];
        let mut labels: Vec<_> = errors.iter().map(ProviderError::kind).collect();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), errors.len());
    }

    #[test]
    fn a_task_without_a_model_is_asked_of_the_default_model_under_its_own_id() {
        let task = TaskSpec {
            task_id: TaskId::new_random(),
            workspace_id: "ws".into(),
            conversation_id: "c".into(),
            message_id: "m".into(),
            document_version: String::new(),
            request: ProviderRequest {
                model: None,
                messages: vec![ChatMessage {
                    role: Role::User,
                    content: "hi".into(),
                }],
                max_output_tokens: Some(64),
            },
            max_attempts: 3,
            deadline: None,
        };
        let request = GenerationRequest::for_task(&task, "small-model");
        assert_eq!(request.idempotency_key, task.task_id.to_string());
        assert_eq!(request.model, "small-model");
        assert_eq!(request.max_output_tokens, Some(64));
    }
}
