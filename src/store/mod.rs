//! PostgreSQL: the task store. Every operation is one short statement or one short
//! transaction, and every lease time comes from the database clock (`clock_timestamp()`).
//! No transaction is held across a provider call (I4).
//!
//! The rooms, from the ground up (none imports a room above it):
//! - `settings` (`[database]`), `error` ([`StoreError`]), [`tls`] (libpq's `sslmode` over
//!   rustls), `sessions` (the URL read, the session settings, the pool);
//! - `rows`: the answers callers branch on and the mappers from a task row; `fence`: the
//!   fenced write (I2), written once; the pure decisions behind both are `replyd_core::lease`;
//! - the batchers, over the sessions alone: `gather` (the calls that arrive while one is out
//!   go together as the next, written once), `completions` and `claims` (what each gathers,
//!   `database.batch_completions`, `database.batch_claims`), `renewals` (every running call's lease renewed by one call per
//!   interval, `database.batch_renewals`);
//! - this file: [`Store`], the sessions and the batchers together;
//! - the operations on it: [`tasks`] (ensure, claim, renew, complete, fail, release, read);
//! - [`migrate`]: the schema, from `migrations/`.
//! - [`listen`]: the session that relays task-status notifications to parked records.
//! - [`workspaces`]: workspaces and their API keys (hashes only).
//! - [`intake`]: the one transaction of a submission (message, task, key, outbox row).
//! - [`outbox`]: relay batches (SKIP LOCKED), marking published, purging, lag.
//! - [`quota`]: limits, the counter as read, the admission statement (I8).
//! - [`forgetting`]: retention and erasure, and the forgotten tasks' ids (V21).
//! - [`conversations`]: a conversation's messages in order, with their tasks (V22).
//! - [`cancels`]: Stop, an open task ended `cancelled` (V23).
//! - [`capacity`]: the capacity budget's SQL (I9; V16, V31, V34).
//! - [`end_users`]: end users' signing secrets, token generations and conversations' owners
//!   (V24, V27).
//! - [`live`]: the pieces of running attempts' text, for followers (V26, V30).
//! - [`retries`]: failed tasks run again as new tasks (`replyd tasks retry`).
//! - [`erasure_log`]: every erasure asked for, in a database apart, for after a restore
//!   (its sessions are `log_sessions`').

pub mod cancels;
pub mod capacity;
mod claims;
mod completions;
pub mod conversations;
pub mod end_users;
pub mod erasure_log;
mod error;
mod fence;
pub mod forgetting;
mod gather;
pub mod intake;
pub mod listen;
pub mod live;
mod log_sessions;
pub mod migrate;
pub mod outbox;
pub mod quota;
mod renewals;
pub mod retries;
mod rows;
mod sessions;
mod settings;
pub mod tasks;
pub mod tls;
pub mod workspaces;

use std::time::Duration;

use deadpool_postgres::Object;
use replyd_core::lease::Lease;
use tokio_postgres::types::ToSql;
use tokio_postgres::{Row, Statement};

use sessions::Sessions;

/// The parameters of one statement.
pub(crate) type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

pub use error::StoreError;
pub use renewals::LeaseHold;
pub use rows::{
    CompletionOutcome, EnsureOutcome, FailOutcome, Labelled, Release, ReleaseOutcome, RenewOutcome,
    Taken,
};
pub use sessions::{connect_error, parse_url, session_config, target_of, tls_connector};
pub use settings::DatabaseSettings;

/// The task store: a pool of worker sessions, and the batchers that gather its hot path's
/// calls when they are on.
#[derive(Clone)]
pub struct Store {
    sessions: Sessions,
    /// Set by [`Store::batching_completions`].
    batcher: Option<std::sync::Arc<completions::CompletionBatcher>>,
    /// Set by [`Store::batching_renewals`].
    renewer: Option<std::sync::Arc<renewals::LeaseRenewer>>,
    /// Set by [`Store::batching_claims`].
    claimer: Option<std::sync::Arc<claims::ClaimBatcher>>,
    /// The erasure log's sessions, when `database.erasure_log_url` is set.
    erasure_log: Option<log_sessions::LogSessions>,
}

