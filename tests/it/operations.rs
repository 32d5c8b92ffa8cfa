//! What operators run against replyd, checked against live processes: every metric the
//! Grafana dashboard (deploy/grafana) and the alert rules (deploy/prometheus) select is on a
//! running `replyd serve`'s `/metrics` from its start, or is one Prometheus makes itself
//! (`up`); in split mode, each dashboard panel's series come from a process its `$job`
//! variable lists; the consumer-lag and oldest-in-flight gauges move with real work; the API
//! times each request under its route's template; the rules pass `promtool check rules` and
//! their own `promtool test rules` cases.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::time::Duration;

use crate::helpers::app::{TestApp, WorkerConfig};
use crate::helpers::{infra, task_spec, wait_until};
use replyd_lab::mock_provider::MockSettings;

const LIMIT: Duration = Duration::from_secs(120);

fn deploy(path: &str) -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("deploy")
        .join(path)
}

async fn metrics_page(app: &TestApp, name: &str) -> String {
    let addr = app
        .observability_addr(name)
        .expect("the process serves /metrics");
    reqwest::get(format!("http://{addr}/metrics"))
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The metric families on a `/metrics` page.
fn families(page: &str) -> BTreeSet<String> {
    page.lines()
        .filter(|line| !line.starts_with('#') && !line.is_empty())
        .filter_map(|line| line.split(['{', ' ']).next())
        .map(str::to_owned)
        .collect()
}

/// Every `replyd_*` name in a file.
fn names_in(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("replyd_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        names.insert(name);
    }
    names
}

/// The highest value of `metric` over its labelled series on `page`.
fn max_labelled(page: &str, metric: &str) -> Option<f64> {
    page.lines()
        .filter(|line| line.starts_with(&format!("{metric}{{")))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(f64::max)
}

/// Series Prometheus makes itself for every target it scrapes, which no process exports. The
/// alerts and the dashboard read them to see a process that exports nothing at all.
const PROMETHEUS_SERIES: &[&str] = &["up"];

/// The families a worker on SQS exports from its start: the worker's own and SQS's, which a
/// worker on Kafka does not have. An installation runs one or the other; the dashboard and
/// the rules serve both.
async fn sqs_worker_families() -> BTreeSet<String> {
    let app = TestApp::start_on_sqs(MockSettings::default(), WorkerConfig::default(), 5).await;
    app.spawn_worker("worker");
    let families = served_families(&app, "worker", replyd::telemetry::SQS_METRICS).await;
    app.terminate("worker").await;
    families
}

/// The families process `name` of `app` serves, once every one of `registered` is among them
/// (each process registers its part's families at start).
async fn served_families(
    app: &TestApp,
    name: &str,
    registered: &[(&str, replyd::telemetry::Kind)],
) -> BTreeSet<String> {
    let page = std::cell::RefCell::new(String::new());
    wait_until(&format!("{name} serves its families"), LIMIT, || async {
        let Some(addr) = app.observability_addr(name) else {
            return false;
        };
        let Ok(response) = reqwest::get(format!("http://{addr}/metrics")).await else {
            return false;
        };
        let text = response.text().await.unwrap_or_default();
        let served = families(&text);
        let all = registered.iter().all(|(name, kind)| match kind {
            replyd::telemetry::Kind::Histogram => served.contains(&format!("{name}_count")),
            _ => served.contains(*name),
        });
        *page.borrow_mut() = text;
        all
    })
    .await;
    families(&page.into_inner())
}

/// The metric names a PromQL expression selects. Grafana's variables (`$job`,
/// `${__rate_interval}`) are skipped; so are label matchers, ranges, strings, numbers and
/// durations, functions (a name followed by `(`), the label lists of `by`, `without`, `on`,
/// `ignoring` and `group_*`, and the language's keywords.
fn selected_metrics(expr: &str) -> BTreeSet<String> {
    // The aggregation operators are keywords too: their `by (...)` may come before the
    // parenthesis.
    const KEYWORDS: &[&str] = &[
        "and",
        "or",
        "unless",
        "bool",
        "offset",
        "inf",
        "nan",
        "atan2",
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
    ];
    const LABEL_LISTS: &[&str] = &[
        "by",
        "without",
        "on",
        "ignoring",
        "group_left",
        "group_right",
    ];
    let chars: Vec<char> = expr.chars().collect();
    // The index just past the bracket that closes the one at `from`, strings skipped.
    let past_closing = |from: usize, open: char, close: char| {
        let mut depth = 0;
        let mut at = from;
        let mut quote = None;
        while at < chars.len() {
            let c = chars[at];
            match quote {
                Some(_) if c == '\\' => at += 1,
                Some(q) if c == q => quote = None,
                Some(_) => {}
                None if c == '"' || c == '\'' || c == '`' => quote = Some(c),
                None if c == open => depth += 1,
                None if c == close => {
                    depth -= 1;
                    if depth == 0 {
                        return at + 1;
                    }
                }
                None => {}
            }
            at += 1;
        }
        panic!("unbalanced {open} in {expr}");
    };
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == ':';
    let mut names = BTreeSet::new();
    let mut at = 0;
    while at < chars.len() {
        let c = chars[at];
        if c == '{' {
            at = past_closing(at, '{', '}');
        } else if c == '[' {
            at = past_closing(at, '[', ']');
        } else if c == '"' || c == '\'' || c == '`' {
            at += 1;
            while at < chars.len() && chars[at] != c {
                at += if chars[at] == '\\' { 2 } else { 1 };
            }
            at += 1;
        } else if c == '$' {
            at += 1;
            if chars.get(at) == Some(&'{') {
                at = past_closing(at, '{', '}');
            } else {
                while at < chars.len() && is_name(chars[at]) {
                    at += 1;
                }
            }
        } else if c.is_ascii_digit() || c == '.' {
            while at < chars.len() && (is_name(chars[at]) || chars[at] == '.') {
                at += 1;
            }
        } else if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = at;
            while at < chars.len() && is_name(chars[at]) {
                at += 1;
            }
            let word: String = chars[start..at].iter().collect();
            let mut next = at;
            while next < chars.len() && chars[next].is_whitespace() {
                next += 1;
            }
            let called = chars.get(next) == Some(&'(');
            if LABEL_LISTS.contains(&word.as_str()) {
                if called {
                    at = past_closing(next, '(', ')');
                }
            } else if !called && !KEYWORDS.contains(&word.to_lowercase().as_str()) {
                names.insert(word);
            }
        } else {
            at += 1;
        }
    }
    names
}

