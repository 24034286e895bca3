#!/usr/bin/env bash
# Build the image from the Dockerfile with buildah, run its entrypoint on the simulated
# 8-GPU node and scrape /metrics from it: the image, built and run, in one command.
#
#   image/build-and-run.sh     (root; needs buildah and mmdebstrap: apt-get install -y buildah mmdebstrap)
#
# 1. The Dockerfile's FROM image, if not in local storage, is built from Debian's
#    packages by image/debian-base.sh (no registry but Debian's and PyPI is reachable
#    here; that script says how the stand-in differs from the official image).
# 2. buildah build --isolation chroot --pull=never: no daemon, no user namespaces, no
#    base image pulled. The build's `pip install` reaches PyPI through the host network.
# 3. buildah run --isolation chroot runs the image's ENTRYPOINT with
#    `--simulate node-8gpu --kube-api off --listen 127.0.0.1:PORT`; the script scrapes
#    /metrics until a sample cycle has been served and checks its key series.
#    (`podman run` cannot be used here: crun fails to set rlimits in this sandbox.)
#
# Prints the image's size and the scrape's result; exits non-zero on any failure.
# IMAGE (default localhost/gpu-occupancy-exporter:<pyproject version>) names the result.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
started=$SECONDS
version="$(sed -nE 's/^version = "([^"]+)"/\1/p' pyproject.toml | head -n1)"
image="${IMAGE:-localhost/gpu-occupancy-exporter:$version}"
from="$(awk 'toupper($1) == "FROM" {print $2; exit}' Dockerfile)"
for tool in buildah mmdebstrap python3; do
  command -v "$tool" >/dev/null || {
    echo "image/build-and-run.sh: $tool not found; install it: apt-get install -y buildah mmdebstrap" >&2
    exit 2
  }
done

ctr=""
exporter_pid=""
log="$(mktemp)"
cleanup() {
  if [[ -n $exporter_pid ]]; then
    kill "$exporter_pid" 2>/dev/null || true
    wait "$exporter_pid" 2>/dev/null || true
  fi
  [[ -n $ctr ]] && buildah rm "$ctr" >/dev/null 2>&1 || true
  rm -rf "$log" "$log.ca" "$log.oci" "$log.installed"
}
trap cleanup EXIT

echo "== base image $from"
image_id() { buildah inspect --type image --format '{{.FromImageID}}' "$1" 2>/dev/null || true; }
if [[ -n "$(image_id "docker.io/library/$from")" ]]; then
  echo "docker.io/library/$from is in local storage; image/debian-base.sh rebuilds it"
else
  image/debian-base.sh
fi
# The base.name label names the image really used: the stand-in, where it is one.
base_name="docker.io/library/$from"
if [[ "$(image_id localhost/python-debian:bookworm)" == "$(image_id "$base_name")" ]]; then
  base_name="localhost/python-debian:bookworm"
fi

echo "== buildah build $image"
revision="$(git rev-parse HEAD 2>/dev/null || echo unknown)"
# Where the host's pip trusts an extra CA (PIP_CERT, e.g. a TLS-inspecting proxy in front
# of PyPI), the build's RUN steps get that bundle: a bind mount on the image's empty /mnt
# (`buildah build --volume` mounts for RUN only; nothing of it lands in a layer) and the
# Dockerfile's ARG PIP_CERT naming it (an ARG is no ENV: the image does not keep it).
lend=()
if [[ -n ${PIP_CERT:-} && -f $PIP_CERT ]]; then
  mkdir -p "$log.ca" && cp "$PIP_CERT" "$log.ca/ca.pem"
  lend=(--volume "$log.ca:/mnt:ro" --build-arg PIP_CERT=/mnt/ca.pem)
  echo "lending the build PIP_CERT ($PIP_CERT) for pip's TLS"
fi
build_started=$SECONDS
buildah build --isolation chroot --pull=never --layers=false --format docker --quiet "${lend[@]}" \
  --build-arg "VERSION=$version" \
  --build-arg "REVISION=$revision" \
  --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  --build-arg "BASE_NAME=$base_name" \
  -t "$image" -f Dockerfile . >/dev/null
echo "built in $((SECONDS - build_started)) s"
# Compressed: what a registry stores and a node pulls (the layers gzipped, as a push does).
buildah push --quiet "$image" "oci:$log.oci" >/dev/null
compressed="$(du -sb "$log.oci" | cut -f1)"
size_of() { buildah images --noheading --format '{{.Size}}' "$1" | head -n1; }
echo "image size: $(size_of "$image") uncompressed, $((compressed / 1000000)) MB compressed" \
  "(base $from: $(size_of "docker.io/library/$from") uncompressed)"
buildah inspect --type image --format \
  '{{range $k, $v := .OCIv1.Config.Labels}}label {{$k}}={{$v}}{{"\n"}}{{end}}' "$image" |
  grep org.opencontainers.image || true

echo "== pins: every package pip installed is pinned by image/constraints.txt"
ctr="$(buildah from --pull=never "$image")"
# Debian's own python3-* packages live under /usr/lib/python3; the installer's own
# (pip, setuptools, wheel) come with the base image, not from our install.
buildah run --isolation chroot "$ctr" -- python3 -c '
import importlib.metadata as m
for d in m.distributions():
    if not str(d.locate_file("")).startswith("/usr/lib/python3/"):
        print(d.metadata["Name"], d.version)' >"$log.installed"
python3 - "$log.installed" image/constraints.txt <<'PY'
import re, sys

def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()

installed = dict(line.split() for line in open(sys.argv[1]) if line.strip())
pins = {}
for line in open(sys.argv[2]):
    name, sep, version = line.split("#", 1)[0].strip().partition("==")
    if sep:
        pins[norm(name)] = version
own = {"gpu-occupancy-exporter", "pip", "setuptools", "wheel"}
wrong = {
    name: (version, pins.get(norm(name)))
    for name, version in installed.items()
    if norm(name) not in own and pins.get(norm(name)) != version
}
if wrong:
    sys.exit(f"pins: installed (version, pin) not as image/constraints.txt says: {wrong}")
print(f"pins: {len(installed) - len(own & {norm(n) for n in installed})} packages, all as pinned")
PY

echo "== buildah run: the entrypoint on the simulated node-8gpu"
port="$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
mapfile -t entrypoint < <(buildah inspect --type image \
  --format '{{range .OCIv1.Config.Entrypoint}}{{println .}}{{end}}' "$image")
[[ ${#entrypoint[@]} -gt 0 && -n ${entrypoint[0]} ]] || {
  echo "image/build-and-run.sh: $image has no ENTRYPOINT" >&2
  exit 1
}
buildah run --isolation chroot "$ctr" -- "${entrypoint[@]}" \
  --simulate node-8gpu --kube-api off --listen "127.0.0.1:$port" >"$log" 2>&1 &
exporter_pid=$!

# Scrape until a sample cycle has been served (gpu_info present), then check key series.
python3 - "$port" "$exporter_pid" <<'PY'
import os, sys, time, urllib.request

port, pid = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 120
body, error = "", "no answer"
while time.monotonic() < deadline:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the exporter exited before serving /metrics")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            body = r.read().decode()
        if "\ngpu_info{" in body and "\ngpu_sm_active_ratio{" in body:
            break
    except OSError as exc:
        error = str(exc)
    time.sleep(0.5)
else:
    sys.exit(f"no sample cycle on /metrics within 120 s (last: {error})")
series = [line for line in body.splitlines() if line and not line.startswith("#")]
gpus = {line.split('uuid="', 1)[1].split('"', 1)[0] for line in series if line.startswith("gpu_info{")}
need = ("gpu_info{", "gpu_sm_active_ratio{", "gpu_memory_used_bytes{", "gpu_exporter_build_info{")
missing = [name for name in need if not any(line.startswith(name) for line in series)]
print(f"scrape: {len(series)} series, {len(body)} bytes, {len(gpus)} GPUs in gpu_info")
for line in series:
    if line.startswith("gpu_exporter_build_info{"):
        print(f"scrape: {line}")
if missing or len(gpus) != 8:
    sys.exit(f"scrape: missing {missing} or not 8 GPUs ({len(gpus)})")
print("scrape: ok")
PY
echo "total $((SECONDS - started)) s"
