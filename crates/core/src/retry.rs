//! What to do after a provider call failed: retry after a delay, or fail the task for good.
//! Pure: the caller supplies the attempt number, the budget left and a random draw.
//!
//! Keeps I7 (bounded effort) on the provider side: a retry is never planned past the attempt
//! budget or the deadline, and the delay lands in the task row (`next_attempt_at`), so a
//! redelivery or a restart continues the same schedule. Delays are exponential with full
//! jitter, capped, and never shorter than what the provider asked for (`Retry-After`).
//!
//! The attempt budget counts calls that may have cost money. A refusal that surely did no work
//! (a 429, a 503, a connection refused: `ProviderRan::No`) gives its attempt back, and is
//! bounded instead by the deadline and by a budget of its own, in time
//! (`retry.refusal_budget_ms` from the first refusal): a burst against a rate-limited provider
//! waits for capacity instead of failing its tasks, and the task says which budget ended it.

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
    /// How long a task may keep being refused by the provider (429, 503, connection refused),
    /// counted from its first refusal. Refusals spend no attempt (they cost nothing); this is
    /// what ends a task whose provider never lets it in. Default 600000 (10 minutes).
    pub refusal_budget_ms: u64,
}

impl Default for RetrySettings {
    fn default() -> Self {
        Self {
            base_delay_ms: 500,
            max_delay_ms: 30_000,
            ambiguous: AmbiguousPolicy::Retry,
            provider_honours_idempotency_key: false,
            refusal_budget_ms: 10 * 60 * 1000,
        }
    }
}

impl RetrySettings {
    /// What is wrong with `[retry]` on its own: a setting and why, for each broken rule.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = Vec::new();
        if self.base_delay_ms == 0 || self.base_delay_ms > self.max_delay_ms {
            out.push((
                "retry.base_delay_ms",
                format!(
                    "{} must be positive and at most retry.max_delay_ms ({})",
                    self.base_delay_ms, self.max_delay_ms
                ),
            ));
        }
        out
    }

    pub fn refusal_budget(&self) -> Duration {
        Duration::from_millis(self.refusal_budget_ms)
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
    /// 1-based number of the attempt that failed (of the calls that may have cost money).
    pub number: i32,
    pub max_attempts: i32,
    /// Refusals before this one (`reply_tasks.refusals`).
    pub refusals: i32,
    /// Time left of the refusal budget, once a refusal started it; `None` before the first.
    pub refusal_left: Option<Duration>,
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
        _ if is_refusal(error) => AttemptOutcome::Refused,
        _ => AttemptOutcome::ProviderError,
    }
}

