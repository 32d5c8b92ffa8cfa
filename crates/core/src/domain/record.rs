//! Trusted task values, parsed from untrusted records. Pure: no I/O.
//!
//! A record is parsed once, here, into a [`TaskSpec`]; everything after this point works with
//! values that are known to be complete and within limits. A record that cannot become a
//! `TaskSpec` gets a [`RecordError`] naming the problem, which the worker sends to the
//! dead-letter topic instead of crashing or stalling its partition.

use std::fmt;

use chrono::{DateTime, Utc};
use prost::Message;
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::proto::v1;

/// The record layouts this build understands.
pub const SUPPORTED_SCHEMA_VERSIONS: &[u32] = &[1];

/// Identity of one logical reply task; stable across every delivery and attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct TaskId(Uuid);

impl TaskId {
    /// A fresh random id, for new work (a first submission or a Regenerate).
    pub fn new_random() -> Self {
        Self(Uuid::new_v4())
    }

    /// Parses the text form of a UUID.
    pub fn parse(text: &str) -> Result<Self, uuid::Error> {
        Uuid::parse_str(text).map(Self)
    }

    pub fn as_uuid(&self) -> Uuid {
        self.0
    }
}

impl From<Uuid> for TaskId {
    fn from(id: Uuid) -> Self {
        Self(id)
    }
}

impl fmt::Display for TaskId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Chat role of one prompt message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

/// One message of the prompt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: Role,
    pub content: String,
}

/// What to ask the provider. Stored as JSON in `reply_tasks.request`; compared as a whole when a
/// record for an existing task arrives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProviderRequest {
    /// Model name; `None` means the worker's default.
    pub model: Option<String>,
    pub messages: Vec<ChatMessage>,
    /// Upper bound on the reply's length in tokens; `None` means the provider's default.
    pub max_output_tokens: Option<u32>,
}

/// A reply task as replyd trusts it: every required field present, every limit checked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskSpec {
    pub task_id: TaskId,
    pub workspace_id: String,
    pub conversation_id: String,
    pub message_id: String,
    /// Empty when the conversation has no document.
    pub document_version: String,
    pub request: ProviderRequest,
    /// Most provider calls this task may ever cost (I7).
    pub max_attempts: u32,
    /// No provider call starts after this instant (I7).
    pub deadline: Option<DateTime<Utc>>,
}

/// Limits and defaults applied while parsing records; they come from the worker's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordRules {
    /// Attempt budget for records that leave `max_attempts` at 0.
    pub default_max_attempts: u32,
    /// Largest attempt budget a record may ask for.
    pub max_attempts_limit: u32,
    /// Largest prompt (sum of message contents, in bytes) a record may carry.
    pub max_prompt_bytes: usize,
}

impl Default for RecordRules {
    fn default() -> Self {
        Self {
            default_max_attempts: 3,
            max_attempts_limit: 20,
            max_prompt_bytes: 256 * 1024,
        }
    }
}

/// Why a record cannot become a task. Each variant is a dead-letter reason; `kind()` is the
/// stable label used in metrics and DLQ headers.
#[derive(Debug, Clone, thiserror::Error, PartialEq)]
pub enum RecordError {
    #[error("record is not a replyd.v1.ReplyTask: {0}")]
    Undecodable(String),
    #[error("unknown schema version {found} (this build reads {SUPPORTED_SCHEMA_VERSIONS:?})")]
    UnknownSchemaVersion { found: u32 },
    #[error("required field `{0}` is missing or empty")]
    MissingField(&'static str),
    #[error("field `{field}` is invalid: {reason}")]
    InvalidField { field: &'static str, reason: String },
    #[error("prompt is {bytes} bytes, over the limit of {limit} bytes")]
    PromptTooLarge { bytes: usize, limit: usize },
    /// No value at all (a tombstone, `null`) or a value of zero bytes. Neither can be a task:
    /// a valid record always carries its schema version.
    #[error("{}", if *tombstone {
        "record has no value (a tombstone): a reply task record always carries a replyd.v1.ReplyTask"
    } else {
        "record value is empty (0 bytes): a reply task record always carries a replyd.v1.ReplyTask"
    })]
    Empty { tombstone: bool },
}

impl RecordError {
    /// Short stable label for metrics and the `replyd.error.kind` DLQ header.
    pub fn kind(&self) -> &'static str {
        match self {
            RecordError::Undecodable(_) => "undecodable",
            RecordError::UnknownSchemaVersion { .. } => "unknown_schema_version",
            RecordError::MissingField(_) => "missing_field",
            RecordError::InvalidField { .. } => "invalid_field",
            RecordError::PromptTooLarge { .. } => "prompt_too_large",
            RecordError::Empty { .. } => "empty_record",
        }
    }
}

