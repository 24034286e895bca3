{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "gpu-occupancy-exporter.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart unless the release already contains it. */}}
{{- define "gpu-occupancy-exporter.fullname" -}}
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

{{- define "gpu-occupancy-exporter.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gpu-occupancy-exporter.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gpu-occupancy-exporter.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gpu-occupancy-exporter.labels" -}}
helm.sh/chart: {{ include "gpu-occupancy-exporter.chart" . }}
{{ include "gpu-occupancy-exporter.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: exporter
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* kubeApi as the flag spells it: an unquoted YAML `off` arrives as false. */}}
{{- define "gpu-occupancy-exporter.kubeApi" -}}
{{- if eq (toString .Values.kubeApi) "false" }}off{{ else }}{{ .Values.kubeApi }}{{ end }}
{{- end }}

{{/* The pod watch (and so the ServiceAccount token and RBAC) is on unless kubeApi is "off". */}}
{{- define "gpu-occupancy-exporter.podWatch" -}}
{{- if ne (include "gpu-occupancy-exporter.kubeApi" .) "off" }}true{{ end }}
{{- end }}

{{/* The pod needs a ServiceAccount token: for the pod watch, or for kube-rbac-proxy's
TokenReviews and SubjectAccessReviews. */}}
{{- define "gpu-occupancy-exporter.apiIdentity" -}}
{{- if or (include "gpu-occupancy-exporter.podWatch" .) .Values.kubeRbacProxy.enabled }}true{{ end }}
{{- end }}

{{- define "gpu-occupancy-exporter.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gpu-occupancy-exporter.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "gpu-occupancy-exporter.proxyImage" -}}
{{- $image := .Values.kubeRbacProxy.image }}
{{- if $image.digest }}
{{- printf "%s@%s" $image.repository $image.digest }}
{{- else }}
{{- printf "%s:%s" $image.repository $image.tag }}
{{- end }}
{{- end }}

{{- define "gpu-occupancy-exporter.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* Exporter flags from values; extraArgs come last so they win. */}}
{{- define "gpu-occupancy-exporter.args" -}}
{{- /* Behind kube-rbac-proxy: loopback only, the proxy owns the pod port. */}}
{{- $listen := printf ":%v" .Values.port }}
{{- if .Values.kubeRbacProxy.enabled }}{{ $listen = printf "127.0.0.1:%v" .Values.kubeRbacProxy.upstreamPort }}{{ end -}}
- {{ printf "--listen=%s" $listen | quote }}
{{- if include "gpu-occupancy-exporter.webConfig.enabled" . }}
- {{ printf "--web-config-file=%s" (include "gpu-occupancy-exporter.webConfig.path" .) | quote }}
{{- end }}
- {{ printf "--interval=%v" .Values.interval | quote }}
{{- with .Values.slowInterval }}
{{- if lt (float64 .) (float64 $.Values.interval) }}
{{- fail (printf "slowInterval %v is shorter than interval %v: the slow tier is read at most once per cycle; set slowInterval to %v or more, or leave it empty" . $.Values.interval $.Values.interval) }}
{{- end }}
- {{ printf "--slow-interval=%v" . | quote }}
{{- end }}
- {{ printf "--liveness-cycles=%v" .Values.livenessCycles | quote }}
- {{ printf "--pod-resources-interval=%v" .Values.podResourcesInterval | quote }}
- {{ printf "--proc-root=%s" .Values.hostProc.mountPath | quote }}
{{- if .Values.hostCgroup.enabled }}
- {{ printf "--cgroup-root=%s" .Values.hostCgroup.mountPath | quote }}
{{- else }}
- "--cgroup-root=off"
{{- end }}
- "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock"
- {{ printf "--kube-api=%s" (include "gpu-occupancy-exporter.kubeApi" .) | quote }}
{{- with .Values.resourceNames }}
- {{ printf "--resource-names=%s" (join "," .) | quote }}
{{- end }}
{{- if .Values.perProcessMetrics }}
- "--per-process-metrics"
{{- end }}
{{- with .Values.families.disable }}
- {{ printf "--families-disable=%s" (join "," .) | quote }}
{{- end }}
{{- with .Values.families.enable }}
- {{ printf "--families-enable=%s" (join "," .) | quote }}
{{- end }}
- {{ printf "--log-level=%s" .Values.logLevel | quote }}
- {{ printf "--log-format=%s" .Values.logFormat | quote }}
- {{ printf "--dcgm=%s" (include "gpu-occupancy-exporter.dcgmMode" .) | quote }}
{{- if include "gpu-occupancy-exporter.dcgmCopy" . }}
- {{ printf "--dcgm-bindings-path=%s/bindings" (include "gpu-occupancy-exporter.dcgmMount" .) | quote }}
- {{ printf "--dcgm-library-path=%s/lib" (include "gpu-occupancy-exporter.dcgmMount" .) | quote }}
{{- else }}
{{- with .Values.dcgm.bindingsPath }}
- {{ printf "--dcgm-bindings-path=%s" . | quote }}
{{- end }}
{{- end }}
{{- with .Values.dcgm.operatorNamespace }}
- {{ printf "--dcgm-operator-namespace=%s" . | quote }}
{{- end }}
{{- if .Values.kmsg.enabled }}
- "--kmsg"
- "--kmsg-path=/dev/kmsg"
{{- end }}
{{- if not .Values.kubeEvents.enabled }}
- "--kube-events=off"
{{- end }}
{{- if .Values.nodeCondition.enabled }}
- "--node-condition"
{{- end }}
{{- if .Values.draDeviceTaints.enabled }}
- "--dra-device-taints"
- {{ printf "--dra-device-taint-effect=%s" .Values.draDeviceTaints.effect | quote }}
{{- end }}
{{- if eq (toString .Values.kubeWrites.mode) "shadow" }}
{{- if .Values.kubeWrites.shadowKinds }}
- {{ printf "--kube-writes=shadow=%s" (join "," .Values.kubeWrites.shadowKinds) | quote }}
{{- else }}
- "--kube-writes=shadow"
{{- end }}
{{- end }}
{{- range .Values.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end }}
