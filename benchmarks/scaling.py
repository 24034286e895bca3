"""Scaling curve: the exporter's cost as GPUs and GPU processes grow.

Each point is a generated scenario run as its own simulated node (``python -m
exporter.sim``) with our exporter beside it at ``--interval 1``, measured from outside
(``benchmarks/processes.py``): whole-process CPU per second while Prometheus scrapes
OpenMetrics every 5 s, RSS, and scrape latency in both formats. The grid is 1 / 8 / 16
GPUs x 8 / 64 / 512 processes, plus 8 GPUs x 7 MIG instances and one GPU time-sliced
among 48 pods.

Usage: ``python benchmarks/scaling.py [--quick]``; writes ``benchmarks/results/scaling.*``
(``scaling-quick.*`` with ``--quick``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from exporter.exposition.scrape_demand import KEEP_RENDERING_CYCLES

sys.path.insert(0, str(Path(__file__).resolve().parent))  # processes.py, machine.py

from machine import cores, machine_line
from processes import (
    OPENMETRICS_ACCEPT,
    ROOT,
    ExporterProcess,
    NodeServer,
    PeriodicScraper,
    all_sources_up,
    cpu_per_second,
    exporter_argv,
    free_port,
    get,
    memory_mib,
    running,
    scrape_latencies,
)

RESULTS_DIR = ROOT / "benchmarks" / "results"

# The targets every point is held to (benchmarks/README.md).
TARGET_CPU_MS_PER_S = 5.0
TARGET_RSS_MIB = 64.0
TARGET_SCRAPE_P99_MS = 2.0

PROCESSES_PER_POD = 4  # one main process and three data-loader workers per container
GPU_MEMORY_BUDGET_MIB = 64 * 1024  # what the processes on one GPU hold together
GRID_GPUS = (1, 8, 16)
GRID_PROCESSES = (8, 64, 512)
# GPU instance ids the driver gives seven 1g.10gb instances on an H100 80GB (profile 19,
# `nvidia-smi mig -cgi 19,19,19,19,19,19,19 -C`; `nvidia-smi mig -lgi` lists ids 7, 8, 9
# at placements 4-6 and 11-14 at 0-3; the same ids as the A100's 1g.5gb). Seven is the
# H100's maximum (NVIDIA MIG User Guide, "Supported GPUs"; MAX_MIG_DEVICES in the sim).
MIG_1G_GPU_INSTANCE_IDS = (7, 8, 9, 11, 12, 13, 14)
TIMESLICED_REPLICAS = 48


@dataclass(frozen=True)
class Point:
    """One point of the curve: what its scenario holds."""

    name: str
    kind: str  # grid | mig | timesliced
    gpus: int
    processes: int
    pods: int


@dataclass(frozen=True)
class Plan:
    """How long each point is measured."""

    warmup_cycles: int  # after every source is up; over 10 lets the text format drop out
    cpu_s: float
    scrapes: int  # per format, 10 ms apart


FULL = Plan(warmup_cycles=KEEP_RENDERING_CYCLES + 1, cpu_s=15.0, scrapes=200)
QUICK = Plan(warmup_cycles=3, cpu_s=6.0, scrapes=50)
QUICK_POINTS = ("1gpu-8p", "8gpu-64p", "16gpu-512p", "timesliced-48")


# -- scenarios ---------------------------------------------------------------------------


def _header(description: str, gpus: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "description": description,
        "node_name": "sim-node-scaling",
        "driver_version": "580.65.06",
        "nvml_version": "13.580.65.06",
        "cuda_driver_version": 13000,
        "gpu_defaults": {"pcie_tx_bytes_per_s": 150_000_000, "pcie_rx_bytes_per_s": 900_000_000},
        "gpus": gpus,
        "pods": [],
    }


def _pod(index: int, device: dict[str, list[str]], processes: list[dict[str, Any]]) -> Any:
    return {
        "namespace": "bench",
        "name": f"job-{index}",
        "qos": "burstable",
        "containers": [{"name": "main", "devices": device, "processes": processes}],
    }


def _container_processes(
    gpu: int, count: int, pods_on_gpu: int, mig: int | None = None
) -> list[dict[str, Any]]:
    """A main process holding most of the pod's share of memory, the rest workers."""
    share_mib = GPU_MEMORY_BUDGET_MIB // pods_on_gpu
    if mig is not None:
        share_mib = 8 * 1024
    main = {"gpu": gpu, "memory": f"{share_mib * 3 // 4}MiB", "sm": 90 // pods_on_gpu}
    worker = {"gpu": gpu, "memory": f"{share_mib // 4 // 3}MiB", "sm": 0}
    procs = [{**main, "comm": "python3"}] + [
        {**worker, "comm": "pt_data_worker"} for _ in range(count - 1)
    ]
    if mig is not None:
        for proc in procs:
            proc["mig"] = mig
    return procs


def processes_per_pod(gpus: int, processes: int) -> int:
    """Up to four per pod, fewer where that leaves every GPU a pod (8 on 8 GPUs: one each)."""
    return min(PROCESSES_PER_POD, max(1, processes // gpus))


def scenario_yaml(gpus: int, processes: int) -> str:
    """``processes`` in pods placed round-robin on ``gpus`` GPUs: a GPU with one pod is
    allocated whole, a GPU with more is time-sliced (one replica each), so 512 processes
    fit on one GPU. Nodes of 8 and more GPUs are HGX boards with 18 NVLinks per GPU; the
    single GPU is a PCIe card."""
    per_pod = processes_per_pod(gpus, processes)
    pods = math.ceil(processes / per_pod)
    per_gpu = [len(range(g, pods, gpus)) for g in range(gpus)]
    links = 18 if gpus >= 8 else 0
    data = _header(
        f"Scaling point: {gpus} GPUs, {processes} processes in {pods} pods",
        [{"nvlink_links": links} for _ in range(gpus)],
    )
    left = processes
    for i in range(pods):
        gpu, replica = i % gpus, i // gpus
        count = min(per_pod, left)
        left -= count
        if per_gpu[gpu] == 1:
            device = {"nvidia.com/gpu": [f"gpu{gpu}"]}
        else:
            device = {"nvidia.com/gpu.shared": [f"gpu{gpu}::{replica}"]}
        data["pods"].append(_pod(i, device, _container_processes(gpu, count, per_gpu[gpu])))
    return str(yaml.safe_dump(data, sort_keys=False))


def mig_8x7_yaml() -> str:
    """8 H100s, each split into seven 1g.10gb instances, one pod of four per instance."""

    def instances() -> list[dict[str, Any]]:
        return [
            {"profile": "1g.10gb", "gpu_instance_id": gi, "compute_instance_id": 0}
            for gi in MIG_1G_GPU_INSTANCE_IDS
        ]

    per_gpu = len(MIG_1G_GPU_INSTANCE_IDS)
    data = _header(
        f"Scaling point: 8 GPUs x {per_gpu} MIG 1g.10gb instances",
        [{"mig": instances()} for _ in range(8)],
    )
    for gpu in range(8):
        for m in range(per_gpu):
            device = {"nvidia.com/mig-1g.10gb": [f"gpu{gpu}/mig{m}"]}
            procs = _container_processes(gpu, PROCESSES_PER_POD, 1, mig=m)
            data["pods"].append(_pod(gpu * per_gpu + m, device, procs))
    return str(yaml.safe_dump(data, sort_keys=False))


def timesliced_48_yaml() -> str:
    """One GPU time-sliced among 48 pods (one replica each), four processes per pod."""
    data = _header(
        f"Scaling point: 1 GPU time-sliced among {TIMESLICED_REPLICAS} pods", [{"nvlink_links": 0}]
    )
    for r in range(TIMESLICED_REPLICAS):
        device = {"nvidia.com/gpu.shared": [f"gpu0::{r}"]}
        procs = _container_processes(0, PROCESSES_PER_POD, TIMESLICED_REPLICAS)
        data["pods"].append(_pod(r, device, procs))
    return str(yaml.safe_dump(data, sort_keys=False))


def all_points() -> list[tuple[Point, str]]:
    """Every point of the full curve with its scenario text."""
    out = [
        (
            Point(f"{g}gpu-{p}p", "grid", g, p, math.ceil(p / processes_per_pod(g, p))),
            scenario_yaml(g, p),
        )
        for g in GRID_GPUS
        for p in GRID_PROCESSES
    ]
    mig_pods = 8 * len(MIG_1G_GPU_INSTANCE_IDS)
    out.append((Point("mig-8x7", "mig", 8, mig_pods * PROCESSES_PER_POD, mig_pods), mig_8x7_yaml()))
    out.append(
        (
            Point(
                f"timesliced-{TIMESLICED_REPLICAS}",
                "timesliced",
                1,
                TIMESLICED_REPLICAS * PROCESSES_PER_POD,
                TIMESLICED_REPLICAS,
            ),
            timesliced_48_yaml(),
        )
    )
    return out


def write_scenarios(points: list[tuple[Point, str]], directory: Path) -> dict[str, Path]:
    paths = {}
    for point, text in points:
        paths[point.name] = directory / f"scaling-{point.name}.yaml"
        paths[point.name].write_text(text)
    return paths


# -- measuring ---------------------------------------------------------------------------

_CYCLES = re.compile(rb"^gpu_exporter_sample_duration_seconds_count (\S+)$", re.M)


def _cycles_done(body: bytes) -> int:
    found = _CYCLES.search(body)
    return int(float(found.group(1))) if found else 0


def _series(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))


def verdict(point: dict[str, Any]) -> list[str]:
    """The targets this point misses (empty: all met)."""
    missed = []
    if point["cpu_ms_per_s"] > TARGET_CPU_MS_PER_S:
        missed.append("CPU")
    if point["rss_mib"] > TARGET_RSS_MIB:
        missed.append("RSS")
    for fmt in ("openmetrics", "text"):
        if point["scrape"][fmt]["ms"]["p99"] > TARGET_SCRAPE_P99_MS:
            missed.append(f"p99 {fmt}")
    return missed


def measure_point(name: str, scenario_path: Path, plan: Plan) -> dict[str, Any]:
    """Start the node and our exporter, warm up, then measure CPU (with OpenMetrics
    scraped every 5 s), RSS, scrape latency in both formats and the exposition size."""
    load = os.getloadavg()[0]
    started = time.monotonic()
    node = NodeServer(str(scenario_path))
    log: list[str] = []
    try:
        port = free_port()
        exporter = ExporterProcess(
            exporter_argv(node.dir, port, 1.0), port, ready_when=all_sources_up()
        )
        with running(exporter, log=log):
            ready_s = time.monotonic() - started
            # Every source is up (found by a text scrape at cycle c); from here on only
            # OpenMetrics is asked for, as Prometheus does, so after 10 cycles the text
            # format is no longer rendered every cycle.
            first = _cycles_done(get(port))
            while _cycles_done(get(port, headers=OPENMETRICS_ACCEPT)) < first + plan.warmup_cycles:
                time.sleep(0.25)
            pids = {"exporter": exporter.pid, "node": node.proc.pid}
            with PeriodicScraper(port, 5.0, OPENMETRICS_ACCEPT) as scraper:
                cpu = cpu_per_second(pids, plan.cpu_s)
            rss = memory_mib(exporter.pid)
            scrape = {
                "openmetrics": scrape_latencies(port, OPENMETRICS_ACCEPT, plan.scrapes, 0.01),
                "text": scrape_latencies(port, {}, plan.scrapes, 0.01),
            }
            body = get(port)
    finally:
        node.stop()
    result: dict[str, Any] = {
        "name": name,
        "load_average_1m_before": load,
        "ready_s": ready_s,
        "cpu_ms_per_s": cpu["exporter"]["cpu_ms_per_s"],
        "cpu_ms_per_s_stat": cpu["exporter"]["cpu_ms_per_s_stat"],
        "node_cpu_ms_per_s": cpu["node"]["cpu_ms_per_s"],
        "scrapes_during_cpu": scraper.scrapes,
        "rss_mib": rss["rss"],
        "memory_mib": rss,
        "scrape": scrape,
        "series": _series(body),
        "text_bytes": len(body),
        "openmetrics_bytes": scrape["openmetrics"]["body_bytes"],
        "exporter_stderr": log,
    }
    result["missed"] = verdict(result)
    return result


def _machine() -> dict[str, Any]:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    return {
        "line": machine_line(),
        "cores": cores(),
        "python": platform.python_version(),
        "kernel": platform.release(),
        "commit": commit,
    }


def nvml_calls_per_cycle(scenario_path: Path, cycles: int = 30) -> float:
    """NVML calls per cycle on this point's node, counted in-process at the simulated
    library (benchmarks/calls.py) in a process of its own, over one slow-tier period."""
    code = (
        "import asyncio, json, logging, sys; logging.disable(logging.WARNING); "
        f"sys.path[:0] = [{str(ROOT)!r}, {str(ROOT / 'benchmarks')!r}]; "
        "import calls; from exporter.sim.scenario import load_scenario; "
        f"r = asyncio.run(calls.count_calls(load_scenario({str(scenario_path)!r}), {cycles}, 1)); "
        "print(json.dumps(r['per_cycle']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def measure_curve(quick: bool) -> dict[str, Any]:
    """Every point (quick: four of them, shorter windows), one after another."""
    plan = QUICK if quick else FULL
    points = [(p, text) for p, text in all_points() if not quick or p.name in QUICK_POINTS]
    started = time.monotonic()
    results: dict[str, Any] = {
        "mode": "quick" if quick else "full",
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "plan": asdict(plan),
        "targets": {
            "cpu_ms_per_s": TARGET_CPU_MS_PER_S,
            "rss_mib": TARGET_RSS_MIB,
            "scrape_p99_ms": TARGET_SCRAPE_P99_MS,
        },
        "machine": _machine(),
        "points": [],
    }
    with tempfile.TemporaryDirectory(prefix="gpusim-scaling-") as tmp:
        paths = write_scenarios(points, Path(tmp))
        for i, (point, _) in enumerate(points, 1):
            print(f"[{i}/{len(points)}] {point.name}", flush=True)
            measured = measure_point(point.name, paths[point.name], plan)
            measured["nvml_calls_per_cycle"] = nvml_calls_per_cycle(paths[point.name])
            results["points"].append({**asdict(point), **measured})
    results["duration_s"] = time.monotonic() - started
    results["growth"] = growth(results["points"])
    return results


# -- reporting ---------------------------------------------------------------------------


def growth(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """CPU against processes on the grid, per GPU count (or across GPU counts where no
    count has two points, as in the quick run): the CPU ratio between the two largest
    process counts next to the process ratio, and a least-squares line a + b * n."""
    grid = [p for p in points if p["kind"] == "grid"]
    groups: dict[str, list[dict[str, Any]]] = {}
    for p in grid:
        groups.setdefault(f"{p['gpus']} GPU{'s' if p['gpus'] > 1 else ''}", []).append(p)
    if all(len(g) < 2 for g in groups.values()):
        groups = {"all GPU counts": grid} if len(grid) >= 2 else {}
    out = []
    for label, group in groups.items():
        if len(group) < 2:
            continue
        group = sorted(group, key=lambda p: p["processes"])
        n = [float(p["processes"]) for p in group]
        cpu = [float(p["cpu_ms_per_s"]) for p in group]
        mean_n, mean_c = sum(n) / len(n), sum(cpu) / len(cpu)
        slope = sum((x - mean_n) * (y - mean_c) for x, y in zip(n, cpu, strict=True)) / sum(
            (x - mean_n) ** 2 for x in n
        )
        lo, hi = group[-2], group[-1]
        cpu_ratio = hi["cpu_ms_per_s"] / lo["cpu_ms_per_s"]
        process_ratio = hi["processes"] / lo["processes"]
        out.append(
            {
                "group": label,
                "from": lo["name"],
                "to": hi["name"],
                "cpu_ratio": cpu_ratio,
                "process_ratio": process_ratio,
                "at_most_linear": cpu_ratio <= process_ratio,
                "fit_base_ms_per_s": mean_c - slope * mean_n,
                "fit_us_per_s_per_process": slope * 1000,
            }
        )
    return out


def curve_markdown(results: dict[str, Any]) -> str:
    """The table of points against the targets, and the growth lines."""
    t = results["targets"]
    lines = [
        f"# Scaling curve ({results['mode']} run)",
        "",
        f"Run {results['started']} in {results['duration_s']:.0f} s on "
        f"{results['machine']['line']} (commit {results['machine']['commit']}); "
        "regenerate with `python benchmarks/scaling.py`. Our exporter at `--interval 1` "
        "beside a simulated node in its own process; CPU over "
        f"{results['plan']['cpu_s']:g} s with OpenMetrics scraped every 5 s, "
        f"{results['plan']['scrapes']} scrapes per format 10 ms apart. Targets: CPU "
        f"≤ {t['cpu_ms_per_s']:g} ms/s, RSS ≤ {t['rss_mib']:g} MiB, scrape p99 "
        f"≤ {t['scrape_p99_ms']:g} ms.",
        "",
    ]
    if results["plan"]["warmup_cycles"] < KEEP_RENDERING_CYCLES:
        lines += [
            f"Warm-up of {results['plan']['warmup_cycles']} cycles, fewer than the "
            f"{KEEP_RENDERING_CYCLES} after which an unasked format stops being rendered: "
            "the CPU figures include rendering the text format every cycle too.",
            "",
        ]
    lines += [
        "| point | GPUs | processes | pods | series | NVML calls/cycle | CPU ms/s | RSS MiB "
        "| p99 OM ms | p99 text ms | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for p in results["points"]:
        missed = ", ".join(p["missed"])
        lines.append(
            f"| {p['name']} | {p['gpus']} | {p['processes']} | {p['pods']} | {p['series']} "
            f"| {p.get('nvml_calls_per_cycle', float('nan')):.0f} "
            f"| {p['cpu_ms_per_s']:.2f} | {p['rss_mib']:.1f} "
            f"| {p['scrape']['openmetrics']['ms']['p99']:.2f} "
            f"| {p['scrape']['text']['ms']['p99']:.2f} "
            f"| {'pass' if not missed else 'over: ' + missed} |"
        )
    lines.append("")
    for g in results["growth"]:
        word = "no faster than linear" if g["at_most_linear"] else "FASTER than linear"
        lines.append(
            f"- Growth, {g['group']}: CPU({g['to']}) / CPU({g['from']}) = "
            f"{g['cpu_ratio']:.2f} for {g['process_ratio']:g}x the processes: {word}; "
            f"least-squares fit {g['fit_base_ms_per_s']:.2f} ms/s + "
            f"{g['fit_us_per_s_per_process']:.1f} µs/s per process."
        )
    lines.append("")
    return "\n".join(lines)


def plot(results: dict[str, Any], path: Path) -> None:
    """CPU, RSS and scrape p99 against processes (log x), one line per GPU count; the
    MIG and time-sliced points as single markers; targets dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels: list[tuple[str, Callable[[dict[str, Any]], float], float]] = [
        ("CPU ms per second", lambda p: p["cpu_ms_per_s"], TARGET_CPU_MS_PER_S),
        ("RSS MiB", lambda p: p["rss_mib"], TARGET_RSS_MIB),
        (
            "scrape p99 ms (OpenMetrics)",
            lambda p: p["scrape"]["openmetrics"]["ms"]["p99"],
            TARGET_SCRAPE_P99_MS,
        ),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (title, value, target) in zip(axes, panels, strict=True):
        by_gpus: dict[int, list[dict[str, Any]]] = {}
        for p in results["points"]:
            if p["kind"] == "grid":
                by_gpus.setdefault(p["gpus"], []).append(p)
        for gpus, group in sorted(by_gpus.items()):
            group = sorted(group, key=lambda p: p["processes"])
            ax.plot(
                [p["processes"] for p in group],
                [value(p) for p in group],
                marker="o",
                label=f"{gpus} GPU{'s' if gpus > 1 else ''}",
            )
        for p in results["points"]:
            if p["kind"] != "grid":
                ax.plot(p["processes"], value(p), marker="s", linestyle="", label=p["name"])
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_xscale("log")
        ax.set_xlabel("GPU processes")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"gpu-occupancy-exporter scaling ({results['mode']} run, --interval 1)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="four points, short windows (~80 s)")
    args = parser.parse_args()
    results = measure_curve(args.quick)
    text = curve_markdown(results)
    print()
    print(text)
    for p in results["points"]:
        for line in p["exporter_stderr"]:
            print(f"{p['name']}: {line}")
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    stem = RESULTS_DIR / ("scaling-quick" if args.quick else "scaling")
    stem.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    stem.with_suffix(".md").write_text(text)
    plot(results, stem.with_suffix(".png"))
    print(f"wrote {stem.relative_to(ROOT)}.{{md,json,png}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
