"""Activity as counters (pure): seconds each GPU (or MIG device) and each container was
active, so ``rate()`` over any window is the mean over that window, whatever the sample
interval and the scrape interval (docs/metrics.md, "Activity counters").

A gauge "averaged over the cycle" shows a scrape only the cycle it lands in; a counter of
active seconds accumulates every window the sources measured:

- occupancy (GPM or DCGM: SM active, occupancy, tensor, DRAM, FP64/32/16, graphics):
  each window adds ratio x its length, once, by its end (``Occupancy.window_end``); a
  window served again between two GPM reads adds nothing;
- GPU-Util: the busy seconds NVML's sample buffer accounts for (``ActiveWindow``);
- a container: the SM seconds of its processes' samples (``ProcessUtilization.sm_seconds``)
  on each device, each process's samples added once, by their newest timestamp.

Beside them, ``sampled`` counts the seconds the windows covered, per device and signal
(``occupancy``, ``utilization``): ``rate(active) / rate(sampled)`` is the mean over the
time that was measured, exact even across a gap (GPM failing, an exporter restart).

A counter is served exactly when its gauge is (the reading is present this cycle);
absence of a reading adds nothing and serves nothing, never a zero. Totals of a device
or container that is gone are dropped (bounded by what the node has), unless NVML did not
answer this cycle (then nothing is known to be gone).
"""

from __future__ import annotations

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
OCCUPANCY = "occupancy"  # the GPM/DCGM signal
ContainerKey = tuple[ContainerRef, DeviceRef]


def account_active_time(
    state: ActiveTime, gpus: Iterable[GpuSample], attribution: Attribution, *, nvml_ok: bool
) -> ActiveTime:
    devices = {uuid: dict(metrics) for uuid, metrics in state.devices.items()}
    sampled = {uuid: dict(signals) for uuid, signals in state.sampled.items()}
    window_end = dict(state.window_end)
    present: set[str] = set()
    # (GPU UUID, pid) -> SM seconds not yet added, and the stamp that adds them
    new_sm: dict[tuple[str, int], float] = {}
    stamps: dict[tuple[str, int], int] = {}
    gpus = tuple(gpus)
    for gpu in gpus:
        if gpu.error:
            continue
        present.add(gpu.uuid)
        _add_occupancy(gpu.uuid, gpu.occupancy, devices, sampled, window_end)
        _add_utilization(gpu.uuid, gpu.utilization_window, devices, sampled, window_end)
        for mig in gpu.mig_instances:
            present.add(mig.uuid)
            _add_occupancy(mig.uuid, mig.occupancy, devices, sampled, window_end)
        for sample in gpu.process_utilization:
            key = (gpu.uuid, sample.pid)
            stamps[key] = sample.timestamp_us
            if sample.timestamp_us > state.process_stamp.get(key, -1):
                new_sm[key] = sample.sm_seconds
    containers = dict(state.containers)
    seen_containers: set[ContainerKey] = set()
    for row in attribution.processes:
        if row.owner != "pod" or not (row.namespace and row.pod and row.container):
            continue
        where = (
            ContainerRef(row.namespace, row.pod, row.container),
            DeviceRef(row.gpu, row.uuid, row.mig_uuid),
        )
        seen_containers.add(where)
        containers[where] = containers.get(where, 0.0) + new_sm.get((row.uuid, row.pid), 0.0)
    if nvml_ok:  # what is not here now is gone: drop it (bounded by the node)
        devices = {uuid: m for uuid, m in devices.items() if uuid in present}
        sampled = {uuid: s for uuid, s in sampled.items() if uuid in present}
        window_end = {key: end for key, end in window_end.items() if key[0] in present}
        containers = {key: v for key, v in containers.items() if key in seen_containers}
    else:
        stamps = {**state.process_stamp, **stamps}
    return ActiveTime(devices, sampled, window_end, containers, stamps)


def _add_occupancy(
    uuid: str,
    occupancy: Occupancy | None,
    devices: dict[str, dict[str, float]],
    sampled: dict[str, dict[str, float]],
    window_end: dict[tuple[str, str], float],
) -> None:
    if occupancy is None or occupancy.window_end is None or occupancy.window_s is None:
        return
    if not _new_window(uuid, occupancy.source, occupancy.window_end, window_end):
        return
    seconds = max(occupancy.window_s, 0.0)
    metrics = devices.setdefault(uuid, {})
    for name in OCCUPANCY_FIELDS:
        ratio = getattr(occupancy, name)
        if ratio is not None:
            metrics[name] = metrics.get(name, 0.0) + min(max(ratio, 0.0), 1.0) * seconds
    signals = sampled.setdefault(uuid, {})
    signals[OCCUPANCY] = signals.get(OCCUPANCY, 0.0) + seconds


def _add_utilization(
    uuid: str,
    window: ActiveWindow | None,
    devices: dict[str, dict[str, float]],
    sampled: dict[str, dict[str, float]],
    window_end: dict[tuple[str, str], float],
) -> None:
    if window is None or not _new_window(uuid, UTILIZATION, window.end, window_end):
        return
    seconds = max(window.seconds, 0.0)
    metrics = devices.setdefault(uuid, {})
    metrics[UTILIZATION] = metrics.get(UTILIZATION, 0.0) + min(max(window.active_s, 0.0), seconds)
    signals = sampled.setdefault(uuid, {})
    signals[UTILIZATION] = signals.get(UTILIZATION, 0.0) + seconds


def _new_window(
    uuid: str, signal: str, end: float, window_end: dict[tuple[str, str], float]
) -> bool:
    """Whether a window ending at ``end`` was not added yet (and remember it if so).
    Ends only move forward: a window ending at or before the last one added is one
    already counted (served again between reads), never counted twice."""
    key = (uuid, signal)
    last = window_end.get(key)
    if last is not None and end <= last:
        return False
    window_end[key] = end
    return True
