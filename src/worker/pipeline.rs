//! What happens to one record: decode (bad → dead-letter copy) → ensure the task → the lease
//! state machine of [`super::runner`] until the task is terminal.
//!
//! Keeps I3 from the record's side: the handler says `Done` only when the task is terminal or
//! the record's copy is in the dead-letter topic; a cancelled record (revoke, shutdown) says
//! `Cancelled` and is read again by the partition's next owner.

use std::sync::Arc;
use std::time::Duration;

use rdkafka::Message;
use rdkafka::message::OwnedMessage;
use tokio_util::sync::CancellationToken;

use super::consumer::{RecordHandler, RecordOutcome};
use crate::kafka::dead_letter::DeadLetters;
use crate::telemetry::{self, trace};
use replyd_core::domain::{RecordEnd, RecordRules, TaskSpec};
use replyd_core::offsets::PartitionKey;

use super::runner::{FromRecord, TaskRunner};
use super::store_retry::pause;

/// Settings of the per-record pipeline.
#[derive(Debug, Clone)]
pub struct PipelineSettings {
    pub rules: RecordRules,
    /// Wait before retrying a failed database or dead-letter write.
    pub io_retry: Duration,
}

/// The record handler the worker runs.
pub struct Pipeline {
    dead_letters: DeadLetters,
    runner: TaskRunner,
    settings: PipelineSettings,
}

impl RecordHandler for Pipeline {
    async fn handle(
        self: Arc<Self>,
        record: OwnedMessage,
        cancel: CancellationToken,
    ) -> RecordOutcome {
        self.process(record, cancel).await
    }
}

impl Pipeline {
    pub fn new(dead_letters: DeadLetters, runner: TaskRunner, settings: PipelineSettings) -> Self {
        Self {
            dead_letters,
            runner,
            settings,
        }
    }

    async fn process(&self, record: OwnedMessage, cancel: CancellationToken) -> RecordOutcome {
        let offset = record.offset();
        // The record's own span of the task's trace (a new trace when it came without a
        // `traceparent`); the log's span stays the consumer's `record`.
        let span = trace::process(record.topic(), record.partition(), offset, record.headers());
        let outcome = self.process_traced(record, cancel, &span).await;
        span.record("replyd.outcome", outcome.label());
        outcome
    }

    async fn process_traced(
        &self,
        record: OwnedMessage,
        cancel: CancellationToken,
        span: &tracing::Span,
    ) -> RecordOutcome {
        let key = PartitionKey::new(record.topic(), record.partition());
        let offset = record.offset();
        let written_at = record
            .timestamp()
            .to_millis()
            .and_then(chrono::DateTime::from_timestamp_millis);
        let spec = match TaskSpec::from_record(record.payload(), written_at, &self.settings.rules) {
            Ok(spec) => spec,
            Err(error) => {
                // A bad record is done once its copy is durable in the dead-letter topic.
                loop {
                    match self.dead_letters.send(&record, &error).await {
                        Ok(()) => {
                            telemetry::record_dead_lettered(
                                &key,
                                offset,
                                error.kind(),
                                &error.to_string(),
                            );
                            return RecordOutcome::Done(RecordEnd::DeadLettered);
                        }
                        Err(e) => telemetry::dead_letter_failed(&key, offset, &e),
                    }
                    if !pause(&cancel, self.settings.io_retry).await {
                        return RecordOutcome::Cancelled;
                    }
                }
            }
        };
        let task_id = spec.task_id;
        let id = task_id.to_string();
        tracing::Span::current().record("task_id", id.as_str());
        span.record("replyd.task_id", id.as_str());
        let record = FromRecord {
            spec: &spec,
            offset,
        };
        match self.runner.run(task_id, Some(record), &cancel, span).await {
            Some(how) => RecordOutcome::Done(how),
            None => RecordOutcome::Cancelled,
        }
    }
}
