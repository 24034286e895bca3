"""What each NVML call costs on real hardware, spent by the simulated library.

On a real node every NVML call is an ioctl into the driver, and a few of them cost
milliseconds of CPU (docs/validation.md, "What NVML costs, call by call": an H200 on
driver 580.159.04). The simulated library answers in Python, at Python's cost, so a
comparison between two exporters over it weighs calls by what Python spends on them, not
by what the driver does. A cost profile closes that gap: applied at ``install()``
(``scenario.cost``, or ``python -m exporter.sim --cost NAME`` for every exporter attached
to that node), each simulated call first spends the profile's figure of CPU time, outside
the GIL, as a thread inside a driver call is on a CPU while the process's other Python
threads run on.

``nvmlDeviceGetFieldValues`` is costed per field requested: the sum of each field's
figure. Entry points and fields the profile does not name cost its cheap figures. A name
the simulated library lacks (pynvml then raises FunctionNotFound, as after a failed
dlsym) costs nothing: no driver call is made.

How the time is spent: SHA-256 over a zero buffer (OpenSSL's, which ``hashlib`` runs
with the GIL released for inputs of 2,048 bytes or more), in chunks, until the calling
thread's CPU clock (``time.thread_time_ns``, the kernel's per-thread runtime that
``/proc/<pid>/task/<tid>/schedstat`` and utime + stime also count) has advanced by the
figure; a remainder shorter than one minimal chunk is spun on the clock itself, with the
GIL held for those few microseconds. It is all user time: a driver's is mostly kernel
time (not modelled; docs/simulator.md).
"""

from __future__ import annotations

import hashlib
import mmap
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

NO_COST = "none"  # --cost none: no profile, even where the scenario names one


class CostProfileError(ValueError):
    """An unknown profile name; the message is one line naming the known ones."""


@dataclass(frozen=True)
class CostProfile:
    name: str
    source: str  # where the figures were measured
    calls_us: Mapping[str, float]  # entry point -> µs per call
    fields_us: Mapping[int, float]  # field id -> µs inside nvmlDeviceGetFieldValues
    cheap_call_us: float  # an entry point the table does not name
    cheap_field_us: float  # a field the table does not name

    def field_us(self, field_ids: list[int]) -> float:
        """What one ``nvmlDeviceGetFieldValues`` asking for ``field_ids`` costs."""
        return sum(self.fields_us.get(fid, self.cheap_field_us) for fid in field_ids)

    def call_us(self, name: str, args: tuple[Any, ...]) -> float:
        """What one call of ``name`` with pynvml's ctypes ``args`` costs."""
        if name == FIELD_VALUES:
            ids = _requested_fields(args)
            if ids is not None:
                return self.field_us(ids)
        return self.calls_us.get(name, self.cheap_call_us)


FIELD_VALUES = "nvmlDeviceGetFieldValues"

# -- the H200 profile ------------------------------------------------------------------
# Source: docs/validation.md, "What NVML costs, call by call" (the table at lines ~65-79):
# benchmarks/real_nvml_fields.py on one H200, driver 580.159.04, idle GPU, median of 20
# calls each, every field and call timed alone; nvmlGpmMetricsGet from real_nvml.py
# (in-cycle). Figures the table gives as a range are its midpoint.
H200_CHEAP_CALL_US = 1.0  # "a cheap call about 1 µs alone" (measured 0.9-6.0 µs)
H200_CHEAP_FIELD_US = 4.0  # "a cheap field costs about 4 µs inside a batch" (3.7-9.1 µs)

