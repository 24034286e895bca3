"""Attacks on the activity counters and their cadences (docs/metrics.md, "Activity
counters" and "Cadence"; docs/simulator.md, "Sample buffers").

The NVML source reads through the real pynvml over the simulated libnvidia-ml; the
attacks sit at its outer edge only: a scenario's ``call_errors``, or ``Hostile``, which
wraps the simulated library object pynvml holds and rewrites what the driver answers
(garbage values, timestamps, counts, clock steps). The counters are
``exporter/analysis/active_time.py`` over what the source returned; nothing under
exporter/ is patched.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from collections.abc import Callable
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
    NvmlSnapshot,
    Occupancy,
)
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import SIM_EPOCH_S, install
from exporter.sim.scenario import parse_scenario
from exporter.sources import nvml_sample_reads
from exporter.sources.nvml import NvmlSource
from tests.test_nvml_cadence import R580

U64_MAX = 2**64 - 1
EPOCH_US = SIM_EPOCH_S * 1_000_000
# (timestamp µs, value type, union member, value) as the driver answers a sample
Sample = tuple[int, int, str, float]
SamplesHook = Callable[[list[tuple[int, int]], int, float], "list[Sample] | int"]
# (pid, timestamp µs, smUtil, memUtil)
ProcSample = tuple[int, int, int, int]
# the driver's own answer for a lastSeenTimeStamp, that timestamp, the simulated time
ProcessHook = Callable[[Callable[[int], list[ProcSample]], int, float], "list[ProcSample] | int"]
GpmHook = Callable[[dict[int, tuple[int, float]]], dict[int, tuple[int, float]]]


class Hostile:
    """The library pynvml holds, wrapped: every entry point passes through, except the
    sample-buffer reads and GPM metrics, whose answers a hook may rewrite. A hook sees
    the driver's whole buffer (asked with lastSeenTimeStamp 0), the lastSeenTimeStamp
    the exporter asked with and the simulated time, and answers the samples to return
    (it does the lastSeenTimeStamp filtering) or an NVML error code."""

    def __init__(self, inner: Any, clock: ManualClock) -> None:
        self._inner = inner
        self._clock = clock
        self.samples_hook: SamplesHook | None = None
        self.process_hook: ProcessHook | None = None
        self.gpm_hook: GpmHook | None = None
        self.sample_count_override: int | None = None  # the count a NULL buffer gets
        self.process_count_override: int | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _driver_samples(self, handle: Any, kind: Any) -> list[tuple[int, int]]:
        inner = self._inner.nvmlDeviceGetSamples
        vtype, count = ctypes.c_uint(0), ctypes.c_uint(0)
        seen = ctypes.c_ulonglong(0)
        ret = inner(handle, kind, seen, ctypes.byref(vtype), ctypes.byref(count), None)
        if ret != pynvml.NVML_SUCCESS:
            return []
        buf = (pynvml.c_nvmlSample_t * count.value)()
        inner(handle, kind, seen, ctypes.byref(vtype), ctypes.byref(count), buf)
        return [(s.timeStamp, s.sampleValue.uiVal) for s in buf[: count.value]]

    def nvmlDeviceGetSamples(
        self, handle: Any, kind: Any, last_seen: Any, vtype: Any, count: Any, samples: Any
    ) -> int:
        if self.samples_hook is None and self.sample_count_override is None:
            return int(
                self._inner.nvmlDeviceGetSamples(handle, kind, last_seen, vtype, count, samples)
            )
        if self.sample_count_override is not None:  # "there are this many samples"
            count._obj.value = self.sample_count_override
            vtype._obj.value = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
            # a NULL buffer gets the count (nvml.h); any buffer is too small for it
            return pynvml.NVML_SUCCESS if samples is None else pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert self.samples_hook is not None
        answer = self.samples_hook(
            self._driver_samples(handle, kind), last_seen.value, self._clock.now
        )
        if isinstance(answer, int):
            return answer
        if not answer:
            return pynvml.NVML_ERROR_NOT_FOUND
        vtype._obj.value = answer[0][1]
        if samples is None:
            count._obj.value = len(answer)
            return pynvml.NVML_SUCCESS
        written = answer[: count._obj.value]
        for entry, (stamp, _, member, value) in zip(samples, written, strict=False):
            entry.timeStamp = stamp
            setattr(entry.sampleValue, member, value)
        count._obj.value = len(written)
        return pynvml.NVML_SUCCESS

    def _driver_processes(self, handle: Any, last_seen: int) -> list[ProcSample]:
        inner = self._inner.nvmlDeviceGetProcessUtilization
        count = ctypes.c_uint(0)
        seen = ctypes.c_ulonglong(last_seen)
        if inner(handle, None, ctypes.byref(count), seen) != pynvml.NVML_ERROR_INSUFFICIENT_SIZE:
            return []
        buf = (pynvml.c_nvmlProcessUtilizationSample_t * count.value)()
        inner(handle, buf, ctypes.byref(count), seen)
        return [(s.pid, s.timeStamp, s.smUtil, s.memUtil) for s in buf[: count.value]]

    def nvmlDeviceGetProcessUtilization(
        self, handle: Any, samples: Any, count: Any, last_seen: Any
    ) -> int:
        if self.process_hook is None and self.process_count_override is None:
            return int(
                self._inner.nvmlDeviceGetProcessUtilization(handle, samples, count, last_seen)
            )
        if self.process_count_override is not None:
            count._obj.value = self.process_count_override
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        assert self.process_hook is not None
        answer = self.process_hook(
            lambda seen: self._driver_processes(handle, seen), last_seen.value, self._clock.now
        )
        if isinstance(answer, int):
            return answer
        if not answer:
            return pynvml.NVML_ERROR_NOT_FOUND
        capacity = count._obj.value
        count._obj.value = len(answer)
        if samples is None or capacity < len(answer):
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for entry, (pid, stamp, sm, mem) in zip(samples, answer, strict=False):
            entry.pid, entry.timeStamp, entry.smUtil, entry.memUtil = pid, stamp, sm, mem
            entry.encUtil = entry.decUtil = 0
        return pynvml.NVML_SUCCESS

    def nvmlGpmMetricsGet(self, request: Any) -> int:
        ret = int(self._inner.nvmlGpmMetricsGet(request))
        if ret != pynvml.NVML_SUCCESS or self.gpm_hook is None:
            return ret
        req = request._obj
        metrics = {
            req.metrics[i].metricId: (req.metrics[i].nvmlReturn, req.metrics[i].value)
            for i in range(req.numMetrics)
        }
        changed = self.gpm_hook(metrics)
        for i in range(req.numMetrics):
            rc, value = changed[req.metrics[i].metricId]
            req.metrics[i].nvmlReturn, req.metrics[i].value = rc, value
        return ret


class Node:
    """A simulated node, its NVML source behind ``Hostile``, and the counters, cycled by
    hand. ``container``: pids whose SM seconds count for one pod container (the rows
    attribution would give them)."""

    def __init__(
        self,
        scenario: dict[str, object],
        made: list[NvmlSource],
        *,
        gpm_s: float = 0.0,
        process_s: float = 0.0,
        slow_s: float = 30.0,
        container: tuple[int, ...] = (),
    ) -> None:
        self.clock = ManualClock()
        self.sim = SimNode(parse_scenario({**R580, **scenario}, "test"), self.clock)
        self.library = install(self.sim)
        self.hostile = Hostile(pynvml.nvmlLib, self.clock)
        pynvml.nvmlLib = self.hostile
        pynvml._nvmlGetFunctionPointer_cache.clear()
        self.source = NvmlSource(
            clock=self.clock,
            slow_interval_s=slow_s,
            gpm_interval_s=gpm_s,
            process_utilization_interval_s=process_s,
        )
        made.append(self.source)
        self.state = ActiveTime()
        self.container = container
        self.errors: list[tuple[str, str]] = []
        self.history: list[ActiveTime] = []

    def attribution(self, gpus: tuple[GpuSample, ...]) -> Attribution:
        rows = []
        for gpu in gpus:
            for proc in gpu.processes:
                if proc.pid in self.container:
                    rows.append(
                        AttributedProcess(
                            gpu=gpu.index,
                            uuid=gpu.uuid,
                            mig_uuid=None,
                            gpu_instance_id=None,
                            compute_instance_id=None,
                            pid=proc.pid,
                            memory_used_bytes=proc.memory_used_bytes,
                            sm_ratio=None,
                            kind=proc.kind,
                            owner="pod",
                            namespace="ns",
                            pod="pod",
                            container="main",
                        )
                    )
        return Attribution(processes=tuple(rows))

    def at(self, t: float) -> NvmlSnapshot:
        self.clock.now = t
        snapshot = self.source.sample()
        self.errors += list(snapshot.errors)
        self.state = account_active_time(
            self.state, snapshot.gpus, self.attribution(snapshot.gpus), now=t
        )
        self.history.append(self.state)
        return snapshot

    def run(self, start: int, end: int) -> NvmlSnapshot:
        snapshot = None
        for t in range(start, end):
            snapshot = self.at(float(t))
        assert snapshot is not None
        return snapshot

    def util(self, uuid: str) -> tuple[float, float]:
        """(active, covered) seconds of GPU-Util."""
        return (
            self.state.devices.get(uuid, {}).get("utilization", 0.0),
            self.state.sampled.get(uuid, {}).get("utilization", 0.0),
        )

    def container_total(self) -> float | None:
        return next(iter(self.state.containers.values()), None)


BUSY = {"utilization_gpu": 100}  # GPU-Util 100 % all the time
HALF = {"utilization_gpu": 50}  # GPU-Util 50 % all the time
DUTY = {"duty": {"period_s": 30, "busy": 1 / 3}, "utilization_gpu": 100}
BUSY_PROCESS = {"gpu": 0, "memory": "1GiB", "sm": 80, "pid": 700}


def uuid_of(node: Node) -> str:
    return node.sim.gpus[0].uuid


def shifted(step_at_s: float, by_us: int) -> SamplesHook:
    """The driver's CPU clock stepped by ``by_us`` at simulated ``step_at_s``: samples
    taken after it carry stamps off by that much (those before keep theirs)."""
    step_us = EPOCH_US + int(step_at_s * 1e6)

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        out = []
        for ts, value in driver:
            stamp = ts + by_us if ts > step_us else ts
            if stamp > last_seen:
                out.append((stamp, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", value))
        return sorted(out)

    return hook


Reader = Callable[[int], list[ProcSample]]


def process_clock_step(step_at_s: float, by_us: int) -> ProcessHook:
    """The driver's CPU clock stepped by ``by_us`` at simulated ``step_at_s``, for the
    per-process samples: entries stamped after it carry stamps off by that much, and a
    lastSeenTimeStamp in the stepped frame is read back in the driver's own (each entry
    averages the time since lastSeenTimeStamp, so the driver is asked with it)."""
    step_us = EPOCH_US + int(step_at_s * 1e6)
    stepped_frame = step_us + by_us // 2  # beyond: a stamp of the stepped clock (by > 0)

    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample]:
        stepped = last_seen > stepped_frame if by_us > 0 else 0 < last_seen < stepped_frame
        true_seen = last_seen - by_us if stepped else last_seen
        out = []
        for pid, ts, sm, mem in read(max(true_seen, 0)):
            stamp = ts + by_us if ts > step_us else ts
            if stamp > last_seen:
                out.append((pid, stamp, sm, mem))
        return out

    return hook


def rewritten(kind: int, member: str, value: float, *, from_s: float = 0.0) -> SamplesHook:
    """Every sample newer than ``last_seen`` answered as ``value`` of value type ``kind``
    from simulated ``from_s`` on (the driver's own answer before)."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        garbage = now >= from_s
        return [
            (ts, kind, member, value) if garbage else (ts, 1, "uiVal", v)
            for ts, v in driver
            if ts > last_seen
        ]

    return hook


# -- GPU-Util's sample buffer ----------------------------------------------------------


def test_a_read_failing_longer_than_the_buffer_is_not_covered_as_idle(
    made: list[NvmlSource],
) -> None:
    """Absence is unknown: a gap the driver's buffer no longer holds is not covered idle."""
    errors = [{"call": "nvmlDeviceGetSamples", "error": "TIMEOUT", "from": 30, "until": 150}]
    node = Node({"gpus": [BUSY], "call_errors": errors}, made)
    node.run(0, 200)
    active, covered = node.util(uuid_of(node))
    # busy all along: every second the counter covers must be busy
    assert active == pytest.approx(covered, abs=2.0), (active, covered)


def test_a_stalled_cycle_longer_than_the_buffer_is_not_covered_as_idle(
    made: list[NvmlSource],
) -> None:
    """Absence is unknown: a cycle 90 s late (buffer holds 20 s) covers no idle it never saw."""
    node = Node({"gpus": [BUSY]}, made)
    node.run(0, 30)
    node.at(120.0)  # the cycle stalled elsewhere for 90 s
    node.run(121, 130)
    active, covered = node.util(uuid_of(node))
    assert active == pytest.approx(covered, abs=2.0), (active, covered)


def test_cycles_jittering_against_the_sample_period_do_not_lose_busy_time(
    made: list[NvmlSource],
) -> None:
    """A busy GPU reads busy: cycles 1 s apart +-0.3 s (a loaded node) against the
    driver's 1/6 s samples must not lose time to the per-window clamp (active of a
    window that holds one sample more than it spans is cut, and the next does not get
    it back)."""
    node = Node({"gpus": [BUSY]}, made)
    for k in range(0, 300):
        node.at(k + (0.3, -0.3, 0.1, -0.2, 0.25, -0.1)[k % 6])
    active, covered = node.util(uuid_of(node))
    assert active == pytest.approx(covered, rel=0.005), (active, covered, active / covered)


def test_a_one_second_sample_period_out_of_phase_with_the_cycle_reads_busy(
    made: list[NvmlSource],
) -> None:
    """A busy GPU reads busy: nvml.h allows a 1 s sample period; cycles that alternate
    0.2 s and 1.8 s apart (jitter) against it must not read a busy GPU 60 % busy."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        last = math.floor(now)
        stamps = (EPOCH_US + s * 1_000_000 for s in range(max(0, last - 20), last + 1))
        return [(ts, 1, "uiVal", 100) for ts in stamps if ts > last_seen]

    node = Node({"gpus": [BUSY]}, made)
    node.hostile.samples_hook = hook
    for k in range(0, 200):
        node.at(k + (0.9 if k % 2 else 0.1))
    active, covered = node.util(uuid_of(node))
    assert active == pytest.approx(covered, rel=0.01), (active, covered, active / covered)


def test_one_stray_sample_does_not_shrink_the_learned_period_for_good(
    made: list[NvmlSource],
) -> None:
    """A busy GPU reads busy: one stray sample 20 ms after a real one (an irregular
    driver tick) must not make every later 1/6 s sample count as 20 ms."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        fresh: list[Sample] = [(ts, 1, "uiVal", v) for ts, v in driver if ts > last_seen]
        if now == 10.0 and fresh:
            fresh.append((fresh[-1][0] + 20_000, 1, "uiVal", 100))
        return sorted(fresh)

    node = Node({"gpus": [BUSY]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 20)
    before = node.util(uuid_of(node))
    node.run(20, 120)
    active, covered = node.util(uuid_of(node))
    gained = (active - before[0], covered - before[1])
    assert gained[0] == pytest.approx(gained[1], abs=2.0), gained


def test_a_stamp_ahead_within_the_slack_does_not_hide_the_samples_after_it(
    made: list[NvmlSource],
) -> None:
    """Garbage stamps are refused, not served as idle: one sample stamped 50 s ahead
    (inside SLACK_S) must not make the next 50 s of a busy GPU read idle."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        fresh: list[Sample] = [(ts, 1, "uiVal", v) for ts, v in driver if ts > last_seen]
        if now == 10.0:
            fresh.append((EPOCH_US + 60_000_000, 1, "uiVal", 100))
        return fresh

    node = Node({"gpus": [BUSY]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 100)
    active, covered = node.util(uuid_of(node))
    assert active == pytest.approx(covered, abs=2.0), (active, covered)


@pytest.mark.parametrize(
    ("kind", "member", "value"),
    [
        (99, "uiVal", 100),  # a value type nvml.h does not define
        (pynvml.NVML_VALUE_TYPE_DOUBLE, "dVal", math.nan),
        (pynvml.NVML_VALUE_TYPE_SIGNED_LONG_LONG, "sllVal", -50),
    ],
    ids=["value-type-99", "nan", "negative"],
)
def test_garbage_sample_values_are_not_served_as_idle(
    made: list[NvmlSource], kind: int, member: str, value: float
) -> None:
    """Garbage is refused and counted, never served as idle: a busy GPU stays busy."""
    node = Node({"gpus": [BUSY]}, made)
    node.run(0, 30)
    before = node.util(uuid_of(node))
    node.hostile.samples_hook = rewritten(kind, member, value)
    node.run(30, 60)
    active, covered = node.util(uuid_of(node))
    # whatever the garbage windows add, they must not read as idle time
    assert active - before[0] == pytest.approx(covered - before[1], abs=1.0), (
        active - before[0],
        covered - before[1],
    )
    assert any(q == "utilization_samples" for q, _ in node.errors), "garbage not counted"


def test_sample_values_above_100_percent_are_counted_as_errors(made: list[NvmlSource]) -> None:
    """Garbage (> 100 %) is bounded and counted, never silently served as truth."""
    node = Node({"gpus": [BUSY]}, made)
    node.run(0, 10)
    node.hostile.samples_hook = rewritten(pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, "uiVal", 250)
    node.run(10, 20)
    active, covered = node.util(uuid_of(node))
    assert active <= covered + 1e-9
    assert any(q == "utilization_samples" for q, _ in node.errors), "250 % not counted"


def test_duplicated_and_reordered_samples_count_once(made: list[NvmlSource]) -> None:
    """A window is never counted twice: each sample repeated and the order reversed."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        fresh: list[Sample] = [(ts, 1, "uiVal", v) for ts, v in driver if ts > last_seen]
        return list(reversed(fresh + fresh))

    node = Node({"gpus": [HALF]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 100)
    active, covered = node.util(uuid_of(node))
    assert covered == pytest.approx(98.0, abs=1.0)  # the first read is a baseline
    assert active == pytest.approx(covered / 2, abs=1.0), (active, covered)


def test_a_driver_ignoring_last_seen_adds_nothing_twice(made: list[NvmlSource]) -> None:
    """A window is never counted twice: the whole buffer answered at every read."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        return [(ts, 1, "uiVal", v) for ts, v in driver]

    node = Node({"gpus": [HALF]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 100)
    active, covered = node.util(uuid_of(node))
    assert active <= covered + 1e-9 and covered <= 100.0
    assert active == pytest.approx(covered / 2, abs=1.0), (active, covered)


def test_a_sample_count_past_the_bound_is_refused_counted_and_not_allocated(
    made: list[NvmlSource],
) -> None:
    """A count of 2**32 - 1 is refused and counted (no 64 GiB buffer), never idle."""
    node = Node({"gpus": [BUSY]}, made)
    node.run(0, 10)
    before = node.util(uuid_of(node))
    node.hostile.sample_count_override = 2**32 - 1
    snapshot = node.run(10, 20)
    assert snapshot.gpus[0].error is None
    assert ("utilization_samples", "InsufficientSize") in node.errors
    assert node.util(uuid_of(node)) == before  # nothing added, nothing made idle
    node.hostile.sample_count_override = nvml_sample_reads.MAX_SAMPLES + 1
    node.run(20, 22)
    assert node.util(uuid_of(node)) == before


def test_a_u64_max_stamp_at_the_first_read_does_not_stall_the_counter(
    made: list[NvmlSource],
) -> None:
    """Garbage stamps are refused: one u64-max stamp at the first read must not hide
    every later sample (the counter reading idle while the GPU is busy)."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        fresh: list[Sample] = [(ts, 1, "uiVal", v) for ts, v in driver if ts > last_seen]
        if now == 0.0:
            fresh.append((U64_MAX, 1, "uiVal", 100))
        return fresh

    node = Node({"gpus": [DUTY]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 300)
    active, covered = node.util(uuid_of(node))
    # busy a third of the time: the counter must see it (not read 300 s idle)
    assert active == pytest.approx(covered / 3, abs=10.0), (active, covered)


def test_a_u64_max_stamp_after_the_first_read_is_refused_and_counted(
    made: list[NvmlSource],
) -> None:
    """Garbage stamps are refused and counted; a read holding one is no evidence (its
    time is neither active nor covered, never idle), the reads after count again."""

    def hook(driver: list[tuple[int, int]], last_seen: int, now: float) -> list[Sample]:
        fresh: list[Sample] = [(ts, 1, "uiVal", v) for ts, v in driver if ts > last_seen]
        return [*fresh, (U64_MAX, 1, "uiVal", 100)] if 10 <= now < 15 else fresh

    node = Node({"gpus": [BUSY]}, made)
    node.hostile.samples_hook = hook
    node.run(0, 60)
    active, covered = node.util(uuid_of(node))
    assert ("utilization_samples", "ImplausibleTimestamp") in node.errors
    # the five reads holding it (10-14 s) and the next (it starts a new window) uncovered
    assert active == pytest.approx(covered, abs=1.0) and covered == pytest.approx(53, abs=1)


@pytest.mark.parametrize("by_s", [-3600, 3600], ids=["back", "forward"])
def test_a_wall_clock_step_under_a_busy_gpu_is_not_served_as_idle(
    made: list[NvmlSource], by_s: int
) -> None:
    """Absence is unknown: while stamps are suspect after a clock step, a busy GPU's
    counter must not add idle time (active keeps pace with covered)."""
    node = Node({"gpus": [BUSY]}, made)
    node.run(0, 60)
    node.hostile.samples_hook = shifted(60.0, by_s * 1_000_000)
    node.run(60, 400)
    active, covered = node.util(uuid_of(node))
    assert active == pytest.approx(covered, abs=5.0), (active, covered)


@pytest.mark.slow
@pytest.mark.parametrize("by_s", [-3600, 3600], ids=["back", "forward"])
def test_a_wall_clock_step_under_a_duty_cycle_does_not_stall_forever(
    made: list[NvmlSource], by_s: int
) -> None:
    """A clock step must not stall the counters forever: busy 10 s of every 30, the
    counter must count again within a few minutes of the step."""
    node = Node({"gpus": [DUTY]}, made)
    node.run(0, 60)
    node.hostile.samples_hook = shifted(60.0, by_s * 1_000_000)
    node.run(60, 600)
    before = node.util(uuid_of(node))
    node.run(600, 900)
    active, covered = node.util(uuid_of(node))
    # the last 300 s: a third busy
    assert active - before[0] == pytest.approx((covered - before[1]) / 3, abs=10.0)


# -- per-process samples ---------------------------------------------------------------


def _container_node(made: list[NvmlSource], **kw: Any) -> Node:
    return Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS]},
        made,
        process_s=10.0,
        container=(700,),
        **kw,
    )


def test_a_failed_process_read_does_not_count_the_samples_before_it_again(
    made: list[NvmlSource],
) -> None:
    """A window is never counted twice: the samples standing in after a failed read
    were counted when they were read."""
    errors = [
        {"call": "nvmlDeviceGetProcessUtilization", "error": "TIMEOUT", "from": 20, "until": 21}
    ]
    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS], "call_errors": errors},
        made,
        process_s=10.0,
        container=(700,),
    )
    node.run(0, 60)
    total = node.container_total()
    assert ("process_utilization", "Timeout") in node.errors
    # reads at 10, 30, 40 and 50 s (20 s refused) cover 0-50 s at 80 % SM: 40 SM-seconds
    assert total == pytest.approx(0.8 * 50, abs=0.5), total


