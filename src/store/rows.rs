//! The store's answers and the rows they are read from: what a claim, a completion, a renewal,
//! a release or a failure did (the `*Outcome` types callers branch on), and the mappers from a
//! `reply_tasks` row (or a `replyd_claim` row) to the domain's values. Every file of the store
//! that reads a task row reads it here, so a column is mapped once.

use std::cell::Cell;
use std::time::Duration;

use chrono::{DateTime, Utc};
use tokio_postgres::Row;
use tokio_postgres::types::{FromSql, Json as PgJson};
use uuid::Uuid;

use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{
    AttemptOutcome, ProviderRan, ProviderRequest, StoredTask, TaskId, TaskSpec, TaskStatus,
};
use replyd_core::lease::{ClaimKind, ClaimOutcome, Lease, LeaseSnapshot, Refusal};

use super::error::StoreError;

/// What `ensure_task` found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EnsureOutcome {
    /// The record created the task.
    Created,
    /// The task existed with the same inputs (a redelivery or duplicate publication).
    Exists,
    /// The task existed with different inputs; the record was not applied. The fields name
    /// where it disagrees.
    Conflict { fields: Vec<&'static str> },
    /// The task was forgotten (retention or an erasure); the record was not applied.
    Forgotten,
}

/// What a claim did, and the row as it left it.
#[derive(Debug, Clone)]
pub struct Taken {
    pub claim: ClaimOutcome,
    /// What inserting the record's task found; `None` when the claim had no record to insert.
    pub ensured: Option<EnsureOutcome>,
    /// The row after the claim; `None` when there is no such task.
    pub task: Option<StoredTask>,
}

/// What a completion did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompletionOutcome {
    /// The reply is saved and the task completed, by this assignment.
    Accepted,
    Refused(Refusal),
}

/// What a renewal did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RenewOutcome {
    /// The lease now runs until this instant (database clock).
    Renewed { until: DateTime<Utc> },
    /// The lease is gone: stop the work.
    Refused(Refusal),
}

/// How an attempt that gives its lease back ended (see [`Store::release_as`](super::Store::release_as)).
#[derive(Debug, Clone, Copy)]
pub struct Release<'a> {
    pub outcome: AttemptOutcome,
    pub detail: &'a str,
    /// No claim before this long from now.
    pub retry_after: Duration,
    /// The failure's class (`ProviderError::kind`), remembered for the next decision.
    pub error_class: Option<&'a str>,
    pub ran: ProviderRan,
    /// The attempt cost nothing (a refusal, a wait for capacity of our own): give it back.
    pub give_back: bool,
    /// A refusal by the provider: counted, and the refusal budget started with this length if
    /// it has not started yet.
    pub refusal_budget: Option<Duration>,
}

/// What giving a lease back did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReleaseOutcome {
    /// The task is pending again; anyone may claim it now instead of waiting out the lease.
    Released,
    Refused(Refusal),
}

/// What a terminal failure did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FailOutcome {
    Failed,
    Refused(Refusal),
}

/// What a write that ends a lease answered, as a stable label for traces.
pub trait Labelled {
    fn label(&self) -> &'static str;
}

impl Labelled for CompletionOutcome {
    fn label(&self) -> &'static str {
        match self {
            CompletionOutcome::Accepted => "accepted",
            CompletionOutcome::Refused(refusal) => refusal.label(),
        }
    }
}

impl Labelled for ReleaseOutcome {
    fn label(&self) -> &'static str {
        match self {
            ReleaseOutcome::Released => "released",
            ReleaseOutcome::Refused(refusal) => refusal.label(),
        }
    }
}

impl Labelled for FailOutcome {
    fn label(&self) -> &'static str {
        match self {
            FailOutcome::Failed => "failed",
            FailOutcome::Refused(refusal) => refusal.label(),
        }
    }
}

pub(super) const TASK_COLUMNS: &str = "task_id, workspace_id, conversation_id, message_id, \
     document_version, request, max_attempts, deadline, status, assignment_version, lease_owner, \
     lease_until, attempt_count, provider_operation_id, saved_response, failure, created_at, \
     updated_at, finished_at, next_attempt_at, last_error_class, last_error, refusals, \
     refusal_deadline";

/// A lease length as the `secs` argument of `make_interval` (float8 seconds).
pub(super) fn seconds(duration: Duration) -> f64 {
    duration.as_secs_f64()
}

