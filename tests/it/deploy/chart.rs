//! The chart itself: it lints and renders manifests that validate against the Kubernetes
//! schemas, the settings it renders pass `replyd config check`, its contradictions and typos
//! are refused by name, its values' schema is the values' own, the API is reached from
//! outside and every part spreads over nodes and zones, and checkov finds only the documented
//! choices.

use std::process::Command;

use super::render::{
    KUBERNETES_VERSION, chart, config_of, example_values, object, of_kind, render, rendered,
    renderings, run, scratch, str_of, text,
};
use crate::helpers::infra;

/// The kinds of the operators the chart can render for (the Prometheus Operator's and KEDA's),
/// which the Kubernetes schemas do not hold.
const OPERATOR_KINDS: &[&str] = &[
    "ServiceMonitor",
    "PrometheusRule",
    "HTTPRoute",
    "ScaledObject",
    "TriggerAuthentication",
];

#[test]
fn the_chart_lints_and_renders_manifests_that_validate_against_the_kubernetes_schemas() {
    let helm = infra("HELM");
    let chart = chart();
    let files = example_values();
    for values in [None].into_iter().chain(files.iter().map(Some)) {
        let mut args = vec!["lint", "--strict", chart.to_str().unwrap()];
        if let Some(file) = values {
            args.extend(["-f", file]);
        }
        let out = run(&helm, &args);
        assert!(out.status.success(), "helm lint {values:?}: {}", text(&out));
    }
    let dir = scratch();
    for (name, manifests) in renderings() {
        let kinds: Vec<&str> = manifests
            .lines()
            .filter_map(|l| l.strip_prefix("kind: "))
            .collect();
        let expected: &[&str] = match name.as_str() {
            "serve" => &[
                "ConfigMap",
                "Deployment",
                "Service",
                "Job",
                "ServiceAccount",
            ],
            "production" => &[
                "Deployment",
                "PodDisruptionBudget",
                "ScaledObject",
                "TriggerAuthentication",
                "ServiceMonitor",
                "NetworkPolicy",
                "Job",
            ],
            "prometheus-adapter-values" => &[
                "Deployment",
                "HorizontalPodAutoscaler",
                "ServiceMonitor",
                "Job",
            ],
            _ => &["Deployment", "PodDisruptionBudget", "Service", "Job"],
        };
        for kind in expected {
            assert!(kinds.contains(kind), "{name}: no {kind} in {kinds:?}");
        }
        let deployments = kinds.iter().filter(|k| **k == "Deployment").count();
        assert_eq!(deployments, if name == "serve" { 1 } else { 3 }, "{name}");
        let file = dir.join(format!("{name}.yaml"));
        std::fs::write(&file, &manifests).unwrap();
        let out = run(
            &infra("KUBERNETES_VALIDATE"),
            &["-k", KUBERNETES_VERSION, "--strict", file.to_str().unwrap()],
        );
        assert!(
            out.status.success(),
            "kubernetes-validate ({name}): {}",
            text(&out)
        );
        let report = text(&out);
        // Every resource was checked against a schema, but the operators' own kinds, which
        // kubernetes-validate has no schema for and says so.
        let custom: Vec<&str> = kinds
            .iter()
            .copied()
            .filter(|kind| OPERATOR_KINDS.contains(kind))
            .collect();
        let skipped: Vec<&str> = report
            .lines()
            .filter_map(|line| line.split("Couldn't find schema for kind ").nth(1))
            .filter_map(|rest| rest.split_whitespace().next())
            .collect();
        let mut unvalidated = custom.clone();
        unvalidated.sort_unstable();
        let mut skipped_sorted = skipped.clone();
        skipped_sorted.sort_unstable();
        assert_eq!(skipped_sorted, unvalidated, "{name}: {report}");
        let passed = report.matches(" passed for resource ").count();
        assert_eq!(passed + custom.len(), kinds.len(), "{name}: {report}");
    }
}

