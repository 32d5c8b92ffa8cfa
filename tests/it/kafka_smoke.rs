//! The real broker: a ReplyTask goes through Kafka with rdkafka in a consumer group with
//! auto-commit off, its offset is committed by hand, and the committed offset is read back by a
//! fresh member of the group. Under both group protocols.

use std::time::{Duration, Instant};

use crate::helpers::{infra, task_spec, unique};
use prost::Message as _;
use rdkafka::config::ClientConfig;
use rdkafka::consumer::{BaseConsumer, CommitMode, Consumer};
use rdkafka::message::Message;
use rdkafka::producer::{FutureProducer, FutureRecord};
use rdkafka::{Offset, TopicPartitionList};
use replyd_core::domain::{RecordRules, TaskSpec};
use replyd_lab::produce::create_topic;

fn group_consumer(bootstrap: &str, group: &str, protocol: &str) -> BaseConsumer {
    let mut config = ClientConfig::new();
    config
        .set("bootstrap.servers", bootstrap)
        .set("group.id", group)
        .set("enable.auto.commit", "false")
        .set("enable.auto.offset.store", "false")
        .set("auto.offset.reset", "earliest")
        .set("group.protocol", protocol);
    if protocol == "classic" {
        config
            .set("partition.assignment.strategy", "cooperative-sticky")
            .set("session.timeout.ms", "6000");
    }
    config.create().expect("consumer")
}

/// Joins the group, takes one record, commits past it synchronously and leaves. Runs on a
/// blocking thread: librdkafka's consumer calls block, as they will in the worker's poll
/// thread.
fn consume_one_and_commit(
    bootstrap: &str,
    group: &str,
    protocol: &str,
    topic: &str,
) -> (i64, Vec<u8>) {
    let consumer = group_consumer(bootstrap, group, protocol);
    consumer.subscribe(&[topic]).expect("subscribe");
    let deadline = Instant::now() + Duration::from_secs(60);
    let message = loop {
        assert!(Instant::now() < deadline, "no record within 60 s");
        match consumer.poll(Duration::from_millis(200)) {
            Some(Ok(message)) => break message,
            Some(Err(e)) => panic!("consumer error: {e}"),
            None => {}
        }
    };
    let offset = message.offset();
    let payload = message.payload().expect("payload").to_vec();
    // Commit past the record: offset + 1, the position the group resumes from.
    let mut commit = TopicPartitionList::new();
    commit
        .add_partition_offset(topic, message.partition(), Offset::Offset(offset + 1))
        .unwrap();
    drop(message);
    consumer
        .commit(&commit, CommitMode::Sync)
        .expect("synchronous commit");
    (offset, payload)
}

fn committed_offset(bootstrap: &str, group: &str, protocol: &str, topic: &str) -> Offset {
    let reader = group_consumer(bootstrap, group, protocol);
    let mut query = TopicPartitionList::new();
    query.add_partition(topic, 0);
    let committed = reader
        .committed_offsets(query, Duration::from_secs(10))
        .expect("committed offsets");
    committed
        .find_partition(topic, 0)
        .expect("partition in answer")
        .offset()
}

async fn produce_consume_commit(protocol: &'static str) {
    let bootstrap = infra("KAFKA_BOOTSTRAP");
    let topic = unique("smoke");
    let group = unique("group");
    create_topic(&bootstrap, &topic, 1)
        .await
        .expect("topic created");

    let spec = task_spec(3);
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &bootstrap)
        .set("enable.idempotence", "true")
        .set("message.timeout.ms", "30000")
        .create()
        .expect("producer");
    let payload = spec.to_proto().encode_to_vec();
    let key = spec.task_id.to_string();
    producer
        .send(
            FutureRecord::to(&topic).key(&key).payload(&payload),
            Duration::from_secs(10),
        )
        .await
        .expect("record delivered");

    let (b, g, t) = (bootstrap.clone(), group.clone(), topic.clone());
    let (offset, received) =
        tokio::task::spawn_blocking(move || consume_one_and_commit(&b, &g, protocol, &t))
            .await
            .unwrap();
    assert_eq!(offset, 0);
    let decoded = TaskSpec::from_record(Some(&received), None, &RecordRules::default())
        .expect("the record decodes");
    assert_eq!(decoded, spec);

    // A fresh member of the group reads the committed position back from the broker.
    let committed =
        tokio::task::spawn_blocking(move || committed_offset(&bootstrap, &group, protocol, &topic))
            .await
            .unwrap();
    assert_eq!(committed, Offset::Offset(1));
}

#[tokio::test]
async fn reply_task_round_trips_and_commits_under_the_classic_protocol() {
    produce_consume_commit("classic").await;
}

#[tokio::test]
async fn reply_task_round_trips_and_commits_under_the_consumer_protocol() {
    produce_consume_commit("consumer").await;
}
