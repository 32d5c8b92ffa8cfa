//! The seam between where records come from and what is done with them. A source (the Kafka
//! group consumer, [`super::consumer`], today) owns a record's acknowledgement: it holds the
//! record "in flight" while its handler runs and acknowledges it (for Kafka, commits past it)
//! only once the handler says [`RecordOutcome::Done`]. The handler ([`super::pipeline`]) sees a
//! record only as a [`Delivery`], and keeps a bad one through the source's [`DeadLetter`], so
//! a second source is a room of its own beside the consumer, and the pipeline and the runner
//! do not change for it.

use std::future::Future;
use std::sync::Arc;

use chrono::{DateTime, Utc};
use opentelemetry::propagation::Extractor;
use tokio_util::sync::CancellationToken;

use replyd_core::domain::{RecordEnd, RecordError};
use replyd_core::offsets::PartitionKey;

/// One record as its source delivers it.
pub trait Delivery: Send + Sync + 'static {
    /// The record's bytes; `None` for a tombstone or an empty message.
    fn payload(&self) -> Option<&[u8]>;
    /// When its producer wrote it, when the source says.
    fn written_at(&self) -> Option<DateTime<Utc>>;
    /// Where it sits in its source: the partition (a topic's, or a queue's only one) and its
    /// position there, for logs, metrics and spans.
    fn position(&self) -> (PartitionKey, i64);
    /// The carrier of the trace context its producer sent (`traceparent`), if any.
    fn trace_carrier(&self) -> Option<Box<dyn Extractor + '_>>;
}

/// Where a source keeps the records the pipeline refuses (undecodable, missing fields, a
/// deadline in seconds), durably, before they may count as done.
pub trait DeadLetter<D: Delivery>: Send + Sync + 'static {
    /// Keeps `record` with why it was refused; an `Err` is retried until it is kept.
    fn keep(
        &self,
        record: &D,
        error: &RecordError,
    ) -> impl Future<Output = Result<(), Box<dyn std::error::Error + Send + Sync>>> + Send;
}

/// What a handler says about one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordOutcome {
    /// The record's outcome is durable (task terminal, or its copy kept as a dead letter): the
    /// source may acknowledge it. Says how, for metrics.
    Done(RecordEnd),
    /// The work was cancelled (revoke, shutdown) before a durable outcome: the source must not
    /// acknowledge it, so it is delivered again.
    Cancelled,
}

impl RecordOutcome {
    /// Stable label for traces: how the record ended, or `cancelled`.
    pub fn label(&self) -> &'static str {
        match self {
            RecordOutcome::Done(how) => how.as_str(),
            RecordOutcome::Cancelled => "cancelled",
        }
    }
}

/// Processes one record. Called concurrently for many records, also of one partition.
pub trait RecordHandler<D: Delivery>: Send + Sync + 'static {
    fn handle(
        self: Arc<Self>,
        record: D,
        cancel: CancellationToken,
    ) -> impl Future<Output = RecordOutcome> + Send + 'static;
}
