//! Gathering the calls that arrive while one is out into the next: one round trip and one
//! transaction for many rows, under load only. Nothing waits to fill a batch: an idle store
//! sends a lone call at once, so a batch grows only while the previous one is out. The
//! completions and the claims are gathered this way ([`super::completions`],
//! [`super::claims`]); each says what goes together and how its rows are written
//! ([`Batch`]), and this file does the rest once: the queue, the writing task, the answers,
//! and what a failed call means for each waiter.

use std::future::Future;

use tokio::sync::{mpsc, oneshot};

use super::error::StoreError;

/// What a call said of the rows it wrote: each job's index and its answer (an `Err` is that
/// row's own failure, which its caller retries).
pub(crate) type RowAnswers<A> = Vec<(usize, Result<A, String>)>;

/// One kind of batched call.
pub(crate) trait Batch: Send + Sync + 'static {
    /// One caller's row.
    type Job: Send + Sync + 'static;
    /// What the batch says to one caller.
    type Answer: Send + 'static;

    /// The answer of a job that goes alone: one left out of the call (see [`Batch::together`]),
    /// one whose row the call found locked elsewhere, or every job once the writer is gone.
    fn alone() -> Self::Answer;

    /// Which of `jobs` go in one call (their indexes); the rest go alone.
    fn together(&self, jobs: &[Self::Job]) -> Vec<usize>;

    /// Writes the jobs `sent` names in one call, and answers each row it returned.
    fn write(
        &self,
        jobs: &[Self::Job],
        sent: &[usize],
    ) -> impl Future<Output = Result<RowAnswers<Self::Answer>, StoreError>> + Send;
}

type Queued<B> = (
    <B as Batch>::Job,
    oneshot::Sender<Result<<B as Batch>::Answer, String>>,
);

/// The queue of one kind of call and the task that writes it.
pub(crate) struct Gatherer<B: Batch> {
    queue: mpsc::UnboundedSender<Queued<B>>,
}

impl<B: Batch> Gatherer<B> {
    /// Starts the writing task on the current runtime: at most `max_rows` jobs a call, each
    /// call's size recorded in the histogram `rows_metric`. It ends when the last handle is
    /// gone.
    pub(crate) fn start(batch: B, max_rows: usize, rows_metric: &'static str) -> Self {
        let (queue, queued) = mpsc::unbounded_channel();
        tokio::spawn(write_batches(batch, queued, max_rows.max(1), rows_metric));
        Self { queue }
    }

    /// Queues one job and waits for its batch's answer. A writer that is gone (its runtime is
    /// shutting down) answers [`Batch::alone`]; a call whose outcome is unknown is
    /// [`StoreError::Batch`], and the caller retries.
    pub(crate) async fn submit(&self, job: B::Job) -> Result<B::Answer, StoreError> {
        let (answer, answered) = oneshot::channel();
        if self.queue.send((job, answer)).is_err() {
            return Ok(B::alone());
        }
        match answered.await {
            Ok(Ok(answer)) => Ok(answer),
            Ok(Err(message)) => Err(StoreError::Batch(message)),
            Err(_) => Ok(B::alone()),
        }
    }
}

async fn write_batches<B: Batch>(
    batch: B,
    mut queue: mpsc::UnboundedReceiver<Queued<B>>,
    max: usize,
    rows_metric: &'static str,
) {
    let mut queued = Vec::with_capacity(max);
    while queue.recv_many(&mut queued, max).await > 0 {
        let (jobs, waiters): (Vec<B::Job>, Vec<_>) = queued.drain(..).unzip();
        let answers = write(&batch, &jobs).await;
        metrics::histogram!(rows_metric).record(jobs.len() as f64);
        for (waiter, answer) in waiters.into_iter().zip(answers) {
            // A waiter that went away (cancelled) does not mind.
            let _ = waiter.send(answer);
        }
    }
}

/// Writes one batch; one answer per job, in order.
async fn write<B: Batch>(batch: &B, jobs: &[B::Job]) -> Vec<Result<B::Answer, String>> {
    let sent = batch.together(jobs);
    let mut answers: Vec<Result<B::Answer, String>> =
        (0..jobs.len()).map(|_| Ok(B::alone())).collect();
    match batch.write(jobs, &sent).await {
        Ok(outcomes) => {
            for (i, outcome) in outcomes {
                answers[i] = outcome;
            }
        }
        Err(e) => {
            // The call's outcome is unknown (it may have committed): each caller retries, and
            // every batched write answers a repeat as the first one's (a completion as this
            // assignment's own reply, a claim with its own earlier lease).
            let message = e.to_string();
            for &i in &sent {
                answers[i] = Err(message.clone());
            }
        }
    }
    answers
}