#[test]
fn the_settings_the_chart_renders_pass_replyd_config_check() {
    let dir = scratch();
    // A CA file where the production values name one (the check opens it).
    let ca = dir.join("kafka-ca.pem");
    std::fs::write(&ca, "not read by the check\n").unwrap();
    for (name, manifests) in renderings() {
        let toml = config_of(&manifests);
        assert!(toml.contains("[\"kafka\"]"), "{name}: {toml}");
        let file = dir.join(format!("{name}.toml"));
        std::fs::write(&file, &toml).unwrap();
        // The secrets as the Deployment passes them: environment variables.
        let mut check = Command::new(env!("CARGO_BIN_EXE_replyd"));
        check.args(["config", "check", "--config"]).arg(&file).env(
            "REPLYD_DATABASE__URL",
            "postgres://replyd:secret@db:5432/replyd",
        );
        if toml.contains("\"ca_file\"") {
            check
                .env("REPLYD_KAFKA__SECURITY__SASL_PASSWORD", "secret")
                .env("REPLYD_KAFKA__SECURITY__CA_FILE", &ca);
        }
        // The trace endpoint the Deployments pass, read as the parts read it.
        let endpoint = env_value(&manifests, "OTEL_EXPORTER_OTLP_ENDPOINT");
        if let Some(endpoint) = &endpoint {
            check.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint);
        }
        let out = check.output().unwrap();
        assert!(out.status.success(), "{name}: {}\n{toml}", text(&out));
        let traced = text(&out).contains("traces: exported to http://otel-collector");
        assert_eq!(traced, name == "production", "{name}: {}", text(&out));
    }
}

/// The value of the environment variable `name` in the first container that sets it.
fn env_value(manifests: &str, name: &str) -> Option<String> {
    let at = manifests.find(&format!("- name: {name}\n"))?;
    let value = manifests[at..]
        .lines()
        .nth(1)?
        .trim()
        .strip_prefix("value: ")?;
    Some(value.trim_matches('"').to_owned())
}

