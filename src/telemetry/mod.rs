//! Telemetry: every metric and every notable event. Each event function writes its log line
//! and bumps its counter together, in the room of what it reports on (`kafka`, `sqs`, `tasks`,
//! `provider`, `front`; the handles the per-record updates keep, in `kept`); the names of all
//! metrics live in [`catalogue`], how a line is
//! written in [`lines`], traces in [`trace`] and the log set-up in [`logging`]. The probe
//! server that exposes them is `crate::probes`.
//!
//! Events take labels and plain values, never another room's types, so every room can report
//! without telemetry depending on it.

pub mod catalogue;
mod front;
mod kafka;
mod kept;
mod lines;
pub mod logging;
mod provider;
mod sqs;
mod tasks;
pub mod trace;

pub use catalogue::{
    API_METRICS, CAPACITY_WAIT_BUCKETS, COMPLETION_BATCH_ROWS_BUCKETS, HISTOGRAM_BUCKETS,
    HTTP_REQUEST_SECONDS_BUCKETS, Kind, PROVIDER_SECONDS_BUCKETS, RELAY_METRICS,
    RENEWAL_BATCH_ROWS_BUCKETS, SQS_METRICS, WORKER_METRICS, names, register,
};
pub use front::*;
pub use kafka::*;
pub use kept::recording;
pub use lines::{RepeatedFailure, chain};
pub use provider::*;
pub use sqs::*;
pub use tasks::*;
