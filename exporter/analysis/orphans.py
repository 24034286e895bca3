"""Orphaned GPU memory: memory that no running pod can free, by kind.

The kernel reclaims a dead process's RAM, but GPU memory is freed only when the driver
tears the CUDA context down, and a SIGKILL, a forced pod deletion or a process stuck in
the driver can keep that from happening. Each kind is a separate series because each
needs a different fix:

- ``dead_process``: NVML lists a pid that has no ``/proc`` entry for ``dead_cycles``
  cycles (killed, context left; one cycle can be an exit between the two reads);
- ``stuck_process``: a live pid in state D or Z for ``stuck_cycles`` cycles (a thread
  wedged in the driver; SIGKILL cannot help);
- ``deleted_pod``: a live pid whose pod the API and the kubelet no longer know, or
  that finished, for ``deleted_pod_grace_s``;
- ``unattributed``: device memory used beyond what all listed processes account for,
  above ``unattributed_threshold_bytes`` for ``unattributed_cycles`` cycles ("nvidia-smi
  shows no process but memory is full", e.g. a forked child keeping the device open).

A listed process counts in at most one kind (dead, then stuck, then deleted pod), so
kinds add up. Pure: the clock is ``now`` and memory between cycles is ``OrphanState``.

Time: the deleted-pod grace is a window, measured on the monotonic clock (``elapsed``)
from when a pod was first seen gone, so a wall-clock step neither cuts nor stretches it.
A terminating pod's graceful stop ends, for this judgement, its own grace period
(``deletionGracePeriodSeconds``; ``DEFAULT_TERMINATION_GRACE_S`` where the API gives none)
after this process first saw it terminating, on the same monotonic clock: never before
the API server's deadline (``deletionTimestamp`` = request time + that grace period,
and the request came no later than the first sight), and not moved by a step of the
node's clock or a wrong or absent ``Date`` from the server. It can be later than the
server's deadline by how late the pod was first seen (an exporter restarted during the
stop starts counting again).
Who keeps dead-process and unattributed memory alive is found by the holder scan
source: analysis asks for it (``holder_request``) and names what the scan it delivered
found (``orphan_holders``, ``driver_held``).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from exporter.model import (
    KIND_DEAD_PROCESS,
    KIND_DELETED_POD,
    KIND_STUCK_PROCESS,
    KIND_UNATTRIBUTED,
    ORPHAN_KINDS,
    OWNER_DEAD,
    OWNER_POD,
    ROLE_MANAGEMENT,
    AttributedProcess,
    Attribution,
    DriverHeld,
    GpuSample,
    HolderScan,
    HolderScanRequest,
    NodeSnapshot,
    OrphanedMemory,
    OrphanHolder,
    OrphanKind,
    OrphanState,
    PodMeta,
    PodMetaSnapshot,
    PodName,
    Streak,
)

STUCK_STATES: Final = frozenset({"D", "Z"})  # uninterruptible sleep; exited, not reaped
MIB: Final = 1024**2
# A terminating pod's grace period where its metadata gives none: the Pod spec's default
# terminationGracePeriodSeconds (https://kubernetes.io/docs/concepts/workloads/pods/
# pod-lifecycle/#pod-termination: "The default grace period is 30 seconds").
DEFAULT_TERMINATION_GRACE_S: Final = 30
# Kinds whose memory may be kept alive by a live process NVML does not list, through the
# device file it holds: a child forked after CUDA started, a process the fd was passed
# to. A dead pid's context lives on while anyone has its /dev/nvidia<N> open, and a
# driver may keep LISTING the dead pid meanwhile (an H200 on driver 580.159.04 did:
# docs/orphans.md), so both kinds are scanned. Stuck and deleted-pod processes are
# alive and listed: they hold their memory themselves.
SCANNED_KINDS: Final = frozenset({KIND_DEAD_PROCESS, KIND_UNATTRIBUTED})


@dataclass(frozen=True, slots=True)
class OrphanPolicy:
    """Thresholds; the defaults are argued in docs/orphans.md.

    256 MiB of unaccounted memory is below what one leaked CUDA context keeps (a few
    hundred MiB on current GPUs) and well above the driver's own unlisted bookkeeping
    (a few MiB per GPU or MIG instance). Three cycles outlast the skew between the
    memory and process reads. D and Z are normal for an instant (disk I/O, exit), so
    a process is stuck only after ``stuck_cycles`` cycles in them. 60 s after the
    pod's deletion deadline covers the kubelet's and the watch's lag.
    """

    unattributed_threshold_bytes: int = 256 * MIB
    unattributed_cycles: int = 3
    deleted_pod_grace_s: float = 60.0
    stuck_cycles: int = 3
    # A listed pid with no /proc entry in this many consecutive cycles: one cycle can be
    # a process that exited between the NVML listing and the /proc read.
    dead_cycles: int = 3
    # A pod in one of these phases has no running containers left, per the kubelet.
    terminal_phases: frozenset[str] = frozenset({"Succeeded", "Failed"})

    def __post_init__(self) -> None:
        if self.unattributed_threshold_bytes < 0:
            raise ValueError("unattributed_threshold_bytes must be >= 0")
        if min(self.unattributed_cycles, self.stuck_cycles, self.dead_cycles) < 1:
            raise ValueError("cycle counts must be >= 1")
        if self.deleted_pod_grace_s < 0:
            raise ValueError("deleted_pod_grace_s must be >= 0")


@dataclass(slots=True)
class _Acc:
    since: float  # earliest start of the condition among what it adds up
    memory: int | None = 0  # None once a process's memory is unknown
    processes: int = 0


@dataclass(slots=True)
class _Pods:
    """Where a pod UID stands this cycle; built once per call."""

    watch: Mapping[str, PodMeta] | None  # by uid; None: no usable pod watch
    kubelet: frozenset[tuple[str, str]] | None  # (namespace, pod); None: PodResources down
    names: dict[str, PodName] = field(default_factory=dict)  # by uid
    finished: frozenset[str] = frozenset()  # uids of pods in a terminal phase
    # (namespace, pod) of every pod the watch lists: a name listed under another uid
    # is a same-name replacement, whatever the kubelet says of the name
    watched_names: frozenset[tuple[str, str]] = frozenset()


def find_orphans(
    snapshot: NodeSnapshot,
    attribution: Attribution,
    state: OrphanState,
    *,
    now: float,
    policy: OrphanPolicy,
    elapsed: float | None = None,
) -> tuple[tuple[OrphanedMemory, ...], OrphanState]:
    """This cycle's orphaned memory per (GPU, kind), and the state for the next cycle.

    ``now`` is the node's wall clock (what ``first_seen`` is served on), ``elapsed`` the
    monotonic clock windows are measured on (None: ``now`` stands in for it).

    GPUs whose reading failed are skipped: their memory is unknowable until they answer
    again. A lost one's history is dropped (its reset frees its memory); another's is
    kept, not counted on, for when it answers. With NVML down nothing is reported and
    the state is kept as it was.
    """
    if not snapshot.nvml.ok:  # no data is not "cleared": keep every clock running
        return (), state
    healthy = {g.uuid: g for g in snapshot.nvml.gpus if g.error is None}
    rows = [row for row in attribution.processes if row.uuid in healthy]
    blind = _blind_gpus(snapshot)
    listed_on = _listed_on(rows)
    unread = _unread(listed_on, snapshot, state, blind)
    pod_uids = _pod_uids(rows, unread, state)
    pods = _pods(snapshot, attribution, state, policy.terminal_phases, pod_uids)
    stuck = _stuck_streaks(rows, snapshot, state, now, unread)
    dead = _dead_streaks(rows, state, now, unread)
    clock = _Clock(now=now, elapsed=now if elapsed is None else elapsed)
    missing, gone_per_watch = _missing_since(pod_uids, pods, state, clock.elapsed)
    terminating = _terminating_since(pod_uids, pods, state, clock.elapsed)

    found: dict[tuple[str, OrphanKind], _Acc] = {}
    pod_clocks = _PodClocks(missing, terminating)
    for row in rows:
        judged = _kind(row, pod_uids.get(row.pid), stuck, dead, pod_clocks, pods, clock, policy)
        if judged is not None:
            kind, since = judged
            acc = found.setdefault((row.uuid, kind), _Acc(since))
            acc.since = min(acc.since, since)
            if acc.memory is not None and row.memory_used_bytes is not None:
                acc.memory += row.memory_used_bytes
            else:
                acc.memory = None
            acc.processes += 1

    streaks = _unattributed_streaks(healthy.values(), rows, state, now, policy)
    for uuid, (streak, excess) in streaks.items():
        if streak.cycles >= policy.unattributed_cycles:
            found[(uuid, KIND_UNATTRIBUTED)] = _Acc(streak.since, memory=excess)

    # A condition dates from when it was first observed, confirmation windows (cycles,
    # grace) included, so an alert's "for 10m" measures the condition itself.
    started = state.first_seen
    orphans = tuple(
        sorted(
            (
                OrphanedMemory(
                    gpu=healthy[uuid].index,
                    uuid=uuid,
                    kind=kind,
                    memory_used_bytes=acc.memory,
                    processes=acc.processes,
                    first_seen=started.get((uuid, kind), acc.since),
                )
                for (uuid, kind), acc in found.items()
            ),
            key=lambda o: (o.gpu, ORPHAN_KINDS.index(o.kind)),
        )
    )
    # what a GPU that could not list its processes had is kept for when it can
    next_state = OrphanState(
        first_seen={(o.uuid, o.kind): o.first_seen for o in orphans}
        | {key: seen for key, seen in state.first_seen.items() if key[0] in blind},
        unattributed={uuid: streak for uuid, (streak, _) in streaks.items()}
        | {uuid: streak for uuid, streak in state.unattributed.items() if uuid in blind},
        stuck=stuck,
        dead=dead,
        pod_missing_since=missing,
        pod_terminating_since=terminating,
        pod_names=pods.names,
        pod_uids=pod_uids,
        pid_gpus=_pid_gpus(listed_on, dead.keys() | stuck.keys() | pod_uids.keys(), state),
        pods_gone_per_watch=gone_per_watch,
    )
    return orphans, next_state


# ---------------------------------------------------------------------------
# Listed processes: dead, stuck, deleted pod
# ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Clock:
    """One cycle's time on the two clocks orphans are judged by."""

    now: float  # the node's wall clock: what first_seen is served on
    elapsed: float  # the monotonic clock: windows and deadlines


