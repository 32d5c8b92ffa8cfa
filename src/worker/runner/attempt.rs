//! One attempt of the lease state machine: the claimed task waits for the provider's
//! capacity, then calls it (whole, streamed, or as a background operation), its lease renewed
//! meanwhile, and what the call returned is saved or classified.

use std::time::{Duration, Instant};

use tokio_util::sync::CancellationToken;
use tracing::{Instrument as _, Span};

use super::super::live::{LiveText, Received};
use super::kinds::{AttemptEnd, CREATE_RESENDS, Guarded, Guarding, Place, TaskRunner};
use crate::capacity;
use crate::provider::BackgroundProvider;
use crate::store::{CompletionOutcome, Release, ReleaseOutcome};
use crate::telemetry::{self, CallEnd, trace};
use replyd_core::domain::{AttemptOutcome, ProviderRan, RecordEnd, StoredTask, StreamEnd, TaskId};
use replyd_core::lease::{Lease, Refusal};
use replyd_core::provider::{
    Generation, GenerationRequest, OperationId, ProviderError, RateSignals,
};

impl TaskRunner {
    /// One claimed attempt: the provider call raced against cancellation and the lease
    /// renewer, then the fenced write of its result.
    ///
    /// The steps few records take (a wait given up, a background operation, a call cut short
    /// or failed) are boxed where they are awaited: a record's future is as large as its
    /// largest step, and every record in flight holds one.
    pub(super) async fn attempt(
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
                Guarding::Step,
            )
            .await
        {
            Guarded::Done(Some(permit)) => permit,
            Guarded::Done(None) | Guarded::Cancelled => {
                return Box::pin(self.gave_up_waiting(lease)).await;
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
                Box::pin(self.call_background(background, stored, &request, lease, cancel, &live))
                    .instrument(call_span.clone())
                    .await
            }
            None => {
                self.guarded(
                    lease,
                    cancel,
                    self.provider.generate_streamed(&request, &live),
                    Guarding::Call,
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
                return Box::pin(self.interrupted(&id, lease, other, started)).await;
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
                let saving = trace::completion(trace, "save reply");
                let Some(outcome) = self
                    .lease_end("complete", saving, cancel, || {
                        self.store
                            .complete(lease, &generation.text, Some(&generation))
                    })
                    .await
                else {
                    return AttemptEnd::Cancelled;
                };
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
                Box::pin(self.provider_failed(stored, lease, error, cancel, trace)).await
            }
        }
    }

    /// A provider with background operations: look up the operation an earlier attempt
    /// started (any worker, any restart) instead of generating again; otherwise start one and
    /// store its id in the task row *before* waiting, so an ambiguous end of this attempt can
    /// be recovered by the next.
    pub(super) async fn call_background(
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
            .guarded(
                lease,
                cancel,
                background.wait_streamed(&operation, live),
                Guarding::Call,
            )
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
    pub(super) async fn start_operation(
        &self,
        background: &dyn BackgroundProvider,
        request: &GenerationRequest,
        lease: &Lease,
        cancel: &CancellationToken,
    ) -> Guarded<Result<OperationId, ProviderError>> {
        let mut resends = 0;
        loop {
            let started = self
                .guarded(lease, cancel, background.start(request), Guarding::Step)
                .await;
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
    pub(super) async fn stream_ended(
        &self,
        lease: &Lease,
        end: Option<StreamEnd>,
        received: Received,
    ) {
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
    pub(super) async fn observe(&self, model: &str, signals: &RateSignals) {
        self.capacity.observed(model, signals.requests.limit).await;
    }

    /// A claimed task whose wait for capacity was cancelled (revoked, stopping) gives its lease
    /// back, and its attempt with it: no call was made.
    pub(super) async fn gave_up_waiting(&self, lease: &Lease) -> AttemptEnd {
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
}
