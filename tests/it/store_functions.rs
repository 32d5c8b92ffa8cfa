//! The claim's decision is made by a server-side function (`replyd_claim`, migration V9);
//! `lease::decide_claim` is its specification, the one the lease model checks. This test
//! writes generated rows into a real PostgreSQL, claims each, and checks that the function
//! decided what the specification decides and wrote what that decision means (I2, I7).

use std::time::Duration;

use crate::helpers::{TestDb, task_spec};
use chrono::Utc;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
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

/// `replyd_pace` (migration V16) schedules what `capacity::pacing::schedule`, its
/// specification, schedules, over generated buckets, waiters and instants.
#[test]
fn the_capacity_function_schedules_what_pacing_schedules() {
    use replyd_core::pacing::{Budget, HORIZON_SECONDS, schedule};
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let client = runtime.block_on(db.raw_client());
    let mut runner = TestRunner::new(Config {
        cases: 400,
        ..Config::default()
    });
    let case = (
        proptest::option::of(0.0f64..20.0),
        proptest::option::of(0.0f64..20.0),
        proptest::option::of(0.1f64..400.0),
        proptest::option::of(10.0f64..50_000.0),
        0.0f64..20.0,
        proptest::collection::vec(1u64..5_000, 0..40),
    );
    runner
        .run(
            &case,
            |(requests_tat, tokens_tat, rps, tps, now, waiters)| {
                let spec = schedule(
                    Budget {
                        requests_tat,
                        tokens_tat,
                        requests_per_second: rps,
                        tokens_per_second: tps,
                    },
                    now,
                    &waiters,
                );
                let waiters: Vec<i64> = waiters.iter().map(|t| *t as i64).collect();
                let row = runtime.block_on(async {
                    client
                        .query_one(
                            "SELECT delays, new_requests_tat, new_tokens_tat, wait \
                         FROM replyd_pace($1, $2, $3, $4, $5, $6, $7)",
                            &[
                                &requests_tat,
                                &tokens_tat,
                                &rps,
                                &tps,
                                &now,
                                &HORIZON_SECONDS,
                                &waiters,
                            ],
                        )
                        .await
                        .unwrap()
                });
                let delays: Vec<f64> = row.get(0);
                let close = |a: Option<f64>, b: Option<f64>| match (a, b) {
                    (Some(a), Some(b)) => (a - b).abs() < 1e-6,
                    (a, b) => a == b,
                };
                prop_assert_eq!(delays.len(), spec.delays.len(), "{:?}", spec);
                for (sql, rust) in delays.iter().zip(&spec.delays) {
                    prop_assert!((sql - rust).abs() < 1e-6, "{sql} vs {rust}");
                }
                prop_assert!(close(row.get(1), spec.requests_tat));
                prop_assert!(close(row.get(2), spec.tokens_tat));
                prop_assert!((row.get::<_, f64>(3) - spec.wait).abs() < 1e-6);
                Ok::<(), TestCaseError>(())
            },
        )
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_workers_share_one_budget_and_a_refusal_pauses_both() {
    use replyd::store::capacity::GrantAsk;
    let db = TestDb::new().await;
    let waiters = [10u64; 8];
    let ask = |holder: &'static str, n: usize, slots: u32, in_use: u32| GrantAsk {
        bucket: "model-a",
        holder,
        waiters: &waiters[..n],
        want_slots: slots,
        in_use,
        // 600 a minute: one every 100 ms.
        requests_per_second: Some(10.0),
        tokens_per_second: None,
        slot_limit: Some(4),
        slot_ttl: Duration::from_secs(10),
        adaptive: false,
        horizon: Duration::from_millis(250),
        sent_freely: 0,
        demand: &[],
    };
    let a = db.store.capacity_grant(&ask("w-a", 8, 3, 0)).await.unwrap();
    let b = db.store.capacity_grant(&ask("w-b", 8, 3, 0)).await.unwrap();
    // The four slots between them; the schedule is one: w-a's three calls go 100 ms apart,
    // and w-b's one slot gets a send time after theirs, past the quarter second (none yet).
    assert_eq!((a.slots, b.slots), (3, 1));
    assert_eq!(a.delays.len(), 3, "{a:?}");
    assert!(a.delays[2] >= Duration::from_millis(199), "{a:?}");
    assert!(b.delays.is_empty() && b.wait > Duration::ZERO, "{b:?}");
    // w-b waits for a share: w-a, asked again, keeps no more than a fair one (it uses one).
    let a = db.store.capacity_grant(&ask("w-a", 0, 3, 1)).await.unwrap();
    assert_eq!(a.slots, 2);
    let b = db.store.capacity_grant(&ask("w-b", 0, 3, 0)).await.unwrap();
    assert_eq!(b.slots, 2);

    db.store
        .capacity_refused("model-a", Some(Duration::from_secs(30)), false, 0)
        .await
        .unwrap();
    let paused = db.store.capacity_grant(&ask("w-b", 5, 2, 0)).await.unwrap();
    assert!(paused.delays.is_empty());
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
    assert_eq!(other.delays.len(), 2, "two slots, two calls: {other:?}");
}

