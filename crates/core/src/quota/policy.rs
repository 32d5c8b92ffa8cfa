//! The quota policy: what a task's end charges, what one more request needs to be admitted,
//! and how many tokens a settlement or a Stop charges. The rules admission and settlement
//! apply, apart from the retry advice and the reconciler that build on them.

use std::time::Duration;

use super::reservation::Settle;

/// The quota rules of one installation (`[quota]` in the settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuotaPolicy {
    /// Whether a task that ends failed is charged.
    pub charge_failed: bool,
    /// Whether open reservations count against the limit at admission.
    pub pending_reserves: bool,
    /// How long a reservation stays open before the reconciler looks at it.
    pub reservation_ttl: Duration,
    /// How a reservation is settled whose task failed while the provider may have done its
    /// work (an answer lost after the request was sent) when nothing can tell what happened:
    /// charged (the provider may have billed it) or released.
    pub charge_unresolved: bool,
}

impl QuotaPolicy {
    /// How a task that ended failed settles its reservation.
    pub fn on_failure(self) -> Settle {
        if self.charge_failed {
            Settle::Charge
        } else {
            Settle::Release
        }
    }

    /// How an unresolved reservation is settled once nothing can tell whether the provider did
    /// the work.
    pub fn on_unresolved(self) -> Settle {
        if self.charge_unresolved {
            Settle::Charge
        } else {
            Settle::Release
        }
    }
}

/// The counter row as admission and `GET /v1/quota` see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Usage {
    /// None: no limit.
    pub limit: Option<i64>,
    pub used: i64,
    pub reserved: i64,
}

impl Usage {
    /// Whether one more request fits (the same rule the admission statement applies).
    pub fn admits(self, policy: QuotaPolicy) -> bool {
        match self.limit {
            None => true,
            Some(limit) => {
                let held = if policy.pending_reserves {
                    self.reserved
                } else {
                    0
                };
                self.used + held < limit
            }
        }
    }
}

impl Usage {
    /// The token counter as a count of units, for a request of `asked` tokens: it fits when
    /// `used + held + asked <= limit`, exactly when one unit fits under `limit - asked + 1`,
    /// so the generation rules ([`Usage::admits`], [`advise_retry`]) apply unchanged. A
    /// request larger than the whole limit reads as a limit of 0: no window admits it.
    ///
    /// [`advise_retry`]: super::retry::advise_retry
    pub fn in_units_of(self, asked: i64) -> Usage {
        Usage {
            limit: self
                .limit
                .map(|limit| limit.saturating_sub(asked).saturating_add(1).max(0)),
            ..self
        }
    }
}

/// Which of a workspace's limits refused a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Limited {
    Generations,
    /// The request's token ceiling (`asked`) does not fit the token limit.
    Tokens {
        asked: i64,
    },
}

/// Tokens a settlement charges (`replyd_tokens_to_charge` of V17 is its twin): a charge, the
/// usage the saved reply reported, else the request's ceiling (a reply that reported none, or
/// a charged failure, which saved none: "not reported" is never charged as 0); a release or an
/// expiry, none.
pub fn tokens_to_charge(settle: Settle, reported: Option<i64>, ceiling: i64) -> i64 {
    match settle {
        Settle::Charge => reported.unwrap_or(ceiling),
        Settle::Release | Settle::Expire => 0,
    }
}

