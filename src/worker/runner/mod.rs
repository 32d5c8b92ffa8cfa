//! The lease state machine of one task: read (terminal: done) → claim (leased by another live
//! assignment: park until its lease ends or the task's status changes, then read again) →
//! provider call with the lease renewed in the background → guarded completion → classify.
//! Knows nothing of Kafka: it runs a task by its id, for a record of the worker or for any
//! other caller that must drive a task to a terminal state.
//!
//! Keeps I5 (a terminal or foreign-leased task gets no provider call: the read and the claim
//! both check), I4 (no transaction is open during the call: every store operation is one short
//! statement or transaction) and I7 (the budget and the backoff live in the row). I1 and I2
//! are the store's; a refused completion sends the task back to the read step.
//!
//! The rooms: `kinds` (the machine's types), this file (a run: read, claim, park, again),
//! `attempt` (one claim's call: capacity, the provider, its stream or operation) and `guard`
//! (the call raced against cancellation and the lease, and what a failure makes of the task).

mod attempt;
mod guard;
mod kinds;

use std::future::Future;
use std::sync::Arc;

use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, Span};

use super::live::LiveWriter;
use super::parking::{ParkedTasks, WakeSource};
use super::store_retry::{pause, with_retry};
use crate::capacity::Capacity;
use crate::provider::Provider;
use crate::store::{EnsureOutcome, Labelled, Store};
use crate::telemetry::{self, trace};
use crate::transport::source::WindowSlot;
use replyd_core::domain::{RecordEnd, TaskId};
use replyd_core::lease::ClaimOutcome;

use kinds::{AttemptEnd, Place};
pub use kinds::{FromRecord, RunEnd, RunnerSettings, TaskRunner, WhenHeld};

impl TaskRunner {
    pub fn new(
        store: Store,
        provider: Arc<dyn Provider>,
        parked: ParkedTasks,
        capacity: Capacity,
        live: LiveWriter,
        settings: RunnerSettings,
    ) -> Self {
        Self {
            store,
            provider,
            parked,
            capacity,
            live,
            settings,
        }
    }

    /// The workspaces' weights the capacity orders its waiters by (I10).
    pub fn weights(&self) -> crate::capacity::Weights {
        self.capacity.weights()
    }

    /// A store operation retried on I/O errors until it succeeds or `cancel` fires.
    pub(super) async fn with_retry<T, F, Fut>(
        &self,
        operation: &'static str,
        cancel: &CancellationToken,
        op: F,
    ) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, crate::store::StoreError>>,
    {
        with_retry(self.settings.io_retry, operation, cancel, op).await
    }

    /// A write that ends the lease (a completion, a failure, a release), retried as
    /// [`TaskRunner::with_retry`] retries it, inside `span`, which records what it answered.
    pub(super) async fn lease_end<T, F, Fut>(
        &self,
        operation: &'static str,
        span: Span,
        cancel: &CancellationToken,
        op: F,
    ) -> Option<T>
    where
        T: Labelled,
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, crate::store::StoreError>>,
    {
        let answer = self
            .with_retry(operation, cancel, op)
            .instrument(span.clone())
            .await?;
        span.record("replyd.outcome", answer.label());
        Some(answer)
    }

