//! Each adapter's streamed answer against the mock provider over real HTTP on 127.0.0.1,
//! streaming as the real API does: the text handed to the sink piece by piece is the reply the
//! call returns, with the usage of the last chunk; a stream cut, stalled or ended by an error
//! event after the first tokens is the error class a lost or failed answer always was, with
//! what the sink had by then. Faults are forced at rate 1.0. Needs no PostgreSQL or Kafka.

use std::sync::Mutex;

use crate::helpers::provider::{one_shot_server, request, set_faults, start_mock, stats};
use replyd::config::Secret;
use replyd::provider::{Provider, ProviderApi, ProviderSettings, TextSink, build_provider};
use replyd_core::provider::{ProviderError, Usage};
use replyd_lab::mock_provider::{MockProfile, MockSettings};
use serde_json::json;

/// What a sink was handed.
#[derive(Default)]
struct Collected {
    pieces: Mutex<Vec<String>>,
    usage: Mutex<Option<Usage>>,
}

impl TextSink for Collected {
    fn text(&self, delta: &str) {
        self.pieces.lock().unwrap().push(delta.to_owned());
    }

    fn usage(&self, usage: Usage) {
        *self.usage.lock().unwrap() = Some(usage);
    }
}

impl Collected {
    fn text(&self) -> String {
        self.pieces.lock().unwrap().concat()
    }

    fn count(&self) -> usize {
        self.pieces.lock().unwrap().len()
    }
}

fn settings(base_url: &str, api: ProviderApi) -> ProviderSettings {
    ProviderSettings {
        base_url: base_url.to_owned(),
        api_key: Some(Secret::new("sk-test")),
        request_timeout_ms: 30_000,
        connect_timeout_ms: 2_000,
        stream_idle_timeout_ms: 1_000,
        default_model: "mock-model".into(),
        poll_interval_ms: 50,
        api,
        ..ProviderSettings::default()
    }
}

fn mock_for(api: ProviderApi) -> MockSettings {
    MockSettings {
        profile: match api {
            ProviderApi::AnthropicMessages => MockProfile::AnthropicMessages,
            ProviderApi::BackgroundResponses => MockProfile::OpenAiResponses,
            ProviderApi::ChatCompletions => MockProfile::OpenAiChat,
        },
        background_responses: api == ProviderApi::BackgroundResponses,
        latency_ms: 20,
        stream_chunk_chars: 10,
        stream_chunk_interval_ms: Some(5),
        ..MockSettings::default()
    }
}

const LONG: &str = "[mock:reply_chars=300] what are the key decisions?";

const APIS: [ProviderApi; 3] = [
    ProviderApi::ChatCompletions,
    ProviderApi::AnthropicMessages,
    ProviderApi::BackgroundResponses,
];

async fn streamed(
    provider: &dyn Provider,
    key: &str,
    sink: &Collected,
) -> Result<replyd_core::provider::Generation, ProviderError> {
    match provider.as_background() {
        Some(background) => {
            let operation = background.start(&request(key, LONG)).await?;
            background.wait_streamed(&operation, sink).await
        }
        None => provider.generate_streamed(&request(key, LONG), sink).await,
    }
}

#[tokio::test]
async fn each_apis_stream_is_the_reply_in_pieces_with_its_reported_usage() {
    for api in APIS {
        let mock = start_mock(mock_for(api)).await;
        let provider = build_provider(&settings(&mock.base_url(), api)).unwrap();
        let sink = Collected::default();
        let generation = streamed(provider.as_ref(), "task-1", &sink)
            .await
            .unwrap_or_else(|e| panic!("{api:?}: {e}"));
        assert_eq!(generation.text.chars().count(), 300, "{api:?}");
        assert_eq!(sink.text(), generation.text, "{api:?}");
        assert!(sink.count() >= 25, "{api:?}: {} pieces", sink.count());
        assert!(
            generation.usage.is_some(),
            "{api:?}: the last chunk's usage"
        );
        assert_eq!(*sink.usage.lock().unwrap(), generation.usage, "{api:?}");
        let stats = stats(&mock).await;
        assert_eq!(stats.generations, 1, "{api:?}");
        // A background response's create is read only to its first event (its id), and its
        // events are read whole by the wait.
        let left_after_the_id = u64::from(api == ProviderApi::BackgroundResponses);
        assert_eq!(
            (stats.streams_started, stats.streams_completed),
            (1 + left_after_the_id, 1),
            "{api:?}"
        );
    }
}

