"""An adversary's attacks on the per-process quiet rule (exporter/sources/nvml.py,
``_standing``): between reads and at a NotFound, no reading stands while GPU-Util reads
0, neither the last answer nor the last busy GPU-Util is within 1.05 s, and GPU-Util
has read a plausible busy beside per-process readings (``utilization_agreed``).

``test_break_*`` found a wrong answer in the rule's first form (garbage GPU-Util arming
it, one GPU-Util 0 between reads or a sub-second duty cycle making readings flap, reads
phase-locked to idle never arming it), each fixed since; ``test_survives_*`` are
attacks it withstood."""

from __future__ import annotations

import itertools

import pytest

from exporter.sources.nvml import NvmlSource
from tests.test_activity_counter_attacks import BUSY, BUSY_PROCESS, Node
from tests.test_activity_counter_attacks_3 import _gpu_util_hook

SILENT = {"utilization_gpu": 0}  # a platform whose GPU-Util never reports (reads 0)


def _present(node: Node, t: float) -> bool:
    return bool(node.at(t).gpus[0].process_utilization)


# -- absence of evidence ------------------------------------------------------------------


@pytest.mark.parametrize("error", ["TIMEOUT", "NOT_SUPPORTED"])
def test_survives_gpu_util_failing_keeps_stand_ins(made: list[NvmlSource], error: str) -> None:
    """GPU-Util failing between reads (3-9 s) is no evidence of idle: the stand-ins stay."""
    errors = [{"call": "nvmlDeviceGetUtilizationRates", "error": error, "from": 3, "until": 9}]
    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS], "call_errors": errors},
        made,
        process_s=10.0,
    )
    for t in range(0, 10):
        assert _present(node, float(t)), t


def test_survives_silent_gpu_util_keeps_stand_ins(made: list[NvmlSource]) -> None:
    """GPU-Util always 0 beside SM samples: says nothing, the stand-ins stay."""
    node = Node({"gpus": [SILENT], "host_processes": [BUSY_PROCESS]}, made, process_s=10.0)
    for t in range(0, 10):
        assert _present(node, float(t)), t


def test_break_one_garbage_gpu_util_reading_arms_the_quiet_rule_for_good(
    made: list[NvmlSource],
) -> None:
    """A platform whose GPU-Util reads 0 always, except ONE garbage answer (0xFFFFFFFF,
    no percentage) at the first per-process read: _busy() counts any int > 0 as busy, so
    utilization_agreed turns True for good and the platform's constant 0 then hides
    every stand-in between reads. Garbage is no evidence: they should stand."""
    node = Node({"gpus": [SILENT], "host_processes": [BUSY_PROCESS]}, made, process_s=10.0)
    _gpu_util_hook(node, {0.0: 0xFFFFFFFF, 1.0: 0xFFFFFFFF})
    missing = [t for t in range(0, 10) if not _present(node, float(t))]
    assert missing == [], f"stand-ins hidden at {missing}"


def test_break_gpu_util_over_100_is_taken_as_busy_evidence(made: list[NvmlSource]) -> None:
    """Same with a merely implausible 101 %."""
    node = Node({"gpus": [SILENT], "host_processes": [BUSY_PROCESS]}, made, process_s=10.0)
    _gpu_util_hook(node, {0.0: 101, 1.0: 101})
    missing = [t for t in range(0, 10) if not _present(node, float(t))]
    assert missing == [], f"stand-ins hidden at {missing}"


# -- flapping -----------------------------------------------------------------------------


def test_break_one_gpu_util_zero_cycle_between_reads_hides_a_busy_process(
    made: list[NvmlSource],
) -> None:
    """--process-utilization-interval 10 s, 0.5 s cycles, a process busy all along and
    GPU-Util reading 0 for ONE cycle (a sampling phase, as the existing
    test_survives_short_interval_gpu_util_zero_one_cycle_while_busy_no_flap uses at
    0.25 s): the reading vanishes for that one cycle and is back 0.5 s later. One 0
    reading within one driver sample period is no idle GPU: no flap."""
    node = Node({"gpus": [BUSY], "host_processes": [BUSY_PROCESS]}, made, process_s=10.0)
    _gpu_util_hook(node, {5.0: 0})
    seen = []
    t = 0.0
    while t <= 9.5:
        seen.append((t, _present(node, t)))
        t += 0.5
    missing = [t for t, ok in seen if not ok]
    assert missing == [], f"a busy process's reading flapped away at {missing}"