/// I10 across workers: worker w1 holds only workspace A's backlog, w2 holds the other half of
/// A's and all of B's. Each workspace is owed half the rate, so w2 is owed three quarters of
/// it (half through B, a quarter through A). Without the parts, whoever asks first takes the
/// whole horizon. With B of weight 3, B is owed three quarters and w2 seven eighths. A worker
/// alone is held to nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn workers_get_the_rate_in_parts_by_the_workspaces_that_wait_in_them() {
    use replyd::store::capacity::GrantAsk;
    let db = TestDb::new().await;
    let waiters = [10u64; 120];
    let only_a = [("a".to_owned(), 100usize)];
    let a_and_b = [("a".to_owned(), 100usize), ("b".to_owned(), 10usize)];
    let ask = |bucket: &'static str, holder: &'static str, n: usize, demand| GrantAsk {
        bucket,
        holder,
        waiters: &waiters[..n],
        want_slots: 0,
        in_use: 0,
        // 400 a second over a quarter-second horizon: 100 calls a grant at most.
        requests_per_second: Some(400.0),
        tokens_per_second: None,
        slot_limit: None,
        slot_ttl: Duration::from_secs(10),
        adaptive: false,
        horizon: Duration::from_millis(250),
        sent_freely: 0,
        demand,
    };
    for (bucket, b_weight, w2_part) in [("m-even", 1, 75), ("m-weighted", 3, 87)] {
        for workspace in ["a", "b"] {
            db.store.create_workspace(workspace).await.unwrap();
        }
        assert!(db.store.set_workspace_weight("b", b_weight).await.unwrap());
        // w1 tells its demand first (a grant with none of its waiters asked for yet).
        let w1 = db
            .store
            .capacity_grant(&ask(bucket, "w1", 0, &only_a))
            .await
            .unwrap();
        assert!(w1.delays.is_empty(), "{w1:?}");
        let w2 = db
            .store
            .capacity_grant(&ask(bucket, "w2", 110, &a_and_b))
            .await
            .unwrap();
        assert_eq!(
            w2.delays.len(),
            w2_part,
            "{bucket}: w2's part of 100: {w2:?}"
        );
        let w1 = db
            .store
            .capacity_grant(&ask(bucket, "w1", 100, &only_a))
            .await
            .unwrap();
        assert_eq!(
            w1.delays.len(),
            100 - w2_part - usize::from(b_weight == 3),
            "{bucket}: w1's part of 100 (12.5 rounds down), after w2's: {w1:?}"
        );
        // Asked again at once, w1 has spent its credit: nothing, and a wait till it has one.
        let again = db
            .store
            .capacity_grant(&ask(bucket, "w1", 100, &only_a))
            .await
            .unwrap();
        assert!(
            again.delays.len() <= 1 && again.wait > Duration::ZERO,
            "{again:?}"
        );
    }
    // Alone (w2 gone, its demand with it): w1's part is the whole rate.
    let w2_done = db
        .store
        .capacity_grant(&ask("m-alone", "w2", 0, &[]))
        .await
        .unwrap();
    assert!(w2_done.delays.is_empty());
    let alone = db
        .store
        .capacity_grant(&ask("m-alone", "w1", 120, &only_a))
        .await
        .unwrap();
    assert_eq!(alone.delays.len(), 100, "{alone:?}");
}