/// The metric a Grafana variable's query reads: the first argument of `label_values(metric,
/// label)` (none for `label_values(label)`), else the query as PromQL.
fn variable_metrics(query: &str) -> BTreeSet<String> {
    match query
        .trim()
        .strip_prefix("label_values(")
        .and_then(|rest| rest.strip_suffix(')'))
    {
        Some(arguments) => match top_level_split(arguments).as_slice() {
            [selector, _label] => selected_metrics(selector),
            _ => BTreeSet::new(),
        },
        None => selected_metrics(query),
    }
}

/// `text` split at the commas outside brackets and strings.
fn top_level_split(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let (mut depth, mut quote, mut start) = (0i32, None, 0);
    for (at, c) in text.char_indices() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '"') => quote = Some('"'),
            (None, '{' | '(' | '[') => depth += 1,
            (None, '}' | ')' | ']') => depth -= 1,
            (None, ',') if depth == 0 => {
                parts.push(text[start..at].trim());
                start = at + 1;
            }
            _ => {}
        }
    }
    parts.push(text[start..].trim());
    parts
}

/// The alert rules' expressions.
fn rule_expressions(rules: &str) -> Vec<String> {
    let rules: yaml_serde::Value = yaml_serde::from_str(rules).expect("the rules are YAML");
    rules["groups"]
        .as_sequence()
        .expect("rule groups")
        .iter()
        .flat_map(|group| group["rules"].as_sequence().expect("rules").iter())
        .map(|rule| {
            rule["expr"]
                .as_str()
                .expect("every rule has an expr")
                .to_owned()
        })
        .collect()
}

