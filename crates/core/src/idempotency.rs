//! The rules of an idempotent submission (I6), pure: what a valid `Idempotency-Key` is, which
//! inputs a key is bound to, how they are hashed, which of them differ when a key is reused,
//! and how long a key is remembered. No I/O: the intake transaction asks these functions and
//! writes what they decide.
//!
//! Following the IETF Idempotency-Key draft and Stripe's practice: the key is made by the
//! client, once per intended operation (one press of Send), and reused on every retry of it.
//! It is scoped to the workspace and the operation, so two workspaces (or a submission and a
//! regenerate) never share a key. A reuse with the same inputs is the same request; with other
//! inputs it is a client error that names the fields.

use std::fmt;

use chrono::{DateTime, TimeDelta, Utc};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Longest key accepted, in bytes (Stripe's limit).
pub const MAX_KEY_LEN: usize = 255;

/// A client-made idempotency key: 1 to 255 printable ASCII characters.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize)]
pub struct IdempotencyKey(String);

/// Why a key is refused; each is a `400` naming the problem.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error(
        "the Idempotency-Key header is missing: make one key per operation and send it on every retry"
    )]
    Missing,
    #[error("the Idempotency-Key header is empty")]
    Empty,
    #[error("the Idempotency-Key is {len} bytes, over the limit of {MAX_KEY_LEN}")]
    TooLong { len: usize },
    #[error(
        "the Idempotency-Key has a character that is not printable ASCII at byte {at}: use letters, digits and punctuation (a UUID is a good key)"
    )]
    NotPrintable { at: usize },
}

