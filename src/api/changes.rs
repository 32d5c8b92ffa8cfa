//! The task changes of this API process, for its open event streams ([`super::events`]), from
//! one listening session on two channels:
//! - status changes (`replyd_task_status`, sent by the task table's trigger on every status
//!   change), fanned out to every open stream. A notification is only a hint: a stream
//!   re-reads its row on every hint and on a timer.
//! - live text (`replyd_live_pieces`, sent with each round of pieces a worker writes, the
//!   pieces in its payload; and `replyd_live`, one piece a notification, from workers of the
//!   previous release), each piece handed only to the streams that follow its task, so a piece
//!   costs nothing for the streams of other tasks and no read for the streams of its own.
//!
//! The session listens only while a stream is open (each holds the [`Demand`]), and for
//! `database.listen_idle_ms` after the last one closed: an API process nobody follows through
//! does not slow the database's notifying commits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::sync::broadcast;
use tokio_util::sync::CancellationToken;

use crate::store::DatabaseSettings;
use crate::store::listen::{
    Demand, DemandHold, Listener, TASK_STATUS_CHANNEL, listen, parse_status_payloads,
};
use crate::store::live::{
    LIVE_PIECES_CHANNEL, LIVE_TEXT_CHANNEL, LivePiece, parse_live_payload, parse_live_pieces,
};
use replyd_core::domain::TaskId;

/// The fan-out of task status notifications and live text to the open streams of this process.
#[derive(Clone)]
pub struct TaskChanges {
    sender: broadcast::Sender<Option<TaskId>>,
    live: LiveFanout,
    /// Held by every open stream: the session listens while one is.
    demand: Demand,
}

impl Default for TaskChanges {
    fn default() -> Self {
        // A stream that falls this far behind re-reads its row (see `Lagged` below).
        Self {
            sender: broadcast::channel(1024).0,
            live: LiveFanout::default(),
            demand: Demand::default(),
        }
    }
}

/// The one session's listener: status changes to every stream, pieces to their task's.
struct Fanout {
    status: broadcast::Sender<Option<TaskId>>,
    live: LiveFanout,
}

impl Listener for Fanout {
    fn listening(&mut self) {
        // Changes may have been missed while nobody listened: every stream re-reads.
        let _ = self.status.send(None);
        self.live.resync();
    }

    fn notified(&mut self, channel: &str, payload: &str) {
        if channel == LIVE_PIECES_CHANNEL {
            self.live.pieces(parse_live_pieces(payload));
        } else if channel == LIVE_TEXT_CHANNEL {
            self.live.pieces(parse_live_payload(payload));
        } else {
            // One line per task a transaction changed (V32).
            for change in parse_status_payloads(payload) {
                match change {
                    // No receiver (no open stream) is not an error.
                    Ok((task, _)) => drop(self.status.send(Some(task))),
                    Err(line) => crate::telemetry::bad_notification(line),
                }
            }
        }
    }
}

/// What a stream following a task hears of its live text.
#[derive(Debug, Clone)]
pub enum LiveHint {
    /// A piece, as its worker wrote it.
    Piece(Arc<LivePiece>),
    /// Pieces may have been missed (the session listens again): read what was missed.
    Resync,
}

/// Pieces queued for one stream before it reads them itself (it falls behind: `Lagged`).
const LIVE_QUEUE: usize = 256;

/// The followed tasks of this process and their streams' channels.
#[derive(Clone, Default)]
struct LiveFanout {
    followed: Arc<Mutex<HashMap<TaskId, broadcast::Sender<LiveHint>>>>,
}

impl LiveFanout {
    fn lock(&self) -> MutexGuard<'_, HashMap<TaskId, broadcast::Sender<LiveHint>>> {
        // The map holds only senders: usable whatever panicked while it was held.
        self.followed.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl LiveFanout {
    fn resync(&self) {
        for sender in self.lock().values() {
            let _ = sender.send(LiveHint::Resync);
        }
    }

    fn pieces(&self, pieces: impl IntoIterator<Item = LivePiece>) {
        let followed = self.lock();
        for piece in pieces {
            if let Some(sender) = followed.get(&piece.task_id) {
                let _ = sender.send(LiveHint::Piece(Arc::new(piece)));
            }
        }
    }
}

/// One stream's hold on the status changes: the session listens while one exists.
pub(super) struct StatusFollow {
    pub receiver: broadcast::Receiver<Option<TaskId>>,
    _need: DemandHold,
}

/// One stream's hold on its task's live text; the task is let go with its last follower.
pub(super) struct LiveFollow {
    pub receiver: broadcast::Receiver<LiveHint>,
    task: TaskId,
    fanout: LiveFanout,
}

impl Drop for LiveFollow {
    fn drop(&mut self) {
        let mut followed = self.fanout.lock();
        // This stream's receiver is still counted while it is being dropped.
        if followed
            .get(&self.task)
            .is_some_and(|sender| sender.receiver_count() <= 1)
        {
            followed.remove(&self.task);
        }
    }
}

impl TaskChanges {
    /// Starts the one listening session of this process.
    pub fn listen(&self, database: DatabaseSettings, shutdown: CancellationToken) {
        tokio::spawn(listen(
            database,
            format!("replyd-api-listener {}", std::process::id()),
            &[TASK_STATUS_CHANNEL, LIVE_PIECES_CHANNEL, LIVE_TEXT_CHANNEL],
            Fanout {
                status: self.sender.clone(),
                live: self.live.clone(),
            },
            self.demand.clone(),
            shutdown,
        ));
    }

    /// Hears every status change from now on, and keeps the session listening until dropped.
    pub(super) fn subscribe(&self) -> StatusFollow {
        StatusFollow {
            // Held before subscribing: a session started for it resyncs to this receiver.
            _need: self.demand.hold(),
            receiver: self.sender.subscribe(),
        }
    }

    /// Follows `task`'s live text from now on.
    pub(super) fn follow_live(&self, task: TaskId) -> LiveFollow {
        let receiver = self
            .live
            .lock()
            .entry(task)
            .or_insert_with(|| broadcast::channel(LIVE_QUEUE).0)
            .subscribe();
        LiveFollow {
            receiver,
            task,
            fanout: self.live.clone(),
        }
    }
}
