//! The choice of transport: what carries the reply-task records between the relay and the
//! workers (`worker.source`, `relay.sink`). Each transport's own settings are its room's
//! ([`super::kafka::settings`], [`super::sqs::settings`]).

use serde::{Deserialize, Serialize};

/// What carries the reply-task records between the relay and the workers.
#[derive(
    Debug, Clone, Copy, Default, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Transport {
    /// The `kafka.topic` of `[kafka]`, read by a consumer group.
    #[default]
    Kafka,
    /// The SQS Standard queue of `[sqs]`.
    Sqs,
}

impl Transport {
    /// Its name in settings, logs and reports.
    pub fn as_str(self) -> &'static str {
        match self {
            Transport::Kafka => "kafka",
            Transport::Sqs => "sqs",
        }
    }
}
