//! replyd: turns reply-task records on a Kafka topic into at most one saved LLM reply per task
//! in PostgreSQL. See `docs/ARCHITECTURE.md` for the map of modules and the invariants
//! (I1..I8) each one keeps.

pub mod api;
pub mod api_key;
pub mod browsers;
pub mod capacity;
pub mod check;
pub mod cli;
pub mod config;
pub mod domain;
pub mod idempotency;
pub mod inspect;
pub mod kafka;
pub mod mock_provider;
pub mod operator;
pub mod parking;
pub mod pipeline;
pub mod produce;
pub mod proto;
pub mod provider;
pub mod quota;
pub mod reconcile;
pub mod relay;
pub mod retry;
pub mod secret;
pub mod serve;
pub mod startup;
pub mod store;
pub mod telemetry;
pub mod worker;
pub mod workspace_policy;
