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

use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;
use reqwest::{Client, StatusCode, Url};
use serde::{Deserialize, Serialize};
use tokio::time::Instant;

use super::adapter::TextSink;
use super::adapter::{BackgroundProvider, Provider};
use super::http::OpenAiBuildError;
use super::http::{
    build_client, endpoint, extra_headers, status_error, transport_error, with_api_key,
    with_extra_headers, with_idempotency_key, with_trace_context,
};
use super::openai::role_name;
use super::settings::OpenAiSettings;
use super::stream::{self, Cut, StreamFold};
use replyd_core::provider::{
    Generation, GenerationRequest, OperationId, ProviderError, RateSignals, Recovery, Usage,
};
use replyd_core::secret::Secret;

/// The adapter. Cheap to share: hold it in an `Arc`; all calls share one connection pool. Holds
/// no state about operations, so a second instance (another worker, a restarted one) can `wait`
/// on an id the first one started.
#[derive(Debug, Clone)]
pub struct OpenAiResponsesProvider {
    client: Client,
    endpoint: Url,
    api_key: Option<Secret>,
    extra_headers: HeaderMap,
    default_model: String,
    request_timeout: Duration,
    poll_interval: Duration,
    /// How long one `wait` keeps polling an operation that is not done yet.
    max_wait: Duration,
    /// `provider.stream`: responses are created streamed, so their events can be read (and
    /// read again from any point) by whichever attempt waits on them.
    stream: bool,
    stream_idle: Duration,
}

/// How often one streamed wait picks a broken stream up where it broke before it falls back
/// to polling.
const STREAM_RESUMES: u32 = 3;

impl OpenAiResponsesProvider {
    /// Builds the adapter; fails on a base URL or an extra header the settings' check refuses.
    pub fn new(settings: &OpenAiSettings) -> Result<Self, OpenAiBuildError> {
        let endpoint = endpoint(settings, "/responses")?;
        Ok(Self {
            client: build_client(settings)?,
            endpoint,
            api_key: settings.api_key.clone(),
            extra_headers: extra_headers(settings)?,
            default_model: settings.default_model.clone(),
            request_timeout: Duration::from_millis(settings.request_timeout_ms),
            // A zero interval would poll as fast as the provider answers.
            poll_interval: Duration::from_millis(settings.poll_interval_ms.max(1)),
            max_wait: Duration::from_millis(settings.operation_max_wait_ms),
            stream: settings.stream,
            stream_idle: Duration::from_millis(settings.stream_idle_timeout_ms),
        })
    }

    /// The URL responses are created at; an operation lives at `{endpoint}/{id}`.
    pub fn endpoint(&self) -> &Url {
        &self.endpoint
    }

    fn operation_url(&self, operation: &OperationId) -> Result<Url, ProviderError> {
        if operation.0.is_empty() {
            return Err(gone(operation, "the operation id is empty"));
        }
        let mut url = self.endpoint.clone();
        // `new` only accepts http(s) URLs, which always have a path to extend.
        url.path_segments_mut()
            .expect("an http(s) URL has path segments")
            .push(&operation.0);
        Ok(url)
    }

