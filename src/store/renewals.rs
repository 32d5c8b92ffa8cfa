//! Lease renewals, batched per worker (`database.batch_renewals`): every lease whose call is
//! running is renewed by one call of `replyd_renew_many` (migration V11) per renewal interval,
//! whatever the number of calls in flight. One transaction per worker per interval instead of
//! one per task is what makes a short lease cheap, and the lease bounds how long a killed
//! worker's tasks wait for another worker.
//!
//! Each row is guarded as a lone renewal is, and the call never waits on a row lock. A row it
//! could not lock (`busy`) or whose lease no longer holds (`refused`) is renewed alone, through
//! [`renew_one`]: that waits on the lock, reads the clock after it, and says why a lease is
//! gone. A refusal reaches the call's [`LeaseHold`], which stops the call.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::Duration;

use tokio::sync::oneshot;
use uuid::Uuid;

use replyd_core::lease::{Lease, Refusal};

use super::error::StoreError;
use super::fence::{self, AttemptWrite, FencedUpdate};
use super::rows::{RenewOutcome, seconds};
use super::sessions::Sessions;

/// The leases of the calls running now, keyed by task and assignment version.
#[derive(Debug, Default)]
pub(crate) struct HeldLeases {
    held: Mutex<HashMap<(Uuid, i64), Held>>,
}

#[derive(Debug)]
struct Held {
    lease: Lease,
    lost: Option<oneshot::Sender<Refusal>>,
    /// A lone renewal of this row is out: leave it out of the batch until it answers.
    alone: bool,
    /// When the call began, so that a check between renewals skips calls younger than it.
    since: tokio::time::Instant,
}

impl HeldLeases {
    fn lock(&self) -> MutexGuard<'_, HashMap<(Uuid, i64), Held>> {
        self.held.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Tells the call holding `key` that its lease is gone, and forgets the lease.
    fn lost(&self, key: (Uuid, i64), refusal: Refusal) {
        if let Some(mut held) = self.lock().remove(&key)
            && let Some(lost) = held.lost.take()
        {
            // A call that ended meanwhile does not mind.
            let _ = lost.send(refusal);
        }
    }
}

/// How the batched renewer runs: every `every`, each lease extended by `extend` from now;
/// every `check` in between (when set), one read of which leases ended.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RenewalTimes {
    pub every: Duration,
    pub extend: Duration,
    pub check: Option<Duration>,
}

/// The running renewer of a store, and the leases it renews.
#[derive(Debug)]
pub(crate) struct LeaseRenewer {
    leases: Arc<HeldLeases>,
    checked: bool,
}

impl LeaseRenewer {
    /// Starts the renewing task on the current runtime. It ends once the renewer is dropped.
    pub(crate) fn start(store: Sessions, times: RenewalTimes) -> Self {
        let leases = Arc::new(HeldLeases::default());
        tokio::spawn(renew_batches(store, Arc::downgrade(&leases), times));
        Self {
            leases,
            checked: times.check.is_some(),
        }
    }
}

/// A running call's lease, renewed in the background until the hold is dropped.
pub struct LeaseHold {
    how: Renewing,
}

enum Renewing {
    /// In the worker's batch; the renewer says when the lease is gone.
    Batched {
        leases: Arc<HeldLeases>,
        key: (Uuid, i64),
        lost: oneshot::Receiver<Refusal>,
        checked: bool,
    },
    /// On its own: one renewal per interval, by this hold.
    Alone {
        store: Sessions,
        lease: Lease,
        times: RenewalTimes,
    },
}

impl LeaseHold {
    pub(crate) fn batched(renewer: &LeaseRenewer, lease: &Lease) -> Self {
        let (sender, lost) = oneshot::channel();
        let key = (lease.task_id, lease.version);
        renewer.leases.lock().insert(
            key,
            Held {
                lease: lease.clone(),
                lost: Some(sender),
                alone: false,
                since: tokio::time::Instant::now(),
            },
        );
        Self {
            how: Renewing::Batched {
                leases: Arc::clone(&renewer.leases),
                key,
                lost,
                checked: renewer.checked,
            },
        }
    }

    pub(crate) fn alone(store: Sessions, lease: &Lease, every: Duration, extend: Duration) -> Self {
        Self {
            how: Renewing::Alone {
                store,
                lease: lease.clone(),
                times: RenewalTimes {
                    every,
                    extend,
                    check: None,
                },
            },
        }
    }

