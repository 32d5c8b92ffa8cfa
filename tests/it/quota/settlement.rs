//! Settlement: the transaction that ends a task settles its reservation exactly once, charged
//! on completion and on failure only when the policy says so.

use std::time::Duration;

use super::{policy, start};
use replyd::api::reply_view::Accepted;
use replyd_core::lease::ClaimOutcome;
use replyd_core::quota::QuotaPolicy;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completion_charges_once_and_a_failure_is_charged_only_when_the_policy_says_so() {
    for charge_failed in [false, true] {
        let api = start(QuotaPolicy {
            charge_failed,
            ..policy()
        })
        .await;
        let done: Accepted = api.press("done", "q1").await.json().await.unwrap();
        let failed: Accepted = api.press("failed", "q2").await.json().await.unwrap();
        assert_eq!(api.ledger().await, (2, 2, 0, 0, 0, 2));

        api.finish(done.task_id, true).await;
        api.finish(failed.task_id, false).await;
        let (charged, released) = if charge_failed { (2, 0) } else { (1, 1) };
        assert_eq!(
            api.ledger().await,
            (2, 0, charged, released, charged, 0),
            "charge_failed = {charge_failed}"
        );

        // A late write of either task is refused by the fence and settles nothing again.
        let client = api.db.raw_client().await;
        let settled: Vec<(String, String)> = client
            .query(
                "SELECT settled_by, settle_reason FROM quota_reservations ORDER BY settle_reason",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(settled[0], ("w-test".into(), "task completed".into()));
        assert_eq!(
            settled[1],
            ("w-test".into(), "task failed: the provider refused".into())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_settled_reservation_is_never_settled_again() {
    let api = start(policy()).await;
    let accepted: Accepted = api.press("p", "q").await.json().await.unwrap();
    let store = &api.db.store;
    let ClaimOutcome::Claimed(zombie) = store
        .claim(accepted.task_id, "w-zombie", Duration::from_millis(1))
        .await
        .unwrap()
    else {
        panic!("claimable");
    };
    let client = api.db.raw_client().await;
    crate::helpers::wait_until_sql(
        &client,
        "the zombie's lease has run out",
        "SELECT lease_until < clock_timestamp() FROM reply_tasks WHERE task_id = $1",
        &[&accepted.task_id.as_uuid()],
    )
    .await;
    // The zombie's lease ran out; another worker takes the task over and completes it.
    api.finish(accepted.task_id, true).await;
    assert_eq!(api.ledger().await, (1, 0, 1, 0, 1, 0));
    // The zombie comes back: its completion and its failure are refused by the fence, and
    // nothing is settled (or charged) again.
    let late = store
        .complete(&zombie, "a late answer", None)
        .await
        .unwrap();
    assert!(
        matches!(late, replyd::store::CompletionOutcome::Refused(_)),
        "{late:?}"
    );
    let late_failure = store
        .fail(
            &zombie,
            "late",
            replyd_core::domain::AttemptOutcome::ProviderError,
            replyd_core::domain::ProviderRan::No,
        )
        .await
        .unwrap();
    assert!(
        matches!(late_failure, replyd::store::FailOutcome::Refused(_)),
        "{late_failure:?}"
    );
    assert_eq!(api.ledger().await, (1, 0, 1, 0, 1, 0));
}
