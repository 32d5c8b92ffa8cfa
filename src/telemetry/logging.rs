//! The process's log set-up: `RUST_LOG` picks levels (default `info`), lines go to standard
//! error, as text for people or JSON lines (`--log-json`) for log pipelines.

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// Installs the global subscriber; call once, first thing.
pub fn init(json: bool) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    if json {
        builder.json().init();
    } else {
        builder.init();
    }
}
