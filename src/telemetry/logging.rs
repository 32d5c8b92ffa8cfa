//! The process's log set-up: `RUST_LOG` picks levels (default `info`), lines go to standard
//! error, as text for people or JSON lines (`--log-json`) for log pipelines. When traces are on
//! ([`super::trace`]), their exporter is a second layer beside the log's. The spans of a trace
//! have a target of their own: `RUST_LOG`'s filter lets it through exactly when traces are on,
//! the log's layer drops it, and the exporter's layer keeps nothing else. What a line gains
//! from a trace is its ids: a line written inside a span of a sampled trace carries
//! `trace_id` and `span_id`, so a log pipeline joins it to the trace.

use std::fmt;
use std::io::IsTerminal;

use tracing::Subscriber;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::registry::LookupSpan;
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
    let traced = traces.is_some();
    if json {
        let format = tracing_subscriber::fmt::format().json();
        registry
            .with(
                fmt.json()
                    .event_format(WithTraceIds {
                        inner: format,
                        json: true,
                        traced,
                    })
                    .with_filter(not_traces()),
            )
            .init();
    } else {
        let format = tracing_subscriber::fmt::format().with_ansi(std::io::stderr().is_terminal());
        registry
            .with(
                fmt.event_format(WithTraceIds {
                    inner: format,
                    json: false,
                    traced,
                })
                .with_filter(not_traces()),
            )
            .init();
    }
}

/// A line's format, with the ids of the trace span it was written in. The log's layer does not
/// see the trace's spans (they are filtered out of it, so turning traces on adds no span to a
/// line), so the ids are read from the current span as the process knows it.
struct WithTraceIds<F> {
    inner: F,
    json: bool,
    /// Traces on: without them no span has ids, and nothing is looked up.
    traced: bool,
}

impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    F: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> fmt::Result {
        let Some((trace_id, span_id)) = self.traced.then(super::trace::current_ids).flatten()
        else {
            return self.inner.format_event(ctx, writer, event);
        };
        let mut line = String::new();
        self.inner
            .format_event(ctx, Writer::new(&mut line), event)?;
        if self.json
            && let Some(rest) = line.strip_prefix('{')
        {
            write!(
                writer,
                "{{\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\",{rest}"
            )
        } else {
            let (text, end) = match line.strip_suffix('\n') {
                Some(text) => (text, "\n"),
                None => (line.as_str(), ""),
            };
            write!(writer, "{text} trace_id={trace_id} span_id={span_id}{end}")
        }
    }
}
