//! Live text: the text of the attempts a worker runs, forwarded to the tasks' followers while
//! the provider writes it. The provider's stream hands each piece to its attempt's [`LiveText`]
//! (a [`TextSink`]); one writer per process ([`LiveWriter`]) writes, in rounds, what arrived
//! for all of its streaming attempts: one statement, one transaction and one notifying commit
//! a round (`Store::append_live_pieces`, V30), however many attempts stream and however finely
//! the provider cuts their text. The provider's stream never waits for the database.
//!
//! When a piece goes:
//! - an attempt's first piece once its text has gathered for [`FIRST_PIECE_AFTER`]: a reply
//!   whose whole stream is shorter is never written (its completion shows it whole), so a short
//!   reply costs the database nothing for streaming;
//! - each later one `worker.live_text_interval_ms` after the attempt's previous piece;
//! - a round takes every later piece due within half an interval, so the attempts' pieces
//!   share rounds instead of each making its own, and rounds are at least [`MIN_ROUND_GAP`]
//!   apart, so new streams' first pieces share them too: a worker makes a round or two an
//!   interval while its attempts stream, however many they are.
//!
//! A hint, never state: the saved reply is the generation the call returns, whatever was or
//! was not forwarded. A piece the database refuses (the attempt is no longer the task's
//! running one: taken over, stopped) ends that attempt's forwarding; a round lost to a
//! database error is sent again with the same numbers, and the streams go on.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::provider::TextSink;
use crate::store::live::{MAX_PIECE_BYTES, PieceToWrite};
use crate::store::{Store, StoreError};
use crate::telemetry;
use replyd_core::domain::TaskId;
use replyd_core::provider::Usage;

/// How long an attempt's first text gathers before it is written: below what a reader
/// notices, above the whole stream of a short reply.
pub const FIRST_PIECE_AFTER: Duration = Duration::from_millis(20);

/// The least time between two rounds, however many attempts start streaming: new streams'
/// first pieces share rounds too.
const MIN_ROUND_GAP: Duration = Duration::from_millis(10);

/// Most pieces, and bytes of text, in one round; more waits for the next, at once.
const MAX_ROUND_PIECES: usize = 512;
const MAX_ROUND_BYTES: usize = 1 << 20;

/// The writer's plan, in nanoseconds since its epoch: [`IDLE`] (nothing due), [`SCANNING`]
/// (it is reading what is due: any new text must wake it), or the time it sleeps until.
const IDLE: u64 = u64::MAX;
const SCANNING: u64 = 0;

/// Where a round goes: the database (`Store::append_live_pieces`); a test's recorder.
pub trait Rounds: Send + Sync + 'static {
    /// Writes a round; for each piece, in order, whether it is written (false: fenced).
    fn write<'a>(
        &'a self,
        pieces: &'a [PieceToWrite<'a>],
    ) -> BoxFuture<'a, Result<Vec<bool>, StoreError>>;
}

impl Rounds for Store {
    fn write<'a>(
        &'a self,
        pieces: &'a [PieceToWrite<'a>],
    ) -> BoxFuture<'a, Result<Vec<bool>, StoreError>> {
        Box::pin(self.append_live_pieces(pieces))
    }
}

/// The forwarding of a process's streaming attempts: cheap to clone.
#[derive(Clone)]
pub struct LiveWriter {
    writer: Option<Arc<Writer>>,
}

struct Writer {
    rounds: Box<dyn Rounds>,
    interval: Duration,
    epoch: Instant,
    attempts: Mutex<HashMap<u64, Arc<Attempt>>>,
    next_key: AtomicU64,
    /// When the writer means to wake next (see [`IDLE`], [`SCANNING`]).
    planned: AtomicU64,
    due: Notify,
}

struct Attempt {
    task_id: TaskId,
    version: i64,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// Text not sent yet.
    pending: String,
    /// When `pending` last went from empty to not.
    pending_since: Option<Instant>,
    /// The number of the last piece taken (0: none yet).
    seq: i32,
    /// When the last piece was taken.
    last_sent: Option<Instant>,
    /// A piece whose round failed, sent again as it was (it may have been written: the
    /// database keeps the first and the followers see each number once).
    unsent: Option<(i32, String)>,
    /// More than a piece's worth is pending: the next round takes more at once.
    hurry: bool,
    /// Characters received in all.
    chars: usize,
    /// The usage the provider last reported.
    usage: Option<Usage>,
    /// The database refused a piece: nothing more is forwarded.
    fenced: bool,
}

