//! What each statement of `store::tasks` does to the row, transcribed next to the SQL it
//! mirrors: the claim (decided by replyd's own `decide_claim`), a renewal, a release or a
//! failure, the completion, forgetting and the user's Stop, with refusals classified by
//! replyd's own `classify_refusal`, and the reservation's settlement (a second one recorded,
//! for the property that forbids it).

use super::protocol::{
    CancelCheck, LeaseCheck, LeaseProtocol, PARTITION, PartitionTakeover, TaskInsert,
};
use super::state::{
    Deed, Phase, Presence, Reservation, SavedReply, Settler, State, StopFound, TaskRow, Tokens,
    tokens_of,
};
use super::{Tick, WorkerId};
use chrono::{DateTime, Utc};
use replyd_core::domain::TaskStatus;
use replyd_core::lease::{
    ClaimDecision, ClaimOutcome, Claimer, LeaseSnapshot, Refusal, classify_refusal, decide_claim,
    lease_live,
};

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
pub(super) fn guarded_update_matches(state: &State, version: u8, clock: Tick) -> bool {
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
    pub(super) fn claim(&self, state: &mut State, worker: WorkerId) {
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
                let version = row.assignment_version;
                state.note_deed(Deed::Attempt);
                Phase::Calling { version }
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
    pub(super) fn renew(&self, state: &mut State, worker: WorkerId, version: u8) {
        let now = state.now;
        if guarded_update_matches(state, version, now) {
            state.note_deed(Deed::Write);
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
    pub(super) fn give_up(
        &self,
        state: &mut State,
        worker: WorkerId,
        version: u8,
        retryable: bool,
        ran: bool,
    ) {
        let now = state.now;
        let phase = if guarded_update_matches(state, version, now) {
            let gave_up = state.accept(Deed::Write, worker, version);
            state.history.gave_up.push(gave_up);
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
    pub(super) fn apply_completion(
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
            let accepted = state.accept(Deed::Reply, worker, version);
            state.history.accepted.push(accepted);
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
    pub(super) fn forget(state: &mut State, erasure: bool) {
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
    pub(super) fn cancel(&self, state: &mut State) {
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
pub(super) fn settle(state: &mut State, to: Reservation, by: Settler) {
    state.history.settled_again |= state.reservation != Reservation::Reserved;
    state.history.settled_by.get_or_insert(by);
    state.reservation = to;
}
