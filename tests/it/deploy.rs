//! What a platform team applies, checked with real tools on this machine (no Kubernetes
//! cluster and no container engine run here): the Helm chart lints, renders for default,
//! `serve` and every example values file, and its manifests validate against the Kubernetes
//! schemas offline (kubernetes-validate, strict); the settings it renders pass `replyd config
//! check`; its contradictions are refused by name; the labels monitoring and the lag HPA
//! select by are ones its ServiceMonitor attaches, prometheus-adapter's query for the HPA
//! counts each partition of the installation once (promtool), and KEDA's Kafka trigger reads
//! the settings' brokers, group and topic with the chart's Secrets; the chart's manifests and
//! the Dockerfile pass checkov, and the Dockerfile hadolint.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use crate::helpers::{free_port, infra, unique};

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

/// The example values files the chart ships (`ci/*.yaml`), relative to the repository.
fn example_values() -> Vec<String> {
    let mut files: Vec<String> = std::fs::read_dir(chart().join("ci"))
        .unwrap()
        .map(|entry| entry.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.ends_with(".yaml"))
        .map(|name| format!("deploy/helm/replyd/ci/{name}"))
        .collect();
    files.sort();
    assert!(files.iter().any(|f| f == PRODUCTION), "{files:?}");
    files
}

