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

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chrono::Utc;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, Span};

use super::live::{LiveText, LiveWriter, Received};
use super::parking::{ParkedTasks, TaskWatch, WakeSource};
use super::source::WindowSlot;
use super::store_retry::{pause, with_retry};
use crate::capacity::{self, Capacity};
use crate::provider::{BackgroundProvider, Provider};
use crate::store::{
    CompletionOutcome, EnsureOutcome, FailOutcome, Release, ReleaseOutcome, RenewOutcome, Store,
};
use crate::telemetry::{self, CallEnd, trace};
use replyd_core::domain::{
    AttemptOutcome, ProviderRan, RecordEnd, RecordSource, StoredTask, StreamEnd, TaskId, TaskSpec,
};
use replyd_core::lease::{ClaimOutcome, Lease, Refusal};
use replyd_core::provider::{
    Generation, GenerationRequest, OperationId, ProviderError, RateSignals,
};
use replyd_core::retry::{self, Action, Attempt, RetrySettings, attempt_outcome};

/// The record a run starts from: its task, inserted by the first claim if absent, and where
/// it sits, written by each claim that takes the lease and named in the report when the
/// stored task disagrees with it.
#[derive(Debug, Clone, Copy)]
pub struct FromRecord<'a> {
    pub spec: &'a TaskSpec,
    pub source: RecordSource,
    /// Given back while the record only waits for the provider's capacity.
    pub slot: &'a WindowSlot,
}

/// Where a record's attempt waits for capacity: its lane (the record's partition, -1 without
/// a record) and its window slot, given back if it must wait.
#[derive(Clone, Copy)]
struct Place<'a> {
    lane: i32,
    slot: &'a WindowSlot,
}

/// What a run does when another worker holds the task's lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenHeld {
    /// Wait in memory until the lease ends or the task changes: a Kafka record's offset holds
    /// its partition's commit point whether it waits here or not.
    Park,
    /// Give the record back to its source, to be delivered again when the lease ends: an SQS
    /// message waits hidden in its queue instead of in this worker's memory. A lease held by
    /// this worker's own name is still waited for here: its twin wakes it at once.
    HandBack,
}

/// How a run ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunEnd {
    /// The task is terminal, saying how.
    Terminal(RecordEnd),
    /// Cancelled before a durable outcome.
    Cancelled,
    /// Another worker holds the task (under [`WhenHeld::HandBack`]): look again after this.
    HandBack { after: Duration },
}

/// How often a background create whose answer was lost is sent again within one attempt.
const CREATE_RESENDS: u32 = 2;

/// Settings of the lease state machine.
#[derive(Debug, Clone)]
pub struct RunnerSettings {
    /// The lease owner of this process: `<worker_id>#<incarnation>`
    /// ([`super::settings::WorkerSettings::lease_owner`]), written by its claims and compared
    /// by them: a live lease of this owner is never taken over by this process.
    pub lease_owner: String,
    pub lease: Duration,
    pub renew_interval: Duration,
    /// Wait before retrying a failed database write, and the shortest wait before claiming
    /// again.
    pub io_retry: Duration,
    pub default_model: String,
    /// Output tokens counted against a tokens-per-minute limit for a task that names no
    /// `max_output_tokens` (`capacity.default_output_tokens`).
    pub default_output_tokens: u32,
    /// Characters of prompt counted as a token (`capacity.chars_per_token`).
    pub chars_per_token: u32,
    pub retry: RetrySettings,
    /// Whether an ambiguous call can be recovered by the provider (it honours
    /// Idempotency-Key, or looks operations up by id) instead of generating again.
    pub recoverable: bool,
    /// Whether calls ask for a streamed answer (`provider.stream`).
    pub stream: bool,
}

/// Drives tasks to a terminal state through their leases.
pub struct TaskRunner {
    store: Store,
    provider: Arc<dyn Provider>,
    parked: ParkedTasks,
    /// The provider's capacity, shared by the deployment (I9): a claimed task waits for a
    /// permit before its call.
    capacity: Capacity,
    /// The forwarding of this process's streaming attempts' text.
    live: LiveWriter,
    settings: RunnerSettings,
}

/// How a provider future raced against cancellation and the lease ended.
enum Guarded<T> {
    Done(T),
    Cancelled,
    /// The lease is gone (a renewal or a fenced write was refused).
    Refused(Refusal),
}

impl<T> Guarded<T> {
    /// Stable label for traces, as [`CallEnd`] names the interrupted ends.
    fn label(&self) -> &'static str {
        match self {
            Guarded::Done(_) => "done",
            Guarded::Cancelled => CallEnd::Cancelled.label(),
            Guarded::Refused(_) => CallEnd::LeaseLost.label(),
        }
    }
}

