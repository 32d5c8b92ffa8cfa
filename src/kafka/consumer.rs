//! The consumer-group loop: polls on a dedicated thread, runs many records of one partition at
//! once on the tokio runtime, pauses partitions when their window is full, and commits each
//! partition's done prefix — periodically, and synchronously when partitions are revoked and at
//! shutdown.
//!
//! Keeps I3: an offset is committed only past records whose handler said `Done` (their outcome
//! is durable); the commit point comes from [`InFlightOffsets`]. Revocation and shutdown share
//! one drain path ([`Shared::release`]): stop taking records of those partitions, let in-flight
//! work finish up to the drain timeout, cancel the rest, commit, let go. Work that leaks past a
//! revocation is harmless because completions are fenced (I2).
//!
//! Why a dedicated thread: librdkafka runs rebalance callbacks inside `poll`, and our revoke
//! callback blocks while it drains. On a tokio worker thread that would stall the very tasks it
//! waits for.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::OwnedMessage;
use rdkafka::{ClientConfig, ClientContext, Message, Offset, TopicPartitionList};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use crate::config::{GroupProtocol, KafkaSettings, WorkerSettings};
use crate::kafka::tracker::{InFlightOffsets, PartitionKey};
use crate::telemetry;

/// What a handler says about one record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordOutcome {
    /// The record's outcome is durable (task terminal, or copy in the dead-letter topic); its
    /// offset may be committed. The label says how, for metrics.
    Done(&'static str),
    /// The work was cancelled (revoke, shutdown) before a durable outcome: the offset must not
    /// be committed past, so the next owner of the partition reads the record again.
    Cancelled,
}

/// Processes one record. Called concurrently for many records, also of one partition.
pub trait RecordHandler: Send + Sync + 'static {
    fn handle(
        self: Arc<Self>,
        record: OwnedMessage,
        cancel: CancellationToken,
    ) -> impl Future<Output = RecordOutcome> + Send + 'static;
}

/// Live facts about the consumer, for `/readyz` and tests.
#[derive(Debug, Default)]
pub struct ConsumerStatus {
    pub polling: AtomicBool,
    pub assigned_partitions: AtomicUsize,
    pub rebalances: AtomicUsize,
}

/// One assignment of one partition.
struct PartitionRun {
    /// Distinguishes this assignment from an earlier one of the same partition, so a record
    /// that finishes late cannot mark an offset of the new assignment done.
    epoch: u64,
    cancel: CancellationToken,
    paused: bool,
}

#[derive(Default)]
struct State {
    offsets: InFlightOffsets,
    runs: HashMap<PartitionKey, PartitionRun>,
    next_epoch: u64,
    /// What the last commit sent per partition, to skip commits that would change nothing.
    last_committed: HashMap<PartitionKey, i64>,
    /// Set at shutdown: no new records are taken.
    stopping: bool,
}

/// State shared by the poll thread, the rebalance callbacks (on the poll thread too) and the
/// record tasks (on the runtime).
pub struct Shared {
    state: Mutex<State>,
    /// Signalled whenever a record finishes, for drains waiting on in-flight counts.
    finished: Condvar,
    partition_window: usize,
    global_window: usize,
    drain_timeout: Duration,
    pub status: Arc<ConsumerStatus>,
    tasks: TaskTracker,
}

