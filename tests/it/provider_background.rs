//! The background-responses adapter against the mock provider over real HTTP on 127.0.0.1 (mock
//! on port 0): start then wait, recovery of a lost poll by the operation id (within the
//! response's retention), the errors a caller branches on, a hanging poll, and cancellation by
//! dropping `wait`. A lost create found again by the idempotency key when the provider honours
//! it (I6), a hanging create and a refused connection are `provider_transport`'s, run against
//! every adapter. Faults are forced with `PUT /faults` at rate 1.0, so no test depends on
//! chance. Needs no PostgreSQL or Kafka.

use std::time::Duration;

use crate::helpers::provider::{
    assert_bad_requests_refused, request, set_faults, start_mock, stats,
};
use crate::helpers::wait_until;
use replyd::provider::{
    BackgroundProvider, OpenAiResponsesProvider, ProviderApi, ProviderSettings, build_provider,
};
use replyd_core::provider::{OperationId, ProviderError, Recovery};
use replyd_lab::mock_provider::{FaultSettings, MockProfile, MockSettings};

/// Limit of one call (and of one whole `wait`) for tests that expect an answer: generous, since
/// no test waits on it.
const PATIENT_MS: u64 = 30_000;

/// Longest any condition in these tests is waited for.
const CONDITION_LIMIT: Duration = Duration::from_secs(10);

/// Settings whose request timeout (each request) and longest wait (all of one `wait`'s polls)
/// are both `limit_ms`.
fn settings_for(base_url: &str, limit_ms: u64) -> ProviderSettings {
    ProviderSettings {
        base_url: base_url.to_owned(),
        api_key: Some(replyd::config::Secret::new("sk-test")),
        request_timeout_ms: limit_ms,
        connect_timeout_ms: 2_000,
        default_model: "mock-model".into(),
        api: ProviderApi::BackgroundResponses,
        poll_interval_ms: 10,
        operation_max_wait_ms: limit_ms,
        ..ProviderSettings::default()
    }
}

fn provider_for(base_url: &str, limit_ms: u64) -> OpenAiResponsesProvider {
    OpenAiResponsesProvider::new(&settings_for(base_url, limit_ms))
        .expect("a loopback base URL is valid")
}

fn drop_after_work() -> FaultSettings {
    FaultSettings {
        drop_after_work_rate: 1.0,
        ..FaultSettings::default()
    }
}

#[tokio::test]
async fn start_then_wait_returns_the_generation_and_costs_one() {
    let mock = start_mock(MockSettings {
        latency_ms: 50,
        ..MockSettings::default()
    })
    .await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);

    let operation = provider
        .start(&request("task-1", "hello there"))
        .await
        .expect("the mock accepts the create");
    let generation = provider
        .wait(&operation)
        .await
        .expect("the response completes");

    assert_eq!(operation, OperationId("resp_1".into()));
    assert_eq!(
        generation.text,
        "reply to task-1: hello there [generation 1]"
    );
    assert_eq!(generation.model, "mock-model");
    assert_eq!(generation.provider_response_id.as_deref(), Some("resp_1"));
    assert!(generation.usage.is_some());
    let stats = stats(&mock).await;
    assert_eq!((stats.generations, stats.responses_created), (1, 1));
    assert_eq!(stats.per_key.get("task-1"), Some(&1));
    assert!(stats.responses_polled >= 1, "{stats:?}");
    assert_eq!(stats.requests, 0, "no chat request was made");
    mock.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn a_restarted_worker_waits_on_the_stored_id_and_gets_the_same_reply_without_a_new_generation()
 {
    let mock = start_mock(MockSettings {
        latency_ms: 50,
        ..MockSettings::default()
    })
    .await;
    // The first worker starts the operation, stores its id, and is gone.
    let stored = {
        let first_worker = provider_for(&mock.base_url(), PATIENT_MS);
        let operation = first_worker
            .start(&request("task-restart", "q"))
            .await
            .unwrap();
        serde_json::to_string(&operation).expect("an operation id serialises")
    };

    let operation: OperationId = serde_json::from_str(&stored).expect("and reads back");
    let restarted = provider_for(&mock.base_url(), PATIENT_MS);
    let recovered = restarted.wait(&operation).await.unwrap();
    let again = provider_for(&mock.base_url(), PATIENT_MS)
        .wait(&operation)
        .await
        .unwrap();

    assert_eq!(recovered, again);
    assert_eq!(recovered.text, "reply to task-restart: q [generation 1]");
    let stats = stats(&mock).await;
    assert_eq!((stats.generations, stats.responses_created), (1, 1));
}

