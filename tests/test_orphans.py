"""Orphaned GPU memory analysis (pure): kinds, bytes, hysteresis, grace, first_seen.

Snapshots are built by hand and attributed by the real ``attribute``, so these tests
state what an operator would see for a node in a given condition.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

import pytest

from exporter.analysis.attribution import attribute
from exporter.analysis.orphans import (
    OrphanPolicy,
    driver_held,
    find_orphans,
    holder_request,
    name_holders,
    orphan_holders,
)
from exporter.model import (
    KIND_DEAD_PROCESS,
    KIND_DELETED_POD,
    KIND_STUCK_PROCESS,
    KIND_UNATTRIBUTED,
    ClaimDevice,
    ContainerDevices,
    DeviceHolder,
    DriverHeld,
    GpuProcess,
    GpuSample,
    HolderScan,
    MigInstance,
    NodeSnapshot,
    NvmlSnapshot,
    OrphanedMemory,
    OrphanKind,
    OrphanState,
    PodMeta,
    PodMetaSnapshot,
    PodName,
    PodResourcesSnapshot,
    ProcessIdentity,
)

MIB = 1024**2
GIB = 1024**3
T0 = 1_700_000_000.0
# A dead pid judged at once here; the default's confirmation has its own tests below.
POLICY = OrphanPolicy(dead_cycles=1)
UID_A = "11111111-1111-1111-1111-111111111111"
UID_B = "22222222-2222-2222-2222-222222222222"
CID_A = "a" * 64
CID_B = "b" * 64


def uuid_of(index: int) -> str:
    return f"GPU-0000000{index}-0000-0000-0000-000000000000"


def gpu(
    index: int,
    *,
    used: int | None = None,
    reserved: int | None = 512 * MIB,
    processes: Sequence[GpuProcess] = (),
    mig: Sequence[MigInstance] = (),
    error: str | None = None,
    lost: bool = False,
) -> GpuSample:
    """A GPU whose used memory defaults to exactly what its processes list."""
    listed = [*processes, *(p for m in mig for p in m.processes)]
    if used is None:
        used = sum(p.memory_used_bytes or 0 for p in listed)
    return GpuSample(
        index=index,
        uuid=uuid_of(index),
        minor_number=index,
        error=error,
        lost=lost,
        memory_total_bytes=None if error else 80 * GIB,
        memory_used_bytes=None if error else used,
        memory_reserved_bytes=None if error else reserved,
        processes=tuple(processes),
        mig_instances=tuple(mig),
        mig_enabled=bool(mig) or None,
    )


def proc(pid: int, memory: int | None) -> GpuProcess:
    return GpuProcess(pid=pid, memory_used_bytes=memory, kind="compute")


def alive(
    pid: int, uid: str | None = None, cid: str | None = None, state: str = "S"
) -> ProcessIdentity:
    return ProcessIdentity(
        pid=pid, alive=True, pod_uid=uid, container_id=cid, comm="python3", state=state
    )


def dead(pid: int) -> ProcessIdentity:
    return ProcessIdentity(pid=pid, alive=False)


def meta(
    uid: str,
    name: str,
    cid: str,
    *,
    deletion: float | None = None,
    grace: int | None = None,
    ns: str = "ml",
) -> PodMeta:
    return PodMeta(
        uid=uid,
        namespace=ns,
        name=name,
        phase="Running",
        deletion_timestamp=deletion,
        deletion_grace_period_s=grace,
        containers=((cid, "main"),),
    )


def watch(*pods: PodMeta, ok: bool = True) -> PodMetaSnapshot:
    return PodMetaSnapshot(ok=ok, timestamp=T0, pods=tuple(pods))


def kubelet(*allocations: tuple[str, str, int], ok: bool = True) -> PodResourcesSnapshot:
    """(namespace, pod, GPU index) allocations of one container named main."""
    return PodResourcesSnapshot(
        ok=ok,
        timestamp=T0,
        containers=tuple(
            ContainerDevices(ns, pod, "main", "nvidia.com/gpu", (uuid_of(index),))
            for ns, pod, index in allocations
        ),
    )


def node(
    gpus: Sequence[GpuSample],
    identities: Iterable[ProcessIdentity] = (),
    *,
    pod_meta: PodMetaSnapshot | None = None,
    pod_resources: PodResourcesSnapshot | None = None,
    nvml_ok: bool = True,
) -> NodeSnapshot:
    return NodeSnapshot(
        node_name="n1",
        nvml=NvmlSnapshot(ok=nvml_ok, timestamp=T0, gpus=tuple(gpus) if nvml_ok else ()),
        processes=tuple(identities),
        pod_resources=pod_resources,
        pod_meta=pod_meta,
    )


class Run:
    """Feeds snapshots through find_orphans cycle by cycle, carrying the state."""

    def __init__(self, policy: OrphanPolicy = POLICY) -> None:
        self.policy = policy
        self.state = OrphanState()

    def cycle(self, snapshot: NodeSnapshot, now: float) -> tuple[OrphanedMemory, ...]:
        orphans, self.state = find_orphans(
            snapshot, attribute(snapshot), self.state, now=now, policy=self.policy
        )
        return orphans


def kinds(orphans: Iterable[OrphanedMemory]) -> dict[tuple[int, str], tuple[int | None, int]]:
    return {(o.gpu, o.kind): (o.memory_used_bytes, o.processes) for o in orphans}


# ---------------------------------------------------------------------------
# dead_process
# ---------------------------------------------------------------------------


def test_memory_of_pids_nvml_lists_without_a_proc_entry_is_dead_process_memory() -> None:
    snapshot = node(
        [gpu(0, processes=[proc(10, 12 * GIB), proc(11, 2 * GIB), proc(12, 1 * GIB)])],
        [dead(10), dead(11), alive(12)],
    )
    orphans = Run().cycle(snapshot, T0)
    assert kinds(orphans) == {(0, KIND_DEAD_PROCESS): (14 * GIB, 2)}
    assert orphans[0].uuid == uuid_of(0)
    assert orphans[0].first_seen == T0


def test_a_pid_that_exits_between_the_nvml_listing_and_the_proc_read_is_no_orphan() -> None:
    """NVML lists pid 10, which exits before /proc is read: dead for one cycle, gone
    from NVML the next. With the default (3 cycles) it is never an orphan (before: a
    GPUOrphanedMemory Warning for a process that exited normally)."""
    run = Run(OrphanPolicy())
    raced = node([gpu(0, processes=[proc(10, 2 * GIB)])], [dead(10)])
    exited = node([gpu(0)], [])
    assert run.cycle(raced, T0) == ()
    assert run.cycle(exited, T0 + 10) == ()


def test_a_dead_pid_still_listed_for_the_confirmation_cycles_dates_from_its_first() -> None:
    run = Run(OrphanPolicy())
    zombie = node([gpu(0, processes=[proc(10, 2 * GIB)])], [dead(10)])
    assert run.cycle(zombie, T0) == ()
    assert run.cycle(zombie, T0 + 10) == ()
    found = run.cycle(zombie, T0 + 20)
    assert [(o.kind, o.first_seen) for o in found] == [(KIND_DEAD_PROCESS, T0)]


def test_dead_process_memory_unknown_to_nvml_counts_the_process_but_not_as_zero_bytes() -> None:
    snapshot = node(
        [
            gpu(0, processes=[proc(10, 12 * GIB), proc(11, None)]),
            gpu(1, processes=[proc(20, 3 * GIB)]),
        ],
        [dead(10), dead(11), dead(20)],
    )
    assert kinds(Run().cycle(snapshot, T0)) == {
        (0, KIND_DEAD_PROCESS): (None, 2),  # not 12 GiB: the other process holds some too
        (1, KIND_DEAD_PROCESS): (3 * GIB, 1),
    }


def test_a_pid_procfs_never_identified_is_no_orphan() -> None:
    # procfs down (no proc root): no exit was seen, so nothing is a dead process's
    snapshot = node([gpu(0, processes=[proc(10, 3 * GIB)])], [])
    run = Run()
    assert run.cycle(snapshot, T0) == ()
    assert run.cycle(snapshot, T0 + 3600) == ()


def test_a_proc_read_failure_keeps_dead_stuck_and_deleted_pod_verdicts_and_their_age() -> None:
    """/proc unreadable for one cycle in three says nothing of any process: a confirmed
    dead pid, a stuck one and a deleted pod's stay reported with their first age (adversarial
    review: the dead pid's streak restarted, and one failure in three hid it for good)."""
    policy = OrphanPolicy(deleted_pod_grace_s=60, dead_cycles=3, stuck_cycles=3)
    gpus = [gpu(0, processes=[proc(10, 7 * GIB)]), gpu(1, processes=[proc(20, GIB)])]
    gpus.append(gpu(2, processes=[proc(30, 2 * GIB)]))
    readable = node(
        gpus,
        [alive(10, UID_A, CID_A), dead(20), alive(30, state="D")],
        pod_meta=watch(),
        pod_resources=kubelet(),
    )
    unreadable = replace(readable, processes=())
    state = OrphanState()
    first: dict[OrphanKind, float] = {}
    for step in range(30):
        snapshot = unreadable if step % 3 == 2 else readable
        found, state = find_orphans(
            snapshot, attribute(snapshot), state, now=T0 + 10 * step, policy=policy
        )
        kinds = {o.kind: o.first_seen for o in found}
        first = {**kinds, **first}
        if step >= 8:  # 60 s grace from 10 s; three read cycles by 40 s
            assert set(kinds) == {KIND_DELETED_POD, KIND_DEAD_PROCESS, KIND_STUCK_PROCESS}, step
            assert kinds == first, step


