//! What `replyd check` reads of the source the workers read from, whichever transport it is:
//! its records folded into I3's tallies (`replyd_core::tally`), and how many were refused to
//! its dead-letter place. [`super::Transports::read_records`] chooses the transport's reading;
//! each transport's is in its own room (`kafka/records.rs`, `sqs/records.rs`).

use replyd_core::tally::RecordTallies;

/// A source's records as the checker judged them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SourceRecords {
    pub tallies: RecordTallies,
    /// Records (or messages) in the dead-letter place.
    pub dead_lettered: i64,
}

/// Why a source's records could not be read; the checker names the address and setting.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("database: {0}")]
    Database(#[from] tokio_postgres::Error),
    #[error(transparent)]
    Kafka(#[from] rdkafka::error::KafkaError),
    #[error(transparent)]
    Sqs(#[from] super::sqs::SqsError),
    #[error("{0}")]
    Other(String),
}
