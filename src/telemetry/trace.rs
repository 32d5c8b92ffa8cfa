//! Distributed traces (OpenTelemetry), off unless `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set: one trace per task, from the API request
//! through the outbox row (its `traceparent` column), the Kafka record (a W3C `traceparent`
//! header), the worker's claim, the provider call (the header sent on) to the completion.
//!
//! The spans of a trace are their own set, under the target [`TARGET`]: the log output never
//! shows them and the exporter sees nothing else, so turning traces on changes no log line,
//! and with traces off each span here is disabled at its call site (no allocation, no export).
//! Every function of this file that makes a span names its hop; the carriers (HTTP headers,
//! Kafka headers, the stored `traceparent`) go through the W3C trace-context propagator.

use std::collections::HashMap;

use opentelemetry::propagation::{Extractor, Injector, TextMapPropagator};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use rdkafka::message::{Headers, OwnedHeaders};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// The target of every span a trace is made of (and of nothing else).
pub const TARGET: &str = "replyd::trace";

/// The W3C header and column name of a span's context.
pub const TRACEPARENT: &str = "traceparent";

/// Why the trace exporter could not be set up: each names the environment variable.
#[derive(Debug, thiserror::Error)]
pub enum TraceSetupError {
    #[error(
        "{variable} is `{value}`: replyd exports traces as OTLP over HTTP (`http/protobuf`) only; unset it or set it to http/protobuf and point the endpoint at the collector's HTTP port (4318)"
    )]
    Protocol {
        variable: &'static str,
        value: String,
    },
    #[error("{variable} is `{value}`: {reason}")]
    Endpoint {
        variable: &'static str,
        value: String,
        reason: String,
    },
    #[error("the OTLP trace exporter: {0}")]
    Exporter(String),
}

/// What the environment asks of traces, read by [`TraceSettings::from_env`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceSettings {
    /// `service.name` when `OTEL_SERVICE_NAME` (or `OTEL_RESOURCE_ATTRIBUTES`) does not say.
    pub default_service: String,
    /// Where spans go, for the log: the URL without credentials or query, and its variable.
    pub endpoint: String,
}

/// The endpoint variables, the signal's own first (as the OpenTelemetry specification orders
/// them).
const ENDPOINT_VARIABLES: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
];
const PROTOCOL_VARIABLES: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
];

impl TraceSettings {
    /// Whether traces are on, from the variables `lookup` gives (`std::env::var` in the
    /// process; a map in tests). `None`: off (no endpoint, or `OTEL_SDK_DISABLED=true`, or
    /// `OTEL_TRACES_EXPORTER=none`).
    pub fn from_env(
        lookup: impl Fn(&str) -> Option<String>,
        default_service: &str,
    ) -> Result<Option<Self>, TraceSetupError> {
        let set = |name: &str| lookup(name).filter(|v| !v.trim().is_empty());
        if set("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
            || set("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"))
        {
            return Ok(None);
        }
        let Some((variable, value)) = ENDPOINT_VARIABLES
            .iter()
            .find_map(|&name| set(name).map(|v| (name, v)))
        else {
            return Ok(None);
        };
        let bad = |reason: String| TraceSetupError::Endpoint {
            variable,
            value: value.clone(),
            reason,
        };
        let url = reqwest::Url::parse(value.trim())
            .map_err(|e| bad(format!("not a URL ({e}); e.g. http://otel-collector:4318")))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(bad(
                "the collector's URL must be http(s)://host[:port]".into()
            ));
        }
        if let Some((variable, value)) = PROTOCOL_VARIABLES
            .iter()
            .find_map(|&name| set(name).map(|v| (name, v)))
            && value.trim() != "http/protobuf"
        {
            return Err(TraceSetupError::Protocol { variable, value });
        }
        let mut shown = url.clone();
        let _ = shown.set_username("");
        let _ = shown.set_password(None);
        shown.set_query(None);
        Ok(Some(Self {
            default_service: default_service.to_owned(),
            endpoint: format!("{shown} ({variable})"),
        }))
    }
}