# ---------------------------------------------------------------------------
# stuck_process
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("state", ["D", "Z"])
def test_a_process_in_d_or_z_is_stuck_after_the_configured_cycles(state: str) -> None:
    snapshot = node([gpu(0, processes=[proc(10, 5 * GIB)])], [alive(10, state=state)])
    run = Run(OrphanPolicy(dead_cycles=1, stuck_cycles=3))
    assert run.cycle(snapshot, T0) == ()
    assert run.cycle(snapshot, T0 + 10) == ()
    orphans = run.cycle(snapshot, T0 + 20)
    assert kinds(orphans) == {(0, KIND_STUCK_PROCESS): (5 * GIB, 1)}
    assert orphans[0].first_seen == T0  # dates from the first cycle seen in D or Z


def test_a_process_only_briefly_in_d_is_never_stuck() -> None:
    busy = node([gpu(0, processes=[proc(10, 5 * GIB)])], [alive(10, state="D")])
    running = node([gpu(0, processes=[proc(10, 5 * GIB)])], [alive(10, state="R")])
    run = Run(OrphanPolicy(dead_cycles=1, stuck_cycles=2))
    for step in range(6):  # D, R, D, R, ...: the streak never reaches 2
        snapshot = busy if step % 2 == 0 else running
        assert run.cycle(snapshot, T0 + 10 * step) == ()


