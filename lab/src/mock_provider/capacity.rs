//! The mock's capacity limits, kept pure: requests per minute, tokens per minute and requests
//! in progress, and what a client is told about them (OpenAI's or Anthropic's headers, and
//! each one's 429 body). The server module supplies the clock and turns the values into an
//! answer.
//!
//! Limits are quantized to the second, as OpenAI documents its own: a limit of N per minute
//! admits at most N/60 in *any* window of one second. Each admission's share comes back exactly
//! one second after it was spent (a sliding window), so capacity returns continuously and a
//! burst over the limit is refused at once, not after a minute. A bucket refilled at N/60 per
//! second from a capacity of N/60 would admit up to twice that within one second (a full
//! bucket, then its refill); the sliding window is what lets a test sample the mock second by
//! second and find the limit never exceeded. All arithmetic is in whole requests and tokens
//! (`used * 60 <= limit`), so a limit that is not a multiple of 60 is neither rounded up nor
//! drifts. A refused request spends nothing.

use std::collections::VecDeque;
use std::time::{Duration, SystemTime};

use chrono::{DateTime, SecondsFormat, Utc};
use serde_json::{Value, json};

use super::settings::{LimitHeaders, LimitSettings, RefusalDialect};

/// The window every per-minute limit is enforced over.
pub const QUANTUM: Duration = Duration::from_secs(1);

/// Which limit a refusal is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limit {
    /// Requests per minute.
    Requests,
    /// Tokens per minute.
    Tokens,
    /// Requests in progress at once.
    Concurrent,
}

impl Limit {
    /// The label in `/stats` and the `type` of OpenAI's error body (`requests`, `tokens`).
    pub fn as_str(self) -> &'static str {
        match self {
            Limit::Requests => "requests",
            Limit::Tokens => "tokens",
            Limit::Concurrent => "concurrent",
        }
    }
}

/// One per-minute limit enforced over the last [`QUANTUM`]: what each admission spent, and when.
#[derive(Debug, Clone)]
struct Window {
    per_minute: u64,
    /// Admissions still inside the window, oldest first: (when, cost).
    spent: VecDeque<(Duration, u64)>,
    /// Sum of the costs in `spent`.
    used: u64,
}

impl Window {
    fn new(per_minute: u64) -> Self {
        Self {
            per_minute,
            spent: VecDeque::new(),
            used: 0,
        }
    }

    /// Gives back what was spent a whole quantum ago or earlier.
    fn expire(&mut self, now: Duration) {
        while let Some(&(at, cost)) = self.spent.front() {
            if at + QUANTUM > now {
                break;
            }
            self.spent.pop_front();
            self.used -= cost;
        }
    }

    /// Whether `used` plus `cost` stays within a 60th of the limit.
    fn fits_with(&self, used: u64, cost: u64) -> bool {
        (used + cost).saturating_mul(60) <= self.per_minute
    }

    /// How long until `cost` fits, if nobody else is admitted meanwhile; `None` when it never
    /// can (it costs more than a second's share).
    fn wait_for(&self, cost: u64, now: Duration) -> Option<Duration> {
        if !self.fits_with(0, cost) {
            return None;
        }
        let mut used = self.used;
        if self.fits_with(used, cost) {
            return Some(Duration::ZERO);
        }
        for &(at, spent) in &self.spent {
            used -= spent;
            if self.fits_with(used, cost) {
                return Some((at + QUANTUM).saturating_sub(now));
            }
        }
        // Unreachable: an empty window fits any cost that fits at all (checked above).
        Some(QUANTUM)
    }

    fn spend(&mut self, now: Duration, cost: u64) {
        self.spent.push_back((now, cost));
        self.used += cost;
    }

    /// What a client is told about this limit now.
    fn headroom(&self, now: Duration) -> Headroom {
        Headroom {
            limit: self.per_minute,
            remaining: self.per_minute.saturating_sub(self.used.saturating_mul(60)) / 60,
            reset: self.spent.back().map_or(Duration::ZERO, |&(at, _)| {
                (at + QUANTUM).saturating_sub(now)
            }),
        }
    }
}

