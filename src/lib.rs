//! replyd: turns reply-task records on a Kafka topic into at most one saved LLM reply per task
//! in PostgreSQL. See `docs/ARCHITECTURE.md` for the map of modules and the invariants
//! (I1..I8) each one keeps.

pub mod cli;
pub mod config;
pub mod domain;
pub mod mock_provider;
pub mod proto;
pub mod provider;
pub mod store;