# ---------------------------------------------------------------------------
# deleted_pod
# ---------------------------------------------------------------------------


def gpu_with_pod_process() -> GpuSample:
    return gpu(0, processes=[proc(10, 7 * GIB)])


def test_a_live_process_whose_pod_left_api_and_kubelet_is_deleted_pod_after_the_grace() -> None:
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=60))
    identity = [alive(10, UID_A, CID_A)]
    known = node(
        [gpu_with_pod_process()],
        identity,
        pod_meta=watch(meta(UID_A, "trainer", CID_A)),
        pod_resources=kubelet(("ml", "trainer", 0)),
    )
    gone = node([gpu_with_pod_process()], identity, pod_meta=watch(), pod_resources=kubelet())
    assert run.cycle(known, T0) == ()
    assert run.cycle(gone, T0 + 10) == ()  # missing since T0 + 10
    assert run.cycle(gone, T0 + 69) == ()
    orphans = run.cycle(gone, T0 + 70)
    assert kinds(orphans) == {(0, KIND_DELETED_POD): (7 * GIB, 1)}
    assert orphans[0].first_seen == T0 + 10  # dates from when the pod was seen gone


def test_a_pod_the_kubelet_still_lists_is_not_deleted_though_the_api_forgot_it() -> None:
    """Force deletion removes the API object at once; the kubelet is still killing it."""
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=60))
    identity = [alive(10, UID_A, CID_A)]
    known = node(
        [gpu_with_pod_process()],
        identity,
        pod_meta=watch(meta(UID_A, "trainer", CID_A)),
        pod_resources=kubelet(("ml", "trainer", 0)),
    )
    force_deleted = node(
        [gpu_with_pod_process()],
        identity,
        pod_meta=watch(),
        pod_resources=kubelet(("ml", "trainer", 0)),
    )
    run.cycle(known, T0)
    for step in range(1, 20):
        assert run.cycle(force_deleted, T0 + 10 * step) == ()


def test_a_new_pod_the_watch_has_not_delivered_yet_is_not_flagged_within_the_grace() -> None:
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=60))
    lagging = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(),
        pod_resources=kubelet(("ml", "trainer", 0)),
    )
    delivered = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(meta(UID_A, "trainer", CID_A)),
        pod_resources=kubelet(("ml", "trainer", 0)),
    )
    assert run.cycle(lagging, T0) == ()
    assert run.cycle(lagging, T0 + 30) == ()
    assert run.cycle(delivered, T0 + 60) == ()
    assert run.state.pod_missing_since == {}


def test_a_terminating_pod_is_flagged_only_grace_seconds_after_its_deletion_deadline() -> None:
    """The API sets deletionTimestamp to request time + the pod's own grace period; with
    no deletionGracePeriodSeconds the stop is taken as the default 30 s from first sight."""
    deadline = T0 + 30
    terminating = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(meta(UID_A, "api", CID_A, deletion=deadline)),
        pod_resources=kubelet(("ml", "api", 0)),
    )
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=60))
    assert run.cycle(terminating, T0) == ()
    assert run.cycle(terminating, deadline + 59) == ()
    orphans = run.cycle(terminating, deadline + 60)
    assert kinds(orphans) == {(0, KIND_DELETED_POD): (7 * GIB, 1)}
    assert orphans[0].first_seen == deadline


