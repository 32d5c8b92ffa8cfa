//! The process's log set-up: `RUST_LOG` picks levels (default `info`), lines go to standard
//! error, as text for people or JSON lines (`--log-json`) for log pipelines. When traces are on
//! ([`super::trace`]), their exporter is a second layer beside the log's. The spans of a trace
//! have a target of their own: `RUST_LOG`'s filter lets it through exactly when traces are on,
//! the log's layer drops it, and the exporter's layer keeps nothing else, so turning traces on
//! changes no log line.

use std::io::IsTerminal;

use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

use super::trace::{TARGET, Traces};

/// Installs the global subscriber; call once, first thing.
pub fn init(json: bool, traces: Option<&Traces>) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let traced = if traces.is_some() { "info" } else { "off" };
    let filter = filter.add_directive(
        format!("{TARGET}={traced}")
            .parse()
            .expect("a constant directive parses"),
    );
    let not_traces = || filter_fn(|meta| meta.target() != TARGET);
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(traces.map(Traces::layer));
    if json {
        registry.with(fmt.json().with_filter(not_traces())).init();
    } else {
        registry.with(fmt.with_filter(not_traces())).init();
    }
}