#[tokio::test]
async fn when_every_poll_answer_is_lost_the_wait_ends_ambiguous_and_waiting_again_recovers() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    let operation = provider.start(&request("task-poll", "q")).await.unwrap();
    set_faults(&mock, drop_after_work()).await;

    // Lost polls are asked again within the wait, until its limit.
    let impatient = provider_for(&mock.base_url(), 500);
    let error = impatient.wait(&operation).await.unwrap_err();

    assert_eq!(error.kind(), "ambiguous", "{error:?}");
    assert!(
        mock.stats().responses_polled >= 3,
        "the wait polled again after lost answers: {}",
        mock.stats().responses_polled
    );
    set_faults(&mock, FaultSettings::default()).await;
    let recovered = provider.wait(&operation).await.unwrap();
    assert_eq!(recovered.text, "reply to task-poll: q [generation 1]");
    let stats = stats(&mock).await;
    assert_eq!(stats.generations, 1);
    assert_eq!(stats.per_key.get("task-poll"), Some(&1));
}

#[tokio::test]
async fn a_generation_longer_than_the_request_timeout_is_waited_for_in_one_wait() {
    // Each poll is bounded by the request timeout, the wait by the longest wait: a long
    // generation is one wait, not an attempt lost every request timeout.
    let mock = start_mock(MockSettings {
        latency_ms: 1_500,
        ..MockSettings::default()
    })
    .await;
    let provider = OpenAiResponsesProvider::new(&ProviderSettings {
        request_timeout_ms: 300,
        ..settings_for(&mock.base_url(), PATIENT_MS)
    })
    .unwrap();
    let operation = provider.start(&request("task-long", "q")).await.unwrap();

    let generation = provider
        .wait(&operation)
        .await
        .expect("the wait outlives the request timeout");

    assert_eq!(generation.text, "reply to task-long: q [generation 1]");
    assert_eq!(stats(&mock).await.generations, 1);
}

#[tokio::test]
async fn an_operation_still_running_at_the_longest_wait_is_still_running_not_ambiguous() {
    let mock = start_mock(MockSettings {
        latency_ms: 60_000,
        ..MockSettings::default()
    })
    .await;
    let provider = provider_for(&mock.base_url(), 400);
    let operation = provider.start(&request("task-slow", "q")).await.unwrap();

    let error = provider.wait(&operation).await.unwrap_err();

    assert_eq!(error.kind(), "still_running", "{error:?}");
    assert!(
        error.to_string().contains("provider.operation_max_wait_ms"),
        "{error}"
    );
    assert_eq!(error.ran(), replyd_core::domain::ProviderRan::Maybe);
    mock.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn waiting_on_an_unknown_id_says_the_operation_is_gone() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);

    let error = provider
        .wait(&OperationId("resp_never".into()))
        .await
        .unwrap_err();

    let ProviderError::OperationGone { operation, why } = &error else {
        panic!("expected OperationGone, got {error:?}");
    };
    assert_eq!(operation, "resp_never");
    assert!(why.contains("No response found"), "{why}");
    assert_eq!(stats(&mock).await.generations, 0);
}

#[tokio::test]
async fn a_provider_without_background_responses_refuses_the_create_with_404() {
    let mock = start_mock(MockSettings {
        background_responses: false,
        ..MockSettings::default()
    })
    .await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);

    let start = provider
        .start(&request("task-none", "q"))
        .await
        .unwrap_err();
    let wait = provider
        .wait(&OperationId("resp_1".into()))
        .await
        .unwrap_err();

    assert!(
        matches!(&start, ProviderError::Fatal { status: 404, message }
            if message.contains("no background responses")),
        "{start:?}"
    );
    assert!(
        matches!(wait, ProviderError::OperationGone { .. }),
        "{wait:?}"
    );
    let stats = stats(&mock).await;
    assert_eq!((stats.generations, stats.responses_created), (0, 0));
}

#[tokio::test]
async fn generate_on_the_responses_adapter_works_end_to_end_and_once_per_key() {
    let mock = start_mock(MockSettings {
        latency_ms: 20,
        honour_idempotency_key: true,
        ..MockSettings::default()
    })
    .await;
    let provider = build_provider(&settings_for(&mock.base_url(), PATIENT_MS)).unwrap();

    let first = provider.generate(&request("task-gen", "q")).await.unwrap();
    let second = provider.generate(&request("task-gen", "q")).await.unwrap();

    assert_eq!(provider.name(), "openai-responses");
    assert_eq!(provider.recovery(), Recovery::OperationId);
    assert!(provider.as_background().is_some());
    assert_eq!(first.text, "reply to task-gen: q [generation 1]");
    assert_eq!(first, second, "a re-sent create finds the first response");
    let stats = stats(&mock).await;
    assert_eq!((stats.generations, stats.responses_created), (1, 1));
}

