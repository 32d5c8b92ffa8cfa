//! The HTTP API (`replyd api`): the front half of the chain. A browser submits a message with
//! an `Idempotency-Key`; one transaction saves it with its reply task and the outbox row that
//! hands the task to Kafka (I6); the caller follows the task by its id.
//!
//! One file per route group: [`replies`], [`events`], [`quota`], [`conversations`],
//! [`end_users`]; [`demo`] is the demo chat
//! page, served only when `api.demo_page` is on. [`auth`] turns the bearer key (or an end
//! user's token, checked against [`signing`]'s secrets) into the caller; [`path`] reads every
//! route's path parameter; [`problem`] renders every error as problem+json. Unknown routes and
//! methods are
//! problems too, and so are the answers of the HTTP server itself ([`server`], with
//! [`parse_errors`] for the heads its parser refuses), so no refusal of this server is
//! anything but problem+json. [`ApiState`] is what every handler reads; the router is in
//! `routes`.

pub mod auth;
mod changes;
pub mod conversations;
pub mod demo;
pub mod echo;
pub mod end_users;
pub mod events;
pub mod headers;
mod json_body;
pub mod key_uses;
pub mod openapi;
pub mod parse_errors;
pub mod path;
pub mod problem;
pub mod prompt_policy;
pub mod quota;
pub mod rate_limit;
pub mod replies;
mod reply_history;
pub mod reply_input;
mod reply_intake;
pub mod reply_view;
mod routes;
pub mod server;
pub mod settings;
pub mod signing;
mod state;

use tokio_util::sync::CancellationToken;

use replyd_core::quota::QuotaSettings;

use crate::probes::{DatabaseReady, Probes};
use crate::store::DatabaseSettings;
use settings::ApiSettings;

pub use routes::{ROUTES, router};
pub use server::serve;
pub use state::{ApiState, IntakeLimits};

/// What the API is built from: its sections of the settings tree, composed by the tree once
/// every rule between them held.
#[derive(Debug, Clone)]
pub struct ApiParts {
    pub database: DatabaseSettings,
    pub api: ApiSettings,
    pub quota: QuotaSettings,
    /// The bounds of new work, from the worker's, Kafka's and the provider's sections.
    pub limits: IntakeLimits,
}

/// Runs `replyd api` until `shutdown`: migrations first (retried while PostgreSQL is away),
/// then the API on `api.listen`; SIGTERM stops taking connections and lets open requests
/// finish.
pub async fn run(
    settings: ApiParts,
    probes: &Probes,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    let store = crate::connect_retry::migrated_store(&settings.database, &shutdown).await?;
    probes.add("api", DatabaseReady(store.clone()));
    let mut state = ApiState::new(store, settings.api.clone(), settings.limits);
    state.quota = settings.quota.policy();
    state
        .changes
        .listen(settings.database.clone(), shutdown.clone());
    let (addr, served) = serve(settings.api.listen, state, shutdown)
        .await
        .with_context(|| format!("binding {} (api.listen)", settings.api.listen))?;
    tracing::info!(%addr, "API listening");
    if settings.api.demo_page {
        tracing::info!(url = %format!("http://{addr}/demo"), "demo page on (api.demo_page)");
    }
    served.await.context("the API server")?;
    Ok(())
}
