//! `replyd check`: reads the durable state — PostgreSQL, the topic and its dead-letter twin, the
//! group's committed offsets, and (when given) the mock provider's counters — and reports
//! whether the invariants hold. Every figure is read back, none is taken from what a producer
//! meant to do.
//!
//! - I1: `duplicate_replies` counts tasks with more than one accepted attempt in the history
//!   (the schema's constraints make a second saved reply impossible; the history is the
//!   independent witness).
//! - I3: `lost` counts records below the committed offset whose task is not terminal (or was
//!   never created) and bad records below it with no dead-letter copy.
//! - I7: `max_attempts_exceeded` counts tasks with more attempts than their budget.

use std::collections::{HashMap, HashSet};
use std::time::{Duration, Instant};

use clap::Args;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use serde::Serialize;
use uuid::Uuid;

use crate::domain::{RecordRules, TaskSpec};
use crate::kafka::dead_letter::headers;

#[derive(Debug, Clone, Args)]
pub struct CheckArgs {
    /// PostgreSQL URL.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Kafka bootstrap servers.
    #[arg(long, env = "KAFKA_BOOTSTRAP")]
    pub bootstrap: String,
    /// Topic of reply-task records.
    #[arg(long, default_value = "reply-tasks")]
    pub topic: String,
    /// Dead-letter topic (default `<topic>.dlq`).
    #[arg(long)]
    pub dead_letter_topic: Option<String>,
    /// Consumer group whose committed offsets are checked.
    #[arg(long, default_value = "replyd")]
    pub group: String,
    /// Base URL of the mock provider, to read its call counters.
    #[arg(long)]
    pub mock_url: Option<String>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Print one `key=value` line of the headline figures instead (for `make demo`).
    #[arg(long, conflicts_with = "json")]
    pub summary: bool,
}

/// Percentiles of provider calls (attempts) per task.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct CallsPerTask {
    pub p50: i64,
    pub p99: i64,
    pub max: i64,
}

#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct Report {
    pub tasks: i64,
    pub completed: i64,
    pub failed: i64,
    pub pending: i64,
    pub dead_lettered: i64,
    /// Records in the topic (all partitions), good and bad.
    pub records: i64,
    pub bad_records: i64,
    pub duplicate_replies: i64,
    pub lost: i64,
    pub fenced_rejections: i64,
    pub attempts: i64,
    pub provider_calls_per_task: CallsPerTask,
    pub max_attempts_exceeded: i64,
    pub reservations_unsettled: i64,
    /// Requests the mock provider received (when `--mock-url` is given).
    pub provider_calls: Option<i64>,
    /// Generations the mock provider ran (when `--mock-url` is given).
    pub provider_generations: Option<i64>,
    /// Names of the broken invariants; empty when all hold.
    pub violations: Vec<String>,
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error("kafka: {0}")]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error("mock provider: {0}")]
    Mock(#[from] reqwest::Error),
    #[error("{0}")]
    Other(String),
}

impl Report {
    /// The headline figures as one `key=value` line.
    pub fn summary_line(&self) -> String {
        format!(
            "tasks={} completed={} failed={} dead_lettered={} duplicate_replies={} lost={} provider_calls={}",
            self.tasks,
            self.completed,
            self.failed,
            self.dead_lettered,
            self.duplicate_replies,
            self.lost,
            self.provider_calls
                .map_or_else(|| "unknown".to_string(), |n| n.to_string()),
        )
    }
}

/// One record of the source topic, as the checker sees it.
struct SourceRecord {
    partition: i32,
    offset: i64,
    task: Option<Uuid>,
}

fn consumer(bootstrap: &str, group: &str) -> Result<BaseConsumer, CheckError> {
    Ok(ClientConfig::new()
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        .create()?)
}

