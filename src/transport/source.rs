//! The seam between where records come from and what is done with them. A source (the Kafka
//! group consumer, [`super::kafka::consumer`], or an SQS queue, [`super::sqs::source`]) owns a
//! record's acknowledgement: it holds the record "in flight" while its handler runs and
//! acknowledges it (for Kafka, commits past it; for SQS, deletes it) only once the handler says
//! [`RecordOutcome::Done`]. The handler (the worker's pipeline) sees a record only as a
//! [`Delivery`], and keeps a bad one through the source's [`DeadLetter`], so each source is a
//! room of its own, and the pipeline and the runner do not change for it.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use chrono::{DateTime, Utc};
use futures_util::future::BoxFuture;
use opentelemetry::propagation::Extractor;
use tokio_util::sync::CancellationToken;

use crate::capacity::Weights;
use crate::probes::Heartbeat;
use replyd_core::domain::{RecordEnd, RecordError};
use replyd_core::offsets::PartitionKey;

/// One record as its source delivers it.
pub trait Delivery: Send + Sync + 'static {
    /// The record's bytes (`None` for a tombstone), or why its envelope holds none a record
    /// can be read from (an SQS body that is not base64).
    fn payload(&self) -> Result<Option<&[u8]>, RecordError>;
    /// The messaging system, as trace spans name it (`kafka`, `aws_sqs`).
    const SYSTEM: &'static str;
    /// Whether the source can take the record back unacknowledged, to deliver it again later
    /// ([`RecordOutcome::HandedBack`]). A Kafka record cannot leave its partition's order.
    const CAN_HAND_BACK: bool;
    /// Whether the source gives the record's partition to one consumer at a time, and takes it
    /// from a consumer only once that consumer's work for it was drained or cancelled (a Kafka
    /// partition in a consumer group). A live lease taken for a record of such a partition by
    /// another holder is then a lost holder's, and the claim takes it over at once
    /// (`lease::Claimer::may_take_over`). An SQS queue is read by every worker at once: false.
    const PARTITION_HELD_ALONE: bool;
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

/// A running record's slot in its source's window. A record that only waits (for the
/// provider's capacity) gives it back, so that records of other workspaces start while it waits
/// (I10); it ends as any record then, but frees no slot twice. A source without windows (SQS,
/// whose receive asks for what is free) gives [`WindowSlot::none`].
#[derive(Clone, Default)]
pub struct WindowSlot {
    give_back: Option<Arc<dyn Fn() + Send + Sync>>,
}

impl WindowSlot {
    /// No window to give a slot back to.
    pub fn none() -> Self {
        Self::default()
    }

    /// A slot given back by `give_back`, which the source makes idempotent.
    pub fn new(give_back: impl Fn() + Send + Sync + 'static) -> Self {
        Self {
            give_back: Some(Arc::new(give_back)),
        }
    }

    /// The record only waits from now on: its slot goes to the next record.
    pub fn give_back(&self) {
        if let Some(give_back) = &self.give_back {
            give_back();
        }
    }
}

impl std::fmt::Debug for WindowSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WindowSlot")
            .field("windowed", &self.give_back.is_some())
            .finish()
    }
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
    /// Another worker holds the record's task: the source keeps it unacknowledged and
    /// delivers it again after this (only from a delivery that [`Delivery::CAN_HAND_BACK`]).
    HandedBack { after: std::time::Duration },
}

impl RecordOutcome {
    /// Stable label for traces: how the record ended, or `cancelled`.
    pub fn label(&self) -> &'static str {
        match self {
            RecordOutcome::Done(how) => how.as_str(),
            RecordOutcome::Cancelled => "cancelled",
            RecordOutcome::HandedBack { .. } => "handed_back",
        }
    }
}

/// Processes one record. Called concurrently for many records, also of one partition.
pub trait RecordHandler<D: Delivery>: Send + Sync + 'static {
    /// `slot` is the record's place in its source's window, given back while it only waits.
    fn handle(
        self: Arc<Self>,
        record: D,
        cancel: CancellationToken,
        slot: WindowSlot,
    ) -> impl Future<Output = RecordOutcome> + Send + 'static;
}

/// How a worker holds records, from `[worker]`, handed to whichever source it opens.
#[derive(Debug, Clone)]
pub struct Holding {
    /// Records held at once by this worker (`worker.global_window`; on SQS, `sqs.max_in_flight`
    /// when set).
    pub global_window: usize,
    /// Records of one partition running at once (`worker.partition_window`), where the source
    /// has partitions.
    pub partition_window: usize,
    /// Records read past a partition's oldest unfinished one (`worker.read_ahead`).
    pub read_ahead: usize,
    /// How long held records may run on once the worker is asked to stop, or their partition
    /// is taken away.
    pub drain_timeout: Duration,
    /// How often the acknowledgements made so far are sent (Kafka's offset commits).
    pub commit_interval: Duration,
    /// The wait after a failed call to the source.
    pub io_retry: Duration,
}

/// How the worker makes its record handler once the source's dead-letter keeper is known:
/// the pipeline is one for every source, and only the keeper differs.
pub trait MakeHandler: Send + 'static {
    type Handler<D: Delivery, L: DeadLetter<D>>: RecordHandler<D>;

    fn make<D: Delivery, L: DeadLetter<D>>(self, dead_letters: L) -> Arc<Self::Handler<D, L>>;
}

/// What a worker hands the source it opens.
pub struct Opening<M> {
    pub holding: Holding,
    /// Each workspace's weight, by which a windowed source orders the records it starts (I10).
    pub weights: Weights,
    pub make_handler: M,
    pub shutdown: CancellationToken,
}

/// A source's own part of the worker's readiness; the worker adds the database's and the
/// turning of the source's loop.
pub trait SourceHealth: Send + Sync + 'static {
    /// What the source holds, or why it is not ready.
    fn check(&self) -> Result<String, String>;
}

/// A source checked and ready to run: its health for the readiness probe, its loop's
/// heartbeat, and its run, which ends once `shutdown` fired and its records were drained and
/// settled.
pub struct OpenSource {
    pub health: Arc<dyn SourceHealth>,
    /// Beaten on every turn of the source's loop.
    pub heartbeat: Arc<Heartbeat>,
    /// The loop's name in a readiness answer (`poll`, `receive`).
    pub loop_name: &'static str,
    pub run: BoxFuture<'static, anyhow::Result<()>>,
}
