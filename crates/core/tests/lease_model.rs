//! An exhaustive model check of the fenced lease protocol (I1 one reply, I2 fenced, I7 bounded
//! effort) and of how the task's end settles its quota reservation (I8: never released while
//! the provider may have done the work), with the `stateright` checker.
//!
//! One task row, a few workers that claim, renew, call the provider, complete, crash, restart
//! and stall, whose provider calls may also fail (retryable: the lease is given back with a
//! backoff; fatal: the task fails), a task deadline, and a discrete database clock. Claims are
//! decided by replyd's own `decide_claim` and refused writes are classified by its own
//! `classify_refusal`, so the check covers the code the store runs, not a paraphrase of it.
//! What is modelled by hand is what lives in SQL (`store::tasks`): the guarded UPDATE's
//! predicate and the columns each statement writes; those are transcribed next to the
//! statements they mirror.
//!
//! The task may also be forgotten (`Action::Forget`, migration V21), at most once a run:
//! retention deletes it once it is finished and its reservation settled, an erasure at any
//! moment, settling an open task's reservation first (charged when the provider may have done
//! the work, else released). Its row is gone and its id remembered: a fenced write finds no
//! row (`Refusal::NotFound`) and its worker claims again; a claim answers
//! `ClaimOutcome::Forgotten` and its worker is done with the record; the insert that a
//! record's first claim makes refuses the id, so a redelivered record never brings the task
//! back.
//!
//! The user may also press Stop (`Action::Cancel`, migration V23) at any moment the row exists.
//! A Stop races every worker's statement, so it is modelled as the one locked transaction
//! `replyd_cancel` is: it must lose to a saved reply (I1: a finished task is left alone), and
//! when it wins it must fence the in-flight assignment, so that the worker's late completion is
//! refused (`Refusal::Cancelled`), its next claim answers `AlreadyCancelled` and its record is
//! done (I3: cancelled is terminal). Its reservation is settled by the Stop itself (V27):
//! charged when a call may have run (the task was running, under a live lease or a lapsed
//! one, or an earlier call may have done work), since its user may have been shown the text
//! the provider bills; released only when no call can have started. So the I8 property that
//! no reservation is released while the provider may have done the work holds for a Stop as
//! for every other settler, with no exception.
//!
//! While its call runs, a worker may write pieces of the call's text for the task's followers
//! (`Action::LivePiece`, migration V26). The piece's insert is guarded by the assignment and
//! the status only; the model checks that this is enough for followers never to be shown, as
//! the current attempt's, text from an assignment a claim or a Stop has superseded, or after
//! the task ended or was forgotten. An accepted piece changes no state the protocol reads.
//!
//! A claim made for a Kafka record may take over at once a live lease that was taken for a
//! record of the same partition by another holder (`Claimer::may_take_over`, migration V33):
//! the group gives a partition to one member at a time, so such a holder is dead or a zombie.
//! With `PartitionTakeover::ByPartition` every worker is a member that was given the record's
//! partition at some moment, and claims as its holder; the model does not keep the group's
//! assignment, so any worker may take over another's live lease at any time, which is more
//! than Kafka allows and so the worst case for the protocol. A worker's lease owner is its id
//! and its incarnation (`<worker_id>#<token>`), which a restart changes: a restarted worker
//! takes over the live lease of its previous incarnation. The checker must find that the
//! fence still refuses the old holder's writes (I1, I2), that the attempt budget still bounds
//! the calls (I7), and that the takeover notes that the old holder's call may have run (I8);
//! the fifth check leaves that note out and must find the release of work the provider did.
//!
//! The clock and the number of crashes and stalls are bounded, so the state space is finite and
//! the breadth-first search visits all of it.
//!
//! The second model checks the lease with the clock read when the completion statement
//! *started* instead of after the row lock is held (the PostgreSQL behaviour that
//! `a_guarded_update_without_locking_first_accepts_an_expired_lease` shows on the real server),
//! and the checker must find the zombie reply that lets in: proof that the model can fail. The
//! third inserts a record's task without consulting `forgotten_tasks`, and the checker must
//! find the attempt that starts on the task the insert brings back. The fourth cancels without
//! locking the row and reading its status, and the checker must find the saved reply it
//! cancels.

use std::time::Instant;

use chrono::{DateTime, Utc};
use replyd_core::domain::TaskStatus;
use replyd_core::lease::{
    ClaimDecision, ClaimOutcome, Claimer, LeaseSnapshot, Refusal, classify_refusal, decide_claim,
    lease_live,
};
use stateright::{Checker, HasDiscoveries, Model, Property};

const ZOMBIE_ACCEPTED: &str = "I2: no zombie reply is accepted after its lease lapsed";
const ATTEMPT_AFTER_FORGETTING: &str = "no attempt starts after the task is forgotten";
const SAVED_REPLY_CANCELLED: &str =
    "I1: a task with a saved reply stays completed (no Stop cancels it)";
const SETTLED_TWICE: &str = "I8: a reservation is settled at most once";
const RELEASED_AFTER_WORK: &str =
    "I8: a reservation is never released while the provider may have done the work";

/// A reading of the database clock, in ticks since the start of the run.
type Tick = u8;
type WorkerId = u8;

/// Which clock the completion's guarded UPDATE compares `lease_until` with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LeaseCheck {
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
enum TaskInsert {
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
enum PartitionTakeover {
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
const PARTITION: u8 = 0;

/// What the user's Stop (`replyd_cancel`) reads before it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum CancelCheck {
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
struct LeaseProtocol {
    workers: u8,
    /// One initial state per budget and deadline.
    max_attempts: &'static [u8],
    deadlines: &'static [Option<Tick>],
    /// Whether provider calls may fail (`Action::CallFails`).
    call_failures: bool,
    /// A retryable failure gives the lease back with `next_attempt_at = now + backoff_ticks`.
    backoff_ticks: u8,
    /// Refusals (a retryable failure that surely did no work) a task may meet before the next
    /// one fails it: `retry.refusal_budget_ms`, counted instead of timed.
    refusal_budget: u8,
    /// A claim or renewal leases the task until `now + lease_ticks`.
    lease_ticks: u8,
    /// The clock stops here; the checker explores every interleaving up to it.
    last_tick: Tick,
    /// Crashes over the whole run; a crashed worker may restart (its record redelivered).
    max_crashes: u8,
    /// Stalls over the whole run.
    max_stalls: u8,
    /// The task may be forgotten (`Action::Forget`) in the runs with this attempt budget. One
    /// budget is enough: two attempts already meet forgetting in every phase of the lease
    /// (before any claim, under a live or lapsed lease, after a takeover, a release, a
    /// completion, a failure), and the runs with more only repeat those meetings one attempt
    /// later, at twice the states.
    forget_with_budget: Option<u8>,
    /// The user may press Stop (`Action::Cancel`) in the runs with this attempt budget. One
    /// budget, for the reason given for forgetting: two attempts already meet a Stop in every
    /// phase (pending before a claim or backing off, under a live or lapsed lease, mid-call,
    /// mid-completion, after a completion, a failure or a Stop), and allowing it with three
    /// attempts too took the check with failures from 1.35 to 2.1 times the states it has
    /// without Stop, with every property still holding.
    cancel_with_budget: Option<u8>,
    lease_check: LeaseCheck,
    insert: TaskInsert,
    cancel: CancelCheck,
    takeover: PartitionTakeover,
}

/// The columns of the task row that fencing reads or writes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct TaskRow {
    status: TaskStatus,
    assignment_version: u8,
    /// The worker and its incarnation (`<worker_id>#<token>`).
    lease_owner: Option<(WorkerId, u8)>,
    /// `lease_partition` (V33): written by a claim that holds its record's partition alone.
    lease_partition: Option<u8>,
    lease_until: Option<Tick>,
    attempt_count: u8,
    max_attempts: u8,
    deadline: Option<Tick>,
    next_attempt_at: Option<Tick>,
    saved: Option<SavedReply>,
    /// `provider_may_have_run`: some call may have done work whose answer was never saved.
    may_have_run: bool,
    /// `refusals`: calls the provider turned away; each gave its attempt back.
    refusals: u8,
}

impl TaskRow {
    /// The row `replyd_insert_task` inserts for a record: its inputs, every other column its
    /// default.
    fn inserted(max_attempts: u8, deadline: Option<Tick>) -> Self {
        Self {
            status: TaskStatus::Pending,
            assignment_version: 0,
            lease_owner: None,
            lease_partition: None,
            lease_until: None,
            attempt_count: 0,
            max_attempts,
            deadline,
            next_attempt_at: None,
            saved: None,
            may_have_run: false,
            refusals: 0,
        }
    }
}

/// Whether the task's row exists, and whether its id is in `forgotten_tasks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Presence {
    /// The row exists; the task was never forgotten.
    Present,
    /// Retention or an erasure deleted the row (with its attempts and its reservation) and
    /// remembered its id. `State::row` keeps what the row held when it went, for the
    /// properties that speak about the past.
    Forgotten,
    /// Only with `TaskInsert::IgnoresForgotten`: a record's insert put a forgotten task back.
    Recreated,
}

