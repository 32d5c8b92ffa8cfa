//! The mock provider's HTTP routes and shared state: the OpenAI-compatible chat endpoint with
//! its idempotency store, the background responses endpoints around the pure
//! [`ResponseBook`], Anthropic's messages endpoint (in `super::messages`), the capacity limits
//! around the pure [`Capacity`], the counters behind
//! `/stats`, and the run-time fault switch. A request with `"stream": true` is answered by
//! `super::sse` with the events of `super::stream` (or the response's own log).
//!
//! The counters are what the tests and the chaos harness check I6 against: `generations` per key
//! is the number of replies the provider "billed" for that task, through either API. The
//! admissions per second are what a run checks I9 against from the provider's side: a limit
//! never exceeded, sampled at the mock.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::watch;

use super::background::{
    Creation, Output, Replay, ResponseBook, ResponseState, connection_fault, generation_failure,
    not_streamable_body, parse_create, parse_resume, response_object,
};
use super::behaviour::{
    Fault, FaultRng, choose_fault, count_tokens, latency_directive, reply_chars_directive,
    reply_text, sample_latency,
};
use super::capacity::{Admission, Capacity, Limit, limit_headers, refusal_body};
use super::settings::{DEFAULT_MAX_OUTPUT_TOKENS, FaultSettings, MockSettings};
use super::sse::{follow_response, stream_answer};
use super::stream::{
    ChatCompletion, OPENAI_STREAM_ERROR, StreamEnd, Usage, chat_error_event, chat_events,
    chunk_text, course,
};

/// What `GET /stats` answers.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct StatsSnapshot {
    /// Chat-completion and messages requests received, malformed ones included.
    pub requests: u64,
    /// Replies generated (the work a real provider bills for).
    pub generations: u64,
    /// Chat-completion requests being handled right now.
    pub in_flight: u64,
    /// The most requests ever handled at once (a client's concurrency, seen from here).
    pub max_in_flight: u64,
    /// Requests whose client went away before they were answered.
    pub cancelled: u64,
    /// Generations per `Idempotency-Key`, chat and background ones together.
    pub per_key: BTreeMap<String, u64>,
    /// Background responses created by `POST /v1/responses` (a create that found the key's
    /// earlier response is not counted).
    #[serde(default)]
    pub responses_created: u64,
    /// `GET /v1/responses/{id}` requests received, unknown ids and faulted ones included.
    #[serde(default)]
    pub responses_polled: u64,
    /// `POST /v1/responses` requests received (each create, resent or faulted ones included).
    #[serde(default)]
    pub create_requests: u64,
    /// Background responses forgotten after their retention (their lookup is 404 since).
    #[serde(default)]
    pub responses_forgotten: u64,
    /// Generating requests (chat completions, background creates) admitted by the limits.
    #[serde(default)]
    pub admitted: u64,
    /// Generating requests refused over a limit, by limit; they did no work.
    #[serde(default)]
    pub refused: RefusalCounts,
    /// Admitted requests not yet ended: a chat completion until answered, a background
    /// response until its generation ends.
    #[serde(default)]
    pub in_progress: u64,
    /// The most admitted requests ever in progress at once.
    #[serde(default)]
    pub max_in_progress: u64,
    /// Admissions per second of the mock's life (second 0 starts when it started), for the
    /// last [`SECONDS_KEPT`] seconds that had any, oldest first.
    #[serde(default)]
    pub admissions_per_second: Vec<SecondTally>,
    /// The most requests admitted within one of those seconds, over the mock's whole life.
    #[serde(default)]
    pub max_admitted_in_a_second: u64,
    /// The most tokens (as the token limit counts them) admitted within one second.
    #[serde(default)]
    pub max_tokens_in_a_second: u64,
    /// Streamed answers begun: a 200 `text/event-stream` to a chat completion, a message, a
    /// background create or a resume. One whose client left before its end is counted here
    /// only.
    #[serde(default)]
    pub streams_started: u64,
    /// Streamed answers sent to their end.
    #[serde(default)]
    pub streams_completed: u64,
    /// Streamed answers whose connection the mock cut (`stream_cut_rate`, a streamed
    /// `drop_after_work_rate`, a shutdown mid-stream).
    #[serde(default)]
    pub streams_cut: u64,
    /// Streamed answers that stalled (`stream_stall_rate`), counted as the stall begins.
    #[serde(default)]
    pub streams_stalled: u64,
    /// Streamed answers closed after an error event (`stream_error_rate`), or after a
    /// background response's `response.failed`.
    #[serde(default)]
    pub streams_errored: u64,
}

