//! The intake API over real HTTP on loopback, against the real PostgreSQL: one task per
//! logical request whatever the retries and races (I6), workspaces isolated, and every bad
//! input a problem+json 4xx that writes nothing.

use std::time::Duration;

use crate::helpers::TestDb;
use crate::helpers::api::{self, Api};
use replyd::api::reply_view::{Accepted, ReplyStatus, ReplyView};
use replyd::api::settings::ApiSettings;
use replyd::api::{ApiState, IntakeLimits, serve};
use replyd_core::api_key::issue;
use replyd_core::quota::QuotaSettings;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio_util::sync::CancellationToken;

async fn key_for(db: &TestDb, workspace: &str) -> String {
    api::workspace_with_key(&db.store, workspace).await.token
}

async fn start_with(settings: ApiSettings) -> Api {
    start_with_limits(settings, api::limits(1000)).await
}

async fn start_with_limits(settings: ApiSettings, limits: IntakeLimits) -> Api {
    Api::start(settings, limits, QuotaSettings::default().policy()).await
}

async fn start() -> Api {
    start_with(ApiSettings {
        max_body_bytes: 4096,
        ..ApiSettings::default()
    })
    .await
}

fn body(message: &str) -> Value {
    json!({"conversation_id": "conv-1", "message": message, "document_version": "v7"})
}

impl Api {
    async fn post(&self, key: Option<&str>, auth: &str, body: &Value) -> reqwest::Response {
        let mut request = self
            .client
            .post(format!("{}/v1/replies", self.base))
            .bearer_auth(auth)
            .json(body);
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        request.send().await.unwrap()
    }

