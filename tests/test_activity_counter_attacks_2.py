"""Second round of attacks on the activity counters (docs/metrics.md, "Activity
counters"): the learned GPU-Util sample period, the per-process baseline re-read, the
ABSENT_S retention, the occupancy source-switch rule, MIG and the process stamps.

Same harness as tests/test_activity_counter_attacks.py (``Node``: the real NVML source
over the simulated library behind ``Hostile``, which rewrites driver answers; the
counters are exporter/analysis/active_time.py); nothing under exporter/ is patched.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pynvml
import pytest

from exporter.analysis.active_time import ABSENT_S, account_active_time
from exporter.analysis.pipeline import prefer_dcgm
from exporter.model import (
    ActiveTime,
    AttributedProcess,
    Attribution,
    DcgmSnapshot,
    GpuSample,
    Occupancy,
    ProcessUtilization,
)
from exporter.sources.nvml import NvmlSource
from exporter.sources.nvml_sample_reads import MAX_SAMPLES
from tests.test_activity_counter_attacks import (
    BUSY,
    BUSY_PROCESS,
    EPOCH_US,
    Node,
    ProcSample,
    Reader,
    Sample,
    uuid_of,
)

SIM_PERIOD_S = 0.167  # the simulator's GPU-Util sample period (docs/simulator.md)


def grid(period_us: int, now: float, *, every: int = 1, history_s: float = 20.0) -> list[int]:
    """Stamps of the driver's ended sample periods (every ``every``-th) in its history."""
    last = int((EPOCH_US + now * 1e6) // period_us)
    first = int((EPOCH_US + (now - history_s) * 1e6) // period_us)
    return [k * period_us for k in range(first + 1, last + 1) if k % every == 0]


def cycle(node: Node, step: float, end: float) -> None:
    t = 0.0
    while t <= end + 1e-9:
        node.at(t)
        t += step


# -- the learned sample period ------------------------------------------------------------


def test_two_stray_steps_that_agree_do_not_shrink_the_period(made: list[NvmlSource]) -> None:
    """Exact counters: two stray samples 20 ms after a real one (two reads in a row)
    must not make a busy GPU's later 1/6 s samples count 20 ms each."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        fresh: list[Sample] = [(ts, 1, "uiVal", v) for ts, v in driver if ts > last_seen]
        if now in (10.0, 11.0) and fresh:
            fresh.append((fresh[-1][0] + 20_000, 1, "uiVal", 100))
        return sorted(fresh)

    node = Node({"gpus": [BUSY]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 10)
    before = node.util(uuid_of(node))
    node.run(10, 60)
    active, covered = node.util(uuid_of(node))
    gained = (active - before[0], covered - before[1])
    # busy all along: 50 s covered are 50 s busy, within a period per edge
    assert gained[0] == pytest.approx(gained[1], abs=2 * SIM_PERIOD_S + 0.5), gained


@pytest.mark.parametrize("interval", [1.0, 5.0])
def test_a_gpu_that_never_has_two_consecutive_busy_samples_is_not_overcounted(
    made: list[NvmlSource], interval: float
) -> None:
    """Exact counters: a 50 ms kernel every 2.004 s (12 periods) fills one sample in 12;
    the step between samples (2.004 s) is not the period, busy is 2.5 %, not 30 %."""
    gpu = {"duty": {"period_s": 2.004, "busy": 0.05 / 2.004}, "utilization_gpu": 100}
    node = Node({"gpus": [gpu]}, made)
    cycle(node, interval, 300.0)
    active, covered = node.util(uuid_of(node))
    truth = covered * 0.05 / 2.004
    assert active == pytest.approx(truth, abs=2.0), (active, covered, truth)


def test_timestamps_jittered_by_3_percent_do_not_bias_a_busy_gpu(
    made: list[NvmlSource],
) -> None:
    """Exact counters: stamps jittered +-3 % of a 1/6 s period (a loaded driver thread)
    must not make a busy GPU read busy ~95 % of the time."""
    period = 166_667
    rnd = random.Random(7)
    jitter: dict[int, int] = {}

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        out: list[Sample] = []
        for ts in grid(period, now):
            k = ts // period
            stamp = ts + jitter.setdefault(k, int(rnd.uniform(-0.03, 0.03) * period))
            if last_seen < stamp <= EPOCH_US + now * 1e6:
                out.append((stamp, 1, "uiVal", 100))
        return sorted(out)

    node = Node({"gpus": [BUSY]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 120)
    active, covered = node.util(uuid_of(node))
    assert active == pytest.approx(covered, abs=2 * SIM_PERIOD_S + 0.5), (active, covered)


@pytest.mark.parametrize("interval", [1.0, 5.0])
@pytest.mark.parametrize("value", [100, 10], ids=["steady", "bursty-100ms-of-1s"])
def test_a_product_with_a_one_second_period_reads_exact(
    made: list[NvmlSource], interval: float, value: int
) -> None:
    """Exact counters: nvml.h allows a 1 s period; steady and 100 ms-per-second work."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        return [(ts, 1, "uiVal", value) for ts in grid(1_000_000, now) if ts > last_seen]

    node = Node({"gpus": [BUSY]}, made)
    node.hostile.samples_hook = hook
    cycle(node, interval, 300.0)
    active, covered = node.util(uuid_of(node))
    assert covered >= 290.0
    assert active == pytest.approx(covered * value / 100, abs=2.0), (active, covered)


@pytest.mark.parametrize("interval", [1.0, 5.0])
@pytest.mark.parametrize(
    ("gpu", "busy_fraction"),
    [
        ({"utilization_gpu": 100}, 1.0),
        ({"duty": {"period_s": 30, "busy": 1 / 3}, "utilization_gpu": 100}, None),
        ({"duty": {"period_s": 1, "busy": 0.1}, "utilization_gpu": 100}, 0.1),
    ],
    ids=["steady", "duty-10-of-30", "bursty-100ms-of-1s"],
)
def test_steady_duty_and_bursty_workloads_read_exact_on_the_simulator(
    made: list[NvmlSource], interval: float, gpu: dict[str, Any], busy_fraction: float | None
) -> None:
    """Exact counters at --interval 1 and 5: steady, busy 10 s of 30, 100 ms every 1 s."""
    node = Node({"gpus": [gpu]}, made)
    cycle(node, interval, 300.0)
    active, covered = node.util(uuid_of(node))
    assert covered >= 300.0 - interval - 1e-9
    # the duty cycle's busy third ends each 30 s period: all 100 busy s are covered
    truth = 100.0 if busy_fraction is None else covered * busy_fraction
    assert active == pytest.approx(truth, abs=2 * SIM_PERIOD_S), (active, covered, truth)


def test_one_stale_sample_after_a_stall_does_not_stretch_the_window_as_idle(
    made: list[NvmlSource],
) -> None:
    """Absence is unknown, never idle: after a 90 s stall (the buffer holds 20 s), one
    stale sample stamped just after the last seen must not stretch the window to 90 s
    with 70 s of it idle."""
    stale = [False]

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        fresh: list[Sample] = [(ts, 1, "uiVal", v) for ts, v in driver if ts > last_seen]
        if stale[0] and last_seen:
            fresh.append((last_seen + 167_000, 1, "uiVal", 100))
        return sorted(fresh)

    node = Node({"gpus": [BUSY]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 30)
    stale[0] = True
    node.at(120.0)  # the cycle stalled elsewhere for 90 s
    stale[0] = False
    node.run(121, 130)
    active, covered = node.util(uuid_of(node))
    assert active == pytest.approx(covered, abs=2.0), (active, covered)


@pytest.mark.slow
def test_rounding_a_hair_over_100_percent_is_not_paid_out_as_busy_once_idle(
    made: list[NvmlSource],
) -> None:
    """Exact counters: samples of 100.5 % (accepted as rounding) for 600 s must not bank
    3 s of busy time that an idle GPU then reads as busy."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        double = pynvml.NVML_VALUE_TYPE_DOUBLE
        return [(ts, double, "dVal", 100.5) for ts, _ in driver if ts > last_seen]

    idle_at = {"at": 600, "set": {"gpu": 0, "utilization_gpu": 0}}
    node = Node({"gpus": [BUSY], "timeline": [idle_at]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 601)
    before = node.util(uuid_of(node))
    node.run(601, 630)  # idle: GPU-Util 0, the buffer dry
    active, covered = node.util(uuid_of(node))
    assert covered - before[1] >= 28.0
    assert active - before[0] <= 2 * SIM_PERIOD_S, (active - before[0], covered - before[1])


# -- per-process samples: the baseline re-read and its cost -------------------------------


def _counting(calls: list[float], rewrite: Any = None) -> Any:
    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample] | int:
        calls.append(now)
        entries = read(last_seen)
        return rewrite(entries) if rewrite else entries

    return hook


def test_processes_that_never_get_samples_are_not_read_every_cycle(
    made: list[NvmlSource],
) -> None:
    """Cost: a listed process with no SM activity (NotFound) is read at the process
    interval (10 s), not at every 1 s cycle, baseline re-read or not."""
    idle_process = {**BUSY_PROCESS, "sm": 0}
    node = Node(
        {"gpus": [BUSY], "host_processes": [idle_process]}, made, process_s=10.0, container=(700,)
    )
    calls: list[float] = []
    node.hostile.process_hook = _counting(calls)
    node.run(0, 60)
    assert len(calls) <= 60 / 10 + 2, calls


def test_process_entries_stamped_zero_are_refused_not_read_every_cycle(
    made: list[NvmlSource],
) -> None:
    """Garbage is refused and counted, and costs no read per cycle: entries stamped 0
    (a driver that fills no timestamp) keep lastSeenTimeStamp at 0 for good."""
    calls: list[float] = []

    def zero(entries: list[ProcSample]) -> list[ProcSample]:
        return [(pid, 0, sm, mem) for pid, _, sm, mem in entries]

    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS]}, made, process_s=10.0, container=(700,)
    )
    node.hostile.process_hook = _counting(calls, zero)
    node.run(0, 60)
    assert len(calls) <= 60 / 10 + 2, f"{len(calls)} per-process reads in 60 s at 10 s"
    assert any(q == "process_utilization" for q, _ in node.errors), "stamp 0 not counted"


@pytest.mark.slow
def test_process_stamps_stay_bounded_under_pid_churn(made: list[NvmlSource]) -> None:
    """Memory is bounded: a driver answering 1,000 fresh pids at each read (pid churn)
    must not grow the kept process stamps past one read's bound, nor keep them once
    the GPU is quiet."""
    reads = itertools.count()

    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample]:
        n = next(reads)
        stamp = EPOCH_US + int(now * 1e6)
        return [(100_000 + n * 1000 + i, stamp, 1, 0) for i in range(1000)]

    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS]}, made, process_s=1.0, container=(700,)
    )
    node.hostile.process_hook = hook
    node.run(0, 30)
    kept = len(node.state.process_stamp)
    assert kept <= MAX_SAMPLES, kept
    node.hostile.process_hook = lambda read, last_seen, now: []  # quiet: NotFound
    node.run(30, 30 + int(ABSENT_S) + 10)
    assert len(node.state.process_stamp) <= 1000, len(node.state.process_stamp)


# -- containers: ABSENT_S retention and the stamp comparison ------------------------------


def _row(pid: int, container: str = "main", uuid: str = "GPU-a") -> AttributedProcess:
    return AttributedProcess(
        gpu=0,
        uuid=uuid,
        mig_uuid=None,
        gpu_instance_id=None,
        compute_instance_id=None,
        pid=pid,
        memory_used_bytes=1,
        sm_ratio=None,
        kind="compute",
        owner="pod",
        namespace="ns",
        pod="pod",
        container=container,
    )


def _with_process(t: float, pid: int, stamp: int, sm_seconds: float) -> GpuSample:
    reading = ProcessUtilization(
        pid=pid, sm_percent=50, memory_percent=0, timestamp_us=stamp, sm_seconds=sm_seconds
    )
    return GpuSample(index=0, uuid="GPU-a", process_utilization=(reading,))


def test_a_container_replaced_by_one_of_the_same_names_neither_drops_nor_double_counts() -> None:
    """Counters never go down and count each window once: a container leaves and, within
    ABSENT_S, another of the same names (a recreated StatefulSet pod) with a new pid."""
    state = ActiveTime()
    totals = []
    rows: tuple[AttributedProcess, ...]
    for t in range(0, 200):
        if t < 50:
            gpus, rows = (_with_process(t, 700, 1_000_000 * (t + 1), 0.5),), (_row(700),)
        elif t < 100:
            gpus, rows = (GpuSample(0, "GPU-a"),), ()
        else:
            gpus, rows = (_with_process(t, 900, 1_000_000 * (t + 1), 0.5),), (_row(900),)
        state = account_active_time(state, gpus, Attribution(processes=rows), now=float(t))
        totals.append(sum(state.containers.values()))
    assert all(b >= a for a, b in itertools.pairwise(totals))
    assert totals[-1] == pytest.approx(0.5 * 150), totals[-1]


def test_a_reading_whose_stamp_was_seen_reads_ago_is_not_counted_again(
    made: list[NvmlSource],
) -> None:
    """A window is never counted twice: every third read the driver answers, verbatim,
    the entries it answered two reads before (stamps != the last one kept, equal to one
    from long ago)."""
    answers: list[list[ProcSample]] = []

    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample]:
        answer = answers[-2] if len(answers) >= 2 and len(answers) % 3 == 0 else read(last_seen)
        answers.append(answer)
        return answer

    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS]}, made, process_s=10.0, container=(700,)
    )
    node.hostile.process_hook = hook
    node.run(0, 301)
    total = node.container_total()
    # 80 % SM for at most the 300 s: the stale answers add nothing (their time is
    # covered by the next fresh read, since lastSeenTimeStamp did not move)
    assert total is not None and total <= 0.8 * 300 + 0.5, total
    assert total == pytest.approx(0.8 * 300, abs=0.8 * 12), total


def test_container_churn_is_bounded_by_absent_s() -> None:
    """Memory is bounded: 700 short-lived containers (one a second) leave at most
    ABSENT_S of them in the counters."""
    state = ActiveTime()
    for t in range(0, 700):
        rows = (_row(10_000 + t, container=f"c{t}"),)
        gpus = (_with_process(t, 10_000 + t, 1_000_000 * (t + 1), 0.1),)
        state = account_active_time(state, gpus, Attribution(processes=rows), now=float(t))
    assert len(state.containers) <= ABSENT_S + 2
    assert len(state.container_seen) <= ABSENT_S + 2


# -- the occupancy source switch -----------------------------------------------------------


def test_dcgm_flapping_every_cycle_does_not_leave_the_gpu_uncovered() -> None:
    """Absence is unknown, and a source that answers is evidence: GPM answering every
    10 s and DCGM every other second must cover most of the time, not ~4 %."""
    state = ActiveTime()
    for t in range(1, 121):
        gpm_end = float(t - t % 10)
        gpm = Occupancy(source="gpm", sm_active=0.5, window_end=gpm_end, window_s=10.0)
        gpus = (GpuSample(0, "GPU-a", occupancy=gpm if gpm_end > 0 else None),)
        dcgm_occ = Occupancy(source="dcgm", sm_active=0.5, window_end=float(t), window_s=1.0)
        up = t % 2 == 0
        dcgm = DcgmSnapshot(
            ok=up, timestamp=float(t), occupancy=(("GPU-a", dcgm_occ),) if up else ()
        )
        state = account_active_time(state, prefer_dcgm(gpus, dcgm), Attribution(), now=float(t))
    covered = state.sampled.get("GPU-a", {}).get("sm_active", 0.0)
    assert covered <= 120.0
    assert covered >= 60.0, f"{covered} s of 120 covered"


# -- MIG -----------------------------------------------------------------------------------


def test_the_gpu_util_counter_returns_when_mig_mode_is_turned_off(
    made: list[NvmlSource],
) -> None:
    """A counter is served where its gauge is, and nothing stalls it for good: after MIG
    is disabled (GPU-Util samples NOT_SUPPORTED only while in MIG mode) the GPU-Util
    counter counts again."""
    mig = {"profile": "3g.40gb", "gpu_instance_id": 1, "uuid": "MIG-a"}
    gpu = {"name": "NVIDIA H100 80GB HBM3", "utilization_gpu": 100, "mig": [mig]}
    node = Node(
        {"gpus": [gpu], "timeline": [{"at": 100, "set": {"gpu": 0, "mig": []}}]},
        made,
        slow_s=7.0,
    )
    snapshot = node.run(0, 200)
    assert snapshot.gpus[0].mig_enabled is False and snapshot.gpus[0].utilization_gpu_percent
    active, covered = node.util(uuid_of(node))
    assert covered >= 60.0 and active == pytest.approx(covered, abs=1.0), (active, covered)


def test_one_gpm_metric_failing_on_mig_is_covered_per_metric(made: list[NvmlSource]) -> None:
    """Absence is unknown, per metric and per MIG device: SM_UTIL refused for a minute
    leaves sm_active's mean at 0.9 on each instance while tensor_active stays covered."""
    migs = [
        {"profile": "3g.40gb", "gpu_instance_id": 1, "uuid": "MIG-a"},
        {"profile": "3g.40gb", "gpu_instance_id": 2, "uuid": "MIG-b"},
    ]
    gpu = {"name": "NVIDIA H100 80GB HBM3", "mig": migs}
    node = Node({"gpus": [gpu]}, made, gpm_s=10.0)
    failing = [False]
    sm, tensor = pynvml.NVML_GPM_METRIC_SM_UTIL, pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL

    def hook(metrics: dict[int, tuple[int, float]]) -> dict[int, tuple[int, float]]:
        # the instances' figures (the simulator derives them from processes: none here)
        out = {**metrics, sm: (pynvml.NVML_SUCCESS, 90.0), tensor: (pynvml.NVML_SUCCESS, 40.0)}
        if failing[0]:
            out[sm] = (pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0)
        return out

    node.hostile.gpm_hook = hook
    node.run(0, 60)
    failing[0] = True
    node.run(60, 120)
    failing[0] = False
    node.run(120, 181)
    for uuid in ("MIG-a", "MIG-b"):
        active, sampled = node.state.devices[uuid], node.state.sampled[uuid]
        assert active["sm_active"] / sampled["sm_active"] == pytest.approx(0.9, abs=0.01)
        assert active["tensor_active"] / sampled["tensor_active"] == pytest.approx(0.4, abs=0.01)
        assert sampled["sm_active"] <= sampled["tensor_active"] - 50.0
        assert sampled["tensor_active"] <= 181.0
    assert "MIG-a" not in node.state.devices.get(uuid_of(node), {})
