//! The quota's reconciler (I8): every reservation past its TTL is decided from the durable task
//! first and from the provider second, before anything is released or charged again
//! ([`replyd_core::quota::decide_expired`]):
//! - the task completed: its reservation is charged; it failed and the provider did none of
//!   its work: settled as the policy says for a failure;
//! - the task failed while the provider may have done its work (its reservation was kept open,
//!   unresolved): the provider is asked where it can (a stored operation id: done is charged,
//!   still running keeps the reservation, gone expires it), otherwise it is settled as
//!   `quota.charge_unresolved` says;
//! - a worker holds a live lease, a retry is due, or the task was worked within the redelivery
//!   bound (its worker may have vanished with the record uncommitted, and the group hands it
//!   on once the session times out): the reservation is kept for another TTL;
//! - a provider operation id is stored: the reconciler claims the task (which fences any
//!   zombie of an earlier attempt) and asks the provider; work found done is saved as the
//!   reply through the fenced path, and that transaction charges it; work still running keeps
//!   the reservation; an operation the provider no longer has ends the task;
//! - nobody works the task: the reconciler claims it and fails it; the reservation expires
//!   without a charge in the same transaction, or, when an earlier call may have done the
//!   work, is settled as `quota.charge_unresolved` says.
//!
//! Every decision is written to `quota_decisions` (who, when, why) and counted in
//! `replyd_quota_reconciled_total{decision}`. `replyd reconcile` runs one pass; the relay's
//! [`crate::housekeeping`] (and so `serve`'s) runs a pass every [`INTERVAL`].

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use serde::Serialize;

use crate::probes::Heartbeat;
use crate::provider::{BackgroundProvider, Provider, ProviderSettings};
use crate::store::quota::ExpiredReservation;
use crate::store::{CompletionOutcome, DatabaseSettings, FailOutcome, Store, StoreError};
use crate::telemetry;
use replyd_core::domain::{AttemptOutcome, ProviderRan, TaskStatus};
use replyd_core::lease::{ClaimOutcome, Lease};
use replyd_core::provider::{Generation, OperationId, ProviderError};
use replyd_core::quota::{
    ExpiredDecision, LookedUp, QuotaPolicy, Settle, decide_expired, decide_looked_up,
};

/// How often the relay runs a pass.
pub const INTERVAL: Duration = Duration::from_secs(10);

/// Reservations decided per pass at most; the rest wait for the next pass.
const BATCH: i64 = 500;

/// The reconciler's name in leases, attempt rows and decisions.
pub const OWNER: &str = "reconciler";

/// What one pass did.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ReconcileReport {
    pub examined: usize,
    /// Terminal tasks whose reservation was settled now.
    pub settled: usize,
    pub extended: usize,
    /// Tasks completed with the work the provider had done (charged once, no new generation).
    pub completed_from_provider: usize,
    /// Tasks nobody worked in time: failed, reservation expired.
    pub expired: usize,
    /// Reservations left for the next pass (a store or provider error, a lost race).
    pub left: usize,
    /// Open reservations still past their TTL after the pass (left, or beyond its batch):
    /// `replyd_quota_reservations_overdue`. More than a pass or two of them is an alert.
    pub overdue_after: i64,
}

pub struct Reconciler {
    store: Store,
    provider: Option<Arc<dyn Provider>>,
    policy: QuotaPolicy,
    /// The lease the reconciler takes while it asks the provider.
    lease: Duration,
    /// A task worked within this long is still owed to a worker
    /// (the settings' redelivery bound).
    redelivery: Duration,
    /// The loop that runs the passes, beaten after each reservation: a pass of many provider
    /// look-ups is one long turn of the relay's loop, and is alive while it moves.
    heartbeat: Option<Arc<Heartbeat>>,
}

/// What happened to one reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Done {
    Settled,
    Extended,
    CompletedFromProvider,
    Expired,
    Left,
}

impl Reconciler {
    pub fn new(
        store: Store,
        provider: Option<Arc<dyn Provider>>,
        policy: QuotaPolicy,
        lease: Duration,
        redelivery: Duration,
    ) -> Self {
        Self {
            store,
            provider,
            policy,
            lease,
            redelivery,
            heartbeat: None,
        }
    }

    /// Beats `heartbeat` after each reservation a pass decides.
    pub fn beating(mut self, heartbeat: Arc<Heartbeat>) -> Self {
        self.heartbeat = Some(heartbeat);
        self
    }

    /// One pass over the reservations past their TTL.
    pub async fn run_once(&self) -> Result<ReconcileReport, StoreError> {
        let expired = self
            .store
            .expired_reservations(BATCH, self.redelivery)
            .await?;
        let mut report = ReconcileReport {
            examined: expired.len(),
            ..ReconcileReport::default()
        };
        for reservation in &expired {
            let done = match self.reconcile(reservation).await {
                Ok(done) => done,
                Err(e) => {
                    telemetry::store_error("reconcile", &e);
                    Done::Left
                }
            };
            match done {
                Done::Settled => report.settled += 1,
                Done::Extended => report.extended += 1,
                Done::CompletedFromProvider => report.completed_from_provider += 1,
                Done::Expired => report.expired += 1,
                Done::Left => report.left += 1,
            }
            if let Some(heartbeat) = &self.heartbeat {
                heartbeat.beat();
            }
        }
        report.overdue_after = self.store.overdue_reservations().await?;
        telemetry::reservations_overdue(report.overdue_after);
        Ok(report)
    }

