//! A lease fences its holder: a zombie's completion is refused after a takeover, a renewal
//! extends only a live lease of the current version, a completion that waited on a row lock is
//! refused when the lease expired meanwhile (a guarded update that does not lock first would
//! accept it), and worker sessions never hold or wait on a lock without end.

use std::time::Duration;

use super::{
    LONG_LEASE, SHORT_LEASE, attempt_outcomes, claim_ok, hold_row_lock, lease_is_live, new_task,
    wait_for_expiry, wait_until_blocked_by,
};
use crate::helpers::TestDb;
use replyd::store::{CompletionOutcome, RenewOutcome};
use replyd_core::domain::TaskStatus;
use replyd_core::lease::{Lease, Refusal};

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
