//! `GET /v1/replies/{task_id}/events`: Server-Sent Events of a task's state. The current state
//! is sent at once, then each change, and the stream ends after a terminal state.
//!
//! Between its states, a running task's stream carries the text of its current attempt as the
//! provider writes it (`delta` events, each a piece numbered within its attempt, its
//! assignment version): the pieces its worker wrote before the stream (re)connected, read
//! from `reply_live_text`, then each new one as its notification brings it. When the attempt
//! whose text was sent is no longer the task's running one (taken over, given back for a
//! retry, failed, stopped), a `withdrawn` event says its text is void, and the next attempt's
//! starts from empty; a completed task's `status` carries the saved reply, which replaces the
//! text. The text is a hint: it is never read back by anything that decides what is saved.
//!
//! Changes come from PostgreSQL: the task table's trigger notifies every status change, and
//! one listening session per API process ([`super::changes::TaskChanges`]) fans the task ids out to every open
//! stream. A notification is only a hint: a stream re-reads its row on every hint, on every
//! (re)connect and on a timer, so a missed notification can delay an event but never leave a
//! stream hanging. An event is sent when the task's state changes (its status, or a new
//! attempt), not on every write to its row: a lease renewal rewrites the row every few seconds
//! and is nothing a follower needs. `Last-Event-ID` (the id of the last state the client saw)
//! suppresses a state the client already has after a reconnect.
//!
//! Revocation of an API key is immediate for new requests (`401`); a stream opened with the
//! key before it was revoked ends within one re-read ([`REREAD_INTERVAL`]): every re-read also
//! checks the key, in the same round trip. Its reconnect then gets the `401`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use tokio::sync::broadcast;

use super::auth::{Caller, EndUser};
use super::changes::{LiveFollow, LiveHint, StatusFollow};
use super::path::PathParam;
use super::reply_view::ReplyView;
use super::state::ApiState;
use crate::store::Store;
use crate::store::live::LivePiece;
use crate::telemetry;
use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{StoredTask, TaskId, TaskStatus};

/// How often an open stream reads its task (and checks its API key) even without a
/// notification: also the bound on how long a revoked key's stream lives on.
pub const REREAD_INTERVAL: Duration = Duration::from_secs(2);

/// The id of a state: the attempt number and the status, so it changes with every status
/// change (pending → running → pending after a failed attempt → running …) and with a new
/// attempt (a takeover), and not with a lease renewal. The same row gives the same id in every
/// API process, so `Last-Event-ID` works across a reconnect to another one.
fn event_id(task: &StoredTask) -> String {
    format!("{}-{}", task.attempt_count, task.status.as_str())
}

fn event_of(task: &StoredTask) -> Event {
    // A view of plain strings, numbers and dates always serializes.
    Event::default()
        .event("status")
        .id(event_id(task))
        .json_data(ReplyView::of(task))
        .expect("a reply view serializes")
}

/// The id of a piece of live text: `live-<assignment_version>-<seq>`. Sent back as
/// `Last-Event-ID`, the stream goes on after that piece if its attempt still runs.
fn delta_id(version: i64, seq: i32) -> String {
    format!("live-{version}-{seq}")
}

/// The attempt and piece a `Last-Event-ID` of a piece names.
fn parse_delta_id(id: &str) -> Option<(i64, i32)> {
    let (version, seq) = id.strip_prefix("live-")?.split_once('-')?;
    Some((version.parse().ok()?, seq.parse().ok()?))
}

fn delta_event(piece: &LivePiece) -> Event {
    telemetry::api_live_event("delta");
    Event::default()
        .event("delta")
        .id(delta_id(piece.assignment_version, piece.seq))
        .json_data(DeltaData {
            task_id: piece.task_id.to_string(),
            assignment_version: piece.assignment_version,
            seq: piece.seq,
            text: piece.text.clone(),
        })
        .expect("a delta serializes")
}

/// Why an attempt's text was withdrawn, from what the task is now.
fn withdrawal_reason(task: &StoredTask) -> &'static str {
    match task.status {
        TaskStatus::Running => "superseded",
        TaskStatus::Pending => "retrying",
        TaskStatus::Failed => "failed",
        TaskStatus::Cancelled => "cancelled",
        TaskStatus::Completed => "completed",
    }
}

fn withdrawn_event(task: &StoredTask, version: i64) -> Event {
    telemetry::api_live_event("withdrawn");
    Event::default()
        .event("withdrawn")
        .id(format!("withdrawn-{version}"))
        .json_data(WithdrawnData {
            task_id: task.spec.task_id.to_string(),
            assignment_version: version,
            reason: withdrawal_reason(task).to_owned(),
        })
        .expect("a withdrawal serializes")
}

