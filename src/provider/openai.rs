//! [`OpenAiChatProvider`]: one `POST …/chat/completions` per call to an OpenAI-compatible
//! server (`https://api.openai.com/v1/chat/completions`: `provider.base_url`'s rule is
//! [`super::base_url`]), with the task id as `Idempotency-Key` (I6).
//!
//! The client is built so that one `generate` is exactly one request: reqwest's own retry policy
//! is switched off and redirects are not followed, because re-sending is the caller's decision
//! (I7). The one re-send left is hyper's, for a request that was never written to a pooled
//! connection that had just closed; that request cannot have run, so it is not a second call.

use std::borrow::Cow;
use std::fmt;
use std::marker::PhantomData;

use reqwest::{StatusCode, Url};
use serde::{Deserialize, Serialize};

use super::call::{Dialect, Parse};
use super::generation::{Reply, content_refused, malformed, read_body, token_usage};
use super::http::{AdapterBuildError, ApiClient, Classify};
use super::settings::{ProviderSettings, takes_max_completion_tokens};
use super::stream::{self, ErrorEvent, Folded, ReasonEvents, ReasonStream, Text};
use replyd_core::domain::Role;
use replyd_core::provider::classify::classify_status_at;
use replyd_core::provider::{Generation, GenerationRequest, ProviderError};

/// The adapter. Cheap to share: hold it in an `Arc` and call `generate` from many tasks; they
/// share one connection pool.
#[derive(Debug, Clone)]
pub struct OpenAiChatProvider {
    api: ApiClient,
    /// `provider.max_completion_tokens_models`.
    max_completion_tokens_models: Vec<String>,
}

impl OpenAiChatProvider {
    /// Builds the adapter; fails on a base URL or an extra header the settings' check refuses.
    pub fn new(settings: &ProviderSettings) -> Result<Self, AdapterBuildError> {
        Ok(Self {
            api: ApiClient::new(settings, "/chat/completions")?,
            max_completion_tokens_models: settings.max_completion_tokens_models.clone(),
        })
    }

    /// The URL every call is posted to.
    pub fn endpoint(&self) -> &Url {
        &self.api.endpoint
    }
}

/// The role as OpenAI's APIs spell it.
pub(crate) fn role_name(role: Role) -> &'static str {
    match role {
        Role::System => "system",
        Role::User => "user",
        Role::Assistant => "assistant",
    }
}

/// What chat completions make different: the messages as they are, the length limit under
/// the name the model takes, `stream_options` for a streamed answer's usage.
impl Dialect for OpenAiChatProvider {
    const NAME: &'static str = "openai";
    const CLASSIFY: Classify = classify_status_at;
    const PARSE: Parse = parse_completion;
    const FOLD: fn(&str) -> ChatStream = ChatStream::new;

    type Body<'a> = WireRequest<'a>;
    type Fold = ChatStream;

    fn api(&self) -> &ApiClient {
        &self.api
    }

    fn body<'a>(
        &'a self,
        request: &'a GenerationRequest,
        model: &'a str,
        streamed: bool,
    ) -> WireRequest<'a> {
        // One name for the one limit: the reasoning models refuse `max_tokens`, and servers
        // that predate `max_completion_tokens` ignore or refuse that one.
        let (max_tokens, max_completion_tokens) =
            if takes_max_completion_tokens(&self.max_completion_tokens_models, model) {
                (None, request.max_output_tokens)
            } else {
                (request.max_output_tokens, None)
            };
        WireRequest {
            model,
            messages: request
                .messages
                .iter()
                .map(|m| WireMessage {
                    role: role_name(m.role),
                    content: &m.content,
                })
                .collect(),
            max_tokens,
            max_completion_tokens,
            stream: streamed.then_some(true),
            // Without it the stream reports no usage at all.
            stream_options: streamed.then_some(WireStreamOptions {
                include_usage: true,
            }),
        }
    }
}

