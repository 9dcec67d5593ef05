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

{{/*
The name of worker i's monitoring port (policyd serve --workers: worker i serves
/metrics on --monitoring-port + i): "monitoring", then "monitoring-1", ...
*/}}
{{- define "policyd.monitoringPortName" -}}
{{- if eq (int .) 0 }}monitoring{{ else }}monitoring-{{ . }}{{ end -}}
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

{{/*
The EnvoyFilter patch of the gateway's connection manager, in both modes: the
request timeouts, and the client's destination header and the headers of
envoyFilter.stripClientHeaders (less envoyFilter.trustedClientHeaders)
removed as the request arrives (docs/serving.md, "Trust model").
*/}}
{{- define "policyd.edgePatch" -}}
- applyTo: NETWORK_FILTER
  match:
    context: GATEWAY
    listener:
      filterChain:
        filter:
          name: envoy.filters.network.http_connection_manager
  patch:
    operation: MERGE
    value:
      name: envoy.filters.network.http_connection_manager
      typed_config:
        "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
        request_timeout: {{ .Values.envoyFilter.requestTimeout }}
        request_headers_timeout: {{ .Values.envoyFilter.requestHeadersTimeout }}
        early_header_mutation_extensions:
          - name: envoy.http.early_header_mutation.header_mutation
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.http.early_header_mutation.header_mutation.v3.HeaderMutation
              mutations:
                - remove: x-gateway-destination-endpoint
                - remove: {{ .Values.serve.prefillHeader | default "x-prefiller-host-port" }}
                {{- range .Values.envoyFilter.stripClientHeaders }}
                {{- if not (has . $.Values.envoyFilter.trustedClientHeaders) }}
                - remove: {{ . }}
                {{- end }}
                {{- end }}
{{- end -}}
