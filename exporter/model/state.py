"""What analysis carries from one cycle to the next (the agent keeps it, opaque)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from exporter.model.fast_init import fast_init
from exporter.model.findings import AllocationLedger, ContainerEnergy, ContainerRef
from exporter.model.readings import CgroupStats
from exporter.model.vocabulary import OrphanKind


@dataclass(frozen=True, slots=True)
class Streak:
    """A condition seen in ``cycles`` consecutive cycles, the first at ``since``."""

    cycles: int
    since: float


@fast_init
@dataclass(frozen=True, slots=True)
class PodName:
    namespace: str
    name: str


@dataclass(frozen=True, slots=True)
class OrphanState:
    """What orphan analysis carries from one cycle to the next.

    Every mapping is keyed by what it is about and rebuilt every cycle from what is
    still current (never mutated), so the state stays as small as the set of GPU
    processes.
    """

    first_seen: Mapping[tuple[str, OrphanKind], float] = field(default_factory=dict)
    """(GPU uuid, kind) -> when the orphaned memory was first seen."""
    unattributed: Mapping[str, Streak] = field(default_factory=dict)
    """GPU uuid -> cycles its unaccounted memory has stayed above the threshold."""
    stuck: Mapping[int, Streak] = field(default_factory=dict)
    """pid -> cycles it has been in state D or Z."""
    dead: Mapping[int, Streak] = field(default_factory=dict)
    """pid -> cycles NVML has listed it with no /proc entry."""
    pod_missing_since: Mapping[str, float] = field(default_factory=dict)
    """pod uid -> when (monotonic clock) its pod was first seen gone."""
    pod_terminating_since: Mapping[str, tuple[float, float, int | None]] = field(
        default_factory=dict
    )
    """pod uid -> (its deletionTimestamp, when (monotonic clock) it was first seen so, its
    deletionGracePeriodSeconds as last seen): kept while the watch cannot say."""
    pod_names: Mapping[str, PodName] = field(default_factory=dict)
    """pod uid -> its name, learned while it could be named."""
    pod_uids: Mapping[int, str] = field(default_factory=dict)
    """pid -> its pod's uid, for a live listed process: kept for a cycle whose /proc read
    failed, which says nothing of whose a process is."""
    pid_gpus: Mapping[int, frozenset[str]] = field(default_factory=dict)
    """pid -> the GPUs (uuid) it was last listed on, for the pids followed above: a pid
    not listed while one of them could not list its processes is kept, not dropped."""
    pods_gone_per_watch: frozenset[str] = frozenset()
    """pod uids judged gone while the pod watch could say (a uid is never reused): the
    verdict stays while the watch cannot say, whatever the kubelet lists by name."""


@dataclass(frozen=True, slots=True)
class HealthFacts:
    """What the last cycle knew, for the next cycle's transitions.

    A fact whose evidence is missing this cycle (NVML down, a GPU not listed) is carried
    over unchanged: absence of evidence neither raises nor clears it.
    """

    xid_counts: Mapping[tuple[object, ...], int] = field(default_factory=dict)
    unhealthy: Mapping[str, frozenset[str]] = field(default_factory=dict)
    """GPU uuid -> names of the reasons that make it unhealthy (gpu_lost among them)."""
    places: Mapping[str, int] = field(default_factory=dict)
    """GPU uuid -> the index it was last listed at, for each uuid in ``unhealthy``: a fact
    is dropped once another UUID answers readably at its place (the GPU was replaced)."""
    leaks: frozenset[tuple[ContainerRef, str | None, str | None]] = frozenset()
    """(container, GPU uuid, MIG uuid) using a device it was not allocated."""
    orphans: frozenset[tuple[str, OrphanKind]] = frozenset()
    """(GPU uuid, kind) with orphaned memory."""
    orphans_waiting: frozenset[tuple[str, OrphanKind]] = frozenset()
    """(GPU uuid, kind) whose transition waited a cycle for the holder scan; it waits
    once."""
    sources_up: Mapping[str, bool] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class EnergyWindow:
    """A GPU's energy counter as last read, and what its next delta is split by.

    NVML's energy counter is read in the slow tier (it costs ~3 ms a read on an H200), so
    one delta spans many cycles. Each cycle since the read adds, per holder, its share of
    that cycle's energy as estimated from power x step (``by_power``) and from step alone
    (``by_time``, used where a cycle's power was not read), and the whole cycle's estimate
    to ``power_total`` / ``elapsed_s``, whether it could be split or not: the next read's
    delta goes to each holder by its sum over the total, so a part that could not be
    split is not counted, as when the counter was read every cycle."""

    millijoules: int
    elapsed_s: float = 0.0
    power_total: float = 0.0  # mW x s
    power_known: bool = True  # every cycle since the read had a power reading
    by_power: Mapping[tuple[ContainerRef, str, str | None], float] = field(default_factory=dict)
    by_time: Mapping[tuple[ContainerRef, str, str | None], float] = field(default_factory=dict)
    cycles: int = 0  # cycles since the read
    last_shares: Mapping[tuple[ContainerRef, str, str | None], float] = field(
        default_factory=dict
    )  # the last cycle's split, used as such when the window is that one cycle


@dataclass(frozen=True, slots=True)
class LedgerState:
    """What the GPU-hour ledger carries from one cycle to the next: the running totals of
    the allocations that still exist (an allocation that disappears takes its counters
    with it) and each GPU's energy counter as last read with the split accumulated since
    (a GPU that did not report one, a gap or a cycle without a PodResources listing ends
    its window: the next read starts one, so a delta never spans a cycle nobody saw)."""

    allocations: tuple[AllocationLedger, ...] = ()
    energy: tuple[ContainerEnergy, ...] = ()
    energy_windows: Mapping[str, EnergyWindow] = field(default_factory=dict)
    advertised: Mapping[tuple[str, str | None], int] = field(default_factory=dict)
    """(GPU uuid, MIG uuid) -> replica ids the kubelet last advertised for that device:
    kept while GetAllocatableResources fails, so a weight does not change with it."""
    cgroup_readings: Mapping[tuple[str, str], CgroupStats] = field(default_factory=dict)
    """(pod UID, container id) -> its cgroup counters as last read, for the next cycle's
    why-idle window (analysis/why_idle.py); only the last cycle's, like energy readings,
    so a window never spans a cycle without a reading."""
    cgroup_timestamp: float | None = None
    """The monotonic time of ``cgroup_readings`` (None: none)."""
