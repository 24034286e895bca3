"""A PodResources answer's bytes turned into allocations, within stated ceilings.

gRPC's 16 MiB receive cap limits the bytes of one kubelet answer, not the work that
follows: 16 MiB of ``List`` is some 365,000 containers, which decoded whole took
~150 MB for protobuf's tree alone, and turned into allocations (then series) exhausted
the exporter's memory and stalled its event loop for tens of seconds. So here:

- an answer is decoded one entry (one pod, one advertised resource) at a time from a
  shallow first pass (a repeated ``bytes`` field has the same wire format as a repeated
  message), so protobuf never holds the whole tree;
- what an answer may bring in has a ceiling (below); an answer over one is refused
  whole, never truncated: a partial picture would attribute some containers and
  silently drop the rest;
- the caller runs these functions in a worker thread (``asyncio.to_thread``), so a
  large answer never holds up probes, scrapes or the sample cycle's event loop.

The ceilings, from what real nodes have (docs/reliability.md, "What one kubelet answer
may bring in"): the kubelet runs at most ``maxPods`` pods (default 110, and Kubernetes
supports no more than 110 per node: https://kubernetes.io/docs/setup/best-practices/cluster-large/);
a node has at most 8-16 GPUs, each at most 7 MIG instances
(https://docs.nvidia.com/datacenter/tesla/mig-user-guide/), and NVIDIA's device plugin
advertises ``replicas`` ids per GPU or MIG instance when time-slicing
(https://github.com/NVIDIA/k8s-device-plugin#shared-access-to-gpus). 16 GPUs x 7 MIG
instances x 48 replicas is 5,376 ids; the ceilings leave several times that.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple, Protocol, cast

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.message import DecodeError

from exporter.kubelet_api import api_pb2
from exporter.model import AllocatableDevices, ClaimDevice, ContainerDevices

# GPU allocations one List answer may carry: device ids of the GPU resource names plus
# claim devices of the GPU DRA drivers, counted per container as sent.
MAX_GPU_ALLOCATIONS = 10_000
# GPU device ids one GetAllocatableResources answer may advertise, counted as sent.
MAX_ADVERTISED_IDS = 50_000
# Containers one List answer may name (maxPods x a few containers on a real node).
MAX_LISTED_CONTAINERS = 50_000
# Device ids under other resource names kept from one List answer: past it the rest are
# dropped, not refused (they only ever make a container's use unknown; a real node has
# a few hundred at most, SR-IOV functions and the like).
MAX_OTHER_DEVICE_IDS = 10_000


class Undecodable(Exception):
    """An answer that is not the method's response message."""

    def __init__(self) -> None:
        super().__init__("the kubelet's answer could not be decoded")


class OverCeiling(Exception):
    """An answer bringing in more than its ceiling; ``count`` is what it brought."""

    def __init__(self, what: str, count: int, ceiling: int) -> None:
        super().__init__(
            f"{count:,} {what} in one answer, over the ceiling of {ceiling:,} "
            "(far beyond any real node: the answer is refused whole, see "
            "docs/reliability.md)"
        )
        self.count = count
        self.ceiling = ceiling


class _Entries(Protocol):
    """The shallow message: the top-level repeated field 1, each entry's bytes."""

    entries: Sequence[bytes]

    def ParseFromString(self, serialized: bytes) -> int: ...


def _shallow_message() -> type:
    """``message Entries { repeated bytes entries = 1; }``: both response messages keep
    their entries (pods, advertised resources) in field 1, so this reads their bytes
    without decoding them; other top-level fields are skipped."""
    proto = descriptor_pb2.FileDescriptorProto(
        name="exporter_podresources_shallow.proto", package="exporter.shallow", syntax="proto3"
    )
    message = proto.message_type.add(name="Entries")
    message.field.add(
        name="entries",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_BYTES,
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("exporter.shallow.Entries"))


_SHALLOW = _shallow_message()


def _entries(raw: bytes) -> Sequence[bytes]:
    shallow = cast(_Entries, _SHALLOW())
    try:
        shallow.ParseFromString(raw)
    except DecodeError as err:
        raise Undecodable() from err
    return shallow.entries


def _pods(raw: bytes) -> Iterator[api_pb2.PodResources]:
    for entry in _entries(raw):
        try:
            yield api_pb2.PodResources.FromString(entry)
        except DecodeError as err:
            raise Undecodable() from err


def resource_name_matches(name: str, patterns: Iterable[str]) -> bool:
    """True if ``name`` equals a pattern, or starts with a pattern's text before a trailing ``*``.

    Only a trailing ``*`` is special: MIG resource names (``nvidia.com/mig-1g.10gb``)
    are open-ended, everything else is an exact name.
    """
    for pattern in patterns:
        if pattern.endswith("*"):
            if name.startswith(pattern[:-1]):
                return True
        elif name == pattern:
            return True
    return False


class ListAnswer(NamedTuple):
    """What a ``List`` answer says: the GPU allocations, and what the attribution needs
    to tell "allocated nothing" from "not known" (docs/attribution.md, "Isolation leaks")."""

    containers: tuple[ContainerDevices, ...]
    claims: tuple[ClaimDevice, ...]
    # every (namespace, pod, container) named, with or without devices
    listed: frozenset[tuple[str, str, str]] = frozenset()
    # pods with any dynamic_resources, of any driver
    claims_reported: frozenset[tuple[str, str]] = frozenset()
    # device ids under resource names outside ``resource_names``
    other_devices: tuple[ContainerDevices, ...] = ()


