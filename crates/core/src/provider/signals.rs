//! [`RateSignals`]: what a provider's answer says about its capacity, read once from the
//! answer's headers. Pure: the headers and the clock go in, plain values come out.
//!
//! Providers report their limits on every answer, success or refusal, each in its own dialect:
//! - OpenAI (and Azure OpenAI, and many OpenAI-compatible gateways):
//!   `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, the reset as a Go-style duration
//!   (`1s`, `20ms`, `6m0s`, `1h2m3.5s`) until the window is full again;
//! - Anthropic: `anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,
//!   remaining,reset}`, the reset as an RFC 3339 instant;
//! - both: `retry-after` (seconds or an HTTP-date) and OpenAI's `retry-after-ms`.
//!
//! Both dialects are read from every answer, so an adapter need not know which one the server
//! behind its base URL speaks (a gateway may front either). A value that does not parse is left
//! out rather than guessed at: a missing signal makes a caller cautious, a wrong one makes it
//! send more than the provider allows (I9). Azure answers `-1` for a limit it does not report;
//! a negative number is no signal either.

use std::time::{Duration, SystemTime};

use http::header::{HeaderMap, RETRY_AFTER};
use serde::{Deserialize, Serialize};

/// OpenAI's millisecond-precision companion to `Retry-After`; preferred when both are present.
const RETRY_AFTER_MS: &str = "retry-after-ms";

/// One limit the provider enforces over a window (requests, or tokens, per minute).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateWindow {
    /// The most the window allows.
    pub limit: Option<u64>,
    /// What is left of it after this answer (Anthropic rounds tokens to the thousand).
    pub remaining: Option<u64>,
    /// How long until the window is full again, from the moment the answer was read.
    pub resets_in: Option<Duration>,
}

impl RateWindow {
    /// Whether the answer said nothing about this window.
    pub fn is_empty(&self) -> bool {
        *self == RateWindow::default()
    }
}

/// What one answer said about the provider's capacity: each window it reported, and how long
/// it asked us to wait. Empty when it said nothing (a local server, the mock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RateSignals {
    /// Requests per window (OpenAI's `-requests`, Anthropic's `-requests`).
    pub requests: RateWindow,
    /// Tokens per window (OpenAI's `-tokens`, input and output together; Anthropic's
    /// `-tokens`, its most restrictive token limit in effect).
    pub tokens: RateWindow,
    /// Input tokens per window (Anthropic only).
    pub input_tokens: RateWindow,
    /// Output tokens per window (Anthropic only).
    pub output_tokens: RateWindow,
    /// How long the provider asked us to wait before the next request (`retry-after-ms`, else
    /// `retry-after`); usually only on a refusal.
    pub retry_after: Option<Duration>,
}

impl RateSignals {
    /// Reads every signal of `headers`; `now` is the moment the answer was read, against which
    /// an instant (an HTTP-date `retry-after`, Anthropic's resets) becomes a duration.
    ///
    /// One pass over the headers, read on every answer: looking each of the 20 possible names
    /// up instead parsed 20 names and formatted 18 of them per answer, which most answers (a
    /// local server, many gateways) never send.
    pub fn read(headers: &HeaderMap, now: SystemTime) -> Self {
        // Anthropic's windows (requests, tokens, input tokens, output tokens) and OpenAI's
        // (requests, tokens), as sent: the first value of each header.
        let mut anthropic = [Sent::default(); 4];
        let mut openai = [Sent::default(); 2];
        for (name, value) in headers {
            let name = name.as_str();
            let found = if let Some(rest) = name.strip_prefix("anthropic-ratelimit-") {
                rest.rsplit_once('-').and_then(|(kind, field)| {
                    let window = ANTHROPIC_KINDS.iter().position(|k| *k == kind)?;
                    Some((&mut anthropic[window], field))
                })
            } else if let Some(rest) = name.strip_prefix("x-ratelimit-") {
                rest.split_once('-').and_then(|(field, kind)| {
                    let window = OPENAI_KINDS.iter().position(|k| *k == kind)?;
                    Some((&mut openai[window], field))
                })
            } else {
                None
            };
            let Some((sent, field)) = found else { continue };
            let slot = match field {
                "limit" => &mut sent.limit,
                "remaining" => &mut sent.remaining,
                "reset" => &mut sent.reset,
                _ => continue,
            };
            if slot.is_none() {
                *slot = Some(value.to_str().map(str::trim).unwrap_or(""));
            }
        }
        // A window is Anthropic's when it reported any of it, else OpenAI's (only requests
        // and tokens have an OpenAI form).
        let window = |i: usize| {
            let anthropic_window = anthropic[i].window(|v| until_instant(v, now));
            match openai.get(i) {
                Some(openai) if anthropic_window.is_empty() => openai.window(parse_go_duration),
                _ => anthropic_window,
            }
        };
        RateSignals {
            requests: window(0),
            tokens: window(1),
            input_tokens: window(2),
            output_tokens: window(3),
            retry_after: retry_after(headers, now),
        }
    }