/// Refusals over each limit.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusalCounts {
    pub requests: u64,
    pub tokens: u64,
    pub concurrent: u64,
}

impl RefusalCounts {
    /// All refusals.
    pub fn total(&self) -> u64 {
        self.requests + self.tokens + self.concurrent
    }

    fn count(&mut self, limit: Limit) {
        match limit {
            Limit::Requests => self.requests += 1,
            Limit::Tokens => self.tokens += 1,
            Limit::Concurrent => self.concurrent += 1,
        }
    }
}

/// What one second of the mock's life admitted.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SecondTally {
    /// Whole seconds since the mock started.
    pub second: u64,
    pub requests: u64,
    pub tokens: u64,
}

/// How many seconds of admissions `/stats` keeps.
pub const SECONDS_KEPT: usize = 3600;

/// What `GET /stats/{key}` answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyStats {
    pub key: String,
    /// Replies generated under this key; 0 for a key never seen.
    pub generations: u64,
    /// The `traceparent` headers of the requests sent with this key (chat completions and
    /// background creates), oldest first, at most [`TRACEPARENTS_KEPT`].
    #[serde(default)]
    pub traceparents: Vec<String>,
}

/// How many `traceparent` headers are kept per key.
pub const TRACEPARENTS_KEPT: usize = 32;

/// State shared by all requests. Every lock is a `std` mutex held for a few field updates and
/// never across an `.await`, so it cannot stall the runtime.
///
/// Lock order where two are held: `capacity` before `stats`, so the in-progress count and its
/// maximum move with the limiter's; `responses` before `live`, so a streamed response is
/// watched from its creation.
pub(crate) struct MockState {
    settings: MockSettings,
    faults: Mutex<FaultSettings>,
    rng: Mutex<FaultRng>,
    capacity: Mutex<Capacity>,
    /// The admissions per second, as `/stats` answers them (a copy goes into each snapshot).
    seconds: Mutex<VecDeque<SecondTally>>,
    /// The mock's clock for the limits and the retention: monotonic, so a wall-clock step
    /// cannot let a burst through.
    started: Instant,
    stats: Mutex<StatsSnapshot>,
    keys: Mutex<HashMap<String, KeyState>>,
    responses: Mutex<ResponseBook>,
    /// The streamed background responses still generating, by id: each value moves with every
    /// event the response records, which wakes the streams that follow it.
    live: Mutex<HashMap<String, watch::Sender<u64>>>,
    traceparents: Mutex<HashMap<String, Vec<String>>>,
    shutdown: watch::Receiver<bool>,
}

/// A finished chat reply: the exact bytes sent whole, stored so a replay is identical, and the
/// completion they tell, which a stream sends in pieces (a replay too).
#[derive(Clone)]
struct Reply {
    body: Bytes,
    completion: Arc<ChatCompletion>,
}

enum KeyState {
    /// The first request with this key is generating; later ones wait on this.
    InFlight(watch::Receiver<Option<Reply>>),
    Done(Reply),
}

impl MockState {
    pub(crate) fn new(settings: MockSettings, shutdown: watch::Receiver<bool>) -> Self {
        Self {
            faults: Mutex::new(settings.faults.clone()),
            rng: Mutex::new(FaultRng::new(settings.seed)),
            capacity: Mutex::new(Capacity::new(&settings.limits)),
            seconds: Mutex::new(VecDeque::new()),
            started: Instant::now(),
            stats: Mutex::new(StatsSnapshot::default()),
            keys: Mutex::new(HashMap::new()),
            responses: Mutex::new(ResponseBook::with_retention(
                settings.response_retention_ms().map(Duration::from_millis),
            )),
            live: Mutex::new(HashMap::new()),
            traceparents: Mutex::new(HashMap::new()),
            shutdown,
            settings,
        }
    }

    /// The real API this mock imitates.
    pub(super) fn profile(&self) -> super::settings::MockProfile {
        self.settings.profile
    }