/// A refusal that reaches the budget before the provider's first report of its limit (another
/// call of the same worker reported it, in its own round trip) cuts a rate measured from
/// nothing; the report then replaces it. A cut made once a report is known stands.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_report_replaces_a_rate_cut_before_it_and_a_later_cut_stands() {
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let learned = || async {
        client
            .query_one(
                "SELECT learned_rps FROM capacity_buckets WHERE bucket = 'model-a'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, Option<f64>>(0)
    };
    let cut = db
        .store
        .capacity_refused("model-a", Some(Duration::from_secs(1)), true, 0)
        .await
        .unwrap();
    assert_eq!(cut, Some(0.5), "a rate measured from nothing: the floor");
    db.store.capacity_reported("model-a", 50.0).await.unwrap();
    assert_eq!(
        learned().await,
        Some(50.0),
        "the first report replaces the guess"
    );
    // Once the report is known, a refusal (over a second after the report set the rate) cuts
    // it, and the same report again does not undo the cut.
    client
        .execute(
            "UPDATE capacity_buckets SET learned_changed_at = learned_changed_at - 2, \
             cut_at = cut_at - 2, refused_at = refused_at - 2",
            &[],
        )
        .await
        .unwrap();
    let cut = db
        .store
        .capacity_refused("model-a", None, true, 0)
        .await
        .unwrap()
        .unwrap();
    assert!((cut - 45.0).abs() < 1e-9, "{cut}");
    db.store.capacity_reported("model-a", 50.0).await.unwrap();
    assert_eq!(learned().await, Some(cut));
}

/// During a rolling upgrade the previous release's workers call the capacity functions with
/// the signatures they knew (no calls sent freely): those still grant, pause and cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_releases_capacity_calls_still_work() {
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let granted: i32 = client
        .query_one(
            "SELECT cardinality(delays) FROM replyd_capacity_grant( \
             'model-a', 'old', '{1,1,1}'::bigint[], 3, 0, NULL, NULL, NULL, 10, true, 0.25)",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(granted, 3, "nothing learned: every waiter goes");
    let row = client
        .query_one(
            "SELECT requests_per_second, blocked_for \
             FROM replyd_capacity_refused('model-a', 1.0, true)",
            &[],
        )
        .await
        .unwrap();
    let (rate, blocked_for): (Option<f64>, f64) = (row.get(0), row.get(1));
    // 3 went, 1 was refused: 95 % of the 2 that got through.
    assert!(rate.is_some_and(|r| (r - 1.9).abs() < 1e-9), "{rate:?}");
    assert!(blocked_for > 0.5, "{blocked_for}");
}

/// One step of the learned rate's life, as the budget sees it.
#[derive(Debug, Clone)]
enum LearnedStep {
    /// A grant for `waiting` calls (the budget decides how many go), with the calls the worker
    /// let go freely since it last told the budget.
    Grant { waiting: usize, sent_freely: u64 },
    /// A refusal for capacity, with the calls let go freely, and the pause the provider asked
    /// for, if any (it holds grants off; the learned rate does not read it).
    Refused {
        sent_freely: u64,
        pause_secs: Option<f64>,
    },
    /// The provider reported its limit, requests a second.
    Reported(f64),
}

