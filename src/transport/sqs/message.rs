//! One SQS message as the pipeline sees it, and the envelope a record travels in: an SQS body
//! is text (XML-safe Unicode), and a `replyd.v1.ReplyTask` is bytes, so the body is the record
//! in standard base64, and its trace context is the `traceparent` message attribute.

use std::collections::HashMap;

use base64::Engine as _;
use chrono::{DateTime, Utc};
use opentelemetry::propagation::Extractor;

use crate::transport::source::Delivery;
use replyd_core::domain::RecordError;
use replyd_core::offsets::PartitionKey;

/// The message attribute that carries the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";

/// Names of the message attributes on a dead-lettered copy.
pub mod attributes {
    pub const SOURCE_QUEUE: &str = "replyd.source.queue";
    pub const SOURCE_MESSAGE_ID: &str = "replyd.source.message_id";
    pub const ERROR_KIND: &str = "replyd.error.kind";
    pub const ERROR_REASON: &str = "replyd.error.reason";
}

/// The body that carries `record`.
pub fn encode_body(record: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(record)
}

/// The record a body carries; an empty body is an empty record (refused as such).
pub fn decode_body(body: &str) -> Result<Vec<u8>, RecordError> {
    base64::engine::general_purpose::STANDARD
        .decode(body.trim())
        .map_err(|e| {
            RecordError::Undecodable(format!(
                "the SQS message body is not standard base64 ({e}); a reply task travels as its replyd.v1.ReplyTask bytes in base64"
            ))
        })
}

/// A received message: what it carries, and who it is in the queue.
#[derive(Debug, Clone)]
pub struct SqsMessage {
    pub message_id: String,
    /// The receipt handle of this receive (the source keeps the newest for each message id).
    pub receipt_handle: String,
    pub body: String,
    /// The record the body carries, or why it carries none.
    pub record: Result<Vec<u8>, RecordError>,
    pub sent_at: Option<DateTime<Utc>>,
    pub receive_count: u32,
    /// String message attributes (the trace context among them).
    pub attributes: HashMap<String, String>,
    /// The queue's name, standing in for a topic in logs, metrics and spans.
    pub queue: String,
    /// This worker's own count of receives: a position for logs, not an order.
    pub sequence: i64,
}

impl SqsMessage {
    /// From what `ReceiveMessage` returned; `None` for a message without an id or handle.
    pub fn received(
        message: aws_sdk_sqs::types::Message,
        queue: &str,
        sequence: i64,
    ) -> Option<Self> {
        use aws_sdk_sqs::types::MessageSystemAttributeName as System;
        let system = message.attributes.unwrap_or_default();
        let body = message.body.unwrap_or_default();
        let attributes = message
            .message_attributes
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(name, value)| value.string_value.map(|v| (name, v)))
            .collect();
        Some(Self {
            message_id: message.message_id?,
            receipt_handle: message.receipt_handle?,
            record: decode_body(&body),
            body,
            sent_at: system
                .get(&System::SentTimestamp)
                .and_then(|ms| ms.parse::<i64>().ok())
                .and_then(DateTime::from_timestamp_millis),
            receive_count: system
                .get(&System::ApproximateReceiveCount)
                .and_then(|n| n.parse().ok())
                .unwrap_or(1),
            attributes,
            queue: queue.to_owned(),
            sequence,
        })
    }
}

impl Delivery for SqsMessage {
    const SYSTEM: &'static str = "aws_sqs";
    const CAN_HAND_BACK: bool = true;
    /// Every worker receives from the queue: a live lease of another worker is its own.
    const PARTITION_HELD_ALONE: bool = false;

    fn payload(&self) -> Result<Option<&[u8]>, RecordError> {
        match &self.record {
            Ok(bytes) => Ok(Some(bytes)),
            Err(e) => Err(e.clone()),
        }
    }

    fn written_at(&self) -> Option<DateTime<Utc>> {
        self.sent_at
    }

    fn position(&self) -> (PartitionKey, i64) {
        (PartitionKey::new(&self.queue, 0), self.sequence)
    }

    fn trace_carrier(&self) -> Option<Box<dyn Extractor + '_>> {
        Some(Box::new(Attributes(&self.attributes)))
    }
}

/// Message attributes as a trace-context carrier.
struct Attributes<'a>(&'a HashMap<String, String>);

impl Extractor for Attributes<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).map(String::as_str)
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(String::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_travels_in_base64_and_anything_else_is_refused_saying_so() {
        let record = [0u8, 1, 2, 250, 255];
        assert_eq!(decode_body(&encode_body(&record)).unwrap(), record);
        assert_eq!(decode_body("").unwrap(), Vec::<u8>::new());
        let refused = decode_body("{\"prompt\": \"hi\"}").unwrap_err();
        assert_eq!(refused.kind(), "undecodable");
        assert!(refused.to_string().contains("base64"), "{refused}");
    }
}
