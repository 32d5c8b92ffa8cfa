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
use tracing_subscriber::Layer;
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
    let traced = traces.is_some();
    let filter = filter.add_directive(
        format!("{TARGET}={}", if traced { "info" } else { "off" })
            .parse()
            .expect("a constant directive parses"),
    );
    let ansi = std::io::stderr().is_terminal();
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(traces.map(Traces::layer));
    if json {
        let lines = fmt.json().event_format(WithTraceIds {
            inner: tracing_subscriber::fmt::format().json(),
            json: true,
            traced,
        });
        install(registry, lines, traced);
    } else {
        let lines = fmt.event_format(WithTraceIds {
            inner: tracing_subscriber::fmt::format().with_ansi(ansi),
            json: false,
            traced,
        });
        install(registry, lines, traced);
    }
}

/// Puts the log's layer on `registry` and installs the whole. The layer keeps the trace's
/// spans out by a filter of its own only when traces are on: with them off, the filter above
/// has turned their target off for every layer already, and a layer's own filter is not free:
/// the registry then looks up its verdict at every enter and exit of every span, and a
/// record's span is entered at each of the record's polls.
fn install<S, L>(registry: S, lines: L, traced: bool)
where
    S: Subscriber + for<'a> LookupSpan<'a> + Send + Sync + 'static,
    L: Layer<S> + Send + Sync + 'static,
{
    let lines: Box<dyn Layer<S> + Send + Sync> = if traced {
        Box::new(lines.with_filter(filter_fn(|meta| meta.target() != TARGET)))
    } else {
        Box::new(lines)
    };
    registry.with(lines).init();
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
