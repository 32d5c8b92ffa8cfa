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
//! every window until it is settled.

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

/// Parses an operator's period: a positive number of `d`, `h`, `m` or `s`.
pub fn parse_period(text: &str) -> Result<u64, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .ok_or_else(|| format!("{text:?} has no unit: write e.g. 1d, 12h, 30m or 90s"))?;
    let (number, unit) = text.split_at(split);
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} does not start with a number"))?;
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
        Some(total) if total <= i64::MAX as u64 => Ok(total),
        _ => Err(format!("{text:?} is too long")),
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
