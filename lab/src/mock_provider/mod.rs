//! An OpenAI-compatible mock provider with injectable faults and the limits and recovery of
//! the real APIs, for the tests, the benchmarks and the chaos harness. It counts every
//! generation per `Idempotency-Key`, which is how a run proves one logical request per task
//! (I6) and bounded effort (I7) from the provider's side, and every admission per second,
//! which is how it proves a capacity held (I9).
//!
//! Like the real chat APIs it honours no `Idempotency-Key` unless told to
//! (`honour_idempotency_key`), and it imitates one real API's refusals and recovery
//! ([`MockProfile`]). Routes: `POST /v1/chat/completions`; `POST /v1/responses` (background
//! create: answers the id at once, generates in a spawned task) and `GET /v1/responses/{id}`
//! (both 404 when `background_responses` is off; an ended response is 404 after its
//! retention); `POST /v1/messages` (Anthropic's Messages API: `x-api-key` and
//! `anthropic-version` required, Anthropic's bodies and error types, never deduplicated, as
//! Anthropic documents no idempotency key); `GET /v1/models` (the model list, in the
//! profile's shape, generating nothing); `GET /stats`, `GET /stats/{key}`, `GET|PUT /faults`,
//! `GET /healthz`. The OpenAI-compatible routes are served under Gemini's and Azure's roots
//! too, and Azure's classic deployment route with its `api-version` (`routes`). With limits
//! set, a generating request over one is answered 429 at once without any work, and every
//! answer carries the rate-limit headers.
//!
//! Each generating route streams as its real API does when asked (`"stream": true`): chat
//! completion chunks ending with `[DONE]`, Anthropic's message events, a background response's
//! numbered events, which `GET /v1/responses/{id}?stream=true&starting_after=N` resumes. A
//! stream takes its generation's latency in all, as an answer sent whole does: its first delta
//! comes after a quarter of it and its deltas (`stream_chunk_chars`) evenly over the rest
//! ([`pace`]; `stream_chunk_interval_ms` paces them at a fixed interval after the latency
//! instead). The stream faults cut, stall or break a stream with the API's error event
//! mid-way, so a client is tried against the streams it will meet, not kinder ones.
//!
//! The decisions (fault, latency, reply text) live in [`behaviour`], the limits in
//! [`capacity`], the background responses' state machine and event log in [`background`], the
//! streams' events and breaks in [`stream`] and their timing in [`pace`], all pure; the shared state and the mock's own
//! routes in `server`, the generating routes in `chat`, `responses` and `messages`, the
//! sending of streams in `sse`, where each is served in `routes`; this file starts and stops
//! the server.

pub mod background;
pub mod behaviour;
pub mod capacity;
mod chat;
#[cfg(test)]
mod http_tests;
mod messages;
mod models;
pub mod pace;
mod responses;
mod routes;
mod server;
pub mod settings;
mod sse;
pub mod stream;

use std::future::Future;
use std::io::Write;
use std::net::SocketAddr;
use std::sync::Arc;

use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

pub use server::{KeyStats, RefusalCounts, SecondTally, StatsSnapshot};
pub use settings::{
    FaultSettings, InvalidSettings, LimitHeaders, LimitSettings, MockProfile, MockProviderArgs,
    MockSettings,
};

use server::MockState;

/// A running mock provider. Dropping the handle stops the server too; [`MockHandle::shutdown`]
/// also waits for it.
pub struct MockHandle {
    addr: SocketAddr,
    state: Arc<MockState>,
    stop: watch::Sender<bool>,
    task: Option<JoinHandle<std::io::Result<()>>>,
}

impl MockHandle {
    /// The address the server is bound to (the real port when asked for port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `http://ADDR`, the `base_url` for an OpenAI-compatible client.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The counters that `GET /stats` answers, read without a request.
    pub fn stats(&self) -> StatsSnapshot {
        self.state.stats()
    }