/// One limit as the headers report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Headroom {
    /// The limit per minute, as configured (and as OpenAI reports it).
    pub limit: u64,
    /// How much may be sent now: what is left of the current second's share.
    pub remaining: u64,
    /// Time until the whole share is back (the newest admission leaves the window).
    pub reset: Duration,
}

/// The configured per-minute limits as they stand at an instant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Standing {
    pub requests: Option<Headroom>,
    pub tokens: Option<Headroom>,
}

/// A request refused over a limit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    pub limit: Limit,
    /// The limit: per minute for requests and tokens, at once for concurrency.
    pub limit_value: u64,
    /// What the limit had in use: the last second's pace, per minute (so it reads against
    /// `limit_value`), or the requests in progress.
    pub used: u64,
    /// What the request asked for: 1 request, its token cost, 1 slot.
    pub requested: u64,
    /// The request costs more than a second's share of the token limit: no wait admits it.
    pub too_large: bool,
    /// How long until the same request would be admitted if nobody else came (a guess of one
    /// quantum for concurrency, which frees up only when a request ends).
    pub retry_after: Duration,
    /// The limits as they stand, for the headers.
    pub standing: Standing,
}

/// What the limiter decided for a request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admission {
    /// Admitted and counted; the limits as they stand after it, for the headers.
    Admitted(Standing),
    Refused(Refusal),
}

/// The limits and what they have admitted. Time is a monotonic offset (the mock's age).
#[derive(Debug, Clone)]
pub struct Capacity {
    requests: Option<Window>,
    tokens: Option<Window>,
    concurrent: Option<u64>,
    in_progress: u64,
}

impl Capacity {
    pub fn new(limits: &LimitSettings) -> Self {
        Self {
            requests: limits.requests_per_minute.map(Window::new),
            tokens: limits.tokens_per_minute.map(Window::new),
            concurrent: limits.concurrent_requests,
            in_progress: 0,
        }
    }

    /// Admits a request costing `tokens` at `now`, or refuses it by the first limit it is over
    /// (requests, tokens, then concurrency) without spending anything.
    pub fn admit(&mut self, now: Duration, tokens: u64) -> Admission {
        for window in [&mut self.requests, &mut self.tokens].into_iter().flatten() {
            window.expire(now);
        }
        // Each per-minute limit: what it is, what the request costs against it, and how long
        // until that fits (`None`: never).
        let checks = [
            (Limit::Requests, self.requests.as_ref(), 1),
            (Limit::Tokens, self.tokens.as_ref(), tokens),
        ]
        .map(|(limit, window, cost)| window.map(|w| (limit, w, cost, w.wait_for(cost, now))));
        let over = checks
            .iter()
            .flatten()
            .filter(|(_, _, _, wait)| *wait != Some(Duration::ZERO));
        // A request too large for any second is refused as such whatever else it is over; else
        // by the first limit it is over. Its retry-after is the longest wait of all, so a
        // request that waits it out fits every limit.
        let first = over
            .clone()
            .find(|(_, _, _, wait)| wait.is_none())
            .or_else(|| over.clone().next());
        if let Some(&(limit, window, cost, wait)) = first {
            let longest = over.filter_map(|(_, _, _, wait)| *wait).max();
            return Admission::Refused(Refusal {
                limit,
                limit_value: window.per_minute,
                used: window.used.saturating_mul(60),
                requested: cost,
                too_large: wait.is_none(),
                retry_after: if wait.is_none() {
                    QUANTUM
                } else {
                    longest.unwrap_or(QUANTUM)
                },
                standing: self.standing(now),
            });
        }
        if let Some(at_once) = self.concurrent.filter(|max| self.in_progress >= *max) {
            return Admission::Refused(Refusal {
                limit: Limit::Concurrent,
                limit_value: at_once,
                used: self.in_progress,
                requested: 1,
                too_large: false,
                retry_after: QUANTUM,
                standing: self.standing(now),
            });
        }
        if let Some(window) = &mut self.requests {
            window.spend(now, 1);
        }
        if let Some(window) = &mut self.tokens {
            window.spend(now, tokens);
        }
        self.in_progress += 1;
        Admission::Admitted(self.standing(now))
    }

    /// An admitted request ended (answered, abandoned by its client, or its background
    /// generation done): its place among those in progress is free.
    pub fn finish(&mut self) {
        self.in_progress = self.in_progress.saturating_sub(1);
    }

