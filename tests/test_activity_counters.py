"""Activity as counters: every window a source measured is added once, so rate() over any
span is the mean over that span (docs/metrics.md, "Activity counters").

Read through the real pynvml over the simulated libnvidia-ml; the counters are
``exporter/analysis/active_time.py`` over what the NVML source returned.
"""

from __future__ import annotations

import itertools
import math
import random

import pytest

from exporter.analysis.active_time import ABSENT_S, account_active_time
from exporter.model import ActiveTime, ActiveWindow, Attribution, GpuSample, Occupancy
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import install
from exporter.sim.scenario import parse_scenario
from exporter.sources import nvml_samples
from exporter.sources.nvml import NvmlSource
from tests.test_nvml_cadence import R580


class Node:
    """A simulated node and an NVML source with the given cadences, cycled by hand."""

    def __init__(
        self, scenario: dict[str, object], made: list[NvmlSource], *, gpm_s: float, process_s: float
    ) -> None:
        self.clock = ManualClock()
        self.sim = SimNode(parse_scenario({**R580, **scenario}, "test"), self.clock)
        self.library = install(self.sim)
        self.source = NvmlSource(
            clock=self.clock,
            slow_interval_s=30.0,
            gpm_interval_s=gpm_s,
            process_utilization_interval_s=process_s,
        )
        made.append(self.source)
        self.state = ActiveTime()

    def at(self, t: float) -> tuple[GpuSample, ...]:
        self.clock.now = t
        snapshot = self.source.sample()
        assert snapshot.ok and not snapshot.errors, snapshot.errors
        self.state = account_active_time(self.state, snapshot.gpus, Attribution(), now=t)
        return snapshot.gpus


DUTY = {"duty": {"period_s": 30, "busy": 1 / 3}, "gpm": {"sm_active": 90.0}}


def test_a_gpm_window_per_gpm_interval_and_each_added_once(made: list[NvmlSource]) -> None:
    """Busy 10 s of every 30 at 90 % SM: over 300 s the counter holds 0.9 x 100 s, read at
    --interval 1 with a window every 10 s; the gauge is the last window's mean and stands
    between windows, and the counter does not count a window served again."""
    node = Node({"gpus": [DUTY]}, made, gpm_s=10.0, process_s=10.0)
    gauges = []
    for t in range(0, 301):
        (gpu,) = node.at(float(t))
        if gpu.occupancy is not None:
            gauges.append((t, gpu.occupancy.sm_active, gpu.occupancy.window_end))
    uuid = gpu.uuid
    total = node.state.devices[uuid]["sm_active"]
    covered = node.state.sampled[uuid]["sm_active"]
    # primed at 0, first window 0-1 s, then windows on the 10 s grid: up to 300 s
    assert covered == pytest.approx(300.0)
    assert total == pytest.approx(0.9 * 100.0, rel=1e-6)
    # the window ends move only at the grid (and once after priming): 31 windows
    assert len({end for _, _, end in gauges}) == 31
    # between two windows the gauge stands: 9 of every 10 cycles repeat the last value
    assert sum(1 for a, b in itertools.pairwise(gauges) if a[2] == b[2]) >= 260


def test_gpm_is_asked_once_per_window_not_every_cycle(made: list[NvmlSource]) -> None:
    node = Node({"gpus": [DUTY]}, made, gpm_s=10.0, process_s=10.0)
    before = node.library.calls.by_function.get("nvmlGpmMetricsGet", 0)
    for t in range(0, 61):
        node.at(float(t))
    asked = node.library.calls.by_function.get("nvmlGpmMetricsGet", 0) - before
    assert asked == 7  # 0-1 s, then one window per 10 s up to 60 s (not 60 reads)


def test_a_window_is_added_once_and_a_gpu_is_dropped_only_when_long_gone() -> None:
    occupancy = Occupancy(source="gpm", sm_active=0.5, window_end=10.0, window_s=10.0)
    gpu = GpuSample(index=0, uuid="GPU-a", occupancy=occupancy)
    state = account_active_time(ActiveTime(), (gpu,), Attribution(), now=10.0)
    assert state.devices["GPU-a"] == {"sm_active": 5.0}
    assert state.sampled["GPU-a"] == {"sm_active": 10.0}
    # the same window served again adds nothing
    state = account_active_time(state, (gpu,), Attribution(), now=11.0)
    assert state.devices["GPU-a"] == {"sm_active": 5.0}
    # not seen for a while (NVML down, a failed read): the totals stand
    kept = account_active_time(state, (), Attribution(), now=11.0 + ABSENT_S)
    assert kept.devices == state.devices
    # unseen for longer than ABSENT_S: gone, dropped (bounded by what the node has)
    gone = account_active_time(kept, (), Attribution(), now=12.0 + ABSENT_S)
    assert gone.devices == {} and gone.window_end == {} and gone.device_seen == {}


