//! The dead-letter topic: a copy of each record that cannot become a task, with headers that
//! say where it came from and why it was refused. A record counts as done (its offset may be
//! committed) only once the broker has acknowledged its copy (I3).

use std::time::Duration;

use rdkafka::ClientConfig;
use rdkafka::error::KafkaError;
use rdkafka::message::{Header, Headers, Message, OwnedHeaders, OwnedMessage};
use rdkafka::producer::{BaseProducer, FutureProducer, FutureRecord, Producer};
use tokio::sync::OnceCell;

use super::settings::KafkaSettings;
use replyd_core::domain::RecordError;

/// Header names on dead-lettered records.
pub mod headers {
    pub const SOURCE_TOPIC: &str = "replyd.source.topic";
    pub const SOURCE_PARTITION: &str = "replyd.source.partition";
    pub const SOURCE_OFFSET: &str = "replyd.source.offset";
    pub const ERROR_KIND: &str = "replyd.error.kind";
    pub const ERROR_REASON: &str = "replyd.error.reason";
    /// How often the record was sent back from the dead-letter topic (`replyd dead-letters
    /// replay`); kept on the record, so a copy of a replayed record carries it.
    pub const REPLAYS: &str = "replyd.replays";
}

#[derive(Debug, thiserror::Error)]
pub enum DeadLetterError {
    #[error("kafka: {0}")]
    Kafka(#[from] KafkaError),
    #[error("cannot reach Kafka at {bootstrap} (kafka.bootstrap_servers): {error}{}", cause.as_deref().map(|c| format!("; the last broker error: {c}")).unwrap_or_default())]
    Unreachable {
        bootstrap: String,
        error: Box<KafkaError>,
        /// What the broker connection last reported (a refused password, say).
        cause: Option<String>,
    },
    #[error(
        "dead-letter topic `{0}` does not exist: create it before starting workers (`replyd topics ensure` creates it and kafka.topic; or set kafka.dead_letter_topic)"
    )]
    MissingTopic(String),
    #[error("the metadata request did not finish: {0}")]
    Panicked(String),
}

/// The dead-letter copies' producer, made at the first copy. rdkafka's producers poll on a
/// thread of their own, 100 ms at a time, and each poll spins out its last millisecond (the
/// deadline's remainder is rounded down to 0 ms): about 1 % of a core for as long as the
/// producer lives, on every worker, for copies most workers never make.
pub struct DeadLetters {
    config: ClientConfig,
    producer: OnceCell<FutureProducer<super::KafkaLogs>>,
    /// The producers' context (shared): the last broker error, for a failed check.
    logs: super::KafkaLogs,
    topic: String,
    bootstrap: String,
}

impl DeadLetters {
    /// Makes no client: [`Self::verify_topic`], which start-up runs before anything else, makes
    /// one of these settings, so settings librdkafka refuses are refused there, at once.
    pub fn new(kafka: &KafkaSettings) -> Self {
        let logs = super::KafkaLogs::default();
        // Idempotent, fully acknowledged writes: a copy is durable before the source offset
        // is released, and producer retries never duplicate it.
        let mut config = kafka.producer_config();
        // Checking for the topic must not create it behind the operator's back.
        config.set("allow.auto.create.topics", "false");
        Self {
            config,
            producer: OnceCell::new(),
            logs,
            topic: kafka.dead_letter_topic(),
            bootstrap: kafka.bootstrap_servers.clone(),
        }
    }

    /// A client of the producer's settings that polls nowhere: for a metadata request.
    fn probe(&self) -> Result<BaseProducer<super::KafkaLogs>, KafkaError> {
        self.config.create_with_context(self.logs.clone())
    }

    /// Fails unless the dead-letter topic exists: without it every bad record would be retried
    /// forever and hold its partition's commit point, so a worker refuses to start instead.
    pub fn verify_topic(&self) -> Result<(), DeadLetterError> {
        let probe = self.probe()?;
        // Short: start-up retries this, and each try should fit well inside its budget.
        let metadata = probe
            .client()
            .fetch_metadata(Some(&self.topic), Duration::from_secs(3));
        // The client's logs and the errors its connections met (a refused password: the cause
        // a failed request does not carry) reach the context only through a poll of its queue.
        probe.poll(Duration::from_millis(100));
        let metadata = metadata.map_err(|error| DeadLetterError::Unreachable {
            bootstrap: self.bootstrap.clone(),
            error: Box::new(error),
            cause: self.logs.last_error(),
        })?;
        let exists = metadata
            .topics()
            .iter()
            .any(|t| t.name() == self.topic && t.error().is_none() && !t.partitions().is_empty());
        if exists {
            Ok(())
        } else {
            Err(DeadLetterError::MissingTopic(self.topic.clone()))
        }
    }

    pub fn topic(&self) -> &str {
        &self.topic
    }

    /// Writes the copy and waits for the broker's acknowledgement.
    pub async fn send(&self, record: &OwnedMessage, error: &RecordError) -> Result<(), KafkaError> {
        let partition = record.partition().to_string();
        let offset = record.offset().to_string();
        let reason = error.to_string();
        let mut ours = OwnedHeaders::new();
        for (key, value) in [
            (headers::SOURCE_TOPIC, record.topic()),
            (headers::SOURCE_PARTITION, &partition),
            (headers::SOURCE_OFFSET, &offset),
            (headers::ERROR_KIND, error.kind()),
            (headers::ERROR_REASON, &reason),
        ] {
            ours = ours.insert(Header {
                key,
                value: Some(value),
            });
        }
        // Keep the producer's own headers after ours, for tracing.
        let copy = copy_of(record, &self.topic, ours, |_| true);
        let producer = self
            .producer
            .get_or_try_init(|| async { self.config.create_with_context(self.logs.clone()) })
            .await?;
        producer
            .send(copy, Duration::from_secs(30))
            .await
            .map(|_| ())
            .map_err(|(e, _)| e)
    }
}

/// A copy of `message` for `topic`: its key and payload as they are, under `headers` followed
/// by the message's own headers whose names `keep` keeps.
pub fn copy_of<'a, M: Message>(
    message: &'a M,
    topic: &'a str,
    mut headers: OwnedHeaders,
    keep: impl Fn(&str) -> bool,
) -> FutureRecord<'a, [u8], [u8]> {
    if let Some(original) = message.headers() {
        for header in original.iter().filter(|h| keep(h.key)) {
            headers = headers.insert(Header {
                key: header.key,
                value: header.value,
            });
        }
    }
    let mut copy = FutureRecord::<[u8], [u8]>::to(topic).headers(headers);
    if let Some(key) = message.key() {
        copy = copy.key(key);
    }
    if let Some(payload) = message.payload() {
        copy = copy.payload(payload);
    }
    copy
}
