//! The fenced-lease task store against a real PostgreSQL: claims race, leases expire, zombies
//! come back, and completions wait on row locks. Each test names the invariant it attacks.

use std::sync::Arc;
use std::time::Duration;

use crate::helpers::{TestDb, task_spec, wait_until};
use chrono::{DateTime, Utc};
use replyd::store::live::{LIVE_PIECES_CHANNEL, PieceToWrite, parse_live_pieces};
use replyd::store::{CompletionOutcome, EnsureOutcome, FailOutcome, RenewOutcome, Store};
use replyd_core::domain::{AttemptOutcome, TaskId, TaskStatus};
use replyd_core::lease::{ClaimOutcome, Lease, Refusal};
use tokio::sync::Barrier;

const SHORT_LEASE: Duration = Duration::from_millis(300);
const LONG_LEASE: Duration = Duration::from_secs(60);

async fn new_task(db: &TestDb, max_attempts: u32) -> TaskId {
    let spec = task_spec(max_attempts);
    assert_eq!(
        db.store.ensure_task(&spec).await.unwrap(),
        EnsureOutcome::Created
    );
    spec.task_id
}

async fn claim_ok(store: &Store, task: TaskId, owner: &str, lease: Duration) -> Lease {
    match store.claim(task, owner, lease).await.unwrap() {
        ClaimOutcome::Claimed(lease) => lease,
        other => panic!("{owner} expected to claim, got {other:?}"),
    }
}

/// Waits until the database clock is past `until` (never the test's own clock).
async fn wait_for_expiry(db: &TestDb, until: DateTime<Utc>) {
    let client = db.raw_client().await;
    wait_until(
        "the lease expired by the database clock",
        Duration::from_secs(30),
        || {
            let client = &client;
            async move {
                let row = client
                    .query_one("SELECT clock_timestamp() > $1", &[&until])
                    .await
                    .unwrap();
                row.get::<_, bool>(0)
            }
        },
    )
    .await;
}

async fn attempt_outcomes(db: &TestDb, task: TaskId) -> Vec<(i64, Option<String>)> {
    db.raw_client()
        .await
        .query(
            "SELECT assignment_version, outcome FROM reply_attempts WHERE task_id = $1 ORDER BY assignment_version",
            &[&task.as_uuid()],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect()
}

/// Runs 16 claims of one task at once, each on its own connection, released together.
async fn claim_race(db: &TestDb, task: TaskId, round: usize) -> Vec<(String, ClaimOutcome)> {
    let claimers = 16;
    let barrier = Arc::new(Barrier::new(claimers));
    let mut handles = Vec::new();
    for i in 0..claimers {
        let store = db.store.clone();
        let barrier = barrier.clone();
        let owner = format!("worker-{round}-{i}");
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            let outcome = store.claim(task, &owner, SHORT_LEASE).await.unwrap();
            (owner, outcome)
        }));
    }
    let mut outcomes = Vec::new();
    for handle in handles {
        outcomes.push(handle.await.unwrap());
    }
    outcomes
}

#[tokio::test]
async fn sixteen_concurrent_claimers_get_exactly_one_lease_per_round() {
    // I2: one current assignment at a time, whatever the concurrency.
    let db = TestDb::new().await;
    let task = new_task(&db, 5).await;
    let mut previous: Option<Lease> = None;
    for round in 1..=3 {
        let outcomes = claim_race(&db, task, round).await;
        let winners: Vec<&Lease> = outcomes
            .iter()
            .filter_map(|(_, o)| match o {
                ClaimOutcome::Claimed(lease) => Some(lease),
                _ => None,
            })
            .collect();
        assert_eq!(winners.len(), 1, "round {round}: {outcomes:?}");
        let winner = winners[0].clone();
        assert_eq!(winner.version, round as i64, "each claim is version + 1");
        for (owner, outcome) in &outcomes {
            if owner == &winner.owner {
                continue;
            }
            // The losers are told why: the winner's live lease, with its version and end.
            assert_eq!(
                outcome,
                &ClaimOutcome::LeasedByOther {
                    owner: winner.owner.clone(),
                    version: winner.version,
                    until: winner.until,
                },
                "round {round}, {owner}"
            );
        }
        if let Some(stale) = previous.take() {
            assert_eq!(
                db.store.complete(&stale, "stale", None).await.unwrap(),
                CompletionOutcome::Refused(Refusal::TakenOver {
                    current_version: winner.version
                })
            );
        }
        wait_for_expiry(&db, winner.until).await;
        previous = Some(winner);
    }
    let task_row = db.store.read(task).await.unwrap().unwrap();
    assert_eq!(task_row.attempt_count, 3);
    assert_eq!(task_row.saved_response, None);
}

#[tokio::test]
async fn zombie_completion_is_rejected_after_takeover() {
    // I1 + I2: A stalls past its lease, B takes over; A's late answer must not win.
    let db = TestDb::new().await;
    let task = new_task(&db, 3).await;
    let a = claim_ok(&db.store, task, "worker-a", SHORT_LEASE).await;
    wait_for_expiry(&db, a.until).await;
    let b = claim_ok(&db.store, task, "worker-b", LONG_LEASE).await;
    assert_eq!(b.version, a.version + 1);

    assert_eq!(
        db.store.complete(&a, "answer from A", None).await.unwrap(),
        CompletionOutcome::Refused(Refusal::TakenOver {
            current_version: b.version
        })
    );
    assert_eq!(
        db.store.complete(&b, "answer from B", None).await.unwrap(),
        CompletionOutcome::Accepted
    );
    // A, coming back once more after B saved, is still refused, now because the reply exists.
    assert_eq!(
        db.store.complete(&a, "answer from A", None).await.unwrap(),
        CompletionOutcome::Refused(Refusal::AlreadySaved {
            by_this_assignment: false
        })
    );

    let stored = db.store.read(task).await.unwrap().unwrap();
    assert_eq!(stored.status, TaskStatus::Completed);
    assert_eq!(stored.saved_response.as_deref(), Some("answer from B"));
    // The zombie's refusal is on record; its first word (fenced) is kept.
    assert_eq!(
        attempt_outcomes(&db, task).await,
        vec![
            (a.version, Some("fenced".to_string())),
            (b.version, Some("accepted".to_string()))
        ]
    );
}

