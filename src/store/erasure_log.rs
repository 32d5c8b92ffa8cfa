//! The erasure log: every erasure asked for, written to a PostgreSQL database apart from
//! replyd's own (`database.erasure_log_url`) before it is carried out.
//!
//! A restore of replyd's database to a point in time brings back what was erased after that
//! point, and forgets that it was: the rows come back and so does the absence of the
//! `erasures` row that refuses a later record of the scope. A log in the same database would
//! be rolled back with it, so it lives elsewhere, and `replyd after-restore` makes each
//! erasure logged since the restore point again. Written first: an erasure that fails after
//! its entry is written is made again on a restore, which is what its caller asked for; one
//! whose entry cannot be written is not made at all (the caller hears `503` and asks again),
//! so no erasure is ever made that a restore could undo for good.

use chrono::{DateTime, Utc};

use super::forgetting::ErasureScope;
use super::{Store, StoreError};

/// The log's one table, made by each process's first use: the log's database needs no
/// migration.
const TABLE: &str = "CREATE TABLE IF NOT EXISTS replyd_erasure_log (\
    id bigserial PRIMARY KEY, \
    workspace_id text NOT NULL, \
    conversation_id text, \
    end_user_id text, \
    logged_at timestamptz NOT NULL DEFAULT clock_timestamp(), \
    CHECK (conversation_id IS NULL OR end_user_id IS NULL))";

/// One erasure as asked for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Erasure {
    /// A workspace, or one conversation of it (`replyd erase`, `DELETE /v1/conversations/…`).
    Scope(ErasureScope),
    /// The conversations one end user began, and their tokens (`DELETE /v1/end-users/…`).
    EndUser {
        workspace_id: String,
        user_id: String,
    },
}

/// An entry of the log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Logged {
    pub id: i64,
    /// The log database's clock when the entry was written.
    pub at: DateTime<Utc>,
    pub erasure: Erasure,
}

impl Store {
    /// Whether erasures are logged (`database.erasure_log_url` is set).
    pub fn erasure_log_on(&self) -> bool {
        self.erasure_log.is_some()
    }

    /// Writes `erasure` to the log; nothing when the log is off.
    pub async fn log_erasure(&self, erasure: &Erasure) -> Result<(), StoreError> {
        let Some(log) = &self.erasure_log else {
            return Ok(());
        };
        let client = log.client_with_table(TABLE).await?;
        let (workspace, conversation, user) = match erasure {
            Erasure::Scope(scope) => (&scope.workspace_id, scope.conversation_id.as_ref(), None),
            Erasure::EndUser {
                workspace_id,
                user_id,
            } => (workspace_id, None, Some(user_id)),
        };
        client
            .execute(
                "INSERT INTO replyd_erasure_log (workspace_id, conversation_id, end_user_id) \
                 VALUES ($1, $2, $3)",
                &[workspace, &conversation, &user],
            )
            .await
            .map_err(|e| log.failed(e.into()))?;
        Ok(())
    }

    /// The entries written at or after `since`, oldest first; None when the log is off.
    pub async fn logged_erasures_since(
        &self,
        since: DateTime<Utc>,
    ) -> Result<Option<Vec<Logged>>, StoreError> {
        let Some(log) = &self.erasure_log else {
            return Ok(None);
        };
        let client = log.client_with_table(TABLE).await?;
        let rows = client
            .query(
                "SELECT id, logged_at, workspace_id, conversation_id, end_user_id \
                 FROM replyd_erasure_log WHERE logged_at >= $1 ORDER BY id",
                &[&since],
            )
            .await
            .map_err(|e| log.failed(e.into()))?;
        Ok(Some(
            rows.iter()
                .map(|row| {
                    let workspace_id: String = row.get(2);
                    let erasure = match row.get::<_, Option<String>>(4) {
                        Some(user_id) => Erasure::EndUser {
                            workspace_id,
                            user_id,
                        },
                        None => Erasure::Scope(ErasureScope {
                            workspace_id,
                            conversation_id: row.get(3),
                        }),
                    };
                    Logged {
                        id: row.get(0),
                        at: row.get(1),
                        erasure,
                    }
                })
                .collect(),
        ))
    }
}