def test_container_sm_seconds_never_exceed_elapsed_time_for_one_process(
    made: list[NvmlSource],
) -> None:
    """A counter never exceeds elapsed time: one pid repeated 1000 times at 100 %."""

    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample]:
        return [(pid, ts, 100, 50) for pid, ts, _, _ in read(last_seen) for _ in range(1000)]

    node = _container_node(made)
    node.hostile.process_hook = hook
    node.run(0, 120)
    total = node.container_total()
    assert total is not None and total <= 120.0, total


@pytest.mark.slow
def test_a_u64_max_process_stamp_at_the_first_read_does_not_stall_the_counter(
    made: list[NvmlSource],
) -> None:
    """Garbage stamps are refused: one u64-max entry at the first per-process read must
    not hide every later sample (busy 10 s of every 30 at 80 % SM)."""

    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample]:
        if last_seen == U64_MAX:
            return []  # nothing is newer than u64-max: NotFound
        entries = read(last_seen)
        return [*entries, (700, U64_MAX, 80, 40)] if now == 0.0 else entries

    node = Node(
        {"gpus": [DUTY], "host_processes": [BUSY_PROCESS]},
        made,
        process_s=10.0,
        container=(700,),
    )
    node.hostile.process_hook = hook
    node.run(0, 300)
    before = node.container_total() or 0.0
    node.run(300, 600)
    after = node.container_total() or 0.0
    assert after - before == pytest.approx(0.8 * 100, abs=10.0), (before, after)


