//! Wake-ups for parked records. A record whose task is leased by another assignment parks
//! until that lease ends; it is woken early when the task's status changes (completed, failed,
//! or the lease given back), so a duplicate does not hold its partition's commit point (I3) or
//! a window slot for a whole lease after the work is done.
//!
//! Two sources wake a parked record: this process, when one of its own records ends the lease
//! (the same worker holding both copies), and [`relay_task_notifications`], which relays the
//! PostgreSQL notifications the task table's trigger sends from every worker (one session,
//! [`crate::store::listen`]). A wake-up is
//! only a hint to read the row again; the lease end stays the fallback, so a lost notification
//! costs time, never correctness.
//!
//! A watch that must hear other workers (a parked record; a running call waiting for its
//! cancellation when `worker.lease_check_ms` is 0) holds the listening session's [`Demand`]:
//! a worker with nothing parked stops listening after `database.listen_idle_ms`, and the next
//! such watch starts it again (its first act is to wake every watch, so a change made before
//! it listened is not missed). A record watches its task from before its first claim, but
//! listens only once it parks: the fault-free path never makes the worker listen.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

use crate::store::DatabaseSettings;
use crate::store::listen::{
    Demand, DemandHold, Listener, TASK_STATUS_CHANNEL, listen, parse_status_payloads,
};
use crate::telemetry;
use replyd_core::domain::{TaskId, TaskStatus};

/// Where a wake-up came from, for the metric.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WakeSource {
    /// A record of this process ended the lease.
    Local,
    /// A notification from PostgreSQL (any worker).
    Notification,
    /// The notification listener (re)connected and may have missed some: everyone looks again.
    Resync,
}

impl WakeSource {
    pub fn as_str(self) -> &'static str {
        match self {
            WakeSource::Local => "local",
            WakeSource::Notification => "notification",
            WakeSource::Resync => "resync",
        }
    }
}

struct Entry {
    wake: watch::Sender<u64>,
    watchers: usize,
}

/// The tasks records of this process wait on, each with a counter bumped by every wake-up.
#[derive(Default, Clone)]
pub struct ParkedTasks {
    entries: Arc<Mutex<HashMap<TaskId, Entry>>>,
    /// Held by every watch: the listening session runs while one exists.
    demand: Demand,
}

/// A record's interest in one task. Taken *before* the record reads the task, so a change that
/// lands between the read and the park is not missed: [`TaskWatch::changed`] then returns at
/// once.
pub struct TaskWatch {
    task: TaskId,
    receiver: watch::Receiver<u64>,
    parked: ParkedTasks,
    /// Held once the watch listens, until it is dropped.
    need: Option<DemandHold>,
}

impl ParkedTasks {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<TaskId, Entry>> {
        // Every critical section below is a map insert/remove with no panicking call inside;
        // a poisoned lock still holds a consistent map.
        self.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Starts watching `task`: the watch hears this process's own wake-ups at once, and other
    /// workers' once [`TaskWatch::listen`] asks for the listening session.
    pub fn watch(&self, task: TaskId) -> TaskWatch {
        let mut entries = self.lock();
        let entry = entries.entry(task).or_insert_with(|| Entry {
            wake: watch::channel(0).0,
            watchers: 0,
        });
        entry.watchers += 1;
        let receiver = entry.wake.subscribe();
        telemetry::watched_tasks(entries.len());
        TaskWatch {
            task,
            receiver,
            parked: self.clone(),
            need: None,
        }
    }

    /// Wakes every record watching `task`; true if there was one.
    pub fn wake(&self, task: TaskId, source: WakeSource) -> bool {
        let entries = self.lock();
        let Some(entry) = entries.get(&task) else {
            return false;
        };
        entry.wake.send_modify(|n| *n += 1);
        telemetry::wake_up(source.as_str(), 1);
        true
    }

    /// Wakes every watching record.
    pub fn wake_all(&self, source: WakeSource) {
        let entries = self.lock();
        for entry in entries.values() {
            entry.wake.send_modify(|n| *n += 1);
        }
        telemetry::wake_up(source.as_str(), entries.len());
    }

