//! [`OpenAiResponsesProvider`]: OpenAI's Responses API in background mode. `start` posts
//! `…/responses` (`https://api.openai.com/v1/responses`, [`super::base_url`]) with
//! `"background": true` and the task id as `Idempotency-Key`, and returns the response id at
//! once; `wait` polls `GET …/responses/{id}` (with the base URL's query) until the response is
//! done. The id is what makes an ambiguous call recoverable (I6): the caller stores
//! it, and any later attempt waits on it instead of generating again.
//!
//! Like the chat adapter, every request is sent once (no retries, no redirects, the shared
//! client in `http`): re-sending a create or a poll is the caller's decision (I7). The reading of
//! a response object is pure ([`parse_response`]) so each status is tested without a server.
//!
//! The adapter and its calls are here; beside them, each a leaf: `request` (the create's
//! body), `parse` (reading a response object, pure), `events` (reading a response's event
//! stream, pure) and `errors` (what a failure means for the operation).

mod errors;
mod events;
mod parse;
mod request;

use std::time::Duration;

use reqwest::{StatusCode, Url};
use tokio::time::Instant;

use super::adapter::TextSink;
use super::adapter::{BackgroundProvider, Provider};
use super::http::{AdapterBuildError, ApiClient, body, send, status_error, success, with_api_key};
use super::settings::ProviderSettings;
use super::stream::{self, Cut, StreamFold};
use errors::{gone, poll_may_be_retried};
use events::{NoText, ResponseStream};
use parse::{Polled, parse_created, parse_response};
use replyd_core::provider::{Generation, GenerationRequest, OperationId, ProviderError, Recovery};
use request::WireCreate;

/// The adapter. Cheap to share: hold it in an `Arc`; all calls share one connection pool. Holds
/// no state about operations, so a second instance (another worker, a restarted one) can `wait`
/// on an id the first one started.
#[derive(Debug, Clone)]
pub struct OpenAiResponsesProvider {
    /// With `provider.stream`, responses are created streamed, so their events can be read
    /// (and read again from any point) by whichever attempt waits on them.
    api: ApiClient,
    poll_interval: Duration,
    /// How long one `wait` keeps polling an operation that is not done yet.
    max_wait: Duration,
}

/// How often one streamed wait picks a broken stream up where it broke before it falls back
/// to polling.
const STREAM_RESUMES: u32 = 3;

impl OpenAiResponsesProvider {
    /// Builds the adapter; fails on a base URL or an extra header the settings' check refuses.
    pub fn new(settings: &ProviderSettings) -> Result<Self, AdapterBuildError> {
        Ok(Self {
            api: ApiClient::new(settings, "/responses")?,
            // A zero interval would poll as fast as the provider answers.
            poll_interval: Duration::from_millis(settings.poll_interval_ms.max(1)),
            max_wait: Duration::from_millis(settings.operation_max_wait_ms),
        })
    }

    /// The URL responses are created at; an operation lives at `{endpoint}/{id}`.
    pub fn endpoint(&self) -> &Url {
        &self.api.endpoint
    }

    fn operation_url(&self, operation: &OperationId) -> Result<Url, ProviderError> {
        if operation.0.is_empty() {
            return Err(gone(operation, "the operation id is empty"));
        }
        let mut url = self.api.endpoint.clone();
        // `new` only accepts http(s) URLs, which always have a path to extend.
        url.path_segments_mut()
            .expect("an http(s) URL has path segments")
            .push(&operation.0);
        Ok(url)
    }

    fn wire_request<'a>(&'a self, request: &'a GenerationRequest) -> WireCreate<'a> {
        request::create_body(request, self.api.model(request), self.api.stream)
    }

    /// One streamed read of `operation`'s events after `fold`'s last one, into `fold`.
    /// `Ok(false)`: the provider will not stream this response (created without `stream`), so
    /// only polling can wait on it.
    async fn stream_once(
        &self,
        operation: &OperationId,
        fold: &mut ResponseStream,
        sink: &dyn TextSink,
    ) -> Result<bool, Cut> {
        let fatal = |error| Cut {
            error,
            connection: false,
        };
        let mut url = self.operation_url(operation).map_err(fatal)?;
        url.query_pairs_mut().append_pair("stream", "true");
        if let Some(last) = fold.last_sequence {
            url.query_pairs_mut()
                .append_pair("starting_after", &last.to_string());
        }
        let builder = self.api.client.get(url);
        let builder = self
            .api
            .headers(builder, None, with_api_key)
            .map_err(fatal)?;
        let response = send(builder, self.api.request_timeout)
            .await
            .map_err(|error| Cut {
                error,
                connection: true,
            })?;
        let status = response.status();
        if status == StatusCode::BAD_REQUEST {
            return Ok(false);
        }
        if status.is_success() && !stream::is_event_stream(&response) {
            // A server that does not stream a response answers the object: polling reads it.
            return Ok(false);
        }
        if !status.is_success() {
            return Err(match status_error(response).await {
                ProviderError::Fatal {
                    status: 404,
                    message,
                } => fatal(gone(
                    operation,
                    &format!("the provider does not know it ({message})"),
                )),
                error => Cut {
                    connection: poll_may_be_retried(&error),
                    error,
                },
            });
        }
        stream::read(response, fold, sink, self.api.stream_idle).await?;
        Ok(true)
    }