def test_process_sm_above_100_percent_is_counted_as_an_error(made: list[NvmlSource]) -> None:
    """Garbage (smUtil 2**32 - 1) is bounded and counted, never served as truth."""

    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample]:
        return [(pid, ts, 2**32 - 1, 50) for pid, ts, _, _ in read(last_seen)]

    node = _container_node(made)
    node.hostile.process_hook = hook
    snapshot = node.run(0, 30)
    for reading in snapshot.gpus[0].process_utilization:
        assert 0 <= reading.sm_percent <= 100, reading
    assert any(q == "process_utilization" for q, _ in node.errors), "garbage not counted"


def test_thousands_of_pids_are_bounded_and_a_flood_past_the_bound_refused(
    made: list[NvmlSource],
) -> None:
    """Floods are bounded: 20,000 pids are read, a count past MAX_SAMPLES is refused."""

    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample]:
        stamp = EPOCH_US + int(now * 1e6)
        return [(10_000 + i, stamp, 1, 0) for i in range(20_000)]

    node = _container_node(made)
    node.hostile.process_hook = hook
    snapshot = node.run(0, 2)
    assert len(snapshot.gpus[0].process_utilization) == 20_000
    node.hostile.process_hook = None
    node.hostile.process_count_override = 2**32 - 1
    snapshot = node.run(10, 11)
    assert ("process_utilization", "InsufficientSize") in node.errors
    assert snapshot.gpus[0].error is None


