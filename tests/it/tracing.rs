//! Traces, end to end against a real collector: `replyd api`, `relay` and `worker` processes
//! export OTLP/HTTP to Jaeger (all-in-one, memory storage), and the test reads the traces back
//! through Jaeger's query API. A pressed Send is one trace from the API request to the
//! completion, hop by hop with the right parents; a record a producer wrote without a
//! `traceparent` starts a trace of its own.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::helpers::app::{Routes, TestApp, WorkerConfig};
use crate::helpers::{
    free_port, infra, press_until_completed, press_with_headers_until_completed, task_spec, unique,
    wait_until,
};
use replyd_core::api_key::issue;
use replyd_lab::mock_provider::{KeyStats, MockSettings};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(120);

/// A Jaeger process of the test's own, on free loopback ports. Dropping it kills it.
struct Jaeger {
    child: Child,
    /// `http://127.0.0.1:<port>`: the OTLP/HTTP receiver.
    otlp: String,
    /// `http://127.0.0.1:<port>`: the query API.
    query: String,
    log: PathBuf,
}

impl Jaeger {
    async fn start() -> Self {
        let dir = PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/target/test-runs"))
            .join(unique("jaeger"));
        std::fs::create_dir_all(&dir).unwrap();
        let (otlp, query, query_grpc) = (free_port(), free_port(), free_port());
        let config = dir.join("jaeger.yaml");
        std::fs::write(
            &config,
            format!(
                r#"
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
extensions:
  jaeger_storage:
    backends:
      memory_store:
        memory:
          max_traces: 10000
  jaeger_query:
    storage:
      traces: memory_store
    http:
      endpoint: 127.0.0.1:{query}
    grpc:
      endpoint: 127.0.0.1:{query_grpc}
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:{otlp}
processors:
  batch:
    timeout: 100ms
exporters:
  jaeger_storage_exporter:
    trace_storage: memory_store
"#
            ),
        )
        .unwrap();
        let log = dir.join("jaeger.log");
        let out = std::fs::File::create(&log).unwrap();
        let child = Command::new(infra("JAEGER"))
            .arg("--config")
            .arg(format!("file:{}", config.display()))
            .stdin(Stdio::null())
            .stdout(out.try_clone().unwrap())
            .stderr(out)
            .spawn()
            .expect("jaeger starts");
        let jaeger = Self {
            child,
            otlp: format!("http://127.0.0.1:{otlp}"),
            query: format!("http://127.0.0.1:{query}"),
            log,
        };
        let services = format!("{}/api/services", jaeger.query);
        wait_until(
            "Jaeger answers its query API",
            Duration::from_secs(30),
            || {
                let services = services.clone();
                async move {
                    reqwest::get(&services)
                        .await
                        .is_ok_and(|r| r.status().is_success())
                }
            },
        )
        .await;
        jaeger
    }

    /// The trace `trace_id` as Jaeger holds it now (`None` before any span of it arrived).
    async fn trace(&self, trace_id: &str) -> Option<Trace> {
        let response = reqwest::get(format!("{}/api/traces/{trace_id}", self.query))
            .await
            .ok()?;
        if !response.status().is_success() {
            return None;
        }
        let body: Value = response.json().await.ok()?;
        Some(Trace::of(body["data"].get(0)?))
    }

