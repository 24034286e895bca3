"""Node GPU capacity (pure): what the scheduler could still place on this node.

    allocatable = healthy advertised devices - allocated healthy devices

Devices are counted per resource in the units the scheduler sees: whole GPUs, MIG
instances and time-sliced replicas of a device plugin's extended resource (in whatever
form the plugin names them), and the devices of a DRA driver's ResourceSlices (the
resource is then the driver's name). Each device is resolved to its physical GPU for
health: a device on an unhealthy GPU is unhealthy; one that cannot be resolved is
counted as the kubelet advertises it.
"""

from __future__ import annotations

from collections.abc import Sequence

from exporter.analysis.devices import DeviceResolver
from exporter.model import (
    Allocation,
    DeviceCapacity,
    GpuHealth,
    GpuSample,
    PodResourcesSnapshot,
    ResourceSliceSnapshot,
)

NVML_RESOURCE = "nvidia.com/gpu"


def node_capacity(
    gpus: Sequence[GpuSample],
    health: Sequence[GpuHealth],
    pod_resources: PodResourcesSnapshot | None,
    allocations: Sequence[Allocation],
    slices: ResourceSliceSnapshot | None = None,
) -> tuple[DeviceCapacity, ...]:
    """Advertised devices come from the kubelet's GetAllocatableResources and the DRA
    ResourceSlices where they answer, else from NVML (one ``nvidia.com/gpu`` per GPU)."""
    unhealthy_gpus = {h.uuid for h in health if not h.healthy}
    resolver = DeviceResolver(gpus, slices)
    # resource -> device id -> physical GPU UUID (None: unresolved)
    advertised: dict[str, dict[str, str | None]] = {}
    kubelet_ok = pod_resources is not None and pod_resources.ok and pod_resources.allocatable_ok
    if kubelet_ok and pod_resources is not None:
        for entry in pod_resources.allocatable:
            devices = advertised.setdefault(entry.resource_name, {})
            for device_id in entry.device_ids:
                devices[device_id] = resolver.device_id(device_id).uuid
    if slices is not None and slices.ok:
        for device in slices.devices:
            uuid = resolver.claim(device.driver, device.pool, device.name).uuid
            advertised.setdefault(device.driver, {})[f"{device.pool}/{device.name}"] = uuid
    if not kubelet_ok and not advertised and gpus:
        advertised[NVML_RESOURCE] = {g.uuid: g.uuid for g in gpus}
    allocated: dict[str, set[str]] = {}
    for a in allocations:
        allocated.setdefault(a.resource_name, set()).add(a.device_id)
    out = []
    for resource, devices in sorted(advertised.items()):
        unhealthy = {d for d, uuid in devices.items() if uuid in unhealthy_gpus}
        healthy = devices.keys() - unhealthy
        taken = devices.keys() & allocated.get(resource, set())
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
