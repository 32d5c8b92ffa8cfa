//! The OpenAI adapter against the mock provider over real HTTP on 127.0.0.1 (mock on port 0):
//! each error class the caller branches on, one generation per idempotency key (I6), and
//! cancellation by dropping the call. Faults are forced with `PUT /faults` at rate 1.0, so no
//! test depends on chance. Needs no PostgreSQL or Kafka.

mod helpers;

use std::time::Duration;

use futures_util::future::join_all;
use helpers::provider::{
    assert_bad_requests_refused, one_shot_server, request, set_faults, start_mock, stats,
};
use helpers::wait_until;
use replyd::mock_provider::{FaultSettings, KeyStats, MockHandle, MockSettings};
use replyd::provider::{OpenAiChatProvider, OpenAiSettings, Provider, ProviderError};

/// Client timeout for tests that expect an answer: generous, since no test waits on it.
const PATIENT_MS: u64 = 30_000;

fn settings_for(base_url: &str, request_timeout_ms: u64) -> OpenAiSettings {
    OpenAiSettings {
        base_url: base_url.to_owned(),
        api_key: Some(replyd::config::Secret::new("sk-test")),
        request_timeout_ms,
        connect_timeout_ms: 2_000,
        default_model: "mock-model".into(),
        ..OpenAiSettings::default()
    }
}

fn provider_for(base_url: &str, request_timeout_ms: u64) -> OpenAiChatProvider {
    OpenAiChatProvider::new(&settings_for(base_url, request_timeout_ms))
        .expect("a loopback base URL is valid")
}

async fn key_stats(mock: &MockHandle, key: &str) -> KeyStats {
    reqwest::get(format!("{}/stats/{key}", mock.base_url()))
        .await
        .expect("GET /stats/{key}")
        .json()
        .await
        .expect("/stats/{key} is JSON")
}

#[tokio::test]
async fn a_reply_from_the_mock_is_one_counted_generation() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);

    let generation = provider
        .generate(&request("task-1", "hello there"))
        .await
        .expect("the mock answers");

    assert_eq!(
        generation.text,
        "reply to task-1: hello there [generation 1]"
    );
    assert_eq!(generation.model, "mock-model");
    assert_eq!(
        generation.provider_response_id.as_deref(),
        Some("chatcmpl-mock-1")
    );
    assert!(generation.usage.is_some());
    assert_eq!(provider.name(), "openai");
    let stats = stats(&mock).await;
    assert_eq!((stats.requests, stats.generations), (1, 1));
    assert_eq!(stats.per_key.get("task-1"), Some(&1));
    assert_eq!(key_stats(&mock, "task-1").await.generations, 1);
    mock.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn concurrent_requests_with_one_key_cost_one_generation() {
    // The latency keeps the first request in flight while the others arrive, so most of them
    // take the wait-for-the-first path; the count holds either way.
    let mock = start_mock(MockSettings {
        latency_ms: 200,
        ..MockSettings::default()
    })
    .await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    let same = request("task-concurrent", "one question");

    let results = join_all((0..8).map(|_| provider.generate(&same))).await;

    let texts: Vec<String> = results
        .into_iter()
        .map(|r| r.expect("every duplicate gets the reply").text)
        .collect();
    assert!(texts.iter().all(|t| t == &texts[0]), "{texts:?}");
    let stats = stats(&mock).await;
    assert_eq!(stats.requests, 8);
    assert_eq!(stats.generations, 1);
    assert_eq!(key_stats(&mock, "task-concurrent").await.generations, 1);
}

#[tokio::test]
async fn a_repeated_key_gets_the_stored_reply_without_a_new_generation() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);

    let first = provider.generate(&request("task-seq", "q")).await.unwrap();
    let second = provider.generate(&request("task-seq", "q")).await.unwrap();
    let other = provider
        .generate(&request("task-other", "q"))
        .await
        .unwrap();

    assert_eq!(first, second);
    assert_ne!(first.text, other.text);
    let stats = stats(&mock).await;
    assert_eq!((stats.requests, stats.generations), (3, 2));
    assert_eq!(stats.per_key.get("task-seq"), Some(&1));
}

