"""A third adversary's attacks on two changes it did not write (occupancy windows that
claim what a shorter window left; a per-process NotFound on a GPU reading GPU-Util 0
lets no reading stand), kept as tests.

``test_break_*`` found a wrong answer in the code as the adversary found it (each fixed
since: NaN window lengths, a clock stepping back, reads moving by more than JITTER_S
inside a long cycle, a stand-in counted twice, a busy GPU left without its stand-in);
``test_survives_*`` are attacks that code withstood.
"""

from __future__ import annotations

import math
import random

import pynvml
import pytest

from exporter.analysis.active_time import JITTER_S, account_active_time
from exporter.analysis.pipeline import prefer_dcgm
from exporter.model import (
    ActiveTime,
    Attribution,
    DcgmSnapshot,
    GpuSample,
    MigInstance,
    Occupancy,
)
from exporter.sources.nvml import NvmlSource
from tests.test_activity_counter_attacks import BUSY, BUSY_PROCESS, Node, ProcSample, Reader
from tests.test_nvml_source import RICH, Sim, sim, start  # noqa: F401  (fixture)

UUID = "GPU-a"


def _occ(source: str, end: float, length: float | None, sm: float | None = 1.0) -> Occupancy:
    return Occupancy(source=source, sm_active=sm, window_end=end, window_s=length)


def _step(state: ActiveTime, occ: Occupancy | None, now: float) -> ActiveTime:
    gpu = GpuSample(index=0, uuid=UUID, occupancy=occ)
    return account_active_time(state, (gpu,), Attribution(), now=now)


def _covered(state: ActiveTime, uuid: str = UUID) -> float:
    return state.sampled.get(uuid, {}).get("sm_active", 0.0)


def _active(state: ActiveTime, uuid: str = UUID) -> float:
    return state.devices.get(uuid, {}).get("sm_active", 0.0)


# == change 1: _add_occupancy / covered_to ==============================================


def test_break_a_nan_window_poisons_covered_to_and_disables_clipping_for_good() -> None:
    """One window whose length is NaN (and whose ratios are all unset, so no counter
    turns NaN visibly) makes covered_to NaN: from then on min(w, now - NaN) is w, so
    every later window is added in full: a DCGM first window as long as its host
    engine's uptime (1000 s) is then covered on top of the GPM time already covered."""
    state = ActiveTime()
    for t in range(10, 60, 10):
        state = _step(state, _occ("gpm", float(t), 10.0), float(t))
    state = _step(state, Occupancy(source="gpm", window_end=60.0, window_s=math.nan), 60.0)
    # GPM flaps to DCGM, whose window is its uptime, then back
    state = _step(state, _occ("dcgm", 5000.0, 1000.0), 61.0)
    state = _step(state, _occ("gpm", 70.0, 10.0), 70.0)
    covered = _covered(state)
    # elapsed 10 -> 70 plus the first window (10 s)
    assert covered <= 70.0, f"covered {covered} s in 70 s (covered_to={state.covered_to})"


def test_break_a_nan_window_length_turns_the_counters_nan_for_good() -> None:
    """A NaN window_s with a ratio: max(nan, 0.0) is nan, min(nan, x) is nan: active and
    covered become NaN and stay so (rate() of a NaN counter is NaN forever)."""
    state = ActiveTime()
    state = _step(state, _occ("gpm", 10.0, 10.0, 0.5), 10.0)
    state = _step(state, _occ("gpm", 20.0, math.nan, 0.5), 20.0)
    for t in range(30, 100, 10):
        state = _step(state, _occ("gpm", float(t), 10.0, 0.5), float(t))
    assert math.isfinite(_covered(state)) and math.isfinite(_active(state)), (
        _covered(state),
        _active(state),
    )


def test_break_a_clock_that_steps_back_stalls_coverage_until_it_catches_up() -> None:
    """covered_to holds the highest time seen: after the analysis' clock steps back
    (``elapsed_now`` falls back to the wall clock where a snapshot has no monotonic
    time), every window is clipped to 0 until the clock passes the old covered_to again:
    100 s of 10 s windows are lost. Before e7cb278 (added_at = now) one window was."""
    state = ActiveTime()
    for t in range(10, 110, 10):
        state = _step(state, _occ("gpm", float(t), 10.0), float(t))
    before = _covered(state)
    # the clock steps back by 100 s; GPM keeps closing a 10 s window every 10 s
    for k in range(1, 11):
        state = _step(state, _occ("gpm", 100.0 + 10 * k, 10.0), float(10 * k))
    lost = 100.0 - (_covered(state) - before)
    assert lost <= 10.0 + JITTER_S, f"{lost} s of 100 s measured after the step were dropped"


