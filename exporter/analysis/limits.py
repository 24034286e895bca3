"""Promised limits on shared GPUs (pure): HAMi's per-container memory and cores.

HAMi (Project-HAMi) lets a pod ask for part of a GPU with extended resources, and its
device plugin hands HAMi-core (an ``LD_PRELOAD`` library inside the container) the
matching limits: ``CUDA_DEVICE_MEMORY_LIMIT_<i>`` = "<gpumem>m" and
``CUDA_DEVICE_SM_LIMIT`` = gpucores. The limits are enforced in user space, by the
intercepting library, not by the driver: a process without the library, or a process
that allocates past it, is stopped by nothing. Exporting them next to use makes "used
vs promised" and "over its promise" visible (docs/shared-gpus.md).

Resource names and units (HAMi pkg/scheduler/config/config.go, the defaults; clusters
may rename them): ``nvidia.com/gpumem`` in MiB, ``nvidia.com/gpumem-percentage`` in
percent of the device's memory (used when gpumem is absent), ``nvidia.com/gpucores`` in
percent of the SMs (0: no limit, as HAMi-core reads it). Where a container has none of
them, no limit is exported: no series, never a zero.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from exporter.model import (
    Allocation,
    ContainerGpuUsage,
    ContainerLimit,
    ContainerRef,
    DeviceRef,
    GpuSample,
    PodMetaSnapshot,
)

HAMI_MEMORY = "nvidia.com/gpumem"
HAMI_MEMORY_PERCENTAGE = "nvidia.com/gpumem-percentage"
HAMI_CORES = "nvidia.com/gpucores"
MIB = 1024 * 1024

_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(Ki|Mi|Gi|Ti|k|M|G|T)?\s*$")
_SUFFIX = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
}


def quantity(text: str) -> float | None:
    """A Kubernetes quantity as a number ("3000", "4k", "1Gi"); None if it is not one."""
    match = _QUANTITY.match(text)
    if match is None:
        return None
    return float(match.group(1)) * _SUFFIX[match.group(2)]


def _promise(resources: dict[str, str], gpu: GpuSample | None) -> tuple[int | None, float | None]:
    memory: int | None = None
    mib = quantity(resources.get(HAMI_MEMORY, ""))
    percent = quantity(resources.get(HAMI_MEMORY_PERCENTAGE, ""))
    total = gpu.memory_total_bytes if gpu is not None else None
    if mib is not None and mib > 0:
        memory = int(mib) * MIB
    elif percent is not None and 0 < percent <= 100 and total is not None:
        memory = int(total * percent / 100)
    cores = quantity(resources.get(HAMI_CORES, ""))
    sm = cores / 100 if cores is not None and 0 < cores <= 100 else None
    return memory, sm


def _devices(
    containers: Sequence[ContainerGpuUsage], allocations: Sequence[Allocation]
) -> Iterable[tuple[ContainerRef, DeviceRef]]:
    """Every whole GPU a container uses or was allocated (HAMi limits no MIG device)."""
    seen: set[tuple[ContainerRef, str]] = set()
    rows = [(c.container, c.device) for c in containers]
    rows += [(a.container, a.device) for a in allocations]
    for container, device in rows:
        if device.uuid is None or device.gpu is None or device.mig_uuid is not None:
            continue
        if (container, device.uuid) not in seen:
            seen.add((container, device.uuid))
            yield container, DeviceRef(device.gpu, device.uuid)


def container_limits(
    pods: PodMetaSnapshot | None,
    containers: Sequence[ContainerGpuUsage],
    allocations: Sequence[Allocation],
    gpus: Sequence[GpuSample],
) -> tuple[ContainerLimit, ...]:
    if pods is None:
        return ()
    promised: dict[ContainerRef, dict[str, str]] = {}
    for pod in pods.pods:
        for name, resource, value in pod.resources:
            promised.setdefault(ContainerRef(pod.namespace, pod.name, name), {})[resource] = value
    by_uuid = {g.uuid: g for g in gpus}
    out = []
    for container, device in _devices(containers, allocations):
        resources = promised.get(container)
        if not resources:
            continue
        memory, sm = _promise(resources, by_uuid.get(device.uuid or ""))
        if memory is not None or sm is not None:
            out.append(ContainerLimit(container, device, memory, sm))
    return tuple(sorted(out, key=lambda x: (x.container, x.device.gpu or 0)))
