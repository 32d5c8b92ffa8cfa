//! The SQS source of a worker: receives messages in batches (long polling), runs each through
//! the record handler (the same pipeline and runner as a Kafka record), and settles each by what
//! the handler says:
//! - `Done` (the task is terminal, or the message kept as a dead letter): deleted, in batches,
//!   with the newest receipt handle this worker has for it (I3).
//! - `HandedBack` (another worker holds the task): made visible again when that lease ends, not
//!   held in memory meanwhile; when it comes back its task is done (deleted then) or free.
//! - `Cancelled` (the worker is stopping): made visible again at once, for another worker.
//!
//! Meanwhile every held message's visibility is extended every third of
//! `sqs.visibility_timeout_seconds`, in batches of ten, so only a worker that dies or stalls
//! lets its messages reappear; the task's lease, not the visibility, decides who may work on it
//! (a stalled worker's messages come back to others, and its late write is fenced, I2).
//!
//! At most `sqs.max_in_flight` messages run at once; a receive asks for no more than the free
//! slots. A message delivered again while held (SQS Standard may, within its window) starts
//! nothing; its newest handle is kept ([`super::inflight`]).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use aws_sdk_sqs::types::{
    ChangeMessageVisibilityBatchRequestEntry, DeleteMessageBatchRequestEntry,
    MessageSystemAttributeName,
};
use futures_util::FutureExt as _;
use tokio::sync::{Semaphore, mpsc};
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::inflight::{Arrival, InFlight};
use super::message::SqsMessage;
use super::settings::{MAX_VISIBILITY_TIMEOUT_SECONDS, SQS_BATCH_LIMIT, SqsSettings};
use super::{Sqs, SqsError};
use crate::probes::Heartbeat;
use crate::telemetry::{self, RepeatedFailure};
use crate::transport::source::{Holding, RecordHandler, RecordOutcome, WindowSlot};

/// Live facts about the source, for `/readyz` and tests.
#[derive(Debug, Default)]
pub struct SourceStatus {
    /// The last receive call answered (cleared when one fails).
    pub receiving: AtomicBool,
    /// Beaten on every turn of the receive loop, also while a long poll waits.
    pub heartbeat: Arc<Heartbeat>,
    /// Messages held now.
    pub held: AtomicUsize,
    /// The last failed receive, said for readiness.
    pub last_error: Mutex<Option<String>>,
}

/// How one message is let go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Settle {
    Delete,
    /// Visible again after this many seconds.
    Show(i32),
}

impl Settle {
    fn of(outcome: RecordOutcome) -> Self {
        match outcome {
            RecordOutcome::Done(_) => Settle::Delete,
            RecordOutcome::Cancelled => Settle::Show(0),
            RecordOutcome::HandedBack { after } => Settle::Show(hand_back_seconds(after)),
        }
    }
}

/// Whole seconds (SQS's unit) a handed-back message stays hidden: at least one, so it does
/// not bounce straight back, and within SQS's limit.
fn hand_back_seconds(after: Duration) -> i32 {
    let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
    seconds.clamp(1, u64::from(MAX_VISIBILITY_TIMEOUT_SECONDS)) as i32
}