def test_break_reads_jittering_more_than_jitter_s_inside_a_slow_cycle_lose_time() -> None:
    """Claim (a): reads that move inside their cycle lose nothing. A 10 s cycle whose
    reads after this GPU take 0-3 s (8 GPUs x 7 MIG devices read one after another, a
    slow NVML call) moves the read by up to 3 s; the slack is a constant 1 s, so each
    move beyond it is dropped for good."""
    rng = random.Random(11)
    state = ActiveTime()
    read_at = 0.0
    for k in range(1, 361):  # one hour
        now = 10.0 * k
        previous, read_at = read_at, now - rng.uniform(0.0, 3.0)
        state = _step(state, _occ("gpm", read_at, read_at - previous), now)
    covered = _covered(state)
    assert covered >= read_at - 3.0, f"{read_at - covered:.1f} s of {read_at:.0f} lost"


def test_break_mig_devices_read_late_in_a_long_cycle_lose_time() -> None:
    """The same through MIG: 7 MIG devices of one GPU read one after another, each GPM
    read 0.3 s, the cycle's order of reads alternating (or the reads before them
    stalling 2 s every other cycle): the last device's read moves by 2 s and more."""
    state = ActiveTime()
    migs = [f"MIG-{i}" for i in range(7)]
    last_read = {m: 0.0 for m in migs}
    for k in range(1, 181):
        now = 10.0 * k
        stall = 2.0 if k % 2 else 0.0  # every other cycle the reads after them stall
        instances = []
        for i, m in enumerate(migs):
            read = now - stall - 0.3 * (len(migs) - i)
            occ = _occ("gpm", read, read - last_read[m])
            last_read[m] = read
            instances.append(MigInstance(i, m, 1, 0, "1g.10gb", None, None, occupancy=occ))
        gpu = GpuSample(index=0, uuid=UUID, mig_instances=tuple(instances))
        state = account_active_time(state, (gpu,), Attribution(), now=now)
    worst = max(last_read[m] - _covered(state, m) for m in migs)
    assert worst <= 3.0, f"a MIG device lost {worst:.0f} s of {now:.0f}"


def test_survives_flapping_sources_with_jitter_never_cover_more_than_elapsed() -> None:
    """Claim (b): GPM (10 s windows) and DCGM (1 s, plus a first window as long as its
    uptime on each reconnect) flapping every cycle, every read jittered 0-0.9 s."""
    rng = random.Random(3)
    state = ActiveTime()
    gpm_read, dcgm_read = 0.0, None
    first_window = None
    for t in range(1, 601):
        now = float(t)
        if t % 10 == 0:
            previous, gpm_read = gpm_read, now - rng.uniform(0, 0.9)
            gpm_win = (gpm_read, gpm_read - previous)
        gpus = (GpuSample(0, UUID, occupancy=_occ("gpm", *gpm_win) if t >= 10 else None),)
        up = rng.random() < 0.5
        if up:
            at = now - rng.uniform(0, 0.9)
            window = 5000.0 if dcgm_read is None else at - dcgm_read
            dcgm_read = at
            dcgm = DcgmSnapshot(
                ok=True, timestamp=at, occupancy=((UUID, _occ("dcgm", 10_000 + at, window)),)
            )
        else:
            dcgm_read = None
            dcgm = DcgmSnapshot(ok=False, timestamp=now)
        state = account_active_time(state, prefer_dcgm(gpus, dcgm), Attribution(), now=now)
        if first_window is None and _covered(state):
            first_window, first_at = _covered(state), now
        assert _active(state) <= _covered(state) + 1e-9
    assert first_window is not None
    assert _covered(state) <= first_window + (600.0 - first_at) + 1e-6


@pytest.mark.parametrize("bad", [-5.0, 1e300, math.inf, -math.inf, 0.0])
def test_survives_garbage_window_lengths_after_the_first(bad: float) -> None:
    state = ActiveTime()
    for t in range(10, 310, 10):
        length = bad if t % 30 == 0 else 10.0
        state = _step(state, _occ("gpm", float(t), length, 0.7), float(t))
    assert 0.0 <= _covered(state) <= 300.0
    assert _active(state) <= _covered(state)


def test_survives_window_ends_going_backwards_and_now_standing_still() -> None:
    state = ActiveTime()
    state = _step(state, _occ("gpm", 10.0, 10.0), 10.0)
    for end in (5.0, 9.0, 10.0, -1e9):  # older ends: served again, add nothing
        state = _step(state, _occ("gpm", end, 10.0), 11.0)
    assert _covered(state) == 10.0
    for end in (20.0, 30.0, 40.0):  # new ends, the clock not moving
        state = _step(state, _occ("gpm", end, 10.0), 11.0)
    assert _covered(state) <= 10.0 + 1.0


