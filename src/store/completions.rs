//! Batched completions (`database.batch_completions`): the completions that arrive while one
//! batch is being written go out together as the next, in one call of `replyd_complete_many`
//! (migration V10): one round trip and one transaction for all of them. Nothing waits to fill a
//! batch: an idle store sends a lone completion at once, so a batch grows only under load.
//!
//! Each row is guarded exactly as a single completion is (`replyd_lease_holds`) and answered
//! on its own: one row's refusal does not touch its neighbours. The batch never waits on a row
//! lock: a row another session holds comes back [`BatchAnswer::Busy`] and is then completed
//! alone, by the path that waits on the lock and reads the clock after it.

use std::collections::{HashMap, HashSet};

use tokio_postgres::types::Json as PgJson;
use uuid::Uuid;

use replyd_core::lease::{Lease, Refusal, classify_refusal};
use replyd_core::provider::Generation;

use super::error::StoreError;
use super::fence::{is_own_earlier_write, record_refusal};
use super::gather::{Batch, Gatherer, RowAnswers};
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
pub(crate) struct Completion {
    lease: Lease,
    response: String,
    meta: Option<PgJson<Generation>>,
}

/// Completions gathered into one `replyd_complete_many` call ([`super::gather`]).
pub(crate) struct CompletionBatcher(Gatherer<CompletionRows>);

impl CompletionBatcher {
    /// Starts the writing task on the current runtime. It ends when the last handle is gone.
    pub(crate) fn start(sessions: Sessions, max_rows: usize) -> Self {
        Self(Gatherer::start(
            CompletionRows(sessions),
            max_rows,
            crate::telemetry::names::COMPLETION_BATCH_ROWS,
        ))
    }

    /// Queues one completion and waits for its batch's answer.
    pub(crate) async fn complete(
        &self,
        lease: &Lease,
        response: &str,
        meta: Option<&Generation>,
    ) -> Result<BatchAnswer, StoreError> {
        self.0
            .submit(Completion {
                lease: lease.clone(),
                response: response.to_owned(),
                meta: meta.cloned().map(PgJson),
            })
            .await
    }
}

/// How completions are written together.
pub(crate) struct CompletionRows(Sessions);

impl Batch for CompletionRows {
    type Job = Completion;
    type Answer = BatchAnswer;

    fn alone() -> BatchAnswer {
        BatchAnswer::Busy
    }

    /// Each task once: a repeat whose first answer is still out goes alone.
    fn together(&self, jobs: &[Completion]) -> Vec<usize> {
        let mut seen = HashSet::with_capacity(jobs.len());
        (0..jobs.len())
            .filter(|&i| seen.insert(jobs[i].lease.task_id))
            .collect()
    }

    async fn write(
        &self,
        jobs: &[Completion],
        sent: &[usize],
    ) -> Result<RowAnswers<BatchAnswer>, StoreError> {
        write_rows(&self.0, jobs, sent).await
    }
}

async fn write_rows(
    store: &Sessions,
    batch: &[Completion],
    sent: &[usize],
) -> Result<Vec<(usize, Result<BatchAnswer, String>)>, StoreError> {
    let tasks: Vec<Uuid> = sent.iter().map(|&i| batch[i].lease.task_id).collect();
    let versions: Vec<i64> = sent.iter().map(|&i| batch[i].lease.version).collect();
    let responses: Vec<&str> = sent.iter().map(|&i| batch[i].response.as_str()).collect();
    let metas: Vec<Option<&PgJson<Generation>>> =
        sent.iter().map(|&i| batch[i].meta.as_ref()).collect();
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
