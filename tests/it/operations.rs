//! What operators run against replyd, checked against a live process: every metric the
//! Grafana dashboard (deploy/grafana) and the alert rules (deploy/prometheus) name is on a
//! running `replyd serve`'s `/metrics` from its start; the consumer-lag and oldest-in-flight
//! gauges move with real work; the rules pass `promtool check rules` and their own
//! `promtool test rules` cases.

use std::collections::BTreeSet;
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

    // From the first scrape, before any work: every family the files name.
    let page = metrics_page(&app, "serve").await;
    let exported = families(&page);
    let dashboard = std::fs::read_to_string(deploy("grafana/replyd-dashboard.json")).unwrap();
    let rules = std::fs::read_to_string(deploy("prometheus/replyd-alerts.yml")).unwrap();
    serde_json::from_str::<serde_json::Value>(&dashboard).expect("the dashboard is JSON");
    for (file, text) in [("dashboard", &dashboard), ("alert rules", &rules)] {
        let named = names_in(text);
        assert!(named.len() >= 5, "{file} names metrics: {named:?}");
        let missing: Vec<_> = named.difference(&exported).collect();
        assert!(
            missing.is_empty(),
            "{file} names {missing:?}, which /metrics does not have"
        );
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