    /// Whether the end of this lease by someone else (a user's Stop, a takeover) is heard
    /// between renewals without listening: the batch's checks read it (`worker.lease_check_ms`).
    pub fn checked(&self) -> bool {
        matches!(&self.how, Renewing::Batched { checked: true, .. })
    }

    /// Waits until a renewal is refused, and says why. A renewal that fails on I/O is tried
    /// again at the next tick: if the database stays away past the lease, the refusal comes
    /// once it is back.
    pub async fn lost(&mut self) -> Refusal {
        match &mut self.how {
            Renewing::Batched { lost, .. } => match lost.await {
                Ok(refusal) => refusal,
                // The renewer is gone (its runtime is shutting down): nothing renews the
                // lease any more, so wait for the call's own end or cancellation.
                Err(_) => std::future::pending().await,
            },
            Renewing::Alone {
                store,
                lease,
                times,
            } => {
                let mut ticks = tokio::time::interval(times.every);
                ticks.tick().await; // the first tick is immediate; the claim just set the lease
                loop {
                    ticks.tick().await;
                    // Boxed: inline, the statement's future would make every held lease's
                    // `lost` (and each guarded call around it) that much larger.
                    match Box::pin(renew_one(store, lease, times.extend)).await {
                        Ok(RenewOutcome::Renewed { .. }) => {}
                        Ok(RenewOutcome::Refused(refusal)) => return refusal,
                        Err(e) => crate::telemetry::store_error("renew", &e),
                    }
                }
            }
        }
    }
}

impl Drop for LeaseHold {
    fn drop(&mut self) {
        if let Renewing::Batched { leases, key, .. } = &self.how {
            leases.lock().remove(key);
        }
    }
}

/// Renews every held lease once per interval, and checks between renewals which of them ended,
/// until the renewer is dropped.
async fn renew_batches(store: Sessions, leases: Weak<HeldLeases>, times: RenewalTimes) {
    let mut ticks = tokio::time::interval(times.every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    ticks.tick().await;
    // Checks only between renewals: none asked, or none more often than the renewals (which
    // are checks themselves), leaves them out.
    let mut checks = times
        .check
        .filter(|check| *check < times.every)
        .map(|every| {
            let mut checks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            checks
        });
    loop {
        // None: a renewal; Some(age): a check of the calls at least that old.
        let check = tokio::select! {
            _ = ticks.tick() => None,
            age = next_check(&mut checks) => Some(age),
        };
        let Some(leases) = leases.upgrade() else {
            return;
        };
        match check {
            None => renew_round(&store, &leases, times.extend).await,
            Some(age) => check_round(&store, &leases, age, times.extend).await,
        }
    }
}

/// The next tick of the checks, with their period; never without them.
async fn next_check(checks: &mut Option<tokio::time::Interval>) -> Duration {
    match checks {
        Some(checks) => {
            checks.tick().await;
            checks.period()
        }
        None => std::future::pending().await,
    }
}

async fn renew_round(store: &Sessions, leases: &Arc<HeldLeases>, extend: Duration) {
    let batch: Vec<Lease> = leases
        .lock()
        .values()
        .filter(|h| !h.alone)
        .map(|h| h.lease.clone())
        .collect();
    if batch.is_empty() {
        return;
    }
    metrics::histogram!(crate::telemetry::names::RENEWAL_BATCH_ROWS).record(batch.len() as f64);
    match renew_rows(store, &batch, extend).await {
        Ok(answers) => {
            for (lease, answer) in batch.into_iter().zip(answers) {
                if answer != Answer::Renewed {
                    renew_alone(store, leases, lease, extend);
                }
            }
        }
        // Not renewed this time; the lease outlasts more than one interval (validated), and
        // the next tick tries them all again.
        Err(e) => crate::telemetry::store_error("renew", &e),
    }
}

/// One read of which leases, held for at least `age`, no longer hold: a user's Stop or a
/// takeover ended them. Each is renewed alone, which is refused and says why, and that ends
/// its call. A call younger than `age` is left to the next check, so calls that end sooner
/// cost no statement at all. An error leaves it to the next check or renewal: the check is a
/// hint that cuts a call short, the fenced writes decide.
async fn check_round(store: &Sessions, leases: &Arc<HeldLeases>, age: Duration, extend: Duration) {
    let batch: Vec<Lease> = leases
        .lock()
        .values()
        .filter(|h| !h.alone && h.since.elapsed() >= age)
        .map(|h| h.lease.clone())
        .collect();
    if batch.is_empty() {
        return;
    }
    match ended_rows(store, &batch).await {
        Ok(ended) => {
            for lease in batch {
                if ended.contains(&(lease.task_id, lease.version)) {
                    renew_alone(store, leases, lease, extend);
                }
            }
        }
        Err(e) => crate::telemetry::store_error("lease_check", &e),
    }
}

/// One row's answer from `replyd_renew_many`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Renewed,
    /// Locked by another session, or refused: renewed alone, which waits and says why.
    Again,
}

