//! How every long-running command runs: `replyd worker`, `replyd api` and `replyd relay` each
//! run one part, `replyd serve` runs all three in one process for small installations and the
//! demo. Whatever the parts, the process has one observability server (`/metrics`, `/healthz`,
//! `/readyz` on `observability.listen`, ready once every part is), one set of settings and one
//! shutdown path: SIGTERM drains every part. If one part fails, the others are stopped too, so
//! the process never runs half of the chain unnoticed.

use std::fmt;

use anyhow::Context as _;
use futures_util::future::OptionFuture;
use tokio_util::sync::CancellationToken;

use crate::config::Settings;
use crate::probes::Probes;

/// Which parts of the chain a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parts {
    pub api: bool,
    pub relay: bool,
    pub worker: bool,
}

impl Parts {
    pub const ALL: Parts = Parts {
        api: true,
        relay: true,
        worker: true,
    };
    pub const API: Parts = Parts {
        api: true,
        ..Parts::NONE
    };
    pub const RELAY: Parts = Parts {
        relay: true,
        ..Parts::NONE
    };
    pub const WORKER: Parts = Parts {
        worker: true,
        ..Parts::NONE
    };
    const NONE: Parts = Parts {
        api: false,
        relay: false,
        worker: false,
    };

    fn count(self) -> usize {
        [self.api, self.relay, self.worker]
            .into_iter()
            .filter(|on| *on)
            .count()
    }
}

impl fmt::Display for Parts {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names: Vec<&str> = [
            (self.api, "api"),
            (self.relay, "relay"),
            (self.worker, "worker"),
        ]
        .into_iter()
        .filter_map(|(on, name)| on.then_some(name))
        .collect();
        f.write_str(&names.join(","))
    }
}

/// Runs `parts` until `shutdown` or until one of them fails.
pub async fn run(
    settings: Settings,
    parts: Parts,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let probes = Probes::default();
    let listen = settings.observability.listen;
    let addr = crate::probes::serve(
        &settings.observability,
        probes.clone(),
        parts.count(),
        shutdown.clone(),
    )
    .await
    .with_context(|| format!("binding {listen} (observability.listen)"))?;
    // Before the line that says where to scrape: the first scrape finds every family.
    for (on, families) in [
        (parts.api, crate::telemetry::API_METRICS),
        (parts.relay, crate::telemetry::RELAY_METRICS),
        (parts.worker, crate::telemetry::WORKER_METRICS),
    ] {
        if on {
            crate::telemetry::register(families);
        }
    }

    tracing::info!(%addr, %parts, "serving /metrics, /healthz and /readyz");

    let part = |name: &'static str, result: anyhow::Result<()>| {
        if let Err(e) = &result {
            tracing::error!(part = name, error = %crate::telemetry::chain(e.as_ref()), "a part failed; stopping the others");
            shutdown.cancel();
        }
        result.map_err(|e| e.context(name))
    };
    let (api, relay, worker) = tokio::join!(
        OptionFuture::from(parts.api.then_some(async {
            part(
                "api",
                crate::api::run(settings.api_parts(), &probes, shutdown.clone()).await,
            )
        })),
        OptionFuture::from(parts.relay.then_some(async {
            part(
                "relay",
                crate::relay::run(settings.relay_parts(), &probes, shutdown.clone()).await,
            )
        })),
        OptionFuture::from(parts.worker.then_some(async {
            part(
                "worker",
                crate::worker::run_worker(settings.worker_parts(), &probes, shutdown.clone()).await,
            )
        })),
    );
    api.unwrap_or(Ok(()))
        .and(relay.unwrap_or(Ok(())))
        .and(worker.unwrap_or(Ok(())))
}

/// A token cancelled on the first SIGTERM or SIGINT: a worker drains and leaves the group, the
/// API stops taking connections, a tool stops. Call it from within the runtime.
pub fn shutdown_on_signal() -> CancellationToken {
    let token = CancellationToken::new();
    let cancel = token.clone();
    tokio::spawn(async move {
        use tokio::signal::unix::{SignalKind, signal};
        // Installing a handler only fails if the runtime has no signal driver; ours has.
        let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: shutting down"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: shutting down"),
        }
        cancel.cancel();
    });
    token
}
