//! What to do after a provider call failed: retry after a delay, or fail the task for good.
//! Pure: the caller supplies the attempt number, the budget left and a random draw.
//!
//! Keeps I7 (bounded effort) on the provider side: a retry is never planned past the attempt
//! budget or the deadline, and the delay lands in the task row (`next_attempt_at`), so a
//! redelivery or a restart continues the same schedule. Delays are exponential with full
//! jitter, capped, and never shorter than what the provider asked for (`Retry-After`).

use std::time::Duration;

use serde::Deserialize;

use crate::domain::AttemptOutcome;
use crate::provider::ProviderError;

/// What to do when a call may have run at the provider and nothing can recover it.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Deserialize, serde::Serialize, Default, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum AmbiguousPolicy {
    /// Call again, within the attempt budget: the reply matters more than the chance of paying
    /// for a second generation.
    #[default]
    Retry,
    /// Fail the task as `ambiguous` and keep the evidence: never pay twice, at the risk of no
    /// reply.
    Stop,
}

/// Backoff settings, `[retry]` in the settings file.
#[derive(Debug, Clone, Deserialize, serde::Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RetrySettings {
    /// First backoff bound; attempt n waits a random time up to `base * 2^(n-1)`.
    pub base_delay_ms: u64,
    /// Longest backoff (before the provider's own `Retry-After`, which may be longer).
    pub max_delay_ms: u64,
    /// When an ambiguous failure cannot be recovered (the provider offers neither an
    /// idempotency key nor an operation id): `retry` or `stop`.
    pub ambiguous: AmbiguousPolicy,
    /// Whether the provider honours `Idempotency-Key` (the same key while in flight or done
    /// returns the same result without a new generation). Default false: OpenAI chat
    /// completions and Anthropic Messages document no such key (their SDKs send none), so a
    /// resend after an ambiguous failure may be a second, paid generation. Set it true only
    /// for a provider or gateway that documents it. When false, and the adapter has no other
    /// recovery (background responses recover by operation id instead), an ambiguous failure
    /// follows `ambiguous`.
    pub provider_honours_idempotency_key: bool,
}

impl Default for RetrySettings {
    fn default() -> Self {
        Self {
            base_delay_ms: 500,
            max_delay_ms: 30_000,
            ambiguous: AmbiguousPolicy::Retry,
            provider_honours_idempotency_key: false,
        }
    }
}

/// The decision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Give the lease back; the next attempt (by anyone) starts no sooner than `after`.
    Retry { after: Duration },
    /// Fail the task for good with `reason`; `outcome` is the attempt's recorded outcome.
    Fail {
        reason: String,
        outcome: AttemptOutcome,
    },
}

/// What the caller knows about the failed attempt.
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    /// 1-based number of the attempt that failed.
    pub number: i32,
    pub max_attempts: i32,
    /// Time left before the task's deadline, if it has one.
    pub deadline_left: Option<Duration>,
    /// The class (`ProviderError::kind`) of the previous attempt's failure, if any.
    pub previous_error: Option<&'a str>,
    /// Whether the provider adapter can recover an ambiguous call (resend with the same
    /// idempotency key, or look the operation up by its id) instead of generating again.
    pub recoverable: bool,
}

/// The recorded outcome of an attempt that failed with `error`.
pub fn attempt_outcome(error: &ProviderError) -> AttemptOutcome {
    match error {
        ProviderError::Ambiguous { .. } => AttemptOutcome::Ambiguous,
        ProviderError::StillRunning { .. } => AttemptOutcome::Timeout,
        _ => AttemptOutcome::ProviderError,
    }
}

