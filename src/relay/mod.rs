//! `replyd relay`: hands the outbox's tasks to Kafka (or SQS, `relay.sink`). Batches of
//! unpublished rows are taken with `SKIP LOCKED` (many relays at once), published to
//! `kafka.topic` with an idempotent producer (`acks=all`) or sent to `sqs.queue_url`
//! ([`crate::sqs::publish`]), and marked published in the same transaction once acknowledged.
//! Woken by `NOTIFY replyd_outbox`, with a polling fallback. Between batches it runs the
//! [`crate::housekeeping`] rounds that are due (purges, the outbox's lag, the quota's
//! reconciler).
//!
//! A row whose record the broker refuses for good (over the topic's `max.message.bytes`, an
//! invalid record) can never be published: it is marked refused and its task failed with the
//! broker's reason in the batch's transaction (its reservation released, its followers told),
//! instead of being sent again forever while readiness stays down.
//!
//! A relay that dies between the publish and the commit leaves its rows unpublished; the next
//! batch publishes them again and the worker absorbs the duplicate record, because the task
//! id, not the record, is the identity of the work (I1, I6).

pub mod settings;

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use futures_util::future::{BoxFuture, join_all};
use rdkafka::error::KafkaError;
use rdkafka::producer::{FutureProducer, FutureRecord};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use crate::config::Settings;
use crate::connect_retry::retry_connecting;
use crate::housekeeping::Housekeeping;
use crate::kafka::KafkaLogs;
use crate::probes::{Heartbeat, Probes, Readiness};
use crate::sqs::publish::SqsPublisher;
use crate::sqs::settings::Transport;
use crate::sqs::{Sqs, SqsError};
use crate::store::Store;
use crate::store::listen::{Demand, Listener, listen};
use crate::store::outbox::{OutboxRow, Published};
use crate::telemetry::{self, trace};

/// The channel new outbox rows notify (see `migrations/V6`).
pub const OUTBOX_CHANNEL: &str = "replyd_outbox";

/// Wakes the relay loop.
struct WakeRelay(Arc<Notify>);

impl Listener for WakeRelay {
    fn listening(&mut self) {
        // Rows may have come while nobody listened: look now.
        self.0.notify_one();
    }

    fn notified(&mut self, _channel: &str, _payload: &str) {
        self.0.notify_one();
    }
}

/// A relay is ready while the database answers and the outbox's oldest unpublished row is
/// younger than `relay.ready_max_lag_ms`: older means nothing is publishing (Kafka away, or
/// every relay stuck), which is what an operator must hear about.
struct RelayReady {
    store: Store,
    max_lag: Duration,
}

impl Readiness for RelayReady {
    fn check(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            let lag = self
                .store
                .outbox_lag()
                .await
                .map_err(|e| format!("database: {}", telemetry::chain(&e)))?;
            let what = format!(
                "outbox: {} unpublished, the oldest {:.1} s old",
                lag.unpublished, lag.oldest_seconds
            );
            if lag.oldest_seconds > self.max_lag.as_secs_f64() {
                return Err(format!(
                    "{what}, over {} s (relay.ready_max_lag_ms)",
                    self.max_lag.as_secs_f64()
                ));
            }
            Ok(what)
        })
    }
}

/// The relay's producer: idempotent, every record acknowledged by all replicas, and no record
/// over `kafka.max_record_bytes` (the limit the API sized each task's record by).
fn producer_config(settings: &Settings) -> rdkafka::ClientConfig {
    let kafka = &settings.kafka;
    let mut config = kafka.client_config();
    for (key, value) in &kafka.producer_librdkafka {
        config.set(key, value);
    }
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .set("message.max.bytes", kafka.max_record_bytes.to_string())
        // A publish must end well inside the open transaction's idle timeout (validated).
        .set(
            "message.timeout.ms",
            settings.relay.publish_timeout_ms.to_string(),
        );
    config
}

