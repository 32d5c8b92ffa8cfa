//! The erasure log's sessions (`database.erasure_log_url`): a pool of their own, apart from
//! the task store's, and errors that name the log's setting rather than `database.url`. The
//! log's reads and writes are `super::erasure_log`'s.

use replyd_core::secret::Secret;

use super::error::StoreError;
use super::sessions::{Sessions, target_of};
use super::settings::DatabaseSettings;

/// The log's sessions: a small pool, since erasures are rare, and where they go.
#[derive(Clone)]
pub struct LogSessions {
    sessions: Sessions,
    target: String,
    /// Set once this process has made sure the log's table exists.
    table: std::sync::Arc<tokio::sync::OnceCell<()>>,
}

impl LogSessions {
    /// A session, once `make_table` has run in this process (the first call runs it; a failed
    /// run is tried again by the next call).
    pub(super) async fn client_with_table(
        &self,
        make_table: &str,
    ) -> Result<deadpool_postgres::Object, StoreError> {
        let client = self.client().await?;
        self.table
            .get_or_try_init(|| async {
                client
                    .batch_execute(make_table)
                    .await
                    .map_err(|e| self.failed(e.into()))
            })
            .await?;
        Ok(client)
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        self.sessions.client().await.map_err(|e| self.failed(e))
    }

    /// `error` said as the log's, naming its setting (not `database.url`'s).
    pub(super) fn failed(&self, error: StoreError) -> StoreError {
        let reason = match error {
            StoreError::Connect { reason, .. } => reason,
            other => crate::telemetry::chain(&other),
        };
        StoreError::ErasureLog {
            target: self.target.clone(),
            reason,
        }
    }
}

/// The log's sessions, when it is set.
pub(super) fn sessions(settings: &DatabaseSettings) -> Result<Option<LogSessions>, StoreError> {
    if settings.erasure_log_url.expose().is_empty() {
        return Ok(None);
    }
    let log = DatabaseSettings {
        url: settings.erasure_log_url.clone(),
        pool_size: 2,
        listen: false,
        erasure_log_url: Secret::new(""),
        ..settings.clone()
    };
    let target = target_of(&log);
    let sessions = Sessions::connect(&log).map_err(|e| StoreError::ErasureLog {
        target: target.clone(),
        reason: crate::telemetry::chain(&e),
    })?;
    Ok(Some(LogSessions {
        sessions,
        target,
        table: Default::default(),
    }))
}
