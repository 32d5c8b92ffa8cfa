//! End users' tokens over HTTP: the product's backend (the workspace's key) asks for a token
//! per user; a token sees and acts on its own user's conversations only (another's, or one
//! begun with the key, is a 404, as another workspace's is), cannot make tokens or call the
//! key's other routes (403), is refused once expired or revoked (401, saying which), and a
//! request it cannot make writes nothing.

use std::time::Duration;

use replyd::api::reply_view::Accepted;
use replyd::api::settings::ApiSettings;
use replyd_core::quota::QuotaSettings;
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::api::{self, Api, problem};
use crate::helpers::wait_until;

async fn start() -> Api {
    Api::start(
        ApiSettings::default(),
        api::limits(10_000),
        QuotaSettings::default().policy(),
    )
    .await
}

/// `POST /v1/end-user-tokens` with `credential`; the response.
async fn ask_token(api: &Api, credential: &str, body: Value) -> reqwest::Response {
    api.client
        .post(format!("{}/v1/end-user-tokens", api.base))
        .bearer_auth(credential)
        .json(&body)
        .send()
        .await
        .unwrap()
}

/// A token for `user`, which must be made.
async fn token_for(api: &Api, user: &str) -> String {
    let response = ask_token(api, &api.key, json!({"user_id": user})).await;
    assert_eq!(response.status(), StatusCode::CREATED);
    let made: Value = response.json().await.unwrap();
    assert_eq!(
        (&made["token_type"], &made["user_id"]),
        (&json!("Bearer"), &json!(user))
    );
    assert_eq!(made["expires_in"], 900);
    made["token"].as_str().unwrap().to_owned()
}

async fn call(api: &Api, method: Method, path: &str, credential: &str) -> reqwest::Response {
    api.client
        .request(method, format!("{}{path}", api.base))
        .bearer_auth(credential)
        .header("Idempotency-Key", uuid::Uuid::new_v4().to_string())
        .send()
        .await
        .unwrap()
}

async fn post_message(api: &Api, credential: &str, conversation: &str) -> reqwest::Response {
    let key = uuid::Uuid::new_v4().to_string();
    post_with_key(api, credential, &key, conversation).await
}

async fn post_with_key(
    api: &Api,
    credential: &str,
    key: &str,
    conversation: &str,
) -> reqwest::Response {
    api.client
        .post(format!("{}/v1/replies", api.base))
        .bearer_auth(credential)
        .header("Idempotency-Key", key)
        .json(&json!({"conversation_id": conversation, "message": "What changed?"}))
        .send()
        .await
        .unwrap()
}

