"""Scheduled PodResources refreshes and the cycles that read them
(exporter/sources/podresources/source.py): with cycles further apart than the schedule,
a refresh waits until just before the next cycle instead of being made, and superseded,
several times in between; the agent announces each next cycle to every source."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any, ClassVar

from exporter.agent import Agent
from exporter.config import parse_config
from exporter.exposition.server import MetricsCache
from exporter.model import SourceName
from exporter.sources.base import Cycle, Source
from exporter.sources.podresources.source import PREFETCH_S, PodResourcesSource
from tests.harness import simulated_exporter

SCENARIO: dict[str, Any] = {
    "gpus": [{}],
    "pods": [
        {
            "namespace": "ml",
            "name": "a",
            "containers": [{"name": "main", "devices": {"nvidia.com/gpu": ["gpu0"]}}],
        }
    ],
}


async def refreshes(source: PodResourcesSource, seconds: float) -> list[float]:
    """Run the source's refresh task for ``seconds``: the loop times at which its
    snapshot changed, polled every 10 ms."""
    loop = asyncio.get_running_loop()
    seen, times = source.read(None).timestamp, []  # type: ignore[arg-type]
    deadline = loop.time() + seconds
    running = asyncio.create_task(source.run())
    try:
        while loop.time() < deadline:
            await asyncio.sleep(0.01)
            now = source.read(None).timestamp  # type: ignore[arg-type]
            if now != seen:
                seen = now
                times.append(loop.time())
    finally:
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
    return times


async def test_a_refresh_no_cycle_would_read_waits_until_just_before_the_cycle() -> None:
    async with simulated_exporter(SCENARIO, kube_api=False, first_cycle=False) as h:
        client = h.pod_resources.client
        # the shortest schedule --pod-resources-interval allows, cycles 3.5 s apart
        source = PodResourcesSource(client, interval_s=1.0, cycle_interval_s=3.5)
        loop = asyncio.get_running_loop()
        began = loop.time()
        cycle_at = began + 3.5
        source.expect_cycle_at(cycle_at)
        times = await refreshes(source, 3.2)
    # the first at once; then, of the three the schedule would make before the cycle,
    # only the one the cycle reads, begun PREFETCH_S before it
    assert len(times) == 2, [round(t - began, 2) for t in times]
    assert times[0] - began < 0.5
    assert cycle_at - PREFETCH_S - 0.05 <= times[1] <= cycle_at - PREFETCH_S + 0.5
    assert source.period_s == 3.5  # stale after three cycles without one, not 3 s


async def test_a_source_told_of_no_cycle_keeps_its_schedule() -> None:
    async with simulated_exporter(SCENARIO, kube_api=False, first_cycle=False) as h:
        source = PodResourcesSource(h.pod_resources.client, interval_s=0.2)
        times = await refreshes(source, 1.5)
    assert len(times) >= 4, times


async def test_a_cycle_due_sooner_than_the_schedule_changes_nothing() -> None:
    """Cycles every second, refreshes every 0.4 s: each refresh is read by a cycle, so
    none is put off."""
    async with simulated_exporter(SCENARIO, kube_api=False, first_cycle=False) as h:
        source = PodResourcesSource(h.pod_resources.client, interval_s=0.4)
        loop = asyncio.get_running_loop()
        source.expect_cycle_at(loop.time() + 0.3)
        times = await refreshes(source, 1.5)
    assert len(times) >= 3, times


class Listening(Source):
    """Records what the agent announces."""

    name: ClassVar[SourceName] = "cgroups"

    def __init__(self) -> None:
        self.announced: list[float] = []
        self.two = threading.Event()

    def fill(self, cycle: Cycle) -> None:
        pass

    def expect_cycle_at(self, at: float) -> None:
        self.announced.append(at)
        if len(self.announced) >= 2:
            self.two.set()


async def test_the_sample_loop_announces_each_next_cycle_to_the_sources() -> None:
    config = parse_config(["--node-name", "n", "--kube-api", "off", "--interval", "0.2"], env={})
    source = Listening()
    agent = Agent(config, MetricsCache(), [source])
    began = time.monotonic()
    running = asyncio.create_task(agent.run())
    try:
        assert await asyncio.to_thread(source.two.wait, 10)
    finally:
        agent.stop()
        await running
    # announced before each cycle runs: the cycle after it, one interval on
    first, second = source.announced[:2]
    assert began < first < began + 1.0
    assert abs(second - first - 0.2) < 1e-6
