//! `[relay]`: how the outbox relay publishes. The settings tree (`crate::config`) holds it.

use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::setting_problems::SettingProblems;
use crate::transport::Transport;

/// The outbox relay (`replyd relay`).
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct RelaySettings {
    /// Where the outbox is handed: `kafka` (`kafka.topic`) or `sqs` (`sqs.queue_url`).
    pub sink: Transport,
    /// Outbox rows published per transaction.
    pub batch_size: i64,
    /// How often the outbox is looked at when no notification came.
    pub poll_interval_ms: u64,
    /// How long published rows are kept before they are deleted.
    pub retention_ms: u64,
    /// How long a batch's publish may take (librdkafka's `message.timeout.ms` on Kafka; the
    /// whole batch's calls on SQS); must be below
    /// `database.idle_in_transaction_session_timeout_ms`, since the batch's transaction stays
    /// open while its records are published.
    pub publish_timeout_ms: u64,
    /// `/readyz` of a relay says not ready while the oldest unpublished outbox row is older
    /// than this: nothing is publishing. Must be above `relay.poll_interval_ms`.
    pub ready_max_lag_ms: u64,
}

impl Default for RelaySettings {
    fn default() -> Self {
        Self {
            sink: Transport::Kafka,
            batch_size: 100,
            poll_interval_ms: 1_000,
            retention_ms: 60 * 60 * 1000,
            publish_timeout_ms: 5_000,
            ready_max_lag_ms: 60_000,
        }
    }
}

impl RelaySettings {
    /// `relay.publish_timeout_ms` against the database's idle-in-transaction timeout
    /// (`idle_in_transaction_ms`): a batch's transaction stays open while it is published.
    pub fn publish_problems(&self, idle_in_transaction_ms: u64) -> Vec<(&'static str, String)> {
        if self.publish_timeout_ms < idle_in_transaction_ms {
            return Vec::new();
        }
        vec![(
            "relay.publish_timeout_ms",
            format!(
                "{} must be below database.idle_in_transaction_session_timeout_ms ({idle_in_transaction_ms}): a batch's transaction stays open while it is published",
                self.publish_timeout_ms
            ),
        )]
    }

    /// What is wrong with `[relay]` on its own: the batch, the poll interval against the readiness lag. Each problem names its setting.
    pub fn problems(&self) -> Vec<(&'static str, String)> {
        let mut out = SettingProblems::default();
        if self.batch_size < 1 || self.poll_interval_ms == 0 {
            out.refuse(
                "relay.batch_size",
                "relay.batch_size and relay.poll_interval_ms must be positive".into(),
            );
        }
        if self.ready_max_lag_ms <= self.poll_interval_ms {
            out.refuse(
                "relay.ready_max_lag_ms",
                format!(
                    "{} must be above relay.poll_interval_ms ({}): a row may wait that long for a relay that is working",
                    self.ready_max_lag_ms, self.poll_interval_ms
                ),
            );
        }
        out.into()
    }

    pub fn poll_interval(&self) -> Duration {
        Duration::from_millis(self.poll_interval_ms)
    }

    pub fn retention(&self) -> Duration {
        Duration::from_millis(self.retention_ms)
    }

    pub fn publish_timeout(&self) -> Duration {
        Duration::from_millis(self.publish_timeout_ms)
    }

    pub fn ready_max_lag(&self) -> Duration {
        Duration::from_millis(self.ready_max_lag_ms)
    }
}
