//! `[api]`: the HTTP API's address and limits. The settings tree (`crate::config`) holds it.

use std::net::SocketAddr;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::setting_problems::SettingProblems;
use replyd_core::sealed::SealingKey;
use replyd_core::secret::Secret;

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
    /// Origins (`scheme://host[:port]`, as a browser sends `Origin`) whose pages may call the
    /// API: their preflights are answered, and their requests' answers carry
    /// `Access-Control-Allow-Origin` and the headers a client reads (`Location`,
    /// `Idempotent-Replayed`, `Retry-After`). None by default: only a page of the API's own
    /// origin (the demo page) can call it. No wildcard: name each product's origin.
    pub cors_allowed_origins: Vec<String>,
    /// How long a browser may keep a preflight's answer before asking again.
    pub cors_max_age_ms: u64,
    /// The most tokens of history a new message's task carries: the conversation's earlier
    /// messages (its newest 200 at most) with the replies the user kept, counted as the token
    /// quota counts them (bytes and 8 a message), the oldest dropped first, each with its
    /// reply, and within what is left of `worker.max_prompt_bytes` and of the workspace's
    /// whole token quota. Fixed when the task is created. 0 sends each message alone.
    pub history_max_tokens: u32,
    /// The longest an end user's token may live (`POST /v1/end-user-tokens`, whose default is
    /// 900 s or this, the shorter). A token cannot be recalled one by one, only all of a
    /// user's at once: a short life bounds what a leaked one can do.
    pub end_user_token_max_ttl_seconds: u32,
    /// The key that seals each workspace's end-user token signing secrets in the database
    /// (AES-256-GCM): 32 bytes in base64, as `openssl rand -base64 32` prints them. Every API
    /// process of a deployment takes the same one; it is never shown, logged or written to
    /// the database, so reading the database is not enough to sign a token. Unset, end-user
    /// tokens are off: `POST /v1/end-user-tokens` answers `403` and no token is taken. A
    /// secret sealed under another key does not open: tokens it signed are refused and no new
    /// one is signed until `replyd end-user-tokens rotate` retires it. Default: unset.
    pub end_user_token_key: Option<Secret>,
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
            cors_allowed_origins: Vec::new(),
            cors_max_age_ms: 10 * 60 * 1000,
            history_max_tokens: 16_000,
            end_user_token_max_ttl_seconds: 3_600,
            end_user_token_key: None,
        }
    }
}

impl ApiSettings {
    /// `api.idempotency_retention_ms` against the longest a task can keep being retried
    /// (`retry_horizon`): a client retrying within that time must still find its task, or its
    /// late retry would be taken for new work.
    pub fn retention_problems(&self, retry_horizon: Duration) -> Vec<(&'static str, String)> {
        let horizon_ms = retry_horizon.as_millis();
        if u128::from(self.idempotency_retention_ms) > horizon_ms {
            return Vec::new();
        }
        vec![(
            "api.idempotency_retention_ms",
            format!(
                "{} must be longer than a task's longest retry horizon, {horizon_ms} ms (worker.max_attempts_limit × (worker.lease_ms + retry.max_delay_ms) + retry.refusal_budget_ms), or a late retry would be taken for new work",
                self.idempotency_retention_ms
            ),
        )]
    }

