//! Notification listeners: one PostgreSQL session that `LISTEN`s on a channel and hands each
//! payload to a [`Listener`]. The worker's relays `replyd_task_status` (sent by the task
//! table's trigger, see `migrations/V3`) to the records parked on a task whose lease ended
//! (`crate::worker::parking`); the API's fans it out to the event streams; the outbox
//! relay's wakes on `replyd_outbox`.
//!
//! Notifications are hints. A lost one (the session dropped, the server restarted) costs only
//! time: parked records still wake at their lease end, and every (re)connection wakes all
//! parked records once, because notifications sent while nobody listened are gone.

use std::time::Duration;

use futures_util::StreamExt;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use crate::store::DatabaseSettings;
use crate::store::{StoreError, session_config, target_of, tls_connector};
use crate::telemetry::{self, RepeatedFailure};
use replyd_core::domain::{TaskId, TaskStatus};

/// The channel the trigger notifies.
pub const TASK_STATUS_CHANNEL: &str = "replyd_task_status";

/// Parses a notification payload, `<task_id> <status>`.
pub fn parse_status_payload(payload: &str) -> Option<(TaskId, TaskStatus)> {
    let (id, status) = payload.split_once(' ')?;
    Some((TaskId::parse(id).ok()?, TaskStatus::parse(status)?))
}

/// What a listener does with its channels' messages.
pub trait Listener: Send {
    /// The session listens (again): anything sent while it did not is gone.
    fn listening(&mut self);
    /// One notification: its channel and its payload.
    fn notified(&mut self, channel: &str, payload: &str);
}

/// Wakes the records parked on a task whose lease ended.
/// Listens on `channels` until `shutdown`, reconnecting with a bounded backoff, one log line
/// per distinct failure. One session for all of a process's channels: every notification
/// wakes every listening session of the database, whatever its channels.
pub async fn listen(
    settings: DatabaseSettings,
    name: String,
    channels: &'static [&'static str],
    mut listener: impl Listener,
    shutdown: CancellationToken,
) {
    let target = target_of(&settings);
    let mut failures = RepeatedFailure::new("notification listener");
    let mut backoff = INITIAL_BACKOFF;
    while !shutdown.is_cancelled() {
        let session = listen_once(&settings, &name, channels, &mut listener, &shutdown, || {
            // Listening again: the next loss starts over from the shortest wait.
            failures.recovered();
            backoff = INITIAL_BACKOFF;
        });
        match session.await {
            Ok(()) => return, // shut down
            Err(e) => {
                failures.failed(&format!(
                    "PostgreSQL at {target} (database.url): {}",
                    telemetry::chain(&e)
                ));
                telemetry::listener_lost();
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

const INITIAL_BACKOFF: Duration = Duration::from_millis(100);

/// Why a listening session ended.
#[derive(Debug, thiserror::Error)]
enum SessionEnd {
    #[error(transparent)]
    Settings(#[from] StoreError),
    #[error(transparent)]
    Postgres(#[from] tokio_postgres::Error),
    #[error("the server closed the session")]
    Closed,
}

/// One listening session: connect, LISTEN, tell the listener it listens, then relay
/// notifications until the session ends (an error) or `shutdown` (Ok).
async fn listen_once(
    settings: &DatabaseSettings,
    name: &str,
    channels: &[&str],
    listener: &mut impl Listener,
    shutdown: &CancellationToken,
    listening: impl FnOnce(),
) -> Result<(), SessionEnd> {
    let mut config = session_config(settings)?;
    config.application_name(name);
    let (client, mut connection) = config.connect(tls_connector(settings)?).await?;
    let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
    // The connection yields notifications only while polled as a message stream.
    let driver = tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(message) = messages.next().await {
            let end = message.is_err();
            if tx.send(message).is_err() || end {
                break;
            }
        }
    });
    let result = async {
        let statements: Vec<String> = channels.iter().map(|c| format!("LISTEN {c};")).collect();
        client.batch_execute(&statements.concat()).await?;
        telemetry::listener_connected();
        listening();
        listener.listening();
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(()),
                message = rx.recv() => match message {
                    Some(Ok(AsyncMessage::Notification(n))) => {
                        listener.notified(n.channel(), n.payload());
                    }
                    Some(Ok(_)) => {} // notices
                    Some(Err(e)) => return Err(e.into()),
                    None => return Err(SessionEnd::Closed),
                },
            }
        }
    }
    .await;
    driver.abort();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn payloads_carry_the_task_and_its_new_status() {
        let id = TaskId::new_random();
        assert_eq!(
            parse_status_payload(&format!("{id} completed")),
            Some((id, TaskStatus::Completed))
        );
        assert_eq!(parse_status_payload("not-a-task completed"), None);
        assert_eq!(parse_status_payload(&format!("{id} exploded")), None);
        assert_eq!(parse_status_payload(""), None);
    }
}
