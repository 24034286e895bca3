{{- /*
Securing /metrics: the exporter's web config file (--web-config-file, the Prometheus
exporter-toolkit format, docs/security.md), the kube-rbac-proxy sidecar, the probes and
the monitors' scrape settings that must match them, and the checks that refuse settings
which cannot work together.
*/ -}}

{{/* Where the Secrets are mounted in the pod. */}}
{{- define "gpu-occupancy-exporter.mountRoot" -}}
/etc/gpu-occupancy-exporter
{{- end }}

{{/* The kube-rbac-proxy sidecar serves the metrics port. */}}
{{- define "gpu-occupancy-exporter.proxy" -}}
{{- if .Values.kubeRbacProxy.enabled }}true{{ end }}
{{- end }}

{{/* The exporter itself terminates TLS (not the proxy). */}}
{{- define "gpu-occupancy-exporter.exporterTls" -}}
{{- if and .Values.tls.enabled (not .Values.kubeRbacProxy.enabled) }}true{{ end }}
{{- end }}

{{/* The exporter demands a client certificate: the kubelet's probes have none. */}}
{{- define "gpu-occupancy-exporter.clientCertsRequired" -}}
{{- if and (include "gpu-occupancy-exporter.exporterTls" .) (eq .Values.tls.clientAuthType "RequireAndVerifyClientCert") }}true{{ end }}
{{- end }}

{{/* The exporter gets --web-config-file. */}}
{{- define "gpu-occupancy-exporter.webConfig.enabled" -}}
{{- if or (include "gpu-occupancy-exporter.exporterTls" .) .Values.basicAuth.users .Values.webConfig.headers .Values.webConfig.existingSecret }}true{{ end }}
{{- end }}

{{- define "gpu-occupancy-exporter.webConfig.secretName" -}}
{{- default (printf "%s-web-config" (include "gpu-occupancy-exporter.fullname" .)) .Values.webConfig.existingSecret }}
{{- end }}

{{- define "gpu-occupancy-exporter.webConfig.key" -}}
{{- if .Values.webConfig.existingSecret }}{{ .Values.webConfig.existingSecretKey }}{{ else }}web-config.yml{{ end }}
{{- end }}

{{- define "gpu-occupancy-exporter.webConfig.path" -}}
{{- printf "%s/web/%s" (include "gpu-occupancy-exporter.mountRoot" .) (include "gpu-occupancy-exporter.webConfig.key" .) }}
{{- end }}

{{/* The web config file the chart writes (when no existingSecret is given). */}}
{{- define "gpu-occupancy-exporter.webConfig.body" -}}
{{- $root := include "gpu-occupancy-exporter.mountRoot" . }}
{{- $config := dict }}
{{- if include "gpu-occupancy-exporter.exporterTls" . }}
{{- $tls := dict "cert_file" (printf "%s/tls/tls.crt" $root) "key_file" (printf "%s/tls/tls.key" $root) "min_version" .Values.tls.minVersion }}
{{- if ne .Values.tls.clientAuthType "NoClientCert" }}
{{- $_ := set $tls "client_auth_type" .Values.tls.clientAuthType }}
{{- $ca := printf "%s/tls/ca.crt" $root }}
{{- if .Values.tls.clientCASecretName }}{{ $ca = printf "%s/client-ca/ca.crt" $root }}{{ end }}
{{- $_ := set $tls "client_ca_file" $ca }}
{{- end }}
{{- with .Values.tls.clientAllowedSans }}
{{- $_ := set $tls "client_allowed_sans" . }}
{{- end }}
{{- $_ := set $config "tls_server_config" $tls }}
{{- end }}
{{- with .Values.webConfig.headers }}
{{- $_ := set $config "http_server_config" (dict "headers" .) }}
{{- end }}
{{- with .Values.basicAuth.users }}
{{- $_ := set $config "basic_auth_users" . }}
{{- end }}
{{- toYaml $config }}
{{- end }}

