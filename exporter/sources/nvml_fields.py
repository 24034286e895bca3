"""NVML field values: one ``nvmlDeviceGetFieldValues`` call per GPU and cadence tier.

Every cycle (``requests``): the scalar fields (memory temperature, PCIe byte counters,
power, the recovery action) and, per NVLink, the byte counters (scope = the link). The
slow tier (``slow_requests``, exporter/sources/nvml_cadence.py): energy and the time
spent under each performance policy and clock-event reason (on an H200, driver
580.159.04, field 83 took 3.2 ms a read and 75, 270 and 271 0.66-0.79 ms each, against
~4 us for a cheap field: docs/validation.md, benchmarks/real_nvml_fields.py), the PCIe
replay counter and the NVLink error counters of links 0-11 (nvml.h has a field
id per link and counter only up to link 11). Which ids are asked depends on the driver
branch: a field is only asked of drivers that define it, because ids have been
renumbered (the clock-event durations moved in R580).

Each entry has its own return code (``nvmlFieldValue_t.nvmlReturn``): NOT_SUPPORTED is
"absent", anything else is an error of that field alone. A field that stands for a call
of its own (``FALLBACK_FIELDS``) and answers NOT_SUPPORTED is noted per GPU handle and
read through that call from then on, as drivers without the field need. A counter that
must be 64 bits wide (``WIDE_ONLY``) and answers a narrower type is never served: it is
noted per GPU handle (``narrow``) and not asked again.

The request is built here, not by pynvml's ``nvmlDeviceGetFieldValues``: pynvml hands the
library zeroed entries, and an entry the library leaves unwritten (a shim or a driver that
answers the call but not that field) would then read as a successful 0. Each entry here
starts with the return code and value type ``UNWRITTEN``, which no NVML code or type has,
and every value bit set; an entry left so, or with only its return code written, is
counted as not answered. No field asked here can be below 0: a negative value is
invalid. The request of each list of fields is built once and copied per
call (one ``from_buffer_copy``), where pynvml set two attributes per field in Python.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable, Collection, Iterable
from typing import Any

import pynvml

from exporter.sources.nvml_codes import error_name, number_field, set_number_field

FieldKey = tuple[int, int]  # (field id, scope id: the NVLink for per-link fields, else 0)
Errors = Callable[[str, str], None]  # (query, error class): counted as NVML errors
# Error classes of a field answer that NVML itself calls a success.
NOT_ANSWERED = "NotAnswered"  # no entry names the field asked (absent, or another field's)
INVALID_VALUE = "InvalidValue"  # an unknown value type, or a NaN or infinite double
# The return code and the value type an entry is handed to the library with: nvmlReturn_t
# values are 0-29 and 999, nvmlValueType_t 0-6 (nvml.h), so an entry that still holds
# either was not written. Its value is handed over with every bit set: the memory
# temperature, read as uiVal whatever the type says, then reads past any temperature.
UNWRITTEN = 0xFFFF_FFFF
UNWRITTEN_VALUE = 0xFFFF_FFFF_FFFF_FFFF

# Time clocks were held down, per NVML performance policy: nanoseconds since the driver
# loaded (nvml.h "Perf Policy Counter"; DCGM maps DCGM_FI_DEV_POWER_VIOLATION, "Power
# Violation time in ns", to NVML_FI_DEV_PERF_POLICY_POWER: dcgm_fields.h, dcgm_fields.cpp).
# These are the counters nvmlDeviceGetViolationStatus returns, which R580 deprecates for
# field values (pynvml.py 13.615.71 line 4835). pynvml names the power and sync-boost
# policy counters NVML_FI_DEV_CLOCKS_EVENT_REASON_SW_POWER_CAP / _SYNC_BOOST (lines
# 846-847), so they take the clock-event reason names; "thermal" is any thermal slowdown.
POLICY_FIELDS: dict[str, int] = {
    "sw_power_cap": pynvml.NVML_FI_DEV_PERF_POLICY_POWER,
    "thermal": pynvml.NVML_FI_DEV_PERF_POLICY_THERMAL,
    "sync_boost": pynvml.NVML_FI_DEV_PERF_POLICY_SYNC_BOOST,
    "board_limit": pynvml.NVML_FI_DEV_PERF_POLICY_BOARD_LIMIT,
    "low_utilization": pynvml.NVML_FI_DEV_PERF_POLICY_LOW_UTILIZATION,
    "reliability": pynvml.NVML_FI_DEV_PERF_POLICY_RELIABILITY,
}
# Per clock-event reason durations in ns, R580 numbering (pynvml.py 13.615.71 lines
# 848-850). R575 added them under other ids and R580 renumbered them "to resolve overlap
# with NVML_FI_PWR_SMOOTHING_*" (docs.nvidia.com/deploy/nvml-api/change-log.html), so they
# are asked of R580 and newer only. Literal ids: nvidia-ml-py 12.570 lacks the names.
CLOCK_EVENT_FIELDS: dict[str, int] = {
    "sw_thermal_slowdown": 269,
    "hw_thermal_slowdown": 270,
    "hw_power_brake_slowdown": 271,
}
CLOCK_EVENT_FIELDS_SINCE = 580
# Cumulative PCIe bytes, "Value can be wrapped" (nvml.h); added in R555 (change log).
PCIE_BYTES_FIELDS = (
    pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES,
    pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES,
)
PCIE_BYTES_SINCE = 555
# nvmlValueType_t of 64 bits (nvml.h: 2 unsigned long, 3 unsigned long long, 4 signed
# long long; pynvml.py lines 289-295). Driver 580.159.04 on an H200 answers the PCIe byte
# counters as 1, an unsigned int, which under a ~32 GB/s copy wraps every ~130 ms
# (docs/validation.md): no scrape interval can tell such a counter's wraps from its
# resets, so a counter in ``WIDE_ONLY`` is only served from a 64-bit answer.
WIDE_TYPES = frozenset(
    {
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG,
        pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG,
        pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG,
    }
)
WIDE_ONLY = frozenset(PCIE_BYTES_FIELDS)
# Per-link NVLink data bytes (KiB, cumulative; pynvml.py line 689), scope = link; what
# nvitop (api/device.py nvlink_throughput) and DCGM (DcgmCacheManager.cpp
# ReadAndCacheNvLinkBandwidth, "only supported for r445 or newer") read.
NVLINK_BYTES_FIELDS = (
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX,
    pynvml.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX,
)
MEMORY_TEMPERATURE = pynvml.NVML_FI_DEV_MEMORY_TEMP
# What the GPU needs after XID 154 (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION, nvml.h).
RECOVERY_ACTION = pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION
# The same quantities as a call of their own, by nvml.h's field ids (pynvml.py 13.615.71
# lines 610, 629, 543-576 and 633-662): "Total energy consumption for the GPU in mJ since
# the driver was last reloaded" (83, nvmlDeviceGetTotalEnergyConsumption), the PCIe replay
# counter (94, nvmlDeviceGetPcieReplayCounter), and per NVLink 0-11 its flit CRC, data
# CRC, replay and recovery error counters (32-59 and 96-119: one id per link and counter,
# nvmlDeviceGetNvLinkErrorCounter's four counters).
TOTAL_ENERGY = pynvml.NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION
# Power, what nvmlDeviceGetPowerUsage answers: "On Ampere (except GA100) or newer GPUs,
# the API returns power averaged over 1 sec interval. On GA100 and older architectures,
# instantaneous power is returned" (docs.nvidia.com/deploy/nvml-api/
# group__nvmlDeviceQueries.html, nvmlDeviceGetPowerUsage). Field 185, NVML_FI_DEV_POWER_
# AVERAGE (pynvml.py 13.615.71 line 751), is "GPU power averaged over 1 sec interval,
# supported on Ampere (except GA100) or newer architectures" (nvml.h), so where the field
# answers it is the call's value, and where it does not (GA100 and older: NOT_SUPPORTED)
# the call is read as before. Field 186, NVML_FI_DEV_POWER_INSTANT, is another quantity
# on those GPUs and is never asked in its place. Scope 0 is NVML_POWER_SCOPE_GPU
# (pynvml.py line 7363). On an H200 (driver 580.159.04) field 185 at scope 0 equalled the
# call in 80 of 80 back-to-back reads, idle and under load; 186 in none
# (benchmarks/results/real-power-fields-h200.json). nvidia-ml-py 11.525 is the first to
# define the id (11.515's NVML_FI_MAX is 161), so it is asked of R525 and newer only.
POWER_AVERAGE = pynvml.NVML_FI_DEV_POWER_AVERAGE
POWER_FIELDS_SINCE = 525
PCIE_REPLAY_COUNTER = pynvml.NVML_FI_DEV_PCIE_REPLAY_COUNTER
NVLINK_ERROR_FIELD_LINKS = 12  # links 0-11 have a field id per counter; later ones the call
_NVLINK_ERROR_NAMES = {
    "crc_flit": "CRC_FLIT",
    "crc_data": "CRC_DATA",
    "replay": "REPLAY",
    "recovery": "RECOVERY",
}
NVLINK_ERROR_FIELDS: dict[tuple[int, str], int] = {
    (link, counter): getattr(pynvml, f"NVML_FI_DEV_NVLINK_{name}_ERROR_COUNT_L{link}")
    for counter, name in _NVLINK_ERROR_NAMES.items()
    for link in range(NVLINK_ERROR_FIELD_LINKS)
}
FALLBACK_FIELDS = frozenset(
    {TOTAL_ENERGY, POWER_AVERAGE, PCIE_REPLAY_COUNTER, *NVLINK_ERROR_FIELDS.values()}
)
# DCGM discards memory temperatures above 200 C as garbage (DcgmCacheManager.cpp,
# DCGM_FI_DEV_MEMORY_TEMP_CELSIUS).
MAX_MEMORY_TEMPERATURE = 200


def driver_branch(version: str | None) -> int | None:
    """``550.90.07`` -> 550; None when unknown."""
    try:
        return int((version or "").split(".")[0])
    except ValueError:
        return None


def requests(
    branch: int | None,
    nvlinks: int,
    fallback: Collection[FieldKey] = (),
    narrow: Collection[FieldKey] = (),
) -> list[FieldKey]:
    """The fields to ask this driver for every cycle, GPU-wide ones first, then per
    NVLink; those in ``fallback`` are read through their own call instead, and counters
    the driver answered too narrow (``narrow``) are not asked again."""
    keys: list[FieldKey] = [(MEMORY_TEMPERATURE, 0), (RECOVERY_ACTION, 0)]
    if power_asked(branch, fallback):
        keys.append((POWER_AVERAGE, 0))
    if branch is not None and branch >= PCIE_BYTES_SINCE:
        keys += [(fid, 0) for fid in PCIE_BYTES_FIELDS if (fid, 0) not in narrow]
    keys += [(fid, link) for link in range(nvlinks) for fid in NVLINK_BYTES_FIELDS]
    return keys


def power_asked(branch: int | None, fallback: Collection[FieldKey]) -> bool:
    """Whether power is a field of this driver's every-cycle request (else the call)."""
    return (
        branch is not None and branch >= POWER_FIELDS_SINCE and (POWER_AVERAGE, 0) not in fallback
    )


