//! One task per logical request: concurrent first requests with one key make one task, a
//! retry returns the same task and then its reply, a key reused with other inputs is refused,
//! an expired key is new work (and expired keys are purged in batches), another workspace can
//! neither read a task nor replay a key, and a regenerate is a new task whose retry is the
//! same new task.

use super::{body, key_for, start, start_with};
use replyd::api::reply_view::{Accepted, ReplyStatus, ReplyView};
use replyd::api::settings::ApiSettings;
use reqwest::StatusCode;
use serde_json::{Value, json};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_concurrent_first_requests_with_one_key_make_one_task() {
    let api = std::sync::Arc::new(start().await);
    let sends = (0..50).map(|_| {
        let api = api.clone();
        tokio::spawn(async move {
            let response = api.post(Some("press-1"), &api.key, &body("hello")).await;
            let replayed = response.headers().get("idempotent-replayed").is_some();
            assert_eq!(response.status(), StatusCode::ACCEPTED);
            let accepted: Accepted = response.json().await.unwrap();
            assert_eq!(accepted.replayed, replayed);
            accepted
        })
    });
    let answers: Vec<Accepted> = futures_util::future::join_all(sends)
        .await
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    let first = answers[0].task_id;
    assert!(
        answers.iter().all(|a| a.task_id == first),
        "one task id for all 50"
    );
    assert_eq!(
        answers.iter().filter(|a| !a.replayed).count(),
        1,
        "one winner"
    );
    assert_eq!(
        api.counts().await,
        (1, 1, 1, 1),
        "one message, task, key and outbox row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_returns_the_same_task_and_after_completion_its_reply() {
    let api = start().await;
    let first: Accepted = api
        .post(Some("k-1"), &api.key, &body("q"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (first.status, first.replayed),
        (ReplyStatus::Pending, false)
    );
    // The answer was lost; the browser retries with the same key.
    let retry = api.post(Some("k-1"), &api.key, &body("q")).await;
    assert_eq!(retry.headers()["idempotent-replayed"], "true");
    assert_eq!(
        retry.headers()["location"],
        format!("/v1/replies/{}", first.task_id).as_str()
    );
    let retry: Accepted = retry.json().await.unwrap();
    assert_eq!(retry.task_id, first.task_id);

    // The worker saved the reply; a retry now shows the task completed, and GET its reply.
    api.db
        .raw_client()
        .await
        .execute(
            "UPDATE reply_tasks SET status = 'completed', saved_response = 'the answer', \
             finished_at = clock_timestamp() WHERE task_id = $1",
            &[&first.task_id.as_uuid()],
        )
        .await
        .unwrap();
    let late: Accepted = api
        .post(Some("k-1"), &api.key, &body("q"))
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (late.task_id, late.status),
        (first.task_id, ReplyStatus::Completed)
    );
    let view: ReplyView = api
        .client
        .get(format!("{}{}", api.base, first.status_url))
        .bearer_auth(&api.key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(view.reply.as_deref(), Some("the answer"));
    assert_eq!(api.counts().await, (1, 1, 1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_other_inputs_is_422_naming_the_fields() {
    let api = start().await;
    api.post(Some("k-2"), &api.key, &body("q")).await;
    let mut other = body("another question");
    other["document_version"] = json!("v8");
    let refused = api.post(Some("k-2"), &api.key, &other).await;
    assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let problem: Value = refused.json().await.unwrap();
    assert_eq!(problem["fields"], json!(["message", "document_version"]));
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("idempotency_key_reused")
    );
    assert_eq!(api.counts().await, (1, 1, 1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_key_is_new_work() {
    let api = start_with(ApiSettings {
        idempotency_retention_ms: 1,
        ..ApiSettings::default()
    })
    .await;
    let first: Accepted = api
        .post(Some("k-3"), &api.key, &body("q"))
        .await
        .json()
        .await
        .unwrap();
    let client = api.db.raw_client().await;
    crate::helpers::wait_until_sql(
        &client,
        "the key's retention has passed",
        "SELECT bool_and(expires_at <= clock_timestamp()) FROM idempotency_keys",
        &[],
    )
    .await;
    let again: Accepted = api
        .post(Some("k-3"), &api.key, &body("q"))
        .await
        .json()
        .await
        .unwrap();
    assert_ne!(again.task_id, first.task_id);
    assert!(!again.replayed);
    let (messages, tasks, keys, outbox) = api.counts().await;
    assert_eq!((messages, tasks, keys, outbox), (2, 2, 1, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn another_workspace_cannot_read_a_task_or_replay_a_key() {
    let api = start().await;
    let other = key_for(&api.db, "globex").await;
    let acme: Accepted = api
        .post(Some("shared"), &api.key, &body("q"))
        .await
        .json()
        .await
        .unwrap();
    let read = api
        .client
        .get(format!("{}{}", api.base, acme.status_url))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap();
    assert_eq!(read.status(), StatusCode::NOT_FOUND);
    let missing = api
        .client
        .get(format!("{}/v1/replies/{}", api.base, uuid::Uuid::new_v4()))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap();
    assert_eq!(missing.status(), StatusCode::NOT_FOUND);
    let read: Value = read.json().await.unwrap();
    let missing: Value = missing.json().await.unwrap();
    assert_eq!(
        read["type"], missing["type"],
        "another's task looks like no task"
    );
    let stream = api
        .client
        .get(format!("{}{}", api.base, acme.events_url))
        .bearer_auth(&other)
        .send()
        .await
        .unwrap();
    assert_eq!(stream.status(), StatusCode::NOT_FOUND, "nor stream it");
    // The same key in another workspace is another key.
    let globex: Accepted = api
        .post(Some("shared"), &other, &body("q"))
        .await
        .json()
        .await
        .unwrap();
    assert_ne!(globex.task_id, acme.task_id);
    assert!(!globex.replayed);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn regenerate_is_a_new_task_for_the_same_message_and_its_retry_the_same_new_task() {
    let api = start().await;
    let first: Accepted = api
        .post(Some("send-1"), &api.key, &body("q"))
        .await
        .json()
        .await
        .unwrap();
    let regenerate = |key: &'static str, auth: String| {
        let request = api
            .client
            .post(format!(
                "{}/v1/replies/{}/regenerate",
                api.base, first.task_id
            ))
            .bearer_auth(auth)
            .header("Idempotency-Key", key);
        async move { request.send().await.unwrap() }
    };
    let again = regenerate("regen-1", api.key.clone()).await;
    assert_eq!(again.status(), StatusCode::ACCEPTED);
    let again: Accepted = again.json().await.unwrap();
    assert_ne!(
        again.task_id, first.task_id,
        "another answer is another task"
    );
    let retried = regenerate("regen-1", api.key.clone()).await;
    assert_eq!(retried.headers()["idempotent-replayed"], "true");
    let retried: Accepted = retried.json().await.unwrap();
    assert_eq!(
        retried.task_id, again.task_id,
        "a retried press is the same new task"
    );
    // One message, answered by two tasks.
    assert_eq!(api.counts().await, (1, 2, 2, 2));
    let same_message: bool = api
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT count(DISTINCT message_id) = 1 FROM reply_tasks",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(same_message);
    // Another workspace cannot regenerate it; a press without a key is refused.
    let other = key_for(&api.db, "globex").await;
    assert_eq!(
        regenerate("regen-2", other).await.status(),
        StatusCode::NOT_FOUND
    );
    let keyless = api
        .client
        .post(format!(
            "{}/v1/replies/{}/regenerate",
            api.base, first.task_id
        ))
        .bearer_auth(&api.key)
        .send()
        .await
        .unwrap();
    assert_eq!(keyless.status(), StatusCode::BAD_REQUEST);
    assert_eq!(api.counts().await, (1, 2, 2, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_keys_are_purged_in_bounded_batches_and_live_ones_kept() {
    let api = start().await;
    for n in 0..5 {
        let key = format!("purge-{n}");
        let response = api.post(Some(&key), &api.key, &body(&key)).await;
        assert_eq!(response.status(), StatusCode::ACCEPTED);
    }
    let client = api.db.raw_client().await;
    client
        .execute(
            "UPDATE idempotency_keys SET expires_at = clock_timestamp() - interval '1 second' \
             WHERE idempotency_key IN ('purge-0', 'purge-1', 'purge-2')",
            &[],
        )
        .await
        .unwrap();
    let store = &api.db.store;
    assert_eq!(
        store.purge_idempotency_keys(2).await.unwrap(),
        2,
        "a bounded batch"
    );
    assert_eq!(
        store.purge_idempotency_keys(2).await.unwrap(),
        1,
        "the rest"
    );
    assert_eq!(
        store.purge_idempotency_keys(2).await.unwrap(),
        0,
        "nothing expired is left"
    );
    let kept: Vec<String> = client
        .query(
            "SELECT idempotency_key FROM idempotency_keys ORDER BY idempotency_key",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(kept, ["purge-3", "purge-4"]);
    // The tasks and their messages stay: only the key's memory ends.
    assert_eq!(api.counts().await, (5, 5, 2, 5));
}
