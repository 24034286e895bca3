"""NVML calls per sample cycle and what each costs, on a real GPU.

``benchmarks/calls.py`` counts calls at the simulated library, where a call costs
microseconds of Python. On a real node each call enters the driver, so the figures that
carry over are the count *and* each call's time. This script runs the real exporter's
agent in-process against ``libnvidia-ml.so.1`` (``--kube-api off``, ``--dcgm off``, no
kubelet socket: NVML and /proc only) and wraps the loaded library object that pynvml
calls into, so every entry point is counted and timed at the C boundary (pynvml caches
what it resolves, ``_nvmlGetFunctionPointer_cache``; nothing of the exporter's is
touched).

Per cycle it records the calls, the wall time spent inside NVML, the cycle's wall time
and the process CPU (``time.process_time``: every thread, the XID listener's included).
Calls of the XID listener's thread (``nvmlEvent*``: it waits on an event set, outside the
cycle) are counted apart, as in ``calls.py``. Cycles that read the slow tier are told
apart from the others by their call count.

With ``--load heavy`` a torch matmul loop (``tests/gpu/workloads.py``) runs on the GPU
for the whole window, so the process listings and per-process samples have a process.

Usage (on a GPU host): ``python benchmarks/real_nvml.py [--cycles 40] [--load heavy]
[--json PATH]``. Without a GPU it says so and exits 2. docs/validation.md records what
it printed on a lent H100/H200.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import math
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT)]  # run from a checkout without installing

import pynvml  # noqa: E402

from exporter.agent import build_agent  # noqa: E402
from exporter.config import parse_config  # noqa: E402
from exporter.exposition.server import MetricsCache  # noqa: E402
from tests.gpu.host import real_gpu_count  # noqa: E402

OUTSIDE_CYCLE_PREFIX = "nvmlEvent"
OFF_HOST = ["--kube-api", "off", "--dcgm", "off", "--pod-resources-socket", "/nonexistent.sock"]


class _Timed:
    """One entry point: counts and times each call; attributes pynvml sets (``restype``)
    go to the ctypes function underneath."""

    def __init__(self, name: str, fn: Any, book: _Book) -> None:
        object.__setattr__(self, "_name", name)
        object.__setattr__(self, "_fn", fn)
        object.__setattr__(self, "_book", book)

    def __setattr__(self, key: str, value: Any) -> None:
        setattr(self._fn, key, value)

    def __getattr__(self, key: str) -> Any:
        return getattr(self._fn, key)

    def __call__(self, *args: Any) -> Any:
        began = time.perf_counter_ns()
        try:
            return self._fn(*args)
        finally:
            self._book.add(self._name, time.perf_counter_ns() - began)


class _Book:
    """Calls and nanoseconds by entry point, across threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.calls: Counter[str] = Counter()
        self.ns: Counter[str] = Counter()
        self.samples: dict[str, list[int]] = {}

    def add(self, name: str, ns: int) -> None:
        with self.lock:
            self.calls[name] += 1
            self.ns[name] += ns
            self.samples.setdefault(name, []).append(ns)

    def snapshot(self) -> tuple[Counter[str], Counter[str]]:
        with self.lock:
            return Counter(self.calls), Counter(self.ns)


class _TimedLibrary:
    """What pynvml holds as ``nvmlLib``: the real library, each entry point wrapped."""

    def __init__(self, library: ctypes.CDLL, book: _Book) -> None:
        self._library = library
        self._book = book

    def __getattr__(self, name: str) -> Any:
        return _Timed(name, getattr(self._library, name), self._book)


