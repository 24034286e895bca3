"""Months of uptime in minutes: the exporter's memory, open files and threads under churn.

The agent runs in this process with only the simulated NVML library inside (as
libnvidia-ml is on a real node); the rest of the simulated node — proc tree, kernel log,
kubelet gRPC socket, API stand-in — runs in a process of its own (``NodeProcess``), on a
clock both share, so cycles can run faster than real time and what this process holds is
the exporter's. Each cycle moves the node one simulated second on, runs one sample cycle,
and takes the rendered bytes as a scrape would (both formats). PodResources is refreshed
every 10 cycles (its default 10 s at 1 s), and every 1,000 cycles the API stand-in drops
its event history, which makes both watches relist, as after an etcd compaction.

The churning node is ``node-8gpu`` plus the scenario's ``churn:`` block (sim/churn.py): a
new worker pid every cycle living 20 s, a pod ``churn/job-N`` created and deleted every
60 s, and GPU 5 lost and back every 600 s; the quiet node is ``node-8gpu`` alone.

Usage: ``python benchmarks/soak.py [--cycles N] [--quiet-cycles N] [--tracemalloc]``
(``benchmarks/run.py`` runs it too). Results are printed and written to
``benchmarks/results/soak.json`` and ``soak.md``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import linecache
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from exporter import allocator  # noqa: E402
from exporter.agent import Agent, build_agent  # noqa: E402
from exporter.config import parse_config  # noqa: E402
from exporter.exposition.server import OPENMETRICS, TEXT, MetricsCache  # noqa: E402
from exporter.sim.external import NodeProcess, attach  # noqa: E402
from exporter.sources.podresources.source import PodResourcesSource  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
TARGET_SLOPE_MIB = 0.01  # RSS growth per 1,000 cycles after warm-up
TARGET_SLOPE_COUNT = 0.01  # open fds and threads, the same
TARGET_CHURN_OVER_QUIET_MIB = 10.0
POD_RESOURCES_EVERY = 10
EXPIRE_HISTORY_EVERY = 1000
FLAP_GPU, FLAP_PERIOD_S = 5, 600
TRACE_FRAMES = 12
SOAK_BEGIN, SOAK_END = "<!-- soak:begin -->", "<!-- soak:end -->"


@dataclass(frozen=True)
class SoakPlan:
    cycles: int
    churn: bool
    sample_every: int = 100
    slope_from: int = 3000
    tracemalloc: bool = False


def scenario_file(directory: Path, plan: SoakPlan) -> Path:
    """node-8gpu, with churn for the whole run when the plan asks for it."""
    shipped = resources.files("exporter.sim").joinpath("scenarios/node-8gpu.yaml")
    data = yaml.safe_load(shipped.read_text(encoding="utf-8"))
    if plan.churn:
        data["churn"] = {
            "seconds": plan.cycles + 60,
            "gpu_flap": FLAP_GPU,
            "gpu_flap_period_s": FLAP_PERIOD_S,
        }
    path = directory / ("node-8gpu-churn.yaml" if plan.churn else "node-8gpu-quiet.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


def sample(cycle: int, agent: Agent) -> dict[str, Any]:
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    latest = agent.latest
    return {
        "cycle": cycle,
        "rss": int(fields["VmRSS"].split()[0]) / 1024,
        "anon": int(fields["RssAnon"].split()[0]) / 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "gc_objects": len(gc.get_objects()),
        "allocated_blocks": sys.getallocatedblocks(),
        "processes": len(latest.node.processes) if latest else 0,
        **{f"malloc_{k}_mib": v / 2**20 for k, v in (allocator.usage() or {}).items()},
    }


def slope_per_1000(samples: list[dict[str, Any]], key: str, start: int) -> float:
    tail = [s for s in samples if s["cycle"] >= start]
    if len(tail) < 3:
        return float("nan")
    fit = statistics.linear_regression([s["cycle"] for s in tail], [s[key] for s in tail])
    return fit.slope * 1000


def by_module(snapshot: tracemalloc.Snapshot, before: tracemalloc.Snapshot) -> list[list[Any]]:
    """Growth between two snapshots by where it was allocated (innermost frames of this
    project, else the innermost frame), largest first."""
    top = snapshot.compare_to(before, "traceback")[:15]
    linecache.clearcache()
    return [[_where(s.traceback), s.size_diff, s.count_diff] for s in top]


def _where(traceback: tracemalloc.Traceback) -> str:
    innermost_first = list(reversed(traceback))
    frames = [f"{Path(f.filename).name}:{f.lineno}" for f in innermost_first]
    ours = [
        f for f, raw in zip(frames, innermost_first, strict=True) if "/exporter/" in raw.filename
    ]
    return " < ".join((ours or frames)[:3])


async def soak(plan: SoakPlan) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        directory = Path(tmp)
        (directory / "node").mkdir()
        node = NodeProcess(str(scenario_file(directory, plan)), directory / "node")
        try:
            return await _soak(plan, node)
        finally:
            node.stop()


async def _soak(plan: SoakPlan, node: NodeProcess) -> dict[str, Any]:
    paths = attach(node.directory).paths
    assert paths.kubeconfig is not None
    config = parse_config([*paths.flags(), "--dcgm=off"], env={})
    wall_start = time.time()
    agent = build_agent(config, MetricsCache(), wall_clock=lambda: wall_start + node.clock())
    # Background threads, no refresh task: the loop below refreshes PodResources on the
    # simulated schedule, not the real one.
    for source in agent.sources:
        source.start()
    podresources = agent.source("podresources")
    assert isinstance(podresources, PodResourcesSource)
    samples: list[dict[str, Any]] = []
    tracemalloc_growth: list[list[Any]] = []
    before: tracemalloc.Snapshot | None = None
    started = time.monotonic()
    try:
        await asyncio.gather(*(s.prime(30.0) for s in agent.sources))
        for cycle in range(1, plan.cycles + 1):
            node.advance(1.0)
            await agent.cycle()
            for fmt in (TEXT, OPENMETRICS):  # a scrape of each format
                if agent.cache.cached(fmt) is None:
                    agent.cache.render_now(fmt)
            if cycle % POD_RESOURCES_EVERY == 0:
                await podresources.refresh()
            if cycle % EXPIRE_HISTORY_EVERY == 0:
                node.command("expire_history")
            if cycle % plan.sample_every == 0 or cycle == 1:
                samples.append(sample(cycle, agent))
            # Traced from half-way through warm-up, so both snapshots hold the live
            # working set (replaced every cycle) and their difference is what stayed.
            if plan.tracemalloc and cycle == plan.slope_from // 2:
                tracemalloc.start(TRACE_FRAMES)
            if plan.tracemalloc and cycle == plan.slope_from:
                before = tracemalloc.take_snapshot()
        if before is not None:
            tracemalloc_growth = by_module(tracemalloc.take_snapshot(), before)
            tracemalloc.stop()
        latest = agent.latest
        assert latest is not None
        down = [s.name for s in latest.node.sources if not s.up and s.name != "dcgm"]
    finally:
        await agent.close()
    elapsed = time.monotonic() - started
    end = samples[-1]
    return {
        "plan": asdict(plan),
        "seconds": elapsed,
        "cycles_per_s": plan.cycles / elapsed,
        "sources_down_at_end": down,
        "start": samples[0],
        "end": end,
        "max_processes": max(s["processes"] for s in samples),
        "slopes_per_1000_cycles": {
            key: slope_per_1000(samples, key, plan.slope_from)
            for key in (
                "rss",
                "anon",
                "fds",
                "threads",
                "gc_objects",
                "allocated_blocks",
                "malloc_in_use_mib",
                "malloc_free_mib",
            )
            if key in end
        },
        "fds_range_after_warmup": _range(samples, "fds", plan.slope_from),
        "threads_range_after_warmup": _range(samples, "threads", plan.slope_from),
        "tracemalloc_growth_by_file": tracemalloc_growth,
        "samples": samples,
    }


def _range(samples: list[dict[str, Any]], key: str, start: int) -> list[int]:
    values = [s[key] for s in samples if s["cycle"] >= start] or [samples[-1][key]]
    return [min(values), max(values)]


def _run(plan: SoakPlan) -> dict[str, Any]:
    allocator.limit_arenas()  # as the exporter's main() does, before threads start
    return asyncio.run(soak(plan))


def in_fresh_process(plan: SoakPlan) -> dict[str, Any]:
    """Each soak in a process of its own, so neither inherits the other's heap."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run, plan).result()