    /// Waits until the trace has a span of every name in `names`, and returns it.
    async fn wait_for_spans(&self, trace_id: &str, names: &[&str]) -> Trace {
        let mut last = None;
        let found = tokio::time::timeout(LIMIT, async {
            loop {
                if let Some(trace) = self.trace(trace_id).await {
                    if names.iter().all(|n| trace.named(n).is_some()) {
                        return trace;
                    }
                    last = Some(trace.names());
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
        .await;
        found.unwrap_or_else(|_| {
            panic!(
                "trace {trace_id} never had the spans {names:?}; it had {last:?}; Jaeger's log: {}",
                std::fs::read_to_string(&self.log).unwrap_or_default()
            )
        })
    }

    /// The ids of the traces holding a span of `service` tagged `key=value`.
    async fn traces_tagged(&self, service: &str, key: &str, value: &str) -> Vec<String> {
        let tags = json!({ key: value }).to_string();
        let response = reqwest::Client::new()
            .get(format!("{}/api/traces", self.query))
            .query(&[
                ("service", service),
                ("tags", tags.as_str()),
                ("lookback", "1h"),
                ("limit", "20"),
            ])
            .send()
            .await;
        let Ok(response) = response else {
            return Vec::new();
        };
        let body: Value = response.json().await.unwrap_or_default();
        body["data"]
            .as_array()
            .map(|traces| {
                traces
                    .iter()
                    .filter_map(|t| t["traceID"].as_str().map(str::to_owned))
                    .collect()
            })
            .unwrap_or_default()
    }
}

impl Drop for Jaeger {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One span as Jaeger shows it.
#[derive(Debug, Clone)]
struct Span {
    id: String,
    name: String,
    /// The span id of its `CHILD_OF` reference (its parent), if any.
    parent: Option<String>,
    service: String,
    tags: HashMap<String, String>,
}

#[derive(Debug)]
struct Trace {
    spans: Vec<Span>,
}

impl Trace {
    fn of(trace: &Value) -> Self {
        let services: HashMap<String, String> = trace["processes"]
            .as_object()
            .map(|p| {
                p.iter()
                    .map(|(id, process)| {
                        (
                            id.clone(),
                            process["serviceName"].as_str().unwrap_or("").to_owned(),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        let text = |v: &Value| match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        };
        let spans = trace["spans"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|s| Span {
                id: text(&s["spanID"]),
                name: text(&s["operationName"]),
                parent: s["references"].as_array().and_then(|refs| {
                    refs.iter()
                        .find(|r| r["refType"] == "CHILD_OF")
                        .map(|r| text(&r["spanID"]))
                }),
                service: services
                    .get(s["processID"].as_str().unwrap_or(""))
                    .cloned()
                    .unwrap_or_default(),
                tags: s["tags"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .map(|t| (text(&t["key"]), text(&t["value"])))
                    .collect(),
            })
            .collect();
        Self { spans }
    }

    fn named(&self, name: &str) -> Option<&Span> {
        self.spans.iter().find(|s| s.name == name)
    }

    fn span(&self, name: &str) -> &Span {
        self.named(name)
            .unwrap_or_else(|| panic!("no span `{name}` in {:#?}", self.names()))
    }

    fn names(&self) -> Vec<(String, String)> {
        self.spans
            .iter()
            .map(|s| (s.service.clone(), s.name.clone()))
            .collect()
    }
}

fn mock() -> MockSettings {
    MockSettings {
        latency_ms: 50,
        ..MockSettings::default()
    }
}

/// A test app whose processes export their traces to `jaeger`.
async fn traced_app(jaeger: &Jaeger) -> TestApp {
    traced_app_with(jaeger, []).await
}

/// A test app whose processes export their traces to `jaeger`, with `env` besides.
async fn traced_app_with<const N: usize>(jaeger: &Jaeger, env: [(&str, &str); N]) -> TestApp {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    let mut vars = vec![
        ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), jaeger.otlp.clone()),
        // Spans go out every 200 ms instead of every 5 s, so the test waits less.
        ("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into()),
    ];
    vars.extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
    app.route(Routes {
        env: vars,
        ..Routes::default()
    });
    app
}

/// `traceparent` `00-<trace id>-<parent id>-<flags>`, split.
fn parts(traceparent: &str) -> (String, String) {
    let fields: Vec<&str> = traceparent.split('-').collect();
    assert_eq!(fields.len(), 4, "not a traceparent: {traceparent}");
    (fields[1].to_owned(), fields[2].to_owned())
}

/// Asserts the worker's spans of one task in `trace`: `process` a child of `parent` (`None`:
/// a root), the claim, the provider call and the completion its children; the provider got
/// the call span's context in its `traceparent` header.
async fn assert_worker_hops(
    app: &TestApp,
    trace: &Trace,
    trace_id: &str,
    task_id: &str,
    parent: Option<&str>,
) {
    let topic = &app.topic;
    let process = trace.span(&format!("process {topic}"));
    assert_eq!(process.service, "replyd-worker");
    assert_eq!(process.parent.as_deref(), parent, "process's parent");
    assert_eq!(process.tags["span.kind"], "consumer");
    assert_eq!(process.tags["replyd.task_id"], task_id);
    assert_eq!(process.tags["replyd.outcome"], "completed");
    for name in ["claim", "provider call", "save reply"] {
        let span = trace.span(name);
        assert_eq!(span.service, "replyd-worker", "{name}");
        assert_eq!(span.parent.as_ref(), Some(&process.id), "{name}'s parent");
    }
    assert_eq!(trace.span("claim").tags["replyd.outcome"], "claimed");
    let call = trace.span("provider call");
    assert_eq!(call.tags["span.kind"], "client");
    assert_eq!(call.tags["replyd.outcome"], "ok");
    assert_eq!(trace.span("save reply").tags["replyd.outcome"], "accepted");
    // The provider saw the call span as its caller.
    let stats: KeyStats = reqwest::get(format!("{}/stats/{task_id}", app.mock.base_url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(stats.generations, 1);
    assert_eq!(
        stats
            .traceparents
            .iter()
            .map(|t| parts(t))
            .collect::<Vec<_>>(),
        vec![(trace_id.to_owned(), call.id.clone())],
        "the provider's traceparent headers"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pressed_send_is_one_trace_from_the_request_to_the_completion() {
    let jaeger = Jaeger::start().await;
    let app = traced_app(&jaeger).await;
    let store = &app.db.store;
    store.create_workspace("acme").await.unwrap();
    let key = issue(&mut rand::rng());
    store.create_api_key("acme", &key).await.unwrap();
    app.spawn_process("api", "api");
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let api = app.wait_for_api_addr("api", LIMIT).await;
    let http = reqwest::Client::new();

    // A browser that traces its own pages sends its span's context.
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let browser_span = "00f067aa0ba902b7";
    let sent = format!("00-{trace_id}-{browser_span}-01");
    let accepted = press_with_headers_until_completed(
        &http,
        &api,
        &key.token,
        "press-1",
        &[("traceparent", &sent)],
    )
    .await;
    let task_id = accepted["task_id"].as_str().unwrap().to_owned();

    let topic = &app.topic;
    let trace = jaeger
        .wait_for_spans(
            &trace_id,
            &[
                "POST /v1/replies",
                &format!("publish {topic}"),
                &format!("process {topic}"),
                "claim",
                "provider call",
                "save reply",
            ],
        )
        .await;
    let request = trace.span("POST /v1/replies");
    assert_eq!(request.service, "replyd-api");
    assert_eq!(
        request.parent.as_deref(),
        Some(browser_span),
        "the request's parent"
    );
    assert_eq!(request.tags["span.kind"], "server");
    assert_eq!(request.tags["http.response.status_code"], "202");
    assert_eq!(request.tags["replyd.task_id"], task_id);
    let publish = trace.span(&format!("publish {topic}"));
    assert_eq!(publish.service, "replyd-relay");
    assert_eq!(
        publish.parent.as_ref(),
        Some(&request.id),
        "publish's parent"
    );
    assert_eq!(publish.tags["span.kind"], "producer");
    assert_eq!(publish.tags["replyd.task_id"], task_id);
    assert_worker_hops(&app, &trace, &trace_id, &task_id, Some(&publish.id)).await;
    // One trace per task: the later status reads (no traceparent) are traces of their own.
    assert_eq!(
        trace
            .spans
            .iter()
            .filter(|s| s.name == "POST /v1/replies")
            .count(),
        1
    );

    // A press without a traceparent: the API starts the trace, and the outbox row keeps it.
    let second = press_until_completed(&http, &api, &key.token, "press-2").await;
    let second_id = second["task_id"].as_str().unwrap().to_owned();
    let db = app.db.raw_client().await;
    let stored: Option<String> = db
        .query_one(
            "SELECT traceparent FROM outbox WHERE task_id::text = $1",
            &[&second_id],
        )
        .await
        .unwrap()
        .get(0);
    let (second_trace_id, request_span) =
        parts(&stored.expect("the outbox row keeps the request's traceparent"));
    let trace = jaeger
        .wait_for_spans(
            &second_trace_id,
            &[
                "POST /v1/replies",
                &format!("publish {topic}"),
                &format!("process {topic}"),
                "save reply",
            ],
        )
        .await;
    let request = trace.span("POST /v1/replies");
    assert_eq!(
        request.id, request_span,
        "the stored context is the request's span"
    );
    assert_eq!(
        request.parent, None,
        "a press without traceparent is a root"
    );
    let publish = trace.span(&format!("publish {topic}"));
    assert_eq!(publish.parent.as_ref(), Some(&request.id));
    assert_worker_hops(
        &app,
        &trace,
        &second_trace_id,
        &second_id,
        Some(&publish.id),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pressed_send_over_sqs_is_one_trace_from_the_request_to_the_completion() {
    // The relay sends to an SQS queue and the worker receives from it: the trace context
    // travels as the message's `traceparent` attribute.
    let jaeger = Jaeger::start().await;
    let app = TestApp::start_on_sqs(mock(), WorkerConfig::default(), 10).await;
    app.route(Routes {
        env: vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), jaeger.otlp.clone()),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into()),
        ],
        ..Routes::default()
    });
    let store = &app.db.store;
    store.create_workspace("acme").await.unwrap();
    let key = issue(&mut rand::rng());
    store.create_api_key("acme", &key).await.unwrap();
    app.spawn_process("api", "api");
    app.spawn_relay("relay");
    app.spawn_worker("w1");
    let api = app.wait_for_api_addr("api", LIMIT).await;
    let trace_id = uuid::Uuid::new_v4().simple().to_string();
    let sent = format!("00-{trace_id}-00f067aa0ba902b7-01");
    let accepted = press_with_headers_until_completed(
        &reqwest::Client::new(),
        &api,
        &key.token,
        "press-1",
        &[("traceparent", &sent)],
    )
    .await;
    let task_id = accepted["task_id"].as_str().unwrap().to_owned();

    // The queue is named as the test's topic.
    let queue = &app.topic;
    let trace = jaeger
        .wait_for_spans(
            &trace_id,
            &[
                "POST /v1/replies",
                &format!("publish {queue}"),
                &format!("process {queue}"),
                "claim",
                "provider call",
                "save reply",
            ],
        )
        .await;
    let request = trace.span("POST /v1/replies");
    let publish = trace.span(&format!("publish {queue}"));
    assert_eq!(publish.service, "replyd-relay");
    assert_eq!(publish.parent.as_ref(), Some(&request.id));
    assert_eq!(publish.tags["messaging.system"], "aws_sqs");
    assert_eq!(
        trace.span(&format!("process {queue}")).tags["messaging.system"],
        "aws_sqs"
    );
    assert_worker_hops(&app, &trace, &trace_id, &task_id, Some(&publish.id)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_without_a_traceparent_starts_a_trace_of_its_own() {
    let jaeger = Jaeger::start().await;
    // JSON lines, with the HTTP client's connection lines (written inside the provider call's
    // span), to see the log joined to the trace.
    let app = traced_app_with(
        &jaeger,
        [
            ("REPLYD_LOG_JSON", "true"),
            (
                "RUST_LOG",
                "info,replyd=debug,hyper_util=debug,librdkafka=warn",
            ),
        ],
    )
    .await;
    app.spawn_worker("w1");
    let task = task_spec(3);
    let task_id = task.task_id.to_string();
    // The test's producer sends no headers, as a producer without tracing does.
    app.produce_tasks(std::slice::from_ref(&task), 1).await;
    app.wait_until_terminal(&[task.task_id], LIMIT).await;

    let found = tokio::time::timeout(LIMIT, async {
        loop {
            let found = jaeger
                .traces_tagged("replyd-worker", "replyd.task_id", &task_id)
                .await;
            if !found.is_empty() {
                return found;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await
    .expect("the worker's trace reaches Jaeger");
    assert_eq!(found.len(), 1, "one trace for the task: {found:?}");
    let trace_id = found[0].clone();
    let trace = jaeger
        .wait_for_spans(
            &trace_id,
            &[
                &format!("process {}", app.topic),
                "claim",
                "provider call",
                "save reply",
            ],
        )
        .await;
    assert_worker_hops(&app, &trace, &trace_id, &task_id, None).await;
    assert!(
        trace.spans.iter().all(|s| s.service == "replyd-worker"),
        "{:?}",
        trace.names()
    );
    // The log joins the trace: a line written inside one of its spans carries the trace's id
    // and that span's; a line written outside every span (the start-up's) carries neither.
    let lines: Vec<Value> = app
        .log_of("w1")
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect();
    assert!(lines.len() > 5, "JSON lines: {}", app.log_of("w1"));
    let joined: Vec<&Value> = lines
        .iter()
        .filter(|l| l["trace_id"] == trace_id.as_str())
        .collect();
    assert!(
        !joined.is_empty(),
        "no line carries trace {trace_id}: {}",
        app.log_of("w1")
    );
    let span_ids: Vec<&str> = trace.spans.iter().map(|s| s.id.as_str()).collect();
    for line in &joined {
        let span_id = line["span_id"].as_str().unwrap_or_default();
        assert!(
            span_ids.contains(&span_id),
            "{line} is in no span of the trace"
        );
    }
    let first = &lines[0];
    assert!(first.get("trace_id").is_none(), "{first}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_whose_collector_is_away_still_saves_the_reply_and_says_why_spans_are_lost() {
    let app = TestApp::start(1, mock(), WorkerConfig::default()).await;
    // A port nothing listens on: every export is refused.
    let away = format!("http://127.0.0.1:{}", free_port());
    app.route(Routes {
        env: vec![
            ("OTEL_EXPORTER_OTLP_ENDPOINT".into(), away),
            ("OTEL_BSP_SCHEDULE_DELAY".into(), "200".into()),
        ],
        ..Routes::default()
    });
    app.spawn_worker("w1");
    let task = task_spec(3);
    app.produce_tasks(std::slice::from_ref(&task), 1).await;
    app.wait_until_terminal(&[task.task_id], LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    let report = app.check().await;
    assert_eq!(report.violations, Vec::<String>::new(), "{report:#?}");
    assert_eq!(report.completed, 1, "{report:#?}");
    // The exporter's failures are logged (the SDK's own events), and the worker still drains
    // and exits cleanly.
    wait_until("the worker logs a failed export", LIMIT, || {
        let logged = app.log_of("w1").contains("BatchSpanProcessor.ExportError");
        async move { logged }
    })
    .await;
    app.terminate("w1").await;
}

#[test]
fn bad_trace_settings_are_refused_at_start_naming_the_variable() {
    for (env, expected) in [
        (
            vec![("OTEL_EXPORTER_OTLP_ENDPOINT", "collector:4318")],
            "OTEL_EXPORTER_OTLP_ENDPOINT is `collector:4318`",
        ),
        (
            vec![
                ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4317"),
                ("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc"),
            ],
            "OTEL_EXPORTER_OTLP_PROTOCOL is `grpc`",
        ),
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_replyd"))
            // Refused before the settings are read: no file is needed to see it.
            .args(["worker", "--config", "/nonexistent/replyd.toml"])
            .envs(env.iter().copied())
            .output()
            .expect("replyd runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{env:?}: {stderr}");
        assert!(stderr.contains(expected), "{env:?}: {stderr}");
    }
}