@dataclass(frozen=True, slots=True)
class _PodClocks:
    """Since when (monotonic) each live GPU process's pod has been gone, or terminating."""

    missing: Mapping[str, float]
    terminating: Mapping[
        str, tuple[float, float, int | None]
    ]  # (deletionTimestamp, first seen, grace)


def _kind(
    row: AttributedProcess,
    pod_uid: str | None,
    stuck: Mapping[int, Streak],
    dead: Mapping[int, Streak],
    since: _PodClocks,
    pods: _Pods,
    clock: _Clock,
    policy: OrphanPolicy,
) -> tuple[OrphanKind, float] | None:
    """The one kind a listed process counts in, if any, and since when it has applied.

    A process stuck long enough outranks its deleted pod (killing it will not work);
    one only briefly in D stays in its deleted-pod series, whose age must not reset.
    A process /proc said nothing of this cycle is judged as it was last read.
    """
    streak = dead.get(row.pid)  # no /proc entry now, or none when last read
    if streak is not None:
        if streak.cycles < policy.dead_cycles:
            return None  # it may have exited between the NVML listing and the /proc read
        return KIND_DEAD_PROCESS, streak.since
    streak = stuck.get(row.pid)
    if streak is not None and streak.cycles >= policy.stuck_cycles:
        return KIND_STUCK_PROCESS, streak.since
    if pod_uid is not None:
        gone_for = _pod_gone_for(pod_uid, since, pods, clock)
        if gone_for is not None and gone_for >= policy.deleted_pod_grace_s:
            return KIND_DELETED_POD, clock.now - gone_for  # on the node's wall clock
    return None


