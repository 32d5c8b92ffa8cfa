//! The store's one error type: what failed in talking to PostgreSQL. Outcomes a caller
//! branches on (refused, leased by another) are not errors: they are `super::rows`' types.

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
    /// The erasure log could not be written or read: the erasure is not made (or not made
    /// again) until it can be.
    #[error("the erasure log at {target} (database.erasure_log_url): {reason}")]
    ErasureLog { target: String, reason: String },
}
