//! The protocol as a `stateright` model: its initial states, the actions offered in each state
//! and the state each action leads to, with the task's end settling its reservation.

use super::protocol::{CancelCheck, LeaseProtocol};
use super::state::{
    Action, History, Phase, Presence, Reservation, Settler, State, TaskRow, Worker, tokens_of,
};
use super::statements::settle;
use replyd_core::domain::TaskStatus;
use stateright::{Model, Property};

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

    fn properties(&self) -> Vec<Property<Self>> {
        self.all_properties()
    }
}
