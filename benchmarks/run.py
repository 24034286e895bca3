"""Performance harness for gpu-occupancy-exporter on the simulated ``node-8gpu`` node.

Measures, against the targets from the issue (2-core machine):

1. scrape latency of ``/metrics`` (text, gzip, OpenMetrics), from a separate process
   over one keep-alive connection, against ``python -m exporter --simulate node-8gpu``;
2. wall and CPU time of one sample cycle, with the agent run in-process on the
   simulated node and a manual clock (every source on: NVML, procfs, PodResources
   gRPC, the XID listener, the Kubernetes API watch);
3. resident memory over a long run with pids and pods churning, and the RSS of a bare
   exporter process with and without the Kubernetes API.

Usage: ``python benchmarks/run.py [--quick] [--profile]``. Results are printed and
written to ``benchmarks/results/`` (see benchmarks/README.md).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import cProfile
import gc
import http.client
import io
import json
import logging
import math
import multiprocessing
import os
import platform
import pstats
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from array import array
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import IO, Any, TypeVar, cast, overload
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from exporter import __version__  # noqa: E402
from exporter.agent import Agent, build_agent  # noqa: E402
from exporter.config import parse_config  # noqa: E402
from exporter.exposition.server import OPENMETRICS, TEXT, MetricsCache  # noqa: E402
from exporter.sim.environment import SimEnvironment  # noqa: E402
from exporter.sim.node import ManualClock  # noqa: E402
from exporter.sim.scenario import Scenario, SimEvent, load_scenario  # noqa: E402
from exporter.sources.base import Source  # noqa: E402
from exporter.sources.podresources.source import PodResourcesSource  # noqa: E402

SCENARIO = "node-8gpu"
RESULTS_DIR = ROOT / "benchmarks" / "results"

TARGET_SCRAPE_P99_MS = 2.0
TARGET_CYCLE_CPU_MS = 10.0
TARGET_RSS_MIB = 90.0
# Growth per 1,000 cycles after warm-up that still counts as flat. RSS wanders by ±2 MiB
# for runs of ~1,000 cycles as malloc reuses its arenas, which makes smaller slopes noise.
TARGET_RSS_SLOPE_MIB = 0.25

# name: (request headers, seconds of unrecorded warm-up scrapes). The exporter renders
# each cycle only the formats asked for in its last 10 cycles, so the OpenMetrics series
# warms up until the text format the earlier series asked for has dropped out.
SCRAPE_VARIANTS: dict[str, tuple[dict[str, str], float]] = {
    "text": ({}, 2.0),
    "gzip": ({"Accept-Encoding": "gzip"}, 2.0),
    "openmetrics": ({"Accept": "application/openmetrics-text; version=1.0.0"}, 12.0),
}
POD_RESOURCES_EVERY = 10  # cycles between PodResources refreshes (the default 10 s at 1 s)
# The agent renders only the formats scraped lately, so the cycle is timed once per
# format: OpenMetrics is what Prometheus asks for by default (its scrape_protocols prefer
# it), text what older Prometheus and curl get. The memory run asks for both.
CYCLE_FORMATS = (OPENMETRICS, TEXT)
EXPIRE_HISTORY_EVERY = 1000  # cycles between API history compactions (watch relists)
WORKER_LIFETIME_S = 20  # churn: each extra worker process lives this long
JOB_PERIOD_S = 60  # churn: a short-lived pod is created this often ...
JOB_LIFETIME_S = 45  # ... and deleted after this long (its process exits 5 s before)

T = TypeVar("T")


@dataclass(frozen=True)
class Plan:
    """How much of each measurement to do."""

    scrapes: int  # text scrapes (the headline figure)
    variant_scrapes: int  # gzip and OpenMetrics scrapes each
    scrape_spacing_s: float  # start-to-start; spreads scrapes over many sample cycles
    warmup_cycles: int
    cycles: int
    memory_cycles: int
    rss_every: int
    slope_from: int  # cycles of warm-up excluded from the RSS slope
    settle_s: float  # a fresh exporter runs this long before its RSS is read


FULL = Plan(2000, 500, 0.005, 20, 500, 10_000, 100, 3000, 5.0)
QUICK = Plan(200, 50, 0.005, 12, 50, 1000, 50, 300, 3.0)


# -- small helpers ---------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ranked = sorted(values)
    return ranked[max(0, min(len(ranked) - 1, math.ceil(q / 100 * len(ranked)) - 1))]


def summarise(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


def rss_mib(pid: int | str = "self") -> dict[str, float]:
    """VmRSS and VmHWM (peak) of a process, in MiB."""
    fields: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) / 1024
    return {"rss": fields["VmRSS"], "peak": fields["VmHWM"]}


def python_heap() -> dict[str, int]:
    """Objects the collector tracks and pymalloc blocks in use: if these stay flat while
    RSS grows, the growth is allocator fragmentation, not objects kept alive."""
    return {"gc_objects": len(gc.get_objects()), "allocated_blocks": sys.getallocatedblocks()}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ErrorCounter(logging.Handler):
    """Counts ERROR records: a failed cycle is logged, not raised, by the agent."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