/// Runs the relay until `shutdown`.
pub async fn run(
    settings: Settings,
    probes: &Probes,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    crate::connect_retry::migrate(&settings.database, &shutdown).await?;
    let store = Store::connect(&settings.database).context("database settings")?;
    let relay = &settings.relay;
    let kafka = &settings.kafka;
    let sink = match relay.sink {
        Transport::Kafka => Sink::Kafka {
            producer: producer_config(&settings)
                .create_with_context(KafkaLogs::default())
                .with_context(|| {
                    format!(
                        "Kafka producer for {} (kafka.bootstrap_servers)",
                        kafka.bootstrap_servers
                    )
                })?,
            topic: kafka.topic.clone(),
        },
        Transport::Sqs => {
            let sqs = Sqs::connect(&settings.sqs).await.context("SQS settings")?;
            let publisher = retry_connecting(
                "reaching SQS",
                Duration::from_millis(kafka.startup_retry_ms),
                &shutdown,
                SqsError::is_transient,
                || SqsPublisher::connect(sqs.clone(), &settings.sqs),
            )
            .await
            .context("checking the SQS queue")?;
            crate::telemetry::register(crate::telemetry::SQS_METRICS);
            Sink::Sqs(publisher)
        }
    };
    let provider = crate::provider::build_provider(&settings.provider)
        .context("provider settings (the quota reconciler asks the provider)")?;
    let heartbeat = Arc::new(Heartbeat::default());
    probes.watch("relay", Arc::clone(&heartbeat));
    let reconciler = crate::reconcile::Reconciler::new(
        store.clone(),
        Some(provider),
        settings.quota.policy(),
        settings.worker.lease(),
        settings.redelivery_bound(),
    );
    let mut housekeeping = Housekeeping::new(
        store.clone(),
        relay.retention(),
        settings.retention.clone(),
        reconciler,
        Arc::clone(&heartbeat),
    );
    let wake = Arc::new(Notify::new());
    tokio::spawn(listen(
        settings.database.clone(),
        format!("replyd-relay {}", std::process::id()),
        &[OUTBOX_CHANNEL],
        WakeRelay(Arc::clone(&wake)),
        // A relay's work is to hear new rows at once: it always listens.
        Demand::always(),
        shutdown.clone(),
    ));
    probes.add(
        "relay",
        RelayReady {
            store: store.clone(),
            max_lag: relay.ready_max_lag(),
        },
    );
    tracing::info!(to = %sink.name(), "relay started");
    while !shutdown.is_cancelled() {
        heartbeat.beat();
        let published = store
            .relay_batch(relay.batch_size, |rows| {
                sink.publish(rows, relay.publish_timeout())
            })
            .await;
        let full = match published {
            Ok((sent, refused)) => {
                telemetry::outbox_published(sent);
                (sent + refused) as i64 == relay.batch_size
            }
            Err(e) => {
                telemetry::store_error("relay_batch", &e);
                false
            }
        };
        housekeeping.run_due().await;
        if full {
            continue; // more are waiting
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = wake.notified() => {}
            _ = tokio::time::sleep(relay.poll_interval()) => {}
        }
    }
    tracing::info!("relay stopped");
    Ok(())
}

/// Where the relay hands the outbox.
enum Sink {
    Kafka {
        producer: FutureProducer<KafkaLogs>,
        topic: String,
    },
    Sqs(SqsPublisher),
}

impl Sink {
    fn name(&self) -> String {
        match self {
            Sink::Kafka { topic, .. } => format!("kafka topic {topic}"),
            Sink::Sqs(publisher) => format!("sqs queue {}", publisher.queue_name()),
        }
    }

    /// Publishes `rows`. An SQS batch's calls end within `timeout` (the batch's transaction is
    /// open meanwhile); a row whose call did not answer in time stays for the next batch.
    /// librdkafka bounds a Kafka publish itself (`message.timeout.ms`).
    async fn publish(&self, rows: Vec<OutboxRow>, timeout: Duration) -> Published {
        match self {
            Sink::Kafka { producer, topic } => publish(producer, topic, rows).await,
            Sink::Sqs(publisher) => tokio::time::timeout(timeout, publisher.publish(rows))
                .await
                .unwrap_or_default(),
        }
    }
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
        let mut settings = Settings::default();
        settings.kafka.max_record_bytes = 123_456;
        let config = producer_config(&settings);
        assert_eq!(config.get("message.max.bytes"), Some("123456"));
        assert_eq!(config.get("acks"), Some("all"));
    }
}
