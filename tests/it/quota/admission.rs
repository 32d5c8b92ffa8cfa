//! Admission: concurrent first requests never oversubscribe the limit, one key makes one
//! reservation however often it is sent, and a replay is answered whatever the quota says now.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::{policy, start};
use replyd::api::reply_view::Accepted;
use reqwest::StatusCode;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_first_requests_against_a_limit_of_fifty_admit_exactly_fifty() {
    let api = Arc::new(start(policy()).await);
    api.daily_quota(50).await;
    // Sample used + reserved while the burst runs: it must never pass the limit.
    let running = Arc::new(AtomicBool::new(true));
    let sampler = {
        let client = api.db.raw_client().await;
        let running = Arc::clone(&running);
        tokio::spawn(async move {
            let mut samples = Vec::new();
            while running.load(Ordering::Relaxed) {
                let row = client
                    .query_one(
                        "SELECT used + reserved FROM quota_counters WHERE workspace_id = 'acme'",
                        &[],
                    )
                    .await
                    .unwrap();
                samples.push(row.get::<_, i64>(0));
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            samples
        })
    };
    let sends = (0..200).map(|n| {
        let api = Arc::clone(&api);
        async move { api.press(&format!("burst-{n}"), &format!("q{n}")).await }
    });
    let answers = futures_util::future::join_all(sends).await;
    running.store(false, Ordering::Relaxed);
    let samples = sampler.await.unwrap();

    let accepted = answers
        .iter()
        .filter(|r| r.status() == StatusCode::ACCEPTED)
        .count();
    let refused: Vec<_> = answers
        .iter()
        .filter(|r| r.status() == StatusCode::TOO_MANY_REQUESTS)
        .collect();
    assert_eq!((accepted, refused.len()), (50, 150));
    for response in &refused {
        let retry_after: u64 = response.headers()["retry-after"]
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!(retry_after >= 1);
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json"
        );
    }
    assert!(!samples.is_empty());
    assert!(
        samples.iter().all(|held| *held <= 50),
        "used + reserved passed the limit: {:?}",
        samples.iter().max()
    );
    assert_eq!(api.ledger().await, (50, 50, 0, 0, 0, 50));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_first_requests_with_one_key_make_one_reservation() {
    let api = Arc::new(start(policy()).await);
    api.daily_quota(10).await;
    let sends = (0..50).map(|_| {
        let api = Arc::clone(&api);
        async move {
            let response = api.press("one-press", "q").await;
            assert_eq!(response.status(), StatusCode::ACCEPTED);
            response.json::<Accepted>().await.unwrap().task_id
        }
    });
    let tasks = futures_util::future::join_all(sends).await;
    assert!(tasks.iter().all(|t| *t == tasks[0]));
    assert_eq!(api.ledger().await, (1, 1, 0, 0, 0, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_answered_whatever_the_quota_says_now_and_new_work_gets_429() {
    let api = start(policy()).await;
    api.daily_quota(1).await;
    let first = api.press("press-1", "q").await;
    assert_eq!(first.status(), StatusCode::ACCEPTED);
    let first: Accepted = first.json().await.unwrap();

    let over = api.press("press-2", "another").await;
    assert_eq!(over.status(), StatusCode::TOO_MANY_REQUESTS);
    assert!(over.headers().contains_key("retry-after"));
    let problem: Value = over.json().await.unwrap();
    assert_eq!(
        problem["type"],
        "https://replyd.dev/problems/quota_exceeded"
    );
    assert!(
        problem["detail"]
            .as_str()
            .unwrap()
            .contains("1 generations per 1d is taken (0 charged, 1 reserved)"),
        "{problem}"
    );

    // The lost answer's retry: the same task, not a second reservation, though the quota is full.
    let again = api.press("press-1", "q").await;
    assert_eq!(again.status(), StatusCode::ACCEPTED);
    assert_eq!(again.headers()["idempotent-replayed"], "true");
    assert_eq!(
        again.json::<Accepted>().await.unwrap().task_id,
        first.task_id
    );

    // Completed: still the same task on a retry, charged once, and the quota still full.
    api.finish(first.task_id, true).await;
    let late = api.press("press-1", "q").await;
    assert_eq!(late.status(), StatusCode::ACCEPTED);
    assert_eq!(api.ledger().await, (1, 0, 1, 0, 1, 0));
    assert_eq!(
        api.press("press-3", "more").await.status(),
        StatusCode::TOO_MANY_REQUESTS
    );
    let quota = api.quota().await;
    assert_eq!(
        (
            &quota["limit"],
            &quota["used"],
            &quota["reserved"],
            &quota["remaining"]
        ),
        (&json!(1), &json!(1), &json!(0), &json!(0)),
        "{quota}"
    );
    assert_eq!(quota["period"], "1d");
    assert_eq!(quota["policy"]["charge_failed"], false);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_retries_of_one_failed_task_at_once_make_one_task_and_one_reservation() {
    use replyd::store::retries::Retried;
    let api = Arc::new(start(policy()).await);
    let accepted: Accepted = api.press("p", "q").await.json().await.unwrap();
    // It fails with its reservation released (the provider refused: no work done).
    api.finish(accepted.task_id, false).await;
    assert_eq!(api.ledger().await, (1, 0, 0, 1, 0, 0));
    let barrier = Arc::new(tokio::sync::Barrier::new(8));
    let mut runs = Vec::new();
    for _ in 0..8 {
        let (api, barrier) = (Arc::clone(&api), Arc::clone(&barrier));
        runs.push(tokio::spawn(async move {
            barrier.wait().await;
            api.db
                .store
                .retry_failed(accepted.task_id, Some(2), &policy())
                .await
                .unwrap()
        }));
    }
    let mut created = Vec::new();
    let mut already = Vec::new();
    for run in runs {
        match run.await.unwrap() {
            Retried::Created { task_id } => created.push(task_id),
            Retried::Already { task_id } => already.push(task_id),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(created.len(), 1, "{created:?} {already:?}");
    assert!(already.iter().all(|t| *t == created[0]), "{already:?}");
    // Two tasks, one reservation of each: the failed one's released, the retry's open.
    assert_eq!(api.ledger().await, (2, 1, 0, 1, 0, 1));
    // The retry is admitted like new work and settled by its own completion, once.
    api.finish(created[0], true).await;
    assert_eq!(api.ledger().await, (2, 0, 1, 1, 1, 0));
}