_H200_CALLS_US: dict[str, float] = {
    # measured
    "nvmlDeviceGetTotalEnergyConsumption": 3089.0,
    # 2,076-2,355 µs on an idle GPU (NOT_FOUND), per call: the size query and the read
    # are each such a call
    "nvmlDeviceGetProcessUtilization": 2216.0,
    "nvmlGpmMetricsGet": 1855.0,
    "nvmlGpmSampleGet": 178.0,
    "nvmlDeviceGetPcieReplayCounter": 145.0,
    "nvmlDeviceGetCurrPcieLinkWidth": 24.0,
    # measured within 0.9-6.0 µs (individual figures not recorded): the cheap figure
    "nvmlDeviceGetPowerUsage": H200_CHEAP_CALL_US,
    "nvmlDeviceGetTemperature": H200_CHEAP_CALL_US,
    "nvmlDeviceGetUtilizationRates": H200_CHEAP_CALL_US,
    "nvmlDeviceGetMemoryInfo_v2": H200_CHEAP_CALL_US,
    "nvmlDeviceGetComputeRunningProcesses_v3": H200_CHEAP_CALL_US,
    # not measured on the H200: the cheap figure. Every other entry point the simulated
    # library answers, and those nvitop-exporter 1.7.2 asks for, are listed so that the
    # table says so; a name not listed costs the cheap figure too.
    **dict.fromkeys(
        (
            "nvmlInitWithFlags",
            "nvmlInit_v2",
            "nvmlShutdown",
            "nvmlErrorString",
            "nvmlSystemGetDriverVersion",
            "nvmlSystemGetNVMLVersion",
            "nvmlSystemGetCudaDriverVersion",
            "nvmlSystemGetCudaDriverVersion_v2",
            "nvmlDeviceGetCount_v2",
            "nvmlDeviceGetHandleByIndex_v2",
            "nvmlDeviceGetHandleByUUID",
            "nvmlDeviceGetHandleByPciBusId_v2",
            "nvmlDeviceGetIndex",
            "nvmlDeviceGetName",
            "nvmlDeviceGetUUID",
            "nvmlDeviceGetSerial",
            "nvmlDeviceGetMinorNumber",
            "nvmlDeviceGetPciInfo_v3",
            "nvmlDeviceGetCudaComputeCapability",
            "nvmlDeviceGetMemoryInfo",
            "nvmlDeviceGetBAR1MemoryInfo",
            "nvmlDeviceGetConfComputeMemSizeInfo",
            "nvmlDeviceGetClockInfo",
            "nvmlDeviceGetMaxClockInfo",
            "nvmlDeviceGetCurrentClocksEventReasons",
            "nvmlDeviceGetCurrentClocksThrottleReasons",
            "nvmlDeviceGetEnforcedPowerLimit",
            "nvmlDeviceGetPowerManagementLimit",
            "nvmlDeviceGetTemperatureV",
            "nvmlDeviceGetNumFans",
            "nvmlDeviceGetFanSpeed",
            "nvmlDeviceGetFanSpeed_v2",
            "nvmlDeviceGetPerformanceState",
            "nvmlDeviceGetPersistenceMode",
            "nvmlDeviceGetComputeMode",
            "nvmlDeviceGetDisplayMode",
            "nvmlDeviceGetDisplayActive",
            "nvmlDeviceGetEncoderUtilization",
            "nvmlDeviceGetDecoderUtilization",
            "nvmlDeviceGetSamples",
            # nvmlDeviceGetPcieThroughput samples a byte counter over 20 ms (NVML's
            # docs): wall time that the CPU figure here does not model
            "nvmlDeviceGetPcieThroughput",
            "nvmlDeviceGetCurrPcieLinkGeneration",
            "nvmlDeviceGetMaxPcieLinkGeneration",
            "nvmlDeviceGetMaxPcieLinkWidth",
            "nvmlDeviceGetNvLinkState",
            "nvmlDeviceGetNvLinkErrorCounter",
            "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRetiredPages",
            "nvmlDeviceGetRemappedRows",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            "nvmlDeviceGetGraphicsRunningProcesses_v2",
            "nvmlDeviceGetGraphicsRunningProcesses_v3",
            "nvmlDeviceGetMPSComputeRunningProcesses_v2",
            "nvmlDeviceGetMPSComputeRunningProcesses_v3",
            "nvmlDeviceGetRunningProcessDetailList",
            "nvmlDeviceGetMigMode",
            "nvmlDeviceGetMaxMigDeviceCount",
            "nvmlDeviceGetMigDeviceHandleByIndex",
            "nvmlDeviceGetDeviceHandleFromMigDeviceHandle",
            "nvmlDeviceIsMigDeviceHandle",
            "nvmlDeviceGetGpuInstanceId",
            "nvmlDeviceGetComputeInstanceId",
            "nvmlDeviceGetGpuInstanceProfileInfoV",
            "nvmlDeviceGetSupportedEventTypes",
            "nvmlDeviceRegisterEvents",
            "nvmlEventSetCreate",
            "nvmlEventSetFree",
            # blocks in the driver until an event or its timeout: wall time, not CPU
            "nvmlEventSetWait_v2",
            "nvmlGpmQueryDeviceSupport",
            "nvmlGpmSampleAlloc",
            "nvmlGpmSampleFree",
            # like nvmlGpmSampleGet (178 µs) on a MIG instance, but not measured
            "nvmlGpmMigSampleGet",
        ),
        H200_CHEAP_CALL_US,
    ),
}

_H200_FIELDS_US: dict[int, float] = {
    83: 3222.0,  # NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
    75: 794.0,  # NVML_FI_DEV_PERF_POLICY_THERMAL
    270: 662.0,  # HW thermal slowdown duration (R580)
    271: 676.0,  # HW power-brake slowdown duration (R580)
    197: 160.0,  # NVML_FI_DEV_PCIE_COUNT_TX_BYTES
    198: 159.0,  # NVML_FI_DEV_PCIE_COUNT_RX_BYTES
    94: 173.0,  # NVML_FI_DEV_PCIE_REPLAY_COUNTER
    # NVLink error counters (NOT_SUPPORTED on that H200): 3.2 µs
    **dict.fromkeys((32, 39, 46, 53), 3.2),
    # measured within 3.7-9.1 µs: the cheap figure (82, 230, 74, 76-79, 269, 185, 186);
    # every other field, not measured, costs the cheap figure as well
    **dict.fromkeys((82, 230, 74, 76, 77, 78, 79, 269, 185, 186), H200_CHEAP_FIELD_US),
}

