//! Retries of failed tasks (`replyd tasks retry`): each is a new task for the same work, with
//! a new attempt budget, written with its outbox row (the relay hands it to the workers) and,
//! where the workspace has a quota, its reservation, in one transaction. The failed task stays
//! failed with its history and its settled reservation, so nothing is settled twice (I8), and
//! the new task names it (`retry_of`, unique): a second retry of the same failed task finds
//! the first instead of making another.

use chrono::{DateTime, Utc};
use prost::Message as _;
use uuid::Uuid;

use replyd_core::domain::{ProviderRequest, TaskId, TaskSpec};
use replyd_core::quota::QuotaPolicy;

use super::quota::{ADMIT, QuotaRefusal};
use super::{Store, StoreError};

/// Which failed tasks to retry.
#[derive(Debug, Clone, Default)]
pub struct RetrySelection {
    pub workspace: Option<String>,
    /// Failed at or after this time.
    pub since: Option<DateTime<Utc>>,
    /// Failed before this time.
    pub until: Option<DateTime<Utc>>,
    /// Whose failure reason contains this text (say, the provider's status during an outage).
    pub reason_contains: Option<String>,
    pub limit: i64,
}

/// A failed task that no retry names yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailedTask {
    pub task_id: TaskId,
    pub workspace_id: String,
}

/// What a retry did.
#[derive(Debug, Clone, PartialEq)]
pub enum Retried {
    /// The new task, its outbox row and its reservation are written.
    Created { task_id: TaskId },
    /// A retry of it exists already: that task.
    Already { task_id: TaskId },
    /// The task is not failed (it never was, or is gone).
    NotFailed,
    /// The workspace's quota does not admit more work now; nothing written.
    OverQuota(QuotaRefusal),
}

const INSERT_RETRY: &str = "INSERT INTO reply_tasks (task_id, workspace_id, conversation_id, \
     message_id, document_version, request, max_attempts, retry_of) \
     SELECT $1, workspace_id, conversation_id, message_id, document_version, request, \
            coalesce($3, max_attempts), task_id \
     FROM reply_tasks WHERE task_id = $2 AND status = 'failed' \
     ON CONFLICT (retry_of) WHERE retry_of IS NOT NULL DO NOTHING \
     RETURNING workspace_id, conversation_id, message_id, document_version, request, max_attempts";

impl Store {
    /// Failed tasks no retry names yet, the oldest failure first.
    pub async fn failed_tasks(&self, s: &RetrySelection) -> Result<Vec<FailedTask>, StoreError> {
        let rows = self
            .rows(
                "SELECT t.task_id, t.workspace_id FROM reply_tasks t \
                 WHERE t.status = 'failed' \
                   AND NOT EXISTS (SELECT 1 FROM reply_tasks r WHERE r.retry_of = t.task_id) \
                   AND ($1::text IS NULL OR t.workspace_id = $1) \
                   AND ($2::timestamptz IS NULL OR t.finished_at >= $2) \
                   AND ($3::timestamptz IS NULL OR t.finished_at < $3) \
                   AND ($4::text IS NULL OR strpos(t.failure, $4) > 0) \
                 ORDER BY t.finished_at, t.task_id LIMIT $5",
                &[
                    &s.workspace,
                    &s.since,
                    &s.until,
                    &s.reason_contains,
                    &s.limit,
                ],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|row| FailedTask {
                task_id: TaskId::from(row.get::<_, Uuid>(0)),
                workspace_id: row.get(1),
            })
            .collect())
    }

    /// Retries `failed` as a new task with `max_attempts` (the failed task's budget when
    /// `None`), admitted under `quota` where the workspace has a counter.
    pub async fn retry_failed(
        &self,
        failed: TaskId,
        max_attempts: Option<u32>,
        quota: &QuotaPolicy,
    ) -> Result<Retried, StoreError> {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let task_id = TaskId::new_random();
        let budget = max_attempts
            .map(|n| {
                i32::try_from(n).map_err(|_| StoreError::Config("max_attempts over i32".into()))
            })
            .transpose()?;
        let Some(row) = tx
            .query_opt(
                INSERT_RETRY,
                &[&task_id.as_uuid(), &failed.as_uuid(), &budget],
            )
            .await?
        else {
            tx.rollback().await?;
            let existing = client
                .query_opt(
                    "SELECT task_id FROM reply_tasks WHERE retry_of = $1",
                    &[&failed.as_uuid()],
                )
                .await?;
            return Ok(match existing {
                Some(row) => Retried::Already {
                    task_id: TaskId::from(row.get::<_, Uuid>(0)),
                },
                None => Retried::NotFailed,
            });
        };
        let request: ProviderRequest = serde_json::from_value(row.get("request"))
            .map_err(|e| StoreError::Config(format!("stored request of task {failed}: {e}")))?;
        let max_attempts: i32 = row.get("max_attempts");
        let spec = TaskSpec {
            task_id,
            workspace_id: row.get("workspace_id"),
            conversation_id: row.get("conversation_id"),
            message_id: row.get("message_id"),
            document_version: row.get("document_version"),
            request,
            max_attempts: max_attempts as u32,
            deadline: None,
        };
        // The failed task's ceiling, where it had a reservation: what its work was allowed.
        let ceiling: i64 = tx
            .query_opt(
                "SELECT token_ceiling FROM quota_reservations WHERE task_id = $1",
                &[&failed.as_uuid()],
            )
            .await?
            .map_or(0, |r| r.get(0));
        let has_counter = tx
            .query_opt(
                "SELECT 1 FROM quota_counters WHERE workspace_id = $1",
                &[&spec.workspace_id],
            )
            .await?
            .is_some();
        if has_counter {
            let admitted = tx
                .query_opt(
                    ADMIT,
                    &[
                        &spec.workspace_id,
                        &task_id.as_uuid(),
                        &"retry",
                        &failed.to_string(),
                        &quota.pending_reserves,
                        &quota.reservation_ttl.as_secs_f64(),
                        &quota.charge_failed,
                        &ceiling,
                        // An operator's retry is the workspace's, not an end user's.
                        &None::<String>,
                    ],
                )
                .await?;
            if admitted.is_none() {
                tx.rollback().await?;
                drop(client);
                let refusal = self
                    .quota_refusal(&spec.workspace_id, ceiling)
                    .await?
                    .ok_or_else(|| {
                        StoreError::Config(format!(
                            "workspace {} has no quota counter",
                            spec.workspace_id
                        ))
                    })?;
                return Ok(Retried::OverQuota(refusal));
            }
        }
        tx.execute(
            "INSERT INTO outbox (task_id, record_key, payload) VALUES ($1, $2, $3)",
            &[
                &task_id.as_uuid(),
                &spec.record_key(),
                &spec.to_proto().encode_to_vec(),
            ],
        )
        .await?;
        tx.commit().await?;
        Ok(Retried::Created { task_id })
    }
}
