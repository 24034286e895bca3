"""Shared GPUs on a real driver (docs/shared-gpus.md): what the turn-taking and headroom
series assume of NVML.

The simulator gives every process with work a per-process SM sample in each window, the
samples of the processes on a GPU add up to about its busy time, and free memory is
total - used - reserved (exporter/sim/nvml_library.py). On a real driver: two processes
time-share one GPU, a matmul loop (long kernels) and a tiny-kernel loop; the tiny one
waits for the matmuls, yet it must still show SM time (it had work and got turns), or
the exporter would count it as not wanting the GPU.
"""

from __future__ import annotations

import time
from typing import Any

import pynvml
import pytest

from exporter.analysis.sharing import MemoryHistory, SharingPolicy, analyse_sharing
from exporter.model import ContainerGpuUsage, ContainerRef, DeviceRef
from exporter.sources.nvml import NvmlSource
from tests.gpu.conftest import Gpu, requires_gpu, requires_torch

pytestmark = [requires_gpu, pytest.mark.gpu]


@requires_torch
def test_two_processes_taking_turns_both_show_sm_time_and_shares_add_up(
    whole_gpu: Gpu, workload: Any
) -> None:
    heavy = workload("heavy", "30", uuid=whole_gpu.uuid).pid
    tiny = workload("tiny", "30", uuid=whole_gpu.uuid).pid
    source = NvmlSource()
    seen: dict[int, list[float]] = {heavy: [], tiny: []}
    try:
        for _ in range(10):
            time.sleep(1.0)
            gpu = next(g for g in source.sample().gpus if g.uuid == whole_gpu.uuid)
            for u in gpu.process_utilization:
                if u.pid in seen:
                    seen[u.pid].append(u.sm_percent / 100)
    finally:
        source.close()
    print(f"\nper-process SM samples: heavy {seen[heavy]}, tiny {seen[tiny]}")
    assert seen[heavy] and max(seen[heavy]) > 0, "the matmul loop had no SM sample"
    assert seen[tiny] and max(seen[tiny]) > 0, "the waiting tiny-kernel loop had no SM time"
    device = DeviceRef(whole_gpu.index, whole_gpu.uuid)
    rows = tuple(
        ContainerGpuUsage(ContainerRef("gpu-test", name, "main"), device, 0, ratios[-1], 1)
        for name, ratios in (("heavy", seen[heavy]), ("tiny", seen[tiny]))
    )
    shared, shares, _ = analyse_sharing(
        rows, (), (), MemoryHistory(), now=0.0, policy=SharingPolicy()
    )
    print(f"shares: {[(s.container.pod, s.sm_time_share) for s in shares]}")
    assert shared[0].active_containers == 2
    assert sum(s.sm_time_share or 0.0 for s in shares) == pytest.approx(1.0)


def test_headroom_is_what_nvml_calls_free(whole_gpu: Gpu) -> None:
    info = pynvml.nvmlDeviceGetMemoryInfo(whole_gpu.handle, version=pynvml.nvmlMemory_v2)
    print(f"\ntotal {info.total} used {info.used} reserved {info.reserved} free {info.free}")
    assert info.total - info.used - info.reserved == pytest.approx(info.free, abs=2 * 2**20)
