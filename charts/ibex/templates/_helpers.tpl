{{/* Names ---------------------------------------------------------------------------------------------------- */}}
{{- define "ibex.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ibex.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "ibex.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "ibex.labels" -}}
helm.sh/chart: {{ include "ibex.chart" . }}
app.kubernetes.io/name: {{ include "ibex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: ibex
{{- end }}

{{- define "ibex.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ibex.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "ibex.operator.name" -}}{{ include "ibex.fullname" . }}-operator{{- end }}
{{- define "ibex.dataplane.name" -}}{{ include "ibex.fullname" . }}-dataplane{{- end }}

{{- define "ibex.operator.serviceAccountName" -}}
{{- if .Values.operator.serviceAccount.create }}
{{- default (include "ibex.operator.name" .) .Values.operator.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.operator.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ibex.dataplane.serviceAccountName" -}}
{{- if .Values.dataPlane.serviceAccount.create }}
{{- default (include "ibex.dataplane.name" .) .Values.dataPlane.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.dataPlane.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "ibex.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end }}

{{/* Secrets ---------------------------------------------------------------------------------------------------- */}}
{{- define "ibex.storesSecretName" -}}{{ include "ibex.fullname" . }}-stores{{- end }}
{{- define "ibex.keysSecretName" -}}{{ include "ibex.fullname" . }}-keys{{- end }}

{{- define "ibex.postgresSecret" -}}{{ .Values.stores.postgres.existingSecret | default (include "ibex.storesSecretName" .) }}{{- end }}
{{- define "ibex.redisSecret" -}}{{ .Values.stores.redis.existingSecret | default (include "ibex.storesSecretName" .) }}{{- end }}
{{- define "ibex.clickhouseSecret" -}}{{ .Values.stores.clickhouse.existingSecret | default (include "ibex.storesSecretName" .) }}{{- end }}
{{- define "ibex.pepperSecret" -}}{{ .Values.secrets.keyPepper.existingSecret | default (include "ibex.keysSecretName" .) }}{{- end }}
{{- define "ibex.internalSecret" -}}{{ .Values.secrets.internalSecret.existingSecret | default (include "ibex.keysSecretName" .) }}{{- end }}

{{/* The providers file: a ConfigMap the chart renders from providers.config, or one you manage. */}}
{{- define "ibex.providersEnabled" -}}
{{- if or .Values.providers.config .Values.providers.existingConfigMap }}true{{- end }}
{{- end }}
{{- define "ibex.providersConfigMapName" -}}{{ .Values.providers.existingConfigMap | default (printf "%s-providers" (include "ibex.fullname" .)) }}{{- end }}
{{- define "ibex.providersDir" -}}/etc/ibex/providers{{- end }}

{{- define "ibex.env.providersFile" -}}
{{- if include "ibex.providersEnabled" . }}
- name: IBEX_PROVIDERS_FILE
  value: {{ printf "%s/%s" (include "ibex.providersDir" .) .Values.providers.configMapKey | quote }}
{{- end }}
{{- end }}

{{/* Provider API keys (proxy, and memory for fact extraction): each names an environment variable the providers file refers to with api_key_env. */}}
{{- define "ibex.env.providerKeys" -}}
{{- range $i, $key := .Values.providers.apiKeys }}
- name: {{ required (printf "providers.apiKeys[%d].env is required" $i) $key.env }}
  valueFrom:
    secretKeyRef:
      name: {{ required (printf "providers.apiKeys[%d].secretName is required" $i) $key.secretName }}
      key: {{ required (printf "providers.apiKeys[%d].secretKey is required" $i) $key.secretKey }}
{{- end }}
{{- end }}

{{/* The chart writes a stores Secret only for stores given by value. */}}
{{- define "ibex.needsStoresSecret" -}}
{{- if or (not .Values.stores.postgres.existingSecret) (not .Values.stores.redis.existingSecret) (not .Values.stores.clickhouse.existingSecret) }}true{{- end }}
{{- end }}

{{/* Environment ------------------------------------------------------------------------------------------------ */}}
{{/* Common to every IBEX container: data-plane stores, logging, a writable HOME, no model downloads. */}}
{{- define "ibex.env.common" -}}
- name: IBEX_POSTGRES_DSN
  valueFrom:
    secretKeyRef:
      name: {{ include "ibex.postgresSecret" . }}
      key: {{ .Values.stores.postgres.dsnKey }}
- name: IBEX_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "ibex.redisSecret" . }}
      key: {{ .Values.stores.redis.urlKey }}
- name: IBEX_CLICKHOUSE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "ibex.clickhouseSecret" . }}
      key: {{ .Values.stores.clickhouse.urlKey }}
- name: IBEX_LOG_LEVEL
  value: {{ .Values.logLevel | quote }}
- name: IBEX_LOG_JSON
  value: {{ .Values.logJson | quote }}
- name: HOME
  value: /tmp
- name: HF_HUB_OFFLINE
  value: "1"
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* ibex.env.common without the variables a container's own `env` sets (that one wins; duplicate names are
refused by server-side apply). Called with (dict "root" . "env" LIST). */}}
{{- define "ibex.env.commonExcept" -}}
{{- $names := list }}
{{- range .env }}{{- $names = append $names .name }}{{- end }}
{{- $kept := list }}
{{- range (include "ibex.env.common" .root | fromYamlArray) }}
{{- if not (has .name $names) }}{{- $kept = append $kept . }}{{- end }}
{{- end }}
{{- if $kept }}{{ toYaml $kept }}{{- end }}
{{- end }}

{{- define "ibex.env.pepper" -}}
- name: IBEX_KEY_PEPPER
  valueFrom:
    secretKeyRef:
      name: {{ include "ibex.pepperSecret" . }}
      key: {{ .Values.secrets.keyPepper.key }}
{{- end }}

{{- define "ibex.env.internal" -}}
- name: IBEX_INTERNAL_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ include "ibex.internalSecret" . }}
      key: {{ .Values.secrets.internalSecret.key }}
{{- end }}