    /// One poll: the response object as it is now.
    async fn poll(
        &self,
        url: &Url,
        operation: &OperationId,
        limit: Duration,
    ) -> Result<Polled, ProviderError> {
        let builder = self.api.client.get(url.clone()).timeout(limit);
        let builder = self.api.headers(builder, None, with_api_key)?;
        let response = send(builder, limit).await?;
        if !response.status().is_success() {
            return Err(match status_error(response).await {
                ProviderError::Fatal {
                    status: 404,
                    message,
                } => gone(
                    operation,
                    &format!("the provider does not know it ({message})"),
                ),
                other => other,
            });
        }
        let (status, signals, bytes) = success(response, limit).await?;
        Ok(
            match parse_response(status, &bytes, &self.api.default_model)? {
                // The reply carries what the poll that brought it said about capacity.
                Polled::Done(generation) => Polled::Done(Box::new(Generation {
                    rate_signals: signals,
                    ..*generation
                })),
                Polled::Pending => Polled::Pending,
            },
        )
    }
}

#[async_trait::async_trait]
impl Provider for OpenAiResponsesProvider {
    /// `start` then `wait`, for callers that do not store the operation id; a retry of such a
    /// call still finds the first operation through the idempotency key.
    async fn generate(&self, request: &GenerationRequest) -> Result<Generation, ProviderError> {
        let operation = self.start(request).await?;
        self.wait(&operation).await
    }

    fn name(&self) -> &str {
        "openai-responses"
    }

    fn recovery(&self) -> Recovery {
        Recovery::OperationId
    }

    fn as_background(&self) -> Option<&dyn BackgroundProvider> {
        Some(self)
    }
}

#[async_trait::async_trait]
impl BackgroundProvider for OpenAiResponsesProvider {
    async fn start(&self, request: &GenerationRequest) -> Result<OperationId, ProviderError> {
        let create = self.wire_request(request);
        let builder = self
            .api
            .client
            .post(self.api.endpoint.clone())
            .json(&create);
        let builder = self
            .api
            .headers(builder, Some(&request.idempotency_key), with_api_key)?;
        let response = send(builder, self.api.request_timeout).await?;
        if !response.status().is_success() {
            return Err(status_error(response).await);
        }
        if create.stream == Some(true) && stream::is_event_stream(&response) {
            // The first event names the response; the rest is read by `wait_streamed`, from
            // the start, by whichever attempt waits. Closing this stream does not stop a
            // background response.
            let mut fold = ResponseStream::naming(&self.api.default_model);
            let created = stream::read(response, &mut fold, &NoText, self.api.stream_idle).await;
            return match (fold.reply.id, created) {
                (Some(id), _) => Ok(OperationId(id)),
                (None, Err(cut)) => Err(cut.error),
                (None, Ok(())) => Err(ProviderError::MalformedResponse {
                    message: "the response's stream ended before naming it".into(),
                }),
            };
        }
        parse_created(&body(response, self.api.request_timeout).await?)
    }

    async fn look_up(&self, operation: &OperationId) -> Result<Option<Generation>, ProviderError> {
        let url = self.operation_url(operation)?;
        Ok(
            match self.poll(&url, operation, self.api.request_timeout).await? {
                Polled::Done(generation) => Some(*generation),
                Polled::Pending => None,
            },
        )
    }

    /// Streams the operation's events from its first (a new attempt's followers start from
    /// empty), picks a broken stream up after its last event up to [`STREAM_RESUMES`] times,
    /// then polls as [`BackgroundProvider::wait`] does: the operation runs on at the provider
    /// whatever happens to the connection.
    async fn wait_streamed(
        &self,
        operation: &OperationId,
        sink: &dyn TextSink,
    ) -> Result<Generation, ProviderError> {
        if !self.api.stream {
            return self.wait(operation).await;
        }
        let mut fold = ResponseStream::new(&self.api.default_model);
        for _ in 0..=STREAM_RESUMES {
            match self.stream_once(operation, &mut fold, sink).await {
                Ok(true) => return fold.generation(),
                Ok(false) => break,
                Err(cut) if cut.connection => {
                    tracing::debug!(%operation, error = %cut.error, "the response's stream broke; resuming after its last event");
                }
                Err(cut) => return Err(cut.error),
            }
        }
        self.wait(operation).await
    }