def test_a_metric_that_fails_is_not_covered_while_the_others_are() -> None:
    state = ActiveTime()
    for end, tensor in ((10.0, 0.5), (20.0, None), (30.0, 0.5)):
        occupancy = Occupancy(
            source="gpm", sm_active=0.9, tensor_active=tensor, window_end=end, window_s=10.0
        )
        gpu = GpuSample(index=0, uuid="GPU-a", occupancy=occupancy)
        state = account_active_time(state, (gpu,), Attribution(), now=end)
    assert state.sampled["GPU-a"] == {"sm_active": 30.0, "tensor_active": 20.0}
    assert state.devices["GPU-a"]["tensor_active"] / state.sampled["GPU-a"]["tensor_active"] == 0.5


def test_windows_of_two_occupancy_sources_never_cover_a_second_twice() -> None:
    """GPM windows, then DCGM's (its own clock: a first window as long as its uptime),
    then GPM again: no window adds more than the analysis saw pass since the last one,
    so covered never exceeds the 60 s that passed."""
    state = ActiveTime()
    windows = [("gpm", 10.0, 10.0), ("gpm", 20.0, 10.0), ("dcgm", 1005.0, 1005.0)]
    windows += [("dcgm", 1015.0, 10.0), ("gpm", 50.0, 30.0), ("gpm", 60.0, 10.0)]
    for at, (source, end, length) in zip(range(10, 70, 10), windows, strict=True):
        occupancy = Occupancy(source=source, sm_active=1.0, window_end=end, window_s=length)
        gpu = GpuSample(index=0, uuid="GPU-a", occupancy=occupancy)
        state = account_active_time(state, (gpu,), Attribution(), now=float(at))
    assert state.sampled["GPU-a"]["sm_active"] == 60.0
    assert state.source["GPU-a"] == "gpm"


def test_reads_that_move_inside_their_cycle_lose_no_time() -> None:
    """A GPM window runs from read to read, the analysis' clock from one cycle's end of
    reads to the next's: where the reads after a GPU's took longer one cycle than the
    next, its window is longer than the time the analysis saw pass, and the cycle
    before left as much unclaimed. 600 cycles of 0.5 s whose read lands 0-300 ms before
    the cycle's end (seeded) cover the 300 s, within one jitter; clipping each window to
    its own cycle lost 29 s of them (a CI run's 12 % dip in SM active over 5 s)."""
    rng = random.Random(7)
    state = ActiveTime()
    read_at = 0.0
    for k in range(1, 601):
        now = 0.5 * k
        previous, read_at = read_at, now - rng.uniform(0.0, 0.3)
        occupancy = Occupancy(
            source="gpm", sm_active=1.0, window_end=read_at, window_s=read_at - previous
        )
        gpu = GpuSample(index=0, uuid="GPU-a", occupancy=occupancy)
        state = account_active_time(state, (gpu,), Attribution(), now=now)
    covered = state.sampled["GPU-a"]["sm_active"]
    assert read_at - 0.3 <= covered <= 300.0, covered
    assert state.devices["GPU-a"]["sm_active"] == pytest.approx(covered)


def test_gpu_util_a_window_holding_more_than_its_length_is_kept_for_the_next() -> None:
    """Samples and the exporter's clock are not in phase: a window may hold a sample
    more than its length; the excess counts later, never beyond the time covered."""
    state = ActiveTime()
    for end, active in ((1.0, 1.2), (2.0, 0.8), (3.0, 1.5)):
        window = ActiveWindow(end=end, seconds=1.0, active_s=active)
        gpu = GpuSample(index=0, uuid="GPU-a", utilization_window=window)
        state = account_active_time(state, (gpu,), Attribution(), now=end)
        assert state.devices["GPU-a"]["utilization"] <= state.sampled["GPU-a"]["utilization"]
    assert state.devices["GPU-a"]["utilization"] == pytest.approx(3.0)  # 3.5, capped at 3


# -- the sample-buffer arithmetic --------------------------------------------------------


def test_samples_cover_the_step_since_the_one_before_capped_at_the_period() -> None:
    # 1/6 s samples at 50 %, then a 2 s gap (an idle period holds no sample), then one
    period = 166_667
    samples = [(1_000_000 + period * i, 50.0) for i in range(10)] + [(4_000_000, 100.0)]
    buffer = nvml_samples.SampleBuffer(seen_us=1_000_000 - period)
    buffer.learn(ts for ts, _ in samples)
    assert buffer.period_us == period  # the step seen again and again, not the gap
    got = nvml_samples.integrate(samples, buffer.seen_us, buffer.period_us)
    assert got.active_s == pytest.approx(10 * period / 1e6 * 0.5 + period / 1e6, rel=1e-6)
    assert got.newest_us == 4_000_000 and got.garbage == 0


def test_one_stray_step_does_not_shrink_the_learned_period() -> None:
    buffer = nvml_samples.SampleBuffer()
    buffer.learn([0, 166_000, 332_000, 352_000, 372_000, 498_000, 664_000, 830_000])
    assert buffer.period_us == 166_000  # two 20 ms stray steps agree, and are no period


