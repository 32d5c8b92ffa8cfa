//! Kafka at the edges: the group consumer, the in-flight offset tracker behind its commits,
//! and the dead-letter producer.

pub mod consumer;
pub mod dead_letter;
pub mod tracker;

/// The client context of replyd's producers: librdkafka's logs and errors go through
/// [`crate::telemetry`], so a broker that is down is one line a minute, not several a second.
#[derive(Clone, Default)]
pub struct KafkaLogs;

impl rdkafka::ClientContext for KafkaLogs {
    fn log(&self, level: rdkafka::config::RDKafkaLogLevel, fac: &str, message: &str) {
        crate::telemetry::librdkafka_log(level, fac, message);
    }

    fn error(&self, error: rdkafka::error::KafkaError, reason: &str) {
        crate::telemetry::kafka_client_error(&error, reason);
    }
}
