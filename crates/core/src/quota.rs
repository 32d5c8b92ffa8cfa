//! Generation quotas (I8), the pure rules: the policy, the states of a reservation, how a
//! task's end settles its reservation, when capacity returns, and the period an operator
//! writes (`1d`, `12h`, `30m`, `90s`).
//!
//! The policy, by default: a failed task is not charged (no reply, no charge); pending work
//! holds capacity (admission counts open reservations, so a burst cannot oversubscribe the
//! limit while its work is still queued); a reservation lives for `quota.reservation_ttl_ms`
//! and is then reconciled against the task (and the provider) before it is released.
//!
//! Windows are fixed and aligned to the Unix epoch: a `1d` period starts at 00:00 UTC. What is
//! charged counts in the window in which it is charged; an open reservation holds capacity in
//! every window until it is settled. A change of the period puts the counter on the new
//! period's window that holds now, with what was charged inside it.
//!
//! A refusal tells the client the earliest time worth retrying ([`advise_retry`]): the window's
//! end when charges fill it; when open reservations hold the capacity, an estimate of when the
//! first of them settles from how long this workspace's recent ones took; the reconciler's
//! next pass when the first is past its TTL; and no time at all under a limit of 0.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

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

/// Where a reservation is. `Reserved` is the only state that changes, and only once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReservationState {
    Reserved,
    /// The task completed: one generation charged.
    Charged,
    /// The task ended without a charge (failed, when failures are not charged).
    Released,
    /// The TTL passed and the reconciler found no work that will ever complete.
    Expired,
}

impl ReservationState {
    /// Every state, as `quota_reservations.state`'s `CHECK` list holds them (a test holds the
    /// two together); the match below fails to compile until a new variant is listed here too.
    pub const ALL: [ReservationState; 4] = {
        const fn listed(s: ReservationState) {
            match s {
                ReservationState::Reserved
                | ReservationState::Charged
                | ReservationState::Released
                | ReservationState::Expired => {}
            }
        }
        listed(ReservationState::Reserved);
        [
            ReservationState::Reserved,
            ReservationState::Charged,
            ReservationState::Released,
            ReservationState::Expired,
        ]
    };

    pub fn as_str(self) -> &'static str {
        match self {
            ReservationState::Reserved => "reserved",
            ReservationState::Charged => "charged",
            ReservationState::Released => "released",
            ReservationState::Expired => "expired",
        }
    }

    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "reserved" => ReservationState::Reserved,
            "charged" => ReservationState::Charged,
            "released" => ReservationState::Released,
            "expired" => ReservationState::Expired,
            _ => return None,
        })
    }
}

impl fmt::Display for ReservationState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a reservation is settled: the state it goes to, and whether it uses a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settle {
    Charge,
    Release,
    Expire,
}

impl Settle {
    pub fn state(self) -> ReservationState {
        match self {
            Settle::Charge => ReservationState::Charged,
            Settle::Release => ReservationState::Released,
            Settle::Expire => ReservationState::Expired,
        }
    }

    /// Units this settlement adds to the window's `used`.
    pub fn charged_units(self) -> i64 {
        i64::from(self == Settle::Charge)
    }
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

/// The longest period an operator may set: 3650 days. PostgreSQL does the window arithmetic
/// (a window's end is its start plus the period) and its timestamps end in 294276 AD, so a
/// period near `i64::MAX` seconds made every admission and read of the workspace fail with
/// "timestamp out of range". Ten years keeps every window's end far inside that range and
/// far beyond any billing period (a year is the longest in use); a workspace that should not
/// be limited takes `--limit none`. `migrations/V14__quota_period_bound.sql` holds the
/// database to the same bound.
pub const MAX_PERIOD_SECONDS: u64 = 3_650 * 86_400;

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

/// Parses an operator's period: a positive number of `d`, `h`, `m` or `s`, at most
/// [`MAX_PERIOD_SECONDS`].
pub fn parse_period(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} has no unit: write e.g. 1d, 12h, 30m or 90s"))?;
    let (number, unit) = text.split_at(split);
    let too_long = || {
        format!(
            "{text:?} is longer than the longest period, {} (for no limit, use --limit none)",
            format_period(MAX_PERIOD_SECONDS)
        )
    };
    let n: u64 = number.parse().map_err(|e: std::num::ParseIntError| {
        if *e.kind() == std::num::IntErrorKind::PosOverflow {
            too_long()
        } else {
            format!("{text:?} does not start with a number")
        }
    })?;
    let seconds = match unit {
        "d" => 86_400,
        "h" => 3_600,
        "m" => 60,
        "s" => 1,
        other => {
            return Err(format!(
                "unknown unit {other:?} in {text:?}: use d, h, m or s"
            ));
        }
    };
    match n.checked_mul(seconds) {
        Some(0) => Err(format!("{text:?} is not a positive period")),
        Some(total) if total <= MAX_PERIOD_SECONDS => Ok(total),
        _ => Err(too_long()),
    }
}

