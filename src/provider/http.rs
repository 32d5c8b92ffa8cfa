//! The HTTP plumbing every adapter shares: one way to build the client (no retries, no
//! redirects), to name an endpoint, to set the key, idempotency and extra headers, and to turn a
//! failed exchange into a [`ProviderError`]. Sharing it keeps the adapters from drifting apart on
//! the question that matters to the caller: may the provider have run the request (I6, I7)?

use std::time::{Duration, SystemTime};

use reqwest::header::{AUTHORIZATION, HeaderMap, HeaderValue};
use reqwest::{Client, RequestBuilder, Response, StatusCode, Url};

use super::base_url::BaseUrl;
use super::settings::ProviderSettings;
use replyd_core::provider::ProviderError;
use replyd_core::provider::classify::classify_status_at;
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

/// A pure classification of a non-success answer (status, headers, start of the body, now):
/// each API's own, [`classify_status_at`] for OpenAI's.
pub(crate) type Classify = fn(StatusCode, &HeaderMap, &str, SystemTime) -> ProviderError;

/// Most bytes of a non-success body kept for the error message.
const MAX_ERROR_BODY_BYTES: usize = 4 * 1024;

/// A client that sends each request once: reqwest's retry policy is off and redirects are not
/// followed, because re-sending is the caller's decision (I7).
pub(crate) fn build_client(settings: &ProviderSettings) -> Result<Client, reqwest::Error> {
    Client::builder()
        .connect_timeout(Duration::from_millis(settings.connect_timeout_ms))
        .timeout(Duration::from_millis(settings.request_timeout_ms))
        .redirect(reqwest::redirect::Policy::none())
        .retry(reqwest::retry::never())
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
    let Some(api_key) = api_key else {
        return Ok(builder);
    };
    let mut value =
        HeaderValue::from_str(&format!("Bearer {}", api_key.expose())).map_err(|_| {
            ProviderError::Fatal {
                status: 0,
                message: "API key is not a valid header value; request not sent".into(),
            }
        })?;
    // Keeps the key out of any debug output of the request (hyper and reqwest honour it).
    value.set_sensitive(true);
    Ok(builder.header(AUTHORIZATION, value))
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