/// Runs `step` at `now` on `bucket` through the learned rate's SQL (`replyd_capacity_grant`,
/// `_refused`, `_reported`) and on `rust` through its twin, `pacing::Learned`, and returns the
/// twin after it. The SQL's clock is set to `now` (`replyd.capacity_now`).
fn learned_step(
    runtime: &tokio::runtime::Runtime,
    client: &tokio_postgres::Client,
    bucket: &str,
    now: f64,
    step: &LearnedStep,
    rust: replyd_core::pacing::Learned,
) -> replyd_core::pacing::Learned {
    runtime.block_on(async {
        client
            .execute(
                "SELECT set_config('replyd.capacity_now', $1, false)",
                &[&format!("{now:?}")],
            )
            .await
            .unwrap();
        match step {
            LearnedStep::Grant {
                waiting,
                sent_freely,
            } => {
                let waiters = vec![1i64; *waiting];
                let row = client
                    .query_one(
                        "SELECT coalesce(cardinality(delays), 0), blocked_for \
                         FROM replyd_capacity_grant( \
                         $1, 'holder', $2, $3, 0, NULL, NULL, NULL, 10, true, 0.25, $4)",
                        &[
                            &bucket,
                            &waiters,
                            &(*waiting as i32),
                            &(*sent_freely as i64),
                        ],
                    )
                    .await
                    .unwrap();
                let (granted, blocked_for): (i32, f64) = (row.get(0), row.get(1));
                // A pause grants nothing and regrows nothing; the calls let go freely went.
                let sent = rust.sent(now, *sent_freely);
                if blocked_for > 0.0 {
                    sent
                } else {
                    sent.granted(now, granted as u64)
                }
            }
            LearnedStep::Refused {
                sent_freely,
                pause_secs,
            } => {
                client
                    .query_one(
                        "SELECT * FROM replyd_capacity_refused($1, $2, true, $3)",
                        &[&bucket, pause_secs, &(*sent_freely as i64)],
                    )
                    .await
                    .unwrap();
                rust.sent(now, *sent_freely).refused(now)
            }
            LearnedStep::Reported(rate) => {
                client
                    .execute("SELECT replyd_capacity_reported($1, $2)", &[&bucket, rate])
                    .await
                    .unwrap();
                rust.reported(now, *rate)
            }
        }
    })
}

/// The bucket's learned state as the SQL left it, read into its twin's type.
fn learned_in_sql(
    runtime: &tokio::runtime::Runtime,
    client: &tokio_postgres::Client,
    bucket: &str,
) -> replyd_core::pacing::Learned {
    use replyd_core::pacing::{Learned, Window};
    let row = runtime.block_on(async {
        client
            .query_one(
                "SELECT reported_rps, learned_rps, learned_changed_at, cut_at, refused_at, \
                 good_rps, window_start, window_granted, window_refused, previous_rate, \
                 previous_refused_rate FROM capacity_buckets WHERE bucket = $1",
                &[&bucket],
            )
            .await
            .unwrap()
    });
    Learned {
        reported: row.get("reported_rps"),
        per_second: row.get("learned_rps"),
        changed_at: row.get("learned_changed_at"),
        cut_at: row.get("cut_at"),
        refused_at: row.get("refused_at"),
        good_per_second: row.get("good_rps"),
        window: Window {
            start: row.get("window_start"),
            granted: row.get::<_, i64>("window_granted") as u64,
            refused: row.get::<_, i64>("window_refused") as u64,
            previous_granted_rate: row.get("previous_rate"),
            previous_refused_rate: row.get("previous_refused_rate"),
        },
    }
}

/// The two sides agree, to rounding.
fn learned_agree(sql: &replyd_core::pacing::Learned, rust: &replyd_core::pacing::Learned) -> bool {
    let same = |a: f64, b: f64| (a - b).abs() < 1e-9;
    let same_opt = |a: Option<f64>, b: Option<f64>| match (a, b) {
        (Some(a), Some(b)) => same(a, b),
        (a, b) => a == b,
    };
    same_opt(sql.reported, rust.reported)
        && same_opt(sql.per_second, rust.per_second)
        && same(sql.changed_at, rust.changed_at)
        && same(sql.cut_at, rust.cut_at)
        && same(sql.refused_at, rust.refused_at)
        && same(sql.good_per_second, rust.good_per_second)
        && same(sql.window.start, rust.window.start)
        && sql.window.granted == rust.window.granted
        && sql.window.refused == rust.window.refused
        && same(
            sql.window.previous_granted_rate,
            rust.window.previous_granted_rate,
        )
        && same(
            sql.window.previous_refused_rate,
            rust.window.previous_refused_rate,
        )
}