/// A period in seconds as the shortest exact form (`86400` → `1d`).
pub fn format_period(seconds: u64) -> String {
    for (unit, size) in [("d", 86_400), ("h", 3_600), ("m", 60)] {
        if seconds.is_multiple_of(size) {
            return format!("{}{unit}", seconds / size);
        }
    }
    format!("{seconds}s")
}

/// Generation quotas (I8): the policy every workspace's reservations follow. Limits are per
/// workspace (`replyd quota set`); a workspace without one is not limited, and its generations
/// are still reserved and charged once.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct QuotaSettings {
    /// Whether a task that ends failed is charged (no reply, no charge by default).
    pub charge_failed: bool,
    /// Whether pending work holds capacity: admission counts open reservations, so a burst
    /// cannot be admitted past the limit while its work is still queued.
    pub pending_reserves: bool,
    /// How long a reservation stays open before the reconciler decides it from the task (and
    /// the provider). Must be longer than an API task's retry horizon
    /// (worker.default_max_attempts × (worker.lease_ms + retry.max_delay_ms) +
    /// retry.refusal_budget_ms) plus the time a
    /// record can wait for redelivery after its worker vanished (the group's session timeout,
    /// worker.lease_ms and worker.drain_timeout_ms), or one crash could fail work that is only
    /// waiting for the group to hand it on.
    pub reservation_ttl_ms: u64,
    /// A task can fail while the provider may have done its work: every answer was lost after
    /// the request was sent, or a background operation was still running at
    /// `provider.operation_max_wait_ms`. Its reservation is then not released as if nothing
    /// ran: it stays open (holding capacity) until its TTL, while the reconciler asks the
    /// provider where it can (a stored operation id: done is charged, gone is not). When
    /// nothing can tell, `true` charges it (the provider may have billed the work) and `false`
    /// releases it. Only when `charge_failed` is false (otherwise every failure is charged).
    pub charge_unresolved: bool,
}

impl Default for QuotaSettings {
    fn default() -> Self {
        Self {
            charge_failed: false,
            pending_reserves: true,
            reservation_ttl_ms: 60 * 60 * 1000,
            charge_unresolved: true,
        }
    }
}

impl QuotaSettings {
    pub fn policy(&self) -> QuotaPolicy {
        QuotaPolicy {
            charge_failed: self.charge_failed,
            pending_reserves: self.pending_reserves,
            reservation_ttl: Duration::from_millis(self.reservation_ttl_ms),
            charge_unresolved: self.charge_unresolved,
        }
    }
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

    #[test]
    fn periods_parse_and_print() {
        assert_eq!(parse_period("1d"), Ok(86_400));
        assert_eq!(parse_period("12h"), Ok(43_200));
        assert_eq!(parse_period("30m"), Ok(1_800));
        assert_eq!(parse_period("90s"), Ok(90));
        for bad in ["", "d", "1", "0d", "1w", "-1d", "1.5h"] {
            assert!(parse_period(bad).is_err(), "{bad:?}");
        }
        // The longest period is accepted, anything longer refused with the bound named.
        assert_eq!(parse_period("3650d"), Ok(MAX_PERIOD_SECONDS));
        for too_long in ["3651d", "1000000000d", "87601h", "99999999999999999999s"] {
            let refused = parse_period(too_long).unwrap_err();
            assert!(refused.contains("3650d"), "{too_long}: {refused}");
        }
        assert_eq!(format_period(86_400), "1d");
        assert_eq!(format_period(5_400), "90m");
        assert_eq!(format_period(90), "90s");
    }

