"""GPM sampler run as a child process by test_real_gpm.py, possibly under another uid.

Self-contained (pynvml only) so an unprivileged user can run a copy of it. Like the
exporter, it keeps two sample buffers and computes metrics between this window's sample
and the previous one. One JSON line per window on stdout:

    {"t": 1700000000.1, "metrics": {"sm_util": 97.1, "sm_occupancy": 21.0, ...}}
    {"t": 1700000001.1, "stage": "sample", "error": "NoPermission"}

A metric NVML refused alone appears as its error name instead of a number.

    python gpm_reader.py GPU-UUID INTERVAL_S DURATION_S
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import pynvml

METRICS = {
    "graphics_util": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "sm_util": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "tensor_util": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
}


def name(exc: pynvml.NVMLError) -> str:
    return type(exc).__name__.removeprefix("NVMLError_")


def metrics(first: Any, second: Any) -> dict[str, float | str]:
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.sample1, request.sample2 = first, second
    request.numMetrics = len(METRICS)
    for slot, metric_id in enumerate(METRICS.values()):
        request.metrics[slot].metricId = metric_id
    pynvml.nvmlGpmMetricsGet(request)
    values: dict[str, float | str] = {}
    for slot, key in enumerate(METRICS):
        metric = request.metrics[slot]
        ok = metric.nvmlReturn == pynvml.NVML_SUCCESS
        values[key] = metric.value if ok else name(pynvml.NVMLError(metric.nvmlReturn))
    return values


def emit(record: dict[str, Any]) -> None:
    print(json.dumps({"t": time.time(), **record}), flush=True)


def main(argv: list[str]) -> int:
    uuid, interval_s, duration_s = argv[0], float(argv[1]), float(argv[2])
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        buffers = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
    except pynvml.NVMLError as exc:
        emit({"stage": "init", "error": name(exc)})
        return 0
    primed = False
    end = time.monotonic() + duration_s
    while time.monotonic() < end:
        previous, current = buffers
        try:
            pynvml.nvmlGpmSampleGet(handle, current)
        except pynvml.NVMLError as exc:
            emit({"stage": "sample", "error": name(exc)})
            primed = False
        else:
            if primed:
                try:
                    emit({"metrics": metrics(previous, current)})
                except pynvml.NVMLError as exc:
                    emit({"stage": "metrics", "error": name(exc)})
            buffers.reverse()
            primed = True
        time.sleep(interval_s)
    for buffer in buffers:
        pynvml.nvmlGpmSampleFree(buffer)
    pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
