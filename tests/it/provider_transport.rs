//! The failures of transport, met alike by every adapter, run against each of them over real
//! HTTP on 127.0.0.1 (the mock on port 0): a provider that hangs is a call whose answer was
//! lost (`Ambiguous`, after the request timeout), a refused connection surely did nothing
//! (`NotSent`), and an answer lost after the work is `Ambiguous` with the work done, a resend
//! then costing what the API lets the key save. Each failure is one module with one test per
//! adapter, so a failing test names both. Faults are forced with `PUT /faults` at rate 1.0, so
//! no test depends on chance. Needs no PostgreSQL or Kafka.

use std::sync::Arc;
use std::time::Duration;

use crate::helpers::provider::{request, set_faults, start_mock, stats};
use crate::helpers::wait_until;
use replyd::config::Secret;
use replyd::provider::{Provider, ProviderApi, ProviderSettings, build_provider};
use replyd_lab::mock_provider::{FaultSettings, MockSettings};

/// Client timeout for calls that expect an answer: generous, since no test waits on it.
const PATIENT_MS: u64 = 30_000;

/// An adapter under test: the API it calls, and what a resend of a call whose answer was lost
/// costs with a provider that honours the idempotency key where the API lets it.
#[derive(Debug, Clone, Copy)]
struct Adapter {
    api: ProviderApi,
    /// The generation the resend's reply is: the first (1) where the key finds the first
    /// call's work again, the second where the API has no key to honour (Messages).
    resent_generation: u64,
}

const CHAT: Adapter = Adapter {
    api: ProviderApi::ChatCompletions,
    resent_generation: 1,
};
const MESSAGES: Adapter = Adapter {
    api: ProviderApi::AnthropicMessages,
    resent_generation: 2,
};
const BACKGROUND: Adapter = Adapter {
    api: ProviderApi::BackgroundResponses,
    resent_generation: 1,
};

/// One test a failure per adapter, named by the failure (the module) and the adapter.
macro_rules! for_each_adapter {
    ($failure:ident) => {
        mod $failure {
            #[tokio::test]
            async fn chat_completions() {
                super::$failure(super::CHAT).await;
            }

            #[tokio::test]
            async fn anthropic_messages() {
                super::$failure(super::MESSAGES).await;
            }

            #[tokio::test]
            async fn background_responses() {
                super::$failure(super::BACKGROUND).await;
            }
        }
    };
}

/// `adapter` against `base_url`, each request (and a background wait as a whole) limited to
/// `limit_ms`.
fn provider_for(adapter: Adapter, base_url: &str, limit_ms: u64) -> Arc<dyn Provider> {
    build_provider(&ProviderSettings {
        base_url: base_url.to_owned(),
        api_key: Some(Secret::new("sk-test")),
        request_timeout_ms: limit_ms,
        connect_timeout_ms: 2_000,
        default_model: "mock-model".into(),
        api: adapter.api,
        poll_interval_ms: 10,
        operation_max_wait_ms: limit_ms,
        ..ProviderSettings::default()
    })
    .expect("a loopback base URL is valid")
}

for_each_adapter!(a_hanging_provider_is_ambiguous_after_the_client_timeout);

async fn a_hanging_provider_is_ambiguous_after_the_client_timeout(adapter: Adapter) {
    let mock = start_mock(MockSettings::default()).await;
    set_faults(
        &mock,
        FaultSettings {
            hang_rate: 1.0,
            ..FaultSettings::default()
        },
    )
    .await;
    let provider = provider_for(adapter, &mock.base_url(), 300);

    let error = provider
        .generate(&request("task-hang", "q"))
        .await
        .unwrap_err();

    assert_eq!(error.kind(), "ambiguous", "{adapter:?}: {error:?}");
    assert!(error.to_string().contains("300 ms"), "{adapter:?}: {error}");
    // The hanging request must not hold up a graceful shutdown.
    mock.shutdown().await.expect("clean shutdown");
}

for_each_adapter!(a_refused_connection_is_not_sent);

async fn a_refused_connection_is_not_sent(adapter: Adapter) {
    // A port that was just free: bound, read, released, so nothing listens there.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .expect("a free loopback port");
    let provider = provider_for(adapter, &format!("http://{addr}"), PATIENT_MS);

    let error = provider
        .generate(&request("task-refused", "q"))
        .await
        .unwrap_err();

    assert_eq!(error.kind(), "not_sent", "{adapter:?}: {error:?}");
}

for_each_adapter!(an_answer_lost_after_the_work_is_ambiguous_and_a_resend_costs_what_the_key_saves);

async fn an_answer_lost_after_the_work_is_ambiguous_and_a_resend_costs_what_the_key_saves(
    adapter: Adapter,
) {
    // A provider that honours the key: the resend finds the first call's work where the API
    // sends the key to one that can (the Messages API never deduplicates).
    let mock = start_mock(MockSettings {
        honour_idempotency_key: true,
        ..MockSettings::default()
    })
    .await;
    let provider = provider_for(adapter, &mock.base_url(), PATIENT_MS);
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

    assert_eq!(error.kind(), "ambiguous", "{adapter:?}: {error:?}");
    // The work was done (a background response's generation runs on after its create).
    wait_until(
        "the lost call's generation",
        Duration::from_secs(10),
        || async { stats(&mock).await.per_key.get("task-lost") == Some(&1) },
    )
    .await;
    set_faults(&mock, FaultSettings::default()).await;
    let again = provider.generate(&request("task-lost", "q")).await.unwrap();
    let generation = adapter.resent_generation;
    assert_eq!(
        again.text,
        format!("reply to task-lost: q [generation {generation}]"),
        "{adapter:?}"
    );
    let stats = stats(&mock).await;
    assert_eq!(
        stats.per_key.get("task-lost"),
        Some(&generation),
        "{adapter:?}"
    );
    assert_eq!(stats.generations, generation, "{adapter:?}");
    // A background create lost on its way back made the one response the resend found.
    let responses = u64::from(adapter.api == ProviderApi::BackgroundResponses);
    assert_eq!(stats.responses_created, responses, "{adapter:?}");
}
