//! The OpenAI adapter against the mock provider over real HTTP on 127.0.0.1 (mock on port 0):
//! each error class the caller branches on, one generation per idempotency key (I6) when the
//! provider honours it and a second one when, like the real chat APIs, it does not, and
//! cancellation by dropping the call (a hang, a refused connection and a lost answer, met alike
//! by every adapter, are `provider_transport`'s). Faults are forced with `PUT /faults` at rate
//! 1.0, so no test depends on chance. Then the mock's capacity limits as a client meets them: a
//! burst refused at once with the real APIs' bodies and headers, requests at once capped. Needs
//! no PostgreSQL or Kafka.

use std::time::Duration;

use crate::helpers::provider::{
    assert_bad_requests_refused, one_shot_server, request, set_faults, start_mock, stats,
};
use crate::helpers::wait_until;
use futures_util::future::join_all;
use replyd::provider::{OpenAiChatProvider, Provider, ProviderSettings};
use replyd_core::provider::ProviderError;
use replyd_lab::mock_provider::{
    FaultSettings, KeyStats, LimitSettings, MockHandle, MockProfile, MockSettings,
};

/// Client timeout for tests that expect an answer: generous, since no test waits on it.
const PATIENT_MS: u64 = 30_000;

fn settings_for(base_url: &str, request_timeout_ms: u64) -> ProviderSettings {
    ProviderSettings {
        base_url: base_url.to_owned(),
        api_key: Some(replyd::config::Secret::new("sk-test")),
        request_timeout_ms,
        connect_timeout_ms: 2_000,
        default_model: "mock-model".into(),
        ..ProviderSettings::default()
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
    // take the wait-for-the-first path; the count holds either way. A provider that honours
    // the key (an opt-in: no real chat API documents one).
    let mock = start_mock(MockSettings {
        latency_ms: 200,
        honour_idempotency_key: true,
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
async fn a_repeated_key_gets_the_stored_reply_without_a_new_generation_when_the_provider_honours_it()
 {
    let mock = start_mock(MockSettings {
        honour_idempotency_key: true,
        ..MockSettings::default()
    })
    .await;
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

#[tokio::test]
async fn by_default_a_repeated_key_is_a_second_generation_as_with_the_real_chat_apis() {
    // OpenAI chat completions and Anthropic Messages document no Idempotency-Key: a resend is
    // new, paid work, and the mock plays them so unless a test opts in.
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);

    let first = provider
        .generate(&request("task-twice", "q"))
        .await
        .unwrap();
    let second = provider
        .generate(&request("task-twice", "q"))
        .await
        .unwrap();

    assert_ne!(first.text, second.text);
    assert_eq!(second.text, "reply to task-twice: q [generation 2]");
    assert_eq!(key_stats(&mock, "task-twice").await.generations, 2);
}

/// One answer of the mock, as a client saw it.
struct Answer {
    status: u16,
    headers: reqwest::header::HeaderMap,
    body: serde_json::Value,
}

impl Answer {
    fn header(&self, name: &str) -> &str {
        self.headers
            .get(name)
            .unwrap_or_else(|| panic!("no {name} header in {:?}", self.headers))
            .to_str()
            .unwrap()
    }
}

async fn post_chat(
    client: &reqwest::Client,
    mock: &MockHandle,
    body: &serde_json::Value,
) -> Answer {
    let response = client
        .post(format!("{}/v1/chat/completions", mock.base_url()))
        .json(body)
        .send()
        .await
        .expect("the mock answers");
    Answer {
        status: response.status().as_u16(),
        headers: response.headers().clone(),
        body: response.json().await.expect("a JSON body"),
    }
}

/// A chat body of `words` prompt words asking for at most `max_tokens`: it costs
/// `words + max_tokens` against a token limit.
fn chat_body(words: usize, max_tokens: u32) -> serde_json::Value {
    let prompt = vec!["word"; words].join(" ");
    serde_json::json!({
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
    })
}

/// `n` requests sent at once to a new mock with `settings`; their answers, with the mock.
/// Limits are per second: a burst must arrive within one for its count of refusals to be the
/// limit's. On a machine too busy to send `n` requests within 900 ms the burst is sent again
/// to a new mock, three times at most.
async fn burst(
    settings: MockSettings,
    n: usize,
    body: serde_json::Value,
) -> (MockHandle, Vec<Answer>) {
    let client = reqwest::Client::new();
    for _ in 0..3 {
        let mock = start_mock(settings.clone()).await;
        // Connections first, so the burst measures requests rather than handshakes.
        let warm =
            join_all((0..n).map(|_| client.get(format!("{}/healthz", mock.base_url())).send()))
                .await;
        assert!(warm.iter().all(|r| r.is_ok()));
        let started = std::time::Instant::now();
        let answers = join_all((0..n).map(|_| post_chat(&client, &mock, &body))).await;
        if started.elapsed() < Duration::from_millis(900) {
            return (mock, answers);
        }
    }
    panic!("three bursts of {n} requests each took a second or more to be answered");
}

#[tokio::test]
async fn a_burst_over_the_request_limit_gets_the_refusals_the_limit_implies_at_once_with_openais_body_and_headers()
 {
    // 600 requests per minute is 10 in any second.
    let settings = MockSettings {
        limits: LimitSettings {
            requests_per_minute: Some(600),
            ..LimitSettings::default()
        },
        ..MockSettings::default()
    };
    let (mock, answers) = burst(settings, 30, chat_body(3, 16)).await;

    let (admitted, refused): (Vec<&Answer>, Vec<&Answer>) =
        answers.iter().partition(|a| a.status == 200);
    assert_eq!((admitted.len(), refused.len()), (10, 20));
    for answer in &admitted {
        assert_eq!(answer.header("x-ratelimit-limit-requests"), "600");
        assert!(answer.headers.get("retry-after").is_none());
    }
    let mut remaining: Vec<u64> = admitted
        .iter()
        .map(|a| a.header("x-ratelimit-remaining-requests").parse().unwrap())
        .collect();
    remaining.sort_unstable();
    assert_eq!(remaining, (0..10).collect::<Vec<u64>>());
    for answer in &refused {
        assert_eq!(answer.status, 429);
        let error = &answer.body["error"];
        assert_eq!(error["type"], "requests", "{}", answer.body);
        assert_eq!(error["code"], "rate_limit_exceeded");
        assert_eq!(error["param"], serde_json::Value::Null);
        let message = error["message"].as_str().unwrap();
        assert!(
            message.starts_with(
                "Rate limit reached for requests on requests per min (RPM): Limit 600, Used 600, Requested 1."
            ),
            "{message}"
        );
        assert_eq!(answer.header("x-ratelimit-limit-requests"), "600");
        assert_eq!(answer.header("x-ratelimit-remaining-requests"), "0");
        let reset = answer.header("x-ratelimit-reset-requests");
        assert!(reset == "1s" || reset.ends_with("ms"), "{reset}");
        assert_eq!(answer.header("retry-after"), "1");
        assert!(answer.headers.get("x-ratelimit-limit-tokens").is_none());
    }
    // Refused requests did no work; the mock's own tally never saw the limit exceeded.
    let stats = stats(&mock).await;
    assert_eq!((stats.admitted, stats.generations), (10, 10));
    assert_eq!((stats.refused.requests, stats.refused.total()), (20, 20));
    assert_eq!(stats.requests, 30);
    assert!(stats.max_admitted_in_a_second <= 10, "{stats:?}");
    let tallied: u64 = stats.admissions_per_second.iter().map(|s| s.requests).sum();
    assert_eq!(tallied, 10);
}

#[tokio::test]
async fn a_burst_over_the_token_limit_is_refused_by_cost_and_a_request_no_second_admits_is_too_large()
 {
    // 21,000 tokens per minute is 350 in any second; each request costs 10 + 90 = 100.
    let settings = MockSettings {
        limits: LimitSettings {
            tokens_per_minute: Some(21_000),
            ..LimitSettings::default()
        },
        ..MockSettings::default()
    };
    let (mock, answers) = burst(settings, 10, chat_body(10, 90)).await;

    let admitted = answers.iter().filter(|a| a.status == 200).count();
    assert_eq!(admitted, 3);
    let refused: Vec<&Answer> = answers.iter().filter(|a| a.status == 429).collect();
    assert_eq!(refused.len(), 7);
    for answer in &refused {
        assert_eq!(answer.body["error"]["type"], "tokens", "{}", answer.body);
        assert_eq!(answer.body["error"]["code"], "rate_limit_exceeded");
        assert_eq!(answer.header("x-ratelimit-limit-tokens"), "21000");
        assert_eq!(answer.header("x-ratelimit-remaining-tokens"), "50");
        assert!(answer.header("x-ratelimit-reset-tokens").ends_with('s'));
        assert_eq!(answer.header("retry-after"), "1");
    }

    let client = reqwest::Client::new();
    let too_large = post_chat(&client, &mock, &chat_body(10, 400)).await;
    assert_eq!(too_large.status, 429);
    let message = too_large.body["error"]["message"].as_str().unwrap();
    assert!(
        message
            .starts_with("Request too large on tokens per min (TPM): Limit 21000, Requested 410."),
        "{message}"
    );
    let stats = stats(&mock).await;
    assert_eq!((stats.admitted, stats.refused.tokens), (3, 8));
    assert!(stats.max_tokens_in_a_second <= 350, "{stats:?}");
}

#[tokio::test]
async fn the_anthropic_profile_refuses_with_anthropics_body_and_headers() {
    let settings = MockSettings {
        profile: MockProfile::AnthropicMessages,
        limits: LimitSettings {
            requests_per_minute: Some(60),
            tokens_per_minute: Some(60_000),
            ..LimitSettings::default()
        },
        ..MockSettings::default()
    };
    let (_mock, answers) = burst(settings, 3, chat_body(10, 90)).await;

    assert_eq!(answers.iter().filter(|a| a.status == 200).count(), 1);
    let refused = answers.iter().find(|a| a.status == 429).expect("a refusal");
    assert_eq!(refused.body["type"], "error", "{}", refused.body);
    assert_eq!(refused.body["error"]["type"], "rate_limit_error");
    assert!(
        refused.body["error"]["message"]
            .as_str()
            .unwrap()
            .contains("rate limit of 60 requests per minute")
    );
    assert_eq!(refused.header("anthropic-ratelimit-requests-limit"), "60");
    assert_eq!(
        refused.header("anthropic-ratelimit-requests-remaining"),
        "0"
    );
    assert_eq!(refused.header("anthropic-ratelimit-tokens-limit"), "60000");
    assert_eq!(
        refused.header("anthropic-ratelimit-tokens-remaining"),
        "900"
    );
    for reset in [
        "anthropic-ratelimit-requests-reset",
        "anthropic-ratelimit-tokens-reset",
    ] {
        let at = chrono::DateTime::parse_from_rfc3339(refused.header(reset))
            .unwrap_or_else(|e| panic!("{reset} is not RFC 3339: {e}"));
        let ahead = at.signed_duration_since(chrono::Utc::now());
        assert!(ahead <= chrono::Duration::seconds(2), "{reset} {at}");
    }
    assert_eq!(refused.header("retry-after"), "1");
    assert!(refused.headers.get("x-ratelimit-limit-requests").is_none());
}

#[tokio::test]
async fn requests_in_progress_are_capped_and_a_place_frees_when_one_ends() {
    // Ten minutes of latency: the first two stay in progress until their clients go away.
    let mock = start_mock(MockSettings {
        latency_ms: 600_000,
        limits: LimitSettings {
            concurrent_requests: Some(2),
            ..LimitSettings::default()
        },
        ..MockSettings::default()
    })
    .await;
    let client = reqwest::Client::new();
    let url = format!("{}/v1/chat/completions", mock.base_url());
    let slow = || {
        let (client, url) = (client.clone(), url.clone());
        tokio::spawn(async move { client.post(url).json(&chat_body(1, 1)).send().await })
    };
    let first = slow();
    let _second = slow();
    let limit = Duration::from_secs(10);
    wait_until("two requests in progress", limit, || async {
        mock.stats().in_progress == 2
    })
    .await;

    let third = post_chat(&client, &mock, &chat_body(1, 1)).await;

    assert_eq!(third.status, 429);
    assert_eq!(third.body["error"]["code"], "rate_limit_exceeded");
    let message = third.body["error"]["message"].as_str().unwrap();
    assert!(
        message.starts_with("Too many requests in progress at once: Limit 2, In progress 2"),
        "{message}"
    );
    assert_eq!(third.header("retry-after"), "1");

    first.abort();
    wait_until("the abandoned request's place is free", limit, || async {
        mock.stats().in_progress == 1
    })
    .await;
    let fast = serde_json::json!({
        "messages": [{"role": "user", "content": "[mock:latency_ms=0] now"}],
    });
    let fourth = post_chat(&client, &mock, &fast).await;
    assert_eq!(fourth.status, 200, "{}", fourth.body);
    let stats = stats(&mock).await;
    assert_eq!(stats.max_in_progress, 2);
    assert_eq!((stats.refused.concurrent, stats.admitted), (1, 3));
}