impl Shared {
    fn new(worker: &WorkerSettings, status: Arc<ConsumerStatus>) -> Arc<Self> {
        Arc::new(Self {
            state: Mutex::new(State::default()),
            finished: Condvar::new(),
            partition_window: worker.partition_window,
            global_window: worker.global_window,
            drain_timeout: worker.drain_timeout(),
            status,
            tasks: TaskTracker::new(),
        })
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding this lock would be a bug in this module's bookkeeping; the
        // state is still consistent enough to drain and commit, so keep going.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// New partitions: fresh offsets and a fresh cancellation scope for each.
    fn adopt(&self, keys: &[PartitionKey]) {
        let mut state = self.lock();
        for key in keys {
            state.next_epoch += 1;
            let epoch = state.next_epoch;
            state.offsets.assign(key.clone());
            state.last_committed.remove(key);
            if let Some(old) = state.runs.insert(
                key.clone(),
                PartitionRun {
                    epoch,
                    cancel: CancellationToken::new(),
                    paused: false,
                },
            ) {
                old.cancel.cancel();
            }
        }
        self.status
            .assigned_partitions
            .store(state.runs.len(), Ordering::Relaxed);
        telemetry::assigned(state.runs.len());
    }

    /// The drain path shared by revocation and shutdown: wait for the in-flight records of
    /// `keys` up to the drain timeout (none when `wait` is false: the partitions are already
    /// lost), cancel what is left, commit the done prefix synchronously, forget the partitions.
    fn release<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        keys: &[PartitionKey],
        wait: bool,
    ) {
        let deadline = Instant::now() + self.drain_timeout;
        let mut state = self.lock();
        if wait {
            loop {
                let left: usize = keys
                    .iter()
                    .filter_map(|k| state.offsets.partition(k))
                    .map(|p| p.in_flight())
                    .sum();
                let now = Instant::now();
                if left == 0 || now >= deadline {
                    break;
                }
                state = self
                    .finished
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(|poisoned| poisoned.into_inner())
                    .0;
            }
        }
        let mut points = Vec::new();
        for key in keys {
            if let Some(offsets) = state.offsets.revoke(key) {
                if offsets.in_flight() > 0 {
                    telemetry::cancelling_left_over(key, offsets.in_flight(), wait);
                }
                if let Some(point) = offsets.commit_point() {
                    points.push((key.clone(), point));
                }
            }
            if let Some(run) = state.runs.remove(key) {
                run.cancel.cancel();
            }
            state.last_committed.remove(key);
        }
        self.status
            .assigned_partitions
            .store(state.runs.len(), Ordering::Relaxed);
        telemetry::assigned(state.runs.len());
        drop(state);
        if wait {
            commit_points(consumer, &points, CommitMode::Sync);
        }
    }

    /// Hands one record to the handler, unless its partition is not (or no longer) ours.
    fn dispatch<H: RecordHandler>(
        self: &Arc<Self>,
        message: OwnedMessage,
        handler: &Arc<H>,
        runtime: &Handle,
        retry_delay: Duration,
    ) {
        let key = PartitionKey::new(message.topic(), message.partition());
        let offset = message.offset();
        let (epoch, cancel) = {
            let mut state = self.lock();
            if state.stopping {
                // Not begun, so never committed past: the next owner reads it.
                return;
            }
            let Some((epoch, cancel)) = state
                .runs
                .get(&key)
                .map(|run| (run.epoch, run.cancel.child_token()))
            else {
                tracing::debug!(
                    partition = key.partition,
                    offset,
                    "record of a partition no longer assigned; skipped"
                );
                return;
            };
            if let Err(e) = state.offsets.begin(&key, offset) {
                tracing::warn!(partition = key.partition, offset, error = %e, "record out of order; skipped");
                return;
            }
            (epoch, cancel)
        };
        telemetry::record_received(&key);
        // Every log line of this record carries where it came from; the pipeline adds the
        // task id and assignment version once it knows them.
        let span = tracing::info_span!(
            "record",
            partition = key.partition,
            offset,
            task_id = tracing::field::Empty,
            assignment_version = tracing::field::Empty,
        );
        let shared = Arc::clone(self);
        let handler = Arc::clone(handler);
        self.tasks.spawn_on(
            async move {
                let outcome = loop {
                    let attempt = AssertUnwindSafe(
                        Arc::clone(&handler).handle(message.clone(), cancel.clone()),
                    )
                    .catch_unwind()
                    .await;
                    match attempt {
                        Ok(outcome) => break outcome,
                        Err(_) => {
                            // A handler bug must neither crash the process nor drop the record:
                            // the handler is idempotent, so run it again after a pause.
                            tracing::error!(
                                partition = key.partition,
                                offset,
                                "record handler panicked; retrying the record"
                            );
                            tokio::select! {
                                _ = cancel.cancelled() => break RecordOutcome::Cancelled,
                                _ = tokio::time::sleep(retry_delay) => {}
                            }
                        }
                    }
                };
                if let RecordOutcome::Done(how) = outcome {
                    shared.finish(&key, epoch, offset, how);
                }
            }
            .instrument(span),
            runtime,
        );
    }

