"""What the exporter reads from a real GPU. Results are recorded in docs/validation.md."""

from __future__ import annotations

import time

import pytest

from exporter.sources.nvml import NvmlSource
from tests.gpu.conftest import requires_gpu, requires_torch

pytestmark = [requires_gpu, pytest.mark.gpu]


def test_real_gpus_are_read_with_memory_v2_and_identity(real_nvml: None) -> None:
    source = NvmlSource()
    try:
        snapshot = source.sample()
    finally:
        source.close()
    assert snapshot.ok and snapshot.gpus
    for gpu in snapshot.gpus:
        assert gpu.error is None
        assert gpu.uuid.startswith("GPU-") and gpu.name and gpu.pci_bus_id
        assert gpu.memory_total_bytes and gpu.memory_used_bytes is not None
        assert gpu.memory_reserved_bytes is not None, "memory info v2 expected on H100 drivers"
        assert gpu.memory_used_bytes + gpu.memory_reserved_bytes <= gpu.memory_total_bytes


def _occupancy_under(start: object, mode: str) -> tuple[float, float]:
    process = start(mode, "8")  # type: ignore[operator]
    source = NvmlSource()
    try:
        time.sleep(1.5)
        source.sample()  # primes GPM
        time.sleep(2.0)
        snapshot = source.sample()
    finally:
        source.close()
        process.kill()
    gpu = snapshot.gpus[0]
    assert gpu.occupancy is not None, "GPM unsupported on this GPU"
    assert gpu.occupancy.sm_active is not None and gpu.utilization_gpu_percent is not None
    return gpu.utilization_gpu_percent / 100, gpu.occupancy.sm_active


@requires_torch
def test_heavy_matmul_shows_high_sm_activity(real_nvml: None, workload: object) -> None:
    util, sm_active = _occupancy_under(workload, "heavy")
    assert util > 0.9 and sm_active > 0.5


@requires_torch
def test_one_thin_kernel_always_resident_reads_busy_by_gpu_util_but_idle_by_sm_activity(
    real_nvml: None, workload: object
) -> None:
    """GPU-Util is the share of time *a* kernel ran (nvml.h, nvmlUtilization_t.gpu: "Percent
    of time over the past sample period during which one or more kernels was executing");
    one thread spinning keeps it at 100 % while one SM of 132 is busy."""
    util, sm_active = _occupancy_under(workload, "spin")
    print(f"spin: GPU-Util {util:.2f}, SM active {sm_active:.3f}")
    assert util > 0.5, util
    assert sm_active < 0.1, sm_active
    assert util - sm_active > 0.4


@requires_torch
def test_tiny_kernels_with_host_gaps_read_idle_by_both(real_nvml: None, workload: object) -> None:
    """A 1-element kernel every ~2 ms is resident for microseconds of each 2 ms: GPU-Util
    reads it as idle too (H200, driver 580.159.04: 0.00; docs/validation.md). The
    GPU-Util-versus-SM gap needs kernels that stay resident, not merely frequent ones."""
    util, sm_active = _occupancy_under(workload, "tiny")
    print(f"tiny: GPU-Util {util:.2f}, SM active {sm_active:.3f}")
    assert util < 0.2, util
    assert sm_active < 0.1, sm_active


@requires_torch
def test_a_process_holding_memory_is_listed_with_its_memory(
    real_nvml: None, workload: object
) -> None:
    process = workload("hold", "30", "2048")  # type: ignore[operator]
    source = NvmlSource()
    try:
        snapshot = source.sample()
    finally:
        source.close()
    listed = {p.pid: p.memory_used_bytes for g in snapshot.gpus for p in g.processes}
    assert process.pid in listed
    assert (listed[process.pid] or 0) >= 2048 * 2**20
