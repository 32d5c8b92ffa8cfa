//! The provider's capacity, shared by every worker of a deployment (I9: all workers together
//! never send the provider more than its configured requests per minute, tokens per minute and
//! requests at once; with none configured they back off on the provider's own signals).
//!
//! A claimed task waits here for a [`Permit`] before its call, with its lease held (and
//! renewed) and no attempt spent: a wait that ends without a call gives the attempt back. Only
//! a task this worker holds waits, so a duplicate, or a task backing off, takes no permit. A
//! permit is a send time (calls are paced, [`pacing`]) and, under a concurrency limit, a slot,
//! released when the call ends.
//!
//! The budget is kept in PostgreSQL ([`crate::store::capacity`]): one refill loop per model in
//! each worker asks, in one call, for the send times of the calls waiting in that worker (a
//! quarter of a second ahead at most) and for its share of the slots, and hands them out in
//! weighted fair order by workspace (I10, [`replyd_core::fair`]): a workspace whose calls
//! arrive behind another's backlog gets the next permits in turn with it, not after it. A
//! call costs no round trip of its own. The share is renewed while the
//! worker uses it and lapses when the worker vanishes.
//!
//! Where nothing is configured for a model and `capacity.adaptive` is on, the budget is the
//! provider's own: a limit it reports (its rate-limit headers) is the rate; a refusal
//! ([`Capacity::refused`]) pauses every worker for its `Retry-After` (unless a limit was
//! reported) and cuts a learned rate ([`pacing::Learned`]) to
//! what got through in the last second, at most once a second; each second without a refusal
//! takes it back there, then probes higher. While nothing is learned and nothing paused, a
//! worker lets its calls go freely and asks the database only once a second; it counts the
//! calls it let go and tells them with its next grant or refusal, so that the first refusal
//! cuts from what was sent.

use replyd_core::pacing;
pub mod settings;
pub mod weights;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, oneshot};
use tokio_util::sync::CancellationToken;

pub use settings::{CapacityLimits, CapacitySettings};
pub use weights::Weights;

use crate::store::Store;
use crate::store::capacity::GrantAsk;
use crate::telemetry;
use replyd_core::domain::CapacityWait;
use replyd_core::fair::FairQueue;

/// How long a worker lets calls go freely, without asking the database, while a model has
/// nothing configured, learned or paused.
const FREE_LEASE: Duration = Duration::from_secs(1);

/// The longest a refill loop sleeps while calls wait (the budget may free capacity sooner than
/// its estimate: another worker's slots lapse, a pause ends).
const MAX_REFILL_SLEEP: Duration = Duration::from_millis(250);

/// Calls scheduled by one grant at most (a quarter of a second of a very high limit).
const MAX_SCHEDULED: usize = 512;

/// Waits at least this long are recorded on the attempt (`replyd inspect` says why it waited).
pub const RECORDED_WAIT: Duration = Duration::from_secs(1);

/// The right to make one call, from `ready_at` on: its slot given back when dropped.
pub struct Permit {
    ready_at: Instant,
    release: Option<Arc<Bucket>>,
    /// Why the call waited, when it waited its turn for [`RECORDED_WAIT`] or longer.
    waited: Option<CapacityWait>,
}

impl Permit {
    /// Why the call waited, when it waited its turn for a second or more.
    pub fn waited(&self) -> Option<CapacityWait> {
        self.waited
    }
}

impl Drop for Permit {
    fn drop(&mut self) {
        if let Some(bucket) = self.release.take() {
            bucket.release();
        }
    }
}

/// The capacity budget as one worker sees it. Cheap to clone.
#[derive(Clone)]
pub struct Capacity {
    inner: Option<Arc<Governor>>,
    /// Each workspace's weight: the governor's fair order, and the windows' (which need them
    /// whether or not the capacity is governed).
    weights: Weights,
}

