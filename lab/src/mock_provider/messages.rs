//! The mock's `POST /v1/messages`: Anthropic's Messages API, on the same machinery as the
//! OpenAI routes (the fault and latency draws, the generation counted per `Idempotency-Key`,
//! `/stats`, the in-flight and cancelled counters), speaking Anthropic's shapes: `x-api-key`
//! and `anthropic-version` are required, the reply is a `message` with text blocks, and every
//! error, an injected fault included, is `{"type":"error","error":{"type":...,"message":...}}`
//! with the type Anthropic gives its status (429 `rate_limit_error`, 529 `overloaded_error`,
//! ...) and the fault's headers (`retry-after`).
//!
//! Like the real API it never deduplicates: Anthropic documents no idempotency key, so a
//! repeated key generates (and counts) again whatever `honour_idempotency_key` says. The key
//! is only what the generations are counted under.
//!
//! With `"stream": true` the message is answered as Anthropic streams it (the events in
//! `super::stream`): the first event at its time to first token, the text in deltas paced to
//! close at the latency (`super::pace`), and a stream fault's cut, stall or `error` event
//! mid-stream.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::json;

use super::behaviour::latency_directive;
use super::server::{
    ChatRequest, ChatRequestMessage, InFlight, MockState, Produced, ShuttingDown, answer,
    apply_fault_before_work, finish_unless_asked, idempotency_key, produce, shutting_down,
    token_cost,
};
use super::sse::stream_answer;
use super::stream::{Message, Usage, anthropic_error_event, anthropic_events, course, error_type};

/// The `anthropic-version` values the mock serves: the ones Anthropic documents.
pub const KNOWN_VERSIONS: &[&str] = &["2023-06-01", "2023-01-01"];

/// Largest error body the mock re-reads to put it in Anthropic's shape.
const MAX_ERROR_BODY: usize = 64 * 1024;

/// The part of a Messages request the mock reads; other fields (`temperature`, `metadata`,
/// ...) are accepted and ignored, as the API ignores none but the mock need not.
#[derive(Debug, Deserialize)]
struct MessagesRequest {
    model: String,
    max_tokens: u64,
    #[serde(default)]
    system: Option<Content>,
    messages: Vec<InputMessage>,
    #[serde(default)]
    stream: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct InputMessage {
    role: String,
    content: Content,
}

/// A message's (or the system prompt's) content: a string, or a list of blocks of which the
/// text ones are read.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Blocks(Vec<Block>),
}

#[derive(Debug, Deserialize)]
struct Block {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

impl Content {
    fn text(&self) -> String {
        match self {
            Content::Text(text) => text.clone(),
            Content::Blocks(blocks) => blocks
                .iter()
                .filter(|b| b.kind == "text")
                .filter_map(|b| b.text.as_deref())
                .collect(),
        }
    }
}

/// Reads a Messages body as the request the shared machinery serves (the system prompt first,
/// as a `system` message), naming the problem when it is not one the API would take.
fn parse_messages_request(body: &[u8]) -> Result<ChatRequest, String> {
    let request: MessagesRequest =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    if request.max_tokens == 0 {
        return Err("max_tokens: must be at least 1".into());
    }
    if request.messages.is_empty() {
        return Err("messages: at least one message is required".into());
    }
    let mut messages = Vec::with_capacity(request.messages.len() + 1);
    if let Some(system) = &request.system {
        messages.push(ChatRequestMessage {
            role: "system".into(),
            content: system.text(),
        });
    }
    for (i, message) in request.messages.iter().enumerate() {
        if !matches!(message.role.as_str(), "user" | "assistant") {
            return Err(format!(
                "messages.{i}.role: Input should be 'user' or 'assistant'"
            ));
        }
        messages.push(ChatRequestMessage {
            role: message.role.clone(),
            content: message.content.text(),
        });
    }
    Ok(ChatRequest {
        model: Some(request.model),
        messages,
        // Always sent to this API; counted against a token limit like OpenAI's.
        max_tokens: Some(u32::try_from(request.max_tokens).unwrap_or(u32::MAX)),
        max_completion_tokens: None,
        stream: request.stream,
        stream_options: None,
    })
}

/// `POST /v1/messages`.
pub(super) async fn create_message(
    State(state): State<Arc<MockState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let in_flight = InFlight::enter(&state);
    if let Some(refusal) = refuse_headers(&headers) {
        return in_flight.answered(refusal);
    }
    let request = match parse_messages_request(&body) {
        Ok(request) => request,
        Err(message) => {
            return in_flight.answered(anthropic_error(StatusCode::BAD_REQUEST, &message));
        }
    };
    let key = idempotency_key(&headers);
    state.note_traceparent(key.as_deref(), &headers);
    // The limits, as on the other generating routes (their refusal in the profile's shape).
    let cost = token_cost(
        request.messages.iter().map(|m| m.content.as_str()),
        request.max_tokens,
    );
    let admitted = match state.admit(cost) {
        Ok(admitted) => admitted,
        Err(refusal) => return in_flight.answered(*refusal),
    };

    let (fault, latency) = state.draw();
    let fault = fault.for_answer(request.streamed());
    let latency =
        latency_directive(request.messages.iter().map(|m| m.content.as_str())).unwrap_or(latency);
    if let Err(response) = apply_fault_before_work(&state, fault).await {
        return in_flight.answered(admitted.decorate(in_anthropic_shape(response).await));
    }
    let streamed = request.streamed();
    // A stream's text exists at its first token, its deltas then take the rest of the latency.
    let until_text = if streamed {
        state.stream_pacing().first_token(latency)
    } else {
        latency
    };
    let work = {
        let state = Arc::clone(&state);
        async move { produce(&state, key.as_deref(), &request, until_text).await }
    };
    if streamed {
        let chunk_chars = state.stream_chunk_chars();
        return stream_answer(
            &state,
            admitted,
            in_flight,
            latency,
            work,
            move |produced: Produced| {
                let message = Message {
                    id: &message_id(&produced),
                    model: &produced.model,
                    text: &produced.text,
                    usage: Usage {
                        input_tokens: produced.prompt_tokens,
                        output_tokens: produced.completion_tokens,
                    },
                };
                course(
                    anthropic_events(message, chunk_chars),
                    fault,
                    anthropic_error_event,
                )
            },
        );
    }
    let produced = match finish_unless_asked(&state, work).await {
        Ok(produced) => produced,
        Err(ShuttingDown) => {
            return in_flight
                .answered(admitted.decorate(in_anthropic_shape(shutting_down()).await));
        }
    };
    let body = json!({
        "id": message_id(&produced),
        "type": "message",
        "role": "assistant",
        "model": produced.model,
        "content": [{ "type": "text", "text": produced.text }],
        "stop_reason": "end_turn",
        "stop_sequence": null,
        "usage": {
            "input_tokens": produced.prompt_tokens,
            "output_tokens": produced.completion_tokens,
        },
    });
    in_flight.answered(admitted.decorate(answer(fault, Bytes::from(body.to_string()))))
}

/// A generation's message id.
fn message_id(produced: &Produced) -> String {
    format!("msg_mock_{}", produced.generation)
}

/// The API's own header checks, before the body is read: a key (any non-empty one) and a
/// version it knows. The refusal when they fail.
pub(super) fn refuse_headers(headers: &HeaderMap) -> Option<Response> {
    let value = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
            .filter(|v| !v.is_empty())
    };
    if value("x-api-key").is_none() {
        return Some(anthropic_error(
            StatusCode::UNAUTHORIZED,
            "x-api-key header is required",
        ));
    }
    match value("anthropic-version") {
        None => Some(anthropic_error(
            StatusCode::BAD_REQUEST,
            "anthropic-version: header is required",
        )),
        Some(version) if !KNOWN_VERSIONS.contains(&version) => Some(anthropic_error(
            StatusCode::BAD_REQUEST,
            &format!("anthropic-version: unknown version `{version}`"),
        )),
        Some(_) => None,
    }
}