/// The dashboard's panels: each one's title and its queries' expressions.
fn panels(dashboard: &serde_json::Value) -> Vec<(String, Vec<String>)> {
    dashboard["panels"]
        .as_array()
        .expect("panels")
        .iter()
        .map(|panel| {
            let exprs = panel["targets"]
                .as_array()
                .map(|targets| {
                    targets
                        .iter()
                        .filter_map(|t| t["expr"].as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default();
            (
                panel["title"].as_str().unwrap_or_default().to_owned(),
                exprs,
            )
        })
        .collect()
}

/// The query of the dashboard's variable `name`.
fn variable_query(dashboard: &serde_json::Value, name: &str) -> String {
    let variable = dashboard["templating"]["list"]
        .as_array()
        .expect("templating")
        .iter()
        .find(|v| v["name"] == name)
        .unwrap_or_else(|| panic!("the dashboard has a ${name} variable"));
    let query = &variable["query"];
    query
        .as_str()
        .or_else(|| query["query"].as_str())
        .expect("a query variable's query")
        .to_owned()
}

#[test]
fn selected_metrics_reads_names_from_promql_as_prometheus_does() {
    let expr = r#"histogram_quantile(0.99, sum by (job, le) (rate(replyd_a_bucket{job=~"$job",route!="{x}"}[$__rate_interval]))) > 1 and on (job) avg_over_time(up{app="a"}[10m] offset 5m) < 0.5 or absent(replyd_b) unless replyd_c / ignoring(le) group_left replyd_d > bool 2e3"#;
    assert_eq!(
        selected_metrics(expr),
        ["replyd_a_bucket", "replyd_b", "replyd_c", "replyd_d", "up"]
            .into_iter()
            .map(str::to_owned)
            .collect()
    );
    assert_eq!(
        variable_metrics(r#"label_values(up{app_kubernetes_io_name="replyd"}, job)"#),
        ["up".to_owned()].into_iter().collect()
    );
    assert!(variable_metrics("label_values(job)").is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_and_the_alerts_name_only_metrics_a_live_process_exports() {
    let app = TestApp::start(
        2,
        MockSettings {
            latency_ms: 400,
            ..MockSettings::default()
        },
        WorkerConfig {
            partition_window: 2,
            ..WorkerConfig::default()
        },
    )
    .await;
    app.spawn_process("serve", "serve");
    app.wait_until_ready("serve").await;
    wait_until("serve exports its metrics", LIMIT, || async {
        app.observability_addr("serve").is_some()
    })
    .await;

    // The image's health check: `replyd healthz` asks the process's /healthz.
    let healthz = |addr: &str| {
        std::process::Command::new(env!("CARGO_BIN_EXE_replyd"))
            .arg("healthz")
            .env("REPLYD_OBSERVABILITY__LISTEN", addr)
            .output()
            .unwrap()
    };
    let addr = app.observability_addr("serve").unwrap();
    let alive = healthz(&addr);
    assert!(
        alive.status.success(),
        "{}",
        String::from_utf8_lossy(&alive.stderr)
    );

    // From the first scrape, before any work: every family the files name, on Kafka or on
    // SQS.
    let page = metrics_page(&app, "serve").await;
    let mut exported = families(&page);
    exported.extend(sqs_worker_families().await);
    let dashboard = std::fs::read_to_string(deploy("grafana/replyd-dashboard.json")).unwrap();
    let rules = std::fs::read_to_string(deploy("prometheus/replyd-alerts.yml")).unwrap();
    let board: serde_json::Value = serde_json::from_str(&dashboard).expect("the dashboard is JSON");
    // Every replyd name anywhere in the files (annotations and descriptions too)...
    for (file, text) in [("dashboard", &dashboard), ("alert rules", &rules)] {
        let named = names_in(text);
        assert!(named.len() >= 5, "{file} names metrics: {named:?}");
        let missing: Vec<_> = named.difference(&exported).collect();
        assert!(
            missing.is_empty(),
            "{file} names {missing:?}, which /metrics does not have"
        );
    }
    // ...and every metric any expression selects, replyd's or not, is exported, or is one
    // Prometheus makes itself.
    let dashboard_exprs = panels(&board)
        .into_iter()
        .flat_map(|(_, exprs)| exprs)
        .map(|expr| selected_metrics(&expr))
        .chain([variable_metrics(&variable_query(&board, "job"))]);
    let rule_exprs = rule_expressions(&rules)
        .into_iter()
        .map(|expr| selected_metrics(&expr));
    let selected: BTreeSet<String> = dashboard_exprs.chain(rule_exprs).flatten().collect();
    let unknown: Vec<_> = selected
        .iter()
        .filter(|name| !exported.contains(*name) && !PROMETHEUS_SERIES.contains(&name.as_str()))
        .collect();
    assert!(
        unknown.is_empty(),
        "selected, yet neither on /metrics nor made by Prometheus: {unknown:?}"
    );
    // The list of Prometheus's own series holds only what is used, so it cannot hide a typo.
    for made in PROMETHEUS_SERIES {
        assert!(selected.contains(*made), "{made} is allowed but unused");
    }

    // Work arrives faster than 2 × 2 slots drain it: lag, and an in-flight record that ages.
    let tasks: Vec<_> = (0..40).map(|_| task_spec(3)).collect();
    app.produce_tasks(&tasks, 1).await;
    // The highest values seen while the work runs.
    let lag = std::cell::Cell::new(0.0f64);
    let age = std::cell::Cell::new(0.0f64);
    wait_until("lag and an in-flight age are reported", LIMIT, || async {
        let page = metrics_page(&app, "serve").await;
        lag.set(
            lag.get()
                .max(max_labelled(&page, "replyd_consumer_lag_records").unwrap_or(0.0)),
        );
        age.set(
            age.get()
                .max(max_labelled(&page, "replyd_oldest_in_flight_seconds").unwrap_or(0.0)),
        );
        lag.get() > 0.0 && age.get() > 0.0
    })
    .await;
    let ids: Vec<_> = tasks.iter().map(|t| t.task_id).collect();
    app.wait_until_terminal(&ids, LIMIT).await;
    app.wait_until_committed_to_end(LIMIT).await;
    // Caught up: every partition's lag and oldest age come back to 0.
    wait_until("lag and in-flight age return to 0", LIMIT, || async {
        let page = metrics_page(&app, "serve").await;
        max_labelled(&page, "replyd_consumer_lag_records") == Some(0.0)
            && max_labelled(&page, "replyd_oldest_in_flight_seconds") == Some(0.0)
    })
    .await;
    app.terminate("serve").await;
    let gone = healthz(&addr);
    assert_eq!(gone.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&gone.stderr).contains("(observability.listen)"),
        "{}",
        String::from_utf8_lossy(&gone.stderr)
    );
}

#[test]
fn the_alert_rules_pass_promtool_and_their_own_cases() {
    let promtool = infra("PROMTOOL");
    for args in [
        vec!["check", "rules", "replyd-alerts.yml"],
        vec!["test", "rules", "replyd-alerts.test.yml"],
    ] {
        let out = std::process::Command::new(&promtool)
            .args(&args)
            .current_dir(deploy("prometheus"))
            .output()
            .expect("promtool runs");
        assert!(
            out.status.success(),
            "promtool {args:?}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// The samples of `metric` on `page`: each series' labels and value.
fn samples(page: &str, metric: &str) -> Vec<(BTreeMap<String, String>, f64)> {
    page.lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(metric)?;
            let (labels, value) = match rest.strip_prefix('{') {
                Some(labelled) => labelled.rsplit_once("} ")?,
                None => ("", rest.strip_prefix(' ')?),
            };
            let labels = labels
                .split("\",")
                .filter(|pair| !pair.is_empty())
                .filter_map(|pair| {
                    let (name, value) = pair.split_once("=\"")?;
                    Some((name.to_owned(), value.trim_end_matches('"').to_owned()))
                })
                .collect();
            Some((labels, value.parse().ok()?))
        })
        .collect()
}

/// The value of the series of `metric` whose labels are exactly `labels`.
fn sample(page: &str, metric: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let wanted: BTreeMap<String, String> = labels
        .iter()
        .map(|(name, value)| ((*name).to_owned(), (*value).to_owned()))
        .collect();
    samples(page, metric)
        .into_iter()
        .find(|(labels, _)| *labels == wanted)
        .map(|(_, value)| value)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_api_s_requests_are_timed_by_route_template_and_its_refusals_counted_by_status() {
    let app = TestApp::start(1, MockSettings::default(), WorkerConfig::default()).await;
    let key = crate::helpers::api::workspace_with_key(&app.db.store, "acme").await;
    app.spawn_process("api", "api");
    let base = format!("http://{}", app.wait_for_api_addr("api", LIMIT).await);
    let client = reqwest::Client::new();
    let status = |request: reqwest::RequestBuilder| async move {
        request.send().await.unwrap().status().as_u16()
    };

    // Two tasks' paths (one route), without a key and with one; the document; a path no
    // route takes; a method the quota's route does not take.
    let (first, second) = (uuid::Uuid::new_v4(), uuid::Uuid::new_v4());
    for task in [first, second] {
        let url = format!("{base}/v1/replies/{task}");
        assert_eq!(status(client.get(&url)).await, 401);
        assert_eq!(status(client.get(&url).bearer_auth(&key.token)).await, 404);
    }
    assert_eq!(
        status(client.get(format!("{base}/openapi.json"))).await,
        200
    );
    let unknown = format!("/nothing/here/{first}");
    assert_eq!(status(client.get(format!("{base}{unknown}"))).await, 404);
    assert_eq!(status(client.delete(format!("{base}/v1/quota"))).await, 405);

    let metric = "replyd_http_request_duration_seconds_count";
    let page = metrics_page(&app, "api").await;
    let count = |route: &str, method: &str, status: &str| {
        sample(
            &page,
            metric,
            &[("route", route), ("method", method), ("status", status)],
        )
    };
    // Each task's request counted under the route's template, never under its own path.
    assert_eq!(count("/v1/replies/{task_id}", "GET", "401"), Some(2.0));
    assert_eq!(count("/v1/replies/{task_id}", "GET", "404"), Some(2.0));
    assert_eq!(count("/openapi.json", "GET", "200"), Some(1.0));
    assert_eq!(count("/v1/quota", "DELETE", "405"), Some(1.0));
    assert_eq!(count("unmatched", "GET", "404"), Some(1.0));
    for path in [first.to_string(), second.to_string(), unknown] {
        assert!(!page.contains(&path), "{path} is a label: {page}");
    }
    // Every series of the histogram is one of these five (and the one registered at start).
    let series: Vec<_> = samples(&page, metric)
        .into_iter()
        .filter(|(labels, _)| !labels.is_empty())
        .collect();
    assert_eq!(series.len(), 5, "{series:?}");
    // Its buckets are the catalogue's, so a p99 reads the same on every process.
    let buckets = samples(&page, "replyd_http_request_duration_seconds_bucket")
        .into_iter()
        .filter(|(labels, _)| labels.get("route").map(String::as_str) == Some("/openapi.json"))
        .count();
    assert_eq!(
        buckets,
        replyd::telemetry::HTTP_REQUEST_SECONDS_BUCKETS.len() + 1
    );

    // A refusal is counted by its kind and its status: a missing key (401) and no such task
    // (404), whichever route answered it.
    let refused = |kind: &str, status: &str| {
        sample(
            &page,
            "replyd_api_refusals_total",
            &[("kind", kind), ("status", status)],
        )
    };
    assert_eq!(refused("unauthorized", "401"), Some(2.0));
    assert_eq!(refused("not_found", "404"), Some(3.0));
    assert_eq!(refused("method_not_allowed", "405"), Some(1.0));
}

/// One scrape target as Prometheus sees it when the chart's ServiceMonitor scrapes a part in
/// split mode: the labels it attaches (job, the Service's name; app_kubernetes_io_*, from the
/// Service's labels, which `tests/it/deploy.rs` holds the ServiceMonitor to) and the families
/// its page exports.
struct Target {
    labels: BTreeMap<&'static str, String>,
    families: BTreeSet<String>,
}

impl Target {
    /// Whether the target has a series of `metric` (Prometheus makes `up` for every target).
    fn has(&self, metric: &str) -> bool {
        PROMETHEUS_SERIES.contains(&metric) || self.families.contains(metric)
    }
}

/// The `job` values Grafana lists for `label_values(<selector>, job)` over `targets`: the
/// selector's metric and its equality matchers on target labels (a label a target lacks is
/// empty, as in PromQL).
fn listed_jobs<'a>(query: &str, targets: &'a [Target]) -> Vec<&'a Target> {
    let arguments = query
        .trim()
        .strip_prefix("label_values(")
        .and_then(|rest| rest.strip_suffix(')'))
        .unwrap_or_else(|| panic!("$job is a label_values() query: {query}"));
    let [selector, label] = top_level_split(arguments)[..] else {
        panic!("label_values(<selector>, job): {query}");
    };
    assert_eq!(label, "job", "{query}");
    let metric = selector.split('{').next().unwrap().trim();
    let matchers: Vec<(&str, &str, &str)> = selector
        .split_once('{')
        .map(|(_, rest)| rest.trim_end_matches('}'))
        .map(|inner| {
            top_level_split(inner)
                .into_iter()
                .filter(|m| !m.is_empty())
                .map(|m| {
                    let (name, op, value) = ["!=", "=~", "!~", "="]
                        .iter()
                        .find_map(|op| {
                            let (name, value) = m.split_once(op)?;
                            Some((name.trim(), *op, value.trim().trim_matches('"')))
                        })
                        .unwrap_or_else(|| panic!("a matcher: {m}"));
                    assert!(
                        op == "=" || op == "!=",
                        "the model reads = and != only: {m}"
                    );
                    (name, op, value)
                })
                .collect()
        })
        .unwrap_or_default();
    targets
        .iter()
        .filter(|t| t.has(metric))
        .filter(|t| {
            matchers.iter().all(|(name, op, value)| {
                let has = t.labels.get(name).map_or("", String::as_str);
                (has == *value) == (*op == "=")
            })
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_split_mode_every_dashboard_panel_reads_a_part_its_job_variable_lists() {
    let app = TestApp::start(2, MockSettings::default(), WorkerConfig::default()).await;
    // The chart's split mode: a process per part.
    let parts = [
        ("worker", replyd::telemetry::WORKER_METRICS),
        ("api", replyd::telemetry::API_METRICS),
        ("relay", replyd::telemetry::RELAY_METRICS),
    ];
    for (part, _) in parts {
        app.spawn_process(part, part);
    }
    let mut targets = Vec::new();
    for (part, registered) in parts {
        let families = served_families(&app, part, registered).await;
        targets.push(Target {
            labels: BTreeMap::from([
                ("job", format!("replyd-{part}")),
                ("namespace", "replyd".to_owned()),
                ("app_kubernetes_io_name", "replyd".to_owned()),
                ("app_kubernetes_io_instance", "replyd".to_owned()),
                ("app_kubernetes_io_component", part.to_owned()),
            ]),
            families,
        });
    }
    // A worker of an installation on SQS is the same part, with SQS's families too.
    let on_sqs = sqs_worker_families().await;
    targets[0].families.extend(on_sqs);

    let board: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(deploy("grafana/replyd-dashboard.json")).unwrap(),
    )
    .unwrap();
    // Two installations in two namespaces have jobs of the same names: $namespace picks one,
    // and every selector that reads $job reads it too.
    let namespaces = variable_query(&board, "namespace");
    assert_eq!(
        namespaces,
        "label_values(up{app_kubernetes_io_name=\"replyd\"}, namespace)"
    );
    for (title, exprs) in panels(&board) {
        for expr in exprs {
            assert_eq!(
                expr.matches("job=~\"$job\"").count(),
                expr.matches("namespace=~\"$namespace\",job=~\"$job\"")
                    .count(),
                "{title}: {expr}"
            );
        }
    }
    // The targets here are one installation's: with its namespace picked (or All, `.*`), the
    // namespace matcher lets every one of them through.
    let query = variable_query(&board, "job").replace(",namespace=~\"$namespace\"", "");
    let listed = listed_jobs(&query, &targets);
    let jobs: Vec<&str> = listed.iter().map(|t| t.labels["job"].as_str()).collect();
    // Every panel's every series comes from a process the variable lists ("All" selects
    // them all), so no panel is empty because its part was left out.
    let mut empty = Vec::new();
    for (title, exprs) in panels(&board) {
        for metric in exprs.iter().flat_map(|expr| selected_metrics(expr)) {
            if !listed.iter().any(|t| t.has(&metric)) {
                empty.push(format!("{title}: {metric}"));
            }
        }
    }
    assert!(
        empty.is_empty(),
        "$job ({query}) lists {jobs:?}; no listed process exports what these panels read: \
         {empty:#?}"
    );
    assert_eq!(jobs, ["replyd-worker", "replyd-api", "replyd-relay"]);
}

#[test]
fn every_alert_s_runbook_url_is_a_section_of_the_operations_guide() {
    let rules: yaml_serde::Value = yaml_serde::from_str(
        &std::fs::read_to_string(deploy("prometheus/replyd-alerts.yml")).unwrap(),
    )
    .unwrap();
    let guide =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/OPERATIONS.md"))
            .unwrap();
    // A heading's anchor as GitHub makes it: lower case, spaces to dashes, no punctuation.
    let anchors: BTreeSet<String> = guide
        .lines()
        .filter_map(|line| line.strip_prefix('#'))
        .map(|heading| {
            heading
                .trim_start_matches('#')
                .trim()
                .to_lowercase()
                .chars()
                .filter(|c| c.is_alphanumeric() || *c == ' ' || *c == '-' || *c == '_')
                .map(|c| if c == ' ' { '-' } else { c })
                .collect()
        })
        .collect();
    let alerts: Vec<_> = rules["groups"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|group| group["rules"].as_sequence().unwrap().iter())
        .collect();
    assert!(alerts.len() >= 10, "{alerts:?}");
    for rule in alerts {
        let alert = rule["alert"].as_str().expect("every rule is an alert");
        let annotations = &rule["annotations"];
        assert!(
            annotations.get("runbook").is_none(),
            "{alert}: `runbook` is runbook_url now"
        );
        let url = annotations["runbook_url"]
            .as_str()
            .unwrap_or_else(|| panic!("{alert} has a runbook_url"));
        let anchor = url
            .strip_prefix("docs/OPERATIONS.md#")
            .unwrap_or_else(|| panic!("{alert}: {url} is not in docs/OPERATIONS.md"));
        assert_eq!(anchor, alert.to_lowercase(), "{alert}: {url}");
        assert!(anchors.contains(anchor), "{alert}: no section #{anchor}");
    }
}