/// The rendered value sets: default, the one-process install, and every example values file
/// (named by its file, `production` for the production-like one).
fn renderings() -> Vec<(String, String)> {
    let mut sets = vec![
        ("default".to_owned(), render(&[], &[])),
        ("serve".to_owned(), render(&[], &["mode=serve"])),
    ];
    for file in example_values() {
        let name = if file == PRODUCTION {
            "production".to_owned()
        } else {
            file.rsplit('/')
                .next()
                .unwrap()
                .trim_end_matches(".yaml")
                .to_owned()
        };
        sets.push((name, render(&[&file], &[])));
    }
    sets.into_iter()
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

#[test]
fn the_image_builds_its_dependencies_in_a_layer_before_any_source() {
    // In the stage that builds the binary, the dependencies are built (from cargo-chef's
    // recipe) before any source directory is copied: a change to the sources alone reuses the
    // dependency layer. The Dockerfile as it was copied src before its only build.
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    let stage: Vec<&str> = dockerfile
        .lines()
        .skip_while(|l| !(l.starts_with("FROM ") && l.ends_with(" AS build")))
        .skip(1)
        .take_while(|l| !l.starts_with("FROM "))
        .collect();
    assert!(!stage.is_empty(), "a stage named build");
    let position = |what: &dyn Fn(&str) -> bool| stage.iter().position(|l| what(l));
    let cook = position(&|l: &str| l.starts_with("RUN cargo chef cook --release --locked"))
        .expect("the dependencies are cooked in the build stage");
    let first_source = position(&|l: &str| {
        l.starts_with("COPY ") && !l.starts_with("COPY --from=planner") && !l.contains("Cargo.")
    })
    .expect("the sources are copied");
    let build = position(&|l: &str| l.starts_with("RUN cargo build --release --locked"))
        .expect("the binary is built");
    assert!(cook < first_source && first_source < build, "{stage:#?}");
    // The recipe the cook reads comes from a stage of its own, not from the sources here.
    assert!(
        stage[..cook]
            .iter()
            .any(|l| l.starts_with("COPY --from=planner")),
        "{stage:#?}"
    );
}

// Helm's install order, simulated over the rendered manifests (no API server runs here): the
// pre-install hooks one by one by weight (then kind, then name), each waited for; then the
// release's resources; then the post-install hooks. A hook whose pod uses a resource the
// release makes later cannot start, and the install times out on it.

/// Kinds in the order Helm creates them (its `InstallOrder`); other kinds come last.
const HELM_INSTALL_ORDER: &[&str] = &[
    "PriorityClass",
    "Namespace",
    "NetworkPolicy",
    "ResourceQuota",
    "LimitRange",
    "PodSecurityPolicy",
    "PodDisruptionBudget",
    "ServiceAccount",
    "Secret",
    "SecretList",
    "ConfigMap",
    "StorageClass",
    "PersistentVolume",
    "PersistentVolumeClaim",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleList",
    "ClusterRoleBinding",
    "ClusterRoleBindingList",
    "Role",
    "RoleList",
    "RoleBinding",
    "RoleBindingList",
    "Service",
    "DaemonSet",
    "Pod",
    "ReplicationController",
    "ReplicaSet",
    "Deployment",
    "HorizontalPodAutoscaler",
    "StatefulSet",
    "Job",
    "CronJob",
    "IngressClass",
    "Ingress",
    "APIService",
];

/// One rendered object, as Helm orders it.
#[derive(Debug)]
struct Manifest {
    kind: String,
    name: String,
    /// The install hooks it is (`pre-install`, `post-install`), empty for a release resource.
    hooks: Vec<String>,
    weight: i64,
    /// What its pods need to exist: (kind, name).
    uses: Vec<(String, String)>,
}

fn manifests_of(rendered: &str) -> Vec<Manifest> {
    documents(rendered)
        .into_iter()
        .map(|doc| {
            let str_at = |path: &[&str]| -> Option<String> {
                let mut at = &doc;
                for key in path {
                    at = at.get(*key)?;
                }
                at.as_str().map(str::to_owned)
            };
            let hooks = str_at(&["metadata", "annotations", "helm.sh/hook"])
                .map(|h| h.split(',').map(|e| e.trim().to_owned()).collect())
                .unwrap_or_default();
            let weight = str_at(&["metadata", "annotations", "helm.sh/hook-weight"])
                .map(|w| w.parse().expect("a hook weight is a number"))
                .unwrap_or(0);
            let pod = ["spec", "template", "spec"]
                .iter()
                .try_fold(&doc, |at, key| at.get(*key));
            Manifest {
                kind: str_at(&["kind"]).expect("every object has a kind"),
                name: str_at(&["metadata", "name"]).expect("every object has a name"),
                hooks,
                weight,
                uses: pod.map(pod_uses).unwrap_or_default(),
            }
        })
        .collect()
}

/// What a pod spec needs to exist before its pod can be made: its ServiceAccount, and the
/// ConfigMaps and Secrets its volumes and environment read.
fn pod_uses(pod: &yaml_serde::Value) -> Vec<(String, String)> {
    let mut uses = Vec::new();
    let mut add = |kind: &str, name: Option<&yaml_serde::Value>| {
        if let Some(name) = name.and_then(|n| n.as_str()) {
            uses.push((kind.to_owned(), name.to_owned()));
        }
    };
    add("ServiceAccount", pod.get("serviceAccountName"));
    let list = |value: Option<&yaml_serde::Value>| {
        value
            .and_then(|v| v.as_sequence())
            .cloned()
            .unwrap_or_default()
    };
    for volume in list(pod.get("volumes")) {
        add(
            "ConfigMap",
            volume.get("configMap").and_then(|c| c.get("name")),
        );
        add(
            "Secret",
            volume.get("secret").and_then(|c| c.get("secretName")),
        );
    }
    let containers = list(pod.get("containers"))
        .into_iter()
        .chain(list(pod.get("initContainers")));
    for container in containers {
        for env in list(container.get("env")) {
            let from = env.get("valueFrom");
            add(
                "ConfigMap",
                from.and_then(|f| f.get("configMapKeyRef"))
                    .and_then(|r| r.get("name")),
            );
            add(
                "Secret",
                from.and_then(|f| f.get("secretKeyRef"))
                    .and_then(|r| r.get("name")),
            );
        }
        for source in list(container.get("envFrom")) {
            add(
                "ConfigMap",
                source.get("configMapRef").and_then(|r| r.get("name")),
            );
            add(
                "Secret",
                source.get("secretRef").and_then(|r| r.get("name")),
            );
        }
    }
    uses
}

/// Walks Helm's install order and names every hook that uses a resource the release makes
/// after it. Resources the chart does not render (the Secrets the operator makes first, the
/// namespace's `default` ServiceAccount) are prerequisites, not part of the order.
fn install_order_problems(manifests: &[Manifest]) -> Vec<String> {
    let rank = |kind: &str| {
        HELM_INSTALL_ORDER
            .iter()
            .position(|k| *k == kind)
            .unwrap_or(HELM_INSTALL_ORDER.len())
    };
    let hooks_of = |event: &str| {
        let mut hooks: Vec<&Manifest> = manifests
            .iter()
            .filter(|m| m.hooks.iter().any(|h| h == event))
            .collect();
        hooks.sort_by(|a, b| {
            (a.weight, rank(&a.kind), &a.name).cmp(&(b.weight, rank(&b.kind), &b.name))
        });
        hooks
    };
    let mut resources: Vec<&Manifest> = manifests.iter().filter(|m| m.hooks.is_empty()).collect();
    resources.sort_by(|a, b| (rank(&a.kind), &a.name).cmp(&(rank(&b.kind), &b.name)));
    let rendered =
        |kind: &str, name: &str| manifests.iter().any(|m| m.kind == kind && m.name == name);
    let mut made: Vec<(String, String)> = Vec::new();
    let mut problems = Vec::new();
    let mut hook_phase = |hooks: Vec<&Manifest>, event: &str, made: &mut Vec<(String, String)>| {
        for hook in hooks {
            for (kind, name) in &hook.uses {
                let exists = made.iter().any(|(k, n)| k == kind && n == name);
                if rendered(kind, name) && !exists {
                    problems.push(format!(
                        "the {event} hook {}/{} uses {kind}/{name}, which the release makes \
                         after it",
                        hook.kind, hook.name
                    ));
                }
            }
            made.push((hook.kind.clone(), hook.name.clone()));
        }
    };
    hook_phase(hooks_of("pre-install"), "pre-install", &mut made);
    for resource in resources {
        made.push((resource.kind.clone(), resource.name.clone()));
    }
    hook_phase(hooks_of("post-install"), "post-install", &mut made);
    problems
}

/// The rendered object of `kind` named `name`.
fn object<'a>(docs: &'a [yaml_serde::Value], kind: &str, name: &str) -> &'a yaml_serde::Value {
    docs.iter()
        .find(|d| d["kind"].as_str() == Some(kind) && d["metadata"]["name"].as_str() == Some(name))
        .unwrap_or_else(|| panic!("no {kind}/{name}"))
}

