//! The Kafka source (see [`crate::transport::source`]): the consumer-group loop. It polls on a dedicated thread, runs many records of one partition at
//! once on the tokio runtime, pauses partitions when their window is full, and commits each
//! partition's done prefix — periodically, and confirmed (within a bound) when partitions are
//! revoked and at shutdown.
//!
//! Keeps I3: an offset is committed only past records whose handler said `Done` (their outcome
//! is durable); the commit point comes from [`InFlightOffsets`](replyd_core::offsets::InFlightOffsets). Which records run, wait or
//! pause their partition is decided by [`Windows`](replyd_core::windows::Windows) (pure, in the core); this room does what
//! it says with librdkafka and the runtime. Revocation and shutdown share
//! one drain path ([`Shared::release`]): stop taking records of those partitions, let in-flight
//! work finish up to the drain timeout, cancel the rest, commit, let go. Work that leaks past a
//! revocation is harmless because completions are fenced (I2).
//!
//! Why a dedicated thread: librdkafka runs rebalance callbacks inside `poll`, and our revoke
//! callback blocks while it drains. On a tokio worker thread that would stall the very tasks it
//! waits for.
//!
//! The rooms: `shared` (the state and its drain path), `commits` (what is committed and
//! when), `context` (librdkafka's callbacks), and this file (the client's settings and the
//! poll loop).

mod commits;
mod context;
mod shared;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::error::KafkaError;
use rdkafka::message::OwnedMessage;
use rdkafka::{ClientConfig, Message};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

use crate::capacity::Weights;
use crate::telemetry;
use crate::transport::kafka::dead_letter::DeadLetters;
use crate::transport::kafka::settings::{GroupProtocol, KafkaSettings};
use crate::transport::source::{DeadLetter, Delivery, Holding, RecordHandler};
use context::WorkerContext;
use replyd_core::offsets::PartitionKey;
pub use shared::ConsumerStatus;
use shared::Shared;

/// Builds the group consumer: auto-commit and auto offset store off (I3), the configured
/// protocol, librdkafka's local queue sized to the worker's read-ahead, then the pass-through
/// properties.
pub fn consumer_config(kafka: &KafkaSettings, read_ahead: usize) -> ClientConfig {
    let mut config = kafka.client_config();
    // Defaults a platform team would expect; the pass-through map may override them.
    // Statistics feed the consumer-lag gauge.
    config
        .set("auto.offset.reset", "earliest")
        .set("statistics.interval.ms", "5000")
        .set("queued.min.messages", fetched_ahead(read_ahead).to_string());
    if kafka.group_protocol == GroupProtocol::Classic {
        config
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("session.timeout.ms", kafka.session_timeout_ms().to_string());
    }
    for (key, value) in &kafka.librdkafka {
        config.set(key, value);
    }
    // Set last: these carry the invariants and were refused in the pass-through map.
    config
        .set("bootstrap.servers", &kafka.bootstrap_servers)
        .set("group.id", &kafka.group_id)
        .set("group.protocol", kafka.group_protocol.as_str())
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false");
    if !kafka.group_instance_id.is_empty() {
        config.set("group.instance.id", &kafka.group_instance_id);
    }
    config
}

/// How many records of each partition librdkafka keeps fetched ahead of the worker
/// (`queued.min.messages`). Its default, 100,000 a partition, only stops at
/// `queued.max.messages.kbytes` (64 MiB of payload): at window 1,024 its fetched records were
/// 23 MiB of the worker's heap at its peak, against 12 with this bound. A few read-aheads are
/// enough for the windows never to wait for a fetch; below 8,192 a zero-latency drain at
/// window 256 slowed (to 0.75 of its rate at 512).
fn fetched_ahead(read_ahead: usize) -> usize {
    read_ahead.saturating_mul(4).max(8_192)
}

/// Whether a partition the group never committed is read from its first record: librdkafka's
/// `auto.offset.reset` as set (ours `earliest`, or the pass-through map's). The fetch watch
/// then knows where such a partition's reading starts; under `latest` it cannot tell.
fn reads_uncommitted_from_start(config: &ClientConfig) -> bool {
    matches!(
        config.get("auto.offset.reset"),
        Some("earliest" | "smallest" | "beginning")
    )
}

/// How often every partition's commit point is sent again even if it did not move: the result
/// of an async commit is not reported back (see `commit_callback`), so a failed one is mended
/// by sending every point again.
const FULL_COMMIT_INTERVAL: Duration = Duration::from_secs(5);

