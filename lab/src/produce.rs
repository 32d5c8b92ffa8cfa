//! `replyd-lab produce`: publishes reply-task records, for the demo, benchmarks and operators, with
//! options to publish duplicates and each kind of malformed record.

use std::time::Duration;

use clap::Args;
use futures_util::future::join_all;
use prost::Message as _;
use rdkafka::ClientConfig;
use rdkafka::admin::{AdminClient, AdminOptions, NewTopic, TopicReplication};
use rdkafka::client::DefaultClientContext;
use rdkafka::error::{KafkaError, RDKafkaErrorCode};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;

use replyd_core::domain::{ChatMessage, ProviderRequest, Role, TaskId, TaskSpec};
use replyd_core::proto::v1;

/// Publishes to `kafka.topic` at `kafka.bootstrap_servers` with `kafka.producer_librdkafka`,
/// from the same settings as the worker.
#[derive(Debug, Clone, Args)]
pub struct ProduceArgs {
    /// Create the topic (and its dead-letter twin) with this many partitions if missing.
    #[arg(long)]
    pub create_partitions: Option<i32>,
    /// Number of distinct tasks.
    #[arg(long, default_value_t = 100)]
    pub count: usize,
    /// Publish every task this many times (redeliveries by a producer that retried).
    #[arg(long, default_value_t = 1)]
    pub copies: usize,
    /// Publish this many of the tasks once more, at the end (late duplicates).
    #[arg(long, default_value_t = 0)]
    pub duplicates: usize,
    /// Also publish this many malformed records, cycling through the kinds: undecodable
    /// bytes, a missing required field, an unknown schema version, an oversized prompt, an
    /// empty value.
    #[arg(long, default_value_t = 0)]
    pub malformed: usize,
    /// Attempt budget written into each task (0 = the worker's default).
    #[arg(long, default_value_t = 0)]
    pub max_attempts: u32,
    /// Distinct conversations the tasks are spread over (the record key, so one conversation
    /// stays in one partition).
    #[arg(long, default_value_t = 50)]
    pub conversations: usize,
    /// Workspace of the tasks.
    #[arg(long, default_value = "ws-demo")]
    pub workspace: String,
    /// Write the task ids to this file, one a line (standard output gets only the summary).
    #[arg(long)]
    pub ids_file: Option<std::path::PathBuf>,
    /// Words in each task's question, `N` or a range `MIN-MAX` that the tasks are spread over
    /// (task n gets a size of its own, the same on every run): prompts of mixed sizes, for a
    /// provider that limits tokens. Default: the demo's ten-word question.
    #[arg(long, value_parser = PromptWords::parse)]
    pub prompt_words: Option<PromptWords>,
}

/// The sizes of the tasks' questions, in words (`--prompt-words`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PromptWords {
    pub min: usize,
    pub max: usize,
}

impl PromptWords {
    /// `N` or `MIN-MAX`, with 1 <= MIN <= MAX.
    pub fn parse(text: &str) -> Result<Self, String> {
        let number = |part: &str| {
            part.trim()
                .parse::<usize>()
                .map_err(|e| format!("`{part}` is not a number of words: {e}"))
        };
        let (min, max) = match text.split_once('-') {
            Some((min, max)) => (number(min)?, number(max)?),
            None => (number(text)?, number(text)?),
        };
        if min == 0 || min > max {
            return Err(format!(
                "`{text}`: the sizes must be N or MIN-MAX with 1 <= MIN <= MAX"
            ));
        }
        Ok(Self { min, max })
    }

    /// The size of task `n`'s question: spread over the range by a fixed stride (a prime, so
    /// consecutive tasks differ and every size in a range of fewer than 7,919 words is used).
    pub fn of_task(self, n: usize) -> usize {
        let span = self.max - self.min + 1;
        self.min + n.wrapping_mul(7_919) % span
    }
}

/// `task` with its question padded (or cut) to `words` words, the question's own first.
pub fn with_question_words(mut task: TaskSpec, words: usize) -> TaskSpec {
    if let Some(question) = task
        .request
        .messages
        .iter_mut()
        .rev()
        .find(|m| m.role == Role::User)
    {
        let own: Vec<&str> = question.content.split_whitespace().collect();
        let padded: Vec<&str> = own
            .iter()
            .copied()
            .chain(std::iter::repeat("context"))
            .take(words)
            .collect();
        question.content = padded.join(" ");
    }
    task
}

/// What was published, printed as one JSON line.
#[derive(Debug, Clone, Serialize, PartialEq, Eq)]
pub struct ProduceReport {
    pub topic: String,
    pub tasks: usize,
    pub records: usize,
    pub malformed: usize,
    /// Where the task ids went, when asked.
    pub ids_file: Option<String>,
}

/// Why `replyd-lab produce` stopped.
#[derive(Debug, thiserror::Error)]
pub enum ProduceError {
    #[error("kafka at {bootstrap} (kafka.bootstrap_servers): {error}")]
    Kafka {
        bootstrap: String,
        error: KafkaError,
    },
    #[error("writing the task ids to {path}: {error}")]
    Ids { path: String, error: std::io::Error },
}

