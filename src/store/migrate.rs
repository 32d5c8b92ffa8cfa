//! Applies `migrations/` (plain SQL, embedded at build time) with refinery, which keeps its own
//! history table; replyd runs this at start-up and on `replyd migrate`.

use std::time::{Duration, Instant};

use crate::store::DatabaseSettings;

use super::{StoreError, connect_error, session_config, tls_connector};

mod embedded {
    refinery::embed_migrations!("migrations");
}

/// Advisory lock key of migrations ("replyd" in ASCII).
pub const MIGRATION_LOCK: i64 = 0x7265_706c_7964;

/// How long a migrator waits for another to finish before it gives up. Longer than any
/// migration replyd ships takes; a holder past it is stuck, and its name is in the error.
const LOCK_WAIT: Duration = Duration::from_secs(600);

/// How often a waiting migrator asks for the lock again.
const LOCK_POLL: Duration = Duration::from_millis(200);

/// A session of its own, outside the pool (refinery drives it, and the lock is the session's),
/// and the task that runs its connection.
async fn session(
    settings: &DatabaseSettings,
) -> Result<
    (
        tokio_postgres::Client,
        tokio::task::JoinHandle<Result<(), tokio_postgres::Error>>,
    ),
    StoreError,
> {
    let (client, connection) = session_config(settings)?
        .connect(tls_connector(settings)?)
        .await
        .map_err(|e| connect_error(settings, &e))?;
    Ok((client, tokio::spawn(connection)))
}

/// Brings the schema up to date; returns the names of the migrations it applied.
pub async fn run_migrations(settings: &DatabaseSettings) -> Result<Vec<String>, StoreError> {
    let (mut client, connection) = session(settings).await?;
    // Workers start together and each migrates at start-up: without a lock, two runners race
    // on refinery's own history table (CREATE TABLE IF NOT EXISTS is not safe concurrently).
    // A session advisory lock serialises them; it is released when this connection closes.
    lock(&client).await?;
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

/// The migrations this build has that the schema lacks, by name (`V19__...`): what a process
/// started with `database.migrate_on_start` off checks before it serves.
pub async fn pending_migrations(settings: &DatabaseSettings) -> Result<Vec<String>, StoreError> {
    let (mut client, connection) = session(settings).await?;
    let runner = embedded::migrations::runner();
    // refinery's history table is made by the first migration run; before it, all are pending.
    let has_history: bool = client
        .query_one(
            "SELECT to_regclass('refinery_schema_history') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    let applied: Vec<i32> = if has_history {
        runner
            .get_applied_migrations_async(&mut client)
            .await?
            .iter()
            .map(|m| m.version())
            .collect()
    } else {
        Vec::new()
    };
    drop(client);
    let _ = connection.await;
    Ok(runner
        .get_migrations()
        .iter()
        .filter(|m| !applied.contains(&m.version()))
        .map(|m| m.to_string())
        .collect())
}

/// Takes the migration lock, waiting for whoever holds it. Asked with `pg_try_advisory_lock`
/// rather than waited on with `pg_advisory_lock`: the session's `lock_timeout` (5 s, there to
/// keep the hot path from hanging on a stalled worker's row) would end the wait as an error,
/// and every replica but one would exit on it while one migration runs longer.
async fn lock(client: &tokio_postgres::Client) -> Result<(), StoreError> {
    let started = Instant::now();
    let mut told = false;
    loop {
        let got: bool = client
            .query_one("SELECT pg_try_advisory_lock($1)", &[&MIGRATION_LOCK])
            .await?
            .get(0);
        if got {
            if told {
                tracing::info!(
                    waited_s = started.elapsed().as_secs_f64(),
                    "the other migrator finished; migrating"
                );
            }
            return Ok(());
        }
        if started.elapsed() >= LOCK_WAIT {
            let holder: Option<String> = client
                .query_one(
                    "SELECT (SELECT coalesce(nullif(a.application_name, ''), 'pid ' || a.pid) \
                     FROM pg_locks l JOIN pg_stat_activity a USING (pid) \
                     WHERE l.locktype = 'advisory' AND l.granted \
                       AND (l.classid::bigint << 32 | l.objid::bigint) = $1 LIMIT 1)",
                    &[&MIGRATION_LOCK],
                )
                .await?
                .get(0);
            return Err(StoreError::Config(format!(
                "the migration lock is still held after {} s (by {}): another migrator is stuck",
                LOCK_WAIT.as_secs(),
                holder.as_deref().unwrap_or("a session that has since gone")
            )));
        }
        if !told {
            tracing::info!("another process is migrating the schema; waiting for it");
            told = true;
        }
        tokio::time::sleep(LOCK_POLL).await;
    }
}