def slow_requests(
    branch: int | None, error_links: Iterable[int], fallback: Collection[FieldKey] = ()
) -> list[FieldKey]:
    """The slow tier's fields: energy, the time under each performance policy (and on
    R580+ each clock-event reason), the PCIe replay counter and the NVLink error counters
    of ``error_links`` that have a field id, less those read through their own call."""
    keys = [(TOTAL_ENERGY, 0), *((fid, 0) for fid in POLICY_FIELDS.values())]
    if branch is not None and branch >= CLOCK_EVENT_FIELDS_SINCE:
        keys += [(fid, 0) for fid in CLOCK_EVENT_FIELDS.values()]
    keys.append((PCIE_REPLAY_COUNTER, 0))
    keys += [
        (NVLINK_ERROR_FIELDS[(link, counter)], 0)
        for link in error_links
        if link < NVLINK_ERROR_FIELD_LINKS
        for counter in _NVLINK_ERROR_NAMES
    ]
    return [key for key in keys if key not in fallback]


def read(
    query: Callable[..., Any],
    handle: Any,
    keys: Iterable[FieldKey],
    errors: Errors,
    fallback: set[FieldKey] | None = None,
    narrow: dict[FieldKey, int] | None = None,
) -> dict[FieldKey, int | float]:
    """The values NVML gave, by (field, scope); unsupported or failed fields are left out
    (failed ones counted, as are a field not answered and a value that is not a finite
    number of a known type). ``query`` is the source's one-query wrapper: a failure of the
    whole call is counted there and reads as no values. A ``FALLBACK_FIELDS`` field that
    answers NOT_SUPPORTED is added to ``fallback``: its own call is used from then on. A
    ``WIDE_ONLY`` counter answered in fewer than 64 bits is left out, not counted as an
    error (it is what the driver does, every time), and noted in ``narrow`` with the
    value type it came as."""
    keys = list(keys)
    if not keys:
        return {}
    entries = query("field_values", field_values, handle, tuple(keys))
    if entries is None:
        return {}  # the whole call failed: counted by ``query``
    answers = answered(entries)
    values: dict[FieldKey, int | float] = {}
    get = number_field
    for key in keys:
        entry = answers.get(key)
        if entry is None:  # a driver that left the field out or answered another one
            errors(_name(key[0]), NOT_ANSWERED)
            continue
        returned = get(entry, "nvmlReturn")
        if returned == UNWRITTEN:  # handed back as it was handed over
            errors(_name(key[0]), NOT_ANSWERED)
        elif returned == pynvml.NVML_SUCCESS:
            value_type = get(entry, "valueType")
            if value_type == UNWRITTEN and key[0] != MEMORY_TEMPERATURE:
                errors(_name(key[0]), NOT_ANSWERED)  # a return code, and nothing with it
                continue
            if key[0] in WIDE_ONLY and value_type not in WIDE_TYPES:
                if narrow is not None:
                    narrow[key] = int(value_type)
                continue
            value = _decode(key[0], value_type, get(entry, "value"))
            if value is None or value < 0:  # no field asked here can be below 0
                errors(_name(key[0]), INVALID_VALUE)
            else:
                values[key] = value
        elif returned != pynvml.NVML_ERROR_NOT_SUPPORTED:
            errors(_name(key[0]), error_name(pynvml.NVMLError(returned)))
        elif fallback is not None and key[0] in FALLBACK_FIELDS:
            fallback.add(key)
    return values