    async fn counts(&self) -> (i64, i64, i64, i64) {
        let row = self
            .db
            .raw_client()
            .await
            .query_one(
                "SELECT (SELECT count(*) FROM messages), (SELECT count(*) FROM reply_tasks), \
                 (SELECT count(*) FROM idempotency_keys), (SELECT count(*) FROM outbox)",
                &[],
            )
            .await
            .unwrap();
        (row.get(0), row.get(1), row.get(2), row.get(3))
    }
}

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
async fn every_bad_input_is_a_problem_4xx_that_writes_nothing() {
    let api = start().await;
    let revoked = {
        api.db.store.create_workspace("gone").await.unwrap();
        let key = issue(&mut rand::rng());
        api.db.store.create_api_key("gone", &key).await.unwrap();
        api.db.store.revoke_api_key(&key.key_id).await.unwrap();
        key.token
    };
    let url = format!("{}/v1/replies", api.base);
    let c = &api.client;
    let key = api.key.as_str();
    let raw = |content_type: &'static str, payload: Vec<u8>| {
        c.post(&url)
            .bearer_auth(key)
            .header("Idempotency-Key", "k")
            .header("content-type", content_type)
            .body(payload)
    };
    let cases: Vec<(&str, reqwest::RequestBuilder, StatusCode, &str)> = vec![
        (
            "malformed JSON",
            raw("application/json", b"{\"conversation_id\":".to_vec()),
            StatusCode::BAD_REQUEST,
            "malformed_json",
        ),
        (
            "wrong content type",
            raw("text/plain", b"hello".to_vec()),
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "unsupported_media_type",
        ),
        (
            "missing field",
            raw("application/json", br#"{"conversation_id":"c"}"#.to_vec()),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
        ),
        (
            "wrong type",
            raw(
                "application/json",
                br#"{"conversation_id":"c","message":7}"#.to_vec(),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
        ),
        (
            // PostgreSQL text cannot hold it: refused before the transaction, not a 5xx.
            "a NUL character",
            raw(
                "application/json",
                br#"{"conversation_id":"c","message":"a\u0000b"}"#.to_vec(),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
        ),
        (
            "too many output tokens",
            raw(
                "application/json",
                br#"{"conversation_id":"c","message":"m","max_output_tokens":4000000000}"#.to_vec(),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
        ),
        (
            "unknown field",
            raw(
                "application/json",
                br#"{"conversation_id":"c","message":"m","workspace":"x"}"#.to_vec(),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
        ),
        (
            "empty message",
            raw(
                "application/json",
                br#"{"conversation_id":"c","message":"  "}"#.to_vec(),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
        ),
        (
            "body over the limit",
            raw("application/json", vec![b' '; 5000]),
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
        ),
        (
            "message over max_prompt_bytes",
            raw(
                "application/json",
                serde_json::to_vec(&body(&"x".repeat(1001))).unwrap(),
            ),
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid_body",
        ),
        (
            "no idempotency key",
            c.post(&url).bearer_auth(key).json(&body("q")),
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
        ),
        (
            "key too long",
            c.post(&url)
                .bearer_auth(key)
                .header("Idempotency-Key", "k".repeat(256))
                .json(&body("q")),
            StatusCode::BAD_REQUEST,
            "invalid_idempotency_key",
        ),
        (
            "no API key",
            c.post(&url).header("Idempotency-Key", "k").json(&body("q")),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "unknown API key",
            c.post(&url)
                .bearer_auth("rpd_0123456789abcdef_nope")
                .header("Idempotency-Key", "k")
                .json(&body("q")),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "revoked API key",
            c.post(&url)
                .bearer_auth(&revoked)
                .header("Idempotency-Key", "k")
                .json(&body("q")),
            StatusCode::UNAUTHORIZED,
            "unauthorized",
        ),
        (
            "bad task id",
            c.get(format!("{}/v1/replies/not-a-uuid", api.base))
                .bearer_auth(key),
            StatusCode::BAD_REQUEST,
            "invalid_task_id",
        ),
        (
            "unknown route",
            c.get(format!("{}/v2/nothing", api.base)).bearer_auth(key),
            StatusCode::NOT_FOUND,
            "not_found",
        ),
        (
            "wrong method",
            c.delete(&url).bearer_auth(key),
            StatusCode::METHOD_NOT_ALLOWED,
            "method_not_allowed",
        ),
    ];
    for (what, request, status, kind) in cases {
        let response = request.send().await.unwrap();
        assert_eq!(response.status(), status, "{what}");
        assert_eq!(
            response.headers()["content-type"],
            "application/problem+json",
            "{what}"
        );
        let problem: Value = response.json().await.unwrap();
        assert!(
            problem["type"].as_str().unwrap().ends_with(kind),
            "{what}: {problem}"
        );
        assert_eq!(problem["status"], status.as_u16(), "{what}");
        assert!(!problem["detail"].as_str().unwrap().is_empty(), "{what}");
    }
    assert_eq!(
        api.counts().await,
        (0, 0, 0, 0),
        "nothing written by a refused request"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replyd_api_serves_from_its_settings_and_drains_on_sigterm() {
    let db = TestDb::new().await;
    let key = key_for(&db, "acme").await;
    let dir = std::env::temp_dir().join(crate::helpers::unique("api"));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("replyd.toml");
    std::fs::write(
        &config,
        format!(
            "[database]\nurl = \"{}\"\n[api]\nlisten = \"127.0.0.1:0\"\n[observability]\nlisten = \"127.0.0.1:0\"\n",
            db.settings.url.expose()
        ),
    )
    .unwrap();
    let log = dir.join("api.log");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
        .args(["api", "--config"])
        .arg(&config)
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut addr = String::new();
    crate::helpers::wait_until("the API logs its address", Duration::from_secs(60), || {
        let found = std::fs::read_to_string(&log).ok().and_then(|text| {
            let (_, rest) = text.split_once("API listening addr=")?;
            Some(rest.split_whitespace().next()?.to_owned())
        });
        if let Some(found) = found {
            addr = found;
        }
        let ready = !addr.is_empty();
        async move { ready }
    })
    .await;
    let response = reqwest::Client::new()
        .post(format!("http://{addr}/v1/replies"))
        .bearer_auth(&key)
        .header("Idempotency-Key", "from-the-binary")
        .json(&body("q"))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::ACCEPTED);

    // Its own /healthz, /readyz (the API's part: the database answers) and /metrics.
    let text = std::fs::read_to_string(&log).unwrap();
    let observability = text
        .lines()
        .find(|line| line.contains("serving /metrics"))
        .and_then(|line| line.split_once("addr=")?.1.split_whitespace().next())
        .expect("the observability address is logged")
        .to_owned();
    let get = |path: &str| reqwest::get(format!("http://{observability}{path}"));
    assert_eq!(get("/healthz").await.unwrap().text().await.unwrap(), "ok");
    let ready = get("/readyz").await.unwrap();
    assert_eq!(ready.status(), StatusCode::OK);
    assert_eq!(ready.text().await.unwrap(), "api: ready: database answers");
    let metrics = get("/metrics").await.unwrap().text().await.unwrap();
    assert!(
        metrics.contains("replyd_api_submissions_total"),
        "the API's counters are exported:\n{metrics}"
    );

    std::process::Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let status = tokio::task::spawn_blocking(move || child.wait().unwrap())
        .await
        .unwrap();
    assert!(
        status.success(),
        "{}",
        std::fs::read_to_string(&log).unwrap()
    );
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

/// A key over its request rate gets `429 rate_limited` with `Retry-After`, before anything is
/// written; another key of the same workspace has its own bucket; after the wait the key is
/// served again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_over_its_request_rate_is_refused_with_retry_after_and_others_are_not() {
    let api = start_with(ApiSettings {
        rate_limit_per_second: 1,
        rate_limit_burst: 3,
        ..ApiSettings::default()
    })
    .await;
    let other = {
        let key = issue(&mut rand::rng());
        assert!(api.db.store.create_api_key("acme", &key).await.unwrap());
        key.token
    };
    let mut statuses = Vec::new();
    let mut standings = Vec::new();
    let mut refused = None;
    for n in 0..5 {
        let response = api
            .post(Some(&format!("press-{n}")), &api.key, &body("q"))
            .await;
        statuses.push(response.status().as_u16());
        // Every answer says the policy and where the key stands (the IETF draft's headers).
        let header = |name: &str| {
            response
                .headers()
                .get(name)
                .map(|v| v.to_str().unwrap().to_owned())
        };
        assert_eq!(
            header("ratelimit-policy").as_deref(),
            Some("\"caller\";q=3;w=3"),
            "request {n}, answered {}",
            response.status()
        );
        standings.push(header("ratelimit").unwrap_or_default());
        if response.status() == StatusCode::TOO_MANY_REQUESTS && refused.is_none() {
            refused = Some(response);
        }
    }
    // A token a second comes back: what is left falls by one a request, at most one more.
    assert_eq!(standings[0], "\"caller\";r=2;t=1", "{standings:?}");
    assert!(
        ["\"caller\";r=1;t=2", "\"caller\";r=2;t=1"].contains(&standings[1].as_str()),
        "{standings:?}"
    );
    // A caller with no valid key learns nothing of anyone's standing.
    let unknown = api.post(Some("press-x"), "rk_nope", &body("q")).await;
    assert_eq!(unknown.status(), StatusCode::UNAUTHORIZED);
    assert!(unknown.headers().get("ratelimit").is_none());
    assert!(unknown.headers().get("ratelimit-policy").is_none());
    // The burst of 3 within a second, then refusals (a token may come back meanwhile).
    assert_eq!(&statuses[..3], &[202, 202, 202], "{statuses:?}");
    assert!(statuses[3..].contains(&429), "{statuses:?}");
    let refused = refused.unwrap();
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let retry_after: u64 = refused.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=1).contains(&retry_after), "{retry_after}");
    assert_eq!(
        refused.headers()["ratelimit"],
        format!("\"caller\";r=0;t={retry_after}").as_str(),
        "a refused key has none left, until Retry-After"
    );
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["type"].as_str().unwrap().ends_with("/rate_limited"),
        "{problem}"
    );
    // Nothing was written for a refused press.
    let accepted = statuses.iter().filter(|s| **s == 202).count() as i64;
    assert_eq!(api.counts().await.0, accepted);
    // Another key is not touched by this one's bucket.
    let response = api.post(Some("other-1"), &other, &body("q")).await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    // After Retry-After, the key is served again.
    tokio::time::sleep(std::time::Duration::from_secs(retry_after)).await;
    let response = api.post(Some("press-9"), &api.key, &body("q")).await;
    assert_eq!(response.status(), StatusCode::ACCEPTED);
}

/// A request whose headers are over `api.max_header_bytes` is a `431` problem, and nothing is
/// written; one just under the limit is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_over_the_limit_are_refused_with_431_and_write_nothing() {
    let api = start_with(ApiSettings {
        max_header_bytes: 4096,
        ..ApiSettings::default()
    })
    .await;
    let send = |padding: usize| {
        api.client
            .post(format!("{}/v1/replies", api.base))
            .bearer_auth(&api.key)
            .header("Idempotency-Key", format!("press-{padding}"))
            .header("X-Padding", "p".repeat(padding))
            .json(&body("q"))
            .send()
    };
    let refused = send(5000).await.unwrap();
    assert_eq!(
        refused.status(),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/headers_too_large")
            && problem["detail"]
                .as_str()
                .unwrap()
                .contains("api.max_header_bytes"),
        "{problem}"
    );
    assert_eq!(api.counts().await.0, 0, "nothing written");
    let served = send(2000).await.unwrap();
    assert_eq!(served.status(), StatusCode::ACCEPTED);
}

/// One answer read off a raw TCP connection.
struct RawResponse {
    status_line: String,
    /// Names in lower case.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn problem(&self) -> Value {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{}: {:?}",
            self.status_line,
            self.headers
        );
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// Sends `request` as is over a new TCP connection to the API (for bytes an HTTP client will
/// not send) and reads one answer: its head and a `Content-Length` body (30 s at most).
async fn raw_exchange(api: &Api, request: &[u8]) -> RawResponse {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = api.base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let read = async {
        let mut received = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&received[..end]).into_owned();
                let mut lines = head.split("\r\n");
                let status_line = lines.next().unwrap().to_owned();
                let headers: Vec<(String, String)> = lines
                    .filter_map(|l| l.split_once(':'))
                    .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
                    .collect();
                let length: usize = headers
                    .iter()
                    .find(|(n, _)| n == "content-length")
                    .map_or(0, |(_, v)| v.parse().unwrap());
                if received.len() >= end + 4 + length {
                    let body = received[end + 4..end + 4 + length].to_vec();
                    return RawResponse {
                        status_line,
                        headers,
                        body,
                    };
                }
            }
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(
                n > 0,
                "the connection closed before a whole answer: {:?}",
                String::from_utf8_lossy(&received)
            );
            received.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("an answer within 30 s")
}

/// Each field of the body has a bound, named with its limit when it is over it; a
/// `conversation_id` of 700,000 characters (the Kafka record's key) is refused at the door.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_field_over_its_bound_is_422_naming_the_field_and_its_limit() {
    let api = start_with(ApiSettings::default()).await;
    let long = |n: usize| "x".repeat(n);
    let cases = [
        (
            "conversation_id",
            json!({"conversation_id": long(700_000), "message": "q"}),
        ),
        (
            "document_version",
            json!({"conversation_id": "c", "message": "q", "document_version": long(257)}),
        ),
        (
            "model",
            json!({"conversation_id": "c", "message": "q", "model": long(257)}),
        ),
    ];
    for (field, body) in cases {
        let refused = api.post(Some(field), &api.key, &body).await;
        assert_eq!(
            refused.status(),
            StatusCode::UNPROCESSABLE_ENTITY,
            "{field}"
        );
        assert_eq!(
            refused.headers()["content-type"],
            "application/problem+json"
        );
        let problem: Value = refused.json().await.unwrap();
        assert!(
            problem["type"].as_str().unwrap().ends_with("/invalid_body"),
            "{problem}"
        );
        let detail = problem["detail"].as_str().unwrap();
        assert!(
            detail.contains(&format!("`{field}`")) && detail.contains("256 bytes"),
            "{field}: {detail}"
        );
        assert_eq!(problem["fields"], json!([field]), "{field}");
    }
    let at_the_bound = json!({"conversation_id": long(256), "message": "q",
        "document_version": long(256), "model": long(256)});
    let served = api
        .post(Some("at-the-bound"), &api.key, &at_the_bound)
        .await;
    assert_eq!(served.status(), StatusCode::ACCEPTED);
    assert_eq!(
        api.counts().await,
        (1, 1, 1, 1),
        "only the last was written"
    );
}