    fn unwatch(&self, task: TaskId) {
        let mut entries = self.lock();
        if let Some(entry) = entries.get_mut(&task) {
            entry.watchers -= 1;
            if entry.watchers == 0 {
                entries.remove(&task);
            }
        }
        telemetry::watched_tasks(entries.len());
    }
}

impl TaskWatch {
    /// Hears other workers' changes of the task too: holds the listening session from now on.
    /// Anything that changed since the watch was taken still wakes it: either the session
    /// listened all along and relayed it, or it (re)starts now and its first act wakes every
    /// watch. So a record need not listen before it parks, and a worker whose records are
    /// not parked does not listen at all.
    pub fn listen(&mut self) {
        if self.need.is_none() {
            self.need = Some(self.parked.demand.hold());
        }
    }

    /// Returns once the task was woken since this watch was taken or last returned. Pending
    /// for ever if nobody wakes it: always race it against the lease end.
    pub async fn changed(&mut self) {
        if self.receiver.changed().await.is_err() {
            // The sender lives in the map while this watch exists, so it cannot be dropped;
            // were it ever, waiting for the lease end is the correct fallback.
            std::future::pending::<()>().await;
        }
    }
}

impl Drop for TaskWatch {
    fn drop(&mut self) {
        self.parked.unwatch(self.task);
    }
}

struct WakeParked(ParkedTasks);

impl Listener for WakeParked {
    fn listening(&mut self) {
        self.0.wake_all(WakeSource::Resync);
    }

    fn notified(&mut self, _channel: &str, payload: &str) {
        // One line per task a transaction changed (V32).
        for change in parse_status_payloads(payload) {
            match change {
                // A claim (to running) ends nobody's wait.
                Ok((_, TaskStatus::Running)) => {}
                Ok((task, _)) => {
                    self.0.wake(task, WakeSource::Notification);
                }
                Err(line) => telemetry::bad_notification(line),
            }
        }
    }
}

/// Relays `replyd_task_status` to `parked` while something watches, until `shutdown`. `name`
/// becomes the session's `application_name`, so an operator can tell the listener from the
/// pool.
pub async fn relay_task_notifications(
    settings: DatabaseSettings,
    name: String,
    parked: ParkedTasks,
    shutdown: CancellationToken,
) {
    let demand = parked.demand.clone();
    listen(
        settings,
        name,
        &[TASK_STATUS_CHANNEL],
        WakeParked(parked),
        demand,
        shutdown,
    )
    .await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn changed_within(watch: &mut TaskWatch, ms: u64) -> bool {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_time()
            .build()
            .unwrap();
        runtime.block_on(async {
            tokio::time::timeout(Duration::from_millis(ms), watch.changed())
                .await
                .is_ok()
        })
    }

    #[test]
    fn a_wake_before_the_wait_is_not_lost() {
        let parked = ParkedTasks::default();
        let task = TaskId::new_random();
        let mut watch = parked.watch(task);
        assert!(parked.wake(task, WakeSource::Local));
        assert!(changed_within(&mut watch, 1_000));
        // Seen once: the next wait needs a new wake-up.
        assert!(!changed_within(&mut watch, 20));
    }

    #[test]
    fn only_the_woken_task_wakes_and_resync_wakes_all() {
        let parked = ParkedTasks::default();
        let (a, b) = (TaskId::new_random(), TaskId::new_random());
        let (mut wa, mut wb) = (parked.watch(a), parked.watch(b));
        parked.wake(a, WakeSource::Notification);
        assert!(changed_within(&mut wa, 1_000));
        assert!(!changed_within(&mut wb, 20));
        parked.wake_all(WakeSource::Resync);
        assert!(changed_within(&mut wa, 1_000));
        assert!(changed_within(&mut wb, 1_000));
    }

    #[test]
    fn the_entry_lives_while_someone_watches() {
        let parked = ParkedTasks::default();
        let task = TaskId::new_random();
        let first = parked.watch(task);
        let mut second = parked.watch(task);
        drop(first);
        assert!(
            parked.wake(task, WakeSource::Local),
            "still watched by the second"
        );
        assert!(changed_within(&mut second, 1_000));
        drop(second);
        assert!(
            !parked.wake(task, WakeSource::Local),
            "forgotten once nobody watches"
        );
        assert!(parked.lock().is_empty());
    }
}
