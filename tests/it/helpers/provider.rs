//! Fixtures of the provider tests: the mock provider on a loopback port, a request, its stats,
//! and a one-shot server that shows what an adapter put on the wire.

use std::net::SocketAddr;

use replyd_core::domain::{ChatMessage, Role};
use replyd_core::provider::GenerationRequest;
use replyd_lab::mock_provider::{self, MockHandle, MockSettings, StatsSnapshot};

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

/// Switches the mock's faults over HTTP (`PUT /faults`), as a test harness outside the
/// process would; `faults` is a `FaultSettings` or any JSON of its shape.
pub async fn set_faults(mock: &MockHandle, faults: impl serde::Serialize) {
    let response = reqwest::Client::new()
        .put(format!("{}/faults", mock.base_url()))
        .json(&faults)
        .send()
        .await
        .expect("PUT /faults");
    let status = response.status();
    assert!(
        status.is_success(),
        "faults refused ({status}): {}",
        response.text().await.unwrap_or_default()
    );
}

/// Posts each `(body, problem)` case to `url` and asserts an OpenAI-style 400
/// `invalid_request_error` whose message names the problem.
pub async fn assert_bad_requests_refused(url: &str, cases: &[(&str, &str)]) {
    let client = reqwest::Client::new();
    for (body, problem) in cases {
        let response = client
            .post(url)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await
            .unwrap();
        assert_eq!(response.status(), 400, "{body}");
        let error: serde_json::Value = response.json().await.unwrap();
        let message = error["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(problem), "{body}: {error}");
        assert_eq!(error["error"]["type"], "invalid_request_error");
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

/// A server on a loopback port that takes one request, answers it with `head` (the status line
/// and headers, without the blank line) and `body`, and hands back the request as received
/// (head and body, the head's names in lower case). For what the mock does not show: the
/// headers an adapter sends, and answers the mock does not give (rate-limit headers).
pub async fn one_shot_server(head: &str, body: &str) -> (String, tokio::task::JoinHandle<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base_url = format!("http://{}", listener.local_addr().unwrap());
    let response = format!(
        "{head}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{body}",
        body.len()
    );
    let server = tokio::spawn(async move {
        let (mut socket, _) = listener.accept().await.unwrap();
        let mut received = Vec::new();
        let mut buf = [0u8; 4096];
        // Bounded: the head, then the body its content-length announces, at most 1 MiB.
        loop {
            let n = socket.read(&mut buf).await.unwrap();
            if n == 0 {
                break;
            }
            received.extend_from_slice(&buf[..n]);
            let text = String::from_utf8_lossy(&received).to_lowercase();
            if let Some(end) = text.find("\r\n\r\n") {
                let length = text[..end]
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .and_then(|v| v.trim().parse::<usize>().ok())
                    .unwrap_or(0);
                if received.len() >= end + 4 + length {
                    break;
                }
            }
            if received.len() > 1 << 20 {
                break;
            }
        }
        socket.write_all(response.as_bytes()).await.unwrap();
        let text = String::from_utf8_lossy(&received).into_owned();
        match text.split_once("\r\n\r\n") {
            Some((head, body)) => format!("{}\r\n\r\n{body}", head.to_lowercase()),
            None => text.to_lowercase(),
        }
    });
    (base_url, server)
}