    async fn wait(&self, operation: &OperationId) -> Result<Generation, ProviderError> {
        let url = self.operation_url(operation)?;
        // One wait is bounded by `operation_max_wait_ms` as a whole and each poll by the
        // request timeout; every pass of the loop either returns or sleeps at least one poll
        // interval, so the number of polls is bounded too. A poll only reads: one that fails in
        // transit (a lost answer, a 5xx, a 429) is tried again within the same wait, so a
        // flaky poll does not cost the task an attempt, and neither does a long generation.
        let started = Instant::now();
        let deadline = started + self.max_wait;
        // None once a poll said the operation is still running; until then the operation's
        // state is unknown.
        let mut last_error = Some(ProviderError::Ambiguous {
            message: format!("no poll of operation {operation} answered"),
        });
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(self.not_done(operation, started, last_error));
            }
            let mut pause = self.poll_interval;
            match self
                .poll(&url, operation, remaining.min(self.api.request_timeout))
                .await
            {
                Ok(Polled::Done(generation)) => return Ok(*generation),
                Ok(Polled::Pending) => last_error = None,
                Err(e) if poll_may_be_retried(&e) => {
                    if let ProviderError::Retryable {
                        retry_after: Some(after),
                        ..
                    } = &e
                    {
                        pause = pause.max(*after);
                    }
                    // A poll cut short by this wait's own deadline learned nothing about the
                    // operation ("no answer within 0 ms"): what the poll before it said stands.
                    let cut_short =
                        Instant::now() >= deadline && matches!(e, ProviderError::Ambiguous { .. });
                    if !cut_short {
                        last_error = Some(e);
                    }
                }
                Err(e) => return Err(e),
            }
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(self.not_done(operation, started, last_error));
            }
            tokio::time::sleep(pause.min(remaining)).await;
        }
    }
}

impl OpenAiResponsesProvider {
    /// How a wait that ran out of time ended: with the last poll's failure when the provider
    /// could not be asked (the operation's state is unknown: wait on it again), or, when its
    /// last answer said the operation is still running, `StillRunning`.
    fn not_done(
        &self,
        operation: &OperationId,
        started: Instant,
        last_error: Option<ProviderError>,
    ) -> ProviderError {
        last_error.unwrap_or_else(|| ProviderError::StillRunning {
            operation: operation.to_string(),
            waited_ms: u64::try_from(started.elapsed().as_millis()).unwrap_or(u64::MAX),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use replyd_core::domain::{ChatMessage, Role};

    #[test]
    fn the_create_body_asks_for_a_background_response() {
        let provider =
            OpenAiResponsesProvider::new(&ProviderSettings::at("http://127.0.0.1:9/", "fallback"))
                .unwrap();
        let request = GenerationRequest {
            idempotency_key: "k".into(),
            model: String::new(),
            messages: vec![ChatMessage {
                role: Role::User,
                content: "hi".into(),
            }],
            max_output_tokens: Some(16),
        };
        let body = serde_json::to_value(provider.wire_request(&request)).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "model": "fallback",
                "input": [{"role": "user", "content": "hi"}],
                "background": true,
                "max_output_tokens": 16,
                // Created streamed, so any attempt can read its events (`provider.stream`).
                "stream": true,
            })
        );
        assert_eq!(
            provider.endpoint().as_str(),
            "http://127.0.0.1:9/v1/responses"
        );
        let url = provider
            .operation_url(&OperationId("resp_1/../x".into()))
            .unwrap();
        assert_eq!(
            url.as_str(),
            "http://127.0.0.1:9/v1/responses/resp_1%2F..%2Fx"
        );
        assert_eq!(
            provider
                .operation_url(&OperationId(String::new()))
                .unwrap_err()
                .kind(),
            "operation_gone"
        );
    }

    #[test]
    fn the_adapter_offers_recovery_by_operation_id() {
        let provider = OpenAiResponsesProvider::new(&ProviderSettings::default()).unwrap();
        assert_eq!(provider.recovery(), Recovery::OperationId);
        assert!(provider.as_background().is_some());
        assert_eq!(provider.name(), "openai-responses");
    }
}
