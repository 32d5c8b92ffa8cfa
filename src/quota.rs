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

/// The longest period an operator may set: 3650 days. PostgreSQL does the window arithmetic
/// (a window's end is its start plus the period) and its timestamps end in 294276 AD, so a
/// period near `i64::MAX` seconds made every admission and read of the workspace fail with
/// "timestamp out of range". Ten years keeps every window's end far inside that range and
/// far beyond any billing period (a year is the longest in use); a workspace that should not
/// be limited takes `--limit none`. `migrations/V14__quota_period_bound.sql` holds the
/// database to the same bound.
pub const MAX_PERIOD_SECONDS: u64 = 3_650 * 86_400;

/// When a refused request may be tried again, from now: at the window's end if what was
/// charged in it stands in the way, else when the first open reservation can expire (the
/// earliest capacity may return; a settled reservation frees it sooner).
pub fn retry_after(
    usage: Usage,
    policy: QuotaPolicy,
    until_window_end: Duration,
    until_first_expiry: Option<Duration>,
) -> Duration {
    let Some(limit) = usage.limit else {
        return Duration::ZERO;
    };
    if usage.used >= limit || !policy.pending_reserves {
        return until_window_end;
    }
    match until_first_expiry {
        Some(expiry) => expiry.min(until_window_end),
        None => until_window_end,
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: QuotaPolicy = QuotaPolicy {
        charge_failed: false,
        pending_reserves: true,
        reservation_ttl: Duration::from_secs(3600),
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

    #[test]
    fn capacity_returns_at_the_window_end_or_at_the_first_expiry() {
        let hour = Duration::from_secs(3600);
        let minute = Duration::from_secs(60);
        let full_of_charges = Usage {
            limit: Some(2),
            used: 2,
            reserved: 0,
        };
        assert_eq!(
            retry_after(full_of_charges, POLICY, hour, Some(minute)),
            hour
        );
        let held_by_reservations = Usage {
            limit: Some(2),
            used: 1,
            reserved: 1,
        };
        assert_eq!(
            retry_after(held_by_reservations, POLICY, hour, Some(minute)),
            minute
        );
        assert_eq!(retry_after(held_by_reservations, POLICY, hour, None), hour);
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
}

/// What to do with a reservation past its TTL: decided from the durable task first, and
/// from the provider before anything is released or charged while the work may exist.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ExpiredDecision {
    /// The task completed: charge.
    Charge,
    /// The task failed: settle as the reservation's policy says.
    SettleFailed,
    /// The task is still being worked: keep the reservation for another TTL.
    Extend(&'static str),
    /// A provider operation may hold the work: ask the provider before deciding.
    LookUp,
    /// Nobody is working the task and no work can exist: fail it and let the reservation expire.
    Expire(&'static str),
}

impl ExpiredDecision {
    pub fn label(self) -> &'static str {
        match self {
            ExpiredDecision::Charge => "charge",
            ExpiredDecision::SettleFailed => "settle_failed",
            ExpiredDecision::Extend(_) => "extend",
            ExpiredDecision::LookUp => "look_up",
            ExpiredDecision::Expire(_) => "expire",
        }
    }
}

pub fn decide_expired(task: ExpiredTask) -> ExpiredDecision {
    use crate::domain::TaskStatus;
    match task.status {
        TaskStatus::Completed => ExpiredDecision::Charge,
        TaskStatus::Failed => ExpiredDecision::SettleFailed,
        _ if task.lease_live => ExpiredDecision::Extend("a worker holds the task's lease"),
        _ if task.has_operation => ExpiredDecision::LookUp,
        _ if task.retry_due_later => ExpiredDecision::Extend("a retry of the task is due"),
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

/// The decision once the provider answered (the reconciler holds the task's lease then).
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
