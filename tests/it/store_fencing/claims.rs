//! Claims: concurrent claimers get one lease a round, a finished task is never claimed again,
//! the attempt budget and the deadline fail a task, a disagreeing record is reported, and
//! concurrent first deliveries create the task once.

use std::sync::Arc;
use std::time::Duration;

use super::{LONG_LEASE, SHORT_LEASE, attempt_outcomes, claim_ok, new_task, wait_for_expiry};
use crate::helpers::{TestDb, task_spec};
use chrono::Utc;
use replyd::store::{CompletionOutcome, EnsureOutcome, FailOutcome};
use replyd_core::domain::{AttemptOutcome, TaskId, TaskStatus};
use replyd_core::lease::{ClaimOutcome, Lease, Refusal};
use tokio::sync::Barrier;

/// Runs 16 claims of one task at once, each on its own connection, released together.
/// The lease each racer asks for: long enough that every claim of a round lands inside the
/// winner's lease even on a loaded machine (16 claims queue for the pool), so a second winner
/// can only be a broken fence, not a lease that ran out mid-race.
const RACE_LEASE: Duration = Duration::from_secs(3);

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
            let outcome = store.claim(task, &owner, RACE_LEASE).await.unwrap();
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