def test_survives_a_gap_of_minutes_then_windows_resume_in_full() -> None:
    state = ActiveTime()
    for t in range(10, 110, 10):
        state = _step(state, _occ("gpm", float(t), 10.0), float(t))
    for t in range(110, 500):  # GPM failing: no window for 400 s
        state = _step(state, None, float(t))
    before = _covered(state)
    for t in range(510, 610, 10):
        state = _step(state, _occ("gpm", float(t), 10.0), float(t))
    assert _covered(state) - before == pytest.approx(100.0)


def test_survives_many_mig_devices_churning_state_stays_bounded() -> None:
    state = ActiveTime()
    for t in range(1, 2000):
        gen = t // 50  # every 50 s all 7 MIG devices are replaced (new UUIDs)
        instances = tuple(
            MigInstance(
                i,
                f"MIG-{gen}-{i}",
                1,
                0,
                "1g.10gb",
                None,
                None,
                occupancy=_occ("gpm", float(t), 1.0),
            )
            for i in range(7)
        )
        state = account_active_time(
            state, (GpuSample(0, UUID, mig_instances=instances),), Attribution(), now=float(t)
        )
    # devices unseen for ABSENT_S (300 s) are dropped: at most 7 x 7 generations + GPU
    assert len(state.covered_to) <= 7 * 8 + 1
    assert len(state.source) <= 7 * 8 + 1


# == change 2: _process_utilization's quiet NotFound =====================================


def _idle_at_5(extra: dict[str, object]) -> dict[str, object]:
    return {
        **RICH,
        **extra,
        "timeline": [
            *({"at": 5, "set_process": {"pid": pid, "sm": 0}} for pid in (1001, 1003)),
            {"at": 5, "set": {"gpu": 0, "utilization_gpu": 0}},
        ],
    }


# (UNKNOWN is not used: the exporter fails the whole GPU for it, no per-process reading)
@pytest.mark.parametrize("error", ["NOT_SUPPORTED", "TIMEOUT", "NO_DATA"])
def test_survives_gpu_util_failing_is_no_evidence_of_idle(sim: list[Sim], error: str) -> None:  # noqa: F811
    """GPU-Util unread: a per-process NotFound seconds after the last answer lets the
    last readings stand (absence of evidence is not idle)."""
    errors = [{"call": "nvmlDeviceGetUtilizationRates", "error": error, "gpu": 0, "from": 5}]
    s = start(sim, _idle_at_5({"call_errors": errors}))
    assert len(s.sample_at(0.0).gpus[0].process_utilization) == 2
    assert len(s.sample_at(6.0).gpus[0].process_utilization) == 2
    gpu = s.sample_at(8.0).gpus[0]
    assert gpu.utilization_gpu_percent is None
    assert len(gpu.process_utilization) == 2


def test_survives_gpu_util_busy_keeps_the_stand_in(sim: list[Sim]) -> None:  # noqa: F811
    scenario = {
        **RICH,
        "timeline": [
            *({"at": 5, "set_process": {"pid": pid, "sm": 0}} for pid in (1001, 1003)),
        ],
    }
    s = start(sim, scenario)
    s.sample_at(0.0)
    s.sample_at(6.0)
    gpu = s.sample_at(8.0).gpus[0]
    assert gpu.utilization_gpu_percent == 73
    assert len(gpu.process_utilization) == 2


def _gpu_util_hook(node: Node, values: dict[float, object]) -> None:
    """nvmlDeviceGetUtilizationRates answering ``values[now]`` (GPU-Util) where given."""
    inner = node.hostile._inner.nvmlDeviceGetUtilizationRates

    def rates(handle: object, out: object) -> int:
        ret = int(inner(handle, out))
        value = values.get(node.clock.now)
        if ret == pynvml.NVML_SUCCESS and value is not None:
            out._obj.gpu = value  # type: ignore[attr-defined]
        return ret

    node.hostile.nvmlDeviceGetUtilizationRates = rates  # type: ignore[attr-defined]
    pynvml._nvmlGetFunctionPointer_cache.clear()


def test_survives_short_interval_gpu_util_zero_one_cycle_while_busy_no_flap(
    made: list[NvmlSource],
) -> None:
    """--process-utilization-interval 0.25 s, a busy process, GPU-Util reading 0 for
    one cycle (a sampling phase): the process keeps a reading every cycle."""
    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS]},
        made,
        process_s=0.25,
        container=(700,),
    )
    _gpu_util_hook(node, {3.0: 0, 3.25: 0})
    t = 0.0
    while t <= 6.0:
        snap = node.at(t)
        if t >= 0.5:
            assert snap.gpus[0].process_utilization, t
        t += 0.25
    total = node.container_total() or 0.0
    assert total == pytest.approx(0.8 * 6.0, abs=0.2)


