//! The mock's background responses: `POST /v1/responses` creates one and answers at once, a
//! spawned task generates it, and `GET /v1/responses/{id}` polls it or resumes its stream. The
//! state machine and the event log are `super::background`'s; these are the routes around it.
//!
//! They are a file of their own, beside `super::messages`, because they stream through
//! `super::sse`, which depends on the server. The server never imports what streams its answers.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::sync::watch;

use super::background::{
    Creation, Output, ResponseState, connection_fault, generation_failure, not_streamable_body,
    parse_create, parse_resume, response_object,
};
use super::behaviour::latency_directive;
use super::pace::StreamPacing;
use super::server::{
    Admitted, ChatRequest, ChatRequestMessage, MockState, Produced, ShuttingDown, answer,
    apply_fault_before_work, idempotency_key, lock, openai_error, produce, token_cost,
};
use super::sse::follow_response;
use super::stream::{OPENAI_STREAM_ERROR, chunk_text};

/// The answer of a provider without background responses (`background_responses = false`).
fn no_background_responses() -> Response {
    openai_error(
        StatusCode::NOT_FOUND,
        "no such route: this provider has no background responses",
    )
}

/// `POST /v1/responses`: validates the body, draws a fault, then creates a response (or finds
/// the key's earlier one) and answers its object at once, `queued` when new. The generation runs
/// in a spawned task, so it goes on whatever happens to this answer: with `DropAfterWork` the
/// response exists and is generating but the client never learns its id.
///
/// With `"stream": true` the answer is the response's event stream instead, from its
/// `response.created` on; a cut or a stall breaks that connection only (the response goes on,
/// to be resumed with `GET /v1/responses/{id}?stream=true&starting_after=N`), a stream error
/// makes the response fail. A key's earlier response is streamed from its start, or refused
/// 400 if it was not created streaming.
pub(super) async fn create_response(
    State(state): State<Arc<MockState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    lock(&state.stats).create_requests += 1;
    if !state.settings.background_responses {
        return no_background_responses();
    }
    let request = match parse_create(&body) {
        Ok(request) => request,
        Err(message) => return openai_error(StatusCode::BAD_REQUEST, &message),
    };
    let streamed = request.streamed();
    let key = idempotency_key(&headers);
    state.note_traceparent(key.as_deref(), &headers);
    let cost = token_cost(
        request.input.iter().map(|m| m.content.as_str()),
        request.max_output_tokens,
    );
    let admitted = match state.admit(cost) {
        Ok(admitted) => admitted,
        Err(refusal) => return *refusal,
    };
    let (fault, latency) = state.draw();
    let fault = fault.for_answer(streamed);
    let latency =
        latency_directive(request.input.iter().map(|m| m.content.as_str())).unwrap_or(latency);
    if let Err(response) = apply_fault_before_work(&state, fault).await {
        return admitted.decorate(response);
    }

    let model = request.model.clone().unwrap_or_else(|| "mock-model".into());
    let now = state.now();
    let (creation, object, has_stream) = {
        let mut book = lock(&state.responses);
        let creation = book.create(
            key.as_deref(),
            state.settings.honour_idempotency_key,
            &model,
            streamed,
            now,
        );
        let (Creation::New(id) | Creation::Existing(id)) = &creation;
        // Rendered under the same lock as the create, so a new response is answered `queued`
        // even if its generation starts before this answer is sent.
        let (object, has_stream) = book
            .get(id, now)
            .map(|entry| (response_object(id, entry), entry.events.is_some()))
            .expect("the book holds the response it just created or found");
        if let Creation::New(id) = &creation
            && streamed
        {
            // Before the stream that follows it and the generation that records it start.
            lock(&state.live).insert(id.clone(), watch::channel(0).0);
        }
        (creation, object, has_stream)
    };
    let response = match (&creation, streamed) {
        (_, false) => answer(fault, Bytes::from(object.to_string())),
        (Creation::Existing(_), true) if !has_stream => not_streamable(),
        (Creation::New(id) | Creation::Existing(id), true) => {
            follow_response(&state, id.clone(), 0, connection_fault(fault))
        }
    };
    let response = admitted.decorate(response);
    if let Creation::New(id) = creation {
        lock(&state.stats).responses_created += 1;
        let chat = ChatRequest {
            model: request.model,
            messages: request
                .input
                .into_iter()
                .map(|m| ChatRequestMessage {
                    role: m.role,
                    content: m.content,
                })
                .collect(),
            max_tokens: request.max_output_tokens,
            max_completion_tokens: None,
            // The response's stream is its own, recorded by `run_background`.
            stream: None,
            stream_options: None,
        };
        let text_stream = streamed.then(|| TextStream {
            chunk_chars: state.stream_chunk_chars(),
            pacing: state.stream_pacing(),
            fails_after: generation_failure(fault),
        });
        tokio::spawn(run_background(
            Arc::clone(&state),
            id,
            key,
            chat,
            latency,
            admitted,
            text_stream,
        ));
    }
    response
}

