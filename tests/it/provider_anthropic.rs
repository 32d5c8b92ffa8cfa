//! The Anthropic Messages adapter against the mock provider's `/v1/messages` over real HTTP on
//! 127.0.0.1 (mock on port 0): a reply, each error class the caller branches on as Anthropic
//! documents them (a 429 with its `retry-after`, a 529, a 500, the 4xx), and what the adapter
//! puts on the wire. A hang, a refused connection and a lost answer (ambiguous, and with no
//! idempotency key to lean on generated again when resent) are `provider_transport`'s, run
//! against every adapter. Faults are forced with `PUT /faults` at rate 1.0, so no test depends
//! on chance. Needs no PostgreSQL or Kafka.

use std::time::Duration;

use crate::helpers::provider::{one_shot_server, request, set_faults, start_mock, stats};
use replyd::config::Secret;
use replyd::provider::{
    AnthropicMessagesProvider, Provider, ProviderApi, ProviderSettings, build_provider,
};
use replyd_core::provider::{ProviderError, Recovery};
use replyd_lab::mock_provider::{FaultSettings, MockSettings};

/// Client timeout for tests that expect an answer: generous, since no test waits on it.
const PATIENT_MS: u64 = 30_000;

fn settings_for(base_url: &str, request_timeout_ms: u64) -> ProviderSettings {
    ProviderSettings {
        base_url: base_url.to_owned(),
        api_key: Some(Secret::new("sk-ant-test")),
        request_timeout_ms,
        connect_timeout_ms: 2_000,
        default_model: "claude-mock".into(),
        api: ProviderApi::AnthropicMessages,
        ..ProviderSettings::default()
    }
}

fn provider_for(base_url: &str, request_timeout_ms: u64) -> AnthropicMessagesProvider {
    AnthropicMessagesProvider::new(&settings_for(base_url, request_timeout_ms))
        .expect("a loopback base URL is valid")
}

fn failing_with(status: u16) -> FaultSettings {
    FaultSettings {
        error_rate: 1.0,
        error_status: status,
        ..FaultSettings::default()
    }
}

#[tokio::test]
async fn a_reply_from_the_mock_is_one_counted_generation() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = build_provider(&settings_for(&mock.base_url(), PATIENT_MS)).unwrap();

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
        Some("msg_mock_1")
    );
    let usage = generation.usage.expect("usage is reported");
    // "Be brief." (the system prompt) and "hello there": four words.
    assert_eq!(usage.prompt_tokens, 4);
    assert_eq!(usage.completion_tokens, 7);
    assert!(generation.rate_signals.is_empty());
    assert_eq!(provider.name(), "anthropic");
    assert_eq!(provider.recovery(), Recovery::None);
    let stats = stats(&mock).await;
    assert_eq!((stats.requests, stats.generations), (1, 1));
    assert_eq!(stats.per_key.get("task-1"), Some(&1));
    mock.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn a_rate_limit_is_retryable_after_the_providers_delay_and_did_no_work() {
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

    let ProviderError::Retryable {
        status: 429,
        retry_after,
        signals,
        message,
    } = &error
    else {
        panic!("a 429 is retryable: {error:?}");
    };
    assert_eq!(*retry_after, Some(Duration::from_secs(7)));
    assert_eq!(signals.retry_after, Some(Duration::from_secs(7)));
    assert!(message.starts_with("rate_limit_error: "), "{message}");
    assert_eq!(stats(&mock).await.generations, 0);
}

#[tokio::test]
async fn an_overloaded_api_is_retryable_and_a_server_error_may_have_executed() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);

    set_faults(&mock, failing_with(529)).await;
    let overloaded = provider
        .generate(&request("task-529", "q"))
        .await
        .unwrap_err();
    set_faults(&mock, failing_with(500)).await;
    let failed = provider
        .generate(&request("task-500", "q"))
        .await
        .unwrap_err();

    assert!(
        matches!(&overloaded, ProviderError::Retryable { status: 529, message, .. }
            if message.starts_with("overloaded_error: ")),
        "{overloaded:?}"
    );
    assert_eq!(
        failed,
        ProviderError::MaybeExecuted {
            status: 500,
            message: "api_error: injected fault: server error".into()
        }
    );
}

#[tokio::test]
async fn client_errors_are_fatal_with_anthropics_error_type() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    for (status, kind) in [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (403, "permission_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
    ] {
        set_faults(&mock, failing_with(status)).await;

        let error = provider
            .generate(&request("task-4xx", "q"))
            .await
            .unwrap_err();

        assert_eq!(
            error,
            ProviderError::Fatal {
                status,
                message: format!("{kind}: injected fault: server error"),
            }
        );
    }
    assert_eq!(stats(&mock).await.generations, 0);
}