def test_a_process_listing_failing_for_one_cycle_does_not_reset_the_counter(
    made: list[NvmlSource],
) -> None:
    """A counter never goes down except by a real reset: a listing that failed is no
    evidence that the container is gone."""
    errors = [
        {
            "call": "nvmlDeviceGetComputeRunningProcesses_v3",
            "error": "TIMEOUT",
            "from": 40,
            "until": 41,
        }
    ]
    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS], "call_errors": errors},
        made,
        process_s=10.0,
        container=(700,),
    )
    totals = []
    for t in range(0, 60):
        node.at(float(t))
        totals.append(node.container_total() or 0.0)
    assert any(q.startswith("nvmlDeviceGetComputeRunningProcesses") for q, _ in node.errors)
    drops = [(i, a, b) for i, (a, b) in enumerate(itertools.pairwise(totals)) if b < a]
    assert not drops, drops


@pytest.mark.parametrize("by_s", [-3600, 3600], ids=["back", "forward"])
def test_a_clock_step_does_not_stall_the_container_counter(
    made: list[NvmlSource], by_s: int
) -> None:
    """A clock step must not stall the counters forever (here: within five minutes)."""
    hook = process_clock_step(60.0, by_s * 1_000_000)
    node = _container_node(made)
    node.run(0, 60)
    node.hostile.process_hook = hook
    node.run(60, 400)
    before = node.container_total() or 0.0
    node.run(400, 500)
    after = node.container_total() or 0.0
    assert after - before == pytest.approx(0.8 * 100, abs=10.0), (before, after)