struct Governor {
    store: Store,
    settings: CapacitySettings,
    holder: String,
    /// Each workspace's weight in the fair order of the waiting calls.
    weights: Weights,
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
    /// The concurrency share this worker holds, and how much of it is in use.
    slots: u32,
    in_use: u32,
    /// Waiting calls by workspace and lane (the record's partition), in fair order.
    waiting: FairQueue<String, i32, Waiter>,
    /// Letting calls go freely until then (nothing configured, learned or paused).
    free_until: Option<Instant>,
    refilling: bool,
    /// The request limit (a minute's) the provider last reported, as recorded in the budget.
    reported: Option<u64>,
    /// The budget paced this bucket's calls at its last grant (a rate applies, or a pause):
    /// a call that waits then waits for its turn, not for a round trip.
    paced: bool,
    /// Calls let go freely since the budget last heard from this worker: told with the next
    /// grant or refusal (and kept for the one after if that fails), so the learned rate counts
    /// every call that went.
    sent_freely: u64,
}

impl Capacity {
    /// Nothing governs: every permit is free.
    pub fn none() -> Self {
        Self {
            inner: None,
            weights: Weights::default(),
        }
    }

    /// The workspaces' weights this budget orders its waiters by.
    pub fn weights(&self) -> Weights {
        self.weights.clone()
    }

    /// The budget of `settings` for the worker named `holder`, sharing it between workspaces
    /// by `weights`.
    pub fn new(
        store: Store,
        settings: CapacitySettings,
        holder: String,
        weights: Weights,
        shutdown: CancellationToken,
    ) -> Self {
        if !settings.governs() {
            return Self {
                inner: None,
                weights,
            };
        }
        Self {
            inner: Some(Arc::new(Governor {
                store,
                settings,
                holder,
                weights: weights.clone(),
                buckets: Mutex::new(HashMap::new()),
                shutdown,
            })),
            weights,
        }
    }

    /// Waits for the right to call `model` with a request of about `tokens` tokens, for a task
    /// of `workspace` whose record came from partition `lane` (any number where there is
    /// none): a workspace's calls go its partitions in turn, so each partition's window frees
    /// evenly. `waits` is called once if the call must wait for its turn under a limit (not
    /// when it may go at once, nor for the round trip that asks an unlimited budget): the
    /// caller gives back what it need not hold meanwhile (its window slot).
    /// None when `cancel` fires first.
    pub async fn acquire(
        &self,
        model: &str,
        (workspace, lane): (&str, i32),
        tokens: u64,
        cancel: &CancellationToken,
        waits: impl FnOnce(),
    ) -> Option<Permit> {
        let Some(governor) = &self.inner else {
            return Some(Permit {
                ready_at: Instant::now(),
                release: None,
                waited: None,
            });
        };
        let bucket = governor.bucket(model);
        let since = Instant::now();
        let (receive, behind) = {
            // A poisoned lock only means a panic elsewhere; the counts stay usable.
            let mut state = bucket.state.lock().unwrap_or_else(|p| p.into_inner());
            if state.waiting.is_empty() && state.free_until.is_some_and(|until| until > since) {
                let release = if !bucket.slotted() {
                    Some(None)
                } else if state.in_use < state.slots {
                    state.in_use += 1;
                    Some(Some(Arc::clone(&bucket)))
                } else {
                    None
                };
                if let Some(release) = release {
                    state.sent_freely += 1;
                    // No wait: counted too, so the wait's quantiles are over every call.
                    telemetry::capacity_waited(&bucket.name, workspace, Duration::ZERO);
                    return Some(Permit {
                        ready_at: since,
                        release,
                        waited: None,
                    });
                }
            }
            // A wait for a turn: a limit is configured (or the budget paced the last grant),
            // or every slot of this worker's share is in use. Otherwise the wait is only the
            // round trip that asks the budget, and the caller keeps what it holds.
            let turn = bucket.limits.requests_per_minute.is_some()
                || bucket.limits.tokens_per_minute.is_some()
                || state.paced
                || (bucket.slotted() && state.in_use >= state.slots);
            // What it waits behind, for the attempt's record if the wait is long.
            let behind = turn.then(|| {
                let by_workspace = state.waiting.waiting_by_class();
                let own = by_workspace.get(workspace).copied().unwrap_or(0);
                CapacityWait {
                    waited_ms: 0,
                    calls_ahead: count(state.waiting.len()),
                    own_ahead: count(own),
                    workspaces: count(by_workspace.len() + usize::from(own == 0)),
                }
            });
            let (send, receive) = oneshot::channel();
            state.waiting.push(
                workspace.to_owned(),
                lane,
                governor.weights.of(workspace),
                Waiter { tokens, send },
            );
            telemetry::capacity_waiting(&bucket.name, state.waiting.len());
            if !state.refilling {
                state.refilling = true;
                tokio::spawn(refill(Arc::clone(governor), Arc::clone(&bucket)));
            }
            (receive, behind)
        };
        bucket.wake.notify_one();
        if behind.is_some() {
            waits();
        }
        let mut permit = tokio::select! {
            biased;
            _ = cancel.cancelled() => return None,
            permit = receive => permit.ok()?,
        };
        // Paced: the call goes at its send time.
        tokio::select! {
            biased;
            _ = cancel.cancelled() => return None,
            _ = tokio::time::sleep_until(permit.ready_at.into()) => {}
        }
        let waited = since.elapsed();
        telemetry::capacity_waited(&bucket.name, workspace, waited);
        permit.waited = behind
            .filter(|_| waited >= RECORDED_WAIT)
            .map(|behind| CapacityWait {
                waited_ms: count(waited.as_millis() as usize),
                ..behind
            });
        Some(permit)
    }