def test_a_live_process_of_a_finished_pod_is_deleted_pod_after_the_grace() -> None:
    """Succeeded/Failed: the kubelet says every container exited, yet the process runs."""
    finished = PodMeta(UID_A, "ml", "job-1", phase="Failed", containers=((CID_A, "main"),))
    snapshot = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(finished),
        pod_resources=kubelet(("ml", "job-1", 0)),  # a kubelet still listing it changes nothing
    )
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=60))
    assert run.cycle(snapshot, T0) == ()
    orphans = run.cycle(snapshot, T0 + 60)
    assert kinds(orphans) == {(0, KIND_DELETED_POD): (7 * GIB, 1)}
    assert orphans[0].first_seen == T0


def test_a_recreated_pod_of_the_same_name_keeps_the_old_ones_name_listed() -> None:
    """The kubelet lists names: a running successor must not vouch for a finished UID,
    and a finished predecessor must not condemn the successor."""
    old = PodMeta(UID_A, "ml", "web-0", phase="Succeeded", containers=((CID_A, "main"),))
    new = meta(UID_B, "web-0", CID_B)
    snapshot = node(
        [gpu(0, processes=[proc(10, 7 * GIB), proc(11, 3 * GIB)])],
        [alive(10, UID_A, CID_A), alive(11, UID_B, CID_B)],
        pod_meta=watch(old, new),
        pod_resources=kubelet(("ml", "web-0", 0)),
    )
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=0))
    assert kinds(run.cycle(snapshot, T0)) == {(0, KIND_DELETED_POD): (7 * GIB, 1)}


def test_without_the_pod_watch_podresources_alone_flags_a_pod_it_named_before() -> None:
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=60))
    identity = [alive(10, UID_A, CID_A)]
    allocated = node([gpu_with_pod_process()], identity, pod_resources=kubelet(("ml", "t", 0)))
    released = node([gpu_with_pod_process()], identity, pod_resources=kubelet())
    assert run.cycle(allocated, T0) == ()
    assert run.state.pod_names == {UID_A: PodName("ml", "t")}
    assert run.cycle(released, T0 + 10) == ()
    assert kinds(run.cycle(released, T0 + 70)) == {(0, KIND_DELETED_POD): (7 * GIB, 1)}


def test_without_the_pod_watch_a_pod_holding_a_dra_claim_is_listed_by_the_kubelet() -> None:
    """A DRA pod's only PodResources entry is its claim device: that lists it too."""
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=0))
    claim = ClaimDevice("ml", "t", "main", "ml", "t-gpu", "gpu.nvidia.com", "n1", "gpu-0")
    claimed = PodResourcesSnapshot(ok=True, timestamp=T0, claims=(claim,))
    identity = [alive(10, UID_A, CID_A)]
    named = node(
        [gpu_with_pod_process()],
        identity,
        pod_meta=watch(meta(UID_A, "t", CID_A)),
        pod_resources=claimed,
    )
    watch_down = node(
        [gpu_with_pod_process()], identity, pod_meta=watch(ok=False), pod_resources=claimed
    )
    assert run.cycle(named, T0) == ()
    for step in range(1, 5):
        assert run.cycle(watch_down, T0 + 100 * step) == ()


def test_without_the_pod_watch_a_pod_never_named_is_not_flagged() -> None:
    """A UID alone cannot tell a deleted pod from one using a GPU it was not given."""
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=0))
    snapshot = node([gpu_with_pod_process()], [alive(10, UID_A, CID_A)], pod_resources=kubelet())
    for step in range(5):
        assert run.cycle(snapshot, T0 + 100 * step) == ()


def test_with_neither_the_watch_nor_podresources_no_pod_is_flagged_deleted() -> None:
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=0))
    named = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(meta(UID_A, "t", CID_A)),
        pod_resources=kubelet(("ml", "t", 0)),
    )
    blind = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(ok=False),
        pod_resources=kubelet(ok=False),
    )
    run.cycle(named, T0)
    for step in range(1, 5):
        assert run.cycle(blind, T0 + 100 * step) == ()


def test_host_processes_are_never_deleted_pods() -> None:
    snapshot = node(
        [gpu_with_pod_process()], [alive(10)], pod_meta=watch(), pod_resources=kubelet()
    )
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=0))
    assert run.cycle(snapshot, T0) == ()
    assert run.cycle(snapshot, T0 + 100) == ()