/// A body whose Kafka record would be over `kafka.max_record_bytes` is refused before
/// anything is written, naming its largest field: the relay could never publish it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_over_kafka_max_record_bytes_is_422_naming_the_largest_field() {
    let api = start_with_limits(
        ApiSettings::default(),
        IntakeLimits {
            max_prompt_bytes: 1000,
            max_record_bytes: 1000,
            ..IntakeLimits::default()
        },
    )
    .await;
    let body = json!({"conversation_id": "conv-1", "message": "m".repeat(900),
        "context": "c".repeat(100)});
    let refused = api.post(Some("big"), &api.key, &body).await;
    assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY);
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["type"].as_str().unwrap().ends_with("/invalid_body"),
        "{problem}"
    );
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("kafka.max_record_bytes") && detail.contains("`message`"),
        "{detail}"
    );
    assert_eq!(problem["fields"], json!(["message"]));
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
}

/// The schema says `object`: serde's positional form of a struct (a JSON array) is refused,
/// and so is any other JSON value; duplicate and unknown fields are still refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_body_that_is_not_a_json_object_is_422_and_writes_nothing() {
    let api = start().await;
    let cases: [(&str, &[u8], &str); 4] = [
        (
            "an array",
            br#"["c","hello","v1",null,null,64]"#,
            "a JSON object",
        ),
        ("a string", br#""hello""#, "a JSON object"),
        (
            "a duplicate field",
            br#"{"conversation_id":"a","conversation_id":"b","message":"m"}"#,
            "duplicate field `conversation_id`",
        ),
        (
            "an unknown field",
            br#"{"conversation_id":"a","message":"m","workspace":"w"}"#,
            "unknown field `workspace`",
        ),
    ];
    for (what, payload, expected) in cases {
        let refused = api
            .client
            .post(format!("{}/v1/replies", api.base))
            .bearer_auth(&api.key)
            .header("Idempotency-Key", what)
            .header("content-type", "application/json")
            .body(payload.to_vec())
            .send()
            .await
            .unwrap();
        assert_eq!(refused.status(), StatusCode::UNPROCESSABLE_ENTITY, "{what}");
        let problem: Value = refused.json().await.unwrap();
        assert!(
            problem["type"].as_str().unwrap().ends_with("/invalid_body"),
            "{what}: {problem}"
        );
        assert!(
            problem["detail"].as_str().unwrap().contains(expected),
            "{what}: {problem}"
        );
    }
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
}