/// How a streamed response's generation records its text: in deltas of `chunk_chars` at the
/// pace `pacing` gives, failing after `fails_after` deltas when a stream error struck.
struct TextStream {
    chunk_chars: usize,
    pacing: StreamPacing,
    fails_after: Option<usize>,
}

/// The generation of one background response: `in_progress`, the latency, then `completed`
/// (counted like a chat generation, under the key), or `failed` if the mock shuts down first.
/// A streamed one records its text in deltas in between, from its first token on, so it ends
/// at the latency as one generated whole does. The create's admission is held until the
/// generation ends: it is in progress till then.
async fn run_background(
    state: Arc<MockState>,
    id: String,
    key: Option<String>,
    request: ChatRequest,
    latency: Duration,
    admitted: Admitted,
    text_stream: Option<TextStream>,
) {
    state.record(&id, |book| book.begin(&id));
    let until_text = match &text_stream {
        Some(text_stream) => text_stream.pacing.first_token(latency),
        None => latency,
    };
    let end = match produce(&state, key.as_deref(), &request, until_text).await {
        Ok(produced) => match &text_stream {
            Some(text_stream) => record_text(&state, &id, produced, text_stream, latency).await,
            None => ResponseState::Completed(output(produced)),
        },
        Err(ShuttingDown) => shut_down_before_done(),
    };
    state.record(&id, |book| book.finish(&id, end, state.now()));
    lock(&state.live).remove(&id);
    drop(admitted);
}

/// Records a streamed response's text, its first token being now, each delta and then its end
/// at its offset in the pace of a generation of `latency`; how its generation ends.
async fn record_text(
    state: &MockState,
    id: &str,
    produced: Produced,
    text_stream: &TextStream,
    latency: Duration,
) -> ResponseState {
    let first_token = Instant::now();
    state.record(id, |book| book.open_text(id));
    let pieces = chunk_text(&produced.text, text_stream.chunk_chars);
    let pace = text_stream.pacing.pace(latency, pieces.len());
    let sent = text_stream
        .fails_after
        .map_or(pieces.len(), |after| after.min(pieces.len()));
    for (n, piece) in pieces[..sent].iter().enumerate() {
        if state
            .pause_until(first_token, pace.delta_offset(n))
            .await
            .is_err()
        {
            return shut_down_before_done();
        }
        state.record(id, |book| book.delta(id, piece));
    }
    if state
        .pause_until(first_token, pace.tail_offset(sent))
        .await
        .is_err()
    {
        return shut_down_before_done();
    }
    if text_stream.fails_after.is_some() {
        return ResponseState::Failed {
            message: OPENAI_STREAM_ERROR.into(),
        };
    }
    ResponseState::Completed(output(produced))
}

fn output(produced: Produced) -> Output {
    Output {
        text: produced.text,
        model: produced.model,
        input_tokens: produced.prompt_tokens,
        output_tokens: produced.completion_tokens,
    }
}

fn shut_down_before_done() -> ResponseState {
    ResponseState::Failed {
        message: "mock provider shut down before the response was done".into(),
    }
}

/// `GET /v1/responses/{id}`: the response object as it is now; 404 for an unknown id. Faults
/// apply as to any request; `DropAfterWork` loses this poll's answer, not the response.
///
/// With `?stream=true` (and `starting_after=N`), the response's events after sequence number N
/// (all of them without it), then the live ones until it ends, as OpenAI's resume does; 400 for
/// a response not created streaming. A cut or a stall breaks this connection only; a stream
/// error is no fault here (a resume only reads the response).
pub(super) async fn get_response(
    State(state): State<Arc<MockState>>,
    Path(id): Path<String>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    if !state.settings.background_responses {
        return no_background_responses();
    }
    lock(&state.stats).responses_polled += 1;
    let resume = match parse_resume(&query) {
        Ok(resume) => resume,
        Err(message) => return openai_error(StatusCode::BAD_REQUEST, &message),
    };
    let (fault, _latency) = state.draw();
    let fault = fault.for_answer(resume.is_some());
    if let Err(response) = apply_fault_before_work(&state, fault).await {
        return response;
    }
    let now = state.now();
    let found = lock(&state.responses)
        .get(&id, now)
        .map(|entry| (response_object(&id, entry), entry.events.is_some()));
    match (found, resume) {
        (None, _) => openai_error(
            StatusCode::NOT_FOUND,
            &format!("No response found with id '{id}'."),
        ),
        (Some((object, _)), None) => answer(fault, Bytes::from(object.to_string())),
        (Some((_, false)), Some(_)) => not_streamable(),
        (Some((_, true)), Some(from)) => follow_response(&state, id, from, connection_fault(fault)),
    }
}

/// OpenAI's refusal to stream a response created without `stream: true`.
fn not_streamable() -> Response {
    (StatusCode::BAD_REQUEST, axum::Json(not_streamable_body())).into_response()
}