/// The running exporter: flushes what is buffered when the process ends.
pub struct Traces {
    provider: SdkTracerProvider,
    settings: TraceSettings,
}

impl Traces {
    /// Builds the OTLP/HTTP exporter (its endpoint, headers, timeout, batching and sampler
    /// come from the standard `OTEL_*` variables) and installs the W3C propagator.
    pub fn start(settings: &TraceSettings) -> Result<Self, TraceSetupError> {
        use opentelemetry_otlp::{Protocol, WithExportConfig as _};
        // The exporter's rustls takes the process's crypto provider; ring is replyd's own.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_protocol(Protocol::HttpBinary)
            .build()
            .map_err(|e| TraceSetupError::Exporter(e.to_string()))?;
        let mut resource = opentelemetry_sdk::Resource::builder().with_attribute(
            opentelemetry::KeyValue::new("service.version", env!("CARGO_PKG_VERSION")),
        );
        // The resource's own detectors read OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES;
        // the process's role names the service only when neither does.
        let named = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
            || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| v.contains("service.name="));
        if !named {
            resource = resource.with_service_name(settings.default_service.clone());
        }
        let provider = SdkTracerProvider::builder()
            .with_batch_exporter(exporter)
            .with_resource(resource.build())
            .build();
        opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
        Ok(Self {
            provider,
            settings: settings.clone(),
        })
    }

    /// The layer that turns this process's trace spans into OpenTelemetry spans.
    pub fn layer<S>(&self) -> impl tracing_subscriber::Layer<S> + use<S>
    where
        S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
    {
        use opentelemetry::trace::TracerProvider as _;
        use tracing_subscriber::Layer as _;
        tracing_opentelemetry::layer()
            .with_tracer(self.provider.tracer("replyd"))
            .with_location(false)
            .with_threads(false)
            .with_level(false)
            .with_filter(tracing_subscriber::filter::filter_fn(|meta| {
                meta.target() == TARGET
            }))
    }

    /// Says where spans go; call once the log is set up.
    pub fn announce(&self) {
        tracing::info!(
            endpoint = %self.settings.endpoint,
            service = %self.settings.default_service,
            "exporting traces over OTLP/HTTP"
        );
    }

    /// Sends what is buffered (bounded by `OTEL_BSP_EXPORT_TIMEOUT`) and stops the exporter.
    pub fn shutdown(self) {
        if let Err(e) = self.provider.shutdown() {
            tracing::warn!(error = %e, "flushing the last trace spans failed");
        }
    }
}

/// Whether this process makes trace spans (traces on).
pub fn on() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::INFO)
}

/// The trace and span ids (hex, as in a `traceparent`) of the current span, when it belongs
/// to a sampled trace: what a log line written now is joined to its trace by.
pub fn current_ids() -> Option<(String, String)> {
    use opentelemetry::trace::TraceContextExt as _;
    let context = Span::current().context();
    let span = context.span();
    let ids = span.span_context();
    (ids.is_valid() && ids.is_sampled())
        .then(|| (ids.trace_id().to_string(), ids.span_id().to_string()))
}

/// The `traceparent` of `span`, `None` when traces are off or the span is not sampled.
pub fn traceparent(span: &Span) -> Option<String> {
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&span.context(), &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// Makes `span` a child of the context a carrier holds; a missing or malformed
/// `traceparent` leaves it the root of a new trace.
fn adopt(span: &Span, carrier: &dyn Extractor) {
    if span.is_disabled() {
        return; // traces off: no header parsed
    }
    let parent = TraceContextPropagator::new().extract(carrier);
    // Fails only when the span is disabled (traces off): nothing to adopt then.
    let _ = span.set_parent(parent);
}

/// A stored `traceparent`, as a carrier.
struct Stored<'a>(Option<&'a str>);

impl Extractor for Stored<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        (key == TRACEPARENT).then_some(self.0).flatten()
    }
    fn keys(&self) -> Vec<&str> {
        vec![TRACEPARENT]
    }
}