#[test]
fn the_chart_refuses_contradictions_by_the_value_s_name() {
    for (set, expected) in [
        (
            vec!["worker.terminationGracePeriodSeconds=10"],
            "worker.terminationGracePeriodSeconds: 10 s must be above settings.worker.drain_timeout_ms (10000 ms)",
        ),
        (
            vec!["worker.replicas=7"],
            "worker.replicas: 7 is above partitions (6)",
        ),
        (
            vec![
                "worker.autoscaling.enabled=true",
                "worker.autoscaling.maxReplicas=9",
            ],
            "worker.autoscaling.maxReplicas: 9 is above partitions (6)",
        ),
        (
            vec![
                "worker.autoscaling.enabled=true",
                "worker.autoscaling.source=hpa",
            ],
            "worker.autoscaling.source: \"hpa\" is neither \"keda\" nor \"prometheus-adapter\"",
        ),
        (
            vec![
                "worker.autoscaling.enabled=true",
                "worker.autoscaling.targetLagPerReplica=1k",
            ],
            "worker.autoscaling.targetLagPerReplica: \"1k\" is not a whole number",
        ),
        (
            vec![
                "worker.autoscaling.enabled=true",
                "settings.kafka.security.protocol=sasl_ssl",
            ],
            "secrets.kafkaSaslPassword.name: settings.kafka.security uses SASL, and KEDA's Kafka \
             scaler reads the password from this Secret",
        ),
        (
            vec![
                "worker.autoscaling.enabled=true",
                "settings.kafka.security.protocol=ssl",
                "settings.kafka.security.ca_file=/etc/replyd/tls/kafka-ca.pem",
            ],
            "worker.autoscaling.keda.caSecret.name: settings.kafka.security.ca_file \
             (/etc/replyd/tls/kafka-ca.pem) is a file in replyd's pods",
        ),
        (vec!["mode=both"], "mode: \"both\" is neither"),
        (
            vec![
                "settings.worker.source=sqs",
                "settings.sqs.queue_url=https://sqs.eu-west-1.amazonaws.com/1/q",
                "worker.autoscaling.enabled=true",
                "worker.autoscaling.source=prometheus-adapter",
            ],
            "worker.autoscaling.source: prometheus-adapter scales on the workers' Kafka lag; \
             on SQS",
        ),
        (
            vec!["settings.worker.source=sqs"],
            "settings.sqs.queue_url: the workers receive from SQS",
        ),
        (
            vec![
                "settings.worker.source=sqs",
                "settings.sqs.queue_url=http://elasticmq:9324/1/q",
                "worker.autoscaling.enabled=true",
            ],
            "settings.sqs.region: KEDA's aws-sqs-queue scaler needs the queue's region",
        ),
        (
            vec![
                "settings.worker.source=sqs",
                "settings.sqs.queue_url=https://sqs.eu-west-1.amazonaws.com/1/q",
                "worker.autoscaling.enabled=true",
                "worker.autoscaling.keda.sqs.roleArn=arn:aws:iam::1:role/keda",
            ],
            "worker.autoscaling.keda.sqs.roleArn: KEDA assumes this role itself",
        ),
        (
            vec!["api.ingress.enabled=true"],
            "api.ingress.host: the name the API answers to is required",
        ),
        (
            vec!["api.httpRoute.enabled=true"],
            "api.httpRoute.parentRefs: the Gateway the route attaches to is required",
        ),
        (
            vec!["prometheusRule.enabled=true"],
            "prometheusRule.runbookBaseUrl: \"\" is not an http(s) URL",
        ),
        (
            vec!["secrets.databaseUrl.name="],
            "secrets.databaseUrl.name: the Secret holding database.url is required",
        ),
        (
            vec!["topics.manage=operator"],
            "topics.manage: \"operator\" is not one of job, strimzi, none",
        ),
        (
            vec!["topics.manage=strimzi"],
            "topics.strimzi.cluster: the Strimzi Kafka cluster's name is required",
        ),
        (
            vec!["traces.endpoint=otel-collector:4317"],
            "traces.endpoint: \"otel-collector:4317\" is not http(s)://host[:port]",
        ),
    ] {
        let out = render(&[], &set);
        assert!(!out.status.success(), "{set:?} renders");
        assert!(text(&out).contains(expected), "{set:?}: {}", text(&out));
    }
}

/// checkov's findings this project takes on purpose, each with its reason. Anything else
/// it finds fails the test.
const CHECKOV_SKIPS: &[(&str, &str)] = &[
    (
        "CKV_K8S_11",
        "no CPU limit: throttling stalls workers past their leases, and fenced writes follow",
    ),
    (
        "CKV_K8S_35",
        "secrets as environment variables: replyd reads its settings from REPLYD_* variables",
    ),
    (
        "CKV_K8S_43",
        "image by digest: known only once the image is pushed; set image.digest then",
    ),
];

#[test]
fn checkov_finds_nothing_in_the_chart_or_the_dockerfile_but_the_documented_choices() {
    let checkov = infra("CHECKOV");
    let skips: Vec<&str> = CHECKOV_SKIPS.iter().map(|(id, _)| *id).collect();
    let skips = skips.join(",");
    let dir = scratch();
    for (name, manifests) in renderings() {
        std::fs::write(dir.join(format!("{name}.yaml")), manifests).unwrap();
    }
    for (what, args) in [
        (
            "manifests",
            vec!["-d", dir.to_str().unwrap(), "--framework", "kubernetes"],
        ),
        (
            "Dockerfile",
            vec!["-f", "deploy/Dockerfile", "--framework", "dockerfile"],
        ),
    ] {
        let mut args = args;
        // Offline: no guideline or policy download.
        args.extend([
            "--compact",
            "--quiet",
            "--skip-download",
            "--skip-check",
            &skips,
        ]);
        let out = run(&checkov, &args);
        let report = text(&out);
        assert!(out.status.success(), "checkov ({what}): {report}");
        assert!(
            report.contains("Failed checks: 0"),
            "checkov ({what}): {report}"
        );
    }
}

