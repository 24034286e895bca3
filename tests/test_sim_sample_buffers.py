"""The simulated driver's sample buffers (exporter/sim/nvml_library.py): nvmlDeviceGetSamples
(GPU and memory utilisation) and nvmlDeviceGetProcessUtilization, read through the real
pynvml as the exporter reads them. What they hold is in docs/simulator.md ("Sample
buffers"): the samples of a read chained on the last timestamp seen integrate to the
node's busy-weighted activity, however long the reads are apart within the buffer."""

from __future__ import annotations

import ctypes
import itertools
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import (
    PROCESS_SAMPLE_US,
    PROCESS_SAMPLES_KEPT,
    SIM_EPOCH_S,
    UTILIZATION_SAMPLE_US,
    UTILIZATION_SAMPLES_KEPT,
    install,
)
from exporter.sim.scenario import SimDuty, parse_scenario

GPU_UTIL = pynvml.NVML_GPU_UTILIZATION_SAMPLES
MEMORY_UTIL = pynvml.NVML_MEMORY_UTILIZATION_SAMPLES
EPOCH_US = SIM_EPOCH_S * 1_000_000
PERIOD_S = UTILIZATION_SAMPLE_US / 1e6
BUFFER_S = PROCESS_SAMPLES_KEPT * PROCESS_SAMPLE_US / 1e6  # what a process sample averages


def scenario(sm: int = 60, **gpu: Any) -> dict[str, Any]:
    """One GPU (GPU-Util 90 %, memory 40 % unless told) and one pod's process on it."""
    container = {
        "name": "trainer",
        "devices": {"nvidia.com/gpu": ["gpu0"]},
        "processes": [{"gpu": 0, "memory": "1GiB", "sm": sm}],
    }
    return {
        "gpus": [{"utilization_gpu": 90, "utilization_memory": 40, **gpu}],
        "pods": [{"namespace": "ml", "name": "p-0", "containers": [container]}],
    }


class Node:
    def __init__(self, data: dict[str, Any]) -> None:
        self.clock = ManualClock()
        self.sim = SimNode(parse_scenario(data, "test"), self.clock)
        self.library = install(self.sim)
        pynvml.nvmlInit()
        self.handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.pid = self.sim.processes[0].pid if self.sim.processes else None

    def samples(self, last_seen: int, kind: int = GPU_UTIL) -> list[tuple[int, int]]:
        value_type, samples = pynvml.nvmlDeviceGetSamples(self.handle, kind, last_seen)
        assert value_type == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
        return [(s.timeStamp, s.sampleValue.uiVal) for s in samples]

    def newer(self, last_seen: int) -> list[tuple[int, int]]:
        """GPU-Util samples newer than ``last_seen``, none where the driver has none."""
        try:
            return self.samples(last_seen)
        except pynvml.NVMLError_NotFound:
            return []

    def processes(self, last_seen: int) -> list[tuple[int, int, int]]:
        return [
            (s.pid, s.timeStamp, s.smUtil)
            for s in pynvml.nvmlDeviceGetProcessUtilization(self.handle, last_seen)
        ]


@pytest.fixture
def nodes() -> Iterator[list[Node]]:
    made: list[Node] = []
    yield made
    if made:
        pynvml.nvmlShutdown()


def make(nodes: list[Node], data: dict[str, Any]) -> Node:
    """A node; the one before it is shut down first, as a driver would be unloaded."""
    if nodes:
        pynvml.nvmlShutdown()
    node = Node(data)
    nodes.append(node)
    return node


def sim_time(stamp_us: int) -> float:
    return (stamp_us - EPOCH_US) / 1e6


# -- integration over a duty cycle ---------------------------------------------------------

DUTIES = {
    "10 s of every 30": {"period_s": 30, "busy": 1 / 3},
    "100 ms bursts": {"period_s": 0.3, "busy": 1 / 3},
}


@pytest.mark.parametrize("duty", DUTIES.values(), ids=DUTIES.keys())
@pytest.mark.parametrize("every_s", [10.0, 15.0, 7.3])
@pytest.mark.parametrize("util", [90, 3])
def test_gpu_util_samples_integrate_to_the_busy_weighted_util(
    nodes: list[Node], duty: dict[str, float], every_s: float, util: int
) -> None:
    """At 3 % in 100 ms bursts a sample holds 0.6 % at most: rounded one by one they
    would lose most of it; each sample's rounding is carried into the next."""
    node = make(nodes, scenario(duty=duty, utilization_gpu=util))
    last_seen, percent_seconds, stamps = 0, 0.0, []
    while node.clock.now + every_s <= 300:
        node.clock.advance(every_s)
        for stamp, value in node.newer(last_seen):
            assert stamp > last_seen and value <= util
            stamps.append(stamp)
            percent_seconds += value * PERIOD_S
            last_seen = stamp
    assert stamps == sorted(stamps)
    # the first read finds the buffer full (the node ran before the reader): from there
    begin, end = sim_time(stamps[0]) - PERIOD_S, sim_time(last_seen)
    assert begin >= every_s - UTILIZATION_SAMPLES_KEPT * PERIOD_S - PERIOD_S
    truth = util * SimDuty(**duty).busy_time(begin, end)
    assert percent_seconds == pytest.approx(truth, rel=0.005)
    assert abs(percent_seconds - truth) <= util * PERIOD_S  # within one period at the edges


