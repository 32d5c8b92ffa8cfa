//! Applies `migrations/` (plain SQL, embedded at build time) with refinery, which keeps its own
//! history table; replyd runs this at start-up and on `replyd migrate`.

use crate::config::DatabaseSettings;

use super::{StoreError, session_config};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Brings the schema up to date; returns the names of the migrations it applied.
pub async fn run_migrations(settings: &DatabaseSettings) -> Result<Vec<String>, StoreError> {
    let config = session_config(settings)?;
    let (mut client, connection) = config.connect(tokio_postgres::NoTls).await?;
    let connection = tokio::spawn(connection);
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
