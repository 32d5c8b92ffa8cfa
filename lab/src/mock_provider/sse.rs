//! The sending of the mock's streamed answers: a 200 `text/event-stream` answered at once, then
//! the events of a [`Course`] (chat completions, messages) at the offsets its [`Pace`] gives
//! them, or of a background response's log as it grows, and the end the course says: closed,
//! cut, or stalled then cut.
//!
//! Each stream is sent by a spawned task through a small channel whose other end is the body
//! hyper writes, so the task learns that its client left when the channel closes, and a cut is
//! a real one: the body fails, and hyper aborts the connection without the chunked body's
//! terminator, as a dropped connection looks to the client.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::{Body, Bytes};
use axum::http::{HeaderValue, header};
use axum::response::{IntoResponse, Response};
use tokio::sync::mpsc;

use super::background::Replay;
use super::behaviour::Fault;
use super::pace::Pace;
use super::server::{Admitted, InFlight, MockState, ShuttingDown, finish_unless_asked, lock};
use super::stream::{Course, Event, Part, StreamEnd, stream_break};

/// Events buffered between a stream's task and hyper.
const BUFFERED_EVENTS: usize = 16;

/// What a stream's task hands to the body.
enum Piece {
    Frame(Bytes),
    /// Fail the body, which aborts the connection.
    Cut,
}

/// The client left: nothing more can be sent.
pub(super) struct Left;

/// The sending end of a streamed answer, and the counters it moves.
struct Pipe {
    state: Arc<MockState>,
    tx: mpsc::Sender<Piece>,
    /// `stream_split_data` as the stream began.
    split_data: bool,
}

impl Pipe {
    /// A new stream, counted as started, and the answer whose body it feeds.
    fn open(state: &Arc<MockState>) -> (Self, Response) {
        state.stream_started();
        let (tx, rx) = mpsc::channel(BUFFERED_EVENTS);
        let pipe = Self {
            state: Arc::clone(state),
            tx,
            split_data: lock(&state.faults).stream_split_data,
        };
        (pipe, event_stream(rx))
    }

    /// Resolves when the client has left.
    async fn left(&self) {
        self.tx.closed().await;
    }

    async fn send(&self, event: &Event) -> Result<(), Left> {
        let sse = if self.split_data {
            event.split_in_two_lines().to_sse()
        } else {
            event.to_sse()
        };
        self.tx
            .send(Piece::Frame(Bytes::from(sse)))
            .await
            .map_err(|_| Left)
    }

    /// Sends `course`'s events, its first token being now: the head at once, each delta and
    /// then the close at its offset in `pace`; then ends it as it says. A shutdown cuts it; a
    /// client that leaves while it waits is seen at once, not at the next event.
    async fn play(self, course: Course, pace: Pace) -> Result<(), Left> {
        let first_token = Instant::now();
        let mut deltas = 0;
        for event in &course.events {
            let offset = match event.part {
                Part::Head => Duration::ZERO,
                Part::Delta => pace.delta_offset(deltas),
                Part::Tail => pace.tail_offset(deltas),
            };
            let paused = tokio::select! {
                paused = self.state.pause_until(first_token, offset) => paused,
                () = self.left() => return Err(Left),
            };
            if paused.is_err() {
                return self.end(StreamEnd::Cut).await;
            }
            deltas += usize::from(event.part == Part::Delta);
            self.send(event).await?;
        }
        self.end(course.end).await
    }

    /// Ends the stream as `end` says, counting it: closed, cut, or silent for the stall and
    /// then cut (a shutdown ends the stall early).
    async fn end(self, end: StreamEnd) -> Result<(), Left> {
        self.state.stream_ended(end);
        match end {
            // Dropping the sender ends the body cleanly.
            StreamEnd::Completed | StreamEnd::Errored => Ok(()),
            StreamEnd::Cut => self.cut().await,
            StreamEnd::Stalled(stall) => {
                tokio::select! {
                    _ = self.state.pause(stall) => {}
                    () = self.left() => return Err(Left),
                }
                self.cut().await
            }
        }
    }

    async fn cut(self) -> Result<(), Left> {
        self.tx.send(Piece::Cut).await.map_err(|_| Left)
    }
}

