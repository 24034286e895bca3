"""``gpu-occupancy-exporter snapshot``: one analysed sample, for an operator on the node.

It runs the exporter's own code path (same sources, same analysis) for two cycles a
short window apart — GPM occupancy needs two samples — and prints what /metrics would
say as readable tables, or the whole analysis as JSON.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from exporter.model import (
    Analysis,
    ContainerRef,
    DeviceRef,
    GpuSample,
    IdleReason,
    MigInstance,
    SharedGpu,
    XidCount,
    placeholder_uuid,
)

GIB = 1024**3


def _table(headers: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    text_rows = [[("-" if v is None else str(v)) for v in row] for row in rows]
    widths = [
        max(len(h), *(len(r[i]) for r in text_rows)) if text_rows else len(h)
        for i, h in enumerate(headers)
    ]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += [
        "  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in text_rows
    ]
    return lines


def _gib(value: int | None) -> str:
    """GiB with one decimal; "?" where the memory is unknown (never a 0 that looks real)."""
    return "?" if value is None else f"{value / GIB:.1f}"


def _pct(ratio: float | None) -> str | None:
    return None if ratio is None else f"{ratio * 100:.0f}%"


def _uuid_cell(gpu: GpuSample) -> str:
    """The UUID's first 12 characters; "unknown" while NVML never gave it (the
    placeholder ``unknown-gpu-<index>`` cut to 12 would read as a broken UUID)."""
    return "unknown" if gpu.uuid == placeholder_uuid(gpu.index) else gpu.uuid[:12]


def _gpu_row(gpu: GpuSample, health: dict[str, str]) -> list[object]:
    occupancy = gpu.occupancy
    util = None if gpu.utilization_gpu_percent is None else gpu.utilization_gpu_percent / 100
    return [
        gpu.index,
        _uuid_cell(gpu),
        gpu.name,
        f"{_gib(gpu.memory_used_bytes)}/{_gib(gpu.memory_total_bytes)}"
        if gpu.memory_total_bytes
        else None,
        _pct(util),
        _pct(occupancy.sm_active if occupancy else None),
        None if gpu.power_milliwatts is None else f"{gpu.power_milliwatts / 1000:.0f}W",
        None if gpu.temperature_celsius is None else f"{gpu.temperature_celsius}C",
        health.get(gpu.uuid, "unknown"),
    ]


def render_text(analysis: Analysis) -> str:
    """Every section in order: the node line, then one table per kind of finding (a
    section with nothing to show prints nothing, GPUS and PODS excepted)."""
    lines = [line for section in SECTIONS for line in section(analysis)]
    return "\n".join(lines) + "\n"


def _node_lines(analysis: Analysis) -> list[str]:
    node = analysis.node
    nvml = node.nvml
    lines = [
        f"node {node.node_name}  driver {nvml.driver_version or '-'}  "
        f"CUDA {nvml.cuda_driver_version or '-'}  NVML {'up' if nvml.ok else 'DOWN'}"
    ]
    if not nvml.ok:
        lines.append(f"NVML unavailable: {nvml.error}")
    down = [f"{s.name} ({s.error})" for s in node.sources if not s.up]
    if down:
        lines.append("sources down: " + ", ".join(down))
    return lines


def _health_words(analysis: Analysis) -> dict[str, str]:
    """GPU UUID -> its HEALTH cell: the unhealthy reasons, the unknown ones of a GPU that
    could not be read, or the degraded ones of a healthy GPU; a GPU without a verdict is
    left out (printed "unknown")."""
    health = {
        h.uuid: "healthy"
        if h.healthy
        else f"{'UNHEALTHY' if h.unhealthy else 'unknown'}: "
        + ",".join(
            r.reason for r in h.reasons if r.severity == ("unhealthy" if h.unhealthy else "unknown")
        )
        for h in analysis.health
    }
    for h in analysis.health:
        degraded = [r.reason for r in h.reasons if r.severity == "degraded"]
        if degraded and h.healthy:
            health[h.uuid] = "degraded: " + ",".join(degraded)
    return health


def _gpu_lines(analysis: Analysis) -> list[str]:
    health = _health_words(analysis)
    return [
        "",
        "GPUS",
        *_table(
            ["GPU", "UUID", "MODEL", "MEM GiB", "GPU-UTIL", "SM-ACTIVE", "POWER", "TEMP", "HEALTH"],
            (_gpu_row(g, health) for g in analysis.node.nvml.gpus),
        ),
    ]


def _migs(analysis: Analysis) -> list[tuple[int, MigInstance]]:
    return [(g.index, m) for g in analysis.node.nvml.gpus for m in g.mig_instances]


def _mig_lines(analysis: Analysis) -> list[str]:
    migs = _migs(analysis)
    if not migs:
        return []
    return [
        "",
        "MIG INSTANCES",
        *_table(
            ["GPU", "GI", "CI", "PROFILE", "MEM GiB", "SM-ACTIVE", "PROCESSES"],
            (
                [
                    i,
                    m.gpu_instance_id,
                    m.compute_instance_id,
                    m.profile,
                    f"{_gib(m.memory_used_bytes)}/{_gib(m.memory_total_bytes)}",
                    _pct(m.occupancy.sm_active if m.occupancy else None),
                    len(m.processes),
                ]
                for i, m in migs
            ),
        ),
    ]


def _pod_lines(analysis: Analysis) -> list[str]:
    mig_profile = {m.uuid: m.profile for _, m in _migs(analysis)}
    return [
        "",
        "PODS",
        *_table(
            ["NAMESPACE", "POD", "CONTAINER", "GPU", "MIG", "MEM GiB", "SM", "PROCS"],
            (
                [
                    c.container.namespace,
                    c.container.pod,
                    c.container.container,
                    c.device.gpu,
                    mig_profile.get(c.device.mig_uuid or ""),
                    _gib(c.memory_used_bytes),
                    _pct(c.sm_ratio),
                    c.processes,
                ]
                for c in analysis.attribution.containers
            ),
        ),
    ]


def _idle_lines(analysis: Analysis) -> list[str]:
    idle = [i for i in analysis.idle if i.idle_now]
    if not idle:
        return []
    why = {r.container: r for r in analysis.why_idle}
    return [
        "",
        "ALLOCATED BUT IDLE",
        *_table(
            ["NAMESPACE", "POD", "CONTAINER", "DEVICE", "IDLE SECONDS", "WHY IDLE"],
            (
                [
                    *_names(i.container),
                    i.device_id,
                    f"{i.idle_seconds_total:.0f}",
                    why_idle_text(why.get(i.container)),
                ]
                for i in idle
            ),
        ),
    ]


def why_idle_text(reason: IdleReason | None) -> str:
    """The likely cause and the share behind it ("cpu throttled 41%"); for ``unknown``,
    the shares that were measured (none: no window), so "no cause" reads apart from "not
    known". A correlation over the snapshot's window, not a proof (docs/why-idle.md)."""
    if reason is None:
        return "unknown (no cgroup reading)"
    shares = {
        "cpu throttled": reason.throttled_ratio,
        "cpu pressure": reason.cpu_pressure_ratio,
        "io pressure": reason.io_pressure_ratio,
    }
    if reason.cause != "unknown":
        name = reason.cause.replace("_", " ")
        return f"{name} {_pct(shares[name])}"
    measured = [f"{name} {_pct(share)}" for name, share in shares.items() if share is not None]
    return f"unknown ({', '.join(measured)})" if measured else "unknown (no window)"