/// Holds the task's row lock (`SELECT ... FOR UPDATE`, no change) on a separate session until
/// the returned sender fires; returns that session's backend pid.
async fn hold_row_lock(
    db: &TestDb,
    task: TaskId,
) -> (
    i32,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<()>,
) {
    let mut blocker = db.raw_client().await;
    let (pid_tx, pid_rx) = tokio::sync::oneshot::channel();
    let (release_tx, release_rx) = tokio::sync::oneshot::channel::<()>();
    let handle = tokio::spawn(async move {
        let tx = blocker.transaction().await.unwrap();
        let pid: i32 = tx
            .query_one("SELECT pg_backend_pid()", &[])
            .await
            .unwrap()
            .get(0);
        tx.query_one(
            "SELECT task_id FROM reply_tasks WHERE task_id = $1 FOR UPDATE",
            &[&task.as_uuid()],
        )
        .await
        .unwrap();
        pid_tx.send(pid).unwrap();
        let _ = release_rx.await;
        tx.commit().await.unwrap();
    });
    (pid_rx.await.unwrap(), release_tx, handle)
}

async fn wait_until_blocked_by(db: &TestDb, blocker_pid: i32) {
    let observer = db.raw_client().await;
    wait_until(
        "a session waits on the held row lock",
        Duration::from_secs(10),
        || {
            let observer = &observer;
            async move {
                let row = observer
                .query_one(
                    "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
                    &[&blocker_pid],
                )
                .await
                .unwrap();
                row.get::<_, i64>(0) > 0
            }
        },
    )
    .await;
}

async fn lease_is_live(db: &TestDb, lease: &Lease) -> bool {
    db.raw_client()
        .await
        .query_one("SELECT clock_timestamp() < $1", &[&lease.until])
        .await
        .unwrap()
        .get(0)
}

#[tokio::test]
async fn completion_waiting_on_a_row_lock_is_refused_when_the_lease_expires_meanwhile() {
    // I2, the lock-wait case: A's completion starts while A's lease is live, waits on a row
    // lock held by a transaction that changes nothing, and the lease runs out during the wait.
    let db = TestDb::new().await;
    let task = new_task(&db, 3).await;
    let a = claim_ok(&db.store, task, "worker-a", Duration::from_secs(3)).await;
    let (blocker_pid, release, blocker) = hold_row_lock(&db, task).await;

    let store = db.store.clone();
    let lease = a.clone();
    let completion =
        tokio::spawn(async move { store.complete(&lease, "answer from A", None).await });
    wait_until_blocked_by(&db, blocker_pid).await;
    assert!(
        lease_is_live(&db, &a).await,
        "setup: the completion must start waiting while the lease is live, or the test proves nothing"
    );
    wait_for_expiry(&db, a.until).await;
    release.send(()).unwrap();
    blocker.await.unwrap();

    assert_eq!(
        completion.await.unwrap().unwrap(),
        CompletionOutcome::Refused(Refusal::LeaseExpired)
    );
    let stored = db.store.read(task).await.unwrap().unwrap();
    assert_eq!(stored.status, TaskStatus::Running);
    assert_eq!(stored.saved_response, None);
}

#[tokio::test]
async fn a_guarded_update_without_locking_first_accepts_an_expired_lease() {
    // Why the store locks first: the same race against the single-statement form writes. This
    // shows the race above is real on this PostgreSQL, so the refusal there is earned.
    let db = TestDb::new().await;
    let task = new_task(&db, 3).await;
    let a = claim_ok(&db.store, task, "worker-a", Duration::from_secs(3)).await;
    let (blocker_pid, release, blocker) = hold_row_lock(&db, task).await;

    let naive = db.raw_client().await;
    let id = task.as_uuid();
    let version = a.version;
    let write = tokio::spawn(async move {
        naive
            .execute(
                "UPDATE reply_tasks SET saved_response = 'naive', status = 'completed' \
                 WHERE task_id = $1 AND assignment_version = $2 AND status = 'running' \
                   AND lease_until > clock_timestamp() AND saved_response IS NULL",
                &[&id, &version],
            )
            .await
            .unwrap()
    });
    wait_until_blocked_by(&db, blocker_pid).await;
    assert!(lease_is_live(&db, &a).await, "setup: must wait while live");
    wait_for_expiry(&db, a.until).await;
    release.send(()).unwrap();
    blocker.await.unwrap();
    assert_eq!(
        write.await.unwrap(),
        1,
        "the unlocked form wrote after expiry"
    );
}

#[tokio::test]
async fn completed_task_cannot_be_claimed_again() {
    // I1 + I5: a redelivered record for a completed task gets no new attempt.
    let db = TestDb::new().await;
    let task = new_task(&db, 3).await;
    let a = claim_ok(&db.store, task, "worker-a", LONG_LEASE).await;
    assert_eq!(
        db.store.complete(&a, "the reply", None).await.unwrap(),
        CompletionOutcome::Accepted
    );
    assert_eq!(
        db.store.claim(task, "worker-b", LONG_LEASE).await.unwrap(),
        ClaimOutcome::AlreadyCompleted
    );
    // A lost acknowledgement retried: the worker learns its own save went through.
    assert_eq!(
        db.store.complete(&a, "the reply", None).await.unwrap(),
        CompletionOutcome::Refused(Refusal::AlreadySaved {
            by_this_assignment: true
        })
    );
    let stored = db.store.read(task).await.unwrap().unwrap();
    assert_eq!(stored.attempt_count, 1);
    assert_eq!(stored.saved_response.as_deref(), Some("the reply"));
}

#[tokio::test]
async fn failed_task_cannot_be_completed_or_claimed() {
    let db = TestDb::new().await;
    let task = new_task(&db, 3).await;
    let a = claim_ok(&db.store, task, "worker-a", LONG_LEASE).await;
    assert_eq!(
        db.store
            .fail(
                &a,
                "provider said 400: bad request",
                AttemptOutcome::ProviderError,
                replyd_core::domain::ProviderRan::No,
            )
            .await
            .unwrap(),
        FailOutcome::Failed
    );
    assert_eq!(
        db.store.complete(&a, "late answer", None).await.unwrap(),
        CompletionOutcome::Refused(Refusal::Failed)
    );
    assert_eq!(
        db.store.claim(task, "worker-b", LONG_LEASE).await.unwrap(),
        ClaimOutcome::AlreadyFailed
    );
    let stored = db.store.read(task).await.unwrap().unwrap();
    assert_eq!(stored.status, TaskStatus::Failed);
    assert_eq!(
        stored.failure.as_deref(),
        Some("provider said 400: bad request")
    );
    assert_eq!(stored.saved_response, None);
    assert_eq!(
        attempt_outcomes(&db, task).await,
        vec![(a.version, Some("provider_error".to_string()))]
    );
}

#[tokio::test]
async fn renewal_extends_a_live_lease_and_refuses_a_stale_version() {
    let db = TestDb::new().await;
    let task = new_task(&db, 3).await;
    let a = claim_ok(&db.store, task, "worker-a", SHORT_LEASE).await;
    let RenewOutcome::Renewed { until } = db.store.renew(&a, LONG_LEASE).await.unwrap() else {
        panic!("a live lease of the current version renews");
    };
    assert!(until > a.until);

    let stale = Lease {
        version: a.version - 1,
        ..a.clone()
    };
    assert_eq!(
        db.store.renew(&stale, LONG_LEASE).await.unwrap(),
        RenewOutcome::Refused(Refusal::TakenOver {
            current_version: a.version
        })
    );
}