# -- 1. scrape latency against a separate exporter process -----------------------------


class ExporterProcess:
    """``python -m exporter --simulate node-8gpu`` on a free port."""

    def __init__(self, *, kube_api: bool, stderr: IO[bytes]) -> None:
        self.kube_api = kube_api
        self.port = free_port()
        self._stderr = stderr
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "exporter",
                "--simulate",
                SCENARIO,
                "--listen",
                f"127.0.0.1:{self.port}",
                "--interval",
                "1",
                "--log-level",
                "warning",
                "--kube-api",
                "auto" if kube_api else "off",
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
        )

    def get(self, path: str) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=5)
        try:
            conn.request("GET", path)
            response = conn.getresponse()
            return response.status, response.read()
        finally:
            conn.close()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Until /metrics is served and says every source (the kube watch too) is up."""
        want = ["nvml", "procfs", "podresources", "xid"] + (["kube"] if self.kube_api else [])
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._stderr.seek(0)
                raise RuntimeError(f"exporter exited: {self._stderr.read().decode()[-2000:]}")
            try:
                status, body = self.get("/metrics")
            except OSError:
                status, body = 0, b""
            if status == 200 and all(
                f'gpu_exporter_source_up{{source="{name}"}} 1.0'.encode() in body for name in want
            ):
                return
            time.sleep(0.1)
        raise RuntimeError(f"exporter not ready with sources {want} after {timeout_s} s")

    def stop(self) -> list[str]:
        """Stop the exporter; returns what it logged (warnings and worse)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace").splitlines()


@contextmanager
def exporter_process(*, kube_api: bool, log: list[str]) -> Iterator[ExporterProcess]:
    with tempfile.TemporaryFile() as stderr:
        exporter = ExporterProcess(kube_api=kube_api, stderr=stderr)
        try:
            exporter.wait_ready()
            yield exporter
        finally:
            log.extend(exporter.stop())