/// The `data` of a `delta` event: the next piece of the running attempt's text.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct DeltaData {
    pub task_id: String,
    /// The attempt (its assignment version) whose text this is: the text of one attempt is
    /// its pieces in order; a piece of another attempt starts another text.
    pub assignment_version: i64,
    /// The piece's number in its attempt: 1, 2, … with no gap and no repeat on one stream.
    pub seq: i32,
    /// The text to append.
    pub text: String,
}

/// The `data` of a `withdrawn` event: the text of an attempt that will not be saved.
#[derive(serde::Serialize, utoipa::ToSchema)]
pub struct WithdrawnData {
    pub task_id: String,
    /// The attempt whose text is void.
    pub assignment_version: i64,
    /// What the task is now: `superseded` (another attempt runs, and its text follows),
    /// `retrying` (it waits for another attempt), `failed`, `cancelled`.
    pub reason: String,
}

/// The attempt whose text this stream has sent (or is about to send).
#[derive(Debug, Clone, Copy)]
struct Shown {
    version: i64,
    /// The number of the next piece to send.
    next_seq: i32,
    /// Whether any piece was sent (only then is there text to withdraw).
    sent_text: bool,
}

/// What a stream was opened with.
enum Credential {
    /// An API key, by its id.
    Key(String),
    /// An end user's token: it ends at its expiry, when the user's tokens are revoked, when
    /// the key that asked for it is, or when a rotation retires its signing secret.
    Token {
        workspace: String,
        key_id: String,
        user: EndUser,
        signing: std::sync::Arc<super::signing::SigningKeys>,
    },
}

impl std::fmt::Display for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::Key(key_id) => write!(f, "API key {key_id}"),
            Credential::Token {
                workspace, user, ..
            } => {
                write!(f, "end user {:?} of {workspace}", user.id)
            }
        }
    }
}

struct Follow {
    store: Store,
    task_id: TaskId,
    /// What the stream was opened with: it ends once that is revoked (or, a token, expired).
    credential: Credential,
    changes: StatusFollow,
    /// The task's live text, when the stream carries it.
    live: Option<LiveFollow>,
    last_sent: Option<String>,
    /// The attempt whose text was sent, from a `Last-Event-ID` of a piece at first.
    shown: Option<Shown>,
    /// A reconnect after a piece of this attempt: its status is not sent again while it runs.
    resumed: Option<i64>,
    /// Events ready to send, in order.
    queue: VecDeque<Event>,
    /// Pieces may have been written that this stream has not heard of (it just started, its
    /// listener resubscribed, it fell behind, a piece came after a gap): the next read of a
    /// running task reads them. Otherwise the notifications bring every piece, and a re-read
    /// costs no read of the pieces.
    missed: bool,
    /// Read the task before waiting again: at the start, and after a hint, the timer or a
    /// piece that needs it. Not after sending a piece the notification brought, which is the
    /// point of carrying the text in it.
    read_next: bool,
    done: bool,
}

/// What woke a waiting stream.
enum Wake {
    /// Read the task (a hint, the timer).
    Read,
    /// Read the task and the pieces of its running attempt (a resync, or this stream fell
    /// behind the pieces' fan-out).
    Missed,
    /// A piece of its live text.
    Piece(Arc<LivePiece>),
}

impl Follow {
    /// The next event the client has not seen, waiting for hints or the timer.
    async fn next(mut self) -> Option<(Result<Event, Infallible>, Self)> {
        loop {
            if let Some(event) = self.queue.pop_front() {
                return Some((Ok(event), self));
            }
            if self.done {
                return None;
            }
            if std::mem::take(&mut self.read_next) {
                match self.read().await {
                    Ok((_, false)) => {
                        tracing::info!(task_id = %self.task_id, credential = %self.credential, "event stream ended: its credential was revoked or expired");
                        return None;
                    }
                    Ok((Some(task), true)) => {
                        let terminal = task.status.is_terminal();
                        self.sync(&task).await;
                        if terminal {
                            // The client has (or is about to get) the terminal state.
                            self.done = true;
                        }
                        if !self.queue.is_empty() || self.done {
                            continue;
                        }
                    }
                    // Deleted under us: nothing more to say.
                    Ok((None, true)) => return None,
                    // The database is away: try again at the next hint or tick.
                    Err(e) => crate::telemetry::store_error("events_read", &e),
                }
            }
            self.read_next = match self.wait().await {
                Wake::Read => true,
                Wake::Missed => {
                    self.missed = true;
                    true
                }
                Wake::Piece(piece) => !self.append(&piece),
            };
        }
    }