def rows(churn: dict[str, Any], quiet: dict[str, Any] | None) -> list[tuple[str, str, str, str]]:
    slopes = churn["slopes_per_1000_cycles"]
    start = churn["plan"]["slope_from"]
    n = churn["plan"]["cycles"]
    span = f"cycles {start:,}-{n:,}"
    out = [
        ("churning node: cycles", f"{n:,} ({churn['cycles_per_s']:.0f}/s)", "—", "—"),
        (
            "churning node: RSS at start / end",
            f"{churn['start']['rss']:.1f} / {churn['end']['rss']:.1f} MiB",
            "—",
            "—",
        ),
        (
            f"RSS growth per 1,000 cycles, {span}",
            f"{slopes['rss']:.4f} MiB",
            f"≤ {TARGET_SLOPE_MIB} MiB",
            _verdict(slopes["rss"] <= TARGET_SLOPE_MIB),
        ),
        (f"anonymous RSS growth per 1,000 cycles, {span}", f"{slopes['anon']:.4f} MiB", "—", "—"),
        (
            f"pymalloc blocks per 1,000 cycles, {span}",
            f"{slopes['allocated_blocks']:.1f}",
            "—",
            "—",
        ),
        (f"tracked objects per 1,000 cycles, {span}", f"{slopes['gc_objects']:.1f}", "—", "—"),
        *(
            (f"malloc {what} per 1,000 cycles, {span}", f"{slopes[key]:.4f} MiB", "—", "—")
            for what, key in (("in use", "malloc_in_use_mib"), ("held free", "malloc_free_mib"))
            if key in slopes
        ),
        *(
            (
                f"{what} per 1,000 cycles, {span} (min-max {low}-{high})",
                f"{slopes[key]:.4f}",
                f"≤ {TARGET_SLOPE_COUNT}",
                _verdict(abs(slopes[key]) <= TARGET_SLOPE_COUNT),
            )
            for what, key in (("open fds", "fds"), ("threads", "threads"))
            for low, high in [churn[f"{key}_range_after_warmup"]]
        ),
    ]
    if quiet is not None:
        over = churn["end"]["rss"] - quiet["end"]["rss"]
        out += [
            ("quiet node: RSS at end", f"{quiet['end']['rss']:.1f} MiB", "—", "—"),
            (
                "churning node's RSS over the quiet node's",
                f"{over:.1f} MiB",
                f"≤ {TARGET_CHURN_OVER_QUIET_MIB:g} MiB",
                _verdict(over <= TARGET_CHURN_OVER_QUIET_MIB),
            ),
        ]
    return out


