//! The HTTP API (`replyd api`): the front half of the chain. A browser submits a message with
//! an `Idempotency-Key`; one transaction saves it with its reply task and the outbox row that
//! hands the task to Kafka (I6); the caller follows the task by its id.
//!
//! One file per route group: [`replies`], [`events`], [`quota`]; [`demo`] is the demo chat
//! page, served only when `api.demo_page` is on. [`auth`] turns the bearer key into the
//! workspace; [`problem`] renders every error as problem+json. Unknown routes and methods are
//! problems too, and so are the answers of the HTTP server itself ([`server`], with
//! [`parse_errors`] for the heads its parser refuses), so no refusal of this server is
//! anything but problem+json.

pub mod auth;
pub mod demo;
pub mod events;
pub mod openapi;
pub mod parse_errors;
pub mod problem;
pub mod quota;
pub mod rate_limit;
pub mod replies;
pub mod server;

use axum::Router;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;

use crate::config::{ApiSettings, Settings};
use crate::store::Store;
use crate::telemetry::http::{DatabaseReady, Probes};
use problem::Problem;
use replyd_core::quota::QuotaPolicy;
pub use server::serve;

/// What bounds the work the API admits, from the worker's and Kafka's settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IntakeLimits {
    /// Attempt budget of API-created tasks (`worker.default_max_attempts`).
    pub max_attempts: u32,
    /// Largest message plus context (`worker.max_prompt_bytes`): a workers' limit, so the API
    /// refuses at once what the worker would dead-letter.
    pub max_prompt_bytes: usize,
    /// Largest Kafka record (`kafka.max_record_bytes`): the API refuses at once a task whose
    /// record the relay could never publish.
    pub max_record_bytes: usize,
    /// The model a request that names none is asked of (`provider.default_model`): what a
    /// workspace's model list judges it by.
    pub default_model: String,
}

impl IntakeLimits {
    pub fn of(settings: &Settings) -> Self {
        Self {
            max_attempts: settings.worker.default_max_attempts,
            max_prompt_bytes: settings.worker.max_prompt_bytes,
            max_record_bytes: settings.kafka.max_record_bytes,
            default_model: settings.provider.default_model.clone(),
        }
    }
}

impl Default for IntakeLimits {
    /// The limits of the default settings.
    fn default() -> Self {
        Self::of(&Settings::default())
    }
}

/// What every handler reads.
#[derive(Clone)]
pub struct ApiState {
    pub store: Store,
    pub settings: ApiSettings,
    /// What bounds new work.
    pub limits: IntakeLimits,
    /// Task status changes, for the event streams.
    pub changes: events::TaskChanges,
    /// The quota policy (`[quota]`) new work is admitted under.
    pub quota: QuotaPolicy,
    /// The request rate per API key (`api.rate_limit_*`).
    pub limiter: std::sync::Arc<rate_limit::KeyLimiter>,
}

impl ApiState {
    pub fn new(store: Store, settings: ApiSettings, limits: IntakeLimits) -> Self {
        Self {
            limiter: std::sync::Arc::new(rate_limit::KeyLimiter::new(&settings)),
            store,
            settings,
            limits,
            changes: events::TaskChanges::default(),
            quota: crate::config::QuotaSettings::default().policy(),
        }
    }
}

/// The API's routes, each documented in [`openapi`] (a test holds the two together).
pub const ROUTES: [&str; 5] = [
    "/v1/replies",
    "/v1/replies/{task_id}",
    "/v1/replies/{task_id}/events",
    "/v1/replies/{task_id}/regenerate",
    "/v1/quota",
];

pub fn router(state: ApiState) -> Router {
    let [create, show, events, regenerate, quota] = ROUTES;
    let pages = if state.settings.demo_page {
        demo::router()
    } else {
        Router::new()
    };
    Router::new()
        .route(create, post(replies::create))
        .route(show, get(replies::show))
        .route(events, get(events::stream))
        .route(regenerate, post(replies::regenerate))
        .route(quota, get(quota::show))
        .route(
            "/openapi.json",
            get(|| async {
                (
                    [(axum::http::header::CONTENT_TYPE, "application/json")],
                    openapi::document(),
                )
            }),
        )
        // Each routed request is a server span of its trace (its caller's, when it sent a
        // `traceparent`); the intake stores the span's context with the outbox row.
        .route_layer(axum::middleware::from_fn(trace_request))
        .merge(pages)
        .fallback(|| async { Problem::not_found("no such route") })
        .method_not_allowed_fallback(|| async {
            Problem::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method_not_allowed",
                "Method not allowed",
                "this route does not take that method",
            )
        })
        .layer(axum::middleware::from_fn_with_state(
            HeadLimits::of(&state.settings),
            limit_headers,
        ))
        .with_state(state)
}

