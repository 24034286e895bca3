"""The doctor's report: one line per check for an operator, or JSON for a script."""

from __future__ import annotations

import json
from dataclasses import asdict

from exporter.doctor.check import Check, exit_status


def render_text(checks: list[Check]) -> str:
    """``VERDICT  name  detail  (fix: ...)``, columns aligned, then a summary line."""
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for check in checks:
        fix = f"  (fix: {check.fix})" if check.fix and check.verdict != "ok" else ""
        lines.append(f"{check.verdict.upper():<8}  {check.name:<{width}}  {check.detail}{fix}")
    counts = {v: sum(c.verdict == v for c in checks) for v in ("ok", "degraded", "missing")}
    summary = ", ".join(f"{n} {v}" for v, n in counts.items())
    verdict = (
        "the exporter with these flags would work"
        if exit_status(checks) == 0
        else "the exporter with these flags would NOT work"
    )
    return "\n".join([*lines, "", f"{summary}: {verdict}"]) + "\n"


def render_json(checks: list[Check]) -> str:
    """``{"ok": bool, "checks": [{"name", "verdict", "detail", "fix"}, ...]}``."""
    body = {"ok": exit_status(checks) == 0, "checks": [asdict(c) for c in checks]}
    return json.dumps(body, indent=2) + "\n"
