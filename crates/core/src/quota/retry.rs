//! When a refused request is worth trying again (the `Retry-After` of a quota refusal): the
//! facts the store reads after a refusal and the advice decided from them. Separate from the
//! policy because it is a judgement over time (windows, settlements, the reconciler's passes),
//! not a rule of admission.

use std::time::Duration;

use super::policy::{QuotaPolicy, Usage};

/// The wait a refusal advises when open reservations hold the capacity and there is nothing
/// to estimate their settlement from (no reservation of the workspace settled yet, or none
/// took as long as the oldest open one has been open). Replies take seconds; 5 s bounds a
/// refused client to a retry every 5 s and leaves returned capacity unused for 5 s at most,
/// where the reservation's TTL (an hour) would leave it unused all that time.
pub const DEFAULT_SETTLE_WAIT: Duration = Duration::from_secs(5);

/// The shortest wait a refusal advises: `Retry-After` is in whole seconds, and 0 would have a
/// client ask again at once.
const FLOOR: Duration = Duration::from_secs(1);

/// Where the first (earliest-expiring) open reservation stands against its TTL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FirstExpiry {
    /// It expires this long from now.
    In(Duration),
    /// Its TTL ran out this long ago and the reconciler has not settled it yet.
    Passed(Duration),
}

/// What the store knows of a workspace's quota right after a refusal: the facts
/// [`advise_retry`] decides from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RefusalFacts {
    pub usage: Usage,
    /// Until the current window ends and `used` starts again from 0.
    pub until_window_end: Duration,
    /// The first open reservation's expiry; None when no reservation is open.
    pub first_expiry: Option<FirstExpiry>,
    /// How long the oldest open reservation has been open.
    pub oldest_open_age: Option<Duration>,
    /// How long the workspace's most recently settled reservations (charged or released; an
    /// expired one only says the TTL) took from admission to settlement.
    pub recent_settle_times: Vec<Duration>,
}

/// When a refused request is worth trying again, and what that is based on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RetryAdvice {
    /// The quota has room again (a reservation was released, the window reset or the limit
    /// changed between the refusal and the read): at once (after [`FLOOR`]).
    Now,
    /// Charges fill the window: capacity returns when it resets, `after` from now.
    WindowEnd { after: Duration },
    /// Open reservations hold the capacity: the first is expected to settle `after` from now.
    FirstSettlement {
        after: Duration,
        basis: SettleEstimate,
    },
    /// The first open reservation is past its TTL: the reconciler's next pass, `after` from
    /// now at the latest, settles it.
    ReconcilerPass {
        after: Duration,
        /// How long ago its TTL ran out.
        overdue: Duration,
    },
    /// A limit of 0: capacity returns only when an operator raises it; there is no time to
    /// retry at.
    Never,
}

/// What an estimate of the first settlement rests on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SettleEstimate {
    /// The median of what the recent settlements that took longer than the oldest open
    /// reservation's age took beyond that age (`samples` of the `recent`).
    Recent {
        samples: usize,
        recent: usize,
        oldest_age: Duration,
    },
    /// [`DEFAULT_SETTLE_WAIT`]: `recent` settlements, none longer than `oldest_age`.
    Default { recent: usize, oldest_age: Duration },
}

impl RetryAdvice {
    /// The `Retry-After`; None: do not send one.
    pub fn after(self) -> Option<Duration> {
        match self {
            RetryAdvice::Now => Some(FLOOR),
            RetryAdvice::WindowEnd { after }
            | RetryAdvice::FirstSettlement { after, .. }
            | RetryAdvice::ReconcilerPass { after, .. } => Some(after),
            RetryAdvice::Never => None,
        }
    }
}