#[tokio::test]
async fn a_request_without_a_key_or_a_known_version_is_refused_by_the_mock() {
    let mock = start_mock(MockSettings::default()).await;
    let keyless = AnthropicMessagesProvider::new(&ProviderSettings {
        api_key: None,
        ..settings_for(&mock.base_url(), PATIENT_MS)
    })
    .unwrap();
    let from_the_future = AnthropicMessagesProvider::new(&ProviderSettings {
        anthropic_version: "2099-01-01".into(),
        ..settings_for(&mock.base_url(), PATIENT_MS)
    })
    .unwrap();

    let no_key = keyless.generate(&request("k", "q")).await.unwrap_err();
    let bad_version = from_the_future
        .generate(&request("k", "q"))
        .await
        .unwrap_err();

    assert_eq!(
        no_key,
        ProviderError::Fatal {
            status: 401,
            message: "authentication_error: x-api-key header is required".into()
        }
    );
    assert_eq!(
        bad_version,
        ProviderError::Fatal {
            status: 400,
            message: "invalid_request_error: anthropic-version: unknown version `2099-01-01`"
                .into()
        }
    );
    assert_eq!(stats(&mock).await.generations, 0);
}

#[tokio::test]
async fn a_bad_body_gets_anthropics_400_naming_the_problem() {
    let mock = start_mock(MockSettings::default()).await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/messages", mock.base_url());
    for (body, problem) in [
        (
            r#"{"model":"m","messages":[{"role":"user","content":"x"}]}"#,
            "missing field `max_tokens`",
        ),
        (
            r#"{"model":"m","max_tokens":5,"messages":[{"role":"system","content":"x"}]}"#,
            "messages.0.role",
        ),
        (
            r#"{"model":"m","max_tokens":5,"messages":[]}"#,
            "at least one message",
        ),
    ] {
        let response = client
            .post(&url)
            .header("x-api-key", "k")
            .header("anthropic-version", "2023-06-01")
            .header("content-type", "application/json")
            .body(body)
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{body}");
        let error: serde_json::Value = response.json().await.unwrap();
        assert_eq!(error["type"], "error", "{error}");
        assert_eq!(error["error"]["type"], "invalid_request_error", "{error}");
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(problem), "{body}: {error}");
    }
    assert_eq!(stats(&mock).await.generations, 0);
}

#[tokio::test]
async fn the_adapter_sends_anthropics_headers_and_body_and_reads_its_rate_limits() {
    let (base_url, server) = one_shot_server(
        "HTTP/1.1 200 OK\r\nanthropic-ratelimit-requests-limit: 1000\r\n\
         anthropic-ratelimit-requests-remaining: 999\r\n\
         anthropic-ratelimit-requests-reset: 2999-01-01T00:00:00Z\r\n\
         anthropic-ratelimit-output-tokens-limit: 16000\r\n\
         anthropic-ratelimit-output-tokens-remaining: 15000",
        r#"{"id":"msg_1","type":"message","role":"assistant","model":"claude-x",
            "content":[{"type":"text","text":"ok"}],"stop_reason":"end_turn",
            "usage":{"input_tokens":5,"output_tokens":1}}"#,
    )
    .await;
    let mut settings = settings_for(&base_url, PATIENT_MS);
    settings
        .extra_headers
        .insert("anthropic-beta".into(), Secret::new("some-beta-2025"));
    let provider = AnthropicMessagesProvider::new(&settings).unwrap();

    let generation = provider.generate(&request("task-wire", "q")).await.unwrap();

    let received = server.await.unwrap();
    let (head, body) = received.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("post /v1/messages http/1.1"), "{head}");
    for header in [
        "x-api-key: sk-ant-test\r\n",
        "anthropic-version: 2023-06-01\r\n",
        "anthropic-beta: some-beta-2025\r\n",
        "idempotency-key: task-wire\r\n",
        "content-type: application/json\r\n",
    ] {
        assert!(head.contains(header), "{header} in {head}");
    }
    assert!(!head.contains("authorization:"), "{head}");
    let body: serde_json::Value = serde_json::from_str(body).unwrap();
    assert_eq!(
        body,
        serde_json::json!({
            "model": "mock-model",
            "max_tokens": 64,
            "system": "Be brief.",
            "messages": [{"role": "user", "content": "q"}],
        })
    );
    assert_eq!(generation.text, "ok");
    let signals = generation.rate_signals;
    assert_eq!(signals.requests.limit, Some(1000));
    assert_eq!(signals.requests.remaining, Some(999));
    assert!(signals.requests.resets_in.is_some());
    assert_eq!(signals.output_tokens.remaining, Some(15_000));
}
