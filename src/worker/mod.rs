//! `replyd worker`: builds the store, the provider, the dead-letter producer and the pipeline,
//! adds its readiness check, starts the consumer thread, and runs until `shutdown`.
//!
//! The worker's rooms: [`consumer`] (the Kafka group: windows, read-ahead, commits, the drain
//! on revoke), [`pipeline`] (one record: decode, dead-letter, then the runner), [`runner`] (the
//! lease state machine of one task), [`parking`] (records waiting on a task leased elsewhere,
//! woken by the database's notifications), `store_retry` (a store call run again until it
//! succeeds or the record is cancelled).

pub mod consumer;
mod live;
pub mod parking;
pub mod pipeline;
pub mod runner;
pub mod settings;
pub mod source;
mod store_retry;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context;
use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::capacity::{Capacity, Weights};
use crate::config::Settings;
use crate::connect_retry::retry_connecting;
use crate::kafka::dead_letter::{DeadLetterError, DeadLetters};
use crate::probes::{DatabaseReady, Probes, Readiness};
use crate::provider::build_provider;
use crate::sqs::dead_letter::SqsDeadLetters;
use crate::sqs::settings::Transport;
use crate::sqs::source::{SourceLimits, SourceStatus, run_source};
use crate::sqs::{Sqs, SqsError};
use crate::store::Store;

use consumer::{ConsumerStatus, run_consumer};
use live::LiveWriter;
use parking::{ParkedTasks, relay_task_notifications};
use pipeline::{Pipeline, PipelineSettings};
use replyd_core::provider::Recovery;
use runner::{RunnerSettings, TaskRunner};

/// How long the poll loop may be silent before the worker says it is not ready: a revoke's
/// drain holds it up to `worker.drain_timeout_ms`, and meanwhile the worker takes no records.
const READY_POLL_SILENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// What every source's readiness asks after its own: its `what` loop turned within
/// [`READY_POLL_SILENCE`], and the database answers.
async fn turning_with_the_database(
    heartbeat: &crate::probes::Heartbeat,
    what: &str,
    store: &Store,
) -> Result<(), String> {
    let silent = heartbeat.silent_for();
    if silent > READY_POLL_SILENCE {
        return Err(format!(
            "the {what} loop has not turned for {:.1} s",
            silent.as_secs_f64()
        ));
    }
    DatabaseReady(store.clone()).check().await.map(|_| ())
}

/// A worker is ready while its consumer polls (its loop turned within [`READY_POLL_SILENCE`])
/// and the database answers.
struct WorkerReady {
    status: Arc<ConsumerStatus>,
    store: Store,
}

impl Readiness for WorkerReady {
    fn check(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            if !self.status.polling.load(Ordering::Relaxed) {
                return Err("consumer not polling".into());
            }
            turning_with_the_database(&self.status.heartbeat, "poll", &self.store).await?;
            Ok(format!(
                "{} partitions assigned",
                self.status.assigned_partitions.load(Ordering::Relaxed)
            ))
        })
    }
}

