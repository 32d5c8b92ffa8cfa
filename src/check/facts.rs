//! The durable state read into plain values: PostgreSQL (tasks, attempts, the intake's tables,
//! the quota ledger), the topic and its dead-letter twin, the group's committed offsets, and
//! the mock provider's counters. Every figure is read back; the verdict judges them.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use uuid::Uuid;

use crate::config::Settings;
use crate::kafka::dead_letter::headers;
use crate::store::{connect_error, session_config, tls_connector};
use replyd_core::domain::{AttemptOutcome, RecordRules, TaskSpec, TaskStatus};

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Store(#[from] crate::store::StoreError),
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error("kafka at {bootstrap} (kafka.bootstrap_servers): {error}")]
    Kafka {
        bootstrap: String,
        error: rdkafka::error::KafkaError,
    },
    #[error("mock provider: {0}")]
    Mock(#[from] reqwest::Error),
    #[error("{0}")]
    Other(String),
}

impl From<rdkafka::error::KafkaError> for CheckError {
    fn from(error: rdkafka::error::KafkaError) -> Self {
        CheckError::Kafka {
            bootstrap: String::new(),
            error,
        }
    }
}

/// One record of the source topic, as the checker sees it.
#[derive(Debug, Clone)]
pub struct SourceRecord {
    pub partition: i32,
    pub offset: i64,
    /// The task it carries, when the worker's rules make one of it.
    pub task: Option<Uuid>,
}