@pytest.mark.slow
@pytest.mark.parametrize("by_s", [-3600, 3600], ids=["back", "forward"])
def test_a_clock_step_under_a_duty_cycle_does_not_stall_the_container_counter(
    made: list[NvmlSource], by_s: int
) -> None:
    """A clock step must not stall the counters forever: busy 10 s of every 30 (idle
    stretches end the suspicion before it lasts STEP_S), counting again in minutes."""
    hook = process_clock_step(60.0, by_s * 1_000_000)
    node = Node(
        {"gpus": [DUTY], "host_processes": [BUSY_PROCESS]},
        made,
        process_s=10.0,
        container=(700,),
    )
    node.run(0, 60)
    node.hostile.process_hook = hook
    node.run(60, 600)
    before = node.container_total() or 0.0
    node.run(600, 900)
    after = node.container_total() or 0.0
    # the last 300 s: a third busy at 80 % SM
    assert after - before == pytest.approx(0.8 * 100, abs=10.0), (before, after)


# -- GPM -------------------------------------------------------------------------------

GPM_BUSY = {"gpm": {"sm_active": 90.0, "tensor_active": 40.0}, "utilization_gpu": 100}


def _occupancy_totals(node: Node, uuid: str) -> tuple[float, float, float]:
    devices = node.state.devices.get(uuid, {})
    return (
        devices.get("sm_active", 0.0),
        devices.get("tensor_active", 0.0),
        node.state.sampled.get(uuid, {}).get("sm_active", 0.0),
    )


