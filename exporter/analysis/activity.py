"""How active an allocation is this cycle (pure): the one judgement idle time and the
GPU-hour ledger both rest on, so the two never disagree about what "idle" means.

The activity signal per allocation, best first (a GPU NVML does not know or that
failed is not judged at all):
- no process of the container on the device at all: no process (activity 0);
- a time-sliced replica: the container's own SM share (per-process samples), since the
  GPU's activity belongs to everyone sharing it;
- a MIG instance or whole GPU: SM activity from GPM/DCGM, else NVML GPU-Util.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from exporter.model import Allocation, ContainerGpuUsage, ContainerRef, GpuSample
from exporter.model.fast_init import fast_init

UsageKey = tuple[ContainerRef, str | None, str | None]  # (container, GPU uuid, MIG uuid)


@fast_init
@dataclass(frozen=True, slots=True)
class Activity:
    """``ratio`` None: no signal can judge it (an unresolved or unlisted device, a failed
    GPU or process listing, no activity counter). ``has_process``: a process of the
    container is on the device (only meaningful when ``ratio`` is not None)."""

    ratio: float | None
    has_process: bool = False


UNJUDGED = Activity(None)
NO_PROCESS = Activity(0.0, has_process=False)


def finite(value: float | None) -> float | None:
    """``value``, or None when it is not a number (NaN or infinite: no signal)."""
    return value if value is not None and math.isfinite(value) else None


def distinct_allocations(allocations: Sequence[Allocation]) -> tuple[Allocation, ...]:
    """One allocation per (container, device id): the kubelet can list one device under
    two resource names for one container (``nvidia.com/gpu`` and ``nvidia.com/gpu.shared``
    while a device plugin's config changes); that is one device held once, not twice. It
    is shared when either listing says so."""
    merged: dict[tuple[ContainerRef, str], Allocation] = {}
    for a in allocations:
        key = (a.container, a.device_id)
        first = merged.get(key)
        merged[key] = a if first is None else replace(first, shared=first.shared or a.shared)
    return tuple(merged.values())


def usage_index(containers: Iterable[ContainerGpuUsage]) -> dict[UsageKey, ContainerGpuUsage]:
    """Attribution's usage rows by (container, GPU uuid, MIG uuid)."""
    return {(c.container, c.device.uuid, c.device.mig_uuid): c for c in containers}


def activity(
    a: Allocation, usage: Mapping[UsageKey, ContainerGpuUsage], gpus: Mapping[str, GpuSample]
) -> Activity:
    device = a.device
    gpu = gpus.get(device.uuid) if device.uuid is not None else None
    if gpu is None or gpu.error or not gpu.processes_listed:
        # an unresolved device cannot be judged; a lost GPU is not idle, it is broken;
        # without a process listing, "no processes" would be a guess
        return UNJUDGED
    used = usage.get((a.container, gpu.uuid, device.mig_uuid))
    if used is None or used.processes == 0:
        return NO_PROCESS
    # a value that is not a number (a GPM or DCGM read gone wrong) is no signal at all:
    # NaN compares below every threshold and would count as idle
    if a.shared:
        if used.sm_ratio is not None and finite(used.sm_ratio) is None:
            return UNJUDGED
        # a process without a per-process sample had no SM time in the driver's window
        return Activity(used.sm_ratio or 0.0, has_process=True)
    if device.mig_uuid:
        mig = next((m for m in gpu.mig_instances if m.uuid == device.mig_uuid), None)
        ratio = finite(mig.occupancy.sm_active) if mig and mig.occupancy else None
        return Activity(ratio, has_process=True)
    sm_active = finite(gpu.occupancy.sm_active) if gpu.occupancy is not None else None
    if sm_active is not None:
        return Activity(sm_active, has_process=True)
    util = gpu.utilization_gpu_percent
    return Activity(None if util is None else util / 100.0, has_process=True)
