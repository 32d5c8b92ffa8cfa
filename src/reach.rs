//! `replyd config check --connect`: the settings are valid, and what they point at answers.
//! PostgreSQL (a session, and a schema that has every migration this build needs), Kafka when
//! it is used (the brokers, the task topic and the dead-letter topic, and that neither keeps records
//! longer than forgotten tasks are remembered), the provider (its model list, with
//! the key every call carries), and the SQS queue and its dead-letter queue when they are used. Each is asked on its own, within a bound, so one that hangs
//! does not hide the others; each failure names the address and the setting.

use std::time::Duration;

use crate::config::Settings;
use crate::transport::Transport;

/// How long each part may take to answer.
const PART_TIMEOUT: Duration = Duration::from_secs(20);

/// One part's answer: what was reached, or why not.
#[derive(Debug)]
pub struct Reached {
    pub part: &'static str,
    pub answer: Result<String, String>,
}

impl std::fmt::Display for Reached {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.answer {
            Ok(what) => write!(f, "{}: ok: {what}", self.part),
            Err(why) => write!(f, "{}: FAILED: {why}", self.part),
        }
    }
}

/// Asks every part at once; one line each, in a fixed order. Kafka is asked when the worker
/// reads from it or the relay writes to it, the SQS queue when either uses SQS: on SQS alone,
/// nothing of Kafka is required or checked.
pub async fn check(settings: &Settings) -> Vec<Reached> {
    let uses_sqs =
        settings.worker.source == Transport::Sqs || settings.relay.sink == Transport::Sqs;
    let uses_kafka =
        settings.worker.source == Transport::Kafka || settings.relay.sink == Transport::Kafka;
    let (database, kafka, provider, sqs) = tokio::join!(
        bounded(database(settings)),
        bounded_if(uses_kafka, kafka(settings)),
        bounded(provider(settings)),
        bounded_if(uses_sqs, sqs(settings)),
    );
    [
        ("database", Some(database)),
        ("kafka", kafka),
        ("provider", Some(provider)),
        ("sqs", sqs),
    ]
    .into_iter()
    .filter_map(|(part, answer)| {
        Some(Reached {
            part,
            answer: answer?,
        })
    })
    .collect()
}

/// The queue (its depth and visibility timeout), and the dead-letter queue a worker would copy
/// refused messages to, with the receive count after which the queue's own redrive moves a
/// message there.
async fn sqs(settings: &Settings) -> Result<String, String> {
    use crate::transport::sqs::{QueueDepth, RedrivePolicy};
    let sqs = crate::transport::sqs::Sqs::connect(&settings.sqs)
        .await
        .map_err(|e| e.to_string())?;
    let queue = &settings.sqs.queue_url;
    let attributes = sqs.attributes(queue).await.map_err(|e| e.to_string())?;
    let depth = QueueDepth::of(&attributes);
    let mut what = format!(
        "{queue}: {} visible, {} in flight",
        depth.visible, depth.in_flight
    );
    if settings.worker.source == Transport::Sqs {
        let dead_letters = sqs
            .dead_letter_queue(&settings.sqs, &attributes)
            .await
            .map_err(|e| e.to_string())?;
        sqs.attributes(&dead_letters)
            .await
            .map_err(|e| format!("the dead-letter queue: {e}"))?;
        what.push_str(&format!("; dead-letter queue {dead_letters}"));
        if let Some(n) = RedrivePolicy::of(&attributes).and_then(|p| p.max_receive_count) {
            what.push_str(&format!(" after {n} receives (RedrivePolicy)"));
        }
    }
    Ok(what)
}

async fn bounded(
    part: impl std::future::Future<Output = Result<String, String>>,
) -> Result<String, String> {
    tokio::time::timeout(PART_TIMEOUT, part)
        .await
        .unwrap_or_else(|_| Err(format!("no answer in {} s", PART_TIMEOUT.as_secs())))
}

/// [`bounded`], for a part asked only when the settings use it; none when they do not.
async fn bounded_if(
    used: bool,
    part: impl std::future::Future<Output = Result<String, String>>,
) -> Option<Result<String, String>> {
    if used {
        Some(bounded(part).await)
    } else {
        None
    }
}

async fn database(settings: &Settings) -> Result<String, String> {
    let target = crate::store::target_of(&settings.database);
    let pending = crate::store::migrate::pending_migrations(&settings.database)
        .await
        .map_err(|e| crate::telemetry::chain(&e))?;
    if pending.is_empty() {
        Ok(format!("{target}: the schema has every migration"))
    } else {
        Err(format!(
            "{target} (database.url): the schema lacks {} migration(s) this build needs ({}): run `replyd migrate`",
            pending.len(),
            pending.join(", ")
        ))
    }
}

async fn kafka(settings: &Settings) -> Result<String, String> {
    let found = crate::topics::look(settings)
        .await
        .map_err(|e| crate::telemetry::chain(e.as_ref()))?;
    let mut seen = Vec::new();
    let mut missing = Vec::new();
    let mut outlived = Vec::new();
    for t in &found {
        match t.partitions {
            Some(n) => seen.push(format!("{} topic {}: {n} partitions", t.role, t.topic)),
            None => missing.push(format!(
                "{} topic {} does not exist ({})",
                t.role,
                t.topic,
                if t.role == "tasks" {
                    "kafka.topic"
                } else {
                    "kafka.dead_letter_topic"
                }
            )),
        }
        if let Some(ms) = t.retention_ms {
            outlived.extend(settings.retention.outlived_by(&t.topic, ms));
        }
    }
    let brokers = &settings.kafka.bootstrap_servers;
    if !missing.is_empty() {
        return Err(format!(
            "{brokers}: {}: `replyd topics ensure` creates it",
            missing.join("; ")
        ));
    }
    if !outlived.is_empty() {
        return Err(format!("{brokers}: {}", outlived.join("; ")));
    }
    Ok(format!("{brokers}: {}", seen.join("; ")))
}

async fn provider(settings: &Settings) -> Result<String, String> {
    let access = crate::provider::access::check(&settings.provider)
        .await
        .map_err(|e| crate::telemetry::chain(&e))?;
    let model = &settings.provider.default_model;
    let listed = access.models.iter().any(|m| m == model);
    Ok(format!(
        "{}: {} models listed{}",
        settings.provider.base_url,
        access.models.len(),
        if listed || access.models.is_empty() {
            String::new()
        } else {
            format!(", not provider.default_model {model}")
        }
    ))
}