/// Runs the consumer until `shutdown` fires, then drains, commits and leaves the group.
/// Blocking: call it on a thread of its own (see the module comment).
pub fn run_consumer<H: RecordHandler<OwnedMessage>>(
    kafka: &KafkaSettings,
    holding: &Holding,
    handler: Arc<H>,
    runtime: Handle,
    shutdown: CancellationToken,
    status: Arc<ConsumerStatus>,
    weights: Weights,
) -> Result<(), KafkaError> {
    let shared = Shared::new(holding, status, handler, runtime.clone(), weights);
    let config = consumer_config(kafka, holding.read_ahead);
    let uncommitted_from_start = reads_uncommitted_from_start(&config);
    let consumer: BaseConsumer<WorkerContext> = config.create_with_context(WorkerContext::new(
        Arc::clone(&shared),
        kafka.topic.clone(),
        uncommitted_from_start,
    ))?;
    consumer.subscribe(&[&kafka.topic])?;
    shared.status.polling.store(true, Ordering::Relaxed);
    tracing::info!(topic = %kafka.topic, group = %kafka.group_id, protocol = kafka.group_protocol.as_str(), "consumer started");

    let poll_timeout = Duration::from_millis(100);
    let commit_interval = holding.commit_interval;
    let mut next_commit = Instant::now() + commit_interval;
    let mut next_full_commit = Instant::now() + FULL_COMMIT_INTERVAL;
    while !shutdown.is_cancelled() {
        shared.status.heartbeat.beat();
        match consumer.poll(poll_timeout) {
            Some(Ok(message)) => shared.dispatch(message.detach()),
            Some(Err(e)) => telemetry::consumer_error(&e),
            None => {}
        }
        shared.apply_back_pressure(&consumer);
        shared.restart_fetches(&consumer);
        if Instant::now() >= next_commit {
            // Now and then every point is sent again, moved or not: a commit whose failure
            // went unreported must not leave an idle partition behind for good.
            if Instant::now() >= next_full_commit {
                shared.forget_all_commits();
                next_full_commit = Instant::now() + FULL_COMMIT_INTERVAL;
            }
            shared.commit_progress(&consumer, CommitMode::Async);
            shared.report_in_flight_ages();
            next_commit = Instant::now() + commit_interval;
        }
    }

    // Shutdown: the same drain path as a revocation, for every partition, while still polling
    // so the group session and callbacks stay served.
    tracing::info!(
        running = shared.running(),
        "shutting down: draining running records"
    );
    shared.stop_taking();
    let deadline = Instant::now() + holding.drain_timeout;
    while shared.running() > 0 && Instant::now() < deadline {
        shared.status.heartbeat.beat();
        // A record returned now is dropped unbegun, so it is never committed past: the
        // next owner of its partition reads it.
        let _ = consumer.poll(poll_timeout);
        shared.commit_progress(&consumer, CommitMode::Async);
    }
    let assigned = shared.assigned();
    shared.release(&consumer, &assigned, true);
    // Cancelled records return promptly; wait for them so no task outlives the consumer.
    shared.tasks.close();
    runtime.block_on(shared.tasks.wait());
    // Unsubscribing revokes what is left (our callback finds nothing in flight) and closing
    // leaves the group, so the partitions move on at once.
    consumer.unsubscribe();
    // Close within a bound: librdkafka's close can wait without end on a group in the middle
    // of a rebalance (seen after a SIGTERM right after a join), and a worker that never exits
    // cannot be replaced. Dropping an unclosed consumer would wait again, unbounded, so such a
    // consumer is leaked instead; the process is about to exit.
    if consumer.close_queue().is_ok() {
        let deadline = Instant::now() + holding.drain_timeout;
        while !consumer.closed() && Instant::now() < deadline {
            shared.status.heartbeat.beat();
            let _ = consumer.poll(poll_timeout);
        }
    }
    if consumer.closed() {
        // Closed: the group is left and the last commits are made. Dropping it would close
        // its queue a second time, which rdkafka reports as an error (`BrokerDestroy`) on
        // every clean shutdown; the process exits next, so let it go as it is.
        std::mem::forget(consumer);
    } else {
        tracing::warn!("the consumer did not close within the drain timeout; exiting without it");
        std::mem::forget(consumer);
    }
    shared.status.polling.store(false, Ordering::Relaxed);
    tracing::info!("consumer stopped");
    Ok(())
}

/// A Kafka record, as the pipeline sees it.
impl Delivery for OwnedMessage {
    const SYSTEM: &'static str = "kafka";
    const CAN_HAND_BACK: bool = false;
    /// The group gives a partition to one member at a time, and this consumer drains or
    /// cancels a revoked partition's work before it lets the partition go (`Revoked`).
    const PARTITION_HELD_ALONE: bool = true;

    fn payload(&self) -> Result<Option<&[u8]>, replyd_core::domain::RecordError> {
        Ok(Message::payload(self))
    }

    fn written_at(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        self.timestamp()
            .to_millis()
            .and_then(chrono::DateTime::from_timestamp_millis)
    }

    fn position(&self) -> (PartitionKey, i64) {
        (
            PartitionKey::new(self.topic(), self.partition()),
            self.offset(),
        )
    }

    fn trace_carrier(&self) -> Option<Box<dyn opentelemetry::propagation::Extractor + '_>> {
        let headers = Message::headers(self)?;
        Some(Box::new(telemetry::trace::KafkaHeaders(headers)))
    }
}

/// A bad Kafka record is kept as a copy in the dead-letter topic, with where it came from and
/// why it was refused in its headers.
impl DeadLetter<OwnedMessage> for DeadLetters {
    async fn keep(
        &self,
        record: &OwnedMessage,
        error: &replyd_core::domain::RecordError,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        self.send(record, error).await.map_err(Into::into)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn librdkafka_keeps_a_few_read_aheads_fetched_and_the_pass_through_map_may_say_otherwise() {
        let kafka = KafkaSettings::default();
        assert_eq!(
            consumer_config(&kafka, 512).get("queued.min.messages"),
            Some("8192")
        );
        assert_eq!(
            consumer_config(&kafka, 4_096).get("queued.min.messages"),
            Some("16384")
        );
        let kafka = KafkaSettings {
            librdkafka: [("queued.min.messages".into(), "100000".into())].into(),
            ..KafkaSettings::default()
        };
        assert_eq!(
            consumer_config(&kafka, 512).get("queued.min.messages"),
            Some("100000")
        );
    }
}
