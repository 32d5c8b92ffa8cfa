//! Each workspace's weight (I10, `workspaces.weight`, set by `replyd workspace share`), as a
//! worker reads it: the workspaces whose weight is not the default, read every
//! [`REFRESH`]. The windows and the capacity waiters take a record's weight from here when it
//! arrives, so a change reaches the workers within about that; until the first read, and
//! while the database is away, the last weights read stand.

use std::collections::HashMap;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use tokio_util::sync::CancellationToken;

use crate::store::Store;
use crate::telemetry;

/// How often a worker reads the weights.
pub const REFRESH: Duration = Duration::from_secs(10);

/// The weights read last. Cheap to clone.
#[derive(Clone, Default)]
pub struct Weights {
    other_than_one: Arc<RwLock<HashMap<String, u32>>>,
}

impl Weights {
    /// The weight of `workspace` (1 unless set).
    pub fn of(&self, workspace: &str) -> u32 {
        // A poisoned lock only means a panic elsewhere; the map stays usable.
        let weights = self
            .other_than_one
            .read()
            .unwrap_or_else(|p| p.into_inner());
        weights.get(workspace).copied().unwrap_or(1)
    }

    fn replace(&self, read: Vec<(String, i32)>) {
        let read = read
            .into_iter()
            .map(|(workspace, weight)| (workspace, u32::try_from(weight).unwrap_or(1)))
            .collect();
        *self
            .other_than_one
            .write()
            .unwrap_or_else(|p| p.into_inner()) = read;
    }

    /// Reads the weights now, then every [`REFRESH`] until `shutdown`.
    pub fn keep_reading(&self, store: Store, shutdown: CancellationToken) {
        let weights = self.clone();
        tokio::spawn(async move {
            loop {
                match store.workspace_weights().await {
                    Ok(read) => weights.replace(read),
                    Err(e) => telemetry::store_error("workspace_weights", &e),
                }
                tokio::select! {
                    _ = shutdown.cancelled() => return,
                    _ = tokio::time::sleep(REFRESH) => {}
                }
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workspace_not_read_weighs_one_and_a_read_replaces_every_weight() {
        let weights = Weights::default();
        assert_eq!(weights.of("a"), 1);
        weights.replace(vec![("a".into(), 3), ("b".into(), 1000)]);
        assert_eq!(
            (weights.of("a"), weights.of("b"), weights.of("c")),
            (3, 1000, 1)
        );
        weights.replace(vec![("b".into(), 2)]);
        assert_eq!((weights.of("a"), weights.of("b")), (1, 2));
    }
}
