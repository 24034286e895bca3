"""Health transitions (pure): each change of a health fact named once, and a fact
without evidence this cycle carried over, never cleared (exporter/analysis/transitions.py)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from exporter.analysis.transitions import health_transitions
from exporter.model import (
    Allocation,
    Analysis,
    AttributedProcess,
    Attribution,
    ContainerRef,
    DeviceRef,
    GpuHealth,
    GpuSample,
    HealthFacts,
    HealthReason,
    HealthTransition,
    HolderScan,
    HolderScanRequest,
    MigInstance,
    NodeSnapshot,
    NvmlSnapshot,
    OrphanedMemory,
    OrphanHolder,
    PodMeta,
    PodMetaSnapshot,
    PodRef,
    SourceStatus,
    UnallocatedUse,
    XidCount,
)
from exporter.reporting.events import describe

NOW = 1_000.0
UP = {"nvml": True, "podresources": True, "procfs": True}
LOST = HealthReason("gpu_lost", "unhealthy", "GpuIsLost")
ECC = HealthReason("uncorrectable_ecc", "unhealthy", "2 volatile")
REMAP = HealthReason("row_remap_pending", "unhealthy", "reset the GPU")
THERMAL = HealthReason("thermal_slowdown", "degraded")

MIG_GPU = GpuSample(
    index=2,
    uuid="GPU-m",
    mig_enabled=True,
    mig_instances=(
        MigInstance(0, "MIG-one", 1, 0, "3g.40gb", None, None),
        MigInstance(1, "MIG-two", 2, 0, "3g.40gb", None, None),
    ),
)
GPUS = (GpuSample(index=0, uuid="GPU-a"), GpuSample(index=1, uuid="GPU-b"), MIG_GPU)


def alloc(namespace: str, pod: str, gpu: int, uuid: str, mig: str | None = None) -> Allocation:
    device = DeviceRef(gpu, uuid, mig)
    return Allocation(
        ContainerRef(namespace, pod, "main"), device, mig or uuid, "nvidia.com/gpu", False
    )


ALLOCATIONS = (
    alloc("ml", "train-a", 0, "GPU-a"),
    alloc("ml", "train-b", 0, "GPU-a"),
    alloc("ml", "infer", 1, "GPU-b"),
    alloc("mig", "on-one", 2, "GPU-m", "MIG-one"),
    alloc("mig", "on-two", 2, "GPU-m", "MIG-two"),
)
POD_META = PodMetaSnapshot(
    ok=True,
    timestamp=NOW,
    pods=(
        PodMeta("uid-train-a", "ml", "train-a"),
        PodMeta("uid-train-b", "ml", "train-b"),
        PodMeta("uid-infer", "ml", "infer"),
        PodMeta("uid-on-one", "mig", "on-one"),
        PodMeta("uid-on-two", "mig", "on-two"),
    ),
)


def health(*verdicts: tuple[int, str, Sequence[HealthReason]]) -> tuple[GpuHealth, ...]:
    return tuple(GpuHealth(gpu, uuid, tuple(reasons)) for gpu, uuid, reasons in verdicts)


ALL_HEALTHY = health((0, "GPU-a", ()), (1, "GPU-b", ()), (2, "GPU-m", ()))


def cycle(
    *,
    nvml_ok: bool = True,
    verdicts: tuple[GpuHealth, ...] | None = None,
    xids: Iterable[XidCount] = (),
    xids_before_start: Iterable[XidCount] = (),
    leaks: Iterable[UnallocatedUse] = (),
    orphans: Iterable[OrphanedMemory] = (),
    holders: Iterable[OrphanHolder] = (),
    processes: Iterable[AttributedProcess] = (),
    sources: dict[str, bool] | None = None,
    pod_meta: PodMetaSnapshot | None = POD_META,
    timestamp: float = NOW,
    asks_scan: Iterable[str] = (),
    scanned: Iterable[str] | None = None,
) -> Analysis:
    """One cycle's analysis, as the pipeline hands it to ``health_transitions``."""
    statuses = {**UP, "nvml": nvml_ok} if sources is None else sources
    node = NodeSnapshot(
        node_name="node-a",
        nvml=NvmlSnapshot(ok=nvml_ok, timestamp=timestamp, gpus=GPUS if nvml_ok else ()),
        timestamp=timestamp,
        pod_meta=pod_meta,
        holder_scan=None if scanned is None else scan_of(scanned),
        sources=tuple(
            SourceStatus(name, up, None if up else "refused") for name, up in statuses.items()
        ),
    )
    if verdicts is None:
        verdicts = ALL_HEALTHY if nvml_ok else ()
    return Analysis(
        node=node,
        attribution=Attribution(
            processes=tuple(processes),
            allocations=ALLOCATIONS if statuses.get("podresources") else (),
            unallocated_use=tuple(leaks),
        ),
        health=verdicts,
        xid_counts=tuple(xids),
        xid_counts_before_start=tuple(xids_before_start),
        orphans=tuple(orphans),
        orphan_holders=tuple(holders),
        holder_request=scan_request(asks_scan),
    )


