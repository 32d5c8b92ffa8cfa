//! The consumer's librdkafka context: its logs and errors, its statistics (each partition's
//! lag, and whether each is still fetched), the rebalance callbacks (a revocation drains
//! before it returns) and the result of commits.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use rdkafka::consumer::{BaseConsumer, Consumer, ConsumerContext, Rebalance};
use rdkafka::error::{KafkaError, KafkaResult};
use rdkafka::{ClientContext, TopicPartitionList};

use super::commits::keys_of;
use super::shared::Shared;
use crate::telemetry;
use replyd_core::offsets::PartitionKey;

/// librdkafka's callbacks: rebalances, commit results, logs.
pub struct WorkerContext {
    shared: Arc<Shared>,
    topic: String,
    /// Whether a partition without a committed offset is read from its start (see
    /// `reads_uncommitted_from_start`).
    uncommitted_from_start: bool,
    /// Partitions whose lag this worker reported, so one it no longer has is set to 0.
    lag_reported: std::sync::Mutex<std::collections::BTreeSet<i32>>,
}

impl WorkerContext {
    pub(super) fn new(shared: Arc<Shared>, topic: String, uncommitted_from_start: bool) -> Self {
        Self {
            shared,
            topic,
            uncommitted_from_start,
            lag_reported: Default::default(),
        }
    }
}

impl ClientContext for WorkerContext {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        telemetry::librdkafka_log(level, fac, message);
    }

    fn error(&self, error: KafkaError, reason: &str) {
        telemetry::kafka_client_error(&error, reason);
    }

    /// librdkafka's statistics (every `statistics.interval.ms`): the consumer lag of each
    /// partition this worker is assigned, and whether each is still fetched.
    fn stats(&self, statistics: rdkafka::Statistics) {
        let Some(topic) = statistics.topics.get(&self.topic) else {
            return;
        };
        let mut reported = self.lag_reported.lock().unwrap_or_else(|p| p.into_inner());
        for partition in topic.partitions.values().filter(|p| p.partition >= 0) {
            if partition.desired {
                self.shared.watch_fetch(
                    PartitionKey::new(self.topic.as_str(), partition.partition),
                    partition,
                    self.uncommitted_from_start,
                );
            }
            let lag = partition
                .desired
                .then(|| {
                    lag_of(
                        partition.hi_offset,
                        partition.lo_offset,
                        partition.committed_offset,
                    )
                })
                .flatten();
            match lag {
                Some(records) => {
                    telemetry::consumer_lag(partition.partition, records);
                    reported.insert(partition.partition);
                }
                None if reported.remove(&partition.partition) => {
                    telemetry::consumer_lag(partition.partition, 0);
                }
                None => {}
            }
        }
    }
}

/// A partition's consumer lag from librdkafka's statistics: the records after the group's
/// committed offset, up to the high watermark. Before the group's first commit, every record
/// from the low watermark (the group starts at the earliest). None while the watermark is
/// unknown.
pub fn lag_of(high_watermark: i64, low_watermark: i64, committed: i64) -> Option<i64> {
    if high_watermark < 0 {
        return None;
    }
    let from = if committed >= 0 {
        committed
    } else {
        low_watermark.max(0)
    };
    Some((high_watermark - from).max(0))
}

impl ConsumerContext for WorkerContext {
    fn pre_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        if let Rebalance::Revoke(list) = rebalance {
            let keys = keys_of(list);
            // Lost partitions (our session expired) already belong to someone else: draining
            // or committing for them is pointless, so cancel at once.
            let lost = consumer.assignment_lost();
            telemetry::rebalance(if lost { "lost" } else { "revoke" }, &keys);
            self.shared
                .status
                .rebalances
                .fetch_add(1, Ordering::Relaxed);
            self.shared.release(consumer, &keys, !lost);
        }
    }

    fn post_rebalance(&self, consumer: &BaseConsumer<Self>, rebalance: &Rebalance<'_>) {
        match rebalance {
            Rebalance::Assign(list) => {
                let keys = keys_of(list);
                telemetry::rebalance("assign", &keys);
                self.shared
                    .status
                    .rebalances
                    .fetch_add(1, Ordering::Relaxed);
                self.shared.adopt(&keys);
                // librdkafka keeps a partition's pause across assignments: one we paused for
                // back-pressure, lost or revoked, then given back would never be fetched
                // again. Our state starts an adopted partition unpaused; make librdkafka agree.
                if list.count() > 0
                    && let Err(e) = consumer.resume(list)
                {
                    telemetry::consumer_error(&e);
                }
            }
            Rebalance::Error(e) => telemetry::consumer_error(e),
            Rebalance::Revoke(_) => {}
        }
    }

    fn commit_callback(&self, result: KafkaResult<()>, offsets: &TopicPartitionList) {
        // Only some commits report here. librdkafka hands the result of an application's
        // async commit (`rd_kafka_commit(.., async)`) to a configured `offset_commit_cb` or a
        // reply queue only (rd_kafka_cgrp_propagate_commit_result); the OFFSET_COMMIT event
        // rdkafka enables is used for librdkafka's own auto-commits. rdkafka sets neither, so
        // a failed async commit is only librdkafka's COMMITFAIL log line, never this call:
        // hence the periodic full re-commit (FULL_COMMIT_INTERVAL). A commit can fail as a
        // whole or per partition (a generation error during a rebalance is reported on each).
        let failed: Vec<PartitionKey> = match &result {
            Err(e) => {
                telemetry::commit_failed(e, false);
                keys_of(offsets)
            }
            Ok(()) => offsets
                .elements()
                .iter()
                .filter_map(|e| match e.error() {
                    Ok(()) => None,
                    Err(error) => {
                        telemetry::commit_failed(&error, false);
                        Some(PartitionKey::new(e.topic(), e.partition()))
                    }
                })
                .collect(),
        };
        // Forget what we believed committed, so the next tick sends it again even if no
        // record finishes in between (otherwise an idle partition would stay behind).
        self.shared.forget_commits(&failed);
    }
}

#[cfg(test)]
mod tests {
    use super::lag_of;

    #[test]
    fn lag_counts_from_the_committed_offset_or_from_the_start_before_the_first_commit() {
        assert_eq!(lag_of(120, 0, 100), Some(20));
        assert_eq!(lag_of(120, 0, 120), Some(0), "caught up");
        assert_eq!(
            lag_of(120, 30, -1001),
            Some(90),
            "no commit yet: from the low watermark"
        );
        assert_eq!(lag_of(-1, 0, 5), None, "the watermark is not known yet");
        assert_eq!(
            lag_of(100, 0, 130),
            Some(0),
            "a commit ahead of a stale watermark"
        );
    }
}