def test_break_sub_second_duty_cycle_flaps_every_other_cycle(made: list[NvmlSource]) -> None:
    """A GPU computing in 0.5 s bursts every 1 s (duty 50 %), read every 0.5 s with
    per-process reads every 10 s: GPU-Util alternates busy/0 cycle by cycle, and the
    process's reading appears and vanishes every 0.5 s, inside one driver sample period."""
    gpu = {"utilization_gpu": 100, "duty": {"period_s": 1.0, "busy": 0.5, "offset_s": 0.25}}
    node = Node({"gpus": [gpu], "host_processes": [BUSY_PROCESS]}, made, process_s=10.0)
    states = []
    t = 0.0
    while t <= 9.5:
        snap = node.at(t)
        g = snap.gpus[0]
        states.append((t, g.utilization_gpu_percent, bool(g.process_utilization)))
        t += 0.5
    flips = sum(1 for a, b in itertools.pairwise(states) if a[2] != b[2])
    assert flips <= 1, states


def test_break_reads_phase_locked_to_idle_never_arm_the_rule(made: list[NvmlSource]) -> None:
    """A training-like GPU: 10 s of kernels every 30 s (GPU-Util 100, then 0), the
    per-process read every 10 s (default). Every read that answers samples (t=40, 70,
    ...) lands just after a burst ended, when GPU-Util reads 0; the reads during a burst
    answer NotFound (its periods not ended yet). So utilization_agreed never turns True
    although this GPU's GPU-Util plainly reports, and the last burst's figure stands on
    the idle GPU for the whole idle part (19 s of every 30 s): the very stand-in the
    change exists to drop. GPU-Util read 100 seconds before beside those readings, 0
    since: none should stand more than ~1 s after the last answer."""
    gpu = {"utilization_gpu": 100, "duty": {"period_s": 30, "busy": 1 / 3}}
    node = Node({"gpus": [gpu], "host_processes": [BUSY_PROCESS]}, made, process_s=10.0)
    phantom = []
    for t in range(0, 181):
        g = node.at(float(t)).gpus[0]
        in_idle = t % 30 >= 12  # idle since t//30*30+10, answered read at +10
        if t >= 40 and in_idle and g.utilization_gpu_percent == 0 and g.process_utilization:
            phantom.append(t)
    assert phantom == [], f"a reading stood on the idle GPU at {phantom}"


# -- counting -----------------------------------------------------------------------------


def test_survives_duty_cycle_counts_each_window_once(made: list[NvmlSource]) -> None:
    """10 s busy in 30 s at 80 % SM, per-process reads every 10 s, 1 s cycles, 300 s:
    the container's SM seconds are the integral, neither doubled nor lost."""
    gpu = {"utilization_gpu": 100, "duty": {"period_s": 30, "busy": 1 / 3}}
    node = Node(
        {"gpus": [gpu], "host_processes": [BUSY_PROCESS]},
        made,
        process_s=10.0,
        container=(700,),
    )
    node.run(0, 301)
    total = node.container_total() or 0.0
    # 0.8 * 100 s busy in 0..300, less the first burst: the first answered read (t=10)
    # is a baseline (seen == 0), as before this change
    assert total == pytest.approx(0.8 * 90.0, abs=1.0), total


def test_survives_quiet_drop_then_busy_again_not_counted_twice(made: list[NvmlSource]) -> None:
    """Dropped on a quiet cycle, standing again on a busy one, read again: once only."""
    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS]},
        made,
        process_s=10.0,
        container=(700,),
    )
    _gpu_util_hook(node, {t: (0 if t % 2 else 100) for t in (3.0, 4.0, 5.0, 6.0, 7.0, 8.0)})
    node.run(0, 41)
    total = node.container_total() or 0.0
    assert total == pytest.approx(0.8 * 40.0, abs=1.5), total


