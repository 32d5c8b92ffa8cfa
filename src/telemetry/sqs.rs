//! Events of the SQS source and sink: messages received (and received again while held),
//! deleted, handed back, visibility extended, refused batch entries, failed calls, and the
//! queue's depth as SQS approximates it.

use metrics::{counter, gauge};

use super::catalogue::names::*;
use super::lines::{once_a_minute, shape_of};

/// One receive call's answer: `messages` taken, of which `duplicates` were already held here,
/// and how old the oldest of them was (from its `SentTimestamp`).
pub fn sqs_received(messages: usize, duplicates: usize, oldest_seconds: Option<f64>) {
    counter!(SQS_RECEIVED).increment(messages as u64);
    if duplicates > 0 {
        tracing::debug!(
            duplicates,
            "SQS delivered messages this worker already holds"
        );
        counter!(SQS_DUPLICATE_RECEIVES).increment(duplicates as u64);
    }
    if let Some(seconds) = oldest_seconds {
        gauge!(SQS_RECEIVED_AGE_SECONDS).set(seconds);
    }
}

pub fn sqs_deleted(messages: usize) {
    counter!(SQS_DELETED).increment(messages as u64);
}

/// A message let go without deleting it: `held_elsewhere` (another worker holds its task) or
/// `stopping`, visible again after `after_seconds`.
pub fn sqs_handed_back(why: &'static str, after_seconds: i32) {
    tracing::debug!(why, after_seconds, "SQS message handed back");
    counter!(SQS_HANDED_BACK, "why" => why).increment(1);
}

pub fn sqs_visibility_extended(messages: usize) {
    counter!(SQS_VISIBILITY_EXTENSIONS).increment(messages as u64);
}

/// One entry of a batch call SQS refused (a receipt handle made stale by a newer receive).
pub fn sqs_entry_refused(operation: &'static str, code: &str, message: Option<&str>) {
    if once_a_minute(&format!("sqs-entry:{operation}:{code}")) {
        tracing::warn!(
            operation,
            code,
            message,
            "SQS refused an entry of a batch (repeats are held back for a minute)"
        );
    }
    counter!(SQS_ENTRIES_REFUSED, "operation" => operation, "code" => code.to_owned()).increment(1);
}

pub fn sqs_call_failed(operation: &'static str, error: &dyn std::error::Error) {
    let text = error.to_string();
    if once_a_minute(&format!("sqs-call:{operation}:{}", shape_of(&text))) {
        tracing::warn!(
            operation,
            error = %text,
            "an SQS call failed (repeats are held back for a minute)"
        );
    }
    counter!(SQS_ERRORS, "operation" => operation).increment(1);
}

/// The queue's messages by state, as `GetQueueAttributes` approximates them.
pub fn sqs_queue_depth(visible: u64, in_flight: u64, delayed: u64) {
    gauge!(SQS_QUEUE_MESSAGES, "state" => "visible").set(visible as f64);
    gauge!(SQS_QUEUE_MESSAGES, "state" => "in_flight").set(in_flight as f64);
    gauge!(SQS_QUEUE_MESSAGES, "state" => "delayed").set(delayed as f64);
}
