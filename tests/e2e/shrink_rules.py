"""The alert rules on an e2e time scale: one production minute becomes one second.

The real rules wait minutes (`for: 5m`, `for: 1h`, 10-minute ages, 15-minute rate
windows); promtool's unit tests (alerts/tests) check those exact durations. The e2e test
runs a real Prometheus against the running exporter for about two minutes, so it loads a
copy of alerts/gpu-occupancy-exporter.rules.yaml in which every time constant, and
nothing else, is divided by ``SCALE`` with a floor of ``FLOOR_S`` seconds:

- every `for:`;
- every range `[d]` and every `offset d` in an expression;
- every number of seconds compared with an age, `time() - <...> > N`.

The floor keeps every window at several 1 s scrapes and sample cycles, so a rate has
samples and a one-cycle delay never fires an alert. Expressions stay verbatim otherwise
(`test_shrinking_changes_only_time_constants` checks that). The recording rules are
loaded unchanged.
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

_DURATION = r"(?:\d+(?:ms|s|m|h|d|w|y))+"
_RANGE = re.compile(rf"\[({_DURATION})\]")
_OFFSET = re.compile(rf"\boffset\s+({_DURATION})\b")
# `time() - <anything without a comparison> > N`: N is an age in seconds
_AGE = re.compile(r"(\btime\(\)\s*-[^<>=!]*?>\s*)(\d+(?:\.\d+)?)\b")


def shrink_seconds(seconds: float) -> int:
    return max(math.ceil(seconds / SCALE), FLOOR_S)


def shrink_duration(text: str) -> str:
    return f"{shrink_seconds(duration_s(text))}s"


def shrink_expr(expr: str) -> str:
    expr = _RANGE.sub(lambda m: f"[{shrink_duration(m.group(1))}]", expr)
    expr = _OFFSET.sub(lambda m: f"offset {shrink_duration(m.group(1))}", expr)
    return _AGE.sub(lambda m: f"{m.group(1)}{shrink_seconds(float(m.group(2)))}", expr)


def time_constants_blanked(expr: str) -> str:
    """The expression with every constant ``shrink_expr`` may change replaced by ``T``."""
    expr = _RANGE.sub("[T]", expr)
    expr = _OFFSET.sub("offset T", expr)
    return _AGE.sub(lambda m: f"{m.group(1)}T", expr)


def shrink_rules(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of a rule file's document with every alert's time constants shrunk."""
    out: dict[str, Any] = {"groups": []}
    for group in doc["groups"]:
        rules = []
        for rule in group["rules"]:
            rule = dict(rule)
            if "alert" in rule:
                rule["expr"] = shrink_expr(rule["expr"])
                if "for" in rule:
                    rule["for"] = shrink_duration(rule["for"])
            rules.append(rule)
        out["groups"].append({**group, "rules": rules})
    return out


def write_shrunk_rules(source: Path, target: Path) -> Path:
    doc = yaml.safe_load(source.read_text(encoding="utf-8"))
    target.write_text(
        yaml.safe_dump(shrink_rules(doc), sort_keys=False, width=1000), encoding="utf-8"
    )
    return target
