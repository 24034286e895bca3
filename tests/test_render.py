"""The exposition writer (exporter/exposition/render.py) writes exactly what
prometheus_client's generate_latest writes, in both formats, on every shipped scenario
and on awkward input, with its series cache cold and warm."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import generate_latest as generate_text
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.samples import Sample

from exporter.exposition.render import Renderer
from exporter.sim.scenario import SHIPPED
from tests.golden.record import on_schedule
from tests.harness import simulated_exporter


def assert_same_as_library(renderer: Renderer, registry: CollectorRegistry) -> None:
    assert renderer.text(registry) == generate_text(registry)
    assert renderer.openmetrics(registry) == generate_openmetrics(registry)


@pytest.mark.parametrize("scenario", SHIPPED)
async def test_every_shipped_scenario_renders_as_prometheus_client_does(scenario: str) -> None:
    renderer = Renderer()
    async with simulated_exporter(scenario) as h:
        cycles = 0
        async for _ in on_schedule(h):
            cycles += 1
            if cycles % 8 == 1:  # cold, then warm with the series of earlier cycles
                assert_same_as_library(renderer, h.agent.registry)
        assert_same_as_library(renderer, h.agent.registry)


class Families:
    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def test_awkward_label_values_documentation_and_numbers_match_the_library() -> None:
    registry = CollectorRegistry(auto_describe=False)
    gauge = Gauge(
        "g", 'help with \\ backslash, "quotes"\nand a newline', ["a", "b"], registry=registry
    )
    for value in ('quote " here', "back\\slash", "new\nline", "ünïcödé ☃", "", "plain"):
        gauge.labels(value, "x").set(1.5)
    gauge.labels("inf", "y").set(float("inf"))
    gauge.labels("-inf", "y").set(float("-inf"))
    gauge.labels("nan", "y").set(float("nan"))
    gauge.labels("big", "y").set(123456789012.0)
    gauge.labels("tiny", "y").set(1e-12)
    gauge.labels("neg", "y").set(-3.0)
    Counter("c", "a counter", ["source"], registry=registry).labels("nvml").inc(3)
    Histogram("h_seconds", "a histogram", registry=registry, buckets=(0.1, 1.0)).observe(0.5)
    renderer = Renderer()
    assert_same_as_library(renderer, registry)
    assert_same_as_library(renderer, registry)  # warm


def test_families_it_does_not_write_itself_are_left_to_the_library() -> None:
    info = InfoMetricFamily("build", "an info family", value={"version": "1"})
    unit = GaugeMetricFamily("temp_celsius", "with a unit", unit="celsius", value=20)
    stamped = GaugeMetricFamily("stamped", "with a timestamp")
    stamped.samples.append(Sample("stamped", {}, 1.0, 1700000000.5))
    odd_label = GaugeMetricFamily("odd", "a label name outside the legacy set", labels=["a.b"])
    odd_label.add_metric(["v"], 2.0)
    families = Families([info, unit, stamped, odd_label])
    renderer = Renderer()
    assert renderer.text(families) == generate_text(families)  # type: ignore[arg-type]
    assert renderer.openmetrics(families) == generate_openmetrics(families)  # type: ignore[arg-type]


def test_series_of_earlier_renders_are_not_kept() -> None:
    registry = CollectorRegistry(auto_describe=False)
    gauge = Gauge("pods", "one series per pod", ["pod"], registry=registry)
    renderer = Renderer()
    for cycle in range(50):
        gauge.clear()
        gauge.labels(f"job-{cycle}").set(1)  # every cycle a new pod, the old one gone
        assert renderer.text(registry) == generate_text(registry)
    assert len(renderer._series) == 1


def _gauge(name: str, samples: dict[str, float], doc: str = "a gauge") -> Metric:
    family = GaugeMetricFamily(name, doc, labels=["pod"])
    for pod, value in samples.items():
        family.add_metric([pod], value)
    return family


def test_a_family_is_written_again_when_anything_in_it_changed() -> None:
    """Unchanged families are written as last time; a changed value, label, series,
    help text or type, and a family that comes or goes, are written anew."""
    renders = [
        [_gauge("a", {"p1": 1.0, "p2": 2.0}), _gauge("b", {"p1": 0.0})],
        [_gauge("a", {"p1": 1.0, "p2": 2.0}), _gauge("b", {"p1": 0.0})],  # unchanged
        [_gauge("a", {"p1": 1.0, "p2": 2.5}), _gauge("b", {"p1": 0.0})],  # a value
        [_gauge("a", {"p1": 1.0, "p3": 2.5}), _gauge("b", {"p1": 0.0})],  # a label
        [_gauge("a", {"p1": 1.0}), _gauge("b", {"p1": 0.0}, doc="new help")],
        [_gauge("a", {"p1": 1.0}), CounterMetricFamily("b", "a gauge", value=0.0)],
        [_gauge("a", {"p1": 1.0})],  # b gone
        [_gauge("a", {"p1": 1.0}), _gauge("b", {"p1": 0.0}), _gauge("c", {"p1": 1.0})],
        [_gauge("a", {"p1": float("nan")})],
        [_gauge("a", {"p1": float("nan")})],  # NaN != NaN: written anew, the same bytes
    ]
    renderer = Renderer()
    for metrics in renders:
        families = Families(metrics)
        assert renderer.text(families) == generate_text(families)  # type: ignore[arg-type]
        assert renderer.openmetrics(families) == generate_openmetrics(families)  # type: ignore[arg-type]
    assert set(renderer._written[True]) == {"a"}  # only the last render's families are kept