{{/* Probes on /healthz (start-up and liveness) and /readyz (readiness) of one port. The startup probe gives a
process up to five minutes to load (the ONNX model, Presidio, a busy node) before liveness may restart it. */}}
{{- define "ibex.probes" -}}
startupProbe:
  httpGet: {path: /healthz, port: {{ . }}}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 60
livenessProbe:
  httpGet: {path: /healthz, port: {{ . }}}
  periodSeconds: 10
  timeoutSeconds: 3
  failureThreshold: 3
readinessProbe:
  httpGet: {path: /readyz, port: {{ . }}}
  periodSeconds: 5
  timeoutSeconds: 3
  failureThreshold: 2
{{- end }}

{{/* The operator's RBAC is cluster-wide only on the explicit opt-in operator.clusterWide=true. */}}
{{- define "ibex.operator.clusterwide" -}}
{{- if .Values.operator.clusterWide }}true{{- end }}
{{- end }}

{{/* The namespaces the operator watches, one per line: without clusterWide, watchNamespaces (plain names only) or
the release namespace; with clusterWide, watchNamespaces as given (names or globs; empty: every namespace). */}}
{{- define "ibex.operator.namespaces" -}}
{{- if .Values.operator.clusterWide }}
{{- range .Values.operator.watchNamespaces }}{{ . }}
{{ end }}
{{- else }}
{{- range .Values.operator.watchNamespaces }}
{{- if or (contains "*" .) (contains "?" .) (contains "!" .) (contains "," .) }}
{{- fail (printf "operator.watchNamespaces: %q is a glob; globs need the cluster-wide RBAC of operator.clusterWide=true" .) }}
{{- end }}
{{- end }}
{{- range (.Values.operator.watchNamespaces | default (list .Release.Namespace)) }}{{ . }}
{{ end }}
{{- end }}
{{- end }}

{{/* Fails the render when a secret the chart never generates is missing (see secrets.yaml). */}}
{{- define "ibex.requireSecret" -}}
{{- $v := index .root.Values.secrets .name }}
{{- if and (not $v.existingSecret) (not $v.value) }}
{{- fail (printf "secrets.%s: set existingSecret (a Secret you create, e.g. with `openssl rand -base64 48`) or value; the chart does not generate it, because a render-time random value changes on every `helm template` or Argo CD sync" .name) }}
{{- end }}
{{- if and $v.value (lt (len $v.value) 32) }}
{{- fail (printf "secrets.%s.value: at least 32 characters" .name) }}
{{- end }}
{{- end }}

{{/* RBAC rules for what the operator does to the resources it reconciles, wherever they live. */}}
{{- define "ibex.operator.tenantRules" }}
# the four kinds: watch them, add/remove the finalizer (patch), write status
- apiGroups: [ibex.dev]
  resources: [organizations, agents, directives, apikeys]
  verbs: [get, list, watch, patch, update]
- apiGroups: [ibex.dev]
  resources: [organizations/status, agents/status, directives/status, apikeys/status]
  verbs: [get, patch, update]
- apiGroups: [ibex.dev]
  resources: [organizations/finalizers, agents/finalizers, directives/finalizers, apikeys/finalizers]
  verbs: [update]
# ApiKey tokens: read back, create and replace the named Secret (never list, watch or delete: the garbage
# collector removes a token Secret with its ApiKey)
- apiGroups: [""]
  resources: [secrets]
  verbs: [get, create, update]
# Events for transitions and deletions
- apiGroups: ["", events.k8s.io]
  resources: [events]
  verbs: [create, patch]
{{- end }}