/// More header fields than `api.max_headers` is a `431` problem naming the setting, whether
/// the application counts them or hyper's own (higher) cap does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_header_fields_are_a_431_problem_naming_api_max_headers() {
    let api = start().await;
    let mut request = api
        .client
        .post(format!("{}/v1/replies", api.base))
        .bearer_auth(&api.key)
        .header("Idempotency-Key", "many-headers")
        .json(&body("q"));
    for n in 0..150 {
        request = request.header(format!("x-extra-{n}"), "1");
    }
    let refused = request.send().await.unwrap();
    assert_eq!(
        refused.status(),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
    assert_eq!(
        refused.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/problem+json"[..]),
        "{:?}",
        refused.headers()
    );
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/headers_too_large")
            && problem["detail"]
                .as_str()
                .unwrap()
                .contains("api.max_headers"),
        "{problem}"
    );
    // Far beyond: hyper's own cap refuses it before the application sees it.
    let mut flood = String::from("GET /v1/quota HTTP/1.1\r\nHost: localhost\r\n");
    for n in 0..300 {
        flood.push_str(&format!("x{n}:1\r\n"));
    }
    flood.push_str("\r\n");
    let refused = raw_exchange(&api, flood.as_bytes()).await;
    assert!(
        refused.status_line.starts_with("HTTP/1.1 431"),
        "{}",
        refused.status_line
    );
    let problem = refused.problem();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/headers_too_large")
            && problem["detail"]
                .as_str()
                .unwrap()
                .contains("api.max_headers"),
        "{problem}"
    );
    assert_eq!(problem["status"], 431);
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
}

