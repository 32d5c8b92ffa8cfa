//! Pure classification of a provider's non-success HTTP answer into a [`ProviderError`]. No I/O:
//! the adapter hands over the status, the headers and the start of the body.
//!
//! The split follows one question, "may the provider have executed (and billed) this request?",
//! because that is what decides whether a retry is free or must rely on the idempotency key (I6,
//! I7). Statuses not named in the brief are put on the conservative side: an unknown 5xx may have
//! executed, an unknown 4xx is the client's fault and will not get better by retrying.

use std::time::{Duration, SystemTime};

use reqwest::StatusCode;
use reqwest::header::{HeaderMap, LOCATION, RETRY_AFTER};

use super::ProviderError;

/// OpenAI's millisecond-precision companion to `Retry-After`; preferred when both are present.
const RETRY_AFTER_MS: &str = "retry-after-ms";

/// Longest message taken from an error body; the rest is cut so a huge HTML error page cannot
/// flood a log line or the attempt history.
const MAX_MESSAGE_CHARS: usize = 500;

/// Classifies a non-success answer, reading an HTTP-date `Retry-After` against the clock now.
pub fn classify_status(
    status: StatusCode,
    headers: &HeaderMap,
    body_snippet: &str,
) -> ProviderError {
    classify_status_at(status, headers, body_snippet, SystemTime::now())
}

/// [`classify_status`] with the current time passed in, so tests can pin it.
pub fn classify_status_at(
    status: StatusCode,
    headers: &HeaderMap,
    body_snippet: &str,
    now: SystemTime,
) -> ProviderError {
    let code = status.as_u16();
    let message = error_message(status, body_snippet);
    match code {
        // 408: the server gave up waiting for our request, so it did not run it. 409: an
        // idempotency-keyed request with the same key is still in flight; asking again later
        // returns its result.
        408 | 409 | 429 | 503 => ProviderError::Retryable {
            status: code,
            retry_after: retry_after(headers, now),
            message,
        },
        500..=599 => ProviderError::MaybeExecuted {
            status: code,
            message,
        },
        300..=399 => {
            // Redirects are not followed: re-sending a POST elsewhere is not ours to decide, and
            // a redirecting base URL is a configuration error.
            let target = headers
                .get(LOCATION)
                .and_then(|v| v.to_str().ok())
                .unwrap_or("(no Location)");
            ProviderError::Fatal {
                status: code,
                message: format!("redirect to {target} not followed; check the base URL"),
            }
        }
        _ => ProviderError::Fatal {
            status: code,
            message,
        },
    }
}

