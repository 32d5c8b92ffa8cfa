//! Pure classification of a provider's non-success HTTP answer into a [`ProviderError`]. No I/O:
//! the adapter hands over the status, the headers and the start of the body.
//!
//! The split follows one question, "may the provider have executed (and billed) this request?",
//! because that is what decides whether a retry is free or must rely on the idempotency key (I6,
//! I7). Statuses not named in the brief are put on the conservative side: an unknown 5xx may have
//! executed, an unknown 4xx is the client's fault and will not get better by retrying.
//!
//! A refusal to retry later carries the answer's [`RateSignals`], read here once, so the caller
//! sees how much capacity the provider says is left and when it comes back.

use std::time::SystemTime;

use http::StatusCode;
use http::header::{HeaderMap, LOCATION};

use super::ProviderError;
use super::signals::RateSignals;

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
        // OpenAI answers a spent account (credits gone, the monthly budget reached) with a 429
        // too, `insufficient_quota`: no retry passes until someone pays, so it is not a
        // refusal for capacity to wait out for the refusal budget's ten minutes.
        429 if openai_error_code(body_snippet).as_deref() == Some("insufficient_quota") => {
            ProviderError::Fatal {
                status: code,
                message: format!(
                    "the provider account's quota is spent (insufficient_quota: credits or the spending limit); no retry passes until it is raised: {message}"
                ),
            }
        }
        408 | 409 | 429 | 503 => refusal(code, headers, now, message),
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

/// Classifies a non-success answer of Anthropic's Messages API, by its documented statuses
/// and `error.type`: 400 `invalid_request_error`, 401 `authentication_error`, 403
/// `permission_error`, 404 `not_found_error`, 413 `request_too_large` are `Fatal`; 429
/// `rate_limit_error` is `Retryable` with its `retry-after`; 500 `api_error` is
/// `MaybeExecuted`; 529 `overloaded_error` is `Retryable`. Anything else as
/// [`classify_status_at`]. The message starts with the error's type, which says more than its
/// text ("overloaded_error: Overloaded").
pub fn classify_anthropic_status_at(
    status: StatusCode,
    headers: &HeaderMap,
    body_snippet: &str,
    now: SystemTime,
) -> ProviderError {
    let kind = anthropic_error_type(body_snippet);
    let mut message = error_message(status, body_snippet);
    if let Some(kind) = &kind {
        message = format!("{kind}: {message}")
            .chars()
            .take(MAX_MESSAGE_CHARS)
            .collect();
    }
    // 529 (or an overloaded_error behind a gateway's other 5xx): Anthropic sends it when the
    // API as a whole is short of capacity, for every customer at once. Its documentation does
    // not say whether an overloaded request did any work; it is refused before the model
    // generates as far as its SDKs let on (they retry it like a 429, twice by default), and it
    // is treated here as a refusal that did none: Retryable, not counted as an attempt (I7).
    // Were that ever wrong, a retry could pay for a second generation, which the task's
    // attempt budget would not see.
    let overloaded = status.as_u16() == 529
        || (status.is_server_error() && kind.as_deref() == Some("overloaded_error"));
    if overloaded {
        return refusal(status.as_u16(), headers, now, message);
    }
    match classify_status_at(status, headers, body_snippet, now) {
        ProviderError::Retryable {
            status,
            retry_after,
            signals,
            ..
        } => ProviderError::Retryable {
            status,
            retry_after,
            signals,
            message,
        },
        ProviderError::MaybeExecuted { status, .. } => {
            ProviderError::MaybeExecuted { status, message }
        }
        // A redirect keeps its own message, which names the target.
        ProviderError::Fatal { status, .. } if !(300..=399).contains(&status) => {
            ProviderError::Fatal { status, message }
        }
        other => other,
    }
}

/// A refusal that did no work: retry no sooner than the provider asked, and here is what it
/// said about its capacity.
fn refusal(status: u16, headers: &HeaderMap, now: SystemTime, message: String) -> ProviderError {
    let signals = RateSignals::read(headers, now);
    ProviderError::Retryable {
        status,
        retry_after: signals.retry_after,
        signals: Box::new(signals),
        message,
    }
}

/// `error.code` (else `error.type`) of an OpenAI error body (`{"error":{"code":...,"type":...}}`).
fn openai_error_code(body_snippet: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(body_snippet).ok()?;
    let error = value.get("error")?;
    ["code", "type"]
        .iter()
        .find_map(|field| error.get(*field)?.as_str().filter(|t| !t.is_empty()))
        .map(str::to_owned)
}

