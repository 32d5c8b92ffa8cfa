//! `[quota]` in the settings: what an operator writes, and the policy it makes. Kept apart
//! from the rules so the settings' schema and defaults read in one place.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use super::policy::QuotaPolicy;

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

impl QuotaSettings {
    /// `quota.reservation_ttl_ms` against the longest an API task can live once claimed
    /// (`api_task`) plus the longest its record can wait for another worker after its worker
    /// vanished (`redelivery`, said as `redelivery_from`): a reservation must outlive both, or
    /// the reconciler would take work that is still going on, or only waiting to be handed on,
    /// for abandoned work.
    pub fn ttl_problems(
        &self,
        api_task: Duration,
        redelivery: Duration,
        redelivery_from: &str,
    ) -> Vec<(&'static str, String)> {
        let (api_task_ms, redelivery_ms) = (api_task.as_millis(), redelivery.as_millis());
        let least = api_task_ms.saturating_add(redelivery_ms);
        if u128::from(self.reservation_ttl_ms) > least {
            return Vec::new();
        }
        vec![(
            "quota.reservation_ttl_ms",
            format!(
                "{} must be longer than an API task's lifetime plus its redelivery, {least} ms: {api_task_ms} ms (worker.default_max_attempts × (worker.lease_ms + retry.max_delay_ms) + retry.refusal_budget_ms) + {redelivery_ms} ms ({redelivery_from} + worker.lease_ms + worker.drain_timeout_ms), or a worker's crash could fail work that only waits to be handed to another worker",
                self.reservation_ttl_ms
            ),
        )]
    }
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
