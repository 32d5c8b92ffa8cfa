//! The claim's decision is made by a server-side function (`replyd_claim`, migration V9);
//! `lease::decide_claim` is its specification, the one the lease model checks. This test
//! writes generated rows into a real PostgreSQL, claims each, and checks that the function
//! decided what the specification decides and wrote what that decision means (I2, I7). A
//! record's claim inserts its task once and reports a disagreeing copy.

use std::time::Duration;

use crate::helpers::{TestDb, task_spec};
use chrono::Utc;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{RecordSource, TaskStatus};
use replyd_core::lease::{ClaimDecision, Claimer, LeaseSnapshot, Takeover, decide_claim};

/// One generated row. Times are offsets from the database clock in minutes, far enough from
/// zero that the moments between reading the clock here and in the function cannot matter.
#[derive(Debug, Clone)]
struct Row {
    status: TaskStatus,
    lease_minutes: Option<i64>,
    attempt_count: i32,
    max_attempts: i32,
    deadline_minutes: Option<i64>,
    next_attempt_minutes: Option<i64>,
    /// Whether the lease was taken by the claimer's own owner string (`w-after`).
    own_lease: bool,
    /// `lease_partition` (V33): the partition the lease was taken for, held alone.
    lease_partition: Option<i32>,
    /// The claim's record: its partition, and whether the claimer holds it alone (Kafka).
    claim_source: Option<(i32, bool)>,
}

fn offset() -> impl Strategy<Value = i64> {
    prop_oneof![-120i64..=-1, 1i64..=120]
}

fn row() -> impl Strategy<Value = Row> {
    (
        prop_oneof![
            1 => Just(TaskStatus::Pending),
            2 => Just(TaskStatus::Running),
            1 => Just(TaskStatus::Completed),
            1 => Just(TaskStatus::Failed),
        ],
        proptest::option::of(offset()),
        1i32..=4,
        0i32..=4,
        proptest::option::of(offset()),
        proptest::option::of(offset()),
        // Half the rows have another owner's lease of the claim's partition, which the claimer
        // holds alone: a takeover needs that and a live, running row within its budget, which
        // a uniform draw meets too rarely for 500 cases to reach every time.
        prop_oneof![
            (
                any::<bool>(),
                proptest::option::of(0i32..=1),
                proptest::option::of((0i32..=1, any::<bool>())),
            ),
            Just((false, Some(0), Some((0, true)))),
        ],
    )
        .prop_map(
            |(status, lease, max_attempts, attempts, deadline, next, (own, partition, source))| {
                Row {
                    own_lease: own,
                    lease_partition: partition,
                    claim_source: source,
                    // A running row always has a lease (the table's check says so).
                    lease_minutes: if status == TaskStatus::Running {
                        Some(lease.unwrap_or(5))
                    } else {
                        lease
                    },
                    status,
                    attempt_count: attempts.min(max_attempts),
                    max_attempts,
                    deadline_minutes: deadline,
                    next_attempt_minutes: next,
                }
            },
        )
}

