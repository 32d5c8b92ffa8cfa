//! Helm's install order over the rendered manifests: every hook's pod finds what it uses,
//! the topics are made by a hook Job before the workers (or as Strimzi resources), and with
//! static membership the workers are a StatefulSet named by their pods.

use super::render::{
    KUBERNETES_VERSION, documents, object, of_kind, render, rendered, renderings, run, scratch,
    text,
};
use crate::helpers::infra;

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
