"""Whether NVML's power fields mean what ``nvmlDeviceGetPowerUsage`` serves, on a real GPU.

The exporter serves ``gpu_power_watts`` from ``nvmlDeviceGetPowerUsage``, which NVML
documents as the 1 s average on Ampere (except GA100) and newer and the instantaneous
draw on older GPUs (nvml.h); field 185 (NVML_FI_DEV_POWER_AVERAGE) is "GPU power
averaged over 1 sec interval", field 186 (NVML_FI_DEV_POWER_INSTANT) "current GPU
power", each with the power scope in ``scopeId`` (NVML_POWER_SCOPE_GPU 0, _MODULE 1,
_MEMORY 2). On GPU 0 this reads the call and the six (field, scope) pairs back to back,
idle and under a matmul load when torch is there, and prints how often each pair equals
the call that bracketed it, and what each costs.

Usage (on a GPU host): ``python benchmarks/real_power_fields.py [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

import pynvml

PAIRS = [(fid, scope) for fid in (185, 186) for scope in (0, 1, 2)]
LOAD = (
    "import torch,time\n"
    "a=torch.randn(8192,8192,device='cuda')\n"
    "print('ready',flush=True)\n"
    "end=time.time()+float(__import__('sys').argv[1])\n"
    "while time.time()<end:\n"
    "    a@a\n"
    "    torch.cuda.synchronize()\n"
)


def _sample(handle: Any) -> dict[str, Any]:
    before = pynvml.nvmlDeviceGetPowerUsage(handle)
    entries = pynvml.nvmlDeviceGetFieldValues(handle, PAIRS)
    after = pynvml.nvmlDeviceGetPowerUsage(handle)
    out: dict[str, Any] = {"usage": [before, after]}
    for entry in entries:
        key = f"{entry.fieldId}/{entry.scopeId}"
        out[key] = (
            int(entry.value.uiVal) if entry.nvmlReturn == 0 else f"ret{entry.nvmlReturn}",
            int(entry.valueType),
        )
    return out


def _series(handle: Any, count: int) -> list[dict[str, Any]]:
    rows = []
    for _ in range(count):
        rows.append(_sample(handle))
        time.sleep(0.1)
    return rows


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for fid, scope in PAIRS:
        key = f"{fid}/{scope}"
        values = [r[key][0] for r in rows]
        if not all(isinstance(v, int) for v in values):
            out[key] = {"answers": sorted({str(v) for v in values})}
            continue
        equal = sum(v in r["usage"] for v, r in zip(values, rows, strict=True))
        diffs = [abs(v - r["usage"][0]) for v, r in zip(values, rows, strict=True)]
        out[key] = {
            "equal_to_call": f"{equal}/{len(rows)}",
            "max_abs_diff_mW": max(diffs),
            "median_mW": statistics.median(values),
            "value_type": rows[0][key][1],
        }
    out["call_median_mW"] = statistics.median(r["usage"][0] for r in rows)
    return out


def _cost(fn: Any, repeat: int = 200) -> float:
    times = []
    for _ in range(repeat):
        began = time.perf_counter_ns()
        fn()
        times.append((time.perf_counter_ns() - began) / 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    args = parser.parse_args()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    result: dict[str, Any] = {
        "gpu": pynvml.nvmlDeviceGetName(handle),
        "driver": pynvml.nvmlSystemGetDriverVersion(),
        "architecture": pynvml.nvmlDeviceGetArchitecture(handle),
        "idle": _summary(_series(handle, 30)),
    }
    try:
        load = subprocess.Popen(
            [sys.executable, "-c", LOAD, "8"], stdout=subprocess.PIPE, text=True
        )
        assert load.stdout is not None
        if load.stdout.readline().strip() == "ready":
            time.sleep(1.5)
            result["load"] = _summary(_series(handle, 50))
        load.kill()
        load.wait()
    except OSError as exc:
        result["load"] = str(exc)
    result["cost_us"] = {
        "nvmlDeviceGetPowerUsage": _cost(lambda: pynvml.nvmlDeviceGetPowerUsage(handle)),
        "fields [(185,0)]": _cost(lambda: pynvml.nvmlDeviceGetFieldValues(handle, [(185, 0)])),
        "fields [(82,0)]": _cost(lambda: pynvml.nvmlDeviceGetFieldValues(handle, [(82, 0)])),
        "fields [(82,0),(185,0)]": _cost(
            lambda: pynvml.nvmlDeviceGetFieldValues(handle, [(82, 0), (185, 0)])
        ),
    }
    pynvml.nvmlShutdown()
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as out:
            out.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