def test_one_gpm_metric_failing_is_not_read_as_idle_by_the_sampled_ratio(
    made: list[NvmlSource],
) -> None:
    """Absence is unknown: a window without SM_UTIL must not enter the SM mean as idle
    (rate(sm_active_seconds) / rate(sampled{signal="sm_active"}) stays 0.9)."""
    node = Node({"gpus": [GPM_BUSY]}, made, gpm_s=10.0)
    node.run(0, 60)

    def hook(metrics: dict[int, tuple[int, float]]) -> dict[int, tuple[int, float]]:
        sm = pynvml.NVML_GPM_METRIC_SM_UTIL
        return {**metrics, sm: (pynvml.NVML_ERROR_NOT_SUPPORTED, 0.0)}

    node.hostile.gpm_hook = hook
    node.run(60, 120)
    node.hostile.gpm_hook = None
    node.run(120, 181)
    sm, tensor, covered = _occupancy_totals(node, uuid_of(node))
    tensor_covered = node.state.sampled[uuid_of(node)]["tensor_active"]
    assert tensor / tensor_covered == pytest.approx(0.4, abs=0.01)
    assert sm / covered == pytest.approx(0.9, abs=0.01), (sm, covered)  # its own coverage


@pytest.mark.parametrize("value", [-40.0, 250.0, math.inf], ids=["negative", "250", "inf"])
def test_garbage_gpm_values_are_counted_not_served_as_truth(
    made: list[NvmlSource], value: float
) -> None:
    """Garbage GPM values are refused or bounded and counted, never served as truth."""
    node = Node({"gpus": [GPM_BUSY]}, made, gpm_s=10.0)

    def hook(metrics: dict[int, tuple[int, float]]) -> dict[int, tuple[int, float]]:
        return {**metrics, pynvml.NVML_GPM_METRIC_SM_UTIL: (pynvml.NVML_SUCCESS, value)}

    node.hostile.gpm_hook = hook
    snapshot = node.run(0, 30)
    sm, _, covered = _occupancy_totals(node, uuid_of(node))
    assert 0.0 <= sm <= covered
    occupancy = snapshot.gpus[0].occupancy
    assert occupancy is not None and occupancy.sm_active in (None, 0.0, 1.0)
    assert any(q.startswith("gpm") for q, _ in node.errors), "garbage GPM value not counted"


def test_gpm_failing_mid_window_leaves_a_gap_not_idle_nor_a_long_window(
    made: list[NvmlSource],
) -> None:
    """Absence is unknown: GPM refused for a while adds neither active nor covered time,
    and no window spans the gap."""
    errors = [{"call": "nvmlGpmSampleGet", "error": "NO_PERMISSION", "from": 35, "until": 95}]
    node = Node({"gpus": [GPM_BUSY], "call_errors": errors}, made, gpm_s=10.0)
    widths = []
    for t in range(0, 200):
        snapshot = node.at(float(t))
        occ = snapshot.gpus[0].occupancy
        if occ is not None and occ.window_s is not None:
            widths.append(occ.window_s)
    sm, _, covered = _occupancy_totals(node, uuid_of(node))
    assert max(widths) <= 10.0 + 1e-9
    assert covered <= 200 - 60  # the gap is not covered
    assert sm == pytest.approx(0.9 * covered, rel=1e-6)


@pytest.mark.parametrize("gpm_s", [0.1, 3600.0])
def test_gpm_interval_at_its_bounds_keeps_counters_within_wall_time(
    made: list[NvmlSource], gpm_s: float
) -> None:
    """active <= covered <= wall time at --gpm-interval 0.1 and 3600."""
    node = Node({"gpus": [GPM_BUSY]}, made, gpm_s=gpm_s)
    for i in range(0, 400):
        node.at(i * 0.25 if gpm_s < 1 else i * 10.0)
    last = node.clock.now
    sm, _, covered = _occupancy_totals(node, uuid_of(node))
    assert 0.0 <= sm <= covered <= last + 1e-6
    assert covered > 0  # the first window closes one cycle after the primed one


def test_the_gpm_interval_flags_refuse_out_of_bounds_values() -> None:
    """--gpm-interval and --process-utilization-interval stay within their bounds."""
    from exporter.config import ConfigError, parse_config

    for flag in ("--gpm-interval", "--process-utilization-interval"):
        for bad in ("0", "-1", "nan", "inf", "3601", "1e308"):
            with pytest.raises(ConfigError):
                parse_config(["--interval", "0.1", flag, bad], env={})
        config = parse_config(["--interval", "0.1", flag, "3600"], env={})
        assert 3600.0 in (config.gpm_interval_s, config.process_utilization_interval_s)


# -- devices lost, failing, MIG changing -------------------------------------------------


