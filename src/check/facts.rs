//! The durable state read into plain values: PostgreSQL (tasks, attempts, the intake's tables,
//! the quota ledger), the topic and its dead-letter twin, the group's committed offsets, and
//! the mock provider's counters. Every figure is read back; the verdict judges them.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use uuid::Uuid;

use super::records::{QueueFacts, RecordFacts, RecordTallies};
use crate::config::Settings;
use crate::store::{connect_error, session_config, tls_connector};
use crate::transport::Transport;
use crate::transport::kafka::dead_letter::headers;
use crate::transport::sqs::{QueueDepth, Sqs};
use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{AttemptOutcome, TaskSpec, TaskStatus};

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
    #[error(transparent)]
    Sqs(#[from] crate::transport::sqs::SqsError),
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

fn consumer(base: &ClientConfig, group: &str) -> Result<BaseConsumer, CheckError> {
    Ok(base
        .clone()
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.partition.eof", "false")
        // librdkafka fetches ahead into a queue of up to 64 MiB by default; the checker reads
        // as fast as it judges, so a small queue keeps its memory flat at no cost in time.
        .set("queued.max.messages.kbytes", "4096")
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

/// Records read per batch: what the checker holds of a topic at once (a batch being judged,
/// one in the channel, one being read), whatever the topic's length.
const BATCH: usize = 5_000;

/// A read that gets no record for this long while records remain is given up.
const STALL: Duration = Duration::from_secs(60);

/// The partitions of `topic` (none when it does not exist).
fn partitions_of(reader: &BaseConsumer, topic: &str) -> Result<Vec<i32>, CheckError> {
    let metadata = reader.fetch_metadata(Some(topic), Duration::from_secs(10))?;
    Ok(metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic)
        .map(|t| t.partitions().iter().map(|p| p.id()).collect())
        .unwrap_or_default())
}

/// Reads every record of `topic` from the beginning up to the high watermarks seen at start,
/// and sends what `each` makes of them in batches of [`BATCH`]. Blocking: run it off the
/// runtime's threads. The channel is bounded, so a slow receiver slows the read, and a
/// receiver that is gone ends it.
fn stream_topic<T: Send + 'static>(
    base: &ClientConfig,
    topic: &str,
    mut each: impl FnMut(&rdkafka::message::BorrowedMessage<'_>) -> T,
    out: &tokio::sync::mpsc::Sender<Vec<T>>,
) -> Result<(), CheckError> {
    let reader = consumer(base, "replyd-check-reader")?;
    let mut assignment = TopicPartitionList::new();
    let mut remaining: HashMap<i32, i64> = HashMap::new();
    for partition in partitions_of(&reader, topic)? {
        let (low, high) = reader.fetch_watermarks(topic, partition, Duration::from_secs(10))?;
        if high > low {
            remaining.insert(partition, high);
            assignment.add_partition_offset(topic, partition, Offset::Offset(low))?;
        }
    }
    if remaining.is_empty() {
        return Ok(());
    }
    reader.assign(&assignment)?;
    let mut batch = Vec::with_capacity(BATCH);
    let mut progressed = Instant::now();
    while !remaining.is_empty() {
        if progressed.elapsed() > STALL {
            return Err(CheckError::Other(format!(
                "reading {topic}: no record for {} s while {} partition(s) were not read to their end",
                STALL.as_secs(),
                remaining.len()
            )));
        }
        match reader.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => {
                progressed = Instant::now();
                let partition = message.partition();
                if let Some(&high) = remaining.get(&partition) {
                    if message.offset() < high {
                        batch.push(each(&message));
                    }
                    if message.offset() + 1 >= high {
                        remaining.remove(&partition);
                    }
                }
                if batch.len() >= BATCH
                    && out
                        .blocking_send(std::mem::replace(&mut batch, Vec::with_capacity(BATCH)))
                        .is_err()
                {
                    return Ok(());
                }
            }
            Some(Err(e)) => return Err(e.into()),
            None => {}
        }
    }
    if !batch.is_empty() {
        let _ = out.blocking_send(batch);
    }
    Ok(())
}

/// A topic read on a blocking thread: its batches, and the read's own result once they end.
struct BatchRead<T> {
    batches: tokio::sync::mpsc::Receiver<Vec<T>>,
    reader: tokio::task::JoinHandle<Result<(), CheckError>>,
}

impl<T: Send + 'static> BatchRead<T> {
    /// Starts [`stream_topic`] on a blocking thread.
    fn start(
        base: ClientConfig,
        topic: String,
        each: impl FnMut(&rdkafka::message::BorrowedMessage<'_>) -> T + Send + 'static,
    ) -> Self {
        let (tx, batches) = tokio::sync::mpsc::channel(1);
        let reader = tokio::task::spawn_blocking(move || stream_topic(&base, &topic, each, &tx));
        Self { batches, reader }
    }

    /// The next batch; `None` once the read ended (then [`BatchRead::finish`] says how).
    async fn next(&mut self) -> Option<Vec<T>> {
        self.batches.recv().await
    }

    /// How the read ended. Called early (a batch could not be judged), it stops the read.
    async fn finish(self) -> Result<(), CheckError> {
        drop(self.batches);
        self.reader
            .await
            .map_err(|e| CheckError::Other(format!("kafka reader: {e}")))?
    }
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
    /// Where the workers take their records from: a topic, or an SQS queue.
    pub source: Transport,
    /// The source topic's records, judged one by one and counted (on SQS: the queue's and its
    /// dead-letter queue's messages, [`QueueFacts::tallies`]).
    pub records: RecordTallies,
    /// Source records with a dead-letter copy.
    pub dead_lettered: i64,
    pub statuses: StatusCounts,
    pub duplicate_replies: i64,
    pub fenced_rejections: i64,
    pub refused_calls: i64,
    /// Attempts per task (refusals aside): their sum and quantiles.
    pub attempts: AttemptStats,
    pub max_attempts_exceeded: i64,
    pub duplicate_tasks: i64,
    pub tasks_without_one_outbox_row: i64,
    pub outbox_unpublished: i64,
    pub quota: QuotaFacts,
    pub replies_by_worker: BTreeMap<String, i64>,
    pub mock: Option<MockCounts>,
}

/// Tasks by status.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StatusCounts {
    pub tasks: i64,
    pub completed: i64,
    pub failed: i64,
    /// Stopped by their users.
    pub cancelled: i64,
    /// Pending or running.
    pub open: i64,
}