def scan_request(uuids: Iterable[str]) -> HolderScanRequest | None:
    """What this cycle's analysis asks the next cycle's holder scan to cover."""
    gpus = tuple((0, u, 0) for u in uuids)
    return HolderScanRequest(gpus) if gpus else None


def scan_of(uuids: Iterable[str]) -> HolderScan:
    """The holder scan shown this cycle, covering ``uuids`` (what it found is in the
    analysis's ``orphan_holders``)."""
    return HolderScan(minors=(0,), gpus=tuple((0, u, 0) for u in uuids))


def run(
    *analyses: Analysis, facts: HealthFacts | None = None
) -> tuple[list[tuple[HealthTransition, ...]], HealthFacts]:
    """Feed cycles in order; the transitions of each, and the facts carried at the end."""
    facts = facts if facts is not None else HealthFacts(sources_up=dict(UP))
    out = []
    for analysis in analyses:
        transitions, facts = health_transitions(analysis, facts)
        out.append(transitions)
    return out, facts


def kinds(transitions: Iterable[HealthTransition]) -> list[str]:
    return [t.kind for t in transitions]


def xid(count: int, code: int = 79, severity: str = "fatal", **kw: object) -> XidCount:
    gpu = kw.get("gpu", 0)
    uuid = kw.get("uuid", "GPU-a")
    gi = kw.get("gi")
    ci = kw.get("ci")
    return XidCount(gpu, uuid, code, severity, gi, ci, count)  # type: ignore[arg-type]


TRAIN_PODS = (PodRef("ml", "train-a", "uid-train-a"), PodRef("ml", "train-b", "uid-train-b"))

# -- GPU lost and back -------------------------------------------------------------------


