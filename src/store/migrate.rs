//! Applies `migrations/` (plain SQL, embedded at build time) with refinery, which keeps its own
//! history table; replyd runs this at start-up and on `replyd migrate`.

use crate::store::DatabaseSettings;

use super::{StoreError, connect_error, session_config, tls_connector};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Advisory lock key of migrations ("replyd" in ASCII).
const MIGRATION_LOCK: i64 = 0x7265_706c_7964;

/// Brings the schema up to date; returns the names of the migrations it applied.
pub async fn run_migrations(settings: &DatabaseSettings) -> Result<Vec<String>, StoreError> {
    let config = session_config(settings)?;
    let (mut client, connection) = config
        .connect(tls_connector(settings)?)
        .await
        .map_err(|e| connect_error(settings, &e))?;
    let connection = tokio::spawn(connection);
    // Workers start together and each migrates at start-up: without a lock, two runners race
    // on refinery's own history table (CREATE TABLE IF NOT EXISTS is not safe concurrently).
    // A session advisory lock serialises them; it is released when this connection closes.
    client
        .execute("SELECT pg_advisory_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    let report = embedded::migrations::runner()
        .run_async(&mut client)
        .await?;
    drop(client);
    // The connection task ends when the client is dropped; its result carries no information
    // beyond what the migration already returned.
    let _ = connection.await;
    Ok(report
        .applied_migrations()
        .iter()
        .map(|m| m.to_string())
        .collect())
}
