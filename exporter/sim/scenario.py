"""Scenario files: the simulated node's GPUs, pods, processes and timeline.

A scenario is YAML (schema in docs/simulator.md). Loading validates it completely and
raises ``ScenarioError`` with one line naming the bad key, so ``--simulate`` fails at
start-up, not mid-run. Identifiers a user need not care about (UUIDs, pod UIDs,
container IDs, pids) are derived deterministically when absent, so scenarios stay short
and every run of the same scenario produces the same series.
"""

from __future__ import annotations

import hashlib
import math
import re
import uuid as uuidlib
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from exporter.model import OCCUPANCY_FIELDS
from exporter.sim.churn import Churn, ChurnTimeline
from exporter.sim.events import SimEvent

# The shipped scenarios: every YAML file beside this module (config lists the same folder).
SHIPPED = tuple(sorted(p.stem for p in (Path(__file__).parent / "scenarios").glob("*.yaml")))
# Who allocates the GPUs, and so how the kubelet names them: NVIDIA's device plugin
# (UUIDs), GKE's device plugin (nvidia<minor>...) or NVIDIA's DRA driver (claims).
ALLOCATORS = ("nvidia", "gke", "dra")
API_DATE_ABSENT = "absent"  # node_clock.api_date: the API server sends no Date header
GPM_METRICS = OCCUPANCY_FIELDS  # the keys of a GPU's `gpm:` in a scenario
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "B": 1, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4}
_IUNITS = {"KI": 1024, "MI": 1024**2, "GI": 1024**3, "TI": 1024**4}
NVML_ERROR_CODES = {
    "DRIVER_NOT_LOADED": 9,
    "LIBRARY_NOT_FOUND": 12,
    "NO_PERMISSION": 4,
    "UNKNOWN": 999,
    "GPU_IS_LOST": 15,
    "NOT_SUPPORTED": 3,
    "NO_DATA": 21,
    "INVALID_ARGUMENT": 2,
    "NOT_FOUND": 6,
    "RESET_REQUIRED": 16,  # nvml.h: a GPU that needs a reset (means lost, as GPU_IS_LOST)
    "TIMEOUT": 10,
}
# What a call_errors entry may ``raise``: exceptions from inside the binding, not codes.
PYTHON_ERRORS: dict[str, type[Exception]] = {"TypeError": TypeError, "ValueError": ValueError}
# Entry points newer than some drivers, by the driver branch that added them: a scenario
# whose driver_version is older lacks them (FunctionNotFound), as a real R525 driver does.
# nvmlDeviceGetCurrentClocksEventReasons replaced ...ThrottleReasons in R535 (pynvml
# 12.535.77 is the first nvidia-ml-py to call it; 11.525.150 only has the older name).
ADDED_IN_DRIVER = {"nvmlDeviceGetCurrentClocksEventReasons": 535}
# Field ids newer than some drivers (NVML change log): an older driver answers the entry
# NOT_SUPPORTED. PCIe byte counters came with R555; the per-reason clock-event durations
# with R575, renumbered to 269-271 in R580 (the simulated drivers below 580 lack them).
# The power fields 185/186 first appear in nvidia-ml-py 11.525 (11.515 ends at 160).
FIELDS_ADDED_IN_DRIVER = {185: 525, 186: 525, 197: 555, 198: 555, 269: 580, 270: 580, 271: 580}


class ScenarioError(ValueError):
    """A scenario that cannot be loaded; the message is one line for the operator."""


@dataclass
class SimMig:
    profile: str
    gpu_instance_id: int
    compute_instance_id: int
    memory_total: int
    uuid: str = ""


@dataclass
class SimCallError:
    """An NVML entry point that answers ``error`` from ``start`` until ``until`` (simulated
    seconds; None: for good), on every handle or only on one GPU's (or MIG device's).
    ``delay_s`` makes the call block that many real seconds first (error None: then it
    answers normally), as a driver busy with a GPU in trouble does. ``raises`` makes the
    call raise that Python exception instead of answering, as ctypes does inside pynvml
    when the binding and the library disagree (a call with the wrong number of arguments
    raises TypeError): an answer the binding cannot decode."""

    call: str  # the C symbol, e.g. nvmlDeviceGetCount_v2, nvmlGpmSampleGet
    error: int | None
    gpu: int | None = None
    mig: int | None = None  # index into the GPU's MIG list: calls on that MIG handle only
    start: float = 0.0
    until: float | None = None
    delay_s: float = 0.0
    raises: str | None = None  # a name of PYTHON_ERRORS

    def applies(self, call: str, gpu: int | None, mig: int | None, now: float) -> bool:
        if call != self.call or now < self.start:
            return False
        if self.until is not None and now >= self.until:
            return False
        if self.gpu is not None and gpu != self.gpu:
            return False
        return self.mig is None or mig == self.mig


@dataclass
class SimDuty:
    """A GPU busy in bursts: in each ``period_s`` the first ``busy`` share of it runs its
    processes' SM activity, the rest is idle (utilisation, per-process samples and GPM
    activity 0), as a training loop waiting on its data loader is. Periods start at
    simulated time ``offset_s``."""

    period_s: float
    busy: float
    offset_s: float = 0.0

    def busy_at(self, t: float) -> bool:
        return (t - self.offset_s) % self.period_s < self.busy * self.period_s

    def busy_time(self, start: float, end: float) -> float:
        """Seconds of ``[start, end)`` in the busy part of a period (exact)."""
        return max(0.0, self._busy_before(end) - self._busy_before(start))

    def _busy_before(self, t: float) -> float:
        periods, into = divmod(t - self.offset_s, self.period_s)
        return periods * self.busy * self.period_s + min(into, self.busy * self.period_s)


@dataclass
class SimCgroup:
    """A container's cgroup counters' rates (sim/cgroupfs.py writes them): the share of
    CFS periods throttled, the ``some`` stall of each PSI resource in seconds per second,
    ``full`` as a share of ``some``, and whether the kernel has PSI at all."""

    throttled: float = 0.0
    cpu_pressure: float = 0.0
    io_pressure: float = 0.0
    memory_pressure: float = 0.0
    full: float = 0.5
    psi: bool = True
    periods_per_s: float = 10.0  # the default 100 ms CFS period, tasks always runnable