    /// Admitted requests not yet ended.
    pub fn in_progress(&self) -> u64 {
        self.in_progress
    }

    fn standing(&self, now: Duration) -> Standing {
        Standing {
            requests: self.requests.as_ref().map(|w| w.headroom(now)),
            tokens: self.tokens.as_ref().map(|w| w.headroom(now)),
        }
    }
}

/// A duration as OpenAI's reset headers write it (Go's `time.Duration` format, to the
/// millisecond, rounded up so a client never comes back early): `0s`, `20ms`, `1s`, `1.5s`,
/// `6m0s`, `1h0m0s`.
pub fn reset_text(duration: Duration) -> String {
    let ms = duration.as_nanos().div_ceil(1_000_000);
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (hours, rest) = (ms / 3_600_000, ms % 3_600_000);
    let (minutes, rest) = (rest / 60_000, rest % 60_000);
    let (seconds, millis) = (rest / 1000, rest % 1000);
    let seconds = if millis == 0 {
        format!("{seconds}s")
    } else {
        let fraction = format!("{millis:03}");
        format!("{seconds}.{}s", fraction.trim_end_matches('0'))
    };
    match (hours, minutes) {
        (0, 0) => seconds,
        (0, m) => format!("{m}m{seconds}"),
        (h, m) => format!("{h}h{m}m{seconds}"),
    }
}

/// `retry-after` in whole seconds: the wait rounded up, at least 1 (a 0 would invite an
/// immediate resend that is refused again).
pub fn retry_after_seconds(wait: Duration) -> u64 {
    wait.as_nanos().div_ceil(1_000_000_000).max(1) as u64
}

/// The instant `wait` from `now`, rounded up to the second, in RFC 3339 (Anthropic's resets).
pub fn rfc3339_after(now: SystemTime, wait: Duration) -> String {
    let at = now + wait;
    let since_epoch = at
        .duration_since(SystemTime::UNIX_EPOCH)
        .unwrap_or_default();
    let seconds = since_epoch.as_nanos().div_ceil(1_000_000_000) as i64;
    DateTime::<Utc>::from_timestamp(seconds, 0)
        .unwrap_or_default()
        .to_rfc3339_opts(SecondsFormat::Secs, true)
}

/// The rate-limit headers of an answer in `dialect`: those of each configured limit (unless
/// `report` is [`LimitHeaders::RetryAfterOnly`]), and on a refusal `retry-after` (with
/// `retry-after-ms` then, as Azure sends it). `now` is the wall clock (Anthropic's resets are
/// times).
pub fn limit_headers(
    dialect: RefusalDialect,
    report: LimitHeaders,
    standing: &Standing,
    retry_after: Option<Duration>,
    now: SystemTime,
) -> Vec<(&'static str, String)> {
    // (limit, remaining, reset) for requests, then for tokens.
    let names = match dialect {
        RefusalDialect::OpenAi => [
            [
                "x-ratelimit-limit-requests",
                "x-ratelimit-remaining-requests",
                "x-ratelimit-reset-requests",
            ],
            [
                "x-ratelimit-limit-tokens",
                "x-ratelimit-remaining-tokens",
                "x-ratelimit-reset-tokens",
            ],
        ],
        RefusalDialect::Anthropic => [
            [
                "anthropic-ratelimit-requests-limit",
                "anthropic-ratelimit-requests-remaining",
                "anthropic-ratelimit-requests-reset",
            ],
            [
                "anthropic-ratelimit-tokens-limit",
                "anthropic-ratelimit-tokens-remaining",
                "anthropic-ratelimit-tokens-reset",
            ],
        ],
    };
    let mut headers = Vec::new();
    let reported = match report {
        LimitHeaders::Reported => [standing.requests, standing.tokens],
        LimitHeaders::RetryAfterOnly => [None, None],
    };
    for ([limit, remaining, reset], headroom) in names.into_iter().zip(reported) {
        let Some(h) = headroom else { continue };
        let reset_value = match dialect {
            RefusalDialect::OpenAi => reset_text(h.reset),
            RefusalDialect::Anthropic => rfc3339_after(now, h.reset),
        };
        headers.push((limit, h.limit.to_string()));
        headers.push((remaining, h.remaining.to_string()));
        headers.push((reset, reset_value));
    }
    if let Some(wait) = retry_after {
        headers.push(("retry-after", retry_after_seconds(wait).to_string()));
        if report == LimitHeaders::RetryAfterOnly {
            let ms = wait.as_nanos().div_ceil(1_000_000).max(1);
            headers.push(("retry-after-ms", ms.to_string()));
        }
    }
    headers
}

