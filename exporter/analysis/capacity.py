"""Node GPU capacity (pure): the seed's equation made a metric.

    allocatable = healthy advertised devices - allocated healthy devices

Devices are counted per extended resource in the units the scheduler sees (whole GPUs,
MIG instances, time-sliced replicas); each maps to its physical GPU for health.
"""

from __future__ import annotations

from collections.abc import Sequence

from exporter.model import (
    Allocation,
    DeviceCapacity,
    GpuHealth,
    GpuSample,
    PodResourcesSnapshot,
)

NVML_RESOURCE = "nvidia.com/gpu"


def node_capacity(
    gpus: Sequence[GpuSample],
    health: Sequence[GpuHealth],
    pod_resources: PodResourcesSnapshot | None,
    allocations: Sequence[Allocation],
) -> tuple[DeviceCapacity, ...]:
    """Advertised devices come from the kubelet's GetAllocatableResources where it
    answers, else from NVML (one ``nvidia.com/gpu`` per physical GPU)."""
    unhealthy_gpus = {h.uuid for h in health if not h.healthy}
    parent = {m.uuid: g.uuid for g in gpus for m in g.mig_instances}

    def physical(device_id: str) -> str:
        base = device_id.partition("::")[0]
        return parent.get(base, base)

    advertised: dict[str, set[str]] = {}
    if pod_resources is not None and pod_resources.ok and pod_resources.allocatable_ok:
        for entry in pod_resources.allocatable:
            advertised.setdefault(entry.resource_name, set()).update(entry.device_ids)
    elif gpus:
        advertised[NVML_RESOURCE] = {g.uuid for g in gpus}
    allocated: dict[str, set[str]] = {}
    for a in allocations:
        allocated.setdefault(a.resource_name, set()).add(a.device_id)
    out = []
    for resource, devices in sorted(advertised.items()):
        unhealthy = {d for d in devices if physical(d) in unhealthy_gpus}
        healthy = devices - unhealthy
        taken = devices & allocated.get(resource, set())
        out.append(
            DeviceCapacity(
                resource=resource,
                advertised=len(devices),
                healthy=len(healthy),
                unhealthy=len(unhealthy),
                allocated=len(taken),
                allocatable=len(healthy - taken),
            )
        )
    return tuple(out)
