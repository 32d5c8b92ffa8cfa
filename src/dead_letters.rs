//! `replyd dead-letters replay`: sends dead-lettered records back to the task topic once what
//! refused them is fixed (a producer that sent a field wrong and resends nothing, a worker
//! setting too tight such as `worker.max_prompt_bytes`). Each copy's original key, value and
//! producer headers go back to `kafka.topic`; the worker judges the record again, so a record
//! still bad is dead-lettered again, and one whose task already exists is answered from it
//! (the task id, not the record, is the identity of the work: I1, I5).
//!
//! The copies read are those on the dead-letter topic up to its end when the command starts
//! (copies made meanwhile wait for the next run), filtered by the refusal's kind and the
//! copy's time. A record carries how often it was replayed (`replyd.replays`); one replayed
//! `--max-replays` times is left where it is, so a record that can never be a task is not
//! sent round for ever. Nothing is committed: a run is repeatable, and a record replayed twice
//! is one task.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use anyhow::Context as _;
use chrono::{DateTime, Utc};
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{BorrowedMessage, Header, Headers, Message, OwnedHeaders};
use rdkafka::producer::FutureProducer;
use rdkafka::{Offset, TopicPartitionList};
use serde::Serialize;

use crate::config::Settings;
use crate::transport::kafka::KafkaLogs;
use crate::transport::kafka::dead_letter::{copy_of, headers};

/// The dead letters `replyd dead-letters replay` sends back, and how it reports.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct ReplayArgs {
    /// Only copies refused for this kind (`prompt_too_large`, `missing_field`,
    /// `invalid_field`, `undecodable`, `unknown_schema_version`, `empty_record`);
    /// repeatable. Every kind when not given.
    #[arg(long = "kind")]
    pub kinds: Vec<String>,
    /// Only copies made at or after this time (RFC 3339, e.g. 2026-12-02T09:00:00Z).
    #[arg(long)]
    pub since: Option<chrono::DateTime<chrono::Utc>>,
    /// A record replayed this often already is left where it is.
    #[arg(long, default_value_t = 3)]
    pub max_replays: u32,
    /// Count what would be replayed; send nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

/// What one dead-letter copy gets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Decision {
    /// Sent back, as its `n`th replay.
    Replay { n: u32 },
    /// Another kind than asked, or older than asked.
    NotSelected,
    /// Replayed `max_replays` times already.
    Exhausted,
}

/// Decides one copy from its refusal kind, its time and how often its record was replayed.
pub fn decide(
    kind: Option<&str>,
    made_at: Option<DateTime<Utc>>,
    replays: u32,
    filter: &ReplayArgs,
) -> Decision {
    let kind_selected =
        filter.kinds.is_empty() || kind.is_some_and(|k| filter.kinds.iter().any(|f| f == k));
    let time_selected = match (filter.since, made_at) {
        (Some(since), Some(at)) => at >= since,
        (Some(_), None) => false,
        (None, _) => true,
    };
    if !(kind_selected && time_selected) {
        Decision::NotSelected
    } else if replays >= filter.max_replays {
        Decision::Exhausted
    } else {
        Decision::Replay { n: replays + 1 }
    }
}

/// What a run did, by refusal kind.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct ReplayReport {
    pub read: u64,
    pub replayed: BTreeMap<String, u64>,
    pub not_selected: u64,
    pub exhausted: u64,
    pub dry_run: bool,
}

impl std::fmt::Display for ReplayReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let replayed: u64 = self.replayed.values().sum();
        let by_kind: Vec<String> = self
            .replayed
            .iter()
            .map(|(kind, n)| format!("{kind}: {n}"))
            .collect();
        write!(
            f,
            "{} dead-letter copies read; {} {} ({}); {} not selected; {} left after --max-replays",
            self.read,
            replayed,
            if self.dry_run {
                "would be replayed"
            } else {
                "replayed"
            },
            by_kind.join(", "),
            self.not_selected,
            self.exhausted
        )
    }
}

/// A header's value as text.
fn header<'a>(message: &'a BorrowedMessage<'_>, name: &str) -> Option<&'a str> {
    message
        .headers()?
        .iter()
        .find(|h| h.key == name)
        .and_then(|h| h.value)
        .and_then(|v| std::str::from_utf8(v).ok())
}