{{/* A probe as the pod needs it: HTTPS with TLS; a TCP check when client certificates
are required (the kubelet presents none); a port number behind the proxy (a named port
is looked up in the probed container, and the proxy's container owns "metrics").
Called with (dict "probe" PROBE "root" $). */}}
{{- define "gpu-occupancy-exporter.probe" -}}
{{- $v := .root.Values }}
{{- $probe := deepCopy .probe }}
{{- with $probe.httpGet }}
{{- if and $v.tls.enabled (not (hasKey . "scheme")) }}
{{- $_ := set . "scheme" "HTTPS" }}
{{- end }}
{{- if and $v.kubeRbacProxy.enabled (eq (toString .port) "metrics") }}
{{- $_ := set . "port" (int $v.port) }}
{{- end }}
{{- if include "gpu-occupancy-exporter.clientCertsRequired" $.root }}
{{- $_ := set $probe "tcpSocket" (dict "port" .port) }}
{{- $_ := unset $probe "httpGet" }}
{{- end }}
{{- end }}
{{- toYaml $probe }}
{{- end }}

{{/* Scheme, TLS and credentials of a ServiceMonitor endpoint or PodMonitor
podMetricsEndpoint, matching the pod. Called with (dict "monitor" VALUES "kind" KIND
"root" $). Field names: monitoring.coreos.com/v1 Endpoint / PodMetricsEndpoint
(docs/install.md cites them). */}}
{{- define "gpu-occupancy-exporter.monitorAuth" -}}
{{- $v := .root.Values }}
{{- $m := .monitor }}
{{- $out := dict }}
{{- if $v.tls.enabled }}
{{- $tls := dict "serverName" (printf "%s.%s.svc" (include "gpu-occupancy-exporter.fullname" .root) .root.Release.Namespace) }}
{{- with $v.tls.secretName }}
{{- $_ := set $tls "ca" (dict "secret" (dict "name" . "key" "ca.crt")) }}
{{- end }}
{{- range $key, $value := $m.tlsConfig }}
{{- $_ := set $tls $key $value }}
{{- end }}
{{- $_ := set $out "scheme" "https" }}
{{- $_ := set $out "tlsConfig" $tls }}
{{- end }}
{{- with $m.basicAuth.secretName }}
{{- $user := dict "name" . "key" $m.basicAuth.usernameKey }}
{{- $password := dict "name" . "key" $m.basicAuth.passwordKey }}
{{- $_ := set $out "basicAuth" (dict "username" $user "password" $password) }}
{{- end }}
{{- if $v.kubeRbacProxy.enabled }}
{{- if $m.bearerToken.secretName }}
{{- $credentials := dict "name" $m.bearerToken.secretName "key" $m.bearerToken.key }}
{{- $_ := set $out "authorization" (dict "type" "Bearer" "credentials" $credentials) }}
{{- else }}
{{- $_ := set $out "bearerTokenFile" "/var/run/secrets/kubernetes.io/serviceaccount/token" }}
{{- end }}
{{- end }}
{{- if $out }}
{{- toYaml $out }}
{{- end }}
{{- end }}

