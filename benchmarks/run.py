"""Performance harness for gpu-occupancy-exporter: whole-process cost beside a peer, how
cost grows with the node, and the sample cycle from inside.

1. whole process (benchmarks/whole_process.py): the simulated ``node-8gpu`` in its own
   process; our exporter and nvitop-exporter (or a second instance of ours) side by side at
   ``--interval 1``, each scraped every 5 s: CPU per second, idle floor, RSS, scrape
   latency in each format, /metrics size, and the ratios between the two;
2. scaling curve (benchmarks/scaling.py): 1/8/16 GPUs x 8/64/512 processes, 8 GPUs x 7 MIG
   instances and a 48-replica time-sliced GPU: CPU per second, RSS and scrape p99 each;
3. sample cycle (benchmarks/cycle.py): CPU and wall time of one cycle, in-process;
4. hardware-like NVML cost (benchmarks/hardware_cost.py): both exporters over the same
   simulated H200 nodes, at Python's NVML cost and with every call spending what it costs
   on an H200 (the ``h200`` cost profile), side by side.

Memory under churn is benchmarks/soak.py, run on its own (it takes tens of minutes).

Usage: ``python benchmarks/run.py [--quick] [--profile]``. Results are printed and
written to ``benchmarks/results/`` (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # run from a checkout without installing

import calls  # noqa: E402
import cycle  # noqa: E402
import hardware_cost  # noqa: E402
import memory_floor  # noqa: E402
import scaling  # noqa: E402
import whole_process  # noqa: E402
from machine import cores, cpu_model  # noqa: E402

from exporter import __version__  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"

# Targets the exporter is held to (benchmarks/README.md; a 2-core machine).
TARGET_CPU_MS_PER_S = 5.0  # whole process, node-8gpu, --interval 1
TARGET_IDLE_MS_PER_S = 1.0  # the NVML call budget's target (it was 0.3 before)
TARGET_RSS_MIB = 64.0
TARGET_SCRAPE_P99_MS = 2.0
TARGET_CYCLE_CPU_MS = 10.0
TARGET_CPU_RATIO = 3.0  # the peer's CPU over ours, at least
TARGET_SCRAPE_RATIO = 10.0  # the peer's scrape time over ours, at least
TARGET_RSS_RATIO = 2.0  # our RSS over the peer's, at most
# Unset, the exporter limits itself to 2 malloc arenas (exporter/allocator.py); the peer
# runs with glibc's default.
UNSET_ARENAS = "unset (ours: 2, by mallopt at start; the peer: glibc's default)"


class ErrorCounter(logging.Handler):
    """Counts ERROR records: a failed cycle is logged, not raised, by the agent."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


SECTIONS: dict[str, Callable[[Any], Coroutine[Any, Any, Any]]] = {
    "cycle": cycle.measure_cycles,
    "profile": cycle.profile_cycles,
    "simulator_share": cycle.simulator_share,
    "calls": calls.measure,
}


def run_section(name: str, plan: Any) -> Any:
    """Runs in a fresh process, so CPU figures carry nothing from other sections."""
    sys.path[:0] = [str(ROOT), str(HERE)]
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    errors = ErrorCounter()
    logging.getLogger().addHandler(errors)
    result = asyncio.run(SECTIONS[name](plan))
    if isinstance(result, dict):
        result["errors_logged"] = errors.count
    return result


def in_fresh_process(name: str, plan: Any) -> Any:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_section, name, plan).result()