#[tokio::test]
async fn build_provider_chooses_the_chat_adapter_by_default() {
    let settings = ProviderSettings {
        api: ProviderApi::default(),
        ..settings_for("http://127.0.0.1:9", PATIENT_MS)
    };

    let provider = build_provider(&settings).unwrap();

    assert_eq!(provider.name(), "openai");
    assert_eq!(provider.recovery(), Recovery::IdempotencyKey);
    assert!(provider.as_background().is_none());
}

#[tokio::test]
async fn the_background_capability_is_reachable_through_the_shared_provider() {
    let mock = start_mock(MockSettings::default()).await;
    let provider = build_provider(&settings_for(&mock.base_url(), PATIENT_MS)).unwrap();
    let background = provider
        .as_background()
        .expect("the responses adapter is a background provider");

    let operation = background.start(&request("task-dyn", "q")).await.unwrap();
    let generation = background.wait(&operation).await.unwrap();

    assert_eq!(generation.text, "reply to task-dyn: q [generation 1]");
}

#[tokio::test]
async fn injected_errors_on_create_and_poll_are_classified_like_chat() {
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

    let limited = provider.start(&request("task-f", "q")).await.unwrap_err();

    assert!(
        matches!(
            limited,
            ProviderError::Retryable { status: 429, retry_after: Some(after), .. }
                if after == Duration::from_secs(7)
        ),
        "{limited:?}"
    );
    set_faults(
        &mock,
        FaultSettings {
            error_rate: 1.0,
            ..FaultSettings::default()
        },
    )
    .await;
    let failed_create = provider.start(&request("task-f", "q")).await.unwrap_err();
    assert_eq!(
        failed_create,
        ProviderError::MaybeExecuted {
            status: 500,
            message: "injected fault: server error".into()
        }
    );
    assert_eq!(
        mock.stats().responses_created,
        0,
        "faults came before the work"
    );

    set_faults(&mock, FaultSettings::default()).await;
    let operation = provider.start(&request("task-f", "q")).await.unwrap();
    set_faults(
        &mock,
        FaultSettings {
            error_rate: 1.0,
            ..FaultSettings::default()
        },
    )
    .await;
    let failed_poll = provider_for(&mock.base_url(), 500)
        .wait(&operation)
        .await
        .unwrap_err();
    assert_eq!(failed_poll.kind(), "maybe_executed", "{failed_poll:?}");
    set_faults(&mock, FaultSettings::default()).await;
    provider
        .wait(&operation)
        .await
        .expect("the operation outlives a failed poll");
    assert_eq!(stats(&mock).await.generations, 1);
}

#[tokio::test]
async fn a_hanging_poll_is_ambiguous_within_the_wait_limit() {
    let mock = start_mock(MockSettings::default()).await;
    let operation = provider_for(&mock.base_url(), PATIENT_MS)
        .start(&request("task-hang", "q"))
        .await
        .unwrap();
    set_faults(
        &mock,
        FaultSettings {
            hang_rate: 1.0,
            ..FaultSettings::default()
        },
    )
    .await;
    let impatient = provider_for(&mock.base_url(), 300);

    let error = impatient.wait(&operation).await.unwrap_err();

    assert_eq!(error.kind(), "ambiguous", "{error:?}");
    // The hanging poll must not hold up a graceful shutdown.
    mock.shutdown().await.expect("clean shutdown");
}

#[tokio::test]
async fn a_malformed_create_gets_a_400_naming_the_problem() {
    let mock = start_mock(MockSettings::default()).await;
    let url = format!("{}/v1/responses", mock.base_url());
    let cases = [
        ("{not json", "invalid request body"),
        (
            r#"{"model":"m","background":true}"#,
            "missing field `input`",
        ),
        (
            r#"{"input":[],"background":true}"#,
            "'input' must contain at least one message",
        ),
        (
            r#"{"input":[{"role":"user","content":"hi"}]}"#,
            "'background' must be true",
        ),
    ];

    assert_bad_requests_refused(&url, &cases).await;

    let mut empty = request("task-empty", "q");
    empty.messages.clear();
    let error = provider_for(&mock.base_url(), PATIENT_MS)
        .start(&empty)
        .await
        .unwrap_err();
    assert_eq!(
        error,
        ProviderError::Fatal {
            status: 400,
            message: "'input' must contain at least one message".into()
        }
    );
    let stats = stats(&mock).await;
    assert_eq!((stats.generations, stats.responses_created), (0, 0));
}