def _blind_gpus(snapshot: NodeSnapshot) -> frozenset[str]:
    """GPUs that could not list their processes this cycle (the reading failed, or one
    of its listings did), without NVML saying they are lost: a lost GPU's reset frees
    its memory, so nothing of it is kept."""
    return frozenset(
        g.uuid
        for g in snapshot.nvml.gpus
        if not g.lost and (g.error is not None or not g.processes_listed)
    )


def _listed_on(rows: Iterable[AttributedProcess]) -> dict[int, frozenset[str]]:
    """pid -> the GPUs (uuid) NVML lists it on this cycle."""
    on: dict[int, set[str]] = defaultdict(set)
    for row in rows:
        on[row.pid].add(row.uuid)
    return {pid: frozenset(gpus) for pid, gpus in on.items()}


def _unread(
    listed_on: Mapping[int, frozenset[str]],
    snapshot: NodeSnapshot,
    state: OrphanState,
    blind: frozenset[str],
) -> frozenset[int]:
    """Pids this cycle says nothing of: listed, but /proc said nothing of them (procfs
    unreadable); and, not listed now, last listed on a GPU that could not list its
    processes this cycle. Neither dead nor alive: their streaks and pods are kept as
    they were, not counted on: a pid listed on none of the GPUs it was last listed on
    is taken for another process (a reused pid), and nothing of it is kept."""
    read = {p.pid for p in snapshot.processes}
    unread = {
        pid
        for pid, gpus in listed_on.items()
        if pid not in read and (pid not in state.pid_gpus or gpus & state.pid_gpus[pid])
    }
    if blind:
        unread |= {
            pid for pid, gpus in state.pid_gpus.items() if pid not in listed_on and gpus & blind
        }
    return frozenset(unread)


