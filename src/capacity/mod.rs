//! The provider's capacity, shared by every worker of a deployment (I9: all workers together
//! never send the provider more than its configured requests per minute, tokens per minute and
//! requests at once; with none configured they back off on the provider's own signals).
//!
//! A record waits here for a [`Permit`] **before** its task is claimed: it holds no lease
//! (nothing to renew, nothing for another worker to wait out), spends no attempt, and leaves
//! the row free for a duplicate to find terminal. It keeps its place in its partition's
//! window, as every record does until its task is terminal (I3); the window and the
//! read-ahead bound how many wait. A permit is one request, its tokens and, under a
//! concurrency limit, one slot, released when the call ends.
//!
//! Permits come from the budget in PostgreSQL ([`crate::store::capacity`]) in grants: one
//! worker's refill loop per model asks for what its waiting records need (a request each,
//! their tokens, its share of the slots) in one call, and hands the grant out in arrival
//! order, so a call costs no round trip of its own. Requests and tokens granted but not used
//! within a second are dropped: the budget counted them when it granted them, and holding them
//! longer would let a worker send a burst the provider's per-second quantization refuses. The
//! concurrency share is renewed while the worker uses it and lapses when it vanishes.
//!
//! Where nothing is configured for a model and `capacity.adaptive` is on, the budget is the
//! provider's own: a refusal ([`Capacity::refused`]) pauses every worker for its
//! `Retry-After` and cuts a learned rate ([`gcra::Learned`]), which regrows slowly. While
//! nothing is learned and nothing paused, a worker grants itself freely and asks the database
//! only once a second.

pub mod gcra;
pub mod settings;

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;

pub use settings::{CapacityLimits, CapacitySettings};

use crate::store::Store;
use crate::store::capacity::GrantAsk;
use crate::telemetry;

/// How long granted requests and tokens may wait for a record before they are dropped.
const GRANT_LIFETIME: Duration = Duration::from_secs(1);

/// How long a worker grants itself freely, without asking the database, while a model has
/// nothing configured, learned or paused.
const FREE_LEASE: Duration = Duration::from_secs(1);

/// The longest a refill loop sleeps while records wait (the budget may free capacity sooner
/// than its estimate: another worker's slots lapse, a pause ends).
const MAX_REFILL_SLEEP: Duration = Duration::from_millis(250);

/// The right to make one call: released (its concurrency slot given back) when dropped.
pub struct Permit {
    release: Option<(Arc<Bucket>, bool)>,
}

impl Permit {
    /// A permit outside any budget (nothing governs this worker).
    fn free() -> Self {
        Self { release: None }
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some((bucket, slotted)) = self.release.take() {
            bucket.release(slotted);
        }
    }
}

/// The capacity budget as one worker sees it. Cheap to clone.
#[derive(Clone)]
pub struct Capacity {
    inner: Option<Arc<Governor>>,
}

struct Governor {
    store: Store,
    settings: CapacitySettings,
    holder: String,
    buckets: Mutex<HashMap<String, Arc<Bucket>>>,
    shutdown: CancellationToken,
}

/// One model's budget in this worker.
struct Bucket {
    name: String,
    limits: CapacityLimits,
    state: Mutex<BucketState>,
    /// Wakes the refill loop (a new waiter, a released slot).
    wake: Notify,
}

struct Waiter {
    tokens: u64,
    send: oneshot::Sender<Permit>,
}

#[derive(Default)]
struct BucketState {
    requests: u64,
    tokens: u64,
    granted_at: Option<Instant>,
    /// The concurrency share this worker holds, and how much of it is in use.
    slots: u32,
    in_use: u32,
    waiting: VecDeque<Waiter>,
    /// Granting freely until then (nothing configured, learned or paused).
    free_until: Option<Instant>,
    refilling: bool,
}

impl Capacity {
    /// Nothing governs: every permit is free.
    pub fn none() -> Self {
        Self { inner: None }
    }

    /// The budget of `settings` for the worker named `holder`.
    pub fn new(
        store: Store,
        settings: CapacitySettings,
        holder: String,
        shutdown: CancellationToken,
    ) -> Self {
        if !settings.governs() {
            return Self::none();
        }
        Self {
            inner: Some(Arc::new(Governor {
                store,
                settings,
                holder,
                buckets: Mutex::new(HashMap::new()),
                shutdown,
            })),
        }
    }