/// Decides after a failed call. `draw` is uniform in `[0, 1)` (the jitter).
pub fn decide(
    error: &ProviderError,
    attempt: Attempt<'_>,
    settings: &RetrySettings,
    draw: f64,
) -> Action {
    let outcome = attempt_outcome(error);
    let fail = |reason: String| Action::Fail { reason, outcome };
    match error {
        ProviderError::Fatal { .. } => return fail(error.to_string()),
        // Another attempt would only wait on the same operation again (or, without its id,
        // start and pay for a second one): the task ends here, and its reservation stays open
        // until the provider says how the operation ended (I8).
        ProviderError::StillRunning { .. } => return fail(error.to_string()),
        ProviderError::MalformedResponse { .. } if attempt.previous_error == Some(error.kind()) => {
            return fail(format!("{error} (twice in a row)"));
        }
        ProviderError::Ambiguous { .. }
            if !attempt.recoverable && settings.ambiguous == AmbiguousPolicy::Stop =>
        {
            return fail(format!(
                "ambiguous: {error}; the provider offers no recovery and the ambiguous policy is stop"
            ));
        }
        _ => {}
    }
    if attempt.number >= attempt.max_attempts {
        return fail(format!(
            "attempt budget exhausted: {} of {} attempts used; last error: {error}",
            attempt.number, attempt.max_attempts
        ));
    }
    let after = backoff(attempt.number, settings, draw, server_hint(error));
    if let Some(left) = attempt.deadline_left.filter(|left| after >= *left) {
        return fail(format!(
            "deadline exceeded: the next attempt could start only after {after:?}, {left:?} before the deadline; last error: {error}"
        ));
    }
    Action::Retry { after }
}

/// The provider's own "not before" (`Retry-After`), when it gave one.
fn server_hint(error: &ProviderError) -> Option<Duration> {
    match error {
        ProviderError::Retryable { retry_after, .. } => *retry_after,
        _ => None,
    }
}

