//! `/metrics` (Prometheus), `/healthz` (the process is alive) and `/readyz` (every part of the
//! process can do its job now) on one small HTTP server per process, whatever parts it runs.
//!
//! Each part (worker, API, relay) adds its own [`Readiness`] once it has started, so a process
//! is unready until all its parts are up, and stays unready while any one of them is not.
//!
//! Alive is more than "the HTTP server answers": a part whose loop runs on a thread of its own
//! (the worker's poll loop) or a task of its own (the relay's) beats a [`Heartbeat`] on every
//! turn, and `/healthz` fails once one has been silent for `observability.liveness_timeout_ms`,
//! so a loop stuck for good (a deadlock, a call that never returns) is restarted by the
//! orchestrator instead of holding its partitions while the process looks healthy.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::State;
use axum::http::StatusCode;
use axum::routing::get;
use futures_util::future::BoxFuture;
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use tokio_util::sync::CancellationToken;

use serde::{Deserialize, Serialize};

use crate::store::Store;

/// Metrics and health endpoints, logs.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq, Eq, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ObservabilitySettings {
    /// Address of `/metrics`, `/healthz` and `/readyz`. Port 0 picks a free port (logged).
    pub listen: SocketAddr,
    /// `/healthz` fails once a part's loop (the worker's poll loop, the relay's) has not
    /// turned for this long, so the orchestrator restarts a process whose loop is stuck. Must
    /// be more than 5 s longer than the longest a loop may legitimately wait in one step: a
    /// revoke's drain (`worker.drain_timeout_ms`), a statement (`database.statement_timeout_ms`),
    /// a relay batch's publish (`relay.publish_timeout_ms`), a provider look-up of the quota
    /// reconciler, which the relay's loop runs (`provider.request_timeout_ms`).
    pub liveness_timeout_ms: u64,
}

impl Default for ObservabilitySettings {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9464)),
            liveness_timeout_ms: 120_000,
        }
    }
}

/// How much longer than a loop's longest single wait `observability.liveness_timeout_ms` must
/// be: the turn around the wait (a poll, a log line) takes a little too.
const LIVENESS_MARGIN_MS: u64 = 5_000;

impl ObservabilitySettings {
    /// `observability.liveness_timeout_ms` against the longest single wait of a loop's step
    /// (`longest`: the setting that names it, and its milliseconds): a loop waiting that long
    /// is not stuck, and restarting it would only repeat the wait.
    pub fn liveness_problems(&self, longest: (&str, u64)) -> Vec<(&'static str, String)> {
        let (setting, ms) = longest;
        if self.liveness_timeout_ms > ms.saturating_add(LIVENESS_MARGIN_MS) {
            return Vec::new();
        }
        vec![(
            "observability.liveness_timeout_ms",
            format!(
                "{} must be more than {LIVENESS_MARGIN_MS} ms above the longest single wait of a loop's step, {setting} ({ms}): a loop waiting that long is not stuck, and restarting it would only repeat the wait",
                self.liveness_timeout_ms
            ),
        )]
    }

    pub fn liveness_timeout(&self) -> Duration {
        Duration::from_millis(self.liveness_timeout_ms)
    }
}

/// When a loop last turned. Beaten from any thread; read by `/healthz` and the parts' own
/// readiness.
#[derive(Debug)]
pub struct Heartbeat {
    started: Instant,
    /// Milliseconds from `started` to the last beat.
    last_ms: AtomicU64,
}

impl Default for Heartbeat {
    fn default() -> Self {
        Self {
            started: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }
}

impl Heartbeat {
    /// The loop turned.
    pub fn beat(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.last_ms.store(now, Ordering::Relaxed);
    }

    /// How long since the last beat (since creation before the first).
    pub fn silent_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ms.load(Ordering::Relaxed));
        self.started.elapsed().saturating_sub(last)
    }
}