def scrape_latencies(
    port: int, headers: dict[str, str], count: int, spacing_s: float, warmup_s: float
) -> dict[str, Any]:
    """Per-request wall time (request sent to body read) over one keep-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    times: list[float] = []
    size = 0
    content_type = encoding = ""
    warmup = math.ceil(warmup_s / spacing_s)
    try:
        for i in range(warmup + count):
            started = time.perf_counter()
            conn.request("GET", "/metrics", headers=headers)
            response = conn.getresponse()
            body = response.read()
            elapsed = time.perf_counter() - started
            if response.status != 200:
                raise RuntimeError(f"/metrics answered {response.status}")
            if i >= warmup:
                times.append(elapsed * 1000)
            size = len(body)
            content_type = response.getheader("Content-Type", "")
            encoding = response.getheader("Content-Encoding", "") or "identity"
            time.sleep(max(0.0, spacing_s - elapsed))
    finally:
        conn.close()
    return {
        "ms": summarise(times),
        "slow_pct": 100 * sum(t > TARGET_SCRAPE_P99_MS for t in times) / len(times),
        "body_bytes": size,
        "content_type": content_type,
        "content_encoding": encoding,
    }


def measure_scrapes_and_process_rss(plan: Plan) -> tuple[dict[str, Any], dict[str, Any]]:
    scrapes: dict[str, Any] = {}
    process_rss: dict[str, Any] = {}
    log: list[str] = []
    with exporter_process(kube_api=True, log=log) as exporter:
        time.sleep(plan.settle_s)
        process_rss["kube_api_on"] = rss_mib(exporter.proc.pid)
        for name, (headers, warmup_s) in SCRAPE_VARIANTS.items():
            count = plan.scrapes if name == "text" else plan.variant_scrapes
            scrapes[name] = scrape_latencies(
                exporter.port, headers, count, plan.scrape_spacing_s, warmup_s
            )
        process_rss["kube_api_on_after_scrapes"] = rss_mib(exporter.proc.pid)
    with exporter_process(kube_api=False, log=log) as exporter:
        time.sleep(plan.settle_s)
        process_rss["kube_api_off"] = rss_mib(exporter.proc.pid)
    process_rss["kube_api_cost"] = (
        process_rss["kube_api_on"]["rss"] - process_rss["kube_api_off"]["rss"]
    )
    process_rss["exporter_stderr"] = log[-20:]
    return scrapes, process_rss


# -- 2 and 3. the agent in-process on the simulated node -------------------------------


@dataclass
class SimulatedAgent:
    env: SimEnvironment
    agent: Agent
    clock: ManualClock
    scraped: tuple[str, ...]  # exposition formats a scraper asks for after every cycle

    async def step(self) -> None:
        """One second of simulated time, then one sample cycle as the sample loop runs it."""
        self.clock.advance(1.0)
        self.env.sync()
        await self.agent.cycle()
        self.scrape()

    def scrape(self) -> dict[str, bytes]:
        """What a scrape does to the cache: take this cycle's bytes, which also tells the
        agent to keep rendering that format (a scraper that is not there costs nothing)."""
        out = {}
        for fmt in self.scraped:
            rendered = self.agent.cache.cached(fmt)
            out[fmt] = rendered.body if rendered else self.agent.cache.render_now(fmt).body
        return out


@asynccontextmanager
async def simulated_agent(
    scenario: Scenario, scraped: tuple[str, ...]
) -> AsyncIterator[SimulatedAgent]:
    """The real Agent with every source on, like tests/harness.py but without HTTP."""
    clock = ManualClock()
    env = SimEnvironment(scenario, clock=clock, kube_api=True)
    paths = await env.start()
    # The simulator re-syncs every 0.2 s on its own; step() syncs before each cycle, so
    # stop that task to keep its CPU out of the measurements.
    if env._task is not None:
        env._task.cancel()
    try:
        assert paths.kubeconfig is not None
        config = parse_config(
            [
                "--listen=127.0.0.1:0",
                f"--proc-root={paths.proc_root}",
                f"--pod-resources-socket={paths.pod_resources_socket}",
                f"--node-name={paths.node_name}",
                "--kube-api=auto",
                f"--kubeconfig={paths.kubeconfig}",
            ],
            env={},
        )
        wall_start = time.time()
        agent = build_agent(config, MetricsCache(), wall_clock=lambda: wall_start + clock())
        # Background threads start, no refresh task: step() decides when PodResources
        # is refreshed, as tests/harness.py does.
        for source in agent.sources:
            source.start()
        try:
            await asyncio.gather(*(s.prime(30.0) for s in agent.sources))
            deadline = time.monotonic() + 30
            while not all(_up(agent.source(n)) for n in ("kube", "resourceslices")):
                if time.monotonic() > deadline:
                    raise RuntimeError("the API watches did not list within 30 s")
                await asyncio.sleep(0.02)
            await refresh_pod_resources(agent)
            sim = SimulatedAgent(env, agent, clock, scraped)
            await sim.step()
            assert agent.latest is not None
            down = [s.name for s in agent.latest.node.sources if not s.up]
            if down:
                raise RuntimeError(f"sources down in the simulated agent: {down}")
            yield sim
        finally:
            await agent.close()
    finally:
        await env.stop()


def _up(source: Source | None) -> bool:
    status = source.status() if source is not None else None
    return source is None or (status is not None and status.up)


async def refresh_pod_resources(agent: Agent) -> None:
    source = agent.source("podresources")
    assert isinstance(source, PodResourcesSource)
    await source.refresh()


async def measure_cycles(plan: Plan) -> dict[str, Any]:
    """Cycle times with a scraper asking for each format in turn (see CYCLE_FORMATS)."""
    by_format: dict[str, Any] = {}
    for fmt in CYCLE_FORMATS:
        async with simulated_agent(load_scenario(SCENARIO), (fmt,)) as sim:
            for _ in range(plan.warmup_cycles):
                await sim.step()
            walls: list[float] = []
            cpus: list[float] = []
            for _ in range(plan.cycles):
                sim.clock.advance(1.0)
                sim.env.sync()
                wall, cpu = time.perf_counter(), time.process_time()
                await sim.agent.cycle()
                cpus.append((time.process_time() - cpu) * 1000)
                walls.append((time.perf_counter() - wall) * 1000)
                sim.scrape()
            assert sim.agent.latest is not None
            body = sim.scrape()[fmt]
            by_format[fmt] = {
                "wall_ms": summarise(walls),
                "cpu_ms": summarise(cpus),
                "processes": len(sim.agent.latest.node.processes),
                "exposition_lines": body.count(b"\n"),
                "exposition_bytes": len(body),
            }
    return {"by_format": by_format}


async def _inline(func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    return func(*args, **kwargs)


async def profile_cycles(plan: Plan, top: int = 30) -> str:
    """cProfile of the cycles, with ``asyncio.to_thread`` run inline so one profiler
    sees the worker-thread work too."""
    async with simulated_agent(load_scenario(SCENARIO), CYCLE_FORMATS[:1]) as sim:
        for _ in range(plan.warmup_cycles):
            await sim.step()
        profiler = cProfile.Profile()
        with mock.patch("asyncio.to_thread", _inline):
            for _ in range(plan.cycles):
                sim.clock.advance(1.0)
                sim.env.sync()
                profiler.enable()
                await sim.agent.cycle()
                profiler.disable()
                sim.scrape()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


class ChurnTimeline(Sequence[SimEvent]):
    """node-8gpu's own timeline plus churn, with each second's events made on demand.

    Every second a worker process starts in one of the pods on a whole or time-sliced
    GPU and exits ``WORKER_LIFETIME_S`` later (so ~20 extra pids live at any time, each
    pid used once). Every ``JOB_PERIOD_S`` a pod ``churn/job-N`` is created with a
    time-sliced GPU replica, runs one process, and is deleted, so the kube watch, the
    PodResources answer and the pod label sets churn too. Made lazily because a list of
    the ~20,000 events would itself add ~15 MiB to the RSS being measured; the simulated
    node only asks for ``len()`` and ``timeline[i]``, in order.
    """

    def __init__(
        self, base: Sequence[SimEvent], hosts: list[tuple[str, str, int]], seconds: int
    ) -> None:
        self._base: dict[int, list[SimEvent]] = {}
        for event in base:
            self._base.setdefault(math.floor(event.at), []).append(event)
        self._hosts = hosts
        self._seconds = seconds
        self._first = array("l")  # index of each second's first event
        total = 0
        for second in range(seconds + JOB_PERIOD_S + 1):
            self._first.append(total)
            total += len(self._events_at(second))
        self._len = total
        self._cached: tuple[int, list[SimEvent]] = (-1, [])

    def _events_at(self, second: int) -> list[SimEvent]:
        events = list(self._base.get(second, ()))
        if 1 <= second <= self._seconds:
            pod, container, gpu = self._hosts[second % len(self._hosts)]
            worker = {"pid": 300_000 + second, "gpu": gpu, "memory": "256MiB", "sm": 1}
            start = {**worker, "comm": "churn_worker", "pod": pod, "container": container}
            events.append(SimEvent(second, "start", start))
        if 1 <= second - WORKER_LIFETIME_S <= self._seconds:
            events.append(SimEvent(second, "exit", {"value": 300_000 + second - WORKER_LIFETIME_S}))
        job, at = divmod(second - JOB_PERIOD_S // 2, JOB_PERIOD_S)  # `at` s into job N
        if job >= 0 and second - at < self._seconds:
            pod, pid = f"churn/job-{job}", 900_000 + job
            if at == 0:
                devices = {"nvidia.com/gpu.shared": ["gpu2::3"]}
                add = {"pod": pod, "containers": [{"name": "main", "devices": devices}]}
                events.append(SimEvent(second, "add_pod", add))
            elif at == 1:
                job_proc = {"pid": pid, "gpu": 2, "memory": "2GiB", "sm": 10, "comm": "python3"}
                start = {**job_proc, "pod": pod, "container": "main"}
                events.append(SimEvent(second, "start", start))
            elif at == JOB_LIFETIME_S - 5:
                events.append(SimEvent(second, "exit", {"value": pid}))
            elif at == JOB_LIFETIME_S:
                events.append(SimEvent(second, "delete_pod", {"value": pod}))
        return sorted(events, key=lambda e: e.at)

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> SimEvent: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[SimEvent]: ...
    def __getitem__(self, index: int | slice) -> SimEvent | Sequence[SimEvent]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if not 0 <= index < self._len:
            raise IndexError(index)
        second = bisect.bisect_right(self._first, index) - 1
        if self._cached[0] != second:
            self._cached = (second, self._events_at(second))
        return self._cached[1][index - self._first[second]]


def churn_scenario(seconds: int) -> Scenario:
    """node-8gpu with ``ChurnTimeline`` as its timeline."""
    scenario = load_scenario(SCENARIO)
    hosts = sorted(
        {
            (p.pod, p.container, p.gpu)
            for p in scenario.processes
            if p.pod and p.container and p.mig is None  # `start` has no MIG slot
        }
    )
    timeline = ChurnTimeline(scenario.timeline, hosts, seconds)
    # Scenario.timeline is declared a list; the simulator only indexes it.
    return replace(scenario, name=f"{SCENARIO}-churn", timeline=cast("list[SimEvent]", timeline))


async def measure_memory(plan: Plan) -> dict[str, Any]:
    async with simulated_agent(churn_scenario(plan.memory_cycles), (TEXT, OPENMETRICS)) as sim:
        assert sim.env.kube_api is not None
        gc.collect()
        samples = [{"cycle": 0, **rss_mib(), **python_heap()}]
        max_processes = churn_pod_cycles = 0
        for cycle in range(1, plan.memory_cycles + 1):
            await sim.step()
            if cycle % POD_RESOURCES_EVERY == 0:
                await refresh_pod_resources(sim.agent)
            if cycle % EXPIRE_HISTORY_EVERY == 0:
                # Bounds the API stand-in's event history (simulator memory, not the
                # exporter's) and makes the pod watch relist, as after a compaction.
                sim.env.kube_api.expire_history()
            assert sim.agent.latest is not None
            max_processes = max(max_processes, len(sim.agent.latest.node.processes))
            churn_pod_cycles += b'namespace="churn"' in sim.scrape()[TEXT]
            if cycle % plan.rss_every == 0:
                samples.append({"cycle": cycle, **rss_mib(), **python_heap()})
    tail = [s for s in samples if s["cycle"] >= plan.slope_from]

    def per_1000_cycles(key: str) -> float:
        fit = statistics.linear_regression([s["cycle"] for s in tail], [s[key] for s in tail])
        return fit.slope * 1000

    return {
        "cycles": plan.memory_cycles,
        "start_rss": samples[0]["rss"],
        "end_rss": samples[-1]["rss"],
        "peak_rss": samples[-1]["peak"],
        "slope_mib_per_1000_cycles": per_1000_cycles("rss"),
        "slope_blocks_per_1000_cycles": per_1000_cycles("allocated_blocks"),
        "slope_gc_objects_per_1000_cycles": per_1000_cycles("gc_objects"),
        "slope_from_cycle": plan.slope_from,
        "pids_started": plan.memory_cycles + plan.memory_cycles // JOB_PERIOD_S,
        "max_processes": max_processes,
        "cycles_with_churn_pod_in_output": churn_pod_cycles,
        "samples": samples,
    }


SECTIONS: dict[str, Callable[[Plan], Coroutine[Any, Any, Any]]] = {
    "cycle": measure_cycles,
    "memory": measure_memory,
    "profile": profile_cycles,
}


def run_section(name: str, plan: Plan) -> Any:
    """Runs in a fresh process, so RSS and CPU figures carry nothing from other sections."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    errors = ErrorCounter()
    logging.getLogger().addHandler(errors)
    result = asyncio.run(SECTIONS[name](plan))
    if isinstance(result, dict):
        result["errors_logged"] = errors.count
    return result