/// How one attempt (one claim) ended.
enum AttemptEnd {
    /// The task is terminal.
    Terminal(RecordEnd),
    /// The lease is gone (taken over, expired, released after a retryable error): go back to
    /// reading the task.
    Again {
        wait: Duration,
    },
    Cancelled,
}

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
    async fn with_retry<T, F, Fut>(
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

    /// Runs the task until it is terminal, `cancel` fires, or (under [`WhenHeld::HandBack`])
    /// another worker holds it. With `record`, the first claim also inserts the record's task
    /// if it is absent (one round trip for both) and reports a record that disagrees with the
    /// stored task. Each claim, provider call and completion is a child span of `trace` (see
    /// [`trace`]; disabled spans when traces are off).
    pub async fn run(
        &self,
        task_id: TaskId,
        record: Option<FromRecord<'_>>,
        held: WhenHeld,
        cancel: &CancellationToken,
        trace: &Span,
    ) -> RunEnd {
        match self.run_inner(task_id, record, held, cancel, trace).await {
            Some(end) => end,
            None => RunEnd::Cancelled,
        }
    }

    async fn run_inner(
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
                ClaimOutcome::BudgetExhausted { attempts } => {
                    telemetry::task_failed_at_claim(
                        &id,
                        "budget_exhausted",
                        &format!(
                            "attempt budget exhausted: {attempts} of {} attempts used",
                            stored.spec.max_attempts
                        ),
                    );
                    self.parked.wake(task_id, WakeSource::Local);
                    return Some(RunEnd::Terminal(RecordEnd::Failed));
                }
                ClaimOutcome::DeadlinePassed { deadline } => {
                    telemetry::task_failed_at_claim(
                        &id,
                        "deadline_passed",
                        &format!(
                            "deadline {} passed before attempt {}",
                            deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                            stored.attempt_count + 1
                        ),
                    );
                    self.parked.wake(task_id, WakeSource::Local);
                    return Some(RunEnd::Terminal(RecordEnd::Failed));
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

    /// One claimed attempt: the provider call raced against cancellation and the lease
    /// renewer, then the fenced write of its result.
    async fn attempt(
        &self,
        stored: &StoredTask,
        lease: &Lease,
        place: Place<'_>,
        cancel: &CancellationToken,
        trace: &Span,
    ) -> AttemptEnd {
        let id = stored.spec.task_id.to_string();
        let request = GenerationRequest::for_task(&stored.spec, &self.settings.default_model);
        // The provider's capacity first, with the lease held and renewed: the wait is no
        // attempt (a wait that ends without a call gives the attempt back), and only a task
        // this worker holds waits, so a duplicate or a task backing off takes no permit.
        let tokens = capacity::request_tokens(
            request
                .messages
                .iter()
                .map(|m| m.content.chars().count())
                .sum(),
            request.max_output_tokens,
            self.settings.default_output_tokens,
            self.settings.chars_per_token,
        );
        let permit = match self
            .guarded(
                lease,
                cancel,
                self.capacity.acquire(
                    &request.model,
                    (&stored.spec.workspace_id, place.lane),
                    tokens,
                    cancel,
                    || place.slot.give_back(),
                ),
            )
            .await
        {
            Guarded::Done(Some(permit)) => permit,
            Guarded::Done(None) | Guarded::Cancelled => {
                return self.gave_up_waiting(lease).await;
            }
            Guarded::Refused(refusal) => {
                telemetry::lease_renewal_refused(&id, lease.version, &format!("{refusal:?}"));
                return AttemptEnd::Again {
                    wait: Duration::ZERO,
                };
            }
        };
        if let Some(waited) = permit.waited() {
            // Why it waited, for `replyd inspect`: off the call's path, and only for long waits.
            let (store, task, version) = (self.store.clone(), stored.spec.task_id, lease.version);
            tokio::spawn(async move {
                if let Err(e) = store.record_capacity_wait(task, version, waited).await {
                    telemetry::store_error("record_capacity_wait", &e);
                }
            });
        }
        let started = Instant::now();
        // The provider's HTTP requests carry this span's context (`traceparent`).
        let call_span = trace::provider_call(trace, &request.model, lease.attempt);
        // The text of this attempt, for the task's followers, as the provider writes it.
        let live = self.live.start(stored.spec.task_id, lease.version);
        let called = match self.provider.as_background() {
            Some(background) => {
                self.call_background(background, stored, &request, lease, cancel, &live)
                    .instrument(call_span.clone())
                    .await
            }
            None => {
                self.guarded_call(
                    lease,
                    cancel,
                    self.provider.generate_streamed(&request, &live),
                )
                .instrument(call_span.clone())
                .await
            }
        };
        let received = live.received();
        drop(live);
        let result = match called {
            Guarded::Done(result) => result,
            other => {
                call_span.record("replyd.outcome", other.label());
                let end = match other {
                    // The user's Stop is a cancelled stream too, seen through its fence.
                    Guarded::Cancelled | Guarded::Refused(Refusal::Cancelled) => {
                        StreamEnd::Cancelled
                    }
                    _ => StreamEnd::Fenced,
                };
                self.stream_ended(lease, Some(end), received).await;
                return self.interrupted(&id, lease, other, started).await;
            }
        };
        let end = match &result {
            Ok(_) => None,
            // Nothing came: no stream was open (a refusal, a request not sent).
            Err(_) if received.chars == 0 && received.usage.is_none() => None,
            Err(ProviderError::Ambiguous { .. }) => Some(StreamEnd::Cut),
            Err(_) => Some(StreamEnd::Error),
        };
        if result.is_ok() || end.is_some() {
            self.stream_ended(lease, end, received).await;
        }
        match result {
            Ok(generation) => {
                call_span.record("replyd.outcome", CallEnd::Replied.label());
                drop(call_span);
                telemetry::provider_call(&id, lease.version, CallEnd::Replied, started.elapsed());
                self.observe(&request.model, &generation.rate_signals).await;
                telemetry::provider_usage(
                    &request.model,
                    generation
                        .usage
                        .map(|u| (u.prompt_tokens, u.completion_tokens)),
                );
                let meta = serde_json::to_value(&generation).ok();
                let saving = trace::completion(trace, "save reply");
                let Some(outcome) = self
                    .with_retry("complete", cancel, || {
                        self.store.complete(lease, &generation.text, meta.as_ref())
                    })
                    .instrument(saving.clone())
                    .await
                else {
                    return AttemptEnd::Cancelled;
                };
                saving.record("replyd.outcome", outcome.label());
                match outcome {
                    CompletionOutcome::Accepted => {
                        telemetry::reply_accepted(&id, lease.version);
                        self.lease_ended(lease);
                        AttemptEnd::Terminal(RecordEnd::Completed)
                    }
                    CompletionOutcome::Refused(refusal) => {
                        self.refused(&id, lease, refusal, "completion")
                    }
                }
            }
            Err(error) => {
                call_span.record("replyd.outcome", CallEnd::Failed(&error).label());
                drop(call_span);
                telemetry::provider_call(
                    &id,
                    lease.version,
                    CallEnd::Failed(&error),
                    started.elapsed(),
                );
                self.provider_failed(stored, lease, error, cancel, trace)
                    .await
            }
        }
    }

    /// A provider with background operations: look up the operation an earlier attempt
    /// started (any worker, any restart) instead of generating again; otherwise start one and
    /// store its id in the task row *before* waiting, so an ambiguous end of this attempt can
    /// be recovered by the next.
    async fn call_background(
        &self,
        background: &dyn BackgroundProvider,
        stored: &StoredTask,
        request: &GenerationRequest,
        lease: &Lease,
        cancel: &CancellationToken,
        live: &LiveText,
    ) -> Guarded<Result<Generation, ProviderError>> {
        let operation = match &stored.provider_operation_id {
            Some(known) => OperationId(known.clone()),
            None => {
                let started = match self
                    .start_operation(background, request, lease, cancel)
                    .await
                {
                    Guarded::Done(Ok(operation)) => operation,
                    Guarded::Done(Err(error)) => return Guarded::Done(Err(error)),
                    Guarded::Cancelled => return Guarded::Cancelled,
                    Guarded::Refused(refusal) => return Guarded::Refused(refusal),
                };
                match self
                    .with_retry("record_operation", cancel, || {
                        self.store.record_operation(lease, Some(&started.0))
                    })
                    .await
                {
                    Some(Ok(())) => started,
                    Some(Err(refusal)) => return Guarded::Refused(refusal),
                    None => return Guarded::Cancelled,
                }
            }
        };
        let waited = self
            .guarded_call(lease, cancel, background.wait_streamed(&operation, live))
            .await;
        if let Guarded::Done(Err(ProviderError::OperationGone { .. })) = &waited {
            // The provider no longer knows the operation (expired, cancelled): forget it so
            // the next attempt starts a new one. Best effort: if this write is refused, the
            // attempt is over anyway.
            let _ = self.store.record_operation(lease, None).await;
        }
        waited
    }

    /// Creates the background operation. A create whose answer was lost (`Ambiguous`) or that
    /// surely did not arrive (`NotSent`) is sent again at once, with the same idempotency key,
    /// up to [`CREATE_RESENDS`] times within this attempt: the key finds the operation the lost
    /// answer created, so resending cannot start a second generation, and the attempt does not
    /// end without the operation's id while the provider may be doing its work.
    async fn start_operation(
        &self,
        background: &dyn BackgroundProvider,
        request: &GenerationRequest,
        lease: &Lease,
        cancel: &CancellationToken,
    ) -> Guarded<Result<OperationId, ProviderError>> {
        let mut resends = 0;
        loop {
            let started = self.guarded(lease, cancel, background.start(request)).await;
            match &started {
                Guarded::Done(Err(
                    ProviderError::Ambiguous { .. } | ProviderError::NotSent { .. },
                )) if resends < CREATE_RESENDS => {
                    resends += 1;
                    tokio::time::sleep(Duration::from_millis(100 * u64::from(resends))).await;
                }
                _ => return started,
            }
        }
    }

    /// Counts how a streamed call ended and, when it ended without a reply (`end`), records
    /// that on its attempt with what it had received: its characters, and the usage the
    /// provider last reported (none stays "not reported"). Best effort: the record is for
    /// people, and a lost one changes no outcome.
    async fn stream_ended(&self, lease: &Lease, end: Option<StreamEnd>, received: Received) {
        if !self.settings.stream {
            return;
        }
        let Some(end) = end else {
            telemetry::provider_stream_ended("completed");
            return;
        };
        telemetry::provider_stream_ended(end.as_str());
        if let Err(e) = self
            .store
            .record_stream_end(
                TaskId::from(lease.task_id),
                lease.version,
                end,
                received.chars,
                received.usage,
            )
            .await
        {
            telemetry::store_error("record_stream_end", &e);
        }
    }

    /// Tells the capacity budget what the provider said of its request limit with an answer.
    async fn observe(&self, model: &str, signals: &RateSignals) {
        self.capacity.observed(model, signals.requests.limit).await;
    }

    /// A claimed task whose wait for capacity was cancelled (revoked, stopping) gives its lease
    /// back, and its attempt with it: no call was made.
    async fn gave_up_waiting(&self, lease: &Lease) -> AttemptEnd {
        let released = self
            .store
            .release_as(
                lease,
                &Release {
                    outcome: AttemptOutcome::Refused,
                    detail: "cancelled while waiting for the provider's capacity; no call made",
                    retry_after: Duration::ZERO,
                    error_class: None,
                    ran: ProviderRan::No,
                    give_back: true,
                    refusal_budget: None,
                },
            )
            .await;
        if let Ok(ReleaseOutcome::Released) = released {
            self.lease_ended(lease);
        }
        AttemptEnd::Cancelled
    }

    /// Runs one provider future against cancellation and the lease renewer.
    async fn guarded<T>(
        &self,
        lease: &Lease,
        cancel: &CancellationToken,
        call: impl Future<Output = T>,
    ) -> Guarded<T> {
        self.guarded_as(lease, cancel, call, false).await
    }

    /// [`TaskRunner::guarded`] of a provider call: an answer already in hand when the lease's
    /// news comes is handed on (`ended_call_first`).
    async fn guarded_call<T>(
        &self,
        lease: &Lease,
        cancel: &CancellationToken,
        call: impl Future<Output = T>,
    ) -> Guarded<T> {
        self.guarded_as(lease, cancel, call, true).await
    }

    async fn guarded_as<T>(
        &self,
        lease: &Lease,
        cancel: &CancellationToken,
        call: impl Future<Output = T>,
        ended_call_first: bool,
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
                    // assignment's. An error leaves it to the next regular renewal.
                    match self.store.renew(lease, self.settings.lease).await {
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
            if ended_call_first
                && let Some(result) = futures_util::FutureExt::now_or_never(&mut call)
            {
                return Guarded::Done(result);
            }
            return Guarded::Refused(refusal);
        }
    }

    /// Ends an attempt whose call was cut short by cancellation or a lost lease.
    async fn interrupted<T>(
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
    async fn provider_failed(
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
                    .with_retry("fail", cancel, || {
                        self.store.fail(lease, &reason, outcome, ran)
                    })
                    .instrument(failing.clone())
                    .await
                else {
                    return AttemptEnd::Cancelled;
                };
                failing.record("replyd.outcome", failed.label());
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
                    .with_retry("release", cancel, || self.store.release_as(lease, &release))
                    .instrument(releasing.clone())
                    .await;
                if let Some(released) = &released {
                    releasing.record("replyd.outcome", released.label());
                }
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

    fn refused(&self, id: &str, lease: &Lease, refusal: Refusal, what: &'static str) -> AttemptEnd {
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
    fn lease_ended(&self, lease: &Lease) {
        self.parked
            .wake(TaskId::from(lease.task_id), WakeSource::Local);
    }

    /// Parks a record for `wait`, or until its task is woken, or cancellation; false when
    /// cancelled.
    async fn park(
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