/// Full jitter: uniform in `[0, min(cap, base * 2^(n-1))]`, then never below the hint.
pub fn backoff(
    attempt: i32,
    settings: &RetrySettings,
    draw: f64,
    hint: Option<Duration>,
) -> Duration {
    let exponent = u32::try_from(attempt.saturating_sub(1))
        .unwrap_or(0)
        .min(30);
    let bound_ms = settings
        .base_delay_ms
        .saturating_mul(1u64 << exponent)
        .min(settings.max_delay_ms);
    let jittered = Duration::from_millis((bound_ms as f64 * draw.clamp(0.0, 1.0)) as u64);
    hint.map_or(jittered, |hint| jittered.max(hint))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn attempt(number: i32) -> Attempt<'static> {
        Attempt {
            number,
            max_attempts: 5,
            deadline_left: None,
            previous_error: None,
            recoverable: true,
        }
    }

    fn ambiguous() -> ProviderError {
        ProviderError::Ambiguous {
            message: "timed out".into(),
        }
    }

    #[test]
    fn each_failure_class_gets_its_action() {
        let s = RetrySettings::default();
        let cases: Vec<(ProviderError, bool)> = vec![
            (
                ProviderError::NotSent {
                    message: "refused".into(),
                },
                true,
            ),
            (
                ProviderError::Retryable {
                    status: 429,
                    retry_after: None,
                    message: "slow down".into(),
                },
                true,
            ),
            (
                ProviderError::MaybeExecuted {
                    status: 502,
                    message: "bad gateway".into(),
                },
                true,
            ),
            (ambiguous(), true),
            (
                ProviderError::MalformedResponse {
                    message: "no choices".into(),
                },
                true,
            ),
            (
                ProviderError::Fatal {
                    status: 400,
                    message: "bad request".into(),
                },
                false,
            ),
        ];
        for (error, retries) in cases {
            let action = decide(&error, attempt(1), &s, 0.5);
            assert_eq!(
                matches!(action, Action::Retry { .. }),
                retries,
                "{error:?} → {action:?}"
            );
        }
    }

    #[test]
    fn fatal_errors_fail_with_the_providers_message() {
        let error = ProviderError::Fatal {
            status: 400,
            message: "model `x` does not exist".into(),
        };
        let Action::Fail { reason, outcome } =
            decide(&error, attempt(1), &RetrySettings::default(), 0.5)
        else {
            panic!("fatal must fail");
        };
        assert!(reason.contains("model `x` does not exist"), "{reason}");
        assert_eq!(outcome, AttemptOutcome::ProviderError);
    }

    #[test]
    fn an_operation_still_running_past_the_longest_wait_fails_without_another_attempt() {
        let error = ProviderError::StillRunning {
            operation: "resp_1".into(),
            waited_ms: 1_800_000,
        };
        let Action::Fail { reason, outcome } =
            decide(&error, attempt(1), &RetrySettings::default(), 0.5)
        else {
            panic!("waiting again is no new attempt");
        };
        assert!(reason.contains("resp_1 still running"), "{reason}");
        assert_eq!(outcome, AttemptOutcome::Timeout);
    }

    #[test]
    fn a_malformed_answer_is_retried_once_then_fatal() {
        let error = ProviderError::MalformedResponse {
            message: "no choices".into(),
        };
        let again = Attempt {
            previous_error: Some("malformed_response"),
            ..attempt(2)
        };
        assert!(matches!(
            decide(&error, again, &RetrySettings::default(), 0.5),
            Action::Fail { .. }
        ));
    }

    #[test]
    fn an_unrecoverable_ambiguous_failure_follows_the_policy() {
        let none = Attempt {
            recoverable: false,
            ..attempt(1)
        };
        let stop = RetrySettings {
            ambiguous: AmbiguousPolicy::Stop,
            ..RetrySettings::default()
        };
        assert!(matches!(
            decide(&ambiguous(), none, &stop, 0.5),
            Action::Fail {
                outcome: AttemptOutcome::Ambiguous,
                ..
            }
        ));
        assert!(matches!(
            decide(&ambiguous(), none, &RetrySettings::default(), 0.5),
            Action::Retry { .. }
        ));
        // With a way to recover, "stop" does not apply: resending with the key is safe.
        assert!(matches!(
            decide(&ambiguous(), attempt(1), &stop, 0.5),
            Action::Retry { .. }
        ));
    }

    #[test]
    fn the_budget_and_the_deadline_end_the_retries() {
        let s = RetrySettings::default();
        let last = Attempt {
            number: 5,
            ..attempt(5)
        };
        assert!(matches!(
            decide(&ambiguous(), last, &s, 0.5),
            Action::Fail { .. }
        ));
        let hurried = Attempt {
            deadline_left: Some(Duration::from_millis(100)),
            ..attempt(1)
        };
        let rate_limited = ProviderError::Retryable {
            status: 429,
            retry_after: Some(Duration::from_secs(2)),
            message: "slow down".into(),
        };
        let Action::Fail { reason, .. } = decide(&rate_limited, hurried, &s, 0.5) else {
            panic!("a retry after the deadline is no retry");
        };
        assert!(reason.starts_with("deadline exceeded"), "{reason}");
    }

    #[test]
    fn retry_after_is_a_floor_under_the_jitter() {
        let s = RetrySettings::default();
        let hint = Some(Duration::from_secs(3));
        assert_eq!(backoff(1, &s, 0.0, hint), Duration::from_secs(3));
        assert_eq!(backoff(1, &s, 0.999, None), Duration::from_millis(499));
    }

    proptest! {
        /// Every delay lies in [hint, max(hint, min(cap, base * 2^(n-1)))].
        #[test]
        fn delays_stay_within_their_bounds(n in 1i32..40, draw in 0.0f64..1.0, hint_ms in proptest::option::of(0u64..60_000)) {
            let s = RetrySettings::default();
            let hint = hint_ms.map(Duration::from_millis);
            let d = backoff(n, &s, draw, hint);
            let bound = Duration::from_millis((s.base_delay_ms << (n - 1).min(30)).min(s.max_delay_ms));
            let floor = hint.unwrap_or_default();
            prop_assert!(d >= floor);
            prop_assert!(d <= bound.max(floor));
        }
    }
}
