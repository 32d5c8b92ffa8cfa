//! Batched renewals: each lease is kept and only the call whose lease is gone (or whose task
//! was stopped) is ended; a locked row is skipped and renewed alone.

use std::time::Duration;

use super::{claim_ok, hold_row_lock, new_task, wait_for_expiry, wait_until_blocked_by};
use crate::helpers::TestDb;
use chrono::{DateTime, Utc};
use replyd_core::domain::TaskId;
use replyd_core::lease::Refusal;

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