def test_gpu_becoming_lost_names_the_pods_allocated_it_once_and_later_back() -> None:
    lost = health((0, "GPU-a", (LOST,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    (before, became, still, back), facts = run(
        cycle(), cycle(verdicts=lost), cycle(verdicts=lost), cycle()
    )
    assert before == ()
    (t,) = became
    assert (t.kind, t.gpu, t.uuid, t.detail) == ("gpu_lost", 0, "GPU-a", "GpuIsLost")
    assert t.pods == TRAIN_PODS  # not infer's GPU-b, not the MIG pods
    assert still == ()
    assert kinds(back) == ["gpu_back", "gpu_healthy"]
    assert all(t.uuid == "GPU-a" for t in back)
    assert facts.unhealthy == {}


def test_a_lost_gpu_is_not_also_reported_unhealthy() -> None:
    lost = health((0, "GPU-a", (LOST,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    (_, became), _ = run(cycle(), cycle(verdicts=lost))
    assert kinds(became) == ["gpu_lost"]


# -- fatal XIDs ----------------------------------------------------------------------------


def test_a_storm_of_250_fatal_xids_in_one_cycle_is_one_transition_with_the_count() -> None:
    (first, storm, quiet, more), _ = run(
        cycle(xids=[xid(1)]), cycle(xids=[xid(251)]), cycle(xids=[xid(251)]), cycle(xids=[xid(254)])
    )
    assert [t.count for t in first] == [1]
    (t,) = storm
    assert (t.kind, t.xid, t.xid_class, t.count, t.gpu, t.uuid) == (
        "fatal_xid",
        79,
        "fatal",
        250,
        0,
        "GPU-a",
    )
    assert t.pods == TRAIN_PODS
    assert quiet == ()
    assert [t.count for t in more] == [3]


def test_xids_of_a_non_fatal_class_give_no_transition() -> None:
    (a, b), _ = run(
        cycle(xids=[xid(5, code=13, severity="application")]),
        cycle(xids=[xid(90, code=13, severity="application"), xid(3, code=94, severity="warning")]),
    )
    assert a == b == ()


def test_xids_counted_before_start_give_no_transition() -> None:
    (a, b), _ = run(
        cycle(xids_before_start=[xid(40)]),
        cycle(xids_before_start=[xid(41)]),
    )
    assert a == b == ()


def test_an_xid_on_a_mig_instance_names_only_the_pods_allocated_that_instance() -> None:
    on_two = xid(4, gpu=2, uuid="GPU-m", gi=2, ci=0)
    ((t,),), _ = run(cycle(xids=[on_two]))
    assert (t.kind, t.mig_uuid, t.gpu_instance_id, t.count) == ("fatal_xid", "MIG-two", 2, 4)
    assert t.pods == (PodRef("mig", "on-two", "uid-on-two"),)


def test_an_xid_on_a_mig_instance_that_cannot_be_mapped_names_every_pod_of_the_gpu() -> None:
    unknown_gi = xid(1, gpu=2, uuid="GPU-m", gi=9, ci=0)
    ((t,),), _ = run(cycle(xids=[unknown_gi]))
    assert t.mig_uuid is None and t.gpu_instance_id == 9
    assert t.pods == (PodRef("mig", "on-one", "uid-on-one"), PodRef("mig", "on-two", "uid-on-two"))


def test_an_xid_on_one_of_two_compute_instances_of_a_gpu_instance_names_that_ones_pods() -> None:
    split = GpuSample(
        index=2,
        uuid="GPU-m",
        mig_enabled=True,
        mig_instances=(
            MigInstance(0, "MIG-ci0", 1, 0, "1c.3g.40gb", None, None),
            MigInstance(1, "MIG-ci1", 1, 1, "2c.3g.40gb", None, None),
        ),
    )
    analysis = cycle(xids=[xid(1, gpu=2, uuid="GPU-m", gi=1, ci=0)])
    nvml = replace(analysis.node.nvml, gpus=(split,))
    allocations = (
        alloc("mig", "on-ci0", 2, "GPU-m", "MIG-ci0"),
        alloc("mig", "on-ci1", 2, "GPU-m", "MIG-ci1"),
    )
    analysis = replace(
        analysis,
        node=replace(analysis.node, nvml=nvml),
        attribution=replace(analysis.attribution, allocations=allocations),
    )
    ((t,),), _ = run(analysis)
    assert t.mig_uuid == "MIG-ci0"
    assert [p.name for p in t.pods] == ["on-ci0"]


def test_xid_counts_carry_while_nvml_is_down_so_nothing_is_counted_twice() -> None:
    (_, down, again), _ = run(
        cycle(xids=[xid(3)]), cycle(nvml_ok=False, xids=[xid(3)]), cycle(xids=[xid(3)])
    )
    assert kinds(down) == ["source_down"]
    assert kinds(again) == ["source_up"]


# -- unhealthy and healthy ---------------------------------------------------------------


def test_a_gained_unhealthy_reason_gives_gpu_unhealthy_with_pods_and_reasons() -> None:
    ecc = health((0, "GPU-a", (ECC, THERMAL)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    ecc_remap = health((0, "GPU-a", (ECC, REMAP)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    (became, same, gained, clear), facts = run(
        cycle(verdicts=ecc), cycle(verdicts=ecc), cycle(verdicts=ecc_remap), cycle()
    )
    (t,) = became
    assert (t.kind, t.gpu, t.uuid, t.pods) == ("gpu_unhealthy", 0, "GPU-a", TRAIN_PODS)
    assert t.reasons == (ECC,)  # only what makes it unhealthy; degraded is not named
    assert same == ()
    assert kinds(gained) == ["gpu_unhealthy"] and gained[0].reasons == (ECC, REMAP)
    assert kinds(clear) == ["gpu_healthy"] and clear[0].uuid == "GPU-a"
    assert facts.unhealthy == {}


def test_a_degraded_only_verdict_is_no_transition() -> None:
    hot = health((0, "GPU-a", (THERMAL,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    (a, b), facts = run(cycle(verdicts=hot), cycle())
    assert a == b == ()
    assert facts.unhealthy == {}


def test_nvml_down_carries_every_fact_and_says_nothing_is_healthy_or_back() -> None:
    bad = health((0, "GPU-a", (LOST,)), (1, "GPU-b", (ECC,)), (2, "GPU-m", ()))
    leak = UnallocatedUse(ContainerRef("ml", "infer", "main"), DeviceRef(0, "GPU-a"), 2**30, 1)
    dead = OrphanedMemory(0, "GPU-a", "dead_process", 2**30, 1, NOW - 50)
    (_, down, back), facts = run(
        cycle(verdicts=bad, leaks=[leak], orphans=[dead]),
        cycle(nvml_ok=False, timestamp=NOW + 10),
        cycle(verdicts=bad, leaks=[leak], orphans=[dead], timestamp=NOW + 20),
    )
    assert kinds(down) == ["source_down"] and down[0].source == "nvml"
    assert kinds(back) == ["source_up"]  # nothing lost, unhealthy, leaked or orphaned anew
    assert facts.unhealthy == {
        "GPU-a": frozenset({"gpu_lost"}),
        "GPU-b": frozenset({"uncorrectable_ecc"}),
    }
    assert len(facts.leaks) == 1 and facts.orphans == frozenset({("GPU-a", "dead_process")})


def test_facts_while_nvml_is_down_equal_the_facts_before() -> None:
    bad = health((0, "GPU-a", (LOST,)), (1, "GPU-b", (ECC,)), (2, "GPU-m", ()))
    dead = OrphanedMemory(0, "GPU-a", "dead_process", 2**30, 1, NOW - 50)
    (_,), before = run(cycle(verdicts=bad, orphans=[dead], xids=[xid(2)]))
    (_,), during = run(cycle(nvml_ok=False), facts=before)
    assert during.unhealthy == before.unhealthy
    assert during.orphans == before.orphans
    assert during.leaks == before.leaks


def test_a_gpu_not_listed_keeps_its_facts() -> None:
    bad = health((0, "GPU-a", (ECC,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    without_a = health((1, "GPU-b", ()), (2, "GPU-m", ()))
    (_, missing, listed_healthy), _ = run(cycle(verdicts=bad), cycle(verdicts=without_a), cycle())
    assert missing == ()
    assert kinds(listed_healthy) == ["gpu_healthy"]


# -- isolation leaks -------------------------------------------------------------------


LEAK = UnallocatedUse(ContainerRef("ml", "infer", "main"), DeviceRef(0, "GPU-a"), 3 * 2**30, 2)


def test_a_new_isolation_leak_is_one_transition_naming_the_leaking_pod() -> None:
    (first, repeated), _ = run(cycle(leaks=[LEAK]), cycle(leaks=[LEAK]))
    (t,) = first
    assert (t.kind, t.gpu, t.uuid, t.memory_bytes) == ("isolation_leak", 0, "GPU-a", 3 * 2**30)
    assert t.pods == (PodRef("ml", "infer", "uid-infer"),)
    assert t.container == LEAK.container
    assert repeated == ()


def test_a_leak_is_carried_while_podresources_is_down_and_not_reported_again() -> None:
    no_kubelet = {**UP, "podresources": False}
    (_, down, back), facts = run(
        cycle(leaks=[LEAK]), cycle(sources=no_kubelet), cycle(leaks=[LEAK])
    )
    assert kinds(down) == ["source_down"]
    assert kinds(back) == ["source_up"]
    assert len(facts.leaks) == 1


def test_a_leak_that_ended_with_evidence_is_reported_again_when_it_returns() -> None:
    (_, ended, again), _ = run(cycle(leaks=[LEAK]), cycle(), cycle(leaks=[LEAK]))
    assert ended == ()
    assert kinds(again) == ["isolation_leak"]


# -- orphaned memory -----------------------------------------------------------------------


def dead_pid(pid: int) -> AttributedProcess:
    return AttributedProcess(0, "GPU-a", None, None, None, pid, 2**30, None, "compute", "dead")


DEAD = OrphanedMemory(0, "GPU-a", "dead_process", 2**30, 1, NOW - 30)


def test_dead_process_memory_names_the_dead_pid_as_listed_and_clearing_is_told() -> None:
    """The dead pid is what NVML lists, never a holder: it holds nothing."""
    (appeared, same, cleared), facts = run(
        cycle(orphans=[DEAD], processes=[dead_pid(4242)]),
        cycle(orphans=[DEAD], processes=[dead_pid(4242)]),
        cycle(),
    )
    (t,) = appeared
    assert (t.kind, t.uuid, t.orphan_kind, t.memory_bytes) == (
        "orphaned_memory",
        "GPU-a",
        "dead_process",
        2**30,
    )
    assert (t.dead_pids, t.holders) == ((4242,), ())
    assert same == ()
    assert kinds(cleared) == ["orphaned_memory_cleared"]
    assert (cleared[0].gpu, cleared[0].orphan_kind) == (0, "dead_process")
    assert facts.orphans == frozenset()


def test_dead_process_memory_names_the_live_holder_the_scan_found() -> None:
    """What an H200 on driver 580.159.04 showed: the killed parent stays listed, its
    forked child keeps the device open; the child is the holder."""
    child = OrphanHolder(0, "GPU-a", 601, None, None, None, "python3", "holder")
    ((t,),), _ = run(
        cycle(
            orphans=[DEAD],
            processes=[dead_pid(533)],
            holders=[child],
            asks_scan=["GPU-a"],
            scanned=["GPU-a"],
        )
    )
    assert (t.orphan_kind, t.dead_pids, t.holders) == ("dead_process", (533,), (child,))


def test_orphaned_memory_is_not_cleared_while_procfs_is_down() -> None:
    no_proc = {**UP, "procfs": False}
    (_, down, up), facts = run(cycle(orphans=[DEAD]), cycle(sources=no_proc), cycle(orphans=[DEAD]))
    assert kinds(down) == ["source_down"]
    assert kinds(up) == ["source_up"]
    assert facts.orphans == frozenset({("GPU-a", "dead_process")})


FRESH = OrphanedMemory(0, "GPU-a", "unattributed", 2**30, 0, NOW - 20)  # confirmed now


def test_orphaned_memory_waits_one_cycle_for_the_scan_it_asks_for() -> None:
    """The scan this cycle asks for answers in the next one: an Event worth waiting for.
    Dates do not matter (unattributed memory is confirmed cycles after it was first
    seen); whether the scan shown has covered the GPU does."""
    child = OrphanHolder(0, "GPU-a", 77, "ml", "gone", "main", "python", "holder")
    for orphan in (FRESH, DEAD):
        (waiting, named), facts = run(
            cycle(orphans=[orphan], processes=[dead_pid(9)], asks_scan=["GPU-a"]),
            cycle(
                orphans=[orphan],
                processes=[dead_pid(9)],
                holders=[child],
                asks_scan=["GPU-a"],
                scanned=["GPU-a"],
                timestamp=NOW + 10,
            ),
        )
        assert waiting == ()
        (t,) = named
        assert (t.kind, t.orphan_kind, t.holders) == ("orphaned_memory", orphan.kind, (child,))
        assert facts.orphans == frozenset({("GPU-a", orphan.kind)})


def test_orphaned_memory_waits_only_once_and_not_for_a_gpu_no_scan_was_asked_for() -> None:
    """A scan that does not come (its source failed) must not hold the Event back, nor
    must a GPU the scan cannot cover (no minor number), nor one it covered already."""
    (waiting, told), _ = run(
        cycle(orphans=[FRESH], asks_scan=["GPU-a"]),
        cycle(orphans=[FRESH], asks_scan=["GPU-a"], timestamp=NOW + 10),
    )
    assert waiting == ()
    assert [(t.orphan_kind, t.holders) for t in told] == [("unattributed", ())]
    ((t,),), _ = run(cycle(orphans=[FRESH]))
    assert t.orphan_kind == "unattributed"
    ((t,),), _ = run(cycle(orphans=[DEAD], asks_scan=["GPU-a"], scanned=["GPU-a"]))
    assert t.orphan_kind == "dead_process"


def test_an_empty_holder_list_from_no_complete_scan_is_unknown_never_none_found() -> None:
    """After its one wait the Event goes out without holders; it must not say that no
    process holds the memory when no complete scan covered the GPU (none came, or the
    walk stopped at its time or pid bound before reaching the holder): that is unknown.
    A complete scan that covered the GPU and found nobody may say so."""
    truncated = replace(scan_of(["GPU-a"]), truncated=True, resume_pid=4000)
    for orphan in (FRESH, DEAD):
        (_, (late,)), _ = run(
            cycle(orphans=[orphan], processes=[dead_pid(9)], asks_scan=["GPU-a"]),
            cycle(
                orphans=[orphan], processes=[dead_pid(9)], asks_scan=["GPU-a"], timestamp=NOW + 10
            ),
        )
        analysis = cycle(orphans=[orphan], processes=[dead_pid(9)], asks_scan=["GPU-a"])
        analysis = replace(analysis, node=replace(analysis.node, holder_scan=truncated))
        ((cut,),), _ = run(analysis)
        for t in (late, cut):
            note = describe(t)[2]
            assert "holding it was found" not in note, note
            assert "not known" in note, note
        ((done,),), _ = run(
            cycle(orphans=[orphan], processes=[dead_pid(9)], asks_scan=["GPU-a"], scanned=["GPU-a"])
        )
        assert "holding it was found" in describe(done)[2]


def test_unattributed_orphaned_memory_with_holders_found_is_named_at_once() -> None:
    holder = OrphanHolder(0, "GPU-a", 77, "ml", "gone", "main", "python", "holder")
    ((t,),), _ = run(cycle(orphans=[FRESH], holders=[holder], asks_scan=["GPU-a"]))
    assert t.holders == (holder,)


def test_unattributed_memory_that_goes_before_it_was_named_is_never_cleared() -> None:
    (waiting, gone), _ = run(cycle(orphans=[FRESH], asks_scan=["GPU-a"]), cycle(timestamp=NOW + 10))
    assert waiting == gone == ()


# -- sources ------------------------------------------------------------------------------


def test_a_source_down_at_start_is_told_once_and_then_up() -> None:
    no_kube = {**UP, "kube": False}
    (start, still, up), facts = run(
        cycle(sources=no_kube),
        cycle(sources=no_kube),
        cycle(sources={**UP, "kube": True}),
        facts=HealthFacts(),
    )
    (t,) = start
    assert (t.kind, t.source, t.detail) == ("source_down", "kube", "refused")
    assert still == ()
    assert kinds(up) == ["source_up"] and up[0].source == "kube"
    assert facts.sources_up["kube"] is True


def test_sources_up_at_start_and_a_source_missing_from_a_cycle_say_nothing() -> None:
    (start, missing, back), facts = run(
        cycle(sources={**UP, "dcgm": True}),
        cycle(sources=dict(UP)),
        cycle(sources={**UP, "dcgm": True}),
        facts=HealthFacts(),
    )
    assert start == missing == back == ()
    assert facts.sources_up["dcgm"] is True


# -- pod UIDs -----------------------------------------------------------------------------


def test_pod_uid_comes_from_pod_metadata_and_is_none_when_no_source_knows_it() -> None:
    lost = health((0, "GPU-a", (LOST,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    ((t,),), _ = run(cycle(verdicts=lost))
    assert [p.uid for p in t.pods] == ["uid-train-a", "uid-train-b"]
    ((t,),), _ = run(cycle(verdicts=lost, pod_meta=None))
    assert [p.uid for p in t.pods] == [None, None]


def test_pod_uid_comes_from_a_process_of_the_pod_when_the_api_is_not_watched() -> None:
    process = AttributedProcess(
        0, "GPU-a", None, None, None, 10, 2**30, None, "compute", "pod",
        namespace="ml", pod="train-a", container="main", pod_uid="uid-from-procfs",
    )  # fmt: skip
    lost = health((0, "GPU-a", (LOST,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    ((t,),), _ = run(cycle(verdicts=lost, pod_meta=None, processes=[process]))
    assert [p.uid for p in t.pods] == ["uid-from-procfs", None]


def test_two_gpus_answering_with_one_uuid_give_no_transition_and_keep_the_facts() -> None:
    """One lost, one healthy, same UUID: facts kept per UUID would flip every cycle and
    tell Kubernetes that a lost GPU is healthy."""
    twins = health((0, "GPU-a", ()), (1, "GPU-a", (LOST,)), (2, "GPU-m", ()))
    outs, facts = run(cycle(), cycle(verdicts=twins), cycle(verdicts=twins))
    assert [kinds(o) for o in outs] == [[], [], []]
    assert "GPU-a" not in facts.unhealthy


def test_a_gpu_known_unhealthy_and_no_longer_listed_is_named_as_unlisted() -> None:
    from exporter.analysis.transitions import with_transitions

    ecc = health((0, "GPU-a", (LOST,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    _, facts = run(cycle(verdicts=ecc))
    gone = cycle(verdicts=health((1, "GPU-b", ()), (2, "GPU-m", ())))
    analysis, _ = with_transitions(gone, facts)
    assert analysis.unlisted_unhealthy == (("GPU-a", ("gpu_lost",)),)
    assert analysis.transitions == ()
