//! Applies `migrations/` (plain SQL, embedded at build time) with refinery, which keeps its own
//! history table; replyd runs this at start-up and on `replyd migrate`.

use std::time::{Duration, Instant};

use replyd_core::schema::{self, Fit, Floor};

use crate::store::DatabaseSettings;

use super::{StoreError, connect_error, session_config, tls_connector};

mod embedded {
    refinery::embed_migrations!("migrations");
}

#[cfg(test)]
mod rules;

/// An index built `CONCURRENTLY` after refinery's run, outside any transaction: how a migration
/// gets an index on a table that already holds rows (docs/OPERATIONS.md, "Long migrations").
/// refinery runs each migration in a transaction, where PostgreSQL refuses `CONCURRENTLY`, and
/// a plain `CREATE INDEX` stops every writer of the table for the whole build.
#[derive(Debug, Clone, Copy)]
pub struct ConcurrentIndex {
    /// The migration after which it is built: the one that made what it indexes.
    pub after: i32,
    pub name: &'static str,
    pub unique: bool,
    /// What follows the name: `ON table (columns) [WHERE ...]`.
    pub on: &'static str,
}

/// The indexes built after the migrations, in order. A migration that needs one adds it here
/// (and says so in its opening comment); code that relies on the index must do without it
/// until it is valid (the build may still run, or have failed and wait for the next migrate).
pub const CONCURRENT_INDEXES: &[ConcurrentIndex] = &[];

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

/// Brings the schema up to date; returns the names of the migrations it applied. A schema a
/// later release migrated further is left as it is, if that release only expanded it; one it
/// contracted past this binary is refused (`replyd_core::schema`).
pub async fn run_migrations(settings: &DatabaseSettings) -> Result<Vec<String>, StoreError> {
    let (mut client, connection) = session(settings).await?;
    // Workers start together and each migrates at start-up: without a lock, two runners race
    // on refinery's own history table (CREATE TABLE IF NOT EXISTS is not safe concurrently).
    // A session advisory lock serialises them; it is released when this connection closes.
    lock(&client).await?;
    let runner = embedded::migrations::runner();
    let fit = fit(&mut client, &runner).await?;
    // refinery refuses a history with migrations it has no file for (its `abort_missing`):
    // right for a gap in this binary's own, wrong for a later release's expansions.
    let runner = runner.set_abort_missing(matches!(fit, Fit::Known));
    let report = runner.run_async(&mut client).await?;
    let applied = applied_versions(&mut client, &runner).await?;
    build_indexes(&client, CONCURRENT_INDEXES, &applied).await?;
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

/// Builds `indexes` as [`CONCURRENT_INDEXES`] are built after the migrations, under the
/// migration lock; returns the names of those it built. For the tests of the build itself; the
/// service builds its own list in [`run_migrations`].
pub async fn build_concurrent_indexes(
    settings: &DatabaseSettings,
    indexes: &[ConcurrentIndex],
) -> Result<Vec<&'static str>, StoreError> {
    let (mut client, connection) = session(settings).await?;
    lock(&client).await?;
    let runner = embedded::migrations::runner();
    let applied = applied_versions(&mut client, &runner).await?;
    let built = build_indexes(&client, indexes, &applied).await;
    drop(client);
    let _ = connection.await;
    built
}

/// Builds each index of `indexes` whose migration is applied and which is not there and valid
/// yet: `CREATE INDEX CONCURRENTLY`, which lets writers go on, with no statement or lock timeout
/// (a build on a large table takes minutes, and first waits for the transactions open on the
/// table; the lock it waits for stops no writer). A build that failed before (a duplicate under
/// a unique index, a cancel, a crash) left an INVALID index, which PostgreSQL keeps updating but
/// never reads: it is dropped and built again. Idempotent: run at every migrate.
async fn build_indexes(
    client: &tokio_postgres::Client,
    indexes: &[ConcurrentIndex],
    applied: &[i32],
) -> Result<Vec<&'static str>, StoreError> {
    let mut built = Vec::new();
    let mut unbounded = false;
    for index in indexes.iter().filter(|i| applied.contains(&i.after)) {
        let valid: Option<bool> = client
            .query_one(
                "SELECT (SELECT i.indisvalid FROM pg_index i \
                          WHERE i.indexrelid = to_regclass($1::text))",
                &[&index.name],
            )
            .await?
            .get(0);
        if valid == Some(true) {
            continue;
        }
        if !unbounded {
            client
                .batch_execute("SET statement_timeout = 0; SET lock_timeout = 0")
                .await?;
            unbounded = true;
        }
        if valid == Some(false) {
            tracing::warn!(
                index = index.name,
                "an earlier build of this index failed and left it invalid; building it again"
            );
            client
                .batch_execute(&format!("DROP INDEX CONCURRENTLY IF EXISTS {}", index.name))
                .await?;
        }
        tracing::info!(index = index.name, "building an index concurrently");
        let started = Instant::now();
        client
            .batch_execute(&format!(
                "CREATE {}INDEX CONCURRENTLY IF NOT EXISTS {} {}",
                if index.unique { "UNIQUE " } else { "" },
                index.name,
                index.on
            ))
            .await?;
        tracing::info!(
            index = index.name,
            seconds = started.elapsed().as_secs_f64(),
            "index built"
        );
        built.push(index.name);
    }
    Ok(built)
}

