//! `provider.base_url` in each form a provider documents, against the mock over real HTTP on
//! 127.0.0.1: the mock serves each API at the paths the real providers serve it (OpenAI's and
//! Anthropic's `/v1`, Gemini's `/v1beta/openai`, Azure's `/openai/v1` and its classic
//! deployments, which require `api-version`), so a base URL read wrong finds no route and
//! fails the call. Each form's host is the mock's; its path and query are the provider's.
//! Needs no PostgreSQL or Kafka.

use crate::helpers::provider::{request, start_mock, stats};
use replyd::config::Secret;
use replyd::provider::{
    AnthropicMessagesProvider, OpenAiChatProvider, OpenAiResponsesProvider, Provider, ProviderApi,
    ProviderSettings, Streaming,
};
use replyd_lab::mock_provider::{MockProfile, MockSettings};

fn settings(base_url: String, api: ProviderApi) -> ProviderSettings {
    ProviderSettings {
        base_url,
        api_key: Some(Secret::new("sk-test")),
        request_timeout_ms: 30_000,
        connect_timeout_ms: 2_000,
        default_model: "mock-model".into(),
        poll_interval_ms: 20,
        stream: Streaming::Never,
        api,
        ..ProviderSettings::default()
    }
}

#[tokio::test]
async fn each_openai_compatible_providers_documented_base_url_reaches_chat_completions() {
    let mock = start_mock(MockSettings::default()).await;
    let host = mock.base_url();
    // (the form, as its provider documents it; the path and query it must be sent to)
    let forms = [
        ("OpenAI, as its SDKs take it", "/v1", "/v1/chat/completions"),
        ("OpenAI, the server's root", "", "/v1/chat/completions"),
        (
            "the server's root with a slash",
            "/",
            "/v1/chat/completions",
        ),
        (
            "Gemini's OpenAI compatibility",
            "/v1beta/openai",
            "/v1beta/openai/chat/completions",
        ),
        (
            "Azure OpenAI's v1 API",
            "/openai/v1",
            "/openai/v1/chat/completions",
        ),
        (
            "Azure OpenAI's v1 API, without the version",
            "/openai",
            "/openai/v1/chat/completions",
        ),
        (
            "Azure OpenAI's classic deployment",
            "/openai/deployments/gpt-4o?api-version=2024-10-21",
            "/openai/deployments/gpt-4o/chat/completions?api-version=2024-10-21",
        ),
    ];
    for (n, (form, base_path, sent_to)) in forms.iter().enumerate() {
        let provider = OpenAiChatProvider::new(&settings(
            format!("{host}{base_path}"),
            ProviderApi::ChatCompletions,
        ))
        .unwrap_or_else(|e| panic!("{form}: {e}"));
        assert_eq!(
            provider.endpoint().as_str(),
            format!("{host}{sent_to}"),
            "{form}"
        );
        let generation = provider
            .generate(&request(&format!("task-{n}"), "hello"))
            .await
            .unwrap_or_else(|e| panic!("{form}: {e}"));
        assert!(
            generation.text.starts_with(&format!("reply to task-{n}")),
            "{form}"
        );
    }
    assert_eq!(stats(&mock).await.generations, forms.len() as u64);
}

#[tokio::test]
async fn azures_classic_deployment_answers_only_with_its_api_version() {
    let mock = start_mock(MockSettings::default()).await;
    let url = format!(
        "{}/openai/deployments/gpt-4o/chat/completions",
        mock.base_url()
    );
    let body =
        serde_json::json!({"model": "gpt-4o", "messages": [{"role": "user", "content": "hi"}]});
    let client = reqwest::Client::new();
    let without = client.post(&url).json(&body).send().await.unwrap();
    assert_eq!(without.status(), 404);
    let error: serde_json::Value = without.json().await.unwrap();
    assert_eq!(error["error"]["message"], "Resource not found");
    let with = client
        .post(format!("{url}?api-version=2024-10-21"))
        .json(&body)
        .send()
        .await
        .unwrap();
    assert_eq!(with.status(), 200);
    // replyd refuses the form without it before any call.
    let refused = OpenAiChatProvider::new(&settings(
        format!("{}/openai/deployments/gpt-4o", mock.base_url()),
        ProviderApi::ChatCompletions,
    ))
    .unwrap_err();
    assert!(refused.to_string().contains("api-version"), "{refused}");
}

#[tokio::test]
async fn a_background_response_is_created_and_polled_under_the_api_root_with_its_query() {
    let mock = start_mock(MockSettings {
        profile: MockProfile::OpenAiResponses,
        ..MockSettings::default()
    })
    .await;
    for (n, base_path) in ["/v1", "", "/openai/v1?api-version=preview"]
        .iter()
        .enumerate()
    {
        let base_url = format!("{}{base_path}", mock.base_url());
        let provider = OpenAiResponsesProvider::new(&settings(
            base_url.clone(),
            ProviderApi::BackgroundResponses,
        ))
        .unwrap();
        let background = provider.as_background().expect("background responses");
        let key = format!("task-{n}");
        let operation = background
            .start(&request(&key, "hello"))
            .await
            .unwrap_or_else(|e| panic!("{base_url}: {e}"));
        let generation = background
            .wait(&operation)
            .await
            .unwrap_or_else(|e| panic!("{base_url}: {e}"));
        assert!(
            generation.text.starts_with(&format!("reply to {key}")),
            "{base_url}"
        );
    }
    let stats = stats(&mock).await;
    assert_eq!((stats.responses_created, stats.generations), (3, 3));
}

#[tokio::test]
async fn anthropics_base_url_with_or_without_its_version_reaches_messages() {
    let mock = start_mock(MockSettings {
        profile: MockProfile::AnthropicMessages,
        ..MockSettings::default()
    })
    .await;
    for (n, base_path) in ["", "/v1", "/v1/"].iter().enumerate() {
        let base_url = format!("{}{base_path}", mock.base_url());
        let provider = AnthropicMessagesProvider::new(&settings(
            base_url.clone(),
            ProviderApi::AnthropicMessages,
        ))
        .unwrap();
        assert_eq!(
            provider.endpoint().as_str(),
            format!("{}/v1/messages", mock.base_url())
        );
        let generation = provider
            .generate(&request(&format!("task-{n}"), "hello"))
            .await
            .unwrap_or_else(|e| panic!("{base_url}: {e}"));
        assert!(!generation.text.is_empty(), "{base_url}");
    }
    assert_eq!(stats(&mock).await.generations, 3);
}
