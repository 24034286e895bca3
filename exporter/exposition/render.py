"""Text (0.0.4) and OpenMetrics (1.0) bytes of a registry, as prometheus_client writes them.

prometheus_client's ``generate_latest`` escapes every metric and label name character by
character on every call (a Python loop per character): on the reference node that was
about 60 % of a sample cycle. This writer does less work twice over:

- Most families come back from one cycle to the next exactly as they were (on
  ``node-8gpu`` about 83 % of them: identities, limits, states, counters that did not
  move), so a family equal to the one written last time (``Metric.__eq__``: name, help,
  type, unit and every sample) is written as the text it got then.
- In a family that did change, most series keep their labels, so each series'
  ``name{labels}`` is rendered once and reused while the series lives; values go through
  prometheus_client's own ``floatToGoString``.

The output is byte for byte what prometheus_client writes (tests/test_render.py compares
both on every shipped scenario and on awkward label values), with one exception that no
caller produces: Python holds ``-0.0 == 0.0``, so a value that flips between the two is
written as it was last time (the same number to Prometheus). ``FamilyBuilder`` never
serves ``-0.0``, and prometheus_client's counters and histograms cannot hold it. A family
this writer does not handle (exemplars, timestamps, native histograms, names outside the
legacy character set, types other than gauge, counter and histogram) is written by
prometheus_client itself.

The reuse is bounded: a render keeps only the families and series it wrote, so what is
gone costs nothing after the next render in that format; in steady state the kept
families are the very objects the registry serves. A format no one asks for any more
is ``forget``-ed (exporter/exposition/server.py): its last render's families (~0.6 MiB on
node-8gpu, a cycle's samples and texts) are not held until a render that may never come.
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

# (sample name, label items) -> 'name{labels}'
_SeriesNames = dict[tuple[str, tuple[tuple[str, str], ...]], str]


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
        # the series of the families written sample by sample in the last render
        self._series: _SeriesNames = {}
        # by format (True: OpenMetrics), family name -> the family last written, its text
        self._written: dict[bool, dict[str, tuple[Metric, str]]] = {False: {}, True: {}}

    def text(self, registry: Collector) -> bytes:
        return self._render(registry, openmetrics=False)

    def openmetrics(self, registry: Collector) -> bytes:
        return self._render(registry, openmetrics=True)

    def forget(self, *, openmetrics: bool) -> None:
        """Drop the families and texts kept from the last render in this format (for a
        format no one asks for any more: they would be held until its next render)."""
        self._written[openmetrics] = {}

    def _render(self, registry: Collector, *, openmetrics: bool) -> bytes:
        last = self._written[openmetrics]
        written: dict[str, tuple[Metric, str]] = {}
        seen: _SeriesNames = {}
        out: list[str] = []
        for metric in registry.collect():
            previous = last.get(metric.name)
            if previous is not None and previous[0] == metric:
                text = previous[1]
            else:
                text = self._family(metric, seen, openmetrics=openmetrics)
            written[metric.name] = (metric, text)
            out.append(text)
        if openmetrics:
            out.append("# EOF\n")
        self._written[openmetrics] = written
        self._series = seen
        return "".join(out).encode("utf-8")

    def _family(self, metric: Metric, seen: _SeriesNames, *, openmetrics: bool) -> str:
        """One family's text; series names come from the last render where it had them."""
        if not _plain(metric):
            return self._by_library(metric, openmetrics=openmetrics)
        name, kind = metric.name, metric.type
        if openmetrics:
            doc = _escape_value(metric.documentation)
        else:
            doc = metric.documentation.replace("\\", r"\\").replace("\n", r"\n")
            if kind == "counter":
                name += "_total"
        out = [f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"]
        known = self._series
        for sample in metric.samples:
            key = (sample.name, tuple(sample.labels.items()))
            series = known.get(key) or seen.get(key) or _series(sample.name, sample.labels)
            seen[key] = series
            value = floatToGoString(sample.value)  # type: ignore[no-untyped-call]
            out.append(f"{series} {value}\n")
        return "".join(out)

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