def _start_load(mode: str) -> subprocess.Popen[str] | None:
    if mode == "none":
        return None
    sys.path.insert(0, str(ROOT))
    from tests.gpu.workloads import WORKLOAD

    process = subprocess.Popen(
        [sys.executable, "-c", WORKLOAD, mode, "3600", "1024"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline().strip()  # "ready" once the GPU is in use
    if line != "ready":
        process.kill()
        raise SystemExit(f"error: the {mode} workload did not start (printed {line!r})")
    return process


async def _run(cycles: int, interval: float, argv: list[str], book: _Book) -> dict[str, Any]:
    agent = build_agent(parse_config([*OFF_HOST, *argv], env={}), MetricsCache())
    rows: list[dict[str, Any]] = []
    by_function: Counter[str] = Counter()
    ns_by_function: Counter[str] = Counter()
    outside: Counter[str] = Counter()
    try:
        began = time.perf_counter()
        await agent.start()
        start_s = time.perf_counter() - began
        next_at = time.monotonic()
        for index in range(cycles):
            calls0, ns0 = book.snapshot()
            cpu0, wall0 = time.process_time(), time.perf_counter()
            await agent.cycle()
            cpu1, wall1 = time.process_time(), time.perf_counter()
            calls1, ns1 = book.snapshot()
            in_cycle = nvml_ns = 0
            for name in calls1:
                n = calls1[name] - calls0[name]
                if name.startswith(OUTSIDE_CYCLE_PREFIX):
                    outside[name] += n
                elif n:
                    by_function[name] += n
                    ns = ns1[name] - ns0[name]
                    ns_by_function[name] += ns
                    in_cycle += n
                    nvml_ns += ns
            rows.append(
                {
                    "cycle": index,
                    "calls": in_cycle,
                    "nvml_ms": nvml_ns / 1e6,
                    "wall_ms": (wall1 - wall0) * 1e3,
                    "cpu_ms": (cpu1 - cpu0) * 1e3,
                }
            )
            next_at += interval
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        served = agent.registry.collect()
        series = sum(len(family.samples) for family in served)
    finally:
        await agent.close()
    steady = rows[1:]  # the first cycle reads identity and every tier
    least = min(r["calls"] for r in steady)
    fast = [r for r in steady if r["calls"] == least]
    slow = [r for r in steady if r["calls"] > least]

    def summary(part: list[dict[str, Any]]) -> dict[str, Any] | None:
        if not part:
            return None
        return {
            key: statistics.median(r[key] for r in part)
            for key in ("calls", "nvml_ms", "wall_ms", "cpu_ms")
        } | {"cycles": len(part)}

    functions = {}
    for name in sorted(by_function, key=lambda n: -ns_by_function[n]):
        samples = sorted(book.samples[name])
        functions[name] = {
            "calls_per_cycle": by_function[name] / cycles,
            "median_us": statistics.median(samples) / 1e3,
            "p99_us": samples[math.ceil(len(samples) * 0.99) - 1] / 1e3,  # nearest rank
            "ms_per_cycle": ns_by_function[name] / cycles / 1e6,
        }
    return {
        "cycles": cycles,
        "interval_s": interval,
        "start_s": start_s,
        "series": series,
        "first_cycle": rows[0],
        "fast_cycles": summary(fast),
        "slow_cycles": summary(slow),
        "calls_per_cycle_mean": sum(r["calls"] for r in rows) / cycles,
        "functions": functions,
        "outside_cycle_calls": dict(outside),
        "rows": rows,
    }


def _driver() -> dict[str, Any]:
    pynvml.nvmlInit()
    try:
        count = pynvml.nvmlDeviceGetCount()
        return {
            "driver": pynvml.nvmlSystemGetDriverVersion(),
            "nvml": pynvml.nvmlSystemGetNVMLVersion(),
            "gpus": [
                pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(count)
            ],
        }
    finally:
        pynvml.nvmlShutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=40, help="sample cycles (default 40)")
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between cycles")
    parser.add_argument(
        "--load",
        choices=("none", "heavy", "hold"),
        default="none",
        help="a torch workload on the GPU for the window (default none)",
    )
    parser.add_argument("--json", type=Path, help="also write the result here")
    parser.add_argument("exporter_args", nargs="*", help="extra exporter flags (after --)")
    args = parser.parse_args()
    if args.cycles < 3:
        parser.error("--cycles must be at least 3 (the first cycle reads every tier)")
    if real_gpu_count() == 0:
        print("error: no NVIDIA GPU or libnvidia-ml.so.1 here; run on a GPU host", file=sys.stderr)
        return 2
    book = _Book()
    with pynvml.libLoadLock:
        pynvml.nvmlLib = _TimedLibrary(ctypes.CDLL("libnvidia-ml.so.1"), book)
        pynvml._nvmlGetFunctionPointer_cache.clear()
    load = _start_load(args.load)
    try:
        result = asyncio.run(_run(args.cycles, args.interval, args.exporter_args, book))
    finally:
        if load is not None:
            load.kill()
            load.wait()
    with pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
    result["load"] = args.load
    result["machine"] = _driver()
    print(f"# NVML on {result['machine']}, load {args.load}, {args.cycles} cycles")
    for part in ("first_cycle", "fast_cycles", "slow_cycles"):
        print(f"{part}: {result[part]}")
    mean = result["calls_per_cycle_mean"]
    print(f"calls per cycle (mean): {mean:.1f}; series {result['series']}")
    print("| function | calls/cycle | median µs | p99 µs | ms/cycle |")
    print("|---|---:|---:|---:|---:|")
    for name, f in result["functions"].items():
        print(
            f"| {name} | {f['calls_per_cycle']:.2f} | {f['median_us']:.1f} | "
            f"{f['p99_us']:.1f} | {f['ms_per_cycle']:.3f} |"
        )
    print(f"outside the cycle: {result['outside_cycle_calls']}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