/// The dotted paths of every key of `value` that is not under a free-form map of the schema.
fn value_paths(value: &serde_json::Value, schema: &serde_json::Value, at: &str) -> Vec<String> {
    let (Some(map), Some(properties)) = (value.as_object(), schema.get("properties")) else {
        return Vec::new();
    };
    map.iter()
        .flat_map(|(key, inner)| {
            let path = format!("{at}{key}");
            let mut paths = vec![path.clone()];
            if let Some(sub) = properties.get(key) {
                paths.extend(value_paths(inner, sub, &format!("{path}.")));
            }
            paths
        })
        .collect()
}

/// The dotted paths of every property `schema` names.
fn schema_paths(schema: &serde_json::Value, at: &str) -> Vec<String> {
    let Some(properties) = schema.get("properties").and_then(|p| p.as_object()) else {
        return Vec::new();
    };
    properties
        .iter()
        .flat_map(|(key, sub)| {
            let path = format!("{at}{key}");
            let mut paths = vec![path.clone()];
            paths.extend(schema_paths(sub, &format!("{path}.")));
            paths
        })
        .collect()
}

#[test]
fn a_typo_in_the_values_fails_the_install_naming_it_and_the_schema_is_the_values_own() {
    for (set, said) in [
        (
            "workr.replicas=2",
            "additional properties 'workr' not allowed",
        ),
        (
            "worker.autoscaling.maxReplica=9",
            "additional properties 'maxReplica' not allowed",
        ),
        ("partitions=six", "/partitions"),
    ] {
        let out = render(&[], &[set]);
        assert!(!out.status.success(), "{set} rendered");
        assert!(text(&out).contains(said), "{set}: {}", text(&out));
    }
    // Every key values.yaml has, the schema has, and no other (the free-form maps aside).
    let schema: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(chart().join("values.schema.json")).unwrap())
            .unwrap();
    let values: serde_json::Value =
        yaml_serde::from_str(&std::fs::read_to_string(chart().join("values.yaml")).unwrap())
            .unwrap();
    let mut in_values = value_paths(&values, &schema, "");
    in_values.sort();
    let mut in_schema: Vec<String> = schema_paths(&schema, "")
        .into_iter()
        .filter(|p| p != "global")
        .collect();
    in_schema.sort();
    assert_eq!(in_values, in_schema);
}