@pytest.mark.parametrize("duty", DUTIES.values(), ids=DUTIES.keys())
def test_process_samples_integrate_to_the_busy_weighted_sm_share(
    nodes: list[Node], duty: dict[str, float]
) -> None:
    node = make(nodes, scenario(sm=60, duty=duty))
    last_seen, sm_seconds, begin = 0, 0.0, None
    for _ in range(30):
        node.clock.advance(10.0)
        try:
            (entry,) = node.processes(last_seen)
        except pynvml.NVMLError_NotFound:
            continue  # idle since the last read
        pid, stamp, sm = entry
        assert pid == node.pid and stamp > last_seen
        start = max(sim_time(last_seen), sim_time(stamp) - BUFFER_S)
        begin = start if begin is None else begin
        sm_seconds += sm * (sim_time(stamp) - start)
        last_seen = stamp
    assert begin is not None
    truth = 60 * SimDuty(**duty).busy_time(begin, sim_time(last_seen))
    # one rounded percent per read: within 0.5 % x 10 s of the truth per read
    assert sm_seconds == pytest.approx(truth, abs=30 * 0.5 * 10)
    assert sm_seconds == pytest.approx(truth, rel=0.01)


def test_a_timeline_change_is_integrated_from_its_time(nodes: list[Node]) -> None:
    data = {**scenario(), "timeline": [{"at": 12.0, "set": {"gpu": 0, "utilization_gpu": 30}}]}
    node = make(nodes, data)
    node.clock.advance(10.0)
    first = node.samples(0)
    node.clock.advance(10.0)
    second = node.samples(first[-1][0])
    total = sum(value for _, value in first + second) * PERIOD_S
    begin, end = sim_time(first[0][0]) - PERIOD_S, sim_time(second[-1][0])
    assert total == pytest.approx(90 * (12 - begin) + 30 * (end - 12), abs=90 * PERIOD_S)
    assert {v for s, v in second if sim_time(s) > 12 + PERIOD_S} == {30}


def test_memory_samples_hold_the_memory_utilisation(nodes: list[Node]) -> None:
    node = make(nodes, scenario())
    node.clock.advance(5.0)
    samples = node.samples(0, MEMORY_UTIL)
    assert {value for _, value in samples[1:]} == {40}


# -- what a read returns -------------------------------------------------------------------


