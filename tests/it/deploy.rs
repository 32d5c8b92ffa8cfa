//! What a platform team applies, checked with real tools on this machine (no Kubernetes
//! cluster and no container engine run here): the Helm chart lints, renders for default,
//! `serve` and every example values file, and its manifests validate against the Kubernetes
//! schemas offline (kubernetes-validate, strict); the settings it renders pass `replyd config
//! check`; its contradictions are refused by name; the labels monitoring and the lag HPA
//! select by are ones its ServiceMonitor attaches, prometheus-adapter's query for the HPA
//! counts each partition of the installation once (promtool), and KEDA's Kafka trigger reads
//! the settings' brokers, group and topic with the chart's Secrets; the chart's manifests and
//! the Dockerfile pass checkov, and the Dockerfile hadolint.
//!
//! The rooms: [`render`] (running helm and the tools, and reading what the chart renders,
//! shared by all), [`labels`] (the labels the ServiceMonitor attaches, as Prometheus names
//! them), [`chart`] (lint, schemas, settings, contradictions, the values' schema, the API's
//! reach and spread, checkov), [`install_order`] (Helm's install order and the topics' hooks),
//! [`monitoring`] (what the dashboard, the alerts and the PrometheusRule select and carry),
//! [`scaling`] (the lag HPA through prometheus-adapter, KEDA on Kafka and on SQS) and
//! [`image`] (the Dockerfile, its build context, its version and its ports).

mod chart;
mod image;
mod install_order;
mod labels;
mod monitoring;
mod render;
mod scaling;