/// Replays the selected copies of the dead-letter topic to `kafka.topic`.
pub async fn replay(settings: &Settings, filter: &ReplayArgs) -> anyhow::Result<ReplayReport> {
    let kafka = &settings.kafka;
    let dead_letter_topic = kafka.dead_letter_topic();
    let reader: BaseConsumer<KafkaLogs> = kafka
        .client_config()
        .set("group.id", format!("{}.dead-letter-replay", kafka.group_id))
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .set("allow.auto.create.topics", "false")
        .create_with_context(KafkaLogs::default())
        .with_context(|| {
            format!(
                "Kafka consumer for {} (kafka.bootstrap_servers)",
                kafka.bootstrap_servers
            )
        })?;
    let producer: FutureProducer<KafkaLogs> = kafka
        .producer_config()
        .create_with_context(KafkaLogs::default())?;

    // Up to the end as it is now: copies made while this runs (a replayed record refused
    // again) wait for the next run.
    let (mut remaining, assignment) = tokio::task::block_in_place(|| {
        let metadata = reader
            .fetch_metadata(Some(&dead_letter_topic), Duration::from_secs(10))
            .with_context(|| format!("reading the metadata of {dead_letter_topic}"))?;
        let meta = metadata
            .topics()
            .iter()
            .find(|t| t.name() == dead_letter_topic && !t.partitions().is_empty())
            .with_context(|| {
                format!(
                    "dead-letter topic {dead_letter_topic} does not exist (kafka.dead_letter_topic)"
                )
            })?;
        let mut remaining = HashMap::new();
        let mut assignment = TopicPartitionList::new();
        for partition in meta.partitions() {
            let (low, high) = reader.fetch_watermarks(
                &dead_letter_topic,
                partition.id(),
                Duration::from_secs(10),
            )?;
            if high > low {
                remaining.insert(partition.id(), high);
                assignment.add_partition_offset(
                    &dead_letter_topic,
                    partition.id(),
                    Offset::Offset(low),
                )?;
            }
        }
        anyhow::Ok((remaining, assignment))
    })?;
    let mut report = ReplayReport {
        dry_run: filter.dry_run,
        ..ReplayReport::default()
    };
    if remaining.is_empty() {
        return Ok(report);
    }
    reader.assign(&assignment)?;
    let mut sends = Vec::new();
    let mut idle = std::time::Instant::now();
    while !remaining.is_empty() {
        anyhow::ensure!(
            idle.elapsed() < Duration::from_secs(60),
            "reading {dead_letter_topic}: no record for 60 s while {} partition(s) were not read to their end",
            remaining.len()
        );
        let Some(polled) = tokio::task::block_in_place(|| reader.poll(Duration::from_millis(200)))
        else {
            continue;
        };
        let message = polled?;
        idle = std::time::Instant::now();
        let partition = message.partition();
        let Some(&high) = remaining.get(&partition) else {
            continue;
        };
        if message.offset() + 1 >= high {
            remaining.remove(&partition);
        }
        if message.offset() >= high {
            continue;
        }
        report.read += 1;
        let kind = header(&message, headers::ERROR_KIND).map(str::to_owned);
        let replays = header(&message, headers::REPLAYS)
            .and_then(|v| v.parse().ok())
            .unwrap_or(0);
        let made_at = message
            .timestamp()
            .to_millis()
            .and_then(DateTime::from_timestamp_millis);
        match decide(kind.as_deref(), made_at, replays, filter) {
            Decision::NotSelected => report.not_selected += 1,
            Decision::Exhausted => report.exhausted += 1,
            Decision::Replay { n } => {
                *report
                    .replayed
                    .entry(kind.unwrap_or_else(|| "unknown".into()))
                    .or_default() += 1;
                if filter.dry_run {
                    continue;
                }
                // The producer's own headers, without the copy's (where it came from, why it
                // was refused) and with how often it was replayed now.
                let replayed = n.to_string();
                let counted = OwnedHeaders::new().insert(Header {
                    key: headers::REPLAYS,
                    value: Some(&replayed),
                });
                let record = copy_of(&message, &kafka.topic, counted, |key| {
                    !key.starts_with("replyd.")
                });
                sends.push(producer.send_result(record).map_err(|(e, _)| e)?);
            }
        }
    }
    // Every replayed record acknowledged by all replicas before the run says it is done.
    for send in sends {
        send.await
            .context("a replayed record's delivery was dropped")?
            .map_err(|(e, _)| e)
            .with_context(|| format!("replaying to {} (kafka.topic)", kafka.topic))?;
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter(kinds: &[&str]) -> ReplayArgs {
        ReplayArgs {
            kinds: kinds.iter().map(|k| k.to_string()).collect(),
            max_replays: 3,
            ..ReplayArgs::default()
        }
    }

    #[test]
    fn a_copy_is_replayed_when_its_kind_and_time_are_asked_for_and_its_replays_not_spent() {
        const BIG: &str = "prompt_too_large";
        let now = Utc::now();
        let earlier = now - chrono::TimeDelta::seconds(1);
        let any = filter(&[]);
        let big = filter(&[BIG]);
        let since = ReplayArgs {
            since: Some(now),
            ..filter(&[])
        };
        for (kind, made_at, replays, asked, expected) in [
            (Some(BIG), Some(now), 0, &any, Decision::Replay { n: 1 }),
            (Some(BIG), Some(now), 2, &big, Decision::Replay { n: 3 }),
            (
                Some("missing_field"),
                Some(now),
                0,
                &big,
                Decision::NotSelected,
            ),
            (None, Some(now), 0, &big, Decision::NotSelected),
            (Some(BIG), Some(now), 3, &any, Decision::Exhausted),
            (Some("x"), Some(earlier), 0, &since, Decision::NotSelected),
            (Some("x"), None, 0, &since, Decision::NotSelected),
            (Some("x"), Some(now), 0, &since, Decision::Replay { n: 1 }),
        ] {
            assert_eq!(
                decide(kind, made_at, replays, asked),
                expected,
                "{kind:?} made at {made_at:?}, replayed {replays} times, under {asked:?}"
            );
        }
    }
}