#[tokio::test]
async fn dropping_wait_stops_the_polling() {
    // Ten minutes of latency: neither response completes within the test. The second mock is a
    // witness: while a live wait on it polls twenty more times, the dropped wait must not poll.
    let slow = || MockSettings {
        latency_ms: 600_000,
        ..MockSettings::default()
    };
    let dropped_mock = start_mock(slow()).await;
    let witness_mock = start_mock(slow()).await;
    let dropped = provider_for(&dropped_mock.base_url(), PATIENT_MS);
    let witness = provider_for(&witness_mock.base_url(), PATIENT_MS);
    let dropped_op = dropped.start(&request("task-drop", "q")).await.unwrap();
    let witness_op = witness.start(&request("task-witness", "q")).await.unwrap();

    tokio::select! {
        result = dropped.wait(&dropped_op) => {
            panic!("the response cannot complete within the latency: {result:?}")
        }
        () = wait_until("the dropped wait has polled a few times", CONDITION_LIMIT, || async {
            dropped_mock.stats().responses_polled >= 3
        }) => {}
    }
    // `select!` has dropped the wait future here.
    let polled_at_drop = dropped_mock.stats().responses_polled;

    let witness_start = witness_mock.stats().responses_polled;
    tokio::select! {
        result = witness.wait(&witness_op) => {
            panic!("the witness cannot complete within the latency: {result:?}")
        }
        () = wait_until("the witness has polled twenty times", CONDITION_LIMIT, || async {
            witness_mock.stats().responses_polled >= witness_start + 20
        }) => {}
    }

    // A poll already on the wire when the future was dropped may still be counted.
    let polled_after = dropped_mock.stats().responses_polled;
    assert!(
        polled_after <= polled_at_drop + 1,
        "polled {polled_at_drop} at the drop, {polled_after} after"
    );
    assert_eq!(dropped_mock.stats().generations, 0);
}

#[tokio::test]
async fn a_flaky_poll_is_asked_again_within_one_wait() {
    let mock = start_mock(MockSettings {
        latency_ms: 100,
        seed: 3,
        ..MockSettings::default()
    })
    .await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    let operation = provider.start(&request("task-flaky", "q")).await.unwrap();
    set_faults(
        &mock,
        FaultSettings {
            drop_after_work_rate: 0.5,
            ..FaultSettings::default()
        },
    )
    .await;

    let generation = provider
        .wait(&operation)
        .await
        .expect("half the polls lost, the wait still gets the reply");

    assert_eq!(generation.text, "reply to task-flaky: q [generation 1]");
    assert_eq!(stats(&mock).await.generations, 1);
}

#[tokio::test]
async fn by_default_a_resent_create_is_a_second_response_and_a_second_generation() {
    // OpenAI documents no Idempotency-Key for its responses either: the id is the only handle.
    let mock = start_mock(MockSettings::default()).await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);

    let first = provider.start(&request("task-again", "q")).await.unwrap();
    let second = provider.start(&request("task-again", "q")).await.unwrap();

    assert_eq!(first, OperationId("resp_1".into()));
    assert_eq!(second, OperationId("resp_2".into()));
    provider.wait(&first).await.unwrap();
    provider.wait(&second).await.unwrap();
    let stats = stats(&mock).await;
    assert_eq!((stats.generations, stats.responses_created), (2, 2));
}

#[tokio::test]
async fn an_ended_response_is_gone_after_its_retention_and_cannot_be_recovered_by_id() {
    let mock = start_mock(MockSettings {
        profile: MockProfile::OpenAiResponses,
        response_retention_ms: Some(300),
        ..MockSettings::default()
    })
    .await;
    let provider = provider_for(&mock.base_url(), PATIENT_MS);
    let operation = provider.start(&request("task-kept", "q")).await.unwrap();
    provider
        .wait(&operation)
        .await
        .expect("found while it is kept");
    let url = format!("{}/v1/responses/{}", mock.base_url(), operation.0);
    let status = || async { reqwest::get(&url).await.unwrap().status().as_u16() };

    wait_until("the response is forgotten", CONDITION_LIMIT, || async {
        status().await == 404
    })
    .await;

    assert_eq!(mock.stats().responses_forgotten, 1);
    let gone = provider.wait(&operation).await.unwrap_err();
    assert!(
        matches!(gone, ProviderError::OperationGone { .. }),
        "{gone:?}"
    );
    assert_eq!(stats(&mock).await.generations, 1);
}