def test_samples_are_one_period_apart_and_newer_than_last_seen(nodes: list[Node]) -> None:
    node = make(nodes, scenario())
    node.clock.advance(10.0)
    everything = node.samples(0)
    stamps = [stamp for stamp, _ in everything]
    assert {b - a for a, b in itertools.pairwise(stamps)} == {UTILIZATION_SAMPLE_US}
    assert all(stamp % UTILIZATION_SAMPLE_US == 0 for stamp in stamps)
    assert sim_time(stamps[-1]) <= 10.0 < sim_time(stamps[-1]) + PERIOD_S  # the last ended
    middle = stamps[len(stamps) // 2]
    assert node.samples(middle) == [s for s in everything if s[0] > middle]
    assert node.samples(middle - 1) == [s for s in everything if s[0] >= middle]


def test_nothing_newer_is_not_found(nodes: list[Node]) -> None:
    node = make(nodes, scenario())
    node.clock.advance(3.0)
    last = node.samples(0)[-1][0]
    (_, last_process, _) = node.processes(0)[0]
    node.clock.advance(0.01)  # still within the same periods
    with pytest.raises(pynvml.NVMLError_NotFound):
        node.samples(last)
    with pytest.raises(pynvml.NVMLError_NotFound):
        node.processes(last_process)


def test_an_idle_gpu_keeps_no_samples(nodes: list[Node]) -> None:
    """The driver's utilisation buffers "run dry whenever the GPU sits idle"
    (polarsignals/gpu-metrics-agent#37): periods with 0 hold no sample."""
    node = make(nodes, scenario(duty={"period_s": 30, "busy": 1 / 3}))
    node.clock.advance(12.0)
    last = node.samples(0)[-1][0]
    assert sim_time(last) <= 10.0 + PERIOD_S
    node.clock.advance(15.0)  # t = 27: idle since 10
    with pytest.raises(pynvml.NVMLError_NotFound):
        node.samples(last)
    with pytest.raises(pynvml.NVMLError_NotFound):
        node.processes(node.processes(0)[0][1])


def test_a_reader_later_than_the_buffer_gets_only_the_buffer(nodes: list[Node]) -> None:
    node = make(nodes, scenario(sm=60))
    node.clock.advance(60.0)
    samples = node.samples(0)
    assert len(samples) == UTILIZATION_SAMPLES_KEPT
    assert samples[-1][0] - samples[0][0] == (UTILIZATION_SAMPLES_KEPT - 1) * UTILIZATION_SAMPLE_US
    ((_, stamp, sm),) = node.processes(0)
    assert sm == 60  # the mean over the buffer's 20 s, not over the 60 s since 0
    assert sim_time(stamp) == pytest.approx(60.0)
    kept_s = PROCESS_SAMPLES_KEPT * PROCESS_SAMPLE_US / 1e6
    assert kept_s == pytest.approx(20.0)


def test_a_process_active_only_before_the_buffer_is_not_found(nodes: list[Node]) -> None:
    pid = parse_scenario(scenario(), "test").processes[0].pid
    node = make(nodes, {**scenario(), "timeline": [{"at": 1.0, "exit": pid}]})
    node.clock.advance(0.5)
    assert node.processes(0)[0][0] == pid
    node.clock.advance(10.0)
    ((_, stamp, sm),) = node.processes(0)  # its last active period ended at 1 s
    assert sim_time(stamp) == pytest.approx(1.0)
    assert sm == 60  # the 20 s up to it: it ran before the reader came
    node.clock.advance(30.0)
    with pytest.raises(pynvml.NVMLError_NotFound):
        node.processes(0)


# -- the C protocol: sizes, capacity, errors ----------------------------------------------


def _raw_samples(node: Node, last_seen: int, capacity: int | None) -> tuple[int, int, list[int]]:
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetSamples")
    value_type = ctypes.c_uint(99)
    count = ctypes.c_uint(capacity or 0)
    array = None if capacity is None else (pynvml.c_nvmlSample_t * capacity)()
    ret = fn(
        node.handle,
        ctypes.c_uint(GPU_UTIL),
        ctypes.c_ulonglong(last_seen),
        ctypes.byref(value_type),
        ctypes.byref(count),
        array,
    )
    stamps = [] if array is None else [array[i].timeStamp for i in range(count.value)]
    return ret, count.value, stamps


def test_the_size_query_and_a_short_buffer(nodes: list[Node]) -> None:
    node = make(nodes, scenario())
    node.clock.advance(2.0)
    ret, available, _ = _raw_samples(node, 0, None)
    assert ret == pynvml.NVML_SUCCESS and available == len(node.samples(0)) == 120
    ret, written, stamps = _raw_samples(node, 0, 5)
    assert ret == pynvml.NVML_SUCCESS and written == 5
    assert stamps == [stamp for stamp, _ in node.samples(0)[:5]]  # the oldest: read on
    assert _raw_samples(node, 0, 0)[0] == pynvml.NVML_ERROR_INVALID_ARGUMENT

    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
    count = ctypes.c_uint(0)
    ret = fn(node.handle, None, ctypes.byref(count), ctypes.c_ulonglong(0))
    assert ret == pynvml.NVML_ERROR_INSUFFICIENT_SIZE and count.value == 1


def test_mig_other_sample_types_and_scenario_faults(nodes: list[Node]) -> None:
    node = make(nodes, {**scenario(), "missing_functions": ["nvmlDeviceGetSamples"]})
    node.clock.advance(1.0)
    with pytest.raises(pynvml.NVMLError_FunctionNotFound):
        node.samples(0)

    node = make(nodes, scenario(unsupported=["nvmlDeviceGetSamples"]))
    node.clock.advance(1.0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        node.samples(0)
    assert node.processes(0)  # the other buffer is there

    node = make(nodes, scenario())
    node.clock.advance(1.0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        node.samples(0, pynvml.NVML_TOTAL_POWER_SAMPLES)
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        node.samples(0, 42)

    node = make(nodes, {"gpus": [{"mig": [{"profile": "1g.10gb"}]}]})
    node.clock.advance(1.0)
    with pytest.raises(pynvml.NVMLError_NotSupported):
        node.samples(0)

    errors = [{"call": "nvmlDeviceGetSamples", "error": "GPU_IS_LOST", "from": 0, "until": 5}]
    node = make(nodes, {**scenario(), "call_errors": errors})
    node.clock.advance(1.0)
    with pytest.raises(pynvml.NVMLError_GpuIsLost):
        node.samples(0)
    node.clock.advance(5.0)
    assert node.samples(0)


def test_a_process_sample_near_the_buffers_end_averages_its_whole_window(
    nodes: list[Node],
) -> None:
    """Pid runs 60 % to 20 s, 40 % to 30 s, then exits; read at 49.9 s (its last period
    19.9 s old): the mean is over (10 s, 30 s], though part of it is older than the
    buffer, so the activity log reaches back that far."""
    pid = parse_scenario(scenario(), "test").processes[0].pid
    timeline = [
        {"at": 20.0, "set_process": {"pid": pid, "sm": 40}},
        {"at": 30.0, "exit": pid},
    ]
    node = make(nodes, {**scenario(), "timeline": timeline})
    node.clock.advance(1.0)
    last_seen = node.processes(0)[0][1]
    node.clock.advance(25.0)  # a read at 26 s sees the change at 20 s
    node.processes(last_seen)
    node.clock.advance(23.9)
    ((_, stamp, sm),) = node.processes(last_seen)
    assert sim_time(stamp) == pytest.approx(30.0) and sm == (60 + 40) // 2