/// A request head hyper's parser refuses (a DEL byte in `Idempotency-Key`) is answered with a
/// `400` problem naming the header, not hyper's bare status line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_with_a_byte_http_does_not_allow_is_a_400_problem_naming_it() {
    let api = start().await;
    let request = format!(
        "POST /v1/replies HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\n\
         Idempotency-Key: press\x7f1\r\nContent-Length: 0\r\n\r\n",
        api.key
    );
    let refused = raw_exchange(&api, request.as_bytes()).await;
    assert!(
        refused.status_line.starts_with("HTTP/1.1 400"),
        "{}",
        refused.status_line
    );
    let problem = refused.problem();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/malformed_request"),
        "{problem}"
    );
    assert_eq!(problem["status"], 400);
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("Idempotency-Key") && detail.contains("0x7F"),
        "{detail}"
    );
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
}

/// An `Idempotency-Key` or `Authorization` sent twice with different values is ambiguous and
/// refused (`400`) before anything is written; the same value twice is one value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_or_credential_sent_twice_with_different_values_is_refused() {
    let api = start().await;
    let other = key_for(&api.db, "globex").await;
    let url = format!("{}/v1/replies", api.base);
    let twice = |keys: [&str; 2], auths: [&str; 2]| {
        api.client
            .post(&url)
            .header("Idempotency-Key", keys[0])
            .header("Idempotency-Key", keys[1])
            .header("Authorization", format!("Bearer {}", auths[0]))
            .header("Authorization", format!("Bearer {}", auths[1]))
            .json(&body("q"))
            .send()
    };
    let cases = [
        (
            "two keys",
            twice(["press-1", "press-2"], [&api.key, &api.key])
                .await
                .unwrap(),
            "invalid_idempotency_key",
            "Idempotency-Key",
        ),
        (
            "two credentials",
            twice(["press-1", "press-1"], [&api.key, &other])
                .await
                .unwrap(),
            "invalid_authorization",
            "Authorization",
        ),
    ];
    for (what, refused, kind, header) in cases {
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST, "{what}");
        let problem: Value = refused.json().await.unwrap();
        assert!(
            problem["type"].as_str().unwrap().ends_with(kind),
            "{what}: {problem}"
        );
        assert!(
            problem["detail"].as_str().unwrap().contains(header),
            "{what}: {problem}"
        );
    }
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
    let same = twice(["press-1", "press-1"], [&api.key, &api.key])
        .await
        .unwrap();
    assert_eq!(same.status(), StatusCode::ACCEPTED);
}

/// A client that sends half a header block and stops is cut off after
/// `api.header_read_timeout_ms`, rather than holding a connection open without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_header_block_is_closed_after_the_header_read_timeout() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let api = start_with(ApiSettings {
        header_read_timeout_ms: 200,
        ..ApiSettings::default()
    })
    .await;
    let addr = api.base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"POST /v1/replies HTTP/1.1\r\nHost: localhost\r\nIdempotency-Key: slow\r\n")
        .await
        .unwrap();
    let mut received = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), async {
        let mut chunk = [0u8; 1024];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the connection is still open 30 s after half a header block"
    );
}

/// `Expect: 100-continue` with a declared body over `api.max_body_bytes` is answered `413`
/// at once, before the body is read: no `100 Continue` invites the client to send it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_body_over_the_limit_is_413_before_any_100_continue() {
    let api = start().await;
    let request = format!(
        "POST /v1/replies HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\n\
         Idempotency-Key: huge\r\nContent-Type: application/json\r\n\
         Content-Length: 10485760\r\nExpect: 100-continue\r\n\r\n",
        api.key
    );
    let answer = raw_exchange(&api, request.as_bytes()).await;
    assert!(
        answer.status_line.starts_with("HTTP/1.1 413"),
        "the first line back is {:?}",
        answer.status_line
    );
    let problem = answer.problem();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/body_too_large")
            && problem["detail"]
                .as_str()
                .unwrap()
                .contains("api.max_body_bytes"),
        "{problem}"
    );
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
}

/// Shutdown stops taking connections at once, and a request already being read is still
/// answered: its handler was waiting for its body when shutdown began.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_open_when_shutdown_begins_is_answered_and_new_connections_are_refused() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let db = TestDb::new().await;
    let key = key_for(&db, "acme").await;
    let stop = CancellationToken::new();
    let state = ApiState::new(
        db.store.clone(),
        ApiSettings::default(),
        IntakeLimits::default(),
    );
    let (addr, served) = serve("127.0.0.1:0".parse().unwrap(), state, stop.clone())
        .await
        .unwrap();
    let payload = serde_json::to_vec(&body("q")).unwrap();
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(
            format!(
                "POST /v1/replies HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {key}\r\n\
                 Idempotency-Key: open-at-shutdown\r\nContent-Type: application/json\r\n\
                 Content-Length: {}\r\nExpect: 100-continue\r\n\r\n",
                payload.len()
            )
            .as_bytes(),
        )
        .await
        .unwrap();
    // `100 Continue` is sent when the handler starts reading the body.
    let mut interim = [0u8; 25];
    stream.read_exact(&mut interim).await.unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");

    stop.cancel();
    crate::helpers::wait_until(
        "the API refuses new connections",
        Duration::from_secs(10),
        || async move { tokio::net::TcpStream::connect(addr).await.is_err() },
    )
    .await;
    stream.write_all(&payload).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), stream.read_to_end(&mut answer))
        .await
        .expect("the connection closes after its answer")
        .unwrap();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 202 "), "{answer}");
    tokio::time::timeout(Duration::from_secs(30), served)
        .await
        .expect("the server's task ends once its last request is answered")
        .unwrap();
}