def test_each_process_counts_in_one_kind_dead_then_stuck_then_deleted_pod() -> None:
    snapshot = node(
        [gpu(0, processes=[proc(10, 1 * GIB), proc(11, 2 * GIB), proc(12, 4 * GIB)])],
        [dead(10), alive(11, UID_A, CID_A, state="D"), alive(12, UID_A, CID_A)],
        pod_meta=watch(),
        pod_resources=kubelet(),
    )
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=0, stuck_cycles=2))
    first = kinds(run.cycle(snapshot, T0))
    assert first == {(0, KIND_DEAD_PROCESS): (1 * GIB, 1), (0, KIND_DELETED_POD): (6 * GIB, 2)}
    second = kinds(run.cycle(snapshot, T0 + 10))
    assert second == {
        (0, KIND_DEAD_PROCESS): (1 * GIB, 1),
        (0, KIND_DELETED_POD): (4 * GIB, 1),
        (0, KIND_STUCK_PROCESS): (2 * GIB, 1),
    }
    assert sum(memory or 0 for memory, _ in second.values()) == 7 * GIB  # all known


# ---------------------------------------------------------------------------
# unattributed
# ---------------------------------------------------------------------------


def leaking(excess: int, *, reserved: int | None = 512 * MIB) -> NodeSnapshot:
    processes = [proc(10, 20 * GIB)]
    return node(
        [gpu(0, used=20 * GIB + excess, reserved=reserved, processes=processes)], [alive(10)]
    )


def test_unaccounted_memory_is_flagged_after_n_cycles_with_the_whole_excess() -> None:
    run = Run(
        OrphanPolicy(dead_cycles=1, unattributed_threshold_bytes=256 * MIB, unattributed_cycles=3)
    )
    snapshot = leaking(6 * GIB)
    assert run.cycle(snapshot, T0) == ()
    assert run.cycle(snapshot, T0 + 10) == ()
    orphans = run.cycle(snapshot, T0 + 20)
    assert kinds(orphans) == {(0, KIND_UNATTRIBUTED): (6 * GIB, 0)}
    assert orphans[0].first_seen == T0  # dates from the first cycle above the threshold


def test_an_allocation_spike_seen_in_one_cycle_is_not_flagged() -> None:
    run = Run(OrphanPolicy(dead_cycles=1, unattributed_cycles=3))
    steady, spike = leaking(0), leaking(4 * GIB)
    for step, snapshot in enumerate([steady, spike, steady, spike, spike, steady, steady]):
        assert run.cycle(snapshot, T0 + 10 * step) == ()


def test_unaccounted_memory_at_or_below_the_threshold_is_not_flagged() -> None:
    run = Run(
        OrphanPolicy(dead_cycles=1, unattributed_threshold_bytes=256 * MIB, unattributed_cycles=1)
    )
    assert run.cycle(leaking(256 * MIB), T0) == ()
    assert kinds(run.cycle(leaking(256 * MIB + 1), T0 + 10)) == {
        (0, KIND_UNATTRIBUTED): (256 * MIB + 1, 0)
    }


def test_processes_of_every_kind_including_dead_ones_count_as_accounted() -> None:
    snapshot = node(
        [gpu(0, used=10 * GIB, processes=[proc(10, 6 * GIB), proc(11, 4 * GIB)])],
        [dead(10), alive(11)],
    )
    run = Run(OrphanPolicy(dead_cycles=1, unattributed_cycles=1))
    assert kinds(run.cycle(snapshot, T0)) == {(0, KIND_DEAD_PROCESS): (6 * GIB, 1)}


def test_processes_on_mig_instances_count_towards_their_gpu() -> None:
    mig = [
        MigInstance(0, "MIG-a", 1, 0, "3g.40gb", 40 * GIB, 5 * GIB, (proc(20, 5 * GIB),)),
        MigInstance(1, "MIG-b", 2, 0, "3g.40gb", 40 * GIB, 3 * GIB, (proc(21, 3 * GIB),)),
    ]
    healthy = node([gpu(0, used=8 * GIB, mig=mig)], [alive(20), alive(21)])
    leaking_mig = node([gpu(0, used=9 * GIB, mig=mig)], [alive(20), alive(21)])
    run = Run(OrphanPolicy(dead_cycles=1, unattributed_cycles=1))
    assert run.cycle(healthy, T0) == ()
    assert kinds(run.cycle(leaking_mig, T0 + 10)) == {(0, KIND_UNATTRIBUTED): (1 * GIB, 0)}


def test_without_memory_info_v2_unattributed_memory_is_not_judged() -> None:
    """v1 ``used`` includes the driver reserve, whose size is then unknown."""
    run = Run(OrphanPolicy(dead_cycles=1, unattributed_cycles=1))
    for step in range(3):
        assert run.cycle(leaking(6 * GIB, reserved=None), T0 + 10 * step) == ()


def test_a_process_with_unknown_memory_makes_the_gpu_unjudged() -> None:
    snapshot = node(
        [gpu(0, used=30 * GIB, processes=[proc(10, 20 * GIB), proc(11, None)])],
        [alive(10), alive(11)],
    )
    run = Run(OrphanPolicy(dead_cycles=1, unattributed_cycles=1))
    assert run.cycle(snapshot, T0) == ()


