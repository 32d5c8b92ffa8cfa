//! What happens to one record: decode (bad → dead-letter copy) → ensure the task → the lease
//! state machine of [`super::runner`] until the task is terminal.
//!
//! Keeps I3 from the record's side: the handler says `Done` only when the task is terminal or
//! the record is kept as a dead letter; a cancelled record (revoke, shutdown) says `Cancelled`
//! and is delivered again, and a record whose task another worker holds is handed back to a
//! source that can take it (SQS) instead of waiting here. It sees a record only through [`Delivery`], whatever its source.

use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::telemetry::{self, trace};
use crate::transport::source::{DeadLetter, Delivery, RecordHandler, RecordOutcome, WindowSlot};
use replyd_core::domain::{RecordEnd, RecordRules, RecordSource, TaskSpec};

use super::runner::{FromRecord, RunEnd, TaskRunner, WhenHeld};
use super::store_retry::pause;

/// Settings of the per-record pipeline.
#[derive(Debug, Clone)]
pub struct PipelineSettings {
    pub rules: RecordRules,
    /// Wait before retrying a failed database or dead-letter write.
    pub io_retry: Duration,
}

/// The record handler the worker runs; `L` keeps its source's dead letters.
pub struct Pipeline<L> {
    dead_letters: L,
    runner: TaskRunner,
    settings: PipelineSettings,
}

impl<D: Delivery, L: DeadLetter<D>> RecordHandler<D> for Pipeline<L> {
    async fn handle(
        self: Arc<Self>,
        record: D,
        cancel: CancellationToken,
        slot: WindowSlot,
    ) -> RecordOutcome {
        self.process(record, cancel, slot).await
    }
}

impl<L> Pipeline<L> {
    pub fn new(dead_letters: L, runner: TaskRunner, settings: PipelineSettings) -> Self {
        Self {
            dead_letters,
            runner,
            settings,
        }
    }

    async fn process<D: Delivery>(
        &self,
        record: D,
        cancel: CancellationToken,
        slot: WindowSlot,
    ) -> RecordOutcome
    where
        L: DeadLetter<D>,
    {
        let (key, offset) = record.position();
        // The record's own span of the task's trace (a new trace when it came without a
        // `traceparent`); the log's span stays the source's `record`.
        let span = trace::process(
            D::SYSTEM,
            &key.topic,
            key.partition,
            offset,
            record.trace_carrier().as_deref(),
        );
        let outcome = self.process_traced(record, cancel, slot, &span).await;
        span.record("replyd.outcome", outcome.label());
        outcome
    }

    async fn process_traced<D: Delivery>(
        &self,
        record: D,
        cancel: CancellationToken,
        slot: WindowSlot,
        span: &tracing::Span,
    ) -> RecordOutcome
    where
        L: DeadLetter<D>,
    {
        let (key, offset) = record.position();
        let spec = match record.payload().and_then(|payload| {
            TaskSpec::from_record(payload, record.written_at(), &self.settings.rules)
        }) {
            Ok(spec) => spec,
            Err(error) => {
                // A bad record is done once it is kept as a dead letter.
                loop {
                    match self.dead_letters.keep(&record, &error).await {
                        Ok(()) => {
                            telemetry::record_dead_lettered(
                                &key,
                                offset,
                                error.kind(),
                                &error.to_string(),
                            );
                            return RecordOutcome::Done(RecordEnd::DeadLettered);
                        }
                        Err(e) => telemetry::dead_letter_failed(&key, offset, e.as_ref()),
                    }
                    if !pause(&cancel, self.settings.io_retry).await {
                        return RecordOutcome::Cancelled;
                    }
                }
            }
        };
        let record_can_hand_back = D::CAN_HAND_BACK;
        let record_held_alone = D::PARTITION_HELD_ALONE;
        let task_id = spec.task_id;
        let id = task_id.to_string();
        tracing::Span::current().record("task_id", id.as_str());
        span.record("replyd.task_id", id.as_str());
        let record = FromRecord {
            spec: &spec,
            source: RecordSource {
                partition: key.partition,
                offset,
                held_alone: record_held_alone,
            },
            slot: &slot,
        };
        let held = if record_can_hand_back {
            WhenHeld::HandBack
        } else {
            WhenHeld::Park
        };
        match self
            .runner
            .run(task_id, Some(record), held, &cancel, span)
            .await
        {
            Some(RunEnd::Terminal(how)) => RecordOutcome::Done(how),
            Some(RunEnd::HandBack { after }) => RecordOutcome::HandedBack { after },
            None => RecordOutcome::Cancelled,
        }
    }
}
