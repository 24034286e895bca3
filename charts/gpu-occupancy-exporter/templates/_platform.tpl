{{- /*
platform (docs/install.md, "Platforms"): what reaches NVML and what schedules the pod
differs between a GPU Operator cluster, GKE and a plain node with the NVIDIA container
toolkit. Each helper below resolves one setting: an explicit value wins, null (the
default in values.yaml) takes the platform's.

  operator  RuntimeClass nvidia (created by the Operator), the driver-upgrade eviction
            label nvidia.com/gpu.deploy.client (set by the Operator on its GPU nodes from
            v26.7.0: driverUpgradeEviction below).
  gke       no RuntimeClass and no NVIDIA runtime: GKE installs the driver under
            /home/kubernetes/bin/nvidia; the chart mounts it read-only at
            gke.driverMountPath, sets LD_LIBRARY_PATH to its lib64, and runs the
            container privileged so it may open /dev/nvidia* (no device plugin hands
            them to a pod that requests no GPU), as Google's own DCGM example does
            (GoogleCloudPlatform/prometheus-engine, examples/nvidia-dcgm/exporter.yaml).
            Nodes: also cloud.google.com/gke-accelerator. The priority-class
            ResourceQuota, which GKE requires for system-node-critical outside
            kube-system.
  plain     no RuntimeClass (the node's default runtime is nvidia: `nvidia-ctk runtime
            configure --set-as-default`), no eviction label.
*/ -}}
{{- define "gpu-occupancy-exporter.platform" -}}
{{- $p := .Values.platform -}}
{{- if eq (toString $p) "gke-autopilot" -}}
{{- fail "platform gke-autopilot: GKE Autopilot admits no privileged, hostPath or hostPID pods, and the exporter needs all three (the host's /proc and PodResources socket, /dev/nvidia*); run it on a GKE Standard GPU node pool (platform: gke), or use GKE's managed DCGM metrics on Autopilot (docs/install.md, \"GKE Autopilot\")" -}}
{{- end -}}
{{- if not (has $p (list "operator" "gke" "plain")) -}}
{{- fail (printf "platform %q is not one of operator, gke, plain (docs/install.md, \"Platforms\")" (toString $p)) -}}
{{- end -}}
{{- $p -}}
{{- end -}}

{{- /* The RuntimeClass name, empty for none. */ -}}
{{- define "gpu-occupancy-exporter.runtimeClassName" -}}
{{- $set := .Values.nvidia.runtimeClassName -}}
{{- if kindIs "invalid" $set -}}
{{- if eq (include "gpu-occupancy-exporter.platform" .) "operator" }}nvidia{{ end -}}
{{- else -}}
{{- $set -}}
{{- end -}}
{{- end -}}

{{- /* How the pod leaves a node whose driver is being upgraded (empty: it does not):
  selector  nodeSelector {nodeLabel: "true"}: k8s-driver-manager v0.12.0+ (GPU Operator
            v26.7.0+) pauses the label and waits for such DaemonSet pods to leave; only
            there does the Operator set the label at all (state_manager.go).
  affinity  a required node-affinity expression nodeLabel NotIn [paused-for-driver-upgrade]:
            schedules on nodes without the label (older Operators) and leaves a node
            whose label is paused, without the driver manager waiting for it.
  enabled: true picks selector, false nothing; null on platform operator picks selector
  when gpuOperator.version is 26.7.0 or later, or, with no version, when the cluster
  (Helm lookup, at install) has a node with the label; else affinity, which `helm
  template` (no cluster) renders. */ -}}
{{- define "gpu-occupancy-exporter.driverUpgradeEviction" -}}
{{- $set := .Values.driverUpgradeEviction.enabled -}}
{{- if kindIs "invalid" $set -}}
{{- if eq (include "gpu-occupancy-exporter.platform" .) "operator" -}}
{{- $version := toString (default "" .Values.gpuOperator.version) -}}
{{- if $version -}}
{{- if semverCompare ">=26.7.0-0" $version }}selector{{ else }}affinity{{ end -}}
{{- else -}}
{{- $labelled := false -}}
{{- $nodes := lookup "v1" "Node" "" "" -}}
{{- range $node := (default list (get (default dict $nodes) "items")) -}}
{{- if hasKey (default dict $node.metadata.labels) $.Values.driverUpgradeEviction.nodeLabel -}}
{{- $labelled = true -}}
{{- end -}}
{{- end -}}
{{- if $labelled }}selector{{ else }}affinity{{ end -}}
{{- end -}}
{{- end -}}
{{- else if $set -}}
selector
{{- end -}}
{{- end -}}

{{- /* "true" when the priority-class ResourceQuota is rendered. */ -}}
{{- define "gpu-occupancy-exporter.priorityClassQuota" -}}
{{- $set := .Values.priorityClassQuota.enabled -}}
{{- if kindIs "invalid" $set -}}
{{- if and (eq (include "gpu-occupancy-exporter.platform" .) "gke") .Values.priorityClassName (ne .Release.Namespace "kube-system") }}true{{ end -}}
{{- else if $set -}}
true
{{- end -}}
{{- end -}}

{{- /* "true" on GKE: the host's driver directory, LD_LIBRARY_PATH, a privileged container. */ -}}
{{- define "gpu-occupancy-exporter.gkeDriver" -}}
{{- if eq (include "gpu-occupancy-exporter.platform" .) "gke" }}true{{ end -}}
{{- end -}}

{{- /* gpuNodeSelectorTerms, plus GKE's accelerator label on GKE. */ -}}
{{- define "gpu-occupancy-exporter.nodeSelectorTerms" -}}
{{- $terms := default list .Values.gpuNodeSelectorTerms -}}
{{- if and $terms (include "gpu-occupancy-exporter.gkeDriver" .) -}}
{{- $gke := dict "matchExpressions" (list (dict "key" "cloud.google.com/gke-accelerator" "operator" "Exists")) -}}
{{- $terms = append $terms $gke -}}
{{- end -}}
{{- if eq (include "gpu-occupancy-exporter.driverUpgradeEviction" .) "affinity" -}}
{{- $paused := dict "key" .Values.driverUpgradeEviction.nodeLabel "operator" "NotIn" "values" (list "paused-for-driver-upgrade") -}}
{{- $each := list -}}
{{- range $term := $terms -}}
{{- $expressions := append (default list $term.matchExpressions) $paused -}}
{{- $each = append $each (merge (dict "matchExpressions" $expressions) (omit $term "matchExpressions")) -}}
{{- end -}}
{{- $terms = $each -}}
{{- end -}}
{{- toJson $terms -}}
{{- end -}}
