//! A store call on a record's path, run again after an I/O error until it succeeds or the
//! record is cancelled: the pipeline's and the runner's one way to wait out PostgreSQL.

use std::future::Future;
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::StoreError;
use crate::telemetry;

/// Runs a store operation until it succeeds or `cancel` fires (`None`). A write whose
/// outcome is unknown (the connection broke during COMMIT) is simply run again: every
/// fenced write answers a repeat with what the first one did (`AlreadySaved` by this
/// assignment, or a refusal), and a cancelled record is read again by the next owner.
pub(super) async fn with_retry<T, F, Fut>(
    io_retry: Duration,
    operation: &'static str,
    cancel: &CancellationToken,
    mut op: F,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    loop {
        match op().await {
            Ok(value) => return Some(value),
            Err(e) => telemetry::store_error(operation, &e),
        }
        if !pause(cancel, io_retry).await {
            return None;
        }
    }
}

/// Sleeps `wait` unless cancelled first; false when cancelled.
pub(super) async fn pause(cancel: &CancellationToken, wait: Duration) -> bool {
    tokio::select! {
        biased;
        _ = cancel.cancelled() => false,
        _ = tokio::time::sleep(wait) => true,
    }
}
