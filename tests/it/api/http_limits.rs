//! The HTTP layer's limits, some sent over a raw TCP connection (bytes an HTTP client will
//! not send): headers over the size or count limit, a byte HTTP does not allow, a key or
//! credential sent twice, a half-sent header block, and a declared body over the limit.

use std::time::Duration;

use super::{body, key_for, start, start_with};
use crate::helpers::api::Api;
use replyd::api::settings::ApiSettings;
use reqwest::StatusCode;
use serde_json::Value;

/// A request whose headers are over `api.max_header_bytes` is a `431` problem, and nothing is
/// written; one just under the limit is served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_over_the_limit_are_refused_with_431_and_write_nothing() {
    let api = start_with(ApiSettings {
        max_header_bytes: 4096,
        ..ApiSettings::default()
    })
    .await;
    let send = |padding: usize| {
        api.client
            .post(format!("{}/v1/replies", api.base))
            .bearer_auth(&api.key)
            .header("Idempotency-Key", format!("press-{padding}"))
            .header("X-Padding", "p".repeat(padding))
            .json(&body("q"))
            .send()
    };
    let refused = send(5000).await.unwrap();
    assert_eq!(
        refused.status(),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/headers_too_large")
            && problem["detail"]
                .as_str()
                .unwrap()
                .contains("api.max_header_bytes"),
        "{problem}"
    );
    assert_eq!(api.counts().await.0, 0, "nothing written");
    let served = send(2000).await.unwrap();
    assert_eq!(served.status(), StatusCode::ACCEPTED);
}

/// One answer read off a raw TCP connection.
struct RawResponse {
    status_line: String,
    /// Names in lower case.
    headers: Vec<(String, String)>,
    body: Vec<u8>,
}

impl RawResponse {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn problem(&self) -> Value {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "{}: {:?}",
            self.status_line,
            self.headers
        );
        serde_json::from_slice(&self.body).unwrap()
    }
}

/// Sends `request` as is over a new TCP connection to the API (for bytes an HTTP client will
/// not send) and reads one answer: its head and a `Content-Length` body (30 s at most).
async fn raw_exchange(api: &Api, request: &[u8]) -> RawResponse {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let addr = api.base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream.write_all(request).await.unwrap();
    let read = async {
        let mut received = Vec::new();
        let mut chunk = [0u8; 4096];
        loop {
            if let Some(end) = received.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&received[..end]).into_owned();
                let mut lines = head.split("\r\n");
                let status_line = lines.next().unwrap().to_owned();
                let headers: Vec<(String, String)> = lines
                    .filter_map(|l| l.split_once(':'))
                    .map(|(n, v)| (n.trim().to_ascii_lowercase(), v.trim().to_owned()))
                    .collect();
                let length: usize = headers
                    .iter()
                    .find(|(n, _)| n == "content-length")
                    .map_or(0, |(_, v)| v.parse().unwrap());
                if received.len() >= end + 4 + length {
                    let body = received[end + 4..end + 4 + length].to_vec();
                    return RawResponse {
                        status_line,
                        headers,
                        body,
                    };
                }
            }
            let n = stream.read(&mut chunk).await.unwrap();
            assert!(
                n > 0,
                "the connection closed before a whole answer: {:?}",
                String::from_utf8_lossy(&received)
            );
            received.extend_from_slice(&chunk[..n]);
        }
    };
    tokio::time::timeout(Duration::from_secs(30), read)
        .await
        .expect("an answer within 30 s")
}

/// More header fields than `api.max_headers` is a `431` problem naming the setting, whether
/// the application counts them or hyper's own (higher) cap does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_many_header_fields_are_a_431_problem_naming_api_max_headers() {
    let api = start().await;
    let mut request = api
        .client
        .post(format!("{}/v1/replies", api.base))
        .bearer_auth(&api.key)
        .header("Idempotency-Key", "many-headers")
        .json(&body("q"));
    for n in 0..150 {
        request = request.header(format!("x-extra-{n}"), "1");
    }
    let refused = request.send().await.unwrap();
    assert_eq!(
        refused.status(),
        StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE
    );
    assert_eq!(
        refused.headers().get("content-type").map(|v| v.as_bytes()),
        Some(&b"application/problem+json"[..]),
        "{:?}",
        refused.headers()
    );
    let problem: Value = refused.json().await.unwrap();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/headers_too_large")
            && problem["detail"]
                .as_str()
                .unwrap()
                .contains("api.max_headers"),
        "{problem}"
    );
    // Far beyond: hyper's own cap refuses it before the application sees it.
    let mut flood = String::from("GET /v1/quota HTTP/1.1\r\nHost: localhost\r\n");
    for n in 0..300 {
        flood.push_str(&format!("x{n}:1\r\n"));
    }
    flood.push_str("\r\n");
    let refused = raw_exchange(&api, flood.as_bytes()).await;
    assert!(
        refused.status_line.starts_with("HTTP/1.1 431"),
        "{}",
        refused.status_line
    );
    let problem = refused.problem();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/headers_too_large")
            && problem["detail"]
                .as_str()
                .unwrap()
                .contains("api.max_headers"),
        "{problem}"
    );
    assert_eq!(problem["status"], 431);
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
}

