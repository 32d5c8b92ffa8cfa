//! The seam every adapter fills: [`Provider`] (one call, no retries) and, for a provider that
//! runs a generation as an operation with an id, [`BackgroundProvider`]. The caller holds one
//! `Arc<dyn Provider>` whatever the adapter (see the room's face, `super`).

use replyd_core::provider::{
    Generation, GenerationRequest, OperationId, ProviderError, Recovery, Usage,
};

/// Where a streamed call's text goes as it arrives: the worker forwards it to the task's
/// followers. A hint only: what is saved is the generation the call returns.
pub trait TextSink: Send + Sync {
    /// The next piece of the reply's text, in order.
    fn text(&self, delta: &str);
    /// The usage the provider reported so far (a cut stream keeps the last one).
    fn usage(&self, _usage: Usage) {}
}

/// An LLM provider. Implementations make one request per call and never retry.
#[async_trait::async_trait]
pub trait Provider: Send + Sync {
    /// Asks for one reply. Dropping the returned future aborts the request.
    async fn generate(&self, request: &GenerationRequest) -> Result<Generation, ProviderError>;

    /// Asks for one reply, streamed when the adapter and `provider.stream` allow: its text goes
    /// to `sink` as it is written, and the whole reply is returned as from `generate`. The
    /// default asks for the whole reply at once.
    async fn generate_streamed(
        &self,
        request: &GenerationRequest,
        _sink: &dyn TextSink,
    ) -> Result<Generation, ProviderError> {
        self.generate(request).await
    }

    /// Short stable name for logs and metrics (`"openai"`).
    fn name(&self) -> &str;

    /// What this adapter can do about an ambiguous call. The default fits adapters that send
    /// the task id as `Idempotency-Key`, as `OpenAiChatProvider` does.
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

    /// [`BackgroundProvider::wait`], with the operation's text sent to `sink` from its start
    /// as it is written, where the provider streams it. The default waits without streaming.
    async fn wait_streamed(
        &self,
        operation: &OperationId,
        _sink: &dyn TextSink,
    ) -> Result<Generation, ProviderError> {
        self.wait(operation).await
    }

    /// One look at `operation`, without waiting: its generation when it is done, `None` while
    /// it is queued or running. Errors as `wait`'s (`OperationGone` for an unknown one).
    async fn look_up(&self, operation: &OperationId) -> Result<Option<Generation>, ProviderError>;
}
