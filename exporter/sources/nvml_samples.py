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

import math
from collections.abc import Iterable
from dataclasses import dataclass

MIN_PERIOD_US = 10_000  # no driver samples faster than 100 Hz; a smaller step is noise
MAX_PERIOD_US = 5_000_000  # nor slower than every 5 s: a larger "period" is a gap
# How far back a process's averaged entry can reach: the driver's history. Not
# documented by NVIDIA; 20 s is the simulator's (docs/simulator.md), to be measured on a
# GPU host. --process-utilization-interval's default (10 s) stays within it.
PROCESS_HISTORY_US = 20_000_000


@dataclass(frozen=True, slots=True)
class Integrated:
    active_s: float  # busy seconds the samples account for
    covered_s: float  # seconds the samples cover
    newest_us: int  # the newest sample's timestamp (the next read's lastSeenTimeStamp)
    period_us: int | None  # the sample period learned so far


def learn_period(period_us: int | None, step_us: int) -> int | None:
    """The smaller of the known period and a new step between two samples of a series."""
    if step_us < MIN_PERIOD_US or step_us > MAX_PERIOD_US:
        return period_us
    return step_us if period_us is None else min(period_us, step_us)


def integrate(
    samples: Iterable[tuple[int, float | None]], seen_us: int, period_us: int | None
) -> Integrated:
    """One series' samples (timestamp µs, percent) newer than ``seen_us`` (0: never read),
    each covering the step since the one before, capped at the period. A sample at or
    before ``seen_us``, or whose value is not a finite number, is ignored; a percentage
    outside 0..100 is clamped."""
    fresh = sorted(
        ((int(ts), value) for ts, value in samples if int(ts) > seen_us), key=lambda s: s[0]
    )
    previous = seen_us if seen_us > 0 else None
    for ts, _ in fresh:  # learn from this read's steps before using the period
        if previous is not None:
            period_us = learn_period(period_us, ts - previous)
        previous = ts
    active = covered = 0.0
    previous = seen_us if seen_us > 0 else None
    newest = seen_us
    for ts, value in fresh:
        if period_us is None:
            step = 0  # no period known yet: what a sample covers cannot be said
        elif previous is None:
            step = period_us  # the first sample ever read: one period
        else:
            step = min(ts - previous, period_us)
        previous = newest = ts
        if not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        seconds = max(step, 0) / 1e6
        covered += seconds
        active += seconds * min(max(float(value), 0.0), 100.0) / 100.0
    return Integrated(active, covered, newest, period_us)


def process_sm_seconds(entries: Iterable[tuple[int, float]], seen_us: int) -> float:
    """SM-seconds of one process's entries (timestamp µs, SM percent) returned for a read
    with ``lastSeenTimeStamp`` ``seen_us``: each entry's share x the span since the entry
    before it (the first: since ``seen_us``, at most ``PROCESS_HISTORY_US`` back). 0 for
    the first read (``seen_us`` 0): what came before the exporter is not its to count."""
    if seen_us <= 0:
        return 0.0
    total = 0.0
    previous: int | None = None
    for ts, value in sorted(entries, key=lambda e: e[0]):
        if ts <= seen_us or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        start = previous if previous is not None else max(seen_us, ts - PROCESS_HISTORY_US)
        previous = ts
        total += max(ts - start, 0) / 1e6 * min(max(float(value), 0.0), 100.0) / 100.0
    return total


# A sample stamped further ahead of the last one seen than the time since the last read
# plus this is garbage, or the clock stepped forward: it is not counted (the error is).
SLACK_S = 60.0
# Longer than any driver's history: a suspicion that lasts this long is a clock step, not
# a stray sample (which ages out of the driver's buffer), and the buffer is read afresh.
STEP_S = 120.0


@dataclass
class StampGuard:
    """Keeps a sample buffer's ``lastSeenTimeStamp`` sane.

    The driver returns every sample stamped after the timestamp asked with, so one
    garbage stamp far ahead taken as "seen" would hide every real sample from then on,
    and a wall clock stepped back leaves every new sample behind it (NotFound for good).
    So a sample further ahead than ``SLACK_S`` past the time since the last read is not
    taken; and when either condition lasts ``STEP_S`` (a forward step: such samples keep
    coming; a backward one: NotFound while the GPU is busy), the buffer is read afresh
    from 0, that read a baseline (nothing counted), as at start.
    """

    seen_us: int = 0
    answered_at: float | None = None  # source clock of the last read that answered
    suspect_since: float | None = None

    def plausible(self, now: float) -> int | None:
        """The newest stamp a sample may have to be taken; None: any (first read)."""
        if self.seen_us <= 0 or self.answered_at is None:
            return None
        return self.seen_us + int((now - self.answered_at + SLACK_S) * 1e6)

    def suspect(self, now: float) -> bool:
        """Something is wrong with the stamps now: whether it has lasted ``STEP_S``
        (then the next read starts afresh)."""
        if self.suspect_since is None:
            self.suspect_since = now
        if now - self.suspect_since >= STEP_S:
            self.seen_us, self.suspect_since = 0, None
            return True
        return False

    def fine(self) -> None:
        self.suspect_since = None