/// A chat completion's stream: `data:` chunks whose first choice's `delta.content` is the next
/// piece of text, a chunk with `finish_reason`, the usage chunk (`choices: []`, asked for with
/// `stream_options.include_usage`), then `data: [DONE]`, which some servers leave out (the
/// body ends after the finish reason). An `error` object instead of a chunk is OpenAI's error
/// after the first tokens. Pure.
pub(crate) type ChatStream = ReasonStream<ChatEvents>;

/// The reading of a chat completion's chunks, and the refusal they spelled out. The OpenAI
/// SDKs end a stream at the end of its body and require a `finish_reason` of every choice.
#[derive(Default)]
pub(crate) struct ChatEvents {
    refusal: String,
}

impl ReasonEvents for ChatEvents {
    fn event<'d>(
        &mut self,
        folded: &mut Folded,
        _event: &str,
        data: &'d str,
    ) -> Result<Option<Cow<'d, str>>, ProviderError> {
        if data.trim() == "[DONE]" {
            folded.done = true;
            return Ok(None);
        }
        let chunk: WireChunk = serde_json::from_str(data)
            .map_err(|e| stream::malformed("a chat completion chunk", e))?;
        if let Some(error) = chunk.error {
            let status = match error.kind.as_deref() {
                Some("rate_limit_exceeded" | "tokens") => 429,
                _ => 500,
            };
            return Err(error.failed_mid_stream(status, folded));
        }
        if folded.reply.id.is_none() {
            folded.reply.id = chunk.id.map(Text::into_owned);
        }
        if folded.reply.model.is_none() {
            folded.reply.model = chunk
                .model
                .filter(|m| !m.as_str().is_empty())
                .map(Text::into_owned);
        }
        if let Some(usage) = chunk.usage {
            folded.reply.usage = Some(token_usage(usage.prompt_tokens, usage.completion_tokens));
        }
        let Some(choice) = chunk.choices.0 else {
            return Ok(None);
        };
        if let Some(reason) = choice.finish_reason {
            folded.finish_reason = Some(reason.into_owned());
        }
        let Some(delta) = choice.delta else {
            return Ok(None);
        };
        if let Some(refusal) = delta.refusal {
            self.refusal.push_str(refusal.as_str());
        }
        let piece = delta.content.unwrap_or_default();
        folded.reply.text.push_str(piece.as_str());
        Ok(Some(piece.0))
    }

    fn refused(&self, folded: &Folded) -> Option<ProviderError> {
        if !self.refusal.is_empty() {
            return Some(content_refused(200, &self.refusal));
        }
        match folded.finish_reason.as_deref() {
            Some("content_filter") => Some(content_refused(200, "finish_reason is content_filter")),
            Some(_) => None,
            None => Some(ProviderError::MalformedResponse {
                message: "the stream ended with [DONE] but no chunk gave a finish_reason".into(),
            }),
        }
    }
}

/// Reads a success body as a chat completion. Pure.
fn parse_completion(
    status: StatusCode,
    bytes: &[u8],
    asked_model: &str,
) -> Result<Generation, ProviderError> {
    let completion: WireCompletion = read_body(bytes, "a chat completion")?;
    let choice = completion
        .choices
        .into_iter()
        .next()
        .ok_or_else(|| malformed("completion has no choices"))?;
    let message = choice
        .message
        .ok_or_else(|| malformed("first choice has no message"))?;
    if let Some(refusal) = message.refusal.filter(|r| !r.is_empty()) {
        return Err(content_refused(status.as_u16(), refusal));
    }
    if choice.finish_reason.as_deref() == Some("content_filter") {
        return Err(content_refused(
            status.as_u16(),
            "finish_reason is content_filter",
        ));
    }
    let text = message
        .content
        .ok_or_else(|| malformed("first choice's message has no content"))?;
    let reply = Reply {
        text,
        id: completion.id,
        model: completion.model,
        usage: completion
            .usage
            .map(|u| token_usage(u.prompt_tokens, u.completion_tokens)),
    };
    Ok(reply.generation(asked_model))
}

