"""Activity as counters (pure): seconds each GPU (or MIG device) and each container was
active, so ``rate()`` over any window is the mean over that window, whatever the sample
interval and the scrape interval (docs/metrics.md, "Activity counters").

A gauge averaged over one window shows a scrape only the window it lands in; a counter of
active seconds accumulates every window the sources measured:

- occupancy (GPM or DCGM: SM active, occupancy, tensor, DRAM, FP64/32/16, graphics):
  each window adds ratio x its length, once, by its end (``Occupancy.window_end``); a
  window served again between two GPM reads adds nothing. The windows added never cover
  more seconds than the analysis' own clock saw pass, so windows of two sources (DCGM on
  and off) never cover a second twice, and a window of garbage length claims only time
  nobody covered; but a window runs from read to read and the analysis' clock from one
  cycle's end of reads to the next, so what a shorter window left stays claimable by
  the next (up to one window's worth, at least ``JITTER_S``): reads that land earlier or
  later in their cycle lose nothing. A window whose length is no finite number adds
  nothing;
- GPU-Util: the busy seconds NVML's sample buffer accounts for (``ActiveWindow``), never
  more in all than the time covered (samples and the exporter's clock are not in phase,
  so one window may hold a little more than its length: up to ``MAX_EXCESS_S`` is kept
  for later);
- a container: the SM seconds of its processes' samples (``ProcessUtilization.sm_seconds``)
  on each device, each process's samples added once, by their newest timestamp; its
  total starts at its processes' first reading there.

Beside them, ``sampled`` counts the seconds the windows covered, per device and metric:
``rate(active) / rate(sampled)`` is the mean over the time that was measured, exact
even across a gap (GPM failing, one metric failing, an exporter restart).

A counter is served exactly when its gauge is (exposition); absence of a reading adds
nothing, never a zero. A device or container not seen for ``ABSENT_S`` is dropped with
its totals (bounded by what the node has): one failed read, or a GPU failing for a
cycle, does not reset a counter.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from exporter.model import (
    OCCUPANCY_FIELDS,
    ActiveTime,
    ActiveWindow,
    Attribution,
    ContainerRef,
    DeviceRef,
    GpuSample,
    Occupancy,
)

UTILIZATION = "utilization"  # GPU-Util's metric name and signal
OCCUPANCY = "occupancy"  # the GPM/DCGM windows
ABSENT_S = 300.0  # a device or container unseen this long is gone
MAX_EXCESS_S = 1.0  # GPU-Util's longest sample period (nvml.h): the most a window holds over
# What a window may claim of the time the ones before it left unclaimed, at least (up to
# one window's worth): a read may move inside its cycle by up to the cycle's length from
# one cycle to the next.
JITTER_S = 1.0
ContainerKey = tuple[ContainerRef, DeviceRef]
_UTILIZATION_RAW = "utilization_unclamped"  # GPU-Util's busy seconds as the samples say


def account_active_time(
    state: ActiveTime, gpus: Iterable[GpuSample], attribution: Attribution, *, now: float
) -> ActiveTime:
    devices = {uuid: dict(metrics) for uuid, metrics in state.devices.items()}
    sampled = {uuid: dict(signals) for uuid, signals in state.sampled.items()}
    window_end = dict(state.window_end)
    source = dict(state.source)
    covered_to = dict(state.covered_to)
    added_at = dict(state.added_at)
    device_seen = dict(state.device_seen)
    # (GPU UUID, pid) stamps: a GPU that answered keeps only the pids it reports now
    # (bounded by one read); one that did not keeps its own until it is gone
    gpus = tuple(gpus)
    answered = {gpu.uuid for gpu in gpus if not gpu.error}
    stamps = {key: v for key, v in state.process_stamp.items() if key[0] not in answered}
    new_sm: dict[tuple[str, int], float] = {}  # (GPU UUID, pid) -> SM seconds to add
    for gpu in gpus:
        device_seen[gpu.uuid] = now  # a GPU failing this cycle is still there
        if gpu.error:
            continue
        _add_occupancy(
            gpu.uuid, gpu.occupancy, devices, sampled, window_end, source, covered_to, added_at, now
        )
        _add_utilization(gpu.uuid, gpu.utilization_window, devices, sampled, window_end)
        for mig in gpu.mig_instances:
            device_seen[mig.uuid] = now
            _add_occupancy(
                mig.uuid,
                mig.occupancy,
                devices,
                sampled,
                window_end,
                source,
                covered_to,
                added_at,
                now,
            )
        for sample in gpu.process_utilization:
            key = (gpu.uuid, sample.pid)
            # a reading standing in has the stamp already added; a new one another (a
            # smaller one too: the clock the driver stamps with may have stepped back)
            if sample.timestamp_us != state.process_stamp.get(key):
                new_sm[key] = sample.sm_seconds
            stamps[key] = sample.timestamp_us
    containers = dict(state.containers)
    container_seen = dict(state.container_seen)
    for row in attribution.processes:
        if row.owner != "pod" or not (row.namespace and row.pod and row.container):
            continue
        where = (
            ContainerRef(row.namespace, row.pod, row.container),
            DeviceRef(row.gpu, row.uuid, row.mig_uuid),
        )
        container_seen[where] = now
        # a container's total starts at its processes' first reading on the device (a
        # baseline adds 0): none read yet (MIG mode, no driver support) is no zero
        if (row.uuid, row.pid) in new_sm or where in containers:
            containers[where] = containers.get(where, 0.0) + new_sm.get((row.uuid, row.pid), 0.0)
    gone = {uuid for uuid, at in device_seen.items() if now - at > ABSENT_S}
    return ActiveTime(
        devices={uuid: m for uuid, m in devices.items() if uuid not in gone},
        sampled={uuid: m for uuid, m in sampled.items() if uuid not in gone},
        window_end={key: end for key, end in window_end.items() if key[0] not in gone},
        source={uuid: name for uuid, name in source.items() if uuid not in gone},
        covered_to={uuid: at for uuid, at in covered_to.items() if uuid not in gone},
        added_at={uuid: at for uuid, at in added_at.items() if uuid not in gone},
        containers={
            key: total
            for key, total in containers.items()
            if now - container_seen.get(key, now) <= ABSENT_S
        },
        process_stamp={key: stamp for key, stamp in stamps.items() if key[0] not in gone},
        device_seen={uuid: at for uuid, at in device_seen.items() if uuid not in gone},
        container_seen={key: at for key, at in container_seen.items() if now - at <= ABSENT_S},
    )


def _add_occupancy(
    uuid: str,
    occupancy: Occupancy | None,
    devices: dict[str, dict[str, float]],
    sampled: dict[str, dict[str, float]],
    window_end: dict[tuple[str, str], float],
    source: dict[str, str],
    covered_to: dict[str, float],
    added_at: dict[str, float],
    now: float,
) -> None:
    if occupancy is None or occupancy.window_end is None or occupancy.window_s is None:
        return
    if not (math.isfinite(occupancy.window_s) and math.isfinite(occupancy.window_end)):
        return  # no length, no window: nothing covered, never NaN in the totals
    key = (uuid, OCCUPANCY)
    if source.get(uuid, occupancy.source) != occupancy.source:
        window_end.pop(key, None)  # the other source's ends are on its own clock
    source[uuid] = occupancy.source
    if not _new_window(key, occupancy.window_end, window_end):
        return
    seconds = max(occupancy.window_s, 0.0)
    last, previous = covered_to.get(uuid), added_at.get(uuid)
    added_at[uuid] = now
    if last is None or previous is None:
        covered_to[uuid] = now
    else:
        # never more than the analysis' clock saw pass that no window claimed yet, at most
        # one window's worth before the last was added (a read moves inside its cycle by
        # less than that) or JITTER_S; a clock that stepped back claims nothing this time
        floor = min(now - JITTER_S, previous - (now - previous))
        last = min(max(last, floor), now)
        seconds = min(seconds, now - last)
        covered_to[uuid] = last + seconds
    metrics = devices.setdefault(uuid, {})
    covered = sampled.setdefault(uuid, {})
    for name in OCCUPANCY_FIELDS:
        ratio = getattr(occupancy, name)
        if ratio is not None:
            metrics[name] = metrics.get(name, 0.0) + min(max(ratio, 0.0), 1.0) * seconds
            covered[name] = covered.get(name, 0.0) + seconds


def _add_utilization(
    uuid: str,
    window: ActiveWindow | None,
    devices: dict[str, dict[str, float]],
    sampled: dict[str, dict[str, float]],
    window_end: dict[tuple[str, str], float],
) -> None:
    if window is None or not _new_window((uuid, UTILIZATION), window.end, window_end):
        return
    covered = sampled.setdefault(uuid, {})
    covered[UTILIZATION] = covered.get(UTILIZATION, 0.0) + max(window.seconds, 0.0)
    metrics = devices.setdefault(uuid, {})
    busy = metrics.get(_UTILIZATION_RAW, 0.0) + max(window.active_s, 0.0)
    # what one window held over (samples and the clock out of phase), a later one gets,
    # up to one sample period at most: more is no phase, and is not banked
    metrics[_UTILIZATION_RAW] = min(busy, covered[UTILIZATION] + MAX_EXCESS_S)
    metrics[UTILIZATION] = min(busy, covered[UTILIZATION])


def _new_window(key: tuple[str, str], end: float, window_end: dict[tuple[str, str], float]) -> bool:
    """Whether a window ending at ``end`` was not added yet (and remember it if so).
    Ends only move forward: a window ending at or before the last one added is one
    already counted (served again between reads), never counted twice."""
    last = window_end.get(key)
    if last is not None and end <= last:
        return False
    window_end[key] = end
    return True