/// Kinds of malformed records `produce` can make.
pub const MALFORMED_KINDS: [&str; 5] = [
    "undecodable",
    "missing_field",
    "unknown_schema_version",
    "prompt_too_large",
    "empty_record",
];

/// A task of the demo workload: conversation `n % conversations`.
pub fn demo_task(workspace: &str, n: usize, conversations: usize, max_attempts: u32) -> TaskSpec {
    TaskSpec {
        task_id: TaskId::new_random(),
        workspace_id: workspace.to_owned(),
        conversation_id: format!("conv-{}", n % conversations.max(1)),
        message_id: format!("msg-{n}"),
        document_version: "v1".into(),
        request: ProviderRequest {
            model: None,
            messages: vec![
                ChatMessage {
                    role: Role::System,
                    content: "Answer from the document only.".into(),
                },
                ChatMessage {
                    role: Role::User,
                    content: format!("Question {n}: what are the key decisions in this document?"),
                },
            ],
            max_output_tokens: Some(256),
        },
        max_attempts,
        deadline: None,
    }
}

/// The value of malformed record number `n`, and its kind.
pub fn malformed_record(n: usize) -> (&'static str, Vec<u8>) {
    let kind = MALFORMED_KINDS[n % MALFORMED_KINDS.len()];
    let mut record = demo_task("ws-demo", n, 1, 0).to_proto();
    let bytes = match kind {
        // A varint that never ends: not a protobuf message at all.
        "undecodable" => vec![
            0x0a, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff,
        ],
        "missing_field" => {
            record.task_id.clear();
            record.encode_to_vec()
        }
        "unknown_schema_version" => {
            record.schema_version = 99;
            record.encode_to_vec()
        }
        "empty_record" => Vec::new(),
        _ => {
            record.messages = vec![v1::ChatMessage {
                role: v1::Role::User as i32,
                // Over the default 256 KiB limit, under the broker's 1 MB record limit.
                content: "x".repeat(300 * 1024),
            }];
            record.encode_to_vec()
        }
    };
    (kind, bytes)
}

/// A client config with only the brokers: a plaintext cluster (the tests' and the demo's).
pub fn plain(bootstrap: &str) -> ClientConfig {
    let mut config = ClientConfig::new();
    config.set("bootstrap.servers", bootstrap);
    config
}

/// Creates `topic` with `partitions` partitions unless it exists.
pub async fn create_topic(bootstrap: &str, topic: &str, partitions: i32) -> Result<(), KafkaError> {
    create_topic_with(&plain(bootstrap), topic, partitions).await
}

/// [`create_topic`] through `base` (the brokers and how to reach them).
pub async fn create_topic_with(
    base: &ClientConfig,
    topic: &str,
    partitions: i32,
) -> Result<(), KafkaError> {
    let admin: AdminClient<DefaultClientContext> = base.create()?;
    let results = admin
        .create_topics(
            [&NewTopic::new(
                topic,
                partitions,
                TopicReplication::Fixed(1),
            )],
            &AdminOptions::new().operation_timeout(Some(Duration::from_secs(30))),
        )
        .await?;
    for result in results {
        match result {
            Ok(_) | Err((_, RDKafkaErrorCode::TopicAlreadyExists)) => {}
            Err((_, code)) => return Err(KafkaError::AdminOp(code)),
        }
    }
    Ok(())
}

pub fn producer(bootstrap: &str) -> Result<FutureProducer, KafkaError> {
    producer_with(&plain(bootstrap), &Default::default())
}

/// An idempotent producer (`acks=all`) through `base` (the brokers and how to reach them),
/// with the pass-through properties.
pub fn producer_with(
    base: &ClientConfig,
    properties: &std::collections::BTreeMap<String, String>,
) -> Result<FutureProducer, KafkaError> {
    let mut config = base.clone();
    config.set("linger.ms", "5");
    for (key, value) in properties {
        config.set(key, value);
    }
    config
        .set("enable.idempotence", "true")
        .set("acks", "all")
        .create()
}

/// Publishes `records` (key, value) and waits for every acknowledgement, a batch at a time so
/// memory stays bounded.
pub async fn publish(
    producer: &FutureProducer,
    topic: &str,
    records: &[(String, Vec<u8>)],
) -> Result<(), KafkaError> {
    for batch in records.chunks(1000) {
        let sends = batch.iter().map(|(key, value)| {
            producer.send(
                FutureRecord::to(topic).key(key).payload(value),
                Duration::from_secs(30),
            )
        });
        for result in join_all(sends).await {
            result.map_err(|(e, _)| e)?;
        }
    }
    Ok(())
}