/// The attempts of every task (refusals aside), by the nearest-rank method.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AttemptStats {
    pub total: i64,
    pub p50: i64,
    pub p99: i64,
    pub max: i64,
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
    /// Reservations of cancelled tasks not settled by the Stop's rule: charged when a call
    /// may have run, released only when none can have started.
    pub cancelled_misettled: i64,
    pub charges_without_reply: i64,
    pub counter_mismatches: i64,
    pub token_charge_mismatches: i64,
}

/// Reads the topic, its dead-letter twin, the committed offsets, the task tables and the
/// mock's counters.
pub async fn read_facts(
    settings: &Settings,
    mock_url: Option<&str>,
    sqs: Option<Sqs>,
) -> Result<Facts, CheckError> {
    let config = session_config(&settings.database)?;
    let (client, connection) = config
        .connect(tls_connector(&settings.database)?)
        .await
        .map_err(|e| connect_error(&settings.database, &e))?;
    tokio::spawn(connection);
    let bootstrap = settings.kafka.bootstrap_servers.clone();
    let named = move |e: CheckError| match e {
        CheckError::Kafka { error, .. } => CheckError::Kafka {
            bootstrap: bootstrap.clone(),
            error,
        },
        other => other,
    };
    let (records, dead_lettered) = match settings.worker.source {
        Transport::Kafka => read_records(settings, &client).await.map_err(named)?,
        Transport::Sqs => {
            let sqs = match sqs {
                Some(sqs) => sqs,
                None => Sqs::connect(&settings.sqs).await?,
            };
            let queue = read_queue(settings, &sqs, &client).await?;
            (queue.tallies(), queue.dead_letters)
        }
    };
    let statuses = client
        .query_one(
            "SELECT count(*), \
               count(*) FILTER (WHERE status = $1), \
               count(*) FILTER (WHERE status = $2), \
               count(*) FILTER (WHERE status IN ($3, $4)), \
               count(*) FILTER (WHERE status = $5) \
             FROM reply_tasks",
            &[
                &TaskStatus::Completed.as_str(),
                &TaskStatus::Failed.as_str(),
                &TaskStatus::Pending.as_str(),
                &TaskStatus::Running.as_str(),
                &TaskStatus::Cancelled.as_str(),
            ],
        )
        .await?;
    let statuses = StatusCounts {
        tasks: statuses.get(0),
        completed: statuses.get(1),
        failed: statuses.get(2),
        open: statuses.get(3),
        cancelled: statuses.get(4),
    };
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
    // tasks), one outbox row per API-created task and per retry of a failed task, and every
    // row published after a drain.
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
            "SELECT count(*) FROM (SELECT task_id, created_at FROM idempotency_keys \
                                   UNION ALL SELECT task_id, created_at FROM reply_tasks \
                                   WHERE retry_of IS NOT NULL) k, \
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
                                    AND (r.charge_on_failure OR t.provider_may_have_run)) \
                                OR (t.status = 'cancelled' AND t.provider_may_have_run))), \
               (SELECT count(*) FROM quota_counters q WHERE (q.reserved, q.tokens_reserved) <> \
                  (SELECT count(*), coalesce(sum(o.token_ceiling), 0) FROM quota_reservations o \
                    WHERE o.workspace_id = q.workspace_id AND o.state = 'reserved')), \
               count(*) FILTER (WHERE r.state <> 'reserved' AND NOT (t.status = 'cancelled' \
                                AND r.state = 'charged' AND r.tokens_charged <= greatest(r.token_ceiling, \
                                    (SELECT coalesce(sum(a.prompt_tokens + a.completion_tokens), 0) \
                                       FROM reply_attempts a WHERE a.task_id = t.task_id))) \
                 AND r.tokens_charged IS DISTINCT FROM \
                 CASE WHEN r.state <> 'charged' THEN 0 \
                      ELSE coalesce((SELECT a.prompt_tokens + a.completion_tokens \
                                       FROM reply_attempts a \
                                      WHERE a.task_id = t.task_id \
                                        AND a.assignment_version = t.assignment_version \
                                        AND t.status = 'completed'), r.token_ceiling) END), \
               count(*) FILTER (WHERE t.status = 'cancelled' AND r.state <> \
                                CASE WHEN t.provider_may_have_run THEN 'charged' ELSE 'released' END) \
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
        cancelled_misettled: row.get(10),
    };
    // Nearest rank: percentile_disc(p) is the value at rank ceil(p × n).
    let attempts = client
        .query_one(
            "SELECT coalesce(sum(n), 0)::bigint, \
               coalesce(percentile_disc(0.5) WITHIN GROUP (ORDER BY n), 0), \
               coalesce(percentile_disc(0.99) WITHIN GROUP (ORDER BY n), 0), \
               coalesce(max(n), 0) \
             FROM (SELECT count(a.task_id) FILTER (WHERE a.outcome IS DISTINCT FROM 'refused') AS n \
                   FROM reply_tasks t LEFT JOIN reply_attempts a USING (task_id) \
                   GROUP BY t.task_id) per_task",
            &[],
        )
        .await?;
    let attempts = AttemptStats {
        total: attempts.get(0),
        p50: attempts.get(1),
        p99: attempts.get(2),
        max: attempts.get(3),
    };
    let replies_by_worker = client
        .query(
            // By worker id: a lease owner is the id and its run's incarnation (`w1#3f0c…`).
            "SELECT split_part(worker, '#', 1), count(*) FROM reply_attempts \
             WHERE outcome = $1 GROUP BY 1",
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
        source: settings.worker.source,
        records,
        dead_lettered,
        statuses,
        duplicate_replies,
        fenced_rejections,
        refused_calls,
        attempts,
        max_attempts_exceeded,
        duplicate_tasks,
        tasks_without_one_outbox_row,
        outbox_unpublished,
        quota,
        replies_by_worker,
        mock,
    })
}

