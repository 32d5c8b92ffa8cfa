//! The Kafka source (see [`super::source`]): the consumer-group loop. It polls on a dedicated thread, runs many records of one partition at
//! once on the tokio runtime, pauses partitions when their window is full, and commits each
//! partition's done prefix — periodically, and confirmed (within a bound) when partitions are
//! revoked and at shutdown.
//!
//! Keeps I3: an offset is committed only past records whose handler said `Done` (their outcome
//! is durable); the commit point comes from [`InFlightOffsets`]. Which records run, wait or
//! pause their partition is decided by [`Windows`] (pure, in the core); this file does what
//! it says with librdkafka and the runtime. Revocation and shutdown share
//! one drain path ([`Shared::release`]): stop taking records of those partitions, let in-flight
//! work finish up to the drain timeout, cancel the rest, commit, let go. Work that leaks past a
//! revocation is harmless because completions are fenced (I2).
//!
//! Why a dedicated thread: librdkafka runs rebalance callbacks inside `poll`, and our revoke
//! callback blocks while it drains. On a tokio worker thread that would stall the very tasks it
//! waits for.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::message::OwnedMessage;
use rdkafka::{ClientConfig, ClientContext, Message, Offset, TopicPartitionList};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::settings::WorkerSettings;
use crate::capacity::Weights;
use crate::kafka::settings::{GroupProtocol, KafkaSettings};
use crate::probes::Heartbeat;
use crate::telemetry;
use replyd_core::fetch_watch::{FetchWatch, Sighting, Verdict};
use replyd_core::offsets::{InFlightOffsets, PartitionKey};
use replyd_core::windows::{self, Offer, WindowLimits, Windows};

use super::source::{DeadLetter, Delivery, RecordHandler, RecordOutcome, WindowSlot};
use crate::kafka::dead_letter::DeadLetters;

/// Live facts about the consumer, for `/readyz` and tests.
#[derive(Debug, Default)]
pub struct ConsumerStatus {
    pub polling: AtomicBool,
    /// Beaten on every turn of the poll loop (`/healthz` watches it).
    pub heartbeat: Arc<Heartbeat>,
    pub assigned_partitions: AtomicUsize,
    pub rebalances: AtomicUsize,
}

struct State {
    offsets: InFlightOffsets,
    /// Which records run, which wait, which partitions are paused: the rules are
    /// [`Windows`]'s; each assignment's scope is the cancellation token of its records.
    windows: Windows<PartitionKey, CancellationToken, OwnedMessage>,
    /// What the last commit sent per partition, to skip commits that would change nothing.
    last_committed: HashMap<PartitionKey, i64>,
    /// Set at shutdown: no new records are taken.
    stopping: bool,
    /// Partitions not fetched while records wait in Kafka ([`FetchWatch`]), and the fetch
    /// restarts it asked for, with what the client said of each, for the poll loop to make.
    fetch_watch: FetchWatch<PartitionKey>,
    restarts: Vec<(PartitionKey, i64, String)>,
}

impl State {
    fn new(limits: WindowLimits) -> Self {
        Self {
            offsets: InFlightOffsets::default(),
            windows: Windows::new(limits),
            last_committed: HashMap::new(),
            stopping: false,
            fetch_watch: FetchWatch::default(),
            restarts: Vec::new(),
        }
    }

    /// The waiting records the windows have room for now, in fair order.
    fn ready(&mut self) -> Vec<Start> {
        self.windows
            .take_ready()
            .into_iter()
            .map(Start::of)
            .collect()
    }

    fn assigned(&self) -> usize {
        self.windows.assigned().count()
    }
}

/// Starts the handler on one record; type-erased so the shared state needs no type parameter.
type Starter = Arc<
    dyn Fn(OwnedMessage, CancellationToken, WindowSlot) -> BoxFuture<'static, RecordOutcome>
        + Send
        + Sync,
>;