/// Publishes one record with no value (a tombstone) and waits for its acknowledgement.
pub async fn publish_tombstone(
    producer: &FutureProducer,
    topic: &str,
    key: &str,
) -> Result<(), KafkaError> {
    producer
        .send(
            FutureRecord::<str, [u8]>::to(topic).key(key),
            Duration::from_secs(30),
        )
        .await
        .map(|_| ())
        .map_err(|(e, _)| e)
}

/// Runs `replyd-lab produce`.
pub async fn run(
    settings: &replyd::config::Settings,
    args: &ProduceArgs,
) -> Result<ProduceReport, ProduceError> {
    let kafka = &settings.kafka;
    let bootstrap = &kafka.bootstrap_servers;
    let at_kafka = |error| ProduceError::Kafka {
        bootstrap: bootstrap.clone(),
        error,
    };
    let base = kafka.client_config();
    if let Some(partitions) = args.create_partitions {
        create_topic_with(&base, &kafka.topic, partitions)
            .await
            .map_err(at_kafka)?;
        create_topic_with(&base, &kafka.dead_letter_topic(), partitions)
            .await
            .map_err(at_kafka)?;
    }
    let tasks: Vec<TaskSpec> = (0..args.count)
        .map(|n| {
            let task = demo_task(&args.workspace, n, args.conversations, args.max_attempts);
            match args.prompt_words {
                Some(sizes) => with_question_words(task, sizes.of_task(n)),
                None => task,
            }
        })
        .collect();
    let encoded: Vec<(String, Vec<u8>)> = tasks
        .iter()
        .map(|t| (t.conversation_id.clone(), t.to_proto().encode_to_vec()))
        .collect();
    let mut records =
        Vec::with_capacity(encoded.len() * args.copies + args.duplicates + args.malformed);
    for _ in 0..args.copies.max(1) {
        records.extend(encoded.iter().cloned());
    }
    // Malformed records go in the middle of the stream, so later good records must still flow.
    let at = records.len() / 2;
    let bad: Vec<(String, Vec<u8>)> = (0..args.malformed)
        .map(|n| (format!("malformed-{n}"), malformed_record(n).1))
        .collect();
    records.splice(at..at, bad);
    records.extend(encoded.iter().take(args.duplicates).cloned());

    let producer = producer_with(&base, &kafka.producer_librdkafka).map_err(at_kafka)?;
    publish(&producer, &kafka.topic, &records)
        .await
        .map_err(at_kafka)?;
    let ids_file = match &args.ids_file {
        Some(path) => {
            let ids: String = tasks.iter().map(|t| format!("{}\n", t.task_id)).collect();
            std::fs::write(path, ids).map_err(|error| ProduceError::Ids {
                path: path.display().to_string(),
                error,
            })?;
            Some(path.display().to_string())
        }
        None => None,
    };
    Ok(ProduceReport {
        topic: kafka.topic.clone(),
        tasks: tasks.len(),
        records: records.len(),
        malformed: args.malformed,
        ids_file,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use replyd_core::domain::{RecordError, RecordRules};

    #[test]
    fn each_malformed_kind_is_refused_as_that_kind() {
        let rules = RecordRules::default();
        for n in 0..MALFORMED_KINDS.len() {
            let (kind, bytes) = malformed_record(n);
            let err: RecordError = TaskSpec::from_record(Some(&bytes), None, &rules).unwrap_err();
            let expected = if kind == "missing_field" {
                "missing_field"
            } else {
                kind
            };
            assert_eq!(err.kind(), expected, "{err}");
        }
    }

    #[test]
    fn prompt_sizes_are_spread_over_their_range_and_padded_to_them() {
        let sizes = PromptWords::parse("50-1950").unwrap();
        let of: Vec<usize> = (0..2000).map(|n| sizes.of_task(n)).collect();
        assert!(of.iter().all(|w| (50..=1950).contains(w)));
        assert_eq!(
            of.iter().collect::<std::collections::HashSet<_>>().len(),
            1901
        );
        assert_eq!(PromptWords::parse("8"), Ok(PromptWords { min: 8, max: 8 }));
        for bad in ["0", "9-3", "x", "3-"] {
            assert!(PromptWords::parse(bad).is_err(), "{bad}");
        }

        let task = with_question_words(demo_task("ws", 3, 1, 0), 14);
        let question = &task.request.messages[1].content;
        assert!(question.starts_with("Question 3: what are"), "{question}");
        assert_eq!(question.split_whitespace().count(), 14);
        assert!(question.ends_with("document? context context context context"));
        let short = with_question_words(demo_task("ws", 3, 1, 0), 2);
        assert_eq!(short.request.messages[1].content, "Question 3:");
        assert_eq!(
            short.request.messages[0].role,
            Role::System,
            "the system prompt is kept"
        );
    }

    #[test]
    fn demo_tasks_are_valid_records() {
        let task = demo_task("ws", 7, 3, 4);
        let back = TaskSpec::from_record(
            Some(&task.to_proto().encode_to_vec()),
            None,
            &RecordRules::default(),
        )
        .unwrap();
        assert_eq!(back, task);
        assert_eq!(back.conversation_id, "conv-1");
    }
}