#[tokio::test]
async fn without_idempotency_every_request_generates_anew() {
    let mock = start_mock(MockSettings {
        honour_idempotency_key: false,
        latency_ms: 50,
        ..MockSettings::default()
    })
    .await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    let same = request("task-ignored", "q");

    let concurrent = join_all((0..4).map(|_| provider.generate(&same))).await;
    let sequential = provider.generate(&same).await.unwrap();

    let mut texts: Vec<String> = concurrent.into_iter().map(|r| r.unwrap().text).collect();
    texts.push(sequential.text);
    texts.sort();
    texts.dedup();
    assert_eq!(texts.len(), 5, "every request got its own generation");
    assert_eq!(key_stats(&mock, "task-ignored").await.generations, 5);
}

#[tokio::test]
async fn requests_without_a_key_always_generate() {
    let mock = start_mock(MockSettings::default()).await;
    let client = reqwest::Client::new();
    let body = serde_json::json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});

    for _ in 0..2 {
        let response = client
            .post(format!("{}/v1/chat/completions", mock.base_url()))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 200);
    }

    let stats = stats(&mock).await;
    assert_eq!(stats.generations, 2);
    assert!(stats.per_key.is_empty());
}

#[tokio::test]
async fn a_rate_limit_is_retryable_after_the_providers_delay() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    set_faults(
        &mock,
        FaultSettings {
            rate_limit_rate: 1.0,
            retry_after_s: 7,
            ..FaultSettings::default()
        },
    )
    .await;

    let error = provider
        .generate(&request("task-429", "q"))
        .await
        .unwrap_err();

    assert!(
        matches!(
            error,
            ProviderError::Retryable {
                status: 429,
                retry_after: Some(after),
                ..
            } if after == Duration::from_secs(7)
        ),
        "{error:?}"
    );
    assert_eq!(stats(&mock).await.generations, 0);
    set_faults(&mock, FaultSettings::default()).await;
    provider
        .generate(&request("task-429", "q"))
        .await
        .expect("the retry succeeds once the limit is lifted");
}

#[tokio::test]
async fn a_server_error_may_have_executed() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    set_faults(
        &mock,
        FaultSettings {
            error_rate: 1.0,
            ..FaultSettings::default()
        },
    )
    .await;

    let error = provider
        .generate(&request("task-500", "q"))
        .await
        .unwrap_err();

    assert_eq!(
        error,
        ProviderError::MaybeExecuted {
            status: 500,
            message: "injected fault: server error".into()
        }
    );
    assert_eq!(error.kind(), "maybe_executed");
}

#[tokio::test]
async fn a_bad_request_is_fatal_with_the_providers_message() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    let mut empty = request("task-400", "q");
    empty.messages.clear();

    let error = provider.generate(&empty).await.unwrap_err();

    assert_eq!(
        error,
        ProviderError::Fatal {
            status: 400,
            message: "'messages' must contain at least one message".into()
        }
    );
}

#[tokio::test]
async fn a_hanging_provider_is_ambiguous_after_the_client_timeout() {
    let mock = start_mock(MockSettings::default()).await;
    set_faults(
        &mock,
        FaultSettings {
            hang_rate: 1.0,
            ..FaultSettings::default()
        },
    )
    .await;
    let provider = provider_for(&mock.base_url(), 300);

    let error = provider
        .generate(&request("task-hang", "q"))
        .await
        .unwrap_err();

    assert_eq!(error.kind(), "ambiguous", "{error:?}");
    assert!(error.to_string().contains("300 ms"), "{error}");
    // The hanging request must not hold up a graceful shutdown.
    mock.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn a_response_lost_after_the_work_is_ambiguous_but_the_work_was_done() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    set_faults(
        &mock,
        FaultSettings {
            drop_after_work_rate: 1.0,
            ..FaultSettings::default()
        },
    )
    .await;

    let error = provider
        .generate(&request("task-lost", "q"))
        .await
        .unwrap_err();

    assert_eq!(error.kind(), "ambiguous", "{error:?}");
    assert_eq!(key_stats(&mock, "task-lost").await.generations, 1);
    // Retrying under the same key recovers the reply that was generated, without a second one.
    set_faults(&mock, FaultSettings::default()).await;
    let recovered = provider.generate(&request("task-lost", "q")).await.unwrap();
    assert_eq!(recovered.text, "reply to task-lost: q [generation 1]");
    assert_eq!(stats(&mock).await.generations, 1);
}

