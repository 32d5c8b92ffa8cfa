//! The HTTP plumbing every adapter shares: one way to build the client (no retries, no
//! redirects) and what each adapter holds of the settings ([`ApiClient`]), to name an endpoint,
//! to set the key, idempotency and extra headers, to read a success answer, and to turn a failed
//! exchange into a [`ProviderError`]. Sharing it keeps the adapters from drifting apart on the
//! question that matters to the caller: may the provider have run the request (I6, I7)?

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderName, HeaderValue};
use reqwest::{Client, RequestBuilder, Response, StatusCode, Url};

use super::base_url::BaseUrl;
use super::settings::ProviderSettings;
use replyd_core::provider::classify::classify_status_at;
use replyd_core::provider::{GenerationRequest, ProviderError, RateSignals};
use replyd_core::secret::Secret;

/// Why an adapter could not be built from its settings.
#[derive(Debug, thiserror::Error)]
pub enum AdapterBuildError {
    #[error("provider base_url `{base_url}` cannot be used: {reason}")]
    BadBaseUrl { base_url: String, reason: String },
    /// Names the header and the rule, never its value.
    #[error("provider.extra_headers: {0}")]
    BadExtraHeader(String),
    #[error("provider.anthropic_version {version:?} cannot be an anthropic-version header")]
    BadAnthropicVersion { version: String },
    #[error("building the HTTP client: {0}")]
    Client(#[from] reqwest::Error),
}

/// What every adapter holds of the settings to reach its API, built alike: the client, the URL
/// of the API's path, the key, the extra headers, the model of a request that names none, and
/// the time limits.
#[derive(Debug, Clone)]
pub(crate) struct ApiClient {
    pub client: Client,
    /// The URL of the API's path: what a call is posted to.
    pub endpoint: Url,
    api_key: Option<Secret>,
    extra_headers: HeaderMap,
    /// `provider.default_model`.
    pub default_model: String,
    pub request_timeout: Duration,
    /// `provider.stream`, as the worker decided it.
    pub stream: bool,
    pub stream_idle: Duration,
}

impl ApiClient {
    /// The client of the API at `path` (`/chat/completions`, `/messages`, `/responses`); fails
    /// on a base URL or an extra header the settings' check refuses.
    pub fn new(settings: &ProviderSettings, path: &str) -> Result<Self, AdapterBuildError> {
        let endpoint = endpoint(settings, path)?;
        Ok(Self {
            client: build_client(settings)?,
            endpoint,
            api_key: settings.api_key.clone(),
            extra_headers: extra_headers(settings)?,
            default_model: settings.default_model.clone(),
            request_timeout: Duration::from_millis(settings.request_timeout_ms),
            stream: settings.streamed(),
            stream_idle: Duration::from_millis(settings.stream_idle_timeout_ms),
        })
    }

    /// The model asked for: the request's, or `provider.default_model` when it names none.
    pub fn model<'a>(&'a self, request: &'a GenerationRequest) -> &'a str {
        if request.model.is_empty() {
            &self.default_model
        } else {
            &request.model
        }
    }