impl State {
    /// When this attempt's next piece is due, if it has one.
    fn due(&self, interval: Duration) -> Option<Instant> {
        if self.fenced {
            return None;
        }
        if self.unsent.is_some() {
            return self.last_sent.map(|at| at + interval);
        }
        if self.pending.is_empty() {
            return None;
        }
        match self.last_sent {
            None => self.pending_since.map(|since| since + FIRST_PIECE_AFTER),
            Some(at) if self.hurry => Some(at),
            Some(at) => Some(at + interval),
        }
    }

    /// Whether a round at `now` takes this attempt's next piece: due by `horizon`, except a
    /// first piece, which goes no earlier than its time (so a short reply is never written).
    fn ready(&self, interval: Duration, now: Instant, horizon: Instant) -> bool {
        let first = self.last_sent.is_none() && self.unsent.is_none();
        self.due(interval)
            .is_some_and(|due| due <= if first { now } else { horizon })
    }

    /// Takes the next piece to send: the unsent one, or the next of `pending`.
    fn take(&mut self, now: Instant) -> Option<(i32, String)> {
        self.last_sent = Some(now);
        if let Some(unsent) = self.unsent.take() {
            return Some(unsent);
        }
        let piece = take_piece(&mut self.pending);
        self.hurry = !self.pending.is_empty();
        if piece.is_empty() {
            return None;
        }
        self.seq += 1;
        Some((self.seq, piece))
    }
}

/// What the stream of an attempt had when it ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Received {
    pub chars: usize,
    pub usage: Option<Usage>,
}

impl LiveWriter {
    /// Forwards live text in rounds, `interval` apart for each attempt, until `shutdown`;
    /// `interval` None keeps the text to this process (counted, not written).
    pub fn new(
        rounds: impl Rounds,
        interval: Option<Duration>,
        shutdown: CancellationToken,
    ) -> Self {
        let Some(interval) = interval else {
            return Self { writer: None };
        };
        let writer = Arc::new(Writer {
            rounds: Box::new(rounds),
            interval,
            epoch: Instant::now(),
            attempts: Mutex::default(),
            next_key: AtomicU64::new(0),
            planned: AtomicU64::new(IDLE),
            due: Notify::new(),
        });
        tokio::spawn(Arc::clone(&writer).run(shutdown));
        Self {
            writer: Some(writer),
        }
    }

    /// Starts forwarding the text of `task_id`'s attempt `version`.
    pub fn start(&self, task_id: TaskId, version: i64) -> LiveText {
        let attempt = Arc::new(Attempt {
            task_id,
            version,
            state: Mutex::default(),
        });
        let registered = self.writer.as_ref().map(|writer| {
            let key = writer.next_key.fetch_add(1, Ordering::Relaxed);
            lock(&writer.attempts).insert(key, Arc::clone(&attempt));
            (Arc::clone(writer), key)
        });
        LiveText {
            attempt,
            registered,
        }
    }
}

/// The forwarding of one attempt's text. Dropping it stops it; what was not sent yet is not
/// (the task's end, or the next attempt, is what the followers see next).
pub struct LiveText {
    attempt: Arc<Attempt>,
    registered: Option<(Arc<Writer>, u64)>,
}

impl LiveText {
    /// What the stream had so far.
    pub fn received(&self) -> Received {
        let state = lock(&self.attempt.state);
        Received {
            chars: state.chars,
            usage: state.usage,
        }
    }
}

impl Drop for LiveText {
    fn drop(&mut self) {
        if let Some((writer, key)) = &self.registered {
            lock(&writer.attempts).remove(key);
        }
    }
}

impl TextSink for LiveText {
    fn text(&self, delta: &str) {
        let due = {
            let mut state = lock(&self.attempt.state);
            state.chars += delta.chars().count();
            if state.fenced || self.registered.is_none() {
                return;
            }
            let was_due = state.due(Duration::ZERO).is_some();
            if state.pending.is_empty() {
                state.pending_since = Some(Instant::now());
            }
            state.pending.push_str(delta);
            if was_due {
                return;
            }
            state.due(
                self.registered
                    .as_ref()
                    .map_or(Duration::ZERO, |r| r.0.interval),
            )
        };
        if let (Some(due), Some((writer, _))) = (due, &self.registered) {
            writer.wake_by(due);
        }
    }

