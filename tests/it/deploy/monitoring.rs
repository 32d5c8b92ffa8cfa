//! What monitoring selects and carries: the ServiceMonitor attaches every label the
//! dashboard, the alerts and the lag HPA select by, and the PrometheusRule carries the rules
//! promtool tests, with absolute runbook URLs.

use super::labels::target_labels;
use super::render::{ADAPTER, PRODUCTION, of_kind, rendered, root, run, scratch, str_of, text};
use crate::helpers::infra;

/// Every `app_kubernetes_io_*` label a text selects by.
fn kubernetes_labels_in(text: &str) -> std::collections::BTreeSet<String> {
    let mut labels = std::collections::BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("app_kubernetes_io_") {
        let label: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        rest = &rest[at + label.len()..];
        labels.insert(label);
    }
    labels
}

#[test]
fn the_service_monitor_attaches_every_label_the_dashboard_the_alerts_and_the_hpa_select_by() {
    for (name, docs) in [
        ("production (keda)", rendered(&[PRODUCTION], &[])),
        ("prometheus-adapter", rendered(&[ADAPTER], &[])),
    ] {
        let attached: Vec<(String, String)> = ["worker", "api", "relay"]
            .into_iter()
            .flat_map(|component| target_labels(&docs, component))
            .collect();
        let names: std::collections::BTreeSet<&str> =
            attached.iter().map(|(label, _)| label.as_str()).collect();
        for file in [
            "deploy/grafana/replyd-dashboard.json",
            "deploy/prometheus/replyd-alerts.yml",
            "deploy/prometheus/adapter-rules.yaml",
        ] {
            let text = std::fs::read_to_string(root().join(file)).unwrap();
            for label in kubernetes_labels_in(&text) {
                assert!(
                    names.contains(label.as_str()),
                    "{name}: {file} selects by {label}, which the ServiceMonitor does not \
                     attach (it attaches {names:?})"
                );
            }
        }
        // The worker's targets carry the instance the HPA selects, with the release's name.
        let on_lag = of_kind(&docs, "HorizontalPodAutoscaler")
            .into_iter()
            .filter(|hpa| str_of(&hpa["spec"]["metrics"][0]["type"]) == "External");
        for hpa in on_lag {
            let selector = &hpa["spec"]["metrics"][0]["external"]["metric"]["selector"];
            for (label, value) in selector["matchLabels"].as_mapping().unwrap() {
                let attached = target_labels(&docs, "worker")
                    .into_iter()
                    .any(|(l, v)| l == str_of(label) && v == str_of(value));
                assert!(
                    attached,
                    "{name}: the HPA selects {label:?}={value:?}, which no worker target has"
                );
            }
        }
    }
}

#[test]
fn the_prometheus_rule_carries_the_tested_rules_with_absolute_runbook_urls() {
    let base = "https://docs.example.com/replyd/v0.1.0/OPERATIONS.md";
    let docs = rendered(
        &[],
        &[
            "prometheusRule.enabled=true",
            &format!("prometheusRule.runbookBaseUrl={base}"),
        ],
    );
    let rules = of_kind(&docs, "PrometheusRule");
    assert_eq!(rules.len(), 1);
    let spec = &rules[0]["spec"];
    // The same rules as the file promtool tests, but for the runbooks' addresses.
    let file: yaml_serde::Value = yaml_serde::from_str(
        &std::fs::read_to_string(root().join("deploy/prometheus/replyd-alerts.yml")).unwrap(),
    )
    .unwrap();
    let without_runbooks = |groups: &yaml_serde::Value| -> Vec<String> {
        let mut alerts = Vec::new();
        for group in groups["groups"].as_sequence().unwrap() {
            for rule in group["rules"].as_sequence().unwrap() {
                let mut rule = rule.clone();
                let runbook = rule["annotations"]["runbook_url"]
                    .as_str()
                    .map(str::to_owned);
                if let Some(annotations) =
                    rule.get_mut("annotations").and_then(|a| a.as_mapping_mut())
                {
                    annotations.remove("runbook_url");
                }
                alerts.push(format!("{rule:?} {}", runbook.is_some()));
            }
        }
        alerts
    };
    assert_eq!(without_runbooks(spec), without_runbooks(&file));
    let mut urls = 0;
    for group in spec["groups"].as_sequence().unwrap() {
        for rule in group["rules"].as_sequence().unwrap() {
            if let Some(url) = rule["annotations"]["runbook_url"].as_str() {
                let alert = rule["alert"].as_str().unwrap();
                assert_eq!(url, format!("{base}#{}", alert.to_lowercase()), "{alert}");
                urls += 1;
            }
        }
    }
    assert!(urls > 10, "{urls} runbooks");
    // What the Prometheus Operator hands Prometheus passes promtool.
    let file = scratch().join("rules.yml");
    std::fs::write(&file, yaml_serde::to_string(spec).unwrap()).unwrap();
    let out = run(
        &infra("PROMTOOL"),
        &["check", "rules", file.to_str().unwrap()],
    );
    assert!(out.status.success(), "promtool: {}", text(&out));
}
