"""The timeline's event type, apart from the scenario that parses it and the churn that
makes it on demand.

Both sim/scenario.py (a scenario's ``timeline:``) and sim/churn.py (a ``churn:`` block's
events, made per simulated second) build events; the simulated node (sim/node.py) applies
them in order. With the type here, neither builder imports the other for it, and the
layering test (tests/test_layering.py) holds exporter/ free of import cycles.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SimEvent:
    """One thing that happens at simulated second ``at``: ``action`` (one of the scenario's
    timeline actions, docs/simulator.md) with its arguments. Read-only: a churn timeline
    makes the same second's events again when asked twice, and a scenario's events are
    applied by every simulated node that loads it, so applying one must not change it."""

    at: float
    action: str
    args: Mapping[str, Any]