    /// `builder` with what every request carries, in the order it has always gone out: the
    /// extra headers, the idempotency key (a create's; a read has none), the API's key as
    /// `key_headers` sets it, the trace context.
    pub fn headers(
        &self,
        builder: RequestBuilder,
        idempotency_key: Option<&str>,
        key_headers: impl FnOnce(
            RequestBuilder,
            Option<&Secret>,
        ) -> Result<RequestBuilder, ProviderError>,
    ) -> Result<RequestBuilder, ProviderError> {
        let builder = with_extra_headers(builder, &self.extra_headers);
        let builder = match idempotency_key {
            Some(key) => with_idempotency_key(builder, key)?,
            None => builder,
        };
        let builder = key_headers(builder, self.api_key.as_ref())?;
        Ok(with_trace_context(builder))
    }
}

/// Sends the request once, an error of the exchange mapped by [`transport_error`] under `limit`.
pub(crate) async fn send(
    builder: RequestBuilder,
    limit: Duration,
) -> Result<Response, ProviderError> {
    builder.send().await.map_err(|e| transport_error(e, limit))
}

/// An answer's body, an error reading it mapped by [`transport_error`] under `limit`.
pub(crate) async fn body(response: Response, limit: Duration) -> Result<Bytes, ProviderError> {
    response
        .bytes()
        .await
        .map_err(|e| transport_error(e, limit))
}

/// A success answer read whole: its status, what its headers say of capacity (carried by the
/// generation read from it), and its body.
pub(crate) async fn success(
    response: Response,
    limit: Duration,
) -> Result<(StatusCode, RateSignals, Bytes), ProviderError> {
    let status = response.status();
    let signals = RateSignals::read(response.headers(), SystemTime::now());
    Ok((status, signals, body(response, limit).await?))
}

/// A pure classification of a non-success answer (status, headers, start of the body, now):
/// each API's own, [`classify_status_at`] for OpenAI's.
pub(crate) type Classify = fn(StatusCode, &HeaderMap, &str, SystemTime) -> ProviderError;

/// Most bytes of a non-success body kept for the error message.
const MAX_ERROR_BODY_BYTES: usize = 4 * 1024;

/// A client that sends each request once: reqwest's retry policy is off and redirects are not
/// followed, because re-sending is the caller's decision (I7). With no retry allowed, reqwest
/// also keeps no copy of each request (its headers and extensions) for a retry that cannot come.
pub(crate) fn build_client(settings: &ProviderSettings) -> Result<Client, reqwest::Error> {
    Client::builder()
        .connect_timeout(Duration::from_millis(settings.connect_timeout_ms))
        .timeout(Duration::from_millis(settings.request_timeout_ms))
        .redirect(reqwest::redirect::Policy::none())
        .retry(reqwest::retry::never().max_retries_per_request(0))
        .build()
}

/// The URL of the API's `path` (`/chat/completions`, `/responses`, `/messages`, `/models`) on
/// `provider.base_url` ([`BaseUrl`]), refusing a base URL the settings' check refuses.
pub(crate) fn endpoint(settings: &ProviderSettings, path: &str) -> Result<Url, AdapterBuildError> {
    BaseUrl::parse(&settings.base_url)
        .map(|base| base.api_url(path))
        .map_err(|reason| AdapterBuildError::BadBaseUrl {
            base_url: settings.base_url.clone(),
            reason,
        })
}

/// `provider.extra_headers` ready to send, refused as the settings' check refuses them.
pub(crate) fn extra_headers(settings: &ProviderSettings) -> Result<HeaderMap, AdapterBuildError> {
    settings
        .extra_header_map()
        .map_err(AdapterBuildError::BadExtraHeader)
}

/// Adds the extra headers. Replyd's own are refused as extra headers, so none is sent twice.
pub(crate) fn with_extra_headers(builder: RequestBuilder, extra: &HeaderMap) -> RequestBuilder {
    if extra.is_empty() {
        builder
    } else {
        builder.headers(extra.clone())
    }
}

/// Adds `Idempotency-Key: <key>`; a key that cannot be a header value is refused before sending.
pub(crate) fn with_idempotency_key(
    builder: RequestBuilder,
    key: &str,
) -> Result<RequestBuilder, ProviderError> {
    let value = HeaderValue::from_str(key).map_err(|_| ProviderError::Fatal {
        status: 0,
        message: "idempotency key is not a valid header value; request not sent".into(),
    })?;
    Ok(builder.header("Idempotency-Key", value))
}

/// Adds `Authorization: Bearer <key>` when a key is configured.
pub(crate) fn with_api_key(
    builder: RequestBuilder,
    api_key: Option<&Secret>,
) -> Result<RequestBuilder, ProviderError> {
    with_key_header(builder, api_key, AUTHORIZATION, "Bearer ")
}

/// Adds `name: <scheme><key>` when a key is configured, kept out of any debug output of the
/// request; a key that cannot be a header value is refused before sending.
pub(crate) fn with_key_header(
    builder: RequestBuilder,
    api_key: Option<&Secret>,
    name: HeaderName,
    scheme: &str,
) -> Result<RequestBuilder, ProviderError> {
    let Some(api_key) = api_key else {
        return Ok(builder);
    };
    let mut value =
        HeaderValue::from_str(&format!("{scheme}{}", api_key.expose())).map_err(|_| {
            ProviderError::Fatal {
                status: 0,
                message: "API key is not a valid header value; request not sent".into(),
            }
        })?;
    // Keeps the key out of any debug output of the request (hyper and reqwest honour it).
    value.set_sensitive(true);
    Ok(builder.header(name, value))
}

/// Adds the current span's `traceparent` (the worker's provider-call span), so the
/// provider's own traces join the task's; nothing when traces are off.
pub(crate) fn with_trace_context(builder: RequestBuilder) -> RequestBuilder {
    let mut headers = reqwest::header::HeaderMap::new();
    crate::telemetry::trace::inject_current(&mut headers);
    builder.headers(headers)
}

/// Maps an error of the exchange to what it means for the caller; `timeout` is the limit the
/// request ran under, named in the message.
pub(crate) fn transport_error(error: reqwest::Error, timeout: Duration) -> ProviderError {
    let message = describe(&error);
    if error.is_connect() {
        // Includes connect timeouts: no byte of the request left this process.
        ProviderError::NotSent { message }
    } else if error.is_timeout() {
        ProviderError::Ambiguous {
            message: format!("no answer within {} ms: {message}", timeout.as_millis()),
        }
    } else {
        // Reset, closed or broken after the request was (maybe partly) written.
        ProviderError::Ambiguous { message }
    }
}

/// Classifies a non-success answer from its status, headers and the start of its body, as
/// OpenAI's APIs mean them.
pub(crate) async fn status_error(response: Response) -> ProviderError {
    status_error_as(response, classify_status_at).await
}

/// [`status_error`] with an API's own classification.
pub(crate) async fn status_error_as(response: Response, classify: Classify) -> ProviderError {
    let status = response.status();
    let headers = response.headers().clone();
    // The status already decides the class; a body that fails to arrive only costs us the
    // provider's message.
    let snippet = match response.bytes().await {
        Ok(bytes) => {
            let cut = bytes.len().min(MAX_ERROR_BODY_BYTES);
            String::from_utf8_lossy(&bytes[..cut]).into_owned()
        }
        Err(_) => String::new(),
    };
    classify(status, &headers, &snippet, SystemTime::now())
}

/// The error and its causes on one line: reqwest's own `Display` hides the cause (refused,
/// reset, timed out) that an operator needs.
fn describe(error: &reqwest::Error) -> String {
    let mut text = error.to_string();
    let mut source = std::error::Error::source(error);
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}