/// The earliest time a refused request is worth trying again:
/// - a limit of 0: never (until an operator raises it);
/// - charges fill the window (`used >= limit`, or open reservations do not count): its end;
/// - open reservations hold the capacity: when the first of them settles, estimated by
///   [`estimate_first_settlement`] and never after its expiry; or, when the first is past its
///   TTL, the reconciler's next pass (one every `reconcile_interval`); the window's end
///   instead when it comes sooner and frees capacity (charges in it, fewer reservations than
///   the limit).
///
/// Every wait is at least [`FLOOR`]. A settlement that is charged frees no capacity inside the
/// window, so the first settlement is the earliest capacity may return, not a promise.
pub fn advise_retry(
    facts: &RefusalFacts,
    policy: QuotaPolicy,
    reconcile_interval: Duration,
) -> RetryAdvice {
    let usage = facts.usage;
    let Some(limit) = usage.limit else {
        return RetryAdvice::Now;
    };
    if limit == 0 {
        return RetryAdvice::Never;
    }
    let window_end = RetryAdvice::WindowEnd {
        after: facts.until_window_end.max(FLOOR),
    };
    if usage.used >= limit {
        return window_end;
    }
    if usage.admits(policy) {
        return RetryAdvice::Now;
    }
    // Open reservations hold the capacity (pending work reserves, or admits would hold).
    let settlement = match facts.first_expiry {
        Some(FirstExpiry::Passed(overdue)) => RetryAdvice::ReconcilerPass {
            // Passes come every interval: the first after the expiry comes within an interval
            // of it; one that has not come by then (left for later, a batch too full, no
            // relay running) is awaited a whole interval.
            after: reconcile_interval
                .checked_sub(overdue)
                .filter(|left| !left.is_zero())
                .unwrap_or(reconcile_interval)
                .max(FLOOR),
            overdue,
        },
        first_expiry => {
            let (estimate, basis) = estimate_first_settlement(
                facts.oldest_open_age.unwrap_or_default(),
                &facts.recent_settle_times,
            );
            let after = match first_expiry {
                Some(FirstExpiry::In(left)) => estimate.min(left),
                _ => estimate,
            };
            RetryAdvice::FirstSettlement {
                after: after.max(FLOOR),
                basis,
            }
        }
    };
    let window_end_frees = usage.used > 0 && usage.reserved < limit;
    match (window_end_frees, settlement.after(), window_end.after()) {
        (true, Some(settle), Some(end)) if end < settle => window_end,
        _ => settlement,
    }
}

