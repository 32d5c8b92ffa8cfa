//! The body of `POST /v1/replies` and what the schema cannot say about it: each field's
//! bound, NUL, the prompt's size and the task's Kafka record, each refusal naming its field.
//! Apart from the handlers so the checks (and the output bound other commands share) read in
//! one place, testable without a server.

use axum::body::Body;
use axum::http::HeaderMap;
use serde::Deserialize;
use utoipa::ToSchema;

use super::json_body::parse_json;
use super::problem::Problem;
use super::state::ApiState;
use crate::store::intake::{Submission, task_spec};
use replyd_core::domain::TaskId;
use replyd_core::domain::limits::{
    MAX_CONVERSATION_ID_BYTES, MAX_DOCUMENT_VERSION_BYTES, MAX_MODEL_BYTES,
};

/// The body of `POST /v1/replies`: a JSON object. Every field is bound to the
/// `Idempotency-Key`: a retry with the same key must send the same values. No text may
/// contain NUL (U+0000). Lengths are in bytes of UTF-8 (the schema's `maxLength` counts
/// characters, so it is the loose side of the same bound). The task's Kafka record, which
/// carries all of them, must also fit `kafka.max_record_bytes`.
#[derive(Debug, Clone, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateReply {
    /// The conversation the message belongs to (not blank; at most 256 bytes: it is also the
    /// task's Kafka record key).
    #[schema(min_length = 1, max_length = 256, pattern = r"\S")]
    pub conversation_id: String,
    /// The user's message (not blank; with `context`, at most `worker.max_prompt_bytes`).
    #[schema(min_length = 1, pattern = r"\S")]
    pub message: String,
    /// The document version the question is about (empty when none; at most 256 bytes).
    #[serde(default)]
    #[schema(max_length = 256)]
    pub document_version: String,
    /// The model to ask; the provider's default when absent (at most 256 bytes).
    #[schema(max_length = 256)]
    pub model: Option<String>,
    /// A system prompt for this reply, sent before the workspace's own. With an end user's
    /// token only where the workspace allows it (`end_user_context`).
    pub context: Option<String>,
    /// The most tokens the reply may have.
    #[schema(minimum = 1, maximum = 1_000_000)]
    pub max_output_tokens: Option<u32>,
    /// Which answer the user kept of an earlier message that has several (after a
    /// Regenerate): the task ids of those replies, at most one per message and 100 in all. An
    /// earlier message not named is sent with its newest completed reply. The model is asked
    /// with the conversation's earlier messages and these replies (oldest dropped first past
    /// `api.history_max_tokens`), fixed when the task is created; the list (not the history it
    /// picks) is bound to the key, so a retry after a new turn elsewhere is the same task.
    #[schema(max_items = 100, value_type = Option<Vec<uuid::Uuid>>)]
    pub kept_replies: Option<Vec<TaskId>>,
}

/// Reads and parses the body, each failure a problem naming it.
pub(super) async fn parse_body(
    state: &ApiState,
    headers: &HeaderMap,
    body: Body,
) -> Result<CreateReply, Problem> {
    let create: CreateReply = parse_json(state, headers, body).await?;
    check_inputs(&create, state.limits.max_prompt_bytes)
        .map_err(|refusal| Problem::invalid_body(refusal.detail).with_fields(refusal.fields))?;
    Ok(create)
}

/// The largest `max_output_tokens` taken: far above what any model writes, low enough that a
/// typo (or an overflow in a client) is refused rather than passed on.
pub const MAX_OUTPUT_TOKENS: u32 = 1_000_000;

/// Why a well-formed body is refused: the fields at fault, and what is wrong with them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Refusal {
    pub(super) fields: Vec<&'static str>,
    pub(super) detail: String,
}

impl Refusal {
    fn of(field: &'static str, detail: String) -> Self {
        Self {
            fields: vec![field],
            detail,
        }
    }
}