def test_survives_not_found_quiet_then_samples_return_the_window(made: list[NvmlSource]) -> None:
    """NotFound-quiet drops; samples the next read returns are counted (not lost)."""
    scenario = {
        "gpus": [BUSY],
        "host_processes": [BUSY_PROCESS],
        "timeline": [
            {"at": 5, "set_process": {"pid": 700, "sm": 0}},
            {"at": 5, "set": {"gpu": 0, "utilization_gpu": 0}},
            {"at": 12, "set_process": {"pid": 700, "sm": 80}},
            {"at": 12, "set": {"gpu": 0, "utilization_gpu": 100}},
        ],
    }
    node = Node(scenario, made, process_s=0.0, container=(700,))
    node.run(0, 31)
    total = node.container_total() or 0.0
    assert total == pytest.approx(0.8 * (5.0 + 18.0), abs=1.5), total


# -- state --------------------------------------------------------------------------------


def test_survives_lost_and_found_gpu_starts_clean(made: list[NvmlSource]) -> None:
    """Agreed on the first handle; the GPU is lost and comes back; on the new handle
    GPU-Util reads 0 always (silent): the stand-ins stay."""
    errors = [
        {"call": "nvmlDeviceGetMemoryInfo_v2", "error": "GPU_IS_LOST", "from": 3, "until": 4},
        {"call": "nvmlDeviceGetMemoryInfo", "error": "GPU_IS_LOST", "from": 3, "until": 4},
    ]
    node = Node(
        {"gpus": [BUSY], "host_processes": [BUSY_PROCESS], "call_errors": errors},
        made,
        process_s=10.0,
    )
    node.run(0, 3)
    lost = node.at(3.0)
    assert lost.gpus[0].error is not None
    _gpu_util_hook(node, {float(t): 0 for t in range(4, 14)})
    missing = [t for t in range(4, 14) if not _present(node, float(t))]
    assert missing == [], missing


def test_survives_reads_under_a_second_apart_do_not_drop(made: list[NvmlSource]) -> None:
    """Per-process reads every 0.5 s, GPU-Util 0 at one read whose NotFound is 0.5 s
    after an answer: it stands."""
    node = Node({"gpus": [BUSY], "host_processes": [BUSY_PROCESS]}, made, process_s=0.5)
    _gpu_util_hook(node, {3.0: 0})
    t = 0.0
    while t <= 6.0:
        assert _present(node, t), t
        t += 0.5


def test_survives_agreement_is_per_gpu(made: list[NvmlSource]) -> None:
    """GPU 0 agrees (GPU-Util busy beside samples); GPU 1 is silent (GPU-Util 0 beside
    SM samples): GPU 1's stand-ins stay between reads."""
    other = {**BUSY_PROCESS, "gpu": 1, "pid": 701}
    node = Node(
        {"gpus": [BUSY, SILENT], "host_processes": [BUSY_PROCESS, other]}, made, process_s=10.0
    )
    missing = []
    for t in range(0, 25):
        gpus = node.at(float(t)).gpus
        if t >= 12 and not gpus[1].process_utilization:
            missing.append(t)
    assert missing == [], missing


def test_survives_sub_second_duty_counts_each_window_once(made: list[NvmlSource]) -> None:
    """0.5 s bursts every 1 s, 0.5 s cycles, reads every 10 s: the flapping stand-ins
    carry no SM time, so the container's total is still the integral (0.8 x 50 %)."""
    gpu = {"utilization_gpu": 100, "duty": {"period_s": 1.0, "busy": 0.5, "offset_s": 0.25}}
    node = Node(
        {"gpus": [gpu], "host_processes": [BUSY_PROCESS]}, made, process_s=10.0, container=(700,)
    )
    t = 0.0
    marks = {}
    while t <= 60.0:
        node.at(t)
        marks[t] = node.container_total() or 0.0
        t += 0.5
    # counted from the second answered read on (the first is a baseline)
    assert marks[60.0] - marks[20.0] == pytest.approx(0.8 * 0.5 * 40.0, abs=1.0), marks
