//! Batched completions (`database.batch_completions`): one call for many rows, each guarded
//! and answered on its own, and no batch ever waits on a row lock.

use std::sync::Arc;
use std::time::Duration;

use super::{
    LONG_LEASE, SHORT_LEASE, attempt_outcomes, claim_ok, hold_row_lock, lease_is_live, new_task,
    wait_for_expiry, wait_until_blocked_by,
};
use crate::helpers::TestDb;
use replyd::store::CompletionOutcome;
use replyd_core::domain::TaskId;
use replyd_core::lease::{Lease, Refusal};
use tokio::sync::Barrier;

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
