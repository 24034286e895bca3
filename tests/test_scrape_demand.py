"""A cycle renders a format only when a request is expected before the next cycle
(exporter/exposition/scrape_demand.py), and a request never gets less for it: one that
finds its cycle unrendered renders it on demand. The families behind it are built only
when something renders them (SnapshotCollector), and a build that fails costs a request
nothing but freshness."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import cast

import pytest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector, CollectorRegistry

from exporter.exposition.metrics import ExpositionOptions, SnapshotCollector
from exporter.exposition.scrape_demand import (
    EARLY_MAX_S,
    KEEP_RENDERING_CYCLES,
    MAX_CLIENTS,
    ClientDemands,
    ScrapeDemand,
)
from exporter.exposition.server import OPENMETRICS, TEXT, MetricsCache
from exporter.model import Analysis


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Counting(Collector):
    """One gauge whose value is the cycle it was set in; counts its collections."""

    def __init__(self) -> None:
        self.cycle = 0
        self.collections = 0

    def collect(self) -> Iterator[Metric]:
        self.collections += 1
        yield GaugeMetricFamily("gpu_example_cycle", "the cycle", value=self.cycle)


def _node(clock: Clock) -> tuple[MetricsCache, Counting, CollectorRegistry]:
    cache = MetricsCache(clock=clock)
    collector = Counting()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return cache, collector, registry


def _scrape(cache: MetricsCache, fmt: str) -> tuple[bytes, bool]:
    """What a request gets, and whether it found the cycle already rendered."""
    rendered = cache.cached(fmt)
    if rendered is not None:
        return rendered.body, True
    return cache.render_now(fmt).body, False


def test_a_steady_scraper_finds_every_cycle_it_asks_for_rendered_but_few_are() -> None:
    """Cycles every 1 s, Prometheus every 5 s at an offset: after two scrapes have shown
    the interval, each scrape finds the latest cycle already rendered, and at most two
    cycles in five render OpenMetrics (five of five did before)."""
    clock = Clock()
    cache, collector, registry = _node(clock)
    renders_before = 0
    hits: list[bool] = []
    for second in range(120):
        collector.cycle = second
        cache.render(registry)
        if second == 20:
            renders_before = collector.collections
        clock.now += 0.6
        if second % 5 == 2:  # a scrape 0.6 s after the cycle of second 2, 7, 12, ...
            body, hit = _scrape(cache, OPENMETRICS)
            assert f"gpu_example_cycle {second}.0".encode() in body
            hits.append(hit)
        clock.now += 0.4
    assert all(hits[3:]), hits
    renders = collector.collections - renders_before
    assert renders <= 2 * (100 // 5), renders


@pytest.mark.parametrize("after_render", [0.01, 0.1, 0.3, 0.6, 0.99])
def test_a_steady_scraper_has_one_cycle_rendered_per_scrape_whatever_its_phase(
    after_render: float,
) -> None:
    """Prometheus every 5 s, ``after_render`` seconds after a cycle's render: every scrape
    finds its cycle rendered, and one cycle renders per scrape. A scraper less than a
    quarter period after the render used to have two cycles rendered per scrape."""
    clock = Clock()
    cache, collector, registry = _node(clock)
    hits: list[bool] = []
    renders_before = 0
    for second in range(120):
        collector.cycle = second
        cache.render(registry)
        if second == 20:
            renders_before = collector.collections
        clock.now += after_render
        if second % 5 == 2:
            body, hit = _scrape(cache, OPENMETRICS)
            assert f"gpu_example_cycle {second}.0".encode() in body
            hits.append(hit)
        clock.now += 1.0 - after_render
    assert all(hits[3:]), hits
    renders = collector.collections - renders_before
    if after_render > EARLY_MAX_S:
        assert renders == 100 // 5
    else:  # within ``early`` of a render: the cycle before renders too, in case
        assert renders <= 2 * (100 // 5)


def test_a_scraper_faster_than_the_cycle_gets_every_cycle_rendered() -> None:
    clock = Clock()
    cache, collector, registry = _node(clock)
    misses = 0
    for second in range(40):
        collector.cycle = second
        cache.render(registry)
        for _ in range(10):
            clock.now += 0.1
            _, hit = _scrape(cache, TEXT)
            misses += not hit
    assert misses <= 1, misses  # the first request, before any scraper was known


def test_an_unexpected_request_gets_the_latest_cycle_rendered_on_demand() -> None:
    clock = Clock()
    cache, collector, registry = _node(clock)
    for second in range(33):  # a scraper every 10 s, last at 30.5
        collector.cycle = second
        cache.render(registry)
        clock.now += 0.5
        if second % 10 == 0:
            _scrape(cache, OPENMETRICS)
        clock.now += 0.5
    collector.cycle = 33
    cache.render(registry)  # not due: the next scrape is expected at 40.5
    clock.now += 0.5
    assert cache.cached(OPENMETRICS) is None
    body, hit = _scrape(cache, OPENMETRICS)
    assert not hit and b"gpu_example_cycle 33.0" in body


def test_a_scraper_that_went_away_costs_nothing_after_a_while() -> None:
    clock = Clock()
    cache, collector, registry = _node(clock)
    for _ in range(10):
        cache.render(registry)
        _scrape(cache, OPENMETRICS)
        clock.now += 1.0
    # no more scrapes; text's start-up window is over too
    for _ in range(KEEP_RENDERING_CYCLES + 2):
        cache.render(registry)
        clock.now += 1.0
    before = collector.collections
    for _ in range(20):
        cache.render(registry)
        clock.now += 1.0
    assert collector.collections == before


class Remembering(Counting):
    """Counting that keeps a weak reference to every family it yields."""

    def __init__(self) -> None:
        super().__init__()
        self.families: list[weakref.ref[Metric]] = []

    def collect(self) -> Iterator[Metric]:
        for family in super().collect():
            self.families.append(weakref.ref(family))
            yield family


def test_a_format_no_one_asks_for_any_more_keeps_nothing_of_its_last_render() -> None:
    """The renderer keeps a format's last families to reuse their text; once every
    client of that format is gone (text's start-up window included), nothing of them is
    held: on node-8gpu a cycle's samples and texts, ~0.6 MiB, until a render that may
    never come."""
    clock = Clock()
    cache = MetricsCache(clock=clock)
    collector = Remembering()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    for _ in range(10):
        cache.render(registry)
        _scrape(cache, OPENMETRICS)
        clock.now += 1.0
    assert any(ref() is not None for ref in collector.families)
    for _ in range(KEEP_RENDERING_CYCLES + 2):
        cache.render(registry)
        clock.now += 1.0
    gc.collect()
    assert [ref for ref in collector.families if ref() is not None] == []
    # a client that comes back is answered as ever
    body, _ = _scrape(cache, OPENMETRICS)
    assert body.startswith(b"# HELP gpu_example_cycle")


def test_a_lapsed_demand_is_one_gone_for_keep_rendering_cycles() -> None:
    demand = ScrapeDemand()
    assert demand.lapsed(0.0, 1.0)  # never asked
    demand.asked(100.0)
    assert not demand.lapsed(100.0 + KEEP_RENDERING_CYCLES - 1, 1.0)
    assert demand.lapsed(100.0 + KEEP_RENDERING_CYCLES, 1.0)
    assert not demand.lapsed(10_000.0, None)  # the cycle's period not known yet
    demand.asked(115.0)  # a scraper every 15 s: gone only 10 cycles after it was due
    assert not demand.lapsed(115.0 + 15 + KEEP_RENDERING_CYCLES - 1, 1.0)
    assert demand.lapsed(115.0 + 15 + KEEP_RENDERING_CYCLES, 1.0)
    clients = ClientDemands()
    clients.asked("a", 100.0)
    clients.asked("b", 105.0)
    assert not clients.lapsed(100.0 + KEEP_RENDERING_CYCLES, 1.0)  # b is not gone yet
    assert clients.lapsed(105.0 + KEEP_RENDERING_CYCLES, 1.0)


def test_text_is_rendered_from_the_start_until_anyone_asks() -> None:
    clock = Clock()
    cache, _, registry = _node(clock)
    cache.render(registry)
    assert cache.cached(TEXT) is not None


def _ha_pair(offsets: tuple[float, float], clients: tuple[str, str]) -> tuple[int, list[bool]]:
    """Two Prometheus replicas scraping OpenMetrics every 15 s at ``offsets`` into the
    second, from ``clients``, over 300 cycles of 1 s: cycle renders after the first
    minute, and whether each scrape found its cycle rendered."""
    clock = Clock()
    cache, collector, registry = _node(clock)
    renders_before, hits = 0, []
    for second in range(300):
        collector.cycle = second
        cache.render(registry)
        if second == 60:
            renders_before = collector.collections
        start = clock.now
        for replica, offset in enumerate(offsets):
            if (second - int(offset)) % 15 == 0 and second >= offset:
                clock.now = start + offset % 1
                rendered = cache.cached(OPENMETRICS, clients[replica])
                hits.append(rendered is not None)
                body = (rendered or cache.render_now(OPENMETRICS)).body
                assert f"gpu_example_cycle {second}.0".encode() in body
        clock.now = start + 1.0
    return collector.collections - renders_before, hits


def test_each_replica_of_an_ha_pair_is_predicted_on_its_own() -> None:
    """Replicas 7 s apart: each finds its cycle rendered, and the format renders about
    once per scrape, not every cycle."""
    renders, hits = _ha_pair((0.3, 7.3), ("10.0.0.1", "10.0.0.2"))
    assert all(hits[8:]), hits
    # 32 scrapes in those 240 cycles; one address for both renders 47 times
    assert renders <= 40, renders


def test_an_ha_pair_behind_one_address_still_gets_every_scrape_answered() -> None:
    """Behind a proxy the two replicas look like one client; what they get is right,
    only the cost and the first replica's latency suffer (the module says how)."""
    renders, hits = _ha_pair((0.3, 7.3), ("127.0.0.1", "127.0.0.1"))
    assert renders < 240 // 2, (renders, hits)


def test_a_flood_of_new_clients_is_remembered_only_up_to_a_bound() -> None:
    demands = ClientDemands()
    for i in range(10_000):
        demands.asked(f"10.0.{i // 256}.{i % 256}", float(i))
    assert len(demands._by_client) == MAX_CLIENTS
    assert demands.due(10_000.0, 1.0)  # the last ones asked once: keep rendering


def test_demand_due_follows_the_last_gaps() -> None:
    demand = ScrapeDemand()
    assert not demand.due(0.0, 1.0)  # never asked
    demand.asked(0.0)
    assert demand.due(5.0, 1.0) and not demand.due(KEEP_RENDERING_CYCLES + 1.0, 1.0)
    demand.asked(15.0)  # every 15 s
    assert not demand.due(20.0, 1.0)
    assert demand.due(29.0, 1.0)  # the next is expected at 30: render at 29
    assert demand.due(28.96, 1.0)  # a little early (or the next cycle a little late)
    assert not demand.due(28.8, 1.0)  # the cycle at 29.8 renders before 30
    assert demand.due(33.0, 1.0)  # overdue: keep rendering
    assert not demand.due(30.0 + KEEP_RENDERING_CYCLES + 1.0, 1.0)  # gone
    demand.asked(17.0)  # a second client 2 s later: the shorter gap counts
    assert demand.due(18.5, 1.0)


# -- the families behind it: built only when rendered, a failed build never a scrape's --


class Builds:
    """A build of the families that counts its calls and fails while ``failing``."""

    def __init__(self) -> None:
        self.calls = 0
        self.failing = False

    def __call__(self, analysis: object, options: ExpositionOptions) -> list[Metric]:
        self.calls += 1
        if self.failing:
            raise ValueError("a bug in building the families")
        return [GaugeMetricFamily("gpu_example_cycle", "the cycle", value=float(str(analysis)))]


def _values(collector: SnapshotCollector) -> list[float]:
    return [s.value for family in collector.collect() for s in family.samples]


def test_families_are_built_once_per_cycle_and_only_when_collected() -> None:
    builds = Builds()
    collector = SnapshotCollector(build=builds)
    collector.set(_analysis(1), build_now=False)
    assert builds.calls == 0
    assert _values(collector) == [1.0] and _values(collector) == [1.0]
    assert builds.calls == 1
    collector.set(_analysis(2), build_now=True)
    assert builds.calls == 2 and _values(collector) == [2.0] and builds.calls == 2


def test_a_build_failing_in_a_request_keeps_the_last_families_and_is_never_retried() -> None:
    builds = Builds()
    collector = SnapshotCollector(build=builds)
    collector.set(_analysis(1))
    builds.failing = True
    collector.set(_analysis(2), build_now=False)
    for _ in range(100):  # a flood of requests for the failing cycle: one build
        assert _values(collector) == [1.0]
    assert builds.calls == 2
    assert collector.failed_builds == 1 and collector.last_build_failed


def test_a_build_failing_in_the_cycle_fails_the_cycle() -> None:
    builds = Builds()
    collector = SnapshotCollector(build=builds)
    collector.set(_analysis(1))
    builds.failing = True
    with pytest.raises(ValueError):
        collector.set(_analysis(2), build_now=True)
    assert _values(collector) == [1.0] and collector.last_build_failed
    assert collector.failed_builds == 0  # the cycle counts its own failure
    builds.failing = False
    collector.set(_analysis(3), build_now=True)
    assert _values(collector) == [3.0] and not collector.last_build_failed


def test_a_failed_build_serves_the_last_completed_cycle_not_an_older_one() -> None:
    """Cycles 2..5 were never rendered, so never built; cycle 6's build fails: a scrape
    gets cycle 5, the latest completed, not cycle 1."""

    def fails_for_six(analysis: object, options: ExpositionOptions) -> list[Metric]:
        if analysis == 6:
            raise ValueError("a bug in building the families")
        return [GaugeMetricFamily("gpu_example_cycle", "the cycle", value=float(str(analysis)))]

    collector = SnapshotCollector(build=fails_for_six)
    collector.set(_analysis(1))
    for cycle in range(2, 6):
        collector.set(_analysis(cycle), build_now=False)
    with pytest.raises(ValueError):
        collector.set(_analysis(6), build_now=True)
    assert _values(collector) == [5.0]


def test_a_build_failing_with_no_scraper_still_fails_cycles_soon() -> None:
    """Nothing asks for the exposition: the families are still built every
    BUILD_AT_LEAST_EVERY cycles, so a build that keeps failing fails that cycle and
    every one after it (the liveness probe's evidence), not never."""
    builds = Builds()
    collector = SnapshotCollector(build=builds)
    every = SnapshotCollector.BUILD_AT_LEAST_EVERY
    for cycle in range(1, 2 * every + 1):
        collector.set(_analysis(cycle), build_now=False)
    assert builds.calls == 2
    builds.failing = True
    failed = []
    for cycle in range(2 * every + 1, 4 * every + 1):
        try:
            collector.set(_analysis(cycle), build_now=False)
        except ValueError:
            failed.append(cycle)
    assert failed and failed[0] <= 3 * every
    assert failed == list(range(failed[0], 4 * every + 1))


def _analysis(cycle: int) -> Analysis:
    """What the injected build reads: only its cycle number."""
    return cast(Analysis, cycle)