def _pid_gpus(
    listed_on: Mapping[int, frozenset[str]], followed: Iterable[int], state: OrphanState
) -> dict[int, frozenset[str]]:
    """The GPUs each followed pid was last listed on: this cycle's, else as kept."""
    gpus: dict[int, frozenset[str]] = {}
    for pid in followed:
        if pid in listed_on:
            gpus[pid] = listed_on[pid]
        elif pid in state.pid_gpus:
            gpus[pid] = state.pid_gpus[pid]
    return gpus


def _pod_uids(
    rows: Iterable[AttributedProcess], unread: frozenset[int], state: OrphanState
) -> dict[int, str]:
    """pid -> pod uid of each live listed process, the unread ones' as last read."""
    uids = {pid: state.pod_uids[pid] for pid in unread if pid in state.pod_uids}
    for row in rows:
        if row.pod_uid is not None and row.owner != OWNER_DEAD:
            uids[row.pid] = row.pod_uid
    return uids


def _dead_streaks(
    rows: Iterable[AttributedProcess], state: OrphanState, now: float, unread: frozenset[int]
) -> dict[int, Streak]:
    """How long each listed pid has had no /proc entry (cycles, and since when)."""
    dead = {row.pid for row in rows if row.owner == OWNER_DEAD}
    return _streaks(dead, state.dead, now) | _kept(unread, state.dead)


def _stuck_streaks(
    rows: Iterable[AttributedProcess],
    snapshot: NodeSnapshot,
    state: OrphanState,
    now: float,
    unread: frozenset[int],
) -> dict[int, Streak]:
    """How long each live listed pid has been in D or Z."""
    states = {p.pid: p.state for p in snapshot.processes if p.alive}
    listed = {row.pid for row in rows if row.owner != OWNER_DEAD}
    stuck = {pid for pid in listed if states.get(pid) in STUCK_STATES}
    return _streaks(stuck, state.stuck, now) | _kept(unread, state.stuck)


def _kept(pids: Iterable[int], previous: Mapping[int, Streak]) -> dict[int, Streak]:
    """The streaks of ``pids`` unchanged: a cycle that could not tell neither ends nor
    extends them."""
    return {pid: previous[pid] for pid in pids if pid in previous}


