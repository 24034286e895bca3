"""NVLink, PCIe, video engines, throttle time, memory temperature and fans on a real GPU:
what the driver answers where the simulator had to assume (docs/simulator.md), and what
the exporter reads. Results go in docs/validation.md (``pytest -s`` prints them)."""

from __future__ import annotations

import time
from typing import Any

import pynvml
import pytest

from exporter.sources import nvml_fields
from exporter.sources.nvml import NvmlSource
from tests.gpu.conftest import Gpu, requires_gpu, requires_torch, return_name

pytestmark = [requires_gpu, pytest.mark.gpu]


def _fields(handle: Any, keys: list[tuple[int, int]]) -> list[Any]:
    values = pynvml.nvmlDeviceGetFieldValues(handle, keys)
    for key, v in zip(keys, values, strict=True):
        print(f"field {key}: {return_name(v.nvmlReturn)} type {v.valueType} ull {v.value.ullVal}")
    return list(values)


def _answer(fn: Any, *args: Any) -> str:
    try:
        return f"Success {fn(*args)!r}"
    except pynvml.NVMLError as exc:
        return type(exc).__name__


def test_the_exporter_reads_the_new_signals_without_errors(real_nvml: None) -> None:
    source = NvmlSource()
    try:
        source.sample()
        time.sleep(1.0)
        snapshot = source.sample()
    finally:
        source.close()
    print("driver", snapshot.driver_version, "errors", snapshot.errors)
    assert snapshot.errors == ()
    for gpu in snapshot.gpus:
        print(gpu.index, gpu.name, gpu.pcie, gpu.memory_temperature_celsius)
        print("  engines", gpu.encoder_utilization_percent, gpu.decoder_utilization_percent)
        print("  fans", gpu.fan_speeds_percent, "clock events", gpu.clock_event_durations_ns)
        print("  nvlinks", gpu.nvlinks)
        pcie = gpu.pcie
        assert pcie is not None and pcie.generation and pcie.width
        assert pcie.max_generation and pcie.generation <= pcie.max_generation
        assert pcie.max_width and pcie.width <= pcie.max_width
        assert dict(gpu.clock_event_durations_ns).keys() >= {"sw_power_cap", "thermal"}


def test_memory_temperature_field_type_and_value(whole_gpu: Gpu) -> None:
    """The simulator marks it UNSIGNED_INT (R545: DOUBLE, nvbugs/4300930); the exporter
    reads uiVal either way. A plausible value, where supported."""
    (entry,) = _fields(whole_gpu.handle, [(nvml_fields.MEMORY_TEMPERATURE, 0)])
    if entry.nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED:
        pytest.skip("no memory temperature sensor on this GPU")
    assert entry.nvmlReturn == pynvml.NVML_SUCCESS
    assert 0 < entry.value.uiVal < nvml_fields.MAX_MEMORY_TEMPERATURE


def test_clock_event_times_are_nanosecond_counters(whole_gpu: Gpu) -> None:
    """Over 2 s no reason can add more than 2e9 ns; none goes backwards."""
    keys = [(fid, 0) for fid in nvml_fields.POLICY_FIELDS.values()]
    version = pynvml.nvmlSystemGetDriverVersion()
    branch = nvml_fields.driver_branch(version if isinstance(version, str) else version.decode())
    if branch is not None and branch >= nvml_fields.CLOCK_EVENT_FIELDS_SINCE:
        keys += [(fid, 0) for fid in nvml_fields.CLOCK_EVENT_FIELDS.values()]
    first = _fields(whole_gpu.handle, keys)
    time.sleep(2.0)
    second = _fields(whole_gpu.handle, keys)
    for a, b in zip(first, second, strict=True):
        if a.nvmlReturn == b.nvmlReturn == pynvml.NVML_SUCCESS:
            assert 0 <= b.value.ullVal - a.value.ullVal <= 2.2e9, a.fieldId