#[tokio::test]
async fn expired_lease_cannot_be_renewed_back_to_life() {
    // I2: once the lease ran out, the only way back is a new claim (version + 1).
    let db = TestDb::new().await;
    let task = new_task(&db, 3).await;
    let a = claim_ok(&db.store, task, "worker-a", SHORT_LEASE).await;
    wait_for_expiry(&db, a.until).await;
    assert_eq!(
        db.store.renew(&a, LONG_LEASE).await.unwrap(),
        RenewOutcome::Refused(Refusal::LeaseExpired)
    );
    assert_eq!(
        db.store.complete(&a, "too late", None).await.unwrap(),
        CompletionOutcome::Refused(Refusal::LeaseExpired)
    );
}

#[tokio::test]
async fn claim_past_the_attempt_budget_fails_the_task_with_a_reason() {
    // I7: the budget lives in the row; expiring leases cannot buy extra attempts.
    let db = TestDb::new().await;
    let task = new_task(&db, 2).await;
    for owner in ["worker-a", "worker-b"] {
        let lease = claim_ok(&db.store, task, owner, SHORT_LEASE).await;
        wait_for_expiry(&db, lease.until).await;
    }
    assert_eq!(
        db.store.claim(task, "worker-c", SHORT_LEASE).await.unwrap(),
        ClaimOutcome::BudgetExhausted { attempts: 2 }
    );
    let stored = db.store.read(task).await.unwrap().unwrap();
    assert_eq!(stored.status, TaskStatus::Failed);
    assert_eq!(stored.attempt_count, 2);
    assert!(
        stored
            .failure
            .as_deref()
            .is_some_and(|f| f.contains("attempt budget exhausted: 2 of 2")),
        "{:?}",
        stored.failure
    );
    // Both attempts ended without an answer and are recorded as such.
    assert_eq!(
        attempt_outcomes(&db, task).await,
        vec![
            (1, Some("abandoned".to_string())),
            (2, Some("abandoned".to_string()))
        ]
    );
}

#[tokio::test]
async fn claim_after_the_deadline_fails_the_task_without_an_attempt() {
    let db = TestDb::new().await;
    let mut spec = task_spec(3);
    spec.deadline = Some(Utc::now() - chrono::Duration::seconds(60));
    db.store.ensure_task(&spec).await.unwrap();
    assert!(matches!(
        db.store
            .claim(spec.task_id, "worker-a", LONG_LEASE)
            .await
            .unwrap(),
        ClaimOutcome::DeadlinePassed { .. }
    ));
    let stored = db.store.read(spec.task_id).await.unwrap().unwrap();
    assert_eq!(stored.status, TaskStatus::Failed);
    assert_eq!(stored.attempt_count, 0);
    assert!(stored.failure.unwrap().starts_with("deadline exceeded"));
}

#[tokio::test]
async fn a_record_that_disagrees_with_the_stored_task_is_reported_not_applied() {
    let db = TestDb::new().await;
    let spec = task_spec(3);
    assert_eq!(
        db.store.ensure_task(&spec).await.unwrap(),
        EnsureOutcome::Created
    );
    assert_eq!(
        db.store.ensure_task(&spec).await.unwrap(),
        EnsureOutcome::Exists
    );

    let mut other = spec.clone();
    other.document_version = "v2".into();
    other.max_attempts = 10;
    assert_eq!(
        db.store.ensure_task(&other).await.unwrap(),
        EnsureOutcome::Conflict {
            fields: vec!["document_version", "max_attempts"]
        }
    );
    let stored = db.store.read(spec.task_id).await.unwrap().unwrap();
    assert_eq!(stored.spec, spec);
}