    /// Waits for the right to call `model` with a request of about `tokens` tokens; None when
    /// `cancel` fires first.
    pub async fn acquire(
        &self,
        model: &str,
        tokens: u64,
        cancel: &CancellationToken,
    ) -> Option<Permit> {
        let Some(governor) = &self.inner else {
            return Some(Permit::free());
        };
        let bucket = governor.bucket(model);
        let since = Instant::now();
        let receive = {
            // A poisoned lock only means a panic elsewhere; the counts stay usable.
            let mut state = bucket.state.lock().unwrap_or_else(|p| p.into_inner());
            if state.waiting.is_empty()
                && let Some(permit) = bucket.take_now(&mut state, tokens)
            {
                return Some(permit);
            }
            let (send, receive) = oneshot::channel();
            state.waiting.push_back(Waiter { tokens, send });
            telemetry::capacity_waiting(&bucket.name, state.waiting.len());
            if !state.refilling {
                state.refilling = true;
                tokio::spawn(refill(Arc::clone(governor), Arc::clone(&bucket)));
            }
            receive
        };
        bucket.wake.notify_one();
        tokio::select! {
            biased;
            _ = cancel.cancelled() => None,
            permit = receive => {
                let permit = permit.ok();
                telemetry::capacity_waited(&bucket.name, since.elapsed());
                permit
            }
        }
    }

    /// The provider refused a call of `model` for capacity (a 429, an overload): every worker
    /// of the deployment pauses for `retry_after` and, where nothing is configured, the
    /// learned rate is cut. Best effort: a failure to record it is logged.
    pub async fn refused(&self, model: &str, retry_after: Option<Duration>) {
        let Some(governor) = &self.inner else {
            return;
        };
        let bucket = governor.bucket(model);
        let adaptive = governor.settings.adaptive && bucket.limits.requests_per_minute.is_none();
        {
            let mut state = bucket.state.lock().unwrap_or_else(|p| p.into_inner());
            // Ask the budget again before granting freely.
            state.free_until = None;
            state.requests = 0;
            state.tokens = 0;
        }
        telemetry::capacity_refused(&bucket.name);
        match governor
            .store
            .capacity_refused(&bucket.name, retry_after, adaptive)
            .await
        {
            Ok(learned) => {
                if let Some(rate) = learned {
                    telemetry::capacity_limit(&bucket.name, rate);
                }
            }
            Err(e) => telemetry::store_error("capacity_refused", &e),
        }
    }
}

impl Governor {
    fn bucket(&self, model: &str) -> Arc<Bucket> {
        let mut buckets = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(buckets.entry(model.to_owned()).or_insert_with(|| {
            Arc::new(Bucket {
                name: model.to_owned(),
                limits: self.settings.limits_of(model),
                state: Mutex::new(BucketState::default()),
                wake: Notify::new(),
            })
        }))
    }
}

impl Bucket {
    fn slotted(&self) -> bool {
        self.limits.max_concurrent.is_some()
    }

    /// A permit from what this worker holds, if it holds enough now.
    fn take_now(self: &Arc<Self>, state: &mut BucketState, tokens: u64) -> Option<Permit> {
        let now = Instant::now();
        let free = state.free_until.is_some_and(|until| until > now);
        if !free {
            if state
                .granted_at
                .is_none_or(|at| now.duration_since(at) > GRANT_LIFETIME)
            {
                state.requests = 0;
                state.tokens = 0;
            }
            let tokens_ok = self.limits.tokens_per_minute.is_none() || state.tokens >= tokens;
            if state.requests == 0 || !tokens_ok {
                return None;
            }
        }
        if self.slotted() && state.in_use >= state.slots {
            return None;
        }
        if !free {
            state.requests -= 1;
            if self.limits.tokens_per_minute.is_some() {
                state.tokens -= tokens;
            }
        }
        if self.slotted() {
            state.in_use += 1;
        }
        Some(Permit {
            release: Some((Arc::clone(self), self.slotted())),
        })
    }

    /// A permit's end: its slot back to this worker's share, and the next waiter served.
    fn release(&self, slotted: bool) {
        if slotted {
            let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
            state.in_use = state.in_use.saturating_sub(1);
        }
        self.wake.notify_one();
    }

    /// Hands out what this worker holds to its waiters, in arrival order. A waiter that gave
    /// up (cancelled) gets nothing, and what it would have taken stays.
    fn serve(self: &Arc<Self>, state: &mut BucketState) {
        while let Some(front) = state.waiting.front() {
            if front.send.is_closed() {
                state.waiting.pop_front();
                continue;
            }
            let tokens = front.tokens;
            let Some(permit) = self.take_now(state, tokens) else {
                break;
            };
            let waiter = state.waiting.pop_front().expect("the front exists");
            if let Err(mut permit) = waiter.send.send(permit) {
                // Gave up between the check and the send. Its slot is given back here, under
                // the lock this function already holds (the permit's own release would take
                // it again); the requests and tokens taken for it are spent either way.
                if let Some((_, true)) = permit.release.take() {
                    state.in_use = state.in_use.saturating_sub(1);
                }
            }
        }
        telemetry::capacity_waiting(&self.name, state.waiting.len());
    }
}

