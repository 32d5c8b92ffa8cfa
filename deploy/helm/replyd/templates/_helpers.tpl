{{/* Names and labels. */}}
{{- define "replyd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "replyd.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "replyd.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "replyd.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{- define "replyd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ .Values.serviceAccount.name | default (include "replyd.fullname" .) }}
{{- else -}}
{{ .Values.serviceAccount.name | default "default" }}
{{- end -}}
{{- end -}}

{{/* The port of a `host:port` listen setting. */}}
{{- define "replyd.port" -}}
{{- splitList ":" . | last -}}
{{- end -}}

{{- define "replyd.metricsPort" -}}
{{- include "replyd.port" (.Values.settings.observability.listen | default "0.0.0.0:9464") -}}
{{- end -}}

{{- define "replyd.apiPort" -}}
{{- include "replyd.port" (.Values.settings.api.listen | default "0.0.0.0:8080") -}}
{{- end -}}

{{/* The components this release runs: the three parts, or `serve`. */}}
{{- define "replyd.components" -}}
{{- if eq .Values.mode "serve" -}}serve{{- else -}}worker api relay{{- end -}}
{{- end -}}

{{/*
Contradictions refused at render time, with the value's name: the same rules replyd applies
to itself at start, where a pod would otherwise crash-loop.
*/}}
{{- define "replyd.validate" -}}
{{- if not (has .Values.mode (list "split" "serve")) -}}
{{- fail (printf "mode: %q is neither \"split\" nor \"serve\"" .Values.mode) -}}
{{- end -}}
{{- if not (has .Values.topics.manage (list "job" "strimzi" "none")) -}}
{{- fail (printf "topics.manage: %q is not one of job, strimzi, none" .Values.topics.manage) -}}
{{- end -}}
{{- if and (eq .Values.topics.manage "strimzi") (not .Values.topics.strimzi.cluster) -}}
{{- fail "topics.strimzi.cluster: the Strimzi Kafka cluster's name is required with topics.manage: strimzi (it is the KafkaTopic's strimzi.io/cluster label)" -}}
{{- end -}}
{{- if not .Values.secrets.databaseUrl.name -}}
{{- fail "secrets.databaseUrl.name: the Secret holding database.url is required" -}}
{{- end -}}
{{- $drain := int ((.Values.settings.worker | default dict).drain_timeout_ms | default 10000) -}}
{{- range $component := list "worker" "serve" -}}
{{- $grace := int (index $.Values $component).terminationGracePeriodSeconds -}}
{{- if le (mul $grace 1000) $drain -}}
{{- fail (printf "%s.terminationGracePeriodSeconds: %d s must be above settings.worker.drain_timeout_ms (%d ms), or a rolling restart kills records mid-drain" $component $grace $drain) -}}
{{- end -}}
{{- end -}}
{{- $onSqs := eq (include "replyd.source" .) "sqs" -}}
{{- if $onSqs -}}
{{- $sqs := .Values.settings.sqs | default dict -}}
{{- if not $sqs.queue_url -}}
{{- fail "settings.sqs.queue_url: the workers receive from SQS (settings.worker.source \"sqs\"), so the queue's URL is required" -}}
{{- end -}}
{{- else if gt (int .Values.worker.replicas) (int .Values.partitions) -}}
{{- fail (printf "worker.replicas: %d is above partitions (%d): the extra workers would own no partition" (int .Values.worker.replicas) (int .Values.partitions)) -}}
{{- end -}}
{{- with .Values.worker.autoscaling -}}
{{- if .enabled -}}
{{- if and (not $onSqs) (gt (int .maxReplicas) (int $.Values.partitions)) -}}
{{- fail (printf "worker.autoscaling.maxReplicas: %d is above partitions (%d)" (int .maxReplicas) (int $.Values.partitions)) -}}
{{- end -}}
{{- if and $onSqs (eq .source "prometheus-adapter") -}}
{{- fail "worker.autoscaling.source: prometheus-adapter scales on the workers' Kafka lag; on SQS (settings.worker.source \"sqs\") use keda, whose aws-sqs-queue scaler reads the queue" -}}
{{- end -}}
{{- if not (has .source (list "keda" "prometheus-adapter")) -}}
{{- fail (printf "worker.autoscaling.source: %q is neither \"keda\" nor \"prometheus-adapter\"" .source) -}}
{{- end -}}
{{- if not (regexMatch "^[1-9][0-9]*$" (toString .targetLagPerReplica)) -}}
{{- fail (printf "worker.autoscaling.targetLagPerReplica: %q is not a whole number of records above 0" (toString .targetLagPerReplica)) -}}
{{- end -}}
{{- if and (eq .source "keda") $onSqs -}}
{{- if not (has .keda.sqs.identityOwner (list "workload" "keda")) -}}
{{- fail (printf "worker.autoscaling.keda.sqs.identityOwner: %q is neither \"workload\" (the workers' ServiceAccount's role) nor \"keda\" (KEDA's own, or keda.sqs.roleArn)" .keda.sqs.identityOwner) -}}
{{- end -}}
{{- $sqs := $.Values.settings.sqs | default dict -}}
{{- if not ($sqs.region | default (regexFind "sqs\\.[a-z0-9-]+\\." ($sqs.queue_url | default ""))) -}}
{{- fail "settings.sqs.region: KEDA's aws-sqs-queue scaler needs the queue's region, and settings.sqs.queue_url's host names none" -}}
{{- end -}}
{{- if and .keda.sqs.roleArn (eq .keda.sqs.identityOwner "workload") -}}
{{- fail "worker.autoscaling.keda.sqs.roleArn: KEDA assumes this role itself; set identityOwner to \"keda\" with it (KEDA takes one or the other)" -}}
{{- end -}}
{{- else if eq .source "keda" -}}
{{- $security := include "replyd.kafkaSecurity" $ | fromYaml -}}
{{- if and $security.sasl (not $.Values.secrets.kafkaSaslPassword.name) -}}
{{- fail "secrets.kafkaSaslPassword.name: settings.kafka.security uses SASL, and KEDA's Kafka scaler reads the password from this Secret" -}}
{{- end -}}
{{- if and $security.tls $security.caFile (not .keda.caSecret.name) -}}
{{- fail (printf "worker.autoscaling.keda.caSecret.name: settings.kafka.security.ca_file (%s) is a file in replyd's pods; KEDA's Kafka scaler reads the CA from a Secret: name it here" $security.caFile) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $traces := .Values.traces.endpoint | default "" -}}
{{- if and $traces (not (regexMatch "^https?://[^/:]+" $traces)) -}}
{{- fail (printf "traces.endpoint: %q is not http(s)://host[:port]; replyd exports OTLP over HTTP (the collector's port 4318)" $traces) -}}
{{- end -}}
{{- end -}}

{{/*
What settings.kafka.security asks of a Kafka client, as KEDA's Kafka scaler names it (YAML, read
back with fromYaml): `sasl` (plaintext, scram_sha256, scram_sha512; empty without SASL), `tls`
(true or false), `caFile` and `username`. replyd's defaults where a setting is absent:
plaintext, and SCRAM-SHA-512 once SASL is on.
*/}}
{{- define "replyd.kafkaSecurity" -}}
{{- $security := (.Values.settings.kafka | default dict).security | default dict -}}
{{- $protocol := $security.protocol | default "plaintext" -}}
{{- $mechanisms := dict "SCRAM-SHA-512" "scram_sha512" "SCRAM-SHA-256" "scram_sha256" "PLAIN" "plaintext" -}}
{{- $mechanism := $security.sasl_mechanism | default "SCRAM-SHA-512" -}}
{{- if not (hasKey $mechanisms $mechanism) -}}
{{- fail (printf "settings.kafka.security.sasl_mechanism: %q is none of SCRAM-SHA-512, SCRAM-SHA-256, PLAIN" $mechanism) -}}
{{- end }}
sasl: {{ if has $protocol (list "sasl_plaintext" "sasl_ssl") }}{{ index $mechanisms $mechanism }}{{ end }}
tls: {{ has $protocol (list "ssl" "sasl_ssl") }}
caFile: {{ $security.ca_file | default "" | quote }}
username: {{ $security.sasl_username | default "" | quote }}
{{- end -}}

{{/* How the worker's replicas scale down: every step is a rebalance, so add quickly and
remove slowly. The HPA's `behavior`, and KEDA's for the HPA it makes. */}}
{{- define "replyd.scalingBehavior" -}}
scaleDown:
  stabilizationWindowSeconds: 600
  policies:
    - type: Pods
      value: 1
      periodSeconds: 120
{{- end -}}

{{/* The environment of every replyd container: settings file, secrets, traces, extras. */}}
{{- define "replyd.env" -}}
- name: REPLYD_CONFIG
  value: /etc/replyd/config/replyd.toml
- name: REPLYD_LOG_JSON
  value: "true"
- name: REPLYD_DATABASE__URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secrets.databaseUrl.name }}
      key: {{ .Values.secrets.databaseUrl.key }}
{{- if .Values.migrations.enabled }}
# The migration Job applies the schema before the pods roll; they only check it.
- name: REPLYD_DATABASE__MIGRATE_ON_START
  value: "false"
{{- end }}
{{- if .Values.secrets.providerApiKey.name }}
- name: REPLYD_PROVIDER__API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secrets.providerApiKey.name }}
      key: {{ .Values.secrets.providerApiKey.key }}
{{- end }}
{{- if .Values.secrets.erasureLogUrl.name }}
- name: REPLYD_DATABASE__ERASURE_LOG_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secrets.erasureLogUrl.name }}
      key: {{ .Values.secrets.erasureLogUrl.key }}
{{- end }}
{{- if .Values.secrets.endUserTokenKey.name }}
- name: REPLYD_API__END_USER_TOKEN_KEY
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secrets.endUserTokenKey.name }}
      key: {{ .Values.secrets.endUserTokenKey.key }}
{{- end }}
{{- if .Values.secrets.kafkaSaslPassword.name }}
- name: REPLYD_KAFKA__SECURITY__SASL_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .Values.secrets.kafkaSaslPassword.name }}
      key: {{ .Values.secrets.kafkaSaslPassword.key }}
{{- end }}
{{- with .Values.traces }}
{{- if .endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ .endpoint | quote }}
{{- end }}
{{- if .sampler }}
- name: OTEL_TRACES_SAMPLER
  value: {{ .sampler | quote }}
{{- end }}
{{- if .samplerArg }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ .samplerArg | quote }}
{{- end }}
{{- if .resourceAttributes }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ .resourceAttributes | quote }}
{{- end }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "replyd.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end -}}

{{- define "replyd.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
runAsUser: 10001
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/*
`settings` as TOML. Helm's own toToml writes every YAML number as a float (`lease_ms =
30000.0`), which replyd refuses for its integer settings; this writes whole numbers as
integers. Keys are quoted, so librdkafka properties (`"fetch.max.bytes"`) stay one key.
*/}}
{{- define "replyd.tomlValue" -}}
{{- if kindIs "float64" . -}}
{{- if eq . (float64 (int64 .)) -}}{{ int64 . }}{{- else -}}{{ . }}{{- end -}}
{{- else if or (kindIs "int" .) (kindIs "int64" .) -}}{{ . }}
{{- else if kindIs "bool" . -}}{{ . }}
{{- else if kindIs "string" . -}}{{ toJson . }}
{{- else if kindIs "slice" . -}}[{{- range $i, $v := . }}{{ if $i }}, {{ end }}{{ include "replyd.tomlValue" $v }}{{ end -}}]
{{- else -}}{{ fail (printf "settings: %v is not a TOML value" .) }}
{{- end -}}
{{- end -}}

{{- define "replyd.tomlTable" -}}
{{- $path := .path -}}
{{- range $key, $value := .table }}
{{- if and (not (kindIs "map" $value)) (not (kindIs "invalid" $value)) }}
{{ toJson $key }} = {{ include "replyd.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $key, $value := .table }}
{{- if kindIs "map" $value }}
{{- $here := ternary (toJson $key) (printf "%s.%s" $path (toJson $key)) (eq $path "") }}

[{{ $here }}]
{{- include "replyd.tomlTable" (dict "table" $value "path" $here) }}
{{- end }}
{{- end }}
{{- end -}}

{{/* Where the workers receive tasks from: "kafka" (the default) or "sqs" (settings.worker.source). */}}
{{- define "replyd.source" -}}
{{- (.Values.settings.worker | default dict).source | default "kafka" -}}
{{- end -}}

{{/* Whether any part uses Kafka: the workers' source or the relay's sink (settings.relay.sink). */}}
{{- define "replyd.usesKafka" -}}
{{- $sink := (.Values.settings.relay | default dict).sink | default "kafka" -}}
{{- if or (eq (include "replyd.source" .) "kafka") (eq $sink "kafka") -}}true{{- end -}}
{{- end -}}