impl Presence {
    fn row_exists(self) -> bool {
        self != Presence::Forgotten
    }

    fn ever_forgotten(self) -> bool {
        self != Presence::Present
    }
}

/// The task's quota reservation (I8), as the settlement trigger and the reconciler move it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Reservation {
    Reserved,
    /// Settled with a charge of these tokens (V17).
    Charged(Tokens),
    Released,
}

/// What a charge counts in tokens: the usage a reply reported, or the request's ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Tokens {
    /// The usage the reply of this worker's claim at this version reported.
    ReportedBy(SavedReply),
    Ceiling,
    /// A Stop's charge: the prompt's bound and the text its followers were shown
    /// (`replyd_stop_tokens`, V27).
    Stopped,
}

/// Whether a reply carries usage: worker 0's provider answers report it, worker 1's do not,
/// so both kinds of reply (and of charge) are in every run without a state of their own.
fn reports_usage(reply: SavedReply) -> bool {
    reply.worker == 0
}

/// `replyd_tokens_to_charge` (V17) at a charge: the saved reply's reported usage, else the
/// ceiling (no reply saved, or it reported none).
fn tokens_of(saved: Option<SavedReply>) -> Tokens {
    match saved {
        Some(reply) if reports_usage(reply) => Tokens::ReportedBy(reply),
        _ => Tokens::Ceiling,
    }
}

/// Who settled the task's reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Settler {
    /// `replyd_settle_reservation` (V13), in the transaction that completes or fails the task.
    TaskEnd,
    /// The quota's reconciler (`quota.charge_unresolved`).
    Reconciler,
    /// `replyd_forget`'s erasure of an open task (V21).
    Erasure,
    /// The user's Stop (`replyd_cancel`, V23).
    Cancel,
}

/// What the user's Stop found when it held the row lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum StopFound {
    /// Never claimed, or backing off after a retryable failure: cancelled.
    Pending,
    /// Running under a live lease, its worker in the call or about to save: cancelled, and
    /// that worker fenced.
    LiveLease,
    /// Running under a lapsed lease (its worker crashed, stalled or is late): cancelled, and the
    /// lapsed-call trigger notes that the provider may have run, as a takeover does.
    LapsedLease,
    /// Completed, failed or cancelled: `already_<status>`, and replyd's Stop writes nothing.
    Finished(TaskStatus),
}

/// Whose reply the row's `saved_response` holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct SavedReply {
    worker: WorkerId,
    version: u8,
}

/// What one worker (one process handling the task's record) is doing. A worker keeps no lease
/// deadline of its own: it may renew or complete at any moment, however late, and only the
/// row's fencing can stop it, which is the worst case for the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Phase {
    /// Has the record and will claim (again): the pipeline's loop.
    Idle,
    /// Restarted, with the record delivered again: its first claim inserts the record's task
    /// first (`replyd_insert_task`), which does nothing while the row exists. (The workers
    /// start `Idle`: the run's row is their records' task, and an insert before a claim only
    /// matters once the task is forgotten, when replyd's claim answers `forgotten` with it or
    /// without it; the broken insert, the one it matters to, shows on a redelivered record.)
    Redelivered,
    /// Holds assignment `version` and is calling the provider; renews in the background.
    Calling { version: u8 },
    /// The provider answered; the reply is not saved yet.
    HasReply { version: u8 },
    /// The completion statement was sent at `started_at` and waits for the row lock.
    Completing { version: u8, started_at: Tick },
    /// The process died; its leases lapse on their own. It may come back with the record
    /// redelivered.
    Crashed,
    /// Finished with the record: its reply was saved, or the task is terminal.
    Done,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Worker {
    phase: Phase,
    /// How often this worker id was restarted: its lease owner's incarnation.
    incarnation: u8,
    /// Takes no action while time passes (SIGSTOP, a long GC pause); a zombie if its lease
    /// lapses meanwhile.
    stalled: bool,
}

/// One accepted fenced write (completion, release or failure), with what held at the instant it
/// was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Acceptance {
    worker: WorkerId,
    version: u8,
    /// The row's `assignment_version` when the write happened.
    current_version: u8,
    lease_until: Option<Tick>,
    /// The database clock when the write happened.
    at: Tick,
}

impl Acceptance {
    /// A write by `worker` holding `version`, accepted on `row` (as it was before the write)
    /// at `now`.
    fn of(worker: WorkerId, version: u8, row: &TaskRow, now: Tick) -> Self {
        Self {
            worker,
            version,
            current_version: row.assignment_version,
            lease_until: row.lease_until,
            at: now,
        }
    }
}

