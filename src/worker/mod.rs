//! `replyd worker`: builds the store, the provider and the runner, opens the source
//! `worker.source` names ([`crate::transport`]) with the pipeline as its record handler, adds
//! its readiness check, and runs until `shutdown`.
//!
//! The worker's rooms: [`pipeline`] (one record: decode, dead-letter, then the runner), [`runner`] (the
//! lease state machine of one task), [`parking`] (records waiting on a task leased elsewhere,
//! woken by the database's notifications), `live` (the running attempts' text forwarded to
//! their followers in rounds), `store_retry` (a store call run again until it
//! succeeds or the record is cancelled).

mod live;
pub mod parking;
pub mod pipeline;
pub mod runner;
pub mod settings;
mod store_retry;

use std::sync::Arc;

use anyhow::Context;
use futures_util::future::BoxFuture;
use tokio_util::sync::CancellationToken;

use crate::capacity::{Capacity, CapacitySettings, Weights};
use crate::probes::{DatabaseReady, Heartbeat, Probes, Readiness};
use crate::provider::{ProviderSettings, build_provider};
use crate::store::{DatabaseSettings, Store};
use crate::transport::Transports;
use crate::transport::kafka::settings::KafkaSettings;
use crate::transport::source::{DeadLetter, Delivery, MakeHandler, Opening, SourceHealth};
use crate::transport::sqs::settings::SqsSettings;

use live::LiveWriter;
use parking::{ParkedTasks, relay_task_notifications};
use pipeline::{Pipeline, PipelineSettings};
use replyd_core::provider::Recovery;
use replyd_core::retry::RetrySettings;
use runner::{RunnerSettings, TaskRunner};
use settings::WorkerSettings;

/// How long the poll loop may be silent before the worker says it is not ready: a revoke's
/// drain holds it up to `worker.drain_timeout_ms`, and meanwhile the worker takes no records.
const READY_POLL_SILENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// What every source's readiness asks after its own: its `what` loop turned within
/// [`READY_POLL_SILENCE`], and the database answers.
async fn turning_with_the_database(
    heartbeat: &Heartbeat,
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

/// A worker is ready while its source's loop turns (within [`READY_POLL_SILENCE`]) and is
/// well by its own account, and the database answers.
struct WorkerReady {
    source: Arc<dyn SourceHealth>,
    heartbeat: Arc<Heartbeat>,
    loop_name: &'static str,
    store: Store,
}

impl Readiness for WorkerReady {
    fn check(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            let what = self.source.check()?;
            turning_with_the_database(&self.heartbeat, self.loop_name, &self.store).await?;
            Ok(what)
        })
    }
}

/// The pipeline, made once the source's dead-letter keeper is known.
struct PipelineParts {
    runner: TaskRunner,
    settings: PipelineSettings,
}

impl MakeHandler for PipelineParts {
    type Handler<D: Delivery, L: DeadLetter<D>> = Pipeline<L>;

    fn make<D: Delivery, L: DeadLetter<D>>(self, dead_letters: L) -> Arc<Pipeline<L>> {
        Arc::new(Pipeline::new(dead_letters, self.runner, self.settings))
    }
}

/// What a worker is built from: its sections of the settings tree, composed by the tree once
/// every rule between them held.
#[derive(Debug, Clone)]
pub struct WorkerParts {
    pub database: DatabaseSettings,
    pub worker: WorkerSettings,
    pub provider: ProviderSettings,
    pub capacity: CapacitySettings,
    pub retry: RetrySettings,
    pub kafka: KafkaSettings,
    pub sqs: SqsSettings,
}

/// Runs one worker until `shutdown` fires, then drains, commits and leaves the group.
pub async fn run_worker(
    settings: WorkerParts,
    probes: &Probes,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    // PostgreSQL and Kafka may come up after us: retry for a bounded time, one log line per
    // distinct failure.
    let mut store = crate::connect_retry::migrated_store(&settings.database, &shutdown).await?;
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
    // Asked for streamed only where live text forwards it, unless `provider.stream` says
    // otherwise: a streamed answer read as events costs more CPU than one JSON body.
    let live_text = settings.worker.live_text_interval();
    let provider_settings = settings.provider.streaming(live_text.is_some());
    let provider = build_provider(&provider_settings).context("provider settings")?;
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
            live_text.filter(|_| provider_settings.streamed()),
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
            stream: provider_settings.streamed(),
        },
    );
    let pipeline_settings = PipelineSettings {
        rules: settings.worker.record_rules(),
        io_retry: settings.worker.io_retry(),
    };
    let opening = Opening {
        holding: settings.worker.holding(),
        // The windows order records by the same weights as the capacity.
        weights: runner.weights(),
        make_handler: PipelineParts {
            runner,
            settings: pipeline_settings,
        },
        shutdown,
    };
    let transports = Transports {
        kafka: &settings.kafka,
        sqs: &settings.sqs,
    };
    let source = transports
        .open_source(settings.worker.source, opening)
        .await?;
    probes.watch("worker", Arc::clone(&source.heartbeat));
    probes.add(
        "worker",
        WorkerReady {
            source: Arc::clone(&source.health),
            heartbeat: Arc::clone(&source.heartbeat),
            loop_name: source.loop_name,
            store,
        },
    );
    tracing::info!(worker_id = %worker_id, source = settings.worker.source.as_str(), "worker started");
    source.run.await
}
