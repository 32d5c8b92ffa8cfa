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
//!
//! This file holds the names every room shares: the properties the broken variants must break,
//! and the clock's and the workers' types. The rooms: [`protocol`] (the bounds and the variant
//! of one check), [`state`] (the row, the workers, the reservation, the history and the
//! actions), [`statements`] (what each SQL statement does to the row, transcribed), [`model`]
//! (the actions offered in each state and the state each leads to), [`properties`] (what
//! must always hold and what must sometimes happen) and [`checks`] (the checks run, of
//! replyd's protocol and of each broken variant).

mod checks;
mod model;
mod properties;
mod protocol;
mod state;
mod statements;

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
