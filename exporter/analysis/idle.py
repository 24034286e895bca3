"""Allocated but idle (pure): how long each container held a device without using it.

The activity signal per allocation, best first (a GPU NVML does not know or that
failed is not judged at all):
- no process of the container on the device at all: idle;
- a time-sliced replica: the container's own SM share (per-process samples), since the
  GPU's activity belongs to everyone sharing it;
- a MIG instance or whole GPU: SM activity from GPM/DCGM, else NVML GPU-Util.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from exporter.model import Allocation, ContainerGpuUsage, ContainerRef, GpuSample, IdleAllocation


@dataclass(frozen=True)
class IdlePolicy:
    threshold_ratio: float = 0.05  # activity below this counts as idle
    max_gap_s: float = 60.0  # longer gaps (exporter down) are not counted as idle time


def _activity(
    a: Allocation,
    usage: dict[tuple[ContainerRef, str | None, str | None], ContainerGpuUsage],
    gpus: dict[str, GpuSample],
) -> float | None:
    device = a.device
    gpu = gpus.get(device.uuid) if device.uuid is not None else None
    if gpu is None or gpu.error or not gpu.processes_listed:
        # an unresolved device cannot be judged; a lost GPU is not idle, it is broken;
        # without a process listing, "no processes" would be a guess
        return None
    used = usage.get((a.container, gpu.uuid, device.mig_uuid))
    if used is None or used.processes == 0:
        return 0.0
    if a.shared:
        return used.sm_ratio or 0.0
    if device.mig_uuid:
        mig = next((m for m in gpu.mig_instances if m.uuid == device.mig_uuid), None)
        return mig.occupancy.sm_active if mig and mig.occupancy else None
    if gpu.occupancy is not None and gpu.occupancy.sm_active is not None:
        return gpu.occupancy.sm_active
    util = gpu.utilization_gpu_percent
    return None if util is None else util / 100.0


def account_idle(
    previous: Sequence[IdleAllocation],
    allocations: Sequence[Allocation],
    containers: Sequence[ContainerGpuUsage],
    gpus: Sequence[GpuSample],
    *,
    elapsed_s: float,
    policy: IdlePolicy,
) -> tuple[IdleAllocation, ...]:
    """Carry the idle counters forward by ``elapsed_s`` (the time since the last cycle).

    Allocations that disappeared drop out; their counters end with them. An allocation
    whose activity cannot be judged (no signal at all) is not counted as idle.
    """
    before = {(p.container, p.device_id): p for p in previous}
    usage = {(c.container, c.device.uuid, c.device.mig_uuid): c for c in containers}
    by_uuid = {g.uuid: g for g in gpus}
    step = elapsed_s if 0 < elapsed_s <= policy.max_gap_s else 0.0
    out = []
    for a in allocations:
        activity = _activity(a, usage, by_uuid)
        idle = activity is not None and activity < policy.threshold_ratio
        prior = before.get((a.container, a.device_id))
        total = (prior.idle_seconds_total if prior else 0.0) + (step if idle else 0.0)
        out.append(IdleAllocation(a.container, a.device, a.device_id, idle, total))
    return tuple(out)
