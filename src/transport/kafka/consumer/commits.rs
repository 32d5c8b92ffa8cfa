//! Committing offsets: the done prefix of each partition, sent asynchronously as records
//! finish, and confirmed within a bound when partitions are let go. A leaf: the shared state
//! and the client's callbacks both use it.

use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer, ConsumerContext};
use rdkafka::{Offset, TopicPartitionList};

use crate::telemetry;
use replyd_core::offsets::PartitionKey;

pub(super) fn commit_points<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    points: &[(PartitionKey, i64)],
    mode: CommitMode,
) {
    if points.is_empty() {
        return;
    }
    let list = commit_list(points, matches!(mode, CommitMode::Sync));
    // An error here is the commit not queued; how a queued async commit fares is only logged
    // by librdkafka (see `commit_callback`), hence the periodic full re-commit. The release
    // path confirms its commit itself (`commit_on_release`).
    match consumer.commit(&list, mode) {
        Ok(()) => telemetry::committed(points, matches!(mode, CommitMode::Sync)),
        Err(e) => telemetry::commit_failed(&e, matches!(mode, CommitMode::Sync)),
    }
}

/// The partition list of commit `points`; `confirmed` labels a failure as the release path's.
fn commit_list(points: &[(PartitionKey, i64)], confirmed: bool) -> TopicPartitionList {
    let mut list = TopicPartitionList::new();
    for (key, point) in points {
        // add_partition_offset fails only for an invalid offset; ours come from real records.
        if let Err(e) = list.add_partition_offset(&key.topic, key.partition, Offset::Offset(*point))
        {
            telemetry::commit_failed(&e, confirmed);
        }
    }
    list
}

/// How long a released partition's last commit is waited for.
const RELEASE_COMMIT_TIMEOUT: Duration = Duration::from_secs(5);

/// The commit of partitions being let go (revoke, shutdown): sent at once, then confirmed by
/// reading the group's committed offsets back, for at most [`RELEASE_COMMIT_TIMEOUT`]. Not a
/// synchronous commit: librdkafka waits for one without a bound, and this runs inside the
/// rebalance callback, on the poll thread, where a wait without end stalls every partition of
/// the worker (a KIP-848 revoke on Kafka 4.4.0 was seen to stop there). A commit that is not
/// confirmed in time costs only redeliveries: the next owner reads those records again, and
/// their tasks are done, so the claim refuses them without a call (I5).
pub(super) fn commit_on_release<C: ConsumerContext>(
    consumer: &BaseConsumer<C>,
    points: &[(PartitionKey, i64)],
) {
    if points.is_empty() {
        return;
    }
    let list = commit_list(points, true);
    if let Err(e) = consumer.commit(&list, CommitMode::Async) {
        telemetry::commit_failed(&e, true);
        return;
    }
    let deadline = Instant::now() + RELEASE_COMMIT_TIMEOUT;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match consumer.committed_offsets(list.clone(), left) {
            Ok(committed) if reached(&committed, points) => {
                telemetry::committed(points, true);
                return;
            }
            Ok(_) => {}
            Err(e) => telemetry::commit_failed(&e, true),
        }
        if Instant::now() >= deadline {
            telemetry::release_commit_unconfirmed(points, RELEASE_COMMIT_TIMEOUT);
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the group's committed offsets are at or past every point.
fn reached(committed: &TopicPartitionList, points: &[(PartitionKey, i64)]) -> bool {
    points.iter().all(|(key, point)| {
        committed
            .find_partition(&key.topic, key.partition)
            .is_some_and(|e| matches!(e.offset(), Offset::Offset(o) if o >= *point))
    })
}

pub(super) fn keys_of(list: &TopicPartitionList) -> Vec<PartitionKey> {
    list.elements()
        .iter()
        .map(|e| PartitionKey::new(e.topic(), e.partition()))
        .collect()
}