    async fn reconcile(&self, reservation: &ExpiredReservation) -> Result<Done, StoreError> {
        let task = reservation.task_id;
        let decision = decide_expired(reservation.task);
        telemetry::quota_reconciled(decision.label());
        let failed = reservation.task.status == TaskStatus::Failed;
        match decision {
            ExpiredDecision::Charge | ExpiredDecision::SettleFailed => {
                let why = "the task was already terminal when its reservation expired";
                self.store.settle_terminal(task, OWNER, why).await?;
                Ok(Done::Settled)
            }
            ExpiredDecision::Extend(why) => self.extend(reservation, why).await,
            ExpiredDecision::LookUp if failed => self.look_up_failed(reservation).await,
            ExpiredDecision::LookUp => self.look_up(reservation).await,
            ExpiredDecision::Unresolved(why) if failed => {
                self.settle_failed_as(reservation, self.policy.on_unresolved(), why)
                    .await
            }
            ExpiredDecision::Expire(why) | ExpiredDecision::Unresolved(why) => {
                let Some(lease) = self.claim(reservation).await? else {
                    return Ok(Done::Left);
                };
                let settle = match decision {
                    ExpiredDecision::Unresolved(_) => self.policy.on_unresolved(),
                    _ => Settle::Expire,
                };
                self.expire(&lease, reservation, why, settle).await
            }
        }
    }

    /// Settles the open reservation of a task that already failed, outright.
    async fn settle_failed_as(
        &self,
        reservation: &ExpiredReservation,
        settle: Settle,
        why: &str,
    ) -> Result<Done, StoreError> {
        Ok(
            match self
                .store
                .settle_as(reservation.task_id, settle, OWNER, why)
                .await?
            {
                Some(_) => Done::Settled,
                None => Done::Left,
            },
        )
    }

    /// Asks the provider about the operation of a task that failed while it may still have
    /// run (a wait that gave up, a deadline): no claim, since no write can be accepted for a
    /// failed task anyway. What the provider did decides the reservation alone; the task stays
    /// failed, as every reader was already told.
    async fn look_up_failed(&self, reservation: &ExpiredReservation) -> Result<Done, StoreError> {
        let Some((background, operation)) = self.askable(reservation) else {
            return self
                .settle_failed_as(
                    reservation,
                    self.policy.on_unresolved(),
                    "the task failed while the provider may have done its work, and the provider cannot be asked",
                )
                .await;
        };
        let found = background.look_up(&OperationId(operation.clone())).await;
        let Some(looked_up) = looked_up(reservation, &found) else {
            return Ok(Done::Left);
        };
        let decision = decide_looked_up(looked_up);
        telemetry::quota_reconciled(decision.label());
        match decision {
            ExpiredDecision::Charge => {
                let response = found
                    .ok()
                    .flatten()
                    .and_then(|g| g.provider_response_id)
                    .unwrap_or_else(|| operation.clone());
                let why = format!(
                    "the provider finished the work after its task failed (response {response}): charged once"
                );
                self.settle_failed_as(reservation, Settle::Charge, &why)
                    .await
            }
            ExpiredDecision::Extend(why) => self.extend(reservation, why).await,
            ExpiredDecision::Expire(why) => {
                self.settle_failed_as(reservation, Settle::Expire, why)
                    .await
            }
            _ => Ok(Done::Left),
        }
    }