/// A record ready to start, taken out of the state under its lock and spawned after it.
struct Start {
    key: PartitionKey,
    epoch: u64,
    cancel: CancellationToken,
    message: OwnedMessage,
}

impl Start {
    /// The windows' word to start a record: it runs in a child of its assignment's scope.
    fn of(start: windows::Start<PartitionKey, CancellationToken, OwnedMessage>) -> Self {
        Self {
            key: start.key,
            epoch: start.epoch,
            cancel: start.scope.child_token(),
            message: start.item,
        }
    }
}

/// State shared by the poll thread, the rebalance callbacks (on the poll thread too) and the
/// record tasks (on the runtime).
pub struct Shared {
    state: Mutex<State>,
    /// Signalled whenever a record stops running, for drains waiting on the running count.
    finished: Condvar,
    drain_timeout: Duration,
    pub status: Arc<ConsumerStatus>,
    tasks: TaskTracker,
    starter: Starter,
    runtime: Handle,
    retry_delay: Duration,
    /// Each workspace's weight in the windows' fair order.
    weights: Weights,
}

impl Shared {
    fn new<H: RecordHandler<OwnedMessage>>(
        worker: &WorkerSettings,
        status: Arc<ConsumerStatus>,
        handler: Arc<H>,
        runtime: Handle,
        weights: Weights,
    ) -> Arc<Self> {
        let starter: Starter = Arc::new(move |message, cancel, slot| {
            Arc::clone(&handler).handle(message, cancel, slot).boxed()
        });
        Arc::new(Self {
            state: Mutex::new(State::new(WindowLimits {
                partition: worker.partition_window,
                global: worker.global_window,
                read_ahead: worker.read_ahead(),
            })),
            finished: Condvar::new(),
            drain_timeout: worker.drain_timeout(),
            status,
            tasks: TaskTracker::new(),
            starter,
            runtime,
            retry_delay: worker.io_retry(),
            weights,
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
            state.offsets.assign(key.clone());
            state.last_committed.remove(key);
            state.fetch_watch.forget(key);
            if let Some(old) = state.windows.assign(key.clone(), CancellationToken::new()) {
                old.scope.cancel();
            }
        }
        self.status
            .assigned_partitions
            .store(state.assigned(), Ordering::Relaxed);
        telemetry::assigned(state.assigned());
    }

    /// The drain path shared by revocation and shutdown: drop the backlog of `keys` (never
    /// started, so never committed past), wait for their running records up to the drain
    /// timeout (not at all when `wait` is false: the partitions are already lost), cancel what
    /// is left, commit the done prefix synchronously, forget the partitions.
    fn release<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        keys: &[PartitionKey],
        wait: bool,
    ) {
        let deadline = Instant::now() + self.drain_timeout;
        let mut state = self.lock();
        for key in keys {
            state.windows.drop_waiting(key);
        }
        if wait {
            loop {
                let running = state.windows.running_of(keys);
                let now = Instant::now();
                if running == 0 || now >= deadline {
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
            if let Some(run) = state.windows.release(key) {
                if run.paused {
                    telemetry::released_while_paused(key);
                }
                if run.running > 0 {
                    telemetry::cancelling_left_over(key, run.running, wait);
                }
                run.scope.cancel();
            }
            if let Some(point) = state.offsets.revoke(key).and_then(|o| o.commit_point()) {
                points.push((key.clone(), point));
            }
            state.last_committed.remove(key);
            state.fetch_watch.forget(key);
            // No longer ours: its owner reports it now.
            telemetry::oldest_in_flight(key.partition, 0.0);
        }
        self.status
            .assigned_partitions
            .store(state.assigned(), Ordering::Relaxed);
        telemetry::assigned(state.assigned());
        drop(state);
        // Cancelled records free no slot for anyone: their partitions are gone.
        self.finished.notify_all();
        if wait {
            commit_on_release(consumer, &points);
        }
    }

    /// Takes one record: queues it by its workspace, then starts what the windows have room
    /// for, in fair order (it may be this record, or others). Skips records of partitions not (or no
    /// longer) ours, and everything once stopping.
    fn dispatch(self: &Arc<Self>, message: OwnedMessage) {
        let key = PartitionKey::new(message.topic(), message.partition());
        let offset = message.offset();
        // Whose it is, for the fair order between workspaces; read outside the lock.
        let owner = replyd_core::proto::record_owner(rdkafka::Message::payload(&message));
        let weight = self.weights.of(&owner);
        let ready = {
            let mut state = self.lock();
            if state.stopping {
                // Not begun, so never committed past: the next owner reads it.
                return;
            }
            if !state.windows.is_assigned(&key) {
                tracing::debug!(
                    partition = key.partition,
                    offset,
                    "record of a partition no longer assigned; skipped"
                );
                return;
            }
            if let Err(e) = state.offsets.begin(&key, offset, Instant::now()) {
                tracing::warn!(partition = key.partition, offset, error = %e, "record out of order; skipped");
                return;
            }
            match state.windows.offer(&key, owner, weight, message) {
                Offer::Queued => state.ready(),
                // Checked above: the partition is assigned.
                Offer::NotAssigned(_) => return,
            }
        };
        telemetry::record_received(&key);
        for start in ready {
            self.spawn(start);
        }
    }

    fn spawn(self: &Arc<Self>, start: Start) {
        let Start {
            key,
            epoch,
            cancel,
            message,
        } = start;
        let offset = message.offset();
        // Every log line of this record carries where it came from; the pipeline adds the
        // task id and assignment version once it knows them.
        // No parent: a record started from another record's finish is not part of it.
        let span = tracing::info_span!(
            parent: None,
            "record",
            partition = key.partition,
            offset,
            task_id = tracing::field::Empty,
            assignment_version = tracing::field::Empty,
        );
        let shared = Arc::clone(self);
        // Given back at most once, while the record waits for capacity; its end then frees
        // nothing more.
        let parked = Arc::new(AtomicBool::new(false));
        let slot = {
            let (shared, key, parked) = (Arc::downgrade(self), key.clone(), Arc::clone(&parked));
            WindowSlot::new(move || {
                if !parked.swap(true, Ordering::SeqCst)
                    && let Some(shared) = shared.upgrade()
                {
                    shared.park(&key, epoch);
                }
            })
        };
        self.tasks.spawn_on(
            async move {
                let outcome = loop {
                    let attempt = AssertUnwindSafe((shared.starter)(
                        message.clone(),
                        cancel.clone(),
                        slot.clone(),
                    ))
                    .catch_unwind()
                    .await;
                    match attempt {
                        // A Kafka record cannot be handed back (`can_hand_back`); were one
                        // asked to wait anyway, it waits here and runs again.
                        Ok(RecordOutcome::HandedBack { after }) => {
                            tokio::select! {
                                _ = cancel.cancelled() => break RecordOutcome::Cancelled,
                                _ = tokio::time::sleep(after) => {}
                            }
                        }
                        Ok(outcome) => break outcome,
                        Err(_) => {
                            // A handler bug must neither crash the process nor drop the record:
                            // the handler is idempotent, so run it again after a pause.
                            tracing::error!("record handler panicked; retrying the record");
                            tokio::select! {
                                _ = cancel.cancelled() => break RecordOutcome::Cancelled,
                                _ = tokio::time::sleep(shared.retry_delay) => {}
                            }
                        }
                    }
                };
                shared.finish(&key, epoch, offset, outcome, parked.load(Ordering::SeqCst));
            }
            .instrument(span),
            &self.runtime,
        );
    }

    /// A record stopped running: done (its offset may be committed) or cancelled (not). Its
    /// slot goes to the next waiting record.
    fn finish(
        self: &Arc<Self>,
        key: &PartitionKey,
        epoch: u64,
        offset: i64,
        outcome: RecordOutcome,
        parked: bool,
    ) {
        let ready = {
            let mut state = self.lock();
            // Only a record of the current assignment counts, and only a done one moves the
            // commit point. A record that gave its slot back while it waited frees none now.
            let counts = if parked {
                state.windows.holds(key, epoch)
            } else {
                state.windows.finish(key, epoch)
            };
            if counts && let RecordOutcome::Done(how) = outcome {
                if let Err(e) = state.offsets.done(key, offset) {
                    tracing::error!(partition = key.partition, offset, error = %e, "offset bookkeeping error");
                }
                telemetry::record_done(key, offset, how);
            }
            // A late end of an earlier assignment frees no slot of its own, but a slot freed
            // meanwhile (a partition taken away) is given out here too.
            state.ready()
        };
        self.finished.notify_all();
        for start in ready {
            self.spawn(start);
        }
    }

    /// A running record of `key`'s assignment `epoch` waits for capacity: its slot goes to the
    /// next waiting record in fair order.
    fn park(self: &Arc<Self>, key: &PartitionKey, epoch: u64) {
        let ready = {
            let mut state = self.lock();
            if !state.windows.park(key, epoch) {
                return;
            }
            state.ready()
        };
        // A drain waits for running records: this one no longer counts.
        self.finished.notify_all();
        for start in ready {
            self.spawn(start);
        }
    }

    /// Pauses partitions whose backlog is full and resumes them once it has drained to half:
    /// memory stays bounded by window + read-ahead records per partition whatever the backlog
    /// in Kafka, and the read-ahead hides the refetch delay after a resume (pausing drops
    /// librdkafka's prefetched records).
    fn apply_back_pressure<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>) {
        let (to_pause, to_resume) = {
            let mut state = self.lock();
            let mut to_pause = TopicPartitionList::new();
            let mut to_resume = TopicPartitionList::new();
            let changes = state.windows.back_pressure();
            for key in &changes.pause {
                to_pause.add_partition(&key.topic, key.partition);
            }
            for key in &changes.resume {
                to_resume.add_partition(&key.topic, key.partition);
            }
            telemetry::in_flight(state.windows.running(), changes.paused);
            telemetry::back_pressure(&changes.pause, &changes.resume);
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

    /// Judges one statistics report of an assigned partition ([`FetchWatch`]): a stalled one is
    /// queued for a fetch restart at the next offset to read.
    fn watch_fetch(&self, key: PartitionKey, report: &rdkafka::statistics::Partition) {
        let mut state = self.lock();
        if state.stopping || !state.windows.is_assigned(&key) {
            return;
        }
        let ours = state
            .offsets
            .partition(&key)
            .and_then(|p| p.next_to_read())
            .unwrap_or(report.committed_offset);
        let sighting = Sighting {
            readable_end: if report.ls_offset >= 0 {
                report.ls_offset
            } else {
                report.hi_offset
            },
            next_to_read: ours.max(report.app_offset),
            paused: state.windows.is_paused(&key),
            waiting: state.windows.waiting(&key),
        };
        if let Verdict::Stalled { from } = state.fetch_watch.observe(&key, sighting) {
            let client = format!(
                "fetch_state={} next_offset={} app_offset={} committed_offset={} hi_offset={} ls_offset={} fetchq_cnt={}",
                report.fetch_state,
                report.next_offset,
                report.app_offset,
                report.committed_offset,
                report.hi_offset,
                report.ls_offset,
                report.fetchq_cnt
            );
            state.restarts.push((key, from, client));
        }
    }

    /// Makes the fetch restarts the watch asked for: a seek to the next offset to read, which
    /// restarts the partition's fetcher there (nothing past it was taken, so nothing is
    /// skipped or read twice). One paused or given up since is left alone.
    fn restart_fetches<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>) {
        let restarts = {
            let mut state = self.lock();
            if state.restarts.is_empty() {
                return;
            }
            let restarts = std::mem::take(&mut state.restarts);
            restarts
                .into_iter()
                .filter(|(key, _, _)| {
                    state.windows.is_assigned(key) && !state.windows.is_paused(key)
                })
                .collect::<Vec<_>>()
        };
        for (key, from, client) in restarts {
            telemetry::fetch_restarted(&key, from, &client);
            if let Err(e) = consumer.seek(
                &key.topic,
                key.partition,
                Offset::Offset(from),
                Duration::ZERO,
            ) {
                telemetry::fetch_restart_failed(&key, &e);
            }
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

    /// Sets the age of each assigned partition's oldest in-flight record.
    fn report_in_flight_ages(&self) {
        let now = Instant::now();
        let ages: Vec<(i32, f64)> = {
            let state = self.lock();
            state
                .offsets
                .assigned()
                .map(|key| {
                    let since = state
                        .offsets
                        .partition(key)
                        .and_then(|p| p.oldest_in_flight());
                    (
                        key.partition,
                        since.map_or(0.0, |at| now.saturating_duration_since(at).as_secs_f64()),
                    )
                })
                .collect()
        };
        for (partition, seconds) in ages {
            telemetry::oldest_in_flight(partition, seconds);
        }
    }

    fn forget_all_commits(&self) {
        self.lock().last_committed.clear();
    }

    fn forget_commits(&self, keys: &[PartitionKey]) {
        let mut state = self.lock();
        for key in keys {
            state.last_committed.remove(key);
        }
    }

    /// Stops taking records: backlogs are dropped (never started, so never committed past).
    fn stop_taking(&self) {
        let mut state = self.lock();
        state.stopping = true;
        state.windows.drop_all_waiting();
    }

    fn running(&self) -> usize {
        self.lock().windows.running()
    }

    fn assigned(&self) -> Vec<PartitionKey> {
        self.lock().windows.assigned().cloned().collect()
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
    let list = commit_list(points, matches!(mode, CommitMode::Sync));
    // An error here is the commit not queued; how a queued async commit fares is only logged
    // by librdkafka (see `commit_callback`), hence the periodic full re-commit. The release
    // path confirms its commit itself (`commit_on_release`).
    match consumer.commit(&list, mode) {
        Ok(()) => telemetry::committed(points, matches!(mode, CommitMode::Sync)),
        Err(e) => telemetry::commit_failed(&e, matches!(mode, CommitMode::Sync)),
    }
}

/// The partition list of commit `points`; `confirmed` labels a failure as the release path's.
fn commit_list(points: &[(PartitionKey, i64)], confirmed: bool) -> TopicPartitionList {
    let mut list = TopicPartitionList::new();
    for (key, point) in points {
        // add_partition_offset fails only for an invalid offset; ours come from real records.
        if let Err(e) = list.add_partition_offset(&key.topic, key.partition, Offset::Offset(*point))
        {
            telemetry::commit_failed(&e, confirmed);
        }
    }
    list
}

/// How long a released partition's last commit is waited for.
const RELEASE_COMMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// The commit of partitions being let go (revoke, shutdown): sent at once, then confirmed by
/// reading the group's committed offsets back, for at most [`RELEASE_COMMIT_TIMEOUT`]. Not a
/// synchronous commit: librdkafka waits for one without a bound, and this runs inside the
/// rebalance callback, on the poll thread, where a wait without end stalls every partition of
/// the worker (a KIP-848 revoke on Kafka 4.4.0 was seen to stop there). A commit that is not
/// confirmed in time costs only redeliveries: the next owner reads those records again, and
/// their tasks are done, so the claim refuses them without a call (I5).
fn commit_on_release<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    points: &[(PartitionKey, i64)],
) {
    if points.is_empty() {
        return;
    }
    let list = commit_list(points, true);
    if let Err(e) = consumer.commit(&list, CommitMode::Async) {
        telemetry::commit_failed(&e, true);
        return;
    }
    let deadline = Instant::now() + RELEASE_COMMIT_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match consumer.committed_offsets(list.clone(), left) {
            Ok(committed) if reached(&committed, points) => {
                telemetry::committed(points, true);
                return;
            }
            Ok(_) => {}
            Err(e) => telemetry::commit_failed(&e, true),
        }
        if Instant::now() >= deadline {
            telemetry::release_commit_unconfirmed(points, RELEASE_COMMIT_TIMEOUT);
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the group's committed offsets are at or past every point.
fn reached(committed: &TopicPartitionList, points: &[(PartitionKey, i64)]) -> bool {
    points.iter().all(|(key, point)| {
        committed
            .find_partition(&key.topic, key.partition)
            .is_some_and(|e| matches!(e.offset(), Offset::Offset(o) if o >= *point))
    })
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
    topic: String,
    /// Partitions whose lag this worker reported, so one it no longer has is set to 0.
    lag_reported: std::sync::Mutex<std::collections::BTreeSet<i32>>,
}

impl ClientContext for WorkerContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        telemetry::librdkafka_log(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        telemetry::kafka_client_error(&error, reason);
    }

    /// librdkafka's statistics (every `statistics.interval.ms`): the consumer lag of each
    /// partition this worker is assigned, and whether each is still fetched.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let Some(topic) = statistics.topics.get(&self.topic) else {
            return;
        };
        let mut reported = self.lag_reported.lock().unwrap_or_else(|p| p.into_inner());
        for partition in topic.partitions.values().filter(|p| p.partition >= 0) {
            if partition.desired {
                self.shared.watch_fetch(
                    PartitionKey::new(self.topic.as_str(), partition.partition),
                    partition,
                );
            }
            let lag = partition
                .desired
                .then(|| {
                    lag_of(
                        partition.hi_offset,
                        partition.lo_offset,
                        partition.committed_offset,
                    )
                })
                .flatten();
            match lag {
                Some(records) => {
                    telemetry::consumer_lag(partition.partition, records);
                    reported.insert(partition.partition);
                }
                None if reported.remove(&partition.partition) => {
                    telemetry::consumer_lag(partition.partition, 0);
                }
                None => {}
            }
        }
    }
}

/// A partition's consumer lag from librdkafka's statistics: the records after the group's
/// committed offset, up to the high watermark. Before the group's first commit, every record
/// from the low watermark (the group starts at the earliest). None while the watermark is
/// unknown.
pub fn lag_of(high_watermark: i64, low_watermark: i64, committed: i64) -> Option<i64> {
    if high_watermark < 0 {
        return None;
    }
    let from = if committed >= 0 {
        committed
    } else {
        low_watermark.max(0)
    };
    Some((high_watermark - from).max(0))
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

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                let keys = keys_of(list);
                telemetry::rebalance("assign", &keys);
                self.shared
                    .status
                    .rebalances
                    .fetch_add(1, Ordering::Relaxed);
                self.shared.adopt(&keys);
                // librdkafka keeps a partition's pause across assignments: one we paused for
                // back-pressure, lost or revoked, then given back would never be fetched
                // again. Our state starts an adopted partition unpaused; make librdkafka agree.
                if list.count() > 0
                    && let Err(e) = consumer.resume(list)
                {
                    telemetry::consumer_error(&e);
                }
            }
            Rebalance::Error(e) => telemetry::consumer_error(e),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        // Only some commits report here. librdkafka hands the result of an application's
        // async commit (`rd_kafka_commit(.., async)`) to a configured `offset_commit_cb` or a
        // reply queue only (rd_kafka_cgrp_propagate_commit_result); the OFFSET_COMMIT event
        // rdkafka enables is used for librdkafka's own auto-commits. rdkafka sets neither, so
        // a failed async commit is only librdkafka's COMMITFAIL log line, never this call:
        // hence the periodic full re-commit (FULL_COMMIT_INTERVAL). A commit can fail as a
        // whole or per partition (a generation error during a rebalance is reported on each).
        let failed: Vec<PartitionKey> = match &result {
            Err(e) => {
                telemetry::commit_failed(e, false);
                keys_of(offsets)
            }
            Ok(()) => offsets
                .elements()
                .iter()
                .filter_map(|e| match e.error() {
                    Ok(()) => None,
                    Err(error) => {
                        telemetry::commit_failed(&error, false);
                        Some(PartitionKey::new(e.topic(), e.partition()))
                    }
                })
                .collect(),
        };
        // Forget what we believed committed, so the next tick sends it again even if no
        // record finishes in between (otherwise an idle partition would stay behind).
        self.shared.forget_commits(&failed);
    }
}

/// Builds the group consumer: auto-commit and auto offset store off (I3), the configured
/// protocol, then the pass-through properties.
pub fn consumer_config(kafka: &KafkaSettings) -> ClientConfig {
    let mut config = kafka.client_config();
    // Defaults a platform team would expect; the pass-through map may override them.
    // Statistics feed the consumer-lag gauge.
    config
        .set("auto.offset.reset", "earliest")
        .set("statistics.interval.ms", "5000");
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

/// How often every partition's commit point is sent again even if it did not move: the result
/// of an async commit is not reported back (see `commit_callback`), so a failed one is mended
/// by sending every point again.
const FULL_COMMIT_INTERVAL: Duration = Duration::from_secs(5);

/// Runs the consumer until `shutdown` fires, then drains, commits and leaves the group.
/// Blocking: call it on a thread of its own (see the module comment).
pub fn run_consumer<H: RecordHandler<OwnedMessage>>(
    kafka: &KafkaSettings,
    worker: &WorkerSettings,
    handler: Arc<H>,
    runtime: Handle,
    shutdown: CancellationToken,
    status: Arc<ConsumerStatus>,
    weights: Weights,
) -> Result<(), KafkaError> {
    let shared = Shared::new(worker, status, handler, runtime.clone(), weights);
    let consumer: BaseConsumer<WorkerContext> =
        consumer_config(kafka).create_with_context(WorkerContext {
            shared: Arc::clone(&shared),
            topic: kafka.topic.clone(),
            lag_reported: Default::default(),
        })?;
    consumer.subscribe(&[&kafka.topic])?;
    shared.status.polling.store(true, Ordering::Relaxed);
    tracing::info!(topic = %kafka.topic, group = %kafka.group_id, protocol = kafka.group_protocol.as_str(), "consumer started");

    let poll_timeout = Duration::from_millis(100);
    let commit_interval = worker.commit_interval();
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
    let deadline = Instant::now() + worker.drain_timeout();
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
        let deadline = Instant::now() + worker.drain_timeout();
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
    fn payload(&self) -> Result<Option<&[u8]>, replyd_core::domain::RecordError> {
        Ok(Message::payload(self))
    }

    fn system(&self) -> &'static str {
        "kafka"
    }

    fn can_hand_back(&self) -> bool {
        false
    }

    /// The group gives a partition to one member at a time, and this consumer drains or
    /// cancels a revoked partition's work before it lets the partition go (`Revoked`).
    fn partition_held_alone(&self) -> bool {
        true
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
    use super::lag_of;

    #[test]
    fn lag_counts_from_the_committed_offset_or_from_the_start_before_the_first_commit() {
        assert_eq!(lag_of(120, 0, 100), Some(20));
        assert_eq!(lag_of(120, 0, 120), Some(0), "caught up");
        assert_eq!(
            lag_of(120, 30, -1001),
            Some(90),
            "no commit yet: from the low watermark"
        );
        assert_eq!(lag_of(-1, 0, 5), None, "the watermark is not known yet");
        assert_eq!(
            lag_of(100, 0, 130),
            Some(0),
            "a commit ahead of a stale watermark"
        );
    }
}
