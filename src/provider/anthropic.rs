//! [`AnthropicMessagesProvider`]: one `POST …/v1/messages` per call to Anthropic's Messages
//! API (`provider.base_url` `https://api.anthropic.com` or `…/v1`, [`super::base_url`]), with
//! `x-api-key` and `anthropic-version`.
//!
//! What this API offers the caller after an ambiguous call is nothing: Anthropic documents no
//! idempotency key and no way to look a message up, and its own SDKs send none. So
//! [`super::Provider::recovery`] is [`Recovery::None`], and `retry.ambiguous` decides whether a
//! lost answer is asked for again (and may be paid twice) or ends the task (I6, I7). The task
//! id is still sent as `Idempotency-Key`: Anthropic ignores it, a gateway in front may honour
//! it, and the mock provider counts the generations of each task by it.
//!
//! Like the OpenAI adapters, every call is one request (the shared client in `http`: no
//! retries, no redirects), sent and read as the chat adapter's are (`call`). The shapes are
//! the API's: system messages go to the top-level
//! `system`, the others to `messages`, and `max_tokens` is always sent, because the API
//! requires it. The reading of an answer is pure ([`parse_message`]), and so is its
//! classification ([`classify_anthropic_status_at`]).

use std::borrow::Cow;

use reqwest::header::{HeaderName, HeaderValue};
use reqwest::{RequestBuilder, StatusCode, Url};
use serde::{Deserialize, Serialize};

use super::call::{Dialect, Parse};
use super::generation::{Reply, content_refused, malformed, read_body, token_usage};
use super::http::{AdapterBuildError, ApiClient, Classify, with_key_header};
use super::settings::ProviderSettings;
use super::stream::{self, ErrorEvent, Folded, ReasonEvents, ReasonStream, Text};
use replyd_core::domain::Role;
use replyd_core::provider::classify::classify_anthropic_status_at;
use replyd_core::provider::{Generation, GenerationRequest, ProviderError, Recovery};
use replyd_core::secret::Secret;

/// The adapter. Cheap to share: hold it in an `Arc`; all calls share one connection pool.
#[derive(Debug, Clone)]
pub struct AnthropicMessagesProvider {
    api: ApiClient,
    /// `provider.anthropic_version`, checked to be a header value when built.
    version: HeaderValue,
    /// `max_tokens` of a task that sets none (`provider.anthropic_max_tokens`).
    default_max_tokens: u32,
}

impl AnthropicMessagesProvider {
    /// Builds the adapter; fails on settings the settings' check refuses (a base URL, an extra
    /// header, an `anthropic_version` that cannot be a header).
    pub fn new(settings: &ProviderSettings) -> Result<Self, AdapterBuildError> {
        let api = ApiClient::new(settings, "/messages")?;
        let version = HeaderValue::from_str(settings.anthropic_version.trim())
            .ok()
            .filter(|v| !v.is_empty())
            .ok_or_else(|| AdapterBuildError::BadAnthropicVersion {
                version: settings.anthropic_version.clone(),
            })?;
        Ok(Self {
            api,
            version,
            // The API refuses 0; the settings' check does too, this keeps a direct caller safe.
            default_max_tokens: settings.anthropic_max_tokens.max(1),
        })
    }

    /// The URL every call is posted to.
    pub fn endpoint(&self) -> &Url {
        &self.api.endpoint
    }
}

/// What the Messages API makes different: no recovery, the system messages as one top-level
/// prompt, `max_tokens` always, the key as `x-api-key` with `anthropic-version`, Anthropic's
/// meaning of a refusal and its shapes of an answer.
impl Dialect for AnthropicMessagesProvider {
    const NAME: &'static str = "anthropic";
    /// Anthropic documents no idempotency key and no look-up of a message.
    const RECOVERY: Recovery = Recovery::None;
    const CLASSIFY: Classify = classify_anthropic_status_at;
    const PARSE: Parse = parse_message;
    const FOLD: fn(&str) -> MessageStream = MessageStream::new;

    type Body<'a> = WireRequest<'a>;
    type Fold = MessageStream;

    fn api(&self) -> &ApiClient {
        &self.api
    }

