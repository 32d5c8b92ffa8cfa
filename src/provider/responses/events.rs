//! Reading a background response's event stream, pure: its text as it comes, the sequence
//! number a broken stream is picked up after, and the final event read as a poll reads the
//! response object. Apart from the calls so every event is tested without a server.

use std::borrow::Cow;

use reqwest::StatusCode;
use serde::Deserialize;

use super::parse::{Polled, parse_response};
use crate::provider::adapter::TextSink;
use crate::provider::generation::Reply;
use crate::provider::stream::{self, StreamFold};
use replyd_core::provider::{Generation, ProviderError};

/// A sink for a stream read only for its first event.
pub(super) struct NoText;

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
    /// The text as it comes, the id from `response.created`, the usage from the final event.
    pub(super) reply: Reply,
    pub(super) last_sequence: Option<u64>,
    ended: Option<Result<Generation, ProviderError>>,
    /// Set while reading a create: finished at `response.created`.
    naming_only: bool,
}

impl ResponseStream {
    pub(crate) fn new(asked_model: &str) -> Self {
        Self {
            asked_model: asked_model.to_owned(),
            reply: Reply::default(),
            last_sequence: None,
            ended: None,
            naming_only: false,
        }
    }

    /// A fold of a create's stream, finished once the response is named.
    pub(super) fn naming(asked_model: &str) -> Self {
        Self {
            naming_only: true,
            ..Self::new(asked_model)
        }
    }
}

impl StreamFold for ResponseStream {
    fn event<'d>(
        &mut self,
        event: &str,
        data: &'d str,
    ) -> Result<Option<Cow<'d, str>>, ProviderError> {
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
        let kind = stream::event_name(&wire.kind, event);
        match kind {
            "response.created" => {
                if let Some(id) = wire.response.as_ref().and_then(|r| r.get("id")) {
                    self.reply.id = id.as_str().map(str::to_owned);
                }
                Ok(None)
            }
            "response.output_text.delta" => {
                let piece = wire.delta.unwrap_or_default();
                self.reply.text.push_str(&piece);
                Ok(Some(Cow::Owned(piece)))
            }
            "response.completed" | "response.incomplete" | "response.failed" => {
                let response = wire.response.unwrap_or_default();
                let bytes = serde_json::to_vec(&response).unwrap_or_default();
                let read = parse_response(StatusCode::OK, &bytes, &self.asked_model);
                self.ended = Some(match read {
                    Ok(Polled::Done(generation)) => {
                        self.reply.usage = generation.usage;
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
        self.ended.is_some() || (self.naming_only && self.reply.id.is_some())
    }

    fn reply(&self) -> &Reply {
        &self.reply
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

#[cfg(test)]
mod tests {
    use super::*;
    use replyd_core::provider::Usage;

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

    /// A fresh stream fed `events`, and the text they gave.
    fn fed(events: &[String]) -> (ResponseStream, String) {
        let mut stream = ResponseStream::new("asked");
        let text = feed(&mut stream, events);
        (stream, text)
    }

    #[test]
    fn a_response_stream_is_its_text_deltas_and_ends_with_the_completed_response() {
        let (stream, text) = fed(&[
            response_event("response.created", 0, CREATED),
            response_event("response.in_progress", 1, CREATED),
            text_delta(2, "Hello"),
            text_delta(3, " there"),
            response_event("response.completed", 4, COMPLETED),
        ]);
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
        let (mut stream, first) = fed(&[
            response_event("response.created", 0, CREATED),
            text_delta(1, "Hel"),
            text_delta(2, "lo"),
        ]);
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
        assert_eq!(stream.reply.id.as_deref(), Some("resp_1"));
    }

    #[test]
    fn a_failed_response_ends_its_stream_with_its_error() {
        let failed = r#","response":{"id":"resp_1","object":"response","status":"failed","error":{"code":"server_error","message":"boom"},"output":[]}"#;
        let (stream, _) = fed(&[
            text_delta(1, "Hi"),
            response_event("response.failed", 2, failed),
        ]);
        assert!(stream.finished());
        assert!(matches!(
            stream.generation(),
            Err(ProviderError::MaybeExecuted { status: 200, .. })
        ));
    }
}
