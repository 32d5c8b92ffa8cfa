//! The fenced write (I2), written once: every guarded change of a task row that is not a
//! claim or a completion (renew, fail, release, record an operation's id) goes through
//! [`write`](fn@write); a lone completion is one call of `replyd_complete` (V9), on the same predicate.
//!
//! It runs the seed's order inside one short transaction: lock the row (`SELECT ... FOR
//! UPDATE`), then run the guarded UPDATE whose predicate reads `clock_timestamp()` *after* the
//! lock is held. A single guarded UPDATE is not enough: PostgreSQL evaluates its predicate
//! before waiting on a lock held by a transaction that only locked the row, and writes after
//! the wait even if the lease ran out meanwhile. Locking first closes that window. The
//! predicate itself is SQL (`replyd_lease_holds`, migration V9), which `replyd_claim` and
//! `replyd_complete` filter on too; the decision of why a write was refused is
//! `replyd_core::lease::classify_refusal`.

use tokio_postgres::Row;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::AttemptOutcome;
use replyd_core::lease::{Lease, Refusal, classify_refusal};

use super::error::StoreError;
use super::rows::snapshot_from;
use super::sessions::Sessions;

// Lock the row before any check that reads the clock; see the module comment.
pub(super) const LOCK_ROW: &str = "SELECT 1 FROM reply_tasks WHERE task_id = $1 FOR UPDATE";

pub(super) const SNAPSHOT: &str = "SELECT status, assignment_version, lease_owner, lease_until, \
     attempt_count, max_attempts, deadline, next_attempt_at, \
     saved_response IS NOT NULL AS has_response, clock_timestamp() AS now \
     FROM reply_tasks WHERE task_id = $1";

/// One fenced write: lock the row, run `update` under [`FENCE`] (whose `$1` is the task id
/// and `$2` the assignment version), and on success record `records`' outcome on the attempt's
/// row when it is [`AttemptWrite::Outcome`]. When the update matches no row, read the row
/// under the same lock and say why; for an `Outcome` write, the refusal is recorded on this
/// assignment's attempt row unless the row already has a final outcome or the refusal is this
/// assignment's own earlier write ([`is_own_earlier_write`]).
///
/// `prelude`, when given, runs once the row is locked (a `SET LOCAL` the task table's
/// triggers read).
pub(super) async fn write(
    sessions: &Sessions,
    lease: &Lease,
    update: FencedUpdate,
    params: &[&(dyn ToSql + Sync)],
    records: AttemptWrite<'_>,
    prelude: Option<&'static str>,
) -> Result<Result<Row, Refusal>, StoreError> {
    let id = lease.task_id;
    let mut client = sessions.client().await?;
    let tx = client.transaction().await?;
    // Lock first, then check the lease in the guarded UPDATE (see the module comment).
    // The two (and a prelude between them) are sent together: one session runs its
    // statements in the order they were sent, each after the one before, so the UPDATE's
    // clock is still read with the lock held, at one round trip instead of two.
    let sql = update.sql();
    let (lock, guarded) =
        futures_util::try_join!(tx.prepare_cached(LOCK_ROW), tx.prepare_cached(&sql))?;
    let lock_params: [&(dyn ToSql + Sync); 1] = [&id];
    let (locked, (), updated) = futures_util::try_join!(
        tx.query_opt(&lock, &lock_params),
        async {
            match prelude {
                Some(prelude) => tx.batch_execute(prelude).await,
                None => Ok(()),
            }
        },
        tx.query_opt(&guarded, params),
    )?;
    if locked.is_none() {
        // No row: the UPDATE found none either.
        return Ok(Err(Refusal::NotFound));
    }
    let result = match updated {
        Some(row) => {
            if let AttemptWrite::Outcome { outcome, detail } = records {
                record_attempt_outcome(&tx, id, lease.version, outcome, detail).await?;
            }
            Ok(row)
        }
        None => {
            let row = tx
                .query_one(&tx.prepare_cached(SNAPSHOT).await?, &[&id])
                .await?;
            let refusal = classify_refusal(&snapshot_from(id, &row)?, lease.version);
            // A refused renewal records nothing: the worker stops and reports the attempt's
            // end through complete or fail, or the next claim does. A retried write whose
            // first try went through keeps that first outcome.
            if matches!(records, AttemptWrite::Outcome { .. }) && !is_own_earlier_write(&refusal) {
                record_attempt_outcome(
                    &tx,
                    id,
                    lease.version,
                    refusal.attempt_outcome(),
                    Some(&format!("{refusal:?}")),
                )
                .await?;
            }
            Err(refusal)
        }
    };
    tx.commit().await?;
    Ok(result)
}

