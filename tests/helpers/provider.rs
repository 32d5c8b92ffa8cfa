//! Fixtures of the provider tests: the mock provider on a loopback port, a request, its stats.

use std::net::SocketAddr;

use replyd::domain::{ChatMessage, Role};
use replyd::mock_provider::{self, MockHandle, MockSettings, StatsSnapshot};
use replyd::provider::GenerationRequest;

/// The mock provider on a free loopback port.
pub async fn start_mock(settings: MockSettings) -> MockHandle {
    let loopback: SocketAddr = "127.0.0.1:0".parse().expect("a literal socket address");
    mock_provider::spawn(settings, loopback)
        .await
        .expect("the mock provider binds a free loopback port")
}

/// A two-message request under idempotency key `key`.
pub fn request(key: &str, prompt: &str) -> GenerationRequest {
    GenerationRequest {
        idempotency_key: key.to_owned(),
        model: "mock-model".into(),
        messages: vec![
            ChatMessage {
                role: Role::System,
                content: "Be brief.".into(),
            },
            ChatMessage {
                role: Role::User,
                content: prompt.to_owned(),
            },
        ],
        max_output_tokens: Some(64),
    }
}

/// The mock's counters, read over HTTP as any client would.
pub async fn stats(mock: &MockHandle) -> StatsSnapshot {
    reqwest::get(format!("{}/stats", mock.base_url()))
        .await
        .expect("GET /stats")
        .json()
        .await
        .expect("/stats is JSON")
}
