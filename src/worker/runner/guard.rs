//! The call raced against cancellation and the lease's end, and what a failure makes of the
//! task: retried, failed, or given back; a refused write ends the attempt; a task held
//! elsewhere is parked until it changes.

use std::future::Future;
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tracing::Span;

use super::super::parking::{TaskWatch, WakeSource};
use super::kinds::{AttemptEnd, Guarded, Guarding, TaskRunner};
use crate::store::{FailOutcome, Release, ReleaseOutcome, RenewOutcome};
use crate::telemetry::{self, CallEnd, trace};
use replyd_core::domain::{AttemptOutcome, ProviderRan, RecordEnd, StoredTask, TaskId};
use replyd_core::lease::{Lease, Refusal};
use replyd_core::provider::{GenerationRequest, ProviderError};
use replyd_core::retry::{self, Action, Attempt, attempt_outcome};

impl TaskRunner {
    /// Runs one provider future against cancellation and the lease renewer.
    pub(super) async fn guarded<T>(
        &self,
        lease: &Lease,
        cancel: &CancellationToken,
        call: impl Future<Output = T>,
        what: Guarding,
    ) -> Guarded<T> {
        // Renewed while the call runs (in the worker's batch when that is on), not after it.
        let mut hold = self
            .store
            .hold(lease, self.settings.renew_interval, self.settings.lease);
        // A change of the task's status while this assignment holds it is someone else's end
        // of it, a user's Stop most often: it must cut the call short while the user still
        // waits for it to stop, not at the next renewal. The batch's lease checks read it
        // (`worker.lease_check_ms`) without a listening session; without them, the call
        // listens for its task's changes and looks at once.
        let mut changed = (!hold.checked()).then(|| {
            let mut watch = self.parked.watch(TaskId::from(lease.task_id));
            watch.listen();
            watch
        });
        tokio::pin!(call);
        loop {
            let refusal = tokio::select! {
                // Cancellation first: a revoked partition's work stops before anything else.
                biased;
                _ = cancel.cancelled() => return Guarded::Cancelled,
                refusal = hold.lost() => refusal,
                () = changed_or_never(&mut changed) => {
                    // A renewal is the fenced look: refused when the task is no longer this
                    // assignment's. An error leaves it to the next regular renewal. Boxed: it is
                    // rare, and inline it would make every guarded step's future its size.
                    match Box::pin(self.store.renew(lease, self.settings.lease)).await {
                        Ok(RenewOutcome::Refused(refusal)) => refusal,
                        _ => continue,
                    }
                }
                result = &mut call => return Guarded::Done(result),
            };
            // A provider's answer that had already come goes to the fenced write, which refuses
            // it and records the refusal, instead of being dropped for news of the lease that
            // came at the same moment (a zombie wakes with both in hand). A permit or an
            // operation's start is not taken with a lost lease: no call follows it.
            if what == Guarding::Call
                && let Some(result) = futures_util::FutureExt::now_or_never(&mut call)
            {
                return Guarded::Done(result);
            }
            return Guarded::Refused(refusal);
        }
    }

    /// Ends an attempt whose call was cut short by cancellation or a lost lease.
    pub(super) async fn interrupted<T>(
        &self,
        id: &str,
        lease: &Lease,
        how: Guarded<T>,
        started: Instant,
    ) -> AttemptEnd {
        match how {
            Guarded::Cancelled => {
                telemetry::provider_call(id, lease.version, CallEnd::Cancelled, started.elapsed());
                // Give the lease back so the partition's next owner need not wait it out.
                match self
                    .store
                    .release(
                        lease,
                        AttemptOutcome::Abandoned,
                        "cancelled: partition revoked or worker stopping",
                        // The call was cut short: it may have reached the provider.
                        ProviderRan::Maybe,
                    )
                    .await
                {
                    Ok(ReleaseOutcome::Released) => self.lease_ended(lease),
                    // A zombie whose partition was revoked while it stalled learns here that
                    // its attempt was over: said and counted as any refused fenced write.
                    Ok(ReleaseOutcome::Refused(refusal)) => {
                        telemetry::write_refused(
                            id,
                            "release",
                            lease.version,
                            refusal.label(),
                            None,
                        );
                    }
                    Err(e) => telemetry::store_error("release", &e),
                }
                AttemptEnd::Cancelled
            }
            Guarded::Refused(refusal) => {
                telemetry::lease_renewal_refused(id, lease.version, &format!("{refusal:?}"));
                telemetry::provider_call(id, lease.version, CallEnd::LeaseLost, started.elapsed());
                AttemptEnd::Again {
                    wait: Duration::ZERO,
                }
            }
            Guarded::Done(_) => AttemptEnd::Again {
                wait: Duration::ZERO,
            },
        }
    }

