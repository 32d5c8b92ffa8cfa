//! The intake transaction of `POST /v1/replies` (I6): the user's message, its reply task, the
//! idempotency record and the outbox row are written in one transaction, or nothing is. The
//! unique key of the idempotency record decides between concurrent first requests with one
//! key: the loser's insert waits for the winner's transaction, finds the row, and answers with
//! the winner's task. A reuse is judged by [`crate::idempotency::decide_reuse`] on the
//! database clock.

use chrono::{DateTime, TimeDelta, Utc};
use prost::Message as _;
use uuid::Uuid;

use crate::domain::{ChatMessage, ProviderRequest, Role, TaskId, TaskSpec};
use crate::idempotency::{BoundInputs, IdempotencyKey, Operation, Reuse, decide_reuse};

use super::{Store, StoreError};

/// A submission, as the API parsed it.
#[derive(Debug, Clone)]
pub struct Submission {
    pub workspace_id: String,
    pub operation: Operation,
    pub key: IdempotencyKey,
    pub inputs: BoundInputs,
    pub max_attempts: u32,
    /// How long the key is remembered.
    pub retention: TimeDelta,
    /// A regenerate answers an existing message again: its id, and no new message row.
    pub existing_message: Option<String>,
}

/// What the intake did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Submitted {
    /// New work: message, task, key and outbox row written.
    Created { task_id: TaskId },
    /// The same request again: the existing task, nothing written.
    Replayed { task_id: TaskId },
    /// The key was used with other inputs; nothing written.
    Mismatch { fields: Vec<&'static str> },
}

/// The provider request a submission asks for: the context as a system message, then the
/// user's message.
pub fn provider_request(inputs: &BoundInputs) -> ProviderRequest {
    let mut messages = Vec::new();
    if let Some(context) = inputs.context.as_ref().filter(|c| !c.is_empty()) {
        messages.push(ChatMessage {
            role: Role::System,
            content: context.clone(),
        });
    }
    messages.push(ChatMessage {
        role: Role::User,
        content: inputs.message.clone(),
    });
    ProviderRequest {
        model: inputs.model.clone(),
        messages,
        max_output_tokens: inputs.max_output_tokens,
    }
}

impl Store {
    /// Runs the intake transaction. A key whose record expired between the attempt and the
    /// read is tried once more as new work.
    pub async fn submit(&self, submission: &Submission) -> Result<Submitted, StoreError> {
        for _ in 0..2 {
            if let Some(done) = self.try_submit(submission).await? {
                return Ok(done);
            }
        }
        Err(StoreError::Config(
            "an idempotency record kept expiring while it was read".into(),
        ))
    }

    async fn try_submit(&self, s: &Submission) -> Result<Option<Submitted>, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let op = s.operation.as_str();
        // A remembered key past its retention is new work: take its row out first.
        tx.execute(
            "DELETE FROM idempotency_keys WHERE workspace_id = $1 AND operation = $2 \
             AND idempotency_key = $3 AND expires_at <= clock_timestamp()",
            &[&s.workspace_id, &op, &s.key.as_str()],
        )
        .await?;
        let task_id = TaskId::new_random();
        let message_id = Uuid::new_v4();
        let message_ref = s
            .existing_message
            .clone()
            .unwrap_or_else(|| message_id.to_string());
        let request = serde_json::to_value(&s.inputs)
            .map_err(|e| StoreError::Config(format!("bound inputs: {e}")))?;
        // The reply task must exist before the key refers to it; both are in this
        // transaction, so a loser of the key never leaves a task behind (it rolls back).
        let spec = TaskSpec {
            task_id,
            workspace_id: s.workspace_id.clone(),
            conversation_id: s.inputs.conversation_id.clone(),
            message_id: message_ref,
            document_version: s.inputs.document_version.clone(),
            request: provider_request(&s.inputs),
            max_attempts: s.max_attempts,
            deadline: None,
        };
        let provider_request = serde_json::to_value(&spec.request)
            .map_err(|e| StoreError::Config(format!("request: {e}")))?;
        let max_attempts = i32::try_from(spec.max_attempts)
            .map_err(|_| StoreError::Config("max_attempts over i32".into()))?;
        tx.execute(
            "INSERT INTO reply_tasks (task_id, workspace_id, conversation_id, message_id, \
             document_version, request, max_attempts) VALUES ($1, $2, $3, $4, $5, $6, $7)",
            &[
                &task_id.as_uuid(),
                &spec.workspace_id,
                &spec.conversation_id,
                &spec.message_id,
                &spec.document_version,
                &provider_request,
                &max_attempts,
            ],
        )
        .await?;
        let retention_s = s.retention.as_seconds_f64();
        // The unique key decides: a concurrent first request's insert waits here for the
        // winner's commit, then inserts nothing.
        let won = tx
            .query_opt(
                "INSERT INTO idempotency_keys (workspace_id, operation, idempotency_key, \
                 request_hash, request, task_id, expires_at) \
                 VALUES ($1, $2, $3, $4, $5, $6, clock_timestamp() + make_interval(secs => $7)) \
                 ON CONFLICT DO NOTHING RETURNING task_id",
                &[
                    &s.workspace_id,
                    &op,
                    &s.key.as_str(),
                    &s.inputs.hash(),
                    &request,
                    &task_id.as_uuid(),
                    &retention_s,
                ],
            )
            .await?
            .is_some();
        if won {
            if s.existing_message.is_none() {
                tx.execute(
                    "INSERT INTO messages (message_id, workspace_id, conversation_id, content) \
                     VALUES ($1, $2, $3, $4)",
                    &[
                        &message_id,
                        &s.workspace_id,
                        &s.inputs.conversation_id,
                        &s.inputs.message,
                    ],
                )
                .await?;
            }
            tx.execute(
                "INSERT INTO outbox (task_id, record_key, payload) VALUES ($1, $2, $3)",
                &[
                    &task_id.as_uuid(),
                    &spec.conversation_id,
                    &spec.to_proto().encode_to_vec(),
                ],
            )
            .await?;
            tx.commit().await?;
            return Ok(Some(Submitted::Created { task_id }));
        }
        // Lost (or a retry): nothing of this attempt may stay.
        tx.rollback().await?;
        let Some(row) = client
            .query_opt(
                "SELECT request_hash, request, task_id, expires_at, clock_timestamp() AS now \
                 FROM idempotency_keys \
                 WHERE workspace_id = $1 AND operation = $2 AND idempotency_key = $3",
                &[&s.workspace_id, &op, &s.key.as_str()],
            )
            .await?
        else {
            // Purged between the insert and this read: try again as new work.
            return Ok(None);
        };
        let stored: BoundInputs = serde_json::from_value(row.get("request"))
            .map_err(|e| StoreError::Config(format!("stored bound inputs: {e}")))?;
        let stored_hash: String = row.get("request_hash");
        let expires_at: DateTime<Utc> = row.get("expires_at");
        let now: DateTime<Utc> = row.get("now");
        let task: Uuid = row.get("task_id");
        Ok(
            match decide_reuse(&stored_hash, &stored, expires_at, &s.inputs, now) {
                Reuse::Replay => Some(Submitted::Replayed {
                    task_id: TaskId::from(task),
                }),
                Reuse::Mismatch { fields } => Some(Submitted::Mismatch { fields }),
                Reuse::Expired => None,
            },
        )
    }
}