    /// The provider refused a call of `model` for capacity (a 429, an overload). Where a limit
    /// is configured, the pacing already holds the deployment to it, and a refusal now and
    /// then (a call arriving a moment early) is only counted: pausing every worker for it would
    /// cost far more than it saves. Where none is, the learned rate is cut, and, unless the
    /// provider reported its limit (the same reasoning), every worker of the deployment pauses
    /// for `retry_after`. Best effort: a failure to record it is logged.
    pub async fn refused(&self, model: &str, retry_after: Option<Duration>) {
        let Some(governor) = &self.inner else {
            return;
        };
        let bucket = governor.bucket(model);
        telemetry::capacity_refused(&bucket.name);
        if bucket.limits.requests_per_minute.is_some() || bucket.limits.tokens_per_minute.is_some()
        {
            return;
        }
        let adaptive = governor.settings.adaptive;
        let sent_freely = {
            let mut state = bucket.state.lock().unwrap_or_else(|p| p.into_inner());
            // Ask the budget again before letting calls go freely.
            state.free_until = None;
            // Taken, not read: a grant told at the same time must not count them again.
            std::mem::take(&mut state.sent_freely)
        };
        match governor
            .store
            .capacity_refused(&bucket.name, retry_after, adaptive, sent_freely)
            .await
        {
            Ok(learned) => {
                if let Some(rate) = learned {
                    telemetry::capacity_limit(&bucket.name, rate);
                }
            }
            Err(e) => {
                bucket.untold(sent_freely);
                telemetry::store_error("capacity_refused", &e);
            }
        }
    }
}

