#!/usr/bin/env bash
# Copy the repository's alert rules and dashboards into the Helm chart.
#
# Helm cannot read files outside a chart's directory, and a symlink pointing out of it
# breaks the whole chart when its target is missing (git keeps no empty directory), so the
# chart carries copies: alerts/*.yaml (the rule files; alerts/tests/ stays out) ->
# files/alerts/, alerts/compat/*.yaml (opt-in rule files) -> files/compat/,
# dashboards/*.json -> files/dashboards/. alerts/ and dashboards/ stay the one source of
# truth; tests/test_helm_chart.py fails when the copies differ from them.
#
#   charts/sync-files.sh          make the copies match (adds, updates, removes)
#   charts/sync-files.sh --check  only report differences; exit 1 if there are any
set -euo pipefail
shopt -s nullglob

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
files="$root/charts/gpu-occupancy-exporter/files"
check=0
case "${1:-}" in
  "") ;;
  --check) check=1 ;;
  *) echo "usage: $0 [--check]" >&2; exit 2 ;;
esac

status=0
# sync SOURCE_DIR DEST_DIR GLOB
sync() {
  local src="$root/$1" dest="$files/$2" pattern="$3" path name
  [[ $check == 1 ]] || mkdir -p "$dest"
  for path in "$src"/$pattern; do
    name="$(basename "$path")"
    if ! cmp -s "$path" "$dest/$name"; then
      if [[ $check == 1 ]]; then
        echo "out of date: charts/gpu-occupancy-exporter/files/$2/$name (from $1/$name)"
        status=1
      else
        cp "$path" "$dest/$name"
        echo "copied $1/$name"
      fi
    fi
  done
  for path in "$dest"/$pattern; do
    name="$(basename "$path")"
    if [[ ! -e "$src/$name" ]]; then
      if [[ $check == 1 ]]; then
        echo "stale: charts/gpu-occupancy-exporter/files/$2/$name ($1/$name is gone)"
        status=1
      else
        rm "$path"
        echo "removed files/$2/$name"
      fi
    fi
  done
}

sync alerts alerts '*.yaml'
sync alerts/compat compat '*.yaml'
sync dashboards dashboards '*.json'
if [[ $status != 0 ]]; then
  echo "run charts/sync-files.sh to update the chart's copies" >&2
fi
exit "$status"