/// Receives from the queue until `shutdown`, then lets the held messages finish for
/// `drain_timeout`, cancels the rest (they are made visible again) and settles all.
pub async fn run_source<H: RecordHandler<SqsMessage>>(
    sqs: Sqs,
    settings: SqsSettings,
    holding: Holding,
    handler: Arc<H>,
    shutdown: CancellationToken,
    status: Arc<SourceStatus>,
) -> anyhow::Result<()> {
    let queue = settings.queue_url.clone();
    let queue_name = settings.queue_name().to_owned();
    let held = Arc::new(Mutex::new(InFlight::default()));
    let slots = Arc::new(Semaphore::new(
        settings.max_in_flight(holding.global_window),
    ));
    // The handlers' work: cancelled only after the drain, not by the stop itself.
    let work = CancellationToken::new();
    let (settled_tx, settled_rx) = mpsc::unbounded_channel::<(String, RecordOutcome)>();
    let settler = tokio::spawn(settle_loop(
        sqs.clone(),
        queue.clone(),
        Arc::clone(&held),
        settled_rx,
        Arc::clone(&status),
    ));
    let extender_stop = CancellationToken::new();
    let extender = tokio::spawn(extend_loop(
        sqs.clone(),
        queue.clone(),
        settings.clone(),
        Arc::clone(&held),
        extender_stop.clone(),
    ));
    let handlers = tokio_util::task::TaskTracker::new();
    let mut failures = RepeatedFailure::new("receiving from SQS");
    let mut sequence: i64 = 0;
    status.receiving.store(true, Ordering::Relaxed);
    tracing::info!(queue = %queue, "SQS source started");

    while !shutdown.is_cancelled() {
        status.heartbeat.beat();
        // Ask for no more than the free slots: wait for one (a handler ending frees it at
        // once), then count the others.
        let mut beat = tokio::time::interval(Duration::from_secs(1));
        let first_slot = loop {
            tokio::select! {
                _ = shutdown.cancelled() => break None,
                _ = beat.tick() => status.heartbeat.beat(),
                permit = Arc::clone(&slots).acquire_owned() => break permit.ok(),
            }
        };
        let Some(first_slot) = first_slot else {
            break;
        };
        let mut first_slot = Some(first_slot);
        let free = 1 + slots.available_permits();
        let wanted = free.min(settings.batch_size as usize).min(SQS_BATCH_LIMIT) as i32;
        let receive = sqs
            .client()
            .receive_message()
            .queue_url(&queue)
            .max_number_of_messages(wanted)
            .wait_time_seconds(settings.wait_time_seconds as i32)
            .visibility_timeout(settings.visibility_timeout_seconds as i32)
            .message_system_attribute_names(MessageSystemAttributeName::SentTimestamp)
            .message_system_attribute_names(MessageSystemAttributeName::ApproximateReceiveCount)
            .message_attribute_names("All")
            .customize()
            .config_override(Sqs::receive_timeouts(&settings))
            .send();
        tokio::pin!(receive);
        let received = loop {
            tokio::select! {
                // A receive cut short here may have taken messages: they reappear after their
                // visibility timeout, and their tasks' claims decide what runs.
                _ = shutdown.cancelled() => break None,
                _ = beat.tick() => status.heartbeat.beat(),
                answer = &mut receive => break Some(answer),
            }
        };
        let Some(answer) = received else { break };
        let messages = match answer {
            Ok(answer) => {
                failures.recovered();
                status.receiving.store(true, Ordering::Relaxed);
                *status.last_error.lock().unwrap_or_else(|p| p.into_inner()) = None;
                answer.messages.unwrap_or_default()
            }
            Err(e) => {
                let error = sqs.error("ReceiveMessage", &queue, e);
                failures.failed(&error.to_string());
                telemetry::sqs_call_failed("ReceiveMessage", &error);
                status.receiving.store(false, Ordering::Relaxed);
                *status.last_error.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(error.to_string());
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(holding.io_retry) => {}
                }
                continue;
            }
        };
        let now = chrono::Utc::now();
        let oldest = messages
            .iter()
            .filter_map(|m| {
                m.attributes
                    .as_ref()?
                    .get(&MessageSystemAttributeName::SentTimestamp)
            })
            .filter_map(|ms| ms.parse::<i64>().ok())
            .min()
            .and_then(chrono::DateTime::from_timestamp_millis)
            .map(|sent| (now - sent).num_milliseconds().max(0) as f64 / 1000.0);
        let mut duplicates = 0;
        let count = messages.len();
        for message in messages {
            sequence += 1;
            let Some(message) = SqsMessage::received(message, &queue_name, sequence) else {
                continue;
            };
            let arrival = held
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .arrive(&message.message_id, &message.receipt_handle);
            if arrival == Arrival::Again {
                duplicates += 1;
                continue;
            }
            let Some(permit) = first_slot
                .take()
                .or_else(|| Arc::clone(&slots).try_acquire_owned().ok())
            else {
                // Only this loop takes slots, and it asked for no more than were free.
                tracing::error!("no free slot for a received message; it is handed back");
                let _ = settled_tx.send((message.message_id.clone(), RecordOutcome::Cancelled));
                continue;
            };
            let (key, _) = crate::transport::source::Delivery::position(&message);
            telemetry::record_received(&key);
            let span = tracing::info_span!(
                parent: None,
                "record",
                queue = %queue_name,
                message_id = %message.message_id,
                receive_count = message.receive_count,
                task_id = tracing::field::Empty,
                assignment_version = tracing::field::Empty,
            );
            let (handler, cancel, settled, io_retry) = (
                Arc::clone(&handler),
                work.child_token(),
                settled_tx.clone(),
                holding.io_retry,
            );
            handlers.spawn(
                async move {
                    let id = message.message_id.clone();
                    let outcome = loop {
                        let run = AssertUnwindSafe(Arc::clone(&handler).handle(
                            message.clone(),
                            cancel.clone(),
                            WindowSlot::none(),
                        ))
                        .catch_unwind()
                        .await;
                        match run {
                            Ok(outcome) => break outcome,
                            Err(_) => {
                                // A handler bug must neither crash the process nor drop the
                                // message: the handler is idempotent, so run it again.
                                tracing::error!("record handler panicked; retrying the message");
                                tokio::select! {
                                    _ = cancel.cancelled() => break RecordOutcome::Cancelled,
                                    _ = tokio::time::sleep(io_retry) => {}
                                }
                            }
                        }
                    };
                    if let RecordOutcome::Done(how) = outcome {
                        telemetry::record_done(&key, message.sequence, how);
                    }
                    let _ = settled.send((id, outcome));
                    drop(permit);
                }
                .instrument(span),
            );
        }
        telemetry::sqs_received(count, duplicates, oldest);
        let holding = held.lock().unwrap_or_else(|p| p.into_inner()).len();
        status.held.store(holding, Ordering::Relaxed);
        telemetry::in_flight(holding, 0);
    }

    // Stopping: what runs may finish within the drain; the rest is cancelled, gives its lease
    // back and its message is made visible at once.
    handlers.close();
    tracing::info!(
        held = held.lock().unwrap_or_else(|p| p.into_inner()).len(),
        "SQS source stopping; draining"
    );
    if tokio::time::timeout(holding.drain_timeout, handlers.wait())
        .await
        .is_err()
    {
        work.cancel();
        handlers.wait().await;
    }
    drop(settled_tx);
    let _ = settler.await;
    extender_stop.cancel();
    let _ = extender.await;
    status.receiving.store(false, Ordering::Relaxed);
    tracing::info!("SQS source stopped");
    Ok(())
}