/// What happened so far, for the properties. Kept in the state so that a property can speak
/// about the past (every acceptance ever, not just the row's one slot).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
struct History {
    accepted: Vec<Acceptance>,
    /// Accepted releases (retryable failures) and failures, in order.
    gave_up: Vec<Acceptance>,
    /// The first claim decided against the backoff or the deadline, as text.
    bad_claim: Option<String>,
    /// A completed, failed or cancelled task became something else.
    left_terminal: bool,
    released: bool,
    claimed_after_release: bool,
    failed_on_deadline: bool,
    failed_on_budget: bool,
    /// The first refused write whose `classify_refusal` answer disagrees with the row it was
    /// read from (`Refusal` has no `Hash`, so it is kept as text).
    misclassified: Option<String>,
    zombie_refused: bool,
    taken_over: bool,
    /// A claim took over (or failed on its budget or deadline) a live lease of another holder
    /// of the partition, and one of a previous incarnation of the claimer's own id.
    took_over_live: bool,
    took_over_own_id: bool,
    own_write_recognised: bool,
    /// The provider did (or may have done) the task's work at least once: a call that
    /// answered, a failed call that may have run, a call whose worker crashed.
    work_done: bool,
    /// A failed task's reservation was held open because its work may exist.
    held_unresolved: bool,
    /// Calls that may have cost money: a call that answered, a failed call that may have run,
    /// a call whose worker crashed (I7 bounds these by `max_attempts`).
    paid_calls: u8,
    refused: bool,
    failed_on_refusals: bool,
    /// The workers holding the current assignment's live lease when the task was forgotten,
    /// one bit each.
    held_lease_when_forgotten: u8,
    forgotten_by_retention: bool,
    /// An erasure settled an open task's reservation as charged, or as released.
    erasure_charged: bool,
    erasure_released: bool,
    /// A forgotten task's row came back.
    came_back: bool,
    /// A claim took a lease (and so started an attempt and its call) after the task was
    /// forgotten.
    attempt_after_forgetting: bool,
    /// A reply, or a renewal, release or failure, was accepted after the task was forgotten.
    reply_after_forgetting: bool,
    write_after_forgetting: bool,
    /// A worker that held the live lease when the task was forgotten had its completion
    /// refused for want of a row.
    leaseholder_found_no_row: bool,
    redelivered_found_forgotten: bool,
    /// Who settled the reservation first, and whether anything settled it again.
    settled_by: Option<Settler>,
    settled_again: bool,
    /// A Stop wrote `status = 'cancelled'`.
    cancelled: bool,
    /// A claim took a lease, a reply was accepted, or a renewal, release or failure was
    /// written, after the task was cancelled.
    attempt_after_cancel: bool,
    reply_after_cancel: bool,
    write_after_cancel: bool,
    /// The workers, one bit each, whose completion was refused as cancelled while they held
    /// the assignment the Stop superseded: their call was in flight when the Stop came.
    completion_refused_by_cancel: u8,
    /// A piece of live text was accepted from an assignment that is not the row's, or after
    /// the task ended, was stopped or was forgotten: followers would be shown text as the
    /// current attempt's that can never be saved.
    piece_out_of_turn: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct State {
    /// The database clock (`clock_timestamp()`).
    now: Tick,
    row: TaskRow,
    presence: Presence,
    reservation: Reservation,
    workers: Vec<Worker>,
    crashes: u8,
    stalls: u8,
    /// What the Stop pressed by the last action found, cleared by the next action. A press
    /// that finds the task finished leaves the row as it was: remembered for longer, it would
    /// only copy the rest of the run, and remembered for one step it shows the press happened.
    stop_answer: Option<StopFound>,
    history: History,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Action {
    /// The database clock advances one tick.
    Tick,
    Claim(WorkerId),
    Renew(WorkerId),
    /// The provider call returns a reply.
    FinishCall(WorkerId),
    /// The provider call fails. Retryable: the lease is given back with a backoff
    /// (`release_for_retry`); otherwise the task fails (`fail`). Both are fenced writes,
    /// atomic at the current clock like a renewal. `ran`: the call may have done the work
    /// (its answer was lost), which the write remembers on the task.
    CallFails {
        worker: WorkerId,
        retryable: bool,
        ran: bool,
    },
    /// The quota's reconciler, past the reservation's TTL, settles the open reservation of a
    /// failed task whose work may exist (`quota.charge_unresolved`, true: charged).
    Reconcile,
    /// The completion statement is sent (and may wait for the row lock).
    StartCompletion(WorkerId),
    /// The completion gets the row lock and runs the guarded UPDATE. `ack_lost`: the commit
    /// happens but the worker does not learn it, so it retries the completion.
    ApplyCompletion {
        worker: WorkerId,
        ack_lost: bool,
    },
    Crash(WorkerId),
    Restart(WorkerId),
    Stall(WorkerId),
    Resume(WorkerId),
    /// `replyd_forget` (V21) deletes the task and remembers its id: retention (a finished task
    /// whose reservation is settled) or an erasure (any task, an open one settled first).
    Forget {
        erasure: bool,
    },
    /// `replyd_cancel` (V23): the user presses Stop.
    Cancel,
    /// `replyd_live_append_batch` (V30; V26's `replyd_live_append` before it): the worker
    /// writes a piece of its call's text for the task's followers, in a round with its other
    /// attempts' pieces, each accepted only while its assignment is the row's and running. It changes
    /// nothing a claim or a write reads: only what the followers are shown.
    LivePiece(WorkerId),
}

/// The database clock as the timestamps the fencing functions compare.
fn instant(tick: Tick) -> DateTime<Utc> {
    // A fixed, valid instant: from_timestamp only fails far outside chrono's range.
    DateTime::from_timestamp(1_800_000_000 + i64::from(tick), 0).expect("in range")
}

fn owner_name((worker, incarnation): (WorkerId, u8)) -> String {
    format!("w{worker}#{incarnation}")
}

/// The row as `tasks::SNAPSHOT` reads it under the row lock, with `clock_timestamp()`.
fn snapshot(row: &TaskRow, now: Tick) -> LeaseSnapshot {
    LeaseSnapshot {
        status: row.status,
        assignment_version: i64::from(row.assignment_version),
        lease_owner: row.lease_owner.map(owner_name),
        lease_partition: row.lease_partition.map(i32::from),
        lease_until: row.lease_until.map(instant),
        attempt_count: i32::from(row.attempt_count),
        max_attempts: i32::from(row.max_attempts),
        deadline: row.deadline.map(instant),
        next_attempt_at: row.next_attempt_at.map(instant),
        has_response: row.saved.is_some(),
        now: instant(now),
    }
}

/// The predicate of every fenced write in `tasks` (renew, complete, fail, release):
/// `WHERE task_id = $1 AND assignment_version = $2 AND status = 'running'
/// AND lease_until > clock_timestamp() AND saved_response IS NULL`, with `clock` standing for
/// `clock_timestamp()`: a deleted (forgotten) row matches nothing. (In this model
/// `status = 'running'` already excludes a saved reply, since saving completes the task in the
/// same UPDATE; the last clause is a second line of defence, and removing it changes nothing
/// the checker can see.)
fn guarded_update_matches(state: &State, version: u8, clock: Tick) -> bool {
    let row = &state.row;
    state.presence.row_exists()
        && row.assignment_version == version
        && row.status == TaskStatus::Running
        && row.lease_until.is_some_and(|until| until > clock)
        && row.saved.is_none()
}

/// Whether a refusal names what is really true of the row it was classified from.
fn refusal_is_truthful(state: &State, version: u8, refusal: &Refusal) -> bool {
    let (row, now) = (&state.row, state.now);
    if !state.presence.row_exists() {
        return *refusal == Refusal::NotFound;
    }
    match refusal {
        Refusal::AlreadySaved { by_this_assignment } => row
            .saved
            .is_some_and(|saved| (saved.version == version) == *by_this_assignment),
        Refusal::Failed => row.status == TaskStatus::Failed,
        Refusal::Cancelled => row.status == TaskStatus::Cancelled,
        Refusal::TakenOver { current_version } => {
            row.assignment_version != version
                && *current_version == i64::from(row.assignment_version)
        }
        Refusal::LeaseExpired => {
            row.assignment_version == version && row.lease_until.is_none_or(|until| until <= now)
        }
        // The row is there.
        Refusal::NotFound => false,
    }
}

impl LeaseProtocol {
    /// Records a refused fenced write by `worker` holding `version`, classified by replyd. The
    /// refusal is read under the lock the refused write held; when that read finds no row (the
    /// task was forgotten), `tasks` answers `NotFound` without classifying.
    fn refuse(state: &mut State, worker: WorkerId, version: u8) -> Refusal {
        let refusal = if state.presence.row_exists() {
            classify_refusal(&snapshot(&state.row, state.now), i64::from(version))
        } else {
            Refusal::NotFound
        };
        if !refusal_is_truthful(state, version, &refusal) {
            state
                .history
                .misclassified
                .get_or_insert_with(|| format!("w{worker} version {version}: {refusal:?}"));
        }
        refusal
    }

    /// `Store::claim`: lock the row reading the snapshot with `clock_timestamp()` (one atomic
    /// step: the row lock serialises it against every other write), decide with
    /// `decide_claim`, and write what it decides.
    fn claim(&self, state: &mut State, worker: WorkerId) {
        let now = state.now;
        let received = state.workers[usize::from(worker)].phase;
        // `replyd_insert_task` (V21), for a record's first claim: `IF EXISTS (SELECT 1 FROM
        // forgotten_tasks ...) THEN RETURN false`, then `INSERT ... ON CONFLICT (task_id) DO
        // NOTHING`, which leaves a row that is there alone. Only the broken insert, which skips
        // the first test, puts a forgotten task back.
        if received == Phase::Redelivered
            && state.presence == Presence::Forgotten
            && self.insert == TaskInsert::IgnoresForgotten
        {
            state.row = TaskRow::inserted(state.row.max_attempts, state.row.deadline);
            state.presence = Presence::Recreated;
        }
        let owner = (worker, state.workers[usize::from(worker)].incarnation);
        let owner_string = owner_name(owner);
        let claimer = Claimer {
            owner: &owner_string,
            partition: (self.takeover != PartitionTakeover::Off).then_some(i32::from(PARTITION)),
        };
        let decision = if state.presence.row_exists() {
            decide_claim(&snapshot(&state.row, now), &claimer)
        } else {
            // `replyd_claim` (V21): `SELECT ... FOR UPDATE` finds no row and `forgotten_tasks`
            // holds the id: 'forgotten'. (No row without a forgetting: the model's row exists
            // from the start.)
            ClaimDecision::Refuse(ClaimOutcome::Forgotten)
        };
        let early = state.row.next_attempt_at.is_some_and(|at| now < at);
        let late = state.row.deadline.is_some_and(|d| now >= d);
        if matches!(decision, ClaimDecision::Claim { .. }) && (early || late) {
            state
                .history
                .bad_claim
                .get_or_insert_with(|| format!("w{worker} claimed at {now}: {:?}", state.row));
        }
        // `replyd_note_lapsed_call` (V13): a running row whose lease ran out, taken over or
        // failed by a claim, lost an assignment that may have sent its call. A live lease
        // taken over (V33) notes it in the claim's own UPDATE, but not in the broken takeover.
        let live = lease_live(
            state.row.status,
            state.row.lease_until.map(instant),
            instant(now),
        );
        let lapsed_running = state.row.status == TaskStatus::Running
            && !(live && self.takeover == PartitionTakeover::ByPartitionNotingNothing);
        if live
            && matches!(
                decision,
                ClaimDecision::Claim { .. } | ClaimDecision::Fail { .. }
            )
        {
            state.history.took_over_live = true;
            state.history.took_over_own_id |=
                state.row.lease_owner.is_some_and(|(w, _)| w == worker);
        }
        let phase = match decision {
            ClaimDecision::Claim { takes_over } => {
                // UPDATE ... SET status = 'running', assignment_version = assignment_version + 1,
                // lease_owner = $2, lease_until = clock_timestamp() + lease,
                // attempt_count = attempt_count + 1
                let row = &mut state.row;
                row.status = TaskStatus::Running;
                row.assignment_version += 1;
                row.lease_owner = Some(owner);
                // `lease_partition = CASE WHEN $held THEN $partition END`
                row.lease_partition = claimer.partition.map(|_| PARTITION);
                row.lease_until = Some(now + self.lease_ticks);
                row.attempt_count += 1;
                row.may_have_run |= lapsed_running;
                state.history.taken_over |= takes_over.is_some();
                state.history.claimed_after_release |= state.history.released;
                state.history.attempt_after_forgetting |= state.presence.ever_forgotten();
                state.history.attempt_after_cancel |= state.history.cancelled;
                Phase::Calling {
                    version: row.assignment_version,
                }
            }
            ClaimDecision::Fail { outcome, .. } => {
                match outcome {
                    ClaimOutcome::BudgetExhausted { .. } => {
                        state.history.failed_on_budget = true;
                    }
                    ClaimOutcome::DeadlinePassed { .. } => {
                        state.history.failed_on_deadline = true;
                    }
                    other => panic!("a claim failed for a reason it cannot have: {other:?}"),
                }
                // UPDATE ... SET status = 'failed' (lease columns untouched).
                state.row.may_have_run |= lapsed_running;
                state.row.status = TaskStatus::Failed;
                Phase::Done
            }
            ClaimDecision::Refuse(ClaimOutcome::AlreadyCompleted | ClaimOutcome::AlreadyFailed) => {
                Phase::Done
            }
            // The record is done, with no call: a cancelled task is never run again.
            ClaimDecision::Refuse(ClaimOutcome::AlreadyCancelled) => Phase::Done,
            // The record is done, with no call: a forgotten task is never run again.
            ClaimDecision::Refuse(ClaimOutcome::Forgotten) => {
                state.history.redelivered_found_forgotten |= received == Phase::Redelivered;
                Phase::Done
            }
            // Parks until the lease or the backoff ends, then claims again: stays idle.
            ClaimDecision::Refuse(
                ClaimOutcome::LeasedByOther { .. } | ClaimOutcome::NotBefore { .. },
            ) => Phase::Idle,
            ClaimDecision::Refuse(outcome) => {
                panic!("the row is absent only once forgotten, yet the claim said {outcome:?}")
            }
        };
        state.workers[usize::from(worker)].phase = phase;
    }

    /// `Store::renew`, evaluated atomically at the current clock: the row lock is taken first,
    /// so no other write and no stale clock reading can come between the check and the write.
    fn renew(&self, state: &mut State, worker: WorkerId, version: u8) {
        let now = state.now;
        if guarded_update_matches(state, version, now) {
            state.history.write_after_forgetting |= state.presence.ever_forgotten();
            state.history.write_after_cancel |= state.history.cancelled;
            state.row.lease_until = Some(now + self.lease_ticks);
        } else {
            // A refused renewal stops the call; the pipeline loops back to read and claim (and a
            // cancelled task's claim ends the record).
            Self::refuse(state, worker, version);
            state.workers[usize::from(worker)].phase = Phase::Idle;
        }
    }

    /// `Store::release_for_retry` (retryable) or `Store::fail` after a failed provider call,
    /// evaluated atomically at the current clock (row lock first, like a renewal).
    fn give_up(
        &self,
        state: &mut State,
        worker: WorkerId,
        version: u8,
        retryable: bool,
        ran: bool,
    ) {
        let now = state.now;
        let phase = if guarded_update_matches(state, version, now) {
            state.history.write_after_forgetting |= state.presence.ever_forgotten();
            state.history.write_after_cancel |= state.history.cancelled;
            state
                .history
                .gave_up
                .push(Acceptance::of(worker, version, &state.row, now));
            let refusal_budget = self.refusal_budget;
            let row = &mut state.row;
            // SET provider_may_have_run = provider_may_have_run OR $ran
            row.may_have_run |= ran;
            // A refusal (retryable, surely no work) gives its attempt back:
            // attempt_count = attempt_count - 1, refusals = refusals + 1.
            let refusal = retryable && !ran;
            if refusal {
                row.attempt_count -= 1;
                row.refusals += 1;
                state.history.refused = true;
            }
            if refusal && row.refusals > refusal_budget {
                // `retry::decide`: the refusal budget is spent; the task fails.
                row.status = TaskStatus::Failed;
                state.history.failed_on_refusals = true;
                Phase::Done
            } else if retryable {
                // SET status = 'pending', lease_owner = NULL, lease_until = NULL,
                // next_attempt_at = clock_timestamp() + backoff
                row.status = TaskStatus::Pending;
                row.lease_owner = None;
                row.lease_until = None;
                row.next_attempt_at = Some(now + self.backoff_ticks);
                state.history.released = true;
                // The pipeline loops back to read and claim (which waits out the backoff).
                Phase::Idle
            } else {
                // SET status = 'failed'
                row.status = TaskStatus::Failed;
                Phase::Done
            }
        } else {
            Self::refuse(state, worker, version);
            Phase::Idle
        };
        state.workers[usize::from(worker)].phase = phase;
    }

    /// `Store::complete` once the row lock is held: the guarded UPDATE, and on zero rows the
    /// refusal read under the same lock. This step is atomic at the current clock because the
    /// row lock serialises it against every other write and `clock_timestamp()` is read after
    /// the lock; only the broken variant reads the clock from before the wait.
    fn apply_completion(
        &self,
        state: &mut State,
        worker: WorkerId,
        version: u8,
        started_at: Tick,
        ack_lost: bool,
    ) {
        let now = state.now;
        let lease_clock = match self.lease_check {
            LeaseCheck::AfterRowLock => now,
            LeaseCheck::WhenStatementStarted => started_at,
        };
        let phase = if guarded_update_matches(state, version, lease_clock) {
            state.history.reply_after_forgetting |= state.presence.ever_forgotten();
            state.history.reply_after_cancel |= state.history.cancelled;
            state
                .history
                .accepted
                .push(Acceptance::of(worker, version, &state.row, now));
            // UPDATE ... SET saved_response = $3, status = 'completed' (one statement, I4).
            state.row.saved = Some(SavedReply { worker, version });
            state.row.status = TaskStatus::Completed;
            if ack_lost {
                // The pipeline retries a store call whose outcome it did not learn.
                Phase::HasReply { version }
            } else {
                Phase::Done
            }
        } else {
            match Self::refuse(state, worker, version) {
                Refusal::AlreadySaved {
                    by_this_assignment: true,
                } => {
                    state.history.own_write_recognised = true;
                    Phase::Done
                }
                Refusal::TakenOver { .. } | Refusal::LeaseExpired => {
                    state.history.zombie_refused = true;
                    Phase::Idle
                }
                // The task was forgotten: the pipeline claims again and finds it so.
                Refusal::NotFound => {
                    state.history.leaseholder_found_no_row |=
                        state.history.held_lease_when_forgotten & (1 << worker) != 0;
                    Phase::Idle
                }
                // The user stopped the task: the pipeline claims again and finds it cancelled.
                Refusal::Cancelled => {
                    // The Stop added one to the version it found, and no claim follows it.
                    if version + 1 == state.row.assignment_version {
                        state.history.completion_refused_by_cancel |= 1 << worker;
                    }
                    Phase::Idle
                }
                // The loop reads the row next and stops on a terminal task.
                _ => Phase::Idle,
            }
        };
        state.workers[usize::from(worker)].phase = phase;
    }

    /// `replyd_forget(tasks, 'retention' | 'erasure')` (V21): one transaction that locks the row
    /// first (`SELECT ... FOR UPDATE`, waiting out any statement that holds it), so one atomic
    /// step here, between any two other statements on the row.
    fn forget(state: &mut State, erasure: bool) {
        let now = state.now;
        for (id, worker) in (0..).zip(&state.workers) {
            if let Phase::Calling { version }
            | Phase::HasReply { version }
            | Phase::Completing { version, .. } = worker.phase
                && guarded_update_matches(state, version, now)
            {
                state.history.held_lease_when_forgotten |= 1 << id;
            }
        }
        let row = &state.row;
        // Every open reservation is settled first, whatever the task's status:
        // `replyd_settle_to(task, CASE WHEN status = 'running' OR provider_may_have_run THEN
        // 'charged' ELSE 'released' END)`, guarded on the reservation being open. A running
        // task's worker may be in the call, whatever its lease says; a failed task's
        // reservation is open only while its work may exist (left for the reconciler), so it
        // is charged. Retention picks none that is open.
        if state.reservation == Reservation::Reserved {
            if row.status == TaskStatus::Running || row.may_have_run {
                let charge = Reservation::Charged(tokens_of(row.saved));
                settle(state, charge, Settler::Erasure);
                state.history.erasure_charged = true;
            } else {
                settle(state, Reservation::Released, Settler::Erasure);
                state.history.erasure_released = true;
            }
        }
        // INSERT INTO forgotten_tasks ...; DELETE FROM reply_attempts ...;
        // DELETE FROM reply_tasks ...
        state.presence = Presence::Forgotten;
        state.history.forgotten_by_retention = !erasure;
    }

    /// `replyd_cancel(task)` (V23), the user's Stop: one transaction that locks the row first
    /// (`SELECT ... FOR UPDATE`, waiting out any statement that holds it), so one atomic step
    /// here, between any two other statements on the row. (No row answers `not_found`, or
    /// `forgotten`, and writes nothing; the action is offered only while the row exists.)
    fn cancel(&self, state: &mut State) {
        let now = state.now;
        let row = &state.row;
        let live = lease_live(row.status, row.lease_until.map(instant), instant(now));
        let found = match row.status {
            TaskStatus::Pending => StopFound::Pending,
            TaskStatus::Running if live => StopFound::LiveLease,
            TaskStatus::Running => StopFound::LapsedLease,
            finished => StopFound::Finished(finished),
        };
        state.stop_answer = Some(found);
        // replyd's Stop reads the status under the lock: `IF status IN ('completed', 'failed',
        // 'cancelled') THEN RETURN 'already_' || status` (a Stop that loses the race to a saved
        // reply, or a second press, changes nothing). The broken one reads nothing.
        if self.cancel != CancelCheck::OverwritesAnyStatus
            && matches!(found, StopFound::Finished(_))
        {
            return;
        }
        // UPDATE reply_tasks SET status = 'cancelled',
        // assignment_version = assignment_version + 1 (fences the in-flight worker),
        // lease_owner = NULL, lease_until = NULL, next_attempt_at = NULL,
        // finished_at = clock_timestamp(). `replyd_note_lapsed_call` (V13) fires on it as on a
        // takeover: a running row whose lease lapsed lost an assignment that may have sent its
        // call. (`UPDATE reply_attempts SET outcome = 'cancelled'` on the current assignment's
        // open attempt follows; the model keeps no attempt rows.)
        let row = &mut state.row;
        // `provider_may_have_run OR status = 'running'`: a running task's call may be under
        // way whether its lease is live or lapsed.
        row.may_have_run |= matches!(found, StopFound::LiveLease | StopFound::LapsedLease);
        let may_have_run = row.may_have_run;
        row.status = TaskStatus::Cancelled;
        row.assignment_version += 1;
        row.lease_owner = None;
        row.lease_until = None;
        row.next_attempt_at = None;
        state.history.cancelled = true;
        // `replyd_settle_to(task, CASE WHEN may_have_run THEN 'charged' ELSE 'released' END,
        // ..., shown)` before the status changes, guarded on the reservation being open. The
        // broken Stop's release is guarded by nothing and reads nothing.
        if self.cancel == CancelCheck::OverwritesAnyStatus {
            settle(state, Reservation::Released, Settler::Cancel);
        } else if self.cancel == CancelCheck::ReleasesWhateverRan {
            if state.reservation == Reservation::Reserved {
                settle(state, Reservation::Released, Settler::Cancel);
            }
        } else if state.reservation == Reservation::Reserved {
            let to = if may_have_run {
                Reservation::Charged(Tokens::Stopped)
            } else {
                Reservation::Released
            };
            settle(state, to, Settler::Cancel);
        }
    }
}

/// Settles the reservation as `to` and remembers who did. A second settlement is recorded, not
/// prevented (every real settler is guarded on the reservation being open), so that the
/// property forbidding it sees a settler that is not.
fn settle(state: &mut State, to: Reservation, by: Settler) {
    state.history.settled_again |= state.reservation != Reservation::Reserved;
    state.history.settled_by.get_or_insert(by);
    state.reservation = to;
}

impl Model for LeaseProtocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        self.max_attempts
            .iter()
            .flat_map(|&max_attempts| self.deadlines.iter().map(move |&d| (max_attempts, d)))
            .map(|(max_attempts, deadline)| State {
                now: 0,
                row: TaskRow::inserted(max_attempts, deadline),
                presence: Presence::Present,
                reservation: Reservation::Reserved,
                workers: vec![
                    Worker {
                        phase: Phase::Idle,
                        incarnation: 0,
                        stalled: false,
                    };
                    usize::from(self.workers)
                ],
                crashes: 0,
                stalls: 0,
                stop_answer: None,
                history: History::default(),
            })
            .collect()
    }

