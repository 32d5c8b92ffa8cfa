//! The consumer's shared state: what the poll thread, the rebalance callbacks and the records'
//! tasks all touch. Which records run, wait or pause their partition is [`Windows`]'s rule,
//! where reading goes on and what may be committed [`InFlightOffsets`]'; this room does what
//! they say with librdkafka and the runtime, and holds the one drain path of revocation and
//! shutdown ([`Shared::release`]).

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::message::OwnedMessage;
use rdkafka::{Message, Offset, TopicPartitionList};
use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::commits::{commit_on_release, commit_points};
use crate::capacity::Weights;
use crate::probes::Heartbeat;
use crate::telemetry;
use crate::transport::source::{Holding, RecordHandler, RecordOutcome, WindowSlot};
use replyd_core::fetch_watch::{FetchWatch, Sighting, Verdict, first_to_read};
use replyd_core::offsets::{InFlightOffsets, PartitionKey};
use replyd_core::windows::{self, Offer, WindowLimits, Windows};

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
    pub(super) fn new(limits: WindowLimits) -> Self {
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

    pub(super) fn assigned(&self) -> usize {
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
    /// The records' tasks, waited for before the consumer closes.
    pub(super) tasks: TaskTracker,
    starter: Starter,
    runtime: Handle,
    retry_delay: Duration,
    /// Each workspace's weight in the windows' fair order.
    weights: Weights,
}

impl Shared {
    pub(super) fn new<H: RecordHandler<OwnedMessage>>(
        holding: &Holding,
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
                partition: holding.partition_window,
                global: holding.global_window,
                read_ahead: holding.read_ahead,
            })),
            finished: Condvar::new(),
            drain_timeout: holding.drain_timeout,
            status,
            tasks: TaskTracker::new(),
            starter,
            runtime,
            retry_delay: holding.io_retry,
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
    pub(super) fn adopt(&self, keys: &[PartitionKey]) {
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
    pub(super) fn release<C: ConsumerContext>(
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
    pub(super) fn dispatch(self: &Arc<Self>, message: OwnedMessage) {
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
    pub(super) fn apply_back_pressure<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>) {
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
    /// `uncommitted_from_start`: where the reset policy starts a partition the group never
    /// committed ([`first_to_read`]).
    pub(super) fn watch_fetch(
        &self,
        key: PartitionKey,
        report: &rdkafka::statistics::Partition,
        uncommitted_from_start: bool,
    ) {
        let mut state = self.lock();
        if state.stopping || !state.windows.is_assigned(&key) {
            return;
        }
        let ours = state
            .offsets
            .partition(&key)
            .and_then(|p| p.next_to_read())
            .unwrap_or_else(|| {
                first_to_read(
                    report.committed_offset,
                    report.lo_offset,
                    uncommitted_from_start,
                )
            });
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
    pub(super) fn restart_fetches<C: ConsumerContext>(&self, consumer: &BaseConsumer<C>) {
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
    pub(super) fn commit_progress<C: ConsumerContext>(
        &self,
        consumer: &BaseConsumer<C>,
        mode: CommitMode,
    ) {
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
    pub(super) fn report_in_flight_ages(&self) {
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

    pub(super) fn forget_all_commits(&self) {
        self.lock().last_committed.clear();
    }

    pub(super) fn forget_commits(&self, keys: &[PartitionKey]) {
        let mut state = self.lock();
        for key in keys {
            state.last_committed.remove(key);
        }
    }

    /// Stops taking records: backlogs are dropped (never started, so never committed past).
    pub(super) fn stop_taking(&self) {
        let mut state = self.lock();
        state.stopping = true;
        state.windows.drop_all_waiting();
    }

    pub(super) fn running(&self) -> usize {
        self.lock().windows.running()
    }

    pub(super) fn assigned(&self) -> Vec<PartitionKey> {
        self.lock().windows.assigned().cloned().collect()
    }
}