#[test]
fn the_topics_are_made_by_a_hook_job_before_the_workers_or_as_strimzi_resources() {
    // By default, a hook Job runs `replyd topics ensure` with the chart's partition count and
    // the same settings as the pods (a hook ConfigMap: the release's does not exist yet).
    let out = render(&[], &["partitions=4", "topics.replicationFactor=3"]);
    assert!(out.status.success(), "{}", text(&out));
    let rendered = String::from_utf8(out.stdout).unwrap();
    let docs = documents(&rendered);
    let job = object(&docs, "Job", "replyd-topics");
    assert_eq!(
        job["metadata"]["annotations"]["helm.sh/hook"].as_str(),
        Some("pre-install,pre-upgrade")
    );
    let container = &job["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args,
        [
            "topics",
            "ensure",
            "--partitions",
            "4",
            "--replication-factor",
            "3"
        ]
    );
    assert_eq!(
        object(&docs, "ConfigMap", "replyd-hooks")["data"]["replyd.toml"],
        object(&docs, "ConfigMap", "replyd")["data"]["replyd.toml"]
    );
    // Its weight is below the migration's: both run before any pod of the release.
    let weight = |name: &str| {
        object(&docs, "Job", name)["metadata"]["annotations"]["helm.sh/hook-weight"]
            .as_str()
            .unwrap()
            .parse::<i64>()
            .unwrap()
    };
    assert!(weight("replyd-topics") < weight("replyd-migrate"));

    // With Strimzi: two KafkaTopics for the named cluster, and no Job.
    let out = render(
        &[],
        &[
            "topics.manage=strimzi",
            "topics.strimzi.cluster=events",
            "settings.kafka.topic=chat-tasks",
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let docs = documents(&String::from_utf8(out.stdout).unwrap());
    assert!(
        !docs
            .iter()
            .any(|d| d["metadata"]["name"].as_str() == Some("replyd-topics")),
        "no topic Job with Strimzi"
    );
    for (name, topic) in [
        ("replyd-tasks", "chat-tasks"),
        ("replyd-dead-letters", "chat-tasks.dlq"),
    ] {
        let resource = object(&docs, "KafkaTopic", name);
        assert_eq!(resource["spec"]["topicName"].as_str(), Some(topic));
        assert_eq!(resource["spec"]["partitions"].as_i64(), Some(6));
        assert_eq!(
            resource["metadata"]["labels"]["strimzi.io/cluster"].as_str(),
            Some("events")
        );
    }
    // And with neither, nothing is made.
    let out = render(&[], &["topics.manage=none"]);
    let rendered = String::from_utf8(out.stdout).unwrap();
    assert!(!rendered.contains("replyd-topics") && !rendered.contains("KafkaTopic"));
}

#[test]
fn with_static_membership_the_workers_are_a_stateful_set_named_by_their_pods() {
    let static_with = |source: &str| {
        let source = format!("worker.autoscaling.source={source}");
        let out = render(
            &[],
            &[
                "staticMembership=true",
                "worker.autoscaling.enabled=true",
                &source,
            ],
        );
        assert!(out.status.success(), "{}", text(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    let rendered = static_with("prometheus-adapter");
    let docs = documents(&rendered);
    let workers = object(&docs, "StatefulSet", "replyd-worker");
    assert_eq!(
        workers["spec"]["serviceName"].as_str(),
        Some("replyd-worker")
    );
    let env = workers["spec"]["template"]["spec"]["containers"][0]["env"]
        .as_sequence()
        .unwrap();
    let instance = env
        .iter()
        .find(|e| e["name"].as_str() == Some("REPLYD_KAFKA__GROUP_INSTANCE_ID"))
        .expect("the pod's name is its group.instance.id");
    assert_eq!(
        instance["valueFrom"]["fieldRef"]["fieldPath"].as_str(),
        Some("metadata.name")
    );
    // The API and the relay stay Deployments; either autoscaler scales the StatefulSet.
    object(&docs, "Deployment", "replyd-api");
    let target_of = |docs: &[yaml_serde::Value], kind: &str| {
        docs.iter()
            .find(|d| d["kind"].as_str() == Some(kind))
            .unwrap_or_else(|| panic!("a {kind}"))["spec"]["scaleTargetRef"]
            .clone()
    };
    let target = target_of(&docs, "HorizontalPodAutoscaler");
    assert_eq!(target["kind"].as_str(), Some("StatefulSet"));
    assert_eq!(target["name"].as_str(), Some("replyd-worker"));
    let target = target_of(&documents(&static_with("keda")), "ScaledObject");
    assert_eq!(target["kind"].as_str(), Some("StatefulSet"));
    assert_eq!(target["name"].as_str(), Some("replyd-worker"));
    // It validates against the Kubernetes schemas, and installs in Helm's order.
    let file = scratch().join("static.yaml");
    std::fs::write(&file, &rendered).unwrap();
    let out = run(
        &infra("KUBERNETES_VALIDATE"),
        &["-k", KUBERNETES_VERSION, "--strict", file.to_str().unwrap()],
    );
    assert!(out.status.success(), "kubernetes-validate: {}", text(&out));
    assert_eq!(
        install_order_problems(&manifests_of(&rendered)),
        Vec::<String>::new()
    );
}

#[test]
fn the_install_order_check_finds_a_hook_that_uses_a_resource_made_after_it() {
    // The chart as it was: the migration Job, a pre-install hook, ran as the release's own
    // ServiceAccount, an ordinary resource made after every pre-install hook.
    let rendered = "\
apiVersion: v1
kind: ServiceAccount
metadata: {name: replyd}
---
apiVersion: batch/v1
kind: Job
metadata:
  name: replyd-migrate
  annotations: {helm.sh/hook: 'pre-install,pre-upgrade', helm.sh/hook-weight: '0'}
spec:
  template:
    spec:
      serviceAccountName: replyd
      containers:
        - name: migrate
          env:
            - name: REPLYD_DATABASE__URL
              valueFrom: {secretKeyRef: {name: replyd-database, key: url}}
";
    assert_eq!(
        install_order_problems(&manifests_of(rendered)),
        vec![
            "the pre-install hook Job/replyd-migrate uses ServiceAccount/replyd, which the \
             release makes after it"
                .to_owned()
        ]
    );
    // The same Job under a hook ServiceAccount of a lower weight installs.
    let fixed = rendered.replace(
        "metadata: {name: replyd}\n",
        "metadata:\n  name: replyd\n  annotations: {helm.sh/hook: pre-install, helm.sh/hook-weight: '-10'}\n",
    );
    assert_eq!(
        install_order_problems(&manifests_of(&fixed)),
        Vec::<String>::new()
    );
}

#[test]
fn every_rendering_installs_in_helm_s_order() {
    let mut sets = renderings();
    // A team that brings its own ServiceAccount.
    let own = render(
        &[],
        &["serviceAccount.create=false", "serviceAccount.name=team-sa"],
    );
    assert!(own.status.success(), "{}", text(&own));
    sets.push((
        "own-service-account".into(),
        String::from_utf8(own.stdout).unwrap(),
    ));
    // A role for the service account (IRSA on EKS: the AWS credential chain SQS uses).
    let role = "arn:aws:iam::123456789012:role/replyd";
    let docs = rendered(
        &[],
        &[&format!(
            "serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn={role}"
        )],
    );
    let account = of_kind(&docs, "ServiceAccount");
    assert_eq!(
        account[0]["metadata"]["annotations"]["eks.amazonaws.com/role-arn"],
        role
    );
    for (name, rendered) in sets {
        let manifests = manifests_of(&rendered);
        let migrate = manifests
            .iter()
            .find(|m| m.kind == "Job")
            .unwrap_or_else(|| panic!("{name}: a migration Job"));
        assert!(migrate.hooks.iter().any(|h| h == "pre-install"), "{name}");
        assert_eq!(
            install_order_problems(&manifests),
            Vec::<String>::new(),
            "{name}"
        );
    }
}

// Scaling on the consumer group's lag, and the labels monitoring selects by.

/// The example values file that scales through prometheus-adapter instead of KEDA.
const ADAPTER: &str = "deploy/helm/replyd/ci/prometheus-adapter-values.yaml";

/// Every object of a rendering.
fn documents(rendered: &str) -> Vec<yaml_serde::Value> {
    use serde::Deserialize as _;
    yaml_serde::Deserializer::from_str(rendered)
        .map(|doc| yaml_serde::Value::deserialize(doc).expect("rendered YAML parses"))
        .filter(|doc| !doc.is_null())
        .collect()
}

/// The objects of `kind` in a rendering.
fn of_kind<'a>(docs: &'a [yaml_serde::Value], kind: &str) -> Vec<&'a yaml_serde::Value> {
    docs.iter().filter(|d| d["kind"] == kind).collect()
}

/// `helm template` of `values` files and `set` pairs, which must succeed, as objects.
fn rendered(values: &[&str], set: &[&str]) -> Vec<yaml_serde::Value> {
    let out = render(values, set);
    assert!(out.status.success(), "{values:?} {set:?}: {}", text(&out));
    documents(&String::from_utf8(out.stdout).unwrap())
}

fn str_of(value: &yaml_serde::Value) -> &str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("a string: {value:?}"))
}

/// A Kubernetes label as Prometheus names it on a target (`app.kubernetes.io/instance` →
/// `app_kubernetes_io_instance`): every character outside `[a-zA-Z0-9_]` becomes `_`.
fn prometheus_label(label: &str) -> String {
    label
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect()
}

/// The labels of the Prometheus Operator's targets for the Service of `component`, as the
/// rendered ServiceMonitor makes them: `job` (the Service's name), `namespace`, and the
/// Service's labels its `targetLabels` copy and the pods' labels its `podTargetLabels` copy.
fn target_labels(docs: &[yaml_serde::Value], component: &str) -> Vec<(String, String)> {
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
fn the_adapter_s_lag_for_the_chart_s_hpa_sums_each_partition_of_its_installation_once() {
    let docs = rendered(&[ADAPTER], &[]);
    let [hpa] = of_kind(&docs, "HorizontalPodAutoscaler")[..] else {
        panic!("one HPA with prometheus-adapter");
    };
    assert!(
        of_kind(&docs, "ScaledObject").is_empty(),
        "KEDA's own HPA would fight the chart's"
    );
    let metric = &hpa["spec"]["metrics"][0]["external"]["metric"];
    let name = str_of(&metric["name"]);
    let rules: yaml_serde::Value = yaml_serde::from_str(
        &std::fs::read_to_string(root().join("deploy/prometheus/adapter-rules.yaml")).unwrap(),
    )
    .unwrap();
    let rule = rules["externalRules"]
        .as_sequence()
        .expect("external rules")
        .iter()
        .find(|r| {
            r["name"]["as"]
                .as_str()
                .unwrap_or_else(|| str_of(&r["seriesQuery"]).split('{').next().unwrap())
                == name
        })
        .unwrap_or_else(|| panic!("an external rule serves {name}"));
    assert_eq!(
        rule["resources"]["overrides"]["namespace"]["resource"], "namespace",
        "the HPA's namespace selects the series"
    );
    // The query as the adapter sends it for this HPA: the series, and as matchers the HPA's
    // selector and its namespace.
    let namespace = str_of(&hpa["metadata"]["namespace"]);
    let mut matchers: Vec<String> = metric["selector"]["matchLabels"]
        .as_mapping()
        .unwrap()
        .iter()
        .map(|(k, v)| format!("{}=\"{}\"", str_of(k), str_of(v)))
        .collect();
    matchers.push(format!("namespace=\"{namespace}\""));
    let query = str_of(&rule["metricsQuery"])
        .replace("<<.Series>>", name)
        .replace("<<.LabelMatchers>>", &matchers.join(","));

    // Two workers of this installation, as the ServiceMonitor labels their series: partition
    // 0 moved from a to b, and a still reports its lag of before the move until its next
    // statistics; another installation in the same namespace, which must not count.
    let labels = target_labels(&docs, "worker");
    let series = |pod: &str, partition: u32, instance: &str| {
        let mut all: Vec<String> = labels
            .iter()
            .map(|(label, value)| {
                let value = if label == "app_kubernetes_io_instance" {
                    instance
                } else {
                    value
                };
                format!("{label}=\"{value}\"")
            })
            .collect();
        all.push(format!("pod=\"{pod}\""));
        all.push(format!("partition=\"{partition}\""));
        format!("{name}{{{}}}", all.join(","))
    };
    let release = labels
        .iter()
        .find(|(label, _)| label == "app_kubernetes_io_instance")
        .map(|(_, value)| value.clone())
        .expect("the worker's targets carry the release");
    let input = [
        (series("worker-a", 0, &release), 80),
        (series("worker-a", 1, &release), 200),
        (series("worker-b", 0, &release), 100),
        (series("worker-b", 2, &release), 300),
        (series("other-worker", 0, "other"), 5000),
    ];
    let test = format!(
        "rule_files: []\nevaluation_interval: 1m\ntests:\n  - interval: 1m\n    input_series:\n{}\n    promql_expr_test:\n      - expr: 'count({})'\n        eval_time: 2m\n        exp_samples:\n          - labels: '{{}}'\n            value: 5\n      - expr: '{}'\n        eval_time: 2m\n        exp_samples:\n          - labels: '{{app_kubernetes_io_instance=\"{release}\"}}'\n            value: 600\n",
        input
            .iter()
            .map(|(s, v)| format!("      - series: '{s}'\n        values: '{v}x5'"))
            .collect::<Vec<_>>()
            .join("\n"),
        str_of(&rule["seriesQuery"]),
        query,
    );
    let file = scratch().join("adapter.test.yml");
    std::fs::write(&file, &test).unwrap();
    let out = run(
        &infra("PROMTOOL"),
        &["test", "rules", file.to_str().unwrap()],
    );
    assert!(out.status.success(), "{}\n{test}", text(&out));
}

#[test]
fn keda_reads_the_lag_from_the_brokers_the_group_and_the_topic_the_settings_name() {
    let docs = rendered(&[PRODUCTION], &[]);
    let values: yaml_serde::Value =
        yaml_serde::from_str(&std::fs::read_to_string(root().join(PRODUCTION)).unwrap()).unwrap();
    let kafka = &values["settings"]["kafka"];
    let scaling = &values["worker"]["autoscaling"];
    assert!(
        of_kind(&docs, "HorizontalPodAutoscaler")
            .iter()
            .all(|hpa| str_of(&hpa["spec"]["scaleTargetRef"]["name"]) != "replyd-worker"),
        "KEDA makes the workers' HPA; a second one would fight it"
    );
    let [scaled] = of_kind(&docs, "ScaledObject")[..] else {
        panic!("one ScaledObject");
    };
    let spec = &scaled["spec"];
    let worker = of_kind(&docs, "Deployment")
        .into_iter()
        .find(|d| d["metadata"]["labels"]["app.kubernetes.io/component"] == "worker")
        .unwrap();
    assert_eq!(spec["scaleTargetRef"]["name"], worker["metadata"]["name"]);
    assert!(
        worker["spec"].get("replicas").is_none(),
        "the Deployment leaves its replicas to the scaler"
    );
    assert_eq!(spec["minReplicaCount"], scaling["minReplicas"]);
    assert_eq!(spec["maxReplicaCount"], scaling["maxReplicas"]);
    let [trigger] = &spec["triggers"].as_sequence().unwrap()[..] else {
        panic!("one trigger");
    };
    assert_eq!(trigger["type"], "kafka");
    let metadata = &trigger["metadata"];
    assert_eq!(metadata["bootstrapServers"], kafka["bootstrap_servers"]);
    assert_eq!(metadata["consumerGroup"], kafka["group_id"]);
    assert_eq!(metadata["topic"], kafka["topic"]);
    assert_eq!(metadata["lagThreshold"], scaling["targetLagPerReplica"]);
    // replyd starts a partition without a committed offset from its beginning.
    assert_eq!(metadata["offsetResetPolicy"], "earliest");

    // SASL_SSL with SCRAM-SHA-512 and a private CA: the scaler authenticates as the workers
    // do, from the chart's Secrets.
    let auth_name = &trigger["authenticationRef"]["name"];
    let [auth] = of_kind(&docs, "TriggerAuthentication")[..] else {
        panic!("one TriggerAuthentication");
    };
    assert_eq!(&auth["metadata"]["name"], auth_name);
    let refs = |list: &str| -> Vec<(String, String, String)> {
        auth["spec"][list]
            .as_sequence()
            .into_iter()
            .flatten()
            .map(|r| {
                (
                    str_of(&r["parameter"]).to_owned(),
                    str_of(&r["name"]).to_owned(),
                    str_of(&r["key"]).to_owned(),
                )
            })
            .collect()
    };
    let password = &values["secrets"]["kafkaSaslPassword"];
    let ca = &scaling["keda"]["caSecret"];
    assert_eq!(
        refs("secretTargetRef"),
        vec![
            (
                "password".to_owned(),
                str_of(&password["name"]).to_owned(),
                str_of(&password["key"]).to_owned()
            ),
            (
                "ca".to_owned(),
                str_of(&ca["name"]).to_owned(),
                str_of(&ca["key"]).to_owned()
            ),
        ]
    );
    let plain = refs("configMapTargetRef");
    let from_config_map = |parameter: &str| {
        let (_, map, key) = plain
            .iter()
            .find(|(p, _, _)| p == parameter)
            .unwrap_or_else(|| panic!("{parameter} from a ConfigMap: {plain:?}"));
        let map = of_kind(&docs, "ConfigMap")
            .into_iter()
            .find(|c| c["metadata"]["name"] == map.as_str())
            .unwrap_or_else(|| panic!("the chart renders ConfigMap {map}"));
        str_of(&map["data"][key.as_str()]).to_owned()
    };
    assert_eq!(from_config_map("sasl"), "scram_sha512");
    assert_eq!(
        from_config_map("username"),
        str_of(&kafka["security"]["sasl_username"])
    );
    assert_eq!(from_config_map("tls"), "enable");

    // Plaintext brokers (the default settings): nothing to authenticate with.
    let docs = rendered(&[], &["worker.autoscaling.enabled=true"]);
    let [scaled] = of_kind(&docs, "ScaledObject")[..] else {
        panic!("one ScaledObject by default");
    };
    assert!(
        scaled["spec"]["triggers"][0]
            .get("authenticationRef")
            .is_none()
    );
    assert!(of_kind(&docs, "TriggerAuthentication").is_empty());
    assert_eq!(
        scaled["spec"]["triggers"][0]["metadata"]["bootstrapServers"],
        "kafka:9092"
    );
}

/// The `ENV` instructions of the Dockerfile's last stage (the image that runs), as name and
/// value, continuation lines joined.
fn image_env() -> Vec<(String, String)> {
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    let last_stage = dockerfile.rsplit("\nFROM ").next().unwrap();
    let joined = last_stage.replace("\\\n", " ");
    joined
        .lines()
        .filter_map(|line| line.trim().strip_prefix("ENV "))
        .flat_map(|pairs| pairs.split_whitespace())
        .map(|pair| {
            let (name, value) = pair.split_once('=').expect("ENV name=value");
            (name.to_owned(), value.trim_matches('"').to_owned())
        })
        .collect()
}

/// The port of every `containerPort` named `name` in the manifests.
fn container_ports(manifests: &str, name: &str) -> Vec<u16> {
    let needle = format!("- name: {name}\n");
    manifests
        .match_indices(&needle)
        .filter_map(|(at, _)| {
            manifests[at + needle.len()..]
                .lines()
                .next()?
                .trim()
                .strip_prefix("containerPort: ")?
                .parse()
                .ok()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_changed_in_the_values_reaches_the_process_the_probes_ask() {
    // What the kubelet does: the chart's values give the container's ports, and the probes ask
    // them. The process must listen where they ask, whatever the image sets.
    let (metrics, api) = (free_port(), free_port());
    let out = render(
        &[],
        &[
            "mode=serve",
            &format!("settings.observability.listen=127.0.0.1:{metrics}"),
            &format!("settings.api.listen=127.0.0.1:{api}"),
        ],
    );
    assert!(out.status.success(), "helm template: {}", text(&out));
    let manifests = String::from_utf8(out.stdout).unwrap();
    assert_eq!(container_ports(&manifests, "metrics"), vec![metrics]);
    assert_eq!(container_ports(&manifests, "http"), vec![api]);
    let file = scratch().join("replyd.toml");
    std::fs::write(&file, config_of(&manifests)).unwrap();

    // The process as the pod starts it: the image's environment, then the container's, where
    // REPLYD_CONFIG names the mounted ConfigMap (here, the file it renders) and the secrets
    // and this machine's broker come as variables.
    let db = crate::helpers::TestDb::new().await;
    let mut serve = tokio::process::Command::new(env!("CARGO_BIN_EXE_replyd"));
    serve
        .arg("serve")
        .envs(image_env())
        .env("REPLYD_CONFIG", &file)
        .env("REPLYD_DATABASE__URL", db.settings.url.expose())
        .env("REPLYD_KAFKA__BOOTSTRAP_SERVERS", infra("KAFKA_BOOTSTRAP"))
        .env("REPLYD_KAFKA__TOPIC", unique("tasks"))
        .env("REPLYD_KAFKA__GROUP_ID", unique("group"))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
    let mut child = serve.spawn().unwrap();
    let client = reqwest::Client::new();
    let answered = |port: u16, path: &'static str| {
        let client = client.clone();
        async move {
            client
                .get(format!("http://127.0.0.1:{port}{path}"))
                .timeout(std::time::Duration::from_secs(2))
                .send()
                .await
                .is_ok()
        }
    };
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !(answered(metrics, "/healthz").await && answered(api, "/v1/quota").await) {
        if let Some(status) = child.try_wait().unwrap() {
            let mut said = String::new();
            use tokio::io::AsyncReadExt as _;
            child
                .stderr
                .take()
                .unwrap()
                .read_to_string(&mut said)
                .await
                .unwrap();
            panic!("replyd serve exited ({status}) before answering on its ports: {said}");
        }
        assert!(
            std::time::Instant::now() < deadline,
            "nothing answered on the ports the values gave ({metrics}, {api})"
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
    child.kill().await.unwrap();
}

#[test]
fn every_file_the_image_copies_from_the_build_context_is_in_it() {
    // .dockerignore keeps deploy/ (and more) out of the build context; a COPY of a file under
    // it fails the build, which no engine here would show.
    let ignored: Vec<String> = std::fs::read_to_string(root().join(".dockerignore"))
        .unwrap()
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    let sources: Vec<&str> = dockerfile
        .lines()
        .filter_map(|l| l.trim().strip_prefix("COPY "))
        .filter(|args| !args.starts_with("--from"))
        .flat_map(|args| {
            let words: Vec<&str> = args.split_whitespace().collect();
            words[..words.len() - 1].to_vec()
        })
        .collect();
    assert!(
        sources.contains(&"deploy/image-defaults.toml"),
        "{sources:?}"
    );
    for source in sources {
        let excluded = ignored.iter().any(|rule| {
            !rule.starts_with('!') && (source == rule || source.starts_with(&format!("{rule}/")))
        });
        let excepted = ignored
            .iter()
            .any(|rule| rule.strip_prefix('!') == Some(source));
        assert!(
            !excluded || excepted,
            "the Dockerfile copies {source}, which .dockerignore keeps out of the context"
        );
        assert!(root().join(source).exists(), "{source} does not exist");
    }
}

#[test]
fn the_chart_the_image_and_the_binary_name_the_crate_s_version() {
    let manifest = std::fs::read_to_string(root().join("Cargo.toml")).unwrap();
    let version = manifest
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|rest| rest.strip_suffix('"'))
        .expect("the crate's version");
    let chart = std::fs::read_to_string(chart().join("Chart.yaml")).unwrap();
    assert!(
        chart.contains(&format!("appVersion: \"{version}\"")),
        "Chart.yaml's appVersion is the crate's {version}:\n{chart}"
    );
    let dockerfile = std::fs::read_to_string(root().join("deploy/Dockerfile")).unwrap();
    assert!(
        dockerfile.contains(&format!("ARG VERSION={version}\n")),
        "the Dockerfile's default VERSION is the crate's {version}"
    );
    let out = run(env!("CARGO_BIN_EXE_replyd"), &["--version"]);
    assert!(out.status.success(), "{}", text(&out));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.starts_with(&format!("replyd {version} (commit ")),
        "{said}"
    );
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

#[test]
fn on_sqs_nothing_of_kafka_is_rendered_and_keda_scales_the_workers_on_the_queue() {
    let sqs = "deploy/helm/replyd/ci/sqs-values.yaml";
    let path = root().join(sqs);
    let sqs = path.to_str().unwrap();
    // The topics are left alone whatever topics.manage says, and the workers are not bound by
    // a partition count.
    for manage in ["job", "strimzi"] {
        let docs = rendered(
            &[sqs],
            &[
                &format!("topics.manage={manage}"),
                "topics.strimzi.cluster=kafka",
                "worker.replicas=20",
                "partitions=6",
            ],
        );
        assert!(of_kind(&docs, "KafkaTopic").is_empty(), "{manage}");
        let jobs: Vec<&str> = of_kind(&docs, "Job")
            .iter()
            .map(|j| str_of(&j["metadata"]["name"]))
            .collect();
        assert_eq!(jobs, vec!["replyd-migrate"], "{manage}");
        let workers = object(&docs, "Deployment", "replyd-worker");
        assert_eq!(
            workers["spec"]["replicas"].as_u64(),
            None,
            "KEDA owns the replicas"
        );
    }
    let docs = rendered(&[sqs], &[]);
    let scaled = object(&docs, "ScaledObject", "replyd-worker");
    assert_eq!(scaled["spec"]["maxReplicaCount"].as_u64(), Some(12));
    let triggers = scaled["spec"]["triggers"].as_sequence().unwrap();
    assert_eq!(triggers.len(), 1);
    let trigger = &triggers[0];
    assert_eq!(str_of(&trigger["type"]), "aws-sqs-queue");
    assert_eq!(
        str_of(&trigger["metadata"]["queueURL"]),
        "https://sqs.eu-west-1.amazonaws.com/123456789012/reply-tasks"
    );
    assert_eq!(str_of(&trigger["metadata"]["queueLength"]), "200");
    assert_eq!(str_of(&trigger["metadata"]["awsRegion"]), "eu-west-1");
    let auth = object(
        &docs,
        "TriggerAuthentication",
        str_of(&trigger["authenticationRef"]["name"]),
    );
    assert_eq!(str_of(&auth["spec"]["podIdentity"]["provider"]), "aws");
    assert_eq!(
        str_of(&auth["spec"]["podIdentity"]["identityOwner"]),
        "workload"
    );
    // The region read from the queue's host when the settings name none; KEDA's own role.
    let docs = rendered(
        &[sqs],
        &[
            "settings.sqs.region=",
            "worker.autoscaling.keda.sqs.identityOwner=keda",
            "worker.autoscaling.keda.sqs.roleArn=arn:aws:iam::1:role/keda",
        ],
    );
    let scaled = object(&docs, "ScaledObject", "replyd-worker");
    assert_eq!(
        str_of(&scaled["spec"]["triggers"][0]["metadata"]["awsRegion"]),
        "eu-west-1"
    );
    let auth = object(&docs, "TriggerAuthentication", "replyd-worker-sqs");
    assert_eq!(
        str_of(&auth["spec"]["podIdentity"]["roleArn"]),
        "arn:aws:iam::1:role/keda"
    );
    assert!(auth["spec"]["podIdentity"].get("identityOwner").is_none());
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
