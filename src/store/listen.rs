//! Notification listeners: one PostgreSQL session that `LISTEN`s on a channel and hands each
//! payload to a [`Listener`]. The worker's relays `replyd_task_status` (sent by the task
//! table's trigger, see `migrations/V3`) to the records parked on a task whose lease ended
//! (`crate::worker::parking`); the API's fans it out to the event streams; the outbox
//! relay's wakes on `replyd_outbox`.
//!
//! Notifications are hints. A lost one (the session dropped, the server restarted) costs only
//! time: parked records still wake at their lease end, and every (re)connection wakes all
//! parked records once, because notifications sent while nobody listened are gone.
//!
//! A session listens only while its process needs it ([`Demand`]): every listening session of
//! the database slows every notifying commit (the server signals each one, and each wakes and
//! reads the queue), so an API process without open event streams, or a worker with no call
//! running and no record parked, does not listen. Whoever needs it again starts a session and
//! hears its `listening` (re-read everything) before any notification, so nothing is missed
//! between the two.

use std::sync::Arc;
use std::time::Duration;

use futures_util::StreamExt;
use tokio::sync::watch;
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use crate::store::DatabaseSettings;
use crate::store::{StoreError, session_config, target_of, tls_connector};
use crate::telemetry::{self, RepeatedFailure};
use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{TaskId, TaskStatus};

/// The channel the trigger notifies.
pub const TASK_STATUS_CHANNEL: &str = "replyd_task_status";

/// Parses one line of a notification payload, `<task_id> <status>`.
pub fn parse_status_payload(payload: &str) -> Option<(TaskId, TaskStatus)> {
    let (id, status) = payload.split_once(' ')?;
    Some((TaskId::parse(id).ok()?, TaskStatus::parse(status)?))
}

/// Parses a notification payload: one line per task whose status one transaction changed
/// (`migrations/V32`; a single line from the previous release's row trigger). `Err` carries a
/// line that is not understood.
pub fn parse_status_payloads(
    payload: &str,
) -> impl Iterator<Item = Result<(TaskId, TaskStatus), &str>> {
    payload
        .lines()
        .filter(|line| !line.is_empty())
        .map(|line| parse_status_payload(line).ok_or(line))
}

/// How many parts of a process need its listening session: the session runs while one does,
/// and ends once none has for `database.listen_idle_ms`.
#[derive(Clone, Debug)]
pub struct Demand(Arc<watch::Sender<usize>>);

impl Default for Demand {
    fn default() -> Self {
        Self(Arc::new(watch::channel(0).0))
    }
}

impl Demand {
    /// A demand nobody lets go: the session always listens (the outbox relay's).
    pub fn always() -> Self {
        let demand = Self::default();
        demand.0.send_modify(|n| *n += 1);
        demand
    }

    /// Needs the session until the returned guard is dropped.
    pub fn hold(&self) -> DemandHold {
        self.0.send_modify(|n| *n += 1);
        DemandHold(self.0.clone())
    }

    /// Returns once something holds it.
    async fn wanted(&self) {
        let mut receiver = self.0.subscribe();
        // The sender lives in `self`, so this cannot fail.
        let _ = receiver.wait_for(|n| *n > 0).await;
    }

    /// Returns once nothing has held it for `idle`.
    async fn unwanted_for(&self, idle: Duration) {
        let mut receiver = self.0.subscribe();
        loop {
            let _ = receiver.wait_for(|n| *n == 0).await;
            tokio::select! {
                _ = tokio::time::sleep(idle) => return,
                // Held again within the linger: wait for the next release.
                _ = receiver.wait_for(|n| *n > 0) => {}
            }
        }
    }
}

/// One part's need of the listening session.
#[derive(Debug)]
pub struct DemandHold(Arc<watch::Sender<usize>>);

impl Drop for DemandHold {
    fn drop(&mut self) {
        self.0.send_modify(|n| *n -= 1);
    }
}

/// What a listener does with its channels' messages.
pub trait Listener: Send {
    /// The session listens (again): anything sent while it did not is gone.
    fn listening(&mut self);
    /// One notification: its channel and its payload.
    fn notified(&mut self, channel: &str, payload: &str);
}