fn consumer(base: &ClientConfig, group: &str) -> Result<BaseConsumer, CheckError> {
    Ok(base
        .clone()
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
    let mut base = ClientConfig::new();
    base.set("bootstrap.servers", bootstrap);
    committed_offsets_with(&base, group, topic, partitions)
}

/// [`committed_offsets`] through `base` (the brokers and how to reach them).
pub fn committed_offsets_with(
    base: &ClientConfig,
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
    Ok(consumer(base, group)?
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
    base: &ClientConfig,
    topic: &str,
    mut each: impl FnMut(&rdkafka::message::BorrowedMessage<'_>) -> T,
) -> Result<Vec<T>, CheckError> {
    let reader = consumer(base, "replyd-check-reader")?;
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

/// Counters of the mock provider.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MockCounts {
    pub requests: i64,
    pub generations: i64,
}

/// Everything the checker reads, as plain values.
#[derive(Debug, Clone, Default)]
pub struct Facts {
    pub source: Vec<SourceRecord>,
    /// (partition, offset) of each dead-letter copy's source record.
    pub dead: HashSet<(i32, i64)>,
    pub committed: HashMap<i32, i64>,
    pub statuses: HashMap<Uuid, TaskStatus>,
    pub duplicate_replies: i64,
    pub fenced_rejections: i64,
    pub refused_calls: i64,
    /// Attempts of each task.
    pub attempts_per_task: Vec<i64>,
    pub max_attempts_exceeded: i64,
    pub duplicate_tasks: i64,
    pub tasks_without_one_outbox_row: i64,
    pub outbox_unpublished: i64,
    pub quota: QuotaFacts,
    pub replies_by_worker: BTreeMap<String, i64>,
    pub mock: Option<MockCounts>,
}

/// The quota's ledger as read (I8).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuotaFacts {
    pub open: i64,
    pub charged: i64,
    pub released: i64,
    pub expired: i64,
    pub unsettled: i64,
    /// Open reservations of failed tasks whose provider may have done the work.
    pub unresolved: i64,
    pub completed_without_charge: i64,
    pub charges_without_reply: i64,
    pub counter_mismatches: i64,
    pub token_charge_mismatches: i64,
}

/// Reads the topic, its dead-letter twin, the committed offsets, the task tables and the
/// mock's counters.
pub async fn read_facts(settings: &Settings, mock_url: Option<&str>) -> Result<Facts, CheckError> {
    let kafka = settings.kafka.clone();
    let rules = settings.worker.record_rules();
    // Kafka: blocking client calls, off the runtime's threads.
    let (source, dead, committed) = tokio::task::spawn_blocking(move || {
        read_kafka(&kafka, &rules).map_err(|e| match e {
            CheckError::Kafka { error, .. } => CheckError::Kafka {
                bootstrap: kafka.bootstrap_servers.clone(),
                error,
            },
            other => other,
        })
    })
    .await
    .map_err(|e| CheckError::Other(format!("kafka reader: {e}")))??;

    let config = session_config(&settings.database)?;
    let (client, connection) = config
        .connect(tls_connector(&settings.database)?)
        .await
        .map_err(|e| connect_error(&settings.database, &e))?;
    tokio::spawn(connection);
    let mut statuses = HashMap::new();
    for row in client
        .query("SELECT task_id, status FROM reply_tasks", &[])
        .await?
    {
        let status: &str = row.get(1);
        let status = TaskStatus::parse(status)
            .ok_or_else(|| CheckError::Other(format!("unknown task status {status:?}")))?;
        statuses.insert(row.get(0), status);
    }
    // Outcomes are bound as parameters from the one enum that writes them.
    let count = |sql: &'static str, outcome: Option<AttemptOutcome>| {
        let client = &client;
        async move {
            match outcome {
                Some(o) => client.query_one(sql, &[&o.as_str()]).await,
                None => client.query_one(sql, &[]).await,
            }
            .map(|r| r.get::<_, i64>(0))
        }
    };
    let duplicate_replies = count(
        "SELECT count(*) FROM (SELECT task_id FROM reply_attempts WHERE outcome = $1 \
         GROUP BY task_id HAVING count(*) > 1) d",
        Some(AttemptOutcome::Accepted),
    )
    .await?;
    let fenced_rejections = count(
        "SELECT count(*) FROM reply_attempts WHERE outcome = $1",
        Some(AttemptOutcome::Fenced),
    )
    .await?;
    let refused_calls = count(
        "SELECT count(*) FROM reply_attempts WHERE outcome = $1",
        Some(AttemptOutcome::Refused),
    )
    .await?;
    let max_attempts_exceeded = count(
        "SELECT count(*) FROM reply_tasks t WHERE attempt_count > max_attempts \
         OR (SELECT count(*) FROM reply_attempts a WHERE a.task_id = t.task_id \
             AND a.outcome IS DISTINCT FROM 'refused') > max_attempts",
        None,
    )
    .await?;
    // I6, from the intake's own tables: one task per submission (a message's create_reply
    // tasks), one outbox row per API-created task, and every row published after a drain.
    let duplicate_tasks = count(
        "SELECT count(*) FROM (SELECT t.message_id FROM reply_tasks t \
         JOIN idempotency_keys k ON k.task_id = t.task_id AND k.operation = 'create_reply' \
         GROUP BY t.workspace_id, t.message_id HAVING count(*) > 1) d",
        None,
    )
    .await?;
    // The relay deletes a published row `relay.retention_ms` after it was published, so a
    // missing row is a violation only for a task younger than that; a second row always is.
    let retention = settings.relay.retention().as_secs_f64();
    let tasks_without_one_outbox_row: i64 = client
        .query_one(
            "SELECT count(*) FROM idempotency_keys k, \
             LATERAL (SELECT count(*) AS n FROM outbox o WHERE o.task_id = k.task_id) o \
             WHERE o.n > 1 OR (o.n = 0 AND k.created_at > clock_timestamp() - make_interval(secs => $1))",
            &[&retention],
        )
        .await?
        .get(0);
    let outbox_unpublished = count(
        "SELECT count(*) FROM outbox WHERE published_at IS NULL AND refused_at IS NULL",
        None,
    )
    .await?;
    // I8, from the reservations, the tasks they reserve for, and the counters.
    let row = client
        .query_one(
            "SELECT \
               count(*) FILTER (WHERE r.state = 'reserved'), \
               count(*) FILTER (WHERE r.state = 'charged'), \
               count(*) FILTER (WHERE r.state = 'released'), \
               count(*) FILTER (WHERE r.state = 'expired'), \
               count(*) FILTER (WHERE r.state = 'reserved' AND r.expires_at < clock_timestamp()), \
               count(*) FILTER (WHERE r.state = 'reserved' AND t.status = 'failed'), \
               count(*) FILTER (WHERE t.status = 'completed' AND r.state <> 'charged'), \
               count(*) FILTER (WHERE r.state = 'charged' AND NOT (t.status = 'completed' \
                                OR (t.status = 'failed' \
                                    AND (r.charge_on_failure OR t.provider_may_have_run)))), \
               (SELECT count(*) FROM quota_counters q WHERE (q.reserved, q.tokens_reserved) <> \
                  (SELECT count(*), coalesce(sum(o.token_ceiling), 0) FROM quota_reservations o \
                    WHERE o.workspace_id = q.workspace_id AND o.state = 'reserved')), \
               count(*) FILTER (WHERE r.state <> 'reserved' AND r.tokens_charged IS DISTINCT FROM \
                 CASE WHEN r.state <> 'charged' THEN 0 \
                      ELSE coalesce((SELECT a.prompt_tokens + a.completion_tokens \
                                       FROM reply_attempts a \
                                      WHERE a.task_id = t.task_id \
                                        AND a.assignment_version = t.assignment_version \
                                        AND t.status = 'completed'), r.token_ceiling) END) \
             FROM quota_reservations r JOIN reply_tasks t USING (task_id)",
            &[],
        )
        .await?;
    let quota = QuotaFacts {
        open: row.get(0),
        charged: row.get(1),
        released: row.get(2),
        expired: row.get(3),
        unsettled: row.get(4),
        unresolved: row.get(5),
        completed_without_charge: row.get(6),
        charges_without_reply: row.get(7),
        counter_mismatches: row.get(8),
        token_charge_mismatches: row.get(9),
    };
    let attempts_per_task = client
        .query(
            "SELECT count(a.task_id) FILTER (WHERE a.outcome IS DISTINCT FROM 'refused') \
             FROM reply_tasks t LEFT JOIN reply_attempts a USING (task_id) GROUP BY t.task_id",
            &[],
        )
        .await?
        .iter()
        .map(|r| r.get::<_, i64>(0))
        .collect();
    let replies_by_worker = client
        .query(
            "SELECT worker, count(*) FROM reply_attempts WHERE outcome = $1 GROUP BY worker",
            &[&AttemptOutcome::Accepted.as_str()],
        )
        .await?
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();

    let mock = match mock_url {
        Some(url) => {
            let stats: serde_json::Value =
                reqwest::get(format!("{}/stats", url.trim_end_matches('/')))
                    .await?
                    .json()
                    .await?;
            Some(MockCounts {
                requests: stats["requests"].as_i64().unwrap_or_default(),
                generations: stats["generations"].as_i64().unwrap_or_default(),
            })
        }
        None => None,
    };
    Ok(Facts {
        source,
        dead,
        committed,
        statuses,
        duplicate_replies,
        fenced_rejections,
        refused_calls,
        attempts_per_task,
        max_attempts_exceeded,
        duplicate_tasks,
        tasks_without_one_outbox_row,
        outbox_unpublished,
        quota,
        replies_by_worker,
        mock,
    })
}

type KafkaFacts = (Vec<SourceRecord>, HashSet<(i32, i64)>, HashMap<i32, i64>);

fn read_kafka(
    kafka: &crate::kafka::settings::KafkaSettings,
    rules: &RecordRules,
) -> Result<KafkaFacts, CheckError> {
    let base = kafka.client_config();
    let source = read_topic(&base, &kafka.topic, |m| SourceRecord {
        partition: m.partition(),
        offset: m.offset(),
        // The worker's own rules, the record's own timestamp: a record is a task here
        // exactly when the worker would have made one of it.
        task: TaskSpec::from_record(
            m.payload(),
            m.timestamp()
                .to_millis()
                .and_then(chrono::DateTime::from_timestamp_millis),
            rules,
        )
        .ok()
        .map(|t| t.task_id.as_uuid()),
    })?;
    let dead = read_topic(&base, &kafka.dead_letter_topic(), |m| {
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
    let committed = committed_offsets_with(&base, &kafka.group_id, &kafka.topic, partitions)?;
    Ok((source, dead, committed))
}
