"""Allocated but idle (pure): how long each container held a device without using it.

What "idle" means is ``exporter/analysis/activity.py``'s judgement, shared with the
GPU-hour ledger (``exporter/analysis/ledger.py``): a device without a process of the
container, or with activity below the threshold. A device that cannot be judged (an
unlisted or failed GPU, a failed process listing, no signal) is never idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from exporter.analysis.activity import activity, distinct_allocations, usage_index
from exporter.model import Allocation, ContainerGpuUsage, GpuSample, IdleAllocation


@dataclass(frozen=True)
class IdlePolicy:
    threshold_ratio: float = 0.05  # activity below this counts as idle
    max_gap_s: float = 60.0  # longer gaps (exporter down) are not counted as idle time


def counted_step(elapsed_s: float, policy: IdlePolicy) -> float:
    """The seconds one cycle adds to time counters: 0 for the first cycle and for a gap
    longer than ``max_gap_s`` (the exporter was down: nobody saw what happened)."""
    return elapsed_s if 0 < elapsed_s <= policy.max_gap_s else 0.0


def account_idle(
    previous: Sequence[IdleAllocation],
    allocations: Sequence[Allocation],
    containers: Sequence[ContainerGpuUsage],
    gpus: Sequence[GpuSample],
    *,
    elapsed_s: float,
    policy: IdlePolicy,
    listed: bool = True,
) -> tuple[IdleAllocation, ...]:
    """Carry the idle counters forward by ``elapsed_s`` (the time since the last cycle).

    Allocations that a PodResources listing no longer has drop out; their counters end
    with them. Without a listing (``listed`` False: PodResources failed) every counter
    stays as it was, not idle: which allocations exist is unknown, not none. An
    allocation whose activity cannot be judged (no signal at all) is not counted as idle.
    """
    if not listed:
        return tuple(replace(p, idle_now=False) for p in previous)
    allocations = distinct_allocations(allocations)
    before = {(p.container, p.device_id): p for p in previous}
    usage = usage_index(containers)
    by_uuid = {g.uuid: g for g in gpus}
    step = counted_step(elapsed_s, policy)
    out = []
    for a in allocations:
        ratio = activity(a, usage, by_uuid).ratio
        idle = ratio is not None and ratio < policy.threshold_ratio
        prior = before.get((a.container, a.device_id))
        total = (prior.idle_seconds_total if prior else 0.0) + (step if idle else 0.0)
        out.append(IdleAllocation(a.container, a.device, a.device_id, idle, total))
    return tuple(out)