def _leak_lines(analysis: Analysis) -> list[str]:
    leaks = analysis.attribution.unallocated_use
    if not leaks:
        return []
    return [
        "",
        "ISOLATION LEAKS (using a GPU not allocated to the container)",
        *_table(
            ["NAMESPACE", "POD", "CONTAINER", "GPU", "MEM GiB"],
            ([*_names(u.container), u.device.gpu, _gib(u.memory_used_bytes)] for u in leaks),
        ),
    ]


def _unowned_lines(analysis: Analysis) -> list[str]:
    unowned = analysis.attribution.unattributed
    if not unowned:
        return []
    return [
        "",
        "NOT OWNED BY ANY CONTAINER",
        *_table(
            ["GPU", "OWNER", "REASON", "MEM GiB", "PROCS"],
            (
                [u.device.gpu, u.owner, u.reason, _gib(u.memory_used_bytes), u.processes]
                for u in unowned
            ),
        ),
    ]


# A container with more than this share of a shared GPU's SM time, among at least two
# that wanted the GPU, on a GPU busy above HOG_BUSY (below it nobody had to wait), is its
# hog: the GPUTimeSliceHog alert's thresholds (docs/shared-gpus.md).
HOG_SHARE = 0.75
HOG_BUSY_PERCENT = 90