impl Store {
    /// Builds the pool. Connections are opened lazily, on first use.
    pub fn connect(settings: &DatabaseSettings) -> Result<Self, StoreError> {
        Ok(Self {
            sessions: Sessions::connect(settings)?,
            batcher: None,
            renewer: None,
            claimer: None,
            erasure_log: log_sessions::sessions(settings)?,
        })
    }

    /// This store, with its completions gathered into batches of at most `max_rows` (see
    /// `completions` and `gather`). Starts the batch writer on the current runtime.
    pub fn batching_completions(mut self, max_rows: usize) -> Self {
        let writer = self.writer();
        self.batcher = Some(std::sync::Arc::new(completions::CompletionBatcher::start(
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

    /// The sessions a batch writer writes through: the same pool, and no handle on any writer,
    /// so each ends once the last store that batches is gone.
    fn writer(&self) -> Sessions {
        self.sessions.clone()
    }

    /// This store, with the leases of running calls renewed together: every `every`, one call
    /// extends each by `extend`, and every `check` (when set) one read finds the leases that
    /// ended meanwhile (see [`renewals`]). Starts the renewer on the current runtime.
    pub fn batching_renewals(
        mut self,
        every: Duration,
        extend: Duration,
        check: Option<Duration>,
    ) -> Self {
        let writer = self.writer();
        self.renewer = Some(std::sync::Arc::new(renewals::LeaseRenewer::start(
            writer,
            renewals::RenewalTimes {
                every,
                extend,
                check,
            },
        )));
        self
    }

    /// Keeps `lease` renewed while its call runs, until the hold is dropped: in the store's
    /// batch when [`Store::batching_renewals`] is on, else by a renewal of its own every `every`.
    pub fn hold(&self, lease: &Lease, every: Duration, extend: Duration) -> LeaseHold {
        match &self.renewer {
            Some(renewer) => LeaseHold::batched(renewer, lease),
            None => LeaseHold::alone(self.writer(), lease, every, extend),
        }
    }

    /// One round trip, for readiness probes.
    pub async fn ping(&self) -> Result<(), StoreError> {
        self.client().await?.simple_query("SELECT 1").await?;
        Ok(())
    }

    /// A pooled session (see [`Sessions::client`]).
    pub(crate) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.sessions.client().await
    }

    /// A pooled session and `sql` prepared on it. The statement is prepared once per session
    /// and kept (`prepare_cached`): a statement whose text is made per call (a `LIMIT` written
    /// into it) goes through [`Store::client`] instead, or the sessions' caches would grow
    /// with every value.
    async fn prepared(&self, sql: &str) -> Result<(Object, Statement), StoreError> {
        let client = self.client().await?;
        let statement = client.prepare_cached(sql).await?;
        Ok((client, statement))
    }

    /// One statement's rows (see [`Store::prepared`]).
    pub(crate) async fn rows(&self, sql: &str, params: Params<'_>) -> Result<Vec<Row>, StoreError> {
        let (client, statement) = self.prepared(sql).await?;
        Ok(client.query(&statement, params).await?)
    }

    /// One statement's one row; none, or more than one, is an error.
    pub(crate) async fn row(&self, sql: &str, params: Params<'_>) -> Result<Row, StoreError> {
        let (client, statement) = self.prepared(sql).await?;
        Ok(client.query_one(&statement, params).await?)
    }

    /// One statement's row, if it returned one; more than one is an error.
    pub(crate) async fn row_opt(
        &self,
        sql: &str,
        p: Params<'_>,
    ) -> Result<Option<Row>, StoreError> {
        let (client, statement) = self.prepared(sql).await?;
        Ok(client.query_opt(&statement, p).await?)
    }

    /// Runs one statement that writes the row of one key (a workspace's, mostly): whether
    /// there was such a row to write.
    pub(crate) async fn wrote_one_row(
        &self,
        sql: &str,
        params: Params<'_>,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        Ok(client.execute(sql, params).await? == 1)
    }
}