    #[test]
    fn states_round_trip() {
        for state in [
            ReservationState::Reserved,
            ReservationState::Charged,
            ReservationState::Released,
            ReservationState::Expired,
        ] {
            assert_eq!(ReservationState::parse(state.as_str()), Some(state));
        }
    }
}

/// What the reconciler knows of a task whose reservation is past its TTL.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ExpiredTask {
    pub status: crate::domain::TaskStatus,
    /// A worker holds a live lease on it (by the database clock).
    pub lease_live: bool,
    /// A provider operation id is stored: the work may exist at the provider.
    pub has_operation: bool,
    /// A failed attempt set a backoff that has not passed yet: a retry is due.
    pub retry_due_later: bool,
    /// Some call of the task may have done work at the provider whose answer replyd never got
    /// (`reply_tasks.provider_may_have_run`).
    pub may_have_run: bool,
    /// The task (not terminal) was worked (claimed, renewed, given back) within the
    /// redelivery bound: a worker that vanished since may still have its record uncommitted,
    /// and the group hands it to another worker once the session times out.
    pub worked_recently: bool,
}

/// What to do with a reservation past its TTL: decided from the durable task first, and
/// from the provider before anything is released or charged while the work may exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiredDecision {
    /// The task completed: charge.
    Charge,
    /// The task failed and the provider did none of its work: settle as the reservation's
    /// policy says for a failure.
    SettleFailed,
    /// The task is still being worked: keep the reservation for another TTL.
    Extend(&'static str),
    /// A provider operation may hold the work: ask the provider before deciding.
    LookUp,
    /// Nobody is working the task and no work can exist: fail it (if it is not failed yet)
    /// and let the reservation expire.
    Expire(&'static str),
    /// The provider may have done the work and nothing can tell: fail the task (if it is not
    /// failed yet) and settle as `quota.charge_unresolved` says.
    Unresolved(&'static str),
}

impl ExpiredDecision {
    pub fn label(self) -> &'static str {
        match self {
            ExpiredDecision::Charge => "charge",
            ExpiredDecision::SettleFailed => "settle_failed",
            ExpiredDecision::Extend(_) => "extend",
            ExpiredDecision::LookUp => "look_up",
            ExpiredDecision::Expire(_) => "expire",
            ExpiredDecision::Unresolved(_) => "unresolved",
        }
    }
}

pub fn decide_expired(task: ExpiredTask) -> ExpiredDecision {
    use crate::domain::TaskStatus;
    match task.status {
        TaskStatus::Completed => ExpiredDecision::Charge,
        TaskStatus::Failed if !task.may_have_run => ExpiredDecision::SettleFailed,
        // Failed, and the provider may have done the work: held until something can tell.
        TaskStatus::Failed if task.has_operation => ExpiredDecision::LookUp,
        TaskStatus::Failed => ExpiredDecision::Unresolved(
            "the task failed while the provider may have done its work, and the provider cannot be asked",
        ),
        _ if task.lease_live => ExpiredDecision::Extend("a worker holds the task's lease"),
        _ if task.has_operation => ExpiredDecision::LookUp,
        _ if task.retry_due_later => ExpiredDecision::Extend("a retry of the task is due"),
        _ if task.worked_recently => ExpiredDecision::Extend(
            "worked within the redelivery bound: its record is still owed to a worker",
        ),
        _ if task.may_have_run => ExpiredDecision::Unresolved(
            "not worked within quota.reservation_ttl_ms, and an earlier call may have done the work at the provider",
        ),
        _ => ExpiredDecision::Expire(
            "not worked within quota.reservation_ttl_ms: no live lease, no provider operation",
        ),
    }
}

/// What the provider said of a stored operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LookedUp {
    Done,
    StillRunning,
    /// Unknown, cancelled, expired or failed: no reply will come from it.
    Gone,
}

/// The decision once the provider answered (for a task not yet terminal, the reconciler
/// holds its lease then).
pub fn decide_looked_up(found: LookedUp) -> ExpiredDecision {
    match found {
        LookedUp::Done => ExpiredDecision::Charge,
        LookedUp::StillRunning => ExpiredDecision::Extend("the provider's operation still runs"),
        LookedUp::Gone => {
            ExpiredDecision::Expire("the provider has no reply for the task's operation")
        }
    }
}