def _shared_lines(analysis: Analysis) -> list[str]:
    """Per shared GPU: its containers and how many wanted it, the memory headroom and
    the hog; then per container: its share of the turns, the deviation from an equal
    share, its recent growth and what HAMi promised it ("-": no sample, no limit)."""
    if not analysis.shared_gpus:
        return []
    shares = {(c.container, c.device.uuid): c for c in analysis.container_shares}
    limits = {(c.container, c.device.uuid): c for c in analysis.container_limits}
    used = {
        (c.container, c.device.uuid): c.memory_used_bytes for c in analysis.attribution.containers
    }
    lines = [
        "",
        "SHARED GPUS (SM-TIME SHARE: part of the turns; HEADROOM: what the next allocation gets)",
    ]
    lines += _table(
        ["GPU", "CONTAINERS", "ACTIVE", "HEADROOM GiB", "HOG"],
        (
            [
                g.device.gpu,
                g.containers,
                g.active_containers,
                _gib(g.memory_headroom_bytes),
                _hog(g, analysis),
            ]
            for g in _by_index(analysis.shared_gpus)
        ),
    )
    rows = []
    for gpu in _by_index(analysis.shared_gpus):
        uuid = gpu.device.uuid
        for key in sorted(k for k in shares.keys() | limits.keys() if k[1] == uuid):
            share, limit = shares.get(key), limits.get(key)
            rows.append(
                [
                    gpu.device.gpu,
                    *_names(key[0]),
                    _pct(share.sm_time_share if share else None),
                    _signed_pct(share.fair_share_deviation if share else None),
                    _gib(used[key]) if key in used else None,
                    _gib(share.memory_growth_bytes) if share else None,
                    _gib(limit.memory_limit_bytes) if limit and limit.memory_limit_bytes else None,
                    _pct(limit.sm_limit_ratio if limit else None),
                ]
            )
    lines += [""]
    lines += _table(
        [
            "GPU",
            "NAMESPACE",
            "POD",
            "CONTAINER",
            "SM-TIME SHARE",
            "VS EQUAL",
            "MEM GiB",
            "GROWTH GiB",
            "HAMI MEM GiB",
            "HAMI SM",
        ],
        rows,
    )
    return lines


def _hog(gpu: SharedGpu, analysis: Analysis) -> str | None:
    """The container over ``HOG_SHARE`` of the turns, with its share; None: no hog."""
    busy = {g.uuid: g.utilization_gpu_percent for g in analysis.node.nvml.gpus}.get(
        gpu.device.uuid or ""
    )
    if gpu.active_containers < 2 or busy is None or busy <= HOG_BUSY_PERCENT:
        return None
    for c in analysis.container_shares:
        if c.device.uuid == gpu.device.uuid and (c.sm_time_share or 0.0) > HOG_SHARE:
            ref = c.container
            return f"{ref.namespace}/{ref.pod}/{ref.container} {_pct(c.sm_time_share)}"
    return None


def _by_index(gpus: Iterable[SharedGpu]) -> list[SharedGpu]:
    return sorted(gpus, key=lambda g: (g.device.gpu is None, g.device.gpu or 0))


def _signed_pct(ratio: float | None) -> str | None:
    return None if ratio is None else f"{round(ratio * 100) or 0:+d}%"  # never "-0%"


