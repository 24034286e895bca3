"""Device memory on a real driver: the identities the simulator models, and how much
memory no listed process accounts for on a healthy GPU (the orphan check's input).

The simulator (exporter/sim/nvml_library.py ``nvmlDeviceGetMemoryInfo``/``_v2``)
assumes v2 ``free = total - reserved - used``, v1 ``used = v2 used + reserved`` with the
same total and free, and that a healthy GPU's v2 ``used`` is the sum of its listed
processes' memory (``unaccounted_memory`` 0), so ``unattributed`` orphans never appear
without a scenario putting them there.
"""

from __future__ import annotations

import time
from typing import Any

import pynvml
import pytest

from exporter.agent import policy_from
from exporter.analysis.attribution import attribute
from exporter.analysis.orphans import find_orphans
from exporter.config import parse_config
from exporter.model import KIND_UNATTRIBUTED, NodeSnapshot, OrphanState
from exporter.sources.nvml import NvmlSource
from tests.gpu.conftest import Gpu, requires_gpu, requires_torch

pytestmark = [requires_gpu, pytest.mark.gpu]

MIB = 2**20


def _devices() -> list[tuple[str, Any]]:
    """Every GPU and every MIG device, labelled."""
    found = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        found.append((f"gpu {index}", handle))
        try:
            slots = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        except pynvml.NVMLError:
            slots = 0
        for slot in range(slots):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError:
                continue
            found.append((f"gpu {index} mig {slot}", mig))
    return found


def test_memory_v2_total_is_reserved_plus_used_plus_free(nvml: None) -> None:
    for label, handle in _devices():
        try:
            v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
        except (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch):
            pytest.skip("this driver has no nvmlDeviceGetMemoryInfo_v2")
        v1 = pynvml.nvmlDeviceGetMemoryInfo(handle)
        for _ in range(3):  # v1 and v2 are two calls: retry if memory moved in between
            v2 = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            again = pynvml.nvmlDeviceGetMemoryInfo(handle)
            if (again.used, again.free) == (v1.used, v1.free):
                break
            v1 = again
        gap = v2.total - (v2.reserved + v2.used + v2.free)
        print(
            f"{label}: v2 total={v2.total} reserved={v2.reserved} used={v2.used} "
            f"free={v2.free} (total - reserved - used - free = {gap}); "
            f"v1 total={v1.total} used={v1.used} free={v1.free}"
        )
        assert gap == 0, f"{label}: v2 total != reserved + used + free (off by {gap} bytes)"
        assert v1.total == v2.total, label
        assert v1.free == v2.free, label
        assert v1.used == v2.used + v2.reserved, label


def _cycle(source: NvmlSource, state: OrphanState, policy: Any, load: str, cycle: int) -> Any:
    """One exporter cycle through the real orphan check; prints the unlisted memory."""
    nvml_snapshot = source.sample()
    snapshot = NodeSnapshot(node_name="gpu-check", nvml=nvml_snapshot, timestamp=time.time())
    found, state = find_orphans(
        snapshot, attribute(snapshot), state, now=snapshot.timestamp, policy=policy
    )
    for gpu in nvml_snapshot.gpus:
        if gpu.mig_enabled or gpu.memory_used_bytes is None:
            continue
        listed = [p.memory_used_bytes for p in gpu.processes]
        known = sum(m for m in listed if m is not None)
        print(
            f"{load} cycle {cycle} gpu {gpu.index}: used {gpu.memory_used_bytes / MIB:.1f} MiB "
            f"(reserved {(gpu.memory_reserved_bytes or 0) / MIB:.1f}), {len(listed)} listed "
            f"process(es) {known / MIB:.1f} MiB ({listed.count(None)} unknown), unlisted "
            f"{(gpu.memory_used_bytes - known) / MIB:.1f} MiB; threshold "
            f"{policy.unattributed_threshold_bytes / MIB:.0f} MiB"
        )
    return found, state, nvml_snapshot


@pytest.mark.parametrize("load", ["idle", pytest.param("busy", marks=requires_torch)])
def test_memory_no_process_accounts_for_stays_below_the_orphan_threshold(
    whole_gpu: Gpu, workload: Any, load: str
) -> None:
    """The exporter's own orphan check, with the shipped defaults, over as many cycles
    as it needs to report: a healthy GPU must not show 'unattributed' memory."""
    policy = policy_from(parse_config([], env={})).orphans
    pid = None
    if load == "busy":
        pid = workload("heavy", "60", uuid=whole_gpu.uuid).pid
        time.sleep(2.0)
    source = NvmlSource()
    state = OrphanState()
    found: Any = ()
    try:
        for cycle in range(policy.unattributed_cycles):
            found, state, nvml_snapshot = _cycle(source, state, policy, load, cycle)
            time.sleep(1.0)
    finally:
        source.close()
    if pid is not None:
        target = next(g for g in nvml_snapshot.gpus if g.uuid == whole_gpu.uuid)
        assert pid in {p.pid for p in target.processes}, "the load is not listed on its GPU"
    unattributed = [o for o in found if o.kind == KIND_UNATTRIBUTED]
    assert unattributed == [], f"a healthy {load} GPU reported unattributed memory: {found}"
