//! The provider boundary: one LLM call, and a typed error that tells the caller what it may do
//! next. The vocabulary (the request, the generation, [`ProviderError`](replyd_core::provider::ProviderError) and what an answer's
//! status and headers mean) is `replyd_core::provider`; the adapters that speak HTTP are here.
//!
//! A [`Provider`] makes exactly one HTTP request per [`Provider::generate`] call and never
//! retries: retries, their budget (I7) and the recovery of ambiguous calls belong to the caller,
//! which is the only place that knows how many attempts a task has left. What the caller needs to
//! decide is whether the provider may have done (and billed) the work, so [`ProviderError`](replyd_core::provider::ProviderError) is
//! split along that line: [`ProviderError::NotSent`](replyd_core::provider::ProviderError::NotSent) surely did nothing,
//! [`ProviderError::MaybeExecuted`](replyd_core::provider::ProviderError::MaybeExecuted) and [`ProviderError::Ambiguous`](replyd_core::provider::ProviderError::Ambiguous) may have. Every request
//! carries the task id as its idempotency key, so a provider that honours the key answers a
//! retried call with the first call's reply instead of generating (and billing) a second (I6).
//!
//! Cancellation is by dropping the future returned by `generate`: the caller selects it against
//! its cancellation signal, and dropping it aborts the in-flight HTTP request.
//!
//! Some providers can do better than an idempotency key after an ambiguous call: a
//! [`BackgroundProvider`] splits the call into [`BackgroundProvider::start`], which returns an
//! [`OperationId`](replyd_core::provider::OperationId) as soon as the provider has accepted the work, and
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

pub mod access;
mod adapter;
pub mod anthropic;
pub mod base_url;
mod call;
mod generation;
mod http;
pub mod openai;
pub mod responses;
pub mod settings;
mod sse;
mod stream;

use std::sync::Arc;

pub use adapter::{BackgroundProvider, Provider, TextSink};

pub use anthropic::AnthropicMessagesProvider;
pub use http::AdapterBuildError;
pub use openai::OpenAiChatProvider;
pub use responses::OpenAiResponsesProvider;
pub use settings::{ProviderApi, ProviderSettings, Streaming};

/// The adapter `settings.api` names, behind the one trait the caller holds.
pub fn build_provider(settings: &ProviderSettings) -> Result<Arc<dyn Provider>, AdapterBuildError> {
    Ok(match settings.api {
        ProviderApi::ChatCompletions => Arc::new(OpenAiChatProvider::new(settings)?),
        ProviderApi::BackgroundResponses => Arc::new(OpenAiResponsesProvider::new(settings)?),
        ProviderApi::AnthropicMessages => Arc::new(AnthropicMessagesProvider::new(settings)?),
    })
}
