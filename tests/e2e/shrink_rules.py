"""The alert rules on an e2e time scale: one production minute becomes one second.

The real rules wait minutes (`for: 5m`, `for: 1h`, 10-minute ages, 15-minute rate
windows); promtool's unit tests (alerts/tests) check those exact durations. The e2e test
runs a real Prometheus against the running exporter for about a minute, so it loads a
copy of alerts/gpu-occupancy-exporter.rules.yaml in which every time constant, and
nothing else, is divided by ``SCALE`` with a floor of ``FLOOR_S`` seconds:

- every `for:`;
- every range `[d]`, subquery `[d:r]` (both) and `offset d` in an expression;
- every number of seconds compared with an age, `time() - <...> > N`.

The floor keeps every window at several 1 s scrapes and sample cycles, so a rate has
samples and a one-cycle delay never fires an alert. Expressions stay verbatim otherwise
(`test_shrinking_changes_only_time_constants` checks that). The recording rules are
loaded unchanged, except a file whose records are themselves windows over time (the
right-sizing rules' 7-day p95s: ``shrink_rules(doc, records=True)``): there every
record's ranges and offsets shrink like an alert's, and each group's ``interval:`` is
divided by ``SCALE`` too, with a floor of one e2e evaluation (``EVALUATION_S``), not
``FLOOR_S``: an interval is not a window that must hold samples. Every function takes
a ``scale`` other than ``SCALE`` for a run that needs longer windows
(test_why_idle_e2e.py: 30) or shorter ones (test_prometheus_e2e.py's alerts: 120).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any

import yaml

from tests.test_alert_rules import duration_s

SCALE = 60  # production seconds per e2e second
FLOOR_S = 5  # no time constant shorter than this many seconds (5 scrapes at 1 s)
EVALUATION_S = 1  # the e2e Prometheus evaluates rules every second (stack.prometheus_config)

_DURATION = r"(?:\d+(?:ms|s|m|h|d|w|y))+"
_RANGE = re.compile(rf"\[({_DURATION})\]")
_SUBQUERY = re.compile(rf"\[({_DURATION}):({_DURATION})\]")
_OFFSET = re.compile(rf"\boffset\s+({_DURATION})\b")
# `time() - <anything without a comparison> > N`: N is an age in seconds
_AGE = re.compile(r"(\btime\(\)\s*-[^<>=!]*?>\s*)(\d+(?:\.\d+)?)\b")


def shrink_seconds(seconds: float, scale: int = SCALE) -> int:
    return max(math.ceil(seconds / scale), FLOOR_S)


def shrink_duration(text: str, scale: int = SCALE) -> str:
    return f"{shrink_seconds(duration_s(text), scale)}s"


def shrink_interval(text: str, scale: int = SCALE) -> str:
    """A rule group's evaluation ``interval:`` on the e2e scale (1m -> 1s)."""
    return f"{max(math.ceil(duration_s(text) / scale), EVALUATION_S)}s"


def shrink_expr(expr: str, scale: int = SCALE) -> str:
    expr = _RANGE.sub(lambda m: f"[{shrink_duration(m.group(1), scale)}]", expr)
    expr = _SUBQUERY.sub(
        lambda m: f"[{shrink_duration(m.group(1), scale)}:{shrink_duration(m.group(2), scale)}]",
        expr,
    )
    expr = _OFFSET.sub(lambda m: f"offset {shrink_duration(m.group(1), scale)}", expr)
    return _AGE.sub(lambda m: f"{m.group(1)}{shrink_seconds(float(m.group(2)), scale)}", expr)


def time_constants_blanked(expr: str) -> str:
    """The expression with every constant ``shrink_expr`` may change replaced by ``T``."""
    expr = _RANGE.sub("[T]", expr)
    expr = _SUBQUERY.sub("[T:T]", expr)
    expr = _OFFSET.sub("offset T", expr)
    return _AGE.sub(lambda m: f"{m.group(1)}T", expr)


def shrink_rules(
    doc: dict[str, Any], *, records: bool = False, scale: int = SCALE
) -> dict[str, Any]:
    """A copy of a rule file's document with every alert's time constants divided by
    ``scale``; with ``records``, every recording rule's and each group's ``interval:`` too."""
    out: dict[str, Any] = {"groups": []}
    for group in doc["groups"]:
        rules = []
        for rule in group["rules"]:
            rule = dict(rule)
            if "alert" in rule or records:
                rule["expr"] = shrink_expr(rule["expr"], scale)
                if "for" in rule:
                    rule["for"] = shrink_duration(rule["for"], scale)
            rules.append(rule)
        shrunk = {**group, "rules": rules}
        if records and "interval" in group:
            shrunk["interval"] = shrink_interval(group["interval"], scale)
        out["groups"].append(shrunk)
    return out


def write_shrunk_rules(
    source: Path, target: Path, *, records: bool = False, scale: int = SCALE
) -> Path:
    doc = yaml.safe_load(source.read_text(encoding="utf-8"))
    target.write_text(
        yaml.safe_dump(
            shrink_rules(doc, records=records, scale=scale), sort_keys=False, width=1000
        ),
        encoding="utf-8",
    )
    return target