/// An error in Anthropic's shape.
fn anthropic_error(status: StatusCode, message: &str) -> Response {
    let body = json!({
        "type": "error",
        "error": { "type": error_type(status), "message": message },
    });
    (status, axum::Json(body)).into_response()
}

/// An answer of the shared machinery (an injected fault, a shutdown) in Anthropic's shape:
/// the same status and headers (`retry-after`, any rate-limit headers), the message re-read
/// from its OpenAI-shaped body. A success passes through.
async fn in_anthropic_shape(response: Response) -> Response {
    let (mut parts, body) = response.into_parts();
    if parts.status.is_success() {
        return Response::from_parts(parts, body);
    }
    let bytes = axum::body::to_bytes(body, MAX_ERROR_BODY)
        .await
        .unwrap_or_default();
    let message = serde_json::from_slice::<serde_json::Value>(&bytes)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(str::to_owned))
        .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
    let error = json!({
        "type": "error",
        "error": { "type": error_type(parts.status), "message": message },
    });
    // The body changes: its old length must not travel with it.
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, axum::body::Body::from(error.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_messages_body_becomes_the_shared_request_with_its_system_prompt_first() {
        let request = parse_messages_request(
            br#"{"model":"claude-x","max_tokens":5,"system":[{"type":"text","text":"Be brief."}],
                 "messages":[{"role":"user","content":"hi"},
                             {"role":"assistant","content":[{"type":"text","text":"yo"}]},
                             {"role":"user","content":[{"type":"image"},{"type":"text","text":"again"}]}]}"#,
        )
        .unwrap();
        assert_eq!(request.model.as_deref(), Some("claude-x"));
        let pairs: Vec<(&str, &str)> = request
            .messages
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            pairs,
            [
                ("system", "Be brief."),
                ("user", "hi"),
                ("assistant", "yo"),
                ("user", "again")
            ]
        );
    }

    #[test]
    fn bodies_the_api_refuses_are_named() {
        for (body, problem) in [
            ("{not json", "invalid request body"),
            (
                r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
                "missing field `max_tokens`",
            ),
            (
                r#"{"max_tokens":5,"messages":[{"role":"user","content":"x"}]}"#,
                "missing field `model`",
            ),
            (
                r#"{"model":"m","max_tokens":0,"messages":[{"role":"user","content":"x"}]}"#,
                "max_tokens: must be at least 1",
            ),
            (
                r#"{"model":"m","max_tokens":5,"messages":[]}"#,
                "messages: at least one message",
            ),
            (
                r#"{"model":"m","max_tokens":5,"messages":[{"role":"system","content":"x"}]}"#,
                "messages.0.role",
            ),
        ] {
            let error = parse_messages_request(body.as_bytes()).unwrap_err();
            assert!(error.contains(problem), "{body}: {error}");
        }
    }

    #[test]
    fn each_status_has_anthropics_error_type() {
        for (status, kind) in [
            (400, "invalid_request_error"),
            (401, "authentication_error"),
            (403, "permission_error"),
            (404, "not_found_error"),
            (413, "request_too_large"),
            (422, "invalid_request_error"),
            (429, "rate_limit_error"),
            (500, "api_error"),
            (503, "api_error"),
            (529, "overloaded_error"),
        ] {
            assert_eq!(
                error_type(StatusCode::from_u16(status).unwrap()),
                kind,
                "{status}"
            );
        }
    }
}