    /// Whether the answer said nothing about capacity.
    pub fn is_empty(&self) -> bool {
        *self == RateSignals::default()
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

/// The window kinds in Anthropic's header names (`anthropic-ratelimit-{kind}-{field}`) and
/// OpenAI's (`x-ratelimit-{field}-{kind}`), in [`RateSignals`]' order.
const ANTHROPIC_KINDS: [&str; 4] = ["requests", "tokens", "input-tokens", "output-tokens"];
const OPENAI_KINDS: [&str; 2] = ["requests", "tokens"];

/// One window's values as sent, before they are read; a value that is not text is empty
/// (unreadable, so no signal).
#[derive(Clone, Copy, Default)]
struct Sent<'a> {
    limit: Option<&'a str>,
    remaining: Option<&'a str>,
    reset: Option<&'a str>,
}

impl Sent<'_> {
    /// The window, its reset read by `reset` (each provider writes it its own way).
    fn window(&self, reset: impl Fn(&str) -> Option<Duration>) -> RateWindow {
        RateWindow {
            limit: self.limit.and_then(count),
            remaining: self.remaining.and_then(count),
            resets_in: self.reset.and_then(reset),
        }
    }
}

/// A count; negative (Azure's `-1` for "not reported") or unparseable is none.
fn count(value: &str) -> Option<u64> {
    value.parse::<u64>().ok()
}

/// An RFC 3339 instant as the time left until it from `now`; an instant already past is zero.
fn until_instant(value: &str, now: SystemTime) -> Option<Duration> {
    let at: SystemTime = chrono::DateTime::parse_from_rfc3339(value).ok()?.into();
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

/// Nanoseconds in one of a Go duration's units.
fn unit_nanos(unit: &str) -> Option<u128> {
    Some(match unit {
        "ns" => 1,
        "us" | "µs" | "μs" => 1_000,
        "ms" => 1_000_000,
        "s" => 1_000_000_000,
        "m" => 60 * 1_000_000_000,
        "h" => 3_600 * 1_000_000_000,
        _ => return None,
    })
}

/// Reads a duration as Go's `time.Duration` prints it, which is how OpenAI sends its resets:
/// one or more decimal numbers each with a unit (`h`, `m`, `s`, `ms`, `us`/`µs`, `ns`), as in
/// `1s`, `20ms`, `6m0s`, `1h2m3.5s`; a bare number is seconds (some gateways send `0` or `12`).
/// The decimal fraction is read exactly, to the nanosecond (digits past it are dropped). `None`
/// for anything else: a sign, an empty string, a unit missing or unknown, or more than
/// `Duration` holds.
pub fn parse_go_duration(text: &str) -> Option<Duration> {
    let text = text.trim();
    if text.is_empty() {
        return None;
    }
    if text.bytes().all(|b| b.is_ascii_digit()) {
        return text.parse::<u64>().ok().map(Duration::from_secs);
    }
    let mut rest = text;
    let mut total: u128 = 0;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !c.is_ascii_digit() && c != '.')
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(digits);
        let unit_len = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, after) = after.split_at(unit_len);
        let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
        if (whole.is_empty() && fraction.is_empty()) || fraction.contains('.') {
            return None;
        }
        let per_unit = unit_nanos(unit)?;
        // Bounded so the sums below cannot overflow u128 before the final check.
        if whole.len() > 20 {
            return None;
        }
        let whole: u128 = if whole.is_empty() {
            0
        } else {
            whole.parse().ok()?
        };
        total = total.checked_add(whole.checked_mul(per_unit)?)?;
        // The fraction's digits, at most as many as reach below a nanosecond of this unit.
        let mut scale = per_unit;
        for digit in fraction.bytes() {
            if scale < 10 {
                break;
            }
            scale /= 10;
            total = total.checked_add(u128::from(digit - b'0') * scale)?;
        }
        rest = after;
    }
    let secs = u64::try_from(total / 1_000_000_000).ok()?;
    let nanos = u32::try_from(total % 1_000_000_000).ok()?;
    Some(Duration::new(secs, nanos))
}