/// Reads the dead-letter topic into a session table, then the source topic batch by batch,
/// judging each record against the committed offsets, that table and the task it carries.
/// Memory holds a few batches, whatever the topics' lengths.
/// An SQS source's state: its queue's and dead-letter queue's depth, and the open tasks
/// handed to it (a producer's, which have no outbox row, and the API's whose row the relay
/// published).
async fn read_queue(
    settings: &Settings,
    sqs: &Sqs,
    client: &tokio_postgres::Client,
) -> Result<QueueFacts, CheckError> {
    let attributes = sqs.attributes(&settings.sqs.queue_url).await?;
    let in_queue = QueueDepth::of(&attributes).total();
    let dead_letter_url = sqs.dead_letter_queue(&settings.sqs, &attributes).await?;
    let dead_letters = sqs.depth(&dead_letter_url).await?.total();
    let open_handed: i64 = client
        .query_one(
            "SELECT count(*) FROM reply_tasks t \
             WHERE t.status IN ($1, $2) \
               AND NOT EXISTS (SELECT 1 FROM outbox o \
                               WHERE o.task_id = t.task_id AND o.published_at IS NULL)",
            &[&TaskStatus::Pending.as_str(), &TaskStatus::Running.as_str()],
        )
        .await?
        .get(0);
    Ok(QueueFacts {
        in_queue: in_queue as i64,
        dead_letters: dead_letters as i64,
        open_handed,
    })
}

