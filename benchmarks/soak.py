"""Hours of uptime in minutes: the exporter's memory, open files and threads under churn.

The agent runs in this process with only the simulated NVML library inside (as
libnvidia-ml is on a real node); the rest of the simulated node — proc tree, kernel log,
kubelet gRPC socket, API stand-in — runs in a process of its own (``NodeProcess``), on a
clock both share, so cycles can run faster than real time and what this process holds is
the exporter's. Every source the exporter runs on a node is on, the kernel-log reader
(``--kmsg``, fed by the simulator's kernel log) included, and the exporter's own HTTP
server (``build_app`` + ``start_server``, as ``cli.serve`` starts it) serves ``/metrics``.
Each cycle moves the node one simulated second on and runs one sample cycle; every
``SCRAPE_EVERY`` cycles a client scrapes ``/metrics`` over TCP, as text, OpenMetrics and
gzip-compressed OpenMetrics in turn, on a kept-alive connection replaced every
``SCRAPES_PER_CONNECTION`` scrapes. PodResources is refreshed every 10 cycles (its default
10 s at 1 s), and every 1,000 cycles the API stand-in drops its event history, which makes
both watches relist, as after an etcd compaction.

The churning node is ``node-8gpu`` plus the scenario's ``churn:`` block (sim/churn.py): a
new worker pid every cycle living 20 s, a pod ``churn/job-N`` created and deleted every
60 s, and GPU 5 lost and back every 600 s; the quiet node is ``node-8gpu`` alone.

``growth_failures`` is the verdict both forms apply over samples a whole churn period
apart: open files, threads, tracked objects and anonymous RSS from the first to the last,
pymalloc blocks by their trend over all of them.
``SoakPlan.leak`` (``--leak``) makes the driver itself keep one float per churned pid, a
leak ``gc.get_objects()`` cannot see, to show that the verdict catches it.

Usage: ``python benchmarks/soak.py [--cycles N] [--quiet-cycles N] [--tracemalloc]
[--record] [--leak]``, on its own (``benchmarks/run.py`` does not run it: it takes tens of
minutes). Results are printed and written to ``benchmarks/results/soak.json`` and
``soak.md``; ``--record`` also writes the table into docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import gzip
import json
import linecache
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Iterable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]  # run from a checkout without installing

from machine import machine_line  # noqa: E402

from exporter import allocator  # noqa: E402
from exporter.agent import Agent, build_agent  # noqa: E402
from exporter.config import parse_config  # noqa: E402
from exporter.exposition.server import (  # noqa: E402
    MetricsCache,
    bound_port,
    build_app,
    start_server,
)
from exporter.sim.external import NodeProcess, attach  # noqa: E402
from exporter.sources.kmsg import KmsgReader  # noqa: E402
from exporter.sources.podresources.source import PodResourcesSource  # noqa: E402
from exporter.sources.xid import XidListener  # noqa: E402

RESULTS_DIR = ROOT / "benchmarks" / "results"
TARGET_SLOPE_MIB = 0.01  # RSS growth per 1,000 cycles after warm-up
TARGET_SLOPE_COUNT = 0.01  # open fds and threads, the same
TARGET_CHURN_OVER_QUIET_MIB = 10.0
POD_RESOURCES_EVERY = 10
EXPIRE_HISTORY_EVERY = 1000
FLAP_GPU, FLAP_PERIOD_S = 5, 600
TRACE_FRAMES = 30
KMSG_WAIT_POLLS = 500  # 10 ms each: how long the driver waits for the kernel-log reader
LISTENER_WAIT_POLLS = 100  # and then for the NVML event listener
SCRAPE_EVERY = 5  # cycles: a 5 s scrape interval at --interval 1
SCRAPES_PER_CONNECTION = 20
PROMETHEUS_ACCEPT = (  # what Prometheus 2.x sends
    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;"
    "q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1"
)
SCRAPES = (  # (kind, Accept, Accept-Encoding), taken in turn
    ("text", "*/*", "identity"),
    ("openmetrics", PROMETHEUS_ACCEPT, "identity"),
    ("gzip", PROMETHEUS_ACCEPT, "gzip"),
)
# The verdict between two samples a churn period apart (growth_failures). Leaks are per
# churned thing, and a period churns FLAP_PERIOD_S pids: one pymalloc block kept per pid
# would add that many blocks, twice the ceiling. Measured between period-aligned samples
# (docs/reliability.md): blocks move by a few hundred, anonymous RSS by under 1 MiB.
MAX_BLOCKS_PER_PERIOD = FLAP_PERIOD_S // 2
MAX_GC_OBJECTS_PER_PERIOD = FLAP_PERIOD_S // 2
MAX_ANON_MIB_PER_PERIOD = 2.0
MAX_HANDLES_IN_FLIGHT = 1  # an fd or thread of a relist or refresh under way at a sample
# Open fds: the soak's scraper runs in the measured process, so its connection counts twice
# (client and server end, consecutive socket inodes); one replaced around a sample (a new
# connection every SCRAPES_PER_CONNECTION scrapes, the old one's server end closing a moment
# later) is +2 with nothing leaked (tests/test_soak.py failed once so, 28 -> 30). A leak per
# churned pid, pod or refresh adds tens to hundreds a period; a slower one shows in the long
# soak's slope (TARGET_SLOPE_COUNT).
MAX_FDS_IN_FLIGHT = 2
MAX_COLLECTIONS = 5  # per sample, until the tracked count stops falling (tracked_objects)
# pymalloc blocks per sample: the median of this many readings this far apart
# (steady_blocks), so work in flight in the watch and writer threads does not count.
BLOCK_READINGS, BLOCK_READING_GAP_S = 20, 0.1
SOAK_BEGIN, SOAK_END = "<!-- soak:begin -->", "<!-- soak:end -->"


@dataclass(frozen=True)
class SoakPlan:
    cycles: int
    churn: bool
    sample_every: int = 100
    slope_from: int = 3000
    tracemalloc: bool = False
    leak: bool = False  # the driver keeps one float per churned pid (LeakyHolder)


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


def tracked_objects() -> int:
    """Objects the collector tracks once collections have settled: it collects until the
    count stops falling (at most ``MAX_COLLECTIONS``). One collection is not enough: the
    collector lets go of a tuple of atomic values only when a collection finds its items
    untracked, which for nested tuples can take one collection per level. The renderer's
    series keys, ``(name, ((label, value), ...))`` made anew at each render, one per served
    series, are such tuples: after one collection anywhere from ~250 to ~1,480 of them were
    still counted, depending on how many automatic collections (paced by every thread's
    allocations) had run since the last render: +1,108 between two samples in CI, with
    nothing more alive."""
    gc.collect()
    count = len(gc.get_objects())
    for _ in range(MAX_COLLECTIONS - 1):
        gc.collect()
        settled = len(gc.get_objects())
        if settled >= count:
            break
        count = settled
    return count


def period_aligned(cycle: int) -> bool:
    """Whether a sample at ``cycle`` is one the ceilings compare (``growth_failures``): at
    the same point of every churn period, so it reads pymalloc blocks steadily."""
    return cycle % FLAP_PERIOD_S == 0


def steady_blocks() -> int:
    """pymalloc blocks as the median of ``BLOCK_READINGS`` readings ``BLOCK_READING_GAP_S``
    apart, no cycle running. One reading also counts what the Kubernetes watch and writer
    threads hold for a moment (an event being decoded, a reconnect, a relist or a write
    under way), or lacks what a relist has dropped and not yet rebuilt: single readings of
    the same served state differed by ~600 blocks either way under load (+606 between
    period-aligned samples in fresh-clone CI, 2026-11-26; -657 beside two busy loops),
    as much as the ceiling of two periods, and the least of several readings undershot
    as far (-552, -649). The median over 2 s is the state most of the window held. What
    the exporter keeps is in every reading, so the median still counts it
    (tests/test_soak.py's leak test)."""
    readings = []
    for _ in range(BLOCK_READINGS):
        readings.append(sys.getallocatedblocks())
        time.sleep(BLOCK_READING_GAP_S)
    return int(statistics.median_low(readings))


def measure(*, steady: bool = True) -> dict[str, Any]:
    """What this process holds: resident and anonymous memory (MiB), open files, threads,
    objects the collector tracks, and pymalloc blocks, which also count what the
    collector does not track (ints, floats, strings held in a dict), after collections
    (``tracked_objects``) so that cyclic garbage waiting for one, and tuples waiting to be
    untracked, do not count; pymalloc blocks as ``steady_blocks`` reads them, or one
    reading where not ``steady`` (samples between the period-aligned ones, which only the
    slopes read: 2 s each would add half an hour to the long soak)."""
    gc_objects = tracked_objects()
    status = Path("/proc/self/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss": int(fields["VmRSS"].split()[0]) / 1024,
        "anon": int(fields["RssAnon"].split()[0]) / 1024,
        "fds": len(os.listdir("/proc/self/fd")),
        "threads": len(os.listdir("/proc/self/task")),
        "gc_objects": gc_objects,
        "allocated_blocks": steady_blocks() if steady else sys.getallocatedblocks(),
        **{f"malloc_{k}_mib": v / 2**20 for k, v in (allocator.usage() or {}).items()},
    }


def render_every_format(agent: Agent) -> None:
    """Render text and OpenMetrics from the latest cycle (``MetricsCache.render_afresh``).

    Each format keeps the families of its own last render (exporter/exposition/
    render.py), and a format renders only when a request is expected (scrape_demand.py):
    whether one last rendered this cycle or several cycles ago, so holding a second set
    of families, would depend on timing. After this every format holds the current
    output's families, and a measurement holds exactly one set.

    Then both formats are rendered once more from nothing (``Renderer.forget``), so the
    renderer's series names hold every served series. It keeps the names of the series of
    the families it wrote anew in its last render, not of those it reused unchanged, so
    how many it held depended on which families changed since that format's last render,
    which the cache's demand decides on real time: 489 to 625 names at period-aligned
    samples of the same served state (~8 pymalloc blocks each: a key, its label tuples,
    the name): +671 blocks between the first two samples of a loaded run with nothing
    leaked, as much as the +637 on which fresh-clone CI once failed the short form
    (2026-11-28)."""
    agent.cache.render_afresh()


def sample(cycle: int, agent: Agent, scraper: Scraper) -> dict[str, Any]:
    """``measure()`` and the cycle's facts. ``gc_objects`` leaves out the objects of the
    current output: its families are rebuilt every cycle, and their size follows the
    pods alive at that moment (a churned pod brings its ledger, energy and owner series,
    ~2 tracked objects a series: a sample and its labels), which is churn, not growth."""
    latest = agent.latest
    render_every_format(agent)
    measured = measure(steady=period_aligned(cycle))
    served = sum(1 + 2 * len(family.samples) for family in agent.collector.collect())
    return {
        "cycle": cycle,
        **measured,
        "gc_objects": measured["gc_objects"] - served,
        "served_series": sum(len(family.samples) for family in agent.collector.collect()),
        "processes": len(latest.node.processes) if latest else 0,
        "scrapes": scraper.scrapes,
    }


def growth_failures(samples: list[dict[str, Any]]) -> list[str]:
    """What grew past its ceiling over ``samples``, period-aligned ones in cycle order (empty
    when nothing did): one line per figure, with its first and last values.

    pymalloc blocks are judged by their trend, the Theil-Sen slope (the median of the
    slopes between every pair of samples, per period), not by last minus first: the blocks
    held at one point of the churn move by a few hundred either way with what happens to
    be alive then (in a 10-period run on the 2-core VM: +640 over two periods, -1,900 over
    one, and no trend), so one difference failed the short form now and then under load
    (+637 over two periods against a ceiling of 600), while a leak per churned thing grows
    every period and keeps its slope. With two samples the slope is their difference. The
    other figures compare the first and the last sample."""
    first, last = samples[0], samples[-1]
    periods = (last["cycle"] - first["cycle"]) / FLAP_PERIOD_S
    ceilings = {
        "allocated_blocks": MAX_BLOCKS_PER_PERIOD,
        "gc_objects": MAX_GC_OBJECTS_PER_PERIOD * periods,
        "anon": MAX_ANON_MIB_PER_PERIOD * periods,
        "fds": MAX_FDS_IN_FLIGHT,
        "threads": MAX_HANDLES_IN_FLIGHT,
    }
    growth = {key: last[key] - first[key] for key in ceilings}
    growth["allocated_blocks"] = blocks_per_period(samples)
    return [
        f"{key}: {first[key]:g} -> {last[key]:g} (+{last[key] - first[key]:g}"
        + (f", {growth[key]:+.0f} a period by trend" if key == "allocated_blocks" else "")
        + f", at most +{ceiling:g}"
        + (" a period" if key == "allocated_blocks" else f" over {periods:g} period(s)")
        + ")"
        for key, ceiling in ceilings.items()
        if growth[key] > ceiling
    ]


def blocks_per_period(samples: list[dict[str, Any]]) -> float:
    """pymalloc blocks gained per churn period: the Theil-Sen slope of ``samples``."""
    slopes: list[float] = [
        (b["allocated_blocks"] - a["allocated_blocks"]) * FLAP_PERIOD_S / (b["cycle"] - a["cycle"])
        for i, a in enumerate(samples)
        for b in samples[i + 1 :]
    ]
    return statistics.median(slopes)


class SampleLog:
    """The samples, in a file until the run ends: kept in a list they would be what grows
    (a dict, its floats and large ints: ~12 pymalloc blocks a sample, ~120 per 1,000
    cycles at one sample per 100, which is what the soak once reported as the exporter's
    growth; docs/reliability.md)."""

    def __init__(self, path: Path) -> None:
        self._file = path.open("w", encoding="utf-8")

    def append(self, sample: dict[str, Any]) -> None:
        self._file.write(json.dumps(sample) + "\n")
        self._file.flush()

    def read(self) -> list[dict[str, Any]]:
        self._file.close()
        with Path(self._file.name).open(encoding="utf-8") as f:
            return [json.loads(line) for line in f]


class LeakyHolder:
    """A deliberate leak for ``SoakPlan.leak``: one float per pid the exporter has seen,
    held in a dict and never dropped, as a per-pid cache without eviction would be. It
    lives in the driver, not in the exporter, and is what ``gc.get_objects()`` misses."""

    def __init__(self) -> None:
        self.held: dict[int, float] = {}

    def keep(self, pids: Iterable[int]) -> None:
        for pid in pids:
            self.held.setdefault(pid, float(pid))


class Scraper:
    """A Prometheus-like client of the exporter's HTTP server: one GET /metrics per call,
    on a kept-alive connection replaced every ``SCRAPES_PER_CONNECTION`` scrapes, the
    response read whole (Content-Length) and checked."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.scrapes = 0
        self.body_bytes: dict[str, int] = {}
        self._streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None

    async def scrape(self) -> None:
        kind, accept, encoding = SCRAPES[self.scrapes % len(SCRAPES)]
        if self._streams is None or self.scrapes % SCRAPES_PER_CONNECTION == 0:
            await self.close()
            self._streams = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = self._streams
        writer.write(
            f"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1:{self.port}\r\nAccept: {accept}\r\n"
            f"Accept-Encoding: {encoding}\r\nUser-Agent: soak\r\n\r\n".encode()
        )
        status = await reader.readline()
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        if not status.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"soak scrape ({kind}): {status!r}")
        if kind == "gzip":
            body = gzip.decompress(body)
        if not body.startswith(b"# HELP"):
            raise RuntimeError(f"soak scrape ({kind}): the body starts {body[:40]!r}")
        self.body_bytes[kind] = len(body)
        self.scrapes += 1

    async def close(self) -> None:
        if self._streams is not None:
            writer = self._streams[1]
            self._streams = None
            writer.close()
            await writer.wait_closed()


def slope_per_1000(samples: list[dict[str, Any]], key: str, start: int) -> float:
    tail = [s for s in samples if s["cycle"] >= start]
    if len(tail) < 3:
        return float("nan")
    fit = statistics.linear_regression([s["cycle"] for s in tail], [s[key] for s in tail])
    return fit.slope * 1000


def growing_in_both_halves(snapshots: list[tracemalloc.Snapshot]) -> list[list[Any]]:
    """Allocation sites (whole tracebacks) whose live blocks grew over both halves of the
    traced span, most blocks first: a steady leak grows in both, a replaced working set
    (a relist's objects, a cycle's strings) moves up in one and down in the other."""
    first, half, last = snapshots
    early = {s.traceback: s.count_diff for s in half.compare_to(first, "traceback")}
    both = [
        (s.traceback, early.get(s.traceback, 0), s.count_diff, s.size_diff)
        for s in last.compare_to(half, "traceback")
        if s.count_diff > 0 and early.get(s.traceback, 0) > 0
    ]
    both.sort(key=lambda row: -(row[1] + row[2]))
    linecache.clearcache()
    return [[_where(tb), a, b, size] for tb, a, b, size in both[:15]]


def _where(traceback: tracemalloc.Traceback) -> str:
    innermost_first = list(reversed(traceback))
    frames = [f"{Path(f.filename).name}:{f.lineno}" for f in innermost_first]
    ours = [
        f for f, raw in zip(frames, innermost_first, strict=True) if "/exporter/" in raw.filename
    ]
    return " < ".join(frames[:2] + [f for f in ours[:3] if f not in frames[:2]])


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
    attached = attach(node.directory)
    paths = attached.paths
    assert paths.kubeconfig is not None
    config = parse_config([*paths.flags(), "--dcgm=off", "--kmsg"], env={})
    wall_start = time.time()
    cache = MetricsCache()
    # The simulated clock paces the Events' windows too: a soak runs hours of node time
    # in minutes, and the recorder must forget old Events on that schedule.
    agent = build_agent(
        config, cache, wall_clock=lambda: wall_start + node.clock(), monotonic=node.clock
    )
    runner = await start_server(
        build_app(cache, config.node_name),
        "127.0.0.1",
        0,
        header_timeout_s=config.http_header_timeout_s,
        max_connections=config.http_max_connections,
    )
    scraper = Scraper(bound_port(runner))
    leak = LeakyHolder() if plan.leak else None
    # Background threads, no refresh task: the loop below refreshes PodResources on the
    # simulated schedule, not the real one.
    for source in agent.sources:
        source.start()
    if agent.reporter is not None:  # Events to the API stand-in, from their own thread
        agent.reporter.start()
    podresources = agent.source("podresources")
    assert isinstance(podresources, PodResourcesSource)
    kmsg = agent.source("kmsg")
    assert isinstance(kmsg, KmsgReader)
    listener = agent.source("xid")
    assert isinstance(listener, XidListener)
    samples = SampleLog(node.directory.parent / "samples.jsonl")
    snapshots: list[tracemalloc.Snapshot] = []
    half_way = plan.slope_from + (plan.cycles - plan.slope_from) // 2
    started = time.monotonic()
    try:
        await asyncio.gather(*(s.prime(30.0) for s in agent.sources))
        for cycle in range(1, plan.cycles + 1):
            # Counted before the advance: the listener's thread syncs the simulated library
            # on its own, so an XID of this second may be there before the cycle starts.
            raised = len(attached.library.node.xids)
            node.advance(1.0)
            await agent.cycle()
            if len(attached.library.node.xids) > raised:
                await xid_readers_caught_up(kmsg, listener, len(attached.library.node.xids))
            if cycle % SCRAPE_EVERY == 0:
                await scraper.scrape()
            if leak is not None and agent.latest is not None:
                leak.keep(p.pid for p in agent.latest.node.processes)
            # Sampled before this cycle's refresh: gRPC core's threads end a moment after
            # a refresh closes its channel, and a sample taken then counted two of them
            # (threads 11 -> 13, fresh-clone CI under load).
            if cycle % plan.sample_every == 0 or cycle == 1:
                samples.append(sample(cycle, agent, scraper))
            if cycle % POD_RESOURCES_EVERY == 0:
                await podresources.refresh()
            if cycle % EXPIRE_HISTORY_EVERY == 0:
                node.command("expire_history")
            # Traced from half-way through warm-up, so every snapshot holds the live
            # working set (replaced every cycle) and their differences are what stayed.
            if plan.tracemalloc and cycle == plan.slope_from // 2:
                tracemalloc.start(TRACE_FRAMES)
            if plan.tracemalloc and cycle in (plan.slope_from, half_way, plan.cycles):
                render_every_format(agent)
                gc.collect()
                snapshots.append(tracemalloc.take_snapshot())
        tracemalloc.stop()
        final = await scraper_counts(scraper)
        latest = agent.latest
        assert latest is not None
        down = [s.name for s in latest.node.sources if not s.up and s.name != "dcgm"]
    finally:
        await scraper.close()
        await runner.cleanup()
        await agent.close()
    elapsed = time.monotonic() - started
    return _summary(plan, samples.read(), elapsed, down, scraper, final, snapshots)


def _summary(
    plan: SoakPlan,
    samples: list[dict[str, Any]],
    elapsed: float,
    down: list[str],
    scraper: Scraper,
    final: dict[str, float],
    snapshots: list[tracemalloc.Snapshot],
) -> dict[str, Any]:
    end = samples[-1]
    return {
        "plan": asdict(plan),
        "seconds": elapsed,
        "cycles_per_s": plan.cycles / elapsed,
        "sources_down_at_end": down,
        "scrapes": scraper.scrapes,
        "scraped_bytes": scraper.body_bytes,
        "xids_at_end": final,
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
        "tracemalloc_growth": growing_in_both_halves(snapshots) if len(snapshots) == 3 else [],
        "samples": samples,
    }


async def xid_readers_caught_up(kmsg: KmsgReader, listener: XidListener, xids: int) -> None:
    """Wait (real time, simulated time standing still) until the kernel-log reader and
    the NVML event listener have taken the XIDs the node raised. Each stamps an XID when
    it takes it, and each runs on real time: the reader polls its file every 0.5 s
    (exporter/sources/kmsg.py, ``poll_interval_s``), the listener waits on NVML's event
    set in its own thread, and either can fall behind by tens of simulated seconds at the
    soak's pace, more on a loaded machine (one CI run counted GPU 7's XID twice). Without
    the wait one copy would be stamped past the ledger's 5 s window for matching it with
    the other, and counted twice, which at one cycle a second cannot happen. The reader
    takes every XID (up to ``KMSG_WAIT_POLLS`` polls); the listener not those of a GPU
    lost before it registered, so it gets at most ``LISTENER_WAIT_POLLS`` more."""
    for _ in range(KMSG_WAIT_POLLS):
        if kmsg.events_total >= xids:  # every XID the node raised, its backlog included
            break
        await asyncio.sleep(0.01)
    for _ in range(LISTENER_WAIT_POLLS):
        if listener.events_total >= xids:
            return
        await asyncio.sleep(0.01)


async def scraper_counts(scraper: Scraper) -> dict[str, float]:
    """XIDs served at the end (text format) by GPU and code: the kernel log's and
    NVML's XIDs reached the exposition through the ledger, each counted once."""
    reader, writer = await asyncio.open_connection("127.0.0.1", scraper.port)
    try:
        writer.write(b"GET /metrics HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n")
        raw = await reader.read()
    finally:
        writer.close()
    counts: dict[str, float] = {}
    for line in raw.decode().splitlines():
        if line.startswith(("gpu_xid_errors_total{", "gpu_xid_errors_before_start{")):
            series, _, value = line.rpartition(" ")
            name, _, labels = series.partition("{")
            pairs = dict(p.split("=", 1) for p in labels.rstrip("}").split(","))
            counts[f"{name}{{gpu={pairs['gpu']},xid={pairs['xid']}}}"] = float(value)
    return counts


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
                _verdict(slopes[key] <= TARGET_SLOPE_COUNT),  # growth: fewer is no failure,
            )
            for what, key in (("open fds", "fds"), ("threads", "threads"))
            for low, high in [churn[f"{key}_range_after_warmup"]]
        ),
        *_verdict_row(churn),
        (
            "scrapes over HTTP (text, OpenMetrics, gzip in turn), bytes of each",
            f"{churn['scrapes']:,}: "
            + ", ".join(f"{b / 1024:.0f} KiB" for b in churn["scraped_bytes"].values()),
            "—",
            "—",
        ),
        (
            "XIDs served at the end (NVML event set + kernel log)",
            ", ".join(f"{k} {v:g}" for k, v in sorted(churn["xids_at_end"].items())) or "none",
            "—",
            "—",
        ),
    ]
    if quiet is not None:
        over = churn["end"]["rss"] - quiet["end"]["rss"]
        out += [
            ("quiet node: RSS at end", f"{quiet['end']['rss']:.1f} MiB", "—", "—"),
            (
                f"quiet node: pymalloc blocks per 1,000 cycles, cycles "
                f"{quiet['plan']['slope_from']:,}-{quiet['plan']['cycles']:,}",
                f"{quiet['slopes_per_1000_cycles']['allocated_blocks']:.1f}",
                "—",
                "—",
            ),
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


def _verdict_row(churn: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """The short form's verdict (``growth_failures``) between the first sample a whole
    churn period after warm-up and the last one at the same point of the period."""
    aligned = [
        s
        for s in churn["samples"]
        if period_aligned(s["cycle"]) and s["cycle"] >= churn["plan"]["slope_from"]
    ]
    if len(aligned) < 2:
        return []
    first, last = aligned[0], aligned[-1]
    failed = growth_failures(aligned)
    return [
        (
            f"blocks, objects, anonymous RSS, fds, threads, cycles {first['cycle']:,}-"
            f"{last['cycle']:,} (tests/test_soak.py's ceilings)",
            "; ".join(failed)
            or f"+{last['allocated_blocks'] - first['allocated_blocks']:,} "
            f"blocks, {last['anon'] - first['anon']:+.1f} MiB anonymous",
            f"≤ {MAX_BLOCKS_PER_PERIOD} blocks (trend), {MAX_ANON_MIB_PER_PERIOD:g} MiB per period",
            _verdict(not failed),
        )
    ]


def markdown(results: dict[str, Any], machine: str) -> str:
    churn, quiet = results["churn"], results.get("quiet")
    quiet_cycles = quiet["plan"]["cycles"] if quiet else 0
    lines = [
        "# Soak: node-8gpu with pid, container, pod and GPU churn",
        "",
        f"Run {results['started']} on {machine}; regenerate with `python benchmarks/soak.py "
        f"--cycles {churn['plan']['cycles']} --quiet-cycles {quiet_cycles}"
        " --record` (see benchmarks/README.md).",
        "",
        "| figure | value | target | result |",
        "|---|---:|---|---|",
        *(f"| {' | '.join(r)} |" for r in rows(churn, quiet)),
        "",
    ]
    if churn["tracemalloc_growth"]:
        start, n = churn["plan"]["slope_from"], churn["plan"]["cycles"]
        half = start + (n - start) // 2
        lines += [
            f"Python allocations whose live blocks grew over both cycles {start:,}-{half:,} "
            f"and {half:,}-{n:,} (tracemalloc, innermost frames first):",
            "",
            "| where | blocks, first half | blocks, second half | bytes, second half |",
            "|---|---:|---:|---:|",
        ]
        lines += [
            f"| {where} | {a:+,} | {b:+,} | {size:+,} |"
            for where, a, b, size in churn["tracemalloc_growth"]
        ]
        lines.append("")
    return "\n".join(lines)


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
        help="also list Python allocations that grew in both halves after warm-up (slower)",
    )
    parser.add_argument(
        "--leak",
        action="store_true",
        help="keep one float per churned pid in the driver, to see the verdict fail",
    )
    parser.add_argument(
        "--record", action="store_true", help="write the table into docs/reliability.md"
    )
    args = parser.parse_args()
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    churn = SoakPlan(
        args.cycles,
        churn=True,
        slope_from=args.slope_from,
        tracemalloc=args.tracemalloc,
        leak=args.leak,
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
    if args.record:
        _into_doc(text)
    return 0


def _into_doc(text: str) -> None:
    """The soak's table into docs/reliability.md, between its markers."""
    doc = ROOT / "docs" / "reliability.md"
    body = text.split("\n", 2)[2].strip()  # without the title
    text = doc.read_text()
    old = text.partition(SOAK_BEGIN)[2].partition(SOAK_END)[0]
    doc.write_text(
        text.replace(f"{SOAK_BEGIN}{old}{SOAK_END}", f"{SOAK_BEGIN}\n{body}\n{SOAK_END}")
    )
    print(f"wrote {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    raise SystemExit(main())