/// The offsets `group` has committed on `partitions` of `topic` (partitions without one are
/// left out). Blocking: call it off the runtime's threads.
pub fn committed_offsets(
    bootstrap: &str,
    group: &str,
    topic: &str,
    partitions: impl IntoIterator<Item = i32>,
) -> Result<HashMap<i32, i64>, CheckError> {
    let mut list = TopicPartitionList::new();
    for p in partitions {
        list.add_partition(topic, p);
    }
    if list.count() == 0 {
        return Ok(HashMap::new());
    }
    Ok(consumer(bootstrap, group)?
        .committed_offsets(list, Duration::from_secs(10))?
        .elements()
        .iter()
        .filter_map(|e| match e.offset() {
            Offset::Offset(o) => Some((e.partition(), o)),
            _ => None,
        })
        .collect())
}

/// Reads every record of `topic` from the beginning up to the high watermarks seen at start.
fn read_topic<T>(
    bootstrap: &str,
    topic: &str,
    mut each: impl FnMut(&rdkafka::message::BorrowedMessage<'_>) -> T,
) -> Result<Vec<T>, CheckError> {
    let reader = consumer(bootstrap, "replyd-check-reader")?;
    let metadata = reader.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    let Some(meta) = metadata.topics().iter().find(|t| t.name() == topic) else {
        return Ok(Vec::new());
    };
    let mut assignment = TopicPartitionList::new();
    let mut remaining: HashMap<i32, i64> = HashMap::new();
    for partition in meta.partitions() {
        let (low, high) =
            reader.fetch_watermarks(topic, partition.id(), Duration::from_secs(10))?;
        if high > low {
            remaining.insert(partition.id(), high);
            assignment.add_partition_offset(topic, partition.id(), Offset::Offset(low))?;
        }
    }
    let mut out = Vec::new();
    if remaining.is_empty() {
        return Ok(out);
    }
    reader.assign(&assignment)?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while !remaining.is_empty() {
        if Instant::now() > deadline {
            return Err(CheckError::Other(format!(
                "reading {topic} took over 120 s"
            )));
        }
        match reader.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => {
                let partition = message.partition();
                if let Some(&high) = remaining.get(&partition) {
                    if message.offset() < high {
                        out.push(each(&message));
                    }
                    if message.offset() + 1 >= high {
                        remaining.remove(&partition);
                    }
                }
            }
            Some(Err(e)) => return Err(e.into()),
            None => {}
        }
    }
    Ok(out)
}

