//! Start-up connections: PostgreSQL and Kafka may come up after replyd (a pod scheduled first,
//! a broker restarting). Each start-up step that connects is retried with a bounded backoff
//! for a bounded time, and logs one line per distinct failure instead of one per attempt.

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use tokio_util::sync::CancellationToken;

use crate::telemetry::RepeatedFailure;

/// Why a start-up step gave up.
#[derive(Debug, thiserror::Error)]
pub enum StartupError<E: std::error::Error + 'static> {
    /// The last error, after retrying for `waited`.
    #[error("{error} (gave up after {waited:?} of retrying)")]
    GaveUp { error: E, waited: Duration },
    /// An error retrying cannot mend (bad credentials, bad settings).
    #[error(transparent)]
    Permanent(E),
    #[error("stopped while waiting to connect")]
    Cancelled,
}

/// Runs `step` until it succeeds, fails with an error `transient` refuses, `limit` passes, or
/// `shutdown` fires. Backoff from 200 ms doubling to 5 s.
pub async fn retry_connecting<T, E, F, Fut>(
    what: &'static str,
    limit: Duration,
    shutdown: &CancellationToken,
    transient: impl Fn(&E) -> bool,
    mut step: F,
) -> Result<T, StartupError<E>>
where
    E: std::error::Error + 'static,
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, E>>,
{
    let started = Instant::now();
    let mut failures = RepeatedFailure::new(what);
    let mut backoff = Duration::from_millis(200);
    loop {
        match step().await {
            Ok(value) => {
                failures.recovered();
                return Ok(value);
            }
            Err(error) if !transient(&error) => return Err(StartupError::Permanent(error)),
            Err(error) => {
                let waited = started.elapsed();
                if waited >= limit {
                    return Err(StartupError::GaveUp { error, waited });
                }
                failures.failed(&crate::telemetry::chain(&error));
            }
        }
        tokio::select! {
            _ = shutdown.cancelled() => return Err(StartupError::Cancelled),
            _ = tokio::time::sleep(backoff) => {}
        }
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
}

/// Brings the schema up to date at start-up, retrying while PostgreSQL cannot be reached; with
/// `database.migrate_on_start` off, only checks that nothing this build needs is missing.
pub async fn migrate(
    database: &crate::store::DatabaseSettings,
    shutdown: &CancellationToken,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    if !database.migrate_on_start {
        let pending = retry_reaching_postgres(database, shutdown, || {
            crate::store::migrate::pending_migrations(database)
        })
        .await
        .context("checking the database schema")?;
        anyhow::ensure!(
            pending.is_empty(),
            "the database schema lacks migrations this build needs ({}): run `replyd migrate` \
             (the chart's migration Job) first, or turn database.migrate_on_start on",
            pending.join(", ")
        );
        return Ok(());
    }
    let applied = retry_reaching_postgres(database, shutdown, || {
        crate::store::migrate::run_migrations(database)
    })
    .await
    .context("applying database migrations")?;
    if !applied.is_empty() {
        tracing::info!(?applied, "migrations applied");
    }
    Ok(())
}

/// Runs a schema step with [`retry_connecting`], retrying for `database.startup_retry_ms` while
/// PostgreSQL cannot be reached; any other store error ends it.
async fn retry_reaching_postgres<T, Fut>(
    database: &crate::store::DatabaseSettings,
    shutdown: &CancellationToken,
    step: impl FnMut() -> Fut,
) -> Result<T, StartupError<crate::store::StoreError>>
where
    Fut: Future<Output = Result<T, crate::store::StoreError>>,
{
    use crate::store::StoreError;
    retry_connecting(
        "connecting to PostgreSQL",
        Duration::from_millis(database.startup_retry_ms),
        shutdown,
        |e: &StoreError| matches!(e, StoreError::Connect { .. }),
        step,
    )
    .await
}

/// The store a long-running part starts from: the schema brought up to date first ([`migrate`],
/// retried while PostgreSQL is away), then the pool.
pub async fn migrated_store(
    database: &crate::store::DatabaseSettings,
    shutdown: &CancellationToken,
) -> anyhow::Result<crate::store::Store> {
    use anyhow::Context as _;
    migrate(database, shutdown).await?;
    crate::store::Store::connect(database).context("database settings")
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[derive(Debug, thiserror::Error, PartialEq)]
    enum Failure {
        #[error("refused")]
        Refused,
        #[error("denied")]
        Denied,
    }

    #[tokio::test(start_paused = true)]
    async fn transient_failures_are_retried_until_success() {
        let calls = Cell::new(0);
        let out = retry_connecting(
            "test",
            Duration::from_secs(60),
            &CancellationToken::new(),
            |e| *e == Failure::Refused,
            || {
                calls.set(calls.get() + 1);
                let n = calls.get();
                async move { if n < 4 { Err(Failure::Refused) } else { Ok(n) } }
            },
        )
        .await
        .unwrap();
        assert_eq!(out, 4);
    }

    #[tokio::test(start_paused = true)]
    async fn permanent_failures_and_the_limit_end_the_retries() {
        let err = retry_connecting(
            "test",
            Duration::from_secs(60),
            &CancellationToken::new(),
            |e| *e == Failure::Refused,
            || async { Err::<(), _>(Failure::Denied) },
        )
        .await
        .unwrap_err();
        assert!(matches!(err, StartupError::Permanent(Failure::Denied)));

        let calls = Cell::new(0);
        let err = retry_connecting(
            "test",
            Duration::from_secs(10),
            &CancellationToken::new(),
            |_| true,
            || {
                calls.set(calls.get() + 1);
                async { Err::<(), _>(Failure::Refused) }
            },
        )
        .await
        .unwrap_err();
        assert!(matches!(err, StartupError::GaveUp { .. }), "{err}");
        // 0.2 + 0.4 + 0.8 + 1.6 + 3.2 + 5 s of backoff pass 10 s: bounded, not one per tick.
        assert!(calls.get() <= 8, "{} attempts", calls.get());
    }
}
