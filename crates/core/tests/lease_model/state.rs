//! The model's state and actions: the task row's columns that fencing reads or writes, whether
//! the row exists, the quota reservation and its tokens, what each worker is doing, the
//! history the properties read, and every action a state may take.

use super::{Tick, WorkerId};
use replyd_core::domain::TaskStatus;

/// The columns of the task row that fencing reads or writes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct TaskRow {
    pub(super) status: TaskStatus,
    pub(super) assignment_version: u8,
    /// The worker and its incarnation (`<worker_id>#<token>`).
    pub(super) lease_owner: Option<(WorkerId, u8)>,
    /// `lease_partition` (V33): written by a claim that holds its record's partition alone.
    pub(super) lease_partition: Option<u8>,
    pub(super) lease_until: Option<Tick>,
    pub(super) attempt_count: u8,
    pub(super) max_attempts: u8,
    pub(super) deadline: Option<Tick>,
    pub(super) next_attempt_at: Option<Tick>,
    pub(super) saved: Option<SavedReply>,
    /// `provider_may_have_run`: some call may have done work whose answer was never saved.
    pub(super) may_have_run: bool,
    /// `refusals`: calls the provider turned away; each gave its attempt back.
    pub(super) refusals: u8,
}

impl TaskRow {
    /// The row `replyd_insert_task` inserts for a record: its inputs, every other column its
    /// default.
    pub(super) fn inserted(max_attempts: u8, deadline: Option<Tick>) -> Self {
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
pub(super) enum Presence {
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
    pub(super) fn row_exists(self) -> bool {
        self != Presence::Forgotten
    }

    pub(super) fn ever_forgotten(self) -> bool {
        self != Presence::Present
    }
}

/// The task's quota reservation (I8), as the settlement trigger and the reconciler move it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Reservation {
    Reserved,
    /// Settled with a charge of these tokens (V17).
    Charged(Tokens),
    Released,
}

/// What a charge counts in tokens: the usage a reply reported, or the request's ceiling.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Tokens {
    /// The usage the reply of this worker's claim at this version reported.
    ReportedBy(SavedReply),
    Ceiling,
    /// A Stop's charge: the prompt's bound and the text its followers were shown
    /// (`replyd_stop_tokens`, V27).
    Stopped,
}

/// Whether a reply carries usage: worker 0's provider answers report it, worker 1's do not,
/// so both kinds of reply (and of charge) are in every run without a state of their own.
pub(super) fn reports_usage(reply: SavedReply) -> bool {
    reply.worker == 0
}

/// `replyd_tokens_to_charge` (V17) at a charge: the saved reply's reported usage, else the
/// ceiling (no reply saved, or it reported none).
pub(super) fn tokens_of(saved: Option<SavedReply>) -> Tokens {
    match saved {
        Some(reply) if reports_usage(reply) => Tokens::ReportedBy(reply),
        _ => Tokens::Ceiling,
    }
}

/// Who settled the task's reservation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Settler {
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
pub(super) enum StopFound {
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
pub(super) struct SavedReply {
    pub(super) worker: WorkerId,
    pub(super) version: u8,
}

/// What one worker (one process handling the task's record) is doing. A worker keeps no lease
/// deadline of its own: it may renew or complete at any moment, however late, and only the
/// row's fencing can stop it, which is the worst case for the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Phase {
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
pub(super) struct Worker {
    pub(super) phase: Phase,
    /// How often this worker id was restarted: its lease owner's incarnation.
    pub(super) incarnation: u8,
    /// Takes no action while time passes (SIGSTOP, a long GC pause); a zombie if its lease
    /// lapses meanwhile.
    pub(super) stalled: bool,
}

/// One accepted fenced write (completion, release or failure), with what held at the instant it
/// was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Acceptance {
    pub(super) worker: WorkerId,
    pub(super) version: u8,
    /// The row's `assignment_version` when the write happened.
    pub(super) current_version: u8,
    pub(super) lease_until: Option<Tick>,
    /// The database clock when the write happened.
    pub(super) at: Tick,
}

impl Acceptance {
    /// A write by `worker` holding `version`, accepted on `row` (as it was before the write)
    /// at `now`.
    pub(super) fn of(worker: WorkerId, version: u8, row: &TaskRow, now: Tick) -> Self {
        Self {
            worker,
            version,
            current_version: row.assignment_version,
            lease_until: row.lease_until,
            at: now,
        }
    }
}

/// What a worker does to the task that no worker may do once the task is forgotten or
/// cancelled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Deed {
    /// A claim took a lease, and so started an attempt and its call.
    Attempt,
    /// A reply was accepted.
    Reply,
    /// A renewal, release or failure was accepted.
    Write,
}

/// The deeds done after the task reached one of its ends (it was forgotten, or cancelled).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(super) struct AfterEnd {
    pub(super) attempt: bool,
    pub(super) reply: bool,
    pub(super) write: bool,
}

