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
//!
//! Each concern has a room of its own: [`policy`] (what is charged and what admits),
//! [`reservation`] (the states a reservation goes through and how it settles), [`retry`] (when
//! a refused request is worth trying again), [`period`] (the operator's period format),
//! [`settings`] (`[quota]` in the settings) and [`reconcile`] (what the reconciler does with a
//! reservation past its TTL). Everything is re-exported here, so callers name
//! `replyd_core::quota::X` whichever room holds it.

pub mod period;
pub mod policy;
pub mod reconcile;
pub mod reservation;
pub mod retry;
pub mod settings;

pub use period::{MAX_PERIOD_SECONDS, format_period, parse_period};
pub use policy::{Limited, QuotaPolicy, Usage, stop_tokens, tokens_to_charge};
pub use reconcile::{ExpiredDecision, ExpiredTask, LookedUp, decide_expired, decide_looked_up};
pub use reservation::{ReservationState, Settle};
pub use retry::{
    DEFAULT_SETTLE_WAIT, FirstExpiry, RefusalFacts, RetryAdvice, SettleEstimate, advise_retry,
    estimate_first_settlement,
};
pub use settings::QuotaSettings;