/// A request head hyper's parser refuses (a DEL byte in `Idempotency-Key`) is answered with a
/// `400` problem naming the header, not hyper's bare status line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_header_with_a_byte_http_does_not_allow_is_a_400_problem_naming_it() {
    let api = start().await;
    let request = format!(
        "POST /v1/replies HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\n\
         Idempotency-Key: press\x7f1\r\nContent-Length: 0\r\n\r\n",
        api.key
    );
    let refused = raw_exchange(&api, request.as_bytes()).await;
    assert!(
        refused.status_line.starts_with("HTTP/1.1 400"),
        "{}",
        refused.status_line
    );
    let problem = refused.problem();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/malformed_request"),
        "{problem}"
    );
    assert_eq!(problem["status"], 400);
    let detail = problem["detail"].as_str().unwrap();
    assert!(
        detail.contains("Idempotency-Key") && detail.contains("0x7F"),
        "{detail}"
    );
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
}

/// An `Idempotency-Key` or `Authorization` sent twice with different values is ambiguous and
/// refused (`400`) before anything is written; the same value twice is one value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_or_credential_sent_twice_with_different_values_is_refused() {
    let api = start().await;
    let other = key_for(&api.db, "globex").await;
    let url = format!("{}/v1/replies", api.base);
    let twice = |keys: [&str; 2], auths: [&str; 2]| {
        api.client
            .post(&url)
            .header("Idempotency-Key", keys[0])
            .header("Idempotency-Key", keys[1])
            .header("Authorization", format!("Bearer {}", auths[0]))
            .header("Authorization", format!("Bearer {}", auths[1]))
            .json(&body("q"))
            .send()
    };
    let cases = [
        (
            "two keys",
            twice(["press-1", "press-2"], [&api.key, &api.key])
                .await
                .unwrap(),
            "invalid_idempotency_key",
            "Idempotency-Key",
        ),
        (
            "two credentials",
            twice(["press-1", "press-1"], [&api.key, &other])
                .await
                .unwrap(),
            "invalid_authorization",
            "Authorization",
        ),
    ];
    for (what, refused, kind, header) in cases {
        assert_eq!(refused.status(), StatusCode::BAD_REQUEST, "{what}");
        let problem: Value = refused.json().await.unwrap();
        assert!(
            problem["type"].as_str().unwrap().ends_with(kind),
            "{what}: {problem}"
        );
        assert!(
            problem["detail"].as_str().unwrap().contains(header),
            "{what}: {problem}"
        );
    }
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
    let same = twice(["press-1", "press-1"], [&api.key, &api.key])
        .await
        .unwrap();
    assert_eq!(same.status(), StatusCode::ACCEPTED);
}

/// A client that sends half a header block and stops is cut off after
/// `api.header_read_timeout_ms`, rather than holding a connection open without end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_sent_header_block_is_closed_after_the_header_read_timeout() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let api = start_with(ApiSettings {
        header_read_timeout_ms: 200,
        ..ApiSettings::default()
    })
    .await;
    let addr = api.base.trim_start_matches("http://");
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    stream
        .write_all(b"POST /v1/replies HTTP/1.1\r\nHost: localhost\r\nIdempotency-Key: slow\r\n")
        .await
        .unwrap();
    let mut received = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(30), async {
        let mut chunk = [0u8; 1024];
        loop {
            match stream.read(&mut chunk).await {
                Ok(0) | Err(_) => return,
                Ok(n) => received.extend_from_slice(&chunk[..n]),
            }
        }
    })
    .await;
    assert!(
        closed.is_ok(),
        "the connection is still open 30 s after half a header block"
    );
}

/// `Expect: 100-continue` with a declared body over `api.max_body_bytes` is answered `413`
/// at once, before the body is read: no `100 Continue` invites the client to send it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_declared_body_over_the_limit_is_413_before_any_100_continue() {
    let api = start().await;
    let request = format!(
        "POST /v1/replies HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\n\
         Idempotency-Key: huge\r\nContent-Type: application/json\r\n\
         Content-Length: 10485760\r\nExpect: 100-continue\r\n\r\n",
        api.key
    );
    let answer = raw_exchange(&api, request.as_bytes()).await;
    assert!(
        answer.status_line.starts_with("HTTP/1.1 413"),
        "the first line back is {:?}",
        answer.status_line
    );
    let problem = answer.problem();
    assert!(
        problem["type"]
            .as_str()
            .unwrap()
            .ends_with("/body_too_large")
            && problem["detail"]
                .as_str()
                .unwrap()
                .contains("api.max_body_bytes"),
        "{problem}"
    );
    assert_eq!(api.counts().await, (0, 0, 0, 0), "nothing written");
}
