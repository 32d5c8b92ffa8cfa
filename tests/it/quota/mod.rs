//! Generation quotas over real HTTP and the real PostgreSQL (I8): admission without
//! oversubscription under concurrency, one reservation per logical request, replays never
//! re-admitted, a `429` that says when to come back, and a reservation settled exactly once
//! by the transaction that ends its task (charged on completion; on failure as the policy says).
//!
//! This file holds what every room uses: the API started with a quota policy, and its quota
//! and ledger as a test reads them. The rooms: [`admission`] (how many presses get in, and
//! one reservation per logical request), [`settlement`] (a reservation settled once, as the
//! policy says), [`refusals`] (the `429` and when it says to come back), [`operator`] (`replyd
//! quota set` and `show`, and period changes), [`tokens`] (a token quota's ceilings and
//! charges) and [`model_policy`] (the workspace's models and output cap).

mod admission;
mod model_policy;
mod operator;
mod refusals;
mod settlement;
mod tokens;

use crate::helpers::api;
use crate::helpers::api::Api;
use replyd::api::settings::ApiSettings;
use replyd_core::quota::{QuotaPolicy, QuotaSettings};
use serde_json::Value;

fn policy() -> QuotaPolicy {
    QuotaSettings::default().policy()
}

async fn start(policy: QuotaPolicy) -> Api {
    Api::start(ApiSettings::default(), api::limits(10_000), policy).await
}

impl Api {
    /// `acme`'s quota set to `limit` generations a day (UTC days, as windows are aligned).
    async fn daily_quota(&self, limit: i64) {
        let set = self.db.store.set_quota("acme", Some(limit), 86_400).await;
        assert!(set.unwrap(), "acme has a quota counter");
    }

    async fn quota(&self) -> Value {
        self.client
            .get(format!("{}/v1/quota", self.base))
            .bearer_auth(&self.key)
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap()
    }

    /// (tasks, reservations by state reserved/charged/released, counter used, counter reserved)
    async fn ledger(&self) -> (i64, i64, i64, i64, i64, i64) {
        let row = self
            .db
            .raw_client()
            .await
            .query_one(
                "SELECT (SELECT count(*) FROM reply_tasks), \
                 (SELECT count(*) FROM quota_reservations WHERE state = 'reserved'), \
                 (SELECT count(*) FROM quota_reservations WHERE state = 'charged'), \
                 (SELECT count(*) FROM quota_reservations WHERE state = 'released'), \
                 (SELECT used FROM quota_counters WHERE workspace_id = 'acme'), \
                 (SELECT reserved FROM quota_counters WHERE workspace_id = 'acme')",
                &[],
            )
            .await
            .unwrap();
        (
            row.get(0),
            row.get(1),
            row.get(2),
            row.get(3),
            row.get(4),
            row.get(5),
        )
    }
}
