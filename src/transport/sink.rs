//! The seam between the relay and where it hands the outbox: a sink publishes a batch of
//! outbox rows and says which it published and which it can never publish (the record itself
//! refused), so the relay marks both in the batch's transaction. Anything else leaves a row for
//! the next batch; a row sent twice is one task to the workers (I1, I6).

use std::time::Duration;

use futures_util::future::BoxFuture;

use crate::store::outbox::{OutboxRow, Published};

/// Where the relay hands the outbox.
pub trait Sink: Send + Sync + 'static {
    /// What it is, for the relay's start line (`kafka topic replyd.tasks`).
    fn name(&self) -> String;
    /// Publishes `rows`, ending within `timeout` (the batch's transaction is open meanwhile).
    fn publish(&self, rows: Vec<OutboxRow>, timeout: Duration) -> BoxFuture<'_, Published>;
}