    fn body<'a>(
        &'a self,
        request: &'a GenerationRequest,
        model: &'a str,
        streamed: bool,
    ) -> WireRequest<'a> {
        // The API has no system role inside `messages`: every system message, wherever it
        // stands, becomes part of the one top-level `system` prompt, in order.
        let system: Vec<&str> = request
            .messages
            .iter()
            .filter(|m| m.role == Role::System)
            .map(|m| m.content.as_str())
            .collect();
        WireRequest {
            model,
            max_tokens: request
                .max_output_tokens
                .filter(|&n| n > 0)
                .unwrap_or(self.default_max_tokens),
            system: (!system.is_empty()).then(|| system.join("\n\n")),
            messages: request
                .messages
                .iter()
                .filter_map(|m| {
                    let role = match m.role {
                        Role::User => "user",
                        Role::Assistant => "assistant",
                        Role::System => return None,
                    };
                    Some(WireMessage {
                        role,
                        content: &m.content,
                    })
                })
                .collect(),
            stream: streamed.then_some(true),
        }
    }

    fn key_headers(
        &self,
        builder: RequestBuilder,
        api_key: Option<&Secret>,
    ) -> Result<RequestBuilder, ProviderError> {
        let builder = with_anthropic_key(builder, api_key)?;
        Ok(builder.header("anthropic-version", self.version.clone()))
    }
}

/// Adds `x-api-key: <key>` when a key is configured, marked sensitive like the bearer token.
pub(super) fn with_anthropic_key(
    builder: RequestBuilder,
    api_key: Option<&Secret>,
) -> Result<RequestBuilder, ProviderError> {
    with_key_header(builder, api_key, HeaderName::from_static("x-api-key"), "")
}

/// Reads a success body as a Messages API message: the reply is its text blocks, in order.
/// A `refusal` stop is a content refusal (`Fatal`), as in the OpenAI adapters; a message cut
/// at `max_tokens` keeps its text. Pure.
pub(crate) fn parse_message(
    status: StatusCode,
    bytes: &[u8],
    asked_model: &str,
) -> Result<Generation, ProviderError> {
    let message: WireMessageAnswer = read_body(bytes, "a message")?;
    if message.kind.as_deref().is_some_and(|k| k != "message") {
        return Err(malformed(format!(
            "body is a `{}`, not a message",
            message.kind.unwrap_or_default()
        )));
    }
    let stop = message.stop_reason.as_deref();
    let mut text: Option<String> = None;
    for block in &message.content {
        if block.kind == "text" {
            text.get_or_insert_with(String::new)
                .push_str(block.text.as_deref().unwrap_or(""));
        }
    }
    if stop == Some("refusal") {
        return Err(content_refused(status.as_u16(), "stop_reason is refusal"));
    }
    let Some(text) = text else {
        return Err(match stop {
            Some("max_tokens") => cut_before_text(status.as_u16()),
            _ => malformed("message has no text content"),
        });
    };
    let reply = Reply {
        text,
        id: message.id,
        model: message.model,
        usage: message
            .usage
            .map(|u| token_usage(u.input_tokens, u.output_tokens)),
    };
    Ok(reply.generation(asked_model))
}

/// A reply cut at `max_tokens` before any text: nothing to save, and final (a retry would ask
/// with the same limit).
fn cut_before_text(status: u16) -> ProviderError {
    ProviderError::Fatal {
        status,
        message: "reply cut at max_tokens before any text".into(),
    }
}

/// A message's event stream: `message_start` (its id, model and the prompt's usage),
/// `content_block_delta`s whose `text_delta` is the next piece of text, `message_delta` (the
/// stop reason and the output's usage), `message_stop` (which a body that ends cleanly after
/// the stop reason may leave out); `ping`s between. An `error` event
/// (`overloaded_error`, `api_error`) is Anthropic's error after the first tokens. Pure.
pub(crate) type MessageStream = ReasonStream<MessageEvents>;

/// The reading of a message's events. `message_stop` is the final event, but `message_delta`
/// already carries what ends the message: its `stop_reason` and the output's final usage.
/// Anthropic's SDKs build the message from the events they got and return it when the body
/// ends, `message_stop` or not.
#[derive(Default)]
pub(crate) struct MessageEvents;

