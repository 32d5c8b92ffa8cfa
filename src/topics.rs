//! `replyd topics ensure`: the task topic (`kafka.topic`) and its dead-letter topic
//! (`kafka.dead_letter_topic`, `<topic>.dlq` by default) exist before the workers start. A
//! missing one is created with the partitions and replication factor asked; one that exists is
//! left as it is and reported, and one with fewer partitions than asked is named, never
//! changed: adding partitions moves keys to other partitions, and a conversation's records
//! would then be read out of order while the old ones drain.
//!
//! The chart runs it as a hook Job before the workers roll (`topics.manage: job`); a platform
//! that manages topics as resources (Strimzi's `KafkaTopic`) or by hand turns it off.

use std::time::Duration;

use anyhow::Context as _;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, ResourceSpecifier, TopicReplication};
use rdkafka::types::RDKafkaErrorCode;
use serde::Serialize;

use crate::config::Settings;
use crate::transport::kafka::KafkaLogs;

type Admin = AdminClient<KafkaLogs>;

/// How long one admin request (a create) may take.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a metadata request may take: brokers that do not answer in this long are named.
const METADATA_TIMEOUT: Duration = Duration::from_secs(10);

/// What `ensure` asks of each topic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Wanted {
    pub partitions: i32,
    /// `None`: the brokers' `default.replication.factor`.
    pub replication_factor: Option<i32>,
}

/// What was found or done for one topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum TopicState {
    Created {
        partitions: i32,
    },
    /// Another process created it between the look and the create: as good as existing.
    Exists {
        partitions: i32,
    },
    /// It exists with fewer partitions than asked; left as it is.
    FewerPartitions {
        partitions: i32,
        wanted: i32,
    },
}

/// One topic's line of the report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TopicReport {
    pub topic: String,
    /// `tasks` or `dead letters`.
    pub role: &'static str,
    #[serde(flatten)]
    pub state: TopicState,
}

/// A topic the brokers have, with `partitions`, against what was asked.
pub fn found(partitions: i32, wanted: Wanted) -> TopicState {
    if partitions < wanted.partitions {
        TopicState::FewerPartitions {
            partitions,
            wanted: wanted.partitions,
        }
    } else {
        TopicState::Exists { partitions }
    }
}

impl std::fmt::Display for TopicReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (topic, role) = (&self.topic, self.role);
        match self.state {
            TopicState::Created { partitions } => {
                write!(f, "{role} topic {topic}: created, {partitions} partitions")
            }
            TopicState::Exists { partitions } => {
                write!(f, "{role} topic {topic}: exists, {partitions} partitions")
            }
            TopicState::FewerPartitions { partitions, wanted } => write!(
                f,
                "{role} topic {topic}: exists with {partitions} partitions, fewer than the \
                 {wanted} asked; left as it is (more partitions would move conversations' \
                 keys): more than {partitions} workers would own nothing"
            ),
        }
    }
}

/// An admin client for the brokers of `settings`, and what its connections report.
fn admin(settings: &Settings) -> anyhow::Result<(Admin, KafkaLogs)> {
    let kafka = &settings.kafka;
    let mut config = kafka.client_config();
    for (key, value) in &kafka.librdkafka {
        config.set(key, value);
    }
    // Asking for a missing topic's metadata must not make the broker create it with its own
    // defaults (auto.create.topics.enable): it is created here, as asked, or not at all.
    config.set("allow.auto.create.topics", "false");
    let logs = KafkaLogs::default();
    let admin = config.create_with_context(logs.clone()).with_context(|| {
        format!(
            "Kafka admin client for {} (kafka.bootstrap_servers)",
            kafka.bootstrap_servers
        )
    })?;
    Ok((admin, logs))
}

/// The task topic and the dead-letter topic with their roles.
fn topics_of(settings: &Settings) -> [(String, &'static str); 2] {
    [
        (settings.kafka.topic.clone(), "tasks"),
        (settings.kafka.dead_letter_topic(), "dead letters"),
    ]
}

/// The metadata of `topic`, or an error naming the brokers and what they last said.
async fn look_up(
    admin: &Admin,
    logs: &KafkaLogs,
    settings: &Settings,
    topic: &str,
) -> anyhow::Result<Option<i32>> {
    partitions_of(admin, topic).await.map_err(|e| {
        let cause = logs
            .last_error()
            .map(|c| format!("; the last broker error: {c}"))
            .unwrap_or_default();
        anyhow::anyhow!(
            "reading the metadata of {topic} from {} (kafka.bootstrap_servers): {e}{cause}",
            settings.kafka.bootstrap_servers
        )
    })
}

/// One topic as the brokers report it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    pub topic: String,
    pub role: &'static str,
    /// `None`: the brokers do not have it.
    pub partitions: Option<i32>,
    /// Its `retention.ms` (`-1`: kept forever); `None` when it does not exist.
    pub retention_ms: Option<i64>,
}

