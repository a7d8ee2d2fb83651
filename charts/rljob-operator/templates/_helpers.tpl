{{/* Chart name, truncated to the 63 characters Kubernetes allows. */}}
{{- define "rljob-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-qualified name of the operator's objects. */}}
{{- define "rljob-operator.fullname" -}}
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

{{- define "rljob-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "rljob-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "rljob-operator.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "rljob-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "rljob-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "rljob-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "rljob-operator.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* Default image of a job role: `rljob-operator.roleImage (list . "trainer")`. */}}
{{- define "rljob-operator.roleImage" -}}
{{- $root := index . 0 }}
{{- $role := index . 1 }}
{{- $images := $root.Values.jobDefaults.images }}
{{- default (printf "%s/%s:%s" $images.registry $role $root.Chart.AppVersion) (get $images $role) }}
{{- end }}

{{/*
RBAC rules: exactly the API calls declared in rljob/operator/rbac.py (tests/operator/test_chart.py
checks it). Each block below is plain YAML with no template actions inside.
*/}}
{{- define "rljob-operator.rules.namespaced" -}}
- apiGroups: ["rljob.io"]
  resources: ["rljobs"]
  verbs: ["list", "watch", "delete"]
- apiGroups: ["rljob.io"]
  resources: ["rljobs/status"]
  verbs: ["patch"]
- apiGroups: ["rljob.io"]
  resources: ["rljobs/scale"]
  verbs: ["patch"]
- apiGroups: ["rljob.io"]
  resources: ["rljobs/finalizers"]
  verbs: ["update"]
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete"]
- apiGroups: [""]
  resources: ["services"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["get", "create", "patch"]
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create"]
- apiGroups: [""]
  resources: ["resourcequotas"]
  verbs: ["list", "watch"]
- apiGroups: [""]
  resources: ["limitranges"]
  verbs: ["list"]
- apiGroups: [""]
  resources: ["persistentvolumeclaims"]
  verbs: ["get", "create"]
- apiGroups: ["scheduling.volcano.sh"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["scheduling.x-k8s.io"]
  resources: ["podgroups"]
  verbs: ["get", "create", "patch"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "create", "patch", "delete"]
{{- end }}

{{- define "rljob-operator.rules.cluster" -}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
- apiGroups: ["storage.k8s.io"]
  resources: ["storageclasses"]
  verbs: ["list"]
{{- end }}

{{- define "rljob-operator.rules.peering.cluster" -}}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{- define "rljob-operator.rules.peering.namespaced" -}}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["get", "list", "watch", "patch"]
{{- end }}

{{/* Labels of the ServiceMonitor, PodMonitor and PrometheusRule: the chart's, plus monitoring.labels. */}}
{{- define "rljob-operator.monitoringLabels" -}}
{{ include "rljob-operator.labels" . }}
{{- with .Values.monitoring.labels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
A reference to an alert's label in Prometheus's own template language ($labels.NAME between double braces),
written out by printf so that Helm does not read it: `include "rljob-operator.alertLabel" "rljob"`.
*/}}
{{- define "rljob-operator.alertLabel" -}}
{{- printf "{{ $labels.%s }}" . }}
{{- end }}
