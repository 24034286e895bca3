"""One cycle of analysis, composed (pure): snapshot + carried state -> Analysis + state.

The agent owns the schedule and the state object; this module owns the order:
DCGM-over-GPM -> attribution -> orphans -> XID ledger -> health -> capacity -> idle ->
why idle (cgroup windows) -> GPU-hour ledger, its idle time by cause, and energy split ->
shared GPUs and promised limits -> health transitions (what changed since last cycle).
Nothing here does I/O or reads a clock: time comes in as ``snapshot.timestamp``. The
one I/O step analysis asks for, the holder scan for orphaned memory, is a finding
(``Analysis.holder_request``) that the holder scan source answers in the next cycle's
snapshot; ``analyse`` is the single entry point.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from exporter.analysis.active_time import account_active_time
from exporter.analysis.allocation_evidence import HeldKey, ProcessKey, settled_pids
from exporter.analysis.attribution import attribute
from exporter.analysis.capacity import DEFAULT_TOLERATED_TAINT_KEYS, node_capacity
from exporter.analysis.cgroup_signals import cgroup_signals
from exporter.analysis.health import HealthPolicy, KnownFacts, assess, with_known_facts
from exporter.analysis.idle import IdlePolicy, account_idle
from exporter.analysis.ledger import account_ledger, listed
from exporter.analysis.limits import container_limits
from exporter.analysis.occupancy_source import occupancy_sources
from exporter.analysis.orphans import (
    OrphanPolicy,
    driver_held,
    find_orphans,
    holder_request,
    orphan_holders,
)
from exporter.analysis.owners import pod_owners
from exporter.analysis.sharing import MemoryHistory, SharingPolicy, analyse_sharing
from exporter.analysis.transitions import with_transitions
from exporter.analysis.why_idle import WhyIdlePolicy, causes, readings_by_key, why_idle
from exporter.analysis.xid import XidLedger, bus_id_map, xid_counts
from exporter.model import (
    ActiveTime,
    Analysis,
    DcgmSnapshot,
    GpuSample,
    HealthFacts,
    IdleAllocation,
    LedgerState,
    NodeSnapshot,
    OrphanState,
)


@dataclass(frozen=True)
class Policy:
    health: HealthPolicy = field(default_factory=HealthPolicy)
    idle: IdlePolicy = field(default_factory=IdlePolicy)
    orphans: OrphanPolicy = field(default_factory=OrphanPolicy)
    sharing: SharingPolicy = field(default_factory=SharingPolicy)
    why_idle: WhyIdlePolicy = field(default_factory=WhyIdlePolicy)
    # Node taint keys GPU pods are taken to tolerate (--capacity-tolerated-taints)
    tolerated_taint_keys: frozenset[str] = DEFAULT_TOLERATED_TAINT_KEYS


@dataclass(frozen=True)
class CarriedState:
    """What one cycle hands the next: counters and the time they were advanced to."""

    xids: XidLedger
    idle: tuple[IdleAllocation, ...] = ()
    ledger: LedgerState = field(default_factory=LedgerState)
    orphans: OrphanState = field(default_factory=OrphanState)
    memory: MemoryHistory = field(default_factory=MemoryHistory)
    health: HealthFacts = field(default_factory=HealthFacts)
    # GPU uuid -> DCGM health systems failing, as DCGM last said: carried while DCGM is
    # down (a host engine restarting is no verdict of healthy)
    dcgm_failures: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # GPU uuid -> health facts (ECC, row remapping, retired pages, recovery action) as
    # last read: a slow read that fails says nothing, so the verdict stands on these
    known_facts: Mapping[str, KnownFacts] = field(default_factory=dict)
    last_timestamp: float | None = None
    # (pid, pod UID, container id) -> PodResources refreshes begun when it was first
    # seen (analysis/allocation_evidence.py): a leak needs an answer begun after that
    first_seen: Mapping[ProcessKey, int] = field(default_factory=dict)
    # devices each pod process was seen allocated (Attribution.held): a later answer
    # without them is no evidence of a leak
    held: frozenset[HeldKey] = frozenset()
    active_time: ActiveTime = field(default_factory=ActiveTime)


def initial_state(policy: Policy, xid_overrides: dict[int, str]) -> CarriedState:
    retention = max(policy.health.xid_window_s, 3600.0)
    return CarriedState(xids=XidLedger(overrides=xid_overrides, retention_s=retention))


def analyse(
    snapshot: NodeSnapshot, state: CarriedState, policy: Policy
) -> tuple[Analysis, CarriedState]:
    now = snapshot.timestamp
    gpus = prefer_dcgm(snapshot.nvml.gpus, snapshot.dcgm)
    snapshot = replace(snapshot, nvml=replace(snapshot.nvml, gpus=gpus))
    settled, first_seen = settled_pids(snapshot, state.first_seen)
    attribution = attribute(snapshot, settled=settled, held_before=state.held)
    # Windows run on the monotonic clock: a wall-clock step must not end a fatal XID's
    # window early (a true fault cleared) or stretch it (a healthy GPU kept unhealthy).
    elapsed_now = snapshot.monotonic if snapshot.monotonic is not None else now
    orphans, orphan_state = find_orphans(
        snapshot, attribution, state.orphans, now=now, policy=policy.orphans, elapsed=elapsed_now
    )
    xid_events = (*snapshot.xid_events, *snapshot.kmsg_events)
    xids = state.xids.record(xid_events, elapsed_now, bus_id_map(gpus))
    failing = dcgm_failures(snapshot.dcgm, state.dcgm_failures)
    judged, known_facts = with_known_facts(gpus, state.known_facts, nvml_ok=snapshot.nvml.ok)
    health = assess(
        judged,
        recent_fatal_xids=xids.recent_fatal(elapsed_now - policy.health.xid_window_s),
        dcgm_failures=failing,
        policy=policy.health,
    )
    capacity = node_capacity(
        gpus,
        health,
        snapshot.pod_resources,
        attribution.allocations,
        snapshot.resource_slices,
        nvml_ok=snapshot.nvml.ok,
        unaccounted=attribution.unaccounted_gpus,
        dra_unreported=attribution.dra_unreported,
        scheduling=snapshot.node_scheduling,
        tolerated_taint_keys=policy.tolerated_taint_keys,
        taint_rules=snapshot.device_taint_rules,
    )
    elapsed, counted_to = elapsed_since(state.last_timestamp, elapsed_now, policy.idle)
    idle = account_idle(
        state.idle,
        attribution.allocations,
        attribution.containers,
        gpus,
        elapsed_s=elapsed,
        policy=policy.idle,
        listed=listed(snapshot.pod_resources),
    )
    signals = cgroup_signals(snapshot, attribution)
    reasons = why_idle(
        state.ledger.cgroup_readings,
        state.ledger.cgroup_timestamp,
        snapshot.cgroups,
        signals,
        policy.why_idle,
    )
    ledger = account_ledger(
        state.ledger,
        attribution.allocations,
        attribution.containers,
        gpus,
        health,
        snapshot.pod_resources,
        elapsed_s=elapsed,
        policy=policy.idle,
        causes=causes(reasons),
    )
    cgroup_readings = readings_by_key(snapshot.cgroups)
    ledger = replace(
        ledger,
        cgroup_readings=cgroup_readings,
        cgroup_timestamp=snapshot.cgroups.timestamp
        if snapshot.cgroups is not None and cgroup_readings
        else None,
    )
    shared, shares, memory = analyse_sharing(
        attribution.containers,
        attribution.allocations,
        gpus,
        state.memory,
        now=elapsed_now,  # its memory-growth window
        policy=policy.sharing,
    )
    active_time = account_active_time(state.active_time, gpus, attribution, now=elapsed_now)
    limits = container_limits(
        snapshot.pod_meta, attribution.containers, attribution.allocations, gpus
    )
    analysis = Analysis(
        node=snapshot,
        attribution=attribution,
        occupancy_sources=occupancy_sources(gpus, snapshot.dcgm),
        health=health,
        capacity=capacity,
        idle=idle,
        ledger=ledger.allocations,
        energy=ledger.energy,
        xid_counts=xid_counts(xids, xids.counts),
        xid_counts_before_start=xid_counts(xids, xids.counts_before_start),
        orphans=orphans,
        orphan_holders=orphan_holders(snapshot, orphans),
        driver_held=driver_held(orphans, snapshot.holder_scan),
        holder_request=holder_request(snapshot, orphans),
        shared_gpus=shared,
        container_shares=shares,
        container_limits=limits,
        pod_owners=pod_owners(snapshot.pod_meta, attribution, now=now),
        cgroup_signals=signals,
        why_idle=reasons,
        active_time=active_time,
    )
    analysis, health_facts = with_transitions(analysis, state.health)
    state = replace(
        state,
        xids=xids,
        idle=idle,
        ledger=ledger,
        orphans=orphan_state,
        memory=memory,
        health=health_facts,
        dcgm_failures=failing,
        known_facts=known_facts,
        last_timestamp=counted_to,
        first_seen=first_seen,
        held=attribution.held,
        active_time=active_time,
    )
    return analysis, state


def elapsed_since(last: float | None, now: float, policy: IdlePolicy) -> tuple[float, float]:
    """The time this cycle counts, and the time counted up to from now on.

    Time counters move only past the latest time already counted: a clock that steps
    back by less than ``max_gap_s`` adds nothing until it has caught up (so the stretch
    it repeats is not counted twice). One that steps back further was reset, as after a
    gap: nothing is counted and counting starts again from ``now``."""
    if last is None:
        return 0.0, now
    if now >= last or now < last - policy.max_gap_s:
        return now - last, now
    return 0.0, last


def prefer_dcgm(gpus: tuple[GpuSample, ...], dcgm: DcgmSnapshot | None) -> tuple[GpuSample, ...]:
    """Where DCGM profiles a GPU, its occupancy replaces GPM's (joined by UUID)."""
    if dcgm is None or not dcgm.ok or not dcgm.occupancy:
        return gpus
    by_uuid = dict(dcgm.occupancy)
    return tuple(
        replace(g, occupancy=by_uuid[g.uuid]) if g.uuid in by_uuid and not g.error else g
        for g in gpus
    )


def dcgm_failures(
    dcgm: DcgmSnapshot | None, previous: Mapping[str, tuple[str, ...]] | None = None
) -> dict[str, tuple[str, ...]]:
    """GPU UUID -> DCGM health systems that report failure. While DCGM is configured
    but down, what it said last (``previous``) stands: its silence is unknown, and a GPU
    failing a health system must not turn healthy because the host engine restarted."""
    if dcgm is None:
        return {}
    if not dcgm.ok:
        return dict(previous or {})
    out: dict[str, list[str]] = {}
    for incident in dcgm.incidents:
        if incident.health == "fail" and incident.gpu_uuid:
            out.setdefault(incident.gpu_uuid, []).append(incident.system)
    return {uuid: tuple(systems) for uuid, systems in out.items()}