/// Settles ended messages: deletes and visibility changes, each gathered into batches of what
/// has ended meanwhile (nothing waits to fill a batch).
async fn settle_loop(
    sqs: Sqs,
    queue: String,
    held: Arc<Mutex<InFlight>>,
    mut ended: mpsc::UnboundedReceiver<(String, RecordOutcome)>,
    status: Arc<SourceStatus>,
) {
    while let Some(first) = ended.recv().await {
        let mut batch = vec![first];
        while batch.len() < SQS_BATCH_LIMIT * 4 {
            match ended.try_recv() {
                Ok(next) => batch.push(next),
                Err(_) => break,
            }
        }
        let mut deletes = Vec::new();
        let mut shows = Vec::new();
        {
            let mut held = held.lock().unwrap_or_else(|p| p.into_inner());
            for (id, outcome) in batch {
                let Some(handle) = held.settle(&id) else {
                    continue;
                };
                match Settle::of(outcome) {
                    Settle::Delete => deletes.push((id, handle)),
                    Settle::Show(after) => shows.push((id, handle, after, outcome)),
                }
            }
            status.held.store(held.len(), Ordering::Relaxed);
            telemetry::in_flight(held.len(), 0);
        }
        for chunk in deletes.chunks(SQS_BATCH_LIMIT) {
            delete(&sqs, &queue, chunk).await;
        }
        for chunk in shows.chunks(SQS_BATCH_LIMIT) {
            let entries: Vec<_> = chunk
                .iter()
                .map(|(id, handle, after, _)| (id.clone(), handle.clone(), *after))
                .collect();
            let changed = change_visibility(&sqs, &queue, &entries).await;
            for (_, _, after, outcome) in chunk {
                let why = match outcome {
                    RecordOutcome::HandedBack { .. } => "held_elsewhere",
                    _ => "stopping",
                };
                telemetry::sqs_handed_back(why, *after);
            }
            if let Err(e) = changed {
                // Not shown again now: it comes back when its visibility runs out.
                telemetry::sqs_call_failed("ChangeMessageVisibilityBatch", &e);
            }
        }
    }
}