/// One call for the whole batch; one answer per lease, in order.
async fn renew_rows(
    store: &Sessions,
    batch: &[Lease],
    extend: Duration,
) -> Result<Vec<Answer>, StoreError> {
    let tasks: Vec<Uuid> = batch.iter().map(|l| l.task_id).collect();
    let versions: Vec<i64> = batch.iter().map(|l| l.version).collect();
    let client = store.client().await?;
    let statement = client
        .prepare_cached("SELECT task_id, outcome FROM replyd_renew_many($1, $2, $3)")
        .await?;
    let rows = client
        .query(&statement, &[&tasks, &versions, &seconds(extend)])
        .await?;
    let renewed: std::collections::HashSet<Uuid> = rows
        .iter()
        .filter(|row| row.get::<_, &str>("outcome") == "renewed")
        .map(|row| row.get("task_id"))
        .collect();
    Ok(batch
        .iter()
        .map(|l| {
            if renewed.contains(&l.task_id) {
                Answer::Renewed
            } else {
                Answer::Again
            }
        })
        .collect())
}

/// The leases of `batch` that no longer hold, by the fence's own test (`replyd_lease_holds`);
/// one read, no lock, no write.
async fn ended_rows(
    store: &Sessions,
    batch: &[Lease],
) -> Result<std::collections::HashSet<(Uuid, i64)>, StoreError> {
    let tasks: Vec<Uuid> = batch.iter().map(|l| l.task_id).collect();
    let versions: Vec<i64> = batch.iter().map(|l| l.version).collect();
    let client = store.client().await?;
    let statement = client
        .prepare_cached(
            "SELECT i.task_id, i.version FROM unnest($1::uuid[], $2::bigint[]) AS i(task_id, version) \
             WHERE NOT EXISTS (SELECT 1 FROM reply_tasks r \
                               WHERE r.task_id = i.task_id AND replyd_lease_holds(r, i.version))",
        )
        .await?;
    let rows = client.query(&statement, &[&tasks, &versions]).await?;
    Ok(rows
        .iter()
        .map(|row| (row.get("task_id"), row.get("version")))
        .collect())
}

/// Renews one lease on its own, off the batch's path; a refusal ends its call.
fn renew_alone(store: &Sessions, leases: &Arc<HeldLeases>, lease: Lease, extend: Duration) {
    let key = (lease.task_id, lease.version);
    match leases.lock().get_mut(&key) {
        Some(held) => held.alone = true,
        // Its call ended meanwhile.
        None => return,
    }
    let store = store.clone();
    let leases = Arc::clone(leases);
    tokio::spawn(async move {
        match renew_one(&store, &lease, extend).await {
            Ok(RenewOutcome::Renewed { .. }) => {
                if let Some(held) = leases.lock().get_mut(&key) {
                    held.alone = false;
                }
            }
            Ok(RenewOutcome::Refused(refusal)) => leases.lost(key, refusal),
            Err(e) => {
                crate::telemetry::store_error("renew", &e);
                if let Some(held) = leases.lock().get_mut(&key) {
                    held.alone = false;
                }
            }
        }
    });
}

/// Renews one lease on its own, through the fenced write: waits on the row lock, reads the
/// clock after it, and says why a lease is gone. Also what `Store::renew` does.
pub(super) async fn renew_one(
    sessions: &Sessions,
    lease: &Lease,
    extend: Duration,
) -> Result<RenewOutcome, StoreError> {
    let result = fence::write(
        sessions,
        lease,
        FencedUpdate {
            set: "lease_until = clock_timestamp() + make_interval(secs => $3), \
                  updated_at = clock_timestamp()",
            returning: "lease_until",
        },
        &[&lease.task_id, &lease.version, &seconds(extend)],
        AttemptWrite::Nothing,
        None,
    )
    .await?;
    Ok(match result {
        Ok(row) => RenewOutcome::Renewed {
            until: row.get("lease_until"),
        },
        Err(refusal) => RenewOutcome::Refused(refusal),
    })
}