/// `error.type` of an Anthropic error body (`{"type":"error","error":{"type":...}}`).
fn anthropic_error_type(body_snippet: &str) -> Option<String> {
    let value: serde_json::Value = serde_json::from_str(body_snippet).ok()?;
    value
        .get("error")?
        .get("type")?
        .as_str()
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
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
    use std::time::Duration;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        super::super::signals::header_map(pairs)
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
                signals: Box::new(RateSignals {
                    retry_after: Some(Duration::from_secs(3)),
                    ..RateSignals::default()
                }),
                message: "Too Many Requests".into(),
            }
        );
    }

    #[test]
    fn a_refusal_carries_what_the_provider_said_about_its_capacity() {
        let error = classify_status_at(
            StatusCode::TOO_MANY_REQUESTS,
            &headers(&[
                ("x-ratelimit-remaining-tokens", "0"),
                ("x-ratelimit-reset-tokens", "1m30s"),
                ("retry-after-ms", "1500"),
            ]),
            r#"{"error":{"message":"Rate limit reached for tokens","type":"tokens"}}"#,
            now(),
        );
        let ProviderError::Retryable {
            retry_after,
            signals,
            ..
        } = error
        else {
            panic!("a 429 is retryable: {error:?}");
        };
        assert_eq!(retry_after, Some(Duration::from_millis(1500)));
        assert_eq!(signals.retry_after, retry_after);
        assert_eq!(signals.tokens.remaining, Some(0));
        assert_eq!(signals.tokens.resets_in, Some(Duration::from_secs(90)));
    }

    fn anthropic_body(kind: &str, message: &str) -> String {
        format!(r#"{{"type":"error","error":{{"type":"{kind}","message":"{message}"}}}}"#)
    }

    #[test]
    fn anthropic_statuses_and_error_types_are_classified_as_documented() {
        let cases: &[(u16, &str, &str)] = &[
            (400, "invalid_request_error", "fatal"),
            (401, "authentication_error", "fatal"),
            (403, "permission_error", "fatal"),
            (404, "not_found_error", "fatal"),
            (413, "request_too_large", "fatal"),
            (429, "rate_limit_error", "retryable"),
            (500, "api_error", "maybe_executed"),
            (529, "overloaded_error", "retryable"),
            // Overloaded behind a gateway that turned the 529 into another 5xx.
            (502, "overloaded_error", "retryable"),
            (502, "api_error", "maybe_executed"),
            (503, "api_error", "retryable"),
        ];
        for &(code, kind, class) in cases {
            let status = StatusCode::from_u16(code).unwrap();
            let error = classify_anthropic_status_at(
                status,
                &HeaderMap::new(),
                &anthropic_body(kind, "the provider's words"),
                now(),
            );
            assert_eq!(error.kind(), class, "{code} {kind}: {error}");
            assert!(
                error
                    .to_string()
                    .contains(&format!("{kind}: the provider's words")),
                "{error}"
            );
        }
        // A 529 without a body (a proxy's) is still overloaded.
        let bare = classify_anthropic_status_at(
            StatusCode::from_u16(529).unwrap(),
            &headers(&[("retry-after", "4")]),
            "",
            now(),
        );
        assert!(
            matches!(
                bare,
                ProviderError::Retryable { status: 529, retry_after: Some(after), .. }
                    if after == Duration::from_secs(4)
            ),
            "{bare:?}"
        );
    }

    #[test]
    fn an_anthropic_rate_limit_carries_its_retry_after_and_windows() {
        let error = classify_anthropic_status_at(
            StatusCode::TOO_MANY_REQUESTS,
            &headers(&[
                ("retry-after", "12"),
                ("anthropic-ratelimit-output-tokens-remaining", "0"),
                (
                    "anthropic-ratelimit-output-tokens-reset",
                    "2015-10-21T07:28:12Z",
                ),
            ]),
            &anthropic_body("rate_limit_error", "Number of request tokens has exceeded"),
            now(),
        );
        let ProviderError::Retryable {
            status: 429,
            retry_after: Some(after),
            signals,
            ..
        } = &error
        else {
            panic!("{error:?}");
        };
        assert_eq!(*after, Duration::from_secs(12));
        assert_eq!(signals.output_tokens.remaining, Some(0));
        assert_eq!(
            signals.output_tokens.resets_in,
            Some(Duration::from_secs(12))
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

    #[test]
    fn a_spent_account_is_fatal_and_a_rate_limit_is_a_refusal() {
        let spent = r#"{"error":{"message":"You exceeded your current quota, please check your plan and billing details.","type":"insufficient_quota","param":null,"code":"insufficient_quota"}}"#;
        let too_many = |body: &str| {
            classify_status_at(
                StatusCode::TOO_MANY_REQUESTS,
                &HeaderMap::new(),
                body,
                now(),
            )
        };
        let error = too_many(spent);
        assert_eq!(error.kind(), "fatal", "{error:?}");
        assert!(error.to_string().contains("insufficient_quota"), "{error}");
        let limited = r#"{"error":{"message":"Rate limit reached","type":"requests","param":null,"code":"rate_limit_exceeded"}}"#;
        let error = too_many(limited);
        assert_eq!(error.kind(), "retryable", "{error:?}");
    }
}
