//! Batched claims (`replyd_claim_many`): each row answered as a lone claim would be, a locked
//! row answered busy without waiting, and batches inserting the same tasks in opposite orders
//! neither deadlock nor claim twice.

use super::{
    LONG_LEASE, SHORT_LEASE, claim_ok, hold_row_lock, new_task, wait_for_expiry,
    wait_until_blocked_by,
};
use crate::helpers::{TestDb, task_spec};
use chrono::{DateTime, Utc};
use replyd::store::{CompletionOutcome, EnsureOutcome};
use replyd_core::domain::{TaskId, TaskStatus};
use replyd_core::lease::ClaimOutcome;

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
