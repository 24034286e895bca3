"""What sources return: frozen values read from NVML, /proc, the kubelet and the API.

Every field a driver may not support is ``None`` when unsupported: exposition emits
no series for ``None`` (never a zero), so "not supported" and "zero" stay distinct.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from exporter.model.fast_init import fast_init
from exporter.model.vocabulary import HolderRole, ProcessKind


@fast_init
@dataclass(frozen=True, slots=True)
class GpuProcess:
    """One process NVML lists on a device (or MIG instance)."""

    pid: int
    memory_used_bytes: int | None  # None: driver cannot say (e.g. WDDM)
    kind: ProcessKind
    gpu_instance_id: int | None = None  # set on MIG devices
    compute_instance_id: int | None = None


@fast_init
@dataclass(frozen=True, slots=True)
class ProcessUtilization:
    """A process's utilisation samples newer than the last read, averaged (percent over
    the driver's sample windows); ``sm_seconds``: the SM time those samples account for
    (each sample's SM share x the period it covers), the increment of
    ``gpu_container_sm_seconds_total``. ``timestamp_us`` (the newest sample's) tells a
    new reading from one carried over from an earlier read."""

    pid: int
    sm_percent: int
    memory_percent: int
    timestamp_us: int
    sm_seconds: float = 0.0


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
    # The window these averages cover: its end (the source's clock, seconds) and length.
    # The activity counters (exporter/analysis/active_time.py) add ratio x window_s once
    # per window end; None: the source did not say (no counter from this reading).
    window_end: float | None = None
    window_s: float | None = None


@dataclass(frozen=True, slots=True)
class ActiveWindow:
    """Time a GPU was busy in the samples NVML kept since the last read (GPU-Util's
    sample buffer, ``nvmlDeviceGetSamples``): ``active_s`` of the ``seconds`` the samples
    cover, the newest ending at ``end`` (the driver's timestamp, epoch seconds)."""

    end: float
    seconds: float
    active_s: float


@fast_init
@dataclass(frozen=True, slots=True)
class NvLink:
    """One NVLink of a GPU. Byte counters are cumulative since the driver loaded (NVML
    counts KiB; these are bytes); ``errors`` holds (type, count) for crc_flit, crc_data,
    replay and recovery, each only where the driver answers it. None: not supported."""

    link: int
    active: bool | None = None
    transmitted_bytes: int | None = None
    received_bytes: int | None = None
    errors: tuple[tuple[str, int], ...] = ()


@fast_init
@dataclass(frozen=True, slots=True)
class PcieLink:
    """The GPU's PCIe link now and at best (the best this GPU and this slot can do), and
    cumulative traffic in bytes (NVML_FI_DEV_PCIE_COUNT_*_BYTES, R555+; may wrap)."""

    generation: int | None = None
    max_generation: int | None = None
    width: int | None = None
    max_width: int | None = None
    transmitted_bytes: int | None = None
    received_bytes: int | None = None


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
class MigProfileInfo:
    """A GPU instance profile the GPU offers (nvmlDeviceGetGpuInstanceProfileInfoV): what
    right-sizing compares a workload with. Fixed while the GPU keeps its MIG mode."""

    name: str  # e.g. "1g.10gb" (NVML: "MIG 1g.10gb")
    memory_bytes: int  # NVML memorySizeMB x 2**20
    compute_slices: int  # NVML sliceCount: the "Ng" of the name
    gpu_slices: int  # the whole GPU's slices: the largest sliceCount among its profiles


PLACEHOLDER_UUID_PREFIX = "unknown-gpu-"


def placeholder_uuid(index: int) -> str:
    """What names the GPU at ``index`` while its UUID cannot be read."""
    return f"{PLACEHOLDER_UUID_PREFIX}{index}"


@fast_init
@dataclass(frozen=True, slots=True)
class GpuSample:
    """Everything read from one physical GPU in one cycle.

    ``error`` is set when the GPU's reading failed as a whole: then only the identity
    fields are meaningful. ``lost`` says whether that failure is NVML's own word that the
    GPU is lost or must be reset (hardware evidence: the GPU is unhealthy); any other
    failure (UNKNOWN, NoPermission, an exception in the binding) leaves its health
    unknown (docs/health.md). ``uuid`` is ``placeholder_uuid(index)`` while the GPU's
    UUID could not be read.
    """

    index: int
    uuid: str
    name: str | None = None
    pci_bus_id: str | None = None
    minor_number: int | None = None
    error: str | None = None  # e.g. "GpuIsLost"; None when the GPU answered
    lost: bool = False  # error is GPU_IS_LOST or RESET_REQUIRED (exporter/sources/nvml_codes.py)
    memory_total_bytes: int | None = None
    memory_used_bytes: int | None = None  # v2 semantics: excludes driver-reserved
    memory_free_bytes: int | None = None
    memory_reserved_bytes: int | None = None
    utilization_gpu_percent: int | None = None
    utilization_memory_percent: int | None = None
    # GPU-Util's samples since the last read (the counter gpu_utilization_seconds_total)
    utilization_window: ActiveWindow | None = None
    temperature_celsius: int | None = None
    power_milliwatts: int | None = None
    power_limit_milliwatts: int | None = None
    energy_millijoules: int | None = None
    # False: this cycle did not read the NVML slow tier (exporter/sources/nvml_cadence.py),
    # so its values (energy, clock-event time, ECC, ...) are the last slow read's, carried
    # as read; the energy ledger splits a delta only when the counter was read again.
    slow_read: bool = True
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
    memory_temperature_celsius: int | None = None  # HBM/GDDR (NVML_FI_DEV_MEMORY_TEMP)
    fan_speeds_percent: tuple[tuple[int, int], ...] = ()  # (fan, percent); none on most DC GPUs
    encoder_utilization_percent: int | None = None
    decoder_utilization_percent: int | None = None
    # (reason, ns) cumulative time clocks were held down, per NVML perf policy / reason
    clock_event_durations_ns: tuple[tuple[str, int], ...] = ()
    pcie: PcieLink | None = None
    nvlinks: tuple[NvLink, ...] = ()
    mig_enabled: bool | None = None
    # On a MIG-enabled GPU the processes live in ``mig_instances[*].processes``.
    processes: tuple[GpuProcess, ...] = ()
    # False when a process listing of the GPU (or of a MIG device) failed or is not
    # supported: ``processes`` is then incomplete, so no count, no unattributed memory
    # and no idleness may be derived from it.
    processes_listed: bool = True
    process_utilization: tuple[ProcessUtilization, ...] = ()
    mig_instances: tuple[MigInstance, ...] = ()
    occupancy: Occupancy | None = None
    # The GPU instance profiles it offers; () for none or not known (not MIG-capable, a
    # driver without the call, or not read yet).
    mig_profiles: tuple[MigProfileInfo, ...] = ()
    # Whether NVML's GPM answers on this GPU (or, in MIG mode, on one of its GPU
    # instances): False on pre-Hopper GPUs; None until asked (or while it cannot be).
    gpm_supported: bool | None = None

    def all_processes(self) -> tuple[GpuProcess, ...]:
        """Processes on the whole GPU and on every MIG instance of it."""
        if not self.mig_instances:
            return self.processes
        return self.processes + tuple(p for m in self.mig_instances for p in m.processes)


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


@fast_init
@dataclass(frozen=True, slots=True)
class ProcessIdentity:
    """What ``<proc-root>/<pid>`` says about a pid.

    ``alive`` False: the directory is missing. A live pid with ``pod_uid`` None is a
    host process (outside kubepods), unless ``cgroup_read`` is False: its cgroup file
    could not be read (permission, I/O), so whose it is is unknown; or unless
    ``cgroup_parsed`` is False: the file was read but is in no form the kernel writes
    (junk), which is no evidence of where the process runs either.
    """

    pid: int
    alive: bool
    pod_uid: str | None = None  # normalised with dashes, lower case
    container_id: str | None = None  # bare 64-hex id, no runtime prefix
    comm: str | None = None
    state: str | None = None  # single letter from /proc/<pid>/stat, e.g. "R", "D", "Z"
    cgroup_read: bool = True
    cgroup_parsed: bool = True
    # The cgroup that attributed the process, as /proc/<pid>/cgroup names it (the v2
    # ``0::`` path, else the path of the v1 line holding the ``cpu`` controller) and that
    # line's version; None: not attributed to a pod, or the file was not read.
    cgroup_path: str | None = None
    cgroup_version: int | None = None


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
class ClaimDevice:
    """One device a DRA ResourceClaim gave one container (PodResources
    ``ContainerResources.dynamic_resources[].claim_resources[]``).

    ``driver``/``pool``/``device`` name the device uniquely; the driver's ResourceSlices
    say which GPU it is. ``share_id`` is set when the claim shares the device
    (consumable capacity); one claim referenced by several containers is shared too.
    """

    namespace: str
    pod: str
    container: str
    claim_namespace: str
    claim_name: str
    driver: str  # e.g. "gpu.nvidia.com"
    pool: str
    device: str  # the device's name inside the pool, e.g. "gpu-0"
    cdi_devices: tuple[str, ...] = ()
    share_id: str | None = None


@dataclass(frozen=True, slots=True)
class PodResourcesSnapshot:
    ok: bool
    timestamp: float
    error: str | None = None
    containers: tuple[ContainerDevices, ...] = ()
    allocatable: tuple[AllocatableDevices, ...] = ()
    allocatable_ok: bool = False  # GetAllocatableResources answered
    claims: tuple[ClaimDevice, ...] = ()  # DRA devices (dynamic_resources)
    # Every (namespace, pod, container) the List answer names, GPU devices or none: the
    # kubelet lists each regular container of the pods it knows (docs/attribution.md,
    # "Isolation leaks"); a container absent from it is unknown, not unallocated.
    listed: frozenset[tuple[str, str, str]] = frozenset()
    # (namespace, pod) of the pods with any dynamic_resources in the answer (any driver):
    # a kubelet without the KubeletPodResourcesDynamicResources gate reports none.
    claims_reported: frozenset[tuple[str, str]] = frozenset()
    # Device ids under resource names outside --resource-names (bounded, see answer.py):
    # one that resolves to a GPU of this node is no leak, and a hint at the flag.
    other_devices: tuple[ContainerDevices, ...] = ()
    # Which List this answers (the source numbers its refreshes from 1; 0: unnumbered),
    # and how many refreshes had begun when it was handed to a cycle: a process first
    # seen with N begun is judged only by an answer numbered above N.
    sequence: int = 0
    begun: int = 0


SliceAttribute = str | int | bool  # DeviceAttribute's string/int/bool/version (as str)


@dataclass(frozen=True, slots=True)
class SliceDevice:
    """One device a DRA driver publishes in a ResourceSlice of this node.

    ``attributes`` are sorted (name, value) pairs with the name unqualified: the
    ``<driver>/`` domain prefix the API allows is stripped, so NVIDIA's ``uuid``,
    ``index``, ``minor``, ``productName`` ... read the same either way.
    """

    driver: str
    pool: str
    name: str
    attributes: tuple[tuple[str, SliceAttribute], ...] = ()
    # The effects of the taints the driver put on the device itself (resource.k8s.io/v1
    # Device.taints, KEP-5055): "NoSchedule", "NoExecute", ... as the API spells them.
    taint_effects: tuple[str, ...] = ()

    def attribute(self, name: str) -> SliceAttribute | None:
        for key, value in self.attributes:
            if key == name:
                return value
        return None


# gpu_exporter_kube_relists_total{reason}: why a list + watch listed again (the first
# LIST of a start is not a relist). docs/metrics.md and docs/reliability.md say more.
RELIST_REASONS = ("resync", "expired", "watch_failed", "bad_stream", "list_failed")
# gpu_exporter_kube_watch_lines_dropped_total{reason}
DROPPED_LINE_REASONS = ("malformed", "oversize")


@dataclass(frozen=True, slots=True)
class WatchCounts:
    """Running totals of one list + watch, (reason, count) pairs with a count above 0:
    relists by ``RELIST_REASONS``, watch lines dropped by ``DROPPED_LINE_REASONS``."""

    relists: tuple[tuple[str, int], ...] = ()
    dropped_lines: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True, slots=True)
class ResourceSliceSnapshot:
    """This node's ResourceSlice devices; ``ok`` False: the API could not be read."""

    ok: bool
    timestamp: float
    error: str | None = None
    devices: tuple[SliceDevice, ...] = ()
    counts: WatchCounts = WatchCounts()


@dataclass(frozen=True, slots=True)
class DeviceTaintRuleSelector:
    """One DRA DeviceTaintRule (resource.k8s.io, KEP-5055) as capacity reads it: which
    devices its ``spec.deviceSelector`` names and the effect of its ``spec.taint``
    (sources/device_taint_rules.py; the matching rule is analysis/capacity.py's).

    ``driver``, ``pool``, ``device``: the selector's exact fields, None where unset (any).
    ``selects``: False when the rule has no ``deviceSelector`` (it then matches no
    device). ``opaque``: the selector also has ``deviceClassName`` or CEL ``selectors``
    (Kubernetes 1.33-1.34 only), which cannot be evaluated here: of the devices the exact
    fields match, which ones it selects is unknown."""

    name: str
    effect: str  # NoSchedule, NoExecute, None, or what a newer API adds
    driver: str | None = None
    pool: str | None = None
    device: str | None = None
    selects: bool = True
    opaque: bool = False


@dataclass(frozen=True, slots=True)
class DeviceTaintRuleSnapshot:
    """The DeviceTaintRules that may name a device of the watched DRA drivers, sorted by
    name; ``ok`` False: they could not be read (then which devices they taint is unknown).
    A cluster that serves no DeviceTaintRule is ``ok`` with none."""

    ok: bool
    timestamp: float
    error: str | None = None
    rules: tuple[DeviceTaintRuleSelector, ...] = ()
    counts: WatchCounts = WatchCounts()


@dataclass(frozen=True, slots=True)
class NodeTaint:
    """One of the Node's ``spec.taints``."""

    key: str
    value: str = ""
    effect: str = ""  # NoSchedule, PreferNoSchedule, NoExecute


@dataclass(frozen=True, slots=True)
class NodeScheduling:
    """What this node's own Node object says about placing new pods on it."""

    unschedulable: bool = False  # spec.unschedulable: cordoned
    taints: tuple[NodeTaint, ...] = ()
    # The GPU Operator's driver upgrade state, the node label
    # nvidia.com/gpu-driver-upgrade-state (None: no such label)
    driver_upgrade_state: str | None = None


@dataclass(frozen=True, slots=True)
class NodeSchedulingSnapshot:
    """The Node watch's reading; ``node`` None: the API has no Node of this name (or it
    was not read: ``ok`` False)."""

    ok: bool
    timestamp: float
    error: str | None = None
    node: NodeScheduling | None = None
    counts: WatchCounts = WatchCounts()


@dataclass(frozen=True, slots=True)
class PodMeta:
    # The UID on this node, as cgroups and the kubelet name the pod: for a static pod the
    # kubelet's (its mirror pod's kubernetes.io/config.mirror), else the API's.
    uid: str
    namespace: str
    name: str
    phase: str | None = None
    deletion_timestamp: float | None = None  # epoch seconds: request time + the grace period
    containers: tuple[tuple[str, str], ...] = ()  # (bare container id, container name)
    # (container name, extended resource name, quantity as the API spells it): each
    # container's limits (its requests where it sets no limit) for resources with a
    # domain ("nvidia.com/gpumem"); HAMi's promised memory and cores are among them.
    resources: tuple[tuple[str, str, str], ...] = ()
    # The pod's controller as metadata.ownerReferences names it (the entry with
    # controller: true; the API server allows one): both None when the pod has none (a
    # bare pod); owner_kind "" when it names one that could not be read (unknown, which is
    # not "no owner"). exporter/analysis/owners.py resolves it to a workload.
    owner_kind: str | None = None
    owner_name: str | None = None
    pod_template_hash: str | None = None  # the pod's `pod-template-hash` label, if any
    api_uid: str | None = None  # a mirror pod's UID in the API, where it differs from uid
    resource_claims: bool = False  # spec.resourceClaims is not empty (DRA)
    # metadata.deletionGracePeriodSeconds: how long the kubelet lets the pod stop gracefully
    # (None: absent or not a whole number >= 0). Last, so positional fields keep their places.
    deletion_grace_period_s: int | None = None


@dataclass(frozen=True, slots=True)
class PodMetaSnapshot:
    ok: bool
    timestamp: float
    error: str | None = None
    pods: tuple[PodMeta, ...] = ()
    counts: WatchCounts = WatchCounts()
    # How far the node's wall clock is ahead of the API server's (its Date headers;
    # sources/server_clock.py): the writer compares a DeviceTaintRule's creation on its
    # clock (orphans do not use it: their deadlines are monotonic). None: unknown.
    server_offset_s: float | None = None


@dataclass(frozen=True, slots=True)
class Pressure:
    """One PSI file's cumulative stall totals, microseconds (``some``/``full`` lines'
    ``total=``); None: that line is absent (``full`` in an old kernel's cpu.pressure)."""

    some_us: int | None = None
    full_us: int | None = None


@dataclass(frozen=True, slots=True)
class CgroupStats:
    """One GPU container's cgroup counters as read this cycle (docs/why-idle.md).

    The container is named as its processes' cgroup names it (pod UID, bare container
    id); analysis maps it to namespace/pod/container. Every field None: not read (a
    missing file, a line the kernel did not write, cgroup v1 for pressure), never 0.
    """

    pod_uid: str
    container_id: str
    cgroup_version: int  # 1 or 2
    nr_periods: int | None = None  # cpu.stat: CFS periods with runnable tasks and a quota
    nr_throttled: int | None = None  # cpu.stat: of those, periods the quota ran out
    throttled_usec: int | None = None  # cpu.stat: time throttled (v1: throttled_time ns / 1000)
    cpu_pressure: Pressure | None = None
    io_pressure: Pressure | None = None
    memory_pressure: Pressure | None = None


@dataclass(frozen=True, slots=True)
class CgroupSnapshot:
    """The cgroup source's reading: ``ok`` False when the cgroup root cannot be read at
    all (every container's counters unknown). ``timestamp`` is monotonic seconds at the
    read, so analysis can turn stall totals into a share of the time between reads."""

    ok: bool
    timestamp: float
    error: str | None = None
    containers: tuple[CgroupStats, ...] = ()


@dataclass(frozen=True, slots=True)
class SourceStatus:
    """Health of one source for ``gpu_exporter_source_up``; ``last_success`` (epoch
    seconds, None: never) for ``gpu_exporter_source_last_success_timestamp_seconds``."""

    name: str
    up: bool
    error: str | None = None
    last_success: float | None = field(default=None, compare=False)  # a time, not a state


@dataclass(frozen=True, slots=True)
class NodeSnapshot:
    node_name: str
    nvml: NvmlSnapshot
    timestamp: float = 0.0  # wall-clock seconds at the start of the cycle
    processes: tuple[ProcessIdentity, ...] = ()
    pod_resources: PodResourcesSnapshot | None = None
    pod_meta: PodMetaSnapshot | None = None
    dcgm: DcgmSnapshot | None = None
    resource_slices: ResourceSliceSnapshot | None = None  # None: DRA not watched
    node_scheduling: NodeSchedulingSnapshot | None = None  # None: the Node not watched
    # None: DeviceTaintRules not watched (no Kubernetes API, or no --dra-drivers)
    device_taint_rules: DeviceTaintRuleSnapshot | None = None
    xid_events: tuple[XidEvent, ...] = ()  # raised since the last cycle (NVML event set)
    kmsg_events: tuple[XidEvent, ...] = ()  # read from the kernel log since the last cycle
    kmsg_overruns: int | None = None  # kernel-log ring overruns since start; None: not read
    holder_scan: HolderScan | None = None  # the last walk for last cycle's HolderScanRequest
    cgroups: CgroupSnapshot | None = None  # None: not read (no --cgroup-root, or off)
    sources: tuple[SourceStatus, ...] = field(default_factory=tuple)
    # The cycle on the monotonic clock (read once its sources are read), which windows
    # are measured on (the XID window); None: not known, ``timestamp`` stands in for it.
    monotonic: float | None = None


@dataclass(slots=True)
class Readings:
    """What the sources have read so far in one cycle: ``NodeSnapshot``'s fields, typed.

    Each source's ``fill`` assigns its own attribute (``cycle.readings.nvml =
    self.read(cycle)``), so mypy checks every source's output against the field it
    fills; ``snapshot`` builds the frozen ``NodeSnapshot`` field by field.
    """

    nvml: NvmlSnapshot | None = None
    processes: tuple[ProcessIdentity, ...] = ()
    pod_resources: PodResourcesSnapshot | None = None
    pod_meta: PodMetaSnapshot | None = None
    dcgm: DcgmSnapshot | None = None
    resource_slices: ResourceSliceSnapshot | None = None
    node_scheduling: NodeSchedulingSnapshot | None = None
    device_taint_rules: DeviceTaintRuleSnapshot | None = None
    xid_events: tuple[XidEvent, ...] = ()
    kmsg_events: tuple[XidEvent, ...] = ()
    kmsg_overruns: int | None = None
    holder_scan: HolderScan | None = None
    cgroups: CgroupSnapshot | None = None

    def snapshot(
        self, node_name: str, timestamp: float, sources: tuple[SourceStatus, ...]
    ) -> NodeSnapshot:
        # NVML not read at all (its source failed outright): down, with the reason
        nvml = self.nvml or NvmlSnapshot(ok=False, timestamp=timestamp, error="NVML not read")
        return NodeSnapshot(
            node_name=node_name,
            nvml=nvml,
            timestamp=timestamp,
            processes=self.processes,
            pod_resources=self.pod_resources,
            pod_meta=self.pod_meta,
            dcgm=self.dcgm,
            resource_slices=self.resource_slices,
            node_scheduling=self.node_scheduling,
            device_taint_rules=self.device_taint_rules,
            xid_events=self.xid_events,
            kmsg_events=self.kmsg_events,
            kmsg_overruns=self.kmsg_overruns,
            holder_scan=self.holder_scan,
            cgroups=self.cgroups,
            sources=sources,
        )


@dataclass(frozen=True, slots=True)
class XidEvent:
    """One XID the driver raised, from the NVML event set or the kernel log.

    NVML names the GPU (``gpu``/``uuid``); the kernel log only names the PCI bus
    (``pci_bus_id`` as printed, e.g. "0000:3b:00"), so kmsg events carry ``gpu`` and
    ``uuid`` None until analysis resolves the bus id. ``timestamp`` is epoch seconds when
    the exporter received the event; only a kernel-log record that was already in the
    log when it was opened carries the kernel's (approximate) time of it instead.
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
    backlog: bool = False  # kmsg: in the log before the exporter started (history)
    # The same moment on the exporter's monotonic clock (None: not known): windows are
    # measured on it, so a wall-clock step neither ends nor stretches them.
    monotonic: float | None = None


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
    # UUIDs of the GPUs DCGM gave a profiling value for (on any connection to the GPUs it
    # has now): their occupancy source, values or not this cycle
    profiled: tuple[str, ...] = ()
    # True when a GPU outside ``profiled`` is known not to be profiled by DCGM: a few reads
    # on this connection gave it nothing, or profiling is unavailable, or ``auto`` never
    # found DCGM. False (first reads, a named or once-reached host engine down): unknown.
    settled: bool = True
    incidents: tuple[DcgmHealthIncident, ...] = ()
    health: str | None = None


@dataclass(frozen=True, slots=True)
class DeviceHolder:
    """One pid with ``/dev/nvidia<minor>`` open that NVML does not list.

    ``role`` is "holder" (may keep memory alive, e.g. a forked child) or "management"
    (a daemon that opens every GPU without allocating, e.g. nvidia-persistenced).
    """

    pid: int
    minors: tuple[int, ...]
    comm: str | None
    role: HolderRole
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
    gpus: tuple[tuple[int, str, int], ...] = ()  # (gpu, uuid, minor) it was asked to cover
    scanned_pids: int = 0
    unreadable_pids: int = 0  # fd table unreadable (permission): a holder may be missed
    truncated: bool = False  # the time or pid bound was hit
    resume_pid: int | None = None  # where a truncated walk stopped, to go on from
    duration_s: float = 0.0
    error: str | None = None  # the proc root itself could not be listed

    @property
    def complete(self) -> bool:
        return not self.truncated and self.unreadable_pids == 0 and self.error is None