/// The learned rate's SQL (migration V31, over V16 and V18) moves the bucket exactly as
/// `capacity::pacing::Learned`, its twin, moves: over generated runs of grants, calls let go
/// freely, refusals (some with a pause) and reports at generated instants. The instants are
/// multiples of 1/64 s, so both sides do the same arithmetic on the same doubles.
#[test]
fn the_learned_rate_moves_in_sql_as_pacing_learned_moves() {
    use replyd_core::pacing::Learned;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let client = runtime.block_on(db.raw_client());
    let mut runner = TestRunner::new(Config {
        cases: 150,
        ..Config::default()
    });
    let sent_freely = || prop_oneof![Just(0u64), 1u64..200];
    let step = prop_oneof![
        (0usize..12, sent_freely()).prop_map(|(waiting, sent_freely)| LearnedStep::Grant {
            waiting,
            sent_freely
        }),
        (sent_freely(), proptest::option::of(1u32..128)).prop_map(|(sent_freely, pause)| {
            LearnedStep::Refused {
                sent_freely,
                pause_secs: pause.map(|p| f64::from(p) / 64.0),
            }
        }),
        (1u32..12_800).prop_map(|r| LearnedStep::Reported(f64::from(r) / 64.0)),
    ];
    let case = proptest::collection::vec((0u32..160, step), 1..40);
    let bucket_no = std::sync::atomic::AtomicU64::new(0);
    runner
        .run(&case, |steps| {
            let n = bucket_no.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let bucket = format!("learned-{n}");
            // The bucket row's defaults: nothing learned, every instant at 0.
            let mut rust = Learned::new(0.0);
            let mut now = 1_000.0f64;
            for (sixty_fourths, step) in steps {
                now += f64::from(sixty_fourths) / 64.0;
                rust = learned_step(&runtime, &client, &bucket, now, &step, rust);
                let sql = learned_in_sql(&runtime, &client, &bucket);
                prop_assert!(
                    learned_agree(&sql, &rust),
                    "after {step:?} at {now}: sql {sql:?}, rust {rust:?}"
                );
            }
            Ok::<(), TestCaseError>(())
        })
        .unwrap();
}

/// A burst against a provider that reports no limit, step by step through the SQL and its
/// twin: the first refusal cuts from the calls let go freely (not from nothing, to the floor);
/// the refusals of the same overload do not cut again, but a refusal a second after the cut
/// does, to what got through; quiet seconds go back to it, then probe; a refusal cuts a rate
/// that regrew a moment ago; a first report replaces the learned rate, and a refusal cuts it
/// by 10 %, never to regrow past it.
#[test]
fn the_learned_rate_is_cut_to_what_got_through_in_sql_as_in_pacing() {
    use LearnedStep::{Grant, Refused, Reported};
    use replyd_core::pacing::Learned;
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let db = runtime.block_on(TestDb::new());
    let client = runtime.block_on(db.raw_client());
    let grant = |waiting, sent_freely| Grant {
        waiting,
        sent_freely,
    };
    let refused = |sent_freely, pause_secs| Refused {
        sent_freely,
        pause_secs,
    };
    // (seconds past 1,000, the step, the learned rate after it)
    let script = [
        // 100 calls let go freely, told with a grant; nothing learned yet.
        (0.5, grant(0, 100), None),
        // The first refusal (and a pause of half a second): 95 % of the 99 that got through.
        (1.5, refused(0, Some(0.5)), Some(94.05)),
        // Another worker's free calls, told during the pause: counted, nothing granted.
        (1.75, grant(3, 6), Some(94.05)),
        // The same overload's other refusal: counted, no cut within a second of the cut.
        (2.0, refused(0, None), Some(94.05)),
        (2.25, grant(12, 0), Some(94.05)),
        // A second after the cut: 18 went and 3 were refused in the last second, 15 got
        // through.
        (2.5, refused(0, None), Some(14.25)),
        // Quiet seconds: back to the 15 that got through, then up by 10 % (at least 1).
        (3.5, grant(4, 0), Some(15.0)),
        (4.5, grant(4, 0), Some(16.5)),
        (5.5, grant(4, 0), Some(18.15)),
        // A refusal a quarter of a second after a regrowth step cuts all the same: 4 went in
        // this window and 4 a second in the one before, over three quarters of a second.
        (5.75, refused(0, None), Some(5.7)),
        // The first report replaces the learned rate and holds a cut off for a second.
        (6.0, Reported(50.0), Some(50.0)),
        (6.5, refused(0, None), Some(50.0)),
        (7.0, refused(0, None), Some(45.0)),
        (7.25, Reported(50.0), Some(45.0)),
        // Nothing got through before that cut: regrowth probes, up to the report.
        (8.0, grant(4, 0), Some(49.5)),
        (9.0, grant(4, 0), Some(50.0)),
    ];
    let bucket = "learned-script";
    let mut rust = Learned::new(0.0);
    for (at, step, expected) in script {
        let now = 1_000.0 + at;
        rust = learned_step(&runtime, &client, bucket, now, &step, rust);
        let sql = learned_in_sql(&runtime, &client, bucket);
        assert!(
            learned_agree(&sql, &rust),
            "after {step:?} at {now}: sql {sql:?}, rust {rust:?}"
        );
        let close = match (rust.per_second, expected) {
            (Some(a), Some(b)) => (a - b).abs() < 1e-9,
            (a, b) => a == b,
        };
        assert!(
            close,
            "after {step:?} at {now}: {rust:?}, expected {expected:?}"
        );
    }
}

