//! What the checker holds the model to: the properties that must always hold (one reply, fenced
//! writes, bounded effort, a reservation settled once and never released while the provider
//! may have done the work) and the behaviours that must sometimes happen, some only in the
//! configurations that can reach them.

use replyd_core::domain::TaskStatus;
use stateright::Property;

use super::protocol::{LeaseProtocol, PartitionTakeover};
use super::state::{
    AfterEnd, Phase, Presence, Reservation, SavedReply, Settler, State, StopFound, Tokens,
    reports_usage,
};
use super::statements::guarded_update_matches;
use super::{
    ATTEMPT_AFTER_FORGETTING, RELEASED_AFTER_WORK, SAVED_REPLY_CANCELLED, SETTLED_TWICE,
    ZOMBIE_ACCEPTED,
};

/// `sometimes` properties from a table of names, each with the history's flag that the
/// behaviour it names sets: a property's condition is a plain `fn`, which cannot be made from a
/// flag chosen at run time.
macro_rules! reached {
    ($($name:literal => $flag:ident),+ $(,)?) => {
        [$(Property::sometimes($name, |_, s: &State| s.history.$flag)),+]
    };
}

/// Which of the task's ends the properties of [`nothing_after`] speak of.
const FORGETTING: bool = false;
const CANCEL: bool = true;

/// What the workers did after the task was forgotten or, with `AFTER_CANCEL`, cancelled.
fn after_end<const AFTER_CANCEL: bool>(s: &State) -> AfterEnd {
    if AFTER_CANCEL {
        s.history.after_cancel
    } else {
        s.history.after_forgetting
    }
}

/// That no worker starts an attempt, has a reply accepted, or writes a renewal, release or
/// failure after the task was forgotten (or, with `AFTER_CANCEL`, cancelled): three properties,
/// named `names` in that order.
fn nothing_after<const AFTER_CANCEL: bool>(
    names: [&'static str; 3],
) -> [Property<LeaseProtocol>; 3] {
    let [attempt, reply, write] = names;
    [
        Property::always(attempt, |_, s: &State| {
            !after_end::<AFTER_CANCEL>(s).attempt
        }),
        Property::always(reply, |_, s: &State| !after_end::<AFTER_CANCEL>(s).reply),
        Property::always(write, |_, s: &State| !after_end::<AFTER_CANCEL>(s).write),
    ]
}

impl LeaseProtocol {
    // No "eventually the task completes": it is not true of this protocol without fairness
    // (every worker may crash, stall past its lease or lose the race until the budget is spent,
    // and the task then fails, as I7 wants), and stateright's `eventually` is only sound on
    // acyclic paths while this model has cycles (a parked claim, a renewal at the same tick)
    // and no fairness constraints. Reachability of completion is checked instead.
    pub(super) fn all_properties(&self) -> Vec<Property<Self>> {
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
        properties.extend(reached![
            "the task fails on its attempt budget" => failed_on_budget,
            "a lapsed lease is taken over" => taken_over,
            "a zombie's completion is refused" => zombie_refused,
            "a retried completion finds its own saved reply" => own_write_recognised,
        ]);
        // What only some configurations can reach: a `sometimes` that cannot be reached fails
        // the check, which is the point (the behaviour must be explored, not assumed).
        if self.deadlines.iter().any(Option::is_some) {
            properties.extend(reached!["the task fails on its deadline" => failed_on_deadline]);
        }
        if self.forget_with_budget.is_some() {
            properties.extend(nothing_after::<FORGETTING>([
                ATTEMPT_AFTER_FORGETTING,
                "no reply is accepted after the task is forgotten",
                "no renewal, release or failure is written after the task is forgotten",
            ]));
            properties.extend([
                Property::always(
                    "I8: no reservation is left open once its task is forgotten",
                    |_, s: &State| {
                        s.presence == Presence::Present || s.reservation != Reservation::Reserved
                    },
                ),
                Property::always("once forgotten, always forgotten", |_, s: &State| {
                    !s.history.came_back
                }),
            ]);
            properties.extend(reached![
                "a task is forgotten while a worker holds its lease, and that worker's completion is refused"
                    => leaseholder_found_no_row,
                "a redelivered record finds its task forgotten" => redelivered_found_forgotten,
                "retention forgets a finished task" => forgotten_by_retention,
                "an erasure charges an open task's reservation" => erasure_charged,
                "an erasure releases the reservation of a task whose provider did nothing"
                    => erasure_released,
            ]);
        }
        if self.cancel_with_budget.is_some() {
            properties.extend(nothing_after::<CANCEL>([
                "no attempt starts after the task is cancelled",
                "no reply is accepted after the task is cancelled",
                "no renewal, release or failure is written after the task is cancelled",
            ]));
            properties.extend([
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
            properties.extend(reached![
                "a live lease of another holder of the partition is taken over" => took_over_live,
                "a restarted worker takes over its previous incarnation's live lease"
                    => took_over_own_id,
            ]);
        }
        if self.call_failures {
            properties.extend(reached![
                "a released task is claimed again after its backoff" => claimed_after_release,
                "a failed task whose work may exist keeps its reservation open" => held_unresolved,
                "the task fails on its refusal budget" => failed_on_refusals,
            ]);
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
        }
        properties
    }
}
