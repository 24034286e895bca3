"""NVML calls per sample cycle, counted where a real driver would be entered.

On the simulator a call costs microseconds of Python; on a real node every NVML call is
an ioctl into the driver, some of them milliseconds. So the number of calls per cycle is
the figure that carries over to hardware. It is counted at the simulated library object
that pynvml calls into (``exporter.sim.nvml_library.CallCount``), not in the exporter.

The agent runs in-process on the simulated node (``cycle.simulated_agent``), one cycle
per simulated second, over ``WINDOW_CYCLES`` cycles after a warm-up: a whole number of
slow-tier periods (``--slow-interval``, default 30 s), so the mean carries the slow tier's
reads in their true share. Calls of the XID listener's thread (``nvmlEvent*``: it waits
on an event set, outside the cycle) are counted apart.

Printed and written to ``benchmarks/results/calls.{json,md}``: calls per cycle in all,
per GPU, by function, the least and most in one cycle, the slow tier's calls (``SLOW_CALLS``
and its field-values call) per cycle and the most in any one cycle (the slow tier is
staggered over the GPUs, so one cycle never pays for all of them), and for the calls that
list or sample processes the calls per process on the node and per GPU with and without
processes (a GPU whose listings all answered empty is not asked for per-process samples:
on an H200 that read took 1.3-2.4 ms even idle). ``benchmarks/results/calls-before.json``
holds the figure before the NVML call budget, printed beside it.

Usage: ``python benchmarks/calls.py [--scenario NAME] [--record-before]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import subprocess
import sys
from collections import Counter
from collections.abc import Collection
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # run from a checkout without installing

from cycle import simulated_agent  # noqa: E402

from exporter.sim.scenario import Scenario, load_scenario  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
BEFORE = RESULTS_DIR / "calls-before.json"
SCENARIO = "node-8gpu"
WARMUP_CYCLES = 5
WINDOW_CYCLES = 60  # two slow-tier periods at the default --slow-interval 30 and 1 s cycles
TARGET_SHARE = 0.40  # the call budget: at most 40 % of the calls before it
# Calls outside the sample cycle: the XID listener's thread waits on an event set.
OUTSIDE_CYCLE_PREFIX = "nvmlEvent"
# Entry points whose answer grows with the processes on a GPU (the listings and the
# per-process samples): one call asks the size, one reads, whatever the count.
PROCESS_CALLS = frozenset(
    {
        "nvmlDeviceGetComputeRunningProcesses_v3",
        "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        "nvmlDeviceGetComputeRunningProcesses_v2",
        "nvmlDeviceGetGraphicsRunningProcesses_v2",
        "nvmlDeviceGetMPSComputeRunningProcesses_v2",
        "nvmlDeviceGetProcessUtilization",
    }
)


# Entry points only the slow tier and the MIG layout read (exporter/sources/nvml_cadence.py:
# READS "slow", and the layout re-read at each slow read); the slow tier's one
# nvmlDeviceGetFieldValues per GPU is counted as the field-values calls beyond one per GPU.
SLOW_CALLS = frozenset(
    {
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetRetiredPages",
        "nvmlDeviceGetRetiredPages_v2",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetMaxPcieLinkGeneration",
        "nvmlDeviceGetMaxPcieLinkWidth",
        "nvmlDeviceGetPcieReplayCounter",
        "nvmlDeviceGetNvLinkState",
        "nvmlDeviceGetNvLinkErrorCounter",
        "nvmlDeviceGetNumFans",
        "nvmlDeviceGetFanSpeed",
        "nvmlDeviceGetFanSpeed_v2",
        "nvmlDeviceGetEnforcedPowerLimit",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetMigMode",
        "nvmlDeviceGetMaxMigDeviceCount",
        "nvmlDeviceGetMigDeviceHandleByIndex",
        "nvmlDeviceGetGpuInstanceId",
        "nvmlDeviceGetComputeInstanceId",
    }
)


def slow_calls(delta: Counter[str], gpus: int) -> int:
    """The slow tier's calls among one cycle's: its entry points, and its field-values
    call (those beyond the every-cycle one per GPU)."""
    fields = max(0, delta.get("nvmlDeviceGetFieldValues", 0) - gpus)
    return fields + sum(n for name, n in delta.items() if name in SLOW_CALLS)


async def count_calls(
    scenario: Scenario, cycles: int = WINDOW_CYCLES, warmup: int = WARMUP_CYCLES
) -> dict[str, Any]:
    """Calls per cycle over ``cycles`` cycles, one simulated second apart."""
    async with simulated_agent(scenario, ()) as sim:
        library = sim.env.library
        assert library is not None
        for _ in range(warmup):
            await sim.step()
        per_cycle: list[int] = []
        slow_per_cycle: list[int] = []
        gpu_count = len(sim.env.node.gpus)
        by_function: Counter[str] = Counter()
        by_gpu: Counter[int | None] = Counter()
        outside: Counter[str] = Counter()
        pairs_before = Counter(library.calls.by_gpu_function)
        for _ in range(cycles):
            functions, gpus = library.calls.snapshot()
            await sim.step()
            after_functions, after_gpus = library.calls.snapshot()
            delta = Counter(after_functions)
            delta.subtract(functions)
            in_cycle = 0
            for name, n in delta.items():
                if name.startswith(OUTSIDE_CYCLE_PREFIX):
                    outside[name] += n
                elif n:
                    by_function[name] += n
                    in_cycle += n
            per_cycle.append(in_cycle)
            slow_per_cycle.append(slow_calls(delta, gpu_count))
            for gpu, n in after_gpus.items():
                by_gpu[gpu] += n - gpus.get(gpu, 0)
        pairs = Counter(library.calls.by_gpu_function)
        pairs.subtract(pairs_before)
        assert sim.agent.latest is not None
        processes = len(sim.agent.latest.node.processes)
        idle = {g.index for g in sim.env.node.gpus if not sim.env.node.listed_processes(g.index)}
    process_calls = sum(n for name, n in by_function.items() if name in PROCESS_CALLS)
    per_gpu_process = _per_gpu(pairs, PROCESS_CALLS, gpu_count, cycles)
    per_gpu_samples = _per_gpu(pairs, {"nvmlDeviceGetProcessUtilization"}, gpu_count, cycles)
    return {
        "scenario": scenario.name,
        "cycles": cycles,
        "gpus": gpu_count,
        "processes": processes,
        "per_cycle": sum(per_cycle) / cycles,
        "least_in_a_cycle": min(per_cycle),
        "most_in_a_cycle": max(per_cycle),
        "per_gpu": sum(per_cycle) / cycles / max(gpu_count, 1),
        "slow_per_cycle": sum(slow_per_cycle) / cycles,
        "slow_most_in_a_cycle": max(slow_per_cycle),
        "slow_cycles": sum(1 for n in slow_per_cycle if n),
        "by_gpu": {
            str(gpu): by_gpu[gpu] / cycles
            for gpu in sorted(by_gpu, key=lambda g: -1 if g is None else g)
            if gpu is not None
        },
        "without_gpu_handle": by_gpu[None] / cycles,
        "by_function": {
            name: n / cycles for name, n in sorted(by_function.items(), key=lambda i: -i[1])
        },
        "process_calls_per_cycle": process_calls / cycles,
        "process_calls_per_process": process_calls / cycles / max(processes, 1),
        # GPUs with no process listed at the end of the window, and the mean per cycle
        # of each kind of GPU (None: no GPU of that kind)
        "idle_gpus": sorted(idle),
        "process_calls_per_busy_gpu": _mean(per_gpu_process, set(range(gpu_count)) - idle),
        "process_calls_per_idle_gpu": _mean(per_gpu_process, idle),
        "process_sample_calls_per_idle_gpu": _mean(per_gpu_samples, idle),
        "outside_cycle": {name: n / cycles for name, n in outside.items()},
    }


def _per_gpu(
    pairs: Counter[tuple[int | None, str]], names: Collection[str], gpus: int, cycles: int
) -> dict[int, float]:
    """Calls of ``names`` per cycle, by GPU."""
    return {
        gpu: sum(n for (g, name), n in pairs.items() if g == gpu and name in names) / cycles
        for gpu in range(gpus)
    }


def _mean(values: dict[int, float], gpus: Collection[int]) -> float | None:
    picked = [values[gpu] for gpu in gpus]
    return sum(picked) / len(picked) if picked else None


async def measure(plan: Any = None) -> dict[str, Any]:
    """run.py's section: node-8gpu's calls per cycle, with the figure before (if kept)."""
    result = await count_calls(load_scenario(SCENARIO))
    result["before_per_cycle"] = (
        json.loads(BEFORE.read_text())["per_cycle"] if BEFORE.exists() else None
    )
    return result


def markdown(after: dict[str, Any], before: dict[str, Any] | None, top: int = 10) -> str:
    """The figure against the one before, and the functions that make it up."""
    lines = [f"# NVML calls per sample cycle ({after['scenario']})", ""]
    lines.append(
        f"Counted at the simulated library's boundary over {after['cycles']} cycles one "
        f"simulated second apart ({after['gpus']} GPUs, {after['processes']} GPU processes); "
        "regenerate with `python benchmarks/calls.py`."
    )
    lines.append("")
    lines += ["| figure | before | now |", "|---|---:|---:|"]

    def row(label: str, key: str) -> None:
        old = "—" if before is None or key not in before else f"{before[key]:.1f}"
        lines.append(f"| {label} | {old} | {after[key]:.1f} |")

    row("calls per cycle (mean)", "per_cycle")
    row("least in one cycle", "least_in_a_cycle")
    row("most in one cycle", "most_in_a_cycle")
    row("per GPU per cycle", "per_gpu")
    row("slow-tier calls per cycle (mean)", "slow_per_cycle")
    row("slow-tier calls, most in one cycle", "slow_most_in_a_cycle")
    row(f"cycles of {after['cycles']} with slow-tier calls", "slow_cycles")
    row("process-scaled calls per cycle", "process_calls_per_cycle")
    row("process-scaled calls per process on the node", "process_calls_per_process")
    for label, key in (
        ("process-scaled calls per cycle, per GPU with processes", "process_calls_per_busy_gpu"),
        ("process-scaled calls per cycle, per GPU without", "process_calls_per_idle_gpu"),
        ("of which per-process samples, per GPU without", "process_sample_calls_per_idle_gpu"),
    ):
        old, now = (before or {}).get(key), after.get(key)
        lines.append(
            f"| {label} | {'—' if old is None else f'{old:.1f}'} | "
            f"{'—' if now is None else f'{now:.1f}'} |"
        )
    if before is not None:
        share = after["per_cycle"] / before["per_cycle"]
        verdict = "pass" if share <= TARGET_SHARE else "FAIL"
        lines += [
            "",
            f"Now {share:.0%} of before ({before['per_cycle']:.0f} → {after['per_cycle']:.0f}; "
            f"target ≤ {TARGET_SHARE:.0%}): {verdict}. Before: commit {before.get('commit')}.",
        ]
    lines += ["", f"Top {top} functions, calls per cycle:", ""]
    lines += ["| function | before | now |", "|---|---:|---:|"]
    names = list(after["by_function"])[:top]
    if before is not None:
        names += [n for n in list(before["by_function"])[:top] if n not in names]
    for name in names:
        old = "—" if before is None else f"{before['by_function'].get(name, 0.0):.2f}"
        lines.append(f"| {name} | {old} | {after['by_function'].get(name, 0.0):.2f} |")
    lines.append("")
    return "\n".join(lines)


def _commit() -> str:
    return subprocess.run(
        ["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", default=SCENARIO)
    parser.add_argument(
        "--record-before",
        action="store_true",
        help=f"write this run as the figure before ({BEFORE.relative_to(ROOT)})",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.ERROR)  # the scenario's findings are not the point
    result = asyncio.run(count_calls(load_scenario(args.scenario)))
    result["commit"] = _commit()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    if args.record_before:
        BEFORE.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {BEFORE.relative_to(ROOT)}")
    before = json.loads(BEFORE.read_text()) if BEFORE.exists() else None
    if before is not None and before["scenario"] != result["scenario"]:
        before = None
    text = markdown(result, None if args.record_before else before)
    print(text)
    if not args.record_before:
        (RESULTS_DIR / "calls.json").write_text(json.dumps(result, indent=2) + "\n")
        (RESULTS_DIR / "calls.md").write_text(text)
        print("wrote benchmarks/results/calls.{json,md}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