# ---------------------------------------------------------------------------
# first_seen, lost GPUs, NVML down
# ---------------------------------------------------------------------------


def test_first_seen_persists_while_the_condition_holds_and_resets_after_it_clears() -> None:
    zombie = node([gpu(0, processes=[proc(10, 2 * GIB)])], [dead(10)])
    bigger = node([gpu(0, processes=[proc(10, 2 * GIB), proc(11, 1 * GIB)])], [dead(10), dead(11)])
    clean = node([gpu(0)], [])
    run = Run()
    assert [o.first_seen for o in run.cycle(zombie, T0)] == [T0]
    assert [o.first_seen for o in run.cycle(bigger, T0 + 10)] == [T0]  # same kind, more pids
    assert [o.memory_used_bytes for o in run.cycle(zombie, T0 + 20)] == [2 * GIB]
    assert run.cycle(clean, T0 + 30) == ()
    assert [o.first_seen for o in run.cycle(zombie, T0 + 40)] == [T0 + 40]


def test_unattributed_first_seen_resets_when_the_excess_drops_below_the_threshold() -> None:
    run = Run(OrphanPolicy(dead_cycles=1, unattributed_cycles=2))
    run.cycle(leaking(2 * GIB), T0)
    assert [o.first_seen for o in run.cycle(leaking(2 * GIB), T0 + 10)] == [T0]
    assert run.cycle(leaking(0), T0 + 20) == ()
    assert run.cycle(leaking(2 * GIB), T0 + 30) == ()
    assert [o.first_seen for o in run.cycle(leaking(2 * GIB), T0 + 40)] == [T0 + 30]


def test_a_lost_gpu_is_skipped_and_its_history_dropped() -> None:
    processes = [proc(10, 2 * GIB)]
    run = Run(OrphanPolicy(dead_cycles=1, unattributed_cycles=1))
    zombie_and_leak = node([gpu(0, used=5 * GIB, processes=processes), gpu(1)], [dead(10)])
    lost = node([gpu(0, error="GpuIsLost", lost=True), gpu(1)], [])
    assert {o.kind for o in run.cycle(zombie_and_leak, T0)} == {
        KIND_DEAD_PROCESS,
        KIND_UNATTRIBUTED,
    }
    assert run.cycle(lost, T0 + 10) == ()
    assert run.state.first_seen == {} and run.state.unattributed == {}
    assert {o.first_seen for o in run.cycle(zombie_and_leak, T0 + 20)} == {T0 + 20}


def test_a_gpu_unreadable_for_a_cycle_keeps_its_orphans_ages() -> None:
    """A GPU whose reading failed without NVML saying it is lost (NVML_ERROR_UNKNOWN once)
    was not reset: its orphans are still there, and come back with their first age
    (before: the dead pid's confirmation, the deleted pod's grace and the unattributed
    streak all started again)."""
    policy = OrphanPolicy(dead_cycles=3, unattributed_cycles=3, deleted_pod_grace_s=60)
    run = Run(policy)
    readable = node(
        [
            gpu(0, used=5 * GIB, processes=[proc(10, 2 * GIB)]),
            gpu(1, processes=[proc(20, 3 * GIB)]),
        ],
        [dead(10), alive(20, UID_A, CID_A)],
        pod_meta=watch(),
        pod_resources=kubelet(),
    )
    unreadable = replace(
        readable,
        nvml=replace(readable.nvml, gpus=(gpu(0, error="Unknown"), gpu(1, error="Unknown"))),
    )
    for step in range(7):
        run.cycle(readable, T0 + 10 * step)
    assert {o.kind: o.first_seen for o in run.cycle(readable, T0 + 70)} == {
        KIND_DEAD_PROCESS: T0,
        KIND_UNATTRIBUTED: T0,
        KIND_DELETED_POD: T0,
    }
    assert run.cycle(unreadable, T0 + 80) == ()  # nothing known of them this cycle
    assert {o.kind: o.first_seen for o in run.cycle(readable, T0 + 90)} == {
        KIND_DEAD_PROCESS: T0,
        KIND_UNATTRIBUTED: T0,
        KIND_DELETED_POD: T0,
    }