@dataclass
class SimGpu:
    index: int
    uuid: str
    minor: int  # /dev/nvidia<minor>; follows PCI probe order, so need not be the index
    name: str
    pci_bus_id: str
    memory_total: int
    memory_reserved: int
    unaccounted_memory: int  # used memory no listed process accounts for
    utilization_gpu: int | None  # None: derived from the processes' SM shares
    utilization_memory: int
    temperature: int
    power_mw: int
    power_limit_mw: int
    energy_mj: int
    clock_sm: int
    clock_memory: int
    clock_event_reasons: int
    pcie_replay: int
    ecc_corrected: int
    ecc_uncorrected: int
    remapped_correctable: int
    remapped_uncorrectable: int
    remapped_pending: bool
    remapped_failure: bool
    retired_pages_sbe: int
    retired_pages_dbe: int
    recovery_action: int | None  # NVML_GPU_RECOVERY_ACTION_*; None: field unsupported
    unsupported: set[str]
    lost: bool
    mig: list[SimMig]
    gpm_supported: bool = True
    gpm: dict[str, float] = field(default_factory=dict)  # percent; absent keys derived
    # listings report usedGpuMemory as NVML_VALUE_NOT_AVAILABLE (device memory still counts it)
    process_memory_unavailable: bool = False
    # NVLink: link count (0: none, NOT_SUPPORTED), links down, data rate of each active
    # link, and error counters per link ({link: {crc_flit|crc_data|replay|recovery: n}})
    nvlink_links: int = 0
    nvlink_inactive: list[int] = field(default_factory=list)
    nvlink_tx_bytes_per_s: float = 0.0
    nvlink_rx_bytes_per_s: float = 0.0
    nvlink_errors: dict[int, dict[str, int]] = field(default_factory=dict)
    # PCIe: current generation/width (None: the max while busy; idle, the generation
    # drops to 1 as NVIDIA's power management does), best possible, and traffic
    pcie_generation: int | None = None
    pcie_max_generation: int = 5
    pcie_width: int | None = None
    pcie_max_width: int = 16
    pcie_tx_bytes_per_s: float = 0.0
    pcie_rx_bytes_per_s: float = 0.0
    encoder_utilization: int = 0  # percent
    decoder_utilization: int = 0
    memory_temperature: int | None = None  # None: GPU temperature + 5 (HBM runs warmer)
    fans: list[int] = field(default_factory=list)  # percent per fan; []: no fans
    duty: SimDuty | None = None  # busy in bursts (why-idle); None: always as configured
    # a broken driver's nvmlDeviceGetFieldValues (FIELD_ANSWERS); None: as a driver answers
    field_answers: str | None = None
    # a broken driver's process listings (LISTING_ANSWERS); None: as nvml.h says
    listing_answers: str | None = None
    # the DRA driver's device name for this GPU (and its MIG devices' prefix); None:
    # gpu-<minor>. A timeline set changes it: the driver renumbering after a restart
    dra_name: str | None = None


@dataclass
class SimProcess:
    pid: int
    gpu: int
    memory: int
    sm: int  # per-process SM percent in the driver's sample window
    kind: str  # compute | graphics | mps
    comm: str
    state: str = "S"
    mig: int | None = None  # index into the GPU's MIG list
    alive: bool = True  # False: NVML lists it, /proc does not (killed, memory held)
    listed: bool = True  # False: gone from NVML's listing
    pod: str | None = None  # "namespace/name"
    container: str | None = None
    extra_gpus: list[int] = field(default_factory=list)
    # GPU indices whose /dev/nvidia<minor> it has open; None: the GPUs it runs on
    holds_devices: list[int] | None = None
    # /proc/<pid>/stat field 22, clock ticks after boot: with the pid it names this one
    # process, so a pid reused by a new process shows a new one (SimNode sets it)
    start_time: int = 0


@dataclass
class SimContainer:
    name: str
    container_id: str
    devices: dict[str, list[str]]  # resource name -> device references
    # resource name -> quantity, served as the container's resources.limits (HAMi's
    # nvidia.com/gpumem, nvidia.com/gpumem-percentage, nvidia.com/gpucores)
    limits: dict[str, str] = field(default_factory=dict)
    cgroup: SimCgroup | None = None  # None: the simulated node writes no cgroup files
    # An init container (``init: true``): served in spec.initContainers; the kubelet's
    # PodResources List names only spec.containers, so it is never listed there.
    init: bool = False


@dataclass
class SimPod:
    namespace: str
    name: str
    uid: str
    qos: str
    phase: str
    containers: list[SimContainer]
    deletion_at: float | None = None  # simulated time the API's deletionTimestamp names
    deletion_grace_s: float | None = None  # its deletionGracePeriodSeconds
    owner: tuple[str, str] | None = None  # (kind, name): the controller ownerReference
    labels: dict[str, str] = field(default_factory=dict)  # metadata.labels
    # A static pod (``static: true``): ``uid`` is the kubelet's, the hash of its manifest
    # (cgroups, PodResources), and this is its mirror pod's UID in the API, which carries
    # ``uid`` in the kubernetes.io/config.mirror annotation. None: an API pod.
    mirror_uid: str | None = None

    @property
    def api_uid(self) -> str:
        """The pod's UID as the API server shows it."""
        return self.mirror_uid or self.uid


@dataclass
class SimKernelLog:
    """The simulated /dev/kmsg and /proc/uptime (sim/kernel_log.py).

    printk stamps records with sched_clock, which stops while the machine is suspended
    and is not NTP-disciplined; /proc/uptime is CLOCK_BOOTTIME. ``clock_lag_s`` is how
    far the first is behind the second (time spent suspended, or drift on a long uptime).
    """

    uptime_s: float = 3600.0  # /proc/uptime at simulated time 0
    clock_lag_s: float = 0.0


