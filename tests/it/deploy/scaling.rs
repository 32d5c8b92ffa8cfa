//! Scaling the workers: prometheus-adapter's lag for the chart's HPA counts each partition of
//! the installation once (promtool), KEDA's Kafka trigger reads the settings' brokers, group
//! and topic with the chart's Secrets, and on SQS nothing of Kafka is rendered and KEDA scales
//! on the queue.

use super::labels::target_labels;
use super::render::{
    ADAPTER, PRODUCTION, object, of_kind, rendered, root, run, scratch, str_of, text,
};
use crate::helpers::infra;

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