def _streaks(pids: Iterable[int], previous: Mapping[int, Streak], now: float) -> dict[int, Streak]:
    """One more cycle for each of ``pids``, from ``previous`` (a new one starts at ``now``);
    a pid not among them this cycle is dropped."""
    streaks: dict[int, Streak] = {}
    for pid in pids:
        seen = previous.get(pid, Streak(0, now))
        streaks[pid] = Streak(seen.cycles + 1, seen.since)
    return streaks


def _pods(
    snapshot: NodeSnapshot,
    attribution: Attribution,
    state: OrphanState,
    terminal_phases: frozenset[str],
    pod_uids: Mapping[int, str],
) -> _Pods:
    """Pod lookups, with names remembered for the UIDs of live GPU processes.

    A name learned while the pod was known (from the watch, or from an exclusive
    allocation without one) is what lets PodResources, which lists names and not UIDs,
    vouch for a pod after the API forgot it. A finished pod does not count as listed
    by the kubelet unless a running pod of the same name is there too (a recreation).
    """
    watch = _watch(snapshot.pod_meta)
    known = list(watch.values()) if watch is not None else []
    finished = frozenset(m.uid for m in known if m.phase in terminal_phases)
    running = {(m.namespace, m.name) for m in known if m.uid not in finished}
    done = {(m.namespace, m.name) for m in known if m.uid in finished} - running
    resources = snapshot.pod_resources
    kubelet = (
        # device-plugin allocations and DRA claim devices both name the pod
        frozenset(
            {(c.namespace, c.pod) for c in resources.containers}
            | {(c.namespace, c.pod) for c in resources.claims}
        )
        - done
        if resources is not None and resources.ok
        else None
    )
    live_uids = {
        row.pod_uid
        for row in attribution.processes
        if row.pod_uid is not None and row.owner != OWNER_DEAD
    } | set(pod_uids.values())
    names = {uid: name for uid, name in state.pod_names.items() if uid in live_uids}
    for row in attribution.processes:
        if row.owner == OWNER_POD and row.pod_uid and row.namespace and row.pod:
            names[row.pod_uid] = PodName(row.namespace, row.pod)
    if watch is not None:
        for uid in live_uids:
            meta = watch.get(uid)
            if meta is not None:
                names[uid] = PodName(meta.namespace, meta.name)
    watched_names = frozenset((m.namespace, m.name) for m in known)
    return _Pods(
        watch=watch, kubelet=kubelet, names=names, finished=finished, watched_names=watched_names
    )


def _watch(pod_meta: PodMetaSnapshot | None) -> dict[str, PodMeta] | None:
    if pod_meta is None or not pod_meta.ok:
        return None
    return {pod.uid: pod for pod in pod_meta.pods}


def _gone(uid: str, pods: _Pods) -> bool:
    """The pod has finished, or neither the API nor the kubelet lists it (as far as
    either can be asked); a terminating pod is judged by its deadline instead.

    Without the watch a pod counts as gone only when its name is known and PodResources
    no longer lists it: a UID alone cannot tell a deleted pod from an unallocated one.
    """
    name = pods.names.get(uid)
    listed_by_kubelet = (
        pods.kubelet is not None
        and name is not None
        and (name.namespace, name.name) in pods.kubelet
    )
    if pods.watch is not None:
        if uid in pods.watch:
            return uid in pods.finished
        if name is not None and (name.namespace, name.name) in pods.watched_names:
            return True  # the name is a new pod's (a StatefulSet replica): this one is gone
        return not listed_by_kubelet
    return pods.kubelet is not None and name is not None and not listed_by_kubelet


def _missing_since(
    pod_uids: Mapping[int, str], pods: _Pods, state: OrphanState, now: float
) -> tuple[dict[str, float], frozenset[str]]:
    """Since when (``now``'s clock: the monotonic one) each live GPU process's pod has
    been gone, for the grace period; and which of them the watch said so.

    A uid is never reused, so a verdict the watch gave stays while the watch cannot say:
    the kubelet names pods, and its listing of the name may be a same-name replacement's.
    """
    previous = state.pod_missing_since
    missing = {
        uid: previous.get(uid, now)
        for uid in set(pod_uids.values())
        if _gone(uid, pods) or (pods.watch is None and uid in state.pods_gone_per_watch)
    }
    if pods.watch is not None:
        # a pod never named may be one the watch has not delivered yet: no verdict of its
        return missing, frozenset(uid for uid in missing if uid in pods.names)
    return missing, state.pods_gone_per_watch & missing.keys()