/// The fence of I2 (`$1` the task, `$2` the assignment version). It is written once, in
/// SQL (`replyd_lease_holds`, migration V9): the row is this assignment's, still running,
/// its lease live by the database clock read after the row lock is held, and no reply saved
/// yet. `replyd_complete` filters on the same function.
pub(super) const FENCE: &str = "task_id = $1 AND replyd_lease_holds(reply_tasks, $2)";

/// Records an assignment's attempt outcome (see [`record_attempt_outcome`]).
const RECORD_ATTEMPT_OUTCOME: &str = "UPDATE reply_attempts SET outcome = $3, detail = $4, \
     finished_at = clock_timestamp() \
     WHERE task_id = $1 AND assignment_version = $2 \
       AND (outcome IS NULL OR outcome = 'abandoned')";

/// A refused write that is this very assignment's earlier accepted write (its acknowledgement
/// was lost and it was sent again): nothing to record, the first outcome stands.
pub(super) fn is_own_earlier_write(refusal: &Refusal) -> bool {
    *refusal
        == Refusal::AlreadySaved {
            by_this_assignment: true,
        }
}

/// Records a refused completion on its assignment's attempt row. It runs after the refused
/// call's commit: the attempt row's guard (no final outcome yet) keeps it from rewriting what a
/// later writer recorded.
pub(super) async fn record_refusal(
    client: &deadpool_postgres::Object,
    lease: &Lease,
    refusal: &Refusal,
) -> Result<(), StoreError> {
    let record = client.prepare_cached(RECORD_ATTEMPT_OUTCOME).await?;
    client
        .execute(
            &record,
            &[
                &lease.task_id,
                &lease.version,
                &refusal.attempt_outcome().as_str(),
                &Some(format!("{refusal:?}")),
            ],
        )
        .await?;
    Ok(())
}

/// A guarded UPDATE of one task row: what it sets (its own parameters from `$3`) and what it
/// returns; the predicate is always [`FENCE`].
#[derive(Clone, Copy)]
pub(super) struct FencedUpdate {
    pub(super) set: &'static str,
    pub(super) returning: &'static str,
}

impl FencedUpdate {
    pub(super) fn sql(self) -> String {
        format!(
            "UPDATE reply_tasks SET {} WHERE {FENCE} RETURNING {}",
            self.set, self.returning
        )
    }
}

/// What a fenced write writes on its assignment's `reply_attempts` row.
#[derive(Clone, Copy)]
pub(super) enum AttemptWrite<'a> {
    /// Renewals: the attempt goes on, nothing to record.
    Nothing,
    /// Completion or failure: the attempt's outcome on success; the refusal otherwise.
    Outcome {
        outcome: AttemptOutcome,
        detail: Option<&'a str>,
    },
}

/// Records the outcome of one assignment's attempt. An `abandoned` mark (written by a
/// takeover) may be replaced by what the attempt's worker reports later; any other outcome is
/// final, so a lost acknowledgement retried cannot rewrite history.
async fn record_attempt_outcome(
    tx: &deadpool_postgres::Transaction<'_>,
    task_id: Uuid,
    version: i64,
    outcome: AttemptOutcome,
    detail: Option<&str>,
) -> Result<(), StoreError> {
    let statement = tx.prepare_cached(RECORD_ATTEMPT_OUTCOME).await?;
    tx.execute(
        &statement,
        &[&task_id, &version, &outcome.as_str(), &detail],
    )
    .await?;
    Ok(())
}