    /// Characters per delta of a stream.
    pub(super) fn stream_chunk_chars(&self) -> usize {
        self.settings.stream_chunk_chars
    }

    /// The pause between two deltas of a stream.
    pub(super) fn stream_chunk_interval(&self) -> Duration {
        Duration::from_millis(self.settings.stream_chunk_interval_ms)
    }

    pub(super) fn stream_started(&self) {
        lock(&self.stats).streams_started += 1;
    }

    pub(super) fn stream_ended(&self, end: StreamEnd) {
        let mut stats = lock(&self.stats);
        match end {
            StreamEnd::Completed => stats.streams_completed += 1,
            StreamEnd::Errored => stats.streams_errored += 1,
            StreamEnd::Cut => stats.streams_cut += 1,
            StreamEnd::Stalled(_) => stats.streams_stalled += 1,
        }
    }

    /// A watch on the events of streamed response `id`, while its generation runs.
    pub(super) fn changes(&self, id: &str) -> Option<watch::Receiver<u64>> {
        lock(&self.live).get(id).map(watch::Sender::subscribe)
    }

    /// Streamed response `id`'s events from sequence number `from` on.
    pub(super) fn replay(&self, id: &str, from: u64) -> Replay {
        lock(&self.responses).replay(id, from, self.now())
    }

    /// Changes response `id` in the book, waking the streams that follow it.
    fn record<R>(&self, id: &str, change: impl FnOnce(&mut ResponseBook) -> R) -> R {
        let changed = change(&mut lock(&self.responses));
        if let Some(live) = lock(&self.live).get(id) {
            live.send_modify(|events| *events += 1);
        }
        changed
    }

    /// Keeps the request's `traceparent` under its idempotency key, when it has both.
    pub(super) fn note_traceparent(&self, key: Option<&str>, headers: &HeaderMap) {
        let (Some(key), Some(value)) = (
            key,
            headers.get("traceparent").and_then(|v| v.to_str().ok()),
        ) else {
            return;
        };
        let mut kept = lock(&self.traceparents);
        let list = kept.entry(key.to_owned()).or_default();
        if list.len() < TRACEPARENTS_KEPT {
            list.push(value.to_owned());
        }
    }

    pub(crate) fn stats(&self) -> StatsSnapshot {
        let mut stats = lock(&self.stats).clone();
        stats.admissions_per_second = lock(&self.seconds).iter().cloned().collect();
        stats.responses_forgotten = lock(&self.responses).forgotten();
        stats
    }

    /// The mock's age: the clock of the limits and the retention.
    fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// Admits a generating request costing `tokens` against the limits, or answers its refusal
    /// (429 in the profile's dialect, at once, with no work done). The admission holds the
    /// request's place among those in progress until it is dropped. The refusal is boxed:
    /// a `Response` is large, and admission is the common path.
    pub(crate) fn admit(self: &Arc<Self>, tokens: u64) -> Result<Admitted, Box<Response>> {
        let now = self.now();
        let dialect = self.settings.profile.refusal_dialect();
        let mut capacity = lock(&self.capacity);
        match capacity.admit(now, tokens) {
            Admission::Admitted(standing) => {
                let in_progress = capacity.in_progress();
                {
                    let mut stats = lock(&self.stats);
                    stats.admitted += 1;
                    stats.in_progress = in_progress;
                    stats.max_in_progress = stats.max_in_progress.max(in_progress);
                }
                drop(capacity);
                self.tally(now, tokens);
                Ok(Admitted {
                    state: Arc::clone(self),
                    headers: limit_headers(dialect, &standing, None, SystemTime::now()),
                })
            }
            Admission::Refused(refusal) => {
                drop(capacity);
                lock(&self.stats).refused.count(refusal.limit);
                let headers = limit_headers(
                    dialect,
                    &refusal.standing,
                    Some(refusal.retry_after),
                    SystemTime::now(),
                );
                let body = refusal_body(dialect, &refusal);
                let mut response =
                    (StatusCode::TOO_MANY_REQUESTS, axum::Json(body)).into_response();
                add_headers(&mut response, &headers);
                Err(Box::new(response))
            }
        }
    }