def field_values(handle: Any, keys: tuple[FieldKey, ...]) -> ctypes.Array[Any]:
    """``nvmlDeviceGetFieldValues`` of ``keys``: the entries as the library wrote them,
    those it did not write still ``UNWRITTEN``. Raises pynvml's NVMLError for the call."""
    request = _request(keys)
    entries: ctypes.Array[Any] = type(request).from_buffer_copy(request)
    call = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetFieldValues")
    pynvml._nvmlCheckReturn(call(handle, ctypes.c_int32(len(keys)), ctypes.byref(entries)))
    return entries


@functools.lru_cache(maxsize=64)  # a few lists per GPU model and driver: fast, slow tier
def _request(keys: tuple[FieldKey, ...]) -> ctypes.Array[Any]:
    """The entries handed to the library for ``keys`` (copied per call, never written)."""
    request: ctypes.Array[Any] = (pynvml.c_nvmlFieldValue_t * len(keys))()
    for entry, (field_id, scope_id) in zip(request, keys, strict=True):
        set_number_field(entry, "fieldId", field_id)
        set_number_field(entry, "scopeId", scope_id)
        set_number_field(entry, "nvmlReturn", UNWRITTEN)
        set_number_field(entry, "valueType", UNWRITTEN)
        number_field(entry, "value").ullVal = UNWRITTEN_VALUE
    return request


