//! The integration tests, one binary: the service against a real PostgreSQL, a real Kafka
//! broker, real HTTP over loopback, real TLS listeners, a real trace collector and Chromium,
//! with the mock provider as the only fake. [`helpers`] holds the fixtures every module shares:
//! the infrastructure's addresses, a fresh schema and topic per test, and [`helpers::app`], the
//! whole service started the way an installation starts it. The chaos scenarios, which crash
//! PostgreSQL and Kafka under everything else, are a binary of their own (`tests/chaos/`).

mod helpers;

mod api;
mod browser;
mod cancel;
mod checker;
mod deploy;
mod end_user_boundary;
mod end_users;
mod fairness;
mod forgetting;
mod front_half;
mod history;
mod house;
mod kafka_smoke;
mod kafka_tls;
mod live;
mod operations;
mod postgres_tls;
mod prompt_policy;
mod provider_anthropic;
mod provider_background;
mod provider_base_urls;
mod provider_failures;
mod provider_http;
mod provider_streams;
mod provider_transport;
mod quota;
mod reconcile;
mod refusals;
mod restore;
mod rollback;
mod secrets;
mod sqs;
mod store_fencing;
mod store_functions;
mod tracing;
mod worker_e2e;
mod workspaces;