/// Runs one worker until `shutdown` fires, then drains, commits and leaves the group.
pub async fn run_worker(
    settings: Settings,
    probes: &Probes,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // PostgreSQL and Kafka may come up after us: retry for a bounded time, one log line per
    // distinct failure.
    crate::connect_retry::migrate(&settings.database, &shutdown).await?;
    let mut store = Store::connect(&settings.database).context("database settings")?;
    if settings.database.batch_completions {
        store = store.batching_completions(settings.database.batch_max_rows);
    }
    if settings.database.batch_claims {
        store = store.batching_claims(settings.database.batch_max_rows);
    }
    if settings.database.batch_renewals {
        store = store.batching_renewals(
            settings.worker.renew_interval(),
            settings.worker.lease(),
            settings.worker.lease_check(),
        );
    }
    let provider = build_provider(&settings.provider).context("provider settings")?;
    // Whether an ambiguous call can be recovered without a second generation.
    let recoverable = match provider.recovery() {
        Recovery::OperationId => true,
        Recovery::IdempotencyKey => settings.retry.provider_honours_idempotency_key,
        Recovery::None => false,
    };
    let worker_id = settings.worker.resolved_worker_id();
    let parked = ParkedTasks::default();
    if settings.database.listen {
        tokio::spawn(relay_task_notifications(
            settings.database.clone(),
            format!("replyd-listener {worker_id} {}", std::process::id()),
            parked.clone(),
            shutdown.clone(),
        ));
    }
    // Each workspace's weight in the fair order (I10): the windows' and the capacity's.
    let weights = Weights::default();
    weights.keep_reading(store.clone(), shutdown.clone());
    let capacity = Capacity::new(
        store.clone(),
        settings.capacity.clone(),
        worker_id.clone(),
        weights.clone(),
        shutdown.clone(),
    );
    let runner = TaskRunner::new(
        store.clone(),
        provider,
        parked,
        capacity,
        // Text is forwarded only from streamed answers.
        LiveWriter::new(
            store.clone(),
            settings
                .worker
                .live_text_interval()
                .filter(|_| settings.provider.stream),
            shutdown.clone(),
        ),
        RunnerSettings {
            lease_owner: settings.worker.lease_owner(&worker_id),
            lease: settings.worker.lease(),
            renew_interval: settings.worker.renew_interval(),
            io_retry: settings.worker.io_retry(),
            default_model: settings.provider.default_model.clone(),
            default_output_tokens: settings.capacity.default_output_tokens,
            chars_per_token: settings.capacity.chars_per_token,
            retry: settings.retry.clone(),
            recoverable,
            stream: settings.provider.stream,
        },
    );
    let pipeline_settings = PipelineSettings {
        rules: settings.worker.record_rules(),
        io_retry: settings.worker.io_retry(),
    };
    match settings.worker.source {
        Transport::Kafka => {
            run_kafka(
                settings,
                probes,
                shutdown,
                store,
                runner,
                pipeline_settings,
                worker_id,
            )
            .await
        }
        Transport::Sqs => {
            run_sqs(
                settings,
                probes,
                shutdown,
                store,
                runner,
                pipeline_settings,
                worker_id,
            )
            .await
        }
    }
}

/// The Kafka source: the dead-letter topic checked, then the consumer's poll thread.
async fn run_kafka(
    settings: Settings,
    probes: &Probes,
    shutdown: CancellationToken,
    store: Store,
    runner: TaskRunner,
    pipeline_settings: PipelineSettings,
    worker_id: String,
) -> anyhow::Result<()> {
    let dead_letters = Arc::new(DeadLetters::new(&settings.kafka).context("dead-letter producer")?);
    retry_connecting(
        "reaching Kafka",
        Duration::from_millis(settings.kafka.startup_retry_ms),
        &shutdown,
        // A topic created moments before the workers (a deploy's topic Job, a test) may not
        // be in every broker's metadata yet: a missing one is waited for within the start-up
        // window like an unreachable broker, then refused by name.
        |e: &DeadLetterError| {
            matches!(
                e,
                DeadLetterError::Unreachable { .. } | DeadLetterError::MissingTopic(_)
            )
        },
        || {
            let dead_letters = Arc::clone(&dead_letters);
            async move {
                // A metadata request blocks: keep it off the runtime's threads.
                tokio::task::spawn_blocking(move || dead_letters.verify_topic())
                    .await
                    .unwrap_or_else(|e| Err(DeadLetterError::Panicked(e.to_string())))
            }
        },
    )
    .await
    .context("checking the dead-letter topic")?;
    let dead_letters = Arc::into_inner(dead_letters)
        .ok_or_else(|| anyhow::anyhow!("the dead-letter check still holds the producer"))?;
    // The windows order records by the same weights as the capacity.
    let weights = runner.weights();
    let pipeline = Arc::new(Pipeline::new(dead_letters, runner, pipeline_settings));
    let status = Arc::new(ConsumerStatus::default());
    probes.watch("worker", Arc::clone(&status.heartbeat));
    probes.add(
        "worker",
        WorkerReady {
            status: Arc::clone(&status),
            store,
        },
    );
    tracing::info!(worker_id = %worker_id, "worker started");

    let runtime = tokio::runtime::Handle::current();
    let consumer = std::thread::Builder::new()
        .name("replyd-poll".into())
        .spawn(move || {
            run_consumer(
                &settings.kafka,
                &settings.worker,
                pipeline,
                runtime,
                shutdown,
                status,
                weights,
            )
        })
        .context("starting the poll thread")?;
    tokio::task::spawn_blocking(move || consumer.join())
        .await
        .context("joining the poll thread")?
        .map_err(|_| anyhow::anyhow!("the poll thread panicked"))?
        .context("kafka consumer")?;
    Ok(())
}