async fn counts(api: &Api) -> (i64, i64) {
    let row = api
        .db
        .raw_client()
        .await
        .query_one(
            "SELECT (SELECT count(*) FROM messages), (SELECT count(*) FROM reply_tasks)",
            &[],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_sees_only_its_users_conversations_and_nothing_of_the_keys_routes() {
    let api = start().await;
    let (a, b) = (
        token_for(&api, "user-a").await,
        token_for(&api, "user-b").await,
    );

    // A's conversation, begun with A's token.
    let response = post_with_key(&api, &a, "press-a", "conv-a").await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    let task: Accepted = response.json().await.unwrap();
    let id = task.task_id;
    let own = [
        (Method::GET, format!("/v1/replies/{id}")),
        (Method::GET, "/v1/conversations/conv-a/messages".to_owned()),
    ];
    for (method, path) in &own {
        assert_eq!(
            call(&api, method.clone(), path, &a).await.status(),
            200,
            "{path}"
        );
        // The product's backend, with the key, sees it too.
        assert_eq!(
            call(&api, method.clone(), path, &api.key).await.status(),
            200,
            "{path}"
        );
    }
    let events = call(&api, Method::GET, &format!("/v1/replies/{id}/events"), &a).await;
    assert_eq!(events.status(), 200);
    drop(events);

    // B: every route of A's task and conversation is a 404, as another workspace's is, and B
    // cannot write into A's conversation.
    let before = counts(&api).await;
    for (method, path) in [
        (Method::GET, format!("/v1/replies/{id}")),
        (Method::GET, format!("/v1/replies/{id}/events")),
        (Method::POST, format!("/v1/replies/{id}/cancel")),
        (Method::POST, format!("/v1/replies/{id}/regenerate")),
        (Method::GET, "/v1/conversations/conv-a/messages".to_owned()),
    ] {
        let (status, kind, _) = problem(call(&api, method, &path, &b).await).await;
        assert_eq!((status, kind.as_str()), (404, "not_found"), "{path}");
    }
    let (status, kind, _) = problem(post_message(&api, &b, "conv-a").await).await;
    assert_eq!((status, kind.as_str()), (404, "not_found"));
    // Nor does A's idempotency key give B A's task: the same press is A's conversation's 404,
    // and the key in B's own conversation is B's own request, new work (a key is its
    // caller's: B learns nothing of A's request from it).
    let (status, kind, _) = problem(post_with_key(&api, &b, "press-a", "conv-a").await).await;
    assert_eq!((status, kind.as_str()), (404, "not_found"));
    assert_eq!(
        post_with_key(&api, &b, "press-a", "conv-b").await.status(),
        202
    );
    // A conversation begun with the key belongs to no end user.
    assert_eq!(post_message(&api, &api.key, "conv-key").await.status(), 202);
    let after_key = counts(&api).await;
    assert_eq!(
        after_key,
        (before.0 + 2, before.1 + 2),
        "only B's own message and the key's were written"
    );
    let (status, _, _) = problem(post_message(&api, &a, "conv-key").await).await;
    assert_eq!(status, 404);
    let listed = call(&api, Method::GET, "/v1/conversations/conv-key/messages", &a).await;
    assert_eq!(listed.status(), 404);
    assert_eq!(
        counts(&api).await,
        after_key,
        "refused requests wrote nothing"
    );

    // A's own task: A may stop it.
    let stopped = call(&api, Method::POST, &format!("/v1/replies/{id}/cancel"), &a).await;
    assert_eq!(stopped.status(), 200);

    // A token cannot make tokens, revoke them, read the quota or erase a conversation.
    for (method, path) in [
        (Method::POST, "/v1/end-user-tokens"),
        (Method::POST, "/v1/end-users/user-b/revoke"),
        (Method::GET, "/v1/quota"),
        (Method::DELETE, "/v1/conversations/conv-a"),
    ] {
        let response = if path == "/v1/end-user-tokens" {
            ask_token(&api, &a, json!({"user_id": "user-b"})).await
        } else {
            call(&api, method, path, &a).await
        };
        let (status, kind, _) = problem(response).await;
        assert_eq!((status, kind.as_str()), (403, "forbidden"), "{path}");
    }
    // Still there: the forbidden erase erased nothing.
    assert_eq!(
        call(&api, Method::GET, "/v1/conversations/conv-a/messages", &a)
            .await
            .status(),
        200
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_is_refused_once_expired_or_revoked_and_bad_requests_for_one_say_why() {
    let api = start().await;
    let a = token_for(&api, "user-a").await;
    assert_eq!(post_message(&api, &a, "conv-a").await.status(), 202);
    let listing = "/v1/conversations/conv-a/messages";

    // A token of one second: refused once it has run out, saying so.
    let short: Value = ask_token(
        &api,
        &api.key,
        json!({"user_id": "user-a", "ttl_seconds": 1}),
    )
    .await
    .json()
    .await
    .unwrap();
    let short = short["token"].as_str().unwrap().to_owned();
    wait_until(
        "the short token expired",
        Duration::from_secs(30),
        || async { call(&api, Method::GET, listing, &short).await.status() == 401 },
    )
    .await;
    let (status, kind, detail) = problem(call(&api, Method::GET, listing, &short).await).await;
    assert_eq!((status, kind.as_str()), (401, "unauthorized"));
    assert!(detail.contains("expired"), "{detail}");

    // Revoked: every token of the user so far is refused; one asked for afterwards works and
    // still sees the user's conversation.
    let revoked = call(&api, Method::POST, "/v1/end-users/user-a/revoke", &api.key).await;
    assert_eq!(revoked.status(), 204);
    let (status, _, detail) = problem(call(&api, Method::GET, listing, &a).await).await;
    assert_eq!(status, 401);
    assert!(detail.contains("revoked"), "{detail}");
    let again = token_for(&api, "user-a").await;
    assert_eq!(call(&api, Method::GET, listing, &again).await.status(), 200);

    // Tampered: refused, and not echoed.
    let tampered = format!("{again}x");
    let (status, _, detail) = problem(call(&api, Method::GET, listing, &tampered).await).await;
    assert_eq!(status, 401);
    assert!(!detail.contains(&again), "{detail}");

    // Bad requests for a token name their field.
    for (body, field) in [
        (json!({"user_id": ""}), "user_id"),
        (json!({"user_id": "x".repeat(257)}), "user_id"),
        (json!({"user_id": "u", "ttl_seconds": 0}), "ttl_seconds"),
        (json!({"user_id": "u", "ttl_seconds": 3_601}), "ttl_seconds"),
    ] {
        let response = ask_token(&api, &api.key, body.clone()).await;
        assert_eq!(response.status(), 422, "{body}");
        let problem: Value = response.json().await.unwrap();
        assert_eq!(problem["fields"], json!([field]), "{body}");
    }
    let unknown = ask_token(&api, &api.key, json!({"user_id": "u", "scope": "all"})).await;
    assert_eq!(unknown.status(), 422);
    // Without a key, no token.
    let anonymous = api
        .client
        .post(format!("{}/v1/end-user-tokens", api.base))
        .json(&json!({"user_id": "u"}))
        .send()
        .await
        .unwrap();
    assert_eq!(anonymous.status(), 401);
}

/// The end users' share of the quota: no one user passes it, whatever the others do, also
/// with many of their requests at once; the workspace's key is held only to the workspace's
/// limit, and a refused request writes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_end_user_passes_their_share_of_the_quota_even_racing() {
    let api = start().await;
    assert!(
        api.db
            .store
            .set_quota("acme", Some(12), 86_400)
            .await
            .unwrap()
    );
    // 25 % of 12 generations: 3 per user per window.
    assert!(
        api.db
            .store
            .set_end_user_share("acme", Some(25))
            .await
            .unwrap()
    );
    let (a, b, c) = (
        token_for(&api, "user-a").await,
        token_for(&api, "user-b").await,
        token_for(&api, "user-c").await,
    );
    for n in 0..3 {
        let accepted = post_message(&api, &a, &format!("a-{n}")).await;
        assert_eq!(accepted.status(), 202);
    }
    let before = counts(&api).await;
    let refused = post_message(&api, &a, "a-3").await;
    assert_eq!(refused.status(), 429);
    assert!(refused.headers().contains_key("retry-after"));
    let (_, kind, detail) = problem(refused).await;
    assert_eq!(kind, "quota_exceeded");
    assert!(
        detail.contains("this end user's share")
            && detail.contains("25 %")
            && detail.contains("3 generations"),
        "{detail}"
    );
    assert_eq!(
        counts(&api).await,
        before,
        "the refused request wrote nothing"
    );

    // Another user has their own share; twenty of one user's first requests at once admit
    // exactly three.
    assert_eq!(post_message(&api, &b, "b-0").await.status(), 202);
    let conversations: Vec<String> = (0..20).map(|n| format!("c-{n}")).collect();
    let racing = futures_util::future::join_all(
        conversations
            .iter()
            .map(|conversation| post_message(&api, &c, conversation)),
    )
    .await;
    let statuses: Vec<u16> = racing.iter().map(|r| r.status().as_u16()).collect();
    assert_eq!(
        statuses.iter().filter(|s| **s == 202).count(),
        3,
        "{statuses:?}"
    );
    assert_eq!(
        statuses.iter().filter(|s| **s == 429).count(),
        17,
        "{statuses:?}"
    );

    // The key is held to the workspace's limit only: 7 of 12 are taken, 5 remain.
    for n in 0..5 {
        assert_eq!(
            post_message(&api, &api.key, &format!("k-{n}"))
                .await
                .status(),
            202
        );
    }
    assert_eq!(post_message(&api, &api.key, "k-5").await.status(), 429);
    let quota: Value = call(&api, Method::GET, "/v1/quota", &api.key)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (&quota["end_user_share_percent"], &quota["remaining"]),
        (&json!(25), &json!(0))
    );
}

/// Rows of each table that holds a conversation's data, for the conversations named.
async fn rows_of(api: &Api, conversations: &[&str]) -> Vec<i64> {
    let conversations: Vec<String> = conversations.iter().map(|c| (*c).to_owned()).collect();
    let client = api.db.raw_client().await;
    let row = client
        .query_one(
            "SELECT (SELECT count(*) FROM messages WHERE conversation_id = ANY($1)), \
                    (SELECT count(*) FROM reply_tasks WHERE conversation_id = ANY($1)), \
                    (SELECT count(*) FROM reply_attempts a JOIN reply_tasks t USING (task_id) \
                      WHERE t.conversation_id = ANY($1)), \
                    (SELECT count(*) FROM conversations WHERE conversation_id = ANY($1))",
            &[&conversations],
        )
        .await
        .unwrap();
    (0..4).map(|i| row.get(i)).collect()
}

/// Erasing an end user: their conversations go (one finished, one still pending, which ends),
/// their tokens stop working, and nothing of another user's or of the key's is touched;
/// erasing again deletes nothing; a token cannot erase.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasing_an_end_user_deletes_their_conversations_only_and_ends_their_tokens() {
    let api = start().await;
    let (a, b) = (
        token_for(&api, "user-a").await,
        token_for(&api, "user-b").await,
    );
    let finished: Accepted = post_message(&api, &a, "a-1").await.json().await.unwrap();
    api.finish(finished.task_id, true).await;
    assert_eq!(post_message(&api, &a, "a-2").await.status(), 202);
    assert_eq!(post_message(&api, &b, "b-1").await.status(), 202);
    assert_eq!(post_message(&api, &api.key, "k-1").await.status(), 202);
    let others = rows_of(&api, &["b-1", "k-1"]).await;
    assert_eq!(rows_of(&api, &["a-1", "a-2"]).await, [2, 2, 1, 2]);

    let forbidden = call(&api, Method::DELETE, "/v1/end-users/user-a", &b).await;
    assert_eq!(forbidden.status(), 403);
    let erased: Value = call(&api, Method::DELETE, "/v1/end-users/user-a", &api.key)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        erased,
        json!({"user_id": "user-a", "conversations": 2, "tasks": 2, "messages": 2, "ended": 1})
    );
    assert_eq!(rows_of(&api, &["a-1", "a-2"]).await, [0, 0, 0, 0]);
    assert_eq!(
        rows_of(&api, &["b-1", "k-1"]).await,
        others,
        "nothing else touched"
    );
    let (status, _, detail) =
        problem(call(&api, Method::GET, "/v1/conversations/b-1/messages", &a).await).await;
    assert_eq!(status, 401);
    assert!(detail.contains("revoked"), "{detail}");
    assert_eq!(
        call(&api, Method::GET, "/v1/conversations/b-1/messages", &b)
            .await
            .status(),
        200
    );
    // A new token for the user begins afresh: their old conversations are gone.
    let again = token_for(&api, "user-a").await;
    assert_eq!(
        call(&api, Method::GET, "/v1/conversations/a-1/messages", &again)
            .await
            .status(),
        404
    );
    let twice: Value = call(&api, Method::DELETE, "/v1/end-users/user-a", &api.key)
        .await
        .json()
        .await
        .unwrap();
    assert_eq!(
        (&twice["conversations"], &twice["tasks"]),
        (&json!(0), &json!(0))
    );
}