/// How long the provider asked us to wait: `retry-after-ms`, else `Retry-After` as
/// delta-seconds or an HTTP-date (a date in the past means "now"). Unparseable values are
/// ignored rather than guessed at.
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let header = |name| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::trim)
    };
    if let Some(ms) = header(RETRY_AFTER_MS).and_then(|v| v.parse::<f64>().ok())
        && ms.is_finite()
        && ms >= 0.0
    {
        return Some(Duration::from_secs_f64(ms / 1000.0));
    }
    let value = header(RETRY_AFTER.as_str())?;
    if let Ok(seconds) = value.parse::<u64>() {
        return Some(Duration::from_secs(seconds));
    }
    // Some providers send fractional seconds; RFC 9110 does not allow it, but the meaning is
    // unambiguous.
    if let Ok(seconds) = value.parse::<f64>() {
        return (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// The provider's own words: OpenAI-style `{"error": {"message": ...}}` when the body is that,
/// else the body itself, else the status' reason phrase.
fn error_message(status: StatusCode, body_snippet: &str) -> String {
    let from_json = serde_json::from_str::<serde_json::Value>(body_snippet)
        .ok()
        .and_then(|v| {
            let error = v.get("error")?;
            error
                .get("message")
                .and_then(|m| m.as_str())
                .or_else(|| error.as_str())
                .map(str::to_owned)
        });
    let text = from_json.unwrap_or_else(|| body_snippet.trim().to_owned());
    let text = if text.is_empty() {
        status
            .canonical_reason()
            .unwrap_or("no reason given")
            .to_owned()
    } else {
        text
    };
    text.chars().take(MAX_MESSAGE_CHARS).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use reqwest::header::HeaderValue;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, HeaderValue::from_str(value).unwrap());
        }
        map
    }

    fn now() -> SystemTime {
        // 2015-10-21T07:28:00Z, the instant in RFC 9110's HTTP-date example.
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480)
    }

    #[test]
    fn statuses_are_classified_by_whether_the_request_may_have_run() {
        let cases: &[(u16, &str)] = &[
            (429, "retryable"),
            (503, "retryable"),
            (408, "retryable"),
            (409, "retryable"),
            (500, "maybe_executed"),
            (502, "maybe_executed"),
            (504, "maybe_executed"),
            (599, "maybe_executed"),
            (400, "fatal"),
            (401, "fatal"),
            (403, "fatal"),
            (404, "fatal"),
            (413, "fatal"),
            (422, "fatal"),
            (301, "fatal"),
            (307, "fatal"),
        ];
        for &(code, kind) in cases {
            let status = StatusCode::from_u16(code).unwrap();
            let error = classify_status_at(status, &HeaderMap::new(), "", now());
            assert_eq!(error.kind(), kind, "status {code}: {error}");
        }
    }

    #[test]
    fn retry_after_is_read_from_every_form_the_providers_use() {
        type Headers = &'static [(&'static str, &'static str)];
        let cases: &[(Headers, Option<Duration>)] = &[
            (&[], None),
            (&[("retry-after", "7")], Some(Duration::from_secs(7))),
            (&[("retry-after", " 0 ")], Some(Duration::ZERO)),
            (&[("retry-after", "1.5")], Some(Duration::from_millis(1500))),
            (
                &[("retry-after", "Wed, 21 Oct 2015 07:28:30 GMT")],
                Some(Duration::from_secs(30)),
            ),
            (
                &[("retry-after", "Wed, 21 Oct 2015 07:27:00 GMT")],
                Some(Duration::ZERO),
            ),
            (&[("retry-after", "soon")], None),
            (&[("retry-after", "-3")], None),
            (
                &[("retry-after-ms", "250")],
                Some(Duration::from_millis(250)),
            ),
            (
                &[("retry-after-ms", "250"), ("retry-after", "7")],
                Some(Duration::from_millis(250)),
            ),
            (
                &[("retry-after-ms", "nope"), ("retry-after", "7")],
                Some(Duration::from_secs(7)),
            ),
        ];
        for (pairs, expected) in cases {
            assert_eq!(
                retry_after(&headers(pairs), now()),
                *expected,
                "headers {pairs:?}"
            );
        }
    }

    #[test]
    fn a_rate_limit_carries_its_retry_after() {
        let error = classify_status_at(
            StatusCode::TOO_MANY_REQUESTS,
            &headers(&[("retry-after", "3")]),
            "",
            now(),
        );
        assert_eq!(
            error,
            ProviderError::Retryable {
                status: 429,
                retry_after: Some(Duration::from_secs(3)),
                message: "Too Many Requests".into(),
            }
        );
    }

    #[test]
    fn the_providers_own_error_message_is_kept() {
        let body =
            r#"{"error":{"message":"'messages' is required","type":"invalid_request_error"}}"#;
        let error = classify_status_at(StatusCode::BAD_REQUEST, &HeaderMap::new(), body, now());
        assert_eq!(
            error,
            ProviderError::Fatal {
                status: 400,
                message: "'messages' is required".into()
            }
        );
        let error = classify_status_at(
            StatusCode::BAD_GATEWAY,
            &HeaderMap::new(),
            "<html>upstream died</html>",
            now(),
        );
        assert_eq!(
            error,
            ProviderError::MaybeExecuted {
                status: 502,
                message: "<html>upstream died</html>".into()
            }
        );
    }

    #[test]
    fn a_huge_error_body_is_cut_short() {
        let body = "x".repeat(10_000);
        let error = classify_status_at(StatusCode::BAD_REQUEST, &HeaderMap::new(), &body, now());
        let ProviderError::Fatal { message, .. } = error else {
            panic!("expected Fatal, got {error:?}");
        };
        assert_eq!(message.len(), MAX_MESSAGE_CHARS);
    }
}
