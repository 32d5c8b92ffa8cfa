//! Batched claims (`database.batch_claims`): the claims that arrive while one batch is being
//! written go out together as the next, in one call of `replyd_claim_many` (migration V12):
//! one round trip and one transaction for all of them. Nothing waits to fill a batch.
//!
//! Each row is claimed by `replyd_claim` itself, inside the batch, so the decision is the lone
//! claim's. The batch never waits on a row lock: a row another session holds comes back
//! [`ClaimAnswer::Busy`] and is then claimed alone, by the path that waits on the lock.

use std::collections::HashSet;
use std::time::Duration;

use tokio_postgres::types::Json as PgJson;
use uuid::Uuid;

use super::error::StoreError;
use super::gather::{Batch, Gatherer, RowAnswers};
use super::rows::{Taken, insert_columns, seconds, taken_from};
use super::sessions::Sessions;
use replyd_core::domain::{ProviderRequest, RecordSource, TaskId, TaskSpec};

/// What the batch said about one claim.
#[derive(Debug)]
pub(crate) enum ClaimAnswer {
    Done(Box<Taken>),
    /// The row was locked by someone else, the same task was already in this batch, or the
    /// claim's owner or lease differs from the batch's: claim it alone. `inserted` says whether
    /// the batch inserted the record's task first.
    Busy {
        inserted: bool,
    },
}

/// One claim as the store is asked for it, written in a batch ([`ClaimBatcher::claim`]) or
/// alone.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClaimCall<'a> {
    pub task_id: TaskId,
    pub owner: &'a str,
    pub lease: Duration,
    /// The record's task, inserted first if it is absent.
    pub insert: Option<&'a TaskSpec>,
    /// The record the claim is made for.
    pub source: Option<RecordSource>,
}

/// One claim waiting for its batch.
pub(crate) struct Claim {
    task_id: Uuid,
    owner: String,
    lease: Duration,
    insert: Option<TaskSpec>,
    source: Option<RecordSource>,
}

/// Claims gathered into one `replyd_claim_many` call ([`super::gather`]).
pub(crate) struct ClaimBatcher(Gatherer<ClaimRows>);

impl ClaimBatcher {
    /// Starts the writing task on the current runtime. It ends when the last handle is gone.
    pub(crate) fn start(sessions: Sessions, max_rows: usize) -> Self {
        Self(Gatherer::start(
            ClaimRows(sessions),
            max_rows,
            crate::telemetry::names::CLAIM_BATCH_ROWS,
        ))
    }

    /// Queues one claim and waits for its batch's answer.
    pub(crate) async fn claim(&self, call: ClaimCall<'_>) -> Result<ClaimAnswer, StoreError> {
        self.0
            .submit(Claim {
                task_id: call.task_id.as_uuid(),
                owner: call.owner.to_owned(),
                lease: call.lease,
                insert: call.insert.cloned(),
                source: call.source,
            })
            .await
    }
}

/// How claims are written together.
pub(crate) struct ClaimRows(Sessions);

impl Batch for ClaimRows {
    type Job = Claim;
    type Answer = ClaimAnswer;

    fn alone() -> ClaimAnswer {
        ClaimAnswer::Busy { inserted: false }
    }

    /// One owner and lease (every claim of a worker has the same), each task once.
    fn together(&self, jobs: &[Claim]) -> Vec<usize> {
        let (owner, lease) = (&jobs[0].owner, jobs[0].lease);
        let mut seen = HashSet::with_capacity(jobs.len());
        (0..jobs.len())
            .filter(|&i| {
                let job = &jobs[i];
                job.owner == *owner && job.lease == lease && seen.insert(job.task_id)
            })
            .collect()
    }

    async fn write(
        &self,
        jobs: &[Claim],
        sent: &[usize],
    ) -> Result<RowAnswers<ClaimAnswer>, StoreError> {
        let (owner, lease) = (&jobs[sent[0]].owner, jobs[sent[0]].lease);
        write_rows(&self.0, jobs, sent, owner, lease).await
    }
}

/// One text column of the tasks to insert: `field` of each sent claim's task, none for a claim
/// that inserts nothing.
fn text_column<'a>(
    batch: &'a [Claim],
    sent: &[usize],
    field: fn(&TaskSpec) -> &String,
) -> Vec<Option<&'a str>> {
    sent.iter()
        .map(|&i| batch[i].insert.as_ref().map(|s| field(s).as_str()))
        .collect()
}

async fn write_rows(
    store: &Sessions,
    batch: &[Claim],
    sent: &[usize],
    owner: &str,
    lease: Duration,
) -> Result<Vec<(usize, Result<ClaimAnswer, String>)>, StoreError> {
    let spec = |i: usize| batch[i].insert.as_ref();
    let tasks: Vec<Uuid> = sent.iter().map(|&i| batch[i].task_id).collect();
    let workspaces = text_column(batch, sent, |s| &s.workspace_id);
    let conversations = text_column(batch, sent, |s| &s.conversation_id);
    let messages = text_column(batch, sent, |s| &s.message_id);
    let versions = text_column(batch, sent, |s| &s.document_version);
    let mut requests: Vec<Option<PgJson<&ProviderRequest>>> = Vec::with_capacity(sent.len());
    let mut max_attempts: Vec<Option<i32>> = Vec::with_capacity(sent.len());
    for &i in sent {
        let (request, attempts) = spec(i)
            .map(|s| insert_columns(batch[i].task_id, s))
            .transpose()?
            .unzip();
        requests.push(request);
        max_attempts.push(attempts);
    }
    let deadlines: Vec<Option<chrono::DateTime<chrono::Utc>>> = sent
        .iter()
        .map(|&i| spec(i).and_then(|s| s.deadline))
        .collect();
    let partitions: Vec<Option<i32>> = sent
        .iter()
        .map(|&i| batch[i].source.map(|s| s.partition))
        .collect();
    let offsets: Vec<Option<i64>> = sent
        .iter()
        .map(|&i| batch[i].source.map(|s| s.offset))
        .collect();
    let held: Vec<bool> = sent
        .iter()
        .map(|&i| batch[i].source.is_some_and(|s| s.held_alone))
        .collect();
    let client = store.client().await?;
    let statement = client
        .prepare_cached(
            "SELECT * FROM replyd_claim_many($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, \
             $13)",
        )
        .await?;
    let rows = client
        .query(
            &statement,
            &[
                &tasks,
                &owner,
                &seconds(lease),
                &workspaces,
                &conversations,
                &messages,
                &versions,
                &requests,
                &max_attempts,
                &deadlines,
                &partitions,
                &offsets,
                &held,
            ],
        )
        .await?;
    let index: std::collections::HashMap<Uuid, usize> =
        sent.iter().map(|&i| (batch[i].task_id, i)).collect();
    let mut outcomes = Vec::with_capacity(rows.len());
    for row in rows {
        let task: Uuid = row.get("input_task");
        let Some(&i) = index.get(&task) else {
            continue;
        };
        let inserted: bool = row.get("inserted");
        let answer = if row.get::<_, bool>("busy") {
            Ok(ClaimAnswer::Busy { inserted })
        } else {
            taken_from(task, &row, spec(i), inserted)
                .map(|taken| ClaimAnswer::Done(Box::new(taken)))
                .map_err(|e| e.to_string())
        };
        outcomes.push((i, answer));
    }
    Ok(outcomes)
}
