"""A simulated ``libnvidia-ml.so.1`` that pynvml loads in place of the real library.

pynvml resolves every C entry point with ``getattr(pynvml.nvmlLib, name)`` and calls it
with ctypes arguments. This object answers those calls from a ``SimNode`` and writes
its results through the same ctypes out-parameters the C library would, so everything
above it — pynvml's marshalling, error classes, struct decoding, and our NVML source —
runs unchanged. It is the only fake under the exporter's NVML path.

Entry points a scenario lists in ``missing_functions`` (or that its ``driver_version``
predates) raise AttributeError (pynvml turns that into FunctionNotFound, like an older
driver); names in a GPU's ``unsupported`` list return NOT_SUPPORTED for that GPU; a lost
GPU answers GPU_IS_LOST; the scenario's ``call_errors`` make one entry point answer an
error code, or block for ``delay_s`` real seconds, for a while (on every handle, one GPU's
or one MIG device's). A GPU back from being lost gets a new handle, and the handles
given out before answer GPU_IS_LOST: the strict case, so the exporter is shown to
re-open it rather than trust a handle that outlived its device.

GPM counters refresh every ``GPM_REFRESH_S``, as the hardware's do: NVML's GPM docs ask
for more than 100 ms between two samples "due to the internal sample refresh rate"
(docs.nvidia.com/deploy/nvml-api/group__nvmlGpmFunctions.html). Two samples taken within
one refresh period hold the same counters, so metrics between them read 0.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import math
import time
from collections.abc import Callable
from typing import Any, NamedTuple

import pynvml

from exporter.sim.mig_profiles import multiprocessors, profiles_for
from exporter.sim.node import SimNode, speed_alone
from exporter.sim.scenario import (
    FIELDS_ADDED_IN_DRIVER,
    PYTHON_ERRORS,
    SimDuty,
    SimGpu,
    SimMig,
    SimProcess,
)
from exporter.sim.wakeups import sleep_interruptibly

SUCCESS: int = pynvml.NVML_SUCCESS
NOT_SUPPORTED: int = pynvml.NVML_ERROR_NOT_SUPPORTED
NOT_FOUND: int = pynvml.NVML_ERROR_NOT_FOUND
INVALID_ARGUMENT: int = pynvml.NVML_ERROR_INVALID_ARGUMENT
INSUFFICIENT_SIZE: int = pynvml.NVML_ERROR_INSUFFICIENT_SIZE
GPU_IS_LOST: int = pynvml.NVML_ERROR_GPU_IS_LOST
TIMEOUT: int = pynvml.NVML_ERROR_TIMEOUT
UNINITIALIZED: int = pynvml.NVML_ERROR_UNINITIALIZED
VERSION_MISMATCH: int = pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
NOT_AVAILABLE = 0xFFFFFFFF
NOT_AVAILABLE_ULL = 0xFFFFFFFFFFFFFFFF  # NVML_VALUE_NOT_AVAILABLE in an unsigned long long
GPM_REFRESH_S = 0.1  # how often GPM counters move; samples closer than this see no change
MAX_MIG_DEVICES = 7
SIM_EPOCH_S = 1_767_225_600  # simulated time 0 = 2026-01-01T00:00:00Z

_GPU_BASE = 0x1000
EVENT_WAIT_STEP_S = 1.0
_GPU_STRIDE = 0x100  # a GPU's handle: _GPU_BASE + generation * _GPU_STRIDE + index
# refresh time, (GPU, GPU instance or None), counters
_GpmSample = tuple[float, tuple[int, int | None], dict[str, float]]
_MIG_BASE = 0x100000
_GPM_METRIC_KEYS = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: "graphics_active",
    pynvml.NVML_GPM_METRIC_SM_UTIL: "sm_active",
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: "sm_occupancy",
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor_active",
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: "dram_active",
    pynvml.NVML_GPM_METRIC_FP64_UTIL: "fp64_active",
    pynvml.NVML_GPM_METRIC_FP32_UTIL: "fp32_active",
    pynvml.NVML_GPM_METRIC_FP16_UTIL: "fp16_active",
}
_PROCESS_MODES = {
    pynvml.NVML_PROCESS_MODE_COMPUTE: "compute",
    pynvml.NVML_PROCESS_MODE_GRAPHICS: "graphics",
    pynvml.NVML_PROCESS_MODE_MPS: "mps",
}
# Field ids by every pynvml name they have, so a GPU's `unsupported` list can name a field
# (NVML_FI_DEV_MEMORY_TEMP) as it names an entry point.
_FIELD_NAMES: dict[int, set[str]] = {}
for _name in dir(pynvml):
    if _name.startswith("NVML_FI_") and isinstance(getattr(pynvml, _name), int):
        _FIELD_NAMES.setdefault(getattr(pynvml, _name), set()).add(_name)
# Duration fields (ns) -> the simulated node's clock-event reason (node.CLOCK_EVENT_BITS):
# the performance-policy counters and R580's per-reason ones (ids 269-271).
_DURATION_FIELDS = {
    pynvml.NVML_FI_DEV_PERF_POLICY_POWER: "sw_power_cap",
    pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL: "thermal",
    pynvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST: "sync_boost",
    pynvml.NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT: "board_limit",
    pynvml.NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION: "low_utilization",
    pynvml.NVML_FI_DEV_PERF_POLICY_RELIABILITY: "reliability",
    269: "sw_thermal_slowdown",
    270: "hw_thermal_slowdown",
    271: "hw_power_brake_slowdown",
}
_NVLINK_ERRORS = {
    pynvml.NVML_NVLINK_ERROR_DL_REPLAY: "replay",
    pynvml.NVML_NVLINK_ERROR_DL_RECOVERY: "recovery",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT: "crc_flit",
    pynvml.NVML_NVLINK_ERROR_DL_CRC_DATA: "crc_data",
}
# nvml.h's per-link error counter fields (links 0-11): id -> (link, counter name).
_NVLINK_ERROR_FIELDS = {
    getattr(pynvml, f"NVML_FI_DEV_NVLINK_{kind}_ERROR_COUNT_L{link}"): (link, name)
    for kind, name in (
        ("CRC_FLIT", "crc_flit"),
        ("CRC_DATA", "crc_data"),
        ("REPLAY", "replay"),
        ("RECOVERY", "recovery"),
    )
    for link in range(12)
}
# Fields that answer what an entry point answers: a GPU that lists the entry point as
# unsupported does not support the field either.
_FIELD_CALLS = {
    pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION: "nvmlDeviceGetTotalEnergyConsumption",
    pynvml.NVML_FI_DEV_POWER_AVERAGE: "nvmlDeviceGetPowerUsage",
    pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER: "nvmlDeviceGetPcieReplayCounter",
    **{fid: "nvmlDeviceGetNvLinkErrorCounter" for fid in _NVLINK_ERROR_FIELDS},
}
ENGINE_SAMPLING_US = 167_000  # the sampling period the engine utilisation calls report
# The driver's sample buffers (docs/simulator.md, "Sample buffers"): nvmlDeviceGetSamples'
# GPU/memory utilisation every 1/6 s (nvml.h: a sample period "between 1 second and 1/6
# second, depending on the product"), per-process SM samples every 100 ms; each buffer
# holds the last 20 s (nvml.h documents no length: the simulator's choice).
UTILIZATION_SAMPLE_US = ENGINE_SAMPLING_US
UTILIZATION_SAMPLES_KEPT = 120
PROCESS_SAMPLE_US = 100_000
PROCESS_SAMPLES_KEPT = 200
# activity kept: a process sample up to 20 s old averages the 20 s before it
_SAMPLE_HISTORY_S = 41.0
_SUPPORTED_EVENTS = (
    pynvml.nvmlEventTypeXidCriticalError
    | pynvml.nvmlEventTypeSingleBitEccError
    | pynvml.nvmlEventTypeDoubleBitEccError
)


class _ProcessInfoR535Early(ctypes.Structure):
    """``nvmlProcessInfo_t`` as drivers 535.43.02 to 535.86.05 wrote it through the ``_v3``
    listings (nvml.h of those releases): the v2 fields plus usedGpuCcProtectedMemory, 32
    bytes per entry where pynvml (>= 12.535.108) reads 24."""

    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
        ("usedGpuCcProtectedMemory", ctypes.c_ulonglong),
    ]


def _value(arg: Any) -> Any:
    """A ctypes scalar passed by value, or a plain Python number."""
    return arg.value if hasattr(arg, "value") else arg


def _out(arg: Any) -> Any:
    """The object behind ``byref(x)``."""
    return arg._obj


def _set_pointer(pointer: Any, address: int) -> None:
    ctypes.c_void_p.from_buffer(pointer).value = address


def _address(pointer: Any) -> int:
    return ctypes.cast(pointer, ctypes.c_void_p).value or 0


def device_call(fn: Callable[..., int]) -> Callable[..., int]:
    """Resolve the handle, then answer lost / unsupported the way the driver would."""

    @functools.wraps(fn)
    def wrapper(self: SimNvmlLibrary, handle: Any, *args: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        node = self.node
        node.advance()
        address = _address(handle)
        if node.scenario.call_errors:
            resolved = self.resolve(address)
            if resolved is not None:
                self.stall(fn.__name__, *resolved)
        with node.lock:
            resolved = self.resolve(address)
            if resolved is None:
                return INVALID_ARGUMENT
            gpu, mig = resolved
            if gpu.lost or (mig is None and address != self._gpu_address(gpu)):
                return GPU_IS_LOST  # lost, or a handle from before it was last lost
            if fn.__name__ in gpu.unsupported:
                return NOT_SUPPORTED
            if node.scenario.call_errors:
                error = self.injected_error(fn.__name__, gpu, mig)
                if error is not None:
                    return error
                self.injected_raise(fn.__name__, gpu, mig)
            return fn(self, gpu, mig, *args)

    return wrapper


class SimNvmlLibrary:
    """Stands where ``ctypes.CDLL('libnvidia-ml.so.1')`` would."""

    def __init__(self, node: SimNode) -> None:
        self.node = node
        self._init_count = 0  # nvmlInit is reference-counted, as in the real library
        self._ids = itertools.count(1)
        self._gpm_samples: dict[int, _GpmSample | None] = {}
        self._gpm_refreshed: dict[tuple[int, int | None], tuple[float, dict[str, float]]] = {}
        self._event_sets: dict[int, dict[str, Any]] = {}
        self._generation: dict[int, int] = {}  # GPU index -> times it came back
        self._seen_lost: set[int] = set()
        self._activity_log: dict[int, list[_Activity]] = {}  # GPU index -> sample history
        self.calls = CallCount(self)  # every call pynvml makes, where install() counts

    # -- handles ----------------------------------------------------------------------

    def _gpu_address(self, gpu: SimGpu) -> int:
        """The handle of a GPU as of now: a new one each time it is back from being
        lost (noticed at the first call that finds it lost, or back)."""
        if gpu.lost:
            self._seen_lost.add(gpu.index)
        elif gpu.index in self._seen_lost:
            self._seen_lost.discard(gpu.index)
            self._generation[gpu.index] = self._generation.get(gpu.index, 0) + 1
        return _GPU_BASE + self._generation.get(gpu.index, 0) * _GPU_STRIDE + gpu.index

    def resolve(self, address: int) -> tuple[SimGpu, SimMig | None] | None:
        """The GPU (and MIG instance) a handle's address names, if any."""
        gpus = self.node.gpus
        if address >= _MIG_BASE:
            gpu_index, mig_index = divmod(address - _MIG_BASE, 0x100)
            if gpu_index < len(gpus) and mig_index < len(gpus[gpu_index].mig):
                return gpus[gpu_index], gpus[gpu_index].mig[mig_index]
            return None
        if _GPU_BASE <= address < _MIG_BASE:
            index = (address - _GPU_BASE) % _GPU_STRIDE
            return (gpus[index], None) if index < len(gpus) else None
        return None

    def injected_error(self, call: str, gpu: SimGpu | None, mig: SimMig | None) -> int | None:
        """The error a scenario's ``call_errors`` make this call answer now, if any."""
        now = self.node.now()
        index = None if gpu is None else gpu.index
        slot = None if gpu is None or mig is None else gpu.mig.index(mig)
        for entry in self.node.scenario.call_errors:
            if entry.error is not None and entry.applies(call, index, slot, now):
                return entry.error
        return None

    def injected_raise(self, call: str, gpu: SimGpu | None, mig: SimMig | None) -> None:
        """Raise the Python exception a scenario's ``call_errors`` entry names (``raise``)
        for this call now, as ctypes raises inside pynvml on a binding mismatch."""
        now = self.node.now()
        index = None if gpu is None else gpu.index
        slot = None if gpu is None or mig is None else gpu.mig.index(mig)
        for entry in self.node.scenario.call_errors:
            if entry.raises is not None and entry.applies(call, index, slot, now):
                raise PYTHON_ERRORS[entry.raises](f"simulated binding mismatch in {call}")

    def stall(self, call: str, gpu: SimGpu | None, mig: SimMig | None) -> None:
        """Block as long as a scenario's ``delay_s`` says, outside the node's lock, so
        the event thread and the simulator go on meanwhile."""
        now = self.node.now()
        index = None if gpu is None else gpu.index
        slot = None if gpu is None or mig is None else gpu.mig.index(mig)
        delay = max(
            (
                e.delay_s
                for e in self.node.scenario.call_errors
                if e.applies(call, index, slot, now)
            ),
            default=0.0,
        )
        if delay > 0:
            time.sleep(delay)

    # -- system -----------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: Any) -> int:
        error = self.node.scenario.nvml_init_error
        if error is not None:
            return error
        with self.node.lock:
            self._init_count += 1
        return SUCCESS

    def nvmlShutdown(self) -> int:
        with self.node.lock:
            if self._init_count == 0:
                return UNINITIALIZED
            self._init_count -= 1
        return SUCCESS

    @property
    def initialised(self) -> bool:
        return self._init_count > 0

    @property
    def nvmlErrorString(self) -> Callable[[Any], bytes]:
        """A plain function: pynvml sets ``restype`` on it as on a ctypes function, which a
        bound method refuses (str() of an error code pynvml has no text for would raise)."""

        def error_string(result: Any) -> bytes:
            return f"simulated NVML error {_value(result)}".encode()

        return error_string

    def _string(self, buf: Any, text: str) -> int:
        if not self.initialised:
            return UNINITIALIZED
        buf.value = text.encode()
        return SUCCESS

    def nvmlSystemGetDriverVersion(self, buf: Any, size: Any) -> int:
        return self._string(buf, self.node.scenario.driver_version)

    def nvmlSystemGetNVMLVersion(self, buf: Any, size: Any) -> int:
        return self._string(buf, self.node.scenario.nvml_version)

    def nvmlSystemGetCudaDriverVersion_v2(self, out: Any) -> int:
        _out(out).value = self.node.scenario.cuda_driver_version
        return SUCCESS

    nvmlSystemGetCudaDriverVersion = nvmlSystemGetCudaDriverVersion_v2

    def nvmlDeviceGetCount_v2(self, out: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        self.node.advance()
        error = self.injected_error("nvmlDeviceGetCount_v2", None, None)
        if error is not None:
            return error
        _out(out).value = 0 if self.node.scenario.nvml_sees_no_gpu else len(self.node.gpus)
        return SUCCESS

    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, out: Any) -> int:
        if not self.initialised:
            return UNINITIALIZED
        i = _value(index)
        if not 0 <= i < len(self.node.gpus):
            return INVALID_ARGUMENT
        if self.node.scenario.call_errors:  # e.g. NO_PERMISSION: nvml.h, this call's returns
            error = self.injected_error("nvmlDeviceGetHandleByIndex_v2", self.node.gpus[i], None)
            if error is not None:
                return error
        with self.node.lock:
            _set_pointer(_out(out), self._gpu_address(self.node.gpus[i]))
        return SUCCESS

    # -- identity ---------------------------------------------------------------------

    @device_call
    def nvmlDeviceGetUUID(self, gpu: SimGpu, mig: SimMig | None, buf: Any, size: Any) -> int:
        buf.value = (mig.uuid if mig else gpu.uuid).encode()
        return SUCCESS

    @device_call
    def nvmlDeviceGetName(self, gpu: SimGpu, mig: SimMig | None, buf: Any, size: Any) -> int:
        # surrogateescape: a scenario name with "\udcff" answers the byte 0xff, not UTF-8,
        # as a corrupted board name would (pynvml's decode of it raises)
        name = f"{gpu.name} MIG {mig.profile}" if mig else gpu.name
        buf.value = name.encode("utf-8", "surrogateescape")
        return SUCCESS

    @device_call
    def nvmlDeviceGetPciInfo_v3(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        info = _out(out)
        domain, bus, rest = gpu.pci_bus_id.split(":")
        info.busId = gpu.pci_bus_id.encode()
        info.busIdLegacy = gpu.pci_bus_id[4:].encode()
        info.domain, info.bus, info.device = int(domain, 16), int(bus, 16), int(rest[:2], 16)
        info.pciDeviceId = 0x233010DE
        return SUCCESS

    @device_call
    def nvmlDeviceGetMinorNumber(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = gpu.minor
        return SUCCESS

    # -- memory and utilisation -------------------------------------------------------

    def _mig_used(self, gpu: SimGpu, mig: SimMig) -> int:
        slot = gpu.mig.index(mig)
        return sum(p.memory for p in self.node.processes if p.gpu == gpu.index and p.mig == slot)

    @device_call
    def nvmlDeviceGetMemoryInfo(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        """v1: ``used`` includes driver-reserved memory, as on real drivers."""
        info = _out(out)
        if mig:
            info.total, info.used = mig.memory_total, self._mig_used(gpu, mig)
        else:
            info.total = gpu.memory_total
            info.used = self.node.memory_used(gpu) + gpu.memory_reserved
        info.free = info.total - info.used
        return SUCCESS

    @device_call
    def nvmlDeviceGetMemoryInfo_v2(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        info = _out(out)
        if info.version != pynvml.nvmlMemory_v2:
            return VERSION_MISMATCH
        if mig:
            info.total, info.reserved = mig.memory_total, 0
            info.used = self._mig_used(gpu, mig)
        else:
            info.total, info.reserved = gpu.memory_total, gpu.memory_reserved
            info.used = self.node.memory_used(gpu)
        info.free = info.total - info.reserved - info.used
        return SUCCESS

    @device_call
    def nvmlDeviceGetUtilizationRates(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        if mig or gpu.mig:  # the driver does not report GPU-Util in MIG mode
            return NOT_SUPPORTED
        util = _out(out)
        util.gpu, util.memory = self.node.utilization_now(gpu), gpu.utilization_memory
        return SUCCESS

    @device_call
    def nvmlDeviceGetTemperature(
        self, gpu: SimGpu, mig: SimMig | None, sensor: Any, out: Any
    ) -> int:
        _out(out).value = gpu.temperature
        return SUCCESS

    @device_call
    def nvmlDeviceGetPowerUsage(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = gpu.power_mw
        return SUCCESS

    @device_call
    def nvmlDeviceGetEnforcedPowerLimit(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = gpu.power_limit_mw
        return SUCCESS

    @device_call
    def nvmlDeviceGetPowerManagementLimit(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        """The limit set by power management; the enforced one is the lowest of it and
        any other constraint, and the simulated GPUs have none other."""
        _out(out).value = gpu.power_limit_mw
        return SUCCESS

    @device_call
    def nvmlDeviceGetTotalEnergyConsumption(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = self._energy_mj(gpu)
        return SUCCESS

    def _energy_mj(self, gpu: SimGpu) -> int:
        """Energy grows with power over simulated time, like the real counter."""
        return gpu.energy_mj + int(gpu.power_mw * self.node.now())

    @device_call
    def nvmlDeviceGetClockInfo(self, gpu: SimGpu, mig: SimMig | None, clock: Any, out: Any) -> int:
        kind = _value(clock)
        if kind == pynvml.NVML_CLOCK_SM:
            _out(out).value = gpu.clock_sm
        elif kind == pynvml.NVML_CLOCK_MEM:
            _out(out).value = gpu.clock_memory
        else:
            return NOT_SUPPORTED
        return SUCCESS

    @device_call
    def nvmlDeviceGetCurrentClocksEventReasons(
        self, gpu: SimGpu, mig: SimMig | None, out: Any
    ) -> int:
        _out(out).value = gpu.clock_event_reasons
        return SUCCESS

    @device_call
    def nvmlDeviceGetCurrentClocksThrottleReasons(
        self, gpu: SimGpu, mig: SimMig | None, out: Any
    ) -> int:
        """The same bits under the name drivers before R535 export (deprecated since)."""
        _out(out).value = gpu.clock_event_reasons
        return SUCCESS

    @device_call
    def nvmlDeviceGetPcieReplayCounter(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = gpu.pcie_replay
        return SUCCESS

    @device_call
    def nvmlDeviceGetTotalEccErrors(
        self, gpu: SimGpu, mig: SimMig | None, error_type: Any, counter_type: Any, out: Any
    ) -> int:
        corrected = _value(error_type) == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED
        _out(out).value = gpu.ecc_corrected if corrected else gpu.ecc_uncorrected
        return SUCCESS

    @device_call
    def nvmlDeviceGetRemappedRows(
        self, gpu: SimGpu, mig: SimMig | None, corr: Any, unc: Any, pending: Any, failure: Any
    ) -> int:
        _out(corr).value = gpu.remapped_correctable
        _out(unc).value = gpu.remapped_uncorrectable
        _out(pending).value = int(gpu.remapped_pending)
        _out(failure).value = int(gpu.remapped_failure)
        return SUCCESS

    @device_call
    def nvmlDeviceGetFieldValues(
        self, gpu: SimGpu, mig: SimMig | None, count: Any, values: Any
    ) -> int:
        """Per-field answers, as the driver gives them: unknown fields, fields newer than
        the driver and fields the GPU lists in ``unsupported`` answer NOT_SUPPORTED."""
        entries = _out(values)
        stamp = int((SIM_EPOCH_S + self.node.now()) * 1_000_000)
        if gpu.field_answers == "unwritten":  # the call answers, no entry is written
            return SUCCESS
        code_only = gpu.field_answers == "code_only"  # type and value left as handed over
        for i in range(_value(count)):
            entry = entries[i]
            self.calls.fields[entry.fieldId] += 1
            entry.timestamp = stamp
            handed = (entry.valueType, entry.value.ullVal) if code_only else None
            entry.nvmlReturn = self._field(gpu, entry)
            if handed is not None:
                entry.valueType, entry.value.ullVal = handed
        if gpu.field_answers not in (None, "code_only"):
            _broken_field_answers(gpu.field_answers, [entries[i] for i in range(_value(count))])
        return SUCCESS

    def _driver_branch(self) -> int:
        return int(self.node.scenario.driver_version.split(".")[0])

    def _field(self, gpu: SimGpu, entry: Any) -> int:
        """Fill one field value; its return code."""
        fid, scope = entry.fieldId, entry.scopeId
        if _FIELD_NAMES.get(fid, set()) & gpu.unsupported:
            return NOT_SUPPORTED
        if _FIELD_CALLS.get(fid) in gpu.unsupported:
            return NOT_SUPPORTED
        if self._driver_branch() < FIELDS_ADDED_IN_DRIVER.get(fid, 0):
            return NOT_SUPPORTED
        now = self.node.now()
        if fid == pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION and gpu.recovery_action is not None:
            return _set_uint(entry, gpu.recovery_action)
        if fid == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            temperature = gpu.memory_temperature
            _set_uint(entry, gpu.temperature + 5 if temperature is None else temperature)
            if self._driver_branch() == 545:  # nvbugs/4300930: typed double, written as uint
                entry.valueType = pynvml.NVML_VALUE_TYPE_DOUBLE
            return SUCCESS
        if fid in _DURATION_FIELDS:
            return _set_ull(entry, self.node.clock_event_time(gpu.index)[_DURATION_FIELDS[fid]])
        if fid == pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES:
            return self._pcie_bytes(entry, gpu.pcie_tx_bytes_per_s * now)
        if fid == pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES:
            return self._pcie_bytes(entry, gpu.pcie_rx_bytes_per_s * now)
        if fid == pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION:
            return _set_ull(entry, self._energy_mj(gpu))
        if fid == pynvml.NVML_FI_DEV_POWER_AVERAGE:
            # the GPU's own power (scope NVML_POWER_SCOPE_GPU), what nvmlDeviceGetPowerUsage
            # answers; the module and memory scopes are not simulated (an H200 on x86 has
            # no module scope either)
            if scope != pynvml.NVML_POWER_SCOPE_GPU:
                return NOT_SUPPORTED
            return _set_uint(entry, gpu.power_mw)
        if fid == pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER:
            return _set_uint(entry, gpu.pcie_replay)
        if fid in _NVLINK_ERROR_FIELDS:
            link, name = _NVLINK_ERROR_FIELDS[fid]
            if not 0 <= link < gpu.nvlink_links:
                return NOT_SUPPORTED
            return _set_ull(entry, gpu.nvlink_errors.get(link, {}).get(name, 0))
        if fid == pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT and gpu.nvlink_links:
            return _set_uint(entry, gpu.nvlink_links)
        if fid in (
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
            pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
        ):
            return self._nvlink_kib(gpu, entry, scope, now)
        return NOT_SUPPORTED

    def _pcie_bytes(self, entry: Any, value: float) -> int:
        """A PCIe byte counter as wide as the scenario's driver answers it: 64 bits, or
        (``pcie_counter_bits: 32``, as driver 580.159.04 on an H200) value type 1, the
        count modulo 2**32."""
        if self.node.scenario.pcie_counter_bits == 32:
            return _set_uint(entry, int(value) % 2**32)
        return _set_ull(entry, value)

    def _nvlink_kib(self, gpu: SimGpu, entry: Any, link: int, now: float) -> int:
        """A link's data KiB since the driver loaded; links that are down never carried any."""
        if not gpu.nvlink_links:
            return NOT_SUPPORTED
        if link >= gpu.nvlink_links:
            return INVALID_ARGUMENT
        tx = entry.fieldId == pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX
        rate = gpu.nvlink_tx_bytes_per_s if tx else gpu.nvlink_rx_bytes_per_s
        return _set_ull(entry, 0 if link in gpu.nvlink_inactive else rate * now / 1024)

    # -- engines, fans, interconnect -----------------------------------------------------

    def _engine(self, percent: int, util: Any, period: Any) -> int:
        _out(util).value = percent
        _out(period).value = ENGINE_SAMPLING_US
        return SUCCESS

    @device_call
    def nvmlDeviceGetEncoderUtilization(
        self, gpu: SimGpu, mig: SimMig | None, util: Any, period: Any
    ) -> int:
        return self._engine(gpu.encoder_utilization, util, period)

    @device_call
    def nvmlDeviceGetDecoderUtilization(
        self, gpu: SimGpu, mig: SimMig | None, util: Any, period: Any
    ) -> int:
        return self._engine(gpu.decoder_utilization, util, period)

    @device_call
    def nvmlDeviceGetNumFans(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        """Passively cooled (data-centre) GPUs have no fans to count."""
        if not gpu.fans:
            return NOT_SUPPORTED
        _out(out).value = len(gpu.fans)
        return SUCCESS

    @device_call
    def nvmlDeviceGetFanSpeed_v2(self, gpu: SimGpu, mig: SimMig | None, fan: Any, out: Any) -> int:
        i = _value(fan)
        if not gpu.fans:
            return NOT_SUPPORTED
        if not 0 <= i < len(gpu.fans):
            return INVALID_ARGUMENT
        _out(out).value = gpu.fans[i]
        return SUCCESS

    @device_call
    def nvmlDeviceGetFanSpeed(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        """The first fan, as drivers before nvmlDeviceGetNumFans report it."""
        if not gpu.fans:
            return NOT_SUPPORTED
        _out(out).value = gpu.fans[0]
        return SUCCESS

    def _link(self, gpu: SimGpu, link: Any) -> int | None:
        """The link index, or the error a GPU without it answers."""
        if not gpu.nvlink_links:
            return None
        i = _value(link)
        return i if 0 <= i < gpu.nvlink_links else -1

    @device_call
    def nvmlDeviceGetNvLinkState(self, gpu: SimGpu, mig: SimMig | None, link: Any, out: Any) -> int:
        i = self._link(gpu, link)
        if i is None:
            return NOT_SUPPORTED
        if i < 0:
            return INVALID_ARGUMENT
        enabled = i not in gpu.nvlink_inactive
        _out(out).value = pynvml.NVML_FEATURE_ENABLED if enabled else pynvml.NVML_FEATURE_DISABLED
        return SUCCESS

    @device_call
    def nvmlDeviceGetNvLinkErrorCounter(
        self, gpu: SimGpu, mig: SimMig | None, link: Any, counter: Any, out: Any
    ) -> int:
        i = self._link(gpu, link)
        name = _NVLINK_ERRORS.get(_value(counter))
        if i is None:
            return NOT_SUPPORTED
        if i < 0 or name is None:
            return INVALID_ARGUMENT
        _out(out).value = gpu.nvlink_errors.get(i, {}).get(name, 0)
        return SUCCESS

    @device_call
    def nvmlDeviceGetCurrPcieLinkGeneration(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = self.node.pcie_link(gpu)[0]
        return SUCCESS

    @device_call
    def nvmlDeviceGetMaxPcieLinkGeneration(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = gpu.pcie_max_generation
        return SUCCESS

    @device_call
    def nvmlDeviceGetCurrPcieLinkWidth(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = self.node.pcie_link(gpu)[1]
        return SUCCESS

    @device_call
    def nvmlDeviceGetMaxPcieLinkWidth(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = gpu.pcie_max_width
        return SUCCESS

    @device_call
    def nvmlDeviceGetPcieThroughput(
        self, gpu: SimGpu, mig: SimMig | None, counter: Any, out: Any
    ) -> int:
        """KB/s over the driver's last 20 ms: the rates behind the PCIe byte counters."""
        kind = _value(counter)
        if kind == pynvml.NVML_PCIE_UTIL_TX_BYTES:
            _out(out).value = int(gpu.pcie_tx_bytes_per_s / 1024)
        elif kind == pynvml.NVML_PCIE_UTIL_RX_BYTES:
            _out(out).value = int(gpu.pcie_rx_bytes_per_s / 1024)
        else:
            return INVALID_ARGUMENT
        return SUCCESS

    @device_call
    def nvmlDeviceGetRetiredPages(
        self, gpu: SimGpu, mig: SimMig | None, cause: Any, count: Any, pages: Any
    ) -> int:
        dbe = _value(cause) == pynvml.NVML_PAGE_RETIREMENT_CAUSE_DOUBLE_BIT_ECC_ERROR
        retired = gpu.retired_pages_dbe if dbe else gpu.retired_pages_sbe
        capacity = _out(count).value
        _out(count).value = retired
        if pages is None or capacity < retired:
            return INSUFFICIENT_SIZE if retired else SUCCESS
        for i in range(retired):
            pages[i] = 0x1000 * (i + 1)
        return SUCCESS

    # -- processes --------------------------------------------------------------------

    def _processes(self, gpu: SimGpu, mig: SimMig | None, kind: str) -> list[SimProcess]:
        slot = gpu.mig.index(mig) if mig else None
        return [
            p
            for p in self.node.listed_processes(gpu.index)
            if p.kind == kind and (slot is None or p.mig == slot)
        ]

    def _fill(self, gpu: SimGpu, entry: Any, proc: SimProcess) -> None:
        """One process entry; usedGpuMemory NOT_AVAILABLE where the GPU cannot say."""
        entry.pid = proc.pid
        entry.usedGpuMemory = NOT_AVAILABLE_ULL if gpu.process_memory_unavailable else proc.memory
        if proc.mig is not None and gpu.mig:
            entry.gpuInstanceId = gpu.mig[proc.mig].gpu_instance_id
            entry.computeInstanceId = gpu.mig[proc.mig].compute_instance_id
        else:
            entry.gpuInstanceId = entry.computeInstanceId = NOT_AVAILABLE
        if hasattr(entry, "usedGpuCcProtectedMemory"):
            entry.usedGpuCcProtectedMemory = 0  # no confidential computing here

    def _list(
        self, gpu: SimGpu, mig: SimMig | None, kind: str, count: Any, array: Any, v3: bool = False
    ) -> int:
        procs = self._processes(gpu, mig, kind)
        capacity = _out(count).value
        _out(count).value = len(procs)
        if not procs:
            return SUCCESS
        if array is not None and capacity < len(procs) and gpu.listing_answers == "cut_short":
            # a broken driver: what fits written, the true count, and success
            for entry, proc in zip(array, procs[:capacity], strict=False):
                self._fill(gpu, entry, proc)
            return SUCCESS
        if array is None or capacity < len(procs):
            return INSUFFICIENT_SIZE
        entries = array
        if v3 and self.node.scenario.process_info_layout == "r535_early":
            # the driver writes its own, wider entries into the caller's array
            wide = _ProcessInfoR535Early * len(procs)
            if ctypes.sizeof(array) < ctypes.sizeof(wide):
                return INSUFFICIENT_SIZE  # the real driver would overrun the buffer
            entries = wide.from_address(ctypes.addressof(array))
        for entry, proc in zip(entries, procs, strict=False):
            self._fill(gpu, entry, proc)
        return SUCCESS

    @device_call
    def nvmlDeviceGetComputeRunningProcesses_v3(
        self, gpu: SimGpu, mig: SimMig | None, count: Any, array: Any
    ) -> int:
        return self._list(gpu, mig, "compute", count, array, v3=True)

    @device_call
    def nvmlDeviceGetGraphicsRunningProcesses_v3(
        self, gpu: SimGpu, mig: SimMig | None, count: Any, array: Any
    ) -> int:
        return self._list(gpu, mig, "graphics", count, array, v3=True)

    @device_call
    def nvmlDeviceGetMPSComputeRunningProcesses_v3(
        self, gpu: SimGpu, mig: SimMig | None, count: Any, array: Any
    ) -> int:
        return self._list(gpu, mig, "mps", count, array, v3=True)

    @device_call
    def nvmlDeviceGetRunningProcessDetailList(
        self, gpu: SimGpu, mig: SimMig | None, plist: Any
    ) -> int:
        """R535.104+: every process of one mode, with conf-compute protected memory (0)."""
        detail = _out(plist)
        if detail.version != pynvml.nvmlProcessDetailList_v1:
            return VERSION_MISMATCH
        kind = _PROCESS_MODES.get(detail.mode)
        if kind is None:
            return INVALID_ARGUMENT
        procs = self._processes(gpu, mig, kind)
        capacity = detail.numProcArrayEntries
        detail.numProcArrayEntries = len(procs)
        if not procs:
            return SUCCESS
        if not detail.procArray or capacity < len(procs):
            return INSUFFICIENT_SIZE
        for i, proc in enumerate(procs):
            self._fill(gpu, detail.procArray[i], proc)
        return SUCCESS

    @device_call
    def nvmlDeviceGetConfComputeMemSizeInfo(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        """R535+ has the symbol; the simulated GPUs run without confidential computing."""
        return NOT_SUPPORTED

    # drivers without _v3 (before R510, and 535.98): the 24-byte struct pynvml reads
    @device_call
    def nvmlDeviceGetComputeRunningProcesses_v2(
        self, gpu: SimGpu, mig: SimMig | None, count: Any, array: Any
    ) -> int:
        return self._list(gpu, mig, "compute", count, array)

    @device_call
    def nvmlDeviceGetGraphicsRunningProcesses_v2(
        self, gpu: SimGpu, mig: SimMig | None, count: Any, array: Any
    ) -> int:
        return self._list(gpu, mig, "graphics", count, array)

    @device_call
    def nvmlDeviceGetMPSComputeRunningProcesses_v2(
        self, gpu: SimGpu, mig: SimMig | None, count: Any, array: Any
    ) -> int:
        return self._list(gpu, mig, "mps", count, array)

    # -- sample buffers: GPU/memory utilisation samples, per-process SM samples --------

    def _activity(self, gpu: SimGpu) -> list[_Activity]:
        """The GPU's activity as the sample buffers saw it: one entry per state (GPU-Util,
        memory utilisation, SM share of each process, duty cycle), in force from its
        ``since`` until the next entry's. Worked out here, at a buffer read, not at every
        tick: a state that changed since the last read is dated from the latest timeline
        event applied (an event changes the state; between two reads that saw two events
        change this GPU, the state in between is not seen). A GPU read for the first time
        has been in its state since that latest event or, before any, for as long as the
        buffers reach back: a reader finds them full, as on a node that ran before it."""
        node = self.node
        now = node.now()
        state = _Activity(
            0.0,
            node.utilization_gpu(gpu),
            gpu.utilization_memory,
            tuple((p.pid, p.sm) for p in node.listed_processes(gpu.index) if p.alive and p.sm > 0),
            gpu.duty,
        )
        history = self._activity_log.setdefault(gpu.index, [])
        if not history or history[-1][1:] != state[1:]:
            changed = node.last_event_at()
            if not history:  # as on a node that ran before the reader came: buffers full
                since = now - _SAMPLE_HISTORY_S if changed is None else changed
            else:
                since = max(history[-1].since, now if changed is None else changed)
            history.append(state._replace(since=since))
        horizon = now - _SAMPLE_HISTORY_S
        while len(history) > 1 and history[1].since <= horizon:
            del history[0]
        return history

    def _utilization_samples(
        self, gpu: SimGpu, gpu_util: bool, last_seen: int
    ) -> list[tuple[int, int]]:
        """(timestamp µs, percent) of each utilisation sample newer than ``last_seen``, oldest
        first. Sample k covers ((k-1)·P, k·P] (epoch µs, P = UTILIZATION_SAMPLE_US) and holds
        the percent times the share of it the GPU was busy (a ``duty:`` cycle's idle part
        counts 0 for GPU-Util). Each value is the rounded integral up to its end minus the
        rounded integral up to its start, so a run of samples sums to the true integral
        within 1 (percent x period) per state: nothing is lost to rounding. Periods whose
        value is 0 hold no sample: the driver's buffer "runs dry" while the GPU is idle."""
        period = UTILIZATION_SAMPLE_US
        period_s = period / 1e6
        history = self._activity(gpu)
        last = _period_index(self.node.now(), period)
        first = max(last - UTILIZATION_SAMPLES_KEPT + 1, last_seen // period + 1)
        if first > last or not any(  # an idle GPU costs one look, not one per period
            (seg.gpu if gpu_util else seg.memory) > 0
            and (i + 1 == len(history) or history[i + 1].since > _period_start(first, period))
            for i, seg in enumerate(history)
        ):
            return []
        out: list[tuple[int, int]] = []
        for k in range(first, last + 1):
            start, end = _period_start(k, period), _period_start(k + 1, period)
            value = 0
            for i, seg in enumerate(history):
                seg_end = history[i + 1].since if i + 1 < len(history) else math.inf
                lo, hi = max(start, seg.since), min(end, seg_end)
                if hi <= lo:
                    continue
                rate = seg.gpu if gpu_util else seg.memory  # memory: as UtilizationRates
                duty = seg.duty if gpu_util else None
                value += round(rate * SimNode.busy_seconds(duty, seg.since, hi) / period_s)
                value -= round(rate * SimNode.busy_seconds(duty, seg.since, lo) / period_s)
            if value > 0:
                out.append((k * period, value))
        return out

    @device_call
    def nvmlDeviceGetSamples(
        self,
        gpu: SimGpu,
        mig: SimMig | None,
        sampling_type: Any,
        last_seen: Any,
        value_type: Any,
        count: Any,
        samples: Any,
    ) -> int:
        """GPU or memory utilisation samples newer than ``last_seen`` (epoch µs) from the
        last ``UTILIZATION_SAMPLES_KEPT`` periods, oldest first, as unsigned ints. With
        ``samples`` NULL: how many there are. NOT_FOUND when there is none. Other sample
        types (power, clocks) are not kept here: NOT_SUPPORTED."""
        kind = _value(sampling_type)
        wanted = (pynvml.NVML_GPU_UTILIZATION_SAMPLES, pynvml.NVML_MEMORY_UTILIZATION_SAMPLES)
        if kind not in wanted:
            return NOT_SUPPORTED if 0 <= kind < _SAMPLING_TYPE_COUNT else INVALID_ARGUMENT
        if mig or gpu.mig:  # nvml.h: utilisation samples are not supported in MIG mode
            return NOT_SUPPORTED
        if count is None or (samples is not None and _out(count).value == 0):
            return INVALID_ARGUMENT
        found = self._utilization_samples(
            gpu, kind == pynvml.NVML_GPU_UTILIZATION_SAMPLES, _value(last_seen)
        )
        if not found:
            return NOT_FOUND
        _out(value_type).value = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        if samples is None:
            _out(count).value = len(found)
            return SUCCESS
        written = found[: _out(count).value]  # the oldest that fit: read on from the last
        for entry, (stamp, value) in zip(samples, written, strict=False):
            entry.timeStamp = stamp
            entry.sampleValue.uiVal = value
        _out(count).value = len(written)
        return SUCCESS

    def _process_samples(self, gpu: SimGpu, last_seen: int) -> list[tuple[int, int, int]]:
        """(pid, timestamp µs, SM %) of each process active in a 100 ms period newer than
        ``last_seen`` within the buffer (the last ``PROCESS_SAMPLES_KEPT`` periods): one
        entry per process, as the driver answers. Its timestamp ends the last period the
        process was active in; its SM % is the mean, rounded, of the process's ``sm``
        times the GPU's busy share over the periods after ``max(last_seen, timestamp -
        20 s)`` up to the timestamp (idle ones 0), so SM % / 100 x (timestamp -
        max(last_seen, timestamp - 20 s)) is its SM time there."""
        period = PROCESS_SAMPLE_US
        history = self._activity(gpu)
        last = _period_index(self.node.now(), period)
        after = last_seen // period  # before the history began: no activity
        seen = self._process_activity(history, max(after, last - PROCESS_SAMPLES_KEPT), last)
        out = []
        for pid, (_, until) in sorted(seen.items()):
            k = min(last, max(after + 1, _period_holding(until, period)))
            first = max(after, k - PROCESS_SAMPLES_KEPT)
            sm_seconds = self._process_activity(history, first, k)[pid][0]
            out.append((pid, k * period, round(sm_seconds / ((k - first) * period / 1e6))))
        return out

    @staticmethod
    def _process_activity(
        history: list[_Activity], after: int, last: int
    ) -> dict[int, tuple[float, float]]:
        """pid -> (SM % x busy seconds, end of its last busy stretch) over the process
        sample periods after ``after`` up to ``last``."""
        period = PROCESS_SAMPLE_US
        span_start, span_end = _period_start(after + 1, period), _period_start(last + 1, period)
        active: dict[int, tuple[float, float]] = {}
        for i, seg in enumerate(history):
            seg_end = history[i + 1].since if i + 1 < len(history) else math.inf
            lo, hi = max(span_start, seg.since), min(span_end, seg_end)
            busy = SimNode.busy_seconds(seg.duty, lo, hi)
            until = SimNode.last_busy_instant(seg.duty, lo, hi)
            if busy <= 0 or until is None:
                continue
            for pid, sm in seg.sm:
                total, latest = active.get(pid, (0.0, until))
                active[pid] = (total + sm * busy, max(latest, until))
        return active

    @device_call
    def nvmlDeviceGetProcessUtilization(
        self, gpu: SimGpu, mig: SimMig | None, samples: Any, count: Any, last_seen: Any
    ) -> int:
        """One sample per process active since ``last_seen`` (µs; _process_samples says
        what it holds); NOT_FOUND when none was. The size asked with ``samples`` NULL
        answers INSUFFICIENT_SIZE, as pynvml expects."""
        if mig or gpu.mig:
            return NOT_SUPPORTED
        found = self._process_samples(gpu, _value(last_seen))
        if not found:
            return NOT_FOUND
        capacity = _out(count).value
        _out(count).value = len(found)
        if samples is None or capacity < len(found):
            return INSUFFICIENT_SIZE
        for entry, (pid, stamp, sm) in zip(samples, found, strict=False):
            entry.pid, entry.timeStamp, entry.smUtil = pid, stamp, sm
            entry.memUtil = sm // 2
            entry.encUtil = entry.decUtil = 0
        return SUCCESS

    # -- MIG --------------------------------------------------------------------------

    @device_call
    def nvmlDeviceGetMigMode(
        self, gpu: SimGpu, mig: SimMig | None, current: Any, pending: Any
    ) -> int:
        _out(current).value = _out(pending).value = int(bool(gpu.mig))
        return SUCCESS

    @device_call
    def nvmlDeviceGetMaxMigDeviceCount(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = MAX_MIG_DEVICES if gpu.mig else 0
        return SUCCESS

    @device_call
    def nvmlDeviceGetMigDeviceHandleByIndex(
        self, gpu: SimGpu, mig: SimMig | None, index: Any, out: Any
    ) -> int:
        i = _value(index)
        if not gpu.mig:
            return INVALID_ARGUMENT
        if not 0 <= i < len(gpu.mig):
            return NOT_FOUND
        _set_pointer(_out(out), _MIG_BASE + gpu.index * 0x100 + i)
        return SUCCESS

    @device_call
    def nvmlDeviceGetGpuInstanceProfileInfoV(
        self, gpu: SimGpu, mig: SimMig | None, profile: Any, out: Any
    ) -> int:
        """A GPU instance profile of the GPU's model (sim/mig_profiles.py), whatever its
        MIG mode: nvml.h names NOT_SUPPORTED for a device that does not support MIG or a
        profile it lacks, not for MIG mode being off, and NVIDIA's go-nvlib lists the
        profiles of every MIG-capable GPU without looking at the mode. NOT_SUPPORTED for
        models without MIG and for profiles the model lacks."""
        info = _out(out)
        if mig is not None:
            return INVALID_ARGUMENT  # a MIG device handle is not a GPU
        if info.version != pynvml.nvmlGpuInstanceProfileInfo_v2:
            return VERSION_MISMATCH
        wanted = _value(profile)
        if not 0 <= wanted < pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT:
            return INVALID_ARGUMENT
        found = [p for p in profiles_for(gpu.name, gpu.memory_total) if p.constant == wanted]
        if not found:
            return NOT_SUPPORTED
        row = found[0]
        info.id, info.isP2pSupported, info.sliceCount = row.profile_id, 0, row.slices
        info.instanceCount = row.instances
        info.multiprocessorCount = multiprocessors(gpu.name, row.slices)
        info.copyEngineCount = row.slices
        info.decoderCount = info.encoderCount = info.jpegCount = info.ofaCount = 0
        info.memorySizeMB = gpu.memory_total * row.eighths // 8 // (1 << 20)
        info.name = f"MIG {row.name}".encode()
        return SUCCESS

    @device_call
    def nvmlDeviceIsMigDeviceHandle(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = int(mig is not None)
        return SUCCESS

    @device_call
    def nvmlDeviceGetGpuInstanceId(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        if mig is None:
            return INVALID_ARGUMENT
        _out(out).value = mig.gpu_instance_id
        return SUCCESS

    @device_call
    def nvmlDeviceGetComputeInstanceId(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        if mig is None:
            return INVALID_ARGUMENT
        _out(out).value = mig.compute_instance_id
        return SUCCESS

    @device_call
    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
        self, gpu: SimGpu, mig: SimMig | None, out: Any
    ) -> int:
        if mig is None:
            return INVALID_ARGUMENT
        _set_pointer(_out(out), self._gpu_address(gpu))
        return SUCCESS

    # -- GPM (GPU performance monitoring) ---------------------------------------------

    @device_call
    def nvmlGpmQueryDeviceSupport(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).isSupportedDevice = int(gpu.gpm_supported)
        return SUCCESS

    def nvmlGpmSampleAlloc(self, out: Any) -> int:
        sample_id = next(self._ids)
        self._gpm_samples[sample_id] = None
        _set_pointer(_out(out), sample_id)
        return SUCCESS

    def nvmlGpmSampleFree(self, sample: Any) -> int:
        return SUCCESS if self._gpm_samples.pop(_address(sample), 0) != 0 else INVALID_ARGUMENT

    def _gpm_sample(self, gpu: SimGpu, gpu_instance: int | None, sample: Any) -> int:
        """The counters as of their last refresh: a sample within ``GPM_REFRESH_S`` of
        the previous refresh gets the same counters (and time) as that one."""
        if not gpu.gpm_supported:
            return NOT_SUPPORTED
        sample_id = _address(sample)
        if sample_id not in self._gpm_samples:
            return INVALID_ARGUMENT
        key = (gpu.index, gpu_instance)
        now = self.node.now()
        refreshed = self._gpm_refreshed.get(key)
        if refreshed is None or now - refreshed[0] >= GPM_REFRESH_S:
            refreshed = self._gpm_refreshed[key] = (
                now,
                self.node.gpm_counters(gpu.index, gpu_instance),
            )
        self._gpm_samples[sample_id] = (refreshed[0], key, refreshed[1])
        return SUCCESS

    @device_call
    def nvmlGpmSampleGet(self, gpu: SimGpu, mig: SimMig | None, sample: Any) -> int:
        """On a MIG device handle, the counters of its GPU instance."""
        return self._gpm_sample(gpu, mig.gpu_instance_id if mig else None, sample)

    @device_call
    def nvmlGpmMigSampleGet(
        self, gpu: SimGpu, mig: SimMig | None, gpu_instance: Any, sample: Any
    ) -> int:
        """A GPU instance's counters: every compute instance in it counts."""
        gi = _value(gpu_instance)
        if all(m.gpu_instance_id != gi for m in gpu.mig):
            return NOT_FOUND
        return self._gpm_sample(gpu, gi, sample)

    def nvmlGpmMetricsGet(self, request: Any) -> int:
        req = _out(request)
        if req.version != pynvml.NVML_GPM_METRICS_GET_VERSION:
            return VERSION_MISMATCH
        first = self._gpm_samples.get(_address(req.sample1))
        second = self._gpm_samples.get(_address(req.sample2))
        if first is None or second is None or first[1] != second[1]:
            return INVALID_ARGUMENT
        elapsed = second[0] - first[0]
        for i in range(req.numMetrics):
            metric = req.metrics[i]
            key = _GPM_METRIC_KEYS.get(metric.metricId)
            if key is None:
                metric.nvmlReturn = NOT_SUPPORTED
                continue
            delta = second[2][key] - first[2][key]
            metric.value = delta / elapsed if elapsed > 0 else 0.0
            metric.nvmlReturn = SUCCESS
        return SUCCESS

    # -- events (XID, ECC) ------------------------------------------------------------

    @device_call
    def nvmlDeviceGetSupportedEventTypes(self, gpu: SimGpu, mig: SimMig | None, out: Any) -> int:
        _out(out).value = _SUPPORTED_EVENTS
        return SUCCESS

    def nvmlEventSetCreate(self, out: Any) -> int:
        set_id = next(self._ids)
        with self.node.lock:
            # XIDs raised before the set exists are never delivered: bring the node up to
            # now first, or one process's library that has not yet been asked anything
            # (sim/external.py) would deliver the XIDs raised before time 0 as new.
            self.node.advance()
            self._event_sets[set_id] = {"devices": {}, "seen": len(self.node.xids)}
        _set_pointer(_out(out), set_id)
        return SUCCESS

    @device_call
    def nvmlDeviceRegisterEvents(
        self, gpu: SimGpu, mig: SimMig | None, types: Any, event_set: Any
    ) -> int:
        registered = self._event_sets.get(_address(event_set))
        if registered is None:
            return INVALID_ARGUMENT
        registered["devices"][gpu.index] = _value(types)
        return SUCCESS

    def nvmlEventSetWait_v2(self, event_set: Any, out: Any, timeout_ms: Any) -> int:
        """Block until an XID on a registered GPU, or time out (the normal case), or a
        signal arrives (nvml.h: NVML_ERROR_TIMEOUT "if no event arrived in specified
        timeout or interrupt arrived"; wakeups.py)."""
        node = self.node
        deadline = _value(timeout_ms) / 1000.0
        self.stall("nvmlEventSetWait_v2", None, None)
        with node.lock:
            registered = self._event_sets.get(_address(event_set))
            if registered is None:
                return INVALID_ARGUMENT
            node.advance()
            error = self.injected_error("nvmlEventSetWait_v2", None, None)
            if error is not None:  # nvml.h: GPU_IS_LOST, UNKNOWN on any unexpected error
                return error
        began = time.monotonic()
        speed = speed_alone(node.clock)
        with node.wakers.waiting() as wake_fd:
            while True:
                with node.lock:
                    node.advance()
                    for record in node.xids[registered["seen"] :]:
                        registered["seen"] += 1
                        if node.gpus[record.gpu].lost and record.code != 79:
                            continue
                        mask = registered["devices"].get(record.gpu, 0)
                        if mask & pynvml.nvmlEventTypeXidCriticalError:
                            data = _out(out)
                            _set_pointer(data.device, self._gpu_address(node.gpus[record.gpu]))
                            data.eventType = pynvml.nvmlEventTypeXidCriticalError
                            data.eventData = record.code
                            data.gpuInstanceId = record.gpu_instance_id
                            data.computeInstanceId = record.compute_instance_id
                            return SUCCESS
                    waited = time.monotonic() - began  # real time, as the driver's
                    if waited >= deadline:
                        return TIMEOUT
                    # Sleep until the next timeline event is due, as the driver sleeps
                    # until an interrupt: no polling. A clock that another process or a
                    # test moves is looked at again after EVENT_WAIT_STEP_S at the latest
                    # (a test's sync() wakes the wait at once).
                    step = deadline - waited
                    if speed is None:
                        step = min(EVENT_WAIT_STEP_S, step)
                    due = node.seconds_to_next_event()  # simulated seconds
                    if due is not None:
                        step = max(0.001, min(step, due / (speed or 1.0)))
                if not sleep_interruptibly(wake_fd, step):
                    return TIMEOUT

    def nvmlEventSetFree(self, event_set: Any) -> int:
        with self.node.lock:
            return SUCCESS if self._event_sets.pop(_address(event_set), None) else INVALID_ARGUMENT


def _set_uint(entry: Any, value: int) -> int:
    entry.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    entry.value.uiVal = value
    return SUCCESS


def _set_ull(entry: Any, value: float) -> int:
    entry.valueType = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG
    entry.value.ullVal = int(value)
    return SUCCESS


class _Activity(NamedTuple):
    """A GPU's state as its sample buffers record it, from simulated time ``since``."""

    since: float
    gpu: int  # GPU-Util % while busy
    memory: int  # memory utilisation %
    sm: tuple[tuple[int, int], ...]  # (pid, SM %) of each process with SM activity
    duty: SimDuty | None


_SIM_EPOCH_US = SIM_EPOCH_S * 1_000_000
_SAMPLING_TYPE_COUNT = 10  # nvml.h's NVML_SAMPLINGTYPE_COUNT


def _period_index(at: float, period_us: int) -> int:
    """k of the last sample period ((k-1)·P, k·P] (epoch µs) that has ended by simulated
    time ``at``."""
    whole, rest = divmod(_SIM_EPOCH_US, period_us)
    return whole + math.floor((rest + at * 1e6) / period_us)


def _period_holding(at: float, period_us: int) -> int:
    """k of the sample period ((k-1)·P, k·P] that holds simulated time ``at``."""
    whole, rest = divmod(_SIM_EPOCH_US, period_us)
    return whole + math.ceil((rest + at * 1e6) / period_us - 1e-6)


def _period_start(k: int, period_us: int) -> float:
    """Simulated time at which sample period k begins: (k-1)·P epoch µs."""
    return ((k - 1) * period_us - _SIM_EPOCH_US) / 1e6


def _missing(name: str) -> property:
    def lookup(self: SimNvmlLibrary) -> Any:
        if name in self.node.scenario.missing_functions:
            raise AttributeError(name)  # what dlsym failing looks like to pynvml
        return getattr(SimNvmlLibrary, name).__get__(self)  # a test "upgraded" the driver

    return property(lookup)


class CallCount:
    """NVML calls as the driver would see them: every entry point pynvml resolves on the
    library object and calls, by name and by the GPU its handle names (None: a call
    without a GPU handle, such as nvmlGpmMetricsGet or nvmlInit). What ``benchmarks/calls.py``
    reports; on a real node each of these is one ioctl into the driver or more."""

    def __init__(self, library: SimNvmlLibrary) -> None:
        self._library = library
        self.by_function: collections.Counter[str] = collections.Counter()
        self.by_gpu: collections.Counter[int | None] = collections.Counter()
        self.by_gpu_function: collections.Counter[tuple[int | None, str]] = collections.Counter()
        # field ids asked through nvmlDeviceGetFieldValues: on a real driver a field's cost
        # is its own (3.2 ms for energy on an H200, ~4 us for most), not the call's
        self.fields: collections.Counter[int] = collections.Counter()

    def record(self, name: str, args: tuple[Any, ...]) -> None:
        self.by_function[name] += 1
        gpu = None
        if args and isinstance(args[0], pynvml.c_nvmlDevice_t):
            resolved = self._library.resolve(_address(args[0]))
            gpu = None if resolved is None else resolved[0].index
        self.by_gpu[gpu] += 1
        self.by_gpu_function[(gpu, name)] += 1

    def snapshot(self) -> tuple[dict[str, int], dict[int | None, int]]:
        """The counts so far, copied: subtract two snapshots to count a stretch."""
        return dict(self.by_function), dict(self.by_gpu)


class _Counted:
    """What pynvml holds as ``nvmlLib``: the simulated library, each entry point it
    resolves wrapped to count the call first. pynvml caches what it resolves
    (``_nvmlGetFunctionPointer_cache``), so the count is at the C boundary, where a
    real library would be entered."""

    def __init__(self, library: SimNvmlLibrary) -> None:
        self._library = library

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._library, name)
        if not callable(target):
            return target
        record = self._library.calls.record

        def entry(*args: Any) -> Any:
            record(name, args)
            return target(*args)

        return entry


def _broken_field_answers(mode: str, entries: list[Any]) -> None:
    """Spoil answered field values the way ``mode`` (scenario.FIELD_ANSWERS) says."""
    if mode == "reversed":
        answers = [
            (e.fieldId, e.scopeId, e.nvmlReturn, e.valueType, e.value.ullVal) for e in entries
        ]
        for entry, answer in zip(entries, reversed(answers), strict=True):
            (entry.fieldId, entry.scopeId, entry.nvmlReturn, entry.valueType) = answer[:4]
            entry.value.ullVal = answer[4]
        return
    for entry in entries:
        if entry.nvmlReturn != SUCCESS or entry.fieldId == pynvml.NVML_FI_DEV_MEMORY_TEMP:
            continue  # the memory temperature is read as uiVal whatever its type says
        if mode == "unknown_type":
            entry.valueType = 99
        else:
            entry.valueType = pynvml.NVML_VALUE_TYPE_DOUBLE
            entry.value.dVal = math.nan if mode == "nan" else math.inf


def install(node: SimNode, *, count_calls: bool = True, cost: str | None = None) -> SimNvmlLibrary:
    """Make pynvml use the simulated library from now on (process-wide, like dlopen).

    Entry points the scenario's driver lacks are hidden by a subclass whose attributes
    of those names raise AttributeError, as a missing symbol would. With ``count_calls``
    every call pynvml makes is counted (``SimNvmlLibrary.calls``): what tests and
    ``benchmarks/calls.py`` read. An exporter process on a node served elsewhere
    (``external.attach``) is measured whole and counts nothing: the count cost ~0.3 ms of
    its ~7 ms cycle on node-8gpu, work no driver does (benchmarks/README.md).

    ``cost`` names a cost profile (``sim/cost_model.py``; ``none``: none) in place of
    the scenario's ``cost:``. Under one, each call spends the profile's CPU time, outside
    the GIL, before it is answered (``cost_model.Costed``); an unknown name raises
    ``cost_model.CostProfileError`` before anything is installed.
    """
    from exporter.sim.cost_model import Costed, profile  # only here: it needs nothing back

    costs = profile(node.scenario.cost if cost is None else cost)
    missing = sorted(node.scenario.missing_functions)
    cls: type[SimNvmlLibrary] = SimNvmlLibrary
    if missing:
        cls = type(
            "SimNvmlLibraryOlderDriver",
            (SimNvmlLibrary,),
            {name: _missing(name) for name in missing},
        )
    library = cls(node)
    with pynvml.libLoadLock:
        entry_points: Any = _Counted(library) if count_calls else library
        pynvml.nvmlLib = entry_points if costs is None else Costed(entry_points, costs)
        pynvml._nvmlGetFunctionPointer_cache.clear()
    return library