#[derive(Debug, Serialize)]
pub(crate) struct WireRequest<'a> {
    model: &'a str,
    messages: Vec<WireMessage<'a>>,
    // At most one of the two is set. `max_tokens` is the one every OpenAI-compatible server
    // accepts, and OpenAI's reasoning models refuse it ("use 'max_completion_tokens'
    // instead"); OpenAI takes `max_completion_tokens` for every model, but servers that
    // predate it do not. Which one a model gets is `provider.max_completion_tokens_models`:
    // the server cannot be asked, and a model's name is what tells a reasoning model apart.
    #[serde(skip_serializing_if = "Option::is_none")]
    max_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    max_completion_tokens: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream: Option<bool>,
    #[serde(skip_serializing_if = "Option::is_none")]
    stream_options: Option<WireStreamOptions>,
}

#[derive(Debug, Serialize)]
struct WireStreamOptions {
    include_usage: bool,
}

/// A chunk's strings are borrowed from the event's data where they have no escapes: a stream
/// is many chunks, and each repeats the reply's id and model, kept once.
#[derive(Debug, Deserialize)]
struct WireChunk<'a> {
    #[serde(borrow)]
    id: Option<Text<'a>>,
    #[serde(borrow)]
    model: Option<Text<'a>>,
    #[serde(default, borrow)]
    choices: FirstChoice<'a>,
    usage: Option<WireUsage>,
    error: Option<ErrorEvent>,
}

/// A chunk's first choice (replyd asks for one, `n` = 1), read without a list: a stream is many
/// chunks, and a list would be an allocation each. Any later choice is read past unchecked, as
/// nothing of it is used.
#[derive(Debug, Default)]
struct FirstChoice<'a>(Option<WireChunkChoice<'a>>);

impl<'de: 'a, 'a> Deserialize<'de> for FirstChoice<'a> {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct First<'a>(PhantomData<&'a ()>);

        impl<'de: 'a, 'a> serde::de::Visitor<'de> for First<'a> {
            type Value = FirstChoice<'a>;

            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a list of choices")
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<Self::Value, A::Error> {
                let first = seq.next_element()?;
                while seq.next_element::<serde::de::IgnoredAny>()?.is_some() {}
                Ok(FirstChoice(first))
            }
        }

        deserializer.deserialize_seq(First(PhantomData))
    }
}

#[derive(Debug, Deserialize)]
struct WireChunkChoice<'a> {
    #[serde(borrow)]
    delta: Option<WireDelta<'a>>,
    #[serde(borrow)]
    finish_reason: Option<Text<'a>>,
}

#[derive(Debug, Deserialize)]
struct WireDelta<'a> {
    #[serde(borrow)]
    content: Option<Text<'a>>,
    #[serde(borrow)]
    refusal: Option<Text<'a>>,
}

#[derive(Debug, Serialize)]
struct WireMessage<'a> {
    role: &'static str,
    content: &'a str,
}

#[derive(Debug, Deserialize)]
struct WireCompletion {
    id: Option<String>,
    model: Option<String>,
    #[serde(default)]
    choices: Vec<WireChoice>,
    usage: Option<WireUsage>,
}

#[derive(Debug, Deserialize)]
struct WireChoice {
    message: Option<WireReply>,
    finish_reason: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireReply {
    content: Option<String>,
    refusal: Option<String>,
}

#[derive(Debug, Deserialize)]
struct WireUsage {
    prompt_tokens: u32,
    completion_tokens: u32,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::stream::StreamFold;
    use replyd_core::provider::RateSignals;
    use replyd_core::provider::Usage;

    fn parse(body: &str) -> Result<Generation, ProviderError> {
        parse_completion(StatusCode::OK, body.as_bytes(), "asked")
    }

    #[test]
    fn a_chat_completion_becomes_a_generation() {
        let body = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"m-2024",
            "choices":[{"index":0,"message":{"role":"assistant","content":"hello"},
            "finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,
            "total_tokens":4}}"#;
        assert_eq!(
            parse(body).unwrap(),
            Generation {
                text: "hello".into(),
                model: "m-2024".into(),
                usage: Some(Usage {
                    prompt_tokens: 3,
                    completion_tokens: 1
                }),
                provider_response_id: Some("chatcmpl-1".into()),
                rate_signals: RateSignals::default(),
            }
        );
    }