    /// Counts an admission in its second of the mock's life.
    fn tally(&self, now: Duration, tokens: u64) {
        let second = now.as_secs();
        let mut seconds = lock(&self.seconds);
        // Admissions arrive in clock order up to the lock's scheduling; one that lost the race
        // over a second's edge still lands in its own second.
        let slot = match seconds.iter().rposition(|s| s.second <= second) {
            Some(i) if seconds[i].second == second => i,
            found => {
                let at = found.map_or(0, |i| i + 1);
                seconds.insert(
                    at,
                    SecondTally {
                        second,
                        ..SecondTally::default()
                    },
                );
                at
            }
        };
        seconds[slot].requests += 1;
        seconds[slot].tokens += tokens;
        let (requests, tokens) = (seconds[slot].requests, seconds[slot].tokens);
        while seconds.len() > SECONDS_KEPT {
            seconds.pop_front();
        }
        drop(seconds);
        let mut stats = lock(&self.stats);
        stats.max_admitted_in_a_second = stats.max_admitted_in_a_second.max(requests);
        stats.max_tokens_in_a_second = stats.max_tokens_in_a_second.max(tokens);
    }

    /// One fault and one latency per request, drawn together under one lock so a run's draws
    /// depend only on the seed and the order of arrival.
    pub(super) fn draw(&self) -> (Fault, Duration) {
        let faults = lock(&self.faults).clone();
        let mut rng = lock(&self.rng);
        let fault = choose_fault(rng.next_unit(), &faults);
        let latency = sample_latency(
            self.settings.latency_ms,
            self.settings.latency_jitter_ms,
            rng.next_unit(),
        );
        (fault, latency)
    }

    /// Sleeps, unless the server is shutting down first (then `Err`), so a hanging request
    /// cannot hold up a graceful shutdown.
    pub(super) async fn pause(&self, duration: Duration) -> Result<(), ShuttingDown> {
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            _ = tokio::time::sleep(duration) => Ok(()),
            _ = shutdown.wait_for(|&down| down) => Err(ShuttingDown),
        }
    }
}

pub(super) struct ShuttingDown;