def test_a_gpu_failing_one_cycle_does_not_reset_its_counters(made: list[NvmlSource]) -> None:
    """A counter never goes down except by a real reset: one failed read of a GPU that
    is still there is no new device."""
    errors = [{"call": "nvmlDeviceGetMemoryInfo_v2", "error": "UNKNOWN", "from": 50, "until": 51}]
    node = Node({"gpus": [GPM_BUSY], "call_errors": errors}, made, gpm_s=10.0)
    node.run(0, 50)
    before = node.state.devices[uuid_of(node)]
    snapshot = node.at(50.0)
    assert snapshot.gpus[0].error is not None  # the attack landed
    node.run(51, 80)
    after = node.state.devices[uuid_of(node)]
    for metric, value in before.items():
        assert after.get(metric, 0.0) >= value, (metric, value, after.get(metric))


def test_a_gpu_lost_and_back_keeps_active_within_covered(made: list[NvmlSource]) -> None:
    """Lost and back: no counter served while lost, no window spans the loss, and
    active <= covered <= the time the GPU answered."""
    node = Node(
        {"gpus": [GPM_BUSY], "timeline": [{"at": 30, "lose": 0}, {"at": 90, "restore": 0}]},
        made,
        gpm_s=10.0,
    )
    lost_cycles = 0
    for t in range(0, 150):
        snapshot = node.at(float(t))
        if snapshot.gpus[0].error:
            lost_cycles += 1
            assert snapshot.gpus[0].occupancy is None
            assert snapshot.gpus[0].utilization_window is None
    uuid = uuid_of(node)
    sm, _, covered = _occupancy_totals(node, uuid)
    active, util_covered = node.util(uuid)
    assert lost_cycles >= 50
    assert 0 <= sm <= covered <= 150 - lost_cycles
    assert 0 <= active <= util_covered <= 150 - lost_cycles


def test_a_mig_instance_replaced_in_the_same_gpu_instance_gets_no_window_of_the_old(
    made: list[NvmlSource],
) -> None:
    """A window is counted for the device it measured: an instance created at 100 s in
    GPU instance 1 is not credited a window of the one destroyed there, nor served it."""
    old = {"profile": "3g.40gb", "gpu_instance_id": 1, "uuid": "MIG-old"}
    new = {"profile": "3g.40gb", "gpu_instance_id": 1, "uuid": "MIG-new"}
    gpu = {"name": "NVIDIA H100 80GB HBM3", "mig": [old], "gpm": {"sm_active": 90.0}}
    node = Node(
        {
            "gpus": [gpu],
            "timeline": [
                {"at": 100, "set": {"gpu": 0, "mig": [new]}},
                {"at": 100.5, "set": {"gpu": 0, "gpm": {"sm_active": 10.0}}},
            ],
        },
        made,
        gpm_s=10.0,
        slow_s=7.0,
    )
    first_seen = None
    for t in range(0, 160):
        snapshot = node.at(float(t))
        for mig in snapshot.gpus[0].mig_instances:
            if mig.uuid == "MIG-new":
                if first_seen is None:
                    first_seen = float(t)
                    # the first reading of the new instance is none of the old one's
                    assert mig.occupancy is None or mig.occupancy.sm_active != 0.9, mig
                    continue
                occ = mig.occupancy
                if occ is not None and occ.window_end is not None and occ.window_s is not None:
                    assert occ.window_end - occ.window_s >= first_seen - 1e-9, (t, occ)
    assert first_seen is not None
    covered = node.state.sampled["MIG-new"]["sm_active"]
    assert covered <= 160 - first_seen


def test_mig_instances_coming_and_going_are_pruned(made: list[NvmlSource]) -> None:
    """Memory is bounded: counters of destroyed MIG instances are dropped."""
    migs = [
        [{"profile": "1g.10gb", "gpu_instance_id": 1 + i % 7, "uuid": f"MIG-{i}"}]
        for i in range(30)
    ]
    gpu = {"name": "NVIDIA H100 80GB HBM3", "mig": migs[0], "gpm": {"sm_active": 50.0}}
    timeline = [{"at": 10 * i, "set": {"gpu": 0, "mig": m}} for i, m in enumerate(migs) if i]
    node = Node({"gpus": [gpu], "timeline": timeline}, made, gpm_s=1.0, slow_s=1.0)
    node.run(0, 300)
    # bounded by what was seen within ABSENT_S; once the churn stops, only the last stays
    assert len(node.state.devices) <= 2 + ABSENT_S / 10
    node.run(300, 300 + int(ABSENT_S) + 10)
    assert len(node.state.devices) <= 2 and len(node.state.window_end) <= 4
    assert len(node.source._devices[0].gpm) <= 8  # type: ignore[union-attr]


# -- DCGM and GPM on the same GPU ------------------------------------------------------


def _gpm_sample(end: float, window: float) -> GpuSample:
    occupancy = Occupancy(source="gpm", sm_active=0.5, window_end=end, window_s=window)
    return GpuSample(index=0, uuid="GPU-a", occupancy=occupancy)


def test_dcgm_blank_for_one_read_does_not_double_count_the_gpm_window(
    made: list[NvmlSource],
) -> None:
    """covered <= wall time: DCGM's windows and the GPM window that stands in when DCGM
    is blank for one read must not both count the same seconds."""
    state = ActiveTime()
    for t in range(1, 61):
        gpm_end = float(t - t % 10)  # a 10 s GPM window, served until the next
        gpus = (_gpm_sample(gpm_end, 10.0),) if gpm_end > 0 else (GpuSample(0, "GPU-a"),)
        blank = t % 15 == 0  # DCGM has no value for the GPU at this read
        dcgm_occ = Occupancy(source="dcgm", sm_active=0.5, window_end=float(t), window_s=1.0)
        dcgm = DcgmSnapshot(
            ok=True, timestamp=float(t), occupancy=() if blank else (("GPU-a", dcgm_occ),)
        )
        state = account_active_time(state, prefer_dcgm(gpus, dcgm), Attribution(), now=float(t))
    covered = state.sampled["GPU-a"]["sm_active"]
    assert covered <= 60.0, covered


