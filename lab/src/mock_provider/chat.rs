//! The mock's `POST /v1/chat/completions`: OpenAI's chat endpoint, answered whole or streamed,
//! with the idempotency store behind `honour_idempotency_key` (a repeated key waits for the
//! first request's reply and gets the same bytes).
//!
//! It is a file of its own, beside `super::messages`, because it streams through `super::sse`,
//! which depends on the server. The server never imports what streams its answers.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use serde_json::json;
use tokio::sync::watch;

use super::behaviour::latency_directive;
use super::server::{
    ChatRequest, InFlight, KeyState, MockState, Produced, Reply, ShuttingDown, answer,
    apply_fault_before_work, finish_unless_asked, idempotency_key, lock, openai_error, produce,
    shutting_down, token_cost,
};
use super::sse::stream_answer;
use super::stream::{ChatCompletion, Usage, chat_error_event, chat_events, course};

fn parse_request(body: &[u8]) -> Result<ChatRequest, String> {
    let request: ChatRequest =
        serde_json::from_slice(body).map_err(|e| format!("invalid request body: {e}"))?;
    if request.messages.is_empty() {
        return Err("'messages' must contain at least one message".into());
    }
    if request.stream_options.is_some() && !request.streamed() {
        return Err(
            "The 'stream_options' parameter is only allowed when 'stream' is enabled.".into(),
        );
    }
    Ok(request)
}

pub(super) async fn chat_completions(
    State(state): State<Arc<MockState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    let in_flight = InFlight::enter(&state);
    let request = match parse_request(&body) {
        Ok(request) => request,
        Err(message) => {
            return in_flight.answered(openai_error(StatusCode::BAD_REQUEST, &message));
        }
    };
    let key = idempotency_key(&headers);
    state.note_traceparent(key.as_deref(), &headers);
    let cost = token_cost(
        request.messages.iter().map(|m| m.content.as_str()),
        request.max_tokens.or(request.max_completion_tokens),
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
        return in_flight.answered(admitted.decorate(response));
    }

    let streamed = request.streamed().then(|| request.include_usage());
    // A stream's text exists at its first token, its deltas then take the rest of the latency.
    let until_text = if streamed.is_some() {
        state.stream_pacing().first_token(latency)
    } else {
        latency
    };
    let work = {
        let state = Arc::clone(&state);
        async move {
            match key {
                Some(key) if state.settings.honour_idempotency_key => {
                    reply_once(&state, key, &request, until_text).await
                }
                key => generate(&state, key.as_deref(), &request, until_text).await,
            }
        }
    };
    if let Some(include_usage) = streamed {
        let chunk_chars = state.stream_chunk_chars();
        return stream_answer(
            &state,
            admitted,
            in_flight,
            latency,
            work,
            move |reply: Reply| {
                let events = chat_events(&reply.completion, include_usage, chunk_chars);
                course(events, fault, |_| chat_error_event())
            },
        );
    }
    let Ok(reply) = finish_unless_asked(&state, work).await else {
        return in_flight.answered(admitted.decorate(shutting_down()));
    };
    in_flight.answered(admitted.decorate(answer(fault, reply.body)))
}

/// The reply stored under `key`, generating it only if no request with this key has: a request
/// that finds the first one still in flight waits for it and returns the same bytes.
async fn reply_once(
    state: &MockState,
    key: String,
    request: &ChatRequest,
    until_text: Duration,
) -> Result<Reply, ShuttingDown> {
    // Bounded by the number of leaders that are cancelled before finishing; each pass either
    // returns, waits for a leader, or becomes the leader.
    let leader = loop {
        let waiting = {
            let mut keys = lock(&state.keys);
            match keys.get(&key) {
                Some(KeyState::Done(reply)) => return Ok(reply.clone()),
                Some(KeyState::InFlight(rx)) => rx.clone(),
                None => {
                    let (tx, rx) = watch::channel(None);
                    keys.insert(key.clone(), KeyState::InFlight(rx));
                    break tx;
                }
            }
        };
        let mut waiting = waiting;
        if let Ok(reply) = waiting.wait_for(Option::is_some).await {
            // `wait_for` only returns once the value is `Some`.
            return Ok(reply.clone().expect("waited for Some"));
        }
        // The leader was dropped (its client went away) before finishing: its guard removed
        // the entry, so the next pass finds no entry or a new leader.
    };
    let mut guard = LeaderGuard {
        state,
        key: &key,
        leader: Some(leader),
    };
    let reply = generate(state, Some(&key), request, until_text).await?;
    guard.complete(reply.clone());
    Ok(reply)
}

/// Removes an unfinished in-flight entry when its leader is dropped, so the waiters (woken by
/// the dropped sender) start over instead of waiting forever.
struct LeaderGuard<'a> {
    state: &'a MockState,
    key: &'a str,
    leader: Option<watch::Sender<Option<Reply>>>,
}

impl LeaderGuard<'_> {
    fn complete(&mut self, reply: Reply) {
        // Store before waking the waiters, so a waiter that starts over finds `Done`.
        lock(&self.state.keys).insert(self.key.to_owned(), KeyState::Done(reply.clone()));
        if let Some(leader) = self.leader.take() {
            leader.send_replace(Some(reply));
        }
    }
}

impl Drop for LeaderGuard<'_> {
    fn drop(&mut self) {
        if self.leader.is_some() {
            lock(&self.state.keys).remove(self.key);
        }
    }
}

/// A chat generation: [`produce`], wrapped as a chat completion.
async fn generate(
    state: &MockState,
    key: Option<&str>,
    request: &ChatRequest,
    until_text: Duration,
) -> Result<Reply, ShuttingDown> {
    let Produced {
        generation,
        text,
        model,
        prompt_tokens,
        completion_tokens,
    } = produce(state, key, request, until_text).await?;
    let created = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let usage = Usage {
        input_tokens: prompt_tokens,
        output_tokens: completion_tokens,
    };
    let completion = ChatCompletion {
        id: format!("chatcmpl-mock-{generation}"),
        created,
        model,
        text,
        usage: (!lock(&state.faults).omit_usage).then_some(usage),
    };
    let mut body = json!({
        "id": completion.id,
        "object": "chat.completion",
        "created": completion.created,
        "model": completion.model,
        "choices": [{
            "index": 0,
            "message": { "role": "assistant", "content": completion.text },
            "finish_reason": "stop",
        }],
    });
    if let Some(usage) = completion.usage {
        body["usage"] = json!({
            "prompt_tokens": usage.input_tokens,
            "completion_tokens": usage.output_tokens,
            "total_tokens": usage.input_tokens + usage.output_tokens,
        });
    }
    Ok(Reply {
        body: Bytes::from(body.to_string()),
        completion: Arc::new(completion),
    })
}