/// A deadline this long before the record's own timestamp is not a deadline but a unit
/// mistake: `deadline_unix_ms` written in seconds lands in January 1970.
pub const DEADLINE_BEFORE_RECORD_LIMIT: chrono::TimeDelta = chrono::TimeDelta::days(1);

impl TaskSpec {
    /// Decodes and validates one record: its value (`None` for a tombstone) and, when the
    /// record has one, its own timestamp (against which the deadline's unit is checked).
    pub fn from_record(
        value: Option<&[u8]>,
        written_at: Option<DateTime<Utc>>,
        rules: &RecordRules,
    ) -> Result<Self, RecordError> {
        let bytes = match value {
            None => return Err(RecordError::Empty { tombstone: true }),
            Some([]) => return Err(RecordError::Empty { tombstone: false }),
            Some(bytes) => bytes,
        };
        let record =
            v1::ReplyTask::decode(bytes).map_err(|e| RecordError::Undecodable(e.to_string()))?;
        let spec = Self::from_proto(record, rules)?;
        if let (Some(deadline), Some(written)) = (spec.deadline, written_at)
            && deadline < written - DEADLINE_BEFORE_RECORD_LIMIT
        {
            return Err(RecordError::InvalidField {
                field: "deadline_unix_ms",
                reason: format!(
                    "{} is {}, more than a day before the record was written ({}); the field is \
                     milliseconds since the Unix epoch (was it written in seconds?)",
                    deadline.timestamp_millis(),
                    deadline.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                    written.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
                ),
            });
        }
        Ok(spec)
    }

    /// Validates an already decoded record.
    pub fn from_proto(record: v1::ReplyTask, rules: &RecordRules) -> Result<Self, RecordError> {
        // The schema version is checked first: a record of an unknown layout may carry fields
        // whose meaning we would misread, so no other check is trusted before this one.
        if !SUPPORTED_SCHEMA_VERSIONS.contains(&record.schema_version) {
            return Err(RecordError::UnknownSchemaVersion {
                found: record.schema_version,
            });
        }
        let task_id = required("task_id", &record.task_id)?;
        let task_id = TaskId::parse(task_id).map_err(|e| RecordError::InvalidField {
            field: "task_id",
            reason: e.to_string(),
        })?;
        let workspace_id = required("workspace_id", &record.workspace_id)?.to_owned();
        let conversation_id = required("conversation_id", &record.conversation_id)?.to_owned();
        let message_id = required("message_id", &record.message_id)?.to_owned();

        if record.messages.is_empty() {
            return Err(RecordError::MissingField("messages"));
        }
        let mut prompt_bytes = 0usize;
        let mut messages = Vec::with_capacity(record.messages.len());
        for message in &record.messages {
            let role = match v1::Role::try_from(message.role) {
                Ok(v1::Role::System) => Role::System,
                Ok(v1::Role::User) => Role::User,
                Ok(v1::Role::Assistant) => Role::Assistant,
                Ok(v1::Role::Unspecified) | Err(_) => {
                    return Err(RecordError::InvalidField {
                        field: "messages.role",
                        reason: format!("role {} is not system, user or assistant", message.role),
                    });
                }
            };
            if message.content.is_empty() {
                return Err(RecordError::MissingField("messages.content"));
            }
            prompt_bytes += message.content.len();
            messages.push(ChatMessage {
                role,
                content: message.content.clone(),
            });
        }
        if prompt_bytes > rules.max_prompt_bytes {
            return Err(RecordError::PromptTooLarge {
                bytes: prompt_bytes,
                limit: rules.max_prompt_bytes,
            });
        }

        let max_attempts = match record.max_attempts {
            0 => rules.default_max_attempts,
            n if n > rules.max_attempts_limit => {
                return Err(RecordError::InvalidField {
                    field: "max_attempts",
                    reason: format!("{n} is over the limit of {}", rules.max_attempts_limit),
                });
            }
            n => n,
        };
        let deadline = match record.deadline_unix_ms {
            0 => None,
            ms => Some(DateTime::from_timestamp_millis(ms).ok_or_else(|| {
                RecordError::InvalidField {
                    field: "deadline_unix_ms",
                    reason: format!("{ms} is not a representable instant"),
                }
            })?),
        };

        Ok(TaskSpec {
            task_id,
            workspace_id,
            conversation_id,
            message_id,
            document_version: record.document_version,
            request: ProviderRequest {
                model: Some(record.model).filter(|m| !m.is_empty()),
                messages,
                max_output_tokens: Some(record.max_output_tokens).filter(|&n| n > 0),
            },
            max_attempts,
            deadline,
        })
    }

