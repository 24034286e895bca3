"""NVML process listings as real drivers answer them, through the real pynvml.

Two driver behaviours the simulated library reproduces (docs/simulator.md):

- ``usedGpuMemory`` NVML_VALUE_NOT_AVAILABLE (WDDM; MIG without privileges, unverified):
  pynvml turns it into None, and the exporter must keep it unknown all the way to
  /metrics: no memory series that is a 0 or a partial sum, no orphan claimed on a guess;
- drivers 535.43.02 to 535.86.05 writing a 32-byte struct through the ``_v3`` listings
  where pynvml reads 24 bytes (nvitop issue #75): the exporter must read true pids.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from exporter.analysis.attribution import attribute
from exporter.analysis.orphans import OrphanPolicy, find_orphans
from exporter.model import Analysis, GpuProcess, NodeSnapshot, OrphanState, ProcessIdentity
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import SimNvmlLibrary, install
from exporter.sim.scenario import ScenarioError, parse_scenario
from exporter.snapshot import render_text
from exporter.sources.nvml import NvmlSource
from tests.harness import Scrape, simulated_exporter

GiB = 1024**3

# Three compute processes on GPU 0: a 32-byte entry read at 24 bytes is right only for
# the first one, so a listing of one would not show the fault.
R535_EARLY: dict[str, Any] = {
    "driver_version": "535.54.03",
    "nvml_version": "12.535.54.03",
    "cuda_driver_version": 12020,
    "process_info_layout": "r535_early",
    "gpus": [{}, {}],
    "host_processes": [
        {"pid": 2001, "gpu": 0, "memory": "10GiB"},
        {"pid": 2002, "gpu": 0, "memory": "20GiB"},
        {"pid": 2003, "gpu": 0, "memory": "30GiB"},
        {"pid": 2004, "gpu": 0, "memory": "1GiB", "kind": "graphics"},
        {"pid": 2005, "gpu": 1, "memory": "2GiB", "kind": "mps"},
        {"pid": 2006, "gpu": 1, "memory": "3GiB", "kind": "mps"},
    ],
}
R535_EARLY_GPU0 = (
    GpuProcess(pid=2001, memory_used_bytes=10 * GiB, kind="compute"),
    GpuProcess(pid=2002, memory_used_bytes=20 * GiB, kind="compute"),
    GpuProcess(pid=2003, memory_used_bytes=30 * GiB, kind="compute"),
    GpuProcess(pid=2004, memory_used_bytes=1 * GiB, kind="graphics"),
)
R535_EARLY_GPU1 = (
    GpuProcess(pid=2005, memory_used_bytes=2 * GiB, kind="mps"),
    GpuProcess(pid=2006, memory_used_bytes=3 * GiB, kind="mps"),
)

# GPU 0: MIG, and its listings cannot say how much memory a process holds. GPU 1: the
# same workload with memory known, so that every absence below is shown to be a choice.
MIG_3G = {"profile": "3g.40gb", "gpu_instance_id": 1, "compute_instance_id": 0}
UNKNOWN_MEMORY: dict[str, Any] = {
    "gpus": [
        {"process_memory_unavailable": True, "mig": [MIG_3G], "unaccounted_memory": "4GiB"},
        {"mig": [MIG_3G], "unaccounted_memory": "4GiB"},
    ],
    "pods": [
        {
            "namespace": "ml",
            "name": f"job-{gpu}",
            "containers": [
                {
                    "name": "main",
                    "devices": {"nvidia.com/mig-3g.40gb": [f"gpu{gpu}/mig0"]},
                    "processes": [
                        {"pid": 3000 + 10 * gpu, "gpu": gpu, "mig": 0, "memory": "6GiB"},
                        {"pid": 3001 + 10 * gpu, "gpu": gpu, "mig": 0, "memory": "2GiB"},
                    ],
                }
            ],
        }
        for gpu in (0, 1)
    ],
    "host_processes": [  # killed, NVML still lists them: dead_process orphans
        {"pid": 3100, "gpu": 0, "mig": 0, "memory": "1GiB", "alive": False},
        {"pid": 3110, "gpu": 1, "mig": 0, "memory": "1GiB", "alive": False},
    ],
}


@pytest.fixture
def nvml() -> Iterator[list[NvmlSource]]:
    """Sources made on simulated nodes, closed afterwards."""
    made: list[NvmlSource] = []
    yield made
    for source in made:
        source.close()


def nvml_on(made: list[NvmlSource], scenario: dict[str, Any]) -> NvmlSource:
    return node_on(made, scenario)[2]


def node_on(
    made: list[NvmlSource], scenario: dict[str, Any]
) -> tuple[ManualClock, SimNvmlLibrary, NvmlSource]:
    """A source on a simulated node, with the node's clock and the library that counts
    its calls."""
    clock = ManualClock()
    library = install(SimNode(parse_scenario(scenario, "test"), clock))
    source = NvmlSource(clock=clock)
    made.append(source)
    return clock, library, source


# -- the simulated driver, seen through pynvml alone --------------------------------------


def test_early_r535_v3_listing_reads_back_impossible_pids_where_v2_reads_true_ones(
    nvml: list[NvmlSource],
) -> None:
    nvml_on(nvml, R535_EARLY)  # installs the library; pynvml is used directly below
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        garbled = [p.pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)]
        true = [(p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)]
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetRunningProcessDetailList(
                h, pynvml.nvmlProcessDetailList_v1, pynvml.NVML_PROCESS_MODE_COMPUTE
            )
    finally:
        pynvml.nvmlShutdown()
    # the first entry lines up; then usedGpuCcProtectedMemory (0) and the MIG ids
    # (0xFFFFFFFF) of the wider entries land where pynvml reads pids
    assert garbled == [2001, 0, 0xFFFFFFFF]
    assert true == [(2001, 10 * GiB), (2002, 20 * GiB), (2003, 30 * GiB)]


def test_a_current_driver_lists_processes_in_detail_with_no_protected_memory(
    nvml: list[NvmlSource],
) -> None:
    nvml_on(nvml, {**R535_EARLY, "process_info_layout": "v2"})
    pynvml.nvmlInit()
    try:
        h = pynvml.nvmlDeviceGetHandleByIndex(1)
        detail = pynvml.nvmlDeviceGetRunningProcessDetailList(
            h, pynvml.nvmlProcessDetailList_v1, pynvml.NVML_PROCESS_MODE_MPS
        )
        rows = [(p.pid, p.usedGpuMemory, p.usedGpuCcProtectedMemory) for p in detail]
        v3 = [p.pid for p in pynvml.nvmlDeviceGetMPSComputeRunningProcesses_v3(h)]
    finally:
        pynvml.nvmlShutdown()
    assert rows == [(2005, 2 * GiB, 0), (2006, 3 * GiB, 0)]
    assert v3 == [2005, 2006]


def test_unavailable_process_memory_reaches_pynvml_as_none_and_still_fills_the_device(
    nvml: list[NvmlSource],
) -> None:
    nvml_on(nvml, UNKNOWN_MEMORY)
    pynvml.nvmlInit()
    try:
        gpu0 = pynvml.nvmlDeviceGetHandleByIndex(0)
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu0, 0)
        listed = [
            (p.pid, p.usedGpuMemory) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(mig)
        ]
        used = pynvml.nvmlDeviceGetMemoryInfo(gpu0, version=pynvml.nvmlMemory_v2).used
    finally:
        pynvml.nvmlShutdown()
    assert listed == [(3000, None), (3001, None), (3100, None)]
    assert used == (6 + 2 + 1 + 4) * GiB


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"process_info_layout": "v3"},
            "process_info_layout: 'v3' is not one of v2, r535_early",
        ),
        (
            {"gpus": [{"process_memory_unavailable": "yes"}]},
            "gpus[0].process_memory_unavailable: expected true or false",
        ),
    ],
)
def test_process_listing_scenario_keys_are_validated_in_one_line(
    change: dict[str, Any], message: str
) -> None:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario({**R535_EARLY, **change}, "test")
    assert str(caught.value) == message


# -- the NVML source ----------------------------------------------------------------------


def test_early_r535_driver_gives_true_pids_through_the_v2_listings(
    nvml: list[NvmlSource],
) -> None:
    snap = nvml_on(nvml, R535_EARLY).sample()
    assert snap.gpus[0].processes == R535_EARLY_GPU0
    assert snap.gpus[1].processes == R535_EARLY_GPU1
    assert snap.errors == ()


def test_impossible_pids_from_a_driver_the_symbol_test_misses_are_reread_through_v2(
    nvml: list[NvmlSource],
) -> None:
    # Without ConfComputeMemSizeInfo the driver cannot be told from a pre-R535 one by its
    # symbols; the pids it answers give it away.
    scenario = {**R535_EARLY, "missing_functions": ["nvmlDeviceGetConfComputeMemSizeInfo"]}
    source = nvml_on(nvml, scenario)
    for _ in range(2):
        snap = source.sample()
        assert snap.gpus[0].processes == R535_EARLY_GPU0
        assert snap.gpus[1].processes == R535_EARLY_GPU1
        assert snap.errors == ()


def test_unavailable_process_memory_is_none_in_the_sample_not_zero(
    nvml: list[NvmlSource],
) -> None:
    gpu0, gpu1 = nvml_on(nvml, UNKNOWN_MEMORY).sample().gpus
    assert [(p.pid, p.memory_used_bytes) for p in gpu0.mig_instances[0].processes] == [
        (3000, None),
        (3001, None),
        (3100, None),
    ]
    assert [(p.pid, p.memory_used_bytes) for p in gpu1.mig_instances[0].processes] == [
        (3010, 6 * GiB),
        (3011, 2 * GiB),
        (3110, 1 * GiB),
    ]


# -- served: /metrics and the snapshot subcommand -----------------------------------------


def served(scrape: Scrape, name: str, gpu: str, **labels: str) -> list[float]:
    return [value for _, value in scrape.find(name, gpu=gpu, **labels)]


async def test_unknown_process_memory_serves_no_memory_series_and_claims_no_orphan_bytes() -> None:
    async with simulated_exporter(UNKNOWN_MEMORY, argv=("--per-process-metrics",)) as h:
        for _ in range(4):  # past the unattributed confirmation (3 cycles)
            await h.advance(10)
        scrape = await h.scrape()

    pod = {"namespace": "ml", "container": "main"}
    # GPU 1, memory known: every series, with the scenario's values
    assert served(scrape, "gpu_container_memory_used_bytes", "1", pod="job-1", **pod) == [8 * GiB]
    assert served(scrape, "gpu_unattributed_memory_used_bytes", "1", owner="dead") == [GiB]
    assert served(scrape, "gpu_orphaned_memory_bytes", "1", kind="dead_process") == [GiB]
    assert served(scrape, "gpu_orphaned_memory_bytes", "1", kind="unattributed") == [4 * GiB]
    assert len(served(scrape, "gpu_process_memory_used_bytes", "1")) == 3
    # GPU 0, memory unknown: the same processes are counted, no byte is guessed
    assert served(scrape, "gpu_container_processes", "0", pod="job-0", **pod) == [2]
    assert served(scrape, "gpu_container_memory_used_bytes", "0", pod="job-0", **pod) == []
    assert served(scrape, "gpu_unattributed_processes", "0", owner="dead") == [1]
    assert served(scrape, "gpu_unattributed_memory_used_bytes", "0", owner="dead") == []
    assert served(scrape, "gpu_orphaned_processes", "0", kind="dead_process") == [1]
    assert served(scrape, "gpu_orphaned_memory_bytes", "0", kind="dead_process") == []
    assert len(served(scrape, "gpu_orphaned_memory_first_seen_timestamp_seconds", "0")) == 1
    # the 4 GiB no process accounts for cannot be told from the processes' own memory
    assert served(scrape, "gpu_orphaned_memory_bytes", "0", kind="unattributed") == []
    assert served(scrape, "gpu_process_memory_used_bytes", "0") == []
    # the device's own memory is known and served
    whole = [v for k, v in scrape.find("gpu_memory_used_bytes", gpu="0") if "mig_uuid" not in k]
    assert whole == [13 * GiB]


def test_snapshot_prints_unknown_memory_as_a_question_mark_not_zero(
    nvml: list[NvmlSource],
) -> None:
    sample = nvml_on(nvml, UNKNOWN_MEMORY).sample()
    # procfs found none of the listed pids: every one has exited
    gone = tuple(
        ProcessIdentity(pid=p.pid, alive=False) for g in sample.gpus for p in g.all_processes()
    )
    snapshot = NodeSnapshot(node_name="sim-node", nvml=sample, processes=gone)
    attribution = attribute(snapshot)
    one_cycle = OrphanPolicy(dead_cycles=1)  # the rendering, not the confirmation
    orphans, _ = find_orphans(snapshot, attribution, OrphanState(), now=0.0, policy=one_cycle)
    text = render_text(Analysis(node=snapshot, attribution=attribution, orphans=orphans))
    owners = text.split("\nNOT OWNED BY ANY CONTAINER\n")[1].split("\n\n")[0].splitlines()
    # GPU 0's memory is unknown
    assert [line.split() for line in owners[1:]] == [
        ["0", "dead", "-", "?", "3"],
        ["1", "dead", "-", "9.0", "3"],
    ]
    orphan_rows = text.split("\nORPHANED GPU MEMORY\n")[1].split("\n\n")[0].splitlines()
    assert [line.split() for line in orphan_rows[1:]] == [
        ["0", "dead_process", "?", "3"],
        ["1", "dead_process", "9.0", "3"],
    ]


def test_pynvml_reads_the_24_byte_process_struct_current_drivers_write() -> None:
    # nvidia-ml-py 12.535.77 read 32 bytes (usedGpuCcProtectedMemory); 12.535.108 went back
    # to nvmlProcessInfo_v2_t, as drivers from 535.104.05 on write (pyproject's floor).
    assert ctypes.sizeof(pynvml.c_nvmlProcessInfo_v3_t) == 24
    assert [name for name, _ in pynvml.c_nvmlProcessInfo_v3_t._fields_] == [
        "pid",
        "usedGpuMemory",
        "gpuInstanceId",
        "computeInstanceId",
    ]


# -- one call per listing ------------------------------------------------------------------


def _listing_calls(library: SimNvmlLibrary) -> int:
    return sum(
        n for name, n in library.calls.by_function.items() if name.endswith("RunningProcesses_v3")
    )


def _busy(pids: int) -> dict[str, Any]:
    """GPU 0 with ``pids`` compute processes, GPU 1 with none."""
    procs = [{"pid": 5000 + i, "gpu": 0, "memory": "1GiB"} for i in range(pids)]
    return {"gpus": [{}, {}], "host_processes": procs}


def test_each_listing_is_one_call_and_a_gpu_that_outgrows_the_room_costs_one_more_once(
    nvml: list[NvmlSource],
) -> None:
    """pynvml's wrappers call twice per listing (the count, then the entries); the source
    calls once with room to spare. 40 processes outgrow the first room (32): that listing
    is called again with room for twice as many plus 5, and every later one fits."""
    clock, library, source = node_on(nvml, _busy(40))
    first = source.sample()
    assert [p.pid for p in first.gpus[0].processes] == [5000 + i for i in range(40)]
    assert first.gpus[1].processes == () and first.gpus[1].processes_listed
    assert _listing_calls(library) == 3 * 2 + 1  # 3 listings per GPU, compute of GPU 0 twice
    before = _listing_calls(library)
    for _ in range(3):
        clock.advance(1.0)
        again = source.sample()
        assert len(again.gpus[0].processes) == 40 and again.errors == ()
    assert _listing_calls(library) - before == 3 * 3 * 2


def test_a_count_past_any_gpus_is_an_error_not_an_allocation(nvml: list[NvmlSource]) -> None:
    """A listing that claims more processes than any GPU holds (room past 4,096 entries)
    is refused: the processes are unknown (not none) and the failure counted."""
    snap = nvml_on(nvml, _busy(2100)).sample()
    gpu0, gpu1 = snap.gpus
    assert not gpu0.processes_listed and gpu0.processes == ()
    assert gpu1.processes_listed
    assert ("nvmlDeviceGetComputeRunningProcesses", "InsufficientSize") in snap.errors


def test_a_listing_answered_as_a_success_with_more_than_the_room_is_asked_again(
    nvml: list[NvmlSource],
) -> None:
    """A driver that answers a too-small array with success and the true count, writing
    only what fits: the listing is asked again with room for all, never served cut short
    as if complete; later cycles fit at once."""
    scenario = _busy(40)
    scenario["gpus"][0]["listing_answers"] = "cut_short"
    clock, library, source = node_on(nvml, scenario)
    first = source.sample()
    assert [p.pid for p in first.gpus[0].processes] == [5000 + i for i in range(40)]
    assert first.gpus[0].processes_listed and first.errors == ()
    before = _listing_calls(library)
    clock.advance(1.0)
    assert len(source.sample().gpus[0].processes) == 40
    assert _listing_calls(library) - before == 3 * 2
