//! The fenced-lease task store against a real PostgreSQL: claims race, leases expire, zombies
//! come back, and completions wait on row locks. Each test names the invariant it attacks.
//!
//! This file holds what the rooms share: a new task, a claim that must succeed, waiting on the
//! database clock, the attempts' outcomes, and a row lock held by another session. The rooms:
//! [`claims`] (claims race and end a task's budget), [`leases`] (a lease fences its holder,
//! also across row-lock waits), [`migrations`] (processes migrating one schema),
//! [`batch_completions`], [`batch_renewals`] and [`batch_claims`] (one call for many rows, each
//! answered on its own) and [`live_pieces`] (the live text written for followers).

mod batch_claims;
mod batch_completions;
mod batch_renewals;
mod claims;
mod leases;
mod live_pieces;
mod migrations;

use std::time::Duration;

use crate::helpers::{TestDb, task_spec, wait_until};
use chrono::{DateTime, Utc};
use replyd::store::{EnsureOutcome, Store};
use replyd_core::domain::TaskId;
use replyd_core::lease::{ClaimOutcome, Lease};

const SHORT_LEASE: Duration = Duration::from_millis(300);
const LONG_LEASE: Duration = Duration::from_secs(60);

async fn new_task(db: &TestDb, max_attempts: u32) -> TaskId {
    let spec = task_spec(max_attempts);
    assert_eq!(
        db.store.ensure_task(&spec).await.unwrap(),
        EnsureOutcome::Created
    );
    spec.task_id
}

async fn claim_ok(store: &Store, task: TaskId, owner: &str, lease: Duration) -> Lease {
    match store.claim(task, owner, lease).await.unwrap() {
        ClaimOutcome::Claimed(lease) => lease,
        other => panic!("{owner} expected to claim, got {other:?}"),
    }
}

/// Waits until the database clock is past `until` (never the test's own clock).
async fn wait_for_expiry(db: &TestDb, until: DateTime<Utc>) {
    let client = db.raw_client().await;
    wait_until(
        "the lease expired by the database clock",
        Duration::from_secs(30),
        || {
            let client = &client;
            async move {
                let row = client
                    .query_one("SELECT clock_timestamp() > $1", &[&until])
                    .await
                    .unwrap();
                row.get::<_, bool>(0)
            }
        },
    )
    .await;
}

async fn attempt_outcomes(db: &TestDb, task: TaskId) -> Vec<(i64, Option<String>)> {
    db.raw_client()
        .await
        .query(
            "SELECT assignment_version, outcome FROM reply_attempts WHERE task_id = $1 ORDER BY assignment_version",
            &[&task.as_uuid()],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Holds the task's row lock (`SELECT ... FOR UPDATE`, no change) on a separate session until
/// the returned sender fires; returns that session's backend pid.
async fn hold_row_lock(
    db: &TestDb,
    task: TaskId,
) -> (
    i32,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let mut blocker = db.raw_client().await;
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        let tx = blocker.transaction().await.unwrap();
        let pid: i32 = tx
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        tx.query_one(
            "SELECT task_id FROM reply_tasks WHERE task_id = $1 FOR UPDATE",
            &[&task.as_uuid()],
        )
        .await
        .unwrap();
        pid_tx.send(pid).unwrap();
        let _ = release_rx.await;
        tx.commit().await.unwrap();
    });
    (pid_rx.await.unwrap(), release_tx, handle)
}

async fn wait_until_blocked_by(db: &TestDb, blocker_pid: i32) {
    let observer = db.raw_client().await;
    wait_until(
        "a session waits on the held row lock",
        Duration::from_secs(10),
        || {
            let observer = &observer;
            async move {
                let row = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                    &[&blocker_pid],
                )
                .await
                .unwrap();
                row.get::<_, i64>(0) > 0
            }
        },
    )
    .await;
}

async fn lease_is_live(db: &TestDb, lease: &Lease) -> bool {
    db.raw_client()
        .await
        .query_one("SELECT clock_timestamp() < $1", &[&lease.until])
        .await
        .unwrap()
        .get(0)
}