    fn actions(&self, state: &State, actions: &mut Vec<Action>) {
        // Once the row is gone nothing reads the clock (no fenced write can match it, every
        // claim answers `forgotten`), so it stops: states that differ only in it are one.
        if state.now < self.last_tick && state.presence.row_exists() {
            actions.push(Action::Tick);
        }
        // The reconciler finds open reservations by their rows: none once the task is forgotten.
        if state.presence.row_exists()
            && state.row.status == TaskStatus::Failed
            && state.reservation == Reservation::Reserved
        {
            actions.push(Action::Reconcile);
        }
        if state.presence == Presence::Present
            && self.forget_with_budget == Some(state.row.max_attempts)
        {
            actions.push(Action::Forget { erasure: true });
            // Retention (`Store::forget_finished`) picks a finished task whose reservation is
            // settled: one whose work may exist waits for the reconciler.
            if state.row.status.is_terminal() && state.reservation != Reservation::Reserved {
                actions.push(Action::Forget { erasure: false });
            }
        }
        // Offered in every state while the row exists: replyd's Stop writes at most once a run
        // (a later press finds the task cancelled), so it needs no bound of its own. The broken
        // Stop writes at every press; once it has, more presses would only overwrite its own
        // write, with a version that grows without bound.
        if state.presence.row_exists()
            && self.cancel_with_budget == Some(state.row.max_attempts)
            && (self.cancel != CancelCheck::OverwritesAnyStatus || !state.history.cancelled)
        {
            actions.push(Action::Cancel);
        }
        for (id, worker) in (0..).zip(&state.workers) {
            if worker.stalled {
                actions.push(Action::Resume(id));
                continue;
            }
            let can_crash = state.crashes < self.max_crashes;
            let can_stall = state.stalls < self.max_stalls;
            match worker.phase {
                Phase::Idle | Phase::Redelivered => actions.push(Action::Claim(id)),
                Phase::Calling { .. } => {
                    actions.push(Action::Renew(id));
                    actions.push(Action::LivePiece(id));
                    actions.push(Action::FinishCall(id));
                    for retryable in [true, false].into_iter().filter(|_| self.call_failures) {
                        for ran in [true, false] {
                            actions.push(Action::CallFails {
                                worker: id,
                                retryable,
                                ran,
                            });
                        }
                    }
                }
                Phase::HasReply { .. } => actions.push(Action::StartCompletion(id)),
                Phase::Completing { .. } => {
                    actions.push(Action::ApplyCompletion {
                        worker: id,
                        ack_lost: false,
                    });
                    actions.push(Action::ApplyCompletion {
                        worker: id,
                        ack_lost: true,
                    });
                }
                Phase::Crashed => actions.push(Action::Restart(id)),
                Phase::Done => {}
            }
            let holds_work = matches!(
                worker.phase,
                Phase::Calling { .. } | Phase::HasReply { .. } | Phase::Completing { .. }
            );
            if holds_work && can_crash {
                actions.push(Action::Crash(id));
            }
            // A statement already sent runs on the server whatever the process does, so only
            // a worker between statements stalls.
            if matches!(worker.phase, Phase::Calling { .. } | Phase::HasReply { .. }) && can_stall {
                actions.push(Action::Stall(id));
            }
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut state = last.clone();
        state.stop_answer = None;
        match action {
            Action::Tick => state.now += 1,
            Action::Claim(id) => self.claim(&mut state, id),
            Action::Renew(id) => {
                let Phase::Calling { version } = state.workers[usize::from(id)].phase else {
                    return None;
                };
                self.renew(&mut state, id, version);
            }
            Action::LivePiece(id) => {
                let Phase::Calling { version } = state.workers[usize::from(id)].phase else {
                    return None;
                };
                // The insert's guard, as V26 writes it: the assignment and the status, no
                // clock (a piece of a lapsed lease not yet taken over is still the current
                // attempt's text). A refused piece stops the forwarding, not the call.
                let accepted = state.presence.row_exists()
                    && state.row.assignment_version == version
                    && state.row.status == TaskStatus::Running;
                if accepted {
                    state.history.piece_out_of_turn |= state.row.status.is_terminal()
                        || state.history.cancelled
                        || state.presence.ever_forgotten();
                }
            }
            Action::FinishCall(id) => {
                let worker = &mut state.workers[usize::from(id)];
                let Phase::Calling { version } = worker.phase else {
                    return None;
                };
                worker.phase = Phase::HasReply { version };
                state.history.work_done = true;
                state.history.paid_calls += 1;
            }
            Action::CallFails {
                worker,
                retryable,
                ran,
            } => {
                let Phase::Calling { version } = state.workers[usize::from(worker)].phase else {
                    return None;
                };
                state.history.work_done |= ran;
                state.history.paid_calls += u8::from(ran);
                self.give_up(&mut state, worker, version, retryable, ran);
            }
            Action::Reconcile => {
                // `replyd_settle_to(task, 'charged')`, guarded on the reservation being open.
                if state.reservation != Reservation::Reserved || !state.presence.row_exists() {
                    return None;
                }
                let charge = Reservation::Charged(tokens_of(state.row.saved));
                settle(&mut state, charge, Settler::Reconciler);
            }
            Action::StartCompletion(id) => {
                let now = state.now;
                let worker = &mut state.workers[usize::from(id)];
                let Phase::HasReply { version } = worker.phase else {
                    return None;
                };
                worker.phase = Phase::Completing {
                    version,
                    started_at: now,
                };
            }
            Action::ApplyCompletion { worker, ack_lost } => {
                let Phase::Completing {
                    version,
                    started_at,
                } = state.workers[usize::from(worker)].phase
                else {
                    return None;
                };
                self.apply_completion(&mut state, worker, version, started_at, ack_lost);
            }
            Action::Crash(id) => {
                // A statement in flight dies with its session: its transaction never commits.
                // A call cut short may still have done the work at the provider: the worst
                // case for the quota, so the model takes it.
                let worker = &mut state.workers[usize::from(id)];
                let calling = matches!(worker.phase, Phase::Calling { .. });
                state.history.work_done |= calling;
                state.history.paid_calls += u8::from(calling);
                worker.phase = Phase::Crashed;
                state.crashes += 1;
            }
            Action::Restart(id) => {
                // A new process under the same worker id: a new incarnation of its owner.
                let worker = &mut state.workers[usize::from(id)];
                worker.phase = Phase::Redelivered;
                worker.incarnation += 1;
            }
            Action::Stall(id) => {
                state.workers[usize::from(id)].stalled = true;
                state.stalls += 1;
            }
            Action::Resume(id) => state.workers[usize::from(id)].stalled = false,
            Action::Forget { erasure } => {
                if state.presence != Presence::Present {
                    return None;
                }
                Self::forget(&mut state, erasure);
            }
            Action::Cancel => {
                if !state.presence.row_exists() {
                    return None;
                }
                self.cancel(&mut state);
            }
        }
        if last.presence == Presence::Forgotten && state.presence != Presence::Forgotten {
            state.history.came_back = true;
        }
        if last.row.status.is_terminal() && state.row.status != last.row.status {
            state.history.left_terminal = true;
        }
        if !last.row.status.is_terminal() && state.row.status.is_terminal() {
            // `replyd_settle_reservation` (V13), in the transaction that ends the task:
            // completed is charged; failed is released unless its work may exist, in which
            // case the reservation stays open, unresolved, for the reconciler; cancelled was
            // settled by the Stop's own statement.
            match state.row.status {
                TaskStatus::Completed => {
                    let charge = Reservation::Charged(tokens_of(state.row.saved));
                    settle(&mut state, charge, Settler::TaskEnd);
                }
                TaskStatus::Cancelled => {}
                _ if state.row.may_have_run => state.history.held_unresolved = true,
                _ => settle(&mut state, Reservation::Released, Settler::TaskEnd),
            }
        }
        Some(state)
    }

    // No "eventually the task completes": it is not true of this protocol without fairness
    // (every worker may crash, stall past its lease or lose the race until the budget is spent,
    // and the task then fails, as I7 wants), and stateright's `eventually` is only sound on
    // acyclic paths while this model has cycles (a parked claim, a renewal at the same tick)
    // and no fairness constraints. Reachability of completion is checked instead.
    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always("I1: at most one reply is ever accepted", |_, s: &State| {
                s.history.accepted.len() <= 1
            }),
            Property::always(
                "I1: the saved reply is the accepted one and never changes",
                |_, s: &State| {
                    s.row.saved
                        == s.history.accepted.first().map(|a| SavedReply {
                            worker: a.worker,
                            version: a.version,
                        })
                },
            ),
            Property::always(
                "I2: no reply is accepted from a superseded assignment",
                |_, s: &State| {
                    s.history
                        .accepted
                        .iter()
                        .all(|a| a.version == a.current_version)
                },
            ),
            Property::always(
                "live text: no piece is shown as the current attempt's from a superseded assignment, or after the task ended, was stopped or was forgotten",
                |_, s: &State| !s.history.piece_out_of_turn,
            ),
            Property::always(ZOMBIE_ACCEPTED, |_, s: &State| {
                s.history
                    .accepted
                    .iter()
                    .all(|a| a.lease_until.is_some_and(|until| until > a.at))
            }),
            Property::always(
                "I2: no release or failure is written from a superseded or lapsed assignment",
                |_, s: &State| {
                    s.history.gave_up.iter().all(|a| {
                        a.version == a.current_version
                            && a.lease_until.is_some_and(|until| until > a.at)
                    })
                },
            ),
            Property::always("a failed task has no saved reply", |_, s: &State| {
                s.row.status != TaskStatus::Failed || s.row.saved.is_none()
            }),
            Property::always(SAVED_REPLY_CANCELLED, |_, s: &State| {
                s.row.saved.is_none() || s.row.status == TaskStatus::Completed
            }),
            Property::always(
                "a completed, failed or cancelled task stays so",
                |_, s: &State| !s.history.left_terminal,
            ),
            Property::always(
                "I3: a worker is done with its record only once its task is finished or forgotten",
                |_, s: &State| {
                    !s.presence.row_exists()
                        || s.row.status.is_terminal()
                        || s.workers.iter().all(|w| w.phase != Phase::Done)
                },
            ),
            Property::always("I7: attempts never exceed the budget", |_, s: &State| {
                s.row.attempt_count <= s.row.max_attempts
            }),
            Property::always(
                "I7: calls that may have cost money never exceed the budget",
                |_, s: &State| s.history.paid_calls <= s.row.max_attempts,
            ),
            // A Stop included: its user may have been shown the text the provider bills.
            Property::always(RELEASED_AFTER_WORK, |_, s: &State| {
                s.reservation != Reservation::Released || !s.history.work_done
            }),
            Property::always(SETTLED_TWICE, |_, s: &State| !s.history.settled_again),
            Property::always(
                "I8: a finished task's reservation is settled, unless a failed task's work may exist (the reconciler's)",
                |_, s: &State| {
                    !s.row.status.is_terminal()
                        || s.reservation != Reservation::Reserved
                        || (s.row.status == TaskStatus::Failed && s.row.may_have_run)
                },
            ),
            Property::always(
                "I8: a completed task's reservation is charged",
                |_, s: &State| {
                    s.row.status != TaskStatus::Completed
                        || matches!(s.reservation, Reservation::Charged(_))
                },
            ),
            Property::always(
                "I8: a charge counts the saved reply's reported usage, else the ceiling, and no other reply's",
                |_, s: &State| match s.reservation {
                    Reservation::Charged(Tokens::ReportedBy(reply)) => {
                        s.row.saved == Some(reply)
                            && s.history.accepted.len() == 1
                            && reports_usage(reply)
                    }
                    Reservation::Charged(Tokens::Ceiling) => {
                        s.row.saved.is_none_or(|reply| !reports_usage(reply))
                    }
                    Reservation::Charged(Tokens::Stopped) => {
                        s.history.settled_by == Some(Settler::Cancel) && s.row.saved.is_none()
                    }
                    _ => true,
                },
            ),
            Property::always(
                "I8: an open task's reservation stays open while its row exists",
                |_, s: &State| {
                    !s.presence.row_exists()
                        || s.row.status.is_terminal()
                        || s.reservation == Reservation::Reserved
                },
            ),
            Property::always(
                "I7: no claim before the backoff ends or after the deadline",
                |_, s: &State| s.history.bad_claim.is_none(),
            ),
            Property::always(
                "every refused write is classified by its real reason",
                |_, s: &State| s.history.misclassified.is_none(),
            ),
            Property::sometimes("the task completes", |_, s: &State| {
                s.row.status == TaskStatus::Completed
            }),
            Property::sometimes("the task fails on its attempt budget", |_, s: &State| {
                s.history.failed_on_budget
            }),
            Property::sometimes("a lapsed lease is taken over", |_, s: &State| {
                s.history.taken_over
            }),
            Property::sometimes(
                "a stalled worker's lease is lost while it sleeps",
                |_, s: &State| {
                    s.workers.iter().any(|w| match w.phase {
                        Phase::Calling { version } | Phase::HasReply { version } => {
                            w.stalled && !guarded_update_matches(s, version, s.now)
                        }
                        _ => false,
                    })
                },
            ),
            Property::sometimes("a zombie's completion is refused", |_, s: &State| {
                s.history.zombie_refused
            }),
            Property::sometimes(
                "a retried completion finds its own saved reply",
                |_, s: &State| s.history.own_write_recognised,
            ),
            Property::sometimes(
                "a charge counts a reply's reported usage",
                |_, s: &State| matches!(s.reservation, Reservation::Charged(Tokens::ReportedBy(_))),
            ),
            Property::sometimes(
                "a completed task whose reply reported no usage is charged its ceiling",
                |_, s: &State| {
                    s.row.status == TaskStatus::Completed
                        && s.reservation == Reservation::Charged(Tokens::Ceiling)
                },
            ),
        ];
        // What only some configurations can reach: a `sometimes` that cannot be reached fails
        // the check, which is the point (the behaviour must be explored, not assumed).
        if self.deadlines.iter().any(Option::is_some) {
            properties.push(Property::sometimes(
                "the task fails on its deadline",
                |_, s: &State| s.history.failed_on_deadline,
            ));
        }
        if self.forget_with_budget.is_some() {
            properties.extend([
                Property::always(ATTEMPT_AFTER_FORGETTING, |_, s: &State| {
                    !s.history.attempt_after_forgetting
                }),
                Property::always(
                    "no reply is accepted after the task is forgotten",
                    |_, s: &State| !s.history.reply_after_forgetting,
                ),
                Property::always(
                    "no renewal, release or failure is written after the task is forgotten",
                    |_, s: &State| !s.history.write_after_forgetting,
                ),
                Property::always(
                    "I8: no reservation is left open once its task is forgotten",
                    |_, s: &State| {
                        s.presence == Presence::Present || s.reservation != Reservation::Reserved
                    },
                ),
                Property::always("once forgotten, always forgotten", |_, s: &State| {
                    !s.history.came_back
                }),
                Property::sometimes(
                    "a task is forgotten while a worker holds its lease, and that worker's completion is refused",
                    |_, s: &State| s.history.leaseholder_found_no_row,
                ),
                Property::sometimes(
                    "a redelivered record finds its task forgotten",
                    |_, s: &State| s.history.redelivered_found_forgotten,
                ),
                Property::sometimes("retention forgets a finished task", |_, s: &State| {
                    s.history.forgotten_by_retention
                }),
                Property::sometimes(
                    "an erasure charges an open task's reservation",
                    |_, s: &State| s.history.erasure_charged,
                ),
                Property::sometimes(
                    "an erasure releases the reservation of a task whose provider did nothing",
                    |_, s: &State| s.history.erasure_released,
                ),
            ]);
        }
        if self.cancel_with_budget.is_some() {
            properties.extend([
                Property::always(
                    "no attempt starts after the task is cancelled",
                    |_, s: &State| !s.history.attempt_after_cancel,
                ),
                Property::always(
                    "no reply is accepted after the task is cancelled",
                    |_, s: &State| !s.history.reply_after_cancel,
                ),
                Property::always(
                    "no renewal, release or failure is written after the task is cancelled",
                    |_, s: &State| !s.history.write_after_cancel,
                ),
                Property::always("a cancelled task stays cancelled", |_, s: &State| {
                    !s.history.cancelled || s.row.status == TaskStatus::Cancelled
                }),
                Property::always(
                    "I8: a Stop charges when a call may have run, and releases only when none can have started",
                    |_, s: &State| {
                        s.history.settled_by != Some(Settler::Cancel)
                            || s.presence != Presence::Present
                            || s.reservation
                                == if s.row.may_have_run {
                                    Reservation::Charged(Tokens::Stopped)
                                } else {
                                    Reservation::Released
                                }
                    },
                ),
                Property::always(
                    "I8: a cancelled task's reservation was settled by its Stop",
                    |_, s: &State| {
                        s.row.status != TaskStatus::Cancelled
                            || s.history.settled_by == Some(Settler::Cancel)
                    },
                ),
                Property::sometimes(
                    "a Stop lands mid-call, its completion is refused and its record is done",
                    |_, s: &State| {
                        (0..).zip(&s.workers).any(|(id, w): (u8, _)| {
                            s.history.completion_refused_by_cancel & (1 << id) != 0
                                && w.phase == Phase::Done
                        })
                    },
                ),
                Property::sometimes(
                    "a Stop loses the race to a saved reply and changes nothing",
                    |_, s: &State| {
                        s.stop_answer == Some(StopFound::Finished(TaskStatus::Completed))
                    },
                ),
                Property::sometimes(
                    "a Stop finds a failed task and changes nothing",
                    |_, s: &State| s.stop_answer == Some(StopFound::Finished(TaskStatus::Failed)),
                ),
                Property::sometimes(
                    "a second Stop finds the task cancelled and changes nothing",
                    |_, s: &State| {
                        s.stop_answer == Some(StopFound::Finished(TaskStatus::Cancelled))
                    },
                ),
                Property::sometimes("a Stop cancels a pending task", |_, s: &State| {
                    s.stop_answer == Some(StopFound::Pending)
                }),
                Property::sometimes(
                    "a Stop cancels a running task whose lease lapsed",
                    |_, s: &State| s.stop_answer == Some(StopFound::LapsedLease),
                ),
                Property::sometimes(
                    "a Stop lands while the provider does the work, and charges it",
                    |_, s: &State| {
                        s.history.settled_by == Some(Settler::Cancel)
                            && s.history.work_done
                            && s.reservation == Reservation::Charged(Tokens::Stopped)
                    },
                ),
                Property::sometimes(
                    "a Stop before any call releases the reservation",
                    |_, s: &State| {
                        s.history.settled_by == Some(Settler::Cancel)
                            && s.reservation == Reservation::Released
                    },
                ),
            ]);
        }
        if self.forget_with_budget.is_some() && self.forget_with_budget == self.cancel_with_budget {
            properties.push(Property::sometimes(
                "retention forgets a cancelled task",
                |_, s: &State| {
                    s.history.forgotten_by_retention && s.row.status == TaskStatus::Cancelled
                },
            ));
        }
        if self.takeover != PartitionTakeover::Off {
            properties.extend([
                Property::sometimes(
                    "a live lease of another holder of the partition is taken over",
                    |_, s: &State| s.history.took_over_live,
                ),
                Property::sometimes(
                    "a restarted worker takes over its previous incarnation's live lease",
                    |_, s: &State| s.history.took_over_own_id,
                ),
            ]);
        }
        if self.call_failures {
            properties.push(Property::sometimes(
                "a released task is claimed again after its backoff",
                |_, s: &State| s.history.claimed_after_release,
            ));
            properties.push(Property::sometimes(
                "a failed task whose work may exist keeps its reservation open",
                |_, s: &State| s.history.held_unresolved,
            ));
            properties.push(Property::sometimes(
                "a failed task whose call surely did nothing is released",
                |_, s: &State| s.reservation == Reservation::Released,
            ));
            properties.push(Property::sometimes(
                "a task refused on its last attempt completes after all",
                |_, s: &State| {
                    s.history.refused
                        && s.row.status == TaskStatus::Completed
                        && s.history.paid_calls == s.row.max_attempts
                },
            ));
            properties.push(Property::sometimes(
                "the task fails on its refusal budget",
                |_, s: &State| s.history.failed_on_refusals,
            ));
        }
        properties
    }
}

