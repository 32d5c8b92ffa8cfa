//! The task status changes of this API process: one listening session on
//! `replyd_task_status` (sent by the task table's trigger on every status change) fanned out
//! to every open event stream ([`super::events`]). A notification is only a hint: a stream
//! re-reads its row on every hint and on a timer.

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::store::DatabaseSettings;
use crate::store::listen::{Listener, TASK_STATUS_CHANNEL, listen, parse_status_payload};
use replyd_core::domain::TaskId;

/// The fan-out of task status notifications to the open streams of this process.
#[derive(Clone)]
pub struct TaskChanges {
    sender: broadcast::Sender<Option<TaskId>>,
}

impl Default for TaskChanges {
    fn default() -> Self {
        // A stream that falls this far behind re-reads its row (see `Lagged` below).
        Self {
            sender: broadcast::channel(1024).0,
        }
    }
}

struct Fanout(broadcast::Sender<Option<TaskId>>);

impl Listener for Fanout {
    fn listening(&mut self) {
        // Changes may have been missed while nobody listened: every stream re-reads.
        let _ = self.0.send(None);
    }

    fn notified(&mut self, payload: &str) {
        if let Some((task, _)) = parse_status_payload(payload) {
            // No receiver (no open stream) is not an error.
            let _ = self.0.send(Some(task));
        }
    }
}

impl TaskChanges {
    /// Starts the one listening session of this process.
    pub fn listen(&self, database: DatabaseSettings, shutdown: CancellationToken) {
        tokio::spawn(listen(
            database,
            format!("replyd-api-listener {}", std::process::id()),
            TASK_STATUS_CHANNEL,
            Fanout(self.sender.clone()),
            shutdown,
        ));
    }

    pub(super) fn subscribe(&self) -> broadcast::Receiver<Option<TaskId>> {
        self.sender.subscribe()
    }
}
