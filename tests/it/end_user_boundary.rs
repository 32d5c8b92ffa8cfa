//! The end-user boundary, as outside testers tried to cross it: a producer's conversation taken
//! over by an end user, a token outliving the key that asked for it, a workspace's tokens
//! that cannot all be ended, idempotency keys shared between users, an erasure that gave back
//! a user's share of the quota, a signing secret readable in the clear and tokens that live
//! forever, and forged tokens that each cost a database read. Each test is the report's
//! reproduction, over real HTTP against the real PostgreSQL.

use std::time::{Duration, Instant};

use base64::Engine as _;
use replyd::api::reply_view::Accepted;
use replyd::api::settings::ApiSettings;
use replyd_core::api_key::issue;
use replyd_core::end_user::{self, Issuer};
use replyd_core::quota::QuotaSettings;
use replyd_core::sealed::{SealingKey, signing_key_row};
use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::api::{self, Api, TOKEN_KEY, problem};
use crate::helpers::wait_until;

const LIMIT: Duration = Duration::from_secs(60);

async fn start() -> Api {
    Api::start(
        ApiSettings::default(),
        api::limits(10_000),
        QuotaSettings::default().policy(),
    )
    .await
}

/// A token for `user`, asked for with `key`.
async fn token_with(api: &Api, key: &str, user: &str) -> String {
    let response = api
        .client
        .post(format!("{}/v1/end-user-tokens", api.base))
        .bearer_auth(key)
        .json(&json!({"user_id": user}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::CREATED);
    let made: Value = response.json().await.unwrap();
    made["token"].as_str().unwrap().to_owned()
}

async fn send(
    api: &Api,
    method: Method,
    path: &str,
    credential: &str,
    body: Option<Value>,
) -> reqwest::Response {
    let mut request = api
        .client
        .request(method, format!("{}{path}", api.base))
        .bearer_auth(credential)
        .header("Idempotency-Key", uuid::Uuid::new_v4().to_string());
    if let Some(body) = body {
        request = request.json(&body);
    }
    request.send().await.unwrap()
}

/// `POST /v1/replies` of `message` in `conversation` under the idempotency key `key`.
async fn press(
    api: &Api,
    credential: &str,
    key: &str,
    conversation: &str,
    message: &str,
) -> reqwest::Response {
    api.client
        .post(format!("{}/v1/replies", api.base))
        .bearer_auth(credential)
        .header("Idempotency-Key", key)
        .json(&json!({"conversation_id": conversation, "message": message}))
        .send()
        .await
        .unwrap()
}

/// A press of "hi" in a new conversation under a new key, with `token`.
async fn post_as(api: &Api, token: &str) -> reqwest::Response {
    let new = || uuid::Uuid::new_v4().to_string();
    press(api, token, &new(), &new(), "hi").await
}

/// A producer's task, as a record's first claim inserts it: no message row, no conversation
/// row.
async fn producers_task(api: &Api, conversation: &str) -> uuid::Uuid {
    let id = uuid::Uuid::new_v4();
    let request = json!({"model": "gpt-4o-mini", "messages": [
        {"role": "user", "content": "the producer's own question"}
    ]});
    api.db
        .raw_client()
        .await
        .execute(
            "SELECT replyd_insert_task($1, 'acme', $2, 'm-from-a-record', 'v1', $3, 3, NULL)",
            &[&id, &conversation, &request],
        )
        .await
        .unwrap();
    id
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_producers_conversation_is_the_workspaces_and_no_end_user_takes_it_over() {
    let api = start().await;
    let task = producers_task(&api, "prod-conv-x").await;
    let mallory = token_with(&api, &api.key, "mallory").await;

    // Posting into it does not make it the user's.
    let (status, kind, _) =
        problem(press(&api, &mallory, "k-1", "prod-conv-x", "mine?").await).await;
    assert_eq!((status, kind.as_str()), (404, "not_found"));
    let listed = send(
        &api,
        Method::GET,
        "/v1/conversations/prod-conv-x/messages",
        &mallory,
        None,
    )
    .await;
    assert_eq!(listed.status(), 404);
    for (method, path) in [
        (Method::GET, format!("/v1/replies/{task}")),
        (Method::GET, format!("/v1/replies/{task}/events")),
        (Method::POST, format!("/v1/replies/{task}/regenerate")),
        (Method::POST, format!("/v1/replies/{task}/cancel")),
    ] {
        let (status, kind, _) = problem(send(&api, method, &path, &mallory, None).await).await;
        assert_eq!((status, kind.as_str()), (404, "not_found"), "{path}");
    }
    // The workspace's key sees it, and writes into it.
    let path = format!("/v1/replies/{task}");
    let own = send(&api, Method::GET, &path, &api.key, None).await;
    assert_eq!(own.status(), 200);
    assert_eq!(
        press(&api, &api.key, "k-2", "prod-conv-x", "and then?")
            .await
            .status(),
        202
    );

    // A record that comes after a user began a conversation of the same id is the
    // workspace's too: the user sees their own task there, not the record's.
    let alice = token_with(&api, &api.key, "alice").await;
    let response = press(&api, &alice, "k-3", "conv-late", "hello").await;
    assert_eq!(response.status(), 202);
    let hers: Accepted = response.json().await.unwrap();
    let late = producers_task(&api, "conv-late").await;
    for (id, status) in [(hers.task_id.to_string(), 200), (late.to_string(), 404)] {
        let path = format!("/v1/replies/{id}");
        let read = send(&api, Method::GET, &path, &alice, None).await;
        assert_eq!(read.status(), status, "{path}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idempotency_key_is_its_callers_own_and_tells_no_one_of_anothers_request() {
    let api = start().await;
    let alice = token_with(&api, &api.key, "alice").await;
    let bob = token_with(&api, &api.key, "bob").await;
    let first = press(&api, &alice, "shared-key", "conv-alice", "Alice's secret").await;
    assert_eq!(first.status(), 202);
    let first: Accepted = first.json().await.unwrap();

    // Bob guessing Alice's message under her key in his own conversation, then another
    // message: both are his own new work, neither a verdict on Alice's request.
    let guess = press(&api, &bob, "shared-key", "conv-bob", "Alice's secret").await;
    assert_eq!(guess.status(), 202);
    assert!(guess.headers().get("idempotent-replayed").is_none());
    let guess: Accepted = guess.json().await.unwrap();
    assert_ne!(guess.task_id, first.task_id);
    // His own key, reused with another message, is judged against his own request only.
    let (status, kind, detail) =
        problem(press(&api, &bob, "shared-key", "conv-bob", "another guess").await).await;
    assert_eq!((status, kind.as_str()), (422, "idempotency_key_reused"));
    assert!(
        !detail.contains("Alice") && !detail.contains("alice"),
        "{detail}"
    );
    // The workspace's key has keys of its own too.
    let keyed = press(&api, &api.key, "shared-key", "conv-alice", "Alice's secret").await;
    assert_eq!(keyed.status(), 202);
    let keyed: Accepted = keyed.json().await.unwrap();
    assert_ne!(keyed.task_id, first.task_id);
    // Alice's retry is still her request, replayed.
    let again = press(&api, &alice, "shared-key", "conv-alice", "Alice's secret").await;
    assert_eq!(again.status(), 202);
    assert_eq!(again.headers().get("idempotent-replayed").unwrap(), "true");
    let again: Accepted = again.json().await.unwrap();
    assert_eq!(again.task_id, first.task_id);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_dies_with_the_key_that_asked_for_it_revoked_or_expired() {
    let api = start().await;
    let k2 = issue(&mut rand::rng());
    assert!(api.db.store.create_api_key("acme", &k2).await.unwrap());
    let by_k1 = token_with(&api, &api.key, "user-1").await;
    let by_k2 = token_with(&api, &k2.token, "user-2").await;
    assert_eq!(post_as(&api, &by_k2).await.status(), 202);

    api.db.store.revoke_api_key(&k2.key_id).await.unwrap();
    let (status, _, _) = problem(post_as(&api, &k2.token).await).await;
    assert_eq!(status, 401, "the key itself");
    let (status, kind, detail) = problem(post_as(&api, &by_k2).await).await;
    assert_eq!((status, kind.as_str()), (401, "unauthorized"));
    assert!(detail.contains("API key that asked for this"), "{detail}");
    // Another key's tokens are not touched.
    assert_eq!(post_as(&api, &by_k1).await.status(), 202);

    // A key that expires takes its tokens with it, and their holders hear it expired.
    let k3 = issue(&mut rand::rng());
    assert!(api.db.store.create_api_key("acme", &k3).await.unwrap());
    let by_k3 = token_with(&api, &k3.token, "user-3").await;
    assert_eq!(post_as(&api, &by_k3).await.status(), 202);
    api.db
        .raw_client()
        .await
        .execute(
            "UPDATE api_keys SET expires_at = now() - interval '1 second' WHERE key_id = $1",
            &[&k3.key_id],
        )
        .await
        .unwrap();
    let (status, kind, detail) = problem(post_as(&api, &by_k3).await).await;
    assert_eq!((status, kind.as_str()), (401, "unauthorized"));
    assert!(
        detail.contains("API key that asked for this end-user token has expired"),
        "{detail}"
    );
    assert_eq!(post_as(&api, &by_k1).await.status(), 202);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotating_the_signing_secret_ends_every_token_of_the_workspace_after_its_overlap() {
    let api = start().await;
    let before = token_with(&api, &api.key, "user-1").await;
    let other = token_with(&api, &api.key, "user-2").await;
    // A rotation with an overlap: the tokens signed so far work on through it.
    let rotated = api
        .db
        .store
        .rotate_signing_key("acme", Duration::from_secs(3))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rotated.retiring, 1);
    assert_eq!(post_as(&api, &before).await.status(), StatusCode::ACCEPTED);
    let after = token_with(&api, &api.key, "user-1").await;
    let version = |token: &str| end_user::named(token).unwrap().version;
    assert_eq!((version(&before), version(&after)), (1, 2));
    // Once the overlap is over, every token the old secret signed is refused, whoever's.
    wait_until("the old secret's tokens are refused", LIMIT, || async {
        post_as(&api, &before).await.status() == StatusCode::UNAUTHORIZED
    })
    .await;
    assert_eq!(
        post_as(&api, &other).await.status(),
        StatusCode::UNAUTHORIZED
    );
    assert_eq!(post_as(&api, &after).await.status(), StatusCode::ACCEPTED);
    assert_eq!(
        api.db
            .store
            .rotate_signing_key("nobody", Duration::ZERO)
            .await
            .unwrap(),
        None
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_signing_secret_is_sealed_at_rest_and_no_token_lives_longer_than_the_setting() {
    let api = start().await;
    let token = token_with(&api, &api.key, "user-1").await;
    let client = api.db.raw_client().await;
    let clear: i64 = client
        .query_one("SELECT count(*) FROM end_user_token_secrets", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(clear, 0, "no secret is kept in the clear");
    let sealed: Vec<u8> = client
        .query_one(
            "SELECT sealed FROM end_user_signing_keys WHERE workspace_id = 'acme' AND version = 1",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let key_id = api.key.split('_').nth(1).unwrap().to_owned();
    let issuer = Issuer {
        workspace: "acme",
        key_id: &key_id,
    };
    let now = chrono::Utc::now().timestamp();
    // Whoever reads the table has only the sealed bytes: a token signed with them (or any
    // part of them) is refused.
    for guess in [&sealed[..], &sealed[12..], &sealed[12..44]] {
        let forged = end_user::mint(guess, 1, issuer, "user-1", 0, now, 600);
        let (status, _, detail) = problem(post_as(&api, &forged).await).await;
        assert_eq!(status, 401, "{detail}");
    }
    // Even with the secret itself (opened here with the deployment's key, as only the API
    // can), a token for 2100 or from the future is refused.
    let secret = SealingKey::parse(TOKEN_KEY)
        .unwrap()
        .open(&sealed, &signing_key_row("acme", 1))
        .unwrap();
    let forever = end_user::mint(&secret, 1, issuer, "user-1", 0, now, 4_102_444_800 - now);
    let (status, _, detail) = problem(post_as(&api, &forever).await).await;
    assert_eq!(status, 401);
    assert!(detail.contains("longer than the 3600 s"), "{detail}");
    let ahead = end_user::mint(&secret, 1, issuer, "user-1", 0, now + 600, 600);
    let (status, _, detail) = problem(post_as(&api, &ahead).await).await;
    assert_eq!(status, 401);
    assert!(detail.contains("ahead of this server's clock"), "{detail}");
    // The secret does verify the API's own token: the refusals above are the bounds'.
    let legit = end_user::mint(&secret, 1, issuer, "user-1", 0, now, 600);
    assert_eq!(post_as(&api, &legit).await.status(), 202);
    assert_eq!(post_as(&api, &token).await.status(), 202);
    // A sealed secret moved to another workspace's row does not open there.
    assert!(
        SealingKey::parse(TOKEN_KEY)
            .unwrap()
            .open(&sealed, &signing_key_row("other", 1))
            .is_err()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_sealing_key_end_user_tokens_are_off_and_say_so() {
    let api = Api::start(
        ApiSettings {
            end_user_token_key: Some(replyd_core::secret::Secret::new("")),
            ..ApiSettings::default()
        },
        api::limits(10_000),
        QuotaSettings::default().policy(),
    )
    .await;
    let response = api
        .client
        .post(format!("{}/v1/end-user-tokens", api.base))
        .bearer_auth(&api.key)
        .json(&json!({"user_id": "u"}))
        .send()
        .await
        .unwrap();
    let (status, kind, detail) = problem(response).await;
    assert_eq!((status, kind.as_str()), (403, "forbidden"));
    assert!(detail.contains("api.end_user_token_key"), "{detail}");
    let some_token = end_user::mint(
        &[7; 32],
        1,
        Issuer {
            workspace: "acme",
            key_id: "k",
        },
        "u",
        0,
        chrono::Utc::now().timestamp(),
        600,
    );
    let (status, _, detail) = problem(press(&api, &some_token, "k", "c", "hi").await).await;
    assert_eq!(status, 401);
    assert!(detail.contains("not enabled"), "{detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn erasing_an_end_user_gives_back_none_of_what_they_were_charged() {
    let api = start().await;
    assert!(
        api.db
            .store
            .set_quota("acme", Some(4), 86_400)
            .await
            .unwrap()
    );
    api.db
        .raw_client()
        .await
        .execute(
            "UPDATE quota_counters SET end_user_share_percent = 50 WHERE workspace_id = 'acme'",
            &[],
        )
        .await
        .unwrap();
    let s1 = token_with(&api, &api.key, "s1").await;
    for n in 0..2 {
        let response = press(&api, &s1, &format!("p-{n}"), &format!("c-{n}"), "hi").await;
        assert_eq!(response.status(), 202);
        let task: Accepted = response.json().await.unwrap();
        api.finish(task.task_id, true).await;
    }
    let (status, _, _) = problem(press(&api, &s1, "p-2", "c-2", "hi").await).await;
    assert_eq!(status, 429, "the share of 2 is used");

    let erased = send(&api, Method::DELETE, "/v1/end-users/s1", &api.key, None).await;
    assert_eq!(erased.status(), 200);
    let gone: i64 = api
        .db
        .raw_client()
        .await
        .query_one("SELECT count(*) FROM reply_tasks", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(gone, 0, "the user's tasks are erased");
    let again = token_with(&api, &api.key, "s1").await;
    let (status, kind, _) = problem(press(&api, &again, "p-3", "c-3", "hi").await).await;
    assert_eq!(
        (status, kind.as_str()),
        (429, "quota_exceeded"),
        "the share counts what was charged in its window, erased or not"
    );
    // Another user of the workspace still has their share.
    let s2 = token_with(&api, &api.key, "s2").await;
    assert_eq!(press(&api, &s2, "p-4", "c-4", "hi").await.status(), 202);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forged_token_costs_no_database_read_and_a_users_limit_comes_before_their_read() {
    let api = Api::start(
        ApiSettings {
            rate_limit_per_second: 1,
            rate_limit_burst: 1,
            ..ApiSettings::default()
        },
        api::limits(10_000),
        QuotaSettings::default().policy(),
    )
    .await;
    let token = token_with(&api, &api.key, "user-1").await;
    let [header, payload, _]: [&str; 3] = token.split('.').collect::<Vec<_>>().try_into().unwrap();
    // Forgeries naming the workspace's live secret: signature checked against the process's
    // copy, no read.
    let started = Instant::now();
    let reads = api.signing.reads();
    for n in 0..300u32 {
        let signature = base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(n.to_be_bytes());
        let forged = format!("{header}.{payload}.{signature}");
        let (status, _, detail) = problem(press(&api, &forged, "k", "c", "hi").await).await;
        assert_eq!(status, 401, "{detail}");
    }
    let refreshes = started.elapsed().as_secs() / replyd::api::signing::REFRESH.as_secs() + 1;
    assert!(
        api.signing.reads() - reads <= refreshes,
        "{} reads for 300 forged tokens",
        api.signing.reads() - reads
    );
    // A revoked user's token: refused at the read of their standing, and past their rate the
    // limit answers first, without it.
    // (Revoked through the store: the key's own bucket holds one request a second too.)
    api.db
        .store
        .revoke_end_user("acme", "user-1")
        .await
        .unwrap();
    let statuses: Vec<u16> = {
        let mut out = Vec::new();
        for _ in 0..3 {
            out.push(problem(press(&api, &token, "k", "c", "hi").await).await.0);
        }
        out
    };
    assert!(statuses.contains(&429), "{statuses:?}");
    assert!(
        statuses.iter().all(|s| [401, 429].contains(s)),
        "{statuses:?}"
    );
}
