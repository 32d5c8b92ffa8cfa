//! The mock's streamed answers, kept pure: the reply cut into deltas on character boundaries,
//! the events OpenAI chat completions and Anthropic Messages send for it, in their order and
//! shapes (the background responses' events are kept by the response, in `background`), and
//! where a stream fault breaks a stream and how the stream then ends. The server sends the
//! events at the offsets `super::pace` gives them.
//!
//! The service parses these streams with a standard SSE parser, so they are the real APIs'
//! streams to the byte where it matters: a `[DONE]` only at the end, a usage chunk only when
//! asked, an error event in the API's own shape, a cut that is a cut of the connection. A
//! kinder stream would let a client pass here that fails against the real API.

use std::time::Duration;

use axum::http::StatusCode;
use serde_json::{Value, json};

use super::behaviour::Fault;

/// The message OpenAI sends in an error event mid-stream, and in a response that failed so.
pub const OPENAI_STREAM_ERROR: &str =
    "The server had an error while processing your request. Sorry about that!";

/// Where an event stands in a stream: what a stream fault counts and strikes before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Part {
    /// Before the text: the message or response opening.
    Head,
    /// A piece of the text.
    Delta,
    /// After the text: its close, the usage, the end.
    Tail,
}

/// One server-sent event.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    /// The `event:` line; none for OpenAI chat, whose chunks are bare `data:` lines.
    pub name: Option<String>,
    /// The `data:` line: one JSON text, or `[DONE]`.
    pub data: String,
    pub part: Part,
}

impl Event {
    /// A bare `data:` event.
    fn data(data: impl Into<String>, part: Part) -> Self {
        Self {
            name: None,
            data: data.into(),
            part,
        }
    }

    /// An event named after its JSON's `type`, as Anthropic and the Responses API send them.
    pub fn typed(data: &Value, part: Part) -> Self {
        Self {
            name: data["type"].as_str().map(str::to_owned),
            data: data.to_string(),
            part,
        }
    }

    /// The event as it goes on the wire: a `data:` line for each line of its data, as the SSE
    /// spec writes a value that holds newlines (its reader joins them again with one).
    pub fn to_sse(&self) -> String {
        let mut sse = match &self.name {
            Some(name) => format!("event: {name}\n"),
            None => String::new(),
        };
        for line in self.data.split('\n') {
            sse.push_str("data: ");
            sse.push_str(line);
            sse.push('\n');
        }
        sse.push('\n');
        sse
    }

    /// The event with its data broken into two lines after its first comma
    /// (`stream_split_data`): on the wire, two `data:` lines. A JSON text stays the same JSON,
    /// a newline between two of its tokens being whitespace; data without a comma is kept.
    pub fn split_in_two_lines(&self) -> Self {
        let data = match self.data.split_once(',') {
            Some((first, rest)) => format!("{first},\n{rest}"),
            None => self.data.clone(),
        };
        Self {
            data,
            ..self.clone()
        }
    }

    /// Whether this is its API's final event, after which nothing is sent: chat completions'
    /// `[DONE]`, Messages' `message_stop`.
    pub fn is_final(&self) -> bool {
        self.data == "[DONE]" || self.name.as_deref() == Some("message_stop")
    }
}

/// `text` in pieces of `chars` characters (the last may be shorter), never splitting a
/// character; they concatenate to `text`. `chars` is at least 1 (the settings refuse 0).
pub fn chunk_text(text: &str, chars: usize) -> Vec<&str> {
    let chars = chars.max(1);
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let end = rest
            .char_indices()
            .nth(chars)
            .map_or(rest.len(), |(index, _)| index);
        let (piece, tail) = rest.split_at(end);
        pieces.push(piece);
        rest = tail;
    }
    pieces
}

/// Where a stream fault strikes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strike {
    /// Before the first event: the work is done and its answer lost.
    AtOnce,
    /// After that many deltas, or before the text's close if it has fewer.
    AfterDeltas(usize),
}

impl Strike {
    /// Whether the fault strikes before an event of `part`, `deltas_sent` deltas in.
    pub fn before(self, part: Part, deltas_sent: usize) -> bool {
        match (self, part) {
            (Strike::AtOnce, _) | (Strike::AfterDeltas(_), Part::Tail) => true,
            (Strike::AfterDeltas(_), Part::Head) => false,
            (Strike::AfterDeltas(after), Part::Delta) => deltas_sent >= after,
        }
    }
}

