//! SQS as a worker and a relay open it. A worker's source: the queue and its dead-letter queue
//! checked (waiting within `kafka.startup_retry_ms` for an endpoint that does not answer yet),
//! then the receive loop ([`super::source`]). A relay's sink: the queue checked and its size
//! limit read ([`super::publish`]).

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::Context as _;
use tokio_util::sync::CancellationToken;

use super::dead_letter::SqsDeadLetters;
use super::publish::SqsPublisher;
use super::settings::SqsSettings;
use super::source::{SourceStatus, run_source};
use super::{Sqs, SqsError};
use crate::connect_retry::retry_connecting;
use crate::transport::sink::Sink;
use crate::transport::source::{MakeHandler, OpenSource, Opening, SourceHealth};

/// A worker reading SQS is ready while its receive loop turns and its last receive answered.
struct ReceiverHealth(Arc<SourceStatus>);

impl SourceHealth for ReceiverHealth {
    fn check(&self) -> Result<String, String> {
        if !self.0.receiving.load(Ordering::Relaxed) {
            let why = self
                .0
                .last_error
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .unwrap_or_else(|| "not receiving".into());
            return Err(why);
        }
        Ok(format!(
            "{} SQS messages held",
            self.0.held.load(Ordering::Relaxed)
        ))
    }
}

/// The queue and its dead-letter queue checked, and the receive loop ready to run.
pub async fn open_source<M: MakeHandler>(
    settings: SqsSettings,
    startup: Duration,
    opening: Opening<M>,
) -> anyhow::Result<OpenSource> {
    let Opening {
        holding,
        weights: _,
        make_handler,
        shutdown,
    } = opening;
    let sqs = Sqs::connect(&settings).await.context("SQS settings")?;
    let dead_letter_url = retry_connecting(
        "reaching SQS",
        startup,
        &shutdown,
        SqsError::is_transient,
        // The queue answers (it exists, the credentials may read it), and names its
        // dead-letter queue unless the settings do.
        || async {
            let attributes = sqs.attributes(&settings.queue_url).await?;
            sqs.dead_letter_queue(&settings, &attributes).await
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
    let handler = make_handler.make(dead_letters);
    crate::telemetry::register(crate::telemetry::SQS_METRICS);
    let status = Arc::new(SourceStatus::default());
    let health = Arc::new(ReceiverHealth(Arc::clone(&status)));
    let heartbeat = Arc::clone(&status.heartbeat);
    let run = run_source(sqs, settings, holding, handler, shutdown, status);
    Ok(OpenSource {
        health,
        heartbeat,
        loop_name: "receive",
        run: Box::pin(run),
    })
}

/// The queue checked and its size limit read, waiting within `startup` for an endpoint that
/// does not answer yet.
pub async fn open_sink(
    settings: &SqsSettings,
    startup: Duration,
    shutdown: &CancellationToken,
) -> anyhow::Result<Box<dyn Sink>> {
    let sqs = Sqs::connect(settings).await.context("SQS settings")?;
    let publisher = retry_connecting(
        "reaching SQS",
        startup,
        shutdown,
        SqsError::is_transient,
        || SqsPublisher::connect(sqs.clone(), settings),
    )
    .await
    .context("checking the SQS queue")?;
    crate::telemetry::register(crate::telemetry::SQS_METRICS);
    Ok(Box::new(publisher))
}
