//! `/metrics` (Prometheus), `/healthz` (the process answers) and `/readyz` (the consumer polls
//! and the database answers) on one small HTTP server.

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

use crate::kafka::consumer::ConsumerStatus;
use crate::store::Store;

/// The process-wide recorder; installed once, whatever number of servers start.
fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .install_recorder()
            // Only fails if another recorder was installed first, which nothing in replyd does.
            .expect("no other metrics recorder is installed")
    })
}

#[derive(Clone)]
struct Probe {
    status: Arc<ConsumerStatus>,
    store: Store,
}

/// Binds `listen` (port 0 picks one) and serves until `shutdown`; returns the bound address.
pub async fn serve(
    listen: SocketAddr,
    status: Arc<ConsumerStatus>,
    store: Store,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let metrics = prometheus().clone();
    let app = Router::new()
        .route("/metrics", get(move || async move { metrics.render() }))
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(ready))
        .with_state(Probe { status, store });
    let listener = tokio::net::TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    tokio::spawn(async move {
        let served = axum::serve(listener, app)
            .with_graceful_shutdown(async move { shutdown.cancelled().await })
            .await;
        if let Err(e) = served {
            tracing::error!(error = %e, "observability server stopped");
        }
    });
    Ok(addr)
}

async fn ready(State(probe): State<Probe>) -> (StatusCode, String) {
    if !probe.status.polling.load(Ordering::Relaxed) {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "consumer not polling".into(),
        );
    }
    match tokio::time::timeout(Duration::from_secs(2), probe.store.ping()).await {
        Ok(Ok(())) => (
            StatusCode::OK,
            format!(
                "ready: {} partitions assigned",
                probe.status.assigned_partitions.load(Ordering::Relaxed)
            ),
        ),
        Ok(Err(e)) => (StatusCode::SERVICE_UNAVAILABLE, format!("database: {e}")),
        Err(_) => (
            StatusCode::SERVICE_UNAVAILABLE,
            "database: no answer in 2 s".into(),
        ),
    }
}
