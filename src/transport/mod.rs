//! What carries the reply-task records between the relay and the workers, and the one place
//! where the choice between transports is made (`worker.source`, `relay.sink`).
//!
//! - [`source`] is the seam a worker reads through: a source owns a record's acknowledgement,
//!   and the worker's pipeline sees only a [`source::Delivery`]. [`sink`] is the seam the relay
//!   hands the outbox through.
//! - Each transport is a room of its own, beside the others: [`kafka`] (a consumer group, the
//!   dead-letter topic, the idempotent producer) and [`sqs`] (a Standard queue, its dead-letter
//!   queue). Each has an `open` file: how a worker opens its source and a relay its sink.
//! - [`Transports`] makes the choice: it opens the source or the sink a setting names, and
//!   answers what differs between transports for the rest of the service (how soon a vanished
//!   worker's records come back, whether records can be read again after a restore, what
//!   `replyd check` reads of the source's records: [`records`]).
//!
//! A new transport is a new room here, a variant of [`Transport`], its settings in the tree,
//! and the arms of [`Transports`]' matches.

pub mod kafka;
pub mod records;
pub mod settings;
pub mod sink;
pub mod source;
pub mod sqs;

use std::time::Duration;

use anyhow::Context as _;
use replyd_core::domain::RecordRules;
use tokio_util::sync::CancellationToken;

pub use settings::Transport;

use kafka::rewind::Rewound;
use kafka::settings::{GroupProtocol, KafkaSettings};
use records::{ReadError, SourceRecords};
use sink::Sink;
use source::{MakeHandler, OpenSource, Opening};
use sqs::settings::SqsSettings;

/// Every transport's settings, as the settings tree holds them.
#[derive(Debug, Clone, Copy)]
pub struct Transports<'a> {
    pub kafka: &'a KafkaSettings,
    pub sqs: &'a SqsSettings,
}

impl Transports<'_> {
    /// Each transport's own rules, and those between the transports in use and how the worker
    /// holds its records: a setting and why, for each broken one. `[kafka]` is always checked
    /// (the topic commands use it whatever the source); `[sqs]` when something uses the queue.
    pub fn problems(
        self,
        source: Transport,
        sink: Transport,
        lease: Duration,
        drain_timeout: Duration,
    ) -> Vec<(&'static str, String)> {
        let kafka = self.kafka;
        let mut out = kafka.problems();
        if kafka.group_protocol == GroupProtocol::Classic
            && drain_timeout.as_millis() >= u128::from(kafka.session_timeout_ms())
        {
            out.push((
                "worker.drain_timeout_ms",
                format!(
                    "{} must be below kafka.session_timeout_ms ({}): a revoke that drains longer than the session is fenced by the group anyway",
                    drain_timeout.as_millis(),
                    kafka.session_timeout_ms()
                ),
            ));
        }
        if source == Transport::Sqs || sink == Transport::Sqs {
            out.extend(self.sqs.problems());
        }
        if source == Transport::Sqs && self.sqs.visibility_timeout() < lease {
            out.push((
                "sqs.visibility_timeout_seconds",
                format!(
                    "{} s must be at least worker.lease_ms ({} ms): a message that reappears while its task's lease still runs is only handed back again",
                    self.sqs.visibility_timeout_seconds,
                    lease.as_millis()
                ),
            ));
        }
        out
    }

    /// How long a transport that does not answer yet is waited for at start
    /// (`kafka.startup_retry_ms`, which every transport goes by).
    fn startup(self) -> Duration {
        Duration::from_millis(self.kafka.startup_retry_ms)
    }

    /// Opens a worker's source: its dead-letter keeper checked, waiting within the start-up
    /// window for one that does not answer yet.
    pub async fn open_source<M: MakeHandler>(
        self,
        transport: Transport,
        opening: Opening<M>,
    ) -> anyhow::Result<OpenSource> {
        match transport {
            Transport::Kafka => {
                kafka::open::open_source(self.kafka.clone(), self.startup(), opening).await
            }
            Transport::Sqs => {
                sqs::open::open_source(self.sqs.clone(), self.startup(), opening).await
            }
        }
    }

    /// Opens the relay's sink, waiting within the start-up window for one that does not answer
    /// yet. A
    /// publish ends within `publish_timeout`.
    pub async fn open_sink(
        self,
        transport: Transport,
        publish_timeout: Duration,
        shutdown: &CancellationToken,
    ) -> anyhow::Result<Box<dyn Sink>> {
        match transport {
            Transport::Kafka => kafka::open::open_sink(self.kafka, publish_timeout),
            Transport::Sqs => sqs::open::open_sink(self.sqs, self.startup(), shutdown).await,
        }
    }

    /// How long the source takes to notice a worker that vanished mid-record and deliver its
    /// records to another: the group's session timeout on Kafka; on SQS, the messages'
    /// visibility running out.
    pub fn noticed_after(self, transport: Transport) -> Duration {
        match transport {
            Transport::Kafka => Duration::from_millis(self.kafka.group_session_timeout_ms()),
            Transport::Sqs => self.sqs.visibility_timeout(),
        }
    }

    /// What [`Self::noticed_after`] comes from, said with its setting for an error message.
    pub fn noticed_from(self, transport: Transport) -> String {
        match transport {
            Transport::Kafka => match self.kafka.group_protocol {
                GroupProtocol::Classic => format!(
                    "kafka.session_timeout_ms, {} ms",
                    self.kafka.group_session_timeout_ms()
                ),
                GroupProtocol::Consumer => format!(
                    "the broker's group.consumer.session.timeout.ms at its default, {} ms",
                    self.kafka.group_session_timeout_ms()
                ),
            },
            Transport::Sqs => format!(
                "sqs.visibility_timeout_seconds, {} s",
                self.sqs.visibility_timeout_seconds
            ),
        }
    }

    /// After a restore: the records written at or after `point` (milliseconds since the epoch)
    /// made to be read again (on Kafka, the group's committed offsets moved back, a partition
    /// each), or None where the transport cannot deliver a record again once it was
    /// acknowledged (SQS).
    pub async fn read_again_from(
        self,
        transport: Transport,
        point: i64,
        dry_run: bool,
    ) -> anyhow::Result<Option<Vec<Rewound>>> {
        match transport {
            Transport::Kafka => {
                let kafka = self.kafka.clone();
                let rewound = tokio::task::spawn_blocking(move || {
                    kafka::rewind::rewind(&kafka, point, dry_run)
                })
                .await
                .context("the offsets' thread")??;
                Ok(Some(rewound))
            }
            Transport::Sqs => Ok(None),
        }
    }

    /// What `replyd check` reads of `source` for I3: its records judged against the tasks
    /// (`client`, the checker's session), the task a record carries made by `rules` (the
    /// worker's), and its dead-letter place's count. `sqs` is a client of the caller's for a
    /// queue (a tool's own credentials); without one, the AWS chain's.
    pub async fn read_records(
        self,
        source: Transport,
        rules: RecordRules,
        client: &tokio_postgres::Client,
        sqs: Option<sqs::Sqs>,
    ) -> Result<SourceRecords, ReadError> {
        match source {
            Transport::Kafka => kafka::records::read(self.kafka, rules, client).await,
            Transport::Sqs => {
                let sqs = match sqs {
                    Some(sqs) => sqs,
                    None => sqs::Sqs::connect(self.sqs).await?,
                };
                sqs::records::read(self.sqs, &sqs, client).await
            }
        }
    }
}
