//! Moving a consumer group's committed offsets back to a point in time: after the database is
//! restored to that point, the records committed past since then are the tasks it lost, and
//! reading them again puts them back (the worker is idempotent: a record whose task the
//! restored database holds finished is done without a call).
//!
//! Only ever back: a partition whose committed offset is already at or before the point is
//! left alone. Kafka takes a commit from outside the group only while the group has no
//! member, so the workers are stopped first; the error says so.

use std::time::Duration;

use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;

use super::settings::KafkaSettings;

/// How long each request to the brokers may take.
const TIMEOUT: Duration = Duration::from_secs(10);

/// One partition moved back (or, in a dry run, that would be).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Rewound {
    pub partition: i32,
    /// The committed offset before.
    pub from: i64,
    /// The first offset of a record written at or after the point.
    pub to: i64,
}

/// Why the offsets could not be moved; each names what to do.
#[derive(Debug, thiserror::Error)]
pub enum RewindError {
    #[error("reading {what} of topic {topic} from {bootstrap} (kafka.bootstrap_servers): {error}")]
    Read {
        what: &'static str,
        topic: String,
        bootstrap: String,
        error: Box<rdkafka::error::KafkaError>,
    },
    #[error(
        "committing the offsets of group {group} (kafka.group_id): {error}; Kafka takes them only while the group has no member: stop every worker of the group first"
    )]
    Commit {
        group: String,
        error: Box<rdkafka::error::KafkaError>,
    },
}

/// Moves the committed offsets of `kafka.group_id` on `kafka.topic` back to the first record
/// written at or after `point_ms` (milliseconds since the epoch), where they are past it; with
/// `dry_run` only says where. Blocking: call it off the runtime's threads.
pub fn rewind(
    kafka: &KafkaSettings,
    point_ms: i64,
    dry_run: bool,
) -> Result<Vec<Rewound>, RewindError> {
    let read = |what: &'static str| {
        let (topic, bootstrap) = (kafka.topic.clone(), kafka.bootstrap_servers.clone());
        move |error| RewindError::Read {
            what,
            topic,
            bootstrap,
            error: Box::new(error),
        }
    };
    let consumer: BaseConsumer = kafka
        .client_config()
        .set("group.id", &kafka.group_id)
        .set("enable.auto.commit", "false")
        .create()
        .map_err(read("a client"))?;
    let metadata = consumer
        .fetch_metadata(Some(&kafka.topic), TIMEOUT)
        .map_err(read("the metadata"))?;
    let mut all = TopicPartitionList::new();
    let mut at_point = TopicPartitionList::new();
    for topic in metadata.topics() {
        for partition in topic.partitions() {
            all.add_partition(&kafka.topic, partition.id());
            // A time as the offset asks for the first record at or after it.
            let _ = at_point.add_partition_offset(
                &kafka.topic,
                partition.id(),
                Offset::Offset(point_ms),
            );
        }
    }
    let committed = consumer
        .committed_offsets(all, TIMEOUT)
        .map_err(read("the committed offsets"))?;
    let found = consumer
        .offsets_for_times(at_point, TIMEOUT)
        .map_err(read("the offsets at the restore point"))?;
    let mut rewound = Vec::new();
    for element in committed.elements() {
        let Offset::Offset(from) = element.offset() else {
            // Never committed: the group starts at the earliest record anyway.
            continue;
        };
        let to = found
            .find_partition(&kafka.topic, element.partition())
            .map(|e| e.offset());
        // No record at or after the point: nothing was written since, nothing to read again.
        if let Some(Offset::Offset(to)) = to
            && to < from
        {
            rewound.push(Rewound {
                partition: element.partition(),
                from,
                to,
            });
        }
    }
    if dry_run || rewound.is_empty() {
        return Ok(rewound);
    }
    let mut moves = TopicPartitionList::new();
    for r in &rewound {
        let _ = moves.add_partition_offset(&kafka.topic, r.partition, Offset::Offset(r.to));
    }
    consumer
        .commit(&moves, CommitMode::Sync)
        .map_err(|error| RewindError::Commit {
            group: kafka.group_id.clone(),
            error: Box::new(error),
        })?;
    Ok(rewound)
}