    /// The body `provider` posts for `request`, not streamed.
    fn wire(provider: &OpenAiChatProvider, request: &GenerationRequest) -> serde_json::Value {
        serde_json::to_value(provider.body(request, provider.api.model(request), false)).unwrap()
    }

    fn asking(model: &str, max_output_tokens: Option<u32>) -> GenerationRequest {
        GenerationRequest {
            idempotency_key: "k".into(),
            model: model.into(),
            messages: vec![replyd_core::domain::ChatMessage {
                role: Role::User,
                content: "hi".into(),
            }],
            max_output_tokens,
        }
    }

    #[test]
    fn the_length_limit_is_max_completion_tokens_for_reasoning_models_only() {
        let provider =
            OpenAiChatProvider::new(&ProviderSettings::at("http://127.0.0.1:9", "o4-mini"))
                .unwrap();
        let body = |model: &str, limit| wire(&provider, &asking(model, limit));
        let user = serde_json::json!([{"role": "user", "content": "hi"}]);
        for model in ["o1", "o3-mini", "o4-mini-2025-04-16", "gpt-5", "gpt-5-nano"] {
            assert_eq!(
                body(model, Some(64)),
                serde_json::json!({"model": model, "messages": user,
                                   "max_completion_tokens": 64}),
                "{model}"
            );
        }
        for model in ["gpt-4o-mini", "gpt-4.1", "mistral-large", "mock-model"] {
            assert_eq!(
                body(model, Some(64)),
                serde_json::json!({"model": model, "messages": user, "max_tokens": 64}),
                "{model}"
            );
        }
        // The default model decides when the task names none; no limit sends neither field.
        assert_eq!(
            body("", Some(8)),
            serde_json::json!({"model": "o4-mini", "messages": user,
                               "max_completion_tokens": 8})
        );
        assert_eq!(
            body("o3", None),
            serde_json::json!({"model": "o3", "messages": user})
        );

        // A deployment named by the operator (Azure) is listed by its own name.
        let azure = OpenAiChatProvider::new(&ProviderSettings {
            base_url: "http://127.0.0.1:9".into(),
            max_completion_tokens_models: vec!["reasoning-prod".into()],
            ..ProviderSettings::default()
        })
        .unwrap();
        let body = wire(&azure, &asking("reasoning-prod-eu", Some(5)));
        assert_eq!(body["max_completion_tokens"], 5);
        let body = wire(&azure, &asking("o3", Some(5)));
        assert_eq!(body["max_tokens"], 5);
    }

    #[test]
    fn bodies_without_a_reply_are_malformed() {
        for body in [
            "not json",
            "{}",
            r#"{"choices":[]}"#,
            r#"{"choices":[{"finish_reason":"stop"}]}"#,
            r#"{"choices":[{"message":{"role":"assistant","content":null}}]}"#,
        ] {
            let error = parse(body).unwrap_err();
            assert_eq!(error.kind(), "malformed_response", "{body}: {error}");
        }
    }

    #[test]
    fn a_content_refusal_is_fatal() {
        let refused = r#"{"choices":[{"message":{"content":null,"refusal":"I can't"}}]}"#;
        let filtered =
            r#"{"choices":[{"message":{"content":""},"finish_reason":"content_filter"}]}"#;
        for body in [refused, filtered] {
            assert_eq!(parse(body).unwrap_err().kind(), "fatal", "{body}");
        }
    }