/// A workspace's own retention: its finished tasks past it are forgotten while another
/// workspace's, as old, are kept by the deployment's (here none); removing it keeps them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workspaces_own_retention_forgets_its_old_tasks_and_no_one_elses() {
    let api = start().await;
    let globex = api::workspace_with_key(&api.db.store, "globex").await.token;
    let ours: Accepted = post_message(&api, &api.key, "old-1")
        .await
        .json()
        .await
        .unwrap();
    let theirs: Accepted = post_message(&api, &globex, "old-2")
        .await
        .json()
        .await
        .unwrap();
    let tasks = vec![ours.task_id.as_uuid(), theirs.task_id.as_uuid()];
    for task in [ours.task_id, theirs.task_id] {
        api.finish(task, true).await;
    }
    // Both finished ten days ago, their idempotency records expired, charged in a past window.
    let client = api.db.raw_client().await;
    client
        .batch_execute(&format!(
            "UPDATE reply_tasks SET finished_at = finished_at - interval '10 days' \
               WHERE task_id IN ('{0}', '{1}'); \
             UPDATE idempotency_keys SET expires_at = clock_timestamp() - interval '1 second' \
               WHERE task_id IN ('{0}', '{1}'); \
             UPDATE quota_reservations SET created_at = created_at - interval '10 days', \
               settled_at = settled_at - interval '10 days' WHERE task_id IN ('{0}', '{1}')",
            tasks[0], tasks[1]
        ))
        .await
        .unwrap();
    let store = &api.db.store;
    assert_eq!(
        store.forget_finished(None, 100).await.unwrap().tasks,
        0,
        "no retention anywhere"
    );
    assert!(
        store
            .set_task_retention("acme", Some(7 * 86_400))
            .await
            .unwrap()
    );
    assert!(!store.set_task_retention("nobody", Some(1)).await.unwrap());
    // A deployment's retention longer than theirs keeps globex's.
    let thirty_days = Some(Duration::from_secs(30 * 86_400));
    let forgotten = store.forget_finished(thirty_days, 100).await.unwrap();
    assert_eq!(forgotten.tasks, 1);
    let left: Vec<uuid::Uuid> = client
        .query(
            "SELECT task_id FROM reply_tasks WHERE task_id = ANY($1)",
            &[&tasks],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(left, [tasks[1]]);
    assert!(
        store
            .set_task_retention("globex", Some(20 * 86_400))
            .await
            .unwrap()
    );
    assert_eq!(
        store.forget_finished(None, 100).await.unwrap().tasks,
        0,
        "ten days < twenty"
    );
}