# -- report ----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    """The machine line's parts (benchmarks/machine.py) and what else moves the figures."""
    try:
        commit = subprocess.run(
            ["git", "describe", "--always", "--dirty"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    packages = ("prometheus-client", "aiohttp", "grpcio", "protobuf", "kubernetes", "nvitop")
    versions = {}
    for name in packages:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {
        "cpu": cpu_model(),
        "cores": cores(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),  # glibc default when None
        "python": platform.python_version(),
        "exporter": __version__,
        "commit": commit,
        "packages": versions,
    }


@dataclass
class Row:
    figure: str
    value: float
    unit: str
    target: float | None = None  # None: informational
    at_least: bool = False  # the target is a lower bound
    verdict: str = field(init=False)

    def __post_init__(self) -> None:
        if self.target is None:
            self.verdict = "—"
        else:
            ok = self.value >= self.target if self.at_least else self.value <= self.target
            self.verdict = "pass" if ok else "FAIL"

    def cells(self) -> tuple[str, str, str, str]:
        bound = "≥" if self.at_least else "≤"
        target = "—" if self.target is None else f"{bound} {self.target:g}{self.unit_text}"
        return self.figure, f"{self.value:.2f}{self.unit_text}", target, self.verdict

    @property
    def unit_text(self) -> str:
        return "x" if self.unit == "x" else f" {self.unit}" if self.unit else ""


def process_rows(r: dict[str, Any]) -> list[Row]:
    peer = r["peer"]
    cpu, mem, scrapes = r["cpu"], r["memory"], r["scrapes"]
    ours_cpu, peer_cpu = cpu["ours"]["cpu_ms_per_s"], cpu["peer"]["cpu_ms_per_s"]
    out = [
        Row("CPU per second, whole process", ours_cpu, "ms", TARGET_CPU_MS_PER_S),
        Row(f"CPU per second, {peer}", peer_cpu, "ms"),
        Row(f"CPU: {peer} / ours", peer_cpu / ours_cpu, "x", TARGET_CPU_RATIO, at_least=True),
        Row(
            "idle floor between cycles (CPU per second)",
            r["idle"]["cpu_ms_per_s"],
            "ms",
            TARGET_IDLE_MS_PER_S,
        ),
        Row("RSS, whole process, every source on", mem["ours"]["rss"], "MiB", TARGET_RSS_MIB),
        Row("RSS: anonymous part", mem["ours"]["anon"], "MiB"),
        Row("RSS: file-backed part (shared libraries)", mem["ours"]["file"], "MiB"),
        Row(f"RSS, {peer}", mem["peer"]["rss"], "MiB"),
        Row(f"RSS: ours / {peer}", mem["ours"]["rss"] / mem["peer"]["rss"], "x", TARGET_RSS_RATIO),
    ]
    for fmt, scrape in scrapes["ours"].items():
        ms = scrape["ms"]
        what = f"scrape {fmt} ({scrape['body_bytes'] / 1024:.0f} KiB), {ms['n']} scrapes"
        out.append(Row(f"{what}: p50", ms["p50"], "ms"))
        out.append(Row(f"{what}: p99", ms["p99"], "ms", TARGET_SCRAPE_P99_MS))
    theirs, ours_text = scrapes["peer"]["text"], scrapes["ours"]["text"]
    what = f"scrape {peer} ({theirs['body_bytes'] / 1024:.0f} KiB), {theirs['ms']['n']} scrapes"
    out.append(Row(f"{what}: p50", theirs["ms"]["p50"], "ms"))
    out.append(Row(f"{what}: p99", theirs["ms"]["p99"], "ms"))
    for q in ("p50", "p99"):
        ratio = theirs["ms"][q] / ours_text["ms"][q]
        out.append(
            Row(f"scrape {q}: {peer} / ours (text)", ratio, "x", TARGET_SCRAPE_RATIO, at_least=True)
        )
    out.append(Row("series served, ours", r["series"]["ours"], ""))
    out.append(Row(f"series served, {peer}", r["series"]["peer"], ""))
    return out


def memory_rows(r: dict[str, Any]) -> list[Row]:
    """RSS beside the import floor (benchmarks/memory_floor.py)."""
    where = r["scenario"]
    floor, running = r["floor"], r["running"]
    started = floor["grpc_started"]
    return [
        Row(f"import floor: RSS of only the modules ours imported ({where})", floor["rss"], "MiB"),
        Row("import floor with gRPC core started (one PodResources round)", started["rss"], "MiB"),
        Row(f"RSS, whole process, {where}", running["rss"], "MiB"),
        Row(
            "RSS over the floor with gRPC core started",
            r["over_started_floor_mib"],
            "MiB",
            memory_floor.TARGET_OVER_FLOOR_MIB,
        ),
        Row("RSS over the import-only floor", r["over_floor_mib"], "MiB"),
        Row("anonymous RSS over the import-only floor's", r["anon_over_floor_mib"], "MiB"),
        Row("file-backed RSS over the import-only floor's", running["file"] - floor["file"], "MiB"),
    ]


def cycle_rows(r: dict[str, Any], simulator: dict[str, float]) -> list[Row]:
    out = [Row("share of the cycle in the simulated NVML library", 100 * simulator["share"], "%")]
    for fmt, cycles in r["by_format"].items():
        label = f"sample cycle in-process ({fmt} scraped), {cycles['cpu_ms']['n']} cycles"
        out.append(Row(f"{label}: CPU median", cycles["cpu_ms"]["p50"], "ms", TARGET_CYCLE_CPU_MS))
        out.append(Row(f"{label}: CPU mean", cycles["cpu_ms"]["mean"], "ms"))
        out.append(Row(f"{label}: CPU p99", cycles["cpu_ms"]["p99"], "ms"))
    return out


def calls_rows(r: dict[str, Any]) -> list[Row]:
    """NVML calls per cycle on node-8gpu (benchmarks/calls.py), against the figure before
    the cadence tiers: the number that carries over to a real driver."""
    before = r.get("before_per_cycle")
    target = None if before is None else calls.TARGET_SHARE * before
    what = "NVML calls per sample cycle" + ("" if before is None else f" (before: {before:.0f})")
    return [
        Row(what, r["per_cycle"], "", target),
        Row("NVML calls per cycle per GPU", r["per_gpu"], ""),
        Row(
            "NVML process-scaled calls per process on the node", r["process_calls_per_process"], ""
        ),
    ]


def table(rows_: list[Row]) -> str:
    header = ("figure", "value", "target", "result")
    cells = [header, *(r.cells() for r in rows_)]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(4)) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(results: dict[str, Any], rows_: list[Row], curve: str) -> str:
    m = results["machine"]
    packages = ", ".join(f"{k} {v}" for k, v in m["packages"].items())
    lines = [
        f"# Benchmark ({results['mode']} run)",
        "",
        f"Run {results['started']} in {results['duration_s']:.0f} s; "
        f"regenerate with `python benchmarks/run.py` (see benchmarks/README.md).",
        "",
        "| machine | |",
        "|---|---|",
        f"| CPU | {m['cpu']} |",
        f"| cores | {m['cores']} ({m['usable_cores']} usable) |",
        f"| memory | {m['memory_gib']} GiB |",
        f"| kernel | {m['kernel']} |",
        f"| MALLOC_ARENA_MAX | {m['malloc_arena_max'] or UNSET_ARENAS} |",
        f"| Python | {m['python']} |",
        f"| exporter | {m['exporter']} ({m['commit']}) |",
        f"| packages | {packages} |",
        "",
        "Whole process: `node-8gpu` simulated in its own process, each exporter loading only",
        "the simulated NVML library, `--interval 1`, scraped every 5 s.",
        "",
        "| figure | value | target | result |",
        "|---|---:|---|---|",
        *(f"| {' | '.join(r.cells())} |" for r in rows_),
        "",
        curve,
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (under 5 minutes)")
    parser.add_argument(
        "--profile", action="store_true", help="also print a cProfile of the sample cycle"
    )
    args = parser.parse_args()
    mode = "quick" if args.quick else "full"
    started = time.monotonic()
    now = datetime.now(UTC)
    results: dict[str, Any] = {
        "mode": mode,
        "started": now.isoformat(timespec="seconds"),
        "machine": machine(),
    }
    process_plan = whole_process.QUICK if args.quick else whole_process.FULL
    print(f"[1/4] whole process beside a peer ({mode} run)", flush=True)
    results["process"] = whole_process.measure(process_plan)
    print("[1/4] RSS beside the import floor, node-8gpu with churn", flush=True)
    results["memory_floor"] = memory_floor.measure(
        memory_floor.QUICK if args.quick else memory_floor.FULL
    )
    print("[2/4] scaling curve", flush=True)
    results["scaling"] = scaling.measure_curve(quick=args.quick)
    cycle_plan = cycle.QUICK if args.quick else cycle.FULL
    print(f"[3/4] sample cycle in-process over {cycle_plan.cycles} cycles", flush=True)
    results["cycle"] = in_fresh_process("cycle", cycle_plan)
    results["simulator_share"] = in_fresh_process("simulator_share", cycle_plan)
    results["calls"] = in_fresh_process("calls", None)
    print("[4/4] hardware-like NVML cost, both exporters over simulated H200s", flush=True)
    results["hardware_cost"] = hardware_cost.measure(
        hardware_cost.QUICK if args.quick else hardware_cost.FULL
    )
    if args.profile:
        print(in_fresh_process("profile", cycle_plan))
    results["duration_s"] = time.monotonic() - started

    rows_ = (
        process_rows(results["process"])
        + memory_rows(results["memory_floor"])
        + cycle_rows(results["cycle"], results["simulator_share"])
        + calls_rows(results["calls"])
        + [Row(*row) for row in hardware_cost.rows(results["hardware_cost"])]
    )
    results["verdicts"] = [asdict(r) for r in rows_]
    curve = scaling.curve_markdown(results["scaling"])
    curve += "\n\n" + hardware_cost.markdown(results["hardware_cost"]) + "\n"
    print()
    print(table(rows_))
    print()
    print(curve)
    errors = results["cycle"]["errors_logged"]
    for line in results["process"]["stderr"]:
        print(f"stderr: {line}")
    print(f"{errors} errors logged in-process; {results['duration_s']:.0f} s in all")

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    json_path = RESULTS_DIR / f"{now:%Y-%m-%d}{suffix}.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path = RESULTS_DIR / f"latest{suffix}.md"
    md_path.write_text(markdown(results, rows_, curve))
    plot_path = RESULTS_DIR / f"scaling{suffix}.png"
    scaling.plot(results["scaling"], plot_path)
    print(f"wrote {json_path.relative_to(ROOT)}, {md_path.relative_to(ROOT)}, {plot_path.name}")
    return 1 if errors else 0  # a missed target is a finding, not a failure to measure


if __name__ == "__main__":
    raise SystemExit(main())
