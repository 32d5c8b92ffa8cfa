//! The labels the Prometheus Operator's targets carry, as the rendered ServiceMonitor makes
//! them and as Prometheus names them: what the dashboard, the alerts and the lag HPA may
//! select by. Shared by the monitoring and the scaling tests.

use super::render::{of_kind, str_of};

/// A Kubernetes label as Prometheus names it on a target (`app.kubernetes.io/instance` →
/// `app_kubernetes_io_instance`): every character outside `[a-zA-Z0-9_]` becomes `_`.
pub(super) fn prometheus_label(label: &str) -> String {
    label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The labels of the Prometheus Operator's targets for the Service of `component`, as the
/// rendered ServiceMonitor makes them: `job` (the Service's name), `namespace`, and the
/// Service's labels its `targetLabels` copy and the pods' labels its `podTargetLabels` copy.
pub(super) fn target_labels(docs: &[yaml_serde::Value], component: &str) -> Vec<(String, String)> {
    let [monitor] = of_kind(docs, "ServiceMonitor")[..] else {
        panic!("one ServiceMonitor");
    };
    let service = of_kind(docs, "Service")
        .into_iter()
        .find(|s| s["metadata"]["labels"]["app.kubernetes.io/component"] == component)
        .unwrap_or_else(|| panic!("a Service of {component}"));
    let selected = monitor["spec"]["selector"]["matchLabels"]
        .as_mapping()
        .expect("the ServiceMonitor selects by labels")
        .iter()
        .all(|(k, v)| service["metadata"]["labels"][str_of(k)] == *v);
    assert!(
        selected,
        "the ServiceMonitor selects the {component} Service"
    );
    let port = monitor["spec"]["endpoints"][0]["port"].clone();
    assert!(
        service["spec"]["ports"]
            .as_sequence()
            .unwrap()
            .iter()
            .any(|p| p["name"] == port),
        "the {component} Service has the port {port:?}"
    );
    let pods = of_kind(docs, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == component)
        .map(|d| d["spec"]["template"]["metadata"]["labels"].clone())
        .unwrap_or_else(|| panic!("a Deployment of {component}"));
    let mut labels = vec![
        (
            "job".to_owned(),
            str_of(&service["metadata"]["name"]).to_owned(),
        ),
        (
            "namespace".to_owned(),
            str_of(&service["metadata"]["namespace"]).to_owned(),
        ),
    ];
    for (list, from) in [
        ("targetLabels", &service["metadata"]["labels"]),
        ("podTargetLabels", &pods),
    ] {
        for label in monitor["spec"][list].as_sequence().into_iter().flatten() {
            if let Some(value) = from[str_of(label)].as_str() {
                labels.push((prometheus_label(str_of(label)), value.to_owned()));
            }
        }
    }
    labels
}