impl Capacity {
    /// What the provider said of its limits with an answer (its rate-limit headers, read by
    /// the adapter): where nothing is configured and `capacity.adaptive` is on, a reported
    /// request limit (a minute's) becomes the deployment's rate, written to the budget only
    /// when it changes. The remaining count is not acted on: pacing at the reported limit
    /// drives it to 0 at the end of every window by design, and a pause for that would halve
    /// the rate; a `429` (with its `Retry-After`) is what says the deployment went over. Best
    /// effort: a failure to record it is logged.
    pub async fn observed(&self, model: &str, requests_per_minute: Option<u64>) {
        let Some(governor) = &self.inner else {
            return;
        };
        if !governor.settings.adaptive {
            return;
        }
        let bucket = governor.bucket(model);
        if bucket.limits.requests_per_minute.is_some() {
            return;
        }
        let report = {
            let mut state = bucket.state.lock().unwrap_or_else(|p| p.into_inner());
            let report =
                requests_per_minute.filter(|limit| *limit > 0 && state.reported != Some(*limit));
            if let Some(limit) = report {
                state.reported = Some(limit);
                // Ask the budget again: it paces from now on.
                state.free_until = None;
            }
            report
        };
        if let Some(limit) = report {
            let rate = limit as f64 / 60.0;
            match governor.store.capacity_reported(&bucket.name, rate).await {
                Ok(()) => telemetry::capacity_limit(&bucket.name, rate),
                Err(e) => telemetry::store_error("capacity_reported", &e),
            }
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

    /// Calls let go freely that a failed grant or refusal did not tell the budget: told with
    /// the next one.
    fn untold(&self, sent_freely: u64) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.sent_freely += sent_freely;
    }

    /// A permit's end: its slot back to this worker's share, and the refill loop told.
    fn release(&self) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        state.in_use = state.in_use.saturating_sub(1);
        drop(state);
        self.wake.notify_one();
    }

    /// Hands the next `delays.len()` waiters their send times, in fair order. A waiter
    /// that gave up meanwhile gets nothing (its send time is spent: the budget counted it).
    /// Returns how many permits were taken.
    fn serve(self: &Arc<Self>, state: &mut BucketState, now: Instant, delays: &[Duration]) -> u64 {
        let mut taken = 0;
        for delay in delays {
            let Some((_, _, waiter)) = state.waiting.pop(|_| true) else {
                break;
            };
            let slotted = self.slotted();
            if slotted {
                state.in_use += 1;
            }
            let permit = Permit {
                ready_at: now + *delay,
                release: slotted.then(|| Arc::clone(self)),
                waited: None,
            };
            match waiter.send.send(permit) {
                Ok(()) => taken += 1,
                Err(mut permit) => {
                    // Gave up: its slot back here, under the lock this function already holds
                    // (the permit's own release would take it again).
                    if permit.release.take().is_some() {
                        state.in_use = state.in_use.saturating_sub(1);
                    }
                }
            }
        }
        telemetry::capacity_waiting(&self.name, state.waiting.len());
        taken
    }
}

/// The least time between two grants of one bucket while calls wait: releases that come
/// together are served by one grant.
const MIN_GRANT_INTERVAL: Duration = Duration::from_millis(10);