    /// The record form of this task (used by producers, the outbox and tests).
    pub fn to_proto(&self) -> v1::ReplyTask {
        v1::ReplyTask {
            schema_version: 1,
            task_id: self.task_id.to_string(),
            workspace_id: self.workspace_id.clone(),
            conversation_id: self.conversation_id.clone(),
            message_id: self.message_id.clone(),
            document_version: self.document_version.clone(),
            model: self.request.model.clone().unwrap_or_default(),
            messages: self
                .request
                .messages
                .iter()
                .map(|m| v1::ChatMessage {
                    role: match m.role {
                        Role::System => v1::Role::System,
                        Role::User => v1::Role::User,
                        Role::Assistant => v1::Role::Assistant,
                    } as i32,
                    content: m.content.clone(),
                })
                .collect(),
            deadline_unix_ms: self.deadline.map_or(0, |d| d.timestamp_millis()),
            max_attempts: self.max_attempts,
            max_output_tokens: self.request.max_output_tokens.unwrap_or(0),
            metadata: Default::default(),
        }
    }

    /// The key of the task's Kafka record: its conversation, so the tasks of one conversation
    /// go to one partition in the order they were made.
    pub fn record_key(&self) -> &str {
        &self.conversation_id
    }

    /// The size of the task's Kafka record as librdkafka counts it against
    /// `message.max.bytes` (see [`super::limits::record_bytes`]).
    pub fn record_bytes(&self) -> usize {
        super::limits::record_bytes(self.record_key().len(), self.to_proto().encoded_len())
    }

    /// Names of the inputs in which `other` disagrees with `self`. Two records for one task id
    /// must describe the same work; a disagreeing one is reported, never applied, so a late or
    /// forged record cannot change the question (or reset the budget, I7) of existing work.
    pub fn disagreements(&self, other: &TaskSpec) -> Vec<&'static str> {
        [
            ("workspace_id", self.workspace_id != other.workspace_id),
            (
                "conversation_id",
                self.conversation_id != other.conversation_id,
            ),
            ("message_id", self.message_id != other.message_id),
            (
                "document_version",
                self.document_version != other.document_version,
            ),
            ("request", self.request != other.request),
            ("max_attempts", self.max_attempts != other.max_attempts),
            ("deadline", self.deadline != other.deadline),
        ]
        .into_iter()
        .filter_map(|(field, differs)| differs.then_some(field))
        .collect()
    }
}