/// Runs the breadth-first check on two threads (the machine's share) until `finish_when`
/// holds or every reachable state is visited, and reports its size and time.
fn check(model: LeaseProtocol, finish_when: HasDiscoveries) -> impl Checker<LeaseProtocol> {
    let started = Instant::now();
    let checker = model
        .checker()
        .threads(2)
        .finish_when(finish_when)
        .spawn_bfs()
        .join();
    println!(
        "{:?}, {:?}, {:?}, {:?}: {} unique states ({} generated), depth {}, {:.2?}",
        checker.model().lease_check,
        checker.model().insert,
        checker.model().cancel,
        checker.model().takeover,
        checker.unique_state_count(),
        checker.state_count(),
        checker.max_depth(),
        started.elapsed(),
    );
    checker
}

fn replyd_protocol() -> LeaseProtocol {
    LeaseProtocol {
        workers: 3,
        max_attempts: &[2, 3],
        deadlines: &[None],
        call_failures: false,
        backoff_ticks: 1,
        refusal_budget: 1,
        lease_ticks: 2,
        last_tick: 6,
        max_crashes: 1,
        max_stalls: 1,
        forget_with_budget: Some(2),
        cancel_with_budget: Some(2),
        lease_check: LeaseCheck::AfterRowLock,
        insert: TaskInsert::RefusesForgotten,
        cancel: CancelCheck::LocksThenChecksStatus,
        takeover: PartitionTakeover::Off,
    }
}

