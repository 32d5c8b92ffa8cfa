//! The provider boundary: one LLM call, and a typed error that tells the caller what it may do
//! next. The vocabulary (the request, the generation, [`ProviderError`] and what an answer's
//! status and headers mean) is `replyd_core::provider`; the adapters that speak HTTP are here.
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
//! (`RateSignals`: what is left of each limit, when it resets, how long to wait), so a caller
//! can pace itself by it (I9) without reading headers.

pub mod anthropic;
mod http;
pub mod openai;
pub mod responses;
pub mod settings;

use std::sync::Arc;

use replyd_core::provider::{Generation, GenerationRequest, OperationId, ProviderError, Recovery};

pub use anthropic::AnthropicMessagesProvider;
pub use openai::{OpenAiBuildError, OpenAiChatProvider};
pub use responses::OpenAiResponsesProvider;
pub use settings::{OpenAiSettings, ProviderApi};

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
