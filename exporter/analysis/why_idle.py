"""Why an allocated GPU is idle (pure): each GPU container's cgroup counters over the
window since the last cycle, and the likely cause they point to (docs/why-idle.md).

The window is the one between two consecutive cgroup readings (``CgroupSnapshot``'s
monotonic timestamps); the ledger adds this cycle's idle and no_process GPU-seconds of
the container's allocations to the cause (``exporter/analysis/ledger.py``). Shares:

- throttled: d ``nr_throttled`` / d ``nr_periods`` (``cpu.stat``): the part of the CFS
  periods in which the container wanted CPU and had used up its quota;
- cpu / io pressure: d ``some`` stall total / window (``cpu.pressure``, ``io.pressure``):
  seconds per second in which at least one of its tasks waited for CPU / for I/O
  (https://docs.kernel.org/accounting/psi.html).

A share is unknown (None), never 0, when it cannot be measured: no reading in either
cycle, a file or line the kernel did not write (cgroup v1 has no pressure files), no CFS
period in the window (no CPU quota, or nothing runnable), a counter that went back (the
cgroup was recreated: a restart), a window of no length, or a stall share well over the
window (an implausible reading). An unknown share gives no cause; the others still can.

The cause, first that applies: ``cpu_throttled`` (throttled share over
``throttled_ratio``), ``cpu_pressure`` (cpu share over ``pressure_ratio``),
``io_pressure`` (io share over ``pressure_ratio``), else ``unknown`` (which includes "no
reading at all"). This is a correlation over the same window, not a proof: a throttled
container whose GPU idles may be idle for another reason as well.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from exporter.model import (
    CgroupSnapshot,
    CgroupStats,
    ContainerCgroup,
    ContainerRef,
    IdleCause,
    IdleReason,
    Pressure,
)

CgroupKey = tuple[str, str]  # (pod UID, bare container id)

# A stall share over the window by more than this is no reading: the files are read a
# moment after the timestamp, so a share can pass 1 by a little (clamped), not by more.
_STALL_SLACK = 1.1


@dataclass(frozen=True)
class WhyIdlePolicy:
    """Thresholds of the causes (``--why-idle-throttled-ratio``,
    ``--why-idle-pressure-ratio``; their reasoning is in ``exporter/config.py``)."""

    throttled_ratio: float = 0.2
    pressure_ratio: float = 0.2


def readings_by_key(cgroups: CgroupSnapshot | None) -> dict[CgroupKey, CgroupStats]:
    """This cycle's readings, (pod UID, container id) -> counters; empty when the source
    is off or down (so the next cycle has no window: unknown, not 0). The first reading
    of a key wins where one is listed twice."""
    if cgroups is None or not cgroups.ok:
        return {}
    out: dict[CgroupKey, CgroupStats] = {}
    for stats in cgroups.containers:
        out.setdefault((stats.pod_uid, stats.container_id), stats)
    return out


def counter_delta(before: int | None, now: int | None) -> int | None:
    """How far a cumulative counter moved; None when either reading is missing or it
    went back (a recreated cgroup starts again at 0: that window is unknown)."""
    if before is None or now is None or now < before:
        return None
    return now - before


def throttled_share(before: CgroupStats, now: CgroupStats) -> float | None:
    """Periods throttled / periods with a quota over the window; None without periods
    in the window (no CPU limit, or nothing ran) or when the counters disagree."""
    periods = counter_delta(before.nr_periods, now.nr_periods)
    throttled = counter_delta(before.nr_throttled, now.nr_throttled)
    if periods is None or throttled is None or periods == 0 or throttled > periods:
        return None
    return _divide(throttled, periods)


def stall_share(before: Pressure | None, now: Pressure | None, window_s: float) -> float | None:
    """Seconds per second that some task stalled over the window (``some`` totals, µs);
    None without both totals, a window, or with a share no window can hold."""
    if before is None or now is None or window_s <= 0:
        return None
    stalled = counter_delta(before.some_us, now.some_us)
    if stalled is None:
        return None
    share = _divide(stalled, window_s * 1e6)
    return None if share is None or share > _STALL_SLACK else min(share, 1.0)


def _divide(numerator: int, denominator: float) -> float | None:
    """``numerator / denominator``; None where a counter too large for a float (the
    source bounds them to u64, so only a bug gets here) would raise OverflowError."""
    try:
        return numerator / denominator
    except OverflowError:
        return None


def cause_of(
    throttled: float | None,
    cpu_pressure: float | None,
    io_pressure: float | None,
    policy: WhyIdlePolicy,
) -> IdleCause:
    """The first cause whose share passes its threshold (module doc); an unknown share
    never does."""
    if throttled is not None and throttled > policy.throttled_ratio:
        return "cpu_throttled"
    if cpu_pressure is not None and cpu_pressure > policy.pressure_ratio:
        return "cpu_pressure"
    if io_pressure is not None and io_pressure > policy.pressure_ratio:
        return "io_pressure"
    return "unknown"


def window(
    container: ContainerRef,
    before: CgroupStats | None,
    now: CgroupStats,
    window_s: float,
    policy: WhyIdlePolicy,
) -> IdleReason:
    """One container's shares and cause; without an earlier reading of the same cgroup
    version every share is unknown."""
    if before is None or before.cgroup_version != now.cgroup_version:
        return IdleReason(container, "unknown", None, None, None)
    throttled = throttled_share(before, now)
    cpu = stall_share(before.cpu_pressure, now.cpu_pressure, window_s)
    io = stall_share(before.io_pressure, now.io_pressure, window_s)
    return IdleReason(container, cause_of(throttled, cpu, io, policy), throttled, cpu, io)


def why_idle(
    previous: Mapping[CgroupKey, CgroupStats],
    previous_timestamp: float | None,
    cgroups: CgroupSnapshot | None,
    signals: Sequence[ContainerCgroup],
    policy: WhyIdlePolicy,
) -> tuple[IdleReason, ...]:
    """This cycle's reason for every GPU container read now and named
    (``exporter/analysis/cgroup_signals.py``: a container nobody can name has no
    allocation to explain); none when the source did not read or could not."""
    if cgroups is None or not cgroups.ok:
        return ()
    window_s = cgroups.timestamp - previous_timestamp if previous_timestamp is not None else 0.0
    out: dict[ContainerRef, IdleReason] = {}
    for row in signals:
        before = previous.get((row.stats.pod_uid, row.stats.container_id))
        out.setdefault(row.container, window(row.container, before, row.stats, window_s, policy))
    return tuple(out[c] for c in sorted(out))


def causes(reasons: Iterable[IdleReason]) -> dict[ContainerRef, IdleCause]:
    """Container -> this cycle's cause, for the ledger (a container missing: unknown)."""
    return {r.container: r.cause for r in reasons}