    /// Runs the task until it is terminal, `cancel` fires (`None`: cancelled before a durable
    /// outcome), or (under [`WhenHeld::HandBack`]) another worker holds it. With `record`, the
    /// first claim also inserts the record's task if it is absent (one round trip for both)
    /// and reports a record that disagrees with the stored task. Each claim, provider call and
    /// completion is a child span of `trace` (see [`trace`]; disabled spans when traces are
    /// off).
    pub async fn run(
        &self,
        task_id: TaskId,
        record: Option<FromRecord<'_>>,
        held: WhenHeld,
        cancel: &CancellationToken,
        trace: &Span,
    ) -> Option<RunEnd> {
        let id = task_id.to_string();
        // Watched from before the first claim, so a lease that ends between a claim and the
        // park below still wakes this run (the park listens; see `TaskWatch::listen`).
        let mut watch = self.parked.watch(task_id);
        let source = record.as_ref().map(|r| r.source);
        let slot = record
            .as_ref()
            .map_or_else(WindowSlot::none, |r| r.slot.clone());
        let mut record = record;

        loop {
            // I5: the claim reads the row under its lock right before deciding to call, and
            // says what it found (a completed task is never called for).
            let insert = record.as_ref().map(|r| r.spec);
            let claim_span = trace::claim(trace);
            let taken = self
                .with_retry("claim", cancel, || {
                    self.store.claim_task(
                        task_id,
                        &self.settings.lease_owner,
                        self.settings.lease,
                        insert,
                        source,
                    )
                })
                .instrument(claim_span.clone())
                .await?;
            if let (Some(from), Some(EnsureOutcome::Conflict { fields })) =
                (record.take(), &taken.ensured)
            {
                // The stored task is the work; this record's different inputs are only reported.
                telemetry::record_conflicts_with_task(&id, from.source.offset, fields);
            }
            let claim = taken.claim;
            claim_span.record("replyd.outcome", claim.label());
            claim_span.record("replyd.assignment_version", claim.version());
            drop(claim_span);
            telemetry::claim(&id, &claim);
            let Some(stored) = taken.task else {
                if matches!(claim, ClaimOutcome::Forgotten) {
                    // Deleted by retention or an erasure, perhaps while this worker ran it: a
                    // forgotten task is never run again.
                    self.parked.wake(task_id, WakeSource::Local);
                    return Some(RunEnd::Terminal(RecordEnd::Forgotten));
                }
                // Ensured above, and only a forgotten task is deleted: someone removed it.
                tracing::error!(task_id = %id, "task row disappeared; retrying");
                if !pause(cancel, self.settings.io_retry).await {
                    return None;
                }
                continue;
            };
            let wait = match claim {
                ClaimOutcome::Claimed(lease) | ClaimOutcome::TookOver(lease) => {
                    tracing::Span::current().record("assignment_version", lease.version);
                    let place = Place {
                        lane: source.map_or(-1, |s| s.partition),
                        slot: &slot,
                    };
                    match self.attempt(&stored, &lease, place, cancel, trace).await {
                        AttemptEnd::Terminal(how) => return Some(RunEnd::Terminal(how)),
                        AttemptEnd::Cancelled => return None,
                        AttemptEnd::Again { wait } => wait,
                    }
                }
                ClaimOutcome::LeasedByOther { until, owner, .. } => {
                    // Park until the other lease ends or the task's status changes (woken by
                    // `parked`), then look again. The lease end is database time; a small
                    // skew only shifts when we look.
                    let wait = (until - Utc::now())
                        .to_std()
                        .unwrap_or_default()
                        .clamp(self.settings.io_retry / 4, self.settings.lease);
                    if held == WhenHeld::HandBack && owner != self.settings.lease_owner {
                        return Some(RunEnd::HandBack { after: wait });
                    }
                    if !self.park(cancel, wait, &mut watch).await {
                        return None;
                    }
                    continue;
                }
                ClaimOutcome::AlreadyCompleted => {
                    return Some(RunEnd::Terminal(RecordEnd::AlreadyCompleted));
                }
                ClaimOutcome::AlreadyFailed => {
                    return Some(RunEnd::Terminal(RecordEnd::AlreadyFailed));
                }
                ClaimOutcome::AlreadyCancelled => {
                    return Some(RunEnd::Terminal(RecordEnd::Cancelled));
                }
                ClaimOutcome::BudgetExhausted { .. } | ClaimOutcome::DeadlinePassed { .. } => {
                    // Both say why; the default is never taken.
                    let (why, reason) = claim
                        .failure(stored.spec.max_attempts, stored.attempt_count + 1)
                        .unwrap_or_default();
                    return Some(self.failed_at_claim(task_id, why, &reason));
                }
                ClaimOutcome::NotBefore { at } => {
                    let wait = (at - Utc::now())
                        .to_std()
                        .unwrap_or_default()
                        .max(self.settings.io_retry / 4);
                    // Woken early too: a copy elsewhere may finish the task meanwhile.
                    if !self.park(cancel, wait, &mut watch).await {
                        return None;
                    }
                    continue;
                }
                // Both come without a row, handled above.
                ClaimOutcome::NotFound | ClaimOutcome::Forgotten => self.settings.io_retry,
            };
            if !pause(cancel, wait).await {
                return None;
            }
        }
    }

    /// The end of a run whose claim failed the task (its budget spent or its deadline passed):
    /// the failure is reported, and the records parked on the task are woken to see it ended.
    fn failed_at_claim(&self, task_id: TaskId, why: &'static str, reason: &str) -> RunEnd {
        telemetry::task_failed_at_claim(&task_id.to_string(), why, reason);
        self.parked.wake(task_id, WakeSource::Local);
        RunEnd::Terminal(RecordEnd::Failed)
    }
}