/// A preflight as a browser sends it before a page of `origin` posts a press.
async fn preflight(api: &Api, origin: &str) -> reqwest::Response {
    api.client
        .request(reqwest::Method::OPTIONS, format!("{}/v1/replies", api.base))
        .header("Origin", origin)
        .header("Access-Control-Request-Method", "POST")
        .header(
            "Access-Control-Request-Headers",
            "authorization,content-type,idempotency-key",
        )
        .send()
        .await
        .unwrap()
}

fn header<'a>(response: &'a reqwest::Response, name: &str) -> Option<&'a str> {
    response.headers().get(name).map(|v| v.to_str().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_page_of_an_allowed_origin_gets_its_preflight_and_its_answers_readable_and_others_none() {
    const PRODUCT: &str = "https://app.example.com";
    let api = start_with(ApiSettings {
        cors_allowed_origins: vec![PRODUCT.into()],
        ..ApiSettings::default()
    })
    .await;

    // The product's page: its preflight names it, the method and every header a press sends.
    let allowed = preflight(&api, PRODUCT).await;
    assert!(allowed.status().is_success(), "{}", allowed.status());
    assert_eq!(
        header(&allowed, "access-control-allow-origin"),
        Some(PRODUCT)
    );
    let methods = header(&allowed, "access-control-allow-methods").unwrap();
    assert!(
        methods.contains("POST") && methods.contains("GET"),
        "{methods}"
    );
    let headers = header(&allowed, "access-control-allow-headers")
        .unwrap()
        .to_ascii_lowercase();
    for wanted in [
        "authorization",
        "content-type",
        "idempotency-key",
        "last-event-id",
    ] {
        assert!(headers.contains(wanted), "{wanted} in {headers}");
    }
    assert_eq!(header(&allowed, "access-control-max-age"), Some("600"));
    assert_eq!(header(&allowed, "access-control-allow-credentials"), None);
    assert!(
        allowed.headers().get_all("vary").iter().any(|v| v
            .to_str()
            .unwrap()
            .to_ascii_lowercase()
            .contains("origin")),
        "{:?}",
        allowed.headers()
    );

    // Another site's page: the preflight names no origin, so its browser sends nothing.
    let refused = preflight(&api, "https://evil.example.net").await;
    assert_eq!(header(&refused, "access-control-allow-origin"), None);

    // The press itself, and a refusal, both readable by the product's page: the task's
    // location and whether it was a replay are exposed.
    let press = api
        .client
        .post(format!("{}/v1/replies", api.base))
        .header("Origin", PRODUCT)
        .bearer_auth(&api.key)
        .header("Idempotency-Key", "cors-1")
        .json(&body("What are the key decisions?"))
        .send()
        .await
        .unwrap();
    assert_eq!(press.status(), StatusCode::ACCEPTED);
    assert_eq!(header(&press, "access-control-allow-origin"), Some(PRODUCT));
    let exposed = header(&press, "access-control-expose-headers")
        .unwrap()
        .to_ascii_lowercase();
    for wanted in ["location", "idempotent-replayed", "retry-after"] {
        assert!(exposed.contains(wanted), "{wanted} in {exposed}");
    }
    let unauthorized = api
        .client
        .get(format!("{}/v1/quota", api.base))
        .header("Origin", PRODUCT)
        .send()
        .await
        .unwrap();
    assert_eq!(unauthorized.status(), StatusCode::UNAUTHORIZED);
    assert_eq!(
        header(&unauthorized, "access-control-allow-origin"),
        Some(PRODUCT)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_allowed_origins_no_answer_names_an_origin() {
    let api = start().await;
    let answer = preflight(&api, "https://app.example.com").await;
    assert_eq!(answer.status(), StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(header(&answer, "access-control-allow-origin"), None);
}

#[test]
fn an_allowed_origin_that_no_browser_sends_is_refused_by_name() {
    crate::helpers::assert_config_refused(
        "[api]\ncors_allowed_origins = [\"https://app.example.com/\", \"*\"]\n",
        "api.cors_allowed_origins: \"https://app.example.com/\": must be scheme://host[:port] with nothing after",
    );
    crate::helpers::assert_config_refused(
        "[api]\ncors_allowed_origins = [\"*\"]\n",
        "api.cors_allowed_origins: \"*\": not an origin",
    );
}

/// One page of conversation `conversation`, as `key`'s workspace sees it.
async fn page(api: &Api, key: &str, conversation: &str, query: &str) -> (StatusCode, Value) {
    let response = api
        .client
        .get(format!(
            "{}/v1/conversations/{conversation}/messages{query}",
            api.base
        ))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    (response.status(), response.json().await.unwrap())
}

async fn press_in(api: &Api, conversation: &str, key: &str, message: &str) -> Accepted {
    let response = api
        .client
        .post(format!("{}/v1/replies", api.base))
        .bearer_auth(&api.key)
        .header("Idempotency-Key", key)
        .json(&json!({"conversation_id": conversation, "message": message}))
        .send()
        .await
        .unwrap();
    assert_eq!(response.status(), StatusCode::ACCEPTED);
    response.json().await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_read_page_by_page_while_others_write_shows_each_message_once_in_order() {
    let api = start().await;
    let api = std::sync::Arc::new(api);
    // Four writers press 15 messages each into one conversation while a reader pages.
    let mut writers = Vec::new();
    for w in 0..4 {
        let api = std::sync::Arc::clone(&api);
        writers.push(tokio::spawn(async move {
            let mut tasks = Vec::new();
            for i in 0..15 {
                let accepted = press_in(
                    &api,
                    "busy",
                    &format!("w{w}-{i}"),
                    &format!("writer {w}, {i}"),
                )
                .await;
                tasks.push(accepted.task_id.to_string());
            }
            tasks
        }));
    }
    let mut seen: Vec<String> = Vec::new();
    let mut cursor: Option<String> = None;
    let mut writing = true;
    let mut pages = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(120);
    loop {
        assert!(
            tokio::time::Instant::now() < deadline,
            "the reader did not reach the end in 120 s: {} seen, writing: {writing}",
            seen.len()
        );
        if writing && writers.iter().all(|w| w.is_finished()) {
            writing = false;
        }
        let query = match &cursor {
            Some(c) => format!("?limit=7&after={c}"),
            None => "?limit=7".into(),
        };
        let (status, body) = page(&api, &api.key, "busy", &query).await;
        if status == StatusCode::NOT_FOUND {
            // No message committed yet: the conversation is made by its first.
            continue;
        }
        assert_eq!(status, StatusCode::OK, "{body}");
        pages += 1;
        for message in body["messages"].as_array().unwrap() {
            let replies = message["replies"].as_array().unwrap();
            assert_eq!(replies.len(), 1, "{message}");
            seen.push(replies[0]["task_id"].as_str().unwrap().to_owned());
        }
        cursor = body["next_cursor"].as_str().map(str::to_owned).or(cursor);
        // Past the last write, read to the end once more.
        if !writing && !body["has_more"].as_bool().unwrap() {
            break;
        }
    }
    let mut pressed: Vec<String> = Vec::new();
    for writer in writers {
        pressed.extend(writer.await.unwrap());
    }
    let distinct: std::collections::BTreeSet<&String> = seen.iter().collect();
    assert_eq!(
        distinct.len(),
        seen.len(),
        "a message shown twice: {seen:?}"
    );
    let pressed: std::collections::BTreeSet<&String> = pressed.iter().collect();
    assert_eq!(distinct, pressed, "a message skipped");
    assert!(pages >= 9, "{pages} pages");
    // Each writer's messages are listed in the order it wrote them.
    let content_order: Vec<String> = {
        let mut all = Vec::new();
        let mut after = String::new();
        loop {
            let (_, body) = page(&api, &api.key, "busy", &format!("?limit=100{after}")).await;
            for m in body["messages"].as_array().unwrap() {
                all.push(m["content"].as_str().unwrap().to_owned());
            }
            if !body["has_more"].as_bool().unwrap() {
                break;
            }
            after = format!("&after={}", body["next_cursor"].as_str().unwrap());
        }
        all
    };
    for w in 0..4 {
        let mine: Vec<&String> = content_order
            .iter()
            .filter(|c| c.starts_with(&format!("writer {w},")))
            .collect();
        let expected: Vec<String> = (0..15).map(|i| format!("writer {w}, {i}")).collect();
        assert_eq!(mine, expected.iter().collect::<Vec<_>>());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listed_message_shows_its_regenerated_replies_and_a_bad_page_is_a_problem() {
    let api = start().await;
    let first = press_in(&api, "conv-a", "a-1", "What are the key decisions?").await;
    let second = press_in(&api, "conv-a", "a-2", "And the risks?").await;
    let third = press_in(&api, "conv-a", "a-3", "Who decided?").await;
    let regenerated: Accepted = api
        .client
        .post(format!(
            "{}/v1/replies/{}/regenerate",
            api.base, first.task_id
        ))
        .bearer_auth(&api.key)
        .header("Idempotency-Key", "a-1-again")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();

    let (status, one) = page(&api, &api.key, "conv-a", "?limit=2").await;
    assert_eq!(status, StatusCode::OK, "{one}");
    assert_eq!(one["conversation_id"], "conv-a");
    assert_eq!(one["has_more"], true);
    let messages = one["messages"].as_array().unwrap();
    assert_eq!(messages.len(), 2);
    assert_eq!(messages[0]["content"], "What are the key decisions?");
    let replies: Vec<&str> = messages[0]["replies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["task_id"].as_str().unwrap())
        .collect();
    assert_eq!(
        replies,
        [first.task_id.to_string(), regenerated.task_id.to_string()],
        "the reply, then the regenerated one"
    );
    assert_eq!(messages[0]["replies"][0]["status"], "pending");
    assert_eq!(
        messages[1]["replies"][0]["task_id"],
        second.task_id.to_string()
    );
    let next = one["next_cursor"].as_str().unwrap();
    let (_, two) = page(&api, &api.key, "conv-a", &format!("?limit=2&after={next}")).await;
    assert_eq!(two["has_more"], false);
    assert_eq!(
        two["messages"][0]["replies"][0]["task_id"],
        third.task_id.to_string()
    );
    // Past the newest: an empty page that keeps the cursor, for what comes next.
    let last = two["next_cursor"].as_str().unwrap();
    let (_, three) = page(&api, &api.key, "conv-a", &format!("?after={last}")).await;
    assert_eq!(three["messages"], json!([]));
    assert_eq!(three["next_cursor"], last);
    let fourth = press_in(&api, "conv-a", "a-4", "Anything else?").await;
    let (_, four) = page(&api, &api.key, "conv-a", &format!("?after={last}")).await;
    assert_eq!(
        four["messages"][0]["replies"][0]["task_id"],
        fourth.task_id.to_string()
    );

    // A message written as the previous release's intake writes it (no number given): the
    // insert numbers it, so it is listed after the others.
    let old_release = uuid::Uuid::new_v4();
    api.db
        .raw_client()
        .await
        .execute(
            "INSERT INTO messages (message_id, workspace_id, conversation_id, content) \
             VALUES ($1, 'acme', 'conv-a', 'From the previous release')",
            &[&old_release],
        )
        .await
        .unwrap();
    let (_, five) = page(&api, &api.key, "conv-a", &format!("?after={last}")).await;
    let contents: Vec<&str> = five["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["content"].as_str().unwrap())
        .collect();
    assert_eq!(contents, ["Anything else?", "From the previous release"]);

    // Another workspace's key, and a conversation nobody wrote to: exactly as absent.
    let other = key_for(&api.db, "globex").await;
    let (status, problem) = page(&api, &other, "conv-a", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{problem}");
    let (status, _) = page(&api, &api.key, "never-written", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    // Pages the API cannot give: problems naming the parameter.
    for query in [
        "?after=42",
        "?after=c2VxOi0x",
        "?limit=0",
        "?limit=101",
        "?limit=ten",
    ] {
        let (status, problem) = page(&api, &api.key, "conv-a", query).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{query}: {problem}");
        assert!(
            problem["type"]
                .as_str()
                .unwrap()
                .ends_with("/invalid_query"),
            "{query}: {problem}"
        );
    }
}

async fn erase_conversation(api: &Api, key: &str, conversation: &str) -> (StatusCode, Value) {
    let response = api
        .client
        .delete(format!("{}/v1/conversations/{conversation}", api.base))
        .bearer_auth(key)
        .send()
        .await
        .unwrap();
    (response.status(), response.json().await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_conversation_erased_through_the_api_is_gone_refuses_new_messages_and_erases_again_as_nothing()
 {
    let api = start().await;
    let first = press_in(&api, "to-erase", "e-1", "Forget this").await;
    press_in(&api, "to-erase", "e-2", "And this").await;
    let kept = press_in(&api, "to-keep", "k-1", "Keep this").await;
    let other = key_for(&api.db, "globex").await;

    // Another workspace's key, and a conversation nobody wrote to: exactly as absent.
    assert_eq!(
        erase_conversation(&api, &other, "to-erase").await.0,
        StatusCode::NOT_FOUND
    );
    assert_eq!(
        erase_conversation(&api, &api.key, "never-written").await.0,
        StatusCode::NOT_FOUND
    );

    let (status, erased) = erase_conversation(&api, &api.key, "to-erase").await;
    assert_eq!(status, StatusCode::OK, "{erased}");
    assert_eq!(
        erased,
        json!({"conversation_id": "to-erase", "tasks": 2, "messages": 2, "ended": 2})
    );
    assert!(api.db.store.is_forgotten(first.task_id).await.unwrap());
    let (status, _) = page(&api, &api.key, "to-erase", "").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    let shown = api
        .client
        .get(format!("{}{}", api.base, first.status_url))
        .bearer_auth(&api.key)
        .send()
        .await
        .unwrap();
    assert_eq!(shown.status(), StatusCode::NOT_FOUND);
    let refused = api
        .client
        .post(format!("{}/v1/replies", api.base))
        .bearer_auth(&api.key)
        .header("Idempotency-Key", "e-3")
        .json(&json!({"conversation_id": "to-erase", "message": "Hello again"}))
        .send()
        .await
        .unwrap();
    assert_eq!(refused.status(), StatusCode::GONE);

    // Again: nothing left to delete, the same answer.
    let (status, again) = erase_conversation(&api, &api.key, "to-erase").await;
    assert_eq!(status, StatusCode::OK, "{again}");
    assert_eq!(
        again,
        json!({"conversation_id": "to-erase", "tasks": 0, "messages": 0, "ended": 0})
    );
    // The other conversation is untouched.
    let (status, listed) = page(&api, &api.key, "to-keep", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(
        listed["messages"][0]["replies"][0]["task_id"],
        kept.task_id.to_string()
    );
}