    /// The provider to ask about a reservation's stored operation, with that operation; None
    /// when no provider that can be asked is configured or no operation was stored.
    fn askable<'a>(
        &'a self,
        reservation: &'a ExpiredReservation,
    ) -> Option<(&'a dyn BackgroundProvider, &'a String)> {
        let background = self.provider.as_deref()?.as_background()?;
        Some((background, reservation.operation_id.as_ref()?))
    }

    async fn extend(
        &self,
        reservation: &ExpiredReservation,
        why: &str,
    ) -> Result<Done, StoreError> {
        self.store
            .extend_reservation(reservation.task_id, self.policy.reservation_ttl, OWNER, why)
            .await?;
        Ok(Done::Extended)
    }

    /// Claims the task so no zombie of an earlier attempt can write it while the reconciler
    /// decides. None when it cannot be claimed now (another lease, a backoff, already
    /// terminal: the next pass sees the new state).
    async fn claim(&self, reservation: &ExpiredReservation) -> Result<Option<Lease>, StoreError> {
        Ok(
            match self
                .store
                .claim(reservation.task_id, OWNER, self.lease)
                .await?
            {
                ClaimOutcome::Claimed(lease) => Some(lease),
                other => {
                    tracing::debug!(task_id = %reservation.task_id, outcome = other.label(), "reconciler could not claim the task");
                    None
                }
            },
        )
    }

    async fn expire(
        &self,
        lease: &Lease,
        reservation: &ExpiredReservation,
        why: &str,
        settle: Settle,
    ) -> Result<Done, StoreError> {
        let reason = format!("reservation expired: {why}");
        // The decision as `ExpiredDecision::label` names it; the reservation's state says how
        // it was settled.
        let label = match settle {
            Settle::Expire => "expire",
            Settle::Charge | Settle::Release => "unresolved",
        };
        match self.store.expire(lease, &reason, settle).await? {
            FailOutcome::Failed => {
                self.store
                    .record_decision(reservation.task_id, OWNER, label, why)
                    .await?;
                tracing::warn!(task_id = %reservation.task_id, reason, "task failed by the quota reconciler");
                Ok(Done::Expired)
            }
            FailOutcome::Refused(_) => Ok(Done::Left),
        }
    }

    /// Asks the provider about the stored operation, holding the task's lease.
    async fn look_up(&self, reservation: &ExpiredReservation) -> Result<Done, StoreError> {
        let Some((background, operation)) = self.askable(reservation) else {
            // No provider that can be asked: keep the reservation rather than guess.
            return self
                .extend(
                    reservation,
                    "the provider cannot be asked about the operation",
                )
                .await;
        };
        let Some(lease) = self.claim(reservation).await? else {
            return Ok(Done::Left);
        };
        let found = background.look_up(&OperationId(operation.clone())).await;
        let looked_up = match looked_up(reservation, &found) {
            Some(looked_up) => looked_up,
            None => {
                // Decide nothing now: give the task back.
                self.store
                    .release(
                        &lease,
                        AttemptOutcome::Abandoned,
                        "reconciler: provider lookup failed",
                        ProviderRan::No,
                    )
                    .await?;
                return Ok(Done::Left);
            }
        };
        let decision = decide_looked_up(looked_up);
        telemetry::quota_reconciled(decision.label());
        match (decision, found) {
            (ExpiredDecision::Charge, Ok(Some(generation))) => {
                match self
                    .store
                    .complete(&lease, &generation.text, Some(&generation))
                    .await?
                {
                    CompletionOutcome::Accepted => {
                        self.store
                            .record_decision(
                                reservation.task_id,
                                OWNER,
                                "complete",
                                "the provider's operation had finished: its reply saved and charged once",
                            )
                            .await?;
                        Ok(Done::CompletedFromProvider)
                    }
                    CompletionOutcome::Refused(_) => Ok(Done::Left),
                }
            }
            (ExpiredDecision::Extend(why), _) => {
                self.store
                    .release(&lease, AttemptOutcome::Abandoned, why, ProviderRan::No)
                    .await?;
                self.extend(reservation, why).await
            }
            (ExpiredDecision::Expire(why), _) => {
                self.expire(&lease, reservation, why, Settle::Expire).await
            }
            // decide_looked_up gives Charge only for a found generation.
            _ => Ok(Done::Left),
        }
    }
}

/// What a look-up of a task's operation found, or None when the provider did not answer
/// (logged; the next pass asks again).
fn looked_up(
    reservation: &ExpiredReservation,
    found: &Result<Option<Generation>, ProviderError>,
) -> Option<LookedUp> {
    match found {
        Ok(Some(_)) => Some(LookedUp::Done),
        Ok(None) => Some(LookedUp::StillRunning),
        Err(ProviderError::OperationGone { .. } | ProviderError::Fatal { .. }) => {
            Some(LookedUp::Gone)
        }
        Err(e) => {
            tracing::info!(task_id = %reservation.task_id, error = %e, "provider lookup failed; the next pass asks again");
            None
        }
    }
}

/// What a reconciler decides by and asks, composed by the settings tree from `[provider]`,
/// `[quota]`, `[worker]` and the transport.
#[derive(Debug, Clone)]
pub struct ReconcileSettings {
    /// The provider asked about work whose outcome the database does not know.
    pub provider: ProviderSettings,
    pub policy: QuotaPolicy,
    /// A worker's lease (`worker.lease_ms`): a task worked within it may still be running.
    pub lease: Duration,
    /// How long a record whose worker vanished may wait to be handed to another: work only
    /// waiting for that is not abandoned.
    pub redelivery: Duration,
}

impl ReconcileSettings {
    /// The reconciler over `store`, asking the provider of these settings.
    pub fn reconciler(&self, store: Store) -> anyhow::Result<Reconciler> {
        let provider = crate::provider::build_provider(&self.provider)
            .context("provider settings (the quota reconciler asks the provider)")?;
        Ok(Reconciler::new(
            store,
            Some(provider),
            self.policy,
            self.lease,
            self.redelivery,
        ))
    }
}

/// `replyd reconcile`: one pass over the database of `database`.
pub async fn run_command(
    database: &DatabaseSettings,
    settings: &ReconcileSettings,
) -> anyhow::Result<ReconcileReport> {
    let store = Store::connect(database).context("database settings")?;
    Ok(settings.reconciler(store)?.run_once().await?)
}
