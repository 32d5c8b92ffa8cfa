//! The checks: replyd's protocol (with failed calls and deadlines, and with partition takeover)
//! holds every property over every reachable state, and each broken variant is caught by the
//! property it breaks.

use std::time::Instant;

use super::protocol::{CancelCheck, LeaseCheck, LeaseProtocol, PartitionTakeover, TaskInsert};
use super::state::{Presence, Reservation, Settler, State, StopFound};
use super::{
    ATTEMPT_AFTER_FORGETTING, RELEASED_AFTER_WORK, SAVED_REPLY_CANCELLED, SETTLED_TWICE,
    ZOMBIE_ACCEPTED,
};
use replyd_core::domain::TaskStatus;
use stateright::{Checker, HasDiscoveries, Model};

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

/// Checks `model` over every reachable state and holds it to every property.
fn assert_holds(model: LeaseProtocol) -> impl Checker<LeaseProtocol> {
    // `All` never holds while the `always` properties hold, so this visits every state.
    let checker = check(model, HasDiscoveries::All);
    assert!(checker.is_done());
    checker.assert_properties();
    checker
}

/// Checks the broken `model` until `finish_when` holds, and shows and returns the path to the
/// first state found that breaks `property` (a breadth-first search's shortest), with the
/// checker for its other discoveries; `found` says what the checker must find.
fn counterexample(
    model: LeaseProtocol,
    finish_when: HasDiscoveries,
    property: &'static str,
    found: &str,
) -> (impl Checker<LeaseProtocol>, Vec<State>) {
    let checker = check(model, finish_when);
    let path = checker.discovery(property).expect(found);
    println!("counterexample:\n{path}");
    (checker, path.into_states())
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
    let checker = assert_holds(replyd_protocol());
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
    assert_holds(replyd_protocol_with_failures());
}

#[test]
fn checking_the_lease_with_the_clock_read_before_the_lock_wait_accepts_a_zombie_reply() {
    let broken = LeaseProtocol {
        lease_check: LeaseCheck::WhenStatementStarted,
        ..replyd_protocol()
    };
    // Stops at the first broken invariant: breadth first, that is a shortest counterexample.
    let (_, states) = counterexample(
        broken,
        HasDiscoveries::AnyFailures,
        ZOMBIE_ACCEPTED,
        "the checker finds a zombie reply accepted on a stale clock reading",
    );
    let accepted = states.last().expect("a path has states").history.accepted[0];
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
    let (_, states) = counterexample(
        broken,
        HasDiscoveries::AnyOf([ATTEMPT_AFTER_FORGETTING].into()),
        ATTEMPT_AFTER_FORGETTING,
        "the checker finds an attempt on a task the insert brought back",
    );
    let (Some(forgotten), Some(claimed)) = (
        states
            .iter()
            .position(|s| s.presence == Presence::Forgotten),
        states
            .iter()
            .position(|s| s.history.after_forgetting.attempt),
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
    let (checker, states) = counterexample(
        broken,
        HasDiscoveries::AllOf([SAVED_REPLY_CANCELLED, SETTLED_TWICE].into()),
        SAVED_REPLY_CANCELLED,
        "the checker finds a saved reply whose task the Stop cancelled",
    );
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
    let (_, states) = counterexample(
        broken,
        HasDiscoveries::AnyOf([RELEASED_AFTER_WORK].into()),
        RELEASED_AFTER_WORK,
        "the checker finds a Stop that releases work the provider did",
    );
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
    assert_holds(replyd_protocol_with_partition_takeover());
}

#[test]
fn taking_over_a_lost_holder_s_live_lease_with_failed_calls_and_deadlines() {
    // One attempt budget, and no forgetting or Stop (both checked with takeovers above): the
    // failures and deadlines multiply the states, and this check is about their meeting with
    // a takeover.
    assert_holds(LeaseProtocol {
        takeover: PartitionTakeover::ByPartition,
        max_attempts: &[2],
        forget_with_budget: None,
        cancel_with_budget: None,
        ..replyd_protocol_with_failures()
    });
}

#[test]
fn a_takeover_that_does_not_note_the_holder_s_call_releases_work_the_provider_did() {
    let broken = LeaseProtocol {
        takeover: PartitionTakeover::ByPartitionNotingNothing,
        call_failures: true,
        ..replyd_protocol_with_partition_takeover()
    };
    let (_, states) = counterexample(
        broken,
        HasDiscoveries::AnyOf([RELEASED_AFTER_WORK].into()),
        RELEASED_AFTER_WORK,
        "the checker finds a takeover that lets the work of the old holder be released",
    );
    assert!(
        states.iter().any(|s| s.history.took_over_live),
        "the counterexample takes over a live lease: {states:?}"
    );
}
