//! The outbox's SQL: a batch of unpublished rows taken with `FOR UPDATE SKIP LOCKED` (so many
//! relays share the table without publishing one row twice at once), marked published in the
//! same transaction once the sink (Kafka or SQS) has acknowledged them, and published rows deleted after their
//! retention in bounded batches. A relay that dies between the publish and the commit leaves
//! its rows unpublished: the next relay publishes them again, and the worker absorbs the
//! duplicate record (the task's id is its identity).

use std::time::Duration;

use tokio_postgres::Transaction;

use super::{Store, StoreError};

/// One row to publish.
#[derive(Debug, Clone)]
pub struct OutboxRow {
    pub outbox_id: i64,
    pub task_id: uuid::Uuid,
    pub record_key: String,
    pub payload: Vec<u8>,
    /// The writing request's trace context, sent on as the record's header.
    pub traceparent: Option<String>,
}

/// What one batch's publish did: the rows the broker acknowledged, and the rows it refused for
/// good (a record it will never take, e.g. over the topic's `max.message.bytes`) with why.
/// Rows in neither stay for the next batch.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Published {
    pub sent: Vec<i64>,
    pub refused: Vec<(i64, String)>,
}

/// How far behind the outbox is.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OutboxLag {
    pub unpublished: i64,
    /// Age of the oldest unpublished row (database clock), 0 when none.
    pub oldest_seconds: f64,
}

impl Store {
    /// Takes up to `limit` unpublished rows, oldest first, skipping rows another relay holds;
    /// hands them to `publish` and, in the same transaction, marks the ones it sent as
    /// published and the ones the broker refused for good as refused, failing their tasks
    /// (see [`REFUSE`]). `publish` must finish well within
    /// `idle_in_transaction_session_timeout`. Returns how many rows were sent and refused.
    pub async fn relay_batch<F, Fut>(
        &self,
        limit: i64,
        publish: F,
    ) -> Result<(usize, usize), StoreError>
    where
        F: FnOnce(Vec<OutboxRow>) -> Fut,
        Fut: std::future::Future<Output = Published>,
    {
        let mut client = self.client().await?;
        let tx = client.transaction().await?;
        let rows = take_batch(&tx, limit).await?;
        if rows.is_empty() {
            tx.commit().await?;
            return Ok((0, 0));
        }
        let published = publish(rows).await;
        if !published.sent.is_empty() {
            tx.execute(
                "UPDATE outbox SET published_at = clock_timestamp() WHERE outbox_id = ANY($1)",
                &[&published.sent],
            )
            .await?;
        }
        if !published.refused.is_empty() {
            let (ids, reasons): (Vec<i64>, Vec<String>) = published.refused.iter().cloned().unzip();
            // Nothing ever ran for these tasks: their reservations are released, whatever
            // `quota.charge_failed` says of failures (the settlement trigger reads this).
            tx.batch_execute("SET LOCAL replyd.settle_as = 'released'")
                .await?;
            tx.execute(REFUSE, &[&ids, &reasons]).await?;
        }
        tx.commit().await?;
        Ok((published.sent.len(), published.refused.len()))
    }

    /// Deletes up to `limit` rows published (or refused) more than `retention` ago; returns
    /// how many.
    pub async fn purge_outbox(&self, retention: Duration, limit: i64) -> Result<u64, StoreError> {
        let client = self.client().await?;
        Ok(client
            .execute(
                "DELETE FROM outbox WHERE outbox_id IN (SELECT outbox_id FROM outbox \
                 WHERE coalesce(published_at, refused_at) < clock_timestamp() - make_interval(secs => $1) \
                 ORDER BY outbox_id LIMIT $2)",
                &[&retention.as_secs_f64(), &limit],
            )
            .await?)
    }

    /// Deletes up to `limit` idempotency records past their `expires_at`: such a key is
    /// already treated as new by the intake, so the row only takes room.
    pub async fn purge_idempotency_keys(&self, limit: i64) -> Result<u64, StoreError> {
        let client = self.client().await?;
        Ok(client
            .execute(
                "DELETE FROM idempotency_keys \
                 WHERE (workspace_id, end_user_id, operation, idempotency_key) IN \
                 (SELECT workspace_id, end_user_id, operation, idempotency_key FROM idempotency_keys \
                  WHERE expires_at < clock_timestamp() ORDER BY expires_at LIMIT $1)",
                &[&limit],
            )
            .await?)
    }

    pub async fn outbox_lag(&self) -> Result<OutboxLag, StoreError> {
        let row = self
            .row(
                "SELECT count(*), coalesce(extract(epoch FROM clock_timestamp() - min(created_at)), 0)::float8 \
                 FROM outbox WHERE published_at IS NULL AND refused_at IS NULL",
                &[],
            )
            .await?;
        Ok(OutboxLag {
            unpublished: row.get(0),
            oldest_seconds: row.get(1),
        })
    }
}

async fn take_batch(tx: &Transaction<'_>, limit: i64) -> Result<Vec<OutboxRow>, StoreError> {
    let rows = tx
        .query(
            "SELECT outbox_id, task_id, record_key, payload, traceparent FROM outbox \
             WHERE published_at IS NULL AND refused_at IS NULL \
             ORDER BY outbox_id LIMIT $1 FOR UPDATE SKIP LOCKED",
            &[&limit],
        )
        .await?;
    Ok(rows
        .iter()
        .map(|r| OutboxRow {
            outbox_id: r.get(0),
            task_id: r.get(1),
            record_key: r.get(2),
            payload: r.get(3),
            traceparent: r.get(4),
        })
        .collect())
}

/// Marks refused rows (`$1` ids, `$2` the broker's reasons) and fails their tasks with the
/// reason, in the relay's transaction: the status change notifies every follower of the task
/// (the trigger of `migrations/V3`) and settles its reservation. Only a task still pending is
/// failed: one already claimed had a copy of its record published before (a relay that died
/// between publish and mark), and that copy's outcome stands.
const REFUSE: &str = "WITH refused AS ( \
       UPDATE outbox o SET refused_at = clock_timestamp(), refusal = r.reason \
         FROM unnest($1::bigint[], $2::text[]) AS r(id, reason) \
        WHERE o.outbox_id = r.id RETURNING o.task_id, o.refusal) \
     UPDATE reply_tasks t SET status = 'failed', \
            failure = 'the broker refused the task''s record for good: ' || refused.refusal, \
            finished_at = clock_timestamp(), updated_at = clock_timestamp() \
       FROM refused WHERE t.task_id = refused.task_id AND t.status = 'pending'";