def test_a_failed_process_listing_keeps_the_gpus_orphans_ages() -> None:
    """One of a GPU's process listings failing (processes_listed False, no error) says
    nothing of its processes either (adversarial review: a confirmed dead pid took 3
    cycles to return, younger, and a listing failing one cycle in three hid it)."""
    run = Run(OrphanPolicy(dead_cycles=3, unattributed_cycles=3))
    readable = node([gpu(0, used=5 * GIB, processes=[proc(10, 2 * GIB)])], [dead(10)])
    unlisted = replace(
        readable,
        nvml=replace(readable.nvml, gpus=(replace(gpu(0, used=5 * GIB), processes_listed=False),)),
    )
    for step in range(3):
        run.cycle(readable, T0 + 10 * step)
    for step in range(3, 30):
        found = run.cycle(unlisted if step % 3 == 0 else readable, T0 + 10 * step)
        expected = {} if step % 3 == 0 else {KIND_DEAD_PROCESS: T0, KIND_UNATTRIBUTED: T0}
        assert {o.kind: o.first_seen for o in found} == expected, step


def test_what_is_kept_for_a_gpu_that_cannot_list_stays_that_gpus() -> None:
    """GPU 1 failing for 2,000 cycles while GPU 0 runs a new pod's process each cycle:
    only what GPU 1 had is kept (adversarial review: every exited pid was kept, 2,000
    of each, and a reused pid read no /proc once inherited a pod gone 5 hours)."""
    run = Run(OrphanPolicy(deleted_pod_grace_s=60))
    for i in range(2000):
        uid = f"{i:08x}-0000-0000-0000-000000000000"
        job = node(
            [gpu(0, processes=[proc(1000 + i, GIB)]), gpu(1, error="Unknown")],
            [alive(1000 + i, uid, CID_A)],
            pod_meta=watch(meta(uid, f"job{i}", CID_A)),
            pod_resources=kubelet(("ml", f"job{i}", 0)),
        )
        assert run.cycle(job, T0 + 10 * i) == ()
    assert max(len(run.state.pod_uids), len(run.state.pod_names), len(run.state.pid_gpus)) <= 1
    reused = node(
        [gpu(0), gpu(1, processes=[proc(1000, GIB)])],  # pid 1000 again, on the other GPU
        [],  # /proc unreadable this cycle
        pod_meta=watch(meta(UID_B, "fresh", CID_B)),
        pod_resources=kubelet(("ml", "fresh", 1)),
    )
    assert run.cycle(reused, T0 + 20_000) == ()


def test_nvml_down_reports_nothing_and_keeps_every_clock() -> None:
    run = Run()
    run.cycle(node([gpu(0, processes=[proc(10, 2 * GIB)])], [dead(10)]), T0)
    kept = run.state
    assert run.cycle(node([], nvml_ok=False), T0 + 10) == ()
    assert run.state == kept
    again = run.cycle(node([gpu(0, processes=[proc(10, 2 * GIB)])], [dead(10)]), T0 + 20)
    assert [o.first_seen for o in again] == [T0]


def test_the_state_only_remembers_what_is_current() -> None:
    run = Run(OrphanPolicy(dead_cycles=1, deleted_pod_grace_s=0))
    with_pod = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A, state="D")],
        pod_meta=watch(),
        pod_resources=kubelet(),
    )
    run.cycle(with_pod, T0)
    assert run.state.stuck and run.state.pod_missing_since
    run.cycle(node([gpu(0)], []), T0 + 10)
    assert run.state == OrphanState()


@pytest.mark.parametrize(
    "bad",
    [
        {"unattributed_threshold_bytes": -1},
        {"unattributed_cycles": 0},
        {"stuck_cycles": 0},
        {"deleted_pod_grace_s": -1.0},
    ],
)
def test_a_nonsensical_policy_is_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        OrphanPolicy(**bad)  # type: ignore[arg-type]


# ---------------------------------------------------------------------------
# Holder scan: when, what for, and naming
# ---------------------------------------------------------------------------


def unattributed(*gpus: int) -> tuple[OrphanedMemory, ...]:
    return tuple(OrphanedMemory(g, uuid_of(g), KIND_UNATTRIBUTED, GIB, 0, T0) for g in gpus)


def covering(gpus: Sequence[int], holders: Sequence[DeviceHolder] = (), **kw: object) -> HolderScan:
    """A walk that covered ``gpus`` (minor = index) and found ``holders``."""
    return HolderScan(
        minors=tuple(gpus),
        holders=tuple(holders),
        gpus=tuple((g, uuid_of(g), g) for g in gpus),
        **kw,  # type: ignore[arg-type]
    )


def dead_memory(*gpus: int) -> tuple[OrphanedMemory, ...]:
    return tuple(OrphanedMemory(g, uuid_of(g), KIND_DEAD_PROCESS, GIB, 1, T0) for g in gpus)


def test_no_scan_is_asked_for_stuck_or_deleted_pod_memory() -> None:
    """Their processes are alive and listed: they hold the memory themselves."""
    listed = (
        OrphanedMemory(0, uuid_of(0), KIND_STUCK_PROCESS, GIB, 1, T0),
        OrphanedMemory(1, uuid_of(1), KIND_DELETED_POD, GIB, 1, T0),
    )
    assert holder_request(node([gpu(0), gpu(1)]), listed) is None
    assert holder_request(node([gpu(0)]), ()) is None