    fn finish(&self, key: &PartitionKey, epoch: u64, offset: i64, how: &'static str) {
        let mut state = self.lock();
        if state.runs.get(key).is_some_and(|run| run.epoch == epoch) {
            if let Err(e) = state.offsets.done(key, offset) {
                tracing::error!(partition = key.partition, offset, error = %e, "offset bookkeeping error");
            }
            telemetry::record_done(key, offset, how);
        }
        drop(state);
        self.finished.notify_all();
    }

    /// Pauses partitions whose window is full (or all, when the global window is) and resumes
    /// them once they have drained to half their window: pausing drops librdkafka's prefetched
    /// records, so a partition is not flipped on every record.
    fn apply_back_pressure<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>) {
        let (to_pause, to_resume) = {
            let mut state = self.lock();
            let total = state.offsets.total_in_flight();
            let global_full = total >= self.global_window;
            let global_room = total <= self.global_window / 2;
            let mut to_pause = TopicPartitionList::new();
            let mut to_resume = TopicPartitionList::new();
            let in_flight: HashMap<PartitionKey, usize> = state
                .runs
                .keys()
                .map(|k| {
                    (
                        k.clone(),
                        state.offsets.partition(k).map_or(0, |p| p.in_flight()),
                    )
                })
                .collect();
            let mut paused = 0;
            for (key, run) in state.runs.iter_mut() {
                let n = in_flight[key];
                if !run.paused && (global_full || n >= self.partition_window) {
                    run.paused = true;
                    to_pause.add_partition(&key.topic, key.partition);
                } else if run.paused && global_room && n <= self.partition_window / 2 {
                    run.paused = false;
                    to_resume.add_partition(&key.topic, key.partition);
                }
                paused += usize::from(run.paused);
            }
            telemetry::in_flight(total, paused);
            (to_pause, to_resume)
        };
        if to_pause.count() > 0
            && let Err(e) = consumer.pause(&to_pause)
        {
            telemetry::consumer_error(&e);
        }
        if to_resume.count() > 0
            && let Err(e) = consumer.resume(&to_resume)
        {
            telemetry::consumer_error(&e);
        }
    }

    /// Commits every partition's done prefix that moved since the last commit.
    fn commit_progress<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>, mode: CommitMode) {
        let points: Vec<(PartitionKey, i64)> = {
            let mut state = self.lock();
            let points: Vec<_> = state
                .offsets
                .commit_points()
                .into_iter()
                .filter(|(k, p)| state.last_committed.get(k).is_none_or(|last| p > last))
                .collect();
            for (key, point) in &points {
                state.last_committed.insert(key.clone(), *point);
            }
            points
        };
        commit_points(consumer, &points, mode);
    }

    fn forget_commits(&self, keys: &[PartitionKey]) {
        let mut state = self.lock();
        for key in keys {
            state.last_committed.remove(key);
        }
    }

    fn in_flight(&self) -> usize {
        self.lock().offsets.total_in_flight()
    }

    fn assigned(&self) -> Vec<PartitionKey> {
        self.lock().runs.keys().cloned().collect()
    }
}

fn commit_points<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    points: &[(PartitionKey, i64)],
    mode: CommitMode,
) {
    if points.is_empty() {
        return;
    }
    let mut list = TopicPartitionList::new();
    for (key, point) in points {
        // add_partition_offset fails only for an invalid offset; ours come from real records.
        if let Err(e) = list.add_partition_offset(&key.topic, key.partition, Offset::Offset(*point))
        {
            telemetry::commit_failed(&e);
        }
    }
    // An async commit's failure arrives in `commit_callback`; a sync one's here.
    match consumer.commit(&list, mode) {
        Ok(()) => telemetry::committed(points, matches!(mode, CommitMode::Sync)),
        Err(e) => telemetry::commit_failed(&e),
    }
}

fn keys_of(list: &TopicPartitionList) -> Vec<PartitionKey> {
    list.elements()
        .iter()
        .map(|e| PartitionKey::new(e.topic(), e.partition()))
        .collect()
}

/// librdkafka's callbacks: rebalances, commit results, logs.
pub struct WorkerContext {
    shared: Arc<Shared>,
}

