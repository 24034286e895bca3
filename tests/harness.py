"""Run the real exporter in-process on a simulated node, with a clock the test moves.

Everything is the production code path: the simulated NVML library under pynvml, the
proc tree on disk, the real gRPC PodResources server on a unix socket, the real
``kubernetes`` client against the HTTP stand-in, the real aiohttp server on a free port,
and a real HTTP client whose responses are parsed with ``prometheus_client.parser``.
Only the schedule differs: the test calls ``cycle()`` instead of waiting on a timer.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import aiohttp
from prometheus_client import CollectorRegistry, Gauge
from prometheus_client.parser import text_string_to_metric_families

from exporter.agent import Agent, build_agent
from exporter.config import parse_config
from exporter.exposition.liveness import Liveness
from exporter.exposition.server import MetricsCache, bound_port, build_app, start_server
from exporter.model import MIRROR_POD_ANNOTATION
from exporter.sim.environment import SimEnvironment
from exporter.sim.node import ManualClock
from exporter.sim.scenario import Scenario, load_scenario, parse_scenario
from exporter.sources.base import Source
from exporter.sources.device_taint_rules import DeviceTaintRuleWatcher, rule_selector
from exporter.sources.kmsg import KmsgReader
from exporter.sources.kube import PodWatcher
from exporter.sources.node_watch import NodeWatcher, node_scheduling
from exporter.sources.podresources.source import PodResourcesSource
from exporter.sources.xid import XidListener

Labels = frozenset[tuple[str, str]]


@dataclass
class Scrape:
    """One parsed scrape: ``values[name][labels] = value`` (samples keyed by sample name)."""

    values: dict[str, dict[Labels, float]] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)

    def series(self, name: str) -> dict[Labels, float]:
        return self.values.get(name, {})

    def get(self, name: str, **labels: str) -> float:
        """The single sample of ``name`` whose labels include ``labels``."""
        wanted = set(labels.items())
        hits = [v for k, v in self.series(name).items() if wanted <= k]
        if len(hits) != 1:
            raise AssertionError(f"{name}{labels}: expected one sample, found {len(hits)}")
        return hits[0]

    def find(self, name: str, **labels: str) -> list[tuple[dict[str, str], float]]:
        wanted = set(labels.items())
        return [(dict(k), v) for k, v in self.series(name).items() if wanted <= k]

    def names(self) -> set[str]:
        return set(self.types)


def parse_exposition(text: str) -> Scrape:
    scrape = Scrape()
    for family in text_string_to_metric_families(text):
        scrape.types[family.name] = family.type
        for sample in family.samples:
            scrape.values.setdefault(sample.name, {})[frozenset(sample.labels.items())] = (
                sample.value
            )
    return scrape


@dataclass
class Harness:
    env: SimEnvironment
    agent: Agent
    url: str
    clock: ManualClock
    session: aiohttp.ClientSession

    def source(self, name: str) -> Source:
        found = self.agent.source(name)
        assert found is not None, f"no {name} source in this configuration"
        return found

    @property
    def xid_listener(self) -> XidListener:
        listener = self.source("xid")
        assert isinstance(listener, XidListener)
        return listener

    @property
    def pod_resources(self) -> PodResourcesSource:
        source = self.source("podresources")
        assert isinstance(source, PodResourcesSource)
        return source

    async def refresh_pod_resources(self) -> None:
        """What the agent's refresh task would do on its next tick."""
        await self.pod_resources.refresh()

    async def cycle(self) -> None:
        """One sample cycle as the agent's loop would run it (simulator synced first).

        XIDs due by now are first handed over by the listener thread, as they would
        have been during a real interval (those raised at or before time 0 came before
        the event set existed, so only the kernel log has them), and, with ``--kmsg``,
        read from the kernel log.
        """
        await asyncio.to_thread(self.env.sync)
        await self._pod_watch_caught_up()
        await self._node_watch_caught_up()
        await self._taint_rule_watch_caught_up()
        due = sum(1 for x in self.env.node.xids if 0 < x.at <= self.clock())
        listener = self.xid_listener
        await _wait_for(
            lambda: listener.events_total >= due or not listener.alive,
            "XID events to be delivered",
        )
        kmsg = self.agent.source("kmsg")
        if isinstance(kmsg, KmsgReader):
            logged = self.env.kernel_log.xids_written
            await _wait_for(lambda: kmsg.events_total >= logged, "kernel-log XIDs to be read")
        await self.agent.cycle()

    async def _pod_watch_caught_up(self) -> None:
        """A pod the timeline adds or deletes reaches the pod watch on its own thread; a
        real interval gives it time, a test's cycle waits for it. Bounded and quiet: a
        test of a failing or lagging watch goes on after the bound."""
        watch, api = self.agent.source("kube"), self.env.kube_api
        if not isinstance(watch, PodWatcher) or api is None or not _up(watch):
            return
        node = watch.node_name
        wanted = {  # a mirror pod is known by the kubelet's UID of its static pod
            str(
                (p["metadata"].get("annotations") or {}).get(MIRROR_POD_ANNOTATION)
                or p["metadata"]["uid"]
            ).lower()
            for p in api.pods()
            if p["spec"].get("nodeName") == node
        }
        with contextlib.suppress(AssertionError):
            await _wait_for(
                lambda: {p.uid for p in watch.snapshot().pods} == wanted,
                "the pod watch to see the API's pods",
                timeout_s=2.0,
            )

    async def _node_watch_caught_up(self) -> None:
        """As ``_pod_watch_caught_up``, for the Node a timeline cordons, taints or labels."""
        watch, api = self.agent.source("node"), self.env.kube_api
        if not isinstance(watch, NodeWatcher) or api is None or not _up(watch):
            return
        node = api.writes.node(watch.node_name)
        wanted = node_scheduling(node) if node is not None else None
        with contextlib.suppress(AssertionError):
            await _wait_for(
                lambda: watch.snapshot().node == wanted,
                "the Node watch to see the API's Node",
                timeout_s=2.0,
            )

    async def _taint_rule_watch_caught_up(self) -> None:
        """As ``_pod_watch_caught_up``, for the DeviceTaintRules a test writes."""
        watch, api = self.agent.source("devicetaintrules"), self.env.kube_api
        if not isinstance(watch, DeviceTaintRuleWatcher) or api is None or not _up(watch):
            return
        read = (rule_selector(r) for r in api.writes.device_taint_rules())
        wanted = tuple(
            r for r in read if r is not None and (r.driver is None or r.driver in watch.drivers)
        )
        with contextlib.suppress(AssertionError):
            await _wait_for(
                lambda: watch.snapshot().rules == wanted,
                "the DeviceTaintRule watch to see the API's rules",
                timeout_s=2.0,
            )

    async def advance(self, seconds: float, *, cycle: bool = True) -> None:
        self.clock.advance(seconds)
        if cycle:
            await self.cycle()

    async def get(self, path: str, **headers: str) -> aiohttp.ClientResponse:
        async with self.session.get(
            self.url + path, headers=headers, auto_decompress=True
        ) as response:
            await response.read()
            return response

    async def scrape(self) -> Scrape:
        async with self.session.get(self.url + "/metrics") as response:
            assert response.status == 200, await response.text()
            return parse_exposition(await response.text())


