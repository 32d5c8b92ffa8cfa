//! A product's own server, as a team building on replyd runs one: it serves the demo chat page
//! on its own origin and holds the workspace's API key, which never reaches the browser. A
//! page signs in as an end user (`POST /demo/session` with a name; a real product would check
//! a password or its own session cookie) and gets a short-lived end-user token from replyd
//! (`POST /v1/end-user-tokens`), then calls replyd on its origin directly, which must allow
//! this one (`api.cors_allowed_origins`). The page asks here again when the token runs out.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::json;

#[derive(Debug, clap::Args)]
pub struct ProductArgs {
    /// Where replyd's API is, e.g. `http://127.0.0.1:8080`: the page calls it there.
    #[arg(long)]
    pub api: String,
    /// The workspace's API key, kept on this server.
    #[arg(long, env = "REPLYD_API_KEY", hide_env_values = true)]
    pub api_key: String,
    /// Where this server listens (its origin is the page's).
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// How long each end user's token lives, in seconds.
    #[arg(long, default_value_t = 900)]
    pub token_ttl_s: u32,
}

#[derive(Clone)]
struct Product {
    api: String,
    key: Arc<str>,
    ttl: u32,
    http: reqwest::Client,
    issued: Arc<AtomicU64>,
}

#[derive(Deserialize)]
struct SignIn {
    user_id: String,
}

/// Serves until `shutdown` resolves.
pub async fn run(
    args: ProductArgs,
    shutdown: impl std::future::Future<Output = ()> + Send + 'static,
) -> anyhow::Result<()> {
    let api = args.api.trim_end_matches('/').to_owned();
    // The page's Content-Security-Policy names it, and the API's CORS setting names this
    // server's origin the same way: an origin, nothing after.
    replyd::api::settings::check_origin(&api)
        .map_err(|why| anyhow::anyhow!("--api {api:?}: {why}"))?;
    let product = Product {
        api: api.clone(),
        key: args.api_key.into(),
        ttl: args.token_ttl_s,
        http: reqwest::Client::new(),
        issued: Arc::new(AtomicU64::new(0)),
    };
    let app = Router::new()
        .route("/demo/config.json", get(config))
        .route("/demo/session", post(session))
        .with_state(product)
        .merge(replyd::api::demo::pages(Some(&api)));
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding --listen {}", args.listen))?;
    let addr = listener.local_addr()?;
    eprintln!("product: the page is http://{addr}/demo (calling replyd at {api})");
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown)
        .await
        .context("serving")
}

/// Where the page finds replyd, and that it signs in here.
async fn config(State(product): State<Product>) -> Response {
    Json(json!({"api": product.api, "session": "/demo/session"})).into_response()
}

/// A token for the end user the page signs in as, asked of replyd with the workspace's key.
async fn session(State(product): State<Product>, Json(sign_in): Json<SignIn>) -> Response {
    let asked = product
        .http
        .post(format!("{}/v1/end-user-tokens", product.api))
        .bearer_auth(&*product.key)
        .json(&json!({"user_id": sign_in.user_id, "ttl_seconds": product.ttl}))
        .send()
        .await;
    match asked {
        Ok(response) => {
            let status = response.status();
            let body = response.text().await.unwrap_or_default();
            if status.is_success() {
                let n = product.issued.fetch_add(1, Ordering::Relaxed) + 1;
                eprintln!(
                    "product: token {n} issued for end user {:?}",
                    sign_in.user_id
                );
            }
            // replyd's answer as it came: the token, or its problem (never the key).
            (
                StatusCode::from_u16(status.as_u16()).unwrap_or(StatusCode::BAD_GATEWAY),
                [(axum::http::header::CONTENT_TYPE, "application/json")],
                body,
            )
                .into_response()
        }
        Err(e) => (
            StatusCode::BAD_GATEWAY,
            Json(json!({"detail": format!("replyd did not answer: {e}")})),
        )
            .into_response(),
    }
}
