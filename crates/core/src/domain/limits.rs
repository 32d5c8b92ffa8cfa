//! Bounds on what one task carries from the intake to Kafka, pure. The API refuses a request
//! over them before anything is written: the relay could never publish its record (the broker
//! refuses a record over its size), so the task would wait in the outbox for good. The
//! settings check uses [`largest_record_bytes`] to refuse a `worker.max_prompt_bytes` whose
//! largest task could not fit `kafka.max_record_bytes`.

use prost::encoding::encoded_len_varint;
use uuid::Uuid;

use super::{ChatMessage, ProviderRequest, Role, TaskId, TaskSpec};

/// Longest `conversation_id` the API takes, in bytes. It is also the task's Kafka record key
/// and is copied into the message, task and outbox rows; conversation ids are UUIDs or short
/// slugs, so 256 bytes leaves room for any client's scheme and keeps the key small.
pub const MAX_CONVERSATION_ID_BYTES: usize = 256;

/// Longest `document_version` the API takes, in bytes: versions are hashes, counters or
/// timestamps, far shorter.
pub const MAX_DOCUMENT_VERSION_BYTES: usize = 256;

/// Longest `model` the API takes, in bytes: providers' model names are well under 100 bytes.
pub const MAX_MODEL_BYTES: usize = 256;

/// Longest workspace id: what the `workspaces` table's check allows (`migrations/V4`).
pub const MAX_WORKSPACE_ID_BYTES: usize = 63;

/// librdkafka's framing of one record, added to its key, value and headers before it compares
/// the sum with `message.max.bytes` (`RD_KAFKAP_MESSAGE_V2_MAX_OVERHEAD`: the length,
/// attributes, timestamp and offset deltas, key and value lengths and header count, each at
/// its longest varint).
pub const RECORD_FRAMING_BYTES: usize = 5 + 1 + 10 + 5 + 5 + 5 + 5;

/// Length of a W3C `traceparent` value (`00-<32 hex>-<16 hex>-<2 hex>`).
const TRACEPARENT_VALUE_BYTES: usize = 55;

/// The `traceparent` header the relay may add to a record, as librdkafka counts it: the name
/// and the value, each after its varint length.
pub const TRACEPARENT_HEADER_BYTES: usize = 1 + "traceparent".len() + 1 + TRACEPARENT_VALUE_BYTES;

/// What librdkafka counts against `message.max.bytes` for a record with a key of `key_len`
/// bytes and a value of `value_len`, with the `traceparent` header the relay may add.
pub fn record_bytes(key_len: usize, value_len: usize) -> usize {
    RECORD_FRAMING_BYTES + key_len + value_len + TRACEPARENT_HEADER_BYTES
}

/// An upper bound, within a few bytes, of the largest record of a task the API makes with a
/// prompt (message plus context) of at most `max_prompt_bytes`: every id at its bound, both
/// a context and a message. A configuration under which this fits never makes a record from
/// `POST /v1/replies` that the relay cannot publish. (A regenerate copies its source task's
/// fields, which may have come from Kafka without these bounds; the API checks each record's
/// own size too.)
pub fn largest_record_bytes(max_prompt_bytes: usize) -> usize {
    // The record with one-byte texts, then the rest of the prompt: each of the two messages
    // has two length prefixes (its entry's and its content's) that grow with its content, at
    // most to the varint of the whole prompt with its framing.
    let small = largest_ids_spec("s", "u").record_bytes();
    let growth = 2 * 2 * (encoded_len_varint(max_prompt_bytes as u64 + 16) - 1);
    small + max_prompt_bytes.saturating_sub(2) + growth
}

/// A task as the intake makes it with every id at its bound, the given context and message.
fn largest_ids_spec(context: &str, message: &str) -> TaskSpec {
    let text = |n: usize| "x".repeat(n);
    TaskSpec {
        // Every UUID has the same 36-byte text.
        task_id: TaskId::from(Uuid::nil()),
        workspace_id: text(MAX_WORKSPACE_ID_BYTES),
        conversation_id: text(MAX_CONVERSATION_ID_BYTES),
        message_id: Uuid::nil().to_string(),
        document_version: text(MAX_DOCUMENT_VERSION_BYTES),
        request: ProviderRequest {
            model: Some(text(MAX_MODEL_BYTES)),
            messages: vec![
                ChatMessage {
                    role: Role::System,
                    content: context.to_owned(),
                },
                ChatMessage {
                    role: Role::User,
                    content: message.to_owned(),
                },
            ],
            max_output_tokens: Some(u32::MAX),
        },
        max_attempts: u32::MAX,
        deadline: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_largest_record_bound_holds_and_is_tight_for_every_split_of_the_prompt() {
        for prompt in [
            2, 100, 127, 128, 129, 1_000, 16_383, 16_384, 16_400, 262_144, 2_097_152,
        ] {
            let bound = largest_record_bytes(prompt);
            let mut largest = 0;
            for context in [1, prompt / 2, prompt - 1] {
                let spec = largest_ids_spec(&"c".repeat(context), &"m".repeat(prompt - context));
                let size = spec.record_bytes();
                assert!(
                    size <= bound,
                    "prompt {prompt}, context {context}: {size} > {bound}"
                );
                largest = largest.max(size);
            }
            assert!(
                bound - largest <= 16,
                "prompt {prompt}: {bound} vs {largest}"
            );
        }
    }

    #[test]
    fn a_record_is_counted_with_its_key_framing_and_traceparent() {
        assert_eq!(record_bytes(6, 100), 36 + 6 + 100 + 68);
    }
}
