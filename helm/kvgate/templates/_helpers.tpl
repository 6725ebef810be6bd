{{/* Chart name. */}}
{{- define "kvgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* Release-qualified name. */}}
{{- define "kvgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "kvgate.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "kvgate.selector" -}}
app.kubernetes.io/name: {{ include "kvgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "kvgate.image" -}}
{{ .Values.image.repository }}:{{ default .Chart.AppVersion .Values.image.tag }}
{{- end -}}

{{- define "kvgate.secretName" -}}
{{- default (printf "%s-secrets" (include "kvgate.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "kvgate.gatewayName" -}}{{ include "kvgate.fullname" . }}-gateway{{- end -}}
{{- define "kvgate.controlName" -}}{{ include "kvgate.fullname" . }}-control{{- end -}}
{{- define "kvgate.workerName" -}}{{ include "kvgate.fullname" . }}-worker{{- end -}}
{{- define "kvgate.redisName" -}}{{ include "kvgate.fullname" . }}-redis{{- end -}}

{{/* The control Service's in-cluster URL (workers report there). */}}
{{- define "kvgate.controlUrl" -}}
http://{{ include "kvgate.controlName" . }}.{{ .Release.Namespace }}.svc.cluster.local:{{ .Values.gateway.controlPort }}
{{- end -}}

{{/* The Redis URL, if any. */}}
{{- define "kvgate.redisUrl" -}}
{{- if eq .Values.redis.mode "external" -}}
{{ .Values.redis.url }}
{{- else -}}
redis://{{ include "kvgate.redisName" . }}.{{ .Release.Namespace }}.svc.cluster.local:6379
{{- end -}}
{{- end -}}

{{/* A float for TOML (always with a decimal point). */}}
{{- define "kvgate.float" -}}{{ printf "%.6f" (float64 .) }}{{- end -}}