/// What the schema cannot say about a well-formed body, each refusal naming its field.
fn check_inputs(create: &CreateReply, max_prompt_bytes: usize) -> Result<(), Refusal> {
    if create.conversation_id.trim().is_empty() {
        return Err(Refusal::of(
            "conversation_id",
            "`conversation_id` is empty".into(),
        ));
    }
    if create.message.trim().is_empty() {
        return Err(Refusal::of("message", "`message` is empty".into()));
    }
    let bounded = [
        (
            "conversation_id",
            Some(&create.conversation_id),
            MAX_CONVERSATION_ID_BYTES,
        ),
        (
            "document_version",
            Some(&create.document_version),
            MAX_DOCUMENT_VERSION_BYTES,
        ),
        ("model", create.model.as_ref(), MAX_MODEL_BYTES),
    ];
    for (field, text, limit) in bounded {
        if let Some(text) = text
            && text.len() > limit
        {
            return Err(Refusal::of(
                field,
                format!(
                    "`{field}` is {} bytes, over the limit of {limit} bytes",
                    text.len()
                ),
            ));
        }
    }
    // PostgreSQL text cannot hold NUL; refused here, it can never fail the intake transaction.
    let texts = [
        ("conversation_id", Some(&create.conversation_id)),
        ("message", Some(&create.message)),
        ("document_version", Some(&create.document_version)),
        ("model", create.model.as_ref()),
        ("context", create.context.as_ref()),
    ];
    if let Some((field, _)) = texts
        .iter()
        .find(|(_, text)| text.is_some_and(|t| t.contains('\0')))
    {
        return Err(Refusal::of(
            field,
            format!("`{field}` contains a NUL character (U+0000)"),
        ));
    }
    if let Some(tokens) = create.max_output_tokens
        && !(1..=MAX_OUTPUT_TOKENS).contains(&tokens)
    {
        return Err(Refusal::of(
            "max_output_tokens",
            format!(
                "`max_output_tokens` is {tokens}; it must be between 1 and {MAX_OUTPUT_TOKENS}"
            ),
        ));
    }
    let prompt = create.message.len() + create.context.as_ref().map_or(0, String::len);
    if prompt > max_prompt_bytes {
        return Err(Refusal {
            fields: vec!["message", "context"],
            detail: format!(
                "`message` and `context` are {prompt} bytes, over the limit of {max_prompt_bytes} (worker.max_prompt_bytes)"
            ),
        });
    }
    Ok(())
}