def test_break_a_transient_not_supported_then_not_found_counts_a_window_twice(
    made: list[NvmlSource],
) -> None:
    """SM seconds never count a window twice. A per-process read answering NOT_SUPPORTED
    once returns () but keeps last_utilization (only NotFound-quiet, no_processes and
    other errors clear it), so the counters forget the stamp; the next read's NotFound on
    a busy GPU lets that same reading stand again, and its stamp is new to the counters:
    its SM seconds are added a second time. (The stand-in path that 51cc85a leaves in
    place; its own quiet path clears last_utilization and is safe.)"""
    calls = {"n": 0}

    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample] | int:
        if now == 5.0:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        if now == 6.0:
            return []  # NotFound: the driver had nothing newer for this read
        calls["n"] += 1
        return read(last_seen)

    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS]},
        made,
        process_s=1.0,
        container=(700,),
    )
    node.hostile.process_hook = hook
    node.run(0, 11)
    total = node.container_total() or 0.0
    # reads from 0 (baseline) to 10 s at 80 % SM: 8 SM-seconds
    assert total == pytest.approx(0.8 * 10, abs=0.3), total


def test_survives_quiet_not_found_neither_loses_nor_double_counts_sm_seconds(
    made: list[NvmlSource],
) -> None:
    """Busy 0-3 s, idle (sm 0, GPU-Util 0) 3-6 s, busy 6-12 s, reads every 1 s; a NotFound
    on a busy GPU after the quiet drop: no reading while idle (5 s); from 6 s, busy
    again, the last reading stands until new samples come (busy, no new sample: no
    evidence) but adds no SM time, and the later read's samples cover the time since the
    last seen stamp."""
    timeline = [
        {"at": 3, "set_process": {"pid": 700, "sm": 0}},
        {"at": 3, "set": {"gpu": 0, "utilization_gpu": 0}},
        {"at": 6, "set_process": {"pid": 700, "sm": 80}},
        {"at": 6, "set": {"gpu": 0, "utilization_gpu": 100}},
    ]

    def hook(read: Reader, last_seen: int, now: float) -> list[ProcSample] | int:
        return [] if now == 7.0 else read(last_seen)  # a NotFound while busy again

    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS], "timeline": timeline},
        made,
        process_s=1.0,
        container=(700,),
    )
    node.hostile.process_hook = hook
    seen = [bool(node.at(float(t)).gpus[0].process_utilization) for t in range(13)]
    # idle from 3 s: at 4 s the last answer (3 s) is within a driver sample period, so
    # it stands; at 5 s nothing stands; busy again from 6 s: a reading every cycle
    assert not seen[5] and all(seen[6:]), seen
    total = node.container_total() or 0.0
    assert total == pytest.approx(0.8 * (3 + 6), abs=0.3), total


def test_break_a_busy_gpu_after_a_quiet_drop_has_no_reading_and_its_replica_reads_idle(
    made: list[NvmlSource],
) -> None:
    """ "GPU-Util busy: no evidence, the previous samples stand" (the docstring), and "a
    time-shared replica reads idle as soon as its GPU does" (51cc85a), not before. A GPU
    busy in bursts (0.25 s of every 2.5 s, sm 80), per-process reads every 0.5 s: the
    quiet NotFound at 2.0 s drops the reading (right: idle since 0.25 s), but at 2.5 s
    GPU-Util reads 100 while the burst's first per-process sample is not written yet
    (NotFound): nothing is left to stand, so the process has no SM sample and a shared
    replica on this GPU is judged idle (activity.py: no sample = 0 SM) on a busy GPU.
    Before 51cc85a the stand-in held here."""
    node = Node(
        {
            "gpus": [{"duty": {"period_s": 2.5, "busy": 0.1}, "utilization_gpu": 100}],
            "host_processes": [BUSY_PROCESS],
        },
        made,
        process_s=0.5,
        container=(700,),
    )
    busy_without_reading = []
    for k in range(0, 25):
        t = 0.5 * k
        gpu = node.at(t).gpus[0]
        if t > 0 and (gpu.utilization_gpu_percent or 0) > 0 and not gpu.process_utilization:
            busy_without_reading.append(t)
    assert busy_without_reading == [], (
        f"GPU-Util busy, no process reading at {busy_without_reading}"
    )