pub(super) fn invalid(task_id: Uuid, reason: impl Into<String>) -> StoreError {
    StoreError::InvalidRow {
        task_id,
        reason: reason.into(),
    }
}

/// A row read by column name, each name looked for from just after the last one found.
/// `Row::get` by name compares the name with every column before it, and a claim's row has
/// about 30 read on every claim; read in the statement's order, each is found at the first
/// look. Any order still finds every column (the search wraps around); a name the row does
/// not have panics, as `Row::get` does.
pub(super) struct Columns<'r> {
    row: &'r Row,
    next: Cell<usize>,
}

impl<'r> Columns<'r> {
    pub(super) fn new(row: &'r Row) -> Self {
        Self {
            row,
            next: Cell::new(0),
        }
    }

    fn find(&self, name: &str) -> Option<usize> {
        let columns = self.row.columns();
        let start = self.next.get();
        let at = (0..columns.len())
            .map(|k| (start + k) % columns.len())
            .find(|&i| columns[i].name() == name)?;
        self.next.set(at + 1);
        Some(at)
    }

    pub(super) fn get<T: FromSql<'r>>(&self, name: &str) -> T {
        match self.find(name) {
            Some(at) => self.row.get(at),
            None => panic!("the row has no column `{name}`"),
        }
    }

    pub(super) fn try_get<T: FromSql<'r>>(&self, name: &str) -> Result<T, tokio_postgres::Error> {
        match self.find(name) {
            Some(at) => self.row.try_get(at),
            // `Row::try_get`'s own error for a missing column.
            None => self.row.try_get(name),
        }
    }
}

/// The columns of a task to insert that are not stored as its spec holds them: the request as
/// JSON (written straight into the statement's parameters, with no JSON tree built in between)
/// and the attempt budget as an `integer`. A spec that cannot be written is refused as an
/// invalid row of `task_id`.
pub(super) fn insert_columns(
    task_id: Uuid,
    spec: &TaskSpec,
) -> Result<(PgJson<&ProviderRequest>, i32), StoreError> {
    let request = PgJson(&spec.request);
    let max_attempts =
        i32::try_from(spec.max_attempts).map_err(|_| invalid(task_id, "max_attempts over i32"))?;
    Ok((request, max_attempts))
}

/// The row's `status` column, one the service knows.
fn status_of(task_id: Uuid, row: &Columns) -> Result<TaskStatus, StoreError> {
    let status: &str = row.get("status");
    TaskStatus::parse(status).ok_or_else(|| invalid(task_id, format!("unknown status {status:?}")))
}

pub(super) fn snapshot_from(task_id: Uuid, row: &Row) -> Result<LeaseSnapshot, StoreError> {
    let row = &Columns::new(row);
    Ok(LeaseSnapshot {
        status: status_of(task_id, row)?,
        assignment_version: row.get("assignment_version"),
        lease_owner: row.get("lease_owner"),
        lease_until: row.get("lease_until"),
        attempt_count: row.get("attempt_count"),
        max_attempts: row.get("max_attempts"),
        deadline: row.get("deadline"),
        next_attempt_at: row.get("next_attempt_at"),
        has_response: row.get("has_response"),
        // Read by claims only (`decide_claim`, in SQL); the refusals classified from these rows
        // do not look at it, and the completion functions' rows (V9, V10) do not carry it.
        lease_partition: row.try_get("lease_partition").unwrap_or(None),
        now: row.get("now"),
    })
}

pub(super) fn task_from(row: &Row) -> Result<StoredTask, StoreError> {
    task_from_columns(&Columns::new(row))
}

