//! The provider vocabulary: what one call asks ([`GenerationRequest`]), what it brings back
//! ([`Generation`], [`Usage`]), and why it brought nothing ([`ProviderError`]), split along the
//! line the caller decides by: whether the provider may have done (and billed) the work. The
//! adapters that speak HTTP to a provider live in the service (`replyd::provider`); what an
//! answer's status and headers mean is decided here, in [`classify`] and [`signals`], so that
//! the retry policy, the pacing and the mock provider's tests read one set of rules.

pub mod classify;
pub mod signals;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::domain::{ChatMessage, ProviderRan, TaskSpec};

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
    /// The adapter is a background provider (`replyd::provider::BackgroundProvider`): store
    /// the [`OperationId`] that `start` returned and `wait` on it again.
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