#[test]
fn the_api_is_reached_from_outside_scaled_on_its_cpu_and_every_part_spread_over_nodes_and_zones() {
    let docs = rendered(
        &[],
        &[
            "api.autoscaling.enabled=true",
            "api.autoscaling.maxReplicas=7",
            "api.ingress.enabled=true",
            "api.ingress.host=replyd.example.com",
            "api.ingress.tlsSecret=replyd-tls",
            "api.httpRoute.enabled=true",
            "api.httpRoute.parentRefs[0].name=public",
            "api.httpRoute.hostnames[0]=replyd.example.com",
        ],
    );
    // The HPA owns the API's replicas.
    let api = object(&docs, "Deployment", "replyd-api");
    assert!(api["spec"].get("replicas").is_none(), "{api:?}");
    let hpa = object(&docs, "HorizontalPodAutoscaler", "replyd-api");
    assert_eq!(str_of(&hpa["spec"]["scaleTargetRef"]["name"]), "replyd-api");
    assert_eq!(hpa["spec"]["maxReplicas"].as_u64(), Some(7));
    assert_eq!(
        str_of(&hpa["spec"]["metrics"][0]["resource"]["name"]),
        "cpu"
    );
    // Both routes reach the API's Service on its http port.
    let service = object(&docs, "Service", "replyd-api");
    let http_port = service["spec"]["ports"]
        .as_sequence()
        .unwrap()
        .iter()
        .find(|p| str_of(&p["name"]) == "http")
        .unwrap()["port"]
        .as_u64();
    let ingress = object(&docs, "Ingress", "replyd-api");
    let rule = &ingress["spec"]["rules"][0];
    assert_eq!(str_of(&rule["host"]), "replyd.example.com");
    let backend = &rule["http"]["paths"][0]["backend"]["service"];
    assert_eq!(str_of(&backend["name"]), "replyd-api");
    assert_eq!(str_of(&backend["port"]["name"]), "http");
    assert_eq!(
        str_of(&ingress["spec"]["tls"][0]["secretName"]),
        "replyd-tls"
    );
    let route = object(&docs, "HTTPRoute", "replyd-api");
    assert_eq!(str_of(&route["spec"]["parentRefs"][0]["name"]), "public");
    let backend = &route["spec"]["rules"][0]["backendRefs"][0];
    assert_eq!(str_of(&backend["name"]), "replyd-api");
    assert_eq!(backend["port"].as_u64(), http_port);
    // Every part's pods spread over zones and nodes, each constraint selecting its own part.
    for part in ["worker", "api", "relay"] {
        let deployment = object(&docs, "Deployment", &format!("replyd-{part}"));
        let spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
            .as_sequence()
            .unwrap();
        let keys: Vec<&str> = spread.iter().map(|c| str_of(&c["topologyKey"])).collect();
        assert_eq!(
            keys,
            ["topology.kubernetes.io/zone", "kubernetes.io/hostname"]
        );
        for constraint in spread {
            assert_eq!(str_of(&constraint["whenUnsatisfiable"]), "ScheduleAnyway");
            assert_eq!(
                str_of(&constraint["labelSelector"]["matchLabels"]["app.kubernetes.io/component"]),
                part
            );
        }
    }
    // In serve mode the routes reach the one process.
    let docs = rendered(
        &[],
        &[
            "mode=serve",
            "api.ingress.enabled=true",
            "api.ingress.host=replyd.example.com",
        ],
    );
    let ingress = object(&docs, "Ingress", "replyd-serve");
    assert_eq!(
        str_of(&ingress["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]["name"]),
        "replyd-serve"
    );
}

/// The erasure log's URL is a secret every process reads when it is named, as the database's
/// is; unnamed, no process is told of one.
#[test]
fn the_erasure_log_s_url_reaches_every_process_from_its_secret_when_named() {
    let erasure_log_env = |docs: &[yaml_serde::Value]| -> Vec<Option<String>> {
        of_kind(docs, "Deployment")
            .into_iter()
            .flat_map(|d| {
                d["spec"]["template"]["spec"]["containers"]
                    .as_sequence()
                    .cloned()
                    .unwrap_or_default()
            })
            .map(|container| {
                container["env"].as_sequence().and_then(|env| {
                    env.iter()
                        .find(|e| str_of(&e["name"]) == "REPLYD_DATABASE__ERASURE_LOG_URL")
                        .map(|e| {
                            let from = &e["valueFrom"]["secretKeyRef"];
                            format!("{}/{}", str_of(&from["name"]), str_of(&from["key"]))
                        })
                })
            })
            .collect()
    };
    let named = rendered(&[], &["secrets.erasureLogUrl.name=replyd-erasure-log"]);
    let told = erasure_log_env(&named);
    assert!(!told.is_empty());
    assert!(
        told.iter()
            .all(|e| e.as_deref() == Some("replyd-erasure-log/url")),
        "{told:?}"
    );
    let unnamed = rendered(&[], &[]);
    assert!(erasure_log_env(&unnamed).iter().all(Option::is_none));
}
