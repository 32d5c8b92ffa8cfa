//! `replyd relay`: hands the outbox's tasks to the sink `relay.sink` names
//! ([`crate::transport`]: Kafka's idempotent producer, or an SQS queue). Batches of
//! unpublished rows are taken with `SKIP LOCKED` (many relays at once), published, and marked
//! published in the same transaction once acknowledged.
//! Woken by `NOTIFY replyd_outbox`, with a polling fallback. Between batches it runs the
//! [`crate::housekeeping`] rounds that are due (purges, the outbox's lag, the quota's
//! reconciler).
//!
//! A row whose record the broker refuses for good (over the topic's `max.message.bytes`, an
//! invalid record) can never be published: it is marked refused and its task failed with the
//! broker's reason in the batch's transaction (its reservation released, its followers told),
//! instead of being sent again forever while readiness stays down.
//!
//! A relay that dies between the publish and the commit leaves its rows unpublished; the next
//! batch publishes them again and the worker absorbs the duplicate record, because the task
//! id, not the record, is the identity of the work (I1, I6).

pub mod settings;

use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::housekeeping::Housekeeping;
use crate::housekeeping::settings::RetentionSettings;
use crate::probes::{Heartbeat, Probes, Readiness};
use crate::reconcile::ReconcileSettings;
use crate::store::listen::{Demand, Listener, listen};
use crate::store::{DatabaseSettings, Store};
use crate::telemetry;
use crate::transport::Transports;
use crate::transport::kafka::settings::KafkaSettings;
use crate::transport::sqs::settings::SqsSettings;
use settings::RelaySettings;

/// The channel new outbox rows notify (see `migrations/V6`).
pub const OUTBOX_CHANNEL: &str = "replyd_outbox";

/// Wakes the relay loop.
struct WakeRelay(Arc<Notify>);

impl Listener for WakeRelay {
    fn listening(&mut self) {
        // Rows may have come while nobody listened: look now.
        self.0.notify_one();
    }

    fn notified(&mut self, _channel: &str, _payload: &str) {
        self.0.notify_one();
    }
}

/// A relay is ready while the database answers and the outbox's oldest unpublished row is
/// younger than `relay.ready_max_lag_ms`: older means nothing is publishing (Kafka away, or
/// every relay stuck), which is what an operator must hear about.
struct RelayReady {
    store: Store,
    max_lag: Duration,
}

impl Readiness for RelayReady {
    fn check(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            let lag = self
                .store
                .outbox_lag()
                .await
                .map_err(|e| format!("database: {}", telemetry::chain(&e)))?;
            let what = format!(
                "outbox: {} unpublished, the oldest {:.1} s old",
                lag.unpublished, lag.oldest_seconds
            );
            if lag.oldest_seconds > self.max_lag.as_secs_f64() {
                return Err(format!(
                    "{what}, over {} s (relay.ready_max_lag_ms)",
                    self.max_lag.as_secs_f64()
                ));
            }
            Ok(what)
        })
    }
}

/// What a relay is built from: its sections of the settings tree, composed by the tree once
/// every rule between them held.
#[derive(Debug, Clone)]
pub struct RelayParts {
    pub database: DatabaseSettings,
    pub relay: RelaySettings,
    pub retention: RetentionSettings,
    /// The quota's reconciler, which housekeeping runs between batches.
    pub reconcile: ReconcileSettings,
    pub kafka: KafkaSettings,
    pub sqs: SqsSettings,
}

/// Runs the relay until `shutdown`.
pub async fn run(
    settings: RelayParts,
    probes: &Probes,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let store = crate::connect_retry::migrated_store(&settings.database, &shutdown).await?;
    let relay = &settings.relay;
    let transports = Transports {
        kafka: &settings.kafka,
        sqs: &settings.sqs,
    };
    let sink = transports
        .open_sink(relay.sink, relay.publish_timeout(), &shutdown)
        .await?;
    let heartbeat = Arc::new(Heartbeat::default());
    probes.watch("relay", Arc::clone(&heartbeat));
    let reconciler = settings.reconcile.reconciler(store.clone())?;
    let mut housekeeping = Housekeeping::new(
        store.clone(),
        relay.retention(),
        settings.retention.clone(),
        reconciler,
        Arc::clone(&heartbeat),
    );
    let wake = Arc::new(Notify::new());
    tokio::spawn(listen(
        settings.database.clone(),
        format!("replyd-relay {}", std::process::id()),
        &[OUTBOX_CHANNEL],
        WakeRelay(Arc::clone(&wake)),
        // A relay's work is to hear new rows at once: it always listens.
        Demand::always(),
        shutdown.clone(),
    ));
    probes.add(
        "relay",
        RelayReady {
            store: store.clone(),
            max_lag: relay.ready_max_lag(),
        },
    );
    tracing::info!(to = %sink.name(), "relay started");
    while !shutdown.is_cancelled() {
        heartbeat.beat();
        let published = store
            .relay_batch(relay.batch_size, |rows| {
                sink.publish(rows, relay.publish_timeout())
            })
            .await;
        let full = match published {
            Ok((sent, refused)) => {
                telemetry::outbox_published(sent);
                (sent + refused) as i64 == relay.batch_size
            }
            Err(e) => {
                telemetry::store_error("relay_batch", &e);
                false
            }
        };
        housekeeping.run_due().await;
        if full {
            continue; // more are waiting
        }
        tokio::select! {
            _ = shutdown.cancelled() => break,
            _ = wake.notified() => {}
            _ = tokio::time::sleep(relay.poll_interval()) => {}
        }
    }
    tracing::info!("relay stopped");
    Ok(())
}