struct HttpHeaders<'a>(&'a axum::http::HeaderMap);

impl Extractor for HttpHeaders<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(axum::http::HeaderName::as_str).collect()
    }
}

struct HttpHeadersMut<'a>(&'a mut axum::http::HeaderMap);

impl Injector for HttpHeadersMut<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            axum::http::HeaderName::from_bytes(key.as_bytes()),
            axum::http::HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// A Kafka record's headers as a carrier of its trace context.
pub struct KafkaHeaders<'a, H>(pub &'a H);

impl<H: Headers> Extractor for KafkaHeaders<'_, H> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|h| h.key.eq_ignore_ascii_case(key))
            .and_then(|h| h.value)
            .and_then(|v| std::str::from_utf8(v).ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.iter().map(|h| h.key).collect()
    }
}

/// The server span of an API request, a child of the caller's `traceparent` when it sent one.
pub fn api_request(method: &str, route: &str, headers: &axum::http::HeaderMap) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "api request",
        otel.name = format!("{method} {route}"),
        otel.kind = "server",
        http.request.method = method,
        http.route = route,
        http.response.status_code = tracing::field::Empty,
        replyd.task_id = tracing::field::Empty,
        replyd.replayed = tracing::field::Empty,
    );
    adopt(&span, &HttpHeaders(headers));
    span
}

/// The relay's producer span of one outbox row: a child of the request that wrote it.
pub fn publish(system: &'static str, topic: &str, task_id: &str, stored: Option<&str>) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "publish",
        otel.name = format!("publish {topic}"),
        otel.kind = "producer",
        messaging.system = system,
        messaging.operation.type = "send",
        messaging.destination.name = topic,
        replyd.task_id = task_id,
    );
    adopt(&span, &Stored(stored));
    span
}

/// The record's `traceparent` header: the publish span's when traces are on here, else the
/// one the outbox row kept (the request's), so a relay without traces does not cut the chain.
pub fn record_headers(span: &Span, stored: Option<&str>) -> Option<OwnedHeaders> {
    let value = traceparent(span).or_else(|| stored.map(str::to_owned))?;
    Some(OwnedHeaders::new().insert(rdkafka::message::Header {
        key: TRACEPARENT,
        value: Some(value.as_bytes()),
    }))
}

/// The worker's consumer span of one record: a child of its `traceparent` header, or the root
/// of a new trace when the producer sent none.
pub fn process(
    system: &'static str,
    topic: &str,
    partition: i32,
    offset: i64,
    carrier: Option<&dyn Extractor>,
) -> Span {
    let span = tracing::info_span!(
        target: TARGET,
        "process",
        otel.name = format!("process {topic}"),
        otel.kind = "consumer",
        messaging.system = system,
        messaging.operation.type = "process",
        messaging.destination.name = topic,
        messaging.destination.partition.id = partition,
        messaging.kafka.offset = offset,
        replyd.task_id = tracing::field::Empty,
        replyd.outcome = tracing::field::Empty,
    );
    if let Some(carrier) = carrier {
        adopt(&span, carrier);
    }
    span
}

/// One claim of the task (the fenced write that takes its lease).
pub fn claim(parent: &Span) -> Span {
    tracing::info_span!(
        target: TARGET,
        parent: parent,
        "claim",
        replyd.outcome = tracing::field::Empty,
        replyd.assignment_version = tracing::field::Empty,
    )
}

/// One provider call (a generation, or a background operation's create and wait); its
/// context goes out in the request's `traceparent`.
pub fn provider_call(parent: &Span, model: &str, attempt: i32) -> Span {
    tracing::info_span!(
        target: TARGET,
        parent: parent,
        "provider call",
        otel.kind = "client",
        gen_ai.operation.name = "chat",
        gen_ai.request.model = model,
        replyd.attempt = attempt,
        replyd.outcome = tracing::field::Empty,
    )
}

