//! The states of a quota reservation and how one is settled: the vocabulary the store writes
//! to `quota_reservations.state`, kept apart from the policy that chooses among them so the
//! store and the reconciler can name a state without the rules that pick it.

use std::fmt;

use serde::{Deserialize, Serialize};
use strum::{EnumString, IntoStaticStr, VariantArray};

use crate::closed_set::ClosedSet;

/// Where a reservation is (`quota_reservations.state`). `Reserved` is the only state that
/// changes, and only once.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    Serialize,
    Deserialize,
    IntoStaticStr,
    EnumString,
    VariantArray,
)]
#[serde(rename_all = "lowercase")]
#[strum(serialize_all = "lowercase")]
pub enum ReservationState {
    Reserved,
    /// The task completed: one generation charged.
    Charged,
    /// The task ended without a charge (failed, when failures are not charged).
    Released,
    /// The TTL passed and the reconciler found no work that will ever complete.
    Expired,
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

#[cfg(test)]
mod tests {
    use super::*;

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