/// How long a part may take to say whether it is ready.
const CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// The process-wide recorder; installed once, whatever number of servers start.
fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let mut builder = PrometheusBuilder::new();
        // Buckets, not quantiles: a latency histogram can be summed over workers.
        for (name, buckets) in crate::telemetry::HISTOGRAM_BUCKETS {
            builder = builder
                .set_buckets_for_metric(
                    metrics_exporter_prometheus::Matcher::Full((*name).into()),
                    buckets,
                )
                .expect("the bucket list is not empty");
        }
        let handle = builder
            .install_recorder()
            // Only fails if another recorder was installed first, which nothing in replyd does.
            .expect("no other metrics recorder is installed");
        crate::telemetry::recording();
        handle
    })
}

/// One part's answer to "can you do your job now?": what it sees when it can, why not when
/// it cannot.
pub trait Readiness: Send + Sync + 'static {
    fn check(&self) -> BoxFuture<'_, Result<String, String>>;
}

/// A part's name and its check.
type Probe = (&'static str, Arc<dyn Readiness>);

/// A part's name and the heartbeat of its loop.
type Beat = (&'static str, Arc<Heartbeat>);

/// The parts of this process: their readiness checks and their loops' heartbeats.
#[derive(Clone, Default)]
pub struct Probes {
    checks: Arc<Mutex<Vec<Probe>>>,
    beats: Arc<Mutex<Vec<Beat>>>,
}

impl Probes {
    /// Adds `part`'s check; called by each part once it has started.
    pub fn add(&self, part: &'static str, readiness: impl Readiness) {
        self.lock().push((part, Arc::new(readiness)));
    }

    /// Watches `part`'s loop: `/healthz` fails while `heartbeat` is silent too long.
    pub fn watch(&self, part: &'static str, heartbeat: Arc<Heartbeat>) {
        self.beats
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .push((part, heartbeat));
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<Probe>> {
        // The list is only pushed to; a panic elsewhere cannot leave it half-written.
        self.checks
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Alive unless a watched loop has been silent for `limit`: one line per loop.
    fn alive(&self, limit: Duration) -> (StatusCode, String) {
        let beats = self
            .beats
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
            .clone();
        let mut alive = true;
        let mut lines = vec!["ok".to_owned()];
        for (part, heartbeat) in beats {
            let silent = heartbeat.silent_for();
            if silent >= limit {
                alive = false;
                lines[0] = "not alive".into();
                lines.push(format!(
                    "{part}: its loop has not turned for {:.1} s (observability.liveness_timeout_ms = {})",
                    silent.as_secs_f64(),
                    limit.as_millis()
                ));
            } else {
                lines.push(format!(
                    "{part}: its loop turned {:.1} s ago",
                    silent.as_secs_f64()
                ));
            }
        }
        let status = if alive {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (status, lines.join("\n"))
    }

    /// Every part's answer, one line each; ready only when `expected` parts have all said yes.
    async fn answer(&self, expected: usize) -> (StatusCode, String) {
        let probes = self.lock().clone();
        let mut ready = probes.len() >= expected;
        let mut lines = Vec::with_capacity(probes.len() + 1);
        for (part, readiness) in probes {
            match tokio::time::timeout(CHECK_TIMEOUT, readiness.check()).await {
                Ok(Ok(what)) => lines.push(format!("{part}: ready: {what}")),
                Ok(Err(why)) => {
                    ready = false;
                    lines.push(format!("{part}: not ready: {why}"));
                }
                Err(_) => {
                    ready = false;
                    lines.push(format!("{part}: not ready: no answer in 2 s"));
                }
            }
        }
        if lines.len() < expected {
            lines.push("starting".into());
        }
        let status = if ready {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (status, lines.join("\n"))
    }
}

/// The database answers a query: the readiness of a part that only needs PostgreSQL.
pub struct DatabaseReady(pub Store);

impl Readiness for DatabaseReady {
    fn check(&self) -> BoxFuture<'_, Result<String, String>> {
        Box::pin(async move {
            self.0
                .ping()
                .await
                .map(|()| "database answers".to_owned())
                .map_err(|e| format!("database: {}", crate::telemetry::chain(&e)))
        })
    }
}

#[derive(Clone)]
struct Served {
    probes: Probes,
    expected: usize,
    liveness: Duration,
}

/// Binds `settings.listen` (port 0 picks one) and serves until `shutdown`; returns the bound
/// address. `/readyz` is unready until `expected` parts have added their checks to `probes`.
pub async fn serve(
    settings: &ObservabilitySettings,
    probes: Probes,
    expected: usize,
    shutdown: CancellationToken,
) -> std::io::Result<SocketAddr> {
    let metrics = prometheus().clone();
    let app = Router::new()
        .route("/metrics", get(move || async move { metrics.render() }))
        .route(
            "/healthz",
            get(|State(served): State<Served>| async move { served.probes.alive(served.liveness) }),
        )
        .route(
            "/readyz",
            get(|State(served): State<Served>| async move {
                served.probes.answer(served.expected).await
            }),
        )
        .with_state(Served {
            probes,
            expected,
            liveness: settings.liveness_timeout(),
        });
    let listener = tokio::net::TcpListener::bind(settings.listen).await?;
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

/// Asks the `/healthz` of the process listening on `listen` (an unspecified address, such as
/// `0.0.0.0`, is asked on loopback). Ok when it answers 200.
pub async fn probe_health(listen: std::net::SocketAddr) -> anyhow::Result<()> {
    let mut addr = listen;
    if addr.ip().is_unspecified() {
        addr.set_ip(match addr {
            std::net::SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            std::net::SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let response = reqwest::Client::builder()
        .timeout(Duration::from_secs(3))
        .build()?
        .get(format!("http://{addr}/healthz"))
        .send()
        .await?;
    anyhow::ensure!(
        response.status().is_success(),
        "answered {}",
        response.status()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Fixed(Result<&'static str, &'static str>);

    impl Readiness for Fixed {
        fn check(&self) -> BoxFuture<'_, Result<String, String>> {
            let answer = self.0.map(str::to_owned).map_err(str::to_owned);
            Box::pin(async move { answer })
        }
    }

    #[tokio::test]
    async fn ready_only_when_every_expected_part_says_so() {
        let probes = Probes::default();
        let (status, body) = probes.answer(2).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(body, "starting");

        probes.add("api", Fixed(Ok("database answers")));
        let (status, _) = probes.answer(2).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "one part missing");

        probes.add("relay", Fixed(Err("outbox lag 90 s")));
        let (status, body) = probes.answer(2).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            body,
            "api: ready: database answers\nrelay: not ready: outbox lag 90 s"
        );
    }

    #[tokio::test]
    async fn ready_when_all_parts_are() {
        let probes = Probes::default();
        probes.add("api", Fixed(Ok("database answers")));
        let (status, body) = probes.answer(1).await;
        assert_eq!(status, StatusCode::OK);
        assert_eq!(body, "api: ready: database answers");
    }

    #[test]
    fn alive_until_a_watched_loop_is_silent_past_the_limit() {
        let probes = Probes::default();
        let (status, body) = probes.alive(Duration::from_millis(50));
        assert_eq!((status, body.as_str()), (StatusCode::OK, "ok"));
        let turning = Arc::new(Heartbeat::default());
        let stuck = Arc::new(Heartbeat::default());
        probes.watch("worker", Arc::clone(&turning));
        probes.watch("relay", Arc::clone(&stuck));
        turning.beat();
        stuck.beat();
        let (status, _) = probes.alive(Duration::from_secs(60));
        assert_eq!(status, StatusCode::OK);
        // One loop keeps turning, the other stops: past the limit, the process is not alive,
        // and the answer names the loop and the setting.
        std::thread::sleep(Duration::from_millis(120));
        turning.beat();
        let (status, body) = probes.alive(Duration::from_millis(100));
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{body}");
        let lines: Vec<&str> = body.lines().collect();
        assert_eq!(lines[0], "not alive");
        assert!(lines[1].starts_with("worker: its loop turned"), "{body}");
        assert!(
            lines[2].starts_with("relay: its loop has not turned for")
                && lines[2].ends_with("(observability.liveness_timeout_ms = 100)"),
            "{body}"
        );
        // It turns again: alive again.
        stuck.beat();
        assert_eq!(probes.alive(Duration::from_millis(100)).0, StatusCode::OK);
    }
}