impl AfterEnd {
    fn deed(&mut self, deed: Deed) -> &mut bool {
        match deed {
            Deed::Attempt => &mut self.attempt,
            Deed::Reply => &mut self.reply,
            Deed::Write => &mut self.write,
        }
    }
}

/// What happened so far, for the properties. Kept in the state so that a property can speak
/// about the past (every acceptance ever, not just the row's one slot).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub(super) struct History {
    pub(super) accepted: Vec<Acceptance>,
    /// Accepted releases (retryable failures) and failures, in order.
    pub(super) gave_up: Vec<Acceptance>,
    /// The first claim decided against the backoff or the deadline, as text.
    pub(super) bad_claim: Option<String>,
    /// A completed, failed or cancelled task became something else.
    pub(super) left_terminal: bool,
    pub(super) released: bool,
    pub(super) claimed_after_release: bool,
    pub(super) failed_on_deadline: bool,
    pub(super) failed_on_budget: bool,
    /// The first refused write whose `classify_refusal` answer disagrees with the row it was
    /// read from (`Refusal` has no `Hash`, so it is kept as text).
    pub(super) misclassified: Option<String>,
    pub(super) zombie_refused: bool,
    pub(super) taken_over: bool,
    /// A claim took over (or failed on its budget or deadline) a live lease of another holder
    /// of the partition, and one of a previous incarnation of the claimer's own id.
    pub(super) took_over_live: bool,
    pub(super) took_over_own_id: bool,
    pub(super) own_write_recognised: bool,
    /// The provider did (or may have done) the task's work at least once: a call that
    /// answered, a failed call that may have run, a call whose worker crashed.
    pub(super) work_done: bool,
    /// A failed task's reservation was held open because its work may exist.
    pub(super) held_unresolved: bool,
    /// Calls that may have cost money: a call that answered, a failed call that may have run,
    /// a call whose worker crashed (I7 bounds these by `max_attempts`).
    pub(super) paid_calls: u8,
    pub(super) refused: bool,
    pub(super) failed_on_refusals: bool,
    /// The workers holding the current assignment's live lease when the task was forgotten,
    /// one bit each.
    pub(super) held_lease_when_forgotten: u8,
    pub(super) forgotten_by_retention: bool,
    /// An erasure settled an open task's reservation as charged, or as released.
    pub(super) erasure_charged: bool,
    pub(super) erasure_released: bool,
    /// A forgotten task's row came back.
    pub(super) came_back: bool,
    /// What workers did after the task was forgotten.
    pub(super) after_forgetting: AfterEnd,
    /// A worker that held the live lease when the task was forgotten had its completion
    /// refused for want of a row.
    pub(super) leaseholder_found_no_row: bool,
    pub(super) redelivered_found_forgotten: bool,
    /// Who settled the reservation first, and whether anything settled it again.
    pub(super) settled_by: Option<Settler>,
    pub(super) settled_again: bool,
    /// A Stop wrote `status = 'cancelled'`.
    pub(super) cancelled: bool,
    /// What workers did after the task was cancelled.
    pub(super) after_cancel: AfterEnd,
    /// The workers, one bit each, whose completion was refused as cancelled while they held
    /// the assignment the Stop superseded: their call was in flight when the Stop came.
    pub(super) completion_refused_by_cancel: u8,
    /// A piece of live text was accepted from an assignment that is not the row's, or after
    /// the task ended, was stopped or was forgotten: followers would be shown text as the
    /// current attempt's that can never be saved.
    pub(super) piece_out_of_turn: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(super) struct State {
    /// The database clock (`clock_timestamp()`).
    pub(super) now: Tick,
    pub(super) row: TaskRow,
    pub(super) presence: Presence,
    pub(super) reservation: Reservation,
    pub(super) workers: Vec<Worker>,
    pub(super) crashes: u8,
    pub(super) stalls: u8,
    /// What the Stop pressed by the last action found, cleared by the next action. A press
    /// that finds the task finished leaves the row as it was: remembered for longer, it would
    /// only copy the rest of the run, and remembered for one step it shows the press happened.
    pub(super) stop_answer: Option<StopFound>,
    pub(super) history: History,
}

impl State {
    /// Notes that a worker did `deed`, against each end the task has reached by now.
    pub(super) fn note_deed(&mut self, deed: Deed) {
        let forgotten = self.presence.ever_forgotten();
        let history = &mut self.history;
        *history.after_forgetting.deed(deed) |= forgotten;
        *history.after_cancel.deed(deed) |= history.cancelled;
    }

    /// A fenced write by `worker` holding `version`, accepted now as `deed` (on the row as it
    /// is before the write).
    pub(super) fn accept(&mut self, deed: Deed, worker: WorkerId, version: u8) -> Acceptance {
        self.note_deed(deed);
        Acceptance::of(worker, version, &self.row, self.now)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Action {
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