    fn usage(&self, usage: Usage) {
        lock(&self.attempt.state).usage = Some(usage);
    }
}

impl Writer {
    /// Wakes the writer if `due` comes before the time it means to wake.
    fn wake_by(&self, due: Instant) {
        let planned = self.planned.load(Ordering::SeqCst);
        if planned == SCANNING || self.nanos(due) < planned {
            self.due.notify_one();
        }
    }

    fn nanos(&self, at: Instant) -> u64 {
        // Never SCANNING: a time is at least 1.
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos())
            .unwrap_or(IDLE - 1)
            .max(1)
    }

    /// The attempts now registered.
    fn attempts(&self) -> Vec<Arc<Attempt>> {
        lock(&self.attempts).values().cloned().collect()
    }

    /// Waits for what is due, sends it as one round, again until `shutdown`.
    async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        let mut earliest = Instant::now();
        loop {
            self.planned.store(SCANNING, Ordering::SeqCst);
            let next = self
                .attempts()
                .iter()
                .filter_map(|a| lock(&a.state).due(self.interval))
                .min()
                .map(|due| due.max(earliest));
            let now = Instant::now();
            match next {
                Some(at) if at <= now => {
                    self.planned.store(self.nanos(now), Ordering::SeqCst);
                    self.round(now + self.interval / 2).await;
                    earliest = now + MIN_ROUND_GAP;
                    continue;
                }
                Some(at) => self.planned.store(self.nanos(at), Ordering::SeqCst),
                None => self.planned.store(IDLE, Ordering::SeqCst),
            }
            let sleep = async {
                match next {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = shutdown.cancelled() => return,
                () = sleep => {}
                () = self.due.notified() => {}
            }
        }
    }

    /// Sends, as one round, every piece due by `horizon`.
    async fn round(&self, horizon: Instant) {
        let now = Instant::now();
        let mut taken: Vec<(Arc<Attempt>, i32, String)> = Vec::new();
        let mut bytes = 0;
        for attempt in self.attempts() {
            if taken.len() >= MAX_ROUND_PIECES || bytes >= MAX_ROUND_BYTES {
                break;
            }
            let mut state = lock(&attempt.state);
            if !state.ready(self.interval, now, horizon) {
                continue;
            }
            if let Some((seq, text)) = state.take(now) {
                drop(state);
                bytes += text.len();
                taken.push((attempt, seq, text));
            }
        }
        if taken.is_empty() {
            return;
        }
        let pieces: Vec<PieceToWrite<'_>> = taken
            .iter()
            .map(|(attempt, seq, text)| PieceToWrite {
                task_id: attempt.task_id,
                assignment_version: attempt.version,
                seq: *seq,
                text,
            })
            .collect();
        match self.rounds.write(&pieces).await {
            Ok(written) => {
                for ((attempt, _, text), written) in taken.into_iter().zip(written) {
                    if written {
                        telemetry::live_text_piece("written", text.len());
                    } else {
                        telemetry::live_text_piece("fenced", text.len());
                        let mut state = lock(&attempt.state);
                        state.fenced = true;
                        state.pending.clear();
                    }
                }
            }
            Err(e) => {
                telemetry::store_error("live_text", &e);
                for (attempt, seq, text) in taken {
                    telemetry::live_text_piece("error", text.len());
                    lock(&attempt.state).unsent = Some((seq, text));
                }
            }
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

fn lock<T>(state: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding this lock leaves plain data behind: keep using it.
    state.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A round as the recorder got it: (task, version, seq, text) for each piece.
    type Round = Vec<(TaskId, i64, i32, String)>;

    /// Records rounds; refuses the pieces of `fenced` tasks, fails the next `failing` rounds.
    #[derive(Clone, Default)]
    struct Recorder {
        rounds: Arc<Mutex<Vec<Round>>>,
        fenced: Arc<Mutex<Vec<TaskId>>>,
        failing: Arc<AtomicU64>,
    }

    impl Rounds for Recorder {
        fn write<'a>(
            &'a self,
            pieces: &'a [PieceToWrite<'a>],
        ) -> BoxFuture<'a, Result<Vec<bool>, StoreError>> {
            Box::pin(async move {
                // A round takes a moment, as a statement does.
                tokio::time::sleep(Duration::from_millis(2)).await;
                if self.failing.load(Ordering::SeqCst) > 0 {
                    self.failing.fetch_sub(1, Ordering::SeqCst);
                    return Err(StoreError::Batch("connection lost".into()));
                }
                let fenced = lock(&self.fenced).clone();
                lock(&self.rounds).push(
                    pieces
                        .iter()
                        .map(|p| (p.task_id, p.assignment_version, p.seq, p.text.to_owned()))
                        .collect(),
                );
                Ok(pieces
                    .iter()
                    .map(|p| !fenced.contains(&p.task_id))
                    .collect())
            })
        }
    }

    impl Recorder {
        fn rounds(&self) -> Vec<Round> {
            lock(&self.rounds).clone()
        }

        /// The pieces sent for `task`, in the order sent, with their numbers.
        fn sent(&self, task: TaskId) -> Vec<(i32, String)> {
            self.rounds()
                .into_iter()
                .flatten()
                .filter(|p| p.0 == task)
                .map(|p| (p.2, p.3))
                .collect()
        }
    }

    const INTERVAL: Duration = Duration::from_millis(75);

    fn writer(recorder: &Recorder) -> LiveWriter {
        LiveWriter::new(recorder.clone(), Some(INTERVAL), CancellationToken::new())
    }

    /// Streams `deltas` pieces of text into `live`, one every `every`.
    async fn stream(live: &LiveText, deltas: usize, every: Duration) -> String {
        let mut all = String::new();
        for n in 0..deltas {
            let delta = format!("w{n} ");
            live.text(&delta);
            all.push_str(&delta);
            tokio::time::sleep(every).await;
        }
        all
    }

    #[tokio::test(start_paused = true)]
    async fn a_reply_whose_stream_ends_before_its_first_piece_is_due_costs_no_round() {
        let recorder = Recorder::default();
        let writer = writer(&recorder);
        for _ in 0..50 {
            let live = writer.start(TaskId::new_random(), 1);
            stream(&live, 3, Duration::from_millis(5)).await;
            assert_eq!(live.received().chars, 9);
            drop(live);
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(recorder.rounds(), Vec::<Round>::new());
    }

    #[tokio::test(start_paused = true)]
    async fn streaming_attempts_share_rounds_and_each_sends_its_text_once_in_order() {
        let recorder = Recorder::default();
        let writer = writer(&recorder);
        let tasks: Vec<TaskId> = (0..8).map(|_| TaskId::new_random()).collect();
        let streams = tasks.iter().enumerate().map(|(n, task)| {
            let live = writer.start(*task, 3);
            async move {
                // Each starts a little after the one before.
                tokio::time::sleep(Duration::from_millis(7 * n as u64)).await;
                let text = stream(&live, 100, Duration::from_millis(10)).await;
                // Let the last piece go before the attempt ends.
                tokio::time::sleep(INTERVAL * 2).await;
                text
            }
        });
        let texts = futures_util::future::join_all(streams).await;
        for (task, text) in tasks.iter().zip(texts) {
            let sent = recorder.sent(*task);
            let numbers: Vec<i32> = sent.iter().map(|p| p.0).collect();
            assert_eq!(numbers, (1..=numbers.len() as i32).collect::<Vec<_>>());
            let joined: String = sent.into_iter().map(|p| p.1).collect();
            assert_eq!(joined, text);
        }
        // About a second of text each: a round or two an interval for all eight, not a
        // statement for each attempt's every piece.
        let rounds = recorder.rounds();
        let pieces: usize = rounds.iter().map(Vec::len).sum();
        assert!(rounds.len() <= 2 * 16 + 2, "{} rounds", rounds.len());
        assert!(pieces >= 8 * 10, "{pieces} pieces");
        assert!(
            pieces >= rounds.len() * 4,
            "{pieces} pieces in {} rounds",
            rounds.len()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_attempt_sends_no_more_and_the_others_go_on() {
        let recorder = Recorder::default();
        let writer = writer(&recorder);
        let (zombie, other) = (TaskId::new_random(), TaskId::new_random());
        lock(&recorder.fenced).push(zombie);
        let (a, b) = (writer.start(zombie, 1), writer.start(other, 2));
        let (_, text) = tokio::join!(
            stream(&a, 50, Duration::from_millis(10)),
            stream(&b, 50, Duration::from_millis(10))
        );
        tokio::time::sleep(INTERVAL * 2).await;
        assert_eq!(recorder.sent(zombie).len(), 1, "refused at its first piece");
        let joined: String = recorder.sent(other).into_iter().map(|p| p.1).collect();
        assert_eq!(joined, text);
        assert_eq!(a.received().chars, text.chars().count(), "still counted");
    }

    #[tokio::test(start_paused = true)]
    async fn a_round_lost_to_an_error_is_sent_again_with_the_same_numbers() {
        let recorder = Recorder::default();
        recorder.failing.store(2, Ordering::SeqCst);
        let writer = writer(&recorder);
        let task = TaskId::new_random();
        let live = writer.start(task, 1);
        let text = stream(&live, 40, Duration::from_millis(10)).await;
        tokio::time::sleep(INTERVAL * 3).await;
        let sent = recorder.sent(task);
        let numbers: Vec<i32> = sent.iter().map(|p| p.0).collect();
        assert_eq!(numbers, (1..=numbers.len() as i32).collect::<Vec<_>>());
        assert_eq!(sent.into_iter().map(|p| p.1).collect::<String>(), text);
    }

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

    #[test]
    fn a_first_piece_waits_to_gather_and_later_ones_an_interval_after_the_last() {
        let interval = Duration::from_millis(75);
        let t0 = Instant::now();
        let mut state = State::default();
        assert_eq!(state.due(interval), None, "nothing pending");
        state.pending = "Hel".into();
        state.pending_since = Some(t0);
        assert_eq!(state.due(interval), Some(t0 + FIRST_PIECE_AFTER));

        let sent = t0 + FIRST_PIECE_AFTER;
        assert_eq!(state.take(sent), Some((1, "Hel".into())));
        assert_eq!(state.due(interval), None, "all sent");
        state.pending = "lo".into();
        assert_eq!(state.due(interval), Some(sent + interval));

        // A round lost to an error: the same piece, same number, an interval later.
        let again = sent + interval;
        let piece = state.take(again).unwrap();
        assert_eq!(piece, (2, "lo".into()));
        state.unsent = Some(piece);
        state.pending = " world".into();
        assert_eq!(state.due(interval), Some(again + interval));
        assert_eq!(state.take(again + interval), Some((2, "lo".into())));
        assert_eq!(state.take(again + interval), Some((3, " world".into())));

        // A round a little early takes a later piece along, never a first one.
        let soon = again + interval * 2 - interval / 8;
        state.pending = "!".into();
        assert!(state.ready(interval, soon, soon + interval / 4));
        assert!(!state.ready(interval, soon, soon));
        let mut first = State {
            pending: "Hi".into(),
            pending_since: Some(soon),
            ..State::default()
        };
        assert!(!first.ready(interval, soon, soon + interval));
        assert!(first.ready(interval, soon + FIRST_PIECE_AFTER, soon + FIRST_PIECE_AFTER));
        first.pending.clear();

        // Refused: nothing more is due.
        state.pending = "more".into();
        state.fenced = true;
        assert_eq!(state.due(interval), None);
    }

    #[test]
    fn more_than_a_piece_pending_is_due_again_at_once() {
        let interval = Duration::from_millis(75);
        let t0 = Instant::now();
        let mut state = State {
            pending: "a".repeat(MAX_PIECE_BYTES + 10),
            pending_since: Some(t0),
            ..State::default()
        };
        let (seq, piece) = state.take(t0).unwrap();
        assert_eq!((seq, piece.len()), (1, MAX_PIECE_BYTES));
        assert_eq!(state.due(interval), Some(t0), "the rest goes at once");
        let (seq, piece) = state.take(t0).unwrap();
        assert_eq!((seq, piece.len()), (2, 10));
        assert_eq!(state.due(interval), None);
    }
}
