//! PostgreSQL: the task store. Every operation is one short statement or one short
//! transaction, and every lease time comes from the database clock (`clock_timestamp()`).
//! No transaction is held across a provider call (I4).
//!
//! - [`fencing`]: the pure decisions (may this claim proceed? why was this write refused?).
//! - [`tasks`]: ensure, claim, renew, complete, fail, read.
//! - [`batch`]: completions gathered into one call under load (`database.batch_completions`).
//! - [`claims`]: claims gathered the same way (`database.batch_claims`).
//! - [`renewals`]: every running call's lease renewed by one call per interval
//!   (`database.batch_renewals`).
//! - [`migrate`]: the schema, from `migrations/`.
//! - [`listen`]: the session that relays task-status notifications to parked records.
//! - [`workspaces`]: workspaces and their API keys (hashes only).
//! - [`intake`]: the one transaction of a submission (message, task, key, outbox row).
//! - [`outbox`]: relay batches (SKIP LOCKED), marking published, purging, lag.
//! - [`quota`]: limits, the counter as read, the admission statement (I8).
//! - [`tls`]: libpq's `sslmode` and `sslrootcert` over rustls.

mod batch;
pub mod capacity;
mod claims;
pub mod intake;
pub mod listen;
pub mod migrate;
pub mod outbox;
pub mod quota;
mod renewals;
pub mod tasks;
pub mod tls;
pub mod workspaces;

use std::time::Duration;

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::config::DatabaseSettings;

pub use renewals::LeaseHold;
pub use replyd_core::lease::{ClaimOutcome, Lease, Refusal};
pub use tasks::{
    CompletionOutcome, EnsureOutcome, FailOutcome, Release, ReleaseOutcome, RenewOutcome, Taken,
};