async fn read_records(
    settings: &Settings,
    client: &tokio_postgres::Client,
) -> Result<(RecordTallies, i64), CheckError> {
    let kafka = &settings.kafka;
    let base = kafka.client_config();
    // The committed offsets of every partition of the topic (a handful of numbers).
    let committed = {
        let (base, group, topic) = (base.clone(), kafka.group_id.clone(), kafka.topic.clone());
        tokio::task::spawn_blocking(move || {
            let reader = consumer(&base, "replyd-check-reader")?;
            let partitions = partitions_of(&reader, &topic)?;
            committed_offsets_with(&base, &group, &topic, partitions)
        })
        .await
        .map_err(|e| CheckError::Other(format!("kafka reader: {e}")))??
    };
    // Each dead-letter copy names its source record in its headers.
    client
        .batch_execute(
            "CREATE TEMPORARY TABLE IF NOT EXISTS check_dead \
               (partition int, \"offset\" bigint, PRIMARY KEY (partition, \"offset\")); \
             TRUNCATE check_dead",
        )
        .await?;
    let mut dead = BatchRead::start(base.clone(), kafka.dead_letter_topic(), |m| {
        let mut partition: Option<i32> = None;
        let mut offset: Option<i64> = None;
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
    });
    while let Some(batch) = dead.next().await {
        let (partitions, offsets): (Vec<i32>, Vec<i64>) = batch.into_iter().flatten().unzip();
        let inserted = client
            .execute(
                "INSERT INTO check_dead SELECT * FROM unnest($1::int[], $2::bigint[]) \
                 ON CONFLICT DO NOTHING",
                &[&partitions, &offsets],
            )
            .await;
        if let Err(e) = inserted {
            dead.finish().await?;
            return Err(e.into());
        }
    }
    dead.finish().await?;
    let dead_lettered: i64 = client
        .query_one("SELECT count(*) FROM check_dead", &[])
        .await?
        .get(0);

    let rules = settings.worker.record_rules();
    let mut tallies = RecordTallies::default();
    let mut source = BatchRead::start(base, kafka.topic.clone(), move |m| {
        (
            m.partition(),
            m.offset(),
            // The worker's own rules, the record's own timestamp: a record is a task here
            // exactly when the worker would have made one of it.
            TaskSpec::from_record(
                m.payload(),
                m.timestamp()
                    .to_millis()
                    .and_then(chrono::DateTime::from_timestamp_millis),
                &rules,
            )
            .ok()
            .map(|t| t.task_id.as_uuid()),
        )
    });
    while let Some(batch) = source.next().await {
        match judge(client, &batch).await {
            Ok(judged) => {
                for ((partition, offset, task), (terminal, dead_lettered)) in
                    batch.iter().zip(judged)
                {
                    tallies.add(RecordFacts {
                        has_task: task.is_some(),
                        below_commit: committed.get(partition).is_some_and(|c| offset < c),
                        dead_lettered,
                        terminal,
                    });
                }
            }
            Err(e) => {
                source.finish().await?;
                return Err(e);
            }
        }
    }
    source.finish().await?;
    Ok((tallies, dead_lettered))
}

/// For each record of `batch` (partition, offset, task), in order: whether its task is
/// terminal (completed, failed or cancelled; or forgotten: deleted by retention or an erasure, done for good), and whether a
/// dead-letter copy of it exists.
async fn judge(
    client: &tokio_postgres::Client,
    batch: &[(i32, i64, Option<Uuid>)],
) -> Result<Vec<(bool, bool)>, CheckError> {
    let partitions: Vec<i32> = batch.iter().map(|r| r.0).collect();
    let offsets: Vec<i64> = batch.iter().map(|r| r.1).collect();
    let tasks: Vec<Option<Uuid>> = batch.iter().map(|r| r.2).collect();
    let rows = client
        .query(
            "SELECT coalesce(t.status IN ($4, $5, $6), false) \
                 OR EXISTS (SELECT 1 FROM forgotten_tasks f WHERE f.task_id = s.task), \
               EXISTS (SELECT 1 FROM check_dead d WHERE d.partition = s.p AND d.\"offset\" = s.o) \
             FROM unnest($1::int[], $2::bigint[], $3::uuid[]) WITH ORDINALITY AS s(p, o, task, i) \
             LEFT JOIN reply_tasks t ON t.task_id = s.task \
             ORDER BY s.i",
            &[
                &partitions,
                &offsets,
                &tasks,
                &TaskStatus::Completed.as_str(),
                &TaskStatus::Failed.as_str(),
                &TaskStatus::Cancelled.as_str(),
            ],
        )
        .await?;
    if rows.len() != batch.len() {
        return Err(CheckError::Other(format!(
            "{} records judged, {} asked",
            rows.len(),
            batch.len()
        )));
    }
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}
