{{- define "policyd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "policyd.fullname" -}}
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

{{- define "policyd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "policyd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "policyd.labels" -}}
{{ include "policyd.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "policyd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "policyd.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "policyd.policyConfigMap" -}}
{{- default (printf "%s-policy" (include "policyd.fullname" .)) .Values.policy.existingConfigMap -}}
{{- end -}}

{{- define "policyd.host" -}}
{{- printf "%s.%s.svc.cluster.local" (include "policyd.fullname" .) .Release.Namespace -}}
{{- end -}}