/// An admitted generating request's place in the limits. Dropping it ends the request's time in
/// progress: when it is answered, when its client goes away (hyper drops the handler), or, for
/// a background response, when its generation ends.
pub(crate) struct Admitted {
    state: Arc<MockState>,
    /// The rate-limit headers of the answer, as the limits stood at admission.
    headers: Vec<(&'static str, String)>,
}

impl Admitted {
    /// `response` with the rate-limit headers the real APIs send on every answer.
    pub(crate) fn decorate(&self, mut response: Response) -> Response {
        add_headers(&mut response, &self.headers);
        response
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut capacity = lock(&self.state.capacity);
        capacity.finish();
        lock(&self.state.stats).in_progress = capacity.in_progress();
    }
}

fn add_headers(response: &mut Response, headers: &[(&'static str, String)]) {
    for (name, value) in headers {
        if let Ok(value) = HeaderValue::from_str(value) {
            response.headers_mut().insert(*name, value);
        }
    }
}

/// What a request costs against a token limit: its prompt's tokens, counted as the usage block
/// counts them, plus the most it may generate (OpenAI counts the maximum, not the output).
pub(super) fn token_cost<'a>(
    prompt: impl IntoIterator<Item = &'a str>,
    max_output_tokens: Option<u32>,
) -> u64 {
    let prompt: u64 = prompt
        .into_iter()
        .map(|text| u64::from(count_tokens(text)))
        .sum();
    prompt + max_output_tokens.map_or(DEFAULT_MAX_OUTPUT_TOKENS, u64::from)
}

/// Poisoning only means another request panicked mid-update of plain counters; the data is still
/// usable, and a mock that stops answering would hide the real failure.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The OpenAI routes and the mock's own (`/stats`, `/faults`, `/healthz`); Anthropic's
/// messages route is added beside them by the caller (`super::messages`).
pub(crate) fn routes() -> Router<Arc<MockState>> {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/responses", post(create_response))
        .route("/v1/responses/{id}", get(get_response))
        .route("/stats", get(stats))
        .route("/stats/{key}", get(key_stats))
        .route("/faults", get(get_faults).put(put_faults))
        .route("/healthz", get(|| async { "ok" }))
        .fallback(|| async { openai_error(StatusCode::NOT_FOUND, "no such route") })
}

async fn stats(State(state): State<Arc<MockState>>) -> Response {
    axum::Json(state.stats()).into_response()
}

async fn key_stats(State(state): State<Arc<MockState>>, Path(key): Path<String>) -> Response {
    let generations = lock(&state.stats).per_key.get(&key).copied().unwrap_or(0);
    let traceparents = lock(&state.traceparents)
        .get(&key)
        .cloned()
        .unwrap_or_default();
    axum::Json(KeyStats {
        key,
        generations,
        traceparents,
    })
    .into_response()
}

async fn get_faults(State(state): State<Arc<MockState>>) -> Response {
    axum::Json(lock(&state.faults).clone()).into_response()
}

async fn put_faults(State(state): State<Arc<MockState>>, body: Bytes) -> Response {
    let faults: FaultSettings = match serde_json::from_slice(&body) {
        Ok(faults) => faults,
        Err(e) => return openai_error(StatusCode::BAD_REQUEST, &format!("bad faults: {e}")),
    };
    if let Err(e) = faults.validate() {
        return openai_error(StatusCode::BAD_REQUEST, &e.to_string());
    }
    *lock(&state.faults) = faults.clone();
    axum::Json(faults).into_response()
}

/// The part of a chat-completion request the mock reads; other fields are accepted and ignored,
/// as OpenAI-compatible servers do.
#[derive(Debug, Clone, Deserialize)]
pub(super) struct ChatRequest {
    pub(super) model: Option<String>,
    pub(super) messages: Vec<ChatRequestMessage>,
    /// Counted against a token limit, as is `max_completion_tokens` (the reasoning models'
    /// name for it); the reply itself is not cut to it.
    #[serde(default)]
    pub(super) max_tokens: Option<u32>,
    #[serde(default)]
    pub(super) max_completion_tokens: Option<u32>,
    /// Whether the answer is streamed.
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
}

impl ChatRequest {
    pub(super) fn streamed(&self) -> bool {
        self.stream == Some(true)
    }

    /// Whether a stream ends with a usage chunk.
    fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|options| options.include_usage)
            .unwrap_or(false)
    }
}

#[derive(Debug, Clone, Deserialize)]
pub(super) struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Debug, Clone, Deserialize)]
pub(super) struct ChatRequestMessage {
    pub(super) role: String,
    pub(super) content: String,
}

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

/// Counts a chat request in and out of `in_flight`. Dropped without [`InFlight::answered`] (or,
/// for a stream, [`InFlight::done`]) means the handler future or the stream was dropped: hyper
/// does that when the client closes the connection, which is how the tests see a cancelled
/// call.
pub(super) struct InFlight {
    state: Arc<MockState>,
    answered: bool,
}

impl InFlight {
    pub(super) fn enter(state: &Arc<MockState>) -> Self {
        {
            let mut stats = lock(&state.stats);
            stats.requests += 1;
            stats.in_flight += 1;
            stats.max_in_flight = stats.max_in_flight.max(stats.in_flight);
        }
        Self {
            state: Arc::clone(state),
            answered: false,
        }
    }

    pub(super) fn answered(self, response: Response) -> Response {
        self.done();
        response
    }

    /// The request was answered to its end (a stream: to its end, whatever that was).
    pub(super) fn done(mut self) {
        self.answered = true;
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut stats = lock(&self.state.stats);
        stats.in_flight -= 1;
        if !self.answered {
            stats.cancelled += 1;
        }
    }
}

async fn chat_completions(
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
    let work = {
        let state = Arc::clone(&state);
        async move {
            match key {
                Some(key) if state.settings.honour_idempotency_key => {
                    reply_once(&state, key, &request, latency).await
                }
                key => generate(&state, key.as_deref(), &request, latency).await,
            }
        }
    };
    if let Some(include_usage) = streamed {
        let chunk_chars = state.stream_chunk_chars();
        return stream_answer(&state, admitted, in_flight, work, move |reply: Reply| {
            let events = chat_events(&reply.completion, include_usage, chunk_chars);
            course(events, fault, |_| chat_error_event())
        });
    }
    let Ok(reply) = finish_unless_asked(&state, work).await else {
        return in_flight.answered(admitted.decorate(shutting_down()));
    };
    in_flight.answered(admitted.decorate(answer(fault, reply.body)))
}

