//! The dead-letter queue of an SQS source: a copy of each message that cannot become a task
//! (its body as it came), with where it came from and why it was refused in message
//! attributes. The message counts as done, and is deleted, only once SQS has taken its copy
//! (I3). A message that fails in other ways (a worker that dies on it, again and again) is not
//! copied here by replyd: the queue's own `RedrivePolicy` moves it after `maxReceiveCount`
//! receives (`docs/OPERATIONS.md` says how that count and the attempt budget fit together).

use aws_sdk_sqs::types::MessageAttributeValue;

use super::message::{SqsMessage, attributes};
use super::{Sqs, SqsError};
use crate::transport::source::DeadLetter;
use replyd_core::domain::RecordError;

/// SQS's limit of message attributes on one message.
const MAX_ATTRIBUTES: usize = 10;
/// The refusal's reason is cut to this many characters: an attribute counts toward the
/// message's size.
const MAX_REASON_CHARS: usize = 1_024;

pub struct SqsDeadLetters {
    sqs: Sqs,
    /// The dead-letter queue's URL.
    url: String,
}

impl SqsDeadLetters {
    pub fn new(sqs: Sqs, url: String) -> Self {
        Self { sqs, url }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    /// Fails unless the dead-letter queue answers: a worker that could not keep a bad message
    /// would hold it forever, so it refuses to start instead.
    pub async fn verify(&self) -> Result<(), SqsError> {
        self.sqs.attributes(&self.url).await.map(|_| ())
    }
}

fn string(value: &str) -> MessageAttributeValue {
    MessageAttributeValue::builder()
        .data_type("String")
        .string_value(value)
        .build()
        .expect("data type is set")
}

impl DeadLetter<SqsMessage> for SqsDeadLetters {
    async fn keep(
        &self,
        record: &SqsMessage,
        error: &RecordError,
    ) -> Result<(), Box<dyn std::error::Error + Send + Sync>> {
        let reason: String = error.to_string().chars().take(MAX_REASON_CHARS).collect();
        let ours = [
            (attributes::SOURCE_QUEUE, record.queue.as_str()),
            (attributes::SOURCE_MESSAGE_ID, record.message_id.as_str()),
            (attributes::ERROR_KIND, error.kind()),
            (attributes::ERROR_REASON, reason.as_str()),
        ];
        let mut send = self
            .sqs
            .client()
            .send_message()
            .queue_url(&self.url)
            // SQS refuses an empty body; the copy of one says it was empty.
            .message_body(if record.body.is_empty() {
                " "
            } else {
                record.body.as_str()
            });
        // The message's own attributes (its trace context) as far as SQS's limit allows.
        let mut kept = 0;
        for (name, value) in &record.attributes {
            if kept + ours.len() >= MAX_ATTRIBUTES || name.starts_with("replyd.") {
                continue;
            }
            send = send.message_attributes(name, string(value));
            kept += 1;
        }
        for (name, value) in ours {
            send = send.message_attributes(name, string(value));
        }
        send.send()
            .await
            .map_err(|e| self.sqs.error("SendMessage (dead letter)", &self.url, e))?;
        Ok(())
    }
}