/// A 200 `text/event-stream` whose body is what arrives on `rx`.
fn event_stream(rx: mpsc::Receiver<Piece>) -> Response {
    let pieces = futures_util::stream::unfold(rx, |mut rx| async move {
        match rx.recv().await? {
            Piece::Frame(frame) => Some((Ok(frame), rx)),
            Piece::Cut => {
                // Lets hyper flush what was sent before the failure, so the client sees its
                // events and then a broken connection.
                tokio::task::yield_now().await;
                Some((
                    Err(std::io::Error::new(
                        std::io::ErrorKind::ConnectionAborted,
                        "mock provider: stream cut",
                    )),
                    rx,
                ))
            }
        }
    });
    (
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/event-stream; charset=utf-8"),
            ),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        ],
        Body::from_stream(pieces),
    )
        .into_response()
}

/// Answers 200 with an event stream at once (with `admitted`'s rate-limit headers), then sends
/// the course of what `work` produced once it has (without its final event under
/// `stream_without_final_event`), paced as a generation of `latency` is. `work` waits only
/// the time to first token ([`StreamPacing::first_token`]), so the stream closes at about
/// `latency` after it began, as a whole answer is sent. The request stays in flight and in
/// progress until its stream ends. A client that leaves stops receiving (counted as
/// cancelled); its work goes on to its end unless `cancel_on_disconnect`, as for an answer
/// sent whole. A shutdown before the work is done cuts the stream.
///
/// [`StreamPacing::first_token`]: super::pace::StreamPacing::first_token
pub(super) fn stream_answer<T: Send + 'static>(
    state: &Arc<MockState>,
    admitted: Admitted,
    in_flight: InFlight,
    latency: Duration,
    work: impl Future<Output = Result<T, ShuttingDown>> + Send + 'static,
    course_of: impl FnOnce(T) -> Course + Send + 'static,
) -> Response {
    let (pipe, response) = Pipe::open(state);
    let response = admitted.decorate(response);
    let state = Arc::clone(state);
    let pacing = state.stream_pacing();
    tokio::spawn(async move {
        let _in_progress = admitted;
        let produced = tokio::select! {
            produced = finish_unless_asked(&state, work) => produced,
            () = pipe.left() => return,
        };
        let without_final_event = lock(&state.faults).stream_without_final_event;
        let course = match produced {
            Ok(produced) if without_final_event => course_of(produced).without_final_event(),
            Ok(produced) => course_of(produced),
            Err(ShuttingDown) => Course {
                events: Vec::new(),
                end: StreamEnd::Cut,
                text_deltas: 0,
            },
        };
        let pace = pacing.pace(latency, course.text_deltas);
        if pipe.play(course, pace).await.is_ok() {
            in_flight.done();
        }
    });
    response
}

/// Answers 200 with the event stream of background response `id` from sequence number `from`
/// on: the events it has, then each as its generation records it, until it ends. `fault`
/// breaks this connection only; the response goes on.
pub(super) fn follow_response(
    state: &Arc<MockState>,
    id: String,
    from: u64,
    fault: Fault,
) -> Response {
    let (pipe, response) = Pipe::open(state);
    let state = Arc::clone(state);
    tokio::spawn(async move {
        // A client that left needs nothing more.
        let _ = follow(&state, pipe, &id, from, fault).await;
    });
    response
}

async fn follow(
    state: &MockState,
    pipe: Pipe,
    id: &str,
    mut next: u64,
    fault: Fault,
) -> Result<(), Left> {
    let broken = stream_break(fault);
    let mut deltas = 0;
    loop {
        // Watched before reading, so an event recorded after the read wakes this stream.
        let changes = state.changes(id);
        let Replay::Events { events, ended } = state.replay(id, next) else {
            // Forgotten after its retention while this stream was behind.
            return pipe.end(StreamEnd::Cut).await;
        };
        for event in &events {
            if let Some(broken) = broken
                && broken.strike.before(event.part, deltas)
            {
                return pipe.end(broken.end).await;
            }
            pipe.send(event).await?;
            deltas += usize::from(event.part == Part::Delta);
            next += 1;
        }
        if let Some(end) = ended {
            return pipe.end(end).await;
        }
        // A response no generation records any more has ended, so the read above saw it end;
        // the cut is only there should that ever not hold.
        let Some(mut changes) = changes else {
            return pipe.end(StreamEnd::Cut).await;
        };
        tokio::select! {
            // An error means the generation is done: the next read finds the end.
            _ = changes.changed() => {}
            () = pipe.left() => return Err(Left),
        }
    }
}
