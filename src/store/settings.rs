//! `[database]`: how replyd talks to PostgreSQL. The settings tree (`crate::config`) holds it;
//! the store reads it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::setting_problems::SettingProblems;
use replyd_core::secret::Secret;

/// How replyd talks to PostgreSQL.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct DatabaseSettings {
    /// libpq-style URL, e.g. `postgres://user:pass@127.0.0.1:5432/replyd`. A `?options=-c
    /// search_path=...` parameter is honoured (the tests use it to give each test a schema).
    pub url: Secret,
    /// Connections in the pool. Every in-flight record holds one only for the length of one
    /// short statement or transaction, never across a provider call (I4).
    pub pool_size: usize,
    /// `lock_timeout` of every session: a statement that waits longer on a row lock (say, one
    /// held by a stalled process) fails instead of hanging a worker.
    pub lock_timeout_ms: u64,
    /// `idle_in_transaction_session_timeout`: the server ends a session that sits inside a
    /// transaction this long, so a stopped (SIGSTOP) worker cannot keep row locks.
    pub idle_in_transaction_session_timeout_ms: u64,
    /// `statement_timeout` of every session.
    pub statement_timeout_ms: u64,
    /// Keep one session that `LISTEN`s for task status changes, so a record parked on a task
    /// leased elsewhere wakes as soon as that task is done. Turn off where LISTEN cannot work
    /// (behind a transaction-pooling PgBouncer): parked records then wait out the lease.
    pub listen: bool,
    /// How long a listening session stays once nothing of its process needs it (no open event
    /// stream, no running call, no parked record). Every session that listens slows every
    /// notifying commit of the database, so an idle process stops listening; the next need
    /// starts a session again and re-reads what it may have missed.
    pub listen_idle_ms: u64,
    /// How long start-up keeps retrying to reach PostgreSQL before giving up.
    pub startup_retry_ms: u64,
    /// Apply pending migrations when a process starts (`worker`, `api`, `relay`, `serve`),
    /// one process at a time under an advisory lock. Off where a migration Job runs them
    /// first (the Helm chart turns it off when `migrations.enabled`): then the processes'
    /// role needs no DDL rights, and a process whose schema lacks a migration this build has
    /// refuses to start, naming them and `replyd migrate`.
    pub migrate_on_start: bool,
    /// Gather the completions that arrive while one is being written into the next call: one
    /// round trip and one transaction for many tasks, each row guarded and answered on its
    /// own. Nothing waits to fill a batch, so a lone completion goes at once.
    pub batch_completions: bool,
    /// The most completions (or claims) in one batched call.
    pub batch_max_rows: usize,
    /// Gather the claims that arrive while one is being written into the next call, as
    /// completions are (`batch_completions`), at most `batch_max_rows` in one. A row locked
    /// elsewhere is claimed alone, by the path that waits on the lock.
    pub batch_claims: bool,
    /// Renew the leases of all running calls in one call per `worker.renew_interval_ms`,
    /// instead of one transaction per call per interval: what makes a short `worker.lease_ms`
    /// cheap. Each row is guarded and answered on its own.
    pub batch_renewals: bool,
    /// A PostgreSQL URL for the erasure log, in a cluster apart from `url`'s (empty: off).
    /// Every erasure asked for is written there before it is carried out, so one made after
    /// a backup's restore point can be made again after a restore (`replyd after-restore`):
    /// a restored database would otherwise hold what was erased. See OPERATIONS "Backup and
    /// restore".
    pub erasure_log_url: Secret,
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: Secret::new("postgres://replyd:replyd@127.0.0.1:5432/replyd"),
            pool_size: 16,
            lock_timeout_ms: 5_000,
            idle_in_transaction_session_timeout_ms: 10_000,
            statement_timeout_ms: 30_000,
            listen: true,
            listen_idle_ms: 30_000,
            startup_retry_ms: 60_000,
            migrate_on_start: true,
            batch_completions: true,
            batch_max_rows: 64,
            batch_claims: true,
            batch_renewals: true,
            erasure_log_url: Secret::new(""),
        }
    }
}

impl DatabaseSettings {
    /// What is wrong with `[database]`'s numbers on its own: the pool, the batch size (the URL is
    /// read by the sessions: `crate::config` asks them). Each problem names its setting.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = SettingProblems::default();
        if self.pool_size == 0 {
            out.refuse("database.pool_size", "must be at least 1".into());
        }
        if self.batch_max_rows == 0 {
            out.refuse("database.batch_max_rows", "must be at least 1".into());
        }
        out.into()
    }

    pub fn lock_timeout(&self) -> Duration {
        Duration::from_millis(self.lock_timeout_ms)
    }
}