    fn wire_request<'a>(&'a self, request: &'a GenerationRequest) -> WireCreate<'a> {
        WireCreate {
            model: if request.model.is_empty() {
                &self.default_model
            } else {
                &request.model
            },
            input: request
                .messages
                .iter()
                .map(|m| WireInput {
                    role: role_name(m.role),
                    content: &m.content,
                })
                .collect(),
            background: true,
            max_output_tokens: request.max_output_tokens,
            stream: self.stream.then_some(true),
        }
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
        let builder = self.client.get(url);
        let builder = with_extra_headers(builder, &self.extra_headers);
        let builder = with_api_key(builder, self.api_key.as_ref()).map_err(fatal)?;
        let builder = with_trace_context(builder);
        let response = builder.send().await.map_err(|e| Cut {
            error: transport_error(e, self.request_timeout),
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
        stream::read(response, fold, sink, self.stream_idle).await?;
        Ok(true)
    }

    /// One poll: the response object as it is now.
    async fn poll(
        &self,
        url: &Url,
        operation: &OperationId,
        limit: Duration,
    ) -> Result<Polled, ProviderError> {
        let builder = self.client.get(url.clone()).timeout(limit);
        let builder = with_extra_headers(builder, &self.extra_headers);
        let builder = with_api_key(builder, self.api_key.as_ref())?;
        let builder = with_trace_context(builder);
        let response = builder
            .send()
            .await
            .map_err(|e| transport_error(e, limit))?;
        let status = response.status();
        if !status.is_success() {
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
        let signals = RateSignals::read(response.headers(), SystemTime::now());
        let bytes = response
            .bytes()
            .await
            .map_err(|e| transport_error(e, limit))?;
        Ok(match parse_response(status, &bytes, &self.default_model)? {
            // The reply carries what the poll that brought it said about capacity.
            Polled::Done(generation) => Polled::Done(Box::new(Generation {
                rate_signals: signals,
                ..*generation
            })),
            Polled::Pending => Polled::Pending,
        })
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
        let body = self.wire_request(request);
        let builder = self.client.post(self.endpoint.clone()).json(&body);
        let builder = with_extra_headers(builder, &self.extra_headers);
        let builder = with_idempotency_key(builder, &request.idempotency_key)?;
        let builder = with_api_key(builder, self.api_key.as_ref())?;
        let builder = with_trace_context(builder);
        let response = builder
            .send()
            .await
            .map_err(|e| transport_error(e, self.request_timeout))?;
        if !response.status().is_success() {
            return Err(status_error(response).await);
        }
        if body.stream == Some(true) && stream::is_event_stream(&response) {
            // The first event names the response; the rest is read by `wait_streamed`, from
            // the start, by whichever attempt waits. Closing this stream does not stop a
            // background response.
            let mut fold = ResponseStream::naming(&self.default_model);
            let created = stream::read(response, &mut fold, &NoText, self.stream_idle).await;
            return match (fold.id, created) {
                (Some(id), _) => Ok(OperationId(id)),
                (None, Err(cut)) => Err(cut.error),
                (None, Ok(())) => Err(ProviderError::MalformedResponse {
                    message: "the response's stream ended before naming it".into(),
                }),
            };
        }
        let bytes = response
            .bytes()
            .await
            .map_err(|e| transport_error(e, self.request_timeout))?;
        parse_created(&bytes)
    }

    async fn look_up(&self, operation: &OperationId) -> Result<Option<Generation>, ProviderError> {
        let url = self.operation_url(operation)?;
        Ok(
            match self.poll(&url, operation, self.request_timeout).await? {
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
        if !self.stream {
            return self.wait(operation).await;
        }
        let mut fold = ResponseStream::new(&self.default_model);
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
                .poll(&url, operation, remaining.min(self.request_timeout))
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

/// Whether a failed poll leaves the question open, so asking again is right: everything but
/// the operation's own end (gone, failed: status 200 or a 4xx the provider meant).
fn poll_may_be_retried(error: &ProviderError) -> bool {
    match error {
        ProviderError::OperationGone { .. } | ProviderError::Fatal { .. } => false,
        // Status 200: the poll worked and reported the operation's own server-side failure.
        ProviderError::MaybeExecuted { status, .. } => *status != 200,
        _ => true,
    }
}

/// What one poll found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Polled {
    /// `queued` or `in_progress`: poll again.
    Pending,
    /// Done with a reply (boxed: a generation with its rate signals is large, and most polls
    /// are `Pending`).
    Done(Box<Generation>),
}

/// The documented "operation is gone" error: only a new `start` can produce a reply.
fn gone(operation: &OperationId, why: &str) -> ProviderError {
    ProviderError::OperationGone {
        operation: operation.to_string(),
        why: why.to_owned(),
    }
}

/// Reads the answer to a create: the new response's id. Pure.
pub(crate) fn parse_created(bytes: &[u8]) -> Result<OperationId, ProviderError> {
    let response: WireResponse =
        serde_json::from_slice(bytes).map_err(|e| ProviderError::MalformedResponse {
            message: format!("body is not a response object: {e}"),
        })?;
    match response.id {
        Some(id) if !id.is_empty() => Ok(OperationId(id)),
        _ => Err(ProviderError::MalformedResponse {
            message: "created response has no id".into(),
        }),
    }
}

/// Reads a polled response object into "not yet", a generation, or the error its status means
/// (see [`BackgroundProvider`] for the classes). `http_status` is the poll's status, carried by
/// the errors of the operation's own failure. Pure.
pub(crate) fn parse_response(
    http_status: StatusCode,
    bytes: &[u8],
    asked_model: &str,
) -> Result<Polled, ProviderError> {
    let malformed = |message: String| ProviderError::MalformedResponse { message };
    let response: WireResponse = serde_json::from_slice(bytes)
        .map_err(|e| malformed(format!("body is not a response object: {e}")))?;
    let id = OperationId(response.id.clone().unwrap_or_default());
    let status = response
        .status
        .as_deref()
        .ok_or_else(|| malformed("response object has no status".into()))?;
    let code = http_status.as_u16();
    match status {
        "queued" | "in_progress" => Ok(Polled::Pending),
        "completed" => {
            let text = reply_text(&response, code)?
                .ok_or_else(|| malformed("completed response has no output_text".into()))?;
            Ok(Polled::Done(Box::new(generation(
                response,
                text,
                asked_model,
            ))))
        }
        // Cut short (say, at max_output_tokens): the chat adapter keeps a reply cut by
        // `finish_reason: length`, and so does this one.
        "incomplete" => match reply_text(&response, code)? {
            Some(text) => Ok(Polled::Done(Box::new(generation(
                response,
                text,
                asked_model,
            )))),
            None => Err(ProviderError::Fatal {
                status: code,
                message: format!(
                    "response incomplete without output: {}",
                    response
                        .incomplete_details
                        .and_then(|d| d.reason)
                        .unwrap_or_else(|| "no reason given".into())
                ),
            }),
        },
        "failed" => {
            let error = response.error.unwrap_or_default();
            let message = format!(
                "operation {id} failed: {}",
                error.message.as_deref().unwrap_or("no message given")
            );
            if error.code.as_deref() == Some("server_error") {
                Err(ProviderError::MaybeExecuted {
                    status: code,
                    message,
                })
            } else {
                Err(ProviderError::Fatal {
                    status: code,
                    message,
                })
            }
        }
        "cancelled" | "expired" => Err(gone(&id, &format!("it was {status}"))),
        other => Err(malformed(format!("unknown response status `{other}`"))),
    }
}

/// The text of every `output_text` part of every message, in order; `None` when there is none.
/// A refusal part is a content refusal, as in the chat adapter.
fn reply_text(response: &WireResponse, http_status: u16) -> Result<Option<String>, ProviderError> {
    let mut text: Option<String> = None;
    let parts = response
        .output
        .iter()
        .filter(|item| item.kind == "message")
        .flat_map(|item| &item.content);
    for part in parts {
        match part.kind.as_str() {
            "output_text" => text
                .get_or_insert_with(String::new)
                .push_str(part.text.as_deref().unwrap_or("")),
            "refusal" => {
                return Err(ProviderError::Fatal {
                    status: http_status,
                    message: format!(
                        "content refused: {}",
                        part.refusal.as_deref().unwrap_or("no reason given")
                    ),
                });
            }
            _ => {}
        }
    }
    Ok(text)
}

fn generation(response: WireResponse, text: String, asked_model: &str) -> Generation {
    Generation {
        text,
        model: response
            .model
            .filter(|m| !m.is_empty())
            .unwrap_or_else(|| asked_model.to_owned()),
        usage: response.usage.map(|u| Usage {
            prompt_tokens: u.input_tokens,
            completion_tokens: u.output_tokens,
        }),
        provider_response_id: response.id,
        rate_signals: RateSignals::default(),
    }
}

/// A sink for a stream read only for its first event.
struct NoText;

impl TextSink for NoText {
    fn text(&self, _delta: &str) {}
}

/// A background response's events: `response.created` (its id), `response.output_text.delta`s
/// (the next piece of text), then `response.completed`, `response.incomplete` or
/// `response.failed` with the response object, read as a poll reads it. Every event carries a
/// `sequence_number`, after which a broken stream is picked up again. Reading the create's
/// stream, it is finished once the response is named. Pure.
pub(crate) struct ResponseStream {
    asked_model: String,
    text: String,
    id: Option<String>,
    last_sequence: Option<u64>,
    usage: Option<Usage>,
    ended: Option<Result<Generation, ProviderError>>,
    /// Set while reading a create: finished at `response.created`.
    naming_only: bool,
}

impl ResponseStream {
    pub(crate) fn new(asked_model: &str) -> Self {
        Self {
            asked_model: asked_model.to_owned(),
            text: String::new(),
            id: None,
            last_sequence: None,
            usage: None,
            ended: None,
            naming_only: false,
        }
    }

    /// A fold of a create's stream, finished once the response is named.
    fn naming(asked_model: &str) -> Self {
        Self {
            naming_only: true,
            ..Self::new(asked_model)
        }
    }
}

impl StreamFold for ResponseStream {
    fn event(&mut self, event: &str, data: &str) -> Result<Option<String>, ProviderError> {
        let wire: WireStreamEvent = serde_json::from_str(data)
            .map_err(|e| stream::malformed("a response stream event", e))?;
        if let Some(sequence) = wire.sequence_number {
            // A resumed stream repeats nothing; an event at or before the last one is ignored
            // all the same, so no text is counted twice.
            if self.last_sequence.is_some_and(|last| sequence <= last) {
                return Ok(None);
            }
            self.last_sequence = Some(sequence);
        }
        let kind = if wire.kind.is_empty() {
            event
        } else {
            wire.kind.as_str()
        };
        match kind {
            "response.created" => {
                if let Some(id) = wire.response.as_ref().and_then(|r| r.get("id")) {
                    self.id = id.as_str().map(str::to_owned);
                }
                Ok(None)
            }
            "response.output_text.delta" => {
                let piece = wire.delta.unwrap_or_default();
                self.text.push_str(&piece);
                Ok(Some(piece))
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                let response = wire.response.unwrap_or_default();
                let bytes = serde_json::to_vec(&response).unwrap_or_default();
                let read = parse_response(StatusCode::OK, &bytes, &self.asked_model);
                self.ended = Some(match read {
                    Ok(Polled::Done(generation)) => {
                        self.usage = generation.usage;
                        Ok(*generation)
                    }
                    Ok(Polled::Pending) => Err(ProviderError::MalformedResponse {
                        message: format!("`{kind}` carries a response that is not done"),
                    }),
                    Err(error) => Err(error),
                });
                Ok(None)
            }
            "error" => Err(stream::failed_mid_stream(
                500,
                wire.code.as_deref(),
                wire.message.as_deref().unwrap_or("no message"),
                self.chars(),
            )),
            _ => Ok(None),
        }
    }

    fn finished(&self) -> bool {
        self.ended.is_some() || (self.naming_only && self.id.is_some())
    }

    fn usage(&self) -> Option<Usage> {
        self.usage
    }

    fn chars(&self) -> usize {
        self.text.chars().count()
    }

    fn generation(self) -> Result<Generation, ProviderError> {
        self.ended.unwrap_or_else(|| {
            Err(ProviderError::Ambiguous {
                message: "the response's stream ended without its final event".into(),
            })
        })
    }
}

#[derive(Debug, Deserialize)]
struct WireStreamEvent {
    #[serde(rename = "type", default)]
    kind: String,
    sequence_number: Option<u64>,
    response: Option<serde_json::Value>,
    delta: Option<String>,
    code: Option<String>,
    message: Option<String>,
}

#[derive(Debug, Serialize)]
struct WireCreate<'a> {
    model: &'a str,
    input: Vec<WireInput<'a>>,
    background: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_output_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<bool>,
}

#[derive(Debug, Serialize)]
struct WireInput<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Debug, Deserialize)]
struct WireResponse {
    id: Option<String>,
    status: Option<String>,
    model: Option<String>,
    // `null` and absent both mean no output yet.
    #[serde(default, deserialize_with = "null_as_empty")]
    output: Vec<WireOutputItem>,
    usage: Option<WireUsage>,
    error: Option<WireError>,
    incomplete_details: Option<WireIncomplete>,
}

#[derive(Debug, Deserialize)]
struct WireOutputItem {
    #[serde(rename = "type")]
    kind: String,
    // Items other than messages (reasoning, tool calls) may have no content.
    #[serde(default, deserialize_with = "null_as_empty")]
    content: Vec<WireContent>,
}

#[derive(Debug, Deserialize)]
struct WireContent {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    refusal: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireUsage {
    input_tokens: u32,
    output_tokens: u32,
}

#[derive(Debug, Default, Deserialize)]
struct WireError {
    code: Option<String>,
    message: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireIncomplete {
    reason: Option<String>,
}

fn null_as_empty<'de, D, T>(deserializer: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    Ok(Option::<Vec<T>>::deserialize(deserializer)?.unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use replyd_core::domain::{ChatMessage, Role};

    fn parse(body: &str) -> Result<Polled, ProviderError> {
        parse_response(StatusCode::OK, body.as_bytes(), "asked")
    }

    #[test]
    fn a_completed_response_becomes_a_generation() {
        let body = r#"{"id":"resp_1","object":"response","status":"completed","model":"m-2025",
            "output":[{"type":"reasoning","summary":[]},
                      {"type":"message","role":"assistant","content":[
                          {"type":"output_text","text":"hel","annotations":[]},
                          {"type":"output_text","text":"lo"}]}],
            "usage":{"input_tokens":3,"output_tokens":1,"total_tokens":4},"error":null}"#;
        assert_eq!(
            parse(body).unwrap(),
            Polled::Done(Box::new(Generation {
                text: "hello".into(),
                model: "m-2025".into(),
                usage: Some(Usage {
                    prompt_tokens: 3,
                    completion_tokens: 1
                }),
                provider_response_id: Some("resp_1".into()),
                rate_signals: RateSignals::default(),
            }))
        );
    }

    #[test]
    fn queued_and_in_progress_responses_are_pending() {
        for status in ["queued", "in_progress"] {
            let body = format!(r#"{{"id":"resp_1","status":"{status}","output":null}}"#);
            assert_eq!(parse(&body).unwrap(), Polled::Pending, "{status}");
        }
    }

    #[test]
    fn a_failed_response_is_fatal_with_the_providers_message() {
        let body = r#"{"id":"resp_7","status":"failed",
            "error":{"code":"invalid_prompt","message":"prompt flagged"}}"#;
        assert_eq!(
            parse(body).unwrap_err(),
            ProviderError::Fatal {
                status: 200,
                message: "operation resp_7 failed: prompt flagged".into()
            }
        );
    }

    #[test]
    fn a_response_failed_by_a_server_error_may_have_executed() {
        let body = r#"{"id":"resp_7","status":"failed",
            "error":{"code":"server_error","message":"boom"}}"#;
        assert_eq!(
            parse(body).unwrap_err(),
            ProviderError::MaybeExecuted {
                status: 200,
                message: "operation resp_7 failed: boom".into()
            }
        );
    }

    #[test]
    fn cancelled_and_expired_operations_are_gone() {
        for status in ["cancelled", "expired"] {
            let body = format!(r#"{{"id":"resp_2","status":"{status}"}}"#);
            let error = parse(&body).unwrap_err();
            let ProviderError::OperationGone { .. } = &error else {
                panic!("{status}: {error:?}");
            };
            assert!(
                error.to_string().contains("operation resp_2 is gone"),
                "{error}"
            );
        }
    }

    #[test]
    fn an_incomplete_response_keeps_its_text_or_is_fatal_without_it() {
        let cut = r#"{"id":"r","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},
            "output":[{"type":"message","content":[{"type":"output_text","text":"half"}]}]}"#;
        let Polled::Done(generation) = parse(cut).unwrap() else {
            panic!("a cut reply is a reply");
        };
        assert_eq!(generation.text, "half");
        assert_eq!(generation.model, "asked");
        let empty = r#"{"id":"r","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"}}"#;
        let error = parse(empty).unwrap_err();
        assert_eq!(error.kind(), "fatal");
        assert!(error.to_string().contains("max_output_tokens"), "{error}");
    }

    #[test]
    fn a_refusal_is_fatal() {
        let body = r#"{"id":"r","status":"completed",
            "output":[{"type":"message","content":[{"type":"refusal","refusal":"I can't"}]}]}"#;
        let error = parse(body).unwrap_err();
        assert_eq!(error.kind(), "fatal");
        assert!(error.to_string().contains("I can't"), "{error}");
    }

    #[test]
    fn objects_without_a_usable_status_or_output_are_malformed() {
        for body in [
            "not json",
            "{}",
            r#"{"id":"r","status":"thinking"}"#,
            r#"{"id":"r","status":"completed","output":[]}"#,
            r#"{"id":"r","status":"completed","output":[{"type":"reasoning"}]}"#,
        ] {
            let error = parse(body).unwrap_err();
            assert_eq!(error.kind(), "malformed_response", "{body}: {error}");
        }
    }

    #[test]
    fn a_create_answer_yields_the_operation_id() {
        assert_eq!(
            parse_created(br#"{"id":"resp_3","status":"queued"}"#).unwrap(),
            OperationId("resp_3".into())
        );
        for body in [&b"{}"[..], br#"{"id":""}"#, b"<html>"] {
            assert_eq!(
                parse_created(body).unwrap_err().kind(),
                "malformed_response"
            );
        }
    }

    #[test]
    fn the_create_body_asks_for_a_background_response() {
        let provider = OpenAiResponsesProvider::new(&OpenAiSettings {
            base_url: "http://127.0.0.1:9/".into(),
            default_model: "fallback".into(),
            ..OpenAiSettings::default()
        })
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
        let provider = OpenAiResponsesProvider::new(&OpenAiSettings::default()).unwrap();
        assert_eq!(provider.recovery(), Recovery::OperationId);
        assert!(provider.as_background().is_some());
        assert_eq!(provider.name(), "openai-responses");
    }

    fn response_event(kind: &str, sequence: u64, extra: &str) -> String {
        format!(r#"{{"type":"{kind}","sequence_number":{sequence}{extra}}}"#)
    }

    fn text_delta(sequence: u64, delta: &str) -> String {
        response_event(
            "response.output_text.delta",
            sequence,
            &format!(
                r#","item_id":"msg_1","output_index":0,"content_index":0,"delta":{}"#,
                serde_json::to_string(delta).unwrap()
            ),
        )
    }

    const COMPLETED: &str = r#","response":{"id":"resp_1","object":"response","status":"completed","model":"m-1","output":[{"type":"message","id":"msg_1","role":"assistant","content":[{"type":"output_text","text":"Hello there"}]}],"usage":{"input_tokens":9,"output_tokens":3,"total_tokens":12}}"#;
    const CREATED: &str = r#","response":{"id":"resp_1","object":"response","status":"queued"}"#;

    fn feed(stream: &mut ResponseStream, events: &[String]) -> String {
        let mut text = String::new();
        for data in events {
            if let Some(piece) = stream.event("", data).unwrap() {
                text.push_str(&piece);
            }
        }
        text
    }

    #[test]
    fn a_response_stream_is_its_text_deltas_and_ends_with_the_completed_response() {
        let mut stream = ResponseStream::new("asked");
        let text = feed(
            &mut stream,
            &[
                response_event("response.created", 0, CREATED),
                response_event("response.in_progress", 1, CREATED),
                text_delta(2, "Hello"),
                text_delta(3, " there"),
                response_event("response.completed", 4, COMPLETED),
            ],
        );
        assert_eq!(text, "Hello there");
        assert!(stream.finished());
        assert_eq!(stream.last_sequence, Some(4));
        let generation = stream.generation().unwrap();
        assert_eq!(generation.text, "Hello there");
        assert_eq!(
            generation.usage,
            Some(Usage {
                prompt_tokens: 9,
                completion_tokens: 3
            })
        );
    }

    #[test]
    fn a_resumed_stream_counts_no_event_twice() {
        let mut stream = ResponseStream::new("asked");
        let first = feed(
            &mut stream,
            &[
                response_event("response.created", 0, CREATED),
                text_delta(1, "Hel"),
                text_delta(2, "lo"),
            ],
        );
        assert!(!stream.finished());
        assert_eq!(stream.last_sequence, Some(2));
        // A provider that repeats an event the resume asked to skip changes nothing.
        let rest = feed(
            &mut stream,
            &[
                text_delta(2, "lo"),
                text_delta(3, " there"),
                response_event("response.completed", 4, COMPLETED),
            ],
        );
        assert_eq!(format!("{first}{rest}"), "Hello there");
        assert_eq!(stream.generation().unwrap().text, "Hello there");
    }

    #[test]
    fn a_create_stream_is_read_until_it_names_the_response() {
        let mut stream = ResponseStream::naming("asked");
        assert!(!stream.finished());
        feed(
            &mut stream,
            &[response_event("response.created", 0, CREATED)],
        );
        assert!(stream.finished());
        assert_eq!(stream.id.as_deref(), Some("resp_1"));
    }

    #[test]
    fn a_failed_response_ends_its_stream_with_its_error() {
        let failed = r#","response":{"id":"resp_1","object":"response","status":"failed","error":{"code":"server_error","message":"boom"},"output":[]}"#;
        let mut stream = ResponseStream::new("asked");
        feed(
            &mut stream,
            &[
                text_delta(1, "Hi"),
                response_event("response.failed", 2, failed),
            ],
        );
        assert!(stream.finished());
        assert!(matches!(
            stream.generation(),
            Err(ProviderError::MaybeExecuted { status: 200, .. })
        ));
    }
}