/// Listens on `channels` while `demand` is held, until `shutdown`, reconnecting with a bounded
/// backoff, one log line per distinct failure. One session for all of a process's channels:
/// every notification wakes every listening session of the database, whatever its channels.
pub async fn listen(
    settings: DatabaseSettings,
    name: String,
    channels: &'static [&'static str],
    mut listener: impl Listener,
    demand: Demand,
    shutdown: CancellationToken,
) {
    let target = target_of(&settings);
    let idle = Duration::from_millis(settings.listen_idle_ms);
    let mut failures = RepeatedFailure::new("notification listener");
    let mut backoff = INITIAL_BACKOFF;
    while !shutdown.is_cancelled() {
        tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = demand.wanted() => {}
        }
        let session = listen_once(
            &settings,
            &name,
            channels,
            &mut listener,
            (&shutdown, demand.unwanted_for(idle)),
            || {
                // Listening again: the next loss starts over from the shortest wait.
                failures.recovered();
                backoff = INITIAL_BACKOFF;
            },
        );
        match session.await {
            Ok(Quiet::Shutdown) => return,
            Ok(Quiet::Unneeded) => {
                telemetry::listener_idle();
                continue;
            }
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

/// Why a listening session was ended on purpose.
enum Quiet {
    Shutdown,
    /// Nothing of the process needed it for `database.listen_idle_ms`.
    Unneeded,
}

/// One listening session: connect, LISTEN, tell the listener it listens, then relay
/// notifications until the session ends (an error), `shutdown`, or `unneeded` completes.
async fn listen_once(
    settings: &DatabaseSettings,
    name: &str,
    channels: &[&str],
    listener: &mut impl Listener,
    (shutdown, unneeded): (&CancellationToken, impl Future<Output = ()>),
    listening: impl FnOnce(),
) -> Result<Quiet, SessionEnd> {
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
        let mut unneeded = std::pin::pin!(unneeded);
        loop {
            tokio::select! {
                _ = shutdown.cancelled() => return Ok(Quiet::Shutdown),
                _ = &mut unneeded => return Ok(Quiet::Unneeded),
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
    fn a_payload_carries_one_line_per_task_and_names_a_line_it_cannot_read() {
        let (a, b) = (TaskId::new_random(), TaskId::new_random());
        let payload = format!("{a} completed\n{b} running\nnonsense");
        let lines: Vec<_> = parse_status_payloads(&payload).collect();
        assert_eq!(
            lines,
            vec![
                Ok((a, TaskStatus::Completed)),
                Ok((b, TaskStatus::Running)),
                Err("nonsense")
            ]
        );
        // The previous release's payload is one such line.
        assert_eq!(
            parse_status_payloads(&format!("{a} failed")).collect::<Vec<_>>(),
            vec![Ok((a, TaskStatus::Failed))]
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_demand_is_unwanted_only_after_the_linger_with_nobody_holding_it() {
        let demand = Demand::default();
        let linger = Duration::from_secs(30);
        assert_eq!(*demand.0.borrow(), 0);
        let first = demand.hold();
        tokio::time::timeout(Duration::from_millis(1), demand.wanted())
            .await
            .expect("held: wanted at once");
        let unwanted = demand.unwanted_for(linger);
        tokio::pin!(unwanted);
        // Held: never unwanted, however long.
        assert!(
            tokio::time::timeout(Duration::from_secs(300), &mut unwanted)
                .await
                .is_err()
        );
        drop(first);
        // Let go, then held again within the linger: the linger starts over at the next release.
        tokio::time::sleep(Duration::from_secs(20)).await;
        let second = demand.hold();
        assert!(
            tokio::time::timeout(Duration::from_secs(60), &mut unwanted)
                .await
                .is_err()
        );
        drop(second);
        assert!(
            tokio::time::timeout(Duration::from_secs(29), &mut unwanted)
                .await
                .is_err()
        );
        tokio::time::timeout(Duration::from_secs(2), &mut unwanted)
            .await
            .expect("unwanted once nobody held it for the linger");
        assert_eq!(*Demand::always().0.borrow(), 1);
    }

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