/// The refill loop of one bucket in this worker: asks the budget for what its waiters need,
/// serves them, renews its concurrency share while it has one, and ends when it has nothing
/// waiting and nothing held.
async fn refill(governor: Arc<Governor>, bucket: Arc<Bucket>) {
    let limits = bucket.limits;
    let slot_ttl = governor.settings.slot_ttl();
    let mut renewed = Instant::now();
    loop {
        let ask = {
            let mut state = bucket.state.lock().unwrap_or_else(|p| p.into_inner());
            bucket.serve(&mut state);
            let waiting = state.waiting.len() as u64;
            if waiting == 0 && state.in_use == 0 && state.slots == 0 {
                state.refilling = false;
                return;
            }
            let now = Instant::now();
            let free = state.free_until.is_some_and(|until| until > now);
            let renew_due =
                limits.max_concurrent.is_some() && now.duration_since(renewed) >= slot_ttl / 3;
            // Nothing to ask while everyone is served, the worker grants itself freely or no
            // share needs renewing (or giving back: an idle worker frees its share).
            let give_back = waiting == 0 && state.slots > state.in_use;
            if (waiting == 0 || free) && !renew_due && !give_back {
                None
            } else {
                // Tokens: what the waiters need, at most a second's worth at a time (more would
                // only be held while the grant ages); one request needing more than that asks
                // for its own tokens whole.
                let burst = limits
                    .tokens_per_minute
                    .map_or(u64::MAX, |n| (n / 60).max(1));
                let front = state.waiting.front().map_or(0, |w| w.tokens);
                let waiting_tokens: u64 = state.waiting.iter().map(|w| w.tokens).sum();
                let (want_tokens, whole) = if front > burst {
                    (front, true)
                } else {
                    (
                        waiting_tokens.min(burst).saturating_sub(state.tokens),
                        false,
                    )
                };
                Some((
                    waiting.saturating_sub(state.requests),
                    want_tokens,
                    whole,
                    (state.in_use + waiting as u32).min(limits.max_concurrent.unwrap_or(u32::MAX)),
                    state.in_use,
                ))
            }
        };
        let sleep = match ask {
            None => slot_ttl / 3,
            Some((want_requests, want_tokens, tokens_whole, want_slots, in_use)) => {
                let granted = governor
                    .store
                    .capacity_grant(&GrantAsk {
                        bucket: &bucket.name,
                        holder: &governor.holder,
                        want_requests,
                        want_tokens,
                        tokens_whole,
                        want_slots,
                        in_use,
                        requests_per_second: limits.requests_per_minute.map(|n| n as f64 / 60.0),
                        tokens_per_second: limits.tokens_per_minute.map(|n| n as f64 / 60.0),
                        slot_limit: limits.max_concurrent,
                        slot_ttl,
                        adaptive: governor.settings.adaptive,
                    })
                    .await;
                match granted {
                    Ok(granted) => {
                        renewed = Instant::now();
                        if let Some(rate) = granted.requests_per_second {
                            telemetry::capacity_limit(&bucket.name, rate);
                        }
                        let mut state = bucket.state.lock().unwrap_or_else(|p| p.into_inner());
                        let now = Instant::now();
                        let unconstrained = granted.requests_per_second.is_none()
                            && limits.tokens_per_minute.is_none()
                            && limits.max_concurrent.is_none()
                            && granted.blocked_for.is_zero();
                        state.free_until = unconstrained.then(|| now + FREE_LEASE);
                        if state
                            .granted_at
                            .is_some_and(|at| now.duration_since(at) > GRANT_LIFETIME)
                        {
                            state.requests = 0;
                            state.tokens = 0;
                        }
                        state.requests += granted.requests;
                        state.tokens += granted.tokens;
                        state.granted_at = Some(now);
                        state.slots = granted.slots.max(state.in_use);
                        bucket.serve(&mut state);
                        if state.waiting.is_empty() {
                            slot_ttl / 3
                        } else {
                            granted
                                .wait
                                .max(granted.blocked_for)
                                .clamp(Duration::from_millis(5), MAX_REFILL_SLEEP)
                        }
                    }
                    Err(e) => {
                        telemetry::store_error("capacity_grant", &e);
                        Duration::from_millis(500)
                    }
                }
            }
        };
        tokio::select! {
            _ = governor.shutdown.cancelled() => {
                let mut state = bucket.state.lock().unwrap_or_else(|p| p.into_inner());
                state.refilling = false;
                return;
            }
            _ = bucket.wake.notified() => {}
            _ = tokio::time::sleep(sleep) => {}
        }
    }
}

/// Tokens a request counts against a tokens-per-minute limit: its prompt, estimated from the
/// text (about four characters a token, as providers' own estimates go, rounded up), and the
/// most its reply may have.
pub fn request_tokens(
    prompt_chars: usize,
    max_output_tokens: Option<u32>,
    default_output: u32,
) -> u64 {
    (prompt_chars as u64).div_ceil(4) + u64::from(max_output_tokens.unwrap_or(default_output))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_counts_its_prompt_and_its_reply_ceiling() {
        assert_eq!(request_tokens(400, Some(256), 1024), 100 + 256);
        assert_eq!(request_tokens(401, None, 1024), 101 + 1024);
    }
}
