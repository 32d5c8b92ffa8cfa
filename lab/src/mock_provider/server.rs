//! The mock provider's shared state and what its routes share: the idempotency store, the
//! background responses' [`ResponseBook`], the capacity limits around the pure [`Capacity`],
//! the counters behind `/stats`, the run-time fault switch, and the faults, answers and
//! generation every route uses. The generating routes are in files of their own (the chat
//! endpoint in `super::chat`, the background responses in `super::responses`, Anthropic's
//! messages in `super::messages`): a request with `"stream": true` is answered by `super::sse`
//! with the events of `super::stream` (or the response's own log), and `super::sse` depends on
//! this file.
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
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::sync::watch;

use super::background::{Replay, ResponseBook};
use super::behaviour::{
    Fault, FaultRng, choose_fault, count_tokens, reply_chars_directive, reply_text, sample_latency,
};
use super::capacity::{Admission, Capacity, Limit, limit_headers, refusal_body};
use super::pace::StreamPacing;
use super::settings::{DEFAULT_MAX_OUTPUT_TOKENS, FaultSettings, MockSettings};
use super::stream::{ChatCompletion, StreamEnd};

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
    pub(super) settings: MockSettings,
    pub(super) faults: Mutex<FaultSettings>,
    rng: Mutex<FaultRng>,
    capacity: Mutex<Capacity>,
    /// The admissions per second, as `/stats` answers them (a copy goes into each snapshot).
    seconds: Mutex<VecDeque<SecondTally>>,
    /// The mock's clock for the limits and the retention: monotonic, so a wall-clock step
    /// cannot let a burst through.
    started: Instant,
    pub(super) stats: Mutex<StatsSnapshot>,
    pub(super) keys: Mutex<HashMap<String, KeyState>>,
    pub(super) responses: Mutex<ResponseBook>,
    /// The streamed background responses still generating, by id: each value moves with every
    /// event the response records, which wakes the streams that follow it.
    pub(super) live: Mutex<HashMap<String, watch::Sender<u64>>>,
    traceparents: Mutex<HashMap<String, Vec<String>>>,
    shutdown: watch::Receiver<bool>,
}

/// A finished chat reply: the exact bytes sent whole, stored so a replay is identical, and the
/// completion they tell, which a stream sends in pieces (a replay too).
#[derive(Clone)]
pub(super) struct Reply {
    pub(super) body: Bytes,
    pub(super) completion: Arc<ChatCompletion>,
}

pub(super) enum KeyState {
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

    /// How a stream's deltas are spread in time.
    pub(super) fn stream_pacing(&self) -> StreamPacing {
        StreamPacing::from_interval_ms(self.settings.stream_chunk_interval_ms)
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
    pub(super) fn record<R>(&self, id: &str, change: impl FnOnce(&mut ResponseBook) -> R) -> R {
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
    pub(super) fn now(&self) -> Duration {
        self.started.elapsed()
    }

    /// Admits a generating request costing `tokens` against the limits, or answers its refusal
    /// (429 in the profile's dialect, at once, with no work done). The admission holds the
    /// request's place among those in progress until it is dropped. The refusal is boxed:
    /// a `Response` is large, and admission is the common path.
    pub(crate) fn admit(self: &Arc<Self>, tokens: u64) -> Result<Admitted, Box<Response>> {
        let now = self.now();
        let dialect = self.settings.profile.refusal_dialect();
        let report = self.settings.limit_headers;
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
                    headers: limit_headers(dialect, report, &standing, None, SystemTime::now()),
                })
            }
            Admission::Refused(refusal) => {
                drop(capacity);
                lock(&self.stats).refused.count(refusal.limit);
                let headers = limit_headers(
                    dialect,
                    report,
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
        self.sleep_unless_shutting_down(tokio::time::sleep(duration))
            .await
    }

    /// Sleeps until `offset` after `origin` (at once if that has passed), unless the server is
    /// shutting down first. A stream's parts sleep to offsets from its first token rather than
    /// for intervals, so the timer's rounding does not add up over its deltas.
    pub(super) async fn pause_until(
        &self,
        origin: Instant,
        offset: Duration,
    ) -> Result<(), ShuttingDown> {
        if offset.is_zero() {
            // What needs no wait goes at once, shutdown or not, as a stream's first delta and
            // every event at no latency always have.
            return Ok(());
        }
        let sleep = match origin.checked_add(offset) {
            Some(deadline) => tokio::time::sleep_until(deadline.into()),
            // A directive's latency past what the clock can name: as good as never, which
            // tokio's sleep makes of it.
            None => tokio::time::sleep(offset),
        };
        self.sleep_unless_shutting_down(sleep).await
    }

    async fn sleep_unless_shutting_down(
        &self,
        sleep: tokio::time::Sleep,
    ) -> Result<(), ShuttingDown> {
        let mut shutdown = self.shutdown.clone();
        tokio::select! {
            () = sleep => Ok(()),
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
pub(super) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The mock's own routes (`/stats`, `/faults`, `/healthz`) and the fallback. The generating
/// routes are added beside them by the caller (`super::chat`, `super::responses`,
/// `super::messages`): they stream through `super::sse`, which depends on this file.
pub(crate) fn routes() -> Router<Arc<MockState>> {
    Router::new()
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
    pub(super) fn include_usage(&self) -> bool {
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

/// What one generation produced, before either API wraps it.
pub(super) struct Produced {
    pub(super) generation: u64,
    pub(super) text: String,
    pub(super) model: String,
    pub(super) prompt_tokens: u32,
    pub(super) completion_tokens: u32,
}

/// The work: wait `until_text` (an answer sent whole: its latency; a stream: its time to first
/// token, its deltas taking the rest), then count a generation (under the key) and build its
/// text.
pub(super) async fn produce(
    state: &MockState,
    key: Option<&str>,
    request: &ChatRequest,
    until_text: Duration,
) -> Result<Produced, ShuttingDown> {
    state.pause(until_text).await?;
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
pub(super) fn openai_error(status: StatusCode, message: &str) -> Response {
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
