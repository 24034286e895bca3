# syntax=docker/dockerfile:1
# gpu-occupancy-exporter: node-level GPU telemetry for Kubernetes (see docs/install.md).
#
#   docker build -t gpu-occupancy-exporter:0.1.0 .
#
# image/build-and-run.sh builds it with buildah where no base image can be pulled (a
# stand-in python:3.11-slim made from Debian's packages), runs it and scrapes /metrics.
#
# The image holds only the Python package and its wheels: libnvidia-ml comes from the
# host through the NVIDIA container runtime (runtimeClassName nvidia, or
# `docker run --gpus all`), as the NVIDIA container toolkit injects it at start.
#
# tests/test_dockerfile.py repeats this file's COPY and `pip install` steps in a fresh
# virtualenv and runs the installed console script, so the install cannot silently rot.
FROM python:3.11-slim

ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG BASE_NAME=docker.io/library/python:3.11-slim
LABEL org.opencontainers.image.title="gpu-occupancy-exporter" \
      org.opencontainers.image.description="Node-level GPU telemetry exporter for Kubernetes: true SM occupancy, per-pod attribution, zombie GPU memory, GPU health." \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.source="https://github.com/gpu-occupancy-exporter/gpu-occupancy-exporter" \
      org.opencontainers.image.documentation="https://github.com/gpu-occupancy-exporter/gpu-occupancy-exporter/blob/main/docs/install.md" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.base.name="${BASE_NAME}"

# No .pyc writes (the chart runs with a read-only root filesystem), unbuffered logs.
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=utility

# Builds behind a TLS-inspecting proxy: a CA bundle for pip, e.g. `--volume
# /etc/ssl/certs:/mnt:ro --build-arg PIP_CERT=/mnt/ca-certificates.crt` (buildah build;
# the mount exists for RUN steps only). Unset by default: pip's own trust store.
ARG PIP_CERT

# Only what the package build needs (.dockerignore keeps everything else out). The
# dependencies are pinned by image/constraints.txt (image/lock.py writes it from the venv
# the tests passed in), so two builds of one commit install the same versions.
COPY pyproject.toml README.md image/constraints.txt /src/
COPY exporter /src/exporter
RUN pip install --no-cache-dir -c /src/constraints.txt /src \
 && rm -rf /src

# The default user is root, on purpose: the kubelet's pod-resources socket is root-owned
# (connecting needs write permission on it) and NVML opens /dev/nvidia*, which drivers
# may restrict to root. The exporter writes nothing to disk, so a non-root user works
# where neither applies: `docker run --user 65534:65534 ...` or, in the chart,
# podSecurityContext.runAsUser / runAsNonRoot. The chart drops every capability anyway.
WORKDIR /
EXPOSE 9445
# Kubernetes ignores HEALTHCHECK (the chart has its own probes); docker uses it.
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; port = os.environ.get('GPU_EXPORTER_LISTEN', ':9445').rpartition(':')[2]; urllib.request.urlopen(f'http://127.0.0.1:{port}/healthz', timeout=4)"]
ENTRYPOINT ["gpu-occupancy-exporter"]