/// How a stream ended, as `/stats` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamEnd {
    /// Sent to its end.
    Completed,
    /// Closed after an error event (or a background response's `response.failed`).
    Errored,
    /// Its connection cut.
    Cut,
    /// Silent for this long, then cut.
    Stalled(Duration),
}

/// Where a fault breaks a stream and how the stream then ends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Break {
    pub strike: Strike,
    pub end: StreamEnd,
}

/// The break `fault` makes in a streamed answer; `None` when the stream runs to its end (the
/// faults answered before the work leave a stream that starts alone).
pub fn stream_break(fault: Fault) -> Option<Break> {
    let (strike, end) = match fault {
        Fault::DropAfterWork => (Strike::AtOnce, StreamEnd::Cut),
        Fault::StreamCut { after_chunks } => (Strike::AfterDeltas(after_chunks), StreamEnd::Cut),
        Fault::StreamStall {
            after_chunks,
            hang_ms,
        } => (
            Strike::AfterDeltas(after_chunks),
            StreamEnd::Stalled(Duration::from_millis(hang_ms)),
        ),
        Fault::StreamError { after_chunks, .. } => {
            (Strike::AfterDeltas(after_chunks), StreamEnd::Errored)
        }
        Fault::None | Fault::Error { .. } | Fault::RateLimit { .. } | Fault::Hang { .. } => {
            return None;
        }
    };
    Some(Break { strike, end })
}

/// What a streamed answer sends, and how it ends once sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Course {
    pub events: Vec<Event>,
    pub end: StreamEnd,
    /// The deltas of the whole text, sent or not: the generation's pace is set by its text,
    /// not by where a fault breaks its answer.
    pub text_deltas: usize,
}

impl Course {
    /// The course without its API's final event (`stream_without_final_event`): a stream that
    /// ran to its end then ends cleanly after the last event before it.
    pub fn without_final_event(mut self) -> Self {
        self.events.retain(|event| !event.is_final());
        self
    }
}

/// The course of a stream of `events` under `fault`: all of them, or those before its strike,
/// then `error_event` of the fault's status when it is a stream error.
pub fn course(events: Vec<Event>, fault: Fault, error_event: impl FnOnce(u16) -> Event) -> Course {
    let text_deltas = events.iter().filter(|e| e.part == Part::Delta).count();
    let Some(broken) = stream_break(fault) else {
        return Course {
            events,
            end: StreamEnd::Completed,
            text_deltas,
        };
    };
    let mut deltas = 0;
    let mut sent: Vec<Event> = events
        .into_iter()
        .take_while(|event| {
            let goes = !broken.strike.before(event.part, deltas);
            deltas += usize::from(goes && event.part == Part::Delta);
            goes
        })
        .collect();
    if let Fault::StreamError { status, .. } = fault {
        sent.push(error_event(status));
    }
    Course {
        events: sent,
        end: broken.end,
        text_deltas,
    }
}

/// The token counts of a reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    pub input_tokens: u32,
    pub output_tokens: u32,
}

/// A chat completion, as its JSON body and its stream both tell it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatCompletion {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub text: String,
    /// `None` when the answer leaves it out (`omit_usage`).
    pub usage: Option<Usage>,
}

/// OpenAI's `chat.completion.chunk` events for `completion`: the role, the text in pieces of
/// `chunk_chars`, the `finish_reason`, the usage (only when `include_usage` asked for it; every
/// chunk then carries `"usage": null` but that one), then `[DONE]`.
pub fn chat_events(
    completion: &ChatCompletion,
    include_usage: bool,
    chunk_chars: usize,
) -> Vec<Event> {
    let chunk = |choices: Value, usage: Value, part: Part| {
        let mut body = json!({
            "id": completion.id,
            "object": "chat.completion.chunk",
            "created": completion.created,
            "model": completion.model,
            "choices": choices,
        });
        if include_usage {
            body["usage"] = usage;
        }
        Event::data(body.to_string(), part)
    };
    let choice = |delta: Value, finish_reason: Value| json!([{ "index": 0, "delta": delta, "finish_reason": finish_reason }]);
    let mut events = vec![chunk(
        choice(json!({ "role": "assistant", "content": "" }), Value::Null),
        Value::Null,
        Part::Head,
    )];
    events.extend(
        chunk_text(&completion.text, chunk_chars)
            .into_iter()
            .map(|piece| {
                chunk(
                    choice(json!({ "content": piece }), Value::Null),
                    Value::Null,
                    Part::Delta,
                )
            }),
    );
    events.push(chunk(
        choice(json!({}), json!("stop")),
        Value::Null,
        Part::Tail,
    ));
    if include_usage && let Some(usage) = completion.usage {
        events.push(chunk(
            json!([]),
            json!({
                "prompt_tokens": usage.input_tokens,
                "completion_tokens": usage.output_tokens,
                "total_tokens": usage.input_tokens + usage.output_tokens,
            }),
            Part::Tail,
        ));
    }
    events.push(Event::data("[DONE]", Part::Tail));
    events
}

