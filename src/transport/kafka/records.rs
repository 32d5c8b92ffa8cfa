//! What `replyd check` reads of a Kafka source: the group's committed offsets, the
//! dead-letter topic's copies, and every record of the topic from its start up to the high
//! watermarks seen then, each judged by I3's rule (`replyd_core::tally`) against the task it
//! carries. The topics are read on a blocking thread, in batches, so the checker's memory stays
//! flat whatever their length.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{ClientConfig, Offset, TopicPartitionList};
use replyd_core::closed_set::ClosedSet;
use replyd_core::domain::{RecordRules, TaskSpec, TaskStatus};
use replyd_core::tally::{RecordFacts, RecordTallies};
use uuid::Uuid;

use super::dead_letter::headers;
use super::settings::KafkaSettings;
use crate::transport::records::{ReadError, SourceRecords};

fn consumer(base: &ClientConfig, group: &str) -> Result<BaseConsumer, ReadError> {
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

/// The offsets `group` has committed on `partitions` of `topic`, asked through `base` (the
/// brokers and how to reach them); partitions without one are left out. Blocking: call it off
/// the runtime's threads.
pub fn committed_offsets(
    base: &ClientConfig,
    group: &str,
    topic: &str,
    partitions: impl IntoIterator<Item = i32>,
) -> Result<HashMap<i32, i64>, ReadError> {
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
fn partitions_of(reader: &BaseConsumer, topic: &str) -> Result<Vec<i32>, ReadError> {
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
) -> Result<(), ReadError> {
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
            return Err(ReadError::Other(format!(
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
    reader: tokio::task::JoinHandle<Result<(), ReadError>>,
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
    async fn finish(self) -> Result<(), ReadError> {
        drop(self.batches);
        self.reader
            .await
            .map_err(|e| ReadError::Other(format!("kafka reader: {e}")))?
    }
}

/// Reads the dead-letter topic into a session table, then the source topic batch by batch,
/// judging each record against the committed offsets, that table and the task it carries,
/// made of the record by `rules` (the worker's). Memory holds a few batches, whatever the
/// topics' lengths.
pub(crate) async fn read(
    kafka: &KafkaSettings,
    rules: RecordRules,
    client: &tokio_postgres::Client,
) -> Result<SourceRecords, ReadError> {
    let base = kafka.client_config();
    // The committed offsets of every partition of the topic (a handful of numbers).
    let committed = {
        let (base, group, topic) = (base.clone(), kafka.group_id.clone(), kafka.topic.clone());
        tokio::task::spawn_blocking(move || {
            let reader = consumer(&base, "replyd-check-reader")?;
            let partitions = partitions_of(&reader, &topic)?;
            committed_offsets(&base, &group, &topic, partitions)
        })
        .await
        .map_err(|e| ReadError::Other(format!("kafka reader: {e}")))??
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
    Ok(SourceRecords {
        tallies,
        dead_lettered,
    })
}

/// For each record of `batch` (partition, offset, task), in order: whether its task is
/// terminal (completed, failed or cancelled; or forgotten: deleted by retention or an erasure, done for good), and whether a
/// dead-letter copy of it exists.
async fn judge(
    client: &tokio_postgres::Client,
    batch: &[(i32, i64, Option<Uuid>)],
) -> Result<Vec<(bool, bool)>, ReadError> {
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
        return Err(ReadError::Other(format!(
            "{} records judged, {} asked",
            rows.len(),
            batch.len()
        )));
    }
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}
