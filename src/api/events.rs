//! `GET /v1/replies/{task_id}/events`: Server-Sent Events of a task's state. The current state
//! is sent at once, then each change, and the stream ends after a terminal state.
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

use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, Stream};
use tokio::sync::broadcast;

use super::auth::{Caller, EndUser};
use super::problem::ProblemDetails;
use super::replies::ReplyView;
use super::state::ApiState;
use crate::store::Store;
use replyd_core::domain::{StoredTask, TaskId};

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

/// What a stream was opened with.
enum Credential {
    /// An API key, by its id.
    Key(String),
    /// An end user's token: it ends at its expiry or when the user's tokens are revoked.
    Token { workspace: String, user: EndUser },
}

impl std::fmt::Display for Credential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Credential::Key(key_id) => write!(f, "API key {key_id}"),
            Credential::Token { workspace, user } => {
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
    changes: broadcast::Receiver<Option<TaskId>>,
    last_sent: Option<String>,
    done: bool,
}

impl Follow {
    /// The next state the client has not seen, waiting for hints or the timer.
    async fn next(mut self) -> Option<(Result<Event, Infallible>, Self)> {
        loop {
            if self.done {
                return None;
            }
            match self.read().await {
                Ok((_, false)) => {
                    tracing::info!(task_id = %self.task_id, credential = %self.credential, "event stream ended: its credential was revoked or expired");
                    return None;
                }
                Ok((Some(task), true)) => {
                    let id = event_id(&task);
                    if self.last_sent.as_deref() != Some(id.as_str()) {
                        self.done = task.status.is_terminal();
                        self.last_sent = Some(id);
                        return Some((Ok(event_of(&task)), self));
                    }
                    if task.status.is_terminal() {
                        return None; // the client has the terminal state
                    }
                }
                // Deleted under us: nothing more to say.
                Ok((None, true)) => return None,
                // The database is away: try again at the next hint or tick.
                Err(e) => crate::telemetry::store_error("events_read", &e),
            }
            self.wait().await;
        }
    }

    /// The task, and whether the stream's credential still holds.
    async fn read(&self) -> Result<(Option<StoredTask>, bool), crate::store::StoreError> {
        match &self.credential {
            Credential::Key(key_id) => self.store.read_followed(self.task_id, key_id).await,
            Credential::Token { workspace, user } => {
                if chrono::Utc::now().timestamp() >= user.expires_at {
                    return Ok((None, false));
                }
                let check = self.store.token_check(workspace, &user.id).await?;
                let live = check.is_some_and(|c| c.generation == user.generation);
                Ok((self.store.read(self.task_id).await?, live))
            }
        }
    }

    async fn wait(&mut self) {
        let deadline = tokio::time::sleep(REREAD_INTERVAL);
        tokio::pin!(deadline);
        loop {
            tokio::select! {
                _ = &mut deadline => return,
                hint = self.changes.recv() => match hint {
                    Ok(Some(task)) if task == self.task_id => return,
                    Ok(Some(_)) => {}
                    // A resync, or this stream fell behind the fan-out: read now.
                    Ok(None) | Err(broadcast::error::RecvError::Lagged(_)) => return,
                    // The fan-out is gone (shutdown): the timer still reads.
                    Err(broadcast::error::RecvError::Closed) => {
                        (&mut deadline).await;
                        return;
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
#[allow(dead_code)] // documents what `event_of` writes
pub struct StatusEvent {
    /// Always `status`.
    #[schema(pattern = "^status$")]
    event: String,
    /// This state's id (`<attempt>-<status>`, e.g. `1-running`): sent back as
    /// `Last-Event-ID`, that state is not sent again.
    id: String,
    /// The task as JSON, exactly as `GET /v1/replies/{task_id}` shows it (a `ReplyView`).
    data: String,
}

/// Follow a task: its states as Server-Sent Events, each an `event: status` whose data is the
/// task as `GET /v1/replies/{task_id}` shows it.
#[utoipa::path(
    get,
    operation_id = "followReply",
    path = "/v1/replies/{task_id}/events",
    tag = "replies",
    params(
        super::replies::TaskIdPath,
        ("Last-Event-ID" = Option<String>, Header, description = "The id of the last event the client saw: that state is not sent again"),
    ),
    responses(
        (status = 200, description = "The current state at once, then each change of status or attempt (not every write: a lease renewal is no event); the stream ends after a terminal state, or within 2 s of its API key's revocation (a reconnect then gets 401). Keep-alive comments every 15 s. The schema is that of each event", body = StatusEvent, content_type = "text/event-stream"),
        (status = 400, description = "The task id is not a UUID", body = ProblemDetails, content_type = "application/problem+json"),
        (status = 404, description = "No such task in the caller's workspace (for an end user's token, in its user's conversations)", body = ProblemDetails, content_type = "application/problem+json"),
    ),
    security(("api_key" = []), ("end_user_token" = []))
)]
pub async fn stream(
    State(state): State<ApiState>,
    caller: Caller,
    Path(task_id): Path<String>,
    headers: HeaderMap,
) -> Response {
    // Subscribed before the first read, so a change between the read and the wait wakes it.
    let changes = state.changes.subscribe();
    let credential = match &caller.end_user {
        Some(user) => Credential::Token {
            workspace: caller.workspace.clone(),
            user: user.clone(),
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
    let last_sent = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    Sse::new(follow(Follow {
        store: state.store.clone(),
        task_id,
        credential,
        changes,
        last_sent,
        done: false,
    }))
    .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
    .into_response()
}