def one_gauge_cache() -> MetricsCache:
    """A cache holding one rendered cycle with a single gauge ``gpu_example 1``: for
    tests of the HTTP layer that need something to serve but no simulated node."""
    registry = CollectorRegistry()
    Gauge("gpu_example", "an example", registry=registry).set(1)
    cache = MetricsCache()
    cache.render(registry)
    return cache


def big_answer_cache(series: int = 20_000) -> MetricsCache:
    """A cache whose exposition is ~1 MB: an answer a client that does not read stays
    in the middle of taking, in one request (tests of the connection cap)."""
    registry = CollectorRegistry()
    gauge = Gauge("gpu_example", "an example", ["series"], registry=registry)
    for i in range(series):
        gauge.labels(str(i)).set(i)
    cache = MetricsCache()
    cache.render(registry)
    return cache


def scenario_from(source: str | dict[str, object] | Scenario) -> Scenario:
    if isinstance(source, Scenario):
        return source
    if isinstance(source, dict):
        return parse_scenario(source, "test")
    return load_scenario(source)


@asynccontextmanager
async def simulated_exporter(
    scenario: str | dict[str, object] | Scenario,
    *,
    kube_api: bool = True,
    argv: Sequence[str] = (),
    first_cycle: bool = True,
    writer_on_simulated_clock: bool = False,
    before_start: Callable[[SimEnvironment], None] | None = None,
) -> AsyncIterator[Harness]:
    """``writer_on_simulated_clock``: the Kubernetes writer's windows and budgets run
    on the simulated clock (a test of budgets over minutes), not on real time.
    ``before_start``: called with the started simulated node before the exporter
    starts (a fault its first requests must already meet, e.g. the Lease API's)."""
    clock = ManualClock()
    env = SimEnvironment(scenario_from(scenario), clock=clock, kube_api=kube_api)
    paths = await env.start()
    if before_start is not None:
        before_start(env)
    try:
        config = parse_config(
            [
                "--listen",
                "127.0.0.1:0",
                "--proc-root",
                str(paths.proc_root),
                "--kmsg-path",  # read only with --kmsg in argv
                str(paths.kmsg),
                "--pod-resources-socket",
                str(paths.pod_resources_socket),
                "--node-name",
                paths.node_name,
                "--kube-api",
                "auto" if kube_api else "off",
                # the simulated cgroup tree, or off: never the host's /sys/fs/cgroup
                "--cgroup-root",
                str(paths.cgroup_root or "off"),
                *(["--kubeconfig", str(paths.kubeconfig)] if paths.kubeconfig else []),
                # Refreshes are the test's (refresh_pod_resources): a long period keeps a
                # slow run from making the last one stale (3 periods of real time).
                "--pod-resources-interval",
                "600",
                *argv,
            ],
            env={},
        )
        cache = MetricsCache()
        liveness = Liveness(cache, interval_s=config.interval_s, cycles=config.liveness_cycles)
        app = build_app(cache, paths.node_name, liveness=liveness)
        runner = await start_server(app, "127.0.0.1", 0)
        # the cgroup counters grow with simulated time: the source measures by it too
        agent = build_agent(
            config,
            cache,
            wall_clock=env.node.wall_time,
            source_monotonic=env.node.now,
            monotonic=env.node.now if writer_on_simulated_clock else time.monotonic,
        )
        try:
            # Background sources start, but no refresh task runs: the test decides when
            # PodResources is refreshed (Harness.refresh_pod_resources).
            for source in agent.sources:
                source.start()
            if agent.reporter is not None:  # Events etc.: the writer thread, as start() does
                agent.reporter.start()
            await asyncio.gather(*(s.prime(10.0) for s in agent.sources))
            for name in ("kube", "resourceslices", "node", "devicetaintrules"):
                watch = agent.source(name)
                if watch is not None:
                    await _wait_for(lambda w=watch: _up(w), f"{name} watch to list")
            async with aiohttp.ClientSession() as session:
                harness = Harness(
                    env, agent, f"http://127.0.0.1:{bound_port(runner)}", clock, session
                )
                if first_cycle:
                    await harness.cycle()
                yield harness
        finally:
            await runner.cleanup()
            await agent.close()
    finally:
        await env.stop()


def _up(source: Source) -> bool:
    status = source.status()
    return status is not None and status.up


async def _wait_for(predicate: object, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)