#[tokio::test]
async fn a_cut_or_stalled_stream_is_ambiguous_with_the_text_it_had() {
    for api in [ProviderApi::ChatCompletions, ProviderApi::AnthropicMessages] {
        for fault in ["stream_cut_rate", "stream_stall_rate"] {
            let mock = start_mock(mock_for(api)).await;
            set_faults(
                &mock,
                json!({fault: 1.0, "stream_fault_after_chunks": 4, "hang_ms": 5_000}),
            )
            .await;
            let provider = build_provider(&settings(&mock.base_url(), api)).unwrap();
            let sink = Collected::default();
            let error = streamed(provider.as_ref(), "task-1", &sink)
                .await
                .expect_err("no final event");
            match &error {
                ProviderError::Ambiguous { message } => {
                    assert!(
                        message.contains("after 40 characters"),
                        "{api:?} {fault}: {message}"
                    );
                }
                other => panic!("{api:?} {fault}: {other:?}"),
            }
            assert_eq!(sink.count(), 4, "{api:?} {fault}");
            // Chat completions report usage only at the end; Anthropic at the start too.
            let usage = *sink.usage.lock().unwrap();
            match api {
                ProviderApi::AnthropicMessages => assert!(usage.is_some(), "{fault}"),
                _ => assert_eq!(usage, None, "{fault}: not reported"),
            }
            assert_eq!(stats(&mock).await.generations, 1);
        }
    }
}

/// Some OpenAI-compatible servers end a chat completion's stream after the chunk with its
/// `finish_reason` (and the usage chunk) without `data: [DONE]`, and the SDKs take the finish
/// reason and the body's clean end as the end of the answer; likewise Anthropic's SDKs build
/// the message from a stream whose body ends after `message_delta` (its `stop_reason`) without
/// `message_stop`. A stream cut before the finish reason is still a lost answer.
#[tokio::test]
async fn a_stream_that_ends_cleanly_after_its_finish_reason_is_the_whole_reply() {
    for api in [ProviderApi::ChatCompletions, ProviderApi::AnthropicMessages] {
        let mock = start_mock(mock_for(api)).await;
        set_faults(&mock, json!({"stream_without_final_event": true})).await;
        let provider = build_provider(&settings(&mock.base_url(), api)).unwrap();
        let sink = Collected::default();
        let generation = streamed(provider.as_ref(), "task-1", &sink)
            .await
            .unwrap_or_else(|e| panic!("{api:?}: {e}"));
        assert_eq!(generation.text.chars().count(), 300, "{api:?}");
        assert_eq!(sink.text(), generation.text, "{api:?}");
        // The usage chunk comes after the finish reason, and before where [DONE] would be.
        assert!(generation.usage.is_some(), "{api:?}: the usage reported");
        assert_eq!(stats(&mock).await.generations, 1, "{api:?}");

        set_faults(
            &mock,
            json!({"stream_without_final_event": true, "stream_cut_rate": 1.0,
                   "stream_fault_after_chunks": 4}),
        )
        .await;
        let error = streamed(provider.as_ref(), "task-2", &Collected::default())
            .await
            .expect_err("cut before its finish reason");
        assert!(
            matches!(&error, ProviderError::Ambiguous { message } if message.contains("after 40 characters")),
            "{api:?}: {error:?}"
        );
    }
}