/// Errors of the store's I/O. Outcomes a caller branches on (refused, leased by another) are
/// not errors: they are the `*Outcome` enums.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("database error: {0}")]
    Postgres(#[from] tokio_postgres::Error),
    #[error("no database connection: {0}")]
    Pool(#[from] deadpool_postgres::PoolError),
    #[error("invalid database URL or settings: {0}")]
    Config(String),
    /// No connection could be made: says where (never the password) and from which setting.
    #[error("cannot connect to PostgreSQL at {target} (database.url): {reason}")]
    Connect { target: String, reason: String },
    #[error("row of task {task_id} is not what replyd writes: {reason}")]
    InvalidRow { task_id: uuid::Uuid, reason: String },
    /// A batched call (claims, completions) failed; its outcome is unknown, so the caller
    /// retries.
    #[error("batched write failed: {0}")]
    Batch(String),
    #[error("migration failed: {0}")]
    Migration(#[from] refinery::Error),
}

/// The task store: a pool of worker sessions.
#[derive(Clone)]
pub struct Store {
    pool: Pool,
    /// Set by [`Store::batching_completions`].
    batcher: Option<std::sync::Arc<batch::CompletionBatcher>>,
    /// Set by [`Store::batching_renewals`].
    renewer: Option<std::sync::Arc<renewals::LeaseRenewer>>,
    /// Set by [`Store::batching_claims`].
    claimer: Option<std::sync::Arc<claims::ClaimBatcher>>,
    /// Where the pool connects, for error messages (no credentials).
    target: String,
}

/// Parses the URL and adds the worker session settings (`lock_timeout`,
/// `idle_in_transaction_session_timeout`, `statement_timeout`) to whatever `options` it has.
pub fn session_config(settings: &DatabaseSettings) -> Result<tokio_postgres::Config, StoreError> {
    let (mut config, tls) = parse_url(settings)?;
    tls.apply(&mut config);
    let mut options = config.get_options().unwrap_or_default().to_owned();
    options.push_str(&format!(
        " -c lock_timeout={} -c idle_in_transaction_session_timeout={} -c statement_timeout={}",
        settings.lock_timeout_ms,
        settings.idle_in_transaction_session_timeout_ms,
        settings.statement_timeout_ms
    ));
    config.options(options.trim());
    if config.get_application_name().is_none() {
        config.application_name("replyd");
    }
    Ok(config)
}

/// `database.url` as tokio-postgres's config and its TLS half. Neither error quotes the URL,
/// so no password leaks through them.
pub fn parse_url(
    settings: &DatabaseSettings,
) -> Result<(tokio_postgres::Config, tls::TlsSettings), StoreError> {
    let (rest, tls) = tls::split(settings.url.expose()).map_err(StoreError::Config)?;
    let config = rest.parse().map_err(|e: tokio_postgres::Error| {
        StoreError::Config(format!("not a PostgreSQL URL: {e}"))
    })?;
    Ok((config, tls))
}

/// The TLS connector `database.url`'s `sslmode` and `sslrootcert` ask for; every session
/// replyd opens (the pool, the listener, migrations, the checker) connects through it.
pub fn tls_connector(settings: &DatabaseSettings) -> Result<MakeRustlsConnect, StoreError> {
    let (_, tls) = parse_url(settings)?;
    tls::connector(&tls).map_err(StoreError::Config)
}

/// Where `settings.database.url` points, as `host:port[,host:port]/dbname`: for error
/// messages, so it never carries the user or the password.
pub fn target_of(settings: &DatabaseSettings) -> String {
    let Ok((config, _)) = parse_url(settings) else {
        return "an unparsable URL".into();
    };
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .enumerate()
        .map(|(i, host)| {
            let host = match host {
                tokio_postgres::config::Host::Tcp(name) => name.clone(),
                tokio_postgres::config::Host::Unix(path) => path.display().to_string(),
            };
            let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
            format!("{host}:{port}")
        })
        .collect();
    let hosts = if hosts.is_empty() {
        "localhost:5432".to_owned()
    } else {
        hosts.join(",")
    };
    match config.get_dbname() {
        Some(db) => format!("{hosts}/{db}"),
        None => hosts,
    }
}

/// A connection error as [`StoreError::Connect`], naming the target. tokio-postgres puts the
/// cause both in its message and in its source; the chain keeps one copy.
pub fn connect_error(settings: &DatabaseSettings, error: &dyn std::error::Error) -> StoreError {
    StoreError::Connect {
        target: target_of(settings),
        reason: crate::telemetry::chain(error),
    }
}

impl Store {
    /// Builds the pool. Connections are opened lazily, on first use.
    pub fn connect(settings: &DatabaseSettings) -> Result<Self, StoreError> {
        let config = session_config(settings)?;
        let manager = Manager::from_config(
            config,
            tls_connector(settings)?,
            ManagerConfig {
                // Fast recycling skips a round trip per checkout; a broken connection shows up
                // as an error on the next statement, which callers already handle.
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .max_size(settings.pool_size)
            .build()
            .map_err(|e| StoreError::Config(e.to_string()))?;
        Ok(Self {
            pool,
            batcher: None,
            renewer: None,
            claimer: None,
            target: target_of(settings),
        })
    }

    /// This store, with its completions gathered into batches of at most `max_rows` (see
    /// [`batch`]). Starts the batch writer on the current runtime.
    pub fn batching_completions(mut self, max_rows: usize) -> Self {
        let writer = self.writer();
        self.batcher = Some(std::sync::Arc::new(batch::CompletionBatcher::start(
            writer, max_rows,
        )));
        self
    }

    /// This store, with its claims gathered into batches of at most `max_rows` (see
    /// [`claims`]). Starts the batch writer on the current runtime.
    pub fn batching_claims(mut self, max_rows: usize) -> Self {
        let writer = self.writer();
        self.claimer = Some(std::sync::Arc::new(claims::ClaimBatcher::start(
            writer, max_rows,
        )));
        self
    }

    /// The store a batch writer writes through: the same pool, no batching of its own (and no
    /// handle on any writer, so each ends once the last store that batches is gone).
    fn writer(&self) -> Self {
        Self {
            batcher: None,
            renewer: None,
            claimer: None,
            ..self.clone()
        }
    }

    /// This store, with the leases of running calls renewed together: every `every`, one call
    /// extends each by `extend` (see [`renewals`]). Starts the renewer on the current runtime.
    pub fn batching_renewals(mut self, every: Duration, extend: Duration) -> Self {
        let writer = self.writer();
        self.renewer = Some(std::sync::Arc::new(renewals::LeaseRenewer::start(
            writer,
            renewals::RenewalTimes { every, extend },
        )));
        self
    }

    /// Keeps `lease` renewed while its call runs, until the hold is dropped: in the store's
    /// batch when [`Store::batching_renewals`] is on, else by a renewal of its own every `every`.
    pub fn hold(&self, lease: &Lease, every: Duration, extend: Duration) -> LeaseHold {
        match &self.renewer {
            Some(renewer) => LeaseHold::batched(renewer, lease),
            None => LeaseHold::alone(self.clone(), lease, every, extend),
        }
    }

    /// One round trip, for readiness probes.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.client().await?.simple_query("SELECT 1").await?;
        Ok(())
    }

    /// A pooled session. With fast recycling a checkout only fails when a new connection
    /// cannot be made, so every failure here says where it tried.
    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.pool.get().await.map_err(|e| match e {
            deadpool_postgres::PoolError::Backend(e) => StoreError::Connect {
                target: self.target.clone(),
                reason: crate::telemetry::chain(&e),
            },
            other => StoreError::Pool(other),
        })
    }
}
