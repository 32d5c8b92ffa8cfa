//! One call to an API that answers each request with its reply (chat completions, Messages):
//! the body posted once with what every request carries, a refusal classified as the API means
//! it, and the reply read whole or from its event stream with the answer's rate signals. The
//! adapters of such APIs share these steps, so they cannot drift apart on what a failure means
//! (I6, I7); each says only what its API makes different, as a [`Dialect`]. The background
//! adapter, whose call is an operation with an id, uses the plumbing in `http` directly.

use reqwest::{RequestBuilder, Response, StatusCode};
use serde::Serialize;

use super::adapter::{Provider, TextSink};
use super::http::{ApiClient, Classify, send, status_error_as, success, with_api_key};
use super::stream::{self, StreamFold};
use replyd_core::provider::{Generation, GenerationRequest, ProviderError, Recovery};
use replyd_core::secret::Secret;

/// A pure reading of a success body (status, body, the model asked for) as a generation, the
/// model asked for standing in for one the body does not name.
pub(crate) type Parse = fn(StatusCode, &[u8], &str) -> Result<Generation, ProviderError>;

/// What an API makes different about one call: its name, what it offers after an ambiguous
/// call, the body it takes, the headers its key goes in, how it means a refusal, and how its
/// answer reads. Every dialect is a [`Provider`] by the steps below.
pub(crate) trait Dialect: Send + Sync {
    /// [`Provider::name`].
    const NAME: &'static str;
    /// [`Provider::recovery`]; by default the idempotency key, as the trait's.
    const RECOVERY: Recovery = Recovery::IdempotencyKey;
    /// The classification of a non-success answer.
    const CLASSIFY: Classify;
    /// The reading of a success body that is the whole reply.
    const PARSE: Parse;
    /// A fresh reading of the event stream of a reply asked of the model given.
    const FOLD: fn(&str) -> Self::Fold;

    /// The request's body on the wire.
    type Body<'a>: Serialize + Send + Sync
    where
        Self: 'a;
    /// The reading of the API's event stream.
    type Fold: StreamFold;

    /// The client, endpoint and settings the calls go out with.
    fn api(&self) -> &ApiClient;

    /// The body asking `model` for `request`'s reply, streamed when `streamed`.
    fn body<'a>(
        &'a self,
        request: &'a GenerationRequest,
        model: &'a str,
        streamed: bool,
    ) -> Self::Body<'a>;

    /// `builder` with the API's key (and whatever header goes with it), when one is set; by
    /// default `Authorization: Bearer`, as OpenAI's APIs take it.
    fn key_headers(
        &self,
        builder: RequestBuilder,
        api_key: Option<&Secret>,
    ) -> Result<RequestBuilder, ProviderError> {
        with_api_key(builder, api_key)
    }
}

#[async_trait::async_trait]
impl<D: Dialect> Provider for D {
    async fn generate(&self, request: &GenerationRequest) -> Result<Generation, ProviderError> {
        generate(self, request).await
    }

    async fn generate_streamed(
        &self,
        request: &GenerationRequest,
        sink: &dyn TextSink,
    ) -> Result<Generation, ProviderError> {
        generate_streamed(self, request, sink).await
    }

    fn name(&self) -> &str {
        D::NAME
    }

    fn recovery(&self) -> Recovery {
        D::RECOVERY
    }
}

/// One request for the whole reply: [`Provider::generate`].
async fn generate<D: Dialect>(
    dialect: &D,
    request: &GenerationRequest,
) -> Result<Generation, ProviderError> {
    let api = dialect.api();
    let model = api.model(request);
    let response = post(dialect, request, model, false).await?;
    let (status, signals, bytes) = success(response, api.request_timeout).await?;
    let mut generation = D::PARSE(status, &bytes, model)?;
    generation.rate_signals = signals;
    Ok(generation)
}

/// One request for the reply streamed to `sink` as it is written, when `provider.stream` is
/// on (else [`generate`]): [`Provider::generate_streamed`]. A server that answers the whole
/// reply instead is read as [`generate`] reads it.
async fn generate_streamed<D: Dialect>(
    dialect: &D,
    request: &GenerationRequest,
    sink: &dyn TextSink,
) -> Result<Generation, ProviderError> {
    let api = dialect.api();
    if !api.stream {
        return generate(dialect, request).await;
    }
    let model = api.model(request);
    let response = post(dialect, request, model, true).await?;
    stream::answer(
        response,
        D::FOLD(model),
        sink,
        api.stream_idle,
        api.request_timeout,
        |status, bytes| D::PARSE(status, bytes, model),
    )
    .await
}

/// Posts the body with the extra, idempotency, key and trace headers; a non-success answer is
/// the error the API's classification makes of it.
async fn post<D: Dialect>(
    dialect: &D,
    request: &GenerationRequest,
    model: &str,
    streamed: bool,
) -> Result<Response, ProviderError> {
    let api = dialect.api();
    let body = dialect.body(request, model, streamed);
    let builder = api.client.post(api.endpoint.clone()).json(&body);
    let builder = api.headers(builder, Some(&request.idempotency_key), |builder, key| {
        dialect.key_headers(builder, key)
    })?;
    let response = send(builder, api.request_timeout).await?;
    if !response.status().is_success() {
        return Err(status_error_as(response, D::CLASSIFY).await);
    }
    Ok(response)
}