impl ClientContext for WorkerContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        use rdkafka::config::RDKafkaLogLevel::*;
        match level {
            Emerg | Alert | Critical | Error => {
                tracing::error!(target: "librdkafka", fac, "{message}")
            }
            Warning => tracing::warn!(target: "librdkafka", fac, "{message}"),
            Notice | Info => tracing::info!(target: "librdkafka", fac, "{message}"),
            Debug => tracing::debug!(target: "librdkafka", fac, "{message}"),
        }
    }

    fn error(&self, error: KafkaError, reason: &str) {
        tracing::warn!(target: "librdkafka", error = %error, reason, "client error");
        telemetry::consumer_error(&error);
    }
}

impl ConsumerContext for WorkerContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let keys = keys_of(list);
            // Lost partitions (our session expired) already belong to someone else: draining
            // or committing for them is pointless, so cancel at once.
            let lost = consumer.assignment_lost();
            telemetry::rebalance(if lost { "lost" } else { "revoke" }, &keys);
            self.shared
                .status
                .rebalances
                .fetch_add(1, Ordering::Relaxed);
            self.shared.release(consumer, &keys, !lost);
        }
    }

    fn post_rebalance(&self, _consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                let keys = keys_of(list);
                telemetry::rebalance("assign", &keys);
                self.shared
                    .status
                    .rebalances
                    .fetch_add(1, Ordering::Relaxed);
                self.shared.adopt(&keys);
            }
            Rebalance::Error(e) => telemetry::consumer_error(e),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        if let Err(e) = result {
            telemetry::commit_failed(&e);
            // Forget what we believed committed, so the next tick sends it again even if no
            // record finishes in between (otherwise an idle partition would stay behind).
            self.shared.forget_commits(&keys_of(offsets));
        }
    }
}

/// Builds the group consumer: auto-commit and auto offset store off (I3), the configured
/// protocol, then the pass-through properties.
pub fn consumer_config(kafka: &KafkaSettings) -> ClientConfig {
    let mut config = ClientConfig::new();
    // Defaults a platform team would expect; the pass-through map may override them.
    config.set("auto.offset.reset", "earliest");
    if kafka.group_protocol == GroupProtocol::Classic {
        config
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("session.timeout.ms", kafka.session_timeout_ms.to_string());
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
    config
}

/// Runs the consumer until `shutdown` fires, then drains, commits and leaves the group.
/// Blocking: call it on a thread of its own (see the module comment).
pub fn run_consumer<H: RecordHandler>(
    kafka: &KafkaSettings,
    worker: &WorkerSettings,
    handler: Arc<H>,
    runtime: Handle,
    shutdown: CancellationToken,
    status: Arc<ConsumerStatus>,
) -> Result<(), KafkaError> {
    let shared = Shared::new(worker, status);
    let consumer: BaseConsumer<WorkerContext> =
        consumer_config(kafka).create_with_context(WorkerContext {
            shared: Arc::clone(&shared),
        })?;
    consumer.subscribe(&[&kafka.topic])?;
    shared.status.polling.store(true, Ordering::Relaxed);
    tracing::info!(topic = %kafka.topic, group = %kafka.group_id, protocol = kafka.group_protocol.as_str(), "consumer started");

    let poll_timeout = Duration::from_millis(100);
    let commit_interval = worker.commit_interval();
    let mut next_commit = Instant::now() + commit_interval;
    while !shutdown.is_cancelled() {
        match consumer.poll(poll_timeout) {
            Some(Ok(message)) => {
                shared.dispatch(message.detach(), &handler, &runtime, worker.io_retry())
            }
            Some(Err(e)) => telemetry::consumer_error(&e),
            None => {}
        }
        shared.apply_back_pressure(&consumer);
        if Instant::now() >= next_commit {
            shared.commit_progress(&consumer, CommitMode::Async);
            next_commit = Instant::now() + commit_interval;
        }
    }

    // Shutdown: the same drain path as a revocation, for every partition, while still polling
    // so the group session and callbacks stay served.
    tracing::info!(
        in_flight = shared.in_flight(),
        "shutting down: draining in-flight records"
    );
    shared.lock().stopping = true;
    let deadline = Instant::now() + worker.drain_timeout();
    while shared.in_flight() > 0 && Instant::now() < deadline {
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
    // Unsubscribing revokes what is left (our callback finds nothing in flight) and the
    // consumer leaves the group when dropped, so the partitions move on at once.
    consumer.unsubscribe();
    shared.status.polling.store(false, Ordering::Relaxed);
    tracing::info!("consumer stopped");
    Ok(())
}
