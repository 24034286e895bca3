"""Text (0.0.4) and OpenMetrics (1.0) bytes of a registry, as prometheus_client writes them.

prometheus_client's ``generate_latest`` escapes every metric and label name character by
character on every call (a Python loop per character): on the reference node that was
about 60 % of a sample cycle. Names here come from a fixed catalogue and rarely change,
and most series come back with the same labels cycle after cycle, so this writer renders
each series' ``name{labels}`` once and reuses it while the series lives; values go
through prometheus_client's own ``floatToGoString``. The output is byte for byte what
prometheus_client writes (tests/test_render.py compares both on every shipped scenario
and on awkward label values). A family this writer does not handle (exemplars,
timestamps, native histograms, names outside the legacy character set, types other than
gauge, counter and histogram) is written by prometheus_client itself.

The reuse is bounded: a render keeps only the series it wrote, so a series that is gone
costs nothing after the next cycle.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from prometheus_client.exposition import generate_latest as generate_text
from prometheus_client.metrics_core import Metric
from prometheus_client.openmetrics.exposition import escape_label_name
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

_LEGACY_NAME = re.compile(r"^[a-zA-Z_:][a-zA-Z0-9_:]*$")
_LEGACY_LABEL = re.compile(r"^[a-zA-Z_][a-zA-Z0-9_]*$")
_TYPES = frozenset({"gauge", "counter", "histogram"})
_TEXT_ONLY_SUFFIXES = ("_created", "_gsum", "_gcount")  # moved to families of their own


class _Families:
    """A registry's families, collected once for one render."""

    def __init__(self, metrics: Iterable[Metric]) -> None:
        self.metrics = list(metrics)

    def collect(self) -> Iterable[Metric]:
        return self.metrics


def _escape_value(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _plain(metric: Metric) -> bool:
    """Whether this writer produces exactly what prometheus_client would."""
    if metric.type not in _TYPES or metric.unit or not _LEGACY_NAME.match(metric.name):
        return False
    for sample in metric.samples:
        if (
            sample.timestamp is not None
            or sample.exemplar is not None
            or sample.native_histogram is not None
            or sample.value is None
            or sample.name.endswith(_TEXT_ONLY_SUFFIXES)
        ):
            return False
    return True


class Renderer:
    def __init__(self) -> None:
        # (sample name, label items) -> 'name{labels}', for the series of the last render
        self._series: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}

    def text(self, registry: Collector) -> bytes:
        return self._render(registry, openmetrics=False)

    def openmetrics(self, registry: Collector) -> bytes:
        return self._render(registry, openmetrics=True)

    def _render(self, registry: Collector, *, openmetrics: bool) -> bytes:
        known = self._series
        seen: dict[tuple[str, tuple[tuple[str, str], ...]], str] = {}
        out: list[str] = []
        for metric in registry.collect():
            if not _plain(metric):
                out.append(self._by_library(metric, openmetrics=openmetrics))
                continue
            name, kind = metric.name, metric.type
            if openmetrics:
                doc = _escape_value(metric.documentation)
            else:
                doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
                if kind == "counter":
                    name += "_total"
            out.append(f"# HELP {name} {doc}\n# TYPE {name} {kind}\n")
            for sample in metric.samples:
                key = (sample.name, tuple(sample.labels.items()))
                series = known.get(key) or seen.get(key) or _series(sample.name, sample.labels)
                seen[key] = series
                value = floatToGoString(sample.value)  # type: ignore[no-untyped-call]
                out.append(f"{series} {value}\n")
        if openmetrics:
            out.append("# EOF\n")
        self._series = seen
        return "".join(out).encode("utf-8")

    @staticmethod
    def _by_library(metric: Metric, *, openmetrics: bool) -> str:
        one = _Families([metric])
        if openmetrics:
            written: bytes = generate_openmetrics(one)  # type: ignore[no-untyped-call]
            return written.decode("utf-8").removesuffix("# EOF\n")
        return generate_text(one).decode("utf-8")


def _series(name: str, labels: dict[str, str]) -> str:
    if not labels:
        return name
    inner = ",".join(
        f'{k if _LEGACY_LABEL.match(k) else escape_label_name(k)}="{_escape_value(v)}"'
        for k, v in sorted(labels.items())
    )
    return f"{name}{{{inner}}}"