/// OpenAI's error mid-stream: a bare `data:` event with the error body, after which the
/// connection closes with no `[DONE]`.
pub fn chat_error_event() -> Event {
    let body = json!({
        "error": { "message": OPENAI_STREAM_ERROR, "type": "server_error", "param": null, "code": null }
    });
    Event::data(body.to_string(), Part::Tail)
}

/// A message as Anthropic streams it.
#[derive(Debug, Clone, Copy)]
pub struct Message<'a> {
    pub id: &'a str,
    pub model: &'a str,
    pub text: &'a str,
    pub usage: Usage,
}

/// Anthropic's events for `message`, in its order: `message_start`, `content_block_start`,
/// `ping`, a `content_block_delta` per piece of `chunk_chars`, `content_block_stop`,
/// `message_delta` (the stop reason and output tokens), `message_stop`.
pub fn anthropic_events(message: Message<'_>, chunk_chars: usize) -> Vec<Event> {
    let mut events = vec![
        Event::typed(
            &json!({
                "type": "message_start",
                "message": {
                    "id": message.id,
                    "type": "message",
                    "role": "assistant",
                    "content": [],
                    "model": message.model,
                    "stop_reason": null,
                    "stop_sequence": null,
                    "usage": { "input_tokens": message.usage.input_tokens, "output_tokens": 1 },
                },
            }),
            Part::Head,
        ),
        Event::typed(
            &json!({
                "type": "content_block_start",
                "index": 0,
                "content_block": { "type": "text", "text": "" },
            }),
            Part::Head,
        ),
        Event::typed(&json!({ "type": "ping" }), Part::Head),
    ];
    events.extend(
        chunk_text(message.text, chunk_chars)
            .into_iter()
            .map(|piece| {
                Event::typed(
                    &json!({
                        "type": "content_block_delta",
                        "index": 0,
                        "delta": { "type": "text_delta", "text": piece },
                    }),
                    Part::Delta,
                )
            }),
    );
    events.extend(
        [
            json!({ "type": "content_block_stop", "index": 0 }),
            json!({
                "type": "message_delta",
                "delta": { "stop_reason": "end_turn", "stop_sequence": null },
                "usage": { "output_tokens": message.usage.output_tokens },
            }),
            json!({ "type": "message_stop" }),
        ]
        .iter()
        .map(|data| Event::typed(data, Part::Tail)),
    );
    events
}

/// Anthropic's error mid-stream, of the type its documentation gives `status`
/// (`overloaded_error` for 529, `api_error` for the 500s), after which the connection closes.
pub fn anthropic_error_event(status: u16) -> Event {
    let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    let kind = error_type(status);
    let message = match kind {
        "overloaded_error" => "Overloaded",
        _ => "Internal server error",
    };
    Event::typed(
        &json!({ "type": "error", "error": { "type": kind, "message": message } }),
        Part::Tail,
    )
}