def _xid_lines(analysis: Analysis) -> list[str]:
    lines: list[str] = []
    for title, counts in (
        ("XID ERRORS SINCE START", analysis.xid_counts),
        ("XID ERRORS BEFORE START (kernel log)", analysis.xid_counts_before_start),
    ):
        if counts:
            lines += ["", title]
            lines += _table(
                ["GPU", "XID", "CLASS", "COUNT"],
                (
                    [_xid_gpu(x), x.xid, x.severity, x.count]
                    for x in sorted(counts, key=lambda x: (str(x.gpu), x.xid, x.severity))
                ),
            )
    return lines


def _xid_gpu(count: XidCount) -> object:
    """The GPU's index; for a kernel-log XID of a device NVML did not list (lost before
    the exporter started), the PCI address the log named; else "unknown"."""
    if count.gpu is not None:
        return count.gpu
    if count.pci_bus_ids:
        return ",".join(f"PCI:{bus}" for bus in count.pci_bus_ids)
    return "unknown"


def _capacity_lines(analysis: Analysis) -> list[str]:
    if not analysis.capacity:
        return []
    return [
        "",
        "NODE CAPACITY",
        *_table(
            [
                "RESOURCE",
                "ADVERTISED",
                "HEALTHY",
                "UNHEALTHY",
                "UNKNOWN",
                "ALLOCATED",
                "ALLOCATABLE",
            ],
            (  # "-": the count's source is down (docs/health.md)
                [
                    c.resource,
                    c.advertised,
                    c.healthy,
                    c.unhealthy,
                    c.unknown,
                    c.allocated,
                    c.allocatable,
                ]
                for c in analysis.capacity
            ),
        ),
    ]


def _orphan_lines(analysis: Analysis) -> list[str]:
    orphans, holders = analysis.orphans, analysis.orphan_holders
    if not orphans:
        return []
    lines = ["", "ORPHANED GPU MEMORY"]
    lines += _table(
        ["GPU", "KIND", "MEM GiB", "PROCS"],
        ([o.gpu, o.kind, _gib(o.memory_used_bytes), o.processes] for o in orphans),
    )
    held = [h.gpu for h in analysis.driver_held if h.only_drivers]
    if held:
        lines.append(
            "driver-held (no process holds the device; reset the GPU): GPU "
            + ", ".join(str(g) for g in held)
        )
    if holders:
        lines += ["", "HOLDERS OF ORPHANED MEMORY (open device files)"]
        lines += _table(
            ["GPU", "PID", "COMM", "NAMESPACE", "POD", "CONTAINER", "ROLE"],
            ([h.gpu, h.pid, h.comm, h.namespace, h.pod, h.container, h.role] for h in holders),
        )
    return lines


def _jsonable(value: Any) -> Any:
    """Dataclasses as objects; the container and device references a row carries are
    spelled out as its own namespace/pod/container and gpu/uuid/mig_uuid fields."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out: dict[str, Any] = {}
        for f in dataclasses.fields(value):
            item = getattr(value, f.name)
            if isinstance(item, ContainerRef | DeviceRef):
                out.update(_jsonable(item))
            else:
                out[f.name] = _jsonable(item)
        return out
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, frozenset, set)):
        return [_jsonable(v) for v in value]
    return value


def render_json(analysis: Analysis) -> str:
    data = _jsonable(analysis)
    # an unknown verdict is neither healthy nor unhealthy: null
    data["health"] = [
        {**_jsonable(h), "healthy": None if h.unknown else h.healthy} for h in analysis.health
    ]
    return json.dumps(data, indent=2, sort_keys=True) + "\n"


def _names(ref: ContainerRef) -> list[object]:
    return [ref.namespace, ref.pod, ref.container]


# The text snapshot's sections, in the order they print.
SECTIONS: tuple[Callable[[Analysis], list[str]], ...] = (
    _node_lines,
    _gpu_lines,
    _mig_lines,
    _pod_lines,
    _idle_lines,
    _leak_lines,
    _unowned_lines,
    _orphan_lines,
    _shared_lines,
    _xid_lines,
    _capacity_lines,
)
