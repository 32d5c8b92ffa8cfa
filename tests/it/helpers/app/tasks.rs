//! Tasks through a test's application: published to the topic (whole or raw), waited for until
//! terminal, the group's committed and end offsets, and the checker's report over it all.

use std::collections::HashMap;
use std::time::Duration;

use prost::Message as _;
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use replyd_core::domain::{TaskId, TaskSpec};
use replyd_lab::produce::{producer, publish};

use super::TestApp;
use crate::helpers::wait_until;

impl TestApp {
    /// Publishes each task once to each of `partitions` (keys differ, so each copy is a record
    /// of its own partition, processed by whichever worker holds it).
    pub async fn produce_to_partitions(&self, tasks: &[TaskSpec], partitions: &[i32]) {
        let producer = producer(&self.bootstrap).expect("producer");
        for task in tasks {
            let value = task.to_proto().encode_to_vec();
            for &partition in partitions {
                let key = format!("{}-{partition}", task.conversation_id);
                producer
                    .send(
                        rdkafka::producer::FutureRecord::to(&self.topic)
                            .key(&key)
                            .payload(&value)
                            .partition(partition),
                        Duration::from_secs(30),
                    )
                    .await
                    .map_err(|(e, _)| e)
                    .expect("published");
            }
        }
    }

    /// Publishes tasks (key = conversation id) and returns once the broker acknowledged all.
    pub async fn produce_tasks(&self, tasks: &[TaskSpec], copies: usize) {
        let records: Vec<(String, Vec<u8>)> = (0..copies)
            .flat_map(|_| tasks.iter())
            .map(|t| (t.conversation_id.clone(), t.to_proto().encode_to_vec()))
            .collect();
        self.produce_raw(&records).await;
    }

    pub async fn produce_raw(&self, records: &[(String, Vec<u8>)]) {
        let producer = producer(&self.bootstrap).expect("producer");
        publish(&producer, &self.topic, records)
            .await
            .expect("published");
    }

    /// Waits until every task in `ids` is completed or failed. On a timeout it says which
    /// tasks are still open and shows the end of every worker's log: a stall seen once in a
    /// loaded run must be explainable from the failure alone.
    pub async fn wait_until_terminal(&self, ids: &[TaskId], limit: Duration) {
        let client = self.db.raw_client().await;
        let uuids: Vec<uuid::Uuid> = ids.iter().map(|t| t.as_uuid()).collect();
        let deadline = tokio::time::Instant::now() + limit;
        loop {
            let open: Vec<(uuid::Uuid, String)> = client
                .query(
                    "SELECT t.id, coalesce(r.status, 'not saved') FROM unnest($1::uuid[]) AS t(id) \
                     LEFT JOIN reply_tasks r ON r.task_id = t.id \
                     WHERE r.status IS NULL OR r.status NOT IN ('completed', 'failed', 'cancelled') \
                     ORDER BY t.id",
                    &[&uuids],
                )
                .await
                .unwrap()
                .iter()
                .map(|row| (row.get(0), row.get(1)))
                .collect();
            if open.is_empty() {
                return;
            }
            if tokio::time::Instant::now() >= deadline {
                let shown: Vec<String> = open
                    .iter()
                    .take(10)
                    .map(|(id, status)| format!("{id} ({status})"))
                    .collect();
                panic!(
                    "timed out after {limit:?} waiting until {} tasks are terminal: {} are not, \
                     among them {}\n{}",
                    ids.len(),
                    open.len(),
                    shown.join(", "),
                    self.log_tails(40)
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The group's committed offsets, per partition.
    pub async fn committed_offsets(&self) -> HashMap<i32, i64> {
        let (bootstrap, group, topic, partitions) = (
            self.bootstrap.clone(),
            self.group.clone(),
            self.topic.clone(),
            self.partitions,
        );
        tokio::task::spawn_blocking(move || {
            let mut base = rdkafka::ClientConfig::new();
            base.set("bootstrap.servers", &bootstrap);
            replyd::transport::kafka::records::committed_offsets(
                &base,
                &group,
                &topic,
                0..partitions,
            )
            .expect("the group's committed offsets")
        })
        .await
        .unwrap()
    }

    /// Waits until the committed offset of every partition reaches its end.
    pub async fn wait_until_committed_to_end(&self, limit: Duration) {
        let ends = self.end_offsets().await;
        wait_until(
            "offsets committed to the end of every partition",
            limit,
            || async {
                let committed = self.committed_offsets().await;
                ends.iter()
                    .all(|(p, end)| *end == 0 || committed.get(p) == Some(end))
            },
        )
        .await;
    }

    pub async fn end_offsets(&self) -> HashMap<i32, i64> {
        let (bootstrap, topic, partitions) =
            (self.bootstrap.clone(), self.topic.clone(), self.partitions);
        tokio::task::spawn_blocking(move || {
            let reader: BaseConsumer = ClientConfig::new()
                .set("bootstrap.servers", &bootstrap)
                .create()
                .unwrap();
            (0..partitions)
                .map(|p| {
                    (
                        p,
                        reader
                            .fetch_watermarks(&topic, p, Duration::from_secs(10))
                            .unwrap()
                            .1,
                    )
                })
                .collect()
        })
        .await
        .unwrap()
    }

    /// The checker's report over this test's schema, topic, group and mock.
    pub async fn check(&self) -> replyd::check::Report {
        match &self.sqs {
            Some(sqs) => replyd::check::run_with_sqs(
                &self.settings(),
                Some(&self.mock.base_url()),
                sqs.client(),
            )
            .await
            .expect("check runs"),
            None => replyd::check::run(&self.settings(), Some(&self.mock.base_url()))
                .await
                .expect("check runs"),
        }
    }

    /// Attempt outcomes over all tasks, counted.
    pub async fn attempt_outcomes(&self) -> HashMap<String, i64> {
        self.db
            .raw_client()
            .await
            .query(
                "SELECT coalesce(outcome, 'open'), count(*) FROM reply_attempts GROUP BY 1",
                &[],
            )
            .await
            .unwrap()
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect()
    }
}
