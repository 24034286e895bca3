"""What analysis returns: attribution, orphans, health, capacity and idle findings, and
the ``Analysis`` exposition renders.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from exporter.model.fast_init import fast_init
from exporter.model.readings import CgroupStats, NodeSnapshot
from exporter.model.vocabulary import (
    HolderRole,
    IdleCause,
    LedgerStateName,
    OrphanKind,
    Owner,
    ProcessKind,
    TransitionKind,
)


@fast_init
@dataclass(frozen=True, slots=True, order=True)
class ContainerRef:
    """One container of one pod: what every per-container series is labelled with."""

    namespace: str
    pod: str
    container: str


@fast_init
@dataclass(frozen=True, slots=True)
class DeviceRef:
    """A physical GPU and, on MIG, the instance: what every per-device series names.

    ``gpu`` (the NVML index) is None when NVML does not list the GPU; ``uuid`` is None
    when an allocation's device could not be resolved to any GPU.
    """

    gpu: int | None
    uuid: str | None
    mig_uuid: str | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class AttributedProcess:
    """One NVML-listed process with its owner, ready for per-pod and orphan series.

    ``owner`` is "pod" | "host" | "unknown" | "dead". ``reason`` says why an owner is
    "unknown"; ``allocated`` is None when PodResources cannot tell (or owner is not a pod).
    """

    gpu: int
    uuid: str  # physical GPU UUID
    mig_uuid: str | None
    gpu_instance_id: int | None
    compute_instance_id: int | None
    pid: int
    memory_used_bytes: int | None
    sm_ratio: float | None  # latest per-process sample / 100; None: no sample for the pid
    kind: ProcessKind
    owner: Owner
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    reason: str | None = None
    allocated: bool | None = None
    pod_uid: str | None = None  # from procfs; lets orphan analysis spot deleted pods


@fast_init
@dataclass(frozen=True, slots=True)
class ContainerGpuUsage:
    """What one container uses on one device; time-sliced sharers each get their own row."""

    container: ContainerRef
    device: DeviceRef
    memory_used_bytes: int | None  # None: a process's memory is unknown (no partial sum)
    sm_ratio: float | None  # sum over its processes, capped at 1.0; None: no samples
    processes: int


@fast_init
@dataclass(frozen=True, slots=True)
class Allocation:
    """One device the kubelet allocated to a container, resolved to its physical GPU.

    ``device_id`` is the device as the allocating component names it: a GPU or MIG UUID
    or replica ``GPU-...::N`` (NVIDIA's device plugin), ``nvidiaN[/giM][/vgpuK]``
    (GKE's), ``<pool>/<device>`` (a DRA claim; ``resource_name`` is then the driver).
    ``device.uuid`` is the physical GPU's UUID, None when the form or the GPU could not
    be resolved; ``device.gpu`` is None when NVML does not list the GPU.
    """

    container: ContainerRef
    device: DeviceRef
    device_id: str
    resource_name: str
    shared: bool  # time-shared: a replica id, a ".shared" resource, or a shared claim
    claim: str | None = None  # DRA: "<claim namespace>/<claim name>"

    @property
    def resolved(self) -> bool:
        return self.device.uuid is not None


@dataclass(frozen=True, slots=True)
class UnallocatedUse:
    """A container using a device it was not allocated: an isolation leak."""

    container: ContainerRef
    device: DeviceRef
    memory_used_bytes: int | None  # None: a process's memory is unknown
    processes: int


@dataclass(frozen=True, slots=True)
class UnattributedUse:
    """Processes on one device that no pod container owns, per owner kind and reason."""

    device: DeviceRef
    owner: Owner  # never "pod" here
    reason: str | None
    memory_used_bytes: int | None  # None: a process's memory is unknown
    processes: int


@dataclass(frozen=True, slots=True)
class Attribution:
    """The attribution of one NodeSnapshot; every tuple is sorted for stable exposition."""

    processes: tuple[AttributedProcess, ...] = ()
    containers: tuple[ContainerGpuUsage, ...] = ()
    allocations: tuple[Allocation, ...] = ()
    unallocated_use: tuple[UnallocatedUse, ...] = ()
    unattributed: tuple[UnattributedUse, ...] = ()
    # (resource name, device ids) under resource names outside --resource-names that
    # name a GPU of this node: allocations the flag leaves out (never a leak; a hint)
    other_resource_devices: tuple[tuple[str, int], ...] = ()
    # physical GPUs a pod's process uses that the PodResources answer does not account
    # for (its container unlisted, or listed without a device it held before): what is
    # allocated on them is unknown
    unaccounted_gpus: frozenset[str] = frozenset()
    # DRA allocations the answer cannot show: a pod's claims go unreported (the kubelet's
    # KubeletPodResourcesDynamicResources gate off), so a driver's devices are not "free"
    dra_unreported: bool = False
    # (pid, pod UID, container id, GPU UUID, MIG UUID) seen allocated, by the process's own
    # container, in an answer begun after it was first seen: for the next cycle
    held: frozenset[tuple[int, str, str, str, str | None]] = frozenset()


@dataclass(frozen=True, slots=True)
class HealthReason:
    reason: str  # e.g. "fatal_xid", "uncorrectable_ecc", "thermal_slowdown"
    # "unhealthy" | "degraded" | "unknown": "unknown" is no verdict at all (a GPU whose
    # reading failed without hardware evidence): neither healthy nor unhealthy
    severity: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """The verdict for one GPU: unhealthy if any reason has severity "unhealthy";
    unknown if none has, but one says "unknown" (no hardware evidence either way);
    healthy only when neither."""

    gpu: int
    uuid: str
    reasons: tuple[HealthReason, ...] = ()

    @property
    def unhealthy(self) -> bool:
        return any(r.severity == "unhealthy" for r in self.reasons)

    @property
    def unknown(self) -> bool:
        return not self.unhealthy and any(r.severity == "unknown" for r in self.reasons)

    @property
    def healthy(self) -> bool:
        return not any(r.severity in ("unhealthy", "unknown") for r in self.reasons)


@dataclass(frozen=True, slots=True)
class DeviceCapacity:
    """Devices of one extended resource (or DRA driver) by state: allocatable = healthy
    advertised - allocated healthy - disrupted; a device on an unhealthy GPU is unhealthy.

    healthy + unhealthy + unknown = advertised. ``None`` is a count the sources cannot
    give (docs/health.md): health while NVML is down, allocation while the kubelet is.
    """

    resource: str
    advertised: int
    healthy: int | None
    unhealthy: int | None
    allocated: int | None
    allocatable: int | None  # devices known healthy, not allocated and not disrupted
    unknown: int = 0  # advertised devices whose health no present source can judge
    # Healthy devices no allocation holds that a new pod could still not get (a cordoned
    # node, a taint, a driver upgrade); None: the Node (or its devices' taints) unknown.
    disrupted: int | None = None
    # (reason, devices) for each reason that can be told (0 included); a device may
    # count under several
    disrupted_by: tuple[tuple[str, int], ...] = ()


@fast_init
@dataclass(frozen=True, slots=True)
class IdleAllocation:
    """Time a container held a device while the device (or its share) stayed idle."""

    container: ContainerRef
    device: DeviceRef
    device_id: str
    idle_now: bool
    idle_seconds_total: float


@dataclass(frozen=True, slots=True)
class IdleReason:
    """Why a GPU container's allocations may be idle this cycle (analysis/why_idle.py):
    its cgroup's shares over the window since the last cycle and the cause they point to.
    A share is None when it could not be measured (no earlier reading, a counter that
    went back, no PSI, no CFS periods); the cause is then taken from the others."""

    container: ContainerRef
    cause: IdleCause
    throttled_ratio: float | None  # CFS periods throttled / periods with a quota
    cpu_pressure_ratio: float | None  # cpu.pressure some stall, seconds per second
    io_pressure_ratio: float | None  # io.pressure some stall, seconds per second


@dataclass(frozen=True, slots=True)
class ContainerCgroup:
    """One GPU container's cgroup counters (analysis/cgroup_signals.py), named as every
    per-container series is; the counters are as read, None where not read."""

    container: ContainerRef
    stats: CgroupStats


@dataclass(frozen=True, slots=True)
class MigIdentity:
    """The labels that name a MIG instance, kept with a ledger row so that its series
    keep their names while NVML does not list the instance (NVML down, a GPU lost)."""

    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str


@fast_init
@dataclass(frozen=True, slots=True)
class AllocationLedger:
    """The GPU-hour ledger of one allocation (analysis/ledger.py): GPU-equivalent
    seconds it spent in each state since it appeared.

    ``weight`` is the GPU-equivalents it holds now (whole GPU 1, MIG instance its compute
    slices over the GPU's, a time-sliced or MPS replica 1/replicas). ``seconds`` names
    every state of ``LEDGER_STATES`` once, in that order, 0 included, so every series
    exists from the allocation's first cycle; they sum to ``allocated_seconds``, its
    weighted time held (conservation). ``state`` is this cycle's. ``device`` and ``mig``
    are the device as NVML last listed it: while it is not listed they stay, so the
    series keep one identity.
    """

    container: ContainerRef
    device: DeviceRef
    device_id: str
    weight: float
    state: LedgerStateName
    seconds: tuple[tuple[LedgerStateName, float], ...]
    allocated_seconds: float
    mig: MigIdentity | None = None
    # The idle + no_process seconds by likely cause (analysis/why_idle.py): every cause
    # of ``IDLE_CAUSES`` once, in that order, 0 included; they sum to those two states.
    idle_causes: tuple[tuple[IdleCause, float], ...] = ()


@fast_init
@dataclass(frozen=True, slots=True)
class ContainerEnergy:
    """Joules of a GPU's energy counter given to one container holding it (or one of its
    MIG instances) since the allocation appeared: an estimate (analysis/ledger.py).
    ``device`` and ``mig`` as the ledger row's: as NVML last listed them."""

    container: ContainerRef
    device: DeviceRef
    joules_total: float
    mig: MigIdentity | None = None


@dataclass(frozen=True, slots=True)
class OrphanedMemory:
    """GPU memory no running pod can free, per physical GPU and kind.

    ``kind`` is "dead_process" | "deleted_pod" | "stuck_process" | "unattributed".
    ``processes`` counts the NVML-listed processes behind it; it is 0 for
    "unattributed", which by definition no listed process accounts for. ``first_seen``
    (epoch seconds) stays put while the condition holds, so alerts can say "for 10m".
    ``memory_used_bytes`` is None when NVML could not say how much one of the processes
    holds: the processes are still counted, the memory is not guessed.
    """

    gpu: int
    uuid: str
    kind: OrphanKind
    memory_used_bytes: int | None
    processes: int
    first_seen: float


@dataclass(frozen=True, slots=True)
class DriverHeld:
    """Whether a complete holder scan found only management daemons holding a GPU with
    dead-process or unattributed memory: then nothing can be killed, only a GPU reset
    frees it."""

    gpu: int
    uuid: str
    only_drivers: bool


@dataclass(frozen=True, slots=True)
class OrphanHolder:
    """A holder named for exposition: one row per (pid, GPU) it holds."""

    gpu: int | None  # None: a minor NVML does not know
    uuid: str | None
    pid: int
    namespace: str | None
    pod: str | None
    container: str | None
    comm: str | None
    role: HolderRole


@dataclass(frozen=True, slots=True)
class HolderScanRequest:
    """A finding of analysis for the next cycle's holder scan: the GPUs whose
    dead-process or unattributed memory needs a holder named, as (gpu index, uuid,
    device minor)."""

    gpus: tuple[tuple[int, str, int], ...]

    @property
    def minors(self) -> tuple[int, ...]:
        return tuple(sorted({minor for _, _, minor in self.gpus}))


@dataclass(frozen=True, slots=True)
class XidCount:
    """How many times an XID happened on a GPU (or MIG instance): since start, or before
    it (``Analysis.xid_counts_before_start``)."""

    gpu: int | None
    uuid: str | None
    xid: int
    severity: str
    gpu_instance_id: int | None  # only on MIG XIDs
    compute_instance_id: int | None
    count: int
    # gpu None: the PCI addresses the kernel log named for it (no GPU NVML listed had
    # them, e.g. one lost before the exporter started), normalised "dddd:bb:dd"
    pci_bus_ids: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class SharedGpu:
    """A whole GPU several containers share (time-sliced replicas, MPS, or co-located).

    ``containers`` have a process on it; ``active_containers`` of them had SM time in
    the driver's per-process samples of this cycle's window. ``memory_headroom_bytes``
    is total - used - reserved: what the next allocation of anyone can get.
    """

    device: DeviceRef
    containers: int
    active_containers: int
    memory_headroom_bytes: int | None


@fast_init
@dataclass(frozen=True, slots=True)
class ContainerShare:
    """One container's part of a shared GPU.

    ``sm_time_share``: its share of the SM time all containers used (None: nobody had
    a sample); ``fair_share_deviation``: that share minus an equal share of the active
    containers (None: it had no work); ``memory_growth_bytes``: how far its memory rose
    above its lowest point in the growth window (None: memory unknown).
    """

    container: ContainerRef
    device: DeviceRef
    sm_time_share: float | None
    fair_share_deviation: float | None
    memory_growth_bytes: int | None


@dataclass(frozen=True, slots=True)
class ContainerLimit:
    """What a container was promised on a device (HAMi's resources); None: no limit."""

    container: ContainerRef
    device: DeviceRef
    memory_limit_bytes: int | None
    sm_limit_ratio: float | None


@dataclass(frozen=True, slots=True, order=True)
class PodRef:
    """A pod as an Event's ``regarding`` names it; ``uid`` None when no source knows it."""

    namespace: str
    name: str
    uid: str | None = None


@fast_init
@dataclass(frozen=True, slots=True, order=True)
class PodOwner:
    """The workload a pod that holds or uses a GPU belongs to (analysis/owners.py):
    ``kind`` "Deployment", "CronJob", "StatefulSet", ... as resolved, "Pod" for a pod
    that no controller owns (``name`` is then the pod's)."""

    namespace: str
    pod: str
    kind: str
    name: str


@dataclass(frozen=True, slots=True)
class HealthTransition:
    """One change of a health fact; the fields a kind does not use stay empty.

    ``pods`` are the pods the fact concerns: those holding an allocation on the GPU
    (or, for an XID that names a MIG instance, on that instance) for GPU facts, the
    leaking pod for a leak. ``count`` is how many XIDs of this code were raised since
    the last cycle (an XID storm is one transition with a count).
    """

    kind: TransitionKind
    gpu: int | None = None
    uuid: str | None = None
    mig_uuid: str | None = None
    gpu_instance_id: int | None = None
    xid: int | None = None
    xid_class: str | None = None
    count: int = 1
    reasons: tuple[HealthReason, ...] = ()
    pods: tuple[PodRef, ...] = ()
    container: ContainerRef | None = None
    memory_bytes: int | None = None
    orphan_kind: OrphanKind | None = None
    holders: tuple[OrphanHolder, ...] = ()
    # dead_process: the dead pids NVML lists; the holders are the live processes found
    # with the device open, never these
    dead_pids: tuple[int, ...] = ()
    # dead_process / unattributed: whether a complete holder scan covered the GPU. False:
    # an empty ``holders`` is unknown (no scan came, or it stopped at its bound), not none
    holders_scanned: bool = True
    source: str | None = None
    detail: str = ""


@dataclass(frozen=True, slots=True)
class ActiveTime:
    """The activity counters (exporter/analysis/active_time.py): carried from cycle to
    cycle and served as they stand."""

    # device UUID (GPU or MIG device) -> metric -> active seconds
    devices: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # device UUID -> metric -> seconds its windows covered (each metric its own: one
    # that fails while the others answer is not covered)
    sampled: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    # (device UUID, "occupancy" | "utilization") -> end of the last window added
    window_end: Mapping[tuple[str, str], float] = field(default_factory=dict)
    # device UUID -> the occupancy source of the last window added (gpm | dcgm)
    source: Mapping[str, str] = field(default_factory=dict)
    # device UUID -> the analysis' monotonic time its occupancy windows are counted up to
    # (behind the cycle that added the last by what that window left unclaimed)
    covered_to: Mapping[str, float] = field(default_factory=dict)
    # device UUID -> the analysis' monotonic time its last occupancy window was added
    added_at: Mapping[str, float] = field(default_factory=dict)
    containers: Mapping[tuple[ContainerRef, DeviceRef], float] = field(default_factory=dict)
    # (GPU UUID, pid) -> newest process sample added (µs)
    process_stamp: Mapping[tuple[str, int], int] = field(default_factory=dict)
    # when each device / container was last seen (the analysis' monotonic time): totals
    # go only after ABSENT_S unseen, so one failed read never resets a counter
    device_seen: Mapping[str, float] = field(default_factory=dict)
    container_seen: Mapping[tuple[ContainerRef, DeviceRef], float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Analysis:
    """One cycle's snapshot together with everything analysis derived from it."""

    node: NodeSnapshot
    attribution: Attribution
    # (GPU UUID, "gpm" | "dcgm" | "none"): where its occupancy comes from
    occupancy_sources: tuple[tuple[str, str], ...] = ()
    health: tuple[GpuHealth, ...] = ()
    capacity: tuple[DeviceCapacity, ...] = ()
    idle: tuple[IdleAllocation, ...] = ()
    ledger: tuple[AllocationLedger, ...] = ()  # gpu_container_allocated_gpu_seconds_total
    energy: tuple[ContainerEnergy, ...] = ()  # gpu_container_energy_joules_total
    xid_counts: tuple[XidCount, ...] = ()  # cumulative, for gpu_xid_errors_total
    # kernel-log backlog: XIDs raised before the exporter started (history, not new)
    xid_counts_before_start: tuple[XidCount, ...] = ()
    orphans: tuple[OrphanedMemory, ...] = ()
    orphan_holders: tuple[OrphanHolder, ...] = ()
    driver_held: tuple[DriverHeld, ...] = ()
    holder_request: HolderScanRequest | None = None  # GPUs the next cycle's scan should cover
    shared_gpus: tuple[SharedGpu, ...] = ()
    container_shares: tuple[ContainerShare, ...] = ()
    container_limits: tuple[ContainerLimit, ...] = ()
    transitions: tuple[HealthTransition, ...] = ()  # health facts that changed this cycle
    pod_owners: tuple[PodOwner, ...] = ()  # for gpu_pod_owner_info
    cgroup_signals: tuple[ContainerCgroup, ...] = ()  # gpu_container_cpu_* and *_pressure_*
    why_idle: tuple[IdleReason, ...] = ()  # per GPU container with a cgroup reading
    active_time: ActiveTime = field(default_factory=ActiveTime)  # the *_seconds_total counters
    # GPUs known unhealthy that NVML did not list this cycle: (uuid, unhealthy reasons as
    # last seen). Not listed is not healthy (the node condition still counts them).
    unlisted_unhealthy: tuple[tuple[str, tuple[str, ...]], ...] = ()