#[cfg(test)]
mod reconcile_tests {
    use super::*;
    use crate::domain::TaskStatus;

    fn task(status: TaskStatus) -> ExpiredTask {
        ExpiredTask {
            status,
            lease_live: false,
            has_operation: false,
            retry_due_later: false,
            may_have_run: false,
            worked_recently: false,
        }
    }

    #[test]
    fn the_durable_task_decides_first() {
        assert_eq!(
            decide_expired(task(TaskStatus::Completed)),
            ExpiredDecision::Charge
        );
        assert_eq!(
            decide_expired(task(TaskStatus::Failed)),
            ExpiredDecision::SettleFailed
        );
        // A terminal task is settled whatever else the row says.
        let done_with_op = ExpiredTask {
            has_operation: true,
            lease_live: true,
            ..task(TaskStatus::Completed)
        };
        assert_eq!(decide_expired(done_with_op), ExpiredDecision::Charge);
    }

    #[test]
    fn open_work_is_extended_looked_up_or_expired() {
        let leased = ExpiredTask {
            lease_live: true,
            has_operation: true,
            ..task(TaskStatus::Running)
        };
        assert!(matches!(decide_expired(leased), ExpiredDecision::Extend(_)));
        let with_operation = ExpiredTask {
            has_operation: true,
            ..task(TaskStatus::Running)
        };
        assert_eq!(decide_expired(with_operation), ExpiredDecision::LookUp);
        let backing_off = ExpiredTask {
            retry_due_later: true,
            ..task(TaskStatus::Pending)
        };
        assert!(matches!(
            decide_expired(backing_off),
            ExpiredDecision::Extend(_)
        ));
        assert!(matches!(
            decide_expired(task(TaskStatus::Pending)),
            ExpiredDecision::Expire(_)
        ));
        assert!(matches!(
            decide_expired(task(TaskStatus::Running)),
            ExpiredDecision::Expire(_)
        ));
    }

    #[test]
    fn a_failure_whose_work_may_exist_is_not_released_as_if_nothing_ran() {
        let unknown = ExpiredTask {
            may_have_run: true,
            ..task(TaskStatus::Failed)
        };
        assert!(matches!(
            decide_expired(unknown),
            ExpiredDecision::Unresolved(_)
        ));
        let with_operation = ExpiredTask {
            has_operation: true,
            ..unknown
        };
        assert_eq!(decide_expired(with_operation), ExpiredDecision::LookUp);
        // Open work nobody runs any more, whose earlier call may have run: not "expired".
        let abandoned = ExpiredTask {
            may_have_run: true,
            ..task(TaskStatus::Pending)
        };
        assert!(matches!(
            decide_expired(abandoned),
            ExpiredDecision::Unresolved(_)
        ));
        let policy = QuotaPolicy {
            charge_failed: false,
            pending_reserves: true,
            reservation_ttl: std::time::Duration::from_secs(60),
            charge_unresolved: true,
        };
        assert_eq!(policy.on_unresolved(), Settle::Charge);
        let releasing = QuotaPolicy {
            charge_unresolved: false,
            ..policy
        };
        assert_eq!(releasing.on_unresolved(), Settle::Release);
    }

    #[test]
    fn a_task_worked_within_the_redelivery_bound_is_still_owed_to_a_worker() {
        for status in [TaskStatus::Pending, TaskStatus::Running] {
            let recent = ExpiredTask {
                worked_recently: true,
                may_have_run: true,
                ..task(status)
            };
            assert!(
                matches!(decide_expired(recent), ExpiredDecision::Extend(_)),
                "{status:?}"
            );
        }
        // A terminal task is settled whatever its last work was.
        let done = ExpiredTask {
            worked_recently: true,
            ..task(TaskStatus::Completed)
        };
        assert_eq!(decide_expired(done), ExpiredDecision::Charge);
    }

    #[test]
    fn the_provider_decides_before_anything_is_released() {
        assert_eq!(decide_looked_up(LookedUp::Done), ExpiredDecision::Charge);
        assert!(matches!(
            decide_looked_up(LookedUp::StillRunning),
            ExpiredDecision::Extend(_)
        ));
        assert!(matches!(
            decide_looked_up(LookedUp::Gone),
            ExpiredDecision::Expire(_)
        ));
    }
}

#[cfg(test)]
mod token_tests {
    use super::*;

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
