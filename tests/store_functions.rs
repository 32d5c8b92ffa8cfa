//! The claim's decision is made by a server-side function (`replyd_claim`, migration V9);
//! `fencing::decide_claim` is its specification, the one the lease model checks. This test
//! writes generated rows into a real PostgreSQL, claims each, and checks that the function
//! decided what the specification decides and wrote what that decision means (I2, I7).

mod helpers;

use std::time::Duration;

use chrono::Utc;
use helpers::{TestDb, task_spec};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use replyd::domain::TaskStatus;
use replyd::store::fencing::{ClaimDecision, LeaseSnapshot, decide_claim};

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
}

fn offset() -> impl Strategy<Value = i64> {
    prop_oneof![-120i64..=-1, 1i64..=120]
}

fn row() -> impl Strategy<Value = Row> {
    (
        prop_oneof![
            Just(TaskStatus::Pending),
            Just(TaskStatus::Running),
            Just(TaskStatus::Completed),
            Just(TaskStatus::Failed),
        ],
        proptest::option::of(offset()),
        1i32..=4,
        0i32..=4,
        proptest::option::of(offset()),
        proptest::option::of(offset()),
    )
        .prop_map(
            |(status, lease, max_attempts, attempts, deadline, next)| Row {
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
            },
        )
}

#[test]
fn the_claim_function_decides_what_decide_claim_decides() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let client = runtime.block_on(db.raw_client());
    let mut runner = TestRunner::new(Config {
        cases: 300,
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
                         lease_owner = CASE WHEN $3::float8 IS NULL THEN NULL ELSE 'w-before' END, \
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
                        ],
                    )
                    .await
                    .unwrap();
                let before = db.store.read(spec.task_id).await.unwrap().unwrap();
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
                    now: Utc::now(),
                };
                let expected = decide_claim(&snapshot);
                let taken = db
                    .store
                    .claim_task(spec.task_id, "w-after", Duration::from_secs(30), None)
                    .await
                    .unwrap();
                let after = taken.task.expect("the row exists");
                let label = taken.claim.label();
                seen.borrow_mut().insert(label);
                match expected {
                    ClaimDecision::Claim { .. } => {
                        prop_assert_eq!(label, "claimed", "{:?}", row);
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
        .claim_task(spec.task_id, "w-1", Duration::from_secs(30), Some(&spec))
        .await
        .unwrap();
    assert_eq!(first.claim.label(), "claimed");
    assert_eq!(first.ensured, Some(replyd::store::EnsureOutcome::Created));
    assert_eq!(first.task.unwrap().spec, spec);

    // A redelivered copy finds the task (and its live lease), and creates nothing.
    let again = db
        .store
        .claim_task(spec.task_id, "w-2", Duration::from_secs(30), Some(&spec))
        .await
        .unwrap();
    assert_eq!(again.claim.label(), "leased_by_other");
    assert_eq!(again.ensured, Some(replyd::store::EnsureOutcome::Exists));

    let mut other = spec.clone();
    other.message_id = "msg-different".into();
    let conflicting = db
        .store
        .claim_task(spec.task_id, "w-3", Duration::from_secs(30), Some(&other))
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

/// `replyd_gcra` (migration V16) grants what `capacity::gcra::grant`, its specification,
/// grants, over generated buckets, asks and instants.
#[test]
fn the_capacity_function_grants_what_gcra_grants() {
    use replyd::capacity::gcra::{Rate, grant, grant_whole};
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let client = runtime.block_on(db.raw_client());
    let mut runner = TestRunner::new(Config {
        cases: 400,
        ..Config::default()
    });
    let case = (
        proptest::option::of(0.0f64..20.0),
        0.0f64..20.0,
        0u64..5_000,
        1u64..200_000,
        proptest::bool::ANY,
    );
    runner
        .run(&case, |(tat, now, want, per_minute, whole)| {
            let rate = Rate::per_minute(per_minute);
            let spec = if whole {
                grant_whole(tat, now, want, rate)
            } else {
                grant(tat, now, want, rate)
            };
            let row = runtime.block_on(async {
                client
                    .query_one(
                        "SELECT granted, new_tat, wait FROM replyd_gcra($1, $2, $3, $4, $5, $6)",
                        &[
                            &tat,
                            &now,
                            &i64::try_from(want).unwrap(),
                            &rate.per_second,
                            &rate.burst,
                            &whole,
                        ],
                    )
                    .await
                    .unwrap()
            });
            let granted: i64 = row.get(0);
            let new_tat: f64 = row.get(1);
            let wait: f64 = row.get(2);
            prop_assert_eq!(granted as u64, spec.granted, "{:?}", spec);
            prop_assert!((new_tat - spec.tat).abs() < 1e-6, "{new_tat} vs {spec:?}");
            prop_assert!((wait - spec.wait).abs() < 1e-6, "{wait} vs {spec:?}");
            Ok::<(), TestCaseError>(())
        })
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_share_one_budget_and_a_refusal_pauses_both() {
    use replyd::store::capacity::GrantAsk;
    let db = TestDb::new().await;
    let ask = |holder: &'static str, want: u64, slots: u32, in_use: u32| GrantAsk {
        bucket: "model-a",
        holder,
        want_requests: want,
        want_tokens: 0,
        tokens_whole: false,
        want_slots: slots,
        in_use,
        // 600 a minute: 10 a second, 10 at once.
        requests_per_second: Some(10.0),
        tokens_per_second: None,
        slot_limit: Some(4),
        slot_ttl: Duration::from_secs(10),
        adaptive: false,
    };
    let a = db.store.capacity_grant(&ask("w-a", 8, 3, 0)).await.unwrap();
    let b = db.store.capacity_grant(&ask("w-b", 8, 3, 0)).await.unwrap();
    // One second's worth between them, and the four slots between them.
    assert_eq!(a.requests + b.requests, 10, "{a:?} {b:?}");
    assert_eq!((a.slots, b.slots), (3, 1));
    // w-b waits for a share: w-a, asked again, keeps no more than a fair one (it uses one).
    let a = db.store.capacity_grant(&ask("w-a", 0, 3, 1)).await.unwrap();
    assert_eq!(a.slots, 2);
    let b = db.store.capacity_grant(&ask("w-b", 0, 3, 0)).await.unwrap();
    assert_eq!(b.slots, 2);

    db.store
        .capacity_refused("model-a", Some(Duration::from_secs(30)), false)
        .await
        .unwrap();
    let paused = db.store.capacity_grant(&ask("w-b", 5, 2, 0)).await.unwrap();
    assert_eq!(paused.requests, 0);
    assert!(paused.blocked_for > Duration::from_secs(25), "{paused:?}");
    // Another model's budget is its own.
    let other = db
        .store
        .capacity_grant(&GrantAsk {
            bucket: "model-b",
            ..ask("w-b", 5, 2, 0)
        })
        .await
        .unwrap();
    assert_eq!(other.requests, 5);
}