#[tokio::test]
async fn a_refused_connection_is_not_sent() {
    // A port that was just free: bound, read, released, so nothing listens there.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port");
    let provider = provider_for(&format!("http://{addr}"), PATIENT_MS);

    let error = provider
        .generate(&request("task-refused", "q"))
        .await
        .unwrap_err();

    assert_eq!(error.kind(), "not_sent", "{error:?}");
}

#[tokio::test]
async fn a_malformed_body_gets_a_400_naming_the_problem_and_the_mock_keeps_serving() {
    let mock = start_mock(MockSettings::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", mock.base_url());
    let cases = [
        ("{not json", "invalid request body"),
        (r#"{"model":"m"}"#, "missing field `messages`"),
        (
            r#"{"messages":[]}"#,
            "'messages' must contain at least one message",
        ),
        (
            r#"{"messages":[{"role":"user"}]}"#,
            "missing field `content`",
        ),
    ];

    assert_bad_requests_refused(&url, &cases).await;

    let health = client
        .get(format!("{}/healthz", mock.base_url()))
        .send()
        .await
        .unwrap();
    assert_eq!(health.status(), 200);
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    provider
        .generate(&request("task-after", "q"))
        .await
        .unwrap();
    let stats = stats(&mock).await;
    assert_eq!((stats.requests, stats.generations), (5, 1));
}

#[tokio::test]
async fn contradictory_faults_are_refused_at_run_time() {
    let mock = start_mock(MockSettings::default()).await;
    let response = reqwest::Client::new()
        .put(format!("{}/faults", mock.base_url()))
        .json(&serde_json::json!({"error_rate": 0.7, "hang_rate": 0.7}))
        .send()
        .await
        .unwrap();

    assert_eq!(response.status(), 400);
    let error: serde_json::Value = response.json().await.unwrap();
    assert!(
        error["error"]["message"]
            .as_str()
            .unwrap_or_default()
            .contains("over 1"),
        "{error}"
    );
}

#[tokio::test]
async fn dropping_the_generate_future_closes_the_request_at_the_mock() {
    // Ten minutes of latency: the only way the request ends within the test is cancellation.
    let mock = start_mock(MockSettings {
        latency_ms: 600_000,
        ..MockSettings::default()
    })
    .await;
    let provider = provider_for(&mock.base_url(), 900_000);
    let limit = Duration::from_secs(10);
    let cancelled = request("task-cancel", "q");

    tokio::select! {
        result = provider.generate(&cancelled) => {
            panic!("the call cannot finish within the latency: {result:?}")
        }
        () = wait_until("the mock holds the request", limit, || async {
            mock.stats().in_flight == 1
        }) => {}
    }
    // `select!` has dropped the generate future here.

    wait_until("the mock sees the request go away", limit, || async {
        let stats = mock.stats();
        stats.in_flight == 0 && stats.cancelled == 1
    })
    .await;
    let stats = stats(&mock).await;
    assert_eq!((stats.requests, stats.generations), (1, 0));
    assert!(stats.per_key.is_empty());
}

#[tokio::test]
async fn the_adapter_sends_the_idempotency_key_and_the_bearer_token() {
    let (base_url, server) = one_shot_server(
        "HTTP/1.1 200 OK",
        r#"{"choices":[{"message":{"content":"ok"}}]}"#,
    )
    .await;
    let provider = provider_for(&base_url, PATIENT_MS);

    let generation = provider
        .generate(&request("task-headers", "q"))
        .await
        .unwrap();

    let head = server.await.unwrap();
    assert_eq!(generation.text, "ok");
    assert!(
        head.starts_with("post /v1/chat/completions http/1.1"),
        "{head}"
    );
    assert!(head.contains("idempotency-key: task-headers\r\n"), "{head}");
    assert!(head.contains("authorization: bearer sk-test\r\n"), "{head}");
}

#[tokio::test]
async fn extra_headers_go_out_with_every_request() {
    let (base_url, server) = one_shot_server(
        "HTTP/1.1 200 OK",
        r#"{"choices":[{"message":{"content":"ok"}}]}"#,
    )
    .await;
    let mut settings = settings_for(&base_url, PATIENT_MS);
    settings.api_key = None;
    for (name, value) in [("api-key", "azure-key-1"), ("OpenAI-Project", "proj_9")] {
        settings
            .extra_headers
            .insert(name.into(), replyd::config::Secret::new(value));
    }
    let provider = OpenAiChatProvider::new(&settings).unwrap();

    provider
        .generate(&request("task-extra", "q"))
        .await
        .unwrap();

    let received = server.await.unwrap();
    assert!(received.contains("api-key: azure-key-1\r\n"), "{received}");
    assert!(
        received.contains("openai-project: proj_9\r\n"),
        "{received}"
    );
    assert!(
        received.contains("idempotency-key: task-extra\r\n"),
        "{received}"
    );
    assert!(!received.contains("authorization:"), "{received}");
    assert!(!format!("{provider:?}").contains("azure-key-1"));
}

#[tokio::test]
async fn a_reasoning_model_is_asked_with_max_completion_tokens_on_the_wire() {
    let (base_url, server) = one_shot_server(
        "HTTP/1.1 200 OK",
        r#"{"choices":[{"message":{"content":"ok"}}]}"#,
    )
    .await;
    let provider = provider_for(&base_url, PATIENT_MS);
    let mut asked = request("task-o3", "q");
    asked.model = "o3-mini".into();

    provider.generate(&asked).await.unwrap();

    let received = server.await.unwrap();
    let body: serde_json::Value =
        serde_json::from_str(received.split_once("\r\n\r\n").unwrap().1).unwrap();
    assert_eq!(body["max_completion_tokens"], 64, "{body}");
    assert!(body.get("max_tokens").is_none(), "{body}");
}

#[tokio::test]
async fn a_reply_and_a_refusal_carry_the_providers_rate_limit_signals() {
    let (base_url, server) = one_shot_server(
        "HTTP/1.1 200 OK\r\nx-ratelimit-limit-requests: 5000\r\n\
         x-ratelimit-remaining-requests: 4999\r\nx-ratelimit-reset-requests: 12ms\r\n\
         x-ratelimit-limit-tokens: 160000\r\nx-ratelimit-remaining-tokens: 159976\r\n\
         x-ratelimit-reset-tokens: 1m30.5s",
        r#"{"choices":[{"message":{"content":"ok"}}]}"#,
    )
    .await;
    let provider = provider_for(&base_url, PATIENT_MS);

    let generation = provider
        .generate(&request("task-signals", "q"))
        .await
        .unwrap();
    server.await.unwrap();

    let signals = generation.rate_signals;
    assert_eq!(signals.requests.limit, Some(5000));
    assert_eq!(signals.requests.remaining, Some(4999));
    assert_eq!(signals.requests.resets_in, Some(Duration::from_millis(12)));
    assert_eq!(signals.tokens.remaining, Some(159_976));
    assert_eq!(
        signals.tokens.resets_in,
        Some(Duration::from_millis(90_500))
    );
    assert_eq!(signals.retry_after, None);

    let (base_url, server) = one_shot_server(
        "HTTP/1.1 429 Too Many Requests\r\nretry-after-ms: 1500\r\n\
         x-ratelimit-remaining-tokens: 0\r\nx-ratelimit-reset-tokens: 6m0s",
        r#"{"error":{"message":"Rate limit reached for tokens","type":"tokens","code":"rate_limit_exceeded"}}"#,
    )
    .await;
    let provider = provider_for(&base_url, PATIENT_MS);

    let error = provider
        .generate(&request("task-signals", "q"))
        .await
        .unwrap_err();
    server.await.unwrap();

    let ProviderError::Retryable {
        status: 429,
        retry_after,
        signals,
        ..
    } = error
    else {
        panic!("a 429 is retryable: {error:?}");
    };
    assert_eq!(retry_after, Some(Duration::from_millis(1500)));
    assert_eq!(signals.tokens.remaining, Some(0));
    assert_eq!(signals.tokens.resets_in, Some(Duration::from_secs(360)));
}