@requires_torch
def test_pcie_byte_counters_are_served_only_when_wide_and_count_a_copy_workload(
    whole_gpu: Gpu, workload: Any
) -> None:
    """R555+: the exporter serves the PCIe byte counters only from a 64-bit answer
    (nvml_fields.WIDE_TYPES). Where the driver gives 64 bits they grow by about what the
    copies moved and are served; where it gives fewer (driver 580.159.04 on an H200: type
    1, wrapping every ~130 ms under a copy) the exporter serves neither. Either way the
    link runs at its best generation while copying (the simulator's idle downshift)."""
    keys = [(fid, 0) for fid in nvml_fields.PCIE_BYTES_FIELDS]
    idle = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(whole_gpu.handle)
    before = _fields(whole_gpu.handle, keys)
    if before[0].nvmlReturn == pynvml.NVML_ERROR_NOT_SUPPORTED:
        pytest.skip("driver without NVML_FI_DEV_PCIE_COUNT_*_BYTES (before R555)")
    process = workload("copy", "6", uuid=whole_gpu.uuid)
    try:
        time.sleep(2.0)
        busy = pynvml.nvmlDeviceGetCurrPcieLinkGeneration(whole_gpu.handle)
        best = pynvml.nvmlDeviceGetMaxPcieLinkGeneration(whole_gpu.handle)
        after = _fields(whole_gpu.handle, keys)
        source = NvmlSource()
        try:
            served = [g.pcie for g in source.sample().gpus if g.uuid == whole_gpu.uuid]
        finally:
            source.close()
    finally:
        process.kill()
    types = sorted({entry.valueType for entry in before})
    wide = set(types) <= nvml_fields.WIDE_TYPES
    (pcie,) = served
    print(f"PCIe generation idle {idle}, copying {busy}, best {best}")
    width = "64-bit" if wide else "narrower than 64 bits"
    tx, rx = (pcie.transmitted_bytes, pcie.received_bytes) if pcie else (None, None)
    print(f"PCIe byte counters: value type {types} ({width}); the exporter serves {tx}, {rx}")
    assert busy == best
    assert pcie is not None
    if wide:
        for a, b in zip(before, after, strict=True):
            assert b.value.ullVal - a.value.ullVal > 1 << 30  # > 1 GiB each way in 2+ s
        assert pcie.transmitted_bytes is not None and pcie.received_bytes is not None
    else:  # a counter that wraps within a second at link speed: unknown, never served
        assert (pcie.transmitted_bytes, pcie.received_bytes) == (None, None)


def test_nvlink_answers(whole_gpu: Gpu) -> None:
    """Link count, state, data counters and the error counter call, as they answer here."""
    (count,) = _fields(whole_gpu.handle, [(pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0)])
    if count.nvmlReturn != pynvml.NVML_SUCCESS or count.value.uiVal == 0:
        pytest.skip(f"no NVLink here ({return_name(count.nvmlReturn)})")
    links = count.value.uiVal
    for link in range(links):
        print(link, "state", _answer(pynvml.nvmlDeviceGetNvLinkState, whole_gpu.handle, link))
        print(
            "  crc_flit",
            _answer(
                pynvml.nvmlDeviceGetNvLinkErrorCounter,
                whole_gpu.handle,
                link,
                pynvml.NVML_NVLINK_ERROR_DL_CRC_FLIT,
            ),
        )
    data = _fields(
        whole_gpu.handle,
        [(fid, link) for link in range(links) for fid in nvml_fields.NVLINK_BYTES_FIELDS],
    )
    assert {v.nvmlReturn for v in data} <= {pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_NOT_SUPPORTED}


def test_video_engines_and_fans_on_this_gpu(whole_gpu: Gpu) -> None:
    """An H100 has NVDEC but no NVENC: does the encoder call answer 0 or NOT_SUPPORTED (the
    simulator answers 0)? Data-centre GPUs have no fans: NOT_SUPPORTED (the simulator's
    answer) or a count of 0?"""
    handle = whole_gpu.handle
    print("encoder", _answer(pynvml.nvmlDeviceGetEncoderUtilization, handle))
    print("decoder", _answer(pynvml.nvmlDeviceGetDecoderUtilization, handle))
    print("fans", _answer(pynvml.nvmlDeviceGetNumFans, handle))
    print("fan speed", _answer(pynvml.nvmlDeviceGetFanSpeed, handle))
    try:
        decoder = pynvml.nvmlDeviceGetDecoderUtilization(handle)
    except pynvml.NVMLError_NotSupported:
        pytest.skip("no decoder utilisation on this GPU")
    assert 0 <= decoder[0] <= 100 and decoder[1] > 0