    /// Queues what the client lacks of `task`: the withdrawal of text whose attempt no longer
    /// runs, the state if it changed, and the running attempt's pieces not sent yet.
    async fn sync(&mut self, task: &StoredTask) {
        let running = (task.status == TaskStatus::Running).then_some(task.assignment_version);
        if let Some(shown) = self.shown
            && Some(shown.version) != running
        {
            // A completed task's state carries the saved reply, which replaces the text.
            if shown.sent_text && task.status != TaskStatus::Completed {
                self.queue.push_back(withdrawn_event(task, shown.version));
            }
            self.shown = None;
        }
        let id = event_id(task);
        if self.resumed.take().is_some_and(|v| Some(v) == running) {
            self.last_sent = Some(id.clone());
        }
        if self.last_sent.as_deref() != Some(id.as_str()) {
            self.last_sent = Some(id);
            self.queue.push_back(event_of(task));
        }
        let (Some(version), Some(_)) = (running, &self.live) else {
            return;
        };
        if self.shown.is_none() {
            self.missed = true;
        }
        let shown = *self.shown.get_or_insert(Shown {
            version,
            next_seq: 1,
            sent_text: false,
        });
        if !std::mem::take(&mut self.missed) {
            return;
        }
        match self
            .store
            .live_text_after(self.task_id, version, shown.next_seq - 1)
            .await
        {
            Ok(pieces) => {
                for piece in &pieces {
                    self.append(piece);
                }
            }
            Err(e) => {
                self.missed = true;
                crate::telemetry::store_error("live_text_read", &e);
            }
        }
    }

    /// Queues `piece` when it is the next of the attempt whose text is sent; false when the
    /// stream must read to know (another attempt's piece, or one after a gap).
    fn append(&mut self, piece: &LivePiece) -> bool {
        match &mut self.shown {
            Some(shown) if shown.version == piece.assignment_version => {
                if piece.seq < shown.next_seq {
                    return true; // sent already
                }
                if piece.seq > shown.next_seq {
                    self.missed = true;
                    return false; // missed some: read them in order
                }
                shown.next_seq += 1;
                shown.sent_text = true;
                self.queue.push_back(delta_event(piece));
                true
            }
            _ => false,
        }
    }

    /// The task, and whether the stream's credential still holds.
    async fn read(&self) -> Result<(Option<StoredTask>, bool), crate::store::StoreError> {
        match &self.credential {
            Credential::Key(key_id) => self.store.read_followed(self.task_id, key_id).await,
            Credential::Token {
                workspace,
                key_id,
                user,
                signing,
            } => {
                if chrono::Utc::now().timestamp() >= user.expires_at {
                    return Ok((None, false));
                }
                let standing = self
                    .store
                    .token_standing(workspace, &user.id, key_id)
                    .await?;
                let live = standing.key == replyd_core::end_user::AskingKey::Live
                    && standing.generation == user.generation
                    && signing
                        .secret(&self.store, workspace, user.version)
                        .await?
                        .is_some();
                Ok((self.store.read(self.task_id).await?, live))
            }
        }
    }