/// The fenced write of an attempt's end: the reply saved, the task failed or released.
pub fn completion(parent: &Span, what: &'static str) -> Span {
    tracing::info_span!(
        target: TARGET,
        parent: parent,
        "completion",
        otel.name = what,
        replyd.outcome = tracing::field::Empty,
    )
}

/// Adds the current span's `traceparent` to an outgoing HTTP request's headers.
pub fn inject_current(headers: &mut axum::http::HeaderMap) {
    let cx = Span::current().context();
    TraceContextPropagator::new().inject_context(&cx, &mut HttpHeadersMut(headers));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |name| map.get(name).cloned()
    }

    #[test]
    fn traces_are_off_without_an_endpoint() {
        assert_eq!(
            TraceSettings::from_env(env(&[]), "replyd-worker").unwrap(),
            None
        );
        assert_eq!(
            TraceSettings::from_env(env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")]), "w").unwrap(),
            None
        );
    }

    #[test]
    fn an_endpoint_turns_traces_on_unless_the_sdk_is_disabled() {
        let on = [("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")];
        assert_eq!(
            TraceSettings::from_env(env(&on), "replyd-api").unwrap(),
            Some(TraceSettings {
                default_service: "replyd-api".into(),
                endpoint: "http://127.0.0.1:4318/ (OTEL_EXPORTER_OTLP_ENDPOINT)".into(),
            })
        );
        // The signal's own variable wins; credentials never reach the log.
        let traces_only = [
            (
                "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                "https://u:secret@c:4318/v1/traces?k=s",
            ),
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://other:4318"),
        ];
        let shown = TraceSettings::from_env(env(&traces_only), "w")
            .unwrap()
            .unwrap()
            .endpoint;
        assert_eq!(
            shown,
            "https://c:4318/v1/traces (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)"
        );
        let disabled = [on[0], ("OTEL_SDK_DISABLED", "TRUE")];
        assert_eq!(TraceSettings::from_env(env(&disabled), "w").unwrap(), None);
        let none = [on[0], ("OTEL_TRACES_EXPORTER", "none")];
        assert_eq!(TraceSettings::from_env(env(&none), "w").unwrap(), None);
    }

    #[test]
    fn a_bad_endpoint_or_protocol_is_refused_naming_the_variable() {
        let e = TraceSettings::from_env(
            env(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")]),
            "w",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("OTEL_EXPORTER_OTLP_ENDPOINT is `collector:4318`"),
            "{e}"
        );
        let e = TraceSettings::from_env(
            env(&[("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "not a url")]),
            "w",
        )
        .unwrap_err()
        .to_string();
        assert!(e.starts_with("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"), "{e}");
        let e = TraceSettings::from_env(
            env(&[
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ]),
            "w",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("OTEL_EXPORTER_OTLP_PROTOCOL is `grpc`"), "{e}");
        assert!(e.contains("http/protobuf"), "{e}");
    }

    #[test]
    fn kafka_headers_are_read_case_blind_and_a_missing_value_is_no_parent() {
        let headers = OwnedHeaders::new()
            .insert(rdkafka::message::Header {
                key: "TraceParent",
                value: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".as_bytes()),
            })
            .insert(rdkafka::message::Header {
                key: "other",
                value: None::<&[u8]>,
            });
        let carrier = KafkaHeaders(&headers);
        assert_eq!(
            carrier.get(TRACEPARENT),
            Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01")
        );
        assert_eq!(carrier.get("other"), None);
        assert_eq!(carrier.keys(), vec!["TraceParent", "other"]);
    }

    #[test]
    fn with_traces_off_no_context_is_made_or_sent() {
        // No exporter layer in unit tests: every trace span is disabled.
        let span = process("kafka", "t", 0, 1, None);
        assert_eq!(traceparent(&span), None);
        assert!(record_headers(&span, None).is_none());
        let kept = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let headers = record_headers(&span, Some(kept)).unwrap();
        assert_eq!(KafkaHeaders(&headers).get(TRACEPARENT), Some(kept));
        let mut out = axum::http::HeaderMap::new();
        inject_current(&mut out);
        assert!(out.is_empty());
    }
}