/// The values a column's `CHECK (col in (...))` constraint allows, as the database holds it.
async fn check_list(client: &tokio_postgres::Client, table: &str, constraint: &str) -> Vec<String> {
    let definition: String = client
        .query_one(
            "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c \
             WHERE c.conrelid = $1::text::regclass AND c.conname = $2",
            &[&table, &constraint],
        )
        .await
        .unwrap()
        .get(0);
    // `CHECK ((col = ANY (ARRAY['a'::text, 'b'::text])))`: the quoted values, in order.
    let mut values: Vec<String> = definition
        .split('\'')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect();
    values.sort();
    values
}

/// Every closed set the code spells as text is the set its column's `CHECK` allows: a value
/// the code writes is never refused, and a value the database takes can always be read.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_closed_set_is_its_columns_check_list() {
    use replyd_core::domain::AttemptOutcome;
    use replyd_core::quota::ReservationState;
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let sorted = |mut values: Vec<&str>| {
        values.sort();
        values.into_iter().map(str::to_owned).collect::<Vec<_>>()
    };
    assert_eq!(
        check_list(&client, "reply_tasks", "reply_tasks_status_check").await,
        sorted(TaskStatus::ALL.iter().map(|s| s.as_str()).collect())
    );
    assert_eq!(
        check_list(&client, "reply_attempts", "reply_attempts_outcome_check").await,
        sorted(AttemptOutcome::ALL.iter().map(|o| o.as_str()).collect())
    );
    assert_eq!(
        check_list(
            &client,
            "quota_reservations",
            "quota_reservations_state_check"
        )
        .await,
        sorted(ReservationState::ALL.iter().map(|s| s.as_str()).collect())
    );
    // And each spelling reads back as its value.
    for status in TaskStatus::ALL {
        assert_eq!(TaskStatus::parse(status.as_str()), Some(status));
    }
    for outcome in AttemptOutcome::ALL {
        assert_eq!(AttemptOutcome::parse(outcome.as_str()), Some(outcome));
    }
    for state in ReservationState::ALL {
        assert_eq!(ReservationState::parse(state.as_str()), Some(state));
    }
}

/// The labels `replyd_claim` answers with, as the database holds the function, are the claim
/// kinds the store reads back: a label the code does not know would fail a claim's read, and
/// a kind the function never answers would be dead code.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_claim_function_answers_with_the_claim_kinds() {
    use replyd_core::lease::ClaimKind;
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let definition: String = client
        .query_one(
            "SELECT pg_get_functiondef(p.oid) FROM pg_proc p \
             WHERE p.proname = 'replyd_claim' AND p.pronamespace = current_schema()::regnamespace \
             ORDER BY p.pronargs DESC LIMIT 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    // The function's answers: `select '<label>'::text`, `then '<label>'`, `else '<label>'`.
    let mut answered: Vec<String> = Vec::new();
    for word in ["select '", "then '", "else '"] {
        for (at, _) in definition.match_indices(word) {
            let rest = &definition[at + word.len()..];
            let label: String = rest
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            if !label.is_empty() && rest[label.len()..].starts_with('\'') {
                answered.push(label);
            }
        }
    }
    answered.sort();
    answered.dedup();
    let mut kinds: Vec<String> = ClaimKind::ALL
        .iter()
        .map(|k| k.as_str().to_owned())
        .collect();
    kinds.sort();
    assert_eq!(answered, kinds, "replyd_claim's labels against ClaimKind");
    for kind in ClaimKind::ALL {
        assert_eq!(ClaimKind::parse(kind.as_str()), Some(kind));
    }
}

