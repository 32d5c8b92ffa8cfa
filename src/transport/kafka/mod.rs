//! What every Kafka client of replyd shares: its settings ([`settings`]), the client context
//! that routes librdkafka's logs ([`KafkaLogs`]), the dead-letter producer, and the group's
//! offsets moved back after a restore ([`rewind`]). The group consumer is the worker's
//! (`crate::transport::kafka::consumer`).

pub mod consumer;
pub mod dead_letter;
pub mod open;
pub mod publish;
pub mod records;
pub mod rewind;
pub mod settings;

/// The client context of replyd's producers: librdkafka's logs and errors go through
/// [`crate::telemetry`], so a broker that is down is one line a minute, not several a second.
/// It keeps the last error a broker connection reported: a metadata request that times out
/// says only "transport failure", while the cause (a refused password, an untrusted
/// certificate) came through here.
#[derive(Clone, Default)]
pub struct KafkaLogs {
    last_error: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl KafkaLogs {
    /// The last error a broker connection reported, if any.
    pub fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl rdkafka::ClientContext for KafkaLogs {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        crate::telemetry::librdkafka_log(level, fac, message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        // "All brokers are down" follows every cause; the cause is what explains it.
        if !reason.ends_with("brokers are down") {
            *self.last_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_owned());
        }
        crate::telemetry::kafka_client_error(&error, reason);
    }
}

/// For the one-shot readers (`replyd dead-letters replay`): their own offsets are never
/// committed, so the consumer callbacks' defaults do.
impl rdkafka::consumer::ConsumerContext for KafkaLogs {}

/// For the dead-letter topic's check, a producer that sends nothing: no delivery to report.
impl rdkafka::producer::ProducerContext for KafkaLogs {
    type DeliveryOpaque = ();

    fn delivery(&self, _: &rdkafka::message::DeliveryResult<'_>, _: ()) {}
}