def answered(entries: Iterable[Any]) -> dict[FieldKey, Any]:
    """The answers by the (field, scope) each names, never by position: an answer out of
    order must not serve one counter as another (PCIe replays as NVLink recoveries)."""
    out: dict[FieldKey, Any] = {}
    get = number_field
    for entry in entries:
        out.setdefault((int(get(entry, "fieldId")), int(get(entry, "scopeId"))), entry)
    return out


def recovery_action(values: dict[FieldKey, int | float]) -> int | None:
    """What the driver says the GPU needs (raised with XID 154); None on drivers that
    lack the field."""
    value = values.get((RECOVERY_ACTION, 0))
    return None if value is None else int(value)


def clock_event_durations(values: dict[FieldKey, int | float]) -> tuple[tuple[str, int], ...]:
    """(reason, ns) for every policy or reason the driver answered."""
    return tuple(
        (reason, int(values[(fid, 0)]))
        for reason, fid in {**POLICY_FIELDS, **CLOCK_EVENT_FIELDS}.items()
        if (fid, 0) in values
    )


def _name(field_id: int) -> str:
    """The query name a failed field is counted under."""
    if field_id == MEMORY_TEMPERATURE:
        return "memory_temperature"
    if field_id in PCIE_BYTES_FIELDS:
        return "pcie_bytes"
    if field_id in NVLINK_BYTES_FIELDS:
        return "nvlink_bytes"
    if field_id == RECOVERY_ACTION:
        return "recovery_action"
    if field_id == TOTAL_ENERGY:
        return "energy"
    if field_id == POWER_AVERAGE:
        return "power"
    if field_id == PCIE_REPLAY_COUNTER:
        return "pcie_replay"
    if field_id in _NVLINK_ERROR_IDS:
        return "nvlink_errors"
    return "clock_event_time"


