//! Batched completions (`database.batch_completions`): the completions that arrive while one
//! batch is being written go out together as the next, in one call of `replyd_complete_many`
//! (migration V10): one round trip and one transaction for all of them. Nothing waits to fill a
//! batch: an idle store sends a lone completion at once, so a batch grows only under load.
//!
//! Each row is guarded exactly as a single completion is (`replyd_lease_holds`) and answered
//! on its own: one row's refusal does not touch its neighbours. The batch never waits on a row
//! lock: a row another session holds comes back [`BatchAnswer::Busy`] and is then completed
//! alone, by the path that waits on the lock and reads the clock after it.

use std::collections::HashMap;

use serde_json::Value as Json;
use tokio::sync::{mpsc, oneshot};
use uuid::Uuid;

use replyd_core::lease::{Lease, Refusal, classify_refusal};

use super::error::StoreError;
use super::fence::{is_own_earlier_write, record_refusal};
use super::rows::{CompletionOutcome, snapshot_from};
use super::sessions::Sessions;

/// What the batch said about one completion.
#[derive(Debug)]
pub(crate) enum BatchAnswer {
    Done(CompletionOutcome),
    /// The row was locked by someone else (or the same task was already in this batch): send
    /// the completion alone.
    Busy,
}

/// One completion waiting for its batch.
struct Pending {
    lease: Lease,
    response: String,
    meta: Option<Json>,
    answer: oneshot::Sender<Result<BatchAnswer, String>>,
}

/// The queue of completions and the task that writes them.
#[derive(Debug)]
pub(crate) struct CompletionBatcher {
    queue: mpsc::UnboundedSender<Pending>,
}

impl CompletionBatcher {
    /// Starts the writing task on the current runtime. It ends when the last handle is gone.
    pub(crate) fn start(store: Sessions, max_rows: usize) -> Self {
        let (queue, pending) = mpsc::unbounded_channel();
        tokio::spawn(write_batches(store, pending, max_rows.max(1)));
        Self { queue }
    }

    /// Queues one completion and waits for its batch's answer.
    pub(crate) async fn complete(
        &self,
        lease: &Lease,
        response: &str,
        meta: Option<&Json>,
    ) -> Result<BatchAnswer, StoreError> {
        let (answer, answered) = oneshot::channel();
        let pending = Pending {
            lease: lease.clone(),
            response: response.to_owned(),
            meta: meta.cloned(),
            answer,
        };
        if self.queue.send(pending).is_err() {
            // The writing task is gone (its runtime is shutting down): go alone.
            return Ok(BatchAnswer::Busy);
        }
        match answered.await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(message)) => Err(StoreError::Batch(message)),
            Err(_) => Ok(BatchAnswer::Busy),
        }
    }
}

async fn write_batches(store: Sessions, mut queue: mpsc::UnboundedReceiver<Pending>, max: usize) {
    let mut batch = Vec::with_capacity(max);
    while queue.recv_many(&mut batch, max).await > 0 {
        let rows = batch.len();
        let answers = write(&store, &mut batch).await;
        metrics::histogram!(crate::telemetry::names::COMPLETION_BATCH_ROWS).record(rows as f64);
        for (pending, answer) in batch.drain(..).zip(answers) {
            // A waiter that went away (cancelled) does not mind.
            let _ = pending.answer.send(answer);
        }
    }
}

/// Writes one batch; one answer per pending completion, in order.
async fn write(store: &Sessions, batch: &mut [Pending]) -> Vec<Result<BatchAnswer, String>> {
    // A task twice in one batch (a repeat whose first answer is still out) goes alone.
    let mut first: HashMap<Uuid, usize> = HashMap::with_capacity(batch.len());
    let mut sent = Vec::with_capacity(batch.len());
    for (i, pending) in batch.iter().enumerate() {
        if first.insert(pending.lease.task_id, i).is_none() {
            sent.push(i);
        }
    }
    let mut answers: Vec<Result<BatchAnswer, String>> =
        (0..batch.len()).map(|_| Ok(BatchAnswer::Busy)).collect();
    match write_rows(store, batch, &sent).await {
        Ok(outcomes) => {
            for (i, outcome) in outcomes {
                answers[i] = outcome;
            }
        }
        Err(e) => {
            // The batch's outcome is unknown (it may have committed): each caller retries, and a
            // repeat of a write that went through is answered as this assignment's own reply.
            let message = e.to_string();
            for &i in &sent {
                answers[i] = Err(message.clone());
            }
        }
    }
    answers
}

async fn write_rows(
    store: &Sessions,
    batch: &[Pending],
    sent: &[usize],
) -> Result<Vec<(usize, Result<BatchAnswer, String>)>, StoreError> {
    let tasks: Vec<Uuid> = sent.iter().map(|&i| batch[i].lease.task_id).collect();
    let versions: Vec<i64> = sent.iter().map(|&i| batch[i].lease.version).collect();
    let responses: Vec<&str> = sent.iter().map(|&i| batch[i].response.as_str()).collect();
    let metas: Vec<Option<&Json>> = sent.iter().map(|&i| batch[i].meta.as_ref()).collect();
    let client = store.client().await?;
    let statement = client
        .prepare_cached("SELECT * FROM replyd_complete_many($1, $2, $3, $4)")
        .await?;
    let rows = client
        .query(&statement, &[&tasks, &versions, &responses, &metas])
        .await?;
    let index: HashMap<Uuid, usize> = sent.iter().map(|&i| (batch[i].lease.task_id, i)).collect();
    let mut outcomes = Vec::with_capacity(rows.len());
    for row in rows {
        let task: Uuid = row.get("task_id");
        let Some(&i) = index.get(&task) else {
            continue;
        };
        let lease = &batch[i].lease;
        let answer = if row.get::<_, bool>("accepted") {
            Ok(BatchAnswer::Done(CompletionOutcome::Accepted))
        } else if row.get::<_, bool>("busy") {
            Ok(BatchAnswer::Busy)
        } else if row.get::<_, Option<String>>("status").is_none() {
            Ok(BatchAnswer::Done(CompletionOutcome::Refused(
                Refusal::NotFound,
            )))
        } else {
            let refusal = classify_refusal(&snapshot_from(task, &row)?, lease.version);
            // Recorded after the batch's commit, like a lone refusal; a failure here is this
            // row's alone: its caller retries and the refusal is recorded then.
            if is_own_earlier_write(&refusal) {
                Ok(BatchAnswer::Done(CompletionOutcome::Refused(refusal)))
            } else {
                match record_refusal(&client, lease, &refusal).await {
                    Ok(()) => Ok(BatchAnswer::Done(CompletionOutcome::Refused(refusal))),
                    Err(e) => Err(e.to_string()),
                }
            }
        };
        outcomes.push((i, answer));
    }
    Ok(outcomes)
}