#[test]
fn the_claim_function_decides_what_decide_claim_decides() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let client = runtime.block_on(db.raw_client());
    let mut runner = TestRunner::new(Config {
        cases: 500,
        ..Config::default()
    });
    let seen = std::cell::RefCell::new(std::collections::BTreeSet::new());
    runner
        .run(&row(), |row| {
            runtime.block_on(async {
                let spec = task_spec(u32::try_from(row.max_attempts).unwrap());
                let id = spec.task_id.as_uuid();
                db.store.ensure_task(&spec).await.unwrap();
                let minutes = |m: Option<i64>| m.map(|m| m as f64 * 60.0);
                client
                    .execute(
                        "UPDATE reply_tasks SET status = $2, \
                         lease_owner = CASE WHEN $3::float8 IS NULL THEN NULL \
                                            WHEN $7 THEN 'w-after' ELSE 'w-before' END, \
                         lease_partition = $8, provider_may_have_run = false, \
                         lease_until = clock_timestamp() + make_interval(secs => $3), \
                         attempt_count = $4::int4, assignment_version = $4::int4, \
                         deadline = clock_timestamp() + make_interval(secs => $5), \
                         next_attempt_at = clock_timestamp() + make_interval(secs => $6), \
                         saved_response = CASE WHEN $2 = 'completed' THEN 'saved' END, \
                         failure = CASE WHEN $2 = 'failed' THEN 'failed before' END \
                         WHERE task_id = $1",
                        &[
                            &id,
                            &row.status.as_str(),
                            &minutes(row.lease_minutes),
                            &row.attempt_count,
                            &minutes(row.deadline_minutes),
                            &minutes(row.next_attempt_minutes),
                            &row.own_lease,
                            &row.lease_partition,
                        ],
                    )
                    .await
                    .unwrap();
                let before = db.store.read(spec.task_id).await.unwrap().unwrap();
                let lease_partition: Option<i32> = client
                    .query_one(
                        "SELECT lease_partition FROM reply_tasks WHERE task_id = $1",
                        &[&id],
                    )
                    .await
                    .unwrap()
                    .get(0);
                let snapshot = LeaseSnapshot {
                    status: before.status,
                    assignment_version: before.assignment_version,
                    lease_owner: before.lease_owner.clone(),
                    lease_until: before.lease_until,
                    attempt_count: before.attempt_count,
                    max_attempts: before.spec.max_attempts as i32,
                    deadline: before.spec.deadline,
                    next_attempt_at: before.next_attempt_at,
                    has_response: before.saved_response.is_some(),
                    lease_partition,
                    now: Utc::now(),
                };
                let source = row
                    .claim_source
                    .map(|(partition, held_alone)| RecordSource {
                        partition,
                        offset: 7,
                        held_alone,
                    });
                let claimer = Claimer {
                    owner: "w-after",
                    partition: source.and_then(|s| s.partition_held()),
                };
                let expected = decide_claim(&snapshot, &claimer);
                let taken = db
                    .store
                    .claim_task(
                        spec.task_id,
                        "w-after",
                        Duration::from_secs(30),
                        None,
                        source,
                    )
                    .await
                    .unwrap();
                let (after_partition, may_have_run): (Option<i32>, bool) = {
                    let r = client
                        .query_one(
                            "SELECT lease_partition, provider_may_have_run FROM reply_tasks \
                             WHERE task_id = $1",
                            &[&id],
                        )
                        .await
                        .unwrap();
                    (r.get(0), r.get(1))
                };
                let after = taken.task.expect("the row exists");
                let label = taken.claim.label();
                seen.borrow_mut().insert(label);
                match expected {
                    ClaimDecision::Claim { takes_over } => {
                        let took_over = takes_over == Some(Takeover::FromLostHolder);
                        let expected_label = if took_over {
                            "took_over_from_previous_holder"
                        } else {
                            "claimed"
                        };
                        prop_assert_eq!(label, expected_label, "{:?}", row);
                        // Only a claimer holding its partition alone marks its lease so.
                        prop_assert_eq!(after_partition, claimer.partition);
                        // A takeover's holder may have sent its call (I8).
                        if takes_over.is_some() {
                            prop_assert!(may_have_run, "{:?}", row);
                        }
                        prop_assert_eq!(after.status, TaskStatus::Running);
                        prop_assert_eq!(after.assignment_version, before.assignment_version + 1);
                        prop_assert_eq!(after.attempt_count, before.attempt_count + 1);
                        prop_assert_eq!(after.lease_owner.as_deref(), Some("w-after"));
                    }
                    ClaimDecision::Refuse(outcome) => {
                        prop_assert_eq!(label, outcome.label(), "{:?}", row);
                        // A refusal writes nothing.
                        prop_assert_eq!(&after, &before);
                    }
                    ClaimDecision::Fail { reason, outcome } => {
                        prop_assert_eq!(label, outcome.label(), "{:?}", row);
                        prop_assert_eq!(after.status, TaskStatus::Failed);
                        prop_assert_eq!(after.attempt_count, before.attempt_count);
                        if before.status == TaskStatus::Running {
                            prop_assert!(may_have_run, "{:?}", row);
                        }
                        let failure = after.failure.clone().unwrap_or_default();
                        // The same reason up to the deadline's formatting.
                        let head = |s: &str| s.split(':').next().unwrap_or_default().to_owned();
                        prop_assert_eq!(head(&failure), head(&reason));
                        if reason.starts_with("attempt budget") {
                            prop_assert_eq!(failure, reason);
                        }
                    }
                }
                Ok::<(), TestCaseError>(())
            })
        })
        .unwrap();
    // The generator reaches every decision, so the agreement is not vacuous.
    for label in [
        "claimed",
        "took_over_from_previous_holder",
        "already_completed",
        "already_failed",
        "leased_by_other",
        "deadline_passed",
        "backing_off",
        "budget_exhausted",
    ] {
        let seen = seen.borrow();
        assert!(
            seen.contains(label),
            "no generated row was {label}: {seen:?}"
        );
    }
}

#[tokio::test]
async fn a_record_claim_inserts_its_task_once_and_reports_a_disagreeing_copy() {
    let db = TestDb::new().await;
    let spec = task_spec(3);
    let first = db
        .store
        .claim_task(
            spec.task_id,
            "w-1",
            Duration::from_secs(30),
            Some(&spec),
            None,
        )
        .await
        .unwrap();
    assert_eq!(first.claim.label(), "claimed");
    assert_eq!(first.ensured, Some(replyd::store::EnsureOutcome::Created));
    assert_eq!(first.task.unwrap().spec, spec);

    // A redelivered copy finds the task (and its live lease), and creates nothing.
    let again = db
        .store
        .claim_task(
            spec.task_id,
            "w-2",
            Duration::from_secs(30),
            Some(&spec),
            None,
        )
        .await
        .unwrap();
    assert_eq!(again.claim.label(), "leased_by_other");
    assert_eq!(again.ensured, Some(replyd::store::EnsureOutcome::Exists));

    let mut other = spec.clone();
    other.message_id = "msg-different".into();
    let conflicting = db
        .store
        .claim_task(
            spec.task_id,
            "w-3",
            Duration::from_secs(30),
            Some(&other),
            None,
        )
        .await
        .unwrap();
    assert_eq!(
        conflicting.ensured,
        Some(replyd::store::EnsureOutcome::Conflict {
            fields: vec!["message_id"]
        })
    );
    // The stored inputs are kept.
    assert_eq!(conflicting.task.unwrap().spec, spec);

    let client = db.raw_client().await;
    let rows: i64 = client
        .query_one("SELECT count(*) FROM reply_tasks", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 1);
    let attempts: i64 = client
        .query_one("SELECT count(*) FROM reply_attempts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(attempts, 1);
}
