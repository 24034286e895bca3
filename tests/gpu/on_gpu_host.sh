#!/usr/bin/env bash
# Everything docs/validation.md asks of a GPU host, in one run, from the repository root:
# the host's versions, NVML calls per cycle and their cost (idle and under load), the
# whole process beside nvitop-exporter, what the exporter serves and prints, then the
# checks in tests/gpu. Every result goes to $OUT (default /tmp/gpu-validation), one file
# per step, so a run cut short still leaves what it finished. Reads only: it changes no
# GPU setting (no MIG, clocks, resets).
#
#   OUT=/tmp/gpu-validation bash tests/gpu/on_gpu_host.sh
#
# TESTS_TIMEOUT_S bounds the tests/gpu step (default 300 s).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-validation}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
cd "$(dirname "$0")/../.."

step() { echo "== $(date -u +%H:%M:%S) $*"; }

step "host"
{
  nvidia-smi --query-gpu=index,name,uuid,driver_version,mig.mode.current,memory.total \
    --format=csv
  nvidia-smi | head -4
  grep RmProfilingAdminOnly /proc/driver/nvidia/params
  echo "uptime: $(cat /proc/uptime)"
  uname -a
  "$PY" --version
  "$PY" -m pip list 2>/dev/null | grep -iE '^(nvidia-ml-py|prometheus.client|aiohttp|grpcio|protobuf|torch|pytest) '
} >"$OUT/host.txt" 2>&1
cat "$OUT/host.txt"

step "NVML calls and their cost, idle (35 cycles: the first reads every tier, one slow-tier read at 30 s)"
"$PY" benchmarks/real_nvml.py --cycles 35 --json "$OUT/calls-idle.json" 2>&1 | tail -40

step "NVML calls and their cost, under a matmul load (20 cycles)"
"$PY" benchmarks/real_nvml.py --cycles 20 --load heavy --json "$OUT/calls-heavy.json" 2>&1 | tail -40

step "whole process beside nvitop-exporter (30 s)"
"$PY" benchmarks/real_process.py --seconds 30 --json "$OUT/process.json" 2>&1 | tail -20

step "what the exporter serves and what snapshot prints"
port=9445
"$PY" -m exporter --kube-api off --dcgm off --pod-resources-socket /nonexistent.sock \
  --listen "127.0.0.1:$port" --interval 1 --log-level info >"$OUT/serve.log" 2>&1 &
serve=$!
sleep 8
curl -s "127.0.0.1:$port/metrics" >"$OUT/metrics.txt"
kill "$serve"
wait "$serve"
grep -cE '^gpu_' "$OUT/metrics.txt"
{ timeout 60 "$PY" -m exporter snapshot --kube-api off --dcgm off \
    --pod-resources-socket /nonexistent.sock; echo "rc $?"; tail -20 "$OUT/serve.log"; } \
  >"$OUT/snapshot.txt" 2>&1
cat "$OUT/snapshot.txt"
rm -f "$OUT/serve.log"

step "tests/gpu"
timeout "${TESTS_TIMEOUT_S:-300}" "$PY" -m pytest tests/gpu -v -rs -s -p no:cacheprovider \
  2>&1 | tee "$OUT/gpu-tests.log" | grep -E '^(tests/|PASSED|FAILED|SKIPPED|ERROR|=)' | tail -60
step "done"
