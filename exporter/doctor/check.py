"""One check's finding: a verdict an operator can act on, and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Verdict = Literal["ok", "degraded", "missing"]
# Worst last: the order in which a run's verdicts are summed up.
VERDICTS: tuple[Verdict, ...] = ("ok", "degraded", "missing")


@dataclass(frozen=True, slots=True)
class Check:
    """``verdict``: ``ok`` (works), ``degraded`` (works with less), ``missing`` (the
    exporter with these flags would not work). ``fix`` names the remedy (a flag, a chart
    value, an RBAC rule, a toolkit setting); empty only where there is nothing to fix."""

    name: str
    verdict: Verdict
    detail: str
    fix: str = ""


def ok(name: str, detail: str) -> Check:
    return Check(name, "ok", detail)


def degraded(name: str, detail: str, fix: str) -> Check:
    return Check(name, "degraded", detail, fix)


def missing(name: str, detail: str, fix: str) -> Check:
    return Check(name, "missing", detail, fix)


def exit_status(checks: list[Check]) -> int:
    """0 when the exporter with these flags would work (no check ``missing``), else 1."""
    return 1 if any(c.verdict == "missing" for c in checks) else 0