def in_fresh_process(name: str, plan: Plan) -> Any:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(run_section, name, plan).result()


# -- report ----------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = "unknown"
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.partition(":")[2].strip()
            break
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
    packages = ("prometheus-client", "aiohttp", "grpcio", "protobuf", "kubernetes")
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "kernel": platform.release(),
        "malloc_arena_max": os.environ.get("MALLOC_ARENA_MAX"),  # glibc default when None
        "python": platform.python_version(),
        "exporter": __version__,
        "commit": commit,
        "packages": {name: metadata.version(name) for name in packages},
    }


@dataclass
class Row:
    figure: str
    value: float
    unit: str
    target: float | None = None  # upper bound; None: informational
    verdict: str = field(init=False)

    def __post_init__(self) -> None:
        if self.target is None:
            self.verdict = "—"
        else:
            self.verdict = "pass" if self.value <= self.target else "FAIL"

    def cells(self) -> tuple[str, str, str, str]:
        target = "—" if self.target is None else f"≤ {self.target:g} {self.unit}"
        return self.figure, f"{self.value:.2f} {self.unit}", target, self.verdict


def rows(results: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for name, scrape in results["scrape"].items():
        ms = scrape["ms"]
        what = f"scrape {name} ({scrape['body_bytes'] / 1024:.0f} KiB), {ms['n']} scrapes"
        out.append(Row(f"{what}: p50", ms["p50"], "ms"))
        out.append(Row(f"{what}: p99", ms["p99"], "ms", TARGET_SCRAPE_P99_MS))
        out.append(Row(f"{what}: share over {TARGET_SCRAPE_P99_MS:g} ms", scrape["slow_pct"], "%"))
    for fmt, cycles in results["cycle"]["by_format"].items():
        label = f"sample cycle ({fmt} scraped), {cycles['cpu_ms']['n']} cycles"
        cpu, wall = cycles["cpu_ms"], cycles["wall_ms"]
        out.append(Row(f"{label}: CPU median", cpu["p50"], "ms", TARGET_CYCLE_CPU_MS))
        out.append(Row(f"{label}: CPU p99", cpu["p99"], "ms"))
        out.append(Row(f"{label}: wall median", wall["p50"], "ms"))
        out.append(Row(f"{label}: wall p99", wall["p99"], "ms"))
    memory = results["memory"]
    label = f"RSS, in-process, all sources, {memory['cycles']} churn cycles"
    out.append(Row(f"{label}: start", memory["start_rss"], "MiB"))
    out.append(Row(f"{label}: end", memory["end_rss"], "MiB", TARGET_RSS_MIB))
    growth = f"growth per 1,000 cycles after cycle {memory['slope_from_cycle']}"
    out.append(
        Row(f"RSS {growth}", memory["slope_mib_per_1000_cycles"], "MiB", TARGET_RSS_SLOPE_MIB)
    )
    out.append(Row(f"pymalloc blocks {growth}", memory["slope_blocks_per_1000_cycles"], "blocks"))
    process = results["process_rss"]
    out.append(
        Row(
            "RSS, exporter process, kube API on",
            process["kube_api_on"]["rss"],
            "MiB",
            TARGET_RSS_MIB,
        )
    )
    out.append(Row("RSS, exporter process, --kube-api off", process["kube_api_off"]["rss"], "MiB"))
    out.append(Row("RSS cost of the kube API watch", process["kube_api_cost"], "MiB"))
    return out


def table(rows_: list[Row]) -> str:
    header = ("figure", "value", "target", "result")
    cells = [header, *(r.cells() for r in rows_)]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    lines = ["  ".join(c[i].ljust(widths[i]) for i in range(4)) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markdown(results: dict[str, Any], rows_: list[Row]) -> str:
    m = results["machine"]
    packages = ", ".join(f"{k} {v}" for k, v in m["packages"].items())
    lines = [
        f"# Benchmark: {SCENARIO} ({results['mode']} run)",
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
        f"| MALLOC_ARENA_MAX | {m['malloc_arena_max'] or 'unset (glibc default)'} |",
        f"| Python | {m['python']} |",
        f"| exporter | {m['exporter']} ({m['commit']}) |",
        f"| packages | {packages} |",
        "",
        "| figure | value | target | result |",
        "|---|---:|---|---|",
        *(f"| {' | '.join(r.cells())} |" for r in rows_),
        "",
    ]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a fast smoke run (under a minute)")
    parser.add_argument(
        "--profile", action="store_true", help="also print a cProfile of the sample cycle"
    )
    args = parser.parse_args()
    plan = QUICK if args.quick else FULL
    mode = "quick" if args.quick else "full"
    started = time.monotonic()
    now = datetime.now(UTC)
    results: dict[str, Any] = {
        "scenario": SCENARIO,
        "mode": mode,
        "started": now.isoformat(timespec="seconds"),
        "plan": asdict(plan),
        "machine": machine(),
    }
    print(f"[1/3] scrape latency and exporter process RSS ({mode} run)", flush=True)
    results["scrape"], results["process_rss"] = measure_scrapes_and_process_rss(plan)
    print(f"[2/3] sample cycle time over {plan.cycles} cycles", flush=True)
    results["cycle"] = in_fresh_process("cycle", plan)
    print(f"[3/3] RSS over {plan.memory_cycles} cycles with pids churning", flush=True)
    results["memory"] = in_fresh_process("memory", plan)
    if args.profile:
        print(in_fresh_process("profile", plan))
    results["duration_s"] = time.monotonic() - started

    rows_ = rows(results)
    results["verdicts"] = [asdict(r) for r in rows_]
    memory = results["memory"]
    errors = results["cycle"]["errors_logged"] + memory["errors_logged"]
    print()
    print(table(rows_))
    print(
        f"\nchurn: {memory['pids_started']} pids started, up to {memory['max_processes']} "
        f"processes per cycle, a churn pod attributed in "
        f"{memory['cycles_with_churn_pod_in_output']} cycles; {errors} errors logged; "
        f"{results['duration_s']:.0f} s in all"
    )
    for line in results["process_rss"]["exporter_stderr"]:
        print(f"exporter stderr: {line}")

    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    suffix = "-quick" if args.quick else ""
    json_path = RESULTS_DIR / f"{now:%Y-%m-%d}-{SCENARIO}{suffix}.json"
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    md_path = RESULTS_DIR / f"latest{suffix}.md"
    md_path.write_text(markdown(results, rows_))
    print(f"wrote {json_path.relative_to(ROOT)} and {md_path.relative_to(ROOT)}")
    return 1 if errors else 0  # a missed target is a finding, not a failure to measure


if __name__ == "__main__":
    raise SystemExit(main())