/// Runs a generation to its end even when the client goes away (the handler's future is then
/// dropped, the work's task is not), as the hosted APIs do; with `cancel_on_disconnect`, in
/// the handler's future, so a client that leaves stops it.
pub(super) async fn finish_unless_asked<T: Send + 'static>(
    state: &MockState,
    work: impl std::future::Future<Output = Result<T, ShuttingDown>> + Send + 'static,
) -> Result<T, ShuttingDown> {
    if state.settings.cancel_on_disconnect {
        return work.await;
    }
    tokio::spawn(work).await.unwrap_or(Err(ShuttingDown))
}

/// The request's `Idempotency-Key`, when it has a non-empty one.
pub(super) fn idempotency_key(headers: &HeaderMap) -> Option<String> {
    headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty())
        .map(str::to_owned)
}

/// The part of a fault that comes before the work: an error or a 429 answered at once
/// (`Err`), or a hang; the others go on to the work, and strike its answer.
pub(super) async fn apply_fault_before_work(
    state: &MockState,
    fault: Fault,
) -> Result<(), Response> {
    match fault {
        Fault::Error { status } => {
            let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            Err(openai_error(status, "injected fault: server error"))
        }
        Fault::RateLimit { retry_after_s } => {
            let mut response = openai_error(
                StatusCode::TOO_MANY_REQUESTS,
                "injected fault: rate limited",
            );
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_s));
            Err(response)
        }
        Fault::Hang { hang_ms } => match state.pause(Duration::from_millis(hang_ms)).await {
            Ok(()) => Ok(()),
            Err(ShuttingDown) => Err(shutting_down()),
        },
        Fault::None
        | Fault::DropAfterWork
        | Fault::StreamCut { .. }
        | Fault::StreamStall { .. }
        | Fault::StreamError { .. } => Ok(()),
    }
}

/// A JSON success answer, broken mid-body when the fault is `DropAfterWork`.
pub(super) fn answer(fault: Fault, body: Bytes) -> Response {
    if fault == Fault::DropAfterWork {
        broken_response(body)
    } else {
        (
            [(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            )],
            body,
        )
            .into_response()
    }
}

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
async fn create_response(
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
        let pace = streamed.then(|| Pace {
            chunk_chars: state.stream_chunk_chars(),
            interval: state.stream_chunk_interval(),
            fails_after: generation_failure(fault),
        });
        tokio::spawn(run_background(
            Arc::clone(&state),
            id,
            key,
            chat,
            latency,
            admitted,
            pace,
        ));
    }
    response
}

/// How a streamed response's generation records its text: in deltas of `chunk_chars` with
/// `interval` between them, failing after `fails_after` deltas when a stream error struck.
struct Pace {
    chunk_chars: usize,
    interval: Duration,
    fails_after: Option<usize>,
}

/// The generation of one background response: `in_progress`, the latency, then `completed`
/// (counted like a chat generation, under the key), or `failed` if the mock shuts down first.
/// A streamed one records its text in deltas at its `pace` in between. The create's admission
/// is held until the generation ends: it is in progress till then.
async fn run_background(
    state: Arc<MockState>,
    id: String,
    key: Option<String>,
    request: ChatRequest,
    latency: Duration,
    admitted: Admitted,
    pace: Option<Pace>,
) {
    state.record(&id, |book| book.begin(&id));
    let end = match produce(&state, key.as_deref(), &request, latency).await {
        Ok(produced) => match &pace {
            Some(pace) => record_text(&state, &id, produced, pace).await,
            None => ResponseState::Completed(output(produced)),
        },
        Err(ShuttingDown) => shut_down_before_done(),
    };
    state.record(&id, |book| book.finish(&id, end, state.now()));
    lock(&state.live).remove(&id);
    drop(admitted);
}