def _terminating_since(
    pod_uids: Mapping[int, str], pods: _Pods, state: OrphanState, now: float
) -> dict[str, tuple[float, float, int | None]]:
    """Since when (``now``: the monotonic clock) each GPU process's pod has been seen
    terminating with its present ``deletionTimestamp``, and its grace period: a new
    deletion request may only shorten the grace period, and the API server then moves
    the timestamp, so a moved one counts from when it was seen (the shortened grace from
    the new request, never from the old one's sight). Kept while the pod terminates even
    when its process is missing from a cycle (a GPU or /proc read failed once: the first
    sight stays). Without a usable watch this cycle it is not known whether a pod still
    terminates: what was seen is kept, nothing added. Bounded by the watch's pods."""
    previous = state.pod_terminating_since
    if pods.watch is None:
        return dict(previous)
    uids = set(pod_uids.values())
    seen: dict[str, tuple[float, float, int | None]] = {}
    for uid in uids | previous.keys():
        meta = pods.watch.get(uid)
        if meta is None or meta.deletion_timestamp is None:
            continue
        before = previous.get(uid)
        first = now if before is None or before[0] != meta.deletion_timestamp else before[1]
        seen[uid] = (meta.deletion_timestamp, first, meta.deletion_grace_period_s)
    return seen


def _pod_gone_for(uid: str, since: _PodClocks, pods: _Pods, clock: _Clock) -> float | None:
    """How long a pod should have been gone; None while it should not be.

    A terminating pod counts from the end of its graceful stop: its own grace period
    after it was first seen terminating; a vanished or finished one from when we first
    saw it so. Both on the monotonic clock.
    """
    meta = pods.watch.get(uid) if pods.watch is not None else None
    seen = since.terminating.get(uid)  # only for a pod seen with a deletionTimestamp
    if (meta is not None or pods.watch is None) and uid not in pods.finished:
        # listed and not finished; or, the watch down, as last seen: its graceful stop
        if seen is not None:
            _, first, grace = seen
            return clock.elapsed - first - (DEFAULT_TERMINATION_GRACE_S if grace is None else grace)
        if meta is not None:
            return None
    gone = since.missing.get(uid)
    return None if gone is None else clock.elapsed - gone


# ---------------------------------------------------------------------------
# Unattributed device memory
# ---------------------------------------------------------------------------


def _unattributed_streaks(
    gpus: Iterable[GpuSample],
    rows: Sequence[AttributedProcess],
    state: OrphanState,
    now: float,
    policy: OrphanPolicy,
) -> dict[str, tuple[Streak, int]]:
    """Per GPU above the threshold now: its streak and the excess bytes.

    ``used`` is NVML v2, which already excludes driver-reserved memory. Without v2
    (``memory_reserved_bytes`` None) used includes the reserve, whose size we cannot
    know, so the GPU is not judged rather than always flagged; likewise when a listed
    process's memory is unknown, or NVML could not list the processes (the sum would be
    a guess, and a listing NOT_SUPPORTED would flag all used memory).
    """
    listed: dict[str, int] = defaultdict(int)
    unknown: set[str] = set()
    for row in rows:
        if row.memory_used_bytes is None:
            unknown.add(row.uuid)
        else:
            listed[row.uuid] += row.memory_used_bytes
    streaks: dict[str, tuple[Streak, int]] = {}
    for gpu in gpus:
        if gpu.memory_used_bytes is None or gpu.memory_reserved_bytes is None:
            continue
        if gpu.uuid in unknown or not gpu.processes_listed:
            continue
        excess = gpu.memory_used_bytes - listed[gpu.uuid]
        if excess <= policy.unattributed_threshold_bytes:
            continue
        seen = state.unattributed.get(gpu.uuid, Streak(0, now))
        streaks[gpu.uuid] = (Streak(seen.cycles + 1, seen.since), excess)
    return streaks


