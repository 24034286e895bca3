"""What each NVML field and call the exporter uses costs on a real GPU, one at a time.

``real_nvml.py`` times whole calls; one ``nvmlDeviceGetFieldValues`` carries many fields,
so a slow field hides inside the batch. This script times, on GPU 0 (``--repeat`` calls
each, median and p90 in µs):

- every field the exporter asks for (``exporter.sources.nvml_fields``: the every-cycle
  request for this driver's branch, the slow tier's, and the power fields), alone, with
  its return code and value type;
- the every-cycle request as one call, and again without each field in turn;
- the single calls the fields stand in for, and the per-cycle calls that are not fields
  (process utilization, GPM);
- then, under a pinned host<->device copy load, the PCIe byte counters read every 20 ms
  beside ``nvmlDeviceGetPcieThroughput``, to show their width and whether they wrap.

Usage (on a GPU host): ``python benchmarks/real_nvml_fields.py [--repeat 10] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)]

import pynvml  # noqa: E402

from exporter.sources import nvml_fields  # noqa: E402
from exporter.sources.nvml_codes import error_name  # noqa: E402

POWER_FIELDS = {
    "power_average": getattr(pynvml, "NVML_FI_DEV_POWER_AVERAGE", 185),
    "power_instant": getattr(pynvml, "NVML_FI_DEV_POWER_INSTANT", 186),
}


def _time(fn: Callable[[], Any], repeat: int) -> dict[str, Any]:
    times: list[float] = []
    outcome = "Success"
    for _ in range(repeat):
        began = time.perf_counter_ns()
        try:
            fn()
        except pynvml.NVMLError as exc:
            outcome = error_name(exc)
        times.append((time.perf_counter_ns() - began) / 1e3)
    times.sort()
    return {
        "median_us": statistics.median(times),
        "p90_us": times[math.ceil(len(times) * 0.9) - 1],  # nearest rank
        "outcome": outcome,
    }


def _field(handle: Any, fid: int, repeat: int) -> dict[str, Any]:
    out = _time(lambda: pynvml.nvmlDeviceGetFieldValues(handle, [(fid, 0)]), repeat)
    entry = pynvml.nvmlDeviceGetFieldValues(handle, [(fid, 0)])[0]
    out["return"] = (
        error_name(pynvml.NVMLError(entry.nvmlReturn)) if entry.nvmlReturn else "Success"
    )
    out["value_type"] = int(entry.valueType)
    out["ull"] = int(entry.value.ullVal)
    return out


def _samples(handle: Any, last_seen_us: int) -> Any:
    """GPU-Util's sample buffer since ``last_seen_us``; NOT_FOUND (nothing newer) is an
    answer here, not an error: what it costs is the point."""
    try:
        return pynvml.nvmlDeviceGetSamples(
            handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, last_seen_us
        )
    except pynvml.NVMLError_NotFound:
        return None


def _batch_without(
    handle: Any, keys: list[nvml_fields.FieldKey], left_out: nvml_fields.FieldKey
) -> Callable[[], Any]:
    rest = [k for k in keys if k != left_out]
    return lambda: pynvml.nvmlDeviceGetFieldValues(handle, rest)


def _copy_load() -> subprocess.Popen[str]:
    from tests.gpu.workloads import WORKLOAD

    process = subprocess.Popen(
        [sys.executable, "-c", WORKLOAD, "copy", "30"], stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        process.kill()
        raise SystemExit("error: the copy workload did not start")
    return process


def _pcie_series(handle: Any, samples: int) -> list[dict[str, Any]]:
    keys = [(fid, 0) for fid in nvml_fields.PCIE_BYTES_FIELDS]
    rows = []
    for _ in range(samples):
        tx, rx = pynvml.nvmlDeviceGetFieldValues(handle, keys)
        rows.append(
            {
                "t": time.monotonic(),
                "tx": int(tx.value.ullVal),
                "rx": int(rx.value.ullVal),
                "tx_type": int(tx.valueType),
                "tx_kb_s": pynvml.nvmlDeviceGetPcieThroughput(
                    handle, pynvml.NVML_PCIE_UTIL_TX_BYTES
                ),
                "rx_kb_s": pynvml.nvmlDeviceGetPcieThroughput(
                    handle, pynvml.NVML_PCIE_UTIL_RX_BYTES
                ),
            }
        )
        time.sleep(0.02)
    return rows


def measure(repeat: int) -> dict[str, Any]:
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        branch = nvml_fields.driver_branch(pynvml.nvmlSystemGetDriverVersion())
        every_cycle = nvml_fields.requests(branch, 0)
        slow = nvml_fields.slow_requests(branch, [0])
        fields = {f"{fid}": _field(handle, fid, repeat) for fid, _ in every_cycle + slow}
        fields |= {
            f"{fid} ({name})": _field(handle, fid, repeat) for name, fid in POWER_FIELDS.items()
        }
        batch = _time(lambda: pynvml.nvmlDeviceGetFieldValues(handle, every_cycle), repeat)
        without = {
            str(key[0]): _time(_batch_without(handle, every_cycle, key), repeat)["median_us"]
            for key in every_cycle
        }
        calls: dict[str, Callable[[], Any]] = {
            "nvmlDeviceGetPowerUsage": lambda: pynvml.nvmlDeviceGetPowerUsage(handle),
            "nvmlDeviceGetTotalEnergyConsumption": lambda: (
                pynvml.nvmlDeviceGetTotalEnergyConsumption(handle)
            ),
            "nvmlDeviceGetPcieReplayCounter": lambda: pynvml.nvmlDeviceGetPcieReplayCounter(handle),
            "nvmlDeviceGetTemperature": lambda: pynvml.nvmlDeviceGetTemperature(handle, 0),
            "nvmlDeviceGetUtilizationRates": lambda: pynvml.nvmlDeviceGetUtilizationRates(handle),
            "nvmlDeviceGetMemoryInfo_v2": lambda: pynvml.nvmlDeviceGetMemoryInfo(
                handle, pynvml.nvmlMemory_v2
            ),
            "nvmlDeviceGetCurrPcieLinkWidth": lambda: pynvml.nvmlDeviceGetCurrPcieLinkWidth(handle),
            "nvmlDeviceGetProcessUtilization(lastSeen=0)": lambda: (
                pynvml.nvmlDeviceGetProcessUtilization(handle, 0)
            ),
            "nvmlDeviceGetProcessUtilization(lastSeen=now-1s)": lambda: (
                pynvml.nvmlDeviceGetProcessUtilization(handle, int((time.time() - 1) * 1e6))
            ),
            "nvmlDeviceGetComputeRunningProcesses": lambda: (
                pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
            ),
            # read every cycle for gpu_utilization_seconds_total; its cost on hardware is
            # not measured yet (the simulator's cost model gives it a cheap call's)
            "nvmlDeviceGetSamples(GPU_UTILIZATION, lastSeen=0)": lambda: _samples(handle, 0),
            "nvmlDeviceGetSamples(GPU_UTILIZATION, lastSeen=now-1s)": lambda: _samples(
                handle, int((time.time() - 1) * 1e6)
            ),
        }
        single = {name: _time(fn, repeat) for name, fn in calls.items()}
        load = _copy_load()
        try:
            time.sleep(1.0)
            pcie = _pcie_series(handle, 50)
        finally:
            load.kill()
            load.wait()
        return {
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "gpu": pynvml.nvmlDeviceGetName(handle),
            "repeat": repeat,
            "fields_alone": fields,
            "every_cycle_batch": batch | {"fields": [k[0] for k in every_cycle]},
            "every_cycle_batch_without": without,
            "single_calls": single,
            "pcie_under_copy": pcie,
        }
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10, help="calls per figure (default 10)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:
        print(f"error: NVML did not initialise ({exc}); run on a GPU host", file=sys.stderr)
        return 2
    result = measure(args.repeat)
    print(f"# {result['gpu']}, driver {result['driver']}, {args.repeat} calls per figure")
    print("| field alone | return | type | median µs | p90 µs |\n|---|---|---:|---:|---:|")
    for fid, f in result["fields_alone"].items():
        cells = [fid, f["return"], f["value_type"], f"{f['median_us']:.1f}", f"{f['p90_us']:.1f}"]
        print("| " + " | ".join(str(c) for c in cells) + " |")
    b = result["every_cycle_batch"]
    print(f"every-cycle batch {b['fields']}: median {b['median_us']:.1f} µs, p90 {b['p90_us']:.1f}")
    print(f"batch without each field (median µs): {result['every_cycle_batch_without']}")
    for name, s in result["single_calls"].items():
        print(f"{name}: {s['outcome']} median {s['median_us']:.1f} µs, p90 {s['p90_us']:.1f}")
    rows = result["pcie_under_copy"]
    for a, b2 in itertools.pairwise(rows):
        dt = b2["t"] - a["t"]
        print(
            f"dt {dt * 1e3:.0f} ms tx {b2['tx']} ({b2['tx'] - a['tx']:+d}) rx {b2['rx']} "
            f"({b2['rx'] - a['rx']:+d}) type {b2['tx_type']}; throughput tx {b2['tx_kb_s']} "
            f"rx {b2['rx_kb_s']} KB/s"
        )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