def _verdict(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def markdown(results: dict[str, Any], machine: str) -> str:
    churn, quiet = results["churn"], results.get("quiet")
    lines = [
        "# Soak: node-8gpu with pid, container, pod and GPU churn",
        "",
        f"Run {results['started']} on {machine}; regenerate with "
        "`python benchmarks/soak.py` (see benchmarks/README.md).",
        "",
        "| figure | value | target | result |",
        "|---|---:|---|---|",
        *(f"| {' | '.join(r)} |" for r in rows(churn, quiet)),
        "",
    ]
    if churn["tracemalloc_growth_by_file"]:
        lines += ["Python allocations that grew after warm-up, by file (tracemalloc):", ""]
        lines += ["| file | bytes | blocks |", "|---|---:|---:|"]
        lines += [
            f"| {f} | {size:+,} | {count:+,} |"
            for f, size, count in churn["tracemalloc_growth_by_file"]
        ]
        lines.append("")
    return "\n".join(lines)


def machine_line() -> str:
    cpu = next(
        (
            line.partition(":")[2].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        "unknown CPU",
    )
    return f"{cpu}, {os.cpu_count()} cores, Python {sys.version.split()[0]}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cycles", type=int, default=100_000, help="cycles of the churning node (default 100,000)"
    )
    parser.add_argument(
        "--quiet-cycles",
        type=int,
        default=10_000,
        help="cycles of the quiet node (0: skip it; default 10,000)",
    )
    parser.add_argument(
        "--slope-from", type=int, default=3000, help="first cycle of the growth fit (default 3,000)"
    )
    parser.add_argument(
        "--tracemalloc",
        action="store_true",
        help="also list Python allocations that grew after warm-up, by file (slower)",
    )
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    churn = SoakPlan(
        args.cycles, churn=True, slope_from=args.slope_from, tracemalloc=args.tracemalloc
    )
    print(f"soak: churning node-8gpu for {churn.cycles:,} cycles", flush=True)
    results: dict[str, Any] = {"started": started, "churn": in_fresh_process(churn)}
    if args.quiet_cycles:
        quiet = SoakPlan(
            args.quiet_cycles, churn=False, slope_from=min(args.slope_from, args.quiet_cycles // 2)
        )
        print(f"soak: quiet node-8gpu for {quiet.cycles:,} cycles", flush=True)
        results["quiet"] = in_fresh_process(quiet)
    text = markdown(results, machine_line())
    print(text)
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    (RESULTS_DIR / "soak.json").write_text(json.dumps(results, indent=1) + "\n")
    (RESULTS_DIR / "soak.md").write_text(text)
    if args.cycles >= 100_000:  # the recorded long form: its summary goes in the docs
        _into_doc(text)
    return 0


def _into_doc(text: str) -> None:
    """The soak's table into docs/reliability.md, between its markers."""
    doc = ROOT / "docs" / "reliability.md"
    body = text.split("\n", 2)[2].strip()  # without the title
    head, _, rest = doc.read_text().partition(SOAK_BEGIN)
    _, _, tail = rest.partition(SOAK_END)
    doc.write_text(f"{head}{SOAK_BEGIN}\n{body}\n{SOAK_END}{tail}")
    print(f"wrote {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    raise SystemExit(main())
