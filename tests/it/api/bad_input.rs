//! Bad input: every bad request is a `4xx` problem that writes nothing, a field over its bound
//! names the field and its limit, a record over `kafka.max_record_bytes` names its largest
//! field, and a body that is not a JSON object is refused.

use super::{body, start, start_with, start_with_limits};
use replyd::api::IntakeLimits;
use replyd::api::settings::ApiSettings;
use replyd_core::api_key::issue;
use reqwest::StatusCode;
use serde_json::{Value, json};

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
