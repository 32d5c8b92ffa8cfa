//! Housekeeping: the rounds that keep the database small and the quota settled, run by the
//! relay process between its batches (one loop, no extra process to deploy). Every 5 s, the
//! published outbox rows past `relay.retention_ms` and the idempotency records past
//! `api.idempotency_retention_ms` are deleted in bounded batches and the outbox's lag is
//! measured; every [`crate::reconcile::INTERVAL`], a pass of the quota's reconciler.
//!
//! Each round is idempotent and safe to run from every relay at once: a purge deletes what is
//! past its bound whoever deletes it, and each of the reconciler's writes is guarded on the
//! reservation still being open (and its claims are fenced), so two passes at once settle a
//! reservation once. A failed round is counted and logged, and the next one tries again; none
//! holds up the relay's publishing.

use std::time::{Duration, Instant};

use std::sync::Arc;

use crate::probes::Heartbeat;
use crate::reconcile::Reconciler;
use crate::store::Store;
use crate::telemetry;

/// How often published rows are purged and the lag measured.
const PURGE_INTERVAL: Duration = Duration::from_secs(5);

/// Rows deleted per purge statement: a bounded batch keeps each delete's locks and WAL small;
/// a backlog shrinks by this much every round.
const PURGE_BATCH: i64 = 1000;

/// The rounds and when each last ran.
pub struct Housekeeping {
    store: Store,
    outbox_retention: Duration,
    reconciler: Reconciler,
    /// The hosting loop's heartbeat, beaten between rounds' steps: each step is bounded (a
    /// statement, a provider look-up), a whole round of them need not be.
    heartbeat: Arc<Heartbeat>,
    purged: Instant,
    reconciled: Instant,
}

impl Housekeeping {
    /// Rounds over `store`; published outbox rows are kept `outbox_retention`.
    pub fn new(
        store: Store,
        outbox_retention: Duration,
        reconciler: Reconciler,
        heartbeat: Arc<Heartbeat>,
    ) -> Self {
        let now = Instant::now();
        Self {
            store,
            outbox_retention,
            reconciler: reconciler.beating(Arc::clone(&heartbeat)),
            heartbeat,
            purged: now,
            reconciled: now,
        }
    }

    /// Runs the rounds that are due.
    pub async fn run_due(&mut self) {
        if self.purged.elapsed() >= PURGE_INTERVAL {
            self.purged = Instant::now();
            self.purge().await;
        }
        if self.reconciled.elapsed() >= crate::reconcile::INTERVAL {
            self.reconciled = Instant::now();
            match self.reconciler.run_once().await {
                Ok(report) if report.examined > 0 => {
                    tracing::info!(?report, "quota reservations reconciled")
                }
                Ok(_) => {}
                Err(e) => telemetry::store_error("reconcile", &e),
            }
        }
    }

    async fn purge(&self) {
        let store = &self.store;
        match store.purge_outbox(self.outbox_retention, PURGE_BATCH).await {
            Ok(n) => telemetry::outbox_purged(n),
            Err(e) => telemetry::store_error("purge_outbox", &e),
        }
        self.heartbeat.beat();
        match store.purge_idempotency_keys(PURGE_BATCH).await {
            Ok(n) => telemetry::idempotency_keys_purged(n),
            Err(e) => telemetry::store_error("purge_idempotency_keys", &e),
        }
        self.heartbeat.beat();
        match store.outbox_lag().await {
            Ok(lag) => telemetry::outbox_lag(lag.unpublished, lag.oldest_seconds),
            Err(e) => telemetry::store_error("outbox_lag", &e),
        }
    }
}
