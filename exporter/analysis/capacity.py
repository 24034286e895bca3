"""Node GPU capacity (pure): what the scheduler could still place on this node.

    allocatable = healthy advertised devices - allocated healthy devices

Devices are counted per resource in the units the scheduler sees: whole GPUs, MIG
instances and time-sliced replicas of a device plugin's extended resource (in whatever
form the plugin names them), and the devices of a DRA driver's ResourceSlices (the
resource is then the driver's name). Each device is resolved to its physical GPU for
health.

Every count rests on a source that answered (docs/health.md, "Unknown"):

- health needs NVML. A device on a GPU NVML reports is healthy or unhealthy by that
  GPU's verdict; a device naming a GPU that NVML, up, does not report is unhealthy (the
  scheduler can hand it out, nothing can use it); a device that names no GPU at all, or
  any device while NVML is down, is *unknown* and never counted healthy;
- allocation needs the kubelet: while its PodResources answer is missing, ``allocated``
  and ``allocatable`` are ``None`` (served as absent), never 0 or "all free";
- allocation also needs the advertised set to be the kubelet's (or a DRA driver's). Where
  the kubelet lists allocations but cannot say what it advertises (no
  ``GetAllocatableResources``: kubelets before 1.21, or 1.21-1.22 with the feature gate
  off), NVML's GPUs stand in as one ``nvidia.com/gpu`` each: a guess. The device plugin
  may advertise them otherwise (time-sliced replicas under ``nvidia.com/gpu.shared``,
  MIG instances, ``GPU-...::N`` ids), and allocations of those match no guessed device,
  so ``allocated`` and ``allocatable`` of a guessed set are ``None`` too: never "all free"
  on a node whose every GPU is handed out in another form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from exporter.analysis.devices import DeviceResolver
from exporter.model import (
    Allocation,
    DeviceCapacity,
    GpuHealth,
    GpuSample,
    PodResourcesSnapshot,
    ResourceSliceSnapshot,
    SliceDevice,
    placeholder_uuid,
)

NVML_RESOURCE = "nvidia.com/gpu"
_GPU_UUID_PREFIX = "GPU-"  # a physical GPU's UUID (MIG UUIDs name no physical GPU)

Verdict = Literal["healthy", "unhealthy", "unknown"]


def node_capacity(
    gpus: Sequence[GpuSample],
    health: Sequence[GpuHealth],
    pod_resources: PodResourcesSnapshot | None,
    allocations: Sequence[Allocation],
    slices: ResourceSliceSnapshot | None = None,
    *,
    nvml_ok: bool,
    unaccounted: frozenset[str] = frozenset(),
    dra_unreported: bool = False,
) -> tuple[DeviceCapacity, ...]:
    """Advertised devices come from the kubelet's GetAllocatableResources and the DRA
    ResourceSlices where they answer, else from NVML (one ``nvidia.com/gpu`` per GPU).
    ``nvml_ok``: NVML answered this cycle (``gpus`` and ``health`` are its word).
    ``unaccounted``: GPUs a pod's process uses that the answer does not account for
    (``Attribution.unaccounted_gpus``); a resource with a device on one that no listed
    allocation takes has unknown ``allocated`` and ``allocatable``. ``dra_unreported``: a
    pod's claims go unreported in the answer, so every DRA driver's are unknown."""
    resolver = DeviceResolver(gpus, slices)
    # resource -> device id -> physical GPU UUID (None: names no GPU)
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
            key = f"{device.pool}/{device.name}"
            advertised.setdefault(device.driver, {})[key] = uuid or _published_gpu(device)
    guessed = not kubelet_ok and not advertised and bool(gpus)
    if guessed:
        advertised[NVML_RESOURCE] = {g.uuid: g.uuid for g in gpus}
    judge = _Judge(gpus, health, nvml_ok)
    # what is taken of a guessed set is unknown, whatever the kubelet lists (module doc)
    allocation_ok = pod_resources is not None and pod_resources.ok and not guessed
    allocated: dict[str, set[str]] = {}
    for a in allocations:
        allocated.setdefault(a.resource_name, set()).add(a.device_id)
    drivers = {d.driver for d in slices.devices} if slices is not None and slices.ok else set()
    counts = []
    for resource, devices in sorted(advertised.items()):
        taken = allocated.get(resource, set()) if allocation_ok else None
        if dra_unreported and resource in drivers:
            taken = None  # its claims' allocations are not in the answer
        if taken is not None and any(
            uuid in unaccounted and device not in taken for device, uuid in devices.items()
        ):
            taken = None  # one of them may be the unlisted container's
        counts.append(_count(resource, devices, judge, taken))
    return tuple(counts)


class _Judge:
    """One device's health from NVML's word on its physical GPU."""

    def __init__(self, gpus: Sequence[GpuSample], health: Sequence[GpuHealth], nvml_ok: bool):
        self._ok = nvml_ok
        self._reported = {g.uuid for g in gpus}
        self._unhealthy = {h.uuid for h in health if h.unhealthy}
        self._unknown = {h.uuid for h in health if h.unknown}
        # a GPU NVML lists but whose UUID it could not read, for no hardware reason: a
        # device NVML does not report may be that one
        self._unidentified = any(h.unknown and h.uuid == placeholder_uuid(h.gpu) for h in health)

    @property
    def ok(self) -> bool:
        return self._ok

    def __call__(self, uuid: str | None) -> Verdict:
        if not self._ok or uuid is None or uuid in self._unknown:
            return "unknown"
        if uuid not in self._reported and self._unidentified:
            return "unknown"
        if uuid not in self._reported or uuid in self._unhealthy:
            return "unhealthy"  # a GPU NVML cannot see is not one a pod can use
        return "healthy"


def _count(
    resource: str, devices: dict[str, str | None], judge: _Judge, taken: set[str] | None
) -> DeviceCapacity:
    verdicts = {d: judge(uuid) for d, uuid in devices.items()}
    healthy = {d for d, v in verdicts.items() if v == "healthy"}
    unhealthy = sum(1 for v in verdicts.values() if v == "unhealthy")
    unknown = len(verdicts) - len(healthy) - unhealthy
    allocated = None if taken is None else len(devices.keys() & taken)
    return DeviceCapacity(
        resource=resource,
        advertised=len(devices),
        healthy=len(healthy) if judge.ok else None,
        unhealthy=unhealthy if judge.ok else None,
        allocated=allocated,
        allocatable=len(healthy - taken) if judge.ok and taken is not None else None,
        unknown=unknown,
    )


def _published_gpu(device: SliceDevice) -> str | None:
    """The physical GPU a DRA driver publishes for a device NVML does not report (its
    ``uuid`` attribute, when that is a GPU's UUID): None for anything else."""
    uuid = device.attribute("uuid")
    return uuid if isinstance(uuid, str) and uuid.startswith(_GPU_UUID_PREFIX) else None