/// A transaction's status changes go out together at its commit (V32): notifications of
/// `<task_id> <status>` lines, each under NOTIFY's 8,000 bytes, and none for a statement that
/// changes no status. A batch of claims (one statement per task) or of completions is one
/// transaction, so it wakes every listening session once, not once per task.
#[tokio::test]
async fn a_transaction_notifies_its_status_changes_together() {
    use replyd::store::listen::{TASK_STATUS_CHANNEL, parse_status_payloads};

    let db = TestDb::new().await;
    let mut tasks = Vec::new();
    for _ in 0..310 {
        let spec = task_spec(3);
        db.store
            .claim_task(
                spec.task_id,
                "w-1",
                Duration::from_secs(30),
                Some(&spec),
                None,
            )
            .await
            .unwrap();
        tasks.push(spec.task_id.as_uuid());
    }
    let sentinel = task_spec(3);
    db.store
        .claim_task(
            sentinel.task_id,
            "w-1",
            Duration::from_secs(30),
            Some(&sentinel),
            None,
        )
        .await
        .unwrap();

    // Other tests' schemas notify on the same channel: only this test's tasks count.
    let (mut rx, _listening) = crate::helpers::hear(&db.settings, TASK_STATUS_CHANNEL).await;

    let mut client = db.raw_client().await;
    // 300 in one statement; 10 in a transaction of one statement each.
    let (many, few) = tasks.split_at(300);
    client
        .execute(
            "UPDATE reply_tasks SET status = 'failed', failure = 'test', lease_owner = NULL, \
             lease_until = NULL WHERE task_id = ANY($1)",
            &[&many],
        )
        .await
        .unwrap();
    let tx = client.transaction().await.unwrap();
    for task in few {
        tx.execute(
            "UPDATE reply_tasks SET status = 'failed', failure = 'test', lease_owner = NULL, \
             lease_until = NULL WHERE task_id = $1",
            &[task],
        )
        .await
        .unwrap();
    }
    tx.commit().await.unwrap();
    // Rolled back: nothing heard of it.
    let tx = client.transaction().await.unwrap();
    tx.execute(
        "UPDATE reply_tasks SET status = 'completed', saved_response = 'x', failure = NULL \
         WHERE task_id = $1",
        &[&few[0]],
    )
    .await
    .unwrap();
    tx.rollback().await.unwrap();
    // No status changes: no notification.
    client
        .execute(
            "UPDATE reply_tasks SET updated_at = clock_timestamp() WHERE task_id = ANY($1)",
            &[&tasks],
        )
        .await
        .unwrap();
    // The last word, to know that all before it has been heard (one session's notifications
    // arrive in commit order).
    client
        .execute(
            "UPDATE reply_tasks SET status = 'failed', failure = 'test', lease_owner = NULL, \
             lease_until = NULL WHERE task_id = $1",
            &[&sentinel.task_id.as_uuid()],
        )
        .await
        .unwrap();

    let ours: std::collections::HashSet<uuid::Uuid> = tasks.iter().copied().collect();
    let mut payloads = Vec::new();
    loop {
        let payload = tokio::time::timeout(Duration::from_secs(30), rx.recv())
            .await
            .expect("the sentinel's notification")
            .expect("the listening session ended");
        let lines: Vec<_> = parse_status_payloads(&payload)
            .map(|line| line.expect("every line understood"))
            .collect();
        if lines.iter().any(|(task, _)| *task == sentinel.task_id) {
            assert_eq!(lines, vec![(sentinel.task_id, TaskStatus::Failed)]);
            break;
        }
        if lines.iter().any(|(task, _)| ours.contains(&task.as_uuid())) {
            payloads.push((payload.len(), lines));
        }
    }
    assert_eq!(
        payloads.len(),
        3,
        "310 changes in one statement, 150 a notification: {:?}",
        payloads
            .iter()
            .map(|(len, l)| (len, l.len()))
            .collect::<Vec<_>>()
    );
    let mut heard = std::collections::HashSet::new();
    for (len, lines) in &payloads {
        assert!(*len < 8_000, "a payload of {len} bytes");
        for (task, status) in lines {
            assert_eq!(*status, TaskStatus::Failed);
            assert!(
                ours.contains(&task.as_uuid()),
                "another test's task in ours"
            );
            assert!(heard.insert(*task), "{task} heard twice");
        }
    }
    assert_eq!(heard.len(), tasks.len(), "every change heard");
}
