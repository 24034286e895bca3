{{- /* The exporter container's environment and mounts: also the doctor init
container's, so that it checks what the exporter will see. */ -}}
{{- define "gpu-occupancy-exporter.exporterEnv" -}}
- name: NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
# The node's writer Lease: its namespace, and the holder's name (one writer
# per node, docs/kubernetes-events.md).
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
# The NVIDIA runtime injects every GPU's device node and libnvidia-ml
# ("utility": NVML only, no CUDA) without allocating any nvidia.com/gpu.
- name: NVIDIA_VISIBLE_DEVICES
  value: {{ .Values.nvidia.visibleDevices | quote }}
- name: NVIDIA_DRIVER_CAPABILITIES
  value: {{ .Values.nvidia.driverCapabilities | quote }}
{{- if include "gpu-occupancy-exporter.gkeDriver" . }}
# platform gke: libnvidia-ml from the host's driver directory (mounted below).
- name: LD_LIBRARY_PATH
  value: {{ printf "%s/lib64" .Values.gke.driverMountPath | quote }}
{{- end }}
{{- if .Values.migMonitoring.enabled }}
# The toolkit mounts the MIG monitor capability (GPU-level MIG aggregates);
# it demands CAP_SYS_ADMIN for it (added above).
- name: NVIDIA_MIG_MONITOR_DEVICES
  value: "all"
{{- end }}
{{- with .Values.extraEnv }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end -}}

{{- define "gpu-occupancy-exporter.exporterMounts" -}}
{{- $root := include "gpu-occupancy-exporter.mountRoot" . -}}
{{- $tlsMount := dict "name" "tls" "mountPath" (printf "%s/tls" $root) "readOnly" true }}
- name: host-proc
  mountPath: {{ .Values.hostProc.mountPath }}
  readOnly: true
{{- if .Values.hostCgroup.enabled }}
- name: host-cgroup
  mountPath: {{ .Values.hostCgroup.mountPath }}
  readOnly: true
{{- end }}
- name: pod-resources
  mountPath: /var/lib/kubelet/pod-resources
  readOnly: true
{{- if include "gpu-occupancy-exporter.gkeDriver" . }}
- name: nvidia-driver
  mountPath: {{ .Values.gke.driverMountPath }}
  readOnly: true
{{- end }}
{{- if .Values.kmsg.enabled }}
- name: kmsg
  mountPath: /dev/kmsg
  readOnly: true
{{- end }}
- name: tmp
  mountPath: /tmp
{{- if include "gpu-occupancy-exporter.dcgmCopy" . }}
- name: dcgm
  mountPath: {{ include "gpu-occupancy-exporter.dcgmMount" . }}
  readOnly: true
{{- end }}
{{- if include "gpu-occupancy-exporter.webConfig.enabled" . }}
# The web config file (--web-config-file), re-read when it changes.
- name: web-config
  mountPath: {{ $root }}/web
  readOnly: true
{{- end }}
{{- if include "gpu-occupancy-exporter.exporterTls" . }}
# Whole Secrets, no subPath: a renewed certificate reaches the pod.
- {{ toYaml $tlsMount | nindent 2 | trim }}
{{- if .Values.tls.clientCASecretName }}
- name: client-ca
  mountPath: {{ $root }}/client-ca
  readOnly: true
{{- end }}
{{- end }}
{{- with .Values.extraVolumeMounts }}
{{- toYaml . | nindent 0 }}
{{- end }}
{{- end -}}