/// An answer's headers from name and value pairs, for the tests of this room and its
/// neighbours.
#[cfg(test)]
pub(crate) fn header_map(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.insert(*name, http::header::HeaderValue::from_str(value).unwrap());
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        header_map(pairs)
    }

    fn now() -> SystemTime {
        // 2025-08-21T12:40:00Z.
        SystemTime::UNIX_EPOCH + Duration::from_secs(1_755_780_000)
    }

    #[test]
    fn go_durations_as_openai_sends_them_are_read() {
        let ms = Duration::from_millis;
        let cases: &[(&str, Option<Duration>)] = &[
            ("1s", Some(ms(1_000))),
            ("20ms", Some(ms(20))),
            ("6m0s", Some(ms(360_000))),
            ("1h2m3.5s", Some(ms(3_723_500))),
            ("0s", Some(Duration::ZERO)),
            ("17.5ms", Some(Duration::from_micros(17_500))),
            ("1.000000001s", Some(Duration::new(1, 1))),
            ("1.0000000019s", Some(Duration::new(1, 1))),
            ("250us", Some(Duration::from_micros(250))),
            ("250µs", Some(Duration::from_micros(250))),
            ("3ns", Some(Duration::from_nanos(3))),
            (".5s", Some(ms(500))),
            ("12", Some(ms(12_000))),
            (" 2s ", Some(ms(2_000))),
            ("", None),
            ("s", None),
            ("1", Some(ms(1_000))),
            ("1x", None),
            ("-1s", None),
            ("1..5s", None),
            ("1.5.5s", None),
            ("5s3", None),
            ("1 s", None),
            ("99999999999999999999999h", None),
        ];
        for (text, expected) in cases {
            assert_eq!(parse_go_duration(text), *expected, "{text:?}");
        }
    }

    #[test]
    fn openai_headers_become_request_and_token_windows() {
        let signals = RateSignals::read(
            &headers(&[
                ("x-ratelimit-limit-requests", "5000"),
                ("x-ratelimit-remaining-requests", "4999"),
                ("x-ratelimit-reset-requests", "12ms"),
                ("x-ratelimit-limit-tokens", "160000"),
                ("x-ratelimit-remaining-tokens", "159976"),
                ("x-ratelimit-reset-tokens", "6m0s"),
            ]),
            now(),
        );
        assert_eq!(
            signals,
            RateSignals {
                requests: RateWindow {
                    limit: Some(5000),
                    remaining: Some(4999),
                    resets_in: Some(Duration::from_millis(12)),
                },
                tokens: RateWindow {
                    limit: Some(160_000),
                    remaining: Some(159_976),
                    resets_in: Some(Duration::from_secs(360)),
                },
                ..RateSignals::default()
            }
        );
    }

    #[test]
    fn anthropic_headers_become_four_windows_with_resets_from_now() {
        let signals = RateSignals::read(
            &headers(&[
                ("anthropic-ratelimit-requests-limit", "1000"),
                ("anthropic-ratelimit-requests-remaining", "999"),
                ("anthropic-ratelimit-requests-reset", "2025-08-21T12:40:59Z"),
                ("anthropic-ratelimit-tokens-limit", "96000"),
                ("anthropic-ratelimit-tokens-remaining", "95000"),
                ("anthropic-ratelimit-tokens-reset", "2025-08-21T12:40:00.5Z"),
                ("anthropic-ratelimit-input-tokens-limit", "80000"),
                ("anthropic-ratelimit-input-tokens-remaining", "80000"),
                // An offset other than Z, and an instant already past.
                (
                    "anthropic-ratelimit-input-tokens-reset",
                    "2025-08-21T14:39:00+02:00",
                ),
                ("anthropic-ratelimit-output-tokens-limit", "16000"),
                ("anthropic-ratelimit-output-tokens-remaining", "16000"),
                ("anthropic-ratelimit-output-tokens-reset", "not a time"),
                ("retry-after", "7"),
            ]),
            now(),
        );
        assert_eq!(
            signals.requests,
            RateWindow {
                limit: Some(1000),
                remaining: Some(999),
                resets_in: Some(Duration::from_secs(59)),
            }
        );
        assert_eq!(signals.tokens.resets_in, Some(Duration::from_millis(500)));
        assert_eq!(signals.input_tokens.resets_in, Some(Duration::ZERO));
        assert_eq!(signals.input_tokens.limit, Some(80_000));
        assert_eq!(
            signals.output_tokens,
            RateWindow {
                limit: Some(16_000),
                remaining: Some(16_000),
                resets_in: None,
            }
        );
        assert_eq!(signals.retry_after, Some(Duration::from_secs(7)));
    }

    #[test]
    fn unreported_and_unreadable_values_are_no_signal() {
        // Azure's way of saying "not reported", and values no provider means.
        let signals = RateSignals::read(
            &headers(&[
                ("x-ratelimit-limit-tokens", "-1"),
                ("x-ratelimit-remaining-tokens", "-1"),
                ("x-ratelimit-reset-tokens", "soon"),
                ("x-ratelimit-limit-requests", "1.5"),
                ("retry-after-ms", "250"),
            ]),
            now(),
        );
        assert_eq!(
            signals,
            RateSignals {
                retry_after: Some(Duration::from_millis(250)),
                ..RateSignals::default()
            }
        );
        assert!(RateSignals::read(&HeaderMap::new(), now()).is_empty());
    }

    #[test]
    fn a_window_is_anthropics_where_it_reported_one_and_the_first_value_counts() {
        // A gateway that passes both dialects, a repeated header, and names of neither.
        let mut map = headers(&[
            ("anthropic-ratelimit-requests-limit", "50"),
            ("x-ratelimit-limit-requests", "5000"),
            ("x-ratelimit-limit-tokens", "90000"),
            ("x-ratelimit-remaining-tokens", "89000"),
            ("anthropic-ratelimit-widgets-limit", "7"),
            ("x-ratelimit-limit-widgets", "7"),
            ("x-ratelimit-requests", "7"),
        ]);
        map.append(
            "anthropic-ratelimit-requests-limit",
            http::header::HeaderValue::from_static("60"),
        );
        let signals = RateSignals::read(&map, now());
        assert_eq!(
            signals,
            RateSignals {
                requests: RateWindow {
                    limit: Some(50),
                    ..RateWindow::default()
                },
                tokens: RateWindow {
                    limit: Some(90_000),
                    remaining: Some(89_000),
                    resets_in: None,
                },
                ..RateSignals::default()
            }
        );
    }

    /// `d` as Go's `time.Duration.String()` prints it.
    fn go_format(d: Duration) -> String {
        let nanos = d.as_nanos();
        if nanos == 0 {
            return "0s".into();
        }
        let fraction = |value: u128, unit: u128| {
            let whole = value / unit;
            let rest = value % unit;
            if rest == 0 {
                whole.to_string()
            } else {
                let width = unit.ilog10() as usize;
                let digits = format!("{rest:0width$}");
                format!("{whole}.{}", digits.trim_end_matches('0'))
            }
        };
        if nanos < 1_000 {
            return format!("{nanos}ns");
        }
        if nanos < 1_000_000 {
            return format!("{}µs", fraction(nanos, 1_000));
        }
        if nanos < 1_000_000_000 {
            return format!("{}ms", fraction(nanos, 1_000_000));
        }
        let hours = nanos / 3_600_000_000_000;
        let minutes = nanos / 60_000_000_000 % 60;
        let seconds = fraction(nanos % 60_000_000_000, 1_000_000_000);
        match (hours, minutes) {
            (0, 0) => format!("{seconds}s"),
            (0, m) => format!("{m}m{seconds}s"),
            (h, m) => format!("{h}h{m}m{seconds}s"),
        }
    }

    proptest! {
        /// Every duration Go can print (to the nanosecond, up to a thousand hours) reads back
        /// as itself.
        #[test]
        fn a_go_printed_duration_reads_back_exactly(nanos in 0u64..3_600_000_000_000_000) {
            let d = Duration::from_nanos(nanos);
            let text = go_format(d);
            prop_assert_eq!(parse_go_duration(&text), Some(d), "{}", text);
        }

        /// Parts add up: `XhYmZs` is the sum of its parts read alone.
        #[test]
        fn a_duration_is_the_sum_of_its_parts(h in 0u64..1000, m in 0u64..60,
                                               ms in 0u64..60_000) {
            let text = format!("{h}h{m}m{}.{:03}s", ms / 1000, ms % 1000);
            let parts = [format!("{h}h"), format!("{m}m"), format!("{}ms", ms)];
            let sum = parts.iter().map(|p| parse_go_duration(p).unwrap()).sum::<Duration>();
            prop_assert_eq!(parse_go_duration(&text), Some(sum));
        }

        /// Any text at all is read or refused, never a panic (no overflow, no slicing inside a
        /// character).
        #[test]
        fn any_text_is_read_or_refused(text in "[0-9.hmsuµn ]{0,24}") {
            let _ = parse_go_duration(&text);
        }

        /// A window's numbers are read as sent, whatever they are.
        #[test]
        fn counts_are_read_as_sent(limit in any::<u64>(), remaining in any::<u64>()) {
            let signals = RateSignals::read(
                &headers(&[
                    ("x-ratelimit-limit-requests", &limit.to_string()),
                    ("x-ratelimit-remaining-requests", &remaining.to_string()),
                ]),
                now(),
            );
            prop_assert_eq!(signals.requests.limit, Some(limit));
            prop_assert_eq!(signals.requests.remaining, Some(remaining));
        }
    }

    #[test]
    fn retry_after_is_read_from_every_form_the_providers_use() {
        // 2015-10-21T07:28:00Z, the instant in RFC 9110's HTTP-date example.
        let now = SystemTime::UNIX_EPOCH + Duration::from_secs(1_445_412_480);
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
                retry_after(&headers(pairs), now),
                *expected,
                "headers {pairs:?}"
            );
        }
    }
}