/// Unique states of `replyd_protocol()` were 1,151,718 when this was written; a model that
/// explores far fewer has lost part of its behaviour.
const UNIQUE_STATES_FLOOR: usize = 1_100_000;

#[test]
fn the_lease_protocol_accepts_one_reply_only_from_a_live_current_assignment() {
    // `All` never holds while the `always` properties hold, so this visits every state.
    let checker = check(replyd_protocol(), HasDiscoveries::All);
    assert!(checker.is_done());
    checker.assert_properties();
    assert!(
        checker.unique_state_count() >= UNIQUE_STATES_FLOOR,
        "only {} unique states were explored",
        checker.unique_state_count()
    );
}

/// Failed calls and deadlines, with one worker fewer to keep the search small: a retryable
/// failure gives the lease back with a backoff no claim may jump, a fatal one fails the task,
/// both only from the live current assignment, and the deadline fails the task at the next
/// claim.
fn replyd_protocol_with_failures() -> LeaseProtocol {
    LeaseProtocol {
        workers: 2,
        deadlines: &[None, Some(5)],
        call_failures: true,
        ..replyd_protocol()
    }
}

#[test]
fn failed_calls_give_the_lease_back_or_fail_the_task_only_from_a_live_assignment() {
    let checker = check(replyd_protocol_with_failures(), HasDiscoveries::All);
    assert!(checker.is_done());
    checker.assert_properties();
}