    async fn wait(&mut self) -> Wake {
        let deadline = tokio::time::sleep(REREAD_INTERVAL);
        tokio::pin!(deadline);
        loop {
            let live = async {
                match &mut self.live {
                    Some(live) => live.receiver.recv().await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                _ = &mut deadline => return Wake::Read,
                hint = live => match hint {
                    Ok(LiveHint::Piece(piece)) => return Wake::Piece(piece),
                    // Pieces may have been missed: read them.
                    Ok(LiveHint::Resync) | Err(broadcast::error::RecvError::Lagged(_)) => {
                        return Wake::Missed;
                    }
                    Err(broadcast::error::RecvError::Closed) => self.live = None,
                },
                hint = self.changes.receiver.recv() => match hint {
                    Ok(Some(task)) if task == self.task_id => return Wake::Read,
                    Ok(Some(_)) => {}
                    // A resync, or this stream fell behind the fan-out: read now.
                    Ok(None) | Err(broadcast::error::RecvError::Lagged(_)) => return Wake::Read,
                    // The fan-out is gone (shutdown): the timer still reads.
                    Err(broadcast::error::RecvError::Closed) => {
                        (&mut deadline).await;
                        return Wake::Read;
                    }
                },
            }
        }
    }
}

fn follow(follow: Follow) -> impl Stream<Item = Result<Event, Infallible>> {
    stream::unfold(follow, Follow::next)
}

/// One event of a follow stream, as its fields arrive (the schema of each event).
#[derive(utoipa::ToSchema)]
#[allow(dead_code)] // documents what `event_of`, `delta_event` and `withdrawn_event` write
pub struct StatusEvent {
    /// `status` (a state), `delta` (a piece of the running attempt's text) or `withdrawn`
    /// (an attempt's text is void).
    #[schema(pattern = "^(status|delta|withdrawn)$")]
    event: String,
    /// A state's id is `<attempt>-<status>` (e.g. `1-running`); a piece's
    /// `live-<assignment_version>-<seq>`; a withdrawal's `withdrawn-<assignment_version>`.
    /// Sent back as `Last-Event-ID`: a state is not sent again; after a piece, the stream
    /// goes on with the next piece of that attempt if it still runs, and otherwise withdraws
    /// its text first.
    id: String,
    /// JSON: for `status`, the task exactly as `GET /v1/replies/{task_id}` shows it (a
    /// `ReplyView`; a completed one carries the saved reply); for `delta`, a `DeltaData`; for
    /// `withdrawn`, a `WithdrawnData`.
    data: String,
}

/// Follow a task: its states as Server-Sent Events, each an `event: status` whose data is the
/// task as `GET /v1/replies/{task_id}` shows it, and the running attempt's text as it is
/// written (`event: delta`, `event: withdrawn`).
#[utoipa::path(
    get,
    operation_id = "followReply",
    path = "/v1/replies/{task_id}/events",
    tag = "replies",
    params(
        super::replies::TaskIdPath,
        ("Last-Event-ID" = Option<String>, Header, description = "The id of the last event the client saw: that state is not sent again; after a piece of text, the stream resumes with the next piece of that attempt (or withdraws it, if it no longer runs)"),
    ),
    responses(
        (status = 200, description = "The current state at once, then each change of status or attempt (not every write: a lease renewal is no event); while an attempt runs, its text as the provider writes it (`delta` events: append each `text` to the text of its `assignment_version`), and a `withdrawn` event when that attempt's text will not be saved (then the next attempt's text starts from empty). A completed state carries the saved reply: show it in place of the text. The stream ends after a terminal state, or within 2 s of its API key's revocation (a reconnect then gets 401). Keep-alive comments every 15 s. The schema is that of each event", body = StatusEvent, content_type = "text/event-stream"),
        super::replies::BadTaskId,
        super::replies::UnknownTask,
    ),
    security(("api_key" = []), ("end_user_token" = []))
)]
pub async fn stream(
    State(state): State<ApiState>,
    caller: Caller,
    PathParam(task_id): PathParam,
    headers: HeaderMap,
) -> Response {
    // Subscribed before the first read, so a change between the read and the wait wakes it.
    let changes = state.changes.subscribe();
    let credential = match &caller.end_user {
        Some(user) => Credential::Token {
            workspace: caller.workspace.clone(),
            key_id: caller.key_id.clone(),
            user: user.clone(),
            signing: state.signing.clone(),
        },
        // The extractor above authenticated this very header.
        None => Credential::Key(
            replyd_core::api_key::parse_bearer(
                headers
                    .get(axum::http::header::AUTHORIZATION)
                    .map(|v| v.as_bytes()),
            )
            .map(|presented| presented.key_id)
            .unwrap_or_default(),
        ),
    };
    let task_id = match super::replies::task_of(&state, &caller, &task_id).await {
        Ok(task) => task.spec.task_id,
        Err(problem) => return problem.into_response(),
    };
    let last_event_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    // After a piece, the client has its attempt's state and text up to it; after anything
    // else, the id is a state's (or a withdrawal's, which leaves the client no text).
    let resumed = last_event_id.as_deref().and_then(parse_delta_id);
    let (last_sent, shown) = match resumed {
        Some((version, seq)) => (
            None,
            Some(Shown {
                version,
                next_seq: seq.saturating_add(1),
                sent_text: true,
            }),
        ),
        None => (last_event_id, None),
    };
    // Subscribed before the first read too: a piece written between the read of the pieces
    // and the wait is heard.
    let live = Some(state.changes.follow_live(task_id));
    Sse::new(follow(Follow {
        store: state.store.clone(),
        task_id,
        credential,
        changes,
        live,
        last_sent,
        shown,
        resumed: resumed.map(|(version, _)| version),
        queue: VecDeque::new(),
        missed: true,
        read_next: true,
        done: false,
    }))
    .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
    .into_response()
}