impl ReasonEvents for MessageEvents {
    fn event<'d>(
        &mut self,
        folded: &mut Folded,
        event: &str,
        data: &'d str,
    ) -> Result<Option<Cow<'d, str>>, ProviderError> {
        let wire: WireStreamEvent =
            serde_json::from_str(data).map_err(|e| stream::malformed("a Messages event", e))?;
        let kind = stream::event_name(&wire.kind, event);
        match kind {
            "message_start" => {
                if let Some(message) = wire.message {
                    folded.reply.id = message.id;
                    folded.reply.model = message.model.filter(|m| !m.is_empty());
                    folded.reply.usage = message
                        .usage
                        .map(|u| token_usage(u.input_tokens, u.output_tokens));
                }
                Ok(None)
            }
            "content_block_delta" => {
                let piece = wire
                    .delta
                    .filter(|d| d.kind.as_ref().map(Text::as_str) == Some("text_delta"))
                    .and_then(|d| d.text)
                    .unwrap_or_default();
                folded.reply.text.push_str(piece.as_str());
                Ok(Some(piece.0))
            }
            "message_delta" => {
                if let Some(reason) = wire.delta.and_then(|d| d.stop_reason) {
                    folded.finish_reason = Some(reason.into_owned());
                }
                if let Some(output) = wire.usage.map(|u| u.output_tokens) {
                    // The output's count is cumulative; the prompt's was in `message_start`.
                    let prompt = folded.reply.usage.map_or(0, |u| u.prompt_tokens);
                    folded.reply.usage = Some(token_usage(prompt, output));
                }
                Ok(None)
            }
            "message_stop" => {
                folded.done = true;
                Ok(None)
            }
            "error" => {
                let error = wire.error.unwrap_or_default();
                let status = match error.kind.as_deref() {
                    Some("overloaded_error") => 529,
                    Some("rate_limit_error") => 429,
                    _ => 500,
                };
                Err(error.failed_mid_stream(status, folded))
            }
            // `ping`, the content blocks' start and stop, and events added later.
            _ => Ok(None),
        }
    }

    fn refused(&self, folded: &Folded) -> Option<ProviderError> {
        match folded.finish_reason.as_deref() {
            Some("refusal") => Some(content_refused(200, "stop_reason is refusal")),
            Some("max_tokens") if folded.reply.text.is_empty() => Some(cut_before_text(200)),
            _ => None,
        }
    }
}

/// An event's strings are borrowed from its data where they have no escapes: a stream is
/// mostly `content_block_delta` events, each naming its type twice.
#[derive(Debug, Deserialize)]
struct WireStreamEvent<'a> {
    #[serde(rename = "type", default, borrow)]
    kind: Cow<'a, str>,
    message: Option<WireMessageAnswer>,
    #[serde(borrow)]
    delta: Option<WireStreamDelta<'a>>,
    usage: Option<WireUsage>,
    error: Option<ErrorEvent>,
}

#[derive(Debug, Deserialize)]
struct WireStreamDelta<'a> {
    #[serde(rename = "type", borrow)]
    kind: Option<Text<'a>>,
    #[serde(borrow)]
    text: Option<Text<'a>>,
    #[serde(borrow)]
    stop_reason: Option<Text<'a>>,
}

#[derive(Debug, Serialize)]
pub(crate) struct WireRequest<'a> {
    model: &'a str,
    max_tokens: u32,
    #[serde(skip_serializing_if = "Option::is_none")]
    system: Option<String>,
    messages: Vec<WireMessage<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<bool>,
}

#[derive(Debug, Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Debug, Deserialize)]
struct WireMessageAnswer {
    id: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    model: Option<String>,
    #[serde(default)]
    content: Vec<WireBlock>,
    stop_reason: Option<String>,
    usage: Option<WireUsage>,
}

#[derive(Debug, Deserialize)]
struct WireBlock {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireUsage {
    // Absent counts as none: the API always sends both, a gateway may not.
    #[serde(default)]
    input_tokens: u32,
    #[serde(default)]
    output_tokens: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::adapter::Provider;
    use crate::provider::stream::StreamFold;
    use replyd_core::domain::ChatMessage;
    use replyd_core::provider::RateSignals;
    use replyd_core::provider::Usage;

    fn parse(body: &str) -> Result<Generation, ProviderError> {
        parse_message(StatusCode::OK, body.as_bytes(), "asked")
    }

    fn message(role: Role, content: &str) -> ChatMessage {
        ChatMessage {
            role,
            content: content.into(),
        }
    }

    /// The body `provider` posts for `request`, not streamed.
    fn wire(
        provider: &AnthropicMessagesProvider,
        request: &GenerationRequest,
    ) -> serde_json::Value {
        serde_json::to_value(provider.body(request, provider.api.model(request), false)).unwrap()
    }

    fn provider(settings: ProviderSettings) -> AnthropicMessagesProvider {
        AnthropicMessagesProvider::new(&ProviderSettings {
            base_url: "http://127.0.0.1:9".into(),
            ..settings
        })
        .unwrap()
    }

