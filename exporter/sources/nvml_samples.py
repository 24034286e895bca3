"""Active time from NVML's sample buffers: how many seconds a GPU (GPU-Util,
``nvmlDeviceGetSamples``) or a process (SM share, ``nvmlDeviceGetProcessUtilization``)
was busy since the last read.

GPU-Util: the driver keeps a short history of samples, each a percentage over one sample
period ("between 1 second and 1/6 second, depending on the product", nvml.h), stamped
(µs) when the period ended, and returns those newer than ``lastSeenTimeStamp``. A period
with no activity holds no sample (the buffer "runs dry whenever the GPU sits idle":
docs/simulator.md, "Sample buffers"), so a sample covers the step since the one before
it but never more than one period, the period learned as the smallest positive step seen
between two samples (at least ``MIN_PERIOD_US``). The time a read covers is the time
since the previous read on the exporter's own clock (the NVML source), not the samples'.

Processes: "one utilization sample structure is returned per process running" (nvml.h),
its SM share averaged over the time since ``lastSeenTimeStamp`` up to its timestamp
(docs/simulator.md), so its SM-seconds are the share x that span, the span capped at the
history the driver keeps (``PROCESS_HISTORY_US``). Several entries of one pid (a driver
that returns one per period) each cover the span since the one before.

Pure functions over plain numbers: the NVML source keeps the state (last timestamp, the
learned period) per GPU, and the exporter's counters add what these return.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

# GPU-Util's sample period "may be between 1 second and 1/6 second depending on the
# product" (nvml.h, nvmlDeviceGetUtilizationRates); with a little room for timestamps
# that jitter. A step outside is a stray sample, or several periods (an idle period
# holds no sample).
MIN_PERIOD_US = 158_000
SHORTEST_PERIOD_US = 166_667  # 1/6 s: what a sample covers until the period is learned
MAX_PERIOD_US = 1_050_000
MAX_PERCENT = 100.0  # NVML's utilisation percentages are whole numbers up to 100
GPM_MAX_PERCENT = 100.5  # GPM's are floats: a hair over 100 is rounding, more is garbage
# How far back GPU-Util's buffer reaches: 120 samples of 1/6 s in the simulator
# (docs/simulator.md), not documented by NVIDIA, to be measured on a GPU host. A read
# after a longer gap covers only this much (or what the samples span, if more): the rest
# is neither active nor covered, never idle.
HISTORY_S = 20.0
# How far back a process's averaged entry can reach: the driver's history. Not
# documented by NVIDIA; 20 s is the simulator's (docs/simulator.md), to be measured on a
# GPU host. --process-utilization-interval's default (10 s) stays within it.
PROCESS_HISTORY_US = 20_000_000


@dataclass(frozen=True, slots=True)
class Integrated:
    active_s: float  # busy seconds the samples account for
    newest_us: int  # the newest sample's timestamp (the next read's lastSeenTimeStamp)
    garbage: int  # samples whose value is no percentage (not finite, below 0, above 100)


def integrate(
    samples: Iterable[tuple[int, float | None]], seen_us: int, period_us: int
) -> Integrated:
    """One series' samples (timestamp µs, percent) newer than ``seen_us`` (0: never read),
    each covering the step since the one before, capped at the period (a gap between two
    samples is idle time or lost history, not a sample's). A sample at or before
    ``seen_us`` is ignored; one whose value is no percentage is counted as garbage and
    covers nothing."""
    fresh = sorted(
        ((int(ts), value) for ts, value in samples if int(ts) > seen_us), key=lambda s: s[0]
    )
    active = 0.0
    garbage = 0
    previous = seen_us if seen_us > 0 else None
    newest = seen_us
    for ts, value in fresh:
        # the first sample ever read covers one period
        step = period_us if previous is None else min(ts - previous, period_us)
        previous = newest = ts
        if not plausible_percent(value):
            garbage += 1
            continue
        active += max(step, 0) / 1e6 * float(value or 0.0) / 100.0
    return Integrated(active, newest, garbage)


def plausible_percent(value: object, limit: float = MAX_PERCENT) -> bool:
    """A utilisation value NVML may really answer: a finite 0..100 (``limit``); anything
    else is garbage, counted, never served or clamped into shape."""
    return isinstance(value, (int, float)) and math.isfinite(value) and 0.0 <= value <= limit


def process_sm_seconds(entries: Iterable[tuple[int, float]], seen_us: int) -> float:
    """SM-seconds of one process's entries (timestamp µs, SM percent) returned for a read
    with ``lastSeenTimeStamp`` ``seen_us``: each entry's share x the span since the entry
    before it (the first: since ``seen_us``, at most ``PROCESS_HISTORY_US`` back). 0 for
    the first read (``seen_us`` 0): what came before the exporter is not its to count.
    The caller drops entries whose value is no percentage."""
    if seen_us <= 0:
        return 0.0
    total = 0.0
    previous: int | None = None
    for ts, value in sorted(entries, key=lambda e: e[0]):
        if ts <= seen_us:
            continue
        start = previous if previous is not None else max(seen_us, ts - PROCESS_HISTORY_US)
        previous = ts
        total += max(ts - start, 0) / 1e6 * float(value) / 100.0
    return total


# A sample stamped further ahead of the last one seen than the time since that was read,
# plus a history, plus this, is garbage or the clock stepped forward: it is not taken
# (the error is counted).
SLACK_S = 5.0
# Longer than any driver's history: a suspicion that lasts this long is a clock step, not
# a stray sample (which ages out of the driver's buffer), and the buffer is read afresh.
STEP_S = 120.0
# At a first read nothing is known of the driver's clock: a stamp further than this from
# the median of the read's stamps is garbage.
FIRST_READ_SPREAD_US = 3_600_000_000
STEPS_KEPT = 256  # the steps the period is learned from
PERIOD_TOLERANCE = 0.05  # two steps this close are the same period (timestamps jitter)


@dataclass
class SampleBuffer:
    """The reading state of one NVML sample buffer: its ``lastSeenTimeStamp``, the sample
    period learned from it, and what keeps the timestamp sane.

    The driver returns every sample stamped after the timestamp asked with, so one
    garbage stamp far ahead taken as "seen" would hide every real sample from then on,
    and a wall clock stepped back leaves every new sample behind it (NotFound for good).
    So a sample further ahead of the last one seen than the time since it was read, the
    history the buffer holds (``HISTORY_S``) and ``SLACK_S`` is not taken (at a first
    read: one far from the others); and when either condition lasts
    ``STEP_S`` (a forward step: such samples keep coming; a backward one: NotFound while
    the GPU is busy), the buffer is read afresh from 0, that read a baseline (nothing
    counted, no window spanning the suspect time), as at start.

    The period is the smallest step between consecutive samples seen at least twice
    among the last ``STEPS_KEPT`` (within ``MIN_PERIOD_US``..``MAX_PERIOD_US``): a stray
    sample cannot shrink it, as a plain minimum would let it, and a bursty GPU (mostly
    steps of several periods) cannot stretch it, as a median would.
    """

    seen_us: int = 0
    seen_at: float | None = None  # source clock when ``seen_us`` last moved
    answered_at: float | None = None  # source clock of the last read that answered
    suspect_since: float | None = None
    steps: deque[int] = field(default_factory=lambda: deque(maxlen=STEPS_KEPT))
    learned_us: int | None = None

    @property
    def period_us(self) -> int:
        """The sample period as learned so far (None: not yet): the steps within
        ``PERIOD_TOLERANCE`` of the smallest step seen at least twice, their median.
        Steps between samples are whole periods (an idle period holds no sample, so a
        bursty GPU's steps are mostly several); a stray step is seen once; jittered
        timestamps scatter around the period, and each step inside that scatter counts
        whole (the period taken is the scatter's top). Until a step repeats, a sample
        covers the shortest period nvml.h allows (``MIN_PERIOD_US``): a 1 s product's GPU
        that never shows two consecutive busy samples is under-counted, never over. Once
        learned it
        stays (a GPU's period does not change) until the buffer is read afresh."""
        return self.learned_us if self.learned_us is not None else SHORTEST_PERIOD_US

    def learn(self, stamps: Iterable[int]) -> None:
        previous = self.seen_us if self.seen_us > 0 else None
        for ts in sorted(stamps):
            if previous is not None and MIN_PERIOD_US <= ts - previous <= MAX_PERIOD_US:
                self.steps.append(ts - previous)
            previous = ts
        ordered = sorted(self.steps)
        for a, b in itertools.pairwise(ordered):
            if b - a <= a * PERIOD_TOLERANCE:
                # the cluster's top: a jittered step inside it is never cut short
                near = [step for step in ordered if step <= a * (1 + 2 * PERIOD_TOLERANCE)]
                self.learned_us = max(near)
                return

    def plausible(self, stamps: list[int], now: float) -> list[bool]:
        """Which stamps may be taken."""
        if self.seen_us > 0 and self.seen_at is not None:
            # the stamp seen may be up to a history old when it was read
            limit = self.seen_us + int((now - self.seen_at + HISTORY_S + SLACK_S) * 1e6)
            return [ts <= limit for ts in stamps]
        if not stamps:
            return []
        middle = statistics.median_low(stamps)
        return [abs(ts - middle) <= FIRST_READ_SPREAD_US for ts in stamps]

    def suspect(self, now: float) -> bool:
        """Something is wrong with the stamps now: whether it has lasted ``STEP_S``
        (then the next read starts afresh, as at start)."""
        if self.suspect_since is None:
            self.suspect_since = now
        if now - self.suspect_since >= STEP_S:
            self.seen_us, self.suspect_since, self.answered_at, self.seen_at = 0, None, None, None
            self.steps.clear()
            self.learned_us = None
            return True
        return False

    def advance(self, newest_us: int, now: float) -> None:
        """The newest stamp taken, read at ``now``."""
        if newest_us > self.seen_us:
            self.seen_us, self.seen_at = newest_us, now

    def fine(self) -> None:
        self.suspect_since = None