impl IdempotencyKey {
    /// Parses the header's value (`None` when the header is absent).
    pub fn parse(header: Option<&[u8]>) -> Result<Self, KeyError> {
        let bytes = header.ok_or(KeyError::Missing)?;
        if bytes.is_empty() || bytes.iter().all(|b| *b == b' ') {
            return Err(KeyError::Empty);
        }
        if bytes.len() > MAX_KEY_LEN {
            return Err(KeyError::TooLong { len: bytes.len() });
        }
        if let Some(at) = bytes.iter().position(|b| !(0x20..=0x7e).contains(b)) {
            return Err(KeyError::NotPrintable { at });
        }
        // Checked above: every byte is printable ASCII, so this is UTF-8.
        Ok(Self(String::from_utf8_lossy(bytes).into_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for IdempotencyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What a key is scoped to besides its workspace: the operation it names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Operation {
    /// `POST /v1/replies`: a new message and its reply task.
    CreateReply,
    /// `POST /v1/replies/{task_id}/regenerate`: another answer to the same message.
    Regenerate,
}

impl Operation {
    pub fn as_str(self) -> &'static str {
        match self {
            Operation::CreateReply => "create_reply",
            Operation::Regenerate => "regenerate",
        }
    }
}

/// The inputs a key is bound to. Field order is the canonical order of the hash, so it must
/// never change for stored keys (add new fields at the end, as `Option`s that hash as absent).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BoundInputs {
    pub conversation_id: String,
    pub message: String,
    pub document_version: String,
    pub model: Option<String>,
    /// The system prompt, if any.
    pub context: Option<String>,
    pub max_output_tokens: Option<u32>,
    /// For a regenerate: the task whose message is answered again.
    pub source_task: Option<String>,
    /// The replies the user kept of earlier messages (`kept_replies`), sorted; absent when the
    /// request named none, and then left out of the canonical form, so the keys stored
    /// before it was bound hash as they did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kept_replies: Option<Vec<String>>,
}

impl BoundInputs {
    /// SHA-256 of the canonical JSON form, hex: what a replay must match.
    pub fn hash(&self) -> String {
        // Serializing a struct of strings, numbers and options cannot fail.
        let canonical = serde_json::to_vec(self).expect("bound inputs serialize");
        hex(&Sha256::digest(&canonical))
    }

    /// The fields in which `other` differs, in declaration order: the `422` names them.
    pub fn differing_fields(&self, other: &BoundInputs) -> Vec<&'static str> {
        let mut fields = Vec::new();
        let mut check = |name, same: bool| {
            if !same {
                fields.push(name);
            }
        };
        check(
            "conversation_id",
            self.conversation_id == other.conversation_id,
        );
        check("message", self.message == other.message);
        check(
            "document_version",
            self.document_version == other.document_version,
        );
        check("model", self.model == other.model);
        check("context", self.context == other.context);
        check(
            "max_output_tokens",
            self.max_output_tokens == other.max_output_tokens,
        );
        check("source_task", self.source_task == other.source_task);
        check("kept_replies", self.kept_replies == other.kept_replies);
        fields
    }
}

/// What a submission with a key that is already stored is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reuse {
    /// The same request again (a retry): answer with the existing task, marked as a replay.
    Replay,
    /// The same key with other inputs: refuse, naming the fields.
    Mismatch { fields: Vec<&'static str> },
    /// The stored key's retention ended: the submission is new work.
    Expired,
}

/// Decides a reuse of a stored key, by the database clock `now`.
pub fn decide_reuse(
    stored_hash: &str,
    stored: &BoundInputs,
    expires_at: DateTime<Utc>,
    given: &BoundInputs,
    now: DateTime<Utc>,
) -> Reuse {
    if expires_at <= now {
        return Reuse::Expired;
    }
    if stored_hash == given.hash() {
        return Reuse::Replay;
    }
    let fields = stored.differing_fields(given);
    // A hash mismatch with equal fields would mean the canonical form changed under a stored
    // key; refusing with no field named is safer than answering a different question.
    Reuse::Mismatch { fields }
}

/// When a key made at `now` stops being remembered.
pub fn expires_at(now: DateTime<Utc>, retention: TimeDelta) -> DateTime<Utc> {
    now + retention
}

/// Lowercase hex of `bytes`.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn inputs() -> BoundInputs {
        BoundInputs {
            conversation_id: "conv-1".into(),
            message: "What are the key decisions in this document?".into(),
            document_version: "v7".into(),
            model: None,
            context: None,
            max_output_tokens: Some(256),
            source_task: None,
            kept_replies: None,
        }
    }

    #[test]
    fn keys_are_printable_ascii_of_one_to_255_bytes() {
        assert_eq!(IdempotencyKey::parse(None), Err(KeyError::Missing));
        assert_eq!(IdempotencyKey::parse(Some(b"")), Err(KeyError::Empty));
        assert_eq!(IdempotencyKey::parse(Some(b"   ")), Err(KeyError::Empty));
        assert_eq!(
            IdempotencyKey::parse(Some(&[b'k'; 256])),
            Err(KeyError::TooLong { len: 256 })
        );
        assert!(IdempotencyKey::parse(Some(&[b'k'; 255])).is_ok());
        assert_eq!(
            IdempotencyKey::parse(Some(b"abc\x07")),
            Err(KeyError::NotPrintable { at: 3 })
        );
        assert_eq!(
            IdempotencyKey::parse(Some("clé".as_bytes())),
            Err(KeyError::NotPrintable { at: 2 })
        );
        let key = IdempotencyKey::parse(Some(b"8e0f6c52-2b61-4c1b-9d8e-2a4d8b7e1f00")).unwrap();
        assert_eq!(key.as_str(), "8e0f6c52-2b61-4c1b-9d8e-2a4d8b7e1f00");
    }

    #[test]
    fn a_retry_is_a_replay_and_other_inputs_name_their_fields() {
        let now = DateTime::from_timestamp(1_800_000_000, 0).unwrap();
        let later = now + TimeDelta::hours(24);
        let stored = inputs();
        assert_eq!(
            decide_reuse(&stored.hash(), &stored, later, &inputs(), now),
            Reuse::Replay
        );
        let mut other = inputs();
        other.message = "Another question".into();
        other.document_version = "v8".into();
        assert_eq!(
            decide_reuse(&stored.hash(), &stored, later, &other, now),
            Reuse::Mismatch {
                fields: vec!["message", "document_version"]
            }
        );
        // Past its retention, a key is new work, whatever the inputs.
        assert_eq!(
            decide_reuse(&stored.hash(), &stored, now, &other, now),
            Reuse::Expired
        );
    }

    #[test]
    fn the_hash_is_stable_across_builds() {
        // A stored key's hash must still match after an upgrade: pin the canonical form.
        assert_eq!(
            inputs().hash(),
            hex(&Sha256::digest(
                br#"{"conversation_id":"conv-1","message":"What are the key decisions in this document?","document_version":"v7","model":null,"context":null,"max_output_tokens":256,"source_task":null}"#
            ))
        );
    }

    #[test]
    fn kept_replies_are_bound_once_named() {
        let mut kept = inputs();
        kept.kept_replies = Some(vec!["0b6f9a3e-64a4-4d4c-9c0a-7f7c1b2a9e10".into()]);
        assert_ne!(kept.hash(), inputs().hash());
        assert_eq!(kept.differing_fields(&inputs()), ["kept_replies"]);
    }

    proptest! {
        /// Equal inputs hash equally; any difference in a bound field changes the hash and is
        /// named.
        #[test]
        fn hashes_and_differences_agree(message in ".{0,40}", other in ".{0,40}", tokens in proptest::option::of(0u32..5000)) {
            let mut a = inputs();
            a.message = message.clone();
            a.max_output_tokens = tokens;
            let mut b = a.clone();
            prop_assert_eq!(a.hash(), b.hash());
            b.message = other.clone();
            prop_assert_eq!(a.hash() == b.hash(), message == other);
            prop_assert_eq!(a.differing_fields(&b).is_empty(), message == other);
        }

        /// Whatever bytes a client sends as the key, parsing answers without panicking, and
        /// only printable ASCII of 1..=255 bytes passes.
        #[test]
        fn arbitrary_headers_parse_or_are_refused(bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
            let ok = IdempotencyKey::parse(Some(&bytes)).is_ok();
            let printable = !bytes.is_empty() && bytes.len() <= MAX_KEY_LEN
                && bytes.iter().all(|b| (0x20..=0x7e).contains(b))
                && !bytes.iter().all(|b| *b == b' ');
            prop_assert_eq!(ok, printable);
        }
    }
}