    #[test]
    fn a_missing_model_in_the_answer_falls_back_to_the_one_asked_for() {
        let generation = parse(r#"{"choices":[{"message":{"content":"x"}}]}"#).unwrap();
        assert_eq!(generation.model, "asked");
        assert_eq!(generation.usage, None);
    }

    #[test]
    fn a_reserved_extra_header_is_refused_at_build() {
        let settings = ProviderSettings::with_extra_header("Idempotency-Key", "hunter2");
        let error = OpenAiChatProvider::new(&settings).unwrap_err();
        let text = error.to_string();
        assert!(
            text.starts_with("provider.extra_headers: \"Idempotency-Key\" is set by replyd"),
            "{text}"
        );
        assert!(!text.contains("hunter2"), "{text}");
    }

    #[test]
    fn the_endpoint_is_the_base_url_plus_the_chat_path() {
        for base in [
            "http://127.0.0.1:9/",
            "http://127.0.0.1:9",
            "http://127.0.0.1:9/v1",
        ] {
            let provider = OpenAiChatProvider::new(&ProviderSettings {
                base_url: base.into(),
                ..ProviderSettings::default()
            })
            .unwrap();
            assert_eq!(
                provider.endpoint().as_str(),
                "http://127.0.0.1:9/v1/chat/completions"
            );
        }
        let error = OpenAiChatProvider::new(&ProviderSettings {
            base_url: "ftp://example".into(),
            ..ProviderSettings::default()
        })
        .unwrap_err();
        assert!(
            matches!(error, AdapterBuildError::BadBaseUrl { .. }),
            "{error}"
        );
    }

    #[test]
    fn settings_refuse_unknown_fields_and_hide_the_key() {
        let parsed: Result<ProviderSettings, _> =
            serde_json::from_str(r#"{"base_url":"http://x","api_kye":"k"}"#);
        assert!(parsed.is_err());
        let settings: ProviderSettings =
            serde_json::from_str(r#"{"api_key":"sk-hunter2"}"#).unwrap();
        assert_eq!(settings.request_timeout_ms, 60_000);
        let provider = OpenAiChatProvider::new(&settings).unwrap();
        assert!(!format!("{settings:?} {provider:?}").contains("hunter2"));
    }

    /// Feeds `events` (data lines) to a chat stream; the text pieces and the end.
    fn fold(events: &[&str]) -> (Vec<String>, ChatStream, Option<ProviderError>) {
        let mut stream = ChatStream::new("asked");
        let mut pieces = Vec::new();
        for data in events {
            match stream.event("", data) {
                Ok(Some(piece)) if !piece.is_empty() => pieces.push(piece.into_owned()),
                Ok(_) => {}
                Err(e) => return (pieces, stream, Some(e)),
            }
        }
        (pieces, stream, None)
    }

    fn chunk(content: &str) -> String {
        format!(
            r#"{{"id":"chatcmpl-9","object":"chat.completion.chunk","model":"m-1","choices":[{{"index":0,"delta":{{"content":{}}},"finish_reason":null}}],"usage":null}}"#,
            serde_json::to_string(content).unwrap()
        )
    }

    const FINISH: &str = r#"{"id":"chatcmpl-9","object":"chat.completion.chunk","model":"m-1","choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"usage":null}"#;
    const USAGE: &str = r#"{"id":"chatcmpl-9","object":"chat.completion.chunk","model":"m-1","choices":[],"usage":{"prompt_tokens":11,"completion_tokens":4,"total_tokens":15}}"#;
    const FIRST: &str = r#"{"id":"chatcmpl-9","object":"chat.completion.chunk","model":"m-1","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"usage":null}"#;

    #[test]
    fn a_streamed_completion_is_its_pieces_in_order_with_the_last_chunks_usage() {
        let (a, b) = (chunk("Hel"), chunk("lo, wor"));
        let c = chunk("ld");
        let (pieces, stream, error) = fold(&[FIRST, &a, &b, &c, FINISH, USAGE, "[DONE]"]);
        assert!(error.is_none());
        assert_eq!(pieces, ["Hel", "lo, wor", "ld"]);
        assert!(stream.finished());
        assert_eq!(
            stream.generation().unwrap(),
            Generation {
                text: "Hello, world".into(),
                model: "m-1".into(),
                usage: Some(Usage {
                    prompt_tokens: 11,
                    completion_tokens: 4
                }),
                provider_response_id: Some("chatcmpl-9".into()),
                rate_signals: RateSignals::default(),
            }
        );
    }

    #[test]
    fn a_chunk_is_read_for_its_first_choice_and_its_piece_is_borrowed_unless_escaped() {
        // Two choices (a server that ignores `n`): the first one's piece, the second read past.
        let two = r#"{"id":"chatcmpl-9","model":"m-1","choices":[{"index":0,"delta":{"content":"one"},"finish_reason":null},{"index":1,"delta":{"content":"two"},"finish_reason":"stop"}]}"#;
        let mut stream = ChatStream::new("asked");
        let piece = stream.event("", two).unwrap();
        assert!(matches!(piece, Some(Cow::Borrowed("one"))), "{piece:?}");
        assert_eq!(stream.chars(), 3);
        let escaped = chunk("a \"quoted\" word");
        let piece = stream.event("", &escaped).unwrap();
        assert!(
            matches!(&piece, Some(Cow::Owned(p)) if p == "a \"quoted\" word"),
            "{piece:?}"
        );
        // No choices, and choices that are not a list.
        assert_eq!(stream.event("", USAGE).unwrap(), None);
        let not_a_list = r#"{"id":"chatcmpl-9","choices":{"index":0}}"#;
        assert!(matches!(
            stream.event("", not_a_list),
            Err(ProviderError::MalformedResponse { message }) if message.contains("a list of choices")
        ));
    }

    #[test]
    fn a_stream_without_usage_reports_none_and_one_without_done_is_whole_after_its_finish_reason() {
        let a = chunk("Hi");
        let (_, stream, _) = fold(&[FIRST, &a, FINISH, "[DONE]"]);
        assert_eq!(stream.generation().unwrap().usage, None);
        let (_, stream, _) = fold(&[FIRST, &a, FINISH, USAGE]);
        assert!(!stream.finished());
        assert_eq!(stream.chars(), 2);
        assert_eq!(stream.usage().map(|u| u.completion_tokens), Some(4));
        // Read on after the finish reason (the usage chunk follows it); a body that ends
        // there is the whole answer, one that ends before it is not.
        assert!(stream.whole_at_clean_end());
        assert_eq!(stream.generation().unwrap().text, "Hi");
        let (_, stream, _) = fold(&[FIRST, &a, FINISH]);
        assert!(stream.whole_at_clean_end());
        assert_eq!(stream.generation().unwrap().usage, None, "not reported");
        let (_, stream, _) = fold(&[FIRST, &a]);
        assert!(!stream.whole_at_clean_end());
    }

    #[test]
    fn an_error_after_the_first_tokens_may_have_executed() {
        let a = chunk("Partial ");
        let error = r#"{"error":{"message":"The server had an error while processing your request.","type":"server_error","param":null,"code":null}}"#;
        let (pieces, _, failed) = fold(&[FIRST, &a, error]);
        assert_eq!(pieces, ["Partial "]);
        match failed {
            Some(ProviderError::MaybeExecuted {
                status: 500,
                message,
            }) => {
                assert!(message.contains("server_error"), "{message}");
                assert!(message.contains("after 8 characters"), "{message}");
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn a_streamed_refusal_or_filter_is_fatal_and_a_chunk_that_is_not_json_is_malformed() {
        let refusal = r#"{"choices":[{"index":0,"delta":{"refusal":"I can't help with that."},"finish_reason":null}]}"#;
        let (_, stream, _) = fold(&[FIRST, refusal, FINISH, "[DONE]"]);
        assert!(matches!(
            stream.generation(),
            Err(ProviderError::Fatal { .. })
        ));
        let filtered = r#"{"choices":[{"index":0,"delta":{},"finish_reason":"content_filter"}]}"#;
        let (_, stream, _) = fold(&[FIRST, filtered, "[DONE]"]);
        assert!(matches!(
            stream.generation(),
            Err(ProviderError::Fatal { .. })
        ));
        let (_, _, error) = fold(&["{not json"]);
        assert!(matches!(
            error,
            Some(ProviderError::MalformedResponse { .. })
        ));
    }
}
