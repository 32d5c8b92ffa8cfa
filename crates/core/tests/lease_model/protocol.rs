//! The bounds and the protocol variant of one check: how many workers, attempts, crashes and
//! stalls, the clock's end, and which of replyd's statements is replaced by a broken one.

use super::Tick;

/// Which clock the completion's guarded UPDATE compares `lease_until` with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LeaseCheck {
    /// replyd's order: lock the row, then evaluate `lease_until > clock_timestamp()`, so the
    /// lease is checked at the instant the write happens.
    AfterRowLock,
    /// The broken order: a bare guarded UPDATE whose predicate was evaluated when the statement
    /// started, before it waited on a row lock held by a transaction that only locked the row
    /// (so PostgreSQL does not re-check the row after the wait). Version, status and the saved
    /// reply are still read from the row as it is at the write: a row changed by someone else
    /// is re-checked, so only the clock is stale.
    WhenStatementStarted,
}

/// What the insert of a record's task (`replyd_insert_task`, made by the first claim of each
/// delivery of a record) consults before inserting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum TaskInsert {
    /// replyd's (V21): an id in `forgotten_tasks` is refused, so the claim finds no row and
    /// answers `forgotten`.
    RefusesForgotten,
    /// The broken insert: `forgotten_tasks` is not read, and a record of a forgotten task
    /// inserts it again as a new pending row (`ON CONFLICT DO NOTHING` only guards a row that
    /// is there).
    IgnoresForgotten,
}

/// Whether claims hold the record's partition alone (Kafka) and so may take over a live lease
/// of another holder of it (V33).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum PartitionTakeover {
    /// Claims hold no partition (SQS, claims for no record): every live lease is respected.
    Off,
    /// replyd's (V33): claims name partition 0, held alone; a live lease of that partition of
    /// another owner is taken over, and the takeover notes that its call may have run.
    ByPartition,
    /// The broken takeover: as replyd's, but it leaves `provider_may_have_run` to V13's
    /// trigger, which notes only a lapsed lease's call.
    ByPartitionNotingNothing,
}

/// The one partition of the model's record.
pub(super) const PARTITION: u8 = 0;

/// What the user's Stop (`replyd_cancel`) reads before it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CancelCheck {
    /// replyd's (V23): lock the row (`FOR UPDATE`), then cancel only a pending or running task;
    /// a completed, failed or cancelled one answers `already_<status>` and is left alone.
    LocksThenChecksStatus,
    /// The broken cancel: a bare `UPDATE reply_tasks SET status = 'cancelled' ... WHERE
    /// task_id = $1` and a release of the task's reservation by its id, neither reading what it
    /// overwrites.
    OverwritesAnyStatus,
    /// The Stop of V23: locks and checks as replyd's does, but releases the reservation
    /// whatever the provider may have done (the user "was shown no reply", which live text
    /// made untrue).
    ReleasesWhateverRan,
}

/// The bounds and the protocol variant of one check.
#[derive(Debug, Clone)]
pub(super) struct LeaseProtocol {
    pub(super) workers: u8,
    /// One initial state per budget and deadline.
    pub(super) max_attempts: &'static [u8],
    pub(super) deadlines: &'static [Option<Tick>],
    /// Whether provider calls may fail (`Action::CallFails`).
    pub(super) call_failures: bool,
    /// A retryable failure gives the lease back with `next_attempt_at = now + backoff_ticks`.
    pub(super) backoff_ticks: u8,
    /// Refusals (a retryable failure that surely did no work) a task may meet before the next
    /// one fails it: `retry.refusal_budget_ms`, counted instead of timed.
    pub(super) refusal_budget: u8,
    /// A claim or renewal leases the task until `now + lease_ticks`.
    pub(super) lease_ticks: u8,
    /// The clock stops here; the checker explores every interleaving up to it.
    pub(super) last_tick: Tick,
    /// Crashes over the whole run; a crashed worker may restart (its record redelivered).
    pub(super) max_crashes: u8,
    /// Stalls over the whole run.
    pub(super) max_stalls: u8,
    /// The task may be forgotten (`Action::Forget`) in the runs with this attempt budget. One
    /// budget is enough: two attempts already meet forgetting in every phase of the lease
    /// (before any claim, under a live or lapsed lease, after a takeover, a release, a
    /// completion, a failure), and the runs with more only repeat those meetings one attempt
    /// later, at twice the states.
    pub(super) forget_with_budget: Option<u8>,
    /// The user may press Stop (`Action::Cancel`) in the runs with this attempt budget. One
    /// budget, for the reason given for forgetting: two attempts already meet a Stop in every
    /// phase (pending before a claim or backing off, under a live or lapsed lease, mid-call,
    /// mid-completion, after a completion, a failure or a Stop), and allowing it with three
    /// attempts too took the check with failures from 1.35 to 2.1 times the states it has
    /// without Stop, with every property still holding.
    pub(super) cancel_with_budget: Option<u8>,
    pub(super) lease_check: LeaseCheck,
    pub(super) insert: TaskInsert,
    pub(super) cancel: CancelCheck,
    pub(super) takeover: PartitionTakeover,
}
