//! Housekeeping: the rounds that keep the database small and the quota settled, run by the
//! relay process between its batches (one loop, no extra process to deploy). Every 5 s, the
//! published outbox rows past `relay.retention_ms` and the idempotency records past
//! `api.idempotency_retention_ms` are deleted in bounded batches and the outbox's lag is
//! measured; every [`crate::reconcile::INTERVAL`], a pass of the quota's reconciler; every
//! `retention.interval_ms`, a round of retention ([`settings`]): finished tasks past
//! `retention.tasks_ms` forgotten, and forgotten ids past `retention.forgotten_ms` let go.
//!
//! Each round is idempotent and safe to run from every relay at once: a purge deletes what is
//! past its bound whoever deletes it, and each of the reconciler's writes is guarded on the
//! reservation still being open (and its claims are fenced), so two passes at once settle a
//! reservation once. A failed round is counted and logged, and the next one tries again; none
//! holds up the relay's publishing.

pub mod settings;

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::probes::Heartbeat;
use crate::reconcile::Reconciler;
use crate::store::Store;
use crate::telemetry;

/// How often published rows are purged and the lag measured.
const PURGE_INTERVAL: Duration = Duration::from_secs(5);

/// Rows deleted per purge statement: a bounded batch keeps each delete's locks and WAL small;
/// a backlog shrinks by this much every round.
const PURGE_BATCH: i64 = 1000;

/// Retention's batches per round: at most this many times [`FORGET_BATCH`] tasks a round, so
/// a round never holds the relay's loop for long; a backlog (retention just turned on) goes
/// over many rounds.
const RETENTION_BATCHES: usize = 10;

/// Tasks forgotten per statement of retention.
const FORGET_BATCH: i64 = 200;

/// The rounds and when each last ran.
pub struct Housekeeping {
    store: Store,
    outbox_retention: Duration,
    reconciler: Reconciler,
    retention: settings::RetentionSettings,
    /// The hosting loop's heartbeat, beaten between rounds' steps: each step is bounded (a
    /// statement, a provider look-up), a whole round of them need not be.
    heartbeat: Arc<Heartbeat>,
    purged: Instant,
    reconciled: Instant,
    retained: Instant,
}

impl Housekeeping {
    /// Rounds over `store`; published outbox rows are kept `outbox_retention`, tasks as
    /// `retention` says.
    pub fn new(
        store: Store,
        outbox_retention: Duration,
        retention: settings::RetentionSettings,
        reconciler: Reconciler,
        heartbeat: Arc<Heartbeat>,
    ) -> Self {
        let now = Instant::now();
        Self {
            store,
            outbox_retention,
            reconciler: reconciler.beating(Arc::clone(&heartbeat)),
            retention,
            heartbeat,
            purged: now,
            reconciled: now,
            // The first round one interval after start, not at once: a fleet restarting
            // together does not start with every relay's retention round at the same instant.
            retained: now,
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
        if self.retained.elapsed() >= self.retention.interval() {
            self.retained = Instant::now();
            self.retain().await;
        }
    }

    /// Forgets finished tasks past their age, a bounded number of batches, and lets go of
    /// forgotten ids past theirs.
    async fn retain(&self) {
        // Every round, also without a deployment-wide retention: a workspace may set its own.
        let age = self.retention.tasks();
        for _ in 0..RETENTION_BATCHES {
            let batch = self.store.forget_finished(age, FORGET_BATCH).await;
            self.heartbeat.beat();
            match batch {
                Ok(forgotten) => {
                    telemetry::tasks_forgotten("retention", forgotten.tasks);
                    if forgotten.tasks < FORGET_BATCH as u64 {
                        break;
                    }
                }
                Err(e) => {
                    telemetry::store_error("forget_finished", &e);
                    break;
                }
            }
        }
        match self
            .store
            .purge_forgotten(self.retention.forgotten(), PURGE_BATCH)
            .await
        {
            Ok(n) => telemetry::forgotten_purged(n),
            Err(e) => telemetry::store_error("purge_forgotten", &e),
        }
        self.heartbeat.beat();
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
