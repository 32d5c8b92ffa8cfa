//! Live text: the text of the attempt a worker runs, forwarded to the task's followers while
//! the provider writes it. The provider's stream hands each piece to [`LiveText`] (a
//! [`TextSink`]); a writer task writes the first piece at once, then coalesces what arrived
//! within `worker.live_text_interval_ms` into one piece and writes it (`Store::append_live_text`: a row and a notification, one
//! statement), so a reply costs about one statement per interval however finely the provider
//! cuts it, and the provider's stream never waits for the database.
//!
//! A hint, never state: the saved reply is the generation the call returns, whatever was or
//! was not forwarded. A piece the database refuses (the attempt is no longer the task's
//! running one: taken over, stopped) ends the forwarding; a piece lost to a database error is
//! sent again with the same number, and the stream goes on.

use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::provider::TextSink;
use crate::store::Store;
use crate::store::live::MAX_PIECE_BYTES;
use crate::telemetry;
use replyd_core::domain::TaskId;
use replyd_core::provider::Usage;

/// The forwarding of one attempt's text. Dropping it stops the writer; what was not written
/// yet is not (the task's end, or the next attempt, is what the followers see next).
pub struct LiveText {
    shared: Arc<Shared>,
    stop: CancellationToken,
}

#[derive(Default)]
struct Shared {
    state: Mutex<State>,
    arrived: Notify,
}

#[derive(Default)]
struct State {
    /// Text not written yet.
    pending: String,
    /// Characters received in all.
    chars: usize,
    /// The usage the provider last reported.
    usage: Option<Usage>,
    /// The database refused a piece: nothing more is forwarded.
    fenced: bool,
}

/// What the stream of an attempt had when it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    pub chars: usize,
    pub usage: Option<Usage>,
}

impl LiveText {
    /// Starts forwarding the text of `task_id`'s attempt `version`; `interval` None keeps the
    /// text to this process (counted, not written).
    pub fn start(store: Store, task_id: TaskId, version: i64, interval: Option<Duration>) -> Self {
        let shared = Arc::new(Shared::default());
        let stop = CancellationToken::new();
        if let Some(interval) = interval {
            tokio::spawn(write(
                store,
                task_id,
                version,
                interval,
                Arc::clone(&shared),
                stop.clone(),
            ));
        }
        Self { shared, stop }
    }

    /// What the stream had so far.
    pub fn received(&self) -> Received {
        let state = lock(&self.shared.state);
        Received {
            chars: state.chars,
            usage: state.usage,
        }
    }
}

impl Drop for LiveText {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl TextSink for LiveText {
    fn text(&self, delta: &str) {
        let mut state = lock(&self.shared.state);
        state.chars += delta.chars().count();
        if !state.fenced {
            state.pending.push_str(delta);
            self.shared.arrived.notify_one();
        }
    }

    fn usage(&self, usage: Usage) {
        lock(&self.shared.state).usage = Some(usage);
    }
}

/// The writer: waits for text, lets more gather for `interval`, writes it as one piece (at
/// most [`MAX_PIECE_BYTES`]; more waits for the next round), until stopped or fenced.
async fn write(
    store: Store,
    task_id: TaskId,
    version: i64,
    interval: Duration,
    shared: Arc<Shared>,
    stop: CancellationToken,
) {
    let mut seq = 0;
    // A piece whose write failed, sent again as it was (it may have been written: the
    // database keeps the first and the followers see each number once).
    let mut unsent: Option<String> = None;
    loop {
        if unsent.is_none() {
            tokio::select! {
                _ = stop.cancelled() => return,
                () = shared.arrived.notified() => {}
            }
        }
        // The first piece goes at once: the followers' first text waits for the provider's
        // first tokens only. Later ones gather for an interval.
        if seq > 0 {
            tokio::select! {
                _ = stop.cancelled() => return,
                () = tokio::time::sleep(interval) => {}
            }
        }
        let piece = match unsent.take() {
            Some(piece) => piece,
            None => {
                seq += 1;
                take_piece(&mut lock(&shared.state).pending)
            }
        };
        if piece.is_empty() {
            seq -= 1;
            continue;
        }
        match store.append_live_text(task_id, version, seq, &piece).await {
            Ok(true) => telemetry::live_text_piece("written", piece.len()),
            Ok(false) => {
                telemetry::live_text_piece("fenced", piece.len());
                let mut state = lock(&shared.state);
                state.fenced = true;
                state.pending.clear();
                return;
            }
            Err(e) => {
                telemetry::live_text_piece("error", piece.len());
                telemetry::store_error("live_text", &e);
                unsent = Some(piece);
            }
        }
        // More than one piece's worth arrived: the next round writes it without waiting for
        // new text.
        if !lock(&shared.state).pending.is_empty() {
            shared.arrived.notify_one();
        }
    }
}

/// Takes the first piece of `pending`: all of it, or at most [`MAX_PIECE_BYTES`] cut at a
/// character boundary.
fn take_piece(pending: &mut String) -> String {
    if pending.len() <= MAX_PIECE_BYTES {
        return std::mem::take(pending);
    }
    let mut cut = MAX_PIECE_BYTES;
    while !pending.is_char_boundary(cut) {
        cut -= 1;
    }
    let rest = pending.split_off(cut);
    std::mem::replace(pending, rest)
}

fn lock(state: &Mutex<State>) -> MutexGuard<'_, State> {
    // A panic while holding this lock leaves plain data behind: keep using it.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_piece_is_cut_at_a_character_boundary_under_the_notification_limit() {
        let mut pending = "é".repeat(MAX_PIECE_BYTES); // two bytes each
        let first = take_piece(&mut pending);
        assert!(first.len() <= MAX_PIECE_BYTES);
        assert_eq!(first.len(), MAX_PIECE_BYTES);
        assert_eq!(
            first.chars().count() + pending.chars().count(),
            MAX_PIECE_BYTES
        );

        let mut pending = format!("a{}", "é".repeat(MAX_PIECE_BYTES / 2));
        let first = take_piece(&mut pending);
        assert_eq!(first.len(), MAX_PIECE_BYTES - 1);
        assert!(pending.starts_with('é'));

        let mut short = String::from("hello");
        assert_eq!(take_piece(&mut short), "hello");
        assert!(short.is_empty());
    }
}
