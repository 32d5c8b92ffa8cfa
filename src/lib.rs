//! replyd: turns reply-task records on a Kafka topic or an SQS queue into at most one saved LLM
//! reply per task in PostgreSQL. See `docs/ARCHITECTURE.md` for the map of modules and the
//! invariants (I1..I10) each one keeps. The rules themselves, pure, are `replyd_core`; this crate does the
//! I/O around them.

pub mod api;
pub mod capacity;
pub mod check;
pub mod cli;
pub mod config;
pub mod connect_retry;
pub mod dead_letters;
pub mod erasure;
pub mod housekeeping;
pub mod inspect;
pub mod probes;
pub mod provider;
pub mod reach;
pub mod reconcile;
pub mod relay;
pub mod restore;
pub mod retries;
pub mod serve;
pub mod setting_problems;
pub mod store;
pub mod telemetry;
pub mod tenants;
pub mod topics;
pub mod transport;
pub mod worker;