/// The SSE spec joins an event's `data:` lines with a newline, and a JSON chunk written over
/// two lines is the same JSON: each API's stream read with every event split so is the reply.
#[tokio::test]
async fn events_whose_data_is_split_over_two_lines_are_read_as_the_spec_joins_them() {
    for api in APIS {
        let mock = start_mock(mock_for(api)).await;
        set_faults(&mock, json!({"stream_split_data": true})).await;
        let provider = build_provider(&settings(&mock.base_url(), api)).unwrap();
        let sink = Collected::default();
        let generation = streamed(provider.as_ref(), "task-1", &sink)
            .await
            .unwrap_or_else(|e| panic!("{api:?}: {e}"));
        assert_eq!(generation.text.chars().count(), 300, "{api:?}");
        assert_eq!(sink.text(), generation.text, "{api:?}");
        assert!(generation.usage.is_some(), "{api:?}");
    }
}

#[tokio::test]
async fn an_error_event_after_the_first_tokens_may_have_executed() {
    for (api, status) in [
        (ProviderApi::ChatCompletions, 500),
        (ProviderApi::AnthropicMessages, 529),
    ] {
        let mock = start_mock(mock_for(api)).await;
        set_faults(
            &mock,
            json!({"stream_error_rate": 1.0, "stream_fault_after_chunks": 3, "error_status": status}),
        )
        .await;
        let provider = build_provider(&settings(&mock.base_url(), api)).unwrap();
        let sink = Collected::default();
        let error = streamed(provider.as_ref(), "task-1", &sink)
            .await
            .expect_err("an error event");
        assert!(
            matches!(error, ProviderError::MaybeExecuted { status: s, .. } if s == status),
            "{api:?}: {error:?}"
        );
        assert_eq!(error.ran(), replyd_core::domain::ProviderRan::Maybe);
        assert_eq!(sink.count(), 3, "{api:?}");
    }
}

#[tokio::test]
async fn a_background_responses_broken_stream_is_picked_up_after_its_last_event_with_one_generation()
 {
    let api = ProviderApi::BackgroundResponses;
    let mock = start_mock(mock_for(api)).await;
    // Every connection breaks after 5 deltas; the response goes on at the provider.
    set_faults(
        &mock,
        json!({"stream_cut_rate": 1.0, "stream_fault_after_chunks": 5}),
    )
    .await;
    let provider = build_provider(&settings(&mock.base_url(), api)).unwrap();
    let sink = Collected::default();
    let generation = streamed(provider.as_ref(), "task-1", &sink)
        .await
        .expect("resumed, then polled");
    // Each resume went on after the last event it had: no piece twice, and the rest of the
    // text came by polling once the resumes were spent.
    let text = sink.text();
    assert!(generation.text.starts_with(&text), "{text:?}");
    assert!(
        sink.count() >= 10,
        "{} pieces over the resumes",
        sink.count()
    );
    let stats = stats(&mock).await;
    assert_eq!((stats.responses_created, stats.generations), (1, 1));
    assert!(stats.streams_cut >= 2, "{stats:?}");
}

#[tokio::test]
async fn a_server_that_ignores_stream_and_answers_the_whole_reply_is_read_as_such() {
    let body = r#"{"id":"chatcmpl-1","object":"chat.completion","model":"m-1","choices":[{"index":0,"message":{"role":"assistant","content":"whole"},"finish_reason":"stop"}],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}"#;
    let (base_url, server) = one_shot_server("HTTP/1.1 200 OK", body).await;
    let provider = build_provider(&settings(&base_url, ProviderApi::ChatCompletions)).unwrap();
    let sink = Collected::default();
    let generation = provider
        .generate_streamed(&request("task-1", "hello"), &sink)
        .await
        .expect("a whole answer");
    assert_eq!(generation.text, "whole");
    assert_eq!(sink.count(), 0, "nothing was streamed");
    let sent = server.await.unwrap();
    assert!(sent.contains(r#""stream":true"#), "{sent}");
    assert!(sent.contains(r#""include_usage":true"#), "{sent}");
}
