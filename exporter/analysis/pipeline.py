"""One cycle of analysis, composed (pure): snapshot + carried state -> Analysis + state.

The agent owns the schedule and the state object; this module owns the order:
DCGM-over-GPM -> attribution -> orphans -> XID ledger -> health -> capacity -> idle.
Nothing here does I/O or reads a clock: time comes in as ``snapshot.timestamp``. The
one I/O step analysis can ask for — the holder scan for orphaned memory — is requested
by ``holder_scan_needed`` and its result folded in by ``with_holder_scan``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from exporter.analysis.attribution import attribute
from exporter.analysis.capacity import node_capacity
from exporter.analysis.health import HealthPolicy, assess
from exporter.analysis.idle import IdlePolicy, account_idle
from exporter.analysis.orphans import (
    OrphanPolicy,
    ScanRequest,
    driver_held,
    find_orphans,
    gpus_needing_scan,
    orphan_holders,
    record_scan,
    scan_request,
)
from exporter.analysis.xid import XidLedger, bus_id_map
from exporter.model import (
    Analysis,
    DcgmSnapshot,
    GpuSample,
    HolderScan,
    IdleAllocation,
    NodeSnapshot,
    OrphanState,
    XidEvent,
)


@dataclass(frozen=True)
class Policy:
    health: HealthPolicy = field(default_factory=HealthPolicy)
    idle: IdlePolicy = field(default_factory=IdlePolicy)
    orphans: OrphanPolicy = field(default_factory=OrphanPolicy)
    holder_rescan_s: float = 60.0


@dataclass(frozen=True)
class CarriedState:
    """What one cycle hands the next: counters and the time they were advanced to."""

    xids: XidLedger
    idle: tuple[IdleAllocation, ...] = ()
    orphans: OrphanState = field(default_factory=OrphanState)
    last_timestamp: float | None = None


def initial_state(started_at: float, policy: Policy, xid_overrides: dict[int, str]) -> CarriedState:
    retention = max(policy.health.xid_window_s, 3600.0)
    return CarriedState(
        xids=XidLedger(started_at=started_at, overrides=xid_overrides, retention_s=retention)
    )


def analyse(
    snapshot: NodeSnapshot,
    state: CarriedState,
    xid_events: Sequence[XidEvent],
    policy: Policy,
) -> tuple[Analysis, CarriedState]:
    now = snapshot.timestamp
    gpus = prefer_dcgm(snapshot.nvml.gpus, snapshot.dcgm)
    snapshot = replace(snapshot, nvml=replace(snapshot.nvml, gpus=gpus))
    attribution = attribute(snapshot)
    orphans, orphan_state = find_orphans(
        snapshot, attribution, state.orphans, now=now, policy=policy.orphans
    )
    xids = state.xids.record(xid_events, now, bus_id_map(gpus))
    health = assess(
        gpus,
        recent_fatal_xids=xids.recent_fatal(now - policy.health.xid_window_s),
        dcgm_failures=dcgm_failures(snapshot.dcgm),
        policy=policy.health,
    )
    capacity = node_capacity(gpus, health, snapshot.pod_resources, attribution.allocations)
    elapsed = 0.0 if state.last_timestamp is None else now - state.last_timestamp
    idle = account_idle(
        state.idle,
        attribution.allocations,
        attribution.containers,
        gpus,
        elapsed_s=elapsed,
        policy=policy.idle,
    )
    analysis = Analysis(
        node=snapshot,
        attribution=attribution,
        health=health,
        capacity=capacity,
        idle=idle,
        xid_counts=tuple(xids.counts.items()),
        orphans=orphans,
    )
    state = replace(state, xids=xids, idle=idle, orphans=orphan_state, last_timestamp=now)
    return _with_holders(analysis, state), state


def holder_scan_needed(
    analysis: Analysis, state: CarriedState, policy: Policy
) -> ScanRequest | None:
    """Which GPUs' device files to look for, when unattributed memory needs a holder."""
    uuids = gpus_needing_scan(
        analysis.orphans, state.orphans, analysis.node.timestamp, rescan_s=policy.holder_rescan_s
    )
    return scan_request(analysis.node, uuids, state.orphans) if uuids else None


def with_holder_scan(
    analysis: Analysis, state: CarriedState, scan: HolderScan, request: ScanRequest
) -> tuple[Analysis, CarriedState]:
    orphan_state = record_scan(state.orphans, scan, request, now=analysis.node.timestamp)
    state = replace(state, orphans=orphan_state)
    return _with_holders(analysis, state), state


def _with_holders(analysis: Analysis, state: CarriedState) -> Analysis:
    return replace(
        analysis,
        orphan_holders=orphan_holders(analysis.node, analysis.orphans, state.orphans),
        driver_held=driver_held(analysis.orphans, state.orphans),
    )


def prefer_dcgm(gpus: tuple[GpuSample, ...], dcgm: DcgmSnapshot | None) -> tuple[GpuSample, ...]:
    """Where DCGM profiles a GPU, its occupancy replaces GPM's (joined by UUID)."""
    if dcgm is None or not dcgm.ok or not dcgm.occupancy:
        return gpus
    by_uuid = dict(dcgm.occupancy)
    return tuple(
        replace(g, occupancy=by_uuid[g.uuid]) if g.uuid in by_uuid and not g.error else g
        for g in gpus
    )


def dcgm_failures(dcgm: DcgmSnapshot | None) -> dict[str, list[str]]:
    """GPU UUID -> DCGM health systems that report failure."""
    out: dict[str, list[str]] = {}
    if dcgm is None or not dcgm.ok:
        return out
    for incident in dcgm.incidents:
        if incident.health == "fail" and incident.gpu_uuid:
            out.setdefault(incident.gpu_uuid, []).append(incident.system)
    return out
