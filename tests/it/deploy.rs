//! What a platform team applies, checked with real tools on this machine (no Kubernetes
//! cluster and no container engine run here): the Helm chart lints, renders for default,
//! `serve` and production-like values, and its manifests validate against the Kubernetes
//! schemas offline (kubernetes-validate, strict); the settings it renders pass `replyd config
//! check`; its contradictions are refused by name; the chart's manifests and the Dockerfile
//! pass checkov, and the Dockerfile hadolint.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::helpers::{infra, unique};

const KUBERNETES_VERSION: &str = "1.31.0";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn chart() -> PathBuf {
    root().join("deploy/helm/replyd")
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("{program} runs: {e}"))
}

fn text(out: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// `helm template` with `values` files and `--set` pairs.
fn render(values: &[&str], set: &[&str]) -> Output {
    let chart = chart();
    let mut args = vec![
        "template",
        "replyd",
        chart.to_str().unwrap(),
        "--namespace",
        "replyd",
        "--kube-version",
        KUBERNETES_VERSION,
    ];
    for file in values {
        args.extend(["-f", file]);
    }
    for pair in set {
        args.extend(["--set", pair]);
    }
    run(&infra("HELM"), &args)
}

const PRODUCTION: &str = "deploy/helm/replyd/ci/production-values.yaml";

/// The rendered value sets: default, the one-process install, production-like.
fn renderings() -> Vec<(&'static str, String)> {
    [
        ("default", render(&[], &[])),
        ("serve", render(&[], &["mode=serve"])),
        ("production", render(&[PRODUCTION], &[])),
    ]
    .into_iter()
    .map(|(name, out)| {
        assert!(
            out.status.success(),
            "helm template ({name}): {}",
            text(&out)
        );
        (name, String::from_utf8(out.stdout).unwrap())
    })
    .collect()
}

fn scratch() -> PathBuf {
    let dir = std::env::temp_dir().join(unique("deploy"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn the_chart_lints_and_renders_manifests_that_validate_against_the_kubernetes_schemas() {
    let helm = infra("HELM");
    let chart = chart();
    for values in [None, Some(PRODUCTION)] {
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
        let expected: &[&str] = match name {
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
                "HorizontalPodAutoscaler",
                "ServiceMonitor",
                "NetworkPolicy",
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
        // Every resource was checked against a schema, but the Prometheus Operator's own kind.
        let passed = report.matches(" passed for resource ").count();
        assert_eq!(
            passed + usize::from(name == "production"),
            kinds.len(),
            "{name}: {report}"
        );
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

/// The `replyd.toml` of the rendered ConfigMap.
fn config_of(manifests: &str) -> String {
    let start = manifests
        .find("  replyd.toml: |\n")
        .expect("the ConfigMap holds replyd.toml");
    manifests[start..]
        .lines()
        .skip(1)
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect::<Vec<_>>()
        .join("\n")
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
        (vec!["mode=both"], "mode: \"both\" is neither"),
        (
            vec!["secrets.databaseUrl.name="],
            "secrets.databaseUrl.name: the Secret holding database.url is required",
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

#[test]
fn hadolint_passes_the_dockerfile() {
    let out = run(
        &infra("HADOLINT"),
        &["--config", ".hadolint.yaml", "deploy/Dockerfile"],
    );
    assert!(out.status.success(), "hadolint: {}", text(&out));
    // The image runs as a non-root user, with replyd as its entrypoint and its own health check;
    // its build has the files `src/api/demo.rs` embeds.
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    for line in [
        "USER 10001:10001",
        "ENTRYPOINT [\"/usr/local/bin/replyd\"]",
        "CMD [\"/usr/local/bin/replyd\", \"healthz\"]",
        "COPY clients/typescript/demo clients/typescript/demo",
        "COPY clients/typescript/dist clients/typescript/dist",
    ] {
        assert!(dockerfile.contains(line), "the Dockerfile has {line}");
    }
}