    #[test]
    fn a_message_becomes_a_generation_from_its_text_blocks() {
        let body = r#"{"id":"msg_01","type":"message","role":"assistant","model":"claude-x",
            "content":[{"type":"thinking","thinking":"hm"},{"type":"text","text":"hel"},
                       {"type":"tool_use","id":"t","name":"n","input":{}},
                       {"type":"text","text":"lo"}],
            "stop_reason":"end_turn","stop_sequence":null,
            "usage":{"input_tokens":12,"output_tokens":3,"cache_read_input_tokens":0}}"#;
        assert_eq!(
            parse(body).unwrap(),
            Generation {
                text: "hello".into(),
                model: "claude-x".into(),
                usage: Some(Usage {
                    prompt_tokens: 12,
                    completion_tokens: 3
                }),
                provider_response_id: Some("msg_01".into()),
                rate_signals: RateSignals::default(),
            }
        );
    }

    #[test]
    fn a_reply_cut_at_max_tokens_keeps_its_text() {
        let body = r#"{"type":"message","content":[{"type":"text","text":"half"}],
            "stop_reason":"max_tokens"}"#;
        let generation = parse(body).unwrap();
        assert_eq!(generation.text, "half");
        assert_eq!(generation.model, "asked");
        assert_eq!(generation.usage, None);
        let empty = r#"{"type":"message","content":[],"stop_reason":"max_tokens"}"#;
        let error = parse(empty).unwrap_err();
        assert_eq!(error.kind(), "fatal");
        assert!(error.to_string().contains("max_tokens"), "{error}");
    }

    #[test]
    fn a_refusal_is_fatal() {
        let body = r#"{"type":"message","content":[{"type":"text","text":"I can"}],
            "stop_reason":"refusal"}"#;
        let error = parse(body).unwrap_err();
        assert_eq!(error.kind(), "fatal");
        assert!(error.to_string().contains("refus"), "{error}");
    }

    #[test]
    fn bodies_without_a_reply_are_malformed() {
        for body in [
            "not json",
            "{}",
            r#"{"type":"message","content":[]}"#,
            r#"{"type":"message","content":[{"type":"tool_use","id":"t"}]}"#,
            r#"{"type":"error","error":{"type":"api_error","message":"x"}}"#,
            r#"{"type":"message","content":"text"}"#,
        ] {
            let error = parse(body).unwrap_err();
            assert_eq!(error.kind(), "malformed_response", "{body}: {error}");
        }
    }

    #[test]
    fn system_messages_become_the_top_level_system_prompt() {
        let provider = provider(ProviderSettings {
            default_model: "claude-default".into(),
            ..ProviderSettings::default()
        });
        let request = GenerationRequest {
            idempotency_key: "k".into(),
            model: String::new(),
            messages: vec![
                message(Role::System, "Be brief."),
                message(Role::User, "hi"),
                message(Role::Assistant, "hello"),
                message(Role::System, "Answer in French."),
                message(Role::User, "again"),
            ],
            max_output_tokens: Some(64),
        };
        assert_eq!(
            wire(&provider, &request),
            serde_json::json!({
                "model": "claude-default",
                "max_tokens": 64,
                "system": "Be brief.\n\nAnswer in French.",
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "content": "hello"},
                    {"role": "user", "content": "again"},
                ],
            })
        );
    }

    #[test]
    fn max_tokens_is_always_sent_from_the_task_or_the_setting() {
        let provider = provider(ProviderSettings {
            anthropic_max_tokens: 777,
            ..ProviderSettings::default()
        });
        let mut request = GenerationRequest {
            idempotency_key: "k".into(),
            model: "claude-x".into(),
            messages: vec![message(Role::User, "hi")],
            max_output_tokens: None,
        };
        let body = wire(&provider, &request);
        assert_eq!(
            body,
            serde_json::json!({"model": "claude-x", "max_tokens": 777,
                               "messages": [{"role": "user", "content": "hi"}]})
        );
        request.max_output_tokens = Some(0);
        let body = wire(&provider, &request);
        assert_eq!(body["max_tokens"], 777);
        request.max_output_tokens = Some(9);
        let body = wire(&provider, &request);
        assert_eq!(body["max_tokens"], 9);
    }

    #[test]
    fn the_adapter_posts_to_v1_messages_and_offers_no_recovery() {
        let provider = provider(ProviderSettings::default());
        assert_eq!(
            provider.endpoint().as_str(),
            "http://127.0.0.1:9/v1/messages"
        );
        assert_eq!(provider.recovery(), Recovery::None);
        assert!(provider.as_background().is_none());
        assert_eq!(provider.name(), "anthropic");
        let error = AnthropicMessagesProvider::new(&ProviderSettings {
            base_url: "https://api.anthropic.com".into(),
            anthropic_version: "bad\nversion".into(),
            ..ProviderSettings::default()
        })
        .unwrap_err();
        assert!(error.to_string().contains("anthropic_version"), "{error}");
    }

    #[test]
    fn the_key_is_never_shown() {
        let provider = provider(ProviderSettings {
            api_key: Some(Secret::new("sk-ant-hunter2")),
            ..ProviderSettings::default()
        });
        assert!(!format!("{provider:?}").contains("hunter2"));
    }

    fn fold(events: &[(&str, &str)]) -> (String, MessageStream, Option<ProviderError>) {
        let mut stream = MessageStream::new("asked");
        let mut text = String::new();
        for (event, data) in events {
            match stream.event(event, data) {
                Ok(Some(piece)) => text.push_str(&piece),
                Ok(None) => {}
                Err(e) => return (text, stream, Some(e)),
            }
        }
        (text, stream, None)
    }

    const START: (&str, &str) = (
        "message_start",
        r#"{"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude-x","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":25,"output_tokens":1}}}"#,
    );
    const BLOCK: (&str, &str) = (
        "content_block_start",
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    );
    const PING: (&str, &str) = ("ping", r#"{"type": "ping"}"#);
    const DELTA_A: (&str, &str) = (
        "content_block_delta",
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hello"}}"#,
    );
    const DELTA_B: (&str, &str) = (
        "content_block_delta",
        r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"!"}}"#,
    );
    const STOP_BLOCK: (&str, &str) = (
        "content_block_stop",
        r#"{"type":"content_block_stop","index":0}"#,
    );
    const MESSAGE_DELTA: (&str, &str) = (
        "message_delta",
        r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":15}}"#,
    );
    const STOP: (&str, &str) = ("message_stop", r#"{"type":"message_stop"}"#);
    const OVERLOADED: (&str, &str) = (
        "error",
        r#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}"#,
    );
    const REFUSAL_DELTA: (&str, &str) = (
        "message_delta",
        r#"{"type":"message_delta","delta":{"stop_reason":"refusal"},"usage":{"output_tokens":2}}"#,
    );

    #[test]
    fn a_message_stream_is_its_text_deltas_with_the_prompts_and_the_outputs_usage() {
        let (text, stream, error) = fold(&[
            START,
            BLOCK,
            PING,
            DELTA_A,
            DELTA_B,
            STOP_BLOCK,
            MESSAGE_DELTA,
            STOP,
        ]);
        assert!(error.is_none());
        assert_eq!(text, "Hello!");
        assert!(stream.finished());
        let generation = stream.generation().unwrap();
        assert_eq!(generation.text, "Hello!");
        assert_eq!(generation.model, "claude-x");
        assert_eq!(
            generation.usage,
            Some(Usage {
                prompt_tokens: 25,
                completion_tokens: 15
            })
        );
        assert_eq!(generation.provider_response_id.as_deref(), Some("msg_1"));
    }

    #[test]
    fn a_message_stream_that_ends_after_its_stop_reason_is_whole_without_message_stop() {
        let (_, stream, _) = fold(&[START, BLOCK, DELTA_A, DELTA_B, STOP_BLOCK, MESSAGE_DELTA]);
        assert!(!stream.finished());
        assert!(stream.whole_at_clean_end());
        let generation = stream.generation().unwrap();
        assert_eq!(generation.text, "Hello!");
        assert_eq!(generation.usage.map(|u| u.completion_tokens), Some(15));
        let (_, stream, _) = fold(&[START, BLOCK, DELTA_A, DELTA_B, STOP_BLOCK]);
        assert!(!stream.whole_at_clean_end(), "no stop_reason yet");
    }

    #[test]
    fn a_cut_message_stream_is_unfinished_with_the_usage_reported_at_its_start() {
        let (_, stream, _) = fold(&[START, BLOCK, DELTA_A]);
        assert!(!stream.finished());
        assert!(!stream.whole_at_clean_end());
        assert_eq!(stream.chars(), 5);
        assert_eq!(
            stream.usage(),
            Some(Usage {
                prompt_tokens: 25,
                completion_tokens: 1
            })
        );
    }

    #[test]
    fn an_error_event_after_the_first_tokens_may_have_executed() {
        let (text, _, error) = fold(&[START, BLOCK, DELTA_A, OVERLOADED]);
        assert_eq!(text, "Hello");
        match error {
            Some(ProviderError::MaybeExecuted {
                status: 529,
                message,
            }) => {
                assert!(
                    message.starts_with("overloaded_error: Overloaded"),
                    "{message}"
                );
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_streamed_refusal_is_fatal() {
        let (_, stream, _) = fold(&[START, BLOCK, REFUSAL_DELTA, STOP]);
        assert!(matches!(
            stream.generation(),
            Err(ProviderError::Fatal { .. })
        ));
    }
}
