//! The capacity budget's SQL (I9): one grant for a worker (requests, tokens, its share of the
//! concurrency limit) and the report of a provider's refusal, each one call of a server-side
//! function (`migrations/V16`, the learned rate's as `V31` has them, the workers' fair parts as
//! `V34`) that locks the model's
//! bucket row, so every worker of the deployment draws from the same budget. The arithmetic is
//! `replyd_core::pacing`'s.

use std::time::Duration;

use super::{Store, StoreError};

/// What a worker asks of a bucket in one grant.
#[derive(Debug, Clone, PartialEq)]
pub struct GrantAsk<'a> {
    pub bucket: &'a str,
    pub holder: &'a str,
    /// The tokens of each call waiting in this worker, in arrival order.
    pub waiters: &'a [u64],
    /// The concurrency share the worker wants to hold (in use plus waiting).
    pub want_slots: u32,
    /// Slots the worker is using now: never taken away while it does.
    pub in_use: u32,
    /// Configured limits (None: not limited).
    pub requests_per_second: Option<f64>,
    pub tokens_per_second: Option<f64>,
    pub slot_limit: Option<u32>,
    pub slot_ttl: Duration,
    /// Learn a request rate from refusals where none is configured.
    pub adaptive: bool,
    /// How far ahead calls are scheduled.
    pub horizon: Duration,
    /// Calls the worker let go freely (nothing configured, learned or paused) since it last
    /// told the budget: they count towards the learned rate as calls that went.
    pub sent_freely: u64,
    /// How many calls of each workspace wait in this worker (all of them, not only the
    /// `waiters` asked for): where other workers' calls wait too, the budget holds this worker
    /// to its fair part of the rate (I10, `migrations/V34`).
    pub demand: &'a [(String, usize)],
}

/// What one grant gave.
#[derive(Debug, Clone, PartialEq)]
pub struct Granted {
    /// When each of the first `delays.len()` waiters may go, from now.
    pub delays: Vec<Duration>,
    /// The worker's concurrency share now (the slots it may use at once).
    pub slots: u32,
    /// When nothing was granted: how long until something could be.
    pub wait: Duration,
    /// The request rate applied: configured or learned; None: not limited.
    pub requests_per_second: Option<f64>,
    /// The provider's pause still running, if any.
    pub blocked_for: Duration,
}

fn secs(value: f64) -> Duration {
    Duration::try_from_secs_f64(value.max(0.0)).unwrap_or(Duration::MAX)
}

impl Store {
    /// One grant of `ask.bucket` for `ask.holder`.
    pub async fn capacity_grant(&self, ask: &GrantAsk<'_>) -> Result<Granted, StoreError> {
        let client = self.client().await?;
        let statement = client
            .prepare_cached(
                "SELECT delays, slots, wait, requests_per_second, blocked_for \
                 FROM replyd_capacity_grant($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)",
            )
            .await?;
        let waiters: Vec<i64> = ask
            .waiters
            .iter()
            .map(|t| i64::try_from(*t).unwrap_or(i64::MAX))
            .collect();
        let want_slots = i32::try_from(ask.want_slots).unwrap_or(i32::MAX);
        let in_use = i32::try_from(ask.in_use).unwrap_or(i32::MAX);
        let slot_limit = ask
            .slot_limit
            .map(|limit| i32::try_from(limit).unwrap_or(i32::MAX));
        let sent_freely = i64::try_from(ask.sent_freely).unwrap_or(i64::MAX);
        let demand_workspaces: Vec<&str> = ask.demand.iter().map(|(w, _)| w.as_str()).collect();
        let demand_waiting: Vec<i32> = ask
            .demand
            .iter()
            .map(|(_, n)| i32::try_from(*n).unwrap_or(i32::MAX))
            .collect();
        let row = client
            .query_one(
                &statement,
                &[
                    &ask.bucket,
                    &ask.holder,
                    &waiters,
                    &want_slots,
                    &in_use,
                    &ask.requests_per_second,
                    &ask.tokens_per_second,
                    &slot_limit,
                    &ask.slot_ttl.as_secs_f64(),
                    &ask.adaptive,
                    &ask.horizon.as_secs_f64(),
                    &sent_freely,
                    &demand_workspaces,
                    &demand_waiting,
                ],
            )
            .await?;
        let delays: Vec<f64> = row.get("delays");
        Ok(Granted {
            delays: delays.into_iter().map(secs).collect(),
            slots: u32::try_from(row.get::<_, i32>("slots")).unwrap_or(0),
            wait: secs(row.get("wait")),
            requests_per_second: row.get("requests_per_second"),
            blocked_for: secs(row.get("blocked_for")),
        })
    }

    /// Records the request limit the provider reports for `bucket` (its rate-limit headers),
    /// as requests a second.
    pub async fn capacity_reported(
        &self,
        bucket: &str,
        requests_per_second: f64,
    ) -> Result<(), StoreError> {
        let client = self.client().await?;
        client
            .execute(
                "SELECT replyd_capacity_reported($1, $2)",
                &[&bucket, &requests_per_second],
            )
            .await?;
        Ok(())
    }

    /// Reports that the provider refused a call of `bucket` for capacity: every worker pauses
    /// for `pause` (its Retry-After) and, with `adaptive`, the refusal and the `sent_freely`
    /// calls this worker let go since it last told the budget are counted, and the learned
    /// rate is cut. Returns the learned rate now, if any.
    pub async fn capacity_refused(
        &self,
        bucket: &str,
        pause: Option<Duration>,
        adaptive: bool,
        sent_freely: u64,
    ) -> Result<Option<f64>, StoreError> {
        let sent_freely = i64::try_from(sent_freely).unwrap_or(i64::MAX);
        let row = self
            .row(
                "SELECT requests_per_second FROM replyd_capacity_refused($1, $2, $3, $4)",
                &[
                    &bucket,
                    &pause.map(|p| p.as_secs_f64()),
                    &adaptive,
                    &sent_freely,
                ],
            )
            .await?;
        Ok(row.get(0))
    }
}
