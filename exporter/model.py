"""Frozen dataclasses that flow from the sources through analysis to exposition.

Every field a driver may not support is ``None`` when unsupported: exposition emits
no series for ``None`` (never a zero), so "not supported" and "zero" stay distinct.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# ---------------------------------------------------------------------------
# NVML
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process NVML lists on a device (or MIG instance)."""

    pid: int
    used_memory_bytes: int | None  # None: driver cannot say (e.g. WDDM)
    kind: str  # "compute" | "graphics" | "mps"
    gpu_instance_id: int | None = None  # set on MIG devices
    compute_instance_id: int | None = None


@dataclass(frozen=True, slots=True)
class ProcessUtilization:
    """One per-process utilisation sample (percent over the driver's sample window)."""

    pid: int
    sm_percent: int
    memory_percent: int
    timestamp_us: int


@dataclass(frozen=True, slots=True)
class RemappedRows:
    correctable: int
    uncorrectable: int
    pending: bool
    failure: bool


@dataclass(frozen=True, slots=True)
class Occupancy:
    """What the SMs really did between two samples (ratios 0..1), from GPM or DCGM.

    GPU-Util only says a kernel was resident at some point in the window; these say
    how many SMs were busy, how full they were, and which pipes worked.
    """

    source: str  # "gpm" | "dcgm"
    graphics_active: float | None = None
    sm_active: float | None = None
    sm_occupancy: float | None = None
    tensor_active: float | None = None
    dram_active: float | None = None
    fp64_active: float | None = None
    fp32_active: float | None = None
    fp16_active: float | None = None


@dataclass(frozen=True, slots=True)
class MigInstance:
    """A MIG device: a GPU instance + compute instance with its own UUID."""

    mig_index: int
    uuid: str
    gpu_instance_id: int
    compute_instance_id: int
    profile: str  # e.g. "3g.40gb"
    memory_total_bytes: int | None
    memory_used_bytes: int | None
    processes: tuple[GpuProcess, ...] = ()
    occupancy: Occupancy | None = None


@dataclass(frozen=True, slots=True)
class GpuSample:
    """Everything read from one physical GPU in one cycle.

    ``error`` is set when the GPU failed as a whole (lost, unknown error): then only the
    identity fields are meaningful and the GPU is reported unhealthy.
    """

    index: int
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    minor_number: int | None = None
    error: str | None = None  # e.g. "GpuIsLost"; None when the GPU answered
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None  # v2 semantics: excludes driver-reserved
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    utilization_gpu_percent: int | None = None
    utilization_memory_percent: int | None = None
    temperature_celsius: int | None = None
    power_milliwatts: int | None = None
    power_limit_milliwatts: int | None = None
    energy_millijoules: int | None = None
    clock_sm_mhz: int | None = None
    clock_memory_mhz: int | None = None
    clock_event_reasons: int | None = None  # NVML bitmask
    pcie_replay_count: int | None = None
    ecc_corrected_total: int | None = None
    ecc_uncorrected_total: int | None = None
    ecc_uncorrected_volatile: int | None = None  # since the driver loaded
    recovery_action: int | None = None  # NVML_FI_DEV_GET_GPU_RECOVERY_ACTION (XID 154)
    retired_pages: int | None = None  # page retirement (pre-Ampere); NotSupported on H100
    remapped_rows: RemappedRows | None = None
    mig_enabled: bool | None = None
    # On a MIG-enabled GPU the processes live in ``mig_instances[*].processes``.
    processes: tuple[GpuProcess, ...] = ()
    process_utilization: tuple[ProcessUtilization, ...] = ()
    mig_instances: tuple[MigInstance, ...] = ()
    occupancy: Occupancy | None = None


@dataclass(frozen=True, slots=True)
class NvmlSnapshot:
    """One NVML sample cycle. ``ok`` False means NVML itself is unavailable."""

    ok: bool
    timestamp: float  # wall-clock seconds when the cycle started
    error: str | None = None
    driver_version: str | None = None
    nvml_version: str | None = None
    cuda_driver_version: str | None = None
    gpus: tuple[GpuSample, ...] = ()
    errors: tuple[tuple[str, str], ...] = ()  # (query, error class) that failed this cycle