/// The 429 body of `refusal` in `dialect`.
pub fn refusal_body(dialect: RefusalDialect, refusal: &Refusal) -> Value {
    let message = refusal_message(dialect, refusal);
    match dialect {
        RefusalDialect::OpenAi => json!({
            "error": {
                "message": message,
                // OpenAI's types are `requests` and `tokens`; it has no concurrency limit, and a
                // request refused for one is a request that was not admitted.
                "type": match refusal.limit {
                    Limit::Tokens => "tokens",
                    Limit::Requests | Limit::Concurrent => "requests",
                },
                "param": null,
                "code": "rate_limit_exceeded",
            }
        }),
        RefusalDialect::Anthropic => json!({
            "type": "error",
            "error": { "type": "rate_limit_error", "message": message },
        }),
    }
}

fn refusal_message(dialect: RefusalDialect, r: &Refusal) -> String {
    let per_second = r.limit_value / 60;
    let retry = reset_text(r.retry_after);
    match (dialect, r.limit) {
        (_, Limit::Concurrent) => format!(
            "Too many requests in progress at once: Limit {}, In progress {}, Requested 1. Please try again in {retry}.",
            r.limit_value, r.used
        ),
        (RefusalDialect::OpenAi, Limit::Tokens) if r.too_large => format!(
            "Request too large on tokens per min (TPM): Limit {}, Requested {}. Limits are enforced per second ({per_second} tokens in any second): the input or output tokens must be reduced in order to run successfully.",
            r.limit_value, r.requested
        ),
        (RefusalDialect::OpenAi, limit) => {
            let (name, short) = match limit {
                Limit::Tokens => ("tokens", "TPM"),
                _ => ("requests", "RPM"),
            };
            format!(
                "Rate limit reached for {name} on {name} per min ({short}): Limit {}, Used {}, Requested {}. Please try again in {retry}. Limits are enforced per second ({per_second} {name} in any second).",
                r.limit_value, r.used, r.requested
            )
        }
        (RefusalDialect::Anthropic, Limit::Tokens) if r.too_large => format!(
            "Number of request tokens ({}) exceeds what your per-minute rate limit of {} admits in one second ({per_second}); please reduce the prompt length or the maximum tokens requested.",
            r.requested, r.limit_value
        ),
        (RefusalDialect::Anthropic, Limit::Tokens) => format!(
            "This request would exceed your organization's rate limit of {} tokens per minute; see the response headers for current usage. Please reduce the prompt length or the maximum tokens requested, or try again later.",
            r.limit_value
        ),
        (RefusalDialect::Anthropic, Limit::Requests) => format!(
            "This request would exceed your organization's rate limit of {} requests per minute; see the response headers for current usage. Please try again later.",
            r.limit_value
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::UNIX_EPOCH;

    fn limits(rpm: Option<u64>, tpm: Option<u64>, at_once: Option<u64>) -> Capacity {
        Capacity::new(&LimitSettings {
            requests_per_minute: rpm,
            tokens_per_minute: tpm,
            concurrent_requests: at_once,
        })
    }

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn refused(admission: Admission) -> Refusal {
        match admission {
            Admission::Refused(refusal) => refusal,
            Admission::Admitted(standing) => panic!("admitted: {standing:?}"),
        }
    }

    #[test]
    fn a_burst_over_3000_rpm_gets_50_in_its_second_and_the_rest_refused_at_once() {
        let mut capacity = limits(Some(3000), None, None);
        let outcomes: Vec<Admission> = (0..60).map(|_| capacity.admit(ms(0), 10)).collect();
        let admitted = outcomes
            .iter()
            .filter(|a| matches!(a, Admission::Admitted(_)))
            .count();
        assert_eq!(admitted, 50);
        let Admission::Admitted(last) = &outcomes[49] else {
            panic!("the 50th is admitted")
        };
        assert_eq!(
            last.requests,
            Some(Headroom {
                limit: 3000,
                remaining: 0,
                reset: QUANTUM
            })
        );
        let refusal = refused(outcomes[50].clone());
        assert_eq!(refusal.limit, Limit::Requests);
        assert_eq!(
            (refusal.limit_value, refusal.used, refusal.requested),
            (3000, 3000, 1)
        );
        assert_eq!(refusal.retry_after, QUANTUM);
        assert!(!refusal.too_large);

        // Refusals spent nothing: one second after the burst, the whole share is back.
        assert!(matches!(capacity.admit(ms(999), 1), Admission::Refused(_)));
        let after =
            (0..51).filter(|_| matches!(capacity.admit(ms(1000), 1), Admission::Admitted(_)));
        assert_eq!(after.count(), 50);
    }

    #[test]
    fn capacity_comes_back_one_second_after_each_admission_not_all_at_once() {
        let mut capacity = limits(Some(120), None, None); // 2 in any second
        assert!(matches!(capacity.admit(ms(0), 0), Admission::Admitted(_)));
        assert!(matches!(capacity.admit(ms(400), 0), Admission::Admitted(_)));
        let refusal = refused(capacity.admit(ms(500), 0));
        // The first admission's share comes back at 1000 ms.
        assert_eq!(refusal.retry_after, ms(500));
        assert_eq!(refusal.standing.requests.unwrap().reset, ms(900));
        let Admission::Admitted(standing) = capacity.admit(ms(1000), 0) else {
            panic!("one share is back at 1000 ms")
        };
        assert_eq!(standing.requests.unwrap().remaining, 0);
        assert!(matches!(capacity.admit(ms(1001), 0), Admission::Refused(_)));
        assert!(matches!(
            capacity.admit(ms(1400), 0),
            Admission::Admitted(_)
        ));
    }

    #[test]
    fn a_limit_that_is_not_a_multiple_of_60_is_never_rounded_up() {
        // 500 RPM is 8.33 a second: 8 fit in one second, a 9th does not.
        let mut capacity = limits(Some(500), None, None);
        let admitted = (0..20)
            .filter(|_| matches!(capacity.admit(ms(0), 0), Admission::Admitted(_)))
            .count();
        assert_eq!(admitted, 8);
    }

    #[test]
    fn tokens_are_limited_by_their_cost_and_a_request_over_a_seconds_share_is_too_large() {
        let mut capacity = limits(None, Some(60_000), None); // 1,000 tokens in any second
        assert!(matches!(capacity.admit(ms(0), 600), Admission::Admitted(_)));
        let refusal = refused(capacity.admit(ms(10), 500));
        assert_eq!(refusal.limit, Limit::Tokens);
        assert_eq!((refusal.used, refusal.requested), (36_000, 500));
        assert_eq!(refusal.retry_after, ms(990));
        assert_eq!(
            refusal.standing.tokens,
            Some(Headroom {
                limit: 60_000,
                remaining: 400,
                reset: ms(990)
            })
        );
        assert!(matches!(
            capacity.admit(ms(20), 400),
            Admission::Admitted(_)
        ));

        let huge = refused(capacity.admit(ms(5_000), 1_001));
        assert!(huge.too_large);
        let body = refusal_body(RefusalDialect::OpenAi, &huge);
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("Request too large"),
            "{body}"
        );
        assert!(matches!(
            capacity.admit(ms(5_000), 1_000),
            Admission::Admitted(_)
        ));
    }

    #[test]
    fn requests_in_progress_are_capped_and_freed_when_they_end() {
        let mut capacity = limits(None, None, Some(2));
        assert!(matches!(capacity.admit(ms(0), 0), Admission::Admitted(_)));
        assert!(matches!(capacity.admit(ms(0), 0), Admission::Admitted(_)));
        let refusal = refused(capacity.admit(ms(0), 0));
        assert_eq!(refusal.limit, Limit::Concurrent);
        assert_eq!((refusal.limit_value, refusal.used), (2, 2));
        assert_eq!(capacity.in_progress(), 2);
        capacity.finish();
        assert!(matches!(capacity.admit(ms(1), 0), Admission::Admitted(_)));
        assert_eq!(capacity.in_progress(), 2);
    }

    #[test]
    fn without_limits_everything_is_admitted_and_no_header_is_sent() {
        let mut capacity = limits(None, None, None);
        for _ in 0..10_000 {
            let Admission::Admitted(standing) = capacity.admit(ms(0), 1_000_000) else {
                panic!("nothing limits")
            };
            assert_eq!(standing, Standing::default());
        }
        let headers = limit_headers(
            RefusalDialect::OpenAi,
            LimitHeaders::Reported,
            &Standing::default(),
            None,
            SystemTime::UNIX_EPOCH,
        );
        assert!(headers.is_empty());
    }

    #[test]
    fn reset_durations_are_written_as_openai_writes_them() {
        let cases = [
            (Duration::ZERO, "0s"),
            (Duration::from_micros(300), "1ms"),
            (ms(20), "20ms"),
            (ms(999), "999ms"),
            (Duration::from_micros(999_001), "1s"),
            (ms(1000), "1s"),
            (ms(1500), "1.5s"),
            (ms(1250), "1.25s"),
            (ms(61_000), "1m1s"),
            (ms(360_000), "6m0s"),
            (ms(3_600_000), "1h0m0s"),
            (ms(3_723_004), "1h2m3.004s"),
        ];
        for (duration, text) in cases {
            assert_eq!(reset_text(duration), text, "{duration:?}");
        }
    }

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_and_never_zero() {
        assert_eq!(retry_after_seconds(Duration::ZERO), 1);
        assert_eq!(retry_after_seconds(ms(20)), 1);
        assert_eq!(retry_after_seconds(ms(1000)), 1);
        assert_eq!(retry_after_seconds(ms(1001)), 2);
    }

    #[test]
    fn openai_refusals_carry_its_headers_and_body() {
        let mut capacity = limits(Some(3000), Some(90_000), None);
        for _ in 0..50 {
            capacity.admit(ms(0), 10);
        }
        let refusal = refused(capacity.admit(ms(980), 10));
        let headers = limit_headers(
            RefusalDialect::OpenAi,
            LimitHeaders::Reported,
            &refusal.standing,
            Some(refusal.retry_after),
            UNIX_EPOCH,
        );
        let expected = [
            ("x-ratelimit-limit-requests", "3000"),
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "20ms"),
            ("x-ratelimit-limit-tokens", "90000"),
            ("x-ratelimit-remaining-tokens", "1000"),
            ("x-ratelimit-reset-tokens", "20ms"),
            ("retry-after", "1"),
        ];
        let got: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(got, expected);
        // As Azure answers: no limit reported, the wait to the millisecond.
        let (openai, azure) = (RefusalDialect::OpenAi, LimitHeaders::RetryAfterOnly);
        let azure = |wait| limit_headers(openai, azure, &refusal.standing, wait, UNIX_EPOCH);
        assert_eq!(
            azure(Some(refusal.retry_after)),
            [("retry-after", "1".into()), ("retry-after-ms", "20".into())]
        );
        assert!(azure(None).is_empty(), "an admitted answer says nothing");
        let body = refusal_body(RefusalDialect::OpenAi, &refusal);
        assert_eq!(body["error"]["type"], "requests");
        assert_eq!(body["error"]["code"], "rate_limit_exceeded");
        assert_eq!(body["error"]["param"], Value::Null);
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .starts_with("Rate limit reached for requests on requests per min (RPM): Limit 3000, Used 3000, Requested 1."),
            "{body}"
        );
    }

    #[test]
    fn anthropic_refusals_carry_its_headers_with_rfc3339_resets_and_its_body() {
        let mut capacity = limits(Some(60), Some(6_000), None);
        capacity.admit(ms(0), 50);
        let refusal = refused(capacity.admit(ms(250), 50));
        // 2025-01-01T00:00:00.250Z: the reset (750 ms later) is written at the second after.
        let now = SystemTime::UNIX_EPOCH + Duration::from_millis(1_735_689_600_250);
        let headers = limit_headers(
            RefusalDialect::Anthropic,
            LimitHeaders::Reported,
            &refusal.standing,
            Some(refusal.retry_after),
            now,
        );
        let got: Vec<(&str, &str)> = headers.iter().map(|(k, v)| (*k, v.as_str())).collect();
        assert_eq!(
            got,
            [
                ("anthropic-ratelimit-requests-limit", "60"),
                ("anthropic-ratelimit-requests-remaining", "0"),
                ("anthropic-ratelimit-requests-reset", "2025-01-01T00:00:01Z"),
                ("anthropic-ratelimit-tokens-limit", "6000"),
                ("anthropic-ratelimit-tokens-remaining", "50"),
                ("anthropic-ratelimit-tokens-reset", "2025-01-01T00:00:01Z"),
                ("retry-after", "1"),
            ]
        );
        let body = refusal_body(RefusalDialect::Anthropic, &refusal);
        assert_eq!(body["type"], "error");
        assert_eq!(body["error"]["type"], "rate_limit_error");
        assert!(
            body["error"]["message"]
                .as_str()
                .unwrap()
                .contains("60 requests per minute")
        );
    }

    /// One step of a client: arrive `gap_ms` after the previous step, asking for `tokens`;
    /// or an admitted request ends.
    #[derive(Debug, Clone)]
    enum Step {
        Arrive { gap_ms: u64, tokens: u64 },
        End,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => (0u64..120, 0u64..400).prop_map(|(gap_ms, tokens)| Step::Arrive { gap_ms, tokens }),
            1 => Just(Step::End),
        ]
    }

    proptest! {
        /// Whatever arrives, and whenever: in any window of one second the admitted requests
        /// and tokens stay within a 60th of their per-minute limits, and at no instant are more
        /// requests in progress than the concurrency limit.
        #[test]
        fn admitted_requests_never_exceed_the_limits(
            rpm in 60u64..1200,
            tpm in 6_000u64..60_000,
            at_once in 1u64..12,
            steps in prop::collection::vec(step(), 1..400),
        ) {
            let mut capacity = limits(Some(rpm), Some(tpm), Some(at_once));
            let mut now = Duration::ZERO;
            let mut admitted: Vec<(Duration, u64)> = Vec::new();
            let mut open = 0u64;
            for step in steps {
                match step {
                    Step::Arrive { gap_ms, tokens } => {
                        now += ms(gap_ms);
                        match capacity.admit(now, tokens) {
                            Admission::Admitted(_) => {
                                admitted.push((now, tokens));
                                open += 1;
                            }
                            Admission::Refused(refusal) => {
                                prop_assert!(refusal.retry_after <= QUANTUM);
                            }
                        }
                    }
                    Step::End if open > 0 => {
                        capacity.finish();
                        open -= 1;
                    }
                    Step::End => {}
                }
                prop_assert!(open <= at_once);
                prop_assert_eq!(capacity.in_progress(), open);
            }
            // The busiest windows start at an admission.
            for &(start, _) in &admitted {
                let inside = admitted.iter().filter(|(at, _)| *at >= start && *at < start + QUANTUM);
                let (count, tokens) = inside.fold((0u64, 0u64), |(c, t), (_, cost)| (c + 1, t + cost));
                prop_assert!(count * 60 <= rpm, "{count} requests in a second under {rpm} RPM");
                prop_assert!(tokens * 60 <= tpm, "{tokens} tokens in a second under {tpm} TPM");
            }
        }

        /// A refusal is honest: waiting out its retry-after (nobody else arriving) admits the
        /// same request, unless it is too large for any second; and refusing spends nothing.
        #[test]
        fn waiting_out_a_refusal_admits_the_same_request(
            rpm in 60u64..600,
            tpm in 600u64..6_000,
            arrivals in prop::collection::vec((0u64..200, 0u64..100), 1..200),
            tokens in 0u64..150,
        ) {
            let mut capacity = limits(Some(rpm), Some(tpm), None);
            let mut now = Duration::ZERO;
            for (gap_ms, cost) in arrivals {
                now += ms(gap_ms);
                let _ = capacity.admit(now, cost);
            }
            let before = capacity.standing(now);
            if let Admission::Refused(refusal) = capacity.admit(now, tokens) {
                prop_assert_eq!(capacity.standing(now), before);
                let retried = capacity.admit(now + refusal.retry_after, tokens);
                prop_assert_eq!(matches!(retried, Admission::Admitted(_)), !refusal.too_large);
                prop_assert_eq!(refusal.too_large, tokens * 60 > tpm);
            }
        }
    }
}