def test_a_bursty_gpu_whose_steps_are_mostly_several_periods_keeps_the_period() -> None:
    """100 ms bursts every second: most steps are 6 periods; a burst that straddles two
    periods gives a one-period step, seen twice: that is the period, not the 1 s."""
    period = 166_667
    stamps = [k * 6 * period for k in range(10)] + [3 * 6 * period + period]
    stamps += [7 * 6 * period + period]
    buffer = nvml_samples.SampleBuffer()
    buffer.learn(stamps)
    assert buffer.period_us == period


def test_samples_at_or_before_the_last_seen_are_ignored_and_garbage_is_counted() -> None:
    samples = [(50_000, 100.0), (100_000, 100.0), (200_000, math.nan), (300_000, 250.0)]
    got = nvml_samples.integrate(samples, seen_us=100_000, period_us=100_000)
    assert (got.active_s, got.garbage, got.newest_us) == (0.0, 2, 300_000)


def test_until_a_step_repeats_a_sample_covers_the_shortest_period_nvml_allows() -> None:
    buffer = nvml_samples.SampleBuffer()
    buffer.learn([5_000_000])
    assert buffer.period_us == nvml_samples.SHORTEST_PERIOD_US
    got = nvml_samples.integrate([(5_000_000, 100.0)], seen_us=0, period_us=buffer.period_us)
    assert got.active_s == pytest.approx(nvml_samples.SHORTEST_PERIOD_US / 1e6)


def test_a_stamp_far_ahead_is_not_taken_and_a_lasting_step_reads_afresh() -> None:
    buffer = nvml_samples.SampleBuffer()
    buffer.advance(10_000_000, now=10.0)
    limit_s = 1.0 + nvml_samples.HISTORY_S + nvml_samples.SLACK_S
    near, far = 10_000_000 + 1_000_000, 10_000_000 + int((limit_s + 1) * 1e6)
    assert buffer.plausible([near, far], now=11.0) == [True, False]
    assert not buffer.suspect(11.0)
    assert buffer.suspect(11.0 + nvml_samples.STEP_S)  # it lasted: read afresh
    assert (buffer.seen_us, buffer.answered_at) == (0, None)
    # at a first read, a stamp far from the others is garbage
    assert buffer.plausible([5, 6, 2**64 - 1], now=200.0) == [True, True, False]


# -- the cadence flags -------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--gpm-interval", "--process-utilization-interval"])
def test_a_cadence_shorter_than_the_cycle_is_refused_and_its_default_follows_a_longer_one(
    flag: str,
) -> None:
    from exporter.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=f"{flag} 2 is shorter than --interval 5"):
        parse_config(["--interval", "5", flag, "2"], env={})
    config = parse_config(["--interval", "20"], env={})
    assert config.gpm_interval_s == config.process_utilization_interval_s == 20.0
    config = parse_config([], env={})
    assert (config.gpm_interval_s, config.process_utilization_interval_s) == (10.0, 10.0)


# -- GPU-Util and the per-process samples over a duty cycle ------------------------------

BUSY_PROCESS = {"gpu": 0, "memory": "1GiB", "sm": 80, "pid": 700}


def test_gpu_util_and_process_sm_time_add_up_over_a_duty_cycle(made: list[NvmlSource]) -> None:
    """Busy 10 s of every 30 (GPU-Util 100 %, one process at 80 % SM) for 300 s, read
    every second and the per-process samples every 10 s: the GPU-Util counter holds the
    busy 100 s, the process's SM-seconds 0.8 x 100 s, each within one sample period of
    the truth, and the GPU-Util windows cover the time (an idle read is an idle window)."""
    gpu = {"duty": {"period_s": 30, "busy": 1 / 3}, "utilization_gpu": 100}
    node = Node({"gpus": [gpu], "host_processes": [BUSY_PROCESS]}, made, gpm_s=10.0, process_s=10.0)
    sm_seconds = 0.0
    seen: set[int] = set()
    for t in range(0, 301):
        (sample,) = node.at(float(t))
        for reading in sample.process_utilization:
            if reading.timestamp_us not in seen:  # a reading that stands in counts once
                seen.add(reading.timestamp_us)
                sm_seconds += reading.sm_seconds
    uuid = sample.uuid
    # at 300 s GPU-Util reads busy and the buffer has no ended period yet: no evidence,
    # so the last window stands and the next read will cover 299-301 s
    assert node.state.sampled[uuid]["utilization"] == pytest.approx(299.0)
    assert node.state.devices[uuid]["utilization"] == pytest.approx(100.0, abs=0.5)
    # 100 s busy at 80 %, less the first 10 s: at 0 s the driver has no ended period
    # (NotFound), the next read is paced to 10 s, and the first read with samples is a
    # baseline (it averages what the driver held before), not counted
    assert sm_seconds == pytest.approx(80.0 - 0.8 * 10, abs=0.05)