/// Both topics as the brokers report them: partition counts and retention; creates nothing.
pub async fn look(settings: &Settings) -> anyhow::Result<Vec<Found>> {
    let (admin, logs) = admin(settings)?;
    let mut found = Vec::new();
    for (topic, role) in topics_of(settings) {
        let partitions = look_up(&admin, &logs, settings, &topic).await?;
        let retention_ms = match partitions {
            Some(_) => Some(retention_of(&admin, settings, &topic).await?),
            None => None,
        };
        found.push(Found {
            topic,
            role,
            partitions,
            retention_ms,
        });
    }
    Ok(found)
}

/// An existing topic's `retention.ms` as the brokers report it (`-1`: kept forever).
async fn retention_of(admin: &Admin, settings: &Settings, topic: &str) -> anyhow::Result<i64> {
    let results = admin
        .describe_configs(
            [&ResourceSpecifier::Topic(topic)],
            &AdminOptions::new().request_timeout(Some(REQUEST_TIMEOUT)),
        )
        .await
        .with_context(|| {
            format!(
                "describing the configuration of {topic} on {} (kafka.bootstrap_servers)",
                settings.kafka.bootstrap_servers
            )
        })?;
    let resource = results
        .into_iter()
        .next()
        .ok_or_else(|| anyhow::anyhow!("the brokers described nothing for {topic}"))?
        .map_err(|code| anyhow::anyhow!("describing {topic}: {code}"))?;
    resource
        .get("retention.ms")
        .and_then(|entry| entry.value.as_deref())
        .ok_or_else(|| anyhow::anyhow!("{topic} reports no retention.ms"))?
        .parse::<i64>()
        .with_context(|| format!("{topic}'s retention.ms"))
}

/// Makes both topics exist; one report line each.
pub async fn ensure(settings: &Settings, wanted: Wanted) -> anyhow::Result<Vec<TopicReport>> {
    let (admin, logs) = admin(settings)?;
    let mut reports = Vec::new();
    for (topic, role) in topics_of(settings) {
        let partitions = look_up(&admin, &logs, settings, &topic).await?;
        let state = match partitions {
            Some(partitions) => found(partitions, wanted),
            None => create(&admin, &topic, wanted)
                .await
                .with_context(|| format!("creating {role} topic {topic}"))?,
        };
        reports.push(TopicReport { topic, role, state });
    }
    Ok(reports)
}

/// The topic's partition count, `None` when the brokers do not have it.
async fn partitions_of(
    admin: &Admin,
    topic: &str,
) -> Result<Option<i32>, rdkafka::error::KafkaError> {
    let client = admin.inner();
    let topic_name = topic.to_owned();
    // A metadata request blocks: keep it off the runtime's threads.
    let metadata =
        tokio::task::block_in_place(|| client.fetch_metadata(Some(&topic_name), METADATA_TIMEOUT))?;
    Ok(metadata
        .topics()
        .iter()
        .find(|t| t.name() == topic && t.error().is_none() && !t.partitions().is_empty())
        .map(|t| t.partitions().len() as i32))
}

async fn create(admin: &Admin, topic: &str, wanted: Wanted) -> anyhow::Result<TopicState> {
    let new = NewTopic::new(
        topic,
        wanted.partitions,
        // -1 asks for the brokers' default.replication.factor (KIP-464).
        TopicReplication::Fixed(wanted.replication_factor.unwrap_or(-1)),
    );
    let results = admin
        .create_topics(
            [&new],
            &AdminOptions::new().operation_timeout(Some(REQUEST_TIMEOUT)),
        )
        .await?;
    for result in results {
        match result {
            Ok(_) => {}
            // Another process (a second Job, a person) made it meanwhile.
            Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {
                let partitions = partitions_of(admin, topic).await?.unwrap_or(0);
                return Ok(found(partitions, wanted));
            }
            Err((_, code)) => anyhow::bail!("the brokers refused: {code}"),
        }
    }
    Ok(TopicState::Created {
        partitions: wanted.partitions,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const WANT: Wanted = Wanted {
        partitions: 6,
        replication_factor: None,
    };

    #[test]
    fn a_topic_that_exists_is_reported_and_one_with_fewer_partitions_named() {
        assert_eq!(found(6, WANT), TopicState::Exists { partitions: 6 });
        assert_eq!(found(12, WANT), TopicState::Exists { partitions: 12 });
        assert_eq!(
            found(3, WANT),
            TopicState::FewerPartitions {
                partitions: 3,
                wanted: 6
            }
        );
    }
}
