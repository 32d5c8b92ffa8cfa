//! `replyd serve`: the API, the relay and a worker in one process, for small installations
//! and the demo. Each part is the same code as its own command, with the same settings and
//! the same shutdown path: SIGTERM drains all three. If one part fails, the others are
//! stopped too, so the process never runs half of the chain unnoticed.

use tokio_util::sync::CancellationToken;

use crate::config::Settings;

pub async fn run(settings: Settings, shutdown: CancellationToken) -> anyhow::Result<()> {
    let part = |name: &'static str, result: anyhow::Result<()>| {
        if let Err(e) = &result {
            tracing::error!(part = name, error = %crate::telemetry::chain(e.as_ref()), "a part of serve failed; stopping the others");
            shutdown.cancel();
        }
        result.map_err(|e| e.context(name))
    };
    let (api, relay, worker) = tokio::join!(
        async {
            part(
                "api",
                crate::api::run(settings.clone(), shutdown.clone()).await,
            )
        },
        async {
            part(
                "relay",
                crate::relay::run(settings.clone(), shutdown.clone()).await,
            )
        },
        async {
            part(
                "worker",
                crate::worker::run_worker(settings.clone(), shutdown.clone()).await,
            )
        },
    );
    api.and(relay).and(worker)
}