/// Reads the columns in `TASK_COLUMNS`' order, which `replyd_claim`'s rows keep too.
fn task_from_columns(row: &Columns) -> Result<StoredTask, StoreError> {
    let task_id: Uuid = row.get("task_id");
    let (workspace_id, conversation_id, message_id, document_version) = (
        row.get("workspace_id"),
        row.get("conversation_id"),
        row.get("message_id"),
        row.get("document_version"),
    );
    // Read straight from the column's bytes, with no JSON tree built in between.
    let PgJson(request) = row
        .try_get::<PgJson<ProviderRequest>>("request")
        .map_err(|e| invalid(task_id, format!("request column: {e}")))?;
    let max_attempts: i32 = row.get("max_attempts");
    let spec = TaskSpec {
        task_id: TaskId::from(task_id),
        workspace_id,
        conversation_id,
        message_id,
        document_version,
        request,
        max_attempts: u32::try_from(max_attempts)
            .map_err(|_| invalid(task_id, "negative max_attempts"))?,
        deadline: row.get("deadline"),
    };
    Ok(StoredTask {
        spec,
        status: status_of(task_id, row)?,
        assignment_version: row.get("assignment_version"),
        lease_owner: row.get("lease_owner"),
        lease_until: row.get("lease_until"),
        attempt_count: row.get("attempt_count"),
        provider_operation_id: row.get("provider_operation_id"),
        saved_response: row.get("saved_response"),
        failure: row.get("failure"),
        created_at: row.get("created_at"),
        updated_at: row.get("updated_at"),
        finished_at: row.get("finished_at"),
        next_attempt_at: row.get("next_attempt_at"),
        last_error_class: row.get("last_error_class"),
        last_error: row.get("last_error"),
        refusals: row.get("refusals"),
        refusal_deadline: row.get("refusal_deadline"),
    })
}

/// What a claim did, from the row `replyd_claim` returned; `created` says whether this call
/// inserted the record's task.
pub(super) fn taken_from(
    id: Uuid,
    row: &Row,
    insert: Option<&TaskSpec>,
    created: bool,
) -> Result<Taken, StoreError> {
    let row = &Columns::new(row);
    let label: &str = row.get("claim");
    let claim = claim_from(id, label, row)?;
    let task = if matches!(claim, ClaimOutcome::NotFound | ClaimOutcome::Forgotten) {
        None
    } else {
        Some(task_from_columns(row)?)
    };
    let ensured = insert.map(|spec| match (&task, created) {
        (_, true) => EnsureOutcome::Created,
        (Some(stored), false) => {
            let fields = stored.spec.disagreements(spec);
            if fields.is_empty() {
                EnsureOutcome::Exists
            } else {
                EnsureOutcome::Conflict { fields }
            }
        }
        (None, false) if matches!(claim, ClaimOutcome::Forgotten) => EnsureOutcome::Forgotten,
        // Inserted or found, then gone before the lock: reported as not found.
        (None, false) => EnsureOutcome::Exists,
    });
    Ok(Taken {
        claim,
        ensured,
        task,
    })
}

/// A claim's outcome from `replyd_claim`'s label and the row it returned.
fn claim_from(task_id: Uuid, label: &str, row: &Columns) -> Result<ClaimOutcome, StoreError> {
    let Some(kind) = ClaimKind::parse(label) else {
        return Err(invalid(task_id, format!("unknown claim outcome {label:?}")));
    };
    let lease = || Lease {
        task_id,
        version: row.get("assignment_version"),
        owner: row.get("lease_owner"),
        until: row.get("lease_until"),
        attempt: row.get("attempt_count"),
    };
    Ok(match kind {
        ClaimKind::Claimed => ClaimOutcome::Claimed(lease()),
        ClaimKind::TookOver => ClaimOutcome::TookOver(lease()),
        ClaimKind::AlreadyCompleted => ClaimOutcome::AlreadyCompleted,
        ClaimKind::AlreadyFailed => ClaimOutcome::AlreadyFailed,
        ClaimKind::AlreadyCancelled => ClaimOutcome::AlreadyCancelled,
        ClaimKind::LeasedByOther => ClaimOutcome::LeasedByOther {
            owner: row.get::<Option<String>>("lease_owner").unwrap_or_default(),
            version: row.get("assignment_version"),
            until: row
                .get::<Option<DateTime<Utc>>>("lease_until")
                .unwrap_or_else(|| row.get("now")),
        },
        ClaimKind::BudgetExhausted => ClaimOutcome::BudgetExhausted {
            attempts: row.get("attempt_count"),
        },
        ClaimKind::DeadlinePassed => ClaimOutcome::DeadlinePassed {
            deadline: row
                .get::<Option<DateTime<Utc>>>("deadline")
                .unwrap_or_else(|| row.get("now")),
        },
        ClaimKind::BackingOff => ClaimOutcome::NotBefore {
            at: row
                .get::<Option<DateTime<Utc>>>("next_attempt_at")
                .unwrap_or_else(|| row.get("now")),
        },
        ClaimKind::NotFound => ClaimOutcome::NotFound,
        ClaimKind::Forgotten => ClaimOutcome::Forgotten,
    })
}
