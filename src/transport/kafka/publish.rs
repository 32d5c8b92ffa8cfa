//! The relay's Kafka sink (`relay.sink = "kafka"`): an idempotent producer (`acks=all`) to
//! `kafka.topic`. A row whose record the broker refuses for good (over the topic's
//! `max.message.bytes`, an invalid record) is refused, and its task failed with the broker's
//! reason, instead of being sent again forever; any other failure leaves it for the next batch.

use std::time::Duration;

use anyhow::Context as _;
use futures_util::future::{BoxFuture, join_all};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tracing::Instrument as _;

use super::KafkaLogs;
use super::settings::KafkaSettings;
use crate::store::outbox::{OutboxRow, Published};
use crate::telemetry::{self, trace};
use crate::transport::sink::Sink;

/// Publishes outbox rows to `kafka.topic`.
pub struct KafkaPublisher {
    producer: FutureProducer<KafkaLogs>,
    topic: String,
}

impl KafkaPublisher {
    /// The producer, made (librdkafka connects as it sends: an unreachable broker shows in the
    /// sends and in the relay's readiness, not here).
    pub fn new(kafka: &KafkaSettings, publish_timeout: Duration) -> anyhow::Result<Self> {
        let producer = producer_config(kafka, publish_timeout)
            .create_with_context(KafkaLogs::default())
            .with_context(|| {
                format!(
                    "Kafka producer for {} (kafka.bootstrap_servers)",
                    kafka.bootstrap_servers
                )
            })?;
        Ok(Self {
            producer,
            topic: kafka.topic.clone(),
        })
    }
}

impl Sink for KafkaPublisher {
    fn name(&self) -> String {
        format!("kafka topic {}", self.topic)
    }

    /// librdkafka bounds a publish itself (`message.timeout.ms`), by the same timeout.
    fn publish(&self, rows: Vec<OutboxRow>, _timeout: Duration) -> BoxFuture<'_, Published> {
        Box::pin(publish(&self.producer, &self.topic, rows))
    }
}

/// The relay's producer: idempotent, every record acknowledged by all replicas, and no record
/// over `kafka.max_record_bytes` (the limit the API sized each task's record by). A publish
/// ends within `publish_timeout` (`relay.publish_timeout_ms`), well inside the open batch
/// transaction's idle timeout (validated).
fn producer_config(kafka: &KafkaSettings, publish_timeout: Duration) -> rdkafka::ClientConfig {
    let mut config = kafka.producer_config();
    config
        .set("message.max.bytes", kafka.max_record_bytes.to_string())
        .set(
            "message.timeout.ms",
            publish_timeout.as_millis().to_string(),
        );
    config
}

/// Publishes `rows`: the ids Kafka acknowledged, and those it refused for good with why. Each
/// send is a producer span of its task's trace, whose context the record carries in its
/// `traceparent` header.
///
/// A broker checks its size limit against a whole batch of records, and librdkafka does not
/// split a refused batch: a good record that shared a batch with one too large is refused with
/// it. So a refused row is sent again alone, after the batch, and only a refusal of the row
/// on its own refuses it for good.
async fn publish(
    producer: &FutureProducer<KafkaLogs>,
    topic: &str,
    rows: Vec<OutboxRow>,
) -> Published {
    let sends = rows.iter().map(|row| send(producer, topic, row));
    let mut published = Published::default();
    let mut suspects = Vec::new();
    for (row, sent) in rows.iter().zip(join_all(sends).await) {
        match sent {
            Sent::Acknowledged => published.sent.push(row.outbox_id),
            Sent::Refused(_) => suspects.push(row),
            Sent::Failed => {}
        }
    }
    // One at a time: nothing else of this relay is in flight, so each goes in a batch alone.
    for row in suspects {
        match send(producer, topic, row).await {
            Sent::Acknowledged => published.sent.push(row.outbox_id),
            Sent::Refused(reason) => {
                telemetry::outbox_refused(row.outbox_id, &row.task_id.to_string(), &reason);
                published.refused.push((row.outbox_id, reason));
            }
            Sent::Failed => {}
        }
    }
    published
}

/// Sends one row's record and waits for the broker's answer.
async fn send(producer: &FutureProducer<KafkaLogs>, topic: &str, row: &OutboxRow) -> Sent {
    let stored = row.traceparent.as_deref();
    let span = trace::publish("kafka", topic, &row.task_id.to_string(), stored);
    let mut record = FutureRecord::to(topic)
        .key(&row.record_key)
        .payload(&row.payload);
    if let Some(headers) = trace::record_headers(&span, stored) {
        record = record.headers(headers);
    }
    match producer
        .send(record, Duration::from_secs(0))
        .instrument(span)
        .await
    {
        Ok(_) => Sent::Acknowledged,
        Err((e, _)) => match refused_for_good(&e) {
            Some(reason) => Sent::Refused(reason),
            None => {
                telemetry::outbox_publish_failed(row.outbox_id, &telemetry::chain(&e));
                Sent::Failed
            }
        },
    }
}

/// How one row's send ended.
enum Sent {
    Acknowledged,
    /// The broker (or the producer's own size check) will not take the record; why.
    Refused(String),
    /// Anything that may pass later (a broker away, a timeout): the row stays for the next batch.
    Failed,
}

/// Why the broker (or the producer's own check against `message.max.bytes`) will never take
/// this record, or None when sending it again may work. Only errors about the record itself
/// count: one about the topic, the cluster or the credentials holds every row back alike, and
/// failing tasks for it would lose work an operator can still mend.
fn refused_for_good(error: &KafkaError) -> Option<String> {
    use rdkafka::types::RDKafkaErrorCode as Code;
    let KafkaError::MessageProduction(code) = error else {
        return None;
    };
    let why = match code {
        Code::MessageSizeTooLarge => {
            "the record is larger than the broker or topic takes (message.max.bytes / max.message.bytes)"
        }
        Code::InvalidMessageSize => "the record's size is invalid",
        Code::InvalidRecord => "the broker found the record invalid",
        _ => return None,
    };
    Some(format!("{why} ({error})"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rdkafka::types::RDKafkaErrorCode as Code;

    #[test]
    fn only_errors_about_the_record_itself_refuse_it_for_good() {
        for code in [
            Code::MessageSizeTooLarge,
            Code::InvalidMessageSize,
            Code::InvalidRecord,
        ] {
            let refused = refused_for_good(&KafkaError::MessageProduction(code));
            assert!(refused.is_some(), "{code:?}");
        }
        for passing in [
            KafkaError::MessageProduction(Code::MessageTimedOut),
            KafkaError::MessageProduction(Code::UnknownTopicOrPartition),
            KafkaError::MessageProduction(Code::TopicAuthorizationFailed),
            KafkaError::MessageProduction(Code::NotEnoughReplicas),
            KafkaError::MessageProduction(Code::QueueFull),
            KafkaError::Canceled,
        ] {
            assert_eq!(refused_for_good(&passing), None, "{passing:?}");
        }
    }

    #[test]
    fn the_producer_takes_no_record_over_kafka_max_record_bytes() {
        let kafka = KafkaSettings {
            max_record_bytes: 123_456,
            ..KafkaSettings::default()
        };
        let config = producer_config(&kafka, Duration::from_secs(10));
        assert_eq!(config.get("message.max.bytes"), Some("123456"));
        assert_eq!(config.get("acks"), Some("all"));
    }
}