/// Records a streamed response's text at its pace; how its generation ends.
async fn record_text(
    state: &MockState,
    id: &str,
    produced: Produced,
    pace: &Pace,
) -> ResponseState {
    state.record(id, |book| book.open_text(id));
    let pieces = chunk_text(&produced.text, pace.chunk_chars);
    let sent = pace
        .fails_after
        .map_or(pieces.len(), |after| after.min(pieces.len()));
    for (n, piece) in pieces[..sent].iter().enumerate() {
        if n > 0 && state.pause(pace.interval).await.is_err() {
            return shut_down_before_done();
        }
        state.record(id, |book| book.delta(id, piece));
    }
    if pace.fails_after.is_some() {
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
async fn get_response(
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

/// The reply stored under `key`, generating it only if no request with this key has: a request
/// that finds the first one still in flight waits for it and returns the same bytes.
async fn reply_once(
    state: &MockState,
    key: String,
    request: &ChatRequest,
    latency: Duration,
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
    let reply = generate(state, Some(&key), request, latency).await?;
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

/// What one generation produced, before either API wraps it.
pub(super) struct Produced {
    pub(super) generation: u64,
    pub(super) text: String,
    pub(super) model: String,
    pub(super) prompt_tokens: u32,
    pub(super) completion_tokens: u32,
}

/// The work: wait the latency, then count a generation (under the key) and build its text.
pub(super) async fn produce(
    state: &MockState,
    key: Option<&str>,
    request: &ChatRequest,
    latency: Duration,
) -> Result<Produced, ShuttingDown> {
    state.pause(latency).await?;
    let generation = {
        let mut stats = lock(&state.stats);
        stats.generations += 1;
        if let Some(key) = key {
            *stats.per_key.entry(key.to_owned()).or_default() += 1;
        }
        stats.generations
    };
    let last_user = request
        .messages
        .iter()
        .rev()
        .find(|m| m.role == "user")
        .map(|m| m.content.as_str());
    let reply_chars = reply_chars_directive(request.messages.iter().map(|m| m.content.as_str()));
    let text = reply_text(key, last_user, generation, reply_chars);
    let prompt_tokens: u32 = request
        .messages
        .iter()
        .map(|m| count_tokens(&m.content))
        .sum();
    let completion_tokens = count_tokens(&text);
    Ok(Produced {
        generation,
        text,
        model: request.model.as_deref().unwrap_or("mock-model").to_owned(),
        prompt_tokens,
        completion_tokens,
    })
}

/// A chat generation: [`produce`], wrapped as a chat completion.
async fn generate(
    state: &MockState,
    key: Option<&str>,
    request: &ChatRequest,
    latency: Duration,
) -> Result<Reply, ShuttingDown> {
    let Produced {
        generation,
        text,
        model,
        prompt_tokens,
        completion_tokens,
    } = produce(state, key, request, latency).await?;
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

/// "Did the work, lost the answer": status 200 and the headers go out with the first half of the
/// body, then the body stream fails and hyper closes the connection. The client sees a success
/// status and then a body that ends early (reqwest: a body error), so it cannot know the reply
/// that was generated, counted and stored under its key.
fn broken_response(reply: Bytes) -> Response {
    let half = reply.slice(..reply.len() / 2);
    let chunks = futures_util::stream::unfold(0u8, move |step| {
        let half = half.clone();
        async move {
            match step {
                0 => Some((Ok(half), 1)),
                1 => {
                    // Lets hyper flush the headers and the first half before the failure, so
                    // the client sees a broken body rather than a connection closed before any
                    // answer.
                    tokio::task::yield_now().await;
                    Some((
                        Err(std::io::Error::new(
                            std::io::ErrorKind::ConnectionAborted,
                            "mock provider: response dropped after the work was done",
                        )),
                        2,
                    ))
                }
                _ => None,
            }
        }
    });
    (
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        )],
        Body::from_stream(chunks),
    )
        .into_response()
}

pub(super) fn shutting_down() -> Response {
    openai_error(
        StatusCode::SERVICE_UNAVAILABLE,
        "mock provider is shutting down",
    )
}

/// An error in OpenAI's shape, so clients read the message where they read a real provider's.
fn openai_error(status: StatusCode, message: &str) -> Response {
    let kind = match status.as_u16() {
        429 => "rate_limit_error",
        400..=499 => "invalid_request_error",
        _ => "server_error",
    };
    let body = json!({
        "error": { "message": message, "type": kind, "param": null, "code": null }
    });
    (status, axum::Json(body)).into_response()
}