    /// What is wrong with `[api]` on its own: the rate limit, the head and body limits, the header timeout. Each problem names its setting.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = SettingProblems::default();
        if self.rate_limit_per_second > 0 && self.rate_limit_burst == 0 {
            out.refuse(
                "api.rate_limit_burst",
                "must be at least 1 while api.rate_limit_per_second is on".into(),
            );
        }
        if self.max_header_bytes < 1024 {
            out.refuse(
                "api.max_header_bytes",
                "must be at least 1024: an Authorization header alone takes about 100".into(),
            );
        }
        if self.max_body_bytes == 0 {
            out.refuse("api.max_body_bytes", "must be positive".into());
        }
        if self.max_headers < MIN_HEADERS {
            out.refuse(
                "api.max_headers",
                format!(
                    "{} must be at least {MIN_HEADERS}: a browser's request alone sends about 15",
                    self.max_headers
                ),
            );
        }
        if self.header_read_timeout_ms == 0 {
            out.refuse("api.header_read_timeout_ms", "must be positive".into());
        }
        if !(1..=MAX_TOKEN_TTL_SECONDS).contains(&self.end_user_token_max_ttl_seconds) {
            out.refuse(
                "api.end_user_token_max_ttl_seconds",
                format!(
                    "{} must be between 1 and {MAX_TOKEN_TTL_SECONDS} (a day): a token cannot be recalled alone, only with all of its user's",
                    self.end_user_token_max_ttl_seconds
                ),
            );
        }
        if let Some(Err(why)) = self.sealing_key() {
            out.refuse("api.end_user_token_key", why);
        }
        for origin in &self.cors_allowed_origins {
            if let Err(why) = check_origin(origin) {
                out.refuse("api.cors_allowed_origins", format!("{origin:?}: {why}"));
            }
        }
        out.into()
    }

    /// The key end-user token secrets are sealed with, if one is set; why it cannot be used,
    /// if it cannot (never its value).
    pub fn sealing_key(&self) -> Option<Result<SealingKey, String>> {
        self.end_user_token_key
            .as_ref()
            .map(|key| SealingKey::parse(key.expose()))
    }

    pub fn cors_max_age(&self) -> Duration {
        Duration::from_millis(self.cors_max_age_ms)
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

/// The longest `api.end_user_token_max_ttl_seconds` may be.
const MAX_TOKEN_TTL_SECONDS: u32 = 24 * 60 * 60;

/// The fewest header fields `api.max_headers` may allow.
const MIN_HEADERS: usize = 32;

/// Whether `origin` is one a browser sends in `Origin`: `http` or `https`, a host, an optional
/// port, nothing after. A browser compares the allowed origin with its own byte for byte, so a
/// path or a trailing slash would match no page, silently.
pub fn check_origin(origin: &str) -> Result<(), String> {
    if origin == "*" || origin == "null" {
        return Err(
            "not an origin: name each product's origin (`https://app.example.com`); a wildcard or `null` would let any page (or a sandboxed one) call the API with a token it got hold of"
                .into(),
        );
    }
    let uri: axum::http::Uri = origin
        .parse()
        .map_err(|e| format!("not an origin (`https://app.example.com`): {e}"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err("must start with http:// or https://".into()),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err("names no host".into());
    }
    if origin.ends_with('/') || uri.path_and_query().is_some_and(|p| p.as_str() != "/") {
        return Err(
            "must be scheme://host[:port] with nothing after (no path, no trailing slash): a browser's Origin has none"
                .into(),
        );
    }
    if origin != origin.to_ascii_lowercase() {
        return Err("must be lower case, as a browser sends it".into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{ApiSettings, check_origin};

    #[test]
    fn a_token_life_of_zero_or_over_a_day_is_refused_naming_the_setting() {
        for (ttl, refused) in [(0, true), (1, false), (86_400, false), (86_401, true)] {
            let settings = ApiSettings {
                end_user_token_max_ttl_seconds: ttl,
                ..ApiSettings::default()
            };
            let problems = settings.problems();
            assert_eq!(
                problems
                    .iter()
                    .any(|(s, _)| *s == "api.end_user_token_max_ttl_seconds"),
                refused,
                "{ttl}: {problems:?}"
            );
        }
    }

    #[test]
    fn an_allowed_origin_is_one_a_browser_sends() {
        for good in [
            "https://app.example.com",
            "http://127.0.0.1:5173",
            "http://localhost:3000",
        ] {
            assert_eq!(check_origin(good), Ok(()), "{good}");
        }
        for (bad, why) in [
            ("*", "wildcard"),
            ("null", "wildcard or `null`"),
            ("https://app.example.com/", "trailing slash"),
            ("https://app.example.com/chat", "no path"),
            ("app.example.com", "http:// or https://"),
            ("ftp://app.example.com", "http:// or https://"),
            ("https://App.Example.com", "lower case"),
        ] {
            let refused = check_origin(bad).unwrap_err();
            assert!(refused.contains(why), "{bad}: {refused}");
        }
    }
}
