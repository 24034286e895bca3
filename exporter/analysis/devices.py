"""Every allocation form real clusters produce, resolved to the physical GPU (pure).

The kubelet names an allocated device in the allocating component's own words
(docs/attribution.md has the table and its sources):

- NVIDIA's device plugin: a GPU or MIG UUID, ``<uuid>::<replica>`` when time-sliced or
  shared through MPS (and the pre-R470 ``MIG-GPU-<uuid>/<gi>/<ci>`` MIG form);
- GKE's device plugin: ``nvidia<minor>`` (the /dev/nvidia<minor> device minor, which
  need not be the NVML index), ``nvidia<minor>/vgpu<k>`` when time-shared, and
  ``nvidia<minor>/gi<gpu instance id>[/vgpu<k>]`` for MIG partitions;
- DRA: (driver, pool, device) from PodResources ``dynamic_resources``, which only the
  driver's ResourceSlices turn into a GPU (their ``uuid`` attribute).

Anything else is *unresolved*: ``uuid`` None. Callers must then neither guess a GPU nor
call a process on it an isolation leak.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from exporter.model import (
    REPLICA_SEPARATOR,
    DeviceRef,
    GpuSample,
    MigInstance,
    ResourceSliceSnapshot,
    SliceDevice,
)
from exporter.model.fast_init import fast_init

FORM_NVIDIA = "nvidia"
FORM_GKE = "gke"
FORM_DRA = "dra"
FORM_UNRESOLVED = "unresolved"

SHARED_RESOURCE_SUFFIX = ".shared"  # nvidia.com/gpu.shared (renameByDefault replicas)
_LEGACY_MIG_PREFIX = "MIG-GPU-"  # pre-R470 MIG device ids: MIG-GPU-<uuid>/<gi>/<ci>
_UUID_PREFIXES = ("GPU-", "MIG-")
_GKE_ID = re.compile(r"^nvidia(?P<minor>\d+)(?:/gi(?P<gi>\d+))?(?:/vgpu(?P<vgpu>\d+))?$")


@fast_init
@dataclass(frozen=True, slots=True)
class ResolvedDevice:
    """Where an allocated device lives. ``uuid`` None: unresolved (``gpu`` None too)."""

    form: str
    gpu: int | None = None
    uuid: str | None = None  # physical GPU UUID
    mig_uuid: str | None = None
    replica: bool = False  # the id itself says the device is time-shared

    @property
    def resolved(self) -> bool:
        return self.uuid is not None

    @property
    def ref(self) -> DeviceRef:
        return DeviceRef(self.gpu, self.uuid, self.mig_uuid)


UNRESOLVED = ResolvedDevice(FORM_UNRESOLVED)


def resolver_key(gpus: Sequence[GpuSample]) -> tuple[object, ...]:
    """Everything of ``gpus`` a ``DeviceResolver`` reads: over GPUs with equal keys (and
    the same ResourceSlices) it resolves every device id alike."""
    return tuple(
        (
            gpu.index,
            gpu.uuid,
            gpu.minor_number,
            tuple((m.uuid, m.gpu_instance_id, m.compute_instance_id) for m in gpu.mig_instances),
        )
        for gpu in gpus
    )


class DeviceResolver:
    """Lookup tables over one cycle's GPUs (and ResourceSlices), built once per cycle.
    What it reads of the GPUs is ``resolver_key``'s: change the two together."""

    def __init__(
        self, gpus: Sequence[GpuSample], slices: ResourceSliceSnapshot | None = None
    ) -> None:
        self._by_uuid: dict[str, tuple[GpuSample, MigInstance | None]] = {}
        self._by_minor: dict[int, GpuSample] = {}
        for gpu in gpus:
            self._by_uuid[gpu.uuid] = (gpu, None)
            for mig in gpu.mig_instances:
                self._by_uuid[mig.uuid] = (gpu, mig)
            if gpu.minor_number is not None:
                self._by_minor[gpu.minor_number] = gpu
        self._slice_devices: dict[tuple[str, str, str], SliceDevice] = (
            {(d.driver, d.pool, d.name): d for d in slices.devices}
            if slices is not None and slices.ok
            else {}
        )

    def device_id(self, device_id: str) -> ResolvedDevice:
        """A device plugin's kubelet device id (NVIDIA's or GKE's form)."""
        gke = _GKE_ID.match(device_id)
        if gke is not None:
            return self._gke(gke)
        base, separator, _ = device_id.partition(REPLICA_SEPARATOR)
        if not base.startswith(_UUID_PREFIXES):
            return UNRESOLVED
        found = self._uuid(base) or self._legacy_mig(base)
        if found is None:
            # A UUID NVML does not list (a GPU gone from the driver): the UUID is still
            # the device's true name, only its index is unknown.
            if base.startswith(_LEGACY_MIG_PREFIX) or base.startswith("MIG-"):
                return UNRESOLVED  # a MIG UUID does not name its physical GPU
            return ResolvedDevice(FORM_NVIDIA, None, base, None, bool(separator))
        gpu, mig = found
        return ResolvedDevice(
            FORM_NVIDIA, gpu.index, gpu.uuid, mig.uuid if mig else None, bool(separator)
        )

    def claim(self, driver: str, pool: str, device: str) -> ResolvedDevice:
        """A DRA device, through the ``uuid`` attribute the driver's ResourceSlice gives."""
        published = self._slice_devices.get((driver, pool, device))
        uuid = published.attribute("uuid") if published is not None else None
        found = self._uuid(uuid) if isinstance(uuid, str) else None
        if found is None:
            return UNRESOLVED
        gpu, mig = found
        return ResolvedDevice(FORM_DRA, gpu.index, gpu.uuid, mig.uuid if mig else None)

    # -- forms ---------------------------------------------------------------------------

    def _uuid(self, uuid: str) -> tuple[GpuSample, MigInstance | None] | None:
        return self._by_uuid.get(uuid)

    def _legacy_mig(self, device_id: str) -> tuple[GpuSample, MigInstance | None] | None:
        if not device_id.startswith(_LEGACY_MIG_PREFIX):
            return None
        parts = device_id.removeprefix("MIG-").split("/")
        if len(parts) != 3 or not (parts[1].isdigit() and parts[2].isdigit()):
            return None
        found = self._by_uuid.get(parts[0])
        if found is None:
            return None
        gpu = found[0]
        ids = (int(parts[1]), int(parts[2]))
        mig = next(
            (m for m in gpu.mig_instances if (m.gpu_instance_id, m.compute_instance_id) == ids),
            None,
        )
        return (gpu, mig) if mig is not None else None

    def _gke(self, match: re.Match[str]) -> ResolvedDevice:
        gpu = self._by_minor.get(int(match["minor"]))
        if gpu is None:
            return UNRESOLVED
        replica = match["vgpu"] is not None
        if match["gi"] is None:
            return ResolvedDevice(FORM_GKE, gpu.index, gpu.uuid, None, replica)
        gi = int(match["gi"])
        instances = [m for m in gpu.mig_instances if m.gpu_instance_id == gi]
        if len(instances) != 1:  # GKE partitions have one compute instance each
            return UNRESOLVED
        return ResolvedDevice(FORM_GKE, gpu.index, gpu.uuid, instances[0].uuid, replica)
