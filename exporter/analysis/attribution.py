"""Who owns each GPU process and each allocated device.

The join: NVML processes, procfs identities, pod metadata and kubelet PodResources.
Pod metadata is optional: without it an exclusively allocated device still names its
pod through PodResources, while a shared device stays "unknown" rather than guessed.
Pure: everything comes from the snapshot, so the same snapshot gives the same result.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from exporter.analysis.allocation_evidence import HeldKey
from exporter.analysis.devices import SHARED_RESOURCE_SUFFIX, DeviceResolver, resolver_key
from exporter.model import (
    OWNER_DEAD,
    OWNER_HOST,
    OWNER_POD,
    OWNER_UNKNOWN,
    Allocation,
    AttributedProcess,
    Attribution,
    ContainerDevices,
    ContainerGpuUsage,
    ContainerRef,
    DeviceRef,
    GpuProcess,
    GpuSample,
    MigInstance,
    NodeSnapshot,
    Owner,
    PodMeta,
    PodMetaSnapshot,
    PodResourcesSnapshot,
    ProcessIdentity,
    ResourceSliceSnapshot,
    UnallocatedUse,
    UnattributedUse,
)
from exporter.model.fast_init import fast_init

REASON_NO_POD_META = "no pod metadata"
REASON_POD_NOT_ON_NODE = "pod not on this node"
REASON_CONTAINER_UNKNOWN = "container id unknown"
REASON_SHARED_NO_META = "shared GPU without pod metadata"
REASON_AMBIGUOUS_NO_META = "several pods on an exclusive GPU without pod metadata"
REASON_NOT_READ = "process not read from /proc"
REASON_CGROUP_UNPARSED = "cgroup file not understood"

_DeviceKey = tuple[str, str | None]  # physical GPU UUID, MIG UUID


@dataclass(frozen=True, slots=True)
class _Device:
    """Where a process runs: a physical GPU and, on MIG, the instance."""

    gpu: int
    uuid: str
    mig: MigInstance | None
    mig_unresolved: bool = False  # NVML gave MIG ids that match no listed instance

    @property
    def key(self) -> _DeviceKey:
        return (self.uuid, self.mig.uuid if self.mig else None)


@fast_init
@dataclass(frozen=True, slots=True)
class _Listed:
    device: _Device
    process: GpuProcess
    sm_ratio: float | None


@fast_init
@dataclass(frozen=True, slots=True)
class _Owner:
    owner: Owner
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    reason: str | None = None
    by_container_id: bool = False  # named by the process's own container id, not a guess

    @property
    def ref(self) -> ContainerRef | None:
        if self.namespace is None or self.pod is None or self.container is None:
            return None
        return ContainerRef(self.namespace, self.pod, self.container)


@dataclass(frozen=True, slots=True)
class _Context:
    """The lookup tables one snapshot needs, built once per call."""

    identities: Mapping[int, ProcessIdentity]
    pods: Mapping[str, PodMeta] | None  # by uid; None when pod metadata is unusable
    allocations: Mapping[str, Sequence[Allocation]] | None  # by GPU UUID; None: no data
    sharers: Mapping[_DeviceKey, frozenset[tuple[str, str | None]]]
    # (container, GPU UUID, MIG UUID or None for the whole GPU) of every allocation:
    # whether a container holds a device is one lookup, not a scan of the GPU's list
    held: frozenset[tuple[ContainerRef, str, str | None]] = frozenset()
    finished: frozenset[tuple[str, str]] = frozenset()  # (namespace, pod) in a terminal phase
    # containers holding an allocation no form resolves: their use is never a leak
    unresolved: frozenset[ContainerRef] = frozenset()
    # every container the List answer names, GPU devices or none; None: no answer
    listed: frozenset[ContainerRef] | None = None
    # (namespace, pod) with resourceClaims in the spec whose claims the kubelet does not
    # report (the KubeletPodResourcesDynamicResources gate is off): their use is unknown
    claims_unreported: frozenset[tuple[str, str]] = frozenset()
    # (container, GPU UUID, MIG UUID) of device ids under resource names outside
    # --resource-names that resolve to a GPU here: evidence of an allocation, unknown
    other_held: frozenset[tuple[ContainerRef, str, str | None]] = frozenset()
    # pids judged against an answer begun after their first sighting; None: not asked
    settled: frozenset[int] | None = None
    # (pid, pod UID, container id, GPU UUID, MIG UUID) seen allocated in an earlier answer
    held_before: frozenset[HeldKey] = frozenset()


def attribute(
    snapshot: NodeSnapshot,
    *,
    terminal_phases: frozenset[str] = frozenset({"Succeeded", "Failed"}),
    settled: frozenset[int] | None = None,
    held_before: frozenset[HeldKey] = frozenset(),
) -> Attribution:
    """Attribute every NVML process and every PodResources device of one snapshot.

    ``settled``: the pids whose first sighting the PodResources answer postdates (the
    pipeline keeps that memory, ``allocation_evidence``); a pid outside it is never a
    leak this cycle. None judges the snapshot alone (one-shot use). ``held_before``: the
    devices pod processes were seen allocated earlier (the last cycle's ``Attribution.held``);
    an answer that now lists one without it is no evidence of a leak."""
    gpus = snapshot.nvml.gpus
    finished = _finished_pods(snapshot.pod_meta, terminal_phases)
    allocations = _allocations(snapshot.pod_resources, gpus, snapshot.resource_slices, finished)
    listed = _listed_processes(gpus)
    identities = {identity.pid: identity for identity in snapshot.processes}
    context = _Context(
        identities=identities,
        pods=_pods_by_uid(snapshot.pod_meta),
        allocations=None if allocations is None else _by_uuid(allocations),
        sharers=_sharers(listed, identities),
        held=_held(allocations or ()),
        finished=finished,
        unresolved=frozenset(a.container for a in allocations or () if not a.resolved),
        listed=_listed_containers(snapshot.pod_resources),
        claims_unreported=_claims_unreported(snapshot.pod_resources, snapshot.pod_meta),
        other_held=_other_held(snapshot.pod_resources, gpus, snapshot.resource_slices),
        settled=settled,
        held_before=held_before,
    )
    attributed = [_attribute_one(item, context) for item in listed]
    processes = tuple(sorted((row for row, _ in attributed), key=_row_order))
    return Attribution(
        processes=processes,
        containers=_container_usage(processes),
        allocations=allocations or (),
        unallocated_use=_unallocated_use(processes),
        unattributed=_unattributed(processes),
        other_resource_devices=_other_counts(
            snapshot.pod_resources, gpus, snapshot.resource_slices
        ),
        unaccounted_gpus=_unaccounted_gpus(processes, context),
        dra_unreported=bool(context.claims_unreported),
        held=frozenset(key for _, key in attributed if key is not None),
    )


# ---------------------------------------------------------------------------
# NVML processes
# ---------------------------------------------------------------------------


def _listed_processes(gpus: Iterable[GpuSample]) -> list[_Listed]:
    """One entry per (pid, device); the MIG-resolved listing wins over a bare GPU one."""
    merged: dict[tuple[str, str | None, int], _Listed] = {}
    for gpu in gpus:
        samples = _latest_sm_ratios(gpu)
        for device, process in _raw_processes(gpu):
            key = (*device.key, process.pid)
            entry = _Listed(device, process, samples.get(process.pid))
            merged[key] = _merge(merged[key], entry) if key in merged else entry
    on_mig = {(uuid, pid) for uuid, mig_uuid, pid in merged if mig_uuid is not None}
    return [
        entry
        for (uuid, mig_uuid, pid), entry in merged.items()
        if mig_uuid is not None or (uuid, pid) not in on_mig
    ]


def _raw_processes(gpu: GpuSample) -> Iterator[tuple[_Device, GpuProcess]]:
    by_ids: dict[tuple[int | None, int | None], MigInstance] = {
        (m.gpu_instance_id, m.compute_instance_id): m for m in gpu.mig_instances
    }
    for process in gpu.processes:
        mig = by_ids.get((process.gpu_instance_id, process.compute_instance_id))
        unresolved = mig is None and process.gpu_instance_id is not None
        yield _Device(gpu.index, gpu.uuid, mig, unresolved), process
    for mig in gpu.mig_instances:
        for process in mig.processes:
            yield _Device(gpu.index, gpu.uuid, mig), process


def _merge(first: _Listed, second: _Listed) -> _Listed:
    """Keep the first listing but fill in memory or instance ids it lacked."""
    a, b = first.process, second.process
    process = GpuProcess(
        pid=a.pid,
        memory_used_bytes=a.memory_used_bytes
        if a.memory_used_bytes is not None
        else b.memory_used_bytes,
        kind=a.kind,
        gpu_instance_id=a.gpu_instance_id if a.gpu_instance_id is not None else b.gpu_instance_id,
        compute_instance_id=(
            a.compute_instance_id if a.compute_instance_id is not None else b.compute_instance_id
        ),
    )
    return _Listed(first.device, process, first.sm_ratio)


def _latest_sm_ratios(gpu: GpuSample) -> dict[int, float]:
    """Latest SM sample per pid as a 0..1 ratio; NVML may return several per window."""
    latest: dict[int, tuple[int, float]] = {}
    for sample in gpu.process_utilization:
        ratio = min(max(sample.sm_percent / 100.0, 0.0), 1.0)
        seen = latest.get(sample.pid)
        if seen is None or sample.timestamp_us >= seen[0]:
            latest[sample.pid] = (sample.timestamp_us, ratio)
    return {pid: ratio for pid, (_, ratio) in latest.items()}


def _sharers(
    listed: Iterable[_Listed], identities: Mapping[int, ProcessIdentity]
) -> dict[_DeviceKey, frozenset[tuple[str, str | None]]]:
    """Distinct live (pod uid, container id) per device, to refuse ambiguous fallbacks.
    A live process whose cgroup could not be read (or parsed) may be anyone's: it counts as one
    more sharer, so it never leaves another pod's process looking like the only one."""
    found: dict[_DeviceKey, set[tuple[str, str | None]]] = defaultdict(set)
    for entry in listed:
        identity = identities.get(entry.process.pid)
        if identity is None or not identity.alive:
            continue
        if not (identity.cgroup_read and identity.cgroup_parsed):
            found[entry.device.key].add((f"unread pid {identity.pid}", None))
        elif identity.pod_uid is not None:
            found[entry.device.key].add((identity.pod_uid, identity.container_id))
    return {key: frozenset(value) for key, value in found.items()}


# ---------------------------------------------------------------------------
# Ownership
# ---------------------------------------------------------------------------


def _held_key(pid: int, identity: ProcessIdentity | None, device: _Device) -> HeldKey | None:
    """What ``Attribution.held`` remembers a pod process's device by; None without the
    pod and container the process's cgroup names."""
    if identity is None or not identity.pod_uid or not identity.container_id:
        return None
    return (pid, identity.pod_uid, identity.container_id, device.uuid, device.key[1])


def _attribute_one(entry: _Listed, context: _Context) -> tuple[AttributedProcess, HeldKey | None]:
    """The process's row, and its held key for the next cycle (None: none to keep)."""
    device, process = entry.device, entry.process
    identity = context.identities.get(process.pid)
    owner = _owner(identity, device, context)
    allocated = _is_allocated(owner, device, context, identity, process.pid)
    held = _held_key(process.pid, identity, device)
    # only what its own container (by container id, not a guess) was given, in an answer
    # that postdates the process (a stale one may be a predecessor's), or held before
    proven = (
        allocated is True
        and owner.by_container_id
        and context.settled is not None
        and process.pid in context.settled
    )
    if not proven and held not in context.held_before:
        held = None
    row = AttributedProcess(
        gpu=device.gpu,
        uuid=device.uuid,
        mig_uuid=device.key[1],
        gpu_instance_id=device.mig.gpu_instance_id if device.mig else process.gpu_instance_id,
        compute_instance_id=(
            device.mig.compute_instance_id if device.mig else process.compute_instance_id
        ),
        pid=process.pid,
        memory_used_bytes=process.memory_used_bytes,
        sm_ratio=entry.sm_ratio,
        kind=process.kind,
        owner=owner.owner,
        namespace=owner.namespace,
        pod=owner.pod,
        container=owner.container,
        reason=owner.reason,
        allocated=allocated,
        pod_uid=identity.pod_uid if identity is not None and identity.alive else None,
    )
    return row, held


def _owner(identity: ProcessIdentity | None, device: _Device, context: _Context) -> _Owner:
    if identity is None:  # /proc was not read (procfs down): not evidence of an exit
        return _Owner(OWNER_UNKNOWN, reason=REASON_NOT_READ)
    if not identity.alive:
        return _Owner(OWNER_DEAD)
    if not identity.cgroup_read:  # whose it is cannot be told: not a host process
        return _Owner(OWNER_UNKNOWN, reason=REASON_NOT_READ)
    if not identity.cgroup_parsed:  # junk where the cgroup should be: nor is this
        return _Owner(OWNER_UNKNOWN, reason=REASON_CGROUP_UNPARSED)
    if identity.pod_uid is None:
        return _Owner(OWNER_HOST)
    if context.pods is None:
        sharers = context.sharers.get(device.key, frozenset())
        return _owner_from_allocation(device, context.allocations, sharers)
    meta = context.pods.get(identity.pod_uid)
    if meta is None:
        return _Owner(OWNER_UNKNOWN, reason=REASON_POD_NOT_ON_NODE)
    container = dict(meta.containers).get(identity.container_id or "")
    if container is not None:
        return _Owner(OWNER_POD, meta.namespace, meta.name, container, by_container_id=True)
    container = _sole_allocated_container(meta, device, context.allocations)
    if container is None:
        return _Owner(OWNER_UNKNOWN, meta.namespace, meta.name, reason=REASON_CONTAINER_UNKNOWN)
    return _Owner(OWNER_POD, meta.namespace, meta.name, container)


def _owner_from_allocation(
    device: _Device,
    allocations: Mapping[str, Sequence[Allocation]] | None,
    sharers: frozenset[tuple[str, str | None]],
) -> _Owner:
    """Without pod metadata only an exclusive allocation names the pod with certainty."""
    covering = [a for a in _allocations_on(device, allocations) if _covers(a, device)]
    if not covering:
        return _Owner(OWNER_UNKNOWN, reason=REASON_NO_POD_META)
    containers = {a.container for a in covering}
    if len(containers) > 1 or any(a.shared for a in covering):
        return _Owner(OWNER_UNKNOWN, reason=REASON_SHARED_NO_META)
    if len(sharers) > 1:  # another pod uses the device too: one of them is a leak
        return _Owner(OWNER_UNKNOWN, reason=REASON_AMBIGUOUS_NO_META)
    ref = containers.pop()
    return _Owner(OWNER_POD, ref.namespace, ref.pod, ref.container)


def _sole_allocated_container(
    meta: PodMeta, device: _Device, allocations: Mapping[str, Sequence[Allocation]] | None
) -> str | None:
    """Name a container the pod status does not list yet (e.g. just restarted)."""
    names = {
        a.container.container
        for a in _allocations_on(device, allocations)
        if (a.container.namespace, a.container.pod) == (meta.namespace, meta.name)
        and _covers(a, device)
    }
    return names.pop() if len(names) == 1 else None


def _is_allocated(
    owner: _Owner,
    device: _Device,
    context: _Context,
    identity: ProcessIdentity | None,
    pid: int,
) -> bool | None:
    """None when we cannot tell: no PodResources data, or a pod that already finished
    (the kubelet released its devices; a process it left behind is an orphan, not a
    container using a GPU it was never given).

    False (a leak) only on evidence (docs/attribution.md, "Isolation leaks"): the
    kubelet lists the container, with no device covering this one, in an answer begun
    after the process was first seen. A container it does not list (an answer from a
    kubelet that has just restarted, a pod newer than the answer, an init container:
    List names only ``spec.containers``) is unknown; so are a pod whose claims the
    kubelet does not report, a device under another resource name, and MPS's daemons."""
    allocations = context.allocations
    if owner.owner != OWNER_POD or allocations is None or device.mig_unresolved:
        return None
    if (owner.namespace, owner.pod) in context.finished:
        return None
    ref = owner.ref
    if ref in context.unresolved:
        return None  # it may hold this very device under a name we cannot read
    mig_uuid = device.key[1]  # what _covers() accepts: the whole GPU, or this instance
    if (ref, device.uuid, None) in context.held or (
        mig_uuid is not None and (ref, device.uuid, mig_uuid) in context.held
    ):
        return True
    if ref is None or not _judged(ref, device, context, identity, pid):
        return None
    return False


def _judged(
    ref: ContainerRef,
    device: _Device,
    context: _Context,
    identity: ProcessIdentity | None,
    pid: int,
) -> bool:
    """Whether "not allocated this device" is evidence, not absence of evidence."""
    if context.listed is not None and ref not in context.listed:
        return False  # unlisted: unknown, not unallocated
    if (ref.namespace, ref.pod) in context.claims_unreported:
        return False
    mig_uuid = device.key[1]
    if (ref, device.uuid, None) in context.other_held or (
        mig_uuid is not None and (ref, device.uuid, mig_uuid) in context.other_held
    ):
        return False  # allocated under a resource name outside --resource-names
    if identity is not None and is_mps_daemon(identity.comm):
        return False
    if _held_key(pid, identity, device) in context.held_before:
        return False  # allocated it before: a running container's devices stay
    return context.settled is None or pid in context.settled


def _unaccounted_gpus(processes: Sequence[AttributedProcess], context: _Context) -> frozenset[str]:
    """GPUs a pod's process uses whose allocation the answer cannot show: the kubelet
    does not list its container (just restarted, a pod newer than the answer, an init
    container), reports none of its pod's claims, or lists it without a device it was
    seen to hold; or a pod's process that cannot be named on a GPU the answer allocates
    nothing on. The kubelet may count a device of it allocated; capacity must not call
    it free."""
    if context.listed is None or context.allocations is None:
        return frozenset()
    held = {(pid, uid, uuid, mig) for pid, uid, _, uuid, mig in context.held_before}
    unaccounted: set[str] = set()
    for row in processes:
        if row.owner == OWNER_UNKNOWN and row.pod_uid is not None:
            # a pod's process that cannot be named (no pod metadata): unaccounted where
            # the answer allocates nothing on its GPU it could belong to
            if not context.allocations.get(row.uuid):
                unaccounted.add(row.uuid)
            continue
        if row.owner != OWNER_POD or row.allocated is not None or row.namespace is None:
            continue
        ref = ContainerRef(row.namespace, row.pod or "", row.container or "")
        if (
            ref not in context.listed
            or (row.namespace, row.pod) in context.claims_unreported
            or (row.pid, row.pod_uid, row.uuid, row.mig_uuid) in held
        ):
            unaccounted.add(row.uuid)
    return frozenset(unaccounted)


# /proc/<pid>/comm of nvidia-cuda-mps-control and nvidia-cuda-mps-server: the kernel
# keeps 15 bytes (TASK_COMM_LEN 16), so both read "nvidia-cuda-mps". NVIDIA's device
# plugin starts the control daemon (`nvidia-cuda-mps-control -d`) in a container that
# requests no GPU, and the daemon starts a server per client UID on the shared GPUs.
MPS_COMM_PREFIX = "nvidia-cuda-mps"


def is_mps_daemon(comm: str | None) -> bool:
    """MPS's control daemon or server: the infrastructure of a GPU's sharing."""
    return comm is not None and comm.startswith(MPS_COMM_PREFIX)


def _listed_containers(
    pod_resources: PodResourcesSnapshot | None,
) -> frozenset[ContainerRef] | None:
    """Every container the answer names; those with devices or claims count too (a
    snapshot built from allocations alone names its containers through them)."""
    if pod_resources is None or not pod_resources.ok:
        return None
    return frozenset(
        {ContainerRef(*key) for key in pod_resources.listed}
        | {ContainerRef(c.namespace, c.pod, c.container) for c in pod_resources.containers}
        | {ContainerRef(c.namespace, c.pod, c.container) for c in pod_resources.claims}
    )


def _claims_unreported(
    pod_resources: PodResourcesSnapshot | None, pod_meta: PodMetaSnapshot | None
) -> frozenset[tuple[str, str]]:
    """Pods with resourceClaims whose claims the answer does not report."""
    if pod_resources is None or pod_meta is None or not pod_meta.ok:
        return frozenset()
    reported = pod_resources.claims_reported | {(c.namespace, c.pod) for c in pod_resources.claims}
    return frozenset(
        (p.namespace, p.name)
        for p in pod_meta.pods
        if p.resource_claims and (p.namespace, p.name) not in reported
    )


def _other_held(
    pod_resources: PodResourcesSnapshot | None,
    gpus: Sequence[GpuSample],
    slices: ResourceSliceSnapshot | None,
) -> frozenset[tuple[ContainerRef, str, str | None]]:
    """Device ids under other resource names that resolve to a GPU of this node."""
    if pod_resources is None or not pod_resources.ok or not pod_resources.other_devices:
        return frozenset()
    return frozenset(
        (ContainerRef(entry.namespace, entry.pod, entry.container), ref.uuid, ref.mig_uuid)
        for entry, ref in other_resource_devices(pod_resources, gpus, slices)
        if ref.uuid is not None
    )


def _other_counts(
    pod_resources: PodResourcesSnapshot | None,
    gpus: Sequence[GpuSample],
    slices: ResourceSliceSnapshot | None,
) -> tuple[tuple[str, int], ...]:
    if pod_resources is None or not pod_resources.ok or not pod_resources.other_devices:
        return ()
    counts: dict[str, int] = defaultdict(int)
    for entry, _ in other_resource_devices(pod_resources, gpus, slices):
        counts[entry.resource_name] += 1
    return tuple(sorted(counts.items()))


def other_resource_devices(
    pod_resources: PodResourcesSnapshot,
    gpus: Sequence[GpuSample],
    slices: ResourceSliceSnapshot | None,
) -> Iterator[tuple[ContainerDevices, DeviceRef]]:
    """Each device id under a resource name outside --resource-names that names a GPU
    or MIG device of this node, with the device it names."""
    resolver = DeviceResolver(gpus, slices)
    for entry in pod_resources.other_devices:
        for device_id in entry.device_ids:
            ref = resolver.device_id(device_id).ref
            if ref.uuid is not None:
                yield entry, ref


def _allocations_on(
    device: _Device, allocations: Mapping[str, Sequence[Allocation]] | None
) -> Sequence[Allocation]:
    return () if allocations is None else allocations.get(device.uuid, ())


def _covers(allocation: Allocation, device: _Device) -> bool:
    """A whole-GPU (or replica) allocation covers the GPU and its MIG instances."""
    held = allocation.device
    return held.uuid == device.uuid and held.mig_uuid in (None, device.key[1])


def _pods_by_uid(pod_meta: PodMetaSnapshot | None) -> dict[str, PodMeta] | None:
    if pod_meta is None or not pod_meta.ok:
        return None
    return {pod.uid: pod for pod in pod_meta.pods}


# ---------------------------------------------------------------------------
# PodResources allocations
# ---------------------------------------------------------------------------


# The last allocations resolved, and what from: (PodResources, ResourceSlices, finished
# pods, resolver_key of the GPUs, the allocations). The sources hand over the same snapshot
# objects from one cycle to the next until something changes, and GPUs rarely change
# identity, so resolving every device id again each cycle is work done twice (~5 % of a
# sample cycle on node-8gpu, py-spy over the whole process). One tuple, replaced whole:
# two agents in one process (tests) may each find the other's, never a torn one.
_LastAllocations = tuple[
    PodResourcesSnapshot,
    ResourceSliceSnapshot | None,
    frozenset[tuple[str, str]],
    tuple[object, ...],
    tuple[Allocation, ...],
]
_last_allocations: _LastAllocations | None = None


def _allocations(
    pod_resources: PodResourcesSnapshot | None,
    gpus: Sequence[GpuSample],
    slices: ResourceSliceSnapshot | None,
    finished: frozenset[tuple[str, str]],
) -> tuple[Allocation, ...] | None:
    """Resolved allocations of running pods (device plugins' and DRA claims'); None
    when PodResources gave no data. The last call's answer while the snapshots are the
    same objects and the pods finished and the GPUs' identities are equal."""
    global _last_allocations
    if pod_resources is None or not pod_resources.ok:
        return None
    key = resolver_key(gpus)
    last = _last_allocations
    if (
        last is not None
        and last[0] is pod_resources
        and last[1] is slices
        and last[2] == finished
        and last[3] == key
    ):
        return last[4]
    found = _resolve_allocations(pod_resources, gpus, slices, finished)
    _last_allocations = (pod_resources, slices, finished, key, found)
    return found


def _resolve_allocations(
    pod_resources: PodResourcesSnapshot,
    gpus: Sequence[GpuSample],
    slices: ResourceSliceSnapshot | None,
    finished: frozenset[tuple[str, str]],
) -> tuple[Allocation, ...]:
    resolver = DeviceResolver(gpus, slices)
    found = set()
    for entry in pod_resources.containers:
        if (entry.namespace, entry.pod) in finished:
            continue
        for device_id in entry.device_ids:
            device = resolver.device_id(device_id)
            found.add(
                Allocation(
                    container=ContainerRef(entry.namespace, entry.pod, entry.container),
                    device=device.ref,
                    device_id=device_id,
                    resource_name=entry.resource_name,
                    shared=device.replica or entry.resource_name.endswith(SHARED_RESOURCE_SUFFIX),
                )
            )
    claims = [c for c in pod_resources.claims if (c.namespace, c.pod) not in finished]
    holders: dict[tuple[str, str, str, str, str], set[ContainerRef]] = defaultdict(set)
    for c in claims:
        key = (c.claim_namespace, c.claim_name, c.driver, c.pool, c.device)
        holders[key].add(ContainerRef(c.namespace, c.pod, c.container))
    for c in claims:
        device = resolver.claim(c.driver, c.pool, c.device)
        key = (c.claim_namespace, c.claim_name, c.driver, c.pool, c.device)
        found.add(
            Allocation(
                container=ContainerRef(c.namespace, c.pod, c.container),
                device=device.ref,
                device_id=f"{c.pool}/{c.device}",
                resource_name=c.driver,
                shared=c.share_id is not None or len(holders[key]) > 1,
                claim=f"{c.claim_namespace}/{c.claim_name}",
            )
        )
    return tuple(sorted(found, key=_allocation_order))


def _finished_pods(
    pod_meta: PodMetaSnapshot | None, terminal_phases: frozenset[str]
) -> frozenset[tuple[str, str]]:
    """Pods whose every incarnation is terminal: a recreated same-name pod keeps its devices."""
    if pod_meta is None or not pod_meta.ok:
        return frozenset()
    running = {(p.namespace, p.name) for p in pod_meta.pods if p.phase not in terminal_phases}
    return frozenset(
        (p.namespace, p.name)
        for p in pod_meta.pods
        if p.phase in terminal_phases and (p.namespace, p.name) not in running
    )


def _held(allocations: Iterable[Allocation]) -> frozenset[tuple[ContainerRef, str, str | None]]:
    return frozenset(
        (a.container, a.device.uuid, a.device.mig_uuid)
        for a in allocations
        if a.device.uuid is not None
    )


def _by_uuid(allocations: Iterable[Allocation]) -> dict[str, list[Allocation]]:
    grouped: dict[str, list[Allocation]] = defaultdict(list)
    for allocation in allocations:
        if allocation.device.uuid is not None:
            grouped[allocation.device.uuid].append(allocation)
    return dict(grouped)


# ---------------------------------------------------------------------------
# Aggregation
# ---------------------------------------------------------------------------


def _group_by_container(
    rows: Iterable[AttributedProcess],
) -> dict[tuple[ContainerRef, DeviceRef], list[AttributedProcess]]:
    groups: dict[tuple[ContainerRef, DeviceRef], list[AttributedProcess]] = defaultdict(list)
    for row in rows:
        if row.owner == OWNER_POD and row.namespace and row.pod and row.container:
            container = ContainerRef(row.namespace, row.pod, row.container)
            groups[(container, DeviceRef(row.gpu, row.uuid, row.mig_uuid))].append(row)
    return groups


def _container_usage(processes: Sequence[AttributedProcess]) -> tuple[ContainerGpuUsage, ...]:
    usage = (
        ContainerGpuUsage(container, device, _memory(rows), _sm_sum(rows), len(rows))
        for (container, device), rows in _group_by_container(processes).items()
    )
    return tuple(sorted(usage, key=_container_order))


def _unallocated_use(processes: Sequence[AttributedProcess]) -> tuple[UnallocatedUse, ...]:
    groups = _group_by_container(row for row in processes if row.allocated is False)
    leaks = (
        UnallocatedUse(container, device, _memory(rows), len(rows))
        for (container, device), rows in groups.items()
    )
    return tuple(sorted(leaks, key=_container_order))


def _unattributed(processes: Sequence[AttributedProcess]) -> tuple[UnattributedUse, ...]:
    groups: dict[tuple[DeviceRef, Owner, str | None], list[AttributedProcess]]
    groups = defaultdict(list)
    for row in processes:
        if row.owner != OWNER_POD:
            device = DeviceRef(row.gpu, row.uuid, row.mig_uuid)
            groups[(device, row.owner, row.reason)].append(row)
    usage = (
        UnattributedUse(device, owner, reason, _memory(rows), len(rows))
        for (device, owner, reason), rows in groups.items()
    )
    return tuple(sorted(usage, key=_unattributed_order))


def _memory(rows: Iterable[AttributedProcess]) -> int | None:
    """The sum, or None when NVML could not say for one of the processes (WDDM, or MIG
    without privileges): a partial sum would pass for the whole, and unknown is no
    series, never a number that is too small."""
    total = 0
    for row in rows:
        if row.memory_used_bytes is None:
            return None
        total += row.memory_used_bytes
    return total


def _sm_sum(rows: Iterable[AttributedProcess]) -> float | None:
    """Processes of one container add up, but a device cannot be more than fully busy."""
    ratios = [row.sm_ratio for row in rows if row.sm_ratio is not None]
    return min(sum(ratios), 1.0) if ratios else None


# ---------------------------------------------------------------------------
# Ordering: exposition renders tuples as they are, so they must be stable
# ---------------------------------------------------------------------------


def _row_order(row: AttributedProcess) -> tuple[int, str, int]:
    return (row.gpu, row.mig_uuid or "", row.pid)


def _container_order(
    row: ContainerGpuUsage | UnallocatedUse,
) -> tuple[ContainerRef, int, str]:
    device = row.device
    return (row.container, -1 if device.gpu is None else device.gpu, device.mig_uuid or "")


def _allocation_order(row: Allocation) -> tuple[ContainerRef, str, str]:
    return (row.container, row.resource_name, row.device_id)


def _unattributed_order(row: UnattributedUse) -> tuple[int, str, str, str]:
    device = row.device
    gpu = -1 if device.gpu is None else device.gpu
    return (gpu, device.mig_uuid or "", row.owner, row.reason or "")