# ---------------------------------------------------------------------------
# Holder scan: when to run it, and what it found
# ---------------------------------------------------------------------------


def scanned_gpus(orphans: Iterable[OrphanedMemory]) -> dict[str, int]:
    """GPU uuid -> index of each GPU with a kind the holder scan is asked about, once
    per GPU however many such kinds it has: its holders are one set of rows."""
    return {o.uuid: o.gpu for o in orphans if o.kind in SCANNED_KINDS}


def holder_request(
    snapshot: NodeSnapshot, orphans: Iterable[OrphanedMemory]
) -> HolderScanRequest | None:
    """The GPUs whose dead-process or unattributed memory needs a holder named; None
    when there are none.

    One walk covers them all: it costs the same for one device minor as for eight.
    """
    flagged = scanned_gpus(orphans)
    if not flagged:
        return None
    return HolderScanRequest(
        gpus=tuple(
            (g.index, g.uuid, g.minor_number)
            for g in snapshot.nvml.gpus
            if g.uuid in flagged and g.minor_number is not None
        )
    )


def name_holders(
    scan: HolderScan | None, pod_meta: PodMetaSnapshot | None, gpus: Sequence[GpuSample]
) -> tuple[OrphanHolder, ...]:
    """One row per (holder, GPU of ``gpus`` it holds), named from the pod watch.

    A minor no GPU in ``gpus`` has is dropped: those GPUs have nothing to scan for.
    Without the watch (or for a pod it no longer lists) the pod labels stay empty.
    """
    if scan is None:
        return ()
    by_minor = {g.minor_number: g for g in gpus if g.minor_number is not None}
    watch = _watch(pod_meta) or {}
    rows: list[OrphanHolder] = []
    for holder in scan.holders:
        meta = watch.get(holder.pod_uid) if holder.pod_uid else None
        container = dict(meta.containers).get(holder.container_id or "") if meta else None
        for minor in holder.minors:
            gpu = by_minor.get(minor)
            if gpu is None:
                continue
            rows.append(
                OrphanHolder(
                    gpu=gpu.index,
                    uuid=gpu.uuid,
                    pid=holder.pid,
                    namespace=meta.namespace if meta else None,
                    pod=meta.name if meta else None,
                    container=container,
                    comm=holder.comm,
                    role=holder.role,
                )
            )
    return tuple(sorted(rows, key=lambda r: (r.gpu if r.gpu is not None else -1, r.pid)))


def orphan_holders(
    snapshot: NodeSnapshot, orphans: Iterable[OrphanedMemory]
) -> tuple[OrphanHolder, ...]:
    """Holders of the GPUs that have dead-process or unattributed memory now, from the
    last scan; a GPU with both kinds has its rows once."""
    flagged = scanned_gpus(orphans)
    gpus = [g for g in snapshot.nvml.gpus if g.uuid in flagged]
    return name_holders(snapshot.holder_scan, snapshot.pod_meta, gpus)


def driver_held(
    orphans: Iterable[OrphanedMemory], scan: HolderScan | None
) -> tuple[DriverHeld, ...]:
    """Per GPU with dead-process or unattributed memory: whether only the driver holds it.

    True when a complete scan covering the GPU found no process but management daemons
    with it open: nothing to kill, only a GPU reset frees the memory. For a dead pid
    that is the context whose teardown never finished; a forked child or any other live
    holder makes it False. NVML-listed pids are not scanned (their own contexts hold the
    device legitimately), so a holder that also made a context of its own is not seen.
    A GPU the scan did not cover, or covered incompletely, is left out: we do not know.
    One verdict per GPU, whichever kinds it has.
    """
    if scan is None or not scan.complete:
        return ()
    minors = {uuid: minor for _, uuid, minor in scan.gpus}
    verdicts = []
    for uuid, gpu in scanned_gpus(orphans).items():
        if uuid not in minors:
            continue
        minor = minors[uuid]
        held = any(h.role != ROLE_MANAGEMENT and minor in h.minors for h in scan.holders)
        verdicts.append(DriverHeld(gpu, uuid, not held))
    return tuple(sorted(verdicts, key=lambda v: v.gpu))
