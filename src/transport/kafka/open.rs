//! Kafka as a worker and a relay open it. A worker's source: the dead-letter topic checked
//! (waiting within `kafka.startup_retry_ms` for brokers, and for a topic made moments before
//! that is not yet in every broker's metadata), then the group consumer on a poll thread of its
//! own ([`super::consumer`]). A relay's sink: the idempotent producer ([`super::publish`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;

use super::consumer::{ConsumerStatus, run_consumer};
use super::dead_letter::{DeadLetterError, DeadLetters};
use super::publish::KafkaPublisher;
use super::settings::KafkaSettings;
use crate::connect_retry::retry_connecting;
use crate::transport::sink::Sink;
use crate::transport::source::{MakeHandler, OpenSource, Opening, SourceHealth};

/// A worker reading Kafka is ready while its consumer polls.
struct ConsumerHealth(Arc<ConsumerStatus>);

impl SourceHealth for ConsumerHealth {
    fn check(&self) -> Result<String, String> {
        if !self.0.polling.load(Ordering::Relaxed) {
            return Err("consumer not polling".into());
        }
        Ok(format!(
            "{} partitions assigned",
            self.0.assigned_partitions.load(Ordering::Relaxed)
        ))
    }
}

/// The dead-letter topic checked, and the consumer ready to run.
pub async fn open_source<M: MakeHandler>(
    kafka: KafkaSettings,
    startup: Duration,
    opening: Opening<M>,
) -> anyhow::Result<OpenSource> {
    let Opening {
        holding,
        weights,
        make_handler,
        shutdown,
    } = opening;
    let dead_letters = Arc::new(DeadLetters::new(&kafka));
    retry_connecting(
        "reaching Kafka",
        startup,
        &shutdown,
        // A topic created moments before the workers (a deploy's topic Job, a test) may not
        // be in every broker's metadata yet: a missing one is waited for within the start-up
        // window like an unreachable broker, then refused by name.
        |e: &DeadLetterError| {
            matches!(
                e,
                DeadLetterError::Unreachable { .. } | DeadLetterError::MissingTopic(_)
            )
        },
        || {
            let dead_letters = Arc::clone(&dead_letters);
            async move {
                // A metadata request blocks: keep it off the runtime's threads.
                tokio::task::spawn_blocking(move || dead_letters.verify_topic())
                    .await
                    .unwrap_or_else(|e| Err(DeadLetterError::Panicked(e.to_string())))
            }
        },
    )
    .await
    .context("checking the dead-letter topic")?;
    let dead_letters = Arc::into_inner(dead_letters)
        .ok_or_else(|| anyhow::anyhow!("the dead-letter check still holds the producer"))?;
    let handler = make_handler.make(dead_letters);
    let status = Arc::new(ConsumerStatus::default());
    let health = Arc::new(ConsumerHealth(Arc::clone(&status)));
    let heartbeat = Arc::clone(&status.heartbeat);
    let run = async move {
        let runtime = tokio::runtime::Handle::current();
        let consumer = std::thread::Builder::new()
            .name("replyd-poll".into())
            .spawn(move || {
                run_consumer(
                    &kafka, &holding, handler, runtime, shutdown, status, weights,
                )
            })
            .context("starting the poll thread")?;
        tokio::task::spawn_blocking(move || consumer.join())
            .await
            .context("joining the poll thread")?
            .map_err(|_| anyhow::anyhow!("the poll thread panicked"))?
            .context("kafka consumer")?;
        Ok(())
    };
    Ok(OpenSource {
        health,
        heartbeat,
        loop_name: "poll",
        run: Box::pin(run),
    })
}

/// The relay's producer. Nothing is waited for: librdkafka connects as it sends, and a broker
/// away shows in the sends and the relay's readiness.
pub fn open_sink(
    kafka: &KafkaSettings,
    publish_timeout: Duration,
) -> anyhow::Result<Box<dyn Sink>> {
    Ok(Box::new(KafkaPublisher::new(kafka, publish_timeout)?))
}