def test_dcgm_switching_off_and_on_keeps_covered_within_wall_time(
    made: list[NvmlSource],
) -> None:
    """covered <= wall time across DCGM switching off (host engine down) and on again."""
    state = ActiveTime()
    dcgm_read_at: float | None = None
    for t in range(1, 121):
        gpm_end = float(t - t % 10)
        gpus = (_gpm_sample(gpm_end, 10.0),) if gpm_end > 0 else (GpuSample(0, "GPU-a"),)
        dcgm_up = not 45 <= t < 75
        if dcgm_up:
            window = None if dcgm_read_at is None else t - dcgm_read_at
            dcgm_read_at = float(t)
            occ = Occupancy(source="dcgm", sm_active=0.5, window_end=float(t), window_s=window)
            dcgm = DcgmSnapshot(ok=True, timestamp=float(t), occupancy=(("GPU-a", occ),))
        else:
            dcgm_read_at = None  # a failed read drops the connection (dcgm.py sample())
            dcgm = DcgmSnapshot(ok=False, timestamp=float(t))
        state = account_active_time(state, prefer_dcgm(gpus, dcgm), Attribution(), now=float(t))
    covered = state.sampled["GPU-a"]["sm_active"]
    assert covered <= 120.0, covered


# -- restart ---------------------------------------------------------------------------


def test_an_exporter_restart_starts_afresh_and_counts_nothing_from_before(
    made: list[NvmlSource],
) -> None:
    """A restart is a real reset: the new process's first reads are baselines, so no
    counter covers time before it started."""
    node = Node({"gpus": [{**BUSY, **GPM_BUSY}]}, made, gpm_s=10.0)
    node.run(0, 100)
    node.source.close()
    restarted = NvmlSource(clock=node.clock, slow_interval_s=30.0, gpm_interval_s=10.0)
    made.append(restarted)
    node.source, node.state = restarted, ActiveTime()
    node.run(100, 130)
    uuid = uuid_of(node)
    active, covered = node.util(uuid)
    sm, _, occ_covered = _occupancy_totals(node, uuid)
    assert covered <= 30.0 and occ_covered <= 30.0
    assert active == pytest.approx(covered, abs=1.0)
    assert sm == pytest.approx(0.9 * occ_covered, rel=1e-6)


def test_counters_never_go_down_and_stay_within_wall_time_under_mixed_faults(
    made: list[NvmlSource],
) -> None:
    """Monotone, bounded: errors on every sample read now and then, counters checked
    each cycle."""
    errors = [
        {"call": "nvmlDeviceGetSamples", "error": "TIMEOUT", "from": 20, "until": 23},
        {"call": "nvmlGpmSampleGet", "error": "NO_PERMISSION", "from": 40, "until": 42},
        {"call": "nvmlGpmMetricsGet", "error": "TIMEOUT", "from": 61, "until": 62},
    ]
    node = Node({"gpus": [{**GPM_BUSY}], "call_errors": errors}, made, gpm_s=5.0)
    node.run(0, 100)
    previous: ActiveTime | None = None
    for state in node.history:
        for uuid, metrics in state.devices.items():
            covered = state.sampled.get(uuid, {})
            assert metrics.get("sm_active", 0) <= covered.get("sm_active", 0) + 1e-9
            assert metrics.get("utilization", 0) <= covered.get("utilization", 0) + 1e-9
            assert covered.get("sm_active", 0) <= 100 and covered.get("utilization", 0) <= 100
            if previous is not None:
                for metric, value in previous.devices.get(uuid, {}).items():
                    assert metrics.get(metric, 0) >= value
        previous = state


# -- exposition: a counter is served only where its gauge is -------------------------


def _served(analysis: Any) -> dict[str, int]:
    """Family sample name -> how many samples were served."""
    from exporter.exposition.metrics import ExpositionOptions, build_families

    out: dict[str, int] = {}
    for metric in build_families(analysis, ExpositionOptions()):
        for sample in metric.samples:
            out[sample.name] = out.get(sample.name, 0) + 1
    return out


@pytest.mark.parametrize(
    ("call", "gauge", "counter"),
    [
        ("nvmlDeviceGetUtilizationRates", "gpu_utilization_ratio", "gpu_utilization_seconds_total"),
        ("nvmlDeviceGetSamples", "gpu_utilization_ratio", "gpu_utilization_seconds_total"),
        ("nvmlGpmSampleGet", "gpu_sm_active_ratio", "gpu_sm_active_seconds_total"),
    ],
)
def test_a_counter_is_served_only_where_its_gauge_is(
    made: list[NvmlSource], call: str, gauge: str, counter: str
) -> None:
    """Served only where the gauge is: a refused read takes the counter away with its
    gauge (a counter without its gauge is one the docs do not promise)."""
    from exporter.analysis.pipeline import Policy, analyse, initial_state
    from exporter.model import NodeSnapshot

    errors = [{"call": call, "error": "TIMEOUT", "from": 30, "until": 45}]
    node = Node({"gpus": [{**BUSY, **GPM_BUSY}], "call_errors": errors}, made, gpm_s=1.0)
    policy = Policy()
    state = initial_state(policy, {})
    mismatched = []
    for t in range(0, 60):
        node.clock.now = float(t)
        nvml = node.source.sample()
        analysis, state = analyse(NodeSnapshot("n", nvml, timestamp=float(t)), state, policy)
        served = _served(analysis)
        if served.get(counter, 0) > served.get(gauge, 0):
            mismatched.append((t, served.get(gauge, 0), served.get(counter, 0)))
    assert not mismatched, mismatched