/// Refuses a submission whose Kafka record would be over `kafka.max_record_bytes`, naming its
/// largest field: the relay could never publish it. The record is sized from the very task
/// the intake would write ([`task_spec`]), with ids of the length the intake makes.
pub(super) fn check_record_size(
    submission: &Submission,
    max_record_bytes: usize,
) -> Result<(), Refusal> {
    let spec = task_spec(
        submission,
        TaskId::from(uuid::Uuid::nil()),
        uuid::Uuid::nil(),
    );
    let size = spec.record_bytes();
    if size <= max_record_bytes {
        return Ok(());
    }
    let inputs = &submission.inputs;
    let fields = [
        ("conversation_id", inputs.conversation_id.len()),
        ("message", inputs.message.len()),
        ("context", inputs.context.as_ref().map_or(0, String::len)),
        ("document_version", inputs.document_version.len()),
        ("model", inputs.model.as_ref().map_or(0, String::len)),
    ];
    let (field, bytes) = fields
        .into_iter()
        .max_by_key(|(_, bytes)| *bytes)
        .expect("a non-empty list");
    Err(Refusal::of(
        field,
        format!(
            "the task's Kafka record would be {size} bytes, over kafka.max_record_bytes ({max_record_bytes}); its largest field is `{field}` ({bytes} bytes)"
        ),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use replyd_core::idempotency::{BoundInputs, IdempotencyKey, Operation};
    use replyd_core::workspace_policy::Admitted;

    fn create() -> CreateReply {
        CreateReply {
            conversation_id: "conv-1".into(),
            message: "What changed?".into(),
            document_version: "v7".into(),
            model: None,
            context: Some("Be brief.".into()),
            max_output_tokens: Some(256),
            kept_replies: None,
        }
    }

    #[test]
    fn a_well_formed_body_passes() {
        assert_eq!(check_inputs(&create(), 1000), Ok(()));
    }

    #[test]
    fn each_refusal_names_its_field() {
        type Case = (&'static str, fn(&mut CreateReply), &'static str);
        let cases: [Case; 6] = [
            (
                "blank conversation",
                |c| c.conversation_id = " ".into(),
                "`conversation_id` is empty",
            ),
            (
                "blank message",
                |c| c.message = "\n".into(),
                "`message` is empty",
            ),
            (
                "NUL in context",
                |c| c.context = Some("a\0b".into()),
                "`context` contains a NUL",
            ),
            (
                "NUL in the version",
                |c| c.document_version = "\0".into(),
                "`document_version` contains a NUL",
            ),
            (
                "zero tokens",
                |c| c.max_output_tokens = Some(0),
                "`max_output_tokens` is 0",
            ),
            (
                "too many tokens",
                |c| c.max_output_tokens = Some(MAX_OUTPUT_TOKENS + 1),
                "`max_output_tokens` is 1000001",
            ),
        ];
        for (what, break_it, expected) in cases {
            let mut body = create();
            break_it(&mut body);
            let refused = check_inputs(&body, 1000).expect_err(what).detail;
            assert!(refused.starts_with(expected), "{what}: {refused}");
        }
    }

    #[test]
    fn the_prompt_limit_counts_message_and_context() {
        // "What changed?" (13) + "Be brief." (9) = 22 bytes.
        assert_eq!(check_inputs(&create(), 22), Ok(()));
        let refused = check_inputs(&create(), 21).unwrap_err().detail;
        assert!(
            refused.contains("22 bytes, over the limit of 21 (worker.max_prompt_bytes)"),
            "{refused}"
        );
    }

    #[test]
    fn a_field_over_its_bound_is_refused_naming_it_and_at_the_bound_taken() {
        type Case = (&'static str, fn(&mut CreateReply, String), usize);
        let cases: [Case; 3] = [
            (
                "conversation_id",
                |c, text| c.conversation_id = text,
                MAX_CONVERSATION_ID_BYTES,
            ),
            (
                "document_version",
                |c, text| c.document_version = text,
                MAX_DOCUMENT_VERSION_BYTES,
            ),
            ("model", |c, text| c.model = Some(text), MAX_MODEL_BYTES),
        ];
        for (field, set, limit) in cases {
            let mut body = create();
            set(&mut body, "é".repeat(limit / 2));
            assert_eq!(check_inputs(&body, 1000), Ok(()), "{field} at its bound");
            // One more byte: a bound in bytes, not characters.
            set(&mut body, format!("{}x", "é".repeat(limit / 2)));
            let refused = check_inputs(&body, 1000).expect_err(field);
            assert_eq!(refused.fields, [field]);
            assert_eq!(
                refused.detail,
                format!(
                    "`{field}` is {} bytes, over the limit of {limit} bytes",
                    limit + 1
                )
            );
        }
    }

    #[test]
    fn a_record_over_the_limit_is_refused_naming_its_largest_field() {
        let submission = |message: &str, context: Option<&str>| Submission {
            workspace_id: "acme".into(),
            operation: Operation::CreateReply,
            key: IdempotencyKey::parse(Some(b"k")).unwrap(),
            inputs: BoundInputs {
                conversation_id: "conv-1".into(),
                message: message.into(),
                document_version: "v7".into(),
                model: None,
                context: context.map(str::to_owned),
                max_output_tokens: None,
                source_task: None,
                kept_replies: None,
            },
            max_attempts: 3,
            retention: chrono::TimeDelta::hours(1),
            existing_message: None,
            quota: replyd_core::quota::QuotaSettings::default().policy(),
            traceparent: None,
            verdict: Ok(Admitted {
                max_output_tokens: None,
                token_ceiling: 0,
            }),
            history: Ok(Vec::new()),
            end_user: None,
        };
        let small = submission("q", Some("c"));
        let size = task_spec(&small, TaskId::new_random(), uuid::Uuid::new_v4()).record_bytes();
        assert_eq!(
            check_record_size(&small, size),
            Ok(()),
            "exactly at the limit"
        );
        let refused = check_record_size(&small, size - 1).unwrap_err();
        assert_eq!(refused.fields, ["conversation_id"], "{}", refused.detail);
        let long_context = submission("q", Some(&"c".repeat(100)));
        let refused = check_record_size(&long_context, size).unwrap_err();
        assert_eq!(refused.fields, ["context"]);
        assert!(
            refused.detail.contains("over kafka.max_record_bytes")
                && refused.detail.contains("`context` (100 bytes)"),
            "{}",
            refused.detail
        );
    }
}