@dataclass(frozen=True)
class SimNodeClock:
    """The node's wall clock against the API server's (the true time): ``offset_s``
    ahead from the start, plus each ``(at, by)`` step from simulated second ``at`` on
    (NTP stepping it, an operator's ``date -s``). The monotonic clock never steps.
    ``api_date``: the API server's ``Date`` header on every answer: None, its own clock;
    ``API_DATE_ABSENT``, no header at all; any other string, served as it is (garbage,
    or a date far off)."""

    offset_s: float = 0.0
    steps: tuple[tuple[float, float], ...] = ()
    api_date: str | None = None

    def ahead_at(self, at: float) -> float:
        """How far the node's wall clock is ahead of the API server's at ``at``."""
        return self.offset_s + sum(by for step_at, by in self.steps if step_at <= at)


@dataclass
class Scenario:
    name: str
    description: str
    node_name: str
    driver_version: str
    nvml_version: str
    cuda_driver_version: int
    missing_functions: set[str]
    nvml_init_error: int | None
    gpus: list[SimGpu]
    pods: list[SimPod]
    processes: list[SimProcess]
    timeline: Sequence[SimEvent]  # a list, or a churn timeline made on demand (sim/churn.py)
    allocator: str = "nvidia"
    call_errors: list[SimCallError] = field(default_factory=list)
    process_info_layout: str = "v2"  # "r535_early": _v3 listings write 32-byte entries
    # 32: the PCIe byte counter fields come as unsigned int, modulo 2**32 (driver
    # 580.159.04 on an H200 did); 64: unsigned long long
    pcie_counter_bits: int = 64
    kernel_log: SimKernelLog = field(default_factory=SimKernelLog)
    cgroup_version: int = 2  # the node's cgroup hierarchy: /proc/<pid>/cgroup and the tree
    node_clock: SimNodeClock = field(default_factory=SimNodeClock)
    # False: the kubelet's KubeletPodResourcesDynamicResources gate is off (its default
    # through 1.33): List reports no dynamic_resources, though pods have claims
    kubelet_reports_claims: bool = True
    # the container's NVML enumerates no GPU (nvmlDeviceGetCount 0) while the kubelet
    # still advertises the node's: an unprivileged pod on a container toolkit with
    # accept-nvidia-visible-devices-envvar-when-unprivileged = false gets no device nodes
    nvml_sees_no_gpu: bool = False
    # a cost profile (sim/cost_model.py): each NVML call spends what it costs on that
    # hardware; None: Python's cost only. `python -m exporter.sim --cost` overrides it
    cost: str | None = None

    @property
    def has_cgroups(self) -> bool:
        """Whether any container has a ``cgroup:`` key (only then is there a tree)."""
        return any(c.cgroup is not None for pod in self.pods for c in pod.containers)

    def __post_init__(self) -> None:
        if self.process_info_layout == "r535_early":  # 535.104.05 added it (nvml.h)
            self.missing_functions.add("nvmlDeviceGetRunningProcessDetailList")


def parse_size(value: object, where: str) -> int:
    """Accept ints (bytes) and strings like ``80GiB`` or ``512 MiB``."""
    if isinstance(value, bool):
        raise ScenarioError(f"{where}: expected a size, got {value!r}")
    if isinstance(value, int):
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ScenarioError(f"{where}: {value!r} is not a size (use bytes or e.g. 80GiB)")
    unit = (match.group(2) or "").upper().rstrip("B")
    factor = _IUNITS.get(unit) or _UNITS.get(unit)
    if factor is None:
        raise ScenarioError(f"{where}: unknown unit in {value!r}")
    return int(float(match.group(1)) * factor)


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()


def derived_uuid(*parts: object) -> str:
    return str(uuidlib.UUID(bytes=_digest(*parts)[:16]))


def derived_container_id(*parts: object) -> str:
    return _digest("container", *parts).hex()


_GPU_DEFAULTS: dict[str, Any] = {
    "name": "NVIDIA H100 80GB HBM3",
    "memory_total": "80GiB",
    "memory_reserved": "512MiB",
    "unaccounted_memory": 0,
    "utilization_gpu": None,
    "utilization_memory": 0,
    "temperature": 40,
    "power_mw": 70_000,
    "power_limit_mw": 700_000,
    "energy_mj": 1_000_000,
    "clock_sm": 1980,
    "clock_memory": 2619,
    "clock_event_reasons": 0,
    "pcie_replay": 0,
    "ecc_corrected": 0,
    "ecc_uncorrected": 0,
    "remapped_correctable": 0,
    "remapped_uncorrectable": 0,
    "remapped_pending": False,
    "remapped_failure": False,
    "retired_pages_sbe": 0,
    "retired_pages_dbe": 0,
    "recovery_action": 0,
    "unsupported": [],
    "lost": False,
    "mig": [],
    "gpm_supported": True,
    "gpm": {},
    "process_memory_unavailable": False,
    "nvlink_links": 0,
    "nvlink_inactive": [],
    "nvlink_tx_bytes_per_s": 0.0,
    "nvlink_rx_bytes_per_s": 0.0,
    "nvlink_errors": {},
    "pcie_generation": None,
    "pcie_max_generation": 5,
    "pcie_width": None,
    "pcie_max_width": 16,
    "pcie_tx_bytes_per_s": 0.0,
    "pcie_rx_bytes_per_s": 0.0,
    "encoder_utilization": 0,
    "decoder_utilization": 0,
    "memory_temperature": None,
    "fans": [],
    "duty": None,
    "field_answers": None,
    "listing_answers": None,
    "dra_name": None,
}
# How a broken driver can answer nvmlDeviceGetFieldValues: every value a NaN or an
# infinite double, an unknown nvmlValueType_t, the answers in reverse order (each
# entry's fieldId/scopeId naming the field it answers, as nvmlFieldValue_t carries them),
# no entry written at all, or each entry's return code written but not its type or value.
FIELD_ANSWERS = ("nan", "inf", "unknown_type", "reversed", "unwritten", "code_only")
# How a broken driver can answer a process listing whose array is too small: success with
# the true count, only what fits written (nvml.h: NVML_ERROR_INSUFFICIENT_SIZE).
LISTING_ANSWERS = ("cut_short",)
NVLINK_ERROR_TYPES = ("crc_flit", "crc_data", "replay", "recovery")
_SIZE_KEYS = {"memory_total", "memory_reserved", "unaccounted_memory"}
_TIMELINE_ACTIONS = {
    "start",
    "exit",
    "kill",
    "orphan",
    "set",
    "set_process",
    "xid",
    "lose",
    "restore",
    "delete_pod",
    "set_pod_phase",
    "add_pod",
    "fork_orphan",
    "terminate_pod",
    "kmsg_overrun",
    "kubelet_restart",
    "node",
}