fn percentile(sorted: &[i64], p: f64) -> i64 {
    if sorted.is_empty() {
        return 0;
    }
    let rank = ((p * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// Runs every check and returns the report.
pub async fn run(args: &CheckArgs) -> Result<Report, CheckError> {
    let dlq_topic = args
        .dead_letter_topic
        .clone()
        .unwrap_or_else(|| format!("{}.dlq", args.topic));

    // Kafka: blocking client calls, off the runtime's threads.
    let (bootstrap, topic, group) = (
        args.bootstrap.clone(),
        args.topic.clone(),
        args.group.clone(),
    );
    let kafka = tokio::task::spawn_blocking(move || -> Result<_, CheckError> {
        let rules = RecordRules::default();
        let source = read_topic(&bootstrap, &topic, |m| SourceRecord {
            partition: m.partition(),
            offset: m.offset(),
            // Any record that decodes into a task with a valid id is a task record; the
            // worker's own size limit may still refuse it, which the DLQ side accounts for.
            task: TaskSpec::from_record(
                m.payload(),
                m.timestamp()
                    .to_millis()
                    .and_then(chrono::DateTime::from_timestamp_millis),
                &rules,
            )
            .ok()
            .map(|t| t.task_id.as_uuid()),
        })?;
        let dead: HashSet<(i32, i64)> = read_topic(&bootstrap, &dlq_topic, |m| {
            let mut partition = None;
            let mut offset = None;
            if let Some(hs) = m.headers() {
                for h in hs.iter() {
                    let value = h.value.and_then(|v| std::str::from_utf8(v).ok());
                    match h.key {
                        headers::SOURCE_PARTITION => partition = value.and_then(|v| v.parse().ok()),
                        headers::SOURCE_OFFSET => offset = value.and_then(|v| v.parse().ok()),
                        _ => {}
                    }
                }
            }
            partition.zip(offset)
        })?
        .into_iter()
        .flatten()
        .collect();
        let partitions: HashSet<i32> = source.iter().map(|r| r.partition).collect();
        let committed = committed_offsets(&bootstrap, &group, &topic, partitions)?;
        Ok((source, dead, committed))
    })
    .await
    .map_err(|e| CheckError::Other(format!("kafka reader: {e}")))??;
    let (source, dead, committed) = kafka;

    let (client, connection) =
        tokio_postgres::connect(&args.database_url, tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let statuses: HashMap<Uuid, String> = client
        .query("SELECT task_id, status FROM reply_tasks", &[])
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    let count = |status: &str| statuses.values().filter(|s| *s == status).count() as i64;
    let duplicate_replies: i64 = client
        .query_one(
            "SELECT count(*) FROM (SELECT task_id FROM reply_attempts WHERE outcome = 'accepted' \
             GROUP BY task_id HAVING count(*) > 1) d",
            &[],
        )
        .await?
        .get(0);
    let fenced_rejections: i64 = client
        .query_one(
            "SELECT count(*) FROM reply_attempts WHERE outcome = 'fenced'",
            &[],
        )
        .await?
        .get(0);
    let mut attempts_per_task: Vec<i64> = client
        .query(
            "SELECT t.task_id, count(a.task_id) FROM reply_tasks t \
             LEFT JOIN reply_attempts a USING (task_id) GROUP BY t.task_id",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, i64>(1))
        .collect();
    attempts_per_task.sort_unstable();
    let max_attempts_exceeded: i64 = client
        .query_one(
            "SELECT count(*) FROM reply_tasks t WHERE attempt_count > max_attempts \
             OR (SELECT count(*) FROM reply_attempts a WHERE a.task_id = t.task_id) > max_attempts",
            &[],
        )
        .await?
        .get(0);

    let mut lost = 0;
    let mut bad_records = 0;
    for record in &source {
        let below_commit = committed
            .get(&record.partition)
            .is_some_and(|c| record.offset < *c);
        let dead_lettered = dead.contains(&(record.partition, record.offset));
        if record.task.is_none() {
            bad_records += 1;
        }
        if !below_commit || dead_lettered {
            continue;
        }
        let terminal = record
            .task
            .and_then(|id| statuses.get(&id))
            .is_some_and(|s| s == "completed" || s == "failed");
        if !terminal {
            lost += 1;
        }
    }

    let (provider_calls, provider_generations) = match &args.mock_url {
        Some(url) => {
            let stats: serde_json::Value =
                reqwest::get(format!("{}/stats", url.trim_end_matches('/')))
                    .await?
                    .json()
                    .await?;
            (stats["requests"].as_i64(), stats["generations"].as_i64())
        }
        None => (None, None),
    };

    let mut report = Report {
        tasks: statuses.len() as i64,
        completed: count("completed"),
        failed: count("failed"),
        pending: count("pending") + count("running"),
        dead_lettered: dead.len() as i64,
        records: source.len() as i64,
        bad_records,
        duplicate_replies,
        lost,
        fenced_rejections,
        attempts: attempts_per_task.iter().sum(),
        provider_calls_per_task: CallsPerTask {
            p50: percentile(&attempts_per_task, 0.50),
            p99: percentile(&attempts_per_task, 0.99),
            max: attempts_per_task.last().copied().unwrap_or(0),
        },
        max_attempts_exceeded,
        reservations_unsettled: 0,
        provider_calls,
        provider_generations,
        violations: Vec::new(),
    };
    if report.duplicate_replies > 0 {
        report
            .violations
            .push("I1 one reply: tasks with more than one accepted reply".into());
    }
    if report.lost > 0 {
        report.violations.push(
            "I3 nothing lost: records committed past without a terminal task or dead-letter copy"
                .into(),
        );
    }
    if report.max_attempts_exceeded > 0 {
        report
            .violations
            .push("I7 bounded effort: tasks with more attempts than max_attempts".into());
    }
    Ok(report)
}