#[test]
fn checking_the_lease_with_the_clock_read_before_the_lock_wait_accepts_a_zombie_reply() {
    let broken = LeaseProtocol {
        lease_check: LeaseCheck::WhenStatementStarted,
        ..replyd_protocol()
    };
    // Stops at the first broken invariant: breadth first, that is a shortest counterexample.
    let checker = check(broken, HasDiscoveries::AnyFailures);
    let zombie = checker
        .discovery(ZOMBIE_ACCEPTED)
        .expect("the checker finds a zombie reply accepted on a stale clock reading");
    println!("counterexample:\n{zombie}");
    let accepted = zombie.last_state().history.accepted[0];
    assert!(
        accepted
            .lease_until
            .is_some_and(|until| until <= accepted.at),
        "the counterexample ends with a reply written after its lease ran out: {accepted:?}"
    );
}

#[test]
fn an_insert_that_does_not_consult_the_forgotten_tasks_starts_an_attempt_on_a_forgotten_task() {
    let broken = LeaseProtocol {
        insert: TaskInsert::IgnoresForgotten,
        ..replyd_protocol()
    };
    // Stops soon after the attempt is found: the path leads to it and may go a few steps on.
    let checker = check(
        broken,
        HasDiscoveries::AnyOf([ATTEMPT_AFTER_FORGETTING].into()),
    );
    let attempt = checker
        .discovery(ATTEMPT_AFTER_FORGETTING)
        .expect("the checker finds an attempt on a task the insert brought back");
    println!("counterexample:\n{attempt}");
    let states = attempt.into_states();
    let (Some(forgotten), Some(claimed)) = (
        states
            .iter()
            .position(|s| s.presence == Presence::Forgotten),
        states
            .iter()
            .position(|s| s.history.attempt_after_forgetting),
    ) else {
        panic!("the counterexample forgets the task and claims it: {states:?}");
    };
    let claimed_state = &states[claimed];
    assert!(
        forgotten < claimed
            && claimed_state.presence == Presence::Recreated
            && claimed_state.row.status == TaskStatus::Running
            && claimed_state.row.attempt_count == 1,
        "the attempt is the first of the task re-inserted after it was forgotten: {claimed_state:?}"
    );
}