/// The refill loop of one bucket in this worker: serves its waiters from what it holds when
/// the budget lets calls go unpaced, asks the budget for their send times (and a larger share
/// of the slots) when it does not, renews the share while it has one, and ends when it has
/// nothing waiting and nothing held.
async fn refill(governor: Arc<Governor>, bucket: Arc<Bucket>) {
    let limits = bucket.limits;
    let slot_ttl = governor.settings.slot_ttl();
    let mut renewed = Instant::now();
    let mut last_grant: Option<Instant> = None;
    loop {
        let ask = {
            let mut state = bucket.state.lock().unwrap_or_else(|p| p.into_inner());
            state.waiting.retain(|w| !w.send.is_closed());
            let now = Instant::now();
            if state.free_until.is_some_and(|until| until > now) {
                // Unpaced: every waiter that has a slot (or needs none) goes now, without a
                // round trip.
                let room = if bucket.slotted() {
                    state.slots.saturating_sub(state.in_use) as usize
                } else {
                    state.waiting.len()
                };
                let now_delays = vec![Duration::ZERO; room.min(state.waiting.len())];
                let went = bucket.serve(&mut state, now, &now_delays);
                state.sent_freely += went;
            }
            let waiting = state.waiting.len();
            if waiting == 0 && state.in_use == 0 && state.slots == 0 {
                state.refilling = false;
                return;
            }
            let renew_due = bucket.slotted() && now.duration_since(renewed) >= slot_ttl / 3;
            // An idle worker gives its share back.
            let give_back = waiting == 0 && state.slots > state.in_use;
            if waiting == 0 && !renew_due && !give_back {
                None
            } else {
                let waiters: Vec<u64> = state
                    .waiting
                    .in_order(MAX_SCHEDULED)
                    .map(|w| w.tokens)
                    .collect();
                let want_slots =
                    (state.in_use + waiting as u32).min(limits.max_concurrent.unwrap_or(u32::MAX));
                // Taken, not read: a refusal told at the same time must not count them again.
                let sent_freely = std::mem::take(&mut state.sent_freely);
                let demand: Vec<(String, usize)> =
                    state.waiting.waiting_by_class().into_iter().collect();
                Some((waiters, want_slots, state.in_use, sent_freely, demand))
            }
        };
        let sleep = match ask {
            None => slot_ttl / 3,
            Some((waiters, want_slots, in_use, sent_freely, demand)) => {
                if let Some(since) = last_grant.map(|at| at.elapsed())
                    && since < MIN_GRANT_INTERVAL
                {
                    tokio::time::sleep(MIN_GRANT_INTERVAL - since).await;
                }
                last_grant = Some(Instant::now());
                let granted = governor
                    .store
                    .capacity_grant(&GrantAsk {
                        bucket: &bucket.name,
                        holder: &governor.holder,
                        waiters: &waiters,
                        want_slots,
                        in_use,
                        requests_per_second: limits
                            .requests_per_minute
                            .map(|n| pacing::paced(n as f64 / 60.0)),
                        tokens_per_second: limits
                            .tokens_per_minute
                            .map(|n| pacing::paced(n as f64 / 60.0)),
                        slot_limit: limits.max_concurrent,
                        slot_ttl,
                        adaptive: governor.settings.adaptive,
                        horizon: Duration::from_secs_f64(pacing::HORIZON_SECONDS),
                        sent_freely,
                        demand: &demand,
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
                        // Unpaced while no rate applies and nothing is paused: slots, if any,
                        // are then this worker's to hand out as they free.
                        let unpaced = granted.requests_per_second.is_none()
                            && limits.tokens_per_minute.is_none()
                            && granted.blocked_for.is_zero();
                        state.free_until = unpaced.then(|| now + FREE_LEASE);
                        state.paced = !unpaced;
                        state.slots = granted.slots.max(state.in_use);
                        bucket.serve(&mut state, now, &granted.delays);
                        if state.waiting.is_empty() {
                            slot_ttl / 3
                        } else if unpaced {
                            // Waiting for a slot: a release wakes the loop; ask again for a
                            // larger share now and then.
                            MAX_REFILL_SLEEP
                        } else {
                            // Ask again when the granted schedule runs out, or when the
                            // budget said something could be granted.
                            let last = granted.delays.last().copied().unwrap_or_default();
                            last.max(granted.wait)
                                .max(granted.blocked_for)
                                .clamp(Duration::from_millis(5), MAX_REFILL_SLEEP)
                        }
                    }
                    Err(e) => {
                        bucket.untold(sent_freely);
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

/// A count as the attempt's record stores it.
fn count(n: usize) -> i32 {
    i32::try_from(n).unwrap_or(i32::MAX)
}

/// Tokens a request counts against a tokens-per-minute limit: its prompt, estimated from the
/// text (`chars_per_token` characters a token, rounded up), and the most its reply may have.
pub fn request_tokens(
    prompt_chars: usize,
    max_output_tokens: Option<u32>,
    default_output: u32,
    chars_per_token: u32,
) -> u64 {
    (prompt_chars as u64).div_ceil(u64::from(chars_per_token.max(1)))
        + u64::from(max_output_tokens.unwrap_or(default_output))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_counts_its_prompt_and_its_reply_ceiling() {
        assert_eq!(request_tokens(400, Some(256), 1024, 4), 100 + 256);
        assert_eq!(request_tokens(401, None, 1024, 4), 101 + 1024);
        assert_eq!(request_tokens(800, Some(1), 1024, 8), 100 + 1);
    }
}
