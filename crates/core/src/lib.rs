//! replyd's rules, with no I/O: what a record must hold to become a task, when a lease lets a
//! write through, which offsets may be committed, when to retry, what a reservation charges,
//! what an idempotency key binds, and what a provider's answer means. The service
//! (`replyd`) reads and writes PostgreSQL and Kafka around these decisions; every one of them
//! is tested here without either, and the ones with a SQL twin are held to it by the service's
//! store tests.

pub mod api_key;
pub mod closed_set;
pub mod domain;
pub mod end_user;
pub mod fair;
pub mod fetch_watch;
pub mod history;
pub mod idempotency;
pub mod lease;
pub mod offsets;
pub mod pacing;
pub mod prompt_policy;
pub mod proto;
pub mod provider;
pub mod quota;
pub mod retry;
pub mod schema;
pub mod sealed;
pub mod secret;
pub mod tally;
pub mod windows;
pub mod workspace_policy;