/// Deletes one batch, its call retried a few times when SQS does not answer. An entry SQS
/// refuses (a handle made stale by a newer receive elsewhere) is counted and let go: the
/// message comes back, its task is terminal, and whoever receives it deletes it.
async fn delete(sqs: &Sqs, queue: &str, chunk: &[(String, String)]) {
    let entries: Vec<_> = chunk
        .iter()
        .enumerate()
        .map(|(i, (_, handle))| {
            DeleteMessageBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(handle)
                .build()
                .expect("id and handle are set")
        })
        .collect();
    for attempt in 1..=3 {
        let sent = sqs
            .client()
            .delete_message_batch()
            .queue_url(queue)
            .set_entries(Some(entries.clone()))
            .send()
            .await;
        match sent {
            Ok(answer) => {
                telemetry::sqs_deleted(answer.successful.len());
                for failed in answer.failed {
                    telemetry::sqs_entry_refused(
                        "DeleteMessageBatch",
                        &failed.code,
                        failed.message.as_deref(),
                    );
                }
                return;
            }
            Err(e) => {
                let error = sqs.error("DeleteMessageBatch", queue, e);
                telemetry::sqs_call_failed("DeleteMessageBatch", &error);
                if !error.is_transient() || attempt == 3 {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(200 * attempt)).await;
            }
        }
    }
}

/// Sets each entry's visibility (`(message id, handle, seconds)`); the entries SQS refuses
/// are counted.
async fn change_visibility(
    sqs: &Sqs,
    queue: &str,
    entries: &[(String, String, i32)],
) -> Result<usize, SqsError> {
    let requests: Vec<_> = entries
        .iter()
        .enumerate()
        .map(|(i, (_, handle, seconds))| {
            ChangeMessageVisibilityBatchRequestEntry::builder()
                .id(i.to_string())
                .receipt_handle(handle)
                .visibility_timeout(*seconds)
                .build()
                .expect("id and handle are set")
        })
        .collect();
    let answer = sqs
        .client()
        .change_message_visibility_batch()
        .queue_url(queue)
        .set_entries(Some(requests))
        .send()
        .await
        .map_err(|e| sqs.error("ChangeMessageVisibilityBatch", queue, e))?;
    for failed in &answer.failed {
        telemetry::sqs_entry_refused(
            "ChangeMessageVisibilityBatch",
            &failed.code,
            failed.message.as_deref(),
        );
    }
    Ok(answer.successful.len())
}

/// Every third of the visibility timeout: every held message hidden for a whole timeout more,
/// in batches of ten; and the queue's depth for the gauges.
async fn extend_loop(
    sqs: Sqs,
    queue: String,
    settings: SqsSettings,
    held: Arc<Mutex<InFlight>>,
    stop: CancellationToken,
) {
    let mut tick = tokio::time::interval(settings.extend_interval());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await;
    let seconds = settings.visibility_timeout_seconds as i32;
    let mut failures = RepeatedFailure::new("extending the visibility of held SQS messages");
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let entries: Vec<_> = held
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .handles()
            .into_iter()
            .map(|(id, handle)| (id, handle, seconds))
            .collect();
        for chunk in entries.chunks(SQS_BATCH_LIMIT) {
            // What was let go while the earlier chunks were sent is not extended (its handle
            // is deleted or handed back: SQS would refuse the entry, or undo the hand-back).
            let chunk: Vec<_> = {
                let held = held.lock().unwrap_or_else(|p| p.into_inner());
                chunk
                    .iter()
                    .filter(|(id, handle, _)| held.holds(id, handle))
                    .cloned()
                    .collect()
            };
            if chunk.is_empty() {
                continue;
            }
            match change_visibility(&sqs, &queue, &chunk).await {
                Ok(extended) => {
                    failures.recovered();
                    telemetry::sqs_visibility_extended(extended);
                }
                Err(e) => {
                    failures.failed(&e.to_string());
                    telemetry::sqs_call_failed("ChangeMessageVisibilityBatch", &e);
                }
            }
        }
        if let Ok(depth) = sqs.depth(&queue).await {
            telemetry::sqs_queue_depth(depth.visible, depth.in_flight, depth.delayed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use replyd_core::domain::RecordEnd;

    #[test]
    fn each_outcome_settles_its_message_as_sqs_expects() {
        assert_eq!(
            Settle::of(RecordOutcome::Done(RecordEnd::Completed)),
            Settle::Delete
        );
        assert_eq!(
            Settle::of(RecordOutcome::Done(RecordEnd::DeadLettered)),
            Settle::Delete
        );
        assert_eq!(Settle::of(RecordOutcome::Cancelled), Settle::Show(0));
        assert_eq!(
            Settle::of(RecordOutcome::HandedBack {
                after: Duration::from_millis(2_100)
            }),
            Settle::Show(3)
        );
        assert_eq!(hand_back_seconds(Duration::ZERO), 1);
        assert_eq!(
            hand_back_seconds(Duration::from_secs(100_000)),
            MAX_VISIBILITY_TIMEOUT_SECONDS as i32
        );
    }
}