PROFILES: dict[str, CostProfile] = {
    "h200": CostProfile(
        name="h200",
        source="docs/validation.md, 'What NVML costs, call by call' (H200, driver 580.159.04)",
        calls_us=_H200_CALLS_US,
        fields_us=_H200_FIELDS_US,
        cheap_call_us=H200_CHEAP_CALL_US,
        cheap_field_us=H200_CHEAP_FIELD_US,
    ),
}


def known() -> str:
    return ", ".join(sorted(PROFILES))


def check_name(name: str, where: str = "cost") -> str:
    """``name`` if it is a profile (or ``none``); else CostProfileError in one line."""
    if name != NO_COST and name not in PROFILES:
        raise CostProfileError(
            f"{where}: unknown cost profile {name!r} (known: {known()}, or {NO_COST})"
        )
    return name


def profile(name: str | None) -> CostProfile | None:
    """The profile called ``name``; None for no profile (None or ``none``)."""
    if name is None or check_name(name) == NO_COST:
        return None
    return PROFILES[name]


def _requested_fields(args: tuple[Any, ...]) -> list[int] | None:
    """The field ids of ``nvmlDeviceGetFieldValues(handle, count, byref(values))``."""
    try:
        count = int(getattr(args[1], "value", args[1]))
        values = getattr(args[2], "_obj", args[2])
        return [int(values[i].fieldId) for i in range(count)]
    except (IndexError, TypeError, AttributeError, ValueError):
        return None


# -- spending CPU time outside the GIL --------------------------------------------------

_GIL_FREE_BYTES = 2048  # hashlib's HASHLIB_GIL_MINSIZE: from this size it releases the GIL
# Zeros to hash: an anonymous read-only mapping, every page of it the kernel's one zero
# page, so it adds nothing to RSS, and one chunk covers the costliest call (~11 ms).
_ZEROS_BYTES = 16 << 20
_zeros: list[memoryview] = []
_rate: list[float] = []  # bytes hashed per ns of thread CPU, measured once
_clock_ns: list[int] = []  # what one read of the thread's CPU clock costs


def _calibrate() -> None:
    """Map the zeros, fault them in (one pass: ~15 ms once per process), and measure the
    hash rate and the clock read's cost on this machine."""
    zeros = memoryview(
        mmap.mmap(
            -1, _ZEROS_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ
        )
    )
    hashlib.sha256(zeros)
    clock = time.thread_time_ns
    started = clock()
    for _ in range(2):
        hashlib.sha256(zeros[: 1 << 20])
    rate = 2 * (1 << 20) / max(1, clock() - started)
    started = clock()
    for _ in range(100):
        clock()
    clock_ns = (clock() - started) // 101
    if not _zeros:
        _zeros.append(zeros)
        _rate.append(rate)
        _clock_ns.append(clock_ns)


def spend(us: float) -> None:
    """Spend ``us`` microseconds of this thread's CPU time, mostly with the GIL released."""
    if us <= 0:
        return
    clock = time.thread_time_ns
    if not _zeros:
        _calibrate()
    zeros, rate = _zeros[0], _rate[0]
    # the last read of the clock, after the end, is part of the cost
    end = clock() + int(us * 1000) - _clock_ns[0]
    smallest_ns = _GIL_FREE_BYTES / rate
    while (left := end - clock()) > 0:
        if left < smallest_ns:  # a few µs: spin on the clock (GIL held that long)
            while clock() < end:
                pass
            return
        # one GIL-free chunk for most of what is left (0.9: the rate wobbles), so a call
        # releases the GIL about twice, as a C call releases it once
        size = min(_ZEROS_BYTES, max(_GIL_FREE_BYTES, int(left * rate * 0.9)))
        hashlib.sha256(zeros[:size])


class Costed:
    """What pynvml holds as ``nvmlLib`` under a cost profile: the library (or the
    call-counting wrapper around it), each entry point it resolves wrapped to spend the
    profile's figure before the simulated library answers. Like ``_Counted``: pynvml
    caches what it resolves, so this runs at the C boundary, once per call."""

    def __init__(self, library: Any, cost: CostProfile) -> None:
        self._library = library
        self._cost = cost

    @property
    def cost(self) -> CostProfile:
        return self._cost

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._library, name)  # AttributeError: a missing symbol, free
        if not callable(target):
            return target
        return _entry(name, target, self._cost)


def _entry(name: str, target: Callable[..., Any], cost: CostProfile) -> Callable[..., Any]:
    if name == FIELD_VALUES:

        def fields(*args: Any) -> Any:
            spend(cost.call_us(name, args))
            return target(*args)

        return fields
    us = cost.calls_us.get(name, cost.cheap_call_us)

    def entry(*args: Any) -> Any:
        spend(us)
        return target(*args)

    return entry
