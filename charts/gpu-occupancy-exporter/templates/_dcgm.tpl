{{- /*
DCGM (docs/dcgm.md, "With the chart"). Occupancy on GPUs older than Hopper (no GPM)
comes only from DCGM's profiling fields, read from a DCGM host engine through DCGM's
Python bindings and libdcgm, which are on no package index and not in the exporter's
image. On platform operator the chart copies both out of NVIDIA's DCGM image (the image
the GPU Operator runs its nvidia-dcgm host engine from) with an init container, into an
emptyDir the exporter reads them from.
*/ -}}

{{- /* dcgm.mode as the flag spells it: set (false: off), or by platform: auto on
operator (the Operator's nvidia-dcgm Service, docs/dcgm.md), off elsewhere. */ -}}
{{- define "gpu-occupancy-exporter.dcgmMode" -}}
{{- $mode := toString .Values.dcgm.mode -}}
{{- if eq $mode "false" -}}
off
{{- else if and $mode (ne $mode "<nil>") -}}
{{- $mode -}}
{{- else if eq (include "gpu-occupancy-exporter.platform" .) "operator" -}}
auto
{{- else -}}
off
{{- end -}}
{{- end -}}

{{- /* "true" when the init container copies the bindings: DCGM on, no bindingsPath of
the user's own image, and bindingsImage.enabled. */ -}}
{{- define "gpu-occupancy-exporter.dcgmCopy" -}}
{{- if and (ne (include "gpu-occupancy-exporter.dcgmMode" .) "off") (not .Values.dcgm.bindingsPath) .Values.dcgm.bindingsImage.enabled -}}
true
{{- end -}}
{{- end -}}

{{- /* Where the exporter container sees the copy. */ -}}
{{- define "gpu-occupancy-exporter.dcgmMount" -}}
{{- printf "%s/dcgm" (include "gpu-occupancy-exporter.mountRoot" .) -}}
{{- end -}}

{{- /* The DCGM image's tag: as set, else the DCGM the GPU Operator of gpuOperator.version
runs (its deployments/gpu-operator/values.yaml, dcgm.version, at each release tag): a
client of the host engine's own major version. No version: the newest Operator's. */ -}}
{{- define "gpu-occupancy-exporter.dcgmImageTag" -}}
{{- $tag := .Values.dcgm.bindingsImage.tag -}}
{{- if $tag -}}
{{- $tag -}}
{{- else -}}
{{- $version := trimPrefix "v" (toString (default "" .Values.gpuOperator.version)) -}}
{{- $exact := dict
  "23.9.0" "3.2.6-1-ubuntu20.04" "23.9.1" "3.3.0-1-ubuntu22.04" "23.9.2" "3.3.0-1-ubuntu22.04"
  "24.3.0" "3.3.5-1-ubuntu22.04" "24.6.0" "3.3.7-1-ubuntu22.04" "24.6.1" "3.3.7-1-ubuntu22.04"
  "24.6.2" "3.3.7-1-ubuntu22.04" "24.9.0" "3.3.8-1-ubuntu22.04" "24.9.1" "3.3.9-1-ubuntu22.04"
  "24.9.2" "3.3.9-1-ubuntu22.04" "25.3.0" "4.1.1-2-ubuntu22.04" "25.3.1" "4.2.3-1-ubuntu22.04"
  "25.3.2" "4.2.3-1-ubuntu22.04" "25.3.3" "4.3.1-1-ubuntu22.04" "25.3.4" "4.3.1-1-ubuntu22.04"
  "25.10.0" "4.4.1-2-ubuntu22.04" "25.10.1" "4.4.2-1-ubuntu22.04" "26.3.0" "4.5.2-1-ubuntu22.04"
  "26.3.1" "4.5.2-1-ubuntu22.04" "26.3.2" "4.5.2-1-ubuntu22.04" "26.3.3" "4.5.2-1-ubuntu22.04"
  "26.7.0" "4.6.0-1-ubuntu24.04" -}}
{{- if hasKey $exact $version -}}
{{- get $exact $version -}}
{{- else if not $version -}}
4.6.0-1-ubuntu24.04
{{- else if semverCompare ">=26.7.0-0" $version -}}
4.6.0-1-ubuntu24.04
{{- else if semverCompare ">=26.3.0-0" $version -}}
4.5.2-1-ubuntu22.04
{{- else if semverCompare ">=25.10.0-0" $version -}}
4.4.2-1-ubuntu22.04
{{- else if semverCompare ">=25.3.0-0" $version -}}
4.3.1-1-ubuntu22.04
{{- else if semverCompare ">=24.9.0-0" $version -}}
3.3.9-1-ubuntu22.04
{{- else if semverCompare ">=24.3.0-0" $version -}}
3.3.7-1-ubuntu22.04
{{- else -}}
3.3.0-1-ubuntu22.04
{{- end -}}
{{- end -}}
{{- end -}}

{{- /* The init container's script (POSIX sh): the bindings' directory (pydcgm.py) and
libdcgm (DCGM 4: libdcgm.so.4, DCGM 3: libdcgm.so.3, symlinks followed) into $OUT. It never
fails the pod (DCGM is optional): an image without them, or a copy that fails, leaves
the volume empty and says so, and the exporter runs on with its DCGM source reporting the
bindings missing. Each run starts from an empty volume and copies into a staging
directory moved into place whole, so a rerun (the init container runs again when the pod
sandbox is recreated, the emptyDir kept) never trips on its own read-only leftovers; the
copy is made readable to any user and writable by its owner. */ -}}
{{- define "gpu-occupancy-exporter.dcgmCopyScript" -}}
set -u
clear() { chmod -R u+w "$OUT" 2>/dev/null; rm -rf "$OUT/bindings" "$OUT/lib" "$OUT/.staging"; }
src=""
for d in $BINDINGS_DIRS; do
  if [ -z "$src" ] && [ -f "$d/pydcgm.py" ]; then src="$d"; fi
done
lib=""
for d in $LIBRARY_DIRS; do
  for n in libdcgm.so.4 libdcgm.so.3; do
    if [ -z "$lib" ] && [ -f "$d/$n" ]; then lib="$d/$n"; fi
  done
done
clear
if [ -z "$src" ] || [ -z "$lib" ]; then
  echo "dcgm-bindings: no pydcgm.py in [$BINDINGS_DIRS] or no libdcgm.so.4/.so.3 in [$LIBRARY_DIRS] of this image: DCGM stays unavailable to the exporter; set dcgm.bindingsImage.bindingsDir/libraryDir, or dcgm.mode=off" >&2
  exit 0
fi
stage="$OUT/.staging"
if mkdir -p "$stage/bindings" "$stage/lib" \
  && cp -R "$src/." "$stage/bindings/" \
  && cp -L "$lib" "$stage/lib/" \
  && chmod -R u+w,a+rX "$stage" \
  && mv "$stage/bindings" "$OUT/bindings" \
  && mv "$stage/lib" "$OUT/lib"; then
  rmdir "$stage"
  echo "dcgm-bindings: copied $src and $lib"
else
  clear
  echo "dcgm-bindings: copying $src and $lib failed (above): DCGM stays unavailable to the exporter" >&2
fi
exit 0
{{- end -}}