def _expect_mapping(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ScenarioError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _check_keys(data: dict[str, Any], allowed: set[str], where: str) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ScenarioError(f"{where}: unknown key {unknown[0]!r} (allowed: {sorted(allowed)})")


def _gpu(data: dict[str, Any], index: int, defaults: dict[str, Any], node: str) -> SimGpu:
    where = f"gpus[{index}]"
    _check_keys(data, set(_GPU_DEFAULTS) | {"uuid", "pci_bus_id", "minor"}, where)
    merged = {**_GPU_DEFAULTS, **defaults, **data}
    minor = merged.pop("minor", index)
    if not isinstance(minor, int) or isinstance(minor, bool) or not 0 <= minor < 256:
        raise ScenarioError(f"{where}.minor: {minor!r} is not a device minor (0..255)")
    for key in _SIZE_KEYS:
        merged[key] = parse_size(merged[key], f"{where}.{key}")
    uuid = merged.pop("uuid", None) or f"GPU-{derived_uuid(node, 'gpu', index)}"
    bus = merged.pop("pci_bus_id", None) or f"00000000:{0x18 + 0x10 * index:02X}:00.0"
    migs = parse_migs(merged.pop("mig") or [], where, (node, "mig", index))
    merged["unsupported"] = set(merged["unsupported"] or [])
    if merged["field_answers"] not in (None, *FIELD_ANSWERS):
        raise ScenarioError(
            f"{where}.field_answers: {merged['field_answers']!r} is not one of {FIELD_ANSWERS}"
        )
    if merged["listing_answers"] not in (None, *LISTING_ANSWERS):
        raise ScenarioError(
            f"{where}.listing_answers: {merged['listing_answers']!r} is not one of "
            f"{LISTING_ANSWERS}"
        )
    if not isinstance(merged["process_memory_unavailable"], bool):
        raise ScenarioError(f"{where}.process_memory_unavailable: expected true or false")
    merged["gpm"] = {str(k): float(v) for k, v in (merged["gpm"] or {}).items()}
    unknown_gpm = sorted(set(merged["gpm"]) - set(GPM_METRICS))
    if unknown_gpm:
        raise ScenarioError(
            f"{where}.gpm: unknown metric {unknown_gpm[0]!r} (known: {', '.join(GPM_METRICS)})"
        )
    _check_links(merged, where)
    return SimGpu(index=index, uuid=uuid, minor=minor, pci_bus_id=bus, mig=migs, **merged)


def parse_migs(raw: Any, where: str, uuid_parts: tuple[object, ...]) -> list[SimMig]:
    """A GPU's ``mig:`` list (at start, or a timeline ``set`` that reconfigures it); an
    instance without a ``uuid`` gets one derived from ``uuid_parts`` and its slot."""
    if not isinstance(raw, list):
        raise ScenarioError(f"{where}.mig: expected a list of MIG instances")
    migs = []
    for m, item in enumerate(raw):
        mig = _expect_mapping(item, f"{where}.mig[{m}]")
        _check_keys(
            mig,
            {"profile", "gpu_instance_id", "compute_instance_id", "memory_total", "uuid"},
            f"{where}.mig[{m}]",
        )
        migs.append(
            SimMig(
                profile=str(mig.get("profile", "1g.10gb")),
                gpu_instance_id=int(mig.get("gpu_instance_id", m + 1)),
                compute_instance_id=int(mig.get("compute_instance_id", 0)),
                memory_total=parse_size(
                    mig.get("memory_total", "10GiB"), f"{where}.mig[{m}].memory_total"
                ),
                uuid=str(mig.get("uuid") or f"MIG-{derived_uuid(*uuid_parts, m)}"),
            )
        )
    return migs


def _check_links(gpu: dict[str, Any], where: str) -> None:
    """NVLink and PCIe keys: link indices within the GPU's links, known error types,
    a current link no better than the best one."""
    links = gpu["nvlink_links"]
    if not isinstance(links, int) or isinstance(links, bool) or not 0 <= links <= 36:
        raise ScenarioError(f"{where}.nvlink_links: {links!r} is not a link count (0..36)")
    for link in gpu["nvlink_inactive"] or []:
        if not isinstance(link, int) or not 0 <= link < links:
            raise ScenarioError(f"{where}.nvlink_inactive: {link!r} is not one of its links")
    errors = _expect_mapping(gpu["nvlink_errors"] or {}, f"{where}.nvlink_errors")
    for link, counts in errors.items():
        if not isinstance(link, int) or not 0 <= link < links:
            raise ScenarioError(f"{where}.nvlink_errors: {link!r} is not one of its links")
        _check_keys(
            _expect_mapping(counts, f"{where}.nvlink_errors[{link}]"),
            set(NVLINK_ERROR_TYPES),
            f"{where}.nvlink_errors[{link}]",
        )
    gpu["nvlink_inactive"] = list(gpu["nvlink_inactive"] or [])
    gpu["nvlink_errors"] = {
        int(k): {str(t): int(n) for t, n in v.items()} for k, v in errors.items()
    }
    for now, best in (("pcie_generation", "pcie_max_generation"), ("pcie_width", "pcie_max_width")):
        if gpu[now] is not None and not 1 <= gpu[now] <= gpu[best]:
            raise ScenarioError(f"{where}.{now}: {gpu[now]!r} is not between 1 and {best}")
    gpu["fans"] = [int(f) for f in gpu["fans"] or []]
    gpu["duty"] = _duty(gpu["duty"], f"{where}.duty")


def _duty(value: object, where: str) -> SimDuty | None:
    """``{period_s: 50, busy: 0.4[, offset_s: 0]}``: busy 40 % of every 50 s."""
    if value is None:
        return None
    data = _expect_mapping(value, where)
    _check_keys(data, {"period_s", "busy", "offset_s"}, where)
    period, busy = data.get("period_s"), data.get("busy")
    offset = data.get("offset_s", 0.0)
    if not _number(period) or not period > 0:  # type: ignore[operator]
        raise ScenarioError(f"{where}.period_s: {period!r} is not a number of seconds > 0")
    if not _number(busy) or not 0 <= busy <= 1:  # type: ignore[operator]
        raise ScenarioError(f"{where}.busy: {busy!r} is not a share between 0 and 1")
    if not _number(offset):
        raise ScenarioError(f"{where}.offset_s: {offset!r} is not a number of seconds")
    return SimDuty(float(period), float(busy), float(offset))  # type: ignore[arg-type]


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


_CGROUP_SHARES = ("throttled", "cpu_pressure", "io_pressure", "memory_pressure", "full")


def _cgroup(value: object, where: str) -> SimCgroup | None:
    """A container's ``cgroup:`` key (docs/simulator.md): shares 0..1, ``psi`` a boolean,
    ``periods_per_s`` > 0."""
    if value is None:
        return None
    data = _expect_mapping(value, where)
    _check_keys(data, {*_CGROUP_SHARES, "psi", "periods_per_s"}, where)
    for key in _CGROUP_SHARES:
        share = data.get(key, 0.0)
        if not _number(share) or not 0 <= share <= 1:
            raise ScenarioError(f"{where}.{key}: {share!r} is not a share between 0 and 1")
    if not isinstance(data.get("psi", True), bool):
        raise ScenarioError(f"{where}.psi: expected true or false")
    periods = data.get("periods_per_s", 10.0)
    if not _number(periods) or not 0 < periods <= 1000:
        raise ScenarioError(f"{where}.periods_per_s: {periods!r} is not above 0 and <= 1000")
    return SimCgroup(
        **{key: float(data[key]) for key in _CGROUP_SHARES if key in data},
        psi=bool(data.get("psi", True)),
        periods_per_s=float(periods),
    )


def _process(
    data: dict[str, Any],
    where: str,
    pid: int,
    pod: str | None,
    container: str | None,
    gpu_count: int,
) -> SimProcess:
    _check_keys(
        data,
        {
            "pid",
            "gpu",
            "mig",
            "memory",
            "sm",
            "kind",
            "comm",
            "state",
            "alive",
            "listed",
            "extra_gpus",
            "holds_devices",
        },
        where,
    )
    gpu = data.get("gpu")
    if not isinstance(gpu, int) or not 0 <= gpu < gpu_count:
        raise ScenarioError(f"{where}.gpu: {gpu!r} is not a GPU index (0..{gpu_count - 1})")
    kind = str(data.get("kind", "compute"))
    if kind not in {"compute", "graphics", "mps"}:
        raise ScenarioError(f"{where}.kind: {kind!r} is not compute, graphics or mps")
    return SimProcess(
        pid=int(data.get("pid", pid)),
        gpu=gpu,
        mig=data.get("mig"),
        memory=parse_size(data.get("memory", 0), f"{where}.memory"),
        sm=int(data.get("sm", 0)),
        kind=kind,
        comm=str(data.get("comm", "python3")),
        state=str(data.get("state", "S")),
        alive=bool(data.get("alive", True)),
        listed=bool(data.get("listed", True)),
        pod=pod,
        container=container,
        extra_gpus=[int(g) for g in data.get("extra_gpus", [])],
        holds_devices=_holds_devices(data.get("holds_devices", True), where, gpu_count),
    )


def _holds_devices(value: object, where: str, gpu_count: int) -> list[int] | None:
    """``true`` (its own GPUs), ``false``, ``all`` or a list of GPU indices."""
    if value is True:
        return None
    if value is False:
        return []
    if value == "all":
        return list(range(gpu_count))
    if isinstance(value, list) and all(
        isinstance(g, int) and not isinstance(g, bool) and 0 <= g < gpu_count for g in value
    ):
        return [int(g) for g in value]
    raise ScenarioError(
        f"{where}.holds_devices: {value!r} is not true, false, all or a list of GPU indices"
    )


class _Pids:
    def __init__(self) -> None:
        self.next = 20_000

    def take(self) -> int:
        self.next += 7
        return self.next


def _pod(
    data: dict[str, Any],
    where: str,
    node: str,
    gpu_count: int,
    pids: _Pids,
    processes: list[SimProcess],
) -> SimPod:
    _check_keys(
        data,
        {"namespace", "name", "uid", "qos", "phase", "containers", "owner", "labels", "static"},
        where,
    )
    namespace = str(data.get("namespace", "default"))
    name = data.get("name")
    if not name:
        raise ScenarioError(f"{where}.name: a pod needs a name")
    key = f"{namespace}/{name}"
    containers = []
    for c, raw in enumerate(data.get("containers") or []):
        cwhere = f"{where}.containers[{c}]"
        cont = _expect_mapping(raw, cwhere)
        _check_keys(
            cont, {"name", "id", "devices", "limits", "processes", "cgroup", "init"}, cwhere
        )
        cname = str(cont.get("name", f"c{c}"))
        devices = {str(k): [str(d) for d in v] for k, v in (cont.get("devices") or {}).items()}
        containers.append(
            SimContainer(
                cname,
                str(cont.get("id") or derived_container_id(node, key, cname)),
                devices,
                _limits(cont.get("limits"), f"{cwhere}.limits"),
                _cgroup(cont.get("cgroup"), f"{cwhere}.cgroup"),
                init=cont.get("init") is True,
            )
        )
        for p, praw in enumerate(cont.get("processes") or []):
            pwhere = f"{cwhere}.processes[{p}]"
            processes.append(
                _process(_expect_mapping(praw, pwhere), pwhere, pids.take(), key, cname, gpu_count)
            )
    static = data.get("static", False)
    if not isinstance(static, bool):
        raise ScenarioError(f"{where}.static: true or false")
    return SimPod(
        namespace=namespace,
        name=str(name),
        # a static pod's UID is the kubelet's md5 of its manifest: 32 hex digits
        uid=str(
            data.get("uid")
            or (
                _digest(node, "static", key)[:16].hex()
                if static
                else derived_uuid(node, "pod", key)
            )
        ),
        mirror_uid=derived_uuid(node, "mirror", key) if static else None,
        qos=str(data.get("qos", "burstable")),
        phase=str(data.get("phase", "Running")),
        containers=containers,
        owner=_owner(data.get("owner"), f"{where}.owner"),
        labels=_labels(data.get("labels"), f"{where}.labels"),
    )


def _owner(value: object, where: str) -> tuple[str, str] | None:
    """``{kind: ReplicaSet, name: web-5d8f7c9b4f}``: the pod's controller reference."""
    if value is None:
        return None
    data = _expect_mapping(value, where)
    _check_keys(data, {"kind", "name"}, where)
    kind, name = data.get("kind"), data.get("name")
    if not isinstance(kind, str) or not kind or not isinstance(name, str) or not name:
        raise ScenarioError(f"{where}: an owner needs a kind and a name (e.g. kind: Job, name: x)")
    return kind, name


def _labels(value: object, where: str) -> dict[str, str]:
    """``{pod-template-hash: 5d8f7c9b4f}``: the pod's metadata.labels."""
    if value is None:
        return {}
    return {str(k): str(v) for k, v in _expect_mapping(value, where).items()}


def _limits(value: object, where: str) -> dict[str, str]:
    """``{resource: quantity}``, e.g. ``{nvidia.com/gpumem: 10240}`` (HAMi: MiB)."""
    if value is None:
        return {}
    return {str(k): str(v) for k, v in _expect_mapping(value, where).items()}


def _event(raw: object, i: int) -> SimEvent:
    data = _expect_mapping(raw, f"timeline[{i}]")
    if "at" not in data:
        raise ScenarioError(f"timeline[{i}]: every event needs 'at' (seconds after start)")
    actions = sorted(set(data) - {"at"})
    if len(actions) != 1 or actions[0] not in _TIMELINE_ACTIONS:
        raise ScenarioError(
            f"timeline[{i}]: expected exactly one action of {sorted(_TIMELINE_ACTIONS)}, "
            f"got {actions}"
        )
    value = data[actions[0]]
    if actions[0] == "kmsg_overrun":
        _check_overrun(value, float(data["at"]), f"timeline[{i}]")
    if actions[0] == "fork_orphan":
        _check_fork(value, f"timeline[{i}].fork_orphan")
    if actions[0] == "node":
        _check_node(value, f"timeline[{i}].node")
    args = value if isinstance(value, dict) else {"value": value}
    if actions[0] == "add_pod":
        args = _added_pod_cgroups(args, f"timeline[{i}].add_pod")
    return SimEvent(at=float(data["at"]), action=actions[0], args=dict(args))


def _added_pod_cgroups(args: dict[str, Any], where: str) -> dict[str, Any]:
    """``add_pod``'s containers with their ``cgroup:`` keys parsed (as a scenario pod's
    are), so a pod added later gets a cgroup directory too."""
    containers = args.get("containers")
    if not isinstance(containers, list):
        return args
    parsed = [
        {**c, "cgroup": _cgroup(c.get("cgroup"), f"{where}.containers[{j}].cgroup")}
        if isinstance(c, dict)
        else c
        for j, c in enumerate(containers)
    ]
    return {**args, "containers": parsed}


def _check_fork(value: object, where: str) -> None:
    """``fork_orphan: {pid, child_pid, comm, parent_listed}``: ``pid`` is required;
    ``parent_listed`` is true or false (whether the driver keeps listing the dead parent)."""
    data = _expect_mapping(value, where)
    _check_keys(data, {"pid", "child_pid", "comm", "parent_listed"}, where)
    if "pid" not in data:
        raise ScenarioError(f"{where}: needs 'pid' (the parent that dies after forking)")
    if not isinstance(data.get("parent_listed", False), bool):
        raise ScenarioError(
            f"{where}.parent_listed: {data['parent_listed']!r} is not true or false"
        )


def _check_node(value: object, where: str) -> None:
    """``node: {unschedulable, taints, labels}``: what ``kubectl cordon``, ``kubectl taint``
    and ``kubectl label`` (or the GPU Operator) change on the Node. ``taints`` replaces
    the list ({key, value, effect} each); a label set to null is removed."""
    data = _expect_mapping(value, where)
    _check_keys(data, {"unschedulable", "taints", "labels"}, where)
    if "unschedulable" in data and not isinstance(data["unschedulable"], bool):
        raise ScenarioError(
            f"{where}.unschedulable: {data['unschedulable']!r} is not true or false"
        )
    taints = data.get("taints", [])
    if not isinstance(taints, list):
        raise ScenarioError(f"{where}.taints: expected a list of {{key, value, effect}}")
    for j, taint in enumerate(taints):
        t = _expect_mapping(taint, f"{where}.taints[{j}]")
        _check_keys(t, {"key", "value", "effect"}, f"{where}.taints[{j}]")
        if t.get("effect") not in ("NoSchedule", "PreferNoSchedule", "NoExecute"):
            raise ScenarioError(
                f"{where}.taints[{j}].effect: {t.get('effect')!r} is not NoSchedule, "
                "PreferNoSchedule or NoExecute"
            )
    _expect_mapping(data.get("labels", {}), f"{where}.labels")


def _check_overrun(value: object, at: float, where: str) -> None:
    """``kmsg_overrun: N``: N records overwritten in the kernel log while the reader was
    behind, so only after the exporter started (a ring loses its oldest records first,
    never some in the middle of what a reader reads at start)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ScenarioError(f"{where}.kmsg_overrun: {value!r} is not a number of records >= 1")
    if at <= 0:
        raise ScenarioError(f"{where}.kmsg_overrun: 'at' must be after start (> 0), got {at:g}")


def parse_scenario(data: object, name: str) -> Scenario:
    root = _expect_mapping(data, name)
    _check_keys(
        root,
        {
            "description",
            "node_name",
            "allocator",
            "driver_version",
            "nvml_version",
            "cuda_driver_version",
            "missing_functions",
            "nvml_init_error",
            "process_info_layout",
            "pcie_counter_bits",
            "call_errors",
            "gpu_defaults",
            "gpus",
            "pods",
            "host_processes",
            "timeline",
            "churn",
            "kernel_log",
            "cgroup_version",
            "node_clock",
            "kubelet_reports_claims",
            "nvml_sees_no_gpu",
            "cost",
        },
        name,
    )
    node = str(root.get("node_name", "sim-node"))
    allocator = root.get("allocator", "nvidia")
    if allocator not in ALLOCATORS:
        raise ScenarioError(f"allocator: {allocator!r} is not one of {', '.join(ALLOCATORS)}")
    init_error = root.get("nvml_init_error")
    if init_error is not None and init_error not in NVML_ERROR_CODES:
        raise ScenarioError(
            f"nvml_init_error: {init_error!r} is not one of {sorted(NVML_ERROR_CODES)}"
        )
    defaults = _expect_mapping(root.get("gpu_defaults") or {}, "gpu_defaults")
    _check_keys(defaults, set(_GPU_DEFAULTS), "gpu_defaults")
    gpus = [
        _gpu(_expect_mapping(g, f"gpus[{i}]"), i, defaults, node)
        for i, g in enumerate(root.get("gpus") or [])
    ]
    pids = _Pids()
    processes: list[SimProcess] = []
    pods = [
        _pod(_expect_mapping(p, f"pods[{i}]"), f"pods[{i}]", node, len(gpus), pids, processes)
        for i, p in enumerate(root.get("pods") or [])
    ]
    for i, raw in enumerate(root.get("host_processes") or []):
        where = f"host_processes[{i}]"
        processes.append(
            _process(_expect_mapping(raw, where), where, pids.take(), None, None, len(gpus))
        )
    minors: dict[int, int] = {}
    for gpu in gpus:
        if gpu.minor in minors:
            raise ScenarioError(
                f"gpus[{gpu.index}].minor: {gpu.minor} is already GPU {minors[gpu.minor]}'s minor"
            )
        minors[gpu.minor] = gpu.index
    seen: set[int] = set()
    for proc in processes:
        if proc.pid in seen:
            raise ScenarioError(f"pid {proc.pid} is used twice")
        seen.add(proc.pid)
        gpu = gpus[proc.gpu]
        if proc.mig is not None and not 0 <= proc.mig < len(gpu.mig):
            raise ScenarioError(f"pid {proc.pid}: GPU {proc.gpu} has no MIG instance {proc.mig}")
    timeline: Sequence[SimEvent] = sorted(
        (_event(e, i) for i, e in enumerate(root.get("timeline") or [])), key=lambda e: e.at
    )
    if root.get("churn") is not None:
        timeline = _churn_timeline(root["churn"], timeline, processes, len(gpus))
    driver_version = str(root.get("driver_version", "550.90.07"))
    return Scenario(
        name=name,
        description=str(root.get("description", "")),
        node_name=node,
        driver_version=driver_version,
        nvml_version=str(root.get("nvml_version", "12.550.90.07")),
        cuda_driver_version=int(root.get("cuda_driver_version", 12040)),
        missing_functions=set(root.get("missing_functions") or []) | _newer_than(driver_version),
        nvml_init_error=NVML_ERROR_CODES[init_error] if init_error else None,
        gpus=gpus,
        pods=pods,
        processes=processes,
        timeline=timeline,
        allocator=str(allocator),
        process_info_layout=_process_info_layout(root.get("process_info_layout", "v2")),
        pcie_counter_bits=_pcie_counter_bits(root.get("pcie_counter_bits", 64)),
        call_errors=[
            _call_error(_expect_mapping(e, f"call_errors[{i}]"), f"call_errors[{i}]", gpus)
            for i, e in enumerate(root.get("call_errors") or [])
        ],
        kernel_log=_kernel_log(root.get("kernel_log") or {}, timeline),
        cgroup_version=_cgroup_version(root.get("cgroup_version", 2)),
        node_clock=_node_clock(root.get("node_clock") or {}),
        kubelet_reports_claims=root.get("kubelet_reports_claims", True) is not False,
        nvml_sees_no_gpu=root.get("nvml_sees_no_gpu", False) is True,
        cost=_cost(root.get("cost")),
    )


def _cost(value: object) -> str | None:
    """``cost: h200``: a profile of exporter/sim/cost_model.py; absent or ``none``: none."""
    from exporter.sim.cost_model import NO_COST, CostProfileError, check_name

    if value is None:
        return None
    if not isinstance(value, str):
        raise ScenarioError(f"cost: {value!r} is not a cost profile's name")
    try:
        return None if check_name(value) == NO_COST else value
    except CostProfileError as exc:
        raise ScenarioError(str(exc)) from None


def _seconds(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ScenarioError(f"{where}: {value!r} is not a number of seconds")
    return float(value)


def _node_clock(raw: object) -> SimNodeClock:
    """``{offset_s: 180, steps: [{at: 20, by: 7220}], api_date: absent}``: the node's
    wall clock, and the API server's ``Date`` header."""
    data = _expect_mapping(raw, "node_clock")
    _check_keys(data, {"offset_s", "steps", "api_date"}, "node_clock")
    api_date = data.get("api_date")
    if api_date is not None and not isinstance(api_date, str):
        raise ScenarioError(f"node_clock.api_date: {api_date!r} is not a string")
    steps = []
    for i, item in enumerate(data.get("steps") or []):
        where = f"node_clock.steps[{i}]"
        step = _expect_mapping(item, where)
        _check_keys(step, {"at", "by"}, where)
        steps.append(
            (_seconds(step.get("at"), f"{where}.at"), _seconds(step.get("by"), f"{where}.by"))
        )
    return SimNodeClock(
        _seconds(data.get("offset_s", 0.0), "node_clock.offset_s"), tuple(steps), api_date
    )


def _cgroup_version(value: object) -> int:
    """The node's cgroup version: 2 (unified) or 1 (legacy: cpu.stat only, no PSI)."""
    if value not in (1, 2) or isinstance(value, bool):
        raise ScenarioError(f"cgroup_version: {value!r} is not 1 or 2")
    return int(value)


PROCESS_INFO_LAYOUTS = ("v2", "r535_early")


def _pcie_counter_bits(value: object) -> int:
    """How wide the driver answers the PCIe byte counter fields: 64 or 32 bits."""
    if value not in (32, 64) or isinstance(value, bool):
        raise ScenarioError(f"pcie_counter_bits: {value!r} is not 32 or 64")
    return int(value)


def _churn_timeline(
    raw: object, timeline: Sequence[SimEvent], processes: list[SimProcess], gpu_count: int
) -> ChurnTimeline:
    """The timeline with churn (sim/churn.py) made on demand, one second at a time."""
    data = _expect_mapping(raw, "churn")
    names = {f.name for f in fields(Churn)}
    _check_keys(data, names, "churn")
    if "seconds" not in data:
        raise ScenarioError("churn: 'seconds' (how long churn goes on) is required")
    text = {"job_resource", "job_device"}
    values: dict[str, Any] = {k: str(v) if k in text else int(v) for k, v in data.items()}
    churn = Churn(**values)
    for key in ("job_gpu", "gpu_flap"):
        if not 0 <= getattr(churn, key) < gpu_count:
            raise ScenarioError(f"churn.{key}: the node has no GPU {getattr(churn, key)}")
    hosts = sorted(
        {(p.pod, p.container, p.gpu) for p in processes if p.pod and p.container and p.mig is None}
    )
    try:
        return ChurnTimeline(timeline, churn, hosts)
    except ValueError as exc:
        raise ScenarioError(str(exc)) from None


def _process_info_layout(value: object) -> str:
    """How the driver's ``_v3`` process listings lay out an entry (docs/simulator.md)."""
    if value not in PROCESS_INFO_LAYOUTS:
        raise ScenarioError(
            f"process_info_layout: {value!r} is not one of {', '.join(PROCESS_INFO_LAYOUTS)}"
        )
    return str(value)


def _newer_than(driver_version: str) -> set[str]:
    """Entry points the scenario's driver branch predates."""
    try:
        branch = int(driver_version.split(".")[0])
    except ValueError as exc:
        raise ScenarioError(f"driver_version: {driver_version!r} is not like 550.90.07") from exc
    return {name for name, added in ADDED_IN_DRIVER.items() if branch < added}


def _call_error(data: dict[str, Any], where: str, gpus: list[SimGpu]) -> SimCallError:
    _check_keys(data, {"call", "error", "gpu", "mig", "from", "until", "delay_s", "raise"}, where)
    if not data.get("call"):
        raise ScenarioError(f"{where}.call: name the NVML entry point, e.g. nvmlGpmSampleGet")
    error, delay, raises = data.get("error"), data.get("delay_s", 0.0), data.get("raise")
    if isinstance(delay, bool) or not isinstance(delay, int | float) or delay < 0:
        raise ScenarioError(f"{where}.delay_s: {delay!r} is not a number of seconds >= 0")
    if raises is not None and (raises not in PYTHON_ERRORS or error is not None):
        raise ScenarioError(
            f"{where}.raise: {raises!r} is not one of {sorted(PYTHON_ERRORS)} (without error)"
        )
    if error not in NVML_ERROR_CODES and not (error is None and (delay > 0 or raises)):
        raise ScenarioError(f"{where}.error: {error!r} is not one of {sorted(NVML_ERROR_CODES)}")
    gpu, mig = data.get("gpu"), data.get("mig")
    if gpu is not None and not (isinstance(gpu, int) and 0 <= gpu < len(gpus)):
        raise ScenarioError(f"{where}.gpu: {gpu!r} is not a GPU index")
    if mig is not None and (
        gpu is None or not (isinstance(mig, int) and 0 <= mig < len(gpus[gpu].mig))
    ):
        raise ScenarioError(f"{where}.mig: {mig!r} is not a MIG instance of the GPU named by gpu")
    until = data.get("until")
    return SimCallError(
        call=str(data["call"]),
        error=None if error is None else NVML_ERROR_CODES[error],
        gpu=gpu,
        mig=mig,
        start=float(data.get("from", 0.0)),
        until=None if until is None else float(until),
        delay_s=float(delay),
        raises=None if raises is None else str(raises),
    )


def _kernel_log(raw: object, timeline: Sequence[SimEvent]) -> SimKernelLog:
    data = _expect_mapping(raw, "kernel_log")
    _check_keys(data, {"uptime_s", "clock_lag_s"}, "kernel_log")
    values: dict[str, float] = {}
    for key in ("uptime_s", "clock_lag_s"):
        value = data.get(key, getattr(SimKernelLog, key))
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise ScenarioError(f"kernel_log.{key}: {value!r} is not a number of seconds >= 0")
        values[key] = float(value)
    log = SimKernelLog(**values)
    first = min((e.at for e in timeline if e.action == "xid"), default=0.0)
    if log.uptime_s + min(first, 0.0) - log.clock_lag_s < 0:
        raise ScenarioError(
            "kernel_log: the earliest XID would be logged before boot "
            "(raise uptime_s, or lower clock_lag_s)"
        )
    return log


def load_scenario(name_or_path: str) -> Scenario:
    """Load a shipped scenario by name, or a YAML file by path."""
    if name_or_path in SHIPPED:
        text = resources.files("exporter.sim").joinpath(f"scenarios/{name_or_path}.yaml")
        source = text.read_text(encoding="utf-8")
        name = name_or_path
    else:
        path = Path(name_or_path)
        try:
            source = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise ScenarioError(
                f"cannot read scenario {name_or_path!r}: {exc.strerror or exc}; "
                f"use a file path or one of {', '.join(SHIPPED)}"
            ) from exc
        name = path.stem
    try:
        data = yaml.safe_load(source)
    except yaml.YAMLError as exc:
        line = getattr(getattr(exc, "problem_mark", None), "line", None)
        at = f" at line {line + 1}" if line is not None else ""
        raise ScenarioError(f"scenario {name!r} is not valid YAML{at}") from exc
    try:
        return parse_scenario(data, name)
    except ScenarioError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as exc:
        # a value of the wrong kind somewhere the checks above do not name (e.g. sm: lots)
        raise ScenarioError(f"scenario {name!r}: invalid value: {exc}") from exc