    /// Acts on a provider error as the retry policy decides: fail the task for good, or give
    /// the lease back with the backoff written into the row (so any worker, after any restart,
    /// keeps to it) and come back after it.
    pub(super) async fn provider_failed(
        &self,
        stored: &StoredTask,
        lease: &Lease,
        error: ProviderError,
        cancel: &CancellationToken,
        trace: &Span,
    ) -> AttemptEnd {
        let id = stored.spec.task_id.to_string();
        let attempt = Attempt {
            number: lease.attempt,
            max_attempts: i32::try_from(stored.spec.max_attempts).unwrap_or(i32::MAX),
            refusals: stored.refusals,
            refusal_left: stored
                .refusal_deadline
                .map(|d| (d - Utc::now()).to_std().unwrap_or_default()),
            deadline_left: stored
                .spec
                .deadline
                .map(|d| (d - Utc::now()).to_std().unwrap_or_default()),
            previous_error: stored.last_error_class.as_deref(),
            recoverable: self.settings.recoverable,
        };
        let outcome = attempt_outcome(&error);
        let ran = error.ran();
        if let ProviderError::Retryable {
            status,
            retry_after,
            signals,
            ..
        } = &error
        {
            let model =
                GenerationRequest::for_task(&stored.spec, &self.settings.default_model).model;
            self.observe(&model, signals).await;
            if matches!(status, 429 | 503 | 529) {
                // Out of capacity at the provider: every worker of the deployment pauses as
                // it asked, and a learned limit is cut (I9).
                self.capacity
                    .refused(&model, retry_after.or(signals.requests.resets_in))
                    .await;
            }
        }
        match retry::decide(&error, attempt, &self.settings.retry, fastrand::f64()) {
            Action::Fail { reason, outcome } => {
                let failing = trace::completion(trace, "fail task");
                let Some(failed) = self
                    .lease_end("fail", failing, cancel, || {
                        self.store.fail(lease, &reason, outcome, ran)
                    })
                    .await
                else {
                    return AttemptEnd::Cancelled;
                };
                match failed {
                    FailOutcome::Failed => {
                        telemetry::task_failed(&id, lease.version, &reason);
                        self.lease_ended(lease);
                        AttemptEnd::Terminal(RecordEnd::Failed)
                    }
                    FailOutcome::Refused(refusal) => self.refused(&id, lease, refusal, "failure"),
                }
            }
            Action::Retry { after } => {
                telemetry::retry_planned(&id, lease.version, error.kind(), after);
                let detail = error.to_string();
                let release = Release {
                    outcome,
                    detail: &detail,
                    retry_after: after,
                    error_class: Some(error.kind()),
                    ran,
                    give_back: retry::is_refusal(&error),
                    refusal_budget: retry::is_refusal(&error)
                        .then(|| self.settings.retry.refusal_budget()),
                };
                let releasing = trace::completion(trace, "release for retry");
                let released = self
                    .lease_end("release", releasing, cancel, || {
                        self.store.release_as(lease, &release)
                    })
                    .await;
                match released {
                    None => AttemptEnd::Cancelled,
                    Some(ReleaseOutcome::Refused(refusal)) => {
                        self.refused(&id, lease, refusal, "release")
                    }
                    Some(ReleaseOutcome::Released) => {
                        self.lease_ended(lease);
                        AttemptEnd::Again { wait: after }
                    }
                }
            }
        }
    }

    pub(super) fn refused(
        &self,
        id: &str,
        lease: &Lease,
        refusal: Refusal,
        what: &'static str,
    ) -> AttemptEnd {
        let current_version = match refusal {
            Refusal::TakenOver { current_version } => Some(current_version),
            Refusal::LeaseExpired => Some(lease.version),
            _ => None,
        };
        telemetry::write_refused(id, what, lease.version, refusal.label(), current_version);
        match refusal {
            Refusal::AlreadySaved { .. } => AttemptEnd::Terminal(RecordEnd::AlreadyCompleted),
            Refusal::Failed => AttemptEnd::Terminal(RecordEnd::AlreadyFailed),
            Refusal::Cancelled => AttemptEnd::Terminal(RecordEnd::Cancelled),
            // Someone else holds (or may take) the task: read it again, and park if leased.
            Refusal::LeaseExpired | Refusal::TakenOver { .. } | Refusal::NotFound => {
                AttemptEnd::Again {
                    wait: Duration::ZERO,
                }
            }
        }
    }

    /// This process ended `lease` (saved, failed or gave it back): wake its own records parked
    /// on the task at once, without waiting for the notification to come back round.
    pub(super) fn lease_ended(&self, lease: &Lease) {
        self.parked
            .wake(TaskId::from(lease.task_id), WakeSource::Local);
    }

    /// Parks a record for `wait`, or until its task is woken, or cancellation; false when
    /// cancelled.
    pub(super) async fn park(
        &self,
        cancel: &CancellationToken,
        wait: Duration,
        watch: &mut TaskWatch,
    ) -> bool {
        watch.listen();
        tokio::select! {
            biased;
            _ = cancel.cancelled() => false,
            _ = watch.changed() => true,
            _ = tokio::time::sleep(wait) => true,
        }
    }
}

/// The next change of a watched task, or never when nothing is watched.
async fn changed_or_never(watch: &mut Option<TaskWatch>) {
    match watch {
        Some(watch) => watch.changed().await,
        None => std::future::pending().await,
    }
}
