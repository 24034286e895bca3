"""This node's DRA devices from the ResourceSlices of GPU drivers (resource.k8s.io/v1).

PodResources names a container's DRA device only as (driver, pool, device name); which
GPU that is, only the driver's ResourceSlices say: NVIDIA's ``gpu.nvidia.com`` publishes
per device attributes such as ``uuid`` (a MIG device has its own), ``parentUUID``,
``productName`` and ``type``. This source lists + watches the slices whose
``spec.nodeName`` is this node (the same machinery as the pod watch,
``kube_watch.KubeWatchSource``), keeps the devices of the configured drivers, and
hands them over as a sorted ``ResourceSliceSnapshot``.

Only the newest ``pool.generation`` of a pool counts: a driver republishing a pool
writes the new generation before it deletes the old slices, and the API says consumers
must ignore the older ones meanwhile.

An API server that does not serve resource.k8s.io/v1 (Kubernetes before 1.34, or DRA
switched off) answers 404: the cluster has no DRA, so the source is up with no devices
(logged once at INFO, asked again every ``NOT_SERVED_RETRY_S``). A DRA claim on such a
node cannot be resolved and shows in ``gpu_exporter_unresolved_allocations``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from exporter.model import (
    GPU_DRA_DRIVERS,
    ResourceSliceSnapshot,
    SliceDevice,
    SourceName,
    WatchCounts,
)
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle
from exporter.sources.kube_watch import KubeWatchSource, describe_error, http_status
from exporter.text import one_line

API_GROUP = "resource.k8s.io"
API_VERSION = "v1"
# An API server without resource.k8s.io/v1 will not grow it until it is upgraded (or
# DRA enabled and the server restarted): ask again every few minutes, not every minute.
NOT_SERVED_RETRY_S = 300.0
MAX_SLICES = 1000
# resource.k8s.io/v1 Device.taints: at most DeviceTaintsMaxLength = 16 per device
# (k8s.io/api resource/v1/types.go); never more read, whatever a server sends
MAX_DEVICE_TAINTS = 16
NOT_SERVED = (
    f"{API_GROUP}/{API_VERSION} ResourceSlices are not served by this API server "
    "(Kubernetes before 1.34, or DRA disabled)"
)
# First in the message, so the cap on an error's length cuts the server's text instead.
FORBIDDEN_HINT = (
    f"forbidden: the exporter's ClusterRole needs get, list and watch on resourceslices "
    f"in API group {API_GROUP} (Helm value rbac.dra)"
)


def attribute_value(attribute: Any) -> str | int | bool | None:
    """One ``DeviceAttribute`` (``{"int": 3}``, ``{"version": "580.65.6"}``, ...) -> its
    Python value, a version as its text; None for an empty, unknown or ill-typed one
    (the alpha list forms ``ints``/``bools``/``strings`` have no ``SliceAttribute``)."""
    if not isinstance(attribute, Mapping):
        return None
    number = attribute.get("int")
    if isinstance(number, int) and not isinstance(number, bool):  # bool subclasses int
        return number
    flag = attribute.get("bool")
    if isinstance(flag, bool):
        return flag
    for key in ("string", "version"):
        text = attribute.get(key)
        if isinstance(text, str):
            return text
    return None


def attribute_name(qualified: str, driver: str) -> str:
    """``<driver>/uuid`` and ``uuid`` -> ``uuid`` (the API puts unqualified names in the
    driver's domain); another domain stays: ``resource.kubernetes.io/pcieRoot``."""
    domain, sep, bare = qualified.partition("/")
    return bare if sep and domain == driver else qualified


def slice_devices(obj: Mapping[str, Any]) -> tuple[SliceDevice, ...]:
    """A ResourceSlice as the API serialises it -> its devices, attributes flattened
    and sorted by name, the effects of their taints (KEP-5055) sorted; devices without
    a name are skipped."""
    spec = obj.get("spec") or {}
    driver = str(spec.get("driver") or "")
    pool = str((spec.get("pool") or {}).get("name") or "")
    devices: list[SliceDevice] = []
    for device in spec.get("devices") or ():
        if not isinstance(device, Mapping) or not isinstance(device.get("name"), str):
            continue
        attributes: dict[str, str | int | bool] = {}
        raw = device.get("attributes")
        for qualified, attribute in raw.items() if isinstance(raw, Mapping) else ():
            value = attribute_value(attribute)
            if isinstance(qualified, str) and value is not None:
                attributes[attribute_name(qualified, driver)] = value
        taints = device.get("taints")
        effects = tuple(
            sorted(
                {
                    t["effect"]
                    for t in taints[:MAX_DEVICE_TAINTS]
                    if isinstance(t, Mapping) and isinstance(t.get("effect"), str)
                }
            )
            if isinstance(taints, list)
            else ()
        )
        devices.append(
            SliceDevice(driver, pool, device["name"], tuple(sorted(attributes.items())), effects)
        )
    return tuple(devices)


@dataclass(frozen=True, slots=True)
class _Slice:
    """What one slice contributes: its pool's generation decides whether it counts."""

    driver: str
    pool: str
    generation: int
    devices: tuple[SliceDevice, ...]


def _generation(spec: Mapping[str, Any]) -> int:
    value = (spec.get("pool") or {}).get("generation")
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class ResourceSliceWatcher(KubeWatchSource[_Slice, SliceDevice, ResourceSliceSnapshot]):
    """The devices of ``drivers`` in this node's ResourceSlices; ``read()`` hands over
    the current ``ResourceSliceSnapshot``, devices sorted by driver, pool and name."""

    name: ClassVar[SourceName] = "resourceslices"

    path: ClassVar[str] = f"/apis/{API_GROUP}/{API_VERSION}/resourceslices"
    resource: ClassVar[str] = "resourceslices"
    singular: ClassVar[str] = "ResourceSlice"
    thread_name: ClassVar[str] = "resourceslice-watcher"
    description: ClassVar[str] = "DRA ResourceSlice"
    # A node's GPU driver publishes a pool of a few slices (at most 128 devices each,
    # resource.k8s.io/v1 ResourceSliceSpec.devices); far more is a broken server.
    max_objects: ClassVar[int] = MAX_SLICES

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.resource_slices = self.read(cycle)

    def __init__(
        self,
        node_name: str,
        *,
        kubeconfig: str | None = None,
        drivers: Sequence[str] = GPU_DRA_DRIVERS,  # ("gpu.nvidia.com",)
        resync_s: float = 300.0,
        watch_timeout_s: int = 60,
        not_served_retry_s: float = NOT_SERVED_RETRY_S,
    ) -> None:
        if isinstance(drivers, str):  # "gpu.nvidia.com" would become 14 one-letter drivers
            raise TypeError("drivers must be a sequence of driver names, not a str")
        if not drivers:
            raise ValueError("drivers must name at least one DRA driver")
        if not_served_retry_s <= 0:
            raise ValueError(f"not_served_retry_s must be > 0, got {not_served_retry_s}")
        self._drivers = frozenset(drivers)
        self._not_served_retry_s = not_served_retry_s
        super().__init__(
            node_name, kubeconfig=kubeconfig, resync_s=resync_s, watch_timeout_s=watch_timeout_s
        )

    @property
    def drivers(self) -> frozenset[str]:
        return self._drivers

    def _convert(self, obj: Mapping[str, Any]) -> _Slice | None:
        spec = obj.get("spec") or {}
        driver = spec.get("driver")
        if driver not in self._drivers:
            return None
        pool = str((spec.get("pool") or {}).get("name") or "")
        return _Slice(str(driver), pool, _generation(spec), slice_devices(obj))

    def _items(self, values: Iterable[_Slice]) -> tuple[SliceDevice, ...]:
        slices = list(values)
        newest: dict[tuple[str, str], int] = {}
        for s in slices:
            key = (s.driver, s.pool)
            newest[key] = max(newest.get(key, s.generation), s.generation)
        devices = [
            d for s in slices if s.generation == newest[(s.driver, s.pool)] for d in s.devices
        ]
        return tuple(sorted(devices, key=lambda d: (d.driver, d.pool, d.name)))

    def _snapshot(
        self,
        ok: bool,
        timestamp: float,
        error: str | None,
        items: tuple[SliceDevice, ...],
        counts: WatchCounts,
    ) -> ResourceSliceSnapshot:
        return ResourceSliceSnapshot(
            ok=ok, timestamp=timestamp, error=error, devices=items, counts=counts
        )

    def _explain(self, exc: BaseException) -> str:
        status = http_status(exc)
        if status == 404:
            return NOT_SERVED
        if status == 403:
            return one_line(f"{FORBIDDEN_HINT}; {describe_error(exc)}")
        return describe_error(exc)

    def _not_served(self, exc: BaseException) -> bool:
        # A cluster without DRA (before 1.34, or switched off) has no ResourceSlices to
        # watch: that is not an outage, and must not page as GPUExporterSourceDown.
        return http_status(exc) == 404

    def _retry_delay(self, exc: BaseException, backoff: Backoff) -> float:
        delay = backoff.next_delay()
        return max(delay, self._not_served_retry_s) if http_status(exc) == 404 else delay