{{/* Settings that cannot work together fail the render with what to change. */}}
{{- define "gpu-occupancy-exporter.validateSecurity" -}}
{{- $v := .Values }}
{{- $proxy := $v.kubeRbacProxy.enabled }}
{{- if and $v.tls.enabled (not $v.tls.secretName) }}
{{- fail "tls.enabled needs tls.secretName: a kubernetes.io/tls Secret with tls.crt and tls.key (e.g. cert-manager's Certificate spec.secretName)" }}
{{- end }}
{{- if and $proxy (not $v.tls.enabled) }}
{{- fail "kubeRbacProxy.enabled needs tls.enabled and tls.secretName: the proxy serves the metrics port over TLS with that certificate (its self-signed fallback is deprecated upstream, and Prometheus could not verify it before sending its token)" }}
{{- end }}
{{- if and $proxy (or $v.basicAuth.users $v.webConfig.existingSecret) }}
{{- fail "kubeRbacProxy.enabled excludes basicAuth.users and webConfig.existingSecret: the proxy authorises scrapes by RBAC (a bearer token) and the exporter behind it listens on 127.0.0.1 only" }}
{{- end }}
{{- if and $proxy (or (ne $v.tls.clientAuthType "NoClientCert") $v.tls.clientCASecretName $v.tls.clientAllowedSans) }}
{{- fail "tls.clientAuthType, tls.clientCASecretName and tls.clientAllowedSans configure the exporter's TLS, not kube-rbac-proxy's: for client certificates there, pass --client-ca-file in kubeRbacProxy.extraArgs (a verified certificate's CommonName is then authorised by RBAC)" }}
{{- end }}
{{- if and $v.tls.clientAllowedSans (ne $v.tls.clientAuthType "RequireAndVerifyClientCert") }}
{{- fail "tls.clientAllowedSans needs tls.clientAuthType: RequireAndVerifyClientCert" }}
{{- end }}
{{- if and $v.tls.clientCASecretName (eq $v.tls.clientAuthType "NoClientCert") }}
{{- fail "tls.clientCASecretName verifies client certificates: set tls.clientAuthType to VerifyClientCertIfGiven or RequireAndVerifyClientCert" }}
{{- end }}
{{- if and $v.webConfig.existingSecret (or $v.basicAuth.users $v.webConfig.headers (ne $v.tls.clientAuthType "NoClientCert") $v.tls.clientCASecretName $v.tls.clientAllowedSans (ne $v.tls.minVersion "TLS12")) }}
{{- fail "webConfig.existingSecret holds the whole web config file: put basic_auth_users, http_server_config.headers and the tls_server_config client and version settings in that file, not in basicAuth.users, webConfig.headers or tls.client*/tls.minVersion" }}
{{- end }}
{{- range $kind, $m := dict "serviceMonitor" $v.serviceMonitor "podMonitor" $v.podMonitor }}
{{- if $m.enabled }}
{{- if and $m.tlsConfig (not $v.tls.enabled) }}
{{- fail (printf "%s.tlsConfig needs tls.enabled: without TLS the endpoint is scraped over http" $kind) }}
{{- end }}
{{- if and $v.basicAuth.users (not $m.basicAuth.secretName) }}
{{- fail (printf "basicAuth.users is set: Prometheus needs the password, or every scrape is 401: set %s.basicAuth.secretName (a Secret with the keys %s and %s)" $kind $m.basicAuth.usernameKey $m.basicAuth.passwordKey) }}
{{- end }}
{{- if and $m.basicAuth.secretName $proxy }}
{{- fail (printf "%s.basicAuth and kubeRbacProxy.enabled exclude each other: the proxy accepts bearer tokens (%s.bearerToken)" $kind $kind) }}
{{- end }}
{{- if and $m.bearerToken.secretName (not $proxy) }}
{{- fail (printf "%s.bearerToken is for kubeRbacProxy.enabled; the exporter itself takes basic auth (%s.basicAuth)" $kind $kind) }}
{{- end }}
{{- if and $proxy (eq $kind "podMonitor") (not $m.bearerToken.secretName) }}
{{- fail "podMonitor with kubeRbacProxy.enabled needs podMonitor.bearerToken.secretName (a Secret holding a ServiceAccount token allowed to get /metrics): a PodMonitor endpoint has no bearerTokenFile; or use the ServiceMonitor, which sends Prometheus' own token" }}
{{- end }}
{{- if and (include "gpu-occupancy-exporter.clientCertsRequired" $) (not (and $m.tlsConfig.cert $m.tlsConfig.keySecret)) }}
{{- fail (printf "tls.clientAuthType RequireAndVerifyClientCert: Prometheus must present a client certificate: set %s.tlsConfig.cert and %s.tlsConfig.keySecret" $kind $kind) }}
{{- end }}
{{- end }}
{{- end }}
{{- $gmp := $v.googleManagedPrometheus }}
{{- if and $gmp.podMonitoring.enabled $gmp.clusterPodMonitoring.enabled }}
{{- fail "googleManagedPrometheus: enable podMonitoring or clusterPodMonitoring, not both: both would scrape every pod twice under one job (clusterPodMonitoring keeps the series' namespace label)" }}
{{- end }}
{{- if or $gmp.podMonitoring.enabled $gmp.clusterPodMonitoring.enabled }}
{{- if $gmp.timeout }}
{{- $interval := include "gpu-occupancy-exporter.durationMs" $gmp.interval | int64 }}
{{- $timeout := include "gpu-occupancy-exporter.durationMs" $gmp.timeout | int64 }}
{{- if gt $timeout $interval }}
{{- fail (printf "googleManagedPrometheus.timeout %s is longer than its interval %s: GMP refuses it (timeout <= interval); shorten the timeout or leave it empty" $gmp.timeout $gmp.interval) }}
{{- end }}
{{- end }}
{{- if and $gmp.basicAuth.username $v.basicAuth.users (not (hasKey $v.basicAuth.users $gmp.basicAuth.username)) }}
{{- fail (printf "googleManagedPrometheus.basicAuth.username %q is not one of basicAuth.users: every scrape would be 401" $gmp.basicAuth.username) }}
{{- end }}
{{- if and $v.basicAuth.users (not $gmp.basicAuth.secretName) }}
{{- fail "basicAuth.users is set: Google Managed Prometheus needs the password, or every scrape is 401: set googleManagedPrometheus.basicAuth.username and .secretName (a Secret with the key passwordKey)" }}
{{- end }}
{{- if and $gmp.basicAuth.secretName (not $gmp.basicAuth.username) }}
{{- fail "googleManagedPrometheus.basicAuth.secretName needs googleManagedPrometheus.basicAuth.username (GMP takes the user name as plain text)" }}
{{- end }}
{{- if and $proxy (not $gmp.bearerToken.secretName) }}
{{- fail "googleManagedPrometheus with kubeRbacProxy.enabled needs googleManagedPrometheus.bearerToken.secretName (a Secret holding a ServiceAccount token allowed to get /metrics): GMP sends no token of its own" }}
{{- end }}
{{- if and $gmp.bearerToken.secretName (not $proxy) }}
{{- fail "googleManagedPrometheus.bearerToken is for kubeRbacProxy.enabled; the exporter itself takes basic auth (googleManagedPrometheus.basicAuth)" }}
{{- end }}
{{- if (include "gpu-occupancy-exporter.clientCertsRequired" $) }}
{{- fail "tls.clientAuthType RequireAndVerifyClientCert with googleManagedPrometheus: the chart does not give GMP a client certificate; use VerifyClientCertIfGiven or basic auth" }}
{{- end }}
{{- end }}
{{- if not (include "gpu-occupancy-exporter.podWatch" $) }}
{{- range $key, $on := dict "nodeCondition" $v.nodeCondition.enabled "draDeviceTaints" $v.draDeviceTaints.enabled }}
{{- if $on }}
{{- fail (printf "%s.enabled needs kubeApi: auto: the exporter writes it through the Kubernetes API, and kubeApi off gives the pod no API credentials" $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $v.priorityClassQuota.enabled (not $v.priorityClassName) }}
{{- fail "priorityClassQuota.enabled needs priorityClassName: the quota admits pods of that priority class" }}
{{- end }}
{{- end }}

{{/* Milliseconds in a Prometheus duration such as 1m30s (units ms, s, m, h, d, w). */}}
{{- define "gpu-occupancy-exporter.durationMs" -}}
{{- $ms := 0 }}
{{- $unit := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 "d" 86400000 "w" 604800000 }}
{{- range $part := regexFindAll "[0-9]+(ms|s|m|h|d|w)" . -1 }}
{{- $n := regexFind "^[0-9]+" $part | int64 }}
{{- $u := trimPrefix (toString $n) $part }}
{{- $ms = add $ms (mul $n (get $unit $u)) }}
{{- end }}
{{- $ms -}}
{{- end }}
