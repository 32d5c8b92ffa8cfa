//! `[api]`: the HTTP API's address and limits. The settings tree (`crate::config`) holds it.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// The HTTP API (`replyd api`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ApiSettings {
    /// Address of the API. Port 0 picks a free port (logged).
    pub listen: SocketAddr,
    /// Largest request body; larger ones get `413`.
    pub max_body_bytes: usize,
    /// Largest header block of a request (names and values); larger ones get `431`.
    pub max_header_bytes: usize,
    /// Most header fields a request may have (at least 32); more get `431`. (The HTTP
    /// server's own parser takes twice as many before it refuses a request itself, so the
    /// answer names this setting.)
    pub max_headers: usize,
    /// How long a client may take to send a request's head (its request line and headers)
    /// before the connection is closed; also how long an idle keep-alive connection is kept.
    /// Bounds what a slow or stalled client holds.
    pub header_read_timeout_ms: u64,
    /// How long an `Idempotency-Key` is remembered: a retry within it returns the first
    /// request's task, after it the key is new work. Must be longer than the longest retry
    /// horizon of a task (validated), or a late retry would be taken for new work.
    pub idempotency_retention_ms: u64,
    /// Requests per second one API key may make, on average (a token bucket per key, in each
    /// API process: N replicas allow N times the rate). Over it: `429` (`rate_limited`) with
    /// `Retry-After`. 0 turns the limit off.
    pub rate_limit_per_second: u32,
    /// Requests one API key may make at once above the average (the bucket's size).
    pub rate_limit_burst: u32,
    /// Serve the demo chat page at `/demo`, on the API's own origin (the page asks for an API
    /// key and keeps it in the tab's session storage). Off by default: a production API
    /// serves no page.
    pub demo_page: bool,
}

impl Default for ApiSettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 1024 * 1024,
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            header_read_timeout_ms: 10_000,
            idempotency_retention_ms: 24 * 60 * 60 * 1000,
            rate_limit_per_second: 200,
            rate_limit_burst: 400,
            demo_page: false,
        }
    }
}

impl ApiSettings {
    /// What is wrong with `[api]` on its own: the rate limit, the head and body limits, the header timeout. Each problem names its setting.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        let mut refuse = |setting: &'static str, message: String| out.push((setting, message));
        if self.rate_limit_per_second > 0 && self.rate_limit_burst == 0 {
            refuse(
                "api.rate_limit_burst",
                "must be at least 1 while api.rate_limit_per_second is on".into(),
            );
        }
        if self.max_header_bytes < 1024 {
            refuse(
                "api.max_header_bytes",
                "must be at least 1024: an Authorization header alone takes about 100".into(),
            );
        }
        if self.max_body_bytes == 0 {
            refuse("api.max_body_bytes", "must be positive".into());
        }
        if self.max_headers < MIN_HEADERS {
            refuse(
                "api.max_headers",
                format!(
                    "{} must be at least {MIN_HEADERS}: a browser's request alone sends about 15",
                    self.max_headers
                ),
            );
        }
        if self.header_read_timeout_ms == 0 {
            refuse("api.header_read_timeout_ms", "must be positive".into());
        }
        out
    }

    pub fn header_read_timeout(&self) -> Duration {
        Duration::from_millis(self.header_read_timeout_ms)
    }

    pub fn idempotency_retention(&self) -> chrono::TimeDelta {
        chrono::TimeDelta::milliseconds(
            i64::try_from(self.idempotency_retention_ms).unwrap_or(i64::MAX),
        )
    }
}

/// The fewest header fields `api.max_headers` may allow.
const MIN_HEADERS: usize = 32;
