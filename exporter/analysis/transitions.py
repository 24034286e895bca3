"""Health transitions (pure): which health facts changed since the last cycle.

The log, the Kubernetes Events and the node condition tell people about changes, not
states: a GPU that *became* lost, XIDs raised *since* the last cycle, zombie memory that
*appeared*. This module compares this cycle's findings with the facts the last cycle
carried and names each change once.

Absence of evidence changes nothing: while NVML is down no GPU becomes healthy, lost or
back; while PodResources is down no leak ends; while /proc is down no orphaned memory
clears. A fact without evidence this cycle is carried over as it was.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import replace

from exporter.analysis.orphans import SCANNED_KINDS
from exporter.model import (
    KIND_DEAD_PROCESS,
    KIND_DELETED_POD,
    KIND_STUCK_PROCESS,
    OWNER_DEAD,
    ROLE_HOLDER,
    Analysis,
    ContainerRef,
    HealthFacts,
    HealthTransition,
    OrphanHolder,
    OrphanKind,
    PodRef,
    SourceStatus,
    placeholder_uuid,
)

FATAL = "fatal"
LOST = "gpu_lost"
UNHEALTHY = "unhealthy"
UNKNOWN = "unknown"
# Processes named behind one orphaned-memory transition (an Event note has 1 KiB).
MAX_HOLDERS_NAMED = 8


def health_transitions(
    analysis: Analysis, previous: HealthFacts
) -> tuple[tuple[HealthTransition, ...], HealthFacts]:
    """The changes between ``previous`` and ``analysis``, and the facts to carry on."""
    pods = _PodIndex(analysis)
    up = _sources_up(analysis.node.sources)
    nvml_ok = analysis.node.nvml.ok
    out: list[HealthTransition] = []
    xid_out, xid_counts = _fatal_xids(analysis, previous, pods)
    gpu_out, unhealthy, places = _verdicts(analysis, previous, pods)
    leak_out, leaks = _leaks(analysis, previous, pods, judged=nvml_ok and up.get("podresources"))
    orphan_out, orphans, waiting = _orphans(analysis, previous, judged=nvml_ok and up.get("procfs"))
    source_out, sources_up = _sources(analysis.node.sources, previous.sources_up)
    out.extend((*source_out, *gpu_out, *xid_out, *leak_out, *orphan_out))
    facts = HealthFacts(
        xid_counts=xid_counts,
        unhealthy=unhealthy,
        places=places,
        leaks=leaks,
        orphans=orphans,
        orphans_waiting=waiting,
        sources_up=sources_up,
    )
    return tuple(out), facts


class _PodIndex:
    """Which pods hold an allocation on a GPU or MIG instance, with their UIDs."""

    def __init__(self, analysis: Analysis) -> None:
        uids: dict[tuple[str, str], str] = {}
        meta = analysis.node.pod_meta
        for process in analysis.attribution.processes:
            if process.namespace and process.pod and process.pod_uid:
                uids[(process.namespace, process.pod)] = process.pod_uid
        if meta is not None:
            for pod in meta.pods:  # the API's UID: a mirror pod's Events are about it
                uids[(pod.namespace, pod.name)] = pod.api_uid or pod.uid
        self._uids = uids
        self._allocations = analysis.attribution.allocations
        self._migs = {
            (gpu.uuid, mig.gpu_instance_id, mig.compute_instance_id): mig.uuid
            for gpu in analysis.node.nvml.gpus
            for mig in gpu.mig_instances
        }

    def ref(self, container: ContainerRef) -> PodRef:
        key = (container.namespace, container.pod)
        return PodRef(container.namespace, container.pod, self._uids.get(key))

    def mig_uuid(
        self, uuid: str | None, gpu_instance_id: int | None, compute_instance_id: int | None
    ) -> str | None:
        """The MIG device an XID names; None when no single one matches (a GPU instance
        split into several compute instances, and the XID names none of them)."""
        if uuid is None or gpu_instance_id is None:
            return None
        found = {
            mig
            for (gpu, gi, ci), mig in self._migs.items()
            if gpu == uuid and gi == gpu_instance_id and compute_instance_id in (None, ci)
        }
        return found.pop() if len(found) == 1 else None

    def holding(self, uuid: str | None, mig_uuid: str | None = None) -> tuple[PodRef, ...]:
        """Pods allocated the GPU ``uuid`` (any of its MIG instances), or only the MIG
        instance ``mig_uuid`` when one is named."""
        if uuid is None:
            return ()
        return tuple(
            sorted(
                {
                    self.ref(a.container)
                    for a in self._allocations
                    if a.device.uuid == uuid
                    and (mig_uuid is None or a.device.mig_uuid in (None, mig_uuid))
                }
            )
        )


def _sources_up(statuses: Iterable[SourceStatus]) -> dict[str, bool]:
    return {s.name: s.up for s in statuses}


def _fatal_xids(
    analysis: Analysis, previous: HealthFacts, pods: _PodIndex
) -> tuple[list[HealthTransition], dict[tuple[object, ...], int]]:
    """Fatal-class XIDs counted since the last cycle, one transition per GPU (or MIG
    instance) and code with how many there were."""
    out: list[HealthTransition] = []
    counts: dict[tuple[object, ...], int] = {}
    for c in analysis.xid_counts:
        key = (c.gpu, c.uuid, c.xid, c.severity, c.gpu_instance_id, c.compute_instance_id)
        counts[key] = c.count
        new = c.count - previous.xid_counts.get(key, 0)
        if c.severity != FATAL or new <= 0:
            continue
        mig_uuid = pods.mig_uuid(c.uuid, c.gpu_instance_id, c.compute_instance_id)
        out.append(
            HealthTransition(
                "fatal_xid",
                gpu=c.gpu,
                uuid=c.uuid,
                mig_uuid=mig_uuid,
                gpu_instance_id=c.gpu_instance_id,
                xid=c.xid,
                xid_class=c.severity,
                count=new,
                # an XID on a MIG instance we cannot map concerns every pod on the GPU
                pods=pods.holding(c.uuid, mig_uuid),
            )
        )
    return out, counts


def _verdicts(
    analysis: Analysis, previous: HealthFacts, pods: _PodIndex
) -> tuple[list[HealthTransition], dict[str, frozenset[str]], dict[str, int]]:
    """Lost, back, unhealthy and healthy again, from the verdicts NVML gave evidence for.
    A GPU without a verdict this cycle (NVML down, not listed) keeps its last facts, and
    so do GPUs that share a UUID (a broken driver or a hostile library): facts are kept
    per UUID, and two verdicts under one would flip them every cycle.

    A GPU whose reading failed without hardware evidence (a reason of severity unknown)
    clears nothing: its facts stay as they were, and only a reason it gained with
    evidence is told. Facts learned while a GPU's UUID could not be read (under its
    placeholder) are its own once the UUID is read, so its return clears them.

    A fact kept for a UUID NVML no longer lists is dropped when the place (index) it was
    last listed at now answers, readably, with another UUID: hardware evidence that the
    GPU is gone from there (replaced). A GPU merely missing from the listing keeps it."""
    out: list[HealthTransition] = []
    facts = dict(previous.unhealthy)
    seen = Counter(h.uuid for h in analysis.health)
    for health in analysis.health:
        if seen[health.uuid] > 1:
            continue  # two GPUs answering with one UUID: no fact about either can hold
        placeholder = placeholder_uuid(health.gpu)
        if health.uuid != placeholder and placeholder in facts:
            facts[health.uuid] = facts.get(health.uuid, frozenset()) | facts.pop(placeholder)
        bad = tuple(r for r in health.reasons if r.severity == UNHEALTHY)
        names = frozenset(r.reason for r in bad)
        before = facts.get(health.uuid, frozenset())
        if any(r.severity == UNKNOWN for r in health.reasons):
            names |= before  # no evidence that any of them ended
        gpu, uuid = health.gpu, health.uuid
        if LOST in names and LOST not in before:
            detail = next(r.detail for r in bad if r.reason == LOST)
            holding = pods.holding(uuid)
            out.append(
                HealthTransition("gpu_lost", gpu, uuid, reasons=bad, pods=holding, detail=detail)
            )
        if LOST in before and LOST not in names:
            out.append(HealthTransition("gpu_back", gpu, uuid, reasons=bad))
        if names - before - {LOST}:
            holding = pods.holding(uuid)
            out.append(HealthTransition("gpu_unhealthy", gpu, uuid, reasons=bad, pods=holding))
        if before and not names:
            out.append(HealthTransition("gpu_healthy", gpu, uuid))
        if names:
            facts[health.uuid] = names
        else:
            facts.pop(health.uuid, None)
    places = {u: i for u, i in previous.places.items() if u in facts}
    for health in analysis.health:
        if seen[health.uuid] == 1 and health.uuid in facts:
            places[health.uuid] = health.gpu
    answering = {
        h.gpu: h.uuid
        for h in analysis.health
        if seen[h.uuid] == 1
        and h.uuid != placeholder_uuid(h.gpu)
        and not any(r.severity == UNKNOWN for r in h.reasons)
    }
    for uuid in [u for u in facts if u not in seen]:
        place = places.get(uuid)
        if place is not None and answering.get(place, uuid) != uuid:
            facts.pop(uuid)  # another GPU answers at its place: this one was replaced
            places.pop(uuid, None)
    return out, facts, places


def _leaks(
    analysis: Analysis, previous: HealthFacts, pods: _PodIndex, *, judged: bool | None
) -> tuple[list[HealthTransition], frozenset[tuple[ContainerRef, str | None, str | None]]]:
    """New isolation leaks. One ends only when NVML and PodResources both say so."""
    out: list[HealthTransition] = []
    now = {
        (u.container, u.device.uuid, u.device.mig_uuid): u
        for u in analysis.attribution.unallocated_use
    }
    for key, use in sorted(now.items(), key=lambda kv: (kv[0][0], kv[0][1] or "", kv[0][2] or "")):
        if key in previous.leaks:
            continue
        out.append(
            HealthTransition(
                "isolation_leak",
                gpu=use.device.gpu,
                uuid=use.device.uuid,
                mig_uuid=use.device.mig_uuid,
                pods=(pods.ref(use.container),),
                container=use.container,
                memory_bytes=use.memory_used_bytes,
            )
        )
    # a leak whose allocation is unknown this cycle (the kubelet does not list the
    # container now, e.g. just restarted) is carried: unknown neither raises nor ends one
    unknown = {
        (ContainerRef(p.namespace, p.pod, p.container), p.uuid, p.mig_uuid)
        for p in analysis.attribution.processes
        if p.allocated is None and p.namespace and p.pod and p.container
    }
    keys = frozenset(now) | (previous.leaks & unknown)
    return out, keys if judged else keys | previous.leaks


def _orphans(
    analysis: Analysis, previous: HealthFacts, *, judged: bool | None
) -> tuple[
    list[HealthTransition], frozenset[tuple[str, OrphanKind]], frozenset[tuple[str, OrphanKind]]
]:
    """Orphaned memory that appeared, and (with NVML and /proc up) that cleared; and the
    findings held back this cycle.

    Dead-process and unattributed memory is named a cycle late when need be: its holders
    come from the holder scan that this cycle's finding asks for, and an Event that says
    who holds the memory is worth one interval's wait. A finding waits once, and only
    for a GPU the scan was asked about and has not covered yet: a scan that does not
    come (its source failed) must not hold the Event back for good."""
    out: list[HealthTransition] = []
    now = {(o.uuid, o.kind): o for o in analysis.orphans}
    unscanned = _awaiting_scan(analysis)
    waiting: set[tuple[str, OrphanKind]] = set()
    for key, orphan in sorted(now.items()):
        if key in previous.orphans:
            continue
        held = _holders(analysis, orphan.uuid, orphan.kind)
        if (
            not held
            and orphan.kind in SCANNED_KINDS
            and orphan.uuid in unscanned
            and key not in previous.orphans_waiting
        ):
            waiting.add(key)
            continue
        out.append(
            HealthTransition(
                "orphaned_memory",
                gpu=orphan.gpu,
                uuid=orphan.uuid,
                memory_bytes=orphan.memory_used_bytes,
                orphan_kind=orphan.kind,
                count=orphan.processes,
                holders=held,
                dead_pids=_dead_pids(analysis, orphan.uuid, orphan.kind),
                holders_scanned=orphan.kind not in SCANNED_KINDS or _scanned(analysis, orphan.uuid),
            )
        )
    keys = frozenset(now) - waiting
    held_back = frozenset(waiting)
    if not judged:
        return out, keys | previous.orphans, held_back
    gpus = {g.uuid: g.index for g in analysis.node.nvml.gpus}
    for uuid, kind in sorted(previous.orphans - frozenset(now)):
        out.append(
            HealthTransition(
                "orphaned_memory_cleared", gpu=gpus.get(uuid), uuid=uuid, orphan_kind=kind
            )
        )
    return out, keys, held_back


def _scanned(analysis: Analysis, uuid: str) -> bool:
    """Whether the holder scan shown covered ``uuid`` completely (every pid's fd table
    read), so that finding nobody holding it is evidence, not a walk that never got there."""
    scan = analysis.node.holder_scan
    return scan is not None and scan.complete and any(u == uuid for _, u, _ in scan.gpus)


def _awaiting_scan(analysis: Analysis) -> frozenset[str]:
    """GPUs this cycle asks the holder scan about that the scan shown has not covered."""
    request = analysis.holder_request
    if request is None:
        return frozenset()
    scan = analysis.node.holder_scan
    covered = {uuid for _, uuid, _ in scan.gpus} if scan is not None else set()
    return frozenset(uuid for _, uuid, _ in request.gpus if uuid not in covered)


def _holders(analysis: Analysis, uuid: str, kind: OrphanKind) -> tuple[OrphanHolder, ...]:
    """Who holds orphaned memory: for dead-process and unattributed memory, the live
    processes the holder scan found with the device open (a dead pid holds nothing: its
    context lives on through whoever still has the device file); else the listed
    processes behind it (a stuck one, a deleted pod's)."""
    if kind in SCANNED_KINDS:
        return tuple(h for h in analysis.orphan_holders if h.uuid == uuid)
    owners = {
        KIND_DELETED_POD: ("pod",),
        KIND_STUCK_PROCESS: ("pod", "host", "unknown"),
    }
    return tuple(
        OrphanHolder(p.gpu, p.uuid, p.pid, p.namespace, p.pod, p.container, None, ROLE_HOLDER)
        for p in analysis.attribution.processes
        if p.uuid == uuid and p.owner in owners.get(kind, ())
    )[:MAX_HOLDERS_NAMED]


def _dead_pids(analysis: Analysis, uuid: str, kind: OrphanKind) -> tuple[int, ...]:
    """The dead pids NVML lists behind dead-process memory, lowest first."""
    if kind != KIND_DEAD_PROCESS:
        return ()
    pids = {
        p.pid for p in analysis.attribution.processes if p.uuid == uuid and p.owner == OWNER_DEAD
    }
    return tuple(sorted(pids))[:MAX_HOLDERS_NAMED]


def _sources(
    statuses: Iterable[SourceStatus], previous: Mapping[str, bool]
) -> tuple[list[HealthTransition], dict[str, bool]]:
    """A source going down (also at start) or coming back; one missing from this
    cycle's statuses keeps its last state."""
    out: list[HealthTransition] = []
    up = dict(previous)
    for status in statuses:
        before = previous.get(status.name)
        if not status.up and before is not False:
            out.append(
                HealthTransition("source_down", source=status.name, detail=status.error or "")
            )
        elif status.up and before is False:
            out.append(HealthTransition("source_up", source=status.name))
        up[status.name] = status.up
    return out, up


def with_transitions(analysis: Analysis, previous: HealthFacts) -> tuple[Analysis, HealthFacts]:
    transitions, facts = health_transitions(analysis, previous)
    listed = {h.uuid for h in analysis.health}
    unlisted = tuple(
        (uuid, tuple(sorted(reasons)))
        for uuid, reasons in sorted(facts.unhealthy.items())
        if uuid not in listed
    )
    if not analysis.node.nvml.ok:
        unlisted = ()  # nothing is listed: the condition is left alone anyway
    return replace(analysis, transitions=transitions, unlisted_unhealthy=unlisted), facts
