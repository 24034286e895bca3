"""The sample cycle from inside: the agent in-process on the simulated node, timed per cycle.

The agent runs with a ``ManualClock``, as ``tests/harness.py`` does, with every source on
(simulated NVML, the proc tree, the real PodResources gRPC server and client, the real
``kubernetes`` pod watch against the simulator's API stand-in, the XID listener). Each
cycle advances the clock by 1 s, syncs the simulator (not timed), then times ``await
agent.cycle()`` with ``time.perf_counter`` (wall) and ``time.process_time`` (CPU of every
thread of the process, the simulator's included), then takes the cached bytes the way a
scrape does. Because the agent renders only the formats scraped lately, this is done once
per format. ``profile_cycles`` prints a cProfile of the same loop.
"""

from __future__ import annotations

import asyncio
import cProfile
import io
import pstats
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar
from unittest import mock

from processes import summarise

from exporter.agent import Agent, build_agent
from exporter.config import parse_config
from exporter.exposition.server import OPENMETRICS, TEXT, MetricsCache
from exporter.sim.environment import SimEnvironment
from exporter.sim.node import ManualClock
from exporter.sim.scenario import Scenario, load_scenario
from exporter.sources.base import Source
from exporter.sources.podresources.source import PodResourcesSource

SCENARIO = "node-8gpu"
# OpenMetrics is what Prometheus asks for by default (its scrape_protocols prefer it),
# text what older Prometheus and curl get. Scraped after every cycle, a format is
# rendered every cycle; scraped every 5th (a 5 s scrape interval at --interval 1), the
# cycle renders only when a scrape is expected (exporter/exposition/scrape_demand.py).
CYCLE_FORMATS = (OPENMETRICS, TEXT)
# (format, a scrape after every Nth cycle)
CYCLE_CASES = ((OPENMETRICS, 1), (TEXT, 1), (OPENMETRICS, 5))
T = TypeVar("T")


@dataclass(frozen=True)
class CyclePlan:
    warmup_cycles: int
    cycles: int


FULL = CyclePlan(20, 500)
QUICK = CyclePlan(10, 50)


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
        config = parse_config(["--listen=127.0.0.1:0", *paths.flags()], env={})
        wall_start = time.time()
        # Sources measure intervals (the NVML slow tier, --slow-interval) on the
        # simulated clock, as tests/harness.py does.
        agent = build_agent(
            config,
            MetricsCache(),
            wall_clock=lambda: wall_start + clock(),
            source_monotonic=env.node.now,
        )
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


async def measure_cycles(plan: CyclePlan) -> dict[str, Any]:
    """Cycle times with a scraper asking for one format after every cycle or every 5th
    (see CYCLE_CASES); a cycle's time includes the scrape that follows it, which renders
    the cycle when the cycle did not."""
    by_format: dict[str, Any] = {}
    for fmt, every in CYCLE_CASES:
        async with simulated_agent(load_scenario(SCENARIO), (fmt,)) as sim:
            for _ in range(plan.warmup_cycles):
                await sim.step()
            walls: list[float] = []
            cpus: list[float] = []
            for n in range(plan.cycles):
                sim.clock.advance(1.0)
                sim.env.sync()
                wall, cpu = time.perf_counter(), time.process_time()
                await sim.agent.cycle()
                if n % every == 0:
                    sim.scrape()
                cpus.append((time.process_time() - cpu) * 1000)
                walls.append((time.perf_counter() - wall) * 1000)
            assert sim.agent.latest is not None
            body = sim.scrape()[fmt]
            key = fmt if every == 1 else f"{fmt} every {every}th cycle"
            by_format[key] = {
                "wall_ms": summarise(walls),
                "cpu_ms": summarise(cpus),
                "processes": len(sim.agent.latest.node.processes),
                "exposition_lines": body.count(b"\n"),
                "exposition_bytes": len(body),
            }
    return {"by_format": by_format}


async def _inline(func: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
    return func(*args, **kwargs)


async def _profiled(plan: CyclePlan) -> cProfile.Profile:
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
    return profiler


async def profile_cycles(plan: CyclePlan, top: int = 30) -> str:
    out = io.StringIO()
    stats = pstats.Stats(await _profiled(plan), stream=out)
    stats.sort_stats("cumulative").print_stats(top)
    stats.sort_stats("tottime").print_stats(top)
    return out.getvalue()


async def simulator_share(plan: CyclePlan) -> dict[str, float]:
    """The share of a cycle's time spent inside the simulated NVML library (its own
    functions, as cProfile counts them): work a real driver does in C."""
    stats = pstats.Stats(await _profiled(plan))
    entries = stats.stats  # type: ignore[attr-defined]
    total = sum(tottime for _, _, tottime, _, _ in entries.values())
    sim = sum(
        tottime
        for (filename, _, _), (_, _, tottime, _, _) in entries.items()
        if "/exporter/sim/" in filename
    )
    return {"share": sim / total, "profiled_s": total}