# ---------------------------------------------------------------------------
# Host processes (procfs)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """What ``<proc-root>/<pid>`` says about a pid.

    ``alive`` False: the directory is missing. A live pid with ``pod_uid`` None is a
    host process (outside kubepods).
    """

    pid: int
    alive: bool
    pod_uid: str | None = None  # normalised with dashes, lower case
    container_id: str | None = None  # bare 64-hex id, no runtime prefix
    comm: str | None = None
    state: str | None = None  # single letter from /proc/<pid>/stat, e.g. "R", "D", "Z"


# ---------------------------------------------------------------------------
# kubelet PodResources
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ContainerDevices:
    """Devices the kubelet allocated to one container, for one resource name."""

    namespace: str
    pod: str
    container: str
    resource_name: str  # e.g. "nvidia.com/gpu"
    device_ids: tuple[str, ...]  # GPU UUID, MIG UUID, or replica id "GPU-...::N"


@dataclass(frozen=True, slots=True)
class AllocatableDevices:
    resource_name: str
    device_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PodResourcesSnapshot:
    ok: bool
    timestamp: float
    error: str | None = None
    containers: tuple[ContainerDevices, ...] = ()
    allocatable: tuple[AllocatableDevices, ...] = ()
    allocatable_ok: bool = False  # GetAllocatableResources answered


# ---------------------------------------------------------------------------
# Kubernetes pod metadata
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodMeta:
    uid: str
    namespace: str
    name: str
    phase: str | None = None
    deletion_timestamp: float | None = None  # epoch seconds when deletion was requested
    containers: tuple[tuple[str, str], ...] = ()  # (bare container id, container name)


@dataclass(frozen=True, slots=True)
class PodMetaSnapshot:
    ok: bool
    timestamp: float
    error: str | None = None
    pods: tuple[PodMeta, ...] = ()


# ---------------------------------------------------------------------------
# Whole-node snapshot handed to analysis
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """Health of one source for ``gpu_exporter_source_up``."""

    name: str
    up: bool
    error: str | None = None


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    node_name: str
    nvml: NvmlSnapshot
    timestamp: float = 0.0  # wall-clock seconds at the start of the cycle
    processes: tuple[ProcessIdentity, ...] = ()
    pod_resources: PodResourcesSnapshot | None = None
    pod_meta: PodMetaSnapshot | None = None
    dcgm: DcgmSnapshot | None = None
    sources: tuple[SourceStatus, ...] = field(default_factory=tuple)


# ---------------------------------------------------------------------------
# Attribution results
# ---------------------------------------------------------------------------


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
    used_memory_bytes: int | None
    sm_ratio: float | None  # latest per-process sample / 100; None: no sample for the pid
    kind: str  # "compute" | "graphics" | "mps"
    owner: str
    namespace: str | None = None
    pod: str | None = None
    container: str | None = None
    reason: str | None = None
    allocated: bool | None = None
    pod_uid: str | None = None  # from procfs; lets orphan analysis spot deleted pods


@dataclass(frozen=True, slots=True)
class ContainerGpuUsage:
    """What one container uses on one device; time-sliced sharers each get their own row."""

    namespace: str
    pod: str
    container: str
    gpu: int
    uuid: str
    mig_uuid: str | None
    memory_used_bytes: int  # unknown per-process memory counts 0
    sm_ratio: float | None  # sum over its processes, capped at 1.0; None: no samples
    processes: int


@dataclass(frozen=True, slots=True)
class Allocation:
    """One device id the kubelet allocated to a container, resolved against NVML.

    ``gpu`` is None when NVML does not know the device; ``uuid`` is then the device id
    with any replica suffix stripped.
    """

    namespace: str
    pod: str
    container: str
    gpu: int | None
    uuid: str
    device_id: str  # as the kubelet gives it: GPU UUID, MIG UUID or replica "GPU-...::N"
    mig_uuid: str | None
    resource_name: str
    shared: bool  # replica id or a ".shared" resource


@dataclass(frozen=True, slots=True)
class UnallocatedUse:
    """A container using a device it was not allocated: an isolation leak."""

    namespace: str
    pod: str
    container: str
    gpu: int
    uuid: str
    mig_uuid: str | None
    memory_used_bytes: int
    processes: int


@dataclass(frozen=True, slots=True)
class UnattributedUse:
    """Processes on one device that no pod container owns, per owner kind and reason."""

    gpu: int
    uuid: str
    mig_uuid: str | None
    owner: str  # "host" | "unknown" | "dead"
    reason: str | None
    memory_used_bytes: int
    processes: int


@dataclass(frozen=True, slots=True)
class Attribution:
    """The attribution of one NodeSnapshot; every tuple is sorted for stable exposition."""

    processes: tuple[AttributedProcess, ...] = ()
    containers: tuple[ContainerGpuUsage, ...] = ()
    allocations: tuple[Allocation, ...] = ()
    unallocated_use: tuple[UnallocatedUse, ...] = ()
    unattributed: tuple[UnattributedUse, ...] = ()


# ---------------------------------------------------------------------------
# Health, capacity and idle allocations
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HealthReason:
    reason: str  # e.g. "fatal_xid", "uncorrectable_ecc", "thermal_slowdown"
    severity: str  # "unhealthy" | "degraded"
    detail: str = ""


@dataclass(frozen=True, slots=True)
class GpuHealth:
    """The verdict for one GPU: unhealthy if any reason has severity "unhealthy"."""

    gpu: int
    uuid: str
    reasons: tuple[HealthReason, ...] = ()

    @property
    def healthy(self) -> bool:
        return not any(r.severity == "unhealthy" for r in self.reasons)


@dataclass(frozen=True, slots=True)
class DeviceCapacity:
    """Schedulable devices of one extended resource (the seed's capacity equation)."""

    resource: str
    advertised: int
    healthy: int
    unhealthy: int
    allocated: int
    allocatable: int  # healthy advertised devices not allocated


@dataclass(frozen=True, slots=True)
class IdleAllocation:
    """Time a container held a device while the device (or its share) stayed idle."""

    namespace: str
    pod: str
    container: str
    gpu: int | None
    uuid: str
    mig_uuid: str | None
    device_id: str
    idle_now: bool
    idle_seconds_total: float


# ---------------------------------------------------------------------------
# What exposition renders
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Analysis:
    """One cycle's snapshot together with everything analysis derived from it."""

    node: NodeSnapshot
    attribution: Attribution
    health: tuple[GpuHealth, ...] = ()
    capacity: tuple[DeviceCapacity, ...] = ()
    idle: tuple[IdleAllocation, ...] = ()
    # ((gpu, uuid, xid, severity, gpu instance, compute instance), count): cumulative
    # XID counts for gpu_xid_errors_total (instance ids only on MIG XIDs)
    xid_counts: tuple[
        tuple[tuple[int | None, str | None, int, str, int | None, int | None], int], ...
    ] = ()
    orphans: tuple[OrphanedMemory, ...] = ()
    orphan_holders: tuple[OrphanHolder, ...] = ()
    driver_held: tuple[tuple[int, str, bool], ...] = ()  # (gpu, uuid, only drivers hold it)


# ---------------------------------------------------------------------------
# XID events
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One XID the driver raised, from the NVML event set or the kernel log.

    NVML names the GPU (``gpu``/``uuid``); the kernel log only names the PCI bus
    (``pci_bus_id`` as printed, e.g. "0000:3b:00"), so kmsg events carry ``gpu`` and
    ``uuid`` None until analysis resolves the bus id. ``timestamp`` is epoch seconds.
    """

    gpu: int | None
    uuid: str | None
    xid: int
    timestamp: float
    source: str  # "nvml" | "kmsg"
    gpu_instance_id: int | None = None  # MIG attribution, when the driver gives it
    compute_instance_id: int | None = None
    pci_bus_id: str | None = None
    message: str | None = None  # kmsg: the text after the code (pid=..., name=..., detail)


# ---------------------------------------------------------------------------
# DCGM (optional source)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class DcgmHealthIncident:
    """One finding of DCGM's health watches (``dcgmHealthCheck``).

    ``gpu_uuid`` is None when the incident names an entity that is not a GPU DCGM
    listed (e.g. an NVSwitch). ``system`` is the watched subsystem ("pcie", "mem",
    "thermal", ...), ``health`` is "pass" | "warn" | "fail" | "unknown".
    """

    gpu_uuid: str | None
    system: str
    health: str
    message: str


@dataclass(frozen=True, slots=True)
class DcgmSnapshot:
    """One DCGM sample cycle. ``ok`` False: DCGM is unavailable (``error`` says why).

    ``ok`` True with ``error`` set means DCGM answers but a feature is unavailable
    (e.g. profiling fields not supported on this GPU): the rest is still valid.
    ``occupancy`` holds only GPUs with at least one non-blank profiling value, so a
    GPU absent here falls back to GPM. ``health`` is the overall verdict ("pass" |
    "warn" | "fail"), None when health watches are unavailable.
    """

    ok: bool
    timestamp: float  # wall-clock seconds when the cycle started
    error: str | None = None
    occupancy: tuple[tuple[str, Occupancy], ...] = ()  # (GPU UUID, occupancy)
    incidents: tuple[DcgmHealthIncident, ...] = ()
    health: str | None = None


# ---------------------------------------------------------------------------
# Orphaned GPU memory (analysis/orphans.py, sources/holders.py)
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class OrphanedMemory:
    """GPU memory no running pod can free, per physical GPU and kind.

    ``kind`` is "dead_process" | "deleted_pod" | "stuck_process" | "unattributed".
    ``processes`` counts the NVML-listed processes behind it; it is 0 for
    "unattributed", which by definition no listed process accounts for. ``first_seen``
    (epoch seconds) stays put while the condition holds, so alerts can say "for 10m".
    """

    gpu: int
    uuid: str
    kind: str
    memory_bytes: int
    processes: int
    first_seen: float


@dataclass(frozen=True, slots=True)
class DeviceHolder:
    """One pid with ``/dev/nvidia<minor>`` open that NVML does not list.

    ``role`` is "holder" (may keep memory alive, e.g. a forked child) or "management"
    (a daemon that opens every GPU without allocating, e.g. nvidia-persistenced).
    """

    pid: int
    minors: tuple[int, ...]
    comm: str | None
    role: str
    pod_uid: str | None = None
    container_id: str | None = None
    state: str | None = None


@dataclass(frozen=True, slots=True)
class HolderScan:
    """One bounded walk of ``<proc-root>/*/fd`` for the given device minors, or several
    consecutive ones merged (a truncated walk is continued from ``resume_pid``).

    Only a ``complete`` scan can prove that nobody holds a device: a truncated walk,
    or fd tables the exporter may not read (no CAP_SYS_PTRACE), may have missed one.
    """

    minors: tuple[int, ...]
    holders: tuple[DeviceHolder, ...] = ()
    scanned_pids: int = 0
    unreadable_pids: int = 0  # fd table unreadable (permission): a holder may be missed
    truncated: bool = False  # the time or pid bound was hit
    resume_pid: int | None = None  # where a truncated walk stopped, to go on from
    duration_s: float = 0.0
    error: str | None = None  # the proc root itself could not be listed

    @property
    def complete(self) -> bool:
        return not self.truncated and self.unreadable_pids == 0 and self.error is None


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
    role: str  # "holder" | "management"


@dataclass(frozen=True, slots=True)
class OrphanState:
    """What orphan analysis carries from one cycle to the next (the agent keeps it).

    Everything is keyed by what it is about and pruned every cycle to what is still
    current, so the state stays as small as the set of GPU processes.
    """

    first_seen: tuple[tuple[str, str, float], ...] = ()  # (GPU uuid, kind, since)
    unattributed: tuple[tuple[str, int, float], ...] = ()  # (GPU uuid, cycles above, since)
    stuck: tuple[tuple[int, int, float], ...] = ()  # (pid, cycles in D or Z, since)
    pod_missing_since: tuple[tuple[str, float], ...] = ()  # (pod uid, first seen gone)
    pod_names: tuple[tuple[str, str, str], ...] = ()  # (pod uid, namespace, name) learned
    holder_scan: HolderScan | None = None  # the walk shown (last finished, or a first one)
    holder_scan_at: float | None = None
    holder_scan_gpus: tuple[tuple[int, str, int], ...] = ()  # (gpu, uuid, minor) it covered
    holder_scan_pending: HolderScan | None = None  # a rescan cut short, still going on