/// How long until the first open reservation settles, from how long the workspace's recent
/// settlements took and how long the oldest open one has been open: the median of what the
/// recent ones that outlasted that age took beyond it (a reservation already open that long
/// is compared only with those that lasted as long). The oldest stands for all open ones:
/// admitted first, it is the one expected to settle first. Nothing to go by (no recent
/// settlement, or none outlasted that age): [`DEFAULT_SETTLE_WAIT`].
pub fn estimate_first_settlement(
    oldest_age: Duration,
    recent: &[Duration],
) -> (Duration, SettleEstimate) {
    let mut beyond: Vec<Duration> = recent
        .iter()
        .filter(|took| **took > oldest_age)
        .map(|took| *took - oldest_age)
        .collect();
    if beyond.is_empty() {
        return (
            DEFAULT_SETTLE_WAIT,
            SettleEstimate::Default {
                recent: recent.len(),
                oldest_age,
            },
        );
    }
    beyond.sort_unstable();
    // The lower median: with two samples, the shorter (the earliest worth a retry).
    let median = beyond[(beyond.len() - 1) / 2];
    (
        median,
        SettleEstimate::Recent {
            samples: beyond.len(),
            recent: recent.len(),
            oldest_age,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: QuotaPolicy = QuotaPolicy {
        charge_failed: false,
        pending_reserves: true,
        reservation_ttl: Duration::from_secs(3600),
        charge_unresolved: true,
    };

    const INTERVAL: Duration = Duration::from_secs(10);
    const HOUR: Duration = Duration::from_secs(3600);

    fn secs(n: u64) -> Duration {
        Duration::from_secs(n)
    }

    /// A workspace with a limit of 2 whose open reservations hold it: one charged, one open
    /// for 2 s and expiring in an hour.
    fn held() -> RefusalFacts {
        RefusalFacts {
            usage: Usage {
                limit: Some(2),
                used: 1,
                reserved: 1,
            },
            until_window_end: HOUR,
            first_expiry: Some(FirstExpiry::In(HOUR)),
            oldest_open_age: Some(secs(2)),
            recent_settle_times: vec![secs(3), secs(7), secs(1), secs(12)],
        }
    }

    #[test]
    fn charges_that_fill_the_window_wait_for_its_end() {
        let full = RefusalFacts {
            usage: Usage {
                limit: Some(2),
                used: 2,
                reserved: 1,
            },
            ..held()
        };
        assert_eq!(
            advise_retry(&full, POLICY, INTERVAL),
            RetryAdvice::WindowEnd { after: HOUR }
        );
        // Open reservations do not count: only charges can fill the window.
        let not_reserving = QuotaPolicy {
            pending_reserves: false,
            ..POLICY
        };
        assert_eq!(
            advise_retry(&full, not_reserving, INTERVAL),
            RetryAdvice::WindowEnd { after: HOUR }
        );
        // A window ending this instant still says at least a second.
        let ending = RefusalFacts {
            until_window_end: Duration::ZERO,
            ..full
        };
        assert_eq!(
            advise_retry(&ending, POLICY, INTERVAL),
            RetryAdvice::WindowEnd { after: FLOOR }
        );
    }

    #[test]
    fn open_reservations_are_expected_to_settle_as_recent_ones_did() {
        // Of 3, 7, 1 and 12 s, those longer than the oldest's 2 s took 1, 5 and 10 s more.
        assert_eq!(
            advise_retry(&held(), POLICY, INTERVAL),
            RetryAdvice::FirstSettlement {
                after: secs(5),
                basis: SettleEstimate::Recent {
                    samples: 3,
                    recent: 4,
                    oldest_age: secs(2)
                }
            }
        );
        // Never after the first expiry.
        let expiring = RefusalFacts {
            first_expiry: Some(FirstExpiry::In(secs(3))),
            ..held()
        };
        assert_eq!(
            advise_retry(&expiring, POLICY, INTERVAL).after(),
            Some(secs(3))
        );
        // Never under a second.
        let quick = RefusalFacts {
            recent_settle_times: vec![Duration::from_millis(2_100)],
            ..held()
        };
        assert_eq!(advise_retry(&quick, POLICY, INTERVAL).after(), Some(FLOOR));
        // The window's end when it comes sooner and frees capacity.
        let ending = RefusalFacts {
            until_window_end: secs(2),
            ..held()
        };
        assert_eq!(
            advise_retry(&ending, POLICY, INTERVAL),
            RetryAdvice::WindowEnd { after: secs(2) }
        );
        // A window whose end frees nothing (nothing charged in it) is not waited for.
        let all_reserved = RefusalFacts {
            usage: Usage {
                limit: Some(2),
                used: 0,
                reserved: 2,
            },
            until_window_end: secs(2),
            ..held()
        };
        assert_eq!(
            advise_retry(&all_reserved, POLICY, INTERVAL).after(),
            Some(secs(5))
        );
    }

    #[test]
    fn with_nothing_to_go_by_a_short_default_is_advised() {
        let no_history = RefusalFacts {
            recent_settle_times: vec![],
            ..held()
        };
        assert_eq!(
            advise_retry(&no_history, POLICY, INTERVAL),
            RetryAdvice::FirstSettlement {
                after: DEFAULT_SETTLE_WAIT,
                basis: SettleEstimate::Default {
                    recent: 0,
                    oldest_age: secs(2)
                }
            }
        );
        // The oldest open one has outlived every recent settlement.
        let outlived = RefusalFacts {
            oldest_open_age: Some(secs(60)),
            ..held()
        };
        assert_eq!(
            advise_retry(&outlived, POLICY, INTERVAL),
            RetryAdvice::FirstSettlement {
                after: DEFAULT_SETTLE_WAIT,
                basis: SettleEstimate::Default {
                    recent: 4,
                    oldest_age: secs(60)
                }
            }
        );
    }

    #[test]
    fn a_reservation_past_its_ttl_waits_for_the_reconcilers_next_pass() {
        let overdue = |ago| RefusalFacts {
            first_expiry: Some(FirstExpiry::Passed(ago)),
            ..held()
        };
        assert_eq!(
            advise_retry(&overdue(secs(3)), POLICY, INTERVAL),
            RetryAdvice::ReconcilerPass {
                after: secs(7),
                overdue: secs(3)
            }
        );
        // A pass that did not settle it: the next is an interval away at most.
        assert_eq!(
            advise_retry(&overdue(secs(25)), POLICY, INTERVAL).after(),
            Some(INTERVAL)
        );
        assert_eq!(
            advise_retry(&overdue(INTERVAL), POLICY, INTERVAL).after(),
            Some(INTERVAL)
        );
        assert_eq!(
            advise_retry(&overdue(Duration::from_millis(9_900)), POLICY, INTERVAL).after(),
            Some(FLOOR)
        );
    }

    #[test]
    fn a_limit_of_zero_has_no_time_to_retry_and_room_means_now() {
        let zero = RefusalFacts {
            usage: Usage {
                limit: Some(0),
                used: 0,
                reserved: 0,
            },
            ..held()
        };
        assert_eq!(advise_retry(&zero, POLICY, INTERVAL), RetryAdvice::Never);
        assert_eq!(RetryAdvice::Never.after(), None);
        // Read after the refusal, the quota may have room again.
        let released = RefusalFacts {
            usage: Usage {
                limit: Some(2),
                used: 1,
                reserved: 0,
            },
            ..held()
        };
        assert_eq!(advise_retry(&released, POLICY, INTERVAL), RetryAdvice::Now);
        let unlimited = RefusalFacts {
            usage: Usage {
                limit: None,
                ..held().usage
            },
            ..held()
        };
        assert_eq!(advise_retry(&unlimited, POLICY, INTERVAL), RetryAdvice::Now);
        assert_eq!(RetryAdvice::Now.after(), Some(FLOOR));
    }

    proptest::proptest! {
        /// Whatever the facts: a time to retry unless the limit is 0, never under a second,
        /// and never after the first expiry, the next pass or the window's end when that is
        /// what holds the capacity.
        #[test]
        fn advice_is_bounded_by_what_holds_the_capacity(
            limit in 0i64..5,
            used in 0i64..6,
            reserved in 0i64..6,
            window_end_ms in 0u64..10_000_000,
            expiry in proptest::option::of((proptest::bool::ANY, 0u64..10_000_000)),
            oldest_ms in 0u64..100_000,
            recent in proptest::collection::vec(0u64..200_000, 0..20),
        ) {
            let facts = RefusalFacts {
                usage: Usage { limit: Some(limit), used, reserved },
                until_window_end: Duration::from_millis(window_end_ms),
                first_expiry: expiry.map(|(passed, ms)| if passed {
                    FirstExpiry::Passed(Duration::from_millis(ms))
                } else {
                    FirstExpiry::In(Duration::from_millis(ms))
                }),
                oldest_open_age: Some(Duration::from_millis(oldest_ms)),
                recent_settle_times: recent.into_iter().map(Duration::from_millis).collect(),
            };
            let advice = advise_retry(&facts, POLICY, INTERVAL);
            proptest::prop_assert_eq!(advice == RetryAdvice::Never, limit == 0);
            let Some(after) = advice.after() else { return Ok(()) };
            proptest::prop_assert!(after >= FLOOR);
            let window_end = facts.until_window_end.max(FLOOR);
            match advice {
                RetryAdvice::WindowEnd { after } => proptest::prop_assert_eq!(after, window_end),
                RetryAdvice::FirstSettlement { after, .. } => {
                    proptest::prop_assert!(after <= DEFAULT_SETTLE_WAIT.max(Duration::from_secs(200)));
                    if let Some(FirstExpiry::In(left)) = facts.first_expiry {
                        proptest::prop_assert!(after <= left.max(FLOOR));
                    }
                }
                RetryAdvice::ReconcilerPass { after, .. } => {
                    proptest::prop_assert!(after <= INTERVAL);
                }
                RetryAdvice::Now | RetryAdvice::Never => {}
            }
        }
    }
}
