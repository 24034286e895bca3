"""NVML source: one blocking ``sample()`` per cycle, run in a worker thread.

Failure isolation is the point of this file:
- a query the GPU or driver does not support (NotSupported, FunctionNotFound) gives
  ``None``, which exposition turns into *no series*, never a zero;
- any other failed query (NoPermission above all: an unprivileged container, MIG
  without monitoring rights, GPM after a while) also gives ``None`` but is counted as
  an error and asked again next cycle (GPM: with backoff), never switched off;
- a MIG device whose handle or identity cannot be read is left out and counted; its
  GPU carries on;
- a GPU that fails as a whole (GpuIsLost, ResetRequired, Unknown, NoPermission at open,
  an exception in the binding) becomes a ``GpuSample`` with ``error`` set, and the other
  GPUs carry on; only GpuIsLost and ResetRequired set ``lost`` (hardware evidence), any
  other failure leaves the GPU's health unknown (nvml_codes.GPU_LOST);
- NVML that cannot initialise at all, or cannot count its GPUs, gives
  ``NvmlSnapshot(ok=False)``; initialisation is retried with backoff on later cycles,
  so a driver that comes up late is picked up.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeVar

import pynvml

from exporter.model import (
    ActiveWindow,
    GpuProcess,
    GpuSample,
    MigInstance,
    MigProfileInfo,
    NvmlSnapshot,
    Occupancy,
    OccupancyField,
    ProcessKind,
    ProcessUtilization,
    Readings,
    RemappedRows,
    SourceName,
    SourceStatus,
    placeholder_uuid,
)
from exporter.sources import nvml_fields, nvml_links, nvml_sample_reads, nvml_samples
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle, Source
from exporter.sources.nvml_cadence import REREAD_XIDS, SlowSchedule, normalize_bus_id, offset
from exporter.sources.nvml_codes import (
    GPU_FAILED,
    GPU_LOST,
    UNSUPPORTED,
    error_name,
    instance_id,
    number_field,
    set_number_field,
)
from exporter.sources.nvml_listing import ListedProcess, ProcessLister
from exporter.sources.nvml_mig_profiles import ProfileCache

log = logging.getLogger(__name__)
# What NVML answers on a MIG device handle whose instance was destroyed meanwhile.
_STALE_HANDLE = frozenset({"InvalidArgument", "NotFound"})
T = TypeVar("T")

SAMPLE_REUSE_S = 10.0  # how long per-process samples stand in for missing new ones
# nvmlValueType_t -> the member of the sample's value union holding it (nvml.h)
_VALUE_MEMBERS = ("dVal", "uiVal", "ulVal", "ullVal", "sllVal", "siVal", "usVal")
_GPU_FAILED = GPU_FAILED  # the whole GPU stopped answering: isolate it
_GPM_METRICS: dict[OccupancyField, int] = {
    "graphics_active": pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL,
    "sm_active": pynvml.NVML_GPM_METRIC_SM_UTIL,
    "sm_occupancy": pynvml.NVML_GPM_METRIC_SM_OCCUPANCY,
    "tensor_active": pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL,
    "dram_active": pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL,
    "fp64_active": pynvml.NVML_GPM_METRIC_FP64_UTIL,
    "fp32_active": pynvml.NVML_GPM_METRIC_FP32_UTIL,
    "fp16_active": pynvml.NVML_GPM_METRIC_FP16_UTIL,
}
_PROCESS_LISTINGS: tuple[tuple[ProcessKind, str], ...] = (
    ("compute", "nvmlDeviceGetComputeRunningProcesses"),
    ("graphics", "nvmlDeviceGetGraphicsRunningProcesses"),
    ("mps", "nvmlDeviceGetMPSComputeRunningProcesses"),
)
# No process has pid 0 (the idle task) or one above PID_MAX_LIMIT (2**22 on 64-bit
# Linux, include/linux/threads.h): such a pid is a process entry read at the wrong size.
_PID_LIMIT = 4_194_304


def _has_symbol(name: str) -> bool:
    """Whether the loaded libnvidia-ml exports ``name`` (pynvml's own symbol lookup)."""
    try:
        pynvml._nvmlGetFunctionPointer(name)
    except pynvml.NVMLError_FunctionNotFound:
        return False
    return True


@dataclass
class _GpmState:
    """Two GPM sample buffers per GPU (or MIG GPU instance); metrics are computed
    between them. Sampling that fails other than as unsupported is retried with
    backoff, never given up."""

    samples: list[Any] = field(default_factory=list)
    has_previous: bool = False
    supported: bool | None = None  # None: not known yet
    failing: str | None = None  # the error while sampling fails, e.g. NoPermission
    backoff: Backoff = field(default_factory=lambda: Backoff(initial_s=1.0, max_s=60.0))
    retry_at: float = 0.0  # source clock
    sampled_at: float = 0.0  # source clock at the last sample: the next window's start
    last: Occupancy | None = None  # the last window's, served until the next is due


@dataclass(frozen=True)
class _Slow:
    """What the slow tier read (exporter/sources/nvml_cadence.py), served as read until
    the next slow read: counters and states that move once in days or weeks, and the
    counters that cost milliseconds a read (energy, time under some clock-event reasons)."""

    energy_millijoules: int | None
    clock_event_durations_ns: tuple[tuple[str, int], ...]
    power_limit_milliwatts: int | None
    pcie_replay_count: int | None
    ecc_corrected_total: int | None
    ecc_uncorrected_total: int | None
    ecc_uncorrected_volatile: int | None
    retired_pages: int | None
    remapped_rows: RemappedRows | None
    fan_speeds_percent: tuple[tuple[int, int], ...]
    pcie_max: tuple[int | None, int | None]  # generation, width
    nvlinks: nvml_links.LinkStates


@dataclass(frozen=True)
class _MigDevice:
    """One MIG device (compute instance) as the layout read found it."""

    index: int
    handle: Any
    gpu_instance_id: int
    compute_instance_id: int
    uuid: str
    profile: str


@dataclass(frozen=True)
class _Layout:
    """MIG mode and MIG devices: read on change (a new handle) and at each slow read."""

    mig_mode: Any  # nvmlDeviceGetMigMode's [current, pending], None when not reported
    devices: tuple[_MigDevice, ...]
    complete: bool  # False: a read failed, so it is read again next cycle


@dataclass
class _Device:
    """What does not change while the driver is loaded: handle and identity."""

    index: int
    handle: Any
    uuid: str
    name: str | None
    pci_bus_id: str | None
    minor_number: int | None
    # the per-process samples' lastSeenTimeStamp, kept sane (nvml_samples.SampleBuffer)
    process_samples: nvml_samples.SampleBuffer = field(default_factory=nvml_samples.SampleBuffer)
    process_reader: nvml_sample_reads.ProcessUtilizationReader = field(
        default_factory=nvml_sample_reads.ProcessUtilizationReader
    )
    last_utilization: tuple[ProcessUtilization, ...] = ()
    last_utilization_at: float = 0.0  # source clock when last_utilization was read
    # GPU-Util has read busy (a plausible 1-100) while this GPU held per-process readings:
    # it reports here, so its reading 0 says the processes stopped (one that never reads
    # busy beside them, as on a platform that does not report it, says nothing)
    utilization_agreed: bool = False
    busy_at: float = -math.inf  # source clock when GPU-Util last read a plausible busy
    process_schedule: SlowSchedule = field(default_factory=lambda: SlowSchedule(0.0))
    process_attempted: bool = False  # a per-process read was made: paced from then on
    gpm_schedule: SlowSchedule = field(default_factory=lambda: SlowSchedule(0.0))
    # GPU-Util's sample buffer (nvmlDeviceGetSamples): its lastSeenTimeStamp, kept sane
    utilization_buffer: nvml_samples.SampleBuffer = field(default_factory=nvml_samples.SampleBuffer)
    utilization_samples: bool = True  # False: the driver lacks nvmlDeviceGetSamples
    utilization_last: ActiveWindow | None = None  # served again while a read is no evidence
    gpm: dict[int | None, _GpmState] = field(default_factory=dict)  # key: GPU instance id
    nvlink_count: int | None = None  # None: not read yet
    nvlinks_seen_active: set[int] = field(default_factory=set)
    failed: bool = False  # re-open next cycle; the identity still labels the error sample
    mig_profiles: ProfileCache = field(default_factory=ProfileCache)  # per handle and mode
    schedule: SlowSchedule = field(default_factory=lambda: SlowSchedule(0.0))
    slow: _Slow | None = None  # the last slow read; dropped with the handle
    layout: _Layout | None = None  # None: read it this cycle
    field_fallback: set[nvml_fields.FieldKey] = field(default_factory=set)  # NOT_SUPPORTED
    # counters the driver answers narrower than 64 bits (field -> its value type): not
    # served, not asked again on this handle (nvml_fields.WIDE_ONLY)
    narrow_fields: dict[nvml_fields.FieldKey, int] = field(default_factory=dict)


class NvmlSource(Source):
    """The NVML source: every GPU's state, processes and GPM occupancy, each cycle."""

    name: ClassVar[SourceName] = "nvml"

    def __init__(
        self,
        *,
        clock: Callable[[], float] = time.monotonic,
        slow_interval_s: float = 0.0,
        gpm_interval_s: float = 0.0,
        process_utilization_interval_s: float = 0.0,
    ) -> None:
        """``slow_interval_s``: how often the slow tier is read (exporter/sources/
        nvml_cadence.py); ``gpm_interval_s`` and ``process_utilization_interval_s``: how
        often a GPM window closes and the per-process samples are read. 0, the default
        for tools and tests, reads each every cycle. The exporter passes
        ``--slow-interval``, ``--gpm-interval``, ``--process-utilization-interval`` and
        the clock its cycles are paced by."""
        self._clock = clock
        self._slow_interval_s = slow_interval_s
        self._gpm_interval_s = gpm_interval_s
        self._process_interval_s = process_utilization_interval_s
        # per-process samples stand in for this long when a read finds none newer
        self._sample_reuse_s = max(SAMPLE_REUSE_S, 2 * process_utilization_interval_s)
        self._last: NvmlSnapshot | None = None
        self._errors_total = 0
        self._backoff = Backoff(initial_s=1.0, max_s=60.0)
        self._retry_at = 0.0
        self._initialised = False
        self._library: object = None  # pynvml's library when NVML was initialised
        self._init_error: str | None = None
        self._versions: tuple[str | None, str | None, str | None] = (None, None, None)
        self._devices: list[_Device | None] = []
        self._errors: list[tuple[str, str]] = []
        # (GPU index, exception class) already logged: an unexpected exception in one
        # GPU's reads is logged once, then only counted
        self._logged_failures: set[tuple[int, str]] = set()
        self._narrow_logged: set[int] = set()  # GPU indices whose narrow counters were logged
        self._last_readings: Readings | None = None  # the last cycle's, for its XIDs
        self._listing: str | None = None  # "_v3" | "_v2": the process listings' entry points
        self._lister = ProcessLister()
        self._slow_epoch: float | None = None  # when NVML first initialised: the slow grid's 0

    # -- lifecycle --------------------------------------------------------------------

    def _initialise(self) -> bool:
        if self._initialised:
            return True
        if self._clock() < self._retry_at:
            return False
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            return self._init_failed(exc)
        self._library = pynvml.nvmlLib
        try:
            # Without the count there is nothing to sample: that is NVML down, not "no
            # GPUs", so the init is undone and retried like a failed nvmlInit.
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self._optional(pynvml.nvmlShutdown)
            return self._init_failed(exc)
        self._initialised, self._init_error = True, None
        self._backoff.reset()
        self._versions = (
            self._optional(pynvml.nvmlSystemGetDriverVersion),
            self._optional(pynvml.nvmlSystemGetNVMLVersion),
            self._cuda_version(),
        )
        self._devices = [None] * count
        if self._slow_epoch is None:
            self._slow_epoch = self._clock()
        log.info("NVML initialised: %d GPU(s), driver %s", count, self._versions[0])
        return True

    def _init_failed(self, exc: pynvml.NVMLError) -> bool:
        delay = self._backoff.next_delay()
        self._retry_at = self._clock() + delay
        self._init_error = f"{error_name(exc)}: {exc}"
        log.warning("NVML unavailable (%s); retrying in %.0f s", self._init_error, delay)
        return False

    def close(self) -> None:
        # balances our own nvmlInit only, on the library it was made on (one replaced
        # since, as a test installing another simulated library, is not ours)
        if self._initialised and pynvml.nvmlLib is self._library:
            for device in self._devices:
                if device is not None:
                    self._free_gpm(device)
            self._optional(pynvml.nvmlShutdown)
        self._initialised = False

    def _free_gpm(self, device: _Device) -> None:
        for state in device.gpm.values():
            for buffer in state.samples:
                self._optional(pynvml.nvmlGpmSampleFree, buffer)
        device.gpm.clear()

    # -- one cycle --------------------------------------------------------------------

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.nvml = self.read(cycle)

    def read(self, cycle: Cycle) -> NvmlSnapshot:
        if self._last_readings is not None:
            self._reread_after_xids(self._last_readings)
        # filled by the XID sources after this one, read at the next cycle
        self._last_readings = cycle.readings
        snapshot = self.sample()
        self._last = snapshot
        self._errors_total += len(snapshot.errors) + (0 if snapshot.ok else 1)
        return snapshot

    def _reread_after_xids(self, readings: Readings) -> None:
        """Make the slow tier and MIG layout due at once on each GPU that raised an XID
        in ``REREAD_XIDS`` (NVML names the GPU; the kernel log, its PCI bus)."""
        events = [e for e in (*readings.xid_events, *readings.kmsg_events) if e.xid in REREAD_XIDS]
        if not events:
            return
        for device in self._devices:
            if device is None:
                continue
            bus = normalize_bus_id(device.pci_bus_id) if device.pci_bus_id else None
            if any(
                e.uuid == device.uuid
                or (e.uuid is None and e.gpu == device.index)
                or (bus is not None and e.pci_bus_id and normalize_bus_id(e.pci_bus_id) == bus)
                for e in events
            ):
                device.schedule.expire()
                device.layout = None

    def status(self) -> SourceStatus | None:
        last = self._last
        return None if last is None else SourceStatus(self.name, last.ok, last.error)

    @property
    def errors_total(self) -> int:
        """Failed queries and failed initialisations, cumulative."""
        return self._errors_total

    def sample(self) -> NvmlSnapshot:
        started = time.time()
        if not self._initialise():
            return NvmlSnapshot(ok=False, timestamp=started, error=self._init_error)
        self._errors = []
        gpus = tuple(self._sample_gpu(i) for i in range(len(self._devices)))
        driver, nvml, cuda = self._versions
        return NvmlSnapshot(
            ok=True,
            timestamp=started,
            driver_version=driver,
            nvml_version=nvml,
            cuda_driver_version=cuda,
            gpus=gpus,
            errors=tuple(self._errors),
        )

    def _sample_gpu(self, index: int) -> GpuSample:
        device = self._devices[index]
        try:
            if device is None or device.failed:
                fresh = self._open(index)
                if device is not None:
                    self._free_gpm(device)  # the driver's sample buffers of the old handle
                device = self._devices[index] = fresh
            return self._read(device)
        except pynvml.NVMLError as exc:
            # Any NVML error escaping one GPU's queries fails that GPU only, never the cycle.
            # Only GPU_LOST is NVML's word on the GPU itself; any other code (UNKNOWN,
            # NoPermission at open) is the driver interface's: health unknown, logged once.
            reason, lost = error_name(exc), isinstance(exc, GPU_LOST)
            if lost:
                log.debug("GPU %d failed this cycle: %s", index, reason)
            else:
                self._log_once(index, reason, exc_info=False)
            return self._failed(index, device, reason, lost=lost)
        except Exception as exc:  # one GPU's garbage must not end the sample
            # Anything else (a binding that cannot decode an answer, a value no reading
            # can be made of) fails that GPU alike: counted, logged once per GPU and kind,
            # and it says nothing of the GPU's health.
            reason = type(exc).__name__
            self._log_once(index, reason, exc_info=True)
            return self._failed(index, device, reason, lost=False)

    def _log_once(self, index: int, reason: str, *, exc_info: bool) -> None:
        if (index, reason) not in self._logged_failures:
            self._logged_failures.add((index, reason))
            log.warning(
                "GPU %d: its NVML reading failed (%s), counted from now on; its health is "
                "unknown while it fails (no hardware evidence)",
                index,
                reason,
                exc_info=exc_info,
            )

    def _failed(self, index: int, device: _Device | None, reason: str, *, lost: bool) -> GpuSample:
        """The sample of a GPU whose reading failed as a whole (``reason`` counted);
        ``lost``: NVML said the GPU is lost or must be reset."""
        self._errors.append(("gpu", reason))
        if device is None:
            return GpuSample(index=index, uuid=placeholder_uuid(index), error=reason, lost=lost)
        # Re-open next cycle, so a GPU that comes back gets a fresh handle, but keep
        # its last known identity: the lost GPU's series keep their uuid and model.
        device.failed = True
        return GpuSample(
            index=index,
            uuid=device.uuid,
            name=device.name,
            pci_bus_id=device.pci_bus_id,
            minor_number=device.minor_number,
            error=reason,
            lost=lost,
        )

    def _open(self, index: int) -> _Device:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        pci = self._query("pci_info", pynvml.nvmlDeviceGetPciInfo, handle)
        return _Device(
            index=index,
            handle=handle,
            uuid=pynvml.nvmlDeviceGetUUID(handle),
            name=self._query("name", pynvml.nvmlDeviceGetName, handle),
            pci_bus_id=_decode(pci.busId) if pci is not None else None,
            minor_number=self._query("minor_number", pynvml.nvmlDeviceGetMinorNumber, handle),
            schedule=self._schedule(self._slow_interval_s, index),
            gpm_schedule=self._schedule(self._gpm_interval_s, index),
            process_schedule=self._schedule(self._process_interval_s, index),
        )

    def _schedule(self, interval_s: float, index: int) -> SlowSchedule:
        """GPU ``index``'s grid for a read every ``interval_s``: the GPUs spread over it."""
        epoch = self._slow_epoch or 0.0
        return SlowSchedule(interval_s, offset(interval_s, index, len(self._devices), epoch))

    def _read(self, device: _Device) -> GpuSample:
        handle = device.handle
        total, used, free, reserved = self._memory(handle)
        util = self._query("utilization", pynvml.nvmlDeviceGetUtilizationRates, handle)
        now = self._clock()
        slow_due = device.slow is None or device.schedule.due(now)
        gpm_due = device.gpm_schedule.due(now)
        if device.nvlink_count is None:
            device.nvlink_count = nvml_links.nvlink_count(self._query, handle, self._error)
        nvlinks = device.nvlink_count or 0
        if slow_due or device.layout is None or not device.layout.complete:
            previous = device.layout
            device.layout = self._layout(device)
            self._forget_replaced_instances(device, previous, device.layout)
        layout = device.layout
        mig_mode = layout.mig_mode
        mig_enabled = None if mig_mode is None else mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        if mig_enabled:  # processes are listed per MIG instance, none for the whole GPU
            mig_instances, processes_listed = self._mig_instances(device, layout, gpm_due)
            processes: tuple[GpuProcess, ...] = ()
        else:
            mig_instances = ()
            processes, processes_listed = self._processes(handle)
        branch = nvml_fields.driver_branch(self._versions[0])
        fields = nvml_fields.read(
            self._query,
            handle,
            nvml_fields.requests(branch, nvlinks, device.field_fallback, device.narrow_fields),
            self._error,
            device.field_fallback,
            device.narrow_fields,
        )
        if device.narrow_fields and device.index not in self._narrow_logged:
            self._log_narrow(device)
        if slow_due:
            device.slow = self._read_slow(device, nvlinks, branch)
            device.schedule.done(now)
        occupancy = None if mig_enabled else self._gpm(device, None, gpm_due)
        if gpm_due:
            device.gpm_schedule.done(now)
        slow = device.slow
        assert slow is not None  # read above when there was none
        return GpuSample(
            index=device.index,
            uuid=device.uuid,
            name=device.name,
            pci_bus_id=device.pci_bus_id,
            minor_number=device.minor_number,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            memory_reserved_bytes=reserved,
            utilization_gpu_percent=util.gpu if util is not None else None,
            utilization_memory_percent=util.memory if util is not None else None,
            utilization_window=self._utilization_window(device, _busy(util)),
            temperature_celsius=self._query(
                "temperature", pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU
            ),
            power_milliwatts=self._power(device, fields, branch),
            power_limit_milliwatts=slow.power_limit_milliwatts,
            energy_millijoules=slow.energy_millijoules,
            slow_read=slow_due,
            clock_sm_mhz=self._query(
                "clock_sm", pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM
            ),
            clock_memory_mhz=self._query(
                "clock_memory", pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM
            ),
            clock_event_reasons=self._query("clock_event_reasons", _clock_event_reasons, handle),
            pcie_replay_count=slow.pcie_replay_count,
            ecc_corrected_total=slow.ecc_corrected_total,
            ecc_uncorrected_total=slow.ecc_uncorrected_total,
            ecc_uncorrected_volatile=slow.ecc_uncorrected_volatile,
            retired_pages=slow.retired_pages,
            recovery_action=nvml_fields.recovery_action(fields),
            remapped_rows=slow.remapped_rows,
            memory_temperature_celsius=self._memory_temperature(fields),
            fan_speeds_percent=slow.fan_speeds_percent,
            encoder_utilization_percent=_percent(
                self._query("encoder_utilization", pynvml.nvmlDeviceGetEncoderUtilization, handle)
            ),
            decoder_utilization_percent=_percent(
                self._query("decoder_utilization", pynvml.nvmlDeviceGetDecoderUtilization, handle)
            ),
            clock_event_durations_ns=slow.clock_event_durations_ns,
            pcie=nvml_links.pcie_link(self._query, handle, fields, slow.pcie_max),
            nvlinks=nvml_links.nvlinks(nvlinks, fields, slow.nvlinks),
            mig_enabled=mig_enabled,
            processes=processes,
            processes_listed=processes_listed,
            process_utilization=()
            if mig_enabled
            else self._process_utilization(
                device, processes_listed and not processes, _gpu_util(util)
            ),
            mig_instances=mig_instances,
            occupancy=occupancy,
            mig_profiles=self._mig_profiles(device, mig_mode is not None, mig_enabled),
            gpm_supported=_gpm_supported(device),  # after _gpm: what it found out
        )

    def _read_slow(self, device: _Device, nvlinks: int, branch: int | None) -> _Slow:
        """The slow tier, every ``slow_interval_s``: one field-values call (energy,
        clock-event time, PCIe replays, NVLink error counters) and the calls NVML has no
        field for. A failed read leaves its value absent until the next slow read, never
        the previous value."""
        handle = device.handle
        states = nvml_links.nvlink_states(self._query, handle, nvlinks, device.nvlinks_seen_active)
        keys = nvml_fields.slow_requests(
            branch,
            nvml_links.error_links(states, device.nvlinks_seen_active),
            device.field_fallback,
        )
        fields = nvml_fields.read(self._query, handle, keys, self._error, device.field_fallback)
        remapped = self._query("remapped_rows", pynvml.nvmlDeviceGetRemappedRows, handle)
        replay = fields.get((nvml_fields.PCIE_REPLAY_COUNTER, 0))
        if (nvml_fields.PCIE_REPLAY_COUNTER, 0) in device.field_fallback:
            replay = self._query("pcie_replay", pynvml.nvmlDeviceGetPcieReplayCounter, handle)
        return _Slow(
            energy_millijoules=self._energy(device, fields),
            clock_event_durations_ns=nvml_fields.clock_event_durations(fields),
            power_limit_milliwatts=self._query(
                "power_limit", pynvml.nvmlDeviceGetEnforcedPowerLimit, handle
            ),
            pcie_replay_count=None if replay is None else int(replay),
            ecc_corrected_total=self._query(
                "ecc",
                pynvml.nvmlDeviceGetTotalEccErrors,
                handle,
                pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED,
                pynvml.NVML_AGGREGATE_ECC,
            ),
            ecc_uncorrected_total=self._query(
                "ecc",
                pynvml.nvmlDeviceGetTotalEccErrors,
                handle,
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                pynvml.NVML_AGGREGATE_ECC,
            ),
            ecc_uncorrected_volatile=self._query(
                "ecc",
                pynvml.nvmlDeviceGetTotalEccErrors,
                handle,
                pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                pynvml.NVML_VOLATILE_ECC,
            ),
            retired_pages=self._retired_pages(handle),
            remapped_rows=RemappedRows(
                remapped[0], remapped[1], bool(remapped[2]), bool(remapped[3])
            )
            if remapped is not None
            else None,
            fan_speeds_percent=self._fans(handle),
            pcie_max=(
                self._query("pcie_link", pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
                self._query("pcie_link", pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
            ),
            nvlinks=nvml_links.link_errors(
                self._query,
                handle,
                states,
                device.nvlinks_seen_active,
                fields,
                device.field_fallback,
            ),
        )

    def _energy(
        self, device: _Device, fields: dict[nvml_fields.FieldKey, int | float]
    ) -> int | None:
        """Millijoules since the driver loaded: the field NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
        in the slow tier's field values, the call where the driver does not support the
        field (3.1 ms on an H200 either way, hence the slow tier)."""
        if (nvml_fields.TOTAL_ENERGY, 0) in device.field_fallback:
            return self._query("energy", pynvml.nvmlDeviceGetTotalEnergyConsumption, device.handle)
        value = fields.get((nvml_fields.TOTAL_ENERGY, 0))
        return None if value is None else int(value)

    def _power(
        self, device: _Device, fields: dict[nvml_fields.FieldKey, int | float], branch: int | None
    ) -> int | None:
        """Milliwatts as nvmlDeviceGetPowerUsage answers them: the field NVML_FI_DEV_POWER_
        AVERAGE in the cycle's field values where the driver has it and the GPU supports
        it (the same value: exporter/sources/nvml_fields.py), else the call."""
        if nvml_fields.power_asked(branch, device.field_fallback):
            value = fields.get((nvml_fields.POWER_AVERAGE, 0))
            return None if value is None else int(value)
        return self._query("power", pynvml.nvmlDeviceGetPowerUsage, device.handle)

    def _layout(self, device: _Device) -> _Layout:
        """MIG mode and, in MIG mode, each MIG device's handle and identity: read when the
        handle is new and at each slow read; again next cycle when a read failed."""
        errors = len(self._errors)
        mig_mode = self._query("mig_mode", pynvml.nvmlDeviceGetMigMode, device.handle)
        devices: list[_MigDevice] = []
        if mig_mode is not None and mig_mode[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
            count = self._query("mig_count", pynvml.nvmlDeviceGetMaxMigDeviceCount, device.handle)
            for i in range(count or 0):
                mig = self._mig_handle(device, i)
                identity = None if mig is None else self._mig_identity(mig)
                if identity is None:
                    continue
                gi, ci, uuid = identity
                name = self._query("name", pynvml.nvmlDeviceGetName, mig) or ""
                profile = name.rpartition(" MIG ")[2] if " MIG " in name else "unknown"
                devices.append(_MigDevice(i, mig, gi, ci, uuid, profile))
        return _Layout(mig_mode, tuple(devices), complete=len(self._errors) == errors)

    def _forget_replaced_instances(
        self, device: _Device, before: _Layout | None, after: _Layout
    ) -> None:
        """A GPU instance whose MIG devices changed (destroyed and made again, perhaps
        with the same id) starts its GPM windows afresh: no window of the old instance
        is served as, or counted for, the new one. An incomplete layout (a read failed)
        is no evidence of a change."""
        if before is None or not after.complete:
            return
        old, new = _instance_uuids(before), _instance_uuids(after)
        for gi in [gi for gi in device.gpm if gi is not None and old.get(gi) != new.get(gi)]:
            for buffer in device.gpm.pop(gi).samples:
                self._optional(pynvml.nvmlGpmSampleFree, buffer)

    def _mig_profiles(
        self, device: _Device, mig_capable: bool, mig_enabled: bool | None
    ) -> tuple[MigProfileInfo, ...]:
        """The GPU instance profiles, read once per handle and MIG mode; none asked of a
        GPU whose MIG mode NVML does not report (not MIG-capable: go-nvlib's
        ``IsMigCapable`` test)."""
        if not mig_capable:
            return ()
        return device.mig_profiles.get(device.handle, mig_enabled, self._error)

    # -- query helpers ----------------------------------------------------------------

    def _query(self, name: str, fn: Callable[..., T], *args: Any) -> T | None:
        """One NVML query: value, or None when unsupported; whole-GPU failures escape."""
        try:
            return fn(*args)
        except UNSUPPORTED:
            return None
        except _GPU_FAILED:
            raise
        except pynvml.NVMLError as exc:
            self._errors.append((name, error_name(exc)))
            return None

    def _error(self, query: str, reason: str) -> None:
        self._errors.append((query, reason))

    def _optional(self, fn: Callable[..., T], *args: Any) -> T | None:
        try:
            return fn(*args)
        except pynvml.NVMLError:
            return None

    def _cuda_version(self) -> str | None:
        version = self._optional(pynvml.nvmlSystemGetCudaDriverVersion_v2)
        if version is None:
            return None
        return f"{version // 1000}.{version % 1000 // 10}"

    def _memory(self, handle: Any) -> tuple[int | None, int | None, int | None, int | None]:
        """Memory info v2, whose ``used`` excludes driver-reserved memory.

        v1 ``used`` includes the reserved amount and would make every GPU look like it
        leaks; on drivers without v2 we report v1 and leave ``reserved`` unknown.
        """
        try:
            v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            get = number_field
            return get(v2, "total"), get(v2, "used"), get(v2, "free"), get(v2, "reserved")
        except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch):
            pass
        except UNSUPPORTED:
            return None, None, None, None
        except _GPU_FAILED:
            raise
        except pynvml.NVMLError as exc:
            self._errors.append(("memory", error_name(exc)))
            return None, None, None, None
        v1 = self._query("memory", pynvml.nvmlDeviceGetMemoryInfo, handle)
        if v1 is None:
            return None, None, None, None
        return v1.total, v1.used, v1.free, None

    def _memory_temperature(self, fields: dict[nvml_fields.FieldKey, int | float]) -> int | None:
        """HBM/GDDR temperature; a value DCGM would discard as garbage (> 200 C) is an
        error, not a reading."""
        value = fields.get((nvml_fields.MEMORY_TEMPERATURE, 0))
        if value is None:
            return None
        if value > nvml_fields.MAX_MEMORY_TEMPERATURE:
            self._errors.append(("memory_temperature", "ImplausibleValue"))
            return None
        return int(value)

    def _fans(self, handle: Any) -> tuple[tuple[int, int], ...]:
        """Each fan's intended speed, percent of its maximum (may exceed 100). Data-centre
        GPUs have no fans of their own: NOT_SUPPORTED, no series. Drivers without
        ``nvmlDeviceGetNumFans`` report one fan through ``nvmlDeviceGetFanSpeed``."""
        count = self._query("fans", pynvml.nvmlDeviceGetNumFans, handle)
        if count is None:
            speed = self._query("fan_speed", pynvml.nvmlDeviceGetFanSpeed, handle)
            return () if speed is None else ((0, int(speed)),)
        speeds = []
        for fan in range(count):
            speed = self._query("fan_speed", pynvml.nvmlDeviceGetFanSpeed_v2, handle, fan)
            if speed is not None:
                speeds.append((fan, int(speed)))
        return tuple(speeds)

    def _retired_pages(self, handle: Any) -> int | None:
        """Pages retired for double-bit or repeated single-bit ECC errors."""
        total = 0
        for cause in (
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS,
            pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR,
        ):
            pages = self._query("retired_pages", pynvml.nvmlDeviceGetRetiredPages, handle, cause)
            if pages is None:
                return None
            total += len(pages)
        return total

    def _processes(
        self, handle: Any, mig_ids: tuple[int, int] | None = None
    ) -> tuple[tuple[GpuProcess, ...], bool]:
        """The processes of every listing (compute, graphics, MPS), and whether every
        listing answered: a listing that did not leaves the processes unknown, not none
        (``GpuSample.processes_listed``)."""
        found: list[GpuProcess] = []
        answered = True
        for kind, name in _PROCESS_LISTINGS:
            listed = self._list_processes(name, handle)
            if listed is None:
                answered = False
            for proc in listed or ():
                gi, ci = mig_ids or (proc.gpu_instance_id, proc.compute_instance_id)
                found.append(
                    GpuProcess(
                        pid=proc.pid,
                        memory_used_bytes=proc.used_memory,
                        kind=kind,
                        gpu_instance_id=instance_id(gi),
                        compute_instance_id=instance_id(ci),
                    )
                )
        return tuple(found), answered

    def _list_processes(self, name: str, handle: Any) -> list[ListedProcess] | None:
        """One listing (exporter/sources/nvml_listing.py: one call where pynvml makes
        two) through the entry point whose struct is read right here.

        Should the driver still write entries of another size, the pids read back are
        impossible (0, or above the kernel's limit): the ``_v2`` entry point is used
        from then on, and a listing that is wrong even there is dropped as an error.
        """
        suffix = self._listing_suffix()
        procs = self._query(name, self._lister.list, name + suffix, handle)
        if procs is None or all(0 < p.pid <= _PID_LIMIT for p in procs):
            return procs
        if suffix == "_v3":
            log.warning("NVML %s_v3 returned impossible pids: reading %s_v2", name, name)
            self._listing = "_v2"
            return self._list_processes(name, handle)
        self._errors.append((name, "ImplausiblePid"))
        return None

    def _listing_suffix(self) -> str:
        """``process_listing_suffix()``, decided once (the driver library does not change
        under a process)."""
        if self._listing is None:
            self._listing = process_listing_suffix()
            log.debug("NVML process listings: the %s entry points", self._listing)
        return self._listing

    def _process_utilization(
        self, device: _Device, no_processes: bool, gpu_util: int | None
    ) -> tuple[ProcessUtilization, ...]:
        """Per-process SM samples newer than the last ones seen, averaged per pid, with
        the SM time they account for (``nvml_samples.process_sm_seconds``), read every
        ``--process-utilization-interval``; between two reads the last ones stand.

        NotFound means the driver has no sample newer than the last one we read: no
        process ran a kernel since. Then, as between two reads, the previous samples
        stand for up to ``SAMPLE_REUSE_S`` (or two read intervals) since they were read,
        so the per-container SM series do not flap on short intervals, and then drop out;
        except that while GPU-Util (``gpu_util``, this cycle's, None when unread) reads 0
        and both the last read that answered and the last cycle GPU-Util read busy are
        longer ago than the driver's longest sample period (``nvml_samples.MAX_PERIOD_US``),
        none stands: the GPU is idle, and a time-shared replica judged by its SM share is
        idle with it, not busy on its last burst's figure. That needs a GPU-Util that has
        read busy (a plausible 1-100) while readings were held: one that never does (a
        platform that does not report it) says nothing. GPU-Util busy, unread or garbage
        is no evidence: they stand (a GPU busy again before its processes' new samples
        arrive has them stand again). Readings that
        stand keep their timestamp and carry no SM time (``_standing``): their SM time
        is counted once, when read. An entry whose
        value is no percentage is dropped and counted (``ImplausibleValue``); the
        timestamps are kept sane by ``nvml_samples.SampleBuffer``.

        ``no_processes``: every listing of this cycle answered, and none listed a process.
        Then there is nothing to attribute and the read is skipped: on an H200 it took
        1.3-2.4 ms even idle, answering NotFound (docs/validation.md). The
        samples that stood in are dropped (the processes they describe are gone), while
        the last timestamp seen is kept, so the next read returns only samples taken
        since: a process that starts later is averaged over its own samples alone. A
        listing that failed is no evidence of an empty GPU: the read goes ahead.
        """
        if no_processes:
            device.last_utilization = ()
            return ()
        now = self._clock()
        busy = gpu_util is not None and gpu_util > 0
        if nvml_samples.plausible_percent(gpu_util) and gpu_util:
            device.busy_at = now
            device.utilization_agreed = device.utilization_agreed or bool(device.last_utilization)
        quiet = gpu_util == 0
        if device.process_attempted and not device.process_schedule.due(now):
            return self._standing(device, now, quiet)
        device.process_attempted = True
        device.process_schedule.done(now)
        buffer = device.process_samples
        try:
            samples = device.process_reader.read(device.handle, buffer.seen_us)
        except pynvml.NVMLError_NotFound:
            if busy and buffer.seen_us and buffer.suspect(now):
                self._clock_stepped(device, "per-process")
            return self._standing(device, now, quiet)
        except UNSUPPORTED:
            return ()
        except _GPU_FAILED:
            raise
        except pynvml.NVMLError as exc:
            self._errors.append(("process_utilization", error_name(exc)))
            device.last_utilization = ()  # nothing stands in after a failed read
            return ()
        get = number_field
        entries = [
            (get(s, "pid"), get(s, "smUtil"), get(s, "memUtil"), get(s, "timeStamp"))
            for s in samples
        ]
        seen = buffer.seen_us  # the lastSeenTimeStamp this read asked with
        taken = [
            ok and stamp > seen
            for ok, (*_, stamp) in zip(
                buffer.plausible([stamp for *_, stamp in entries], now), entries, strict=True
            )
        ]
        if not all(taken):
            self._errors.append(("process_utilization", "ImplausibleTimestamp"))
            if buffer.suspect(now):
                self._clock_stepped(device, "per-process")
                return ()
        else:
            buffer.fine()
        # pid -> (sm %, memory %, timestamp us) of each sample
        per_pid: dict[int, list[tuple[int, int, int]]] = {}
        for (pid, sm, memory, stamp), ok in zip(entries, taken, strict=True):
            if not ok:
                continue
            buffer.advance(stamp, now)
            if not (nvml_samples.plausible_percent(sm) and nvml_samples.plausible_percent(memory)):
                self._errors.append(("process_utilization", "ImplausibleValue"))
                continue
            per_pid.setdefault(pid, []).append((sm, memory, stamp))
        buffer.answered_at = now
        device.last_utilization_at = now
        device.utilization_agreed = device.utilization_agreed or device.busy_at == now
        if seen == 0 and buffer.seen_us > 0 and per_pid:
            # the first samples average whatever the driver held: read again at the next
            # cycle, so the figures served for the interval are the mean since this read
            device.process_schedule.expire()
        readings = [
            ProcessUtilization(
                pid=pid,
                sm_percent=round(sum(sm for sm, _, _ in group) / len(group)),
                memory_percent=round(sum(mem for _, mem, _ in group) / len(group)),
                timestamp_us=max(stamp for _, _, stamp in group),
                sm_seconds=nvml_samples.process_sm_seconds(
                    ((stamp, sm) for sm, _, stamp in group), seen
                ),
            )
            for pid, group in sorted(per_pid.items())
        ]
        device.last_utilization = tuple(readings)
        return device.last_utilization

    def _standing(self, device: _Device, now: float, quiet: bool) -> tuple[ProcessUtilization, ...]:
        """The last per-process readings, while they may stand in for a read (between two
        reads, or a read that found nothing new), with no SM time: theirs was counted when
        they were read (a reading that stands again after a cycle without one is not
        counted twice). None while GPU-Util reads 0 (``quiet``) and neither the last
        answer nor the last busy GPU-Util is within the driver's longest sample period,
        on a GPU whose GPU-Util has read busy beside per-process readings
        (``utilization_agreed``): the GPU is idle now, and a time-shared replica judged
        by its SM share with it."""
        age = now - device.last_utilization_at
        quiet_for = now - max(device.last_utilization_at, device.busy_at)
        idle = quiet and device.utilization_agreed and quiet_for > nvml_samples.MAX_PERIOD_US / 1e6
        if age > self._sample_reuse_s or idle:
            return ()
        return tuple(replace(r, sm_seconds=0.0) for r in device.last_utilization)

    def _utilization_window(self, device: _Device, busy: bool) -> ActiveWindow | None:
        """GPU-Util's samples since the last read (``nvmlDeviceGetSamples``,
        NVML_GPU_UTILIZATION_SAMPLES), read every cycle: the seconds a kernel ran in the
        time since the last read (``nvml_samples.integrate``), that time capped at what
        the buffer holds (``HISTORY_S``). NotFound is an idle
        window while GPU-Util reads idle too, and no evidence while it reads busy (the
        last window stands; the next read with samples covers the time since). A failed
        read, or samples with garbage values, is no window: the time until the next read
        that answers is not covered (neither active nor covered, never idle). A driver
        without the call: no counter. Timestamps are kept sane by
        ``nvml_samples.SampleBuffer``."""
        if not device.utilization_samples:
            return None
        buffer = device.utilization_buffer
        now = self._clock()
        try:
            kind, samples = nvml_sample_reads.get_samples(
                device.handle, pynvml.NVML_GPU_UTILIZATION_SAMPLES, buffer.seen_us
            )
        except pynvml.NVMLError_NotFound:  # no sample since the last read
            if not busy:  # idle, as GPU-Util says too: an idle window
                return self._utilization_read(device, 0.0, now)
            # GPU-Util reads busy: no evidence either way
            if buffer.seen_us and buffer.suspect(now):
                self._clock_stepped(device, "GPU-Util")
                return None
            return device.utilization_last
        except pynvml.NVMLError_FunctionNotFound:  # the driver lacks the call
            device.utilization_samples = False
            return None
        except pynvml.NVMLError_NotSupported:  # MIG mode, say: asked again, it may change
            buffer.answered_at = None
            return None
        except _GPU_FAILED:
            raise
        except pynvml.NVMLError as exc:
            self._errors.append(("utilization_samples", error_name(exc)))
            buffer.answered_at = None  # the time until a read answers is not covered
            return None
        values = [(number_field(s, "timeStamp"), _sample_value(kind, s)) for s in samples]
        taken = buffer.plausible([stamp for stamp, _ in values], now)
        if not all(taken):  # no evidence: this read covers nothing, nor the time before
            self._errors.append(("utilization_samples", "ImplausibleTimestamp"))
            if buffer.suspect(now):
                self._clock_stepped(device, "GPU-Util")
            buffer.answered_at = None
            return None
        buffer.fine()
        baseline = buffer.seen_us == 0  # the buffer before the exporter: not ours
        buffer.learn(stamp for stamp, _ in values)
        period = buffer.period_us
        got = nvml_samples.integrate(values, buffer.seen_us, period)
        buffer.advance(got.newest_us, now)
        if got.garbage:
            self._errors.append(("utilization_samples", "ImplausibleValue"))
        if got.garbage or baseline:
            # garbage, or the buffer from before the exporter: this read's time is not
            # covered (neither busy nor idle)
            buffer.answered_at = now
            return None
        return self._utilization_read(device, got.active_s, now)

    def _clock_stepped(self, device: _Device, buffer: str) -> None:
        log.warning(
            "GPU %d: the %s samples' timestamps have made no sense for %.0f s (the clock "
            "stepped?): reading that buffer afresh, the time in between not counted",
            device.index,
            buffer,
            nvml_samples.STEP_S,
        )

    def _utilization_read(
        self, device: _Device, active_s: float, now: float
    ) -> ActiveWindow | None:
        """The window of a read that answered: the time since the previous such read on
        the source's clock, at most what the buffer holds (``HISTORY_S``: what a longer
        gap lost is not covered, never idle), ``active_s`` of it busy. The first read
        only starts."""
        buffer = device.utilization_buffer
        previous, buffer.answered_at = buffer.answered_at, now
        if previous is None:
            return None
        seconds = min(now - previous, nvml_samples.HISTORY_S)
        device.utilization_last = ActiveWindow(end=now, seconds=seconds, active_s=active_s)
        return device.utilization_last

    def _log_narrow(self, device: _Device) -> None:
        """Say once per GPU why its PCIe byte counters are not served."""
        self._narrow_logged.add(device.index)
        log.warning(
            "GPU %d: driver %s answers the PCIe byte counters (NVML fields %s) as value type "
            "%s, not 64 bits: such a counter wraps within a second at link speed, so "
            "gpu_pcie_transmitted_bytes_total and gpu_pcie_received_bytes_total are not "
            "served for this GPU and NVML is not asked for them again",
            device.index,
            self._versions[0],
            "/".join(str(fid) for fid, _ in sorted(device.narrow_fields)),
            "/".join(sorted({str(t) for t in device.narrow_fields.values()})),
        )

    def _mig_instances(
        self, device: _Device, layout: _Layout, gpm_due: bool
    ) -> tuple[tuple[MigInstance, ...], bool]:
        """The GPU's MIG devices as the layout read found them (one per compute
        instance), with this cycle's memory, processes and occupancy, and whether every
        process listing of every instance answered.

        A MIG device whose handle or identity could not be read is left out (counted by
        the layout read, which is tried again next cycle); only a whole-GPU failure
        fails the GPU. GPM measures a GPU instance and wants more than 100 ms between
        two samples, so each GPU instance is sampled once per cycle and its compute
        instances share the figures.
        """
        instances = []
        answered = True
        occupancy: dict[int, Occupancy | None] = {}  # per GPU instance, this cycle
        for mig in layout.devices:
            gi = mig.gpu_instance_id
            errors = len(self._errors)
            total, used, _, _ = self._memory(mig.handle)
            if gi not in occupancy:
                occupancy[gi] = self._gpm(device, gi, gpm_due)
            processes, listed = self._processes(mig.handle, (gi, mig.compute_instance_id))
            answered = answered and listed
            if any(reason in _STALE_HANDLE for _, reason in self._errors[errors:]):
                device.layout = None  # the instance was destroyed: read the layout again
            instances.append(
                MigInstance(
                    mig_index=mig.index,
                    uuid=mig.uuid,
                    gpu_instance_id=gi,
                    compute_instance_id=mig.compute_instance_id,
                    profile=mig.profile,
                    memory_total_bytes=total,
                    memory_used_bytes=used,
                    processes=processes,
                    occupancy=occupancy[gi],
                )
            )
        return tuple(instances), answered

    def _mig_handle(self, device: _Device, index: int) -> Any | None:
        """The MIG device in slot ``index``; None for an empty slot or an error."""
        try:
            return pynvml.nvmlDeviceGetMigDeviceHandleByIndex(device.handle, index)
        except (pynvml.NVMLError_NotFound, pynvml.NVMLError_InvalidArgument):
            return None  # no MIG device in this slot
        except _GPU_FAILED:
            raise
        except pynvml.NVMLError as exc:
            self._errors.append(("mig_handle", error_name(exc)))
            return None

    def _mig_identity(self, mig: Any) -> tuple[int, int, str] | None:
        """GPU instance id, compute instance id and UUID, or None (counted as an error)
        when any is unreadable: without them the instance cannot be labelled."""
        try:
            return (
                int(pynvml.nvmlDeviceGetGpuInstanceId(mig)),
                int(pynvml.nvmlDeviceGetComputeInstanceId(mig)),
                str(pynvml.nvmlDeviceGetUUID(mig)),
            )
        except _GPU_FAILED:
            raise
        except pynvml.NVMLError as exc:
            self._errors.append(("mig_identity", error_name(exc)))
            return None

    # -- GPM --------------------------------------------------------------------------

    def _gpm(self, device: _Device, gpu_instance: int | None, due: bool) -> Occupancy | None:
        """Occupancy between this GPM sample and the previous one, a window of
        ``--gpm-interval`` (``due``: the GPU's grid point is reached); between two,
        the last window's figures stand (the activity counters add a window once, by its
        end). A buffer that was only primed is sampled again at the next cycle, so the
        first figures come one cycle after the GPU (or its GPU instance) appeared.

        The first cycle only primes the buffers, so it yields None; so does a GPU
        without GPM (pre-Hopper), where these series are absent by design. Any other
        failure is an error, not "unsupported": NVML answers NoPermission to GPM in an
        unprivileged container after minutes to an hour of working (DCGM issue #214),
        and it may come back. So it is counted, logged when it starts and when it ends,
        and retried with backoff; the series are absent meanwhile.
        """
        state = device.gpm.setdefault(gpu_instance, _GpmState())
        if state.supported is False or self._clock() < state.retry_at:
            return None
        if state.last is not None and not due:
            return state.last  # the last window stands until the next is due
        try:
            if state.supported is None:
                if not pynvml.nvmlGpmQueryDeviceSupport(device.handle).isSupportedDevice:
                    state.supported = False
                    return None
                while len(state.samples) < 2:
                    state.samples.append(pynvml.nvmlGpmSampleAlloc())
                state.supported = True
            previous, current = state.samples
            if gpu_instance is None:
                pynvml.nvmlGpmSampleGet(device.handle, current)
            else:
                pynvml.nvmlGpmMigSampleGet(device.handle, gpu_instance, current)
        except UNSUPPORTED:
            state.supported = False
            return None
        except _GPU_FAILED:
            raise
        except pynvml.NVMLError as exc:
            self._gpm_failed(state, _gpm_where(device, gpu_instance), error_name(exc))
            return None
        if state.failing is not None:
            log.info(
                "GPM on %s answers again (was %s)", _gpm_where(device, gpu_instance), state.failing
            )
            state.failing = None
            state.backoff.reset()
        now = self._clock()
        started, state.sampled_at = state.sampled_at, now
        state.samples.reverse()  # the current sample becomes the next window's previous
        if not state.has_previous:
            state.has_previous = True
            return None
        state.last = self._gpm_metrics(previous, current, now, now - started)
        return state.last

    def _gpm_failed(self, state: _GpmState, where: str, reason: str) -> None:
        """Count it, pace the retries, say so once; the next success primes afresh, so
        no window spans the gap."""
        self._errors.append(("gpm", reason))
        state.has_previous = False
        state.last = None
        state.retry_at = self._clock() + state.backoff.next_delay()
        if state.failing != reason:
            log.warning(
                "GPM on %s fails (%s): its occupancy series are absent until it answers "
                "again; retrying with backoff, each failure counted in "
                'gpu_exporter_errors_total{source="nvml"}',
                where,
                reason,
            )
        state.failing = reason

    def _gpm_metrics(
        self, first: Any, second: Any, window_end: float, window_s: float
    ) -> Occupancy | None:
        get, put = number_field, set_number_field
        request = pynvml.c_nvmlGpmMetricsGet_t()
        put(request, "version", pynvml.NVML_GPM_METRICS_GET_VERSION)
        put(request, "sample1", first)
        put(request, "sample2", second)
        put(request, "numMetrics", len(_GPM_METRICS))
        metrics = get(request, "metrics")
        for slot, metric_id in enumerate(_GPM_METRICS.values()):
            put(metrics[slot], "metricId", metric_id)
        if self._query("gpm_metrics", pynvml.nvmlGpmMetricsGet, request) is None:
            return None
        values: dict[str, float | None] = {}
        for slot, key in enumerate(_GPM_METRICS):
            metric = metrics[slot]
            ok = get(metric, "nvmlReturn") == pynvml.NVML_SUCCESS
            value = get(metric, "value") if ok else None
            if value is not None and not nvml_samples.plausible_percent(
                value, nvml_samples.GPM_MAX_PERCENT
            ):
                self._errors.append(("gpm_metrics", "ImplausibleValue"))
                value = None  # garbage: no series, counted, never clamped into shape
            values[key] = None if value is None else _gpm_ratio(value)
        return Occupancy(source="gpm", window_end=window_end, window_s=window_s, **values)


def process_listing_suffix() -> str:
    """``_v3``, or ``_v2`` where the loaded driver's ``_v3`` is missing or writes the wider
    struct: the process listing entry points to call (also what ``doctor`` checks).

    Drivers 535.43.02 to 535.86.05 wrote a 32-byte struct (usedGpuCcProtectedMemory
    appended) through ``_v3``, where pynvml >= 12.535.108 reads 24 bytes. They are
    known, as nvitop knows them, by having ``nvmlDeviceGetConfComputeMemSizeInfo``
    but not yet ``nvmlDeviceGetRunningProcessDetailList`` (535.104.05 added it and
    went back to 24 bytes). 535.98 and drivers before R510 lack ``_v3``.
    """
    early_r535 = _has_symbol("nvmlDeviceGetConfComputeMemSizeInfo") and not _has_symbol(
        "nvmlDeviceGetRunningProcessDetailList"
    )
    v3 = _has_symbol("nvmlDeviceGetComputeRunningProcesses_v3") and not early_r535
    return "_v3" if v3 else "_v2"


def _busy(util: Any) -> bool:
    """GPU-Util above 0 this cycle (nvmlDeviceGetUtilizationRates), False when unread."""
    return util is not None and isinstance(util.gpu, int) and util.gpu > 0


def _gpu_util(util: Any) -> int | None:
    """GPU-Util this cycle (nvmlDeviceGetUtilizationRates), None when unread."""
    return util.gpu if util is not None and isinstance(util.gpu, int) else None


def _sample_value(kind: int, sample: Any) -> float | None:
    """A sample's value read through the union member its value type names; None for a
    type NVML did not define (the sample is then skipped, not read as some number)."""
    if not 0 <= kind < len(_VALUE_MEMBERS):
        return None
    value = getattr(sample.sampleValue, _VALUE_MEMBERS[kind])
    return float(value)


def _instance_uuids(layout: _Layout) -> dict[int, frozenset[str]]:
    """GPU instance id -> the UUIDs of its MIG devices in a layout."""
    found: dict[int, set[str]] = {}
    for mig in layout.devices:
        found.setdefault(mig.gpu_instance_id, set()).add(mig.uuid)
    return {gi: frozenset(uuids) for gi, uuids in found.items()}


def _gpm_supported(device: _Device) -> bool | None:
    """True when GPM answers for the GPU or one of its GPU instances, False when every
    one asked said unsupported, None when none was asked yet."""
    known = [s.supported for s in device.gpm.values() if s.supported is not None]
    return any(known) if known else None


def _gpm_ratio(percent: float) -> float | None:
    """A GPM percentage as a ratio clamped to [0, 1]; None for a value that is not a
    number (NaN passes through min/max and would compare below every threshold)."""
    if not math.isfinite(percent):
        return None
    return min(max(percent / 100.0, 0.0), 1.0)


def _gpm_where(device: _Device, gpu_instance: int | None) -> str:
    where = f"GPU {device.index}"
    return where if gpu_instance is None else f"{where} GPU instance {gpu_instance}"


def _clock_event_reasons(handle: Any) -> int:
    """Why the clocks are below their maximum: the slowdown bits health reads.

    ``nvmlDeviceGetCurrentClocksEventReasons`` came with R535 (nvidia-ml-py 12.535.77
    is the first to call it); R525-R530 drivers export the same bits only under the
    older, since deprecated ``nvmlDeviceGetCurrentClocksThrottleReasons``.
    """
    try:
        return int(pynvml.nvmlDeviceGetCurrentClocksEventReasons(handle))
    except pynvml.NVMLError_FunctionNotFound:
        return int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(handle))


def _percent(utilization: list[int] | None) -> int | None:
    """The percentage of an engine utilization answer ``[percent, sampling period us]``."""
    return None if utilization is None else int(utilization[0])


def _decode(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
