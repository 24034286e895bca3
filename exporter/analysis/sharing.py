"""Shared GPUs (pure): who took the turns, and how close the next allocation is to OOM.

Processes on one GPU take turns: a kernel runs to completion and nothing preempts it,
and time-slicing only multiplies the advertised device, with no fair share and no
memory isolation (docs/shared-gpus.md). On a GPU that several containers share, per
cycle:

- a container *had work* when the driver's per-process samples gave it SM time in the
  window (attribution's ``sm_ratio``); its *share* is its part of the SM time all
  containers used, and its *deviation* that share minus an equal share of the containers
  that had work (under MPS the kernels run concurrently: a share is then of concurrent
  SM time, not of turns);
- the GPU's *headroom* is total - used - reserved, what the next allocation of anyone
  can get; each container's *growth* is how far its memory rose above its lowest point
  in the last ``growth_window_s``, so "the next growth like the last one will not fit"
  and "who grew" read off the same cycle.

MIG instances are hardware partitions (and per-process samples are not supported
there): they are not shared GPUs in this sense.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from exporter.model import (
    Allocation,
    ContainerGpuUsage,
    ContainerRef,
    ContainerShare,
    DeviceRef,
    GpuSample,
    SharedGpu,
)

_Key = tuple[ContainerRef, str]  # (container, GPU uuid)


@dataclass(frozen=True)
class SharingPolicy:
    growth_window_s: float = 300.0  # how far back a container's memory growth is measured


@dataclass(frozen=True)
class MemoryHistory:
    """(container, GPU uuid) -> its (timestamp, bytes) samples inside the growth window
    that can still be the window's minimum, only for containers on shared GPUs: as small
    as the set of sharers. A sample at or above a later one never is (the later one stays
    in the window longer), so each kept sample is below every later one: memory that holds
    steady keeps one sample, not one per cycle of the window."""

    samples: Mapping[_Key, tuple[tuple[float, int], ...]] = field(default_factory=dict)


def shared_devices(
    containers: Sequence[ContainerGpuUsage], allocations: Sequence[Allocation]
) -> dict[str, list[ContainerGpuUsage]]:
    """GPU uuid -> the usage rows on it, for every whole GPU that two or more containers
    use, or that was allocated as a shared (time-sliced or MPS) device."""
    on: dict[str, list[ContainerGpuUsage]] = defaultdict(list)
    for usage in containers:
        device = usage.device
        if device.uuid is not None and device.gpu is not None and device.mig_uuid is None:
            on[device.uuid].append(usage)
    declared = {
        a.device.uuid for a in allocations if a.shared and a.device.mig_uuid is None and a.resolved
    }
    return {uuid: rows for uuid, rows in on.items() if len(rows) >= 2 or uuid in declared}


def _headroom(gpu: GpuSample | None) -> int | None:
    if gpu is None or gpu.error:
        return None
    total, used = gpu.memory_total_bytes, gpu.memory_used_bytes
    reserved = gpu.memory_reserved_bytes
    if total is None or used is None or reserved is None:
        return None
    return max(total - used - reserved, 0)


def _turns(rows: Sequence[ContainerGpuUsage]) -> dict[ContainerRef, tuple[float, float | None]]:
    """container -> (share of the used SM time, deviation from an equal share); empty
    when no container had a sample (an idle GPU, or samples unsupported)."""
    used = {r.container: r.sm_ratio for r in rows if r.sm_ratio is not None}
    total = sum(used.values())
    if total <= 0:
        return {}
    active = sum(1 for ratio in used.values() if ratio > 0)
    out: dict[ContainerRef, tuple[float, float | None]] = {}
    for row in rows:
        share = (used.get(row.container) or 0.0) / total
        working = used.get(row.container, 0.0) > 0
        out[row.container] = (share, share - 1.0 / active if working else None)
    return out


def analyse_sharing(
    containers: Sequence[ContainerGpuUsage],
    allocations: Sequence[Allocation],
    gpus: Sequence[GpuSample],
    history: MemoryHistory,
    *,
    now: float,
    policy: SharingPolicy,
) -> tuple[tuple[SharedGpu, ...], tuple[ContainerShare, ...], MemoryHistory]:
    by_uuid = {g.uuid: g for g in gpus}
    since = now - policy.growth_window_s
    shared: list[SharedGpu] = []
    shares: list[ContainerShare] = []
    kept: dict[_Key, tuple[tuple[float, int], ...]] = {}
    for uuid, rows in sorted(shared_devices(containers, allocations).items()):
        gpu = by_uuid.get(uuid)
        turns = _turns(rows)
        active = sum(1 for _, deviation in turns.values() if deviation is not None)
        device = DeviceRef(rows[0].device.gpu, uuid)
        shared.append(SharedGpu(device, len(rows), active, _headroom(gpu)))
        for row in sorted(rows, key=lambda r: r.container):
            growth = None
            if row.memory_used_bytes is not None:
                key = (row.container, uuid)
                used = row.memory_used_bytes
                samples = history.samples.get(key, ())
                past = tuple(s for s in samples if s[0] > since and s[1] < used)
                kept[key] = (*past, (now, used))
                growth = used - min(b for _, b in kept[key])
            share, deviation = turns.get(row.container, (None, None))
            shares.append(ContainerShare(row.container, device, share, deviation, growth))
    return tuple(shared), tuple(shares), MemoryHistory(kept)