/// A worker reading SQS is ready while its receive loop turns and its last receive answered,
/// and the database answers.
struct SqsReady {
    status: Arc<SourceStatus>,
    store: Store,
}

impl Readiness for SqsReady {
    fn check(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            if !self.status.receiving.load(Ordering::Relaxed) {
                let why = self
                    .status
                    .last_error
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .clone()
                    .unwrap_or_else(|| "not receiving".into());
                return Err(why);
            }
            turning_with_the_database(&self.status.heartbeat, "receive", &self.store).await?;
            Ok(format!(
                "{} SQS messages held",
                self.status.held.load(Ordering::Relaxed)
            ))
        })
    }
}

/// The SQS source: the queue and its dead-letter queue checked (waiting within
/// `kafka.startup_retry_ms` for an endpoint that does not answer yet), then the receive loop.
async fn run_sqs(
    settings: Settings,
    probes: &Probes,
    shutdown: CancellationToken,
    store: Store,
    runner: TaskRunner,
    pipeline_settings: PipelineSettings,
    worker_id: String,
) -> anyhow::Result<()> {
    let sqs = Sqs::connect(&settings.sqs).await.context("SQS settings")?;
    let startup = Duration::from_millis(settings.kafka.startup_retry_ms);
    let dead_letter_url = retry_connecting(
        "reaching SQS",
        startup,
        &shutdown,
        SqsError::is_transient,
        // The queue answers (it exists, the credentials may read it), and names its
        // dead-letter queue unless the settings do.
        || async {
            let attributes = sqs.attributes(&settings.sqs.queue_url).await?;
            sqs.dead_letter_queue(&settings.sqs, &attributes).await
        },
    )
    .await
    .context("finding the SQS dead-letter queue")?;
    let dead_letters = SqsDeadLetters::new(sqs.clone(), dead_letter_url);
    retry_connecting(
        "reaching the SQS dead-letter queue",
        startup,
        &shutdown,
        SqsError::is_transient,
        || dead_letters.verify(),
    )
    .await
    .with_context(|| format!("checking the dead-letter queue {}", dead_letters.url()))?;
    let pipeline = Arc::new(Pipeline::new(dead_letters, runner, pipeline_settings));
    crate::telemetry::register(crate::telemetry::SQS_METRICS);
    let status = Arc::new(SourceStatus::default());
    probes.watch("worker", Arc::clone(&status.heartbeat));
    probes.add(
        "worker",
        SqsReady {
            status: Arc::clone(&status),
            store,
        },
    );
    tracing::info!(worker_id = %worker_id, queue = %settings.sqs.queue_url, "worker started");
    run_source(
        sqs,
        settings.sqs.clone(),
        SourceLimits {
            max_in_flight: settings.sqs.max_in_flight(settings.worker.global_window),
            drain_timeout: Duration::from_millis(settings.worker.drain_timeout_ms),
            io_retry: settings.worker.io_retry(),
        },
        pipeline,
        shutdown,
        status,
    )
    .await
}