#[test]
fn a_stop_that_does_not_check_the_status_cancels_a_saved_reply() {
    let broken = LeaseProtocol {
        cancel: CancelCheck::OverwritesAnyStatus,
        ..replyd_protocol()
    };
    let checker = check(
        broken,
        HasDiscoveries::AllOf([SAVED_REPLY_CANCELLED, SETTLED_TWICE].into()),
    );
    let cancelled = checker
        .discovery(SAVED_REPLY_CANCELLED)
        .expect("the checker finds a saved reply whose task the Stop cancelled");
    println!("counterexample:\n{cancelled}");
    let states = cancelled.into_states();
    let [.., before, after] = states.as_slice() else {
        panic!("the counterexample saves a reply, then presses Stop: {states:?}");
    };
    assert!(
        before.row.status == TaskStatus::Completed
            && matches!(before.reservation, Reservation::Charged(_))
            && after.stop_answer == Some(StopFound::Finished(TaskStatus::Completed))
            && after.row.status == TaskStatus::Cancelled
            && after.row.saved.is_some()
            && after.reservation == Reservation::Released
            && after.history.settled_again,
        "the Stop overwrites a completed task and releases its charged reservation: {after:?}"
    );
    assert!(
        checker.discovery(SETTLED_TWICE).is_some(),
        "the checker finds a reservation the Stop settles a second time"
    );
}

#[test]
fn a_stop_that_releases_whatever_ran_gives_back_work_the_provider_did() {
    let broken = LeaseProtocol {
        cancel: CancelCheck::ReleasesWhateverRan,
        ..replyd_protocol()
    };
    let checker = check(broken, HasDiscoveries::AnyOf([RELEASED_AFTER_WORK].into()));
    let released = checker
        .discovery(RELEASED_AFTER_WORK)
        .expect("the checker finds a Stop that releases work the provider did");
    println!("counterexample:\n{released}");
    let states = released.into_states();
    let last = states.last().expect("a path has states");
    assert!(
        last.row.status == TaskStatus::Cancelled
            && last.reservation == Reservation::Released
            && last.history.work_done
            && last.history.settled_by == Some(Settler::Cancel),
        "the Stop released a reservation whose call did work: {last:?}"
    );
}

/// Claims made for Kafka records (V33): each worker claims as the holder of the record's
/// partition, so a live lease of another owner is taken over at once, by a survivor or by the
/// same worker id restarted. Two workers, to keep the search small: the takeover needs two
/// owners, which a crash and restart of one worker already gives.
fn replyd_protocol_with_partition_takeover() -> LeaseProtocol {
    LeaseProtocol {
        workers: 2,
        takeover: PartitionTakeover::ByPartition,
        ..replyd_protocol()
    }
}

#[test]
fn taking_over_a_lost_holder_s_live_lease_keeps_one_reply_fenced_and_within_budget() {
    let checker = check(
        replyd_protocol_with_partition_takeover(),
        HasDiscoveries::All,
    );
    assert!(checker.is_done());
    checker.assert_properties();
}

#[test]
fn taking_over_a_lost_holder_s_live_lease_with_failed_calls_and_deadlines() {
    // One attempt budget, and no forgetting or Stop (both checked with takeovers above): the
    // failures and deadlines multiply the states, and this check is about their meeting with
    // a takeover.
    let checker = check(
        LeaseProtocol {
            takeover: PartitionTakeover::ByPartition,
            max_attempts: &[2],
            forget_with_budget: None,
            cancel_with_budget: None,
            ..replyd_protocol_with_failures()
        },
        HasDiscoveries::All,
    );
    assert!(checker.is_done());
    checker.assert_properties();
}

#[test]
fn a_takeover_that_does_not_note_the_holder_s_call_releases_work_the_provider_did() {
    let broken = LeaseProtocol {
        takeover: PartitionTakeover::ByPartitionNotingNothing,
        call_failures: true,
        ..replyd_protocol_with_partition_takeover()
    };
    let checker = check(broken, HasDiscoveries::AnyOf([RELEASED_AFTER_WORK].into()));
    let released = checker
        .discovery(RELEASED_AFTER_WORK)
        .expect("the checker finds a takeover that lets the work of the old holder be released");
    println!("counterexample:\n{released}");
    let states = released.into_states();
    assert!(
        states.iter().any(|s| s.history.took_over_live),
        "the counterexample takes over a live lease: {states:?}"
    );
}