/// Anthropic's error type for a status, as its documentation lists them.
pub fn error_type(status: StatusCode) -> &'static str {
    match status.as_u16() {
        401 => "authentication_error",
        402 => "billing_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        529 => "overloaded_error",
        // 400 and the 4xx statuses Anthropic does not list.
        400..=499 => "invalid_request_error",
        _ => "api_error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn json_of(event: &Event) -> Value {
        serde_json::from_str(&event.data).expect("a JSON event")
    }

    fn completion(text: &str, usage: Option<Usage>) -> ChatCompletion {
        ChatCompletion {
            id: "chatcmpl-mock-4".into(),
            created: 1_700_000_000,
            model: "m".into(),
            text: text.into(),
            usage,
        }
    }

    const USAGE: Usage = Usage {
        input_tokens: 5,
        output_tokens: 3,
    };

    #[test]
    fn text_is_cut_on_character_boundaries() {
        assert_eq!(chunk_text("abcdefg", 3), ["abc", "def", "g"]);
        assert_eq!(chunk_text("héllo wörld", 4), ["héll", "o wö", "rld"]);
        assert_eq!(chunk_text("ab", 12), ["ab"]);
        assert!(chunk_text("", 3).is_empty());
    }

    proptest! {
        /// The deltas put back together are the reply, each at most `chars` characters.
        #[test]
        fn the_deltas_concatenate_to_the_text(text in "\\PC{0,200}", chars in 1usize..20) {
            let pieces = chunk_text(&text, chars);
            prop_assert_eq!(pieces.concat(), text.as_str());
            prop_assert!(pieces.iter().all(|p| (1..=chars).contains(&p.chars().count())));
        }
    }

    #[test]
    fn a_chat_stream_is_the_role_the_pieces_the_stop_then_done() {
        let events = chat_events(&completion("hello world", Some(USAGE)), false, 6);
        assert!(events.iter().all(|e| e.name.is_none()));
        assert_eq!(
            events.iter().map(|e| e.part).collect::<Vec<_>>(),
            [Part::Head, Part::Delta, Part::Delta, Part::Tail, Part::Tail]
        );
        let first = json_of(&events[0]);
        assert_eq!(first["object"], "chat.completion.chunk");
        assert_eq!(first["id"], "chatcmpl-mock-4");
        assert_eq!(first["created"], 1_700_000_000);
        assert_eq!(
            first["choices"],
            json!([{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}])
        );
        assert!(first.get("usage").is_none(), "no usage unless asked");
        let text: String = events[1..3]
            .iter()
            .map(|e| {
                json_of(e)["choices"][0]["delta"]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect();
        assert_eq!(text, "hello world");
        assert_eq!(
            json_of(&events[3])["choices"],
            json!([{"index":0,"delta":{},"finish_reason":"stop"}])
        );
        assert_eq!(events[4].to_sse(), "data: [DONE]\n\n");
        assert!(events[0].to_sse().starts_with("data: {"));
        assert!(events[0].to_sse().ends_with("}\n\n"));
    }

    #[test]
    fn a_chat_stream_asked_for_usage_ends_with_a_usage_chunk_without_choices() {
        let events = chat_events(&completion("hi", Some(USAGE)), true, 12);
        assert_eq!(events.len(), 5);
        for event in &events[..3] {
            assert_eq!(json_of(event)["usage"], Value::Null);
            assert!(json_of(event).get("usage").is_some());
        }
        let usage = json_of(&events[3]);
        assert_eq!(usage["choices"], json!([]));
        assert_eq!(
            usage["usage"],
            json!({"prompt_tokens":5,"completion_tokens":3,"total_tokens":8})
        );
        assert_eq!(events[4].data, "[DONE]");

        let omitted = chat_events(&completion("hi", None), true, 12);
        assert_eq!(omitted.len(), 4, "omit_usage leaves the usage chunk out");
    }

    #[test]
    fn an_anthropic_stream_follows_its_event_order() {
        let message = Message {
            id: "msg_mock_2",
            model: "claude-x",
            text: "hello world",
            usage: USAGE,
        };
        let events = anthropic_events(message, 5);
        let names: Vec<&str> = events.iter().map(|e| e.name.as_deref().unwrap()).collect();
        assert_eq!(
            names,
            [
                "message_start",
                "content_block_start",
                "ping",
                "content_block_delta",
                "content_block_delta",
                "content_block_delta",
                "content_block_stop",
                "message_delta",
                "message_stop"
            ]
        );
        for event in &events {
            assert_eq!(json_of(event)["type"], event.name.as_deref().unwrap());
        }
        let start = json_of(&events[0]);
        assert_eq!(start["message"]["id"], "msg_mock_2");
        assert_eq!(start["message"]["content"], json!([]));
        assert_eq!(start["message"]["stop_reason"], Value::Null);
        assert_eq!(
            start["message"]["usage"],
            json!({"input_tokens":5,"output_tokens":1})
        );
        let text: String = events[3..6]
            .iter()
            .map(|e| {
                let delta = json_of(e)["delta"].clone();
                assert_eq!(delta["type"], "text_delta");
                delta["text"].as_str().unwrap().to_owned()
            })
            .collect();
        assert_eq!(text, "hello world");
        assert_eq!(
            json_of(&events[7]),
            json!({"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":3}})
        );
        assert!(
            events[8]
                .to_sse()
                .starts_with("event: message_stop\ndata: {")
        );
    }

    #[test]
    fn each_dialect_has_its_error_event() {
        assert_eq!(
            json_of(&chat_error_event()),
            json!({"error":{"message":OPENAI_STREAM_ERROR,"type":"server_error","param":null,"code":null}})
        );
        assert_eq!(
            anthropic_error_event(529).to_sse(),
            "event: error\ndata: {\"error\":{\"message\":\"Overloaded\",\"type\":\"overloaded_error\"},\"type\":\"error\"}\n\n"
        );
        assert_eq!(
            json_of(&anthropic_error_event(500))["error"]["type"],
            "api_error"
        );
    }

    #[test]
    fn a_stream_fault_strikes_after_its_deltas_or_before_the_close() {
        let events = chat_events(&completion("abcdefghij", Some(USAGE)), true, 2);
        // Role, five deltas, stop, usage, [DONE].
        assert_eq!(events.len(), 9);

        let whole = course(events.clone(), Fault::None, |_| chat_error_event());
        assert_eq!(whole.end, StreamEnd::Completed);
        assert_eq!(whole.events, events);

        let cut = course(events.clone(), Fault::StreamCut { after_chunks: 3 }, |_| {
            chat_error_event()
        });
        assert_eq!(cut.end, StreamEnd::Cut);
        assert_eq!(cut.events, events[..4]);
        assert_eq!(
            (whole.text_deltas, cut.text_deltas),
            (5, 5),
            "a cut stream keeps the pace of its whole text"
        );

        let stalled = course(
            events.clone(),
            Fault::StreamStall {
                after_chunks: 0,
                hang_ms: 50,
            },
            |_| chat_error_event(),
        );
        assert_eq!(stalled.end, StreamEnd::Stalled(Duration::from_millis(50)));
        assert_eq!(stalled.events, events[..1], "the head goes, no delta");

        let errored = course(
            events.clone(),
            Fault::StreamError {
                after_chunks: 99,
                status: 500,
            },
            |_| chat_error_event(),
        );
        assert_eq!(errored.end, StreamEnd::Errored);
        assert_eq!(
            errored.events[..6],
            events[..6],
            "every delta, then the error"
        );
        assert_eq!(errored.events[6], chat_error_event());
        assert_eq!(errored.events.len(), 7);

        let dropped = course(events.clone(), Fault::DropAfterWork, |_| chat_error_event());
        assert_eq!(dropped.end, StreamEnd::Cut);
        assert!(dropped.events.is_empty(), "the answer is lost whole");

        let hang = course(events.clone(), Fault::Hang { hang_ms: 1 }, |_| {
            chat_error_event()
        });
        assert_eq!(
            hang.end,
            StreamEnd::Completed,
            "a hang is over before a stream starts"
        );
    }

    #[test]
    fn a_stream_may_end_without_its_final_event_and_split_its_data_in_two_lines() {
        let chat = chat_events(&completion("hi", Some(USAGE)), true, 12);
        let ended = course(chat.clone(), Fault::None, |_| chat_error_event()).without_final_event();
        assert_eq!(ended.events, chat[..chat.len() - 1], "all but [DONE]");
        assert_eq!(ended.end, StreamEnd::Completed);
        let message = Message {
            id: "msg_1",
            model: "claude-x",
            text: "hi",
            usage: USAGE,
        };
        let anthropic = anthropic_events(message, 5);
        let ended =
            course(anthropic.clone(), Fault::None, |_| chat_error_event()).without_final_event();
        assert_eq!(ended.events, anthropic[..anthropic.len() - 1]);
        assert_eq!(
            ended.events.last().unwrap().name.as_deref(),
            Some("message_delta")
        );

        // Two `data:` lines, whose joining is the same JSON.
        let split = chat[3].split_in_two_lines();
        let sse = split.to_sse();
        assert_eq!(sse.matches("data: ").count(), 2, "{sse}");
        assert!(sse.ends_with("\n\n") && !sse.ends_with("\n\n\n"), "{sse:?}");
        assert_eq!(json_of(&split), json_of(&chat[3]));
        let named = anthropic[anthropic.len() - 2].split_in_two_lines().to_sse();
        assert!(
            named.starts_with("event: message_delta\ndata: {"),
            "{named}"
        );
        assert_eq!(named.matches("\ndata: ").count(), 2, "{named}");
        assert_eq!(
            Event::data("[DONE]", Part::Tail)
                .split_in_two_lines()
                .to_sse(),
            "data: [DONE]\n\n"
        );
    }
}