#[tokio::test]
async fn concurrent_first_deliveries_create_the_task_once() {
    let db = TestDb::new().await;
    let spec = task_spec(3);
    let barrier = Arc::new(Barrier::new(8));
    let mut handles = Vec::new();
    for _ in 0..8 {
        let (store, spec, barrier) = (db.store.clone(), spec.clone(), barrier.clone());
        handles.push(tokio::spawn(async move {
            barrier.wait().await;
            store.ensure_task(&spec).await.unwrap()
        }));
    }
    let mut created = 0;
    for handle in handles {
        match handle.await.unwrap() {
            EnsureOutcome::Created => created += 1,
            EnsureOutcome::Exists => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    assert_eq!(created, 1);
}

#[tokio::test]
async fn worker_sessions_carry_lock_and_idle_timeouts() {
    // A stalled worker must not keep row locks forever, nor hang on one.
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let lock: String = client
        .query_one("SHOW lock_timeout", &[])
        .await
        .unwrap()
        .get(0);
    let idle: String = client
        .query_one("SHOW idle_in_transaction_session_timeout", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(lock, "5s");
    assert_eq!(idle, "10s");
}

#[tokio::test]
async fn workers_starting_together_migrate_one_schema_without_racing() {
    // Every worker migrates at start; a fresh schema must survive eight at once.
    let db = TestDb::new().await;
    let client = db.raw_client().await;
    let fresh = crate::helpers::unique("t");
    client
        .batch_execute(&format!("CREATE SCHEMA {fresh}"))
        .await
        .unwrap();
    let settings = replyd::store::DatabaseSettings {
        url: crate::helpers::schema_url(&fresh),
        ..replyd::store::DatabaseSettings::default()
    };
    let barrier = Arc::new(Barrier::new(8));
    let mut runs = Vec::new();
    for _ in 0..8 {
        let (settings, barrier) = (settings.clone(), barrier.clone());
        runs.push(tokio::spawn(async move {
            barrier.wait().await;
            replyd::store::migrate::run_migrations(&settings).await
        }));
    }
    let mut applied = Vec::new();
    for run in runs {
        applied.extend(run.await.unwrap().expect("migration succeeds"));
    }
    applied.sort();
    let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/migrations"))
        .unwrap()
        .count();
    let mut unique = applied.clone();
    unique.dedup();
    assert_eq!(unique, applied, "no migration applied twice");
    assert_eq!(
        applied.len(),
        files,
        "every migration applied once: {applied:?}"
    );
}

#[tokio::test]
async fn migrators_waiting_longer_than_the_lock_timeout_for_another_all_succeed() {
    // N replicas start while one migrates for longer than `database.lock_timeout_ms` (a slow
    // migration, a Job mid-upgrade): the others wait for it and then find nothing to do; a
    // wait past the lock timeout is not a failure to exit on (a crash loop).
    let db = TestDb::new().await;
    let holder = db.raw_client().await;
    let settings = replyd::store::DatabaseSettings {
        url: crate::helpers::schema_url(&db.schema),
        lock_timeout_ms: 200,
        ..replyd::store::DatabaseSettings::default()
    };
    holder
        .execute(
            "SELECT pg_advisory_lock($1)",
            &[&replyd::store::migrate::MIGRATION_LOCK],
        )
        .await
        .unwrap();
    let mut runs = Vec::new();
    for _ in 0..4 {
        let settings = settings.clone();
        runs.push(tokio::spawn(async move {
            replyd::store::migrate::run_migrations(&settings).await
        }));
    }
    // Five lock timeouts long: every migrator has asked for the lock and waited past it.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    holder
        .execute(
            "SELECT pg_advisory_unlock($1)",
            &[&replyd::store::migrate::MIGRATION_LOCK],
        )
        .await
        .unwrap();
    for run in runs {
        let applied = run.await.unwrap().expect("a migrator that waited succeeds");
        assert_eq!(
            applied,
            Vec::<String>::new(),
            "the schema was already current"
        );
    }
}

#[tokio::test]
async fn with_migrate_on_start_off_a_process_refuses_a_schema_that_lacks_a_migration() {
    // Where a migration Job runs first, the processes only check: a schema behind the build is
    // refused at start, naming what is missing and the command; once migrated, it starts.
    let db = TestDb::new().await;
    let fresh = crate::helpers::unique("t");
    db.raw_client()
        .await
        .batch_execute(&format!("CREATE SCHEMA {fresh}"))
        .await
        .unwrap();
    let settings = replyd::store::DatabaseSettings {
        url: crate::helpers::schema_url(&fresh),
        migrate_on_start: false,
        ..replyd::store::DatabaseSettings::default()
    };
    let stop = tokio_util::sync::CancellationToken::new();
    let refused = replyd::connect_retry::migrate(&settings, &stop)
        .await
        .expect_err("an empty schema is refused");
    let message = format!("{refused:#}");
    assert!(message.contains("V1__reply_tasks"), "{message}");
    assert!(message.contains("replyd migrate"), "{message}");
    // Nothing was created by the check.
    let tables: i64 = db
        .raw_client()
        .await
        .query_one(
            "SELECT count(*) FROM information_schema.tables WHERE table_schema = $1",
            &[&fresh],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(tables, 0);
    replyd::store::migrate::run_migrations(&settings)
        .await
        .unwrap();
    replyd::connect_retry::migrate(&settings, &stop)
        .await
        .expect("a current schema is accepted");
}

// Batched completions (`database.batch_completions`): one call for many rows, each guarded
// and answered on its own, and no batch ever waits on a row lock.

/// The tasks of one batch, each in a different state, and the answer each must get.
struct Mixed {
    leases: Vec<Lease>,
    expected: Vec<CompletionOutcome>,
}

async fn mixed_batch(db: &TestDb) -> Mixed {
    let mut leases = Vec::new();
    let mut expected = Vec::new();
    // Two live leases: accepted.
    for owner in ["worker-live-1", "worker-live-2"] {
        let task = new_task(db, 3).await;
        leases.push(claim_ok(&db.store, task, owner, LONG_LEASE).await);
        expected.push(CompletionOutcome::Accepted);
    }
    // A lease that ran out, nobody took it over: refused, lease expired.
    let task = new_task(db, 3).await;
    let expired = claim_ok(&db.store, task, "worker-expired", SHORT_LEASE).await;
    wait_for_expiry(db, expired.until).await;
    leases.push(expired);
    expected.push(CompletionOutcome::Refused(Refusal::LeaseExpired));
    // A zombie: its lease ran out and another worker took the task.
    let task = new_task(db, 3).await;
    let zombie = claim_ok(&db.store, task, "worker-zombie", SHORT_LEASE).await;
    wait_for_expiry(db, zombie.until).await;
    let current = claim_ok(&db.store, task, "worker-current", LONG_LEASE).await;
    leases.push(zombie);
    expected.push(CompletionOutcome::Refused(Refusal::TakenOver {
        current_version: current.version,
    }));
    // This assignment's own earlier write (its acknowledgement lost): already saved by it.
    let task = new_task(db, 3).await;
    let repeated = claim_ok(&db.store, task, "worker-repeat", LONG_LEASE).await;
    assert_eq!(
        db.store.complete(&repeated, "first", None).await.unwrap(),
        CompletionOutcome::Accepted
    );
    leases.push(repeated);
    expected.push(CompletionOutcome::Refused(Refusal::AlreadySaved {
        by_this_assignment: true,
    }));
    // No such task.
    let mut missing = leases[0].clone();
    missing.task_id = uuid::Uuid::new_v4();
    leases.push(missing);
    expected.push(CompletionOutcome::Refused(Refusal::NotFound));
    Mixed { leases, expected }
}

#[tokio::test]
async fn batched_completions_answer_each_row_on_its_own() {
    // I1, I2 through the batch: neighbours in every state, sent at once; each gets exactly the
    // answer a lone completion would, and the attempt rows say the same.
    let db = TestDb::new().await;
    let batching = db.store.clone().batching_completions(64);
    let mixed = mixed_batch(&db).await;
    let barrier = Arc::new(Barrier::new(mixed.leases.len()));
    let mut sends = Vec::new();
    for lease in &mixed.leases {
        let (store, lease, barrier) = (batching.clone(), lease.clone(), barrier.clone());
        sends.push(tokio::spawn(async move {
            barrier.wait().await;
            store.complete(&lease, "batched", None).await.unwrap()
        }));
    }
    for ((send, expected), lease) in sends.into_iter().zip(&mixed.expected).zip(&mixed.leases) {
        assert_eq!(&send.await.unwrap(), expected, "task {}", lease.task_id);
    }
    for (lease, expected) in mixed.leases.iter().zip(&mixed.expected) {
        let Some(stored) = db.store.read(TaskId::from(lease.task_id)).await.unwrap() else {
            continue;
        };
        let outcomes = attempt_outcomes(&db, TaskId::from(lease.task_id)).await;
        let mine = outcomes
            .iter()
            .find(|(version, _)| *version == lease.version)
            .and_then(|(_, outcome)| outcome.clone());
        match expected {
            CompletionOutcome::Accepted => {
                assert_eq!(stored.saved_response.as_deref(), Some("batched"));
                assert_eq!(mine.as_deref(), Some("accepted"));
            }
            CompletionOutcome::Refused(Refusal::AlreadySaved { .. }) => {
                // The first write stands, reply and attempt outcome alike.
                assert_eq!(stored.saved_response.as_deref(), Some("first"));
                assert_eq!(mine.as_deref(), Some("accepted"));
            }
            CompletionOutcome::Refused(_) => {
                assert_eq!(stored.saved_response, None, "task {}", lease.task_id);
                assert_eq!(mine.as_deref(), Some("fenced"), "task {}", lease.task_id);
            }
        }
    }
}

#[tokio::test]
async fn one_batch_call_guards_each_row_and_answers_a_locked_row_busy_without_waiting() {
    // The batch statement itself, all rows in one call: a row locked by another transaction
    // comes back `busy` at once (the call returns while the lock is still held), and the rows
    // beside it get their own answers.
    let db = TestDb::new().await;
    let mixed = mixed_batch(&db).await;
    let locked_task = new_task(&db, 3).await;
    let locked = claim_ok(&db.store, locked_task, "worker-locked", LONG_LEASE).await;
    let (_blocker_pid, release, blocker) = hold_row_lock(&db, locked_task).await;

    let mut leases = mixed.leases.clone();
    leases.push(locked.clone());
    let tasks: Vec<uuid::Uuid> = leases.iter().map(|l| l.task_id).collect();
    let versions: Vec<i64> = leases.iter().map(|l| l.version).collect();
    let responses: Vec<&str> = leases.iter().map(|_| "one call").collect();
    let metas: Vec<Option<serde_json::Value>> = leases.iter().map(|_| None).collect();
    let rows = db
        .raw_client()
        .await
        .query(
            "SELECT task_id, accepted, busy, status FROM replyd_complete_many($1, $2, $3, $4)",
            &[&tasks, &versions, &responses, &metas],
        )
        .await
        .unwrap();
    release.send(()).unwrap();
    blocker.await.unwrap();

    assert_eq!(rows.len(), leases.len(), "one answer per row asked about");
    for row in &rows {
        let task: uuid::Uuid = row.get("task_id");
        let accepted: bool = row.get("accepted");
        let busy: bool = row.get("busy");
        let status: Option<String> = row.get("status");
        if task == locked_task.as_uuid() {
            assert!(busy && !accepted, "the locked row is busy, not written");
            continue;
        }
        let i = leases.iter().position(|l| l.task_id == task).unwrap();
        assert!(!busy, "task {task} was free");
        assert_eq!(
            accepted,
            mixed.expected[i] == CompletionOutcome::Accepted,
            "task {task}"
        );
        assert_eq!(
            status.is_none(),
            mixed.expected[i] == CompletionOutcome::Refused(Refusal::NotFound)
        );
    }
    // The locked row was not written; its lone completion goes through now the lock is gone.
    assert_eq!(
        db.store
            .read(locked_task)
            .await
            .unwrap()
            .unwrap()
            .saved_response,
        None
    );
    assert_eq!(
        db.store.complete(&locked, "alone", None).await.unwrap(),
        CompletionOutcome::Accepted
    );
}

#[tokio::test]
async fn a_batched_completion_of_a_locked_row_goes_alone_and_is_refused_if_the_lease_expires_during_the_wait()
 {
    // I2, the lock-wait case through the batch: the locked row comes back busy, its completion
    // is sent alone and waits on the lock while the lease is live, the lease runs out during
    // the wait, and the write is refused. A neighbour completed meanwhile is not held up.
    let db = TestDb::new().await;
    let batching = db.store.clone().batching_completions(64);
    let task = new_task(&db, 3).await;
    let a = claim_ok(&db.store, task, "worker-a", Duration::from_secs(3)).await;
    let neighbour_task = new_task(&db, 3).await;
    let neighbour = claim_ok(&db.store, neighbour_task, "worker-n", LONG_LEASE).await;
    let (blocker_pid, release, blocker) = hold_row_lock(&db, task).await;

    let (store, lease) = (batching.clone(), a.clone());
    let completion =
        tokio::spawn(async move { store.complete(&lease, "answer from A", None).await });
    wait_until_blocked_by(&db, blocker_pid).await;
    assert!(
        lease_is_live(&db, &a).await,
        "setup: the completion must start waiting while the lease is live, or the test proves nothing"
    );
    assert_eq!(
        batching
            .complete(&neighbour, "neighbour", None)
            .await
            .unwrap(),
        CompletionOutcome::Accepted,
        "a row waiting on a lock holds up no other completion"
    );
    assert!(!completion.is_finished(), "A still waits on the lock");
    wait_for_expiry(&db, a.until).await;
    release.send(()).unwrap();
    blocker.await.unwrap();

    assert_eq!(
        completion.await.unwrap().unwrap(),
        CompletionOutcome::Refused(Refusal::LeaseExpired)
    );
    let stored = db.store.read(task).await.unwrap().unwrap();
    assert_eq!(stored.saved_response, None);
    assert_eq!(
        attempt_outcomes(&db, task).await,
        vec![(a.version, Some("fenced".to_owned()))]
    );
}

/// The lease's end as the database has it now (renewals move it; the `Lease` keeps the claim's).
async fn stored_lease_until(db: &TestDb, task: TaskId) -> DateTime<Utc> {
    db.raw_client()
        .await
        .query_one(
            "SELECT lease_until FROM reply_tasks WHERE task_id = $1",
            &[&task.as_uuid()],
        )
        .await
        .unwrap()
        .get(0)
}

async fn stored_lease_is_live(db: &TestDb, task: TaskId) -> bool {
    db.raw_client()
        .await
        .query_one(
            "SELECT lease_until > clock_timestamp() FROM reply_tasks WHERE task_id = $1",
            &[&task.as_uuid()],
        )
        .await
        .unwrap()
        .get(0)
}

/// Whether a hold has been told its lease is gone, without waiting.
fn told_lost(hold: &mut replyd::store::LeaseHold) -> Option<Refusal> {
    futures_util::FutureExt::now_or_never(hold.lost())
}

const RENEW_EVERY: Duration = Duration::from_millis(100);
/// Bounds a wait that must end; how long it took is not what the test judges.
const MUST_END: Duration = Duration::from_secs(20);

#[tokio::test]
async fn batched_renewals_keep_each_lease_and_end_only_the_call_whose_lease_is_gone() {
    // I2 through the batch: three leases renewed together outlive their claim, a row taken
    // over meanwhile is refused on its own (its call is told why), the neighbours are not, and
    // a dropped hold is renewed no more.
    let db = TestDb::new().await;
    let renewing = db
        .store
        .clone()
        .batching_renewals(RENEW_EVERY, Duration::from_secs(1), None);
    let mut leases = Vec::new();
    for _ in 0..3 {
        let task = new_task(&db, 3).await;
        leases.push(claim_ok(&db.store, task, "worker-a", Duration::from_secs(1)).await);
    }
    let mut holds: Vec<_> = leases
        .iter()
        .map(|l| renewing.hold(l, RENEW_EVERY, Duration::from_secs(1)))
        .collect();

    // The state a takeover leaves: the next version, held by another worker.
    let taken = TaskId::from(leases[2].task_id);
    db.raw_client()
        .await
        .execute(
            "UPDATE reply_tasks SET assignment_version = assignment_version + 1, \
             lease_owner = 'worker-b' WHERE task_id = $1",
            &[&taken.as_uuid()],
        )
        .await
        .unwrap();
    let refusal = tokio::time::timeout(MUST_END, holds[2].lost())
        .await
        .expect("the taken-over lease's call is told");
    assert_eq!(
        refusal,
        Refusal::TakenOver {
            current_version: leases[2].version + 1
        }
    );

    for lease in &leases[..2] {
        wait_for_expiry(&db, lease.until).await;
    }
    for (i, lease) in leases[..2].iter().enumerate() {
        let task = TaskId::from(lease.task_id);
        assert!(
            stored_lease_is_live(&db, task).await,
            "lease {i} outlived its claim: the batch renewed it"
        );
        assert_eq!(told_lost(&mut holds[i]), None, "lease {i} was not refused");
    }

    let first = TaskId::from(leases[0].task_id);
    drop(holds.remove(0));
    // A renewal already sent may still land; after that, none.
    tokio::time::sleep(RENEW_EVERY * 3).await;
    wait_for_expiry(&db, stored_lease_until(&db, first).await).await;
    tokio::time::sleep(RENEW_EVERY * 3).await;
    assert!(
        !stored_lease_is_live(&db, first).await,
        "a dropped hold is renewed no more"
    );
    let second = TaskId::from(leases[1].task_id);
    assert!(
        stored_lease_is_live(&db, second).await,
        "its neighbour still is"
    );
}

#[tokio::test]
async fn a_lease_check_between_renewals_ends_only_the_call_whose_task_was_stopped() {
    // The Stop heard without listening: renewals an hour apart, leases of an hour, checks every
    // 50 ms. Only a check can tell the call of the stopped task that its lease is gone; the
    // neighbour's call hears nothing, and the check writes nothing (its lease is unchanged).
    let db = TestDb::new().await;
    let hour = Duration::from_secs(3_600);
    let renewing = db
        .store
        .clone()
        .batching_renewals(hour, hour, Some(Duration::from_millis(50)));
    let stopped = new_task(&db, 3).await;
    let neighbour = new_task(&db, 3).await;
    let a = claim_ok(&db.store, stopped, "worker-a", hour).await;
    let n = claim_ok(&db.store, neighbour, "worker-a", hour).await;
    let mut hold_a = renewing.hold(&a, hour, hour);
    let mut hold_n = renewing.hold(&n, hour, hour);
    assert!(
        hold_a.checked(),
        "a batched hold with checks does not need to listen"
    );
    let neighbour_until = stored_lease_until(&db, neighbour).await;

    assert_eq!(
        db.store.cancel(stopped).await.unwrap(),
        replyd::store::cancels::CancelOutcome::Cancelled
    );
    let refusal = tokio::time::timeout(MUST_END, hold_a.lost())
        .await
        .expect("the stopped task's call is told by a check");
    assert_eq!(refusal, Refusal::Cancelled);
    // Several checks later, the neighbour is still untouched.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(told_lost(&mut hold_n), None, "the neighbour's lease holds");
    assert_eq!(
        stored_lease_until(&db, neighbour).await,
        neighbour_until,
        "a check reads; it renews nothing"
    );

    let without = db.store.clone().batching_renewals(hour, hour, None);
    let hold = without.hold(&n, hour, hour);
    assert!(!hold.checked(), "without checks a call listens");
}

#[tokio::test]
async fn a_renewal_batch_skips_a_locked_row_and_its_lone_renewal_is_refused_if_the_lease_runs_out_during_the_wait()
 {
    // I2, the lock-wait case through the renewer: the batch does not wait on A's locked row, so
    // the neighbour keeps being renewed; A's renewal goes alone and waits on the lock; A's
    // lease runs out during the wait; after the lock, the renewal is refused, not granted.
    let db = TestDb::new().await;
    let renewing = db
        .store
        .clone()
        .batching_renewals(RENEW_EVERY, Duration::from_secs(1), None);
    let task = new_task(&db, 3).await;
    let a = claim_ok(&db.store, task, "worker-a", Duration::from_secs(1)).await;
    let neighbour_task = new_task(&db, 3).await;
    let neighbour = claim_ok(
        &db.store,
        neighbour_task,
        "worker-a",
        Duration::from_secs(1),
    )
    .await;
    let (blocker_pid, release, blocker) = hold_row_lock(&db, task).await;
    let mut hold_a = renewing.hold(&a, RENEW_EVERY, Duration::from_secs(1));
    let mut hold_n = renewing.hold(&neighbour, RENEW_EVERY, Duration::from_secs(1));

    wait_until_blocked_by(&db, blocker_pid).await;
    assert!(
        stored_lease_is_live(&db, task).await,
        "setup: A's renewal must start waiting while its lease is live, or the test proves nothing"
    );
    let a_until = stored_lease_until(&db, task).await;
    wait_for_expiry(&db, neighbour.until).await;
    wait_for_expiry(&db, a_until).await;
    assert!(
        stored_lease_is_live(&db, neighbour_task).await,
        "a row waiting on a lock holds up no other renewal"
    );
    assert_eq!(told_lost(&mut hold_a), None, "A's renewal still waits");
    release.send(()).unwrap();
    blocker.await.unwrap();

    let refusal = tokio::time::timeout(MUST_END, hold_a.lost())
        .await
        .expect("A's call is told once the lock is free");
    assert_eq!(refusal, Refusal::LeaseExpired);
    assert!(
        !stored_lease_is_live(&db, task).await,
        "the expired lease was not renewed back to life"
    );
    assert_eq!(told_lost(&mut hold_n), None);
    assert!(stored_lease_is_live(&db, neighbour_task).await);
}

/// `replyd_claim_many` called directly, for tasks that exist (no records to insert); the
/// answer of each as (task, busy, claim label).
async fn claim_many_raw(
    client: &tokio_postgres::Client,
    tasks: &[uuid::Uuid],
    owner: &str,
) -> Result<Vec<(uuid::Uuid, bool, Option<String>)>, tokio_postgres::Error> {
    let none_text: Vec<Option<String>> = vec![None; tasks.len()];
    let none_json: Vec<Option<serde_json::Value>> = vec![None; tasks.len()];
    let none_int: Vec<Option<i32>> = vec![None; tasks.len()];
    let none_time: Vec<Option<DateTime<Utc>>> = vec![None; tasks.len()];
    let rows = client
        .query(
            "SELECT input_task, busy, claim FROM replyd_claim_many($1, $2, 30, $3, $3, $3, $3, $4, $5, $6)",
            &[&tasks, &owner, &none_text, &none_json, &none_int, &none_time],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect())
}

#[tokio::test]
async fn batched_claims_answer_each_row_as_a_lone_claim_would() {
    // I1, I5, I7 through the batch: seven claims sent at once, each in a different state, each
    // gets the answer (and leaves the row) a lone claim would.
    let db = TestDb::new().await;
    let batching = db.store.clone().batching_claims(64);

    let fresh = task_spec(3);
    let pending = new_task(&db, 3).await;
    let completed = new_task(&db, 3).await;
    let lease = claim_ok(&db.store, completed, "worker-a", LONG_LEASE).await;
    assert_eq!(
        db.store.complete(&lease, "done", None).await.unwrap(),
        CompletionOutcome::Accepted
    );
    let leased = new_task(&db, 3).await;
    let other = claim_ok(&db.store, leased, "worker-a", LONG_LEASE).await;
    let spent = new_task(&db, 1).await;
    let last = claim_ok(&db.store, spent, "worker-a", SHORT_LEASE).await;
    wait_for_expiry(&db, last.until).await;
    let stored = task_spec(3);
    assert_eq!(
        db.store.ensure_task(&stored).await.unwrap(),
        EnsureOutcome::Created
    );
    let disagreeing = replyd_core::domain::TaskSpec {
        message_id: "another message".into(),
        ..stored.clone()
    };
    let unknown = TaskId::new_random();

    let owner = "worker-b";
    let (fresh_t, pending_t, completed_t, leased_t, spent_t, conflict_t, unknown_t) = tokio::join!(
        batching.claim_task(fresh.task_id, owner, LONG_LEASE, Some(&fresh), None),
        batching.claim_task(pending, owner, LONG_LEASE, None, None),
        batching.claim_task(completed, owner, LONG_LEASE, None, None),
        batching.claim_task(leased, owner, LONG_LEASE, None, None),
        batching.claim_task(spent, owner, LONG_LEASE, None, None),
        batching.claim_task(
            disagreeing.task_id,
            owner,
            LONG_LEASE,
            Some(&disagreeing),
            None
        ),
        batching.claim_task(unknown, owner, LONG_LEASE, None, None),
    );

    let fresh_t = fresh_t.unwrap();
    assert_eq!(fresh_t.ensured, Some(EnsureOutcome::Created));
    assert!(
        matches!(fresh_t.claim, ClaimOutcome::Claimed(ref l) if l.version == 1 && l.owner == owner)
    );
    assert!(matches!(pending_t.unwrap().claim, ClaimOutcome::Claimed(ref l) if l.version == 1));
    assert_eq!(completed_t.unwrap().claim, ClaimOutcome::AlreadyCompleted);
    assert!(matches!(
        leased_t.unwrap().claim,
        ClaimOutcome::LeasedByOther { ref owner, version, .. } if owner == "worker-a" && version == other.version
    ));
    assert!(matches!(
        spent_t.unwrap().claim,
        ClaimOutcome::BudgetExhausted { attempts: 1 }
    ));
    assert_eq!(
        db.store.read(spent).await.unwrap().unwrap().status,
        TaskStatus::Failed
    );
    let conflict_t = conflict_t.unwrap();
    assert!(
        matches!(conflict_t.ensured, Some(EnsureOutcome::Conflict { ref fields }) if fields == &vec!["message_id"])
    );
    assert_eq!(
        conflict_t.task.unwrap().spec.message_id,
        stored.message_id,
        "the stored inputs are kept"
    );
    let unknown_t = unknown_t.unwrap();
    assert_eq!(unknown_t.claim, ClaimOutcome::NotFound);
    assert!(unknown_t.task.is_none());
    // The leased task is untouched: its owner's lease and version stand.
    let still = db.store.read(leased).await.unwrap().unwrap();
    assert_eq!(still.assignment_version, other.version);
    assert_eq!(still.lease_owner.as_deref(), Some("worker-a"));
}

#[tokio::test]
async fn a_claim_batch_answers_a_locked_row_busy_without_waiting_and_its_lone_claim_waits() {
    // The lock-then-check order through the batch: one call with a locked row answers it busy
    // while the lock is held and claims its neighbour; through the store, the busy claim goes
    // alone, waits on the lock, and decides after it.
    let db = TestDb::new().await;
    let locked = new_task(&db, 3).await;
    let neighbour = new_task(&db, 3).await;
    let (blocker_pid, release, blocker) = hold_row_lock(&db, locked).await;

    let client = db.raw_client().await;
    let answers = claim_many_raw(
        &client,
        &[locked.as_uuid(), neighbour.as_uuid()],
        "worker-raw",
    )
    .await
    .unwrap();
    let by_task: std::collections::HashMap<_, _> =
        answers.into_iter().map(|(t, b, c)| (t, (b, c))).collect();
    assert_eq!(
        by_task[&locked.as_uuid()],
        (true, None),
        "busy, not waited for"
    );
    assert_eq!(
        by_task[&neighbour.as_uuid()],
        (false, Some("claimed".to_owned()))
    );

    let batching = db.store.clone().batching_claims(64);
    let (store, task) = (batching.clone(), locked);
    let lone = tokio::spawn(async move {
        store
            .claim_task(task, "worker-b", LONG_LEASE, None, None)
            .await
            .unwrap()
    });
    wait_until_blocked_by(&db, blocker_pid).await;
    let other = new_task(&db, 3).await;
    assert!(
        matches!(
            batching
                .claim_task(other, "worker-b", LONG_LEASE, None, None)
                .await
                .unwrap()
                .claim,
            ClaimOutcome::Claimed(_)
        ),
        "a claim waiting on a lock holds up no other claim"
    );
    assert!(!lone.is_finished(), "the locked row's claim still waits");
    release.send(()).unwrap();
    blocker.await.unwrap();
    assert!(matches!(
        lone.await.unwrap().claim,
        ClaimOutcome::Claimed(ref l) if l.version == 1
    ));
}

#[tokio::test]
async fn claim_batches_inserting_the_same_new_tasks_in_opposite_orders_neither_deadlock_nor_claim_twice()
 {
    // Two workers' batches race for the same eight new records, one in order and one
    // reversed, ten times: every call answers (no deadlock error), each task is inserted once
    // and claimed by exactly one of them.
    let db = TestDb::new().await;
    let a = db.store.clone().batching_claims(64);
    let b = db.store.clone().batching_claims(64);
    for round in 0..10 {
        let specs: Vec<_> = (0..8).map(|_| task_spec(3)).collect();
        let forward = async {
            futures_util::future::join_all(
                specs
                    .iter()
                    .map(|s| a.claim_task(s.task_id, "worker-a", LONG_LEASE, Some(s), None)),
            )
            .await
        };
        let backward = async {
            futures_util::future::join_all(
                specs
                    .iter()
                    .rev()
                    .map(|s| b.claim_task(s.task_id, "worker-b", LONG_LEASE, Some(s), None)),
            )
            .await
        };
        let (forward, mut backward) = tokio::join!(forward, backward);
        backward.reverse();
        for (i, (fa, fb)) in forward.into_iter().zip(backward).enumerate() {
            let (fa, fb) = (fa.unwrap(), fb.unwrap());
            let claimed = [&fa, &fb]
                .iter()
                .filter(|t| matches!(t.claim, ClaimOutcome::Claimed(_)))
                .count();
            assert_eq!(
                claimed, 1,
                "round {round}, task {i}: exactly one claim wins"
            );
            let created = [&fa, &fb]
                .iter()
                .filter(|t| t.ensured == Some(EnsureOutcome::Created))
                .count();
            assert_eq!(created, 1, "round {round}, task {i}: inserted once");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_round_of_live_pieces_writes_only_running_attempts_and_announces_them_packed() {
    let db = TestDb::new().await;
    let (mut payloads, _listening) = crate::helpers::hear(&db.settings, LIVE_PIECES_CHANNEL).await;

    let (a, b, done) = (
        new_task(&db, 3).await,
        new_task(&db, 3).await,
        new_task(&db, 3).await,
    );
    let lease_a = claim_ok(&db.store, a, "w1", LONG_LEASE).await;
    let lease_b = claim_ok(&db.store, b, "w1", LONG_LEASE).await;
    let lease_done = claim_ok(&db.store, done, "w1", LONG_LEASE).await;
    assert_eq!(
        db.store.complete(&lease_done, "saved", None).await.unwrap(),
        CompletionOutcome::Accepted
    );
    // Pieces big enough that one round needs more than one notification.
    let big = "é".repeat(3_000);
    let piece = |task: TaskId, version: i64, seq: i32, text: &'static str| PieceToWrite {
        task_id: task,
        assignment_version: version,
        seq,
        text,
    };
    let big: &'static str = Box::leak(big.into_boxed_str());
    let round = [
        piece(a, lease_a.version, 1, big),
        // Not the running attempt: a zombie's version, and a task already completed.
        piece(b, lease_b.version - 1, 1, "zombie"),
        piece(done, lease_done.version, 1, "late"),
        piece(b, lease_b.version, 1, "line one\nline two"),
        piece(a, lease_a.version, 2, big),
    ];
    assert_eq!(
        db.store.append_live_pieces(&round).await.unwrap(),
        [true, false, false, true, true]
    );
    // Sent again (its answer lost): the same answer, nothing written or announced twice.
    assert_eq!(
        db.store.append_live_pieces(&round).await.unwrap(),
        [true, false, false, true, true]
    );
    // A last round marks the end: notifications come in commit order, so anything the
    // round sent again had announced would come before it.
    assert_eq!(
        db.store
            .append_live_pieces(&[piece(a, lease_a.version, 3, "end")])
            .await
            .unwrap(),
        [true]
    );
    let mut announced = Vec::new();
    while announced
        .last()
        .is_none_or(|p: &replyd::store::live::LivePiece| p.text != "end")
    {
        let payload = tokio::time::timeout(Duration::from_secs(30), payloads.recv())
            .await
            .expect("announced")
            .unwrap();
        assert!(payload.len() < 8_000);
        announced.extend(parse_live_pieces(&payload));
    }
    let got: Vec<(TaskId, i32, &str)> = announced
        .iter()
        .map(|p| (p.task_id, p.seq, p.text.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            (a, 1, big),
            (b, 1, "line one\nline two"),
            (a, 2, big),
            (a, 3, "end")
        ]
    );
    let stored = db
        .store
        .live_text_after(a, lease_a.version, 0)
        .await
        .unwrap();
    assert_eq!(stored.len(), 3);
}

#[tokio::test]
async fn an_index_built_after_the_migrations_is_built_concurrently_and_a_failed_build_again() {
    // An index on a table that holds rows is built CONCURRENTLY after refinery's run, outside
    // any transaction and with no statement timeout: a build that takes longer than the
    // session's timeout finishes. One that failed (a duplicate under a unique index) left an
    // invalid index; the next migrate drops it and builds it again, and later ones find it
    // there. An index whose migration is not applied is not built.
    use replyd::store::migrate::{ConcurrentIndex, build_concurrent_indexes};
    let db = TestDb::with(|s| s.statement_timeout_ms = 300).await;
    let client = db.raw_client().await;
    // Each row takes 50 ms to index: a build of 20 rows scans for a second, twice.
    client
        .batch_execute(
            "SET statement_timeout = 0;
             CREATE FUNCTION slow_key(k integer) RETURNS integer IMMUTABLE LANGUAGE sql
                 AS 'SELECT k FROM pg_sleep(0.05)';
             CREATE TABLE indexed (k integer NOT NULL);
             INSERT INTO indexed SELECT g % 19 FROM generate_series(1, 20) g;
             RESET statement_timeout;",
        )
        .await
        .unwrap();
    let plain = client
        .batch_execute("CREATE INDEX indexed_plain ON indexed (slow_key(k))")
        .await
        .expect_err("a build longer than the statement timeout fails in the session");
    assert!(
        format!("{plain:?}").contains("statement timeout"),
        "{plain:?}"
    );
    const INDEXES: &[ConcurrentIndex] = &[
        ConcurrentIndex {
            after: 1,
            name: "indexed_by_slow_key",
            unique: true,
            on: "ON indexed (slow_key(k))",
        },
        ConcurrentIndex {
            after: 100_000,
            name: "indexed_not_yet",
            unique: false,
            on: "ON indexed (k)",
        },
    ];
    let valid = async |name: &str| -> Option<bool> {
        client
            .query_one(
                "SELECT (SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass($1))",
                &[&name],
            )
            .await
            .unwrap()
            .get(0)
    };

    let failed = build_concurrent_indexes(&db.settings, INDEXES)
        .await
        .expect_err("a duplicate fails the unique build");
    assert!(format!("{failed:?}").contains("duplicate"), "{failed:?}");
    assert_eq!(
        valid("indexed_by_slow_key").await,
        Some(false),
        "left invalid"
    );
    // While it is invalid, writers go on.
    client
        .execute("INSERT INTO indexed VALUES (100)", &[])
        .await
        .unwrap();

    client
        .execute("DELETE FROM indexed WHERE k = 1", &[])
        .await
        .unwrap();
    let started = std::time::Instant::now();
    let built = build_concurrent_indexes(&db.settings, INDEXES)
        .await
        .expect("the build after the failed one");
    assert!(
        started.elapsed() > Duration::from_millis(300),
        "longer than the timeout"
    );
    assert_eq!(built, ["indexed_by_slow_key"]);
    assert_eq!(valid("indexed_by_slow_key").await, Some(true));
    assert_eq!(
        valid("indexed_not_yet").await,
        None,
        "its migration is not applied"
    );

    let again = build_concurrent_indexes(&db.settings, INDEXES)
        .await
        .expect("a later migrate");
    assert_eq!(again, Vec::<&str>::new(), "nothing to build");
}