_NVLINK_ERROR_IDS = frozenset(NVLINK_ERROR_FIELDS.values())


def _decode(field_id: int, value_type: int, union: Any) -> int | float | None:
    """The value by its type, as nvitop's ``nvmlQueryFieldValues`` reads it; None for an
    unknown type or a double that is not finite (a NaN or infinite counter is no reading).
    The memory temperature is always ``uiVal``, as DCGM reads it: R545 drivers mark it a
    double while writing an unsigned int (nvbugs/4300930, DcgmCacheManager.cpp
    DCGM_FI_DEV_MEMORY_TEMP_CELSIUS)."""
    if field_id == MEMORY_TEMPERATURE:
        return int(union.uiVal)
    member = _VALUE_MEMBERS.get(value_type)
    if member is None:
        return None
    value: int | float = getattr(union, member)
    return value if isinstance(value, int) or math.isfinite(value) else None


# nvmlValueType_t -> the c_nvmlValue_t member holding it (pynvml.py lines 289-295, 1514)
_VALUE_MEMBERS = {
    pynvml.NVML_VALUE_TYPE_DOUBLE: "dVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_INT: "uiVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG: "ulVal",
    pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG: "ullVal",
    pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG: "sllVal",
    5: "siVal",  # NVML_VALUE_TYPE_SIGNED_INT
    6: "usVal",  # NVML_VALUE_TYPE_UNSIGNED_SHORT
}