/// Tokens a Stop charges for a call that may have run (`replyd_stop_tokens` of V27 is its
/// twin): what the task's attempts reported, or at least its prompt's bound (the `ceiling`
/// less `output_bound`, the request's `max_output_tokens` or
/// [`crate::workspace_policy::DEFAULT_OUTPUT_CEILING`]) and the `shown_bytes` of text its
/// followers were shown, a token being at least one byte; never past the ceiling for text
/// alone. A stopped reply is work the provider bills, as far as anyone can tell it was done.
pub fn stop_tokens(ceiling: i64, output_bound: i64, shown_bytes: i64, reported: i64) -> i64 {
    let prompt = (ceiling - output_bound).max(0);
    reported.max(ceiling.min(prompt + shown_bytes.max(0)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stop_charges_the_prompt_and_the_text_shown_or_what_was_reported() {
        // A ceiling of 1,000 prompt bytes and 4,096 output tokens.
        assert_eq!(
            stop_tokens(5_096, 4_096, 0, 0),
            1_000,
            "nothing shown: the prompt"
        );
        assert_eq!(stop_tokens(5_096, 4_096, 2_400, 0), 3_400);
        assert_eq!(
            stop_tokens(5_096, 4_096, 9_000, 0),
            5_096,
            "never past the ceiling"
        );
        assert_eq!(
            stop_tokens(5_096, 4_096, 2_400, 6_000),
            6_000,
            "what was reported"
        );
        assert_eq!(
            stop_tokens(100, 4_096, 50, 0),
            50,
            "a ceiling under the output bound"
        );
    }

    const POLICY: QuotaPolicy = QuotaPolicy {
        charge_failed: false,
        pending_reserves: true,
        reservation_ttl: Duration::from_secs(3600),
        charge_unresolved: true,
    };

    #[test]
    fn a_failure_is_charged_only_when_the_policy_says_so() {
        assert_eq!(POLICY.on_failure(), Settle::Release);
        let charging = QuotaPolicy {
            charge_failed: true,
            ..POLICY
        };
        assert_eq!(charging.on_failure(), Settle::Charge);
        assert_eq!(Settle::Charge.charged_units(), 1);
        assert_eq!(Settle::Release.charged_units(), 0);
        assert_eq!(Settle::Expire.charged_units(), 0);
    }

    #[test]
    fn admission_counts_open_reservations_only_when_pending_work_reserves() {
        let usage = Usage {
            limit: Some(10),
            used: 6,
            reserved: 4,
        };
        assert!(!usage.admits(POLICY));
        let not_reserving = QuotaPolicy {
            pending_reserves: false,
            ..POLICY
        };
        assert!(usage.admits(not_reserving));
        assert!(
            Usage {
                limit: None,
                used: 1_000,
                reserved: 1_000
            }
            .admits(POLICY)
        );
        assert!(
            !Usage {
                limit: Some(0),
                used: 0,
                reserved: 0
            }
            .admits(POLICY)
        );
    }

    fn policy(pending_reserves: bool) -> QuotaPolicy {
        QuotaPolicy {
            charge_failed: false,
            pending_reserves,
            reservation_ttl: Duration::from_secs(3600),
            charge_unresolved: true,
        }
    }

    #[test]
    fn a_request_fits_the_token_limit_exactly_when_its_units_admit_one() {
        let tokens = Usage {
            limit: Some(1_000),
            used: 600,
            reserved: 300,
        };
        assert!(tokens.in_units_of(100).admits(policy(true)));
        assert!(!tokens.in_units_of(101).admits(policy(true)));
        // Open reservations do not count when pending work does not reserve.
        assert!(tokens.in_units_of(400).admits(policy(false)));
        assert!(!tokens.in_units_of(401).admits(policy(false)));
        // Larger than the whole limit: a limit of 0, which no window admits.
        assert_eq!(tokens.in_units_of(5_000).limit, Some(0));
        assert_eq!(
            Usage {
                limit: None,
                ..tokens
            }
            .in_units_of(9)
            .limit,
            None
        );
    }

    #[test]
    fn a_charge_is_the_reported_usage_else_the_ceiling_and_nothing_else_charges() {
        assert_eq!(tokens_to_charge(Settle::Charge, Some(42), 900), 42);
        assert_eq!(tokens_to_charge(Settle::Charge, Some(0), 900), 0);
        assert_eq!(tokens_to_charge(Settle::Charge, None, 900), 900);
        assert_eq!(tokens_to_charge(Settle::Release, Some(42), 900), 0);
        assert_eq!(tokens_to_charge(Settle::Expire, None, 900), 0);
    }
}
