//! The relay's SQS sink (`relay.sink = "sqs"`): the same outbox rows, sent as messages whose
//! body is the record in base64, whose `traceparent` attribute carries the trace and whose
//! `MessageGroupId` is the task's workspace (SQS fair queues, I10), in
//! `SendMessageBatch` calls of at most ten messages and at most the queue's
//! `MaximumMessageSize` together. A row SQS acknowledges is published; a row whose message is
//! larger than the queue takes can never be sent and is refused for good (its task fails with
//! the reason, as on Kafka); any other failure leaves the row for the next batch, and a row sent
//! twice (a relay dying before its commit) is one task to the workers (I1, I6).

use std::time::Duration;

use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry};
use futures_util::future::BoxFuture;
use tracing::Instrument as _;

use super::message::{TRACEPARENT, encode_body};
use super::settings::{SQS_BATCH_LIMIT, SqsSettings};
use super::{Sqs, SqsError};
use crate::store::outbox::{OutboxRow, Published};
use crate::telemetry::{self, trace};
use crate::transport::sink::Sink;

/// SQS's own largest message when the queue does not say (256 KiB).
const DEFAULT_MAXIMUM_MESSAGE_SIZE: usize = 262_144;

/// Sends outbox rows to one queue.
pub struct SqsPublisher {
    sqs: Sqs,
    queue: String,
    queue_name: String,
    /// The queue's `MaximumMessageSize`: one message's limit and one batch's.
    max_bytes: usize,
}

/// One row as a message: its entry and its size as SQS counts it (body and attributes).
struct Outgoing<'a> {
    row: &'a OutboxRow,
    entry: SendMessageBatchRequestEntry,
    bytes: usize,
}

impl Sink for SqsPublisher {
    fn name(&self) -> String {
        format!("sqs queue {}", self.queue_name)
    }

    /// A row whose call did not answer within `timeout` stays for the next batch.
    fn publish(&self, rows: Vec<OutboxRow>, timeout: Duration) -> BoxFuture<'_, Published> {
        Box::pin(async move {
            tokio::time::timeout(timeout, self.send_all(rows))
                .await
                .unwrap_or_default()
        })
    }
}

impl SqsPublisher {
    /// Connects and reads the queue's size limit (which also proves the queue is there).
    pub async fn connect(sqs: Sqs, settings: &SqsSettings) -> Result<Self, SqsError> {
        let attributes = sqs.attributes(&settings.queue_url).await?;
        let max_bytes = attributes
            .get(&QueueAttributeName::MaximumMessageSize)
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_MAXIMUM_MESSAGE_SIZE);
        Ok(Self {
            sqs,
            queue: settings.queue_url.clone(),
            queue_name: settings.queue_name().to_owned(),
            max_bytes,
        })
    }

    /// Publishes `rows`: the ids SQS acknowledged, and those it can never take with why.
    async fn send_all(&self, rows: Vec<OutboxRow>) -> Published {
        let mut published = Published::default();
        let mut outgoing = Vec::new();
        for (i, row) in rows.iter().enumerate() {
            let stored = row.traceparent.as_deref();
            let span = trace::publish(
                "aws_sqs",
                &self.queue_name,
                &row.task_id.to_string(),
                stored,
            );
            let traceparent = trace::traceparent(&span).or_else(|| stored.map(str::to_owned));
            let body = encode_body(&row.payload);
            let mut bytes = body.len();
            let mut entry = SendMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .message_body(body);
            // The workspace as the message group: on a standard queue SQS's fair queues keep
            // one workspace's backlog from delaying the others' messages (I10).
            let owner = replyd_core::proto::record_owner(Some(&row.payload));
            if !owner.is_empty() {
                entry = entry.message_group_id(owner);
            }
            if let Some(value) = traceparent {
                bytes += TRACEPARENT.len() + "String".len() + value.len();
                entry = entry.message_attributes(
                    TRACEPARENT,
                    MessageAttributeValue::builder()
                        .data_type("String")
                        .string_value(value)
                        .build()
                        .expect("data type is set"),
                );
            }
            if bytes > self.max_bytes {
                let reason = format!(
                    "the message is {bytes} bytes (the record in base64 and its attributes), over the queue's MaximumMessageSize of {} bytes",
                    self.max_bytes
                );
                telemetry::outbox_refused(row.outbox_id, &row.task_id.to_string(), &reason);
                published.refused.push((row.outbox_id, reason));
                continue;
            }
            outgoing.push(Outgoing {
                row,
                entry: entry.build().expect("id and body are set"),
                bytes,
            });
        }
        // Batches of at most ten messages and at most the size limit together.
        let mut batch: Vec<Outgoing> = Vec::new();
        let mut batch_bytes = 0;
        for message in outgoing {
            if batch.len() == SQS_BATCH_LIMIT || batch_bytes + message.bytes > self.max_bytes {
                self.send(std::mem::take(&mut batch), &mut published).await;
                batch_bytes = 0;
            }
            batch_bytes += message.bytes;
            batch.push(message);
        }
        if !batch.is_empty() {
            self.send(batch, &mut published).await;
        }
        published
    }

    async fn send(&self, batch: Vec<Outgoing<'_>>, published: &mut Published) {
        let span = tracing::debug_span!("send batch", messages = batch.len());
        let entries = batch.iter().map(|m| m.entry.clone()).collect();
        let answer = self
            .sqs
            .client()
            .send_message_batch()
            .queue_url(&self.queue)
            .set_entries(Some(entries))
            .send()
            .instrument(span)
            .await;
        match answer {
            Ok(answer) => {
                for sent in answer.successful {
                    if let Some(m) = batch.iter().find(|m| m.entry.id == sent.id) {
                        published.sent.push(m.row.outbox_id);
                    }
                }
                for failed in answer.failed {
                    telemetry::sqs_entry_refused(
                        "SendMessageBatch",
                        &failed.code,
                        failed.message.as_deref(),
                    );
                    if let Some(m) = batch.iter().find(|m| m.entry.id == failed.id) {
                        telemetry::outbox_publish_failed(
                            m.row.outbox_id,
                            &format!(
                                "SQS refused the message: {}: {}",
                                failed.code,
                                failed.message.as_deref().unwrap_or("")
                            ),
                        );
                    }
                }
            }
            Err(e) => {
                let error = self.sqs.error("SendMessageBatch", &self.queue, e);
                for m in &batch {
                    telemetry::outbox_publish_failed(m.row.outbox_id, &error.to_string());
                }
            }
        }
    }
}