    /// Stops accepting, answers requests still waiting (latency, hang) with 503 at once, lets
    /// open connections finish, and waits for the server task.
    pub async fn shutdown(mut self) -> std::io::Result<()> {
        self.stop.send_replace(true);
        match self.task.take() {
            Some(task) => task.await.map_err(std::io::Error::other)?,
            None => Ok(()),
        }
    }
}

impl Drop for MockHandle {
    fn drop(&mut self) {
        self.stop.send_replace(true);
    }
}

/// Binds `listen` (port 0 allowed) and serves the mock in a tokio task. Settings that
/// contradict themselves, or limits that could admit nothing, are refused as `InvalidInput`.
pub async fn spawn(settings: MockSettings, listen: SocketAddr) -> std::io::Result<MockHandle> {
    settings
        .validate()
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    let listener = TcpListener::bind(listen).await?;
    let addr = listener.local_addr()?;
    let (stop, stopped) = watch::channel(false);
    let state = Arc::new(MockState::new(settings, stopped.clone()));
    let app = server::routes()
        .merge(routes::api_routes())
        .with_state(Arc::clone(&state));
    let mut signal = stopped;
    let task = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                // An error means the handle is gone, which also means stop.
                let _ = signal.wait_for(|&down| down).await;
            })
            .await
    });
    Ok(MockHandle {
        addr,
        state,
        stop,
        task: Some(task),
    })
}

/// The `mock-provider` subcommand: binds, prints exactly one line `mock-provider listening on
/// http://ADDR` to stdout (scripts parse it), and serves until `shutdown` completes.
pub async fn run(
    args: MockProviderArgs,
    shutdown: impl Future<Output = ()>,
) -> std::io::Result<()> {
    run_announcing(args, shutdown, &mut std::io::stdout()).await
}

/// [`run`], announcing the address on `out`.
async fn run_announcing(
    args: MockProviderArgs,
    shutdown: impl Future<Output = ()>,
    out: &mut impl Write,
) -> std::io::Result<()> {
    let listen = args.listen;
    let mut handle = spawn(args.into(), listen).await?;
    writeln!(out, "mock-provider listening on {}", handle.base_url())?;
    // A script reading our stdout through a pipe would otherwise wait for a buffer to fill.
    out.flush()?;
    tracing::info!(addr = %handle.addr(), "mock provider serving");
    let mut task = handle.task.take().expect("spawn always sets the task");
    tokio::select! {
        () = shutdown => {
            handle.stop.send_replace(true);
            task.await.map_err(std::io::Error::other)?
        }
        served = &mut task => served.map_err(std::io::Error::other)?,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Cli {
        #[command(flatten)]
        args: MockProviderArgs,
    }

    #[tokio::test]
    async fn run_announces_the_bound_port_on_one_line_and_stops_when_told() {
        let args = Cli::try_parse_from(["mock", "--listen=127.0.0.1:0"])
            .unwrap()
            .args;
        let mut out = Vec::new();

        run_announcing(args, std::future::ready(()), &mut out)
            .await
            .expect("binds, announces and stops");

        let text = String::from_utf8(out).unwrap();
        let port = text
            .strip_prefix("mock-provider listening on http://127.0.0.1:")
            .and_then(|rest| rest.strip_suffix('\n'))
            .and_then(|port| port.parse::<u16>().ok());
        assert!(matches!(port, Some(p) if p != 0), "{text:?}");
    }

    #[tokio::test]
    async fn contradictory_settings_are_refused_before_binding() {
        let settings = MockSettings {
            faults: FaultSettings {
                error_rate: 2.0,
                ..FaultSettings::default()
            },
            ..MockSettings::default()
        };
        let error = spawn(settings, "127.0.0.1:0".parse().unwrap())
            .await
            .err()
            .expect("refused");
        assert_eq!(error.kind(), std::io::ErrorKind::InvalidInput);
        assert!(error.to_string().contains("error_rate"), "{error}");
    }
}