/// A refusal: the provider turned the call away (or it never left) and did no work, so it is
/// no attempt of the budget (I7).
pub fn is_refusal(error: &ProviderError) -> bool {
    matches!(
        error,
        ProviderError::NotSent { .. } | ProviderError::Retryable { .. }
    )
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
    if is_refusal(error) {
        return decide_refusal(error, attempt, settings, draw);
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

/// After a refusal: retry, backing off by the number of refusals so far, unless the refusal
/// budget or the deadline would end before the retry could start. No attempt is spent.
fn decide_refusal(
    error: &ProviderError,
    attempt: Attempt<'_>,
    settings: &RetrySettings,
    draw: f64,
) -> Action {
    let fail = |reason: String| Action::Fail {
        reason,
        outcome: AttemptOutcome::Refused,
    };
    let refusals = attempt.refusals.saturating_add(1);
    let after = backoff(refusals, settings, draw, server_hint(error));
    let budget_left = attempt
        .refusal_left
        .unwrap_or_else(|| settings.refusal_budget());
    if after >= budget_left {
        return fail(format!(
            "refusal budget exhausted: the provider refused {refusals} calls over              retry.refusal_budget_ms ({} ms) without doing them, and the next could start only              after {after:?}; last error: {error}",
            settings.refusal_budget_ms
        ));
    }
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
            refusals: 0,
            refusal_left: None,
            deadline_left: None,
            previous_error: None,
            recoverable: true,
        }
    }

    /// The reason and outcome of a decision that must fail the attempt.
    fn failure(
        error: &ProviderError,
        attempt: Attempt<'_>,
        s: &RetrySettings,
    ) -> (String, AttemptOutcome) {
        match decide(error, attempt, s, 0.5) {
            Action::Fail { reason, outcome } => (reason, outcome),
            other => panic!("{error:?} must fail, not {other:?}"),
        }
    }

    /// Asserts that `error` on a first attempt fails the task at once, as `outcome`, with a
    /// reason that quotes `says`.
    fn assert_fails_at_once(error: &ProviderError, says: &str, outcome: AttemptOutcome) {
        let (reason, failed_as) = failure(error, attempt(1), &RetrySettings::default());
        assert!(reason.contains(says), "{reason}");
        assert_eq!(failed_as, outcome);
    }

    /// A first attempt after `refusals` refusals, with `left` of the refusal budget.
    fn after_refusals(refusals: i32, left: Duration) -> Attempt<'static> {
        Attempt {
            refusals,
            refusal_left: Some(left),
            ..attempt(1)
        }
    }

    fn rate_limited(retry_after: Option<Duration>) -> ProviderError {
        ProviderError::Retryable {
            status: 429,
            retry_after,
            message: "rate_limit_exceeded".into(),
            signals: Box::default(),
        }
    }

    #[test]
    fn a_refusal_on_the_last_attempt_spends_nothing_and_is_retried() {
        let s = RetrySettings::default();
        for refusal in [
            rate_limited(Some(Duration::from_secs(1))),
            ProviderError::NotSent {
                message: "connection refused".into(),
            },
            ProviderError::Retryable {
                status: 503,
                retry_after: None,
                message: "overloaded".into(),
                signals: Box::default(),
            },
        ] {
            assert_eq!(attempt_outcome(&refusal), AttemptOutcome::Refused);
            assert!(
                matches!(decide(&refusal, attempt(5), &s, 0.5), Action::Retry { .. }),
                "{refusal:?}"
            );
        }
        // A call that may have run is an attempt, and the last one ends the task.
        let paid = ProviderError::MaybeExecuted {
            status: 502,
            message: "bad gateway".into(),
        };
        assert!(matches!(
            decide(&paid, attempt(5), &s, 0.5),
            Action::Fail {
                outcome: AttemptOutcome::ProviderError,
                ..
            }
        ));
    }

    #[test]
    fn the_refusal_budget_ends_a_task_the_provider_never_lets_in() {
        let s = RetrySettings::default();
        let nearly_spent = after_refusals(40, Duration::from_millis(500));
        // A retry past the refusal budget is no retry.
        let (reason, outcome) = failure(
            &rate_limited(Some(Duration::from_secs(1))),
            nearly_spent,
            &s,
        );
        assert!(reason.starts_with("refusal budget exhausted"), "{reason}");
        assert!(reason.contains("retry.refusal_budget_ms"), "{reason}");
        assert_eq!(outcome, AttemptOutcome::Refused);
        // The first refusal starts the budget: the whole of it is left.
        assert!(matches!(
            decide(&rate_limited(None), attempt(1), &s, 0.5),
            Action::Retry { .. }
        ));
    }

    #[test]
    fn refusals_back_off_by_their_own_count_under_the_providers_hint() {
        let s = RetrySettings::default();
        let many = after_refusals(20, Duration::from_secs(600));
        let Action::Retry { after } = decide(&rate_limited(None), many, &s, 0.999) else {
            panic!("retried");
        };
        // 20 refusals: the backoff bound is the cap.
        assert!(after > Duration::from_secs(29), "{after:?}");
        let Action::Retry { after } = decide(
            &rate_limited(Some(Duration::from_secs(7))),
            attempt(1),
            &s,
            0.0,
        ) else {
            panic!("retried");
        };
        assert_eq!(after, Duration::from_secs(7));
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
                    signals: Box::default(),
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
        assert_fails_at_once(
            &error,
            "model `x` does not exist",
            AttemptOutcome::ProviderError,
        );
    }

    #[test]
    fn an_operation_still_running_past_the_longest_wait_fails_without_another_attempt() {
        let error = ProviderError::StillRunning {
            operation: "resp_1".into(),
            waited_ms: 1_800_000,
        };
        // Waiting again is no new attempt.
        assert_fails_at_once(&error, "resp_1 still running", AttemptOutcome::Timeout);
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
        assert!(matches!(
            decide(&ambiguous(), attempt(5), &s, 0.5),
            Action::Fail { .. }
        ));
        let hurried = Attempt {
            deadline_left: Some(Duration::from_millis(100)),
            ..attempt(1)
        };
        let rate_limited = ProviderError::Retryable {
            status: 429,
            retry_after: Some(Duration::from_secs(2)),
            signals: Box::default(),
            message: "slow down".into(),
        };
        // A retry after the deadline is no retry.
        let (reason, _) = failure(&rate_limited, hurried, &s);
        assert!(reason.starts_with("deadline exceeded"), "{reason}");
    }

    #[test]
    fn retry_after_is_a_floor_under_the_jitter() {
        let s = RetrySettings::default();
        let hint = Some(Duration::from_secs(3));
        assert_eq!(backoff(1, &s, 0.0, hint), Duration::from_secs(3));
        assert_eq!(backoff(1, &s, 0.999, None), Duration::from_millis(499));
    }

    /// The classes a call can fail with, for the property below.
    fn error_of(kind: u8) -> ProviderError {
        match kind % 6 {
            0 => rate_limited(None),
            1 => ProviderError::NotSent {
                message: "refused".into(),
            },
            2 => ProviderError::MaybeExecuted {
                status: 500,
                message: "".into(),
            },
            3 => ProviderError::Ambiguous { message: "".into() },
            4 => ProviderError::MalformedResponse { message: "".into() },
            _ => ProviderError::Retryable {
                status: 503,
                retry_after: Some(Duration::from_secs(2)),
                message: "".into(),
                signals: Box::default(),
            },
        }
    }

    proptest! {
        /// I7 over any run of failures, as the runner applies the decisions: the calls that
        /// may have cost money never exceed the attempt budget (a refusal gives its attempt
        /// back), and the time spent on refusals never passes the refusal budget.
        #[test]
        fn paid_calls_stay_within_the_budget_whatever_the_refusals(
            kinds in proptest::collection::vec(0u8..6, 1..60),
            max_attempts in 1i32..6,
            draws in proptest::collection::vec(0.0f64..1.0, 60),
        ) {
            let s = RetrySettings { refusal_budget_ms: 120_000, ..RetrySettings::default() };
            let (mut paid, mut refusals) = (0i32, 0i32);
            let mut refused_for = Duration::ZERO;
            for (kind, draw) in kinds.iter().zip(&draws) {
                let error = error_of(*kind);
                // The claim took an attempt; a refusal gives it back below.
                let number = paid + 1;
                let attempt = Attempt {
                    number,
                    max_attempts,
                    refusals,
                    refusal_left: (refusals > 0).then(|| s.refusal_budget().saturating_sub(refused_for)),
                    deadline_left: None,
                    previous_error: None,
                    recoverable: true,
                };
                let action = decide(&error, attempt, &s, *draw);
                if is_refusal(&error) {
                    refusals += 1;
                } else {
                    paid += 1;
                }
                prop_assert!(paid <= max_attempts, "{paid} paid calls of {max_attempts}");
                match action {
                    Action::Retry { after } => {
                        if is_refusal(&error) {
                            refused_for += after;
                            prop_assert!(refused_for < s.refusal_budget());
                        }
                    }
                    Action::Fail { .. } => break,
                }
            }
        }

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