fn required<'a>(field: &'static str, value: &'a str) -> Result<&'a str, RecordError> {
    if value.trim().is_empty() {
        Err(RecordError::MissingField(field))
    } else {
        Ok(value)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn valid_record() -> v1::ReplyTask {
        v1::ReplyTask {
            schema_version: 1,
            task_id: "6f1c2a8e-3b0d-4b5e-9c51-0d3f5e7a9b11".into(),
            workspace_id: "ws-1".into(),
            conversation_id: "conv-1".into(),
            message_id: "msg-1".into(),
            document_version: "v7".into(),
            model: String::new(),
            messages: vec![v1::ChatMessage {
                role: v1::Role::User as i32,
                content: "What are the key decisions in this document?".into(),
            }],
            deadline_unix_ms: 0,
            max_attempts: 0,
            max_output_tokens: 0,
            metadata: Default::default(),
        }
    }

    #[test]
    fn valid_record_round_trips_through_the_wire_format() {
        let rules = RecordRules::default();
        let spec =
            TaskSpec::from_record(Some(&valid_record().encode_to_vec()), None, &rules).unwrap();
        assert_eq!(spec.max_attempts, rules.default_max_attempts);
        assert_eq!(spec.request.model, None);
        let again =
            TaskSpec::from_record(Some(&spec.to_proto().encode_to_vec()), None, &rules).unwrap();
        assert_eq!(spec, again);
    }

    #[test]
    fn each_missing_required_field_is_named() {
        let rules = RecordRules::default();
        type Breaker = fn(&mut v1::ReplyTask);
        let cases: [(&str, Breaker); 5] = [
            ("task_id", |r| r.task_id.clear()),
            ("workspace_id", |r| r.workspace_id.clear()),
            ("conversation_id", |r| r.conversation_id.clear()),
            ("message_id", |r| r.message_id = "  ".into()),
            ("messages", |r| r.messages.clear()),
        ];
        for (field, break_it) in cases {
            let mut record = valid_record();
            break_it(&mut record);
            assert_eq!(
                TaskSpec::from_proto(record, &rules),
                Err(RecordError::MissingField(field))
            );
        }
    }

    #[test]
    fn unknown_schema_version_is_refused_before_anything_else() {
        let mut record = valid_record();
        record.schema_version = 2;
        record.task_id.clear();
        let err = TaskSpec::from_proto(record, &RecordRules::default()).unwrap_err();
        assert_eq!(err, RecordError::UnknownSchemaVersion { found: 2 });
        assert_eq!(err.kind(), "unknown_schema_version");
    }

    #[test]
    fn oversized_prompt_is_refused_with_its_size() {
        let rules = RecordRules {
            max_prompt_bytes: 10,
            ..RecordRules::default()
        };
        let mut record = valid_record();
        record.messages[0].content = "x".repeat(11);
        assert_eq!(
            TaskSpec::from_proto(record, &rules),
            Err(RecordError::PromptTooLarge {
                bytes: 11,
                limit: 10
            })
        );
    }

    #[test]
    fn bad_task_id_role_and_budget_are_invalid_fields() {
        let rules = RecordRules::default();
        let mut record = valid_record();
        record.task_id = "not-a-uuid".into();
        assert!(matches!(
            TaskSpec::from_proto(record, &rules),
            Err(RecordError::InvalidField {
                field: "task_id",
                ..
            })
        ));
        let mut record = valid_record();
        record.messages[0].role = 42;
        assert!(matches!(
            TaskSpec::from_proto(record, &rules),
            Err(RecordError::InvalidField {
                field: "messages.role",
                ..
            })
        ));
        let mut record = valid_record();
        record.max_attempts = rules.max_attempts_limit + 1;
        assert!(matches!(
            TaskSpec::from_proto(record, &rules),
            Err(RecordError::InvalidField {
                field: "max_attempts",
                ..
            })
        ));
    }

    #[test]
    fn metadata_is_not_an_input_but_the_budget_is() {
        let rules = RecordRules::default();
        let base = TaskSpec::from_proto(valid_record(), &rules).unwrap();
        let mut with_metadata = valid_record();
        with_metadata.metadata.insert("trace".into(), "abc".into());
        let same = TaskSpec::from_proto(with_metadata, &rules).unwrap();
        assert!(base.disagreements(&same).is_empty());

        let mut other = valid_record();
        other.max_attempts = 9;
        other.document_version = "v8".into();
        let other = TaskSpec::from_proto(other, &rules).unwrap();
        assert_eq!(
            base.disagreements(&other),
            vec!["document_version", "max_attempts"]
        );
    }

    #[test]
    fn tombstones_and_empty_values_have_their_own_kind() {
        let rules = RecordRules::default();
        let tombstone = TaskSpec::from_record(None, None, &rules).unwrap_err();
        assert_eq!(tombstone, RecordError::Empty { tombstone: true });
        assert_eq!(tombstone.kind(), "empty_record");
        assert!(tombstone.to_string().contains("tombstone"), "{tombstone}");
        let empty = TaskSpec::from_record(Some(&[]), None, &rules).unwrap_err();
        assert_eq!(empty, RecordError::Empty { tombstone: false });
        assert!(empty.to_string().contains("0 bytes"), "{empty}");
    }

    #[test]
    fn a_deadline_in_seconds_is_refused_as_a_unit_mistake() {
        let rules = RecordRules::default();
        let written = DateTime::parse_from_rfc3339("2026-12-01T10:00:00Z")
            .unwrap()
            .with_timezone(&Utc);
        let mut record = valid_record();
        // Seconds where milliseconds belong: 1970-01-21.
        record.deadline_unix_ms = written.timestamp() + 60;
        let err = TaskSpec::from_record(Some(&record.encode_to_vec()), Some(written), &rules)
            .unwrap_err();
        let RecordError::InvalidField { field, reason } = &err else {
            panic!("{err:?}");
        };
        assert_eq!(*field, "deadline_unix_ms");
        assert!(
            reason.contains("milliseconds since the Unix epoch"),
            "{reason}"
        );
        assert!(reason.contains("1970-01-21"), "{reason}");

        // A deadline that passed a little before the record was written is a real (if
        // hopeless) deadline: the task is made, and fails at its first claim.
        record.deadline_unix_ms = (written - chrono::TimeDelta::hours(1)).timestamp_millis();
        let spec =
            TaskSpec::from_record(Some(&record.encode_to_vec()), Some(written), &rules).unwrap();
        assert!(spec.deadline.unwrap() < written);
        // Without the record's timestamp nothing can be compared.
        record.deadline_unix_ms = written.timestamp() + 60;
        assert!(TaskSpec::from_record(Some(&record.encode_to_vec()), None, &rules).is_ok());
    }

    proptest! {
        /// Whatever bytes arrive, parsing returns a value or a typed error; it never panics.
        #[test]
        fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            let _ = TaskSpec::from_record(Some(&bytes), None, &RecordRules::default());
        }

        /// A valid record with any byte flipped still yields a value or a typed error.
        #[test]
        fn corrupted_valid_records_never_panic(index in 0usize..200, flip in 1u8..=255) {
            let mut bytes = valid_record().encode_to_vec();
            let i = index % bytes.len();
            bytes[i] ^= flip;
            let _ = TaskSpec::from_record(Some(&bytes), None, &RecordRules::default());
        }
    }
}
