"""The soak's short form (its long form, 100,000 cycles, is ``python benchmarks/soak.py``;
docs/reliability.md): a churning node-8gpu — a new pid every cycle, a job pod created
and deleted every minute, a GPU lost and back every 10 minutes — keeps the exporter's
open files, threads and Python objects flat. Samples are taken a whole GPU flap period
apart, so each is at the same point of every churn cycle."""

from __future__ import annotations

import asyncio

import pytest

from exporter.sim.node import ManualClock, SimNode
from exporter.sim.scenario import load_scenario
from tests.bench_scripts import load

soak = load("soak")

PERIOD = soak.FLAP_PERIOD_S  # cycles between samples: one period of every kind of churn


def quiet_processes(at_s: float) -> int:
    """GPU processes of node-8gpu without churn ``at_s`` seconds in."""
    node = SimNode(load_scenario("node-8gpu"), ManualClock(at_s))
    node.advance()
    return len(node.processes)


@pytest.mark.slow
def test_a_churning_node_keeps_files_threads_and_python_objects_flat() -> None:
    plan = soak.SoakPlan(cycles=3 * PERIOD, churn=True, sample_every=PERIOD, slope_from=PERIOD)
    result = asyncio.run(soak.soak(plan))
    assert result["sources_down_at_end"] == []
    samples = {s["cycle"]: s for s in result["samples"]}
    warm, mid, end = samples[PERIOD], samples[2 * PERIOD], samples[3 * PERIOD]
    assert warm["processes"] >= quiet_processes(PERIOD) + 15  # ~20 churn workers alive
    for key in ("fds", "threads"):  # one may be in flight (a relist, a refresh) at a sample
        assert end[key] <= warm[key] + 1 and mid[key] <= warm[key] + 1, key
    # Every pid, container and pod of the first periods is gone from what the exporter
    # holds: one object kept per churned pid would add PERIOD objects per period; the
    # objects in flight at a sample (a watch event, a refresh) move the count by ~150.
    grown = end["gc_objects"] - mid["gc_objects"]
    assert grown < PERIOD / 2, (warm, mid, end)