def list_answer(
    raw: bytes,
    resource_names: Sequence[str],
    dra_drivers: frozenset[str],
    ceiling: int = MAX_GPU_ALLOCATIONS,
) -> ListAnswer:
    """The GPU allocations of a ``List`` answer: device-plugin devices merged per
    container and resource, DRA claim devices of ``dra_drivers`` flattened; and every
    container it names, the pods it reports claims for, and the device ids it gives
    under other resource names.

    Raises ``Undecodable``, or ``OverCeiling`` once the answer has brought in more than
    ``ceiling`` allocations or ``MAX_LISTED_CONTAINERS`` containers: past it nothing
    more is kept, the rest is only counted, so the reason can say how many the kubelet
    sent. Device ids under other resource names are kept up to ``MAX_OTHER_DEVICE_IDS``.
    """
    count = 0
    merged: dict[tuple[str, str, str, str], set[str]] = {}
    other: dict[tuple[str, str, str, str], set[str]] = {}
    others = named = 0
    claims: set[ClaimDevice] = set()
    listed: set[tuple[str, str, str]] = set()
    reported: set[tuple[str, str]] = set()
    for pod in _pods(raw):
        for container in pod.containers:
            named += 1
            if named <= MAX_LISTED_CONTAINERS:
                listed.add((pod.namespace, pod.name, container.name))
            for devices in container.devices:
                key = (pod.namespace, pod.name, container.name, devices.resource_name)
                if not resource_name_matches(devices.resource_name, resource_names):
                    others += len(devices.device_ids)
                    if others <= MAX_OTHER_DEVICE_IDS:
                        other.setdefault(key, set()).update(devices.device_ids)
                    continue
                count += len(devices.device_ids)
                if count <= ceiling:
                    merged.setdefault(key, set()).update(devices.device_ids)
            if container.dynamic_resources:
                reported.add((pod.namespace, pod.name))
            for dynamic in container.dynamic_resources:
                for resource in dynamic.claim_resources:
                    if resource.driver_name not in dra_drivers:
                        continue
                    count += 1
                    if count <= ceiling:
                        claims.add(_claim(pod, container, dynamic, resource))
        if count > ceiling and (merged or claims):
            merged, claims = {}, set()  # refused whole: stop holding any of it
    if count > ceiling:
        raise OverCeiling("GPU allocations", count, ceiling)
    if named > MAX_LISTED_CONTAINERS:
        raise OverCeiling("containers", named, MAX_LISTED_CONTAINERS)
    return ListAnswer(
        _containers(merged),
        tuple(sorted(claims, key=_claim_order)),
        frozenset(listed),
        frozenset(reported),
        _containers(other),
    )


def allocatable_answer(
    raw: bytes, resource_names: Sequence[str], ceiling: int = MAX_ADVERTISED_IDS
) -> tuple[AllocatableDevices, ...]:
    """The GPU device ids a ``GetAllocatableResources`` answer advertises, per resource.

    Raises ``Undecodable``, or ``OverCeiling`` past ``ceiling`` ids (counted as sent).
    """
    count = 0
    merged: dict[str, set[str]] = {}
    for entry in _entries(raw):
        try:
            devices = api_pb2.ContainerDevices.FromString(entry)
        except DecodeError as err:
            raise Undecodable() from err
        if not resource_name_matches(devices.resource_name, resource_names):
            continue
        count += len(devices.device_ids)
        if count <= ceiling:
            merged.setdefault(devices.resource_name, set()).update(devices.device_ids)
        else:
            merged.clear()
    if count > ceiling:
        raise OverCeiling("advertised GPU device ids", count, ceiling)
    return tuple(
        AllocatableDevices(resource_name=name, device_ids=tuple(sorted(ids)))
        for name, ids in sorted(merged.items())
    )


def _containers(
    merged: dict[tuple[str, str, str, str], set[str]],
) -> tuple[ContainerDevices, ...]:
    """One entry per container and resource, device ids de-duplicated and sorted: the
    kubelet sends one entry per device per NUMA node, in Go map order, so consecutive
    answers of an unchanged node then compare equal."""
    return tuple(
        ContainerDevices(
            namespace=namespace,
            pod=pod_name,
            container=container_name,
            resource_name=resource_name,
            device_ids=tuple(sorted(ids)),
        )
        for (namespace, pod_name, container_name, resource_name), ids in sorted(merged.items())
    )


def _claim(
    pod: api_pb2.PodResources,
    container: api_pb2.ContainerResources,
    dynamic: api_pb2.DynamicResource,
    resource: api_pb2.ClaimResource,
) -> ClaimDevice:
    return ClaimDevice(
        namespace=pod.namespace,
        pod=pod.name,
        container=container.name,
        claim_namespace=dynamic.claim_namespace,
        claim_name=dynamic.claim_name,
        driver=resource.driver_name,
        pool=resource.pool_name,
        device=resource.device_name,
        cdi_devices=tuple(sorted({c.name for c in resource.cdi_devices})),
        # an empty share_id is what a pre-1.35 kubelet sends: unshared
        share_id=resource.share_id or None,
    )


def _claim_order(claim: ClaimDevice) -> tuple[str, ...]:
    return (
        claim.namespace,
        claim.pod,
        claim.container,
        claim.claim_namespace,
        claim.claim_name,
        claim.driver,
        claim.pool,
        claim.device,
        claim.share_id or "",
        *claim.cdi_devices,
    )