/// The migrations this build has that the schema lacks, by name (`V19__...`): what a process
/// started with `database.migrate_on_start` off checks before it serves. A schema contracted
/// past this binary is refused here too.
pub async fn pending_migrations(settings: &DatabaseSettings) -> Result<Vec<String>, StoreError> {
    let (mut client, connection) = session(settings).await?;
    let runner = embedded::migrations::runner();
    let applied = applied_versions(&mut client, &runner).await?;
    judge(&mut client, &runner, &applied).await?;
    drop(client);
    let _ = connection.await;
    Ok(runner
        .get_migrations()
        .iter()
        .filter(|m| !applied.contains(&m.version()))
        .map(|m| m.to_string())
        .collect())
}

/// The versions of the migrations applied; none before refinery's history table exists (the
/// first migration run makes it).
async fn applied_versions(
    client: &mut tokio_postgres::Client,
    runner: &refinery::Runner,
) -> Result<Vec<i32>, StoreError> {
    let has_history: bool = client
        .query_one(
            "SELECT to_regclass('refinery_schema_history') IS NOT NULL",
            &[],
        )
        .await?
        .get(0);
    if !has_history {
        return Ok(Vec::new());
    }
    Ok(runner
        .get_applied_migrations_async(client)
        .await?
        .iter()
        .map(|m| m.version())
        .collect())
}

/// How the schema stands to this binary.
async fn fit(
    client: &mut tokio_postgres::Client,
    runner: &refinery::Runner,
) -> Result<Fit, StoreError> {
    let applied = applied_versions(client, runner).await?;
    judge(client, runner, &applied).await
}

/// Judges the schema: its applied migrations against this binary's, and its floor (V35).
async fn judge(
    client: &mut tokio_postgres::Client,
    runner: &refinery::Runner,
    applied: &[i32],
) -> Result<Fit, StoreError> {
    let known: Vec<i32> = runner
        .get_migrations()
        .iter()
        .map(|m| m.version())
        .collect();
    let floor = match client
        .query_opt(
            "SELECT oldest_version, oldest_release FROM schema_compatibility",
            &[],
        )
        .await
    {
        Ok(row) => row.map(|r| Floor {
            version: r.get(0),
            release: r.get(1),
        }),
        // A schema from before V35 has no floor: nothing was contracted.
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::UNDEFINED_TABLE) => None,
        Err(e) => return Err(e.into()),
    };
    let fit = schema::judge(&known, applied, floor.as_ref())
        .map_err(|too_new| StoreError::Config(too_new.to_string()))?;
    if let Fit::Ahead { newer } = &fit {
        tracing::info!(
            ?newer,
            this_release = env!("CARGO_PKG_VERSION"),
            "the schema was migrated further by a later release, which only expanded it; \
             running against it and leaving those migrations be"
        );
    }
    Ok(fit)
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The newest migration written before the rules of `rules` (long migrations). Those up to
    /// it are applied in the field and refinery keeps their checksums, so they stay as they are
    /// (V20's index and V22's backfill among them); every migration after it keeps the rules.
    const WRITTEN_BEFORE_THE_RULES: i32 = 36;

    #[test]
    fn migrations_written_from_now_on_keep_to_the_rules_of_long_migrations() {
        let migrations = embedded::migrations::runner().get_migrations().to_vec();
        assert!(
            migrations
                .iter()
                .any(|m| m.version() == WRITTEN_BEFORE_THE_RULES),
            "the last migration exempt from the rules is one of the migrations"
        );
        let refused: Vec<String> = migrations
            .iter()
            .filter(|m| m.version() > WRITTEN_BEFORE_THE_RULES)
            .flat_map(|m| {
                rules::check(m.sql().unwrap_or_default())
                    .into_iter()
                    .map(move |r| format!("{m}: `{}`: {}", r.statement, r.why))
            })
            .collect();
        assert!(refused.is_empty(), "{}", refused.join("\n"));
    }

    #[test]
    fn every_index_built_concurrently_follows_a_migration_and_has_a_plain_name() {
        let versions: Vec<i32> = embedded::migrations::runner()
            .get_migrations()
            .iter()
            .map(|m| m.version())
            .collect();
        for index in CONCURRENT_INDEXES {
            assert!(versions.contains(&index.after), "{index:?}");
            assert!(
                index
                    .name
                    .chars()
                    .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_'),
                "{index:?}"
            );
            assert!(
                index.on.trim_start().to_lowercase().starts_with("on "),
                "{index:?}"
            );
        }
    }
}