/// Runs a routed request inside its server span and records the answer's status on it.
async fn trace_request(
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use tracing::Instrument as _;
    if !crate::telemetry::trace::on() {
        return next.run(request).await;
    }
    let route = request
        .extensions()
        .get::<axum::extract::MatchedPath>()
        .map_or("", |path| path.as_str())
        .to_owned();
    let span =
        crate::telemetry::trace::api_request(request.method().as_str(), &route, request.headers());
    let response = next.run(request).instrument(span.clone()).await;
    span.record("http.response.status_code", response.status().as_u16());
    response
}

/// What [`limit_headers`] holds a request's head to.
#[derive(Debug, Clone, Copy)]
struct HeadLimits {
    max_headers: usize,
    max_header_bytes: usize,
    max_body_bytes: usize,
}

impl HeadLimits {
    fn of(settings: &ApiSettings) -> Self {
        Self {
            max_headers: settings.max_headers,
            max_header_bytes: settings.max_header_bytes,
            max_body_bytes: settings.max_body_bytes,
        }
    }
}

/// Refuses, before any handler or database work, a request with more header fields than
/// `api.max_headers` or a header block (names and values) over `api.max_header_bytes`
/// (`431`), and one whose declared `Content-Length` is over `api.max_body_bytes` (`413`).
/// The body is not read, so a client that sent `Expect: 100-continue` is not told to send it.
async fn limit_headers(
    axum::extract::State(limits): axum::extract::State<HeadLimits>,
    request: axum::extract::Request,
    next: axum::middleware::Next,
) -> axum::response::Response {
    use axum::response::IntoResponse as _;
    let too_large = |detail: String| {
        Problem::new(
            StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
            "headers_too_large",
            "Request header fields too large",
            detail,
        )
        .into_response()
    };
    let headers = request.headers();
    // `len` counts every field, a repeated name each time.
    if headers.len() > limits.max_headers {
        return too_large(format!(
            "the request has {} header fields; api.max_headers allows {}",
            headers.len(),
            limits.max_headers
        ));
    }
    let size: usize = headers
        .iter()
        .map(|(name, value)| name.as_str().len() + value.len())
        .sum();
    if size > limits.max_header_bytes {
        return too_large(format!(
            "the request's headers take {size} bytes; api.max_header_bytes allows {}",
            limits.max_header_bytes
        ));
    }
    // hyper has already refused a Content-Length that is not one number.
    let declared = headers
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(declared) = declared
        && declared > limits.max_body_bytes as u64
    {
        return replies::body_too_large(limits.max_body_bytes).into_response();
    }
    next.run(request).await
}

/// The one value of a header that must not be ambiguous (`Authorization`,
/// `Idempotency-Key`): `None` when absent; the same value repeated is that value; different
/// values are `Err` with how many there are.
pub(crate) fn one_value<'a>(
    headers: &'a HeaderMap,
    name: &str,
) -> Result<Option<&'a HeaderValue>, usize> {
    let mut values = headers.get_all(name).iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    let mut distinct = vec![first];
    for value in values {
        if !distinct.contains(&value) {
            distinct.push(value);
        }
    }
    match distinct.len() {
        1 => Ok(Some(first)),
        n => Err(n),
    }
}

/// Runs `replyd api` until `shutdown`: migrations first (retried while PostgreSQL is away),
/// then the API on `api.listen`; SIGTERM stops taking connections and lets open requests
/// finish.
pub async fn run(
    settings: Settings,
    probes: &Probes,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    use anyhow::Context as _;
    crate::startup::migrate(&settings.database, &shutdown).await?;
    let store = Store::connect(&settings.database).context("database settings")?;
    probes.add("api", DatabaseReady(store.clone()));
    let mut state = ApiState::new(store, settings.api.clone(), IntakeLimits::of(&settings));
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