def test_a_scan_is_asked_for_dead_process_memory() -> None:
    """A dead pid's context lives on while anyone holds its device file, and a driver
    may keep listing the dead pid meanwhile (an H200 on 580.159.04 did): who holds it
    is what an operator must know."""
    request = holder_request(node([gpu(0), gpu(1)]), dead_memory(1))
    assert request is not None and request.gpus == ((1, uuid_of(1), 1),)


def test_a_gpu_with_dead_and_unattributed_memory_is_asked_for_and_named_once() -> None:
    both = (*dead_memory(3), *unattributed(3))
    snapshot = replace(
        node([gpu(3)]), holder_scan=covering([3], [DeviceHolder(5302, (3,), "python3", "holder")])
    )
    request = holder_request(snapshot, both)
    assert request is not None and request.gpus == ((3, uuid_of(3), 3),)
    assert [(r.gpu, r.pid) for r in orphan_holders(snapshot, both)] == [(3, 5302)]
    assert driver_held(both, snapshot.holder_scan) == (DriverHeld(3, uuid_of(3), False),)


def test_the_scan_request_names_every_flagged_gpu_with_its_minor() -> None:
    snapshot = node([gpu(0), gpu(1), gpu(2)])
    request = holder_request(snapshot, unattributed(1, 2))
    assert request is not None
    assert request.gpus == ((1, uuid_of(1), 1), (2, uuid_of(2), 2))
    assert request.minors == (1, 2)


def test_holders_are_named_from_the_pod_watch_per_gpu_they_hold() -> None:
    scan = HolderScan(
        minors=(3, 4),
        holders=(
            DeviceHolder(5302, (3,), "pt_data_worker", "holder", UID_A, CID_A),
            DeviceHolder(812, (3, 4, 9), "nvidia-persiste", "management"),
            DeviceHolder(777, (4,), "python3", "holder", UID_B, CID_B),
        ),
    )
    rows = name_holders(scan, watch(meta(UID_A, "dataloader", CID_A)), [gpu(3), gpu(4)])
    assert [(r.gpu, r.pid, r.namespace, r.pod, r.container, r.comm, r.role) for r in rows] == [
        (3, 812, None, None, None, "nvidia-persiste", "management"),
        (3, 5302, "ml", "dataloader", "main", "pt_data_worker", "holder"),
        (4, 777, None, None, None, "python3", "holder"),  # its pod is gone from the API
        (4, 812, None, None, None, "nvidia-persiste", "management"),
    ]
    assert {r.uuid for r in rows} == {uuid_of(3), uuid_of(4)}


def test_holders_are_shown_only_for_gpus_that_still_have_dead_or_unattributed_memory() -> None:
    scan = covering([3, 4, 5], [DeviceHolder(1, (3, 4, 5), "python3", "holder")])
    snapshot = replace(node([gpu(3), gpu(4), gpu(5)]), holder_scan=scan)
    assert [r.gpu for r in orphan_holders(snapshot, unattributed(4))] == [4]
    assert [r.gpu for r in orphan_holders(snapshot, dead_memory(5))] == [5]
    assert name_holders(None, None, [gpu(3)]) == ()


def test_memory_only_management_daemons_hold_is_driver_held() -> None:
    persistenced = DeviceHolder(812, (3, 4), "nvidia-persiste", "management")
    child = DeviceHolder(5302, (3,), "pt_data_worker", "holder")
    scan = covering([3, 4], [persistenced, child])
    assert driver_held(unattributed(3, 4), scan) == (
        DriverHeld(3, uuid_of(3), False),
        DriverHeld(4, uuid_of(4), True),
    )


def test_a_dead_pids_memory_nobody_but_the_daemons_holds_is_driver_held() -> None:
    """The dead pid's context was never torn down and no live process keeps it: only a
    reset frees it. A forked child holding the device makes it not driver-held."""
    persistenced = DeviceHolder(812, (3, 4), "nvidia-persiste", "management")
    child = DeviceHolder(601, (3,), "python3", "holder")
    assert driver_held(dead_memory(3, 4), covering([3, 4], [persistenced, child])) == (
        DriverHeld(3, uuid_of(3), False),
        DriverHeld(4, uuid_of(4), True),
    )
    assert driver_held(dead_memory(4), covering([4], truncated=True)) == ()


def test_no_driver_held_verdict_from_an_incomplete_scan_or_an_uncovered_gpu() -> None:
    assert driver_held(unattributed(4), covering([4], truncated=True)) == ()
    assert driver_held(unattributed(4), covering([4], unreadable_pids=2)) == ()
    assert driver_held(unattributed(5), covering([4])) == ()
    assert driver_held(unattributed(4), None) == ()
