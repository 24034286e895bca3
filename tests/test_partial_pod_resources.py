"""A PodResources answer that is OK but partial (a kubelet just restarted, a lost device
checkpoint, init containers it never lists): no leak and no free capacity on what it
leaves out (docs/attribution.md, "Isolation leaks"; docs/health.md, "Unknown"). Driven
through the pure pipeline, cycle by cycle, as the agent runs it."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import pytest

from exporter.analysis.pipeline import Policy, analyse, initial_state
from exporter.model import (
    AllocatableDevices,
    Analysis,
    ContainerDevices,
    GpuProcess,
    GpuSample,
    NodeSnapshot,
    NvmlSnapshot,
    PodMeta,
    PodMetaSnapshot,
    PodResourcesSnapshot,
    ProcessIdentity,
)

GIB = 1024**3
UUIDS = ("GPU-00000000-0000-0000-0000-000000000000", "GPU-11111111-1111-1111-1111-111111111111")
ADVERTISED = (AllocatableDevices("nvidia.com/gpu", UUIDS),)
PODS = (("a", "uid-a", "a" * 64, 10), ("b", "uid-b", "b" * 64, 20))  # name, uid, cid, pid


def answer(seq: int, devices: Sequence[int], listed: Sequence[int]) -> PodResourcesSnapshot:
    """A List answer naming pods ``listed``, with devices only for pods ``devices``."""
    return PodResourcesSnapshot(
        ok=True,
        timestamp=float(seq),
        containers=tuple(
            ContainerDevices("ml", PODS[i][0], "main", "nvidia.com/gpu", (UUIDS[i],))
            for i in devices
        ),
        allocatable=ADVERTISED,
        allocatable_ok=True,
        listed=frozenset(("ml", PODS[i][0], "main") for i in listed),
        sequence=seq,
        begun=seq,
    )


def snapshot(
    t: float, pod_resources: PodResourcesSnapshot, *, watch_ok: bool = True
) -> NodeSnapshot:
    gpus = tuple(
        GpuSample(
            index=i,
            uuid=UUIDS[i],
            minor_number=i,
            memory_total_bytes=80 * GIB,
            memory_used_bytes=GIB,
            memory_reserved_bytes=GIB // 2,
            processes=(GpuProcess(pid=PODS[i][3], memory_used_bytes=GIB, kind="compute"),),
        )
        for i in range(2)
    )
    return NodeSnapshot(
        node_name="n1",
        nvml=NvmlSnapshot(ok=True, timestamp=t, gpus=gpus),
        timestamp=t,
        monotonic=t,
        processes=tuple(
            ProcessIdentity(pid=pid, alive=True, pod_uid=uid, container_id=cid, comm="python3")
            for _, uid, cid, pid in PODS
        ),
        pod_resources=pod_resources,
        pod_meta=PodMetaSnapshot(
            ok=watch_ok,
            timestamp=t,
            pods=tuple(
                PodMeta(uid=uid, namespace="ml", name=name, containers=((cid, "main"),))
                for name, uid, cid, _ in PODS
            ),
        ),
    )


def run(partial: Callable[[int], PodResourcesSnapshot], *, watch_ok: bool = True) -> list[Analysis]:
    """3 whole answers, 3 partial ones, 2 whole ones again."""
    policy = Policy()
    state = initial_state(policy, {})
    analyses = []
    for seq in range(1, 9):
        whole = answer(seq, devices=(0, 1), listed=(0, 1))
        pod_resources = partial(seq) if 4 <= seq <= 6 else whole
        analysis, state = analyse(
            snapshot(1000.0 + 10 * seq, pod_resources, watch_ok=watch_ok or seq < 4),
            state,
            policy,
        )
        analyses.append(analysis)
    return analyses


PARTIAL = {
    # the kubelet lists pod a's container without the device it held (device records lost)
    "devices missing": lambda seq: answer(seq, devices=(1,), listed=(0, 1)),
    # pod a left out (a kubelet whose pod list is not refilled yet)
    "pod left out": lambda seq: answer(seq, devices=(1,), listed=(1,)),
    # every pod left out (a kubelet just restarted)
    "empty": lambda seq: answer(seq, devices=(), listed=()),
}


@pytest.mark.parametrize("case", sorted(PARTIAL))
def test_a_partial_answer_is_no_leak_and_no_free_gpu(case: str) -> None:
    """Before (an adversarial review): devices missing raised GPUIsolationLeak for
    pod a; every case counted the GPUs its pods run on as allocatable."""
    analyses = run(PARTIAL[case])
    for seq, analysis in enumerate(analyses, start=1):
        ((allocated, allocatable),) = [(c.allocated, c.allocatable) for c in analysis.capacity]
        assert analysis.attribution.unallocated_use == (), seq
        assert [t.kind for t in analysis.transitions if t.kind == "isolation_leak"] == [], seq
        if 4 <= seq <= 6:
            assert (allocated, allocatable) == (None, None), seq  # unknown, not free
        else:
            assert (allocated, allocatable) == (2, 0), seq


def test_with_the_watch_down_a_pod_left_out_frees_no_gpu() -> None:
    """The pod watch down too: pod a's process cannot be named, and the answer allocates
    nothing on its GPU: still not free."""
    analyses = run(PARTIAL["pod left out"], watch_ok=False)
    assert [(c.allocated, c.allocatable) for c in analyses[4].capacity] == [(None, None)]


def test_a_container_listed_without_a_device_it_never_held_still_leaks() -> None:
    """The other side: pod a's container listed from the start with no device, its
    process on GPU 0: a leak once an answer postdates the process."""
    policy = Policy()
    state = initial_state(policy, {})
    leaks = []
    for seq in range(1, 4):
        pod_resources = answer(seq, devices=(1,), listed=(0, 1))
        analysis, state = analyse(snapshot(1000.0 + 10 * seq, pod_resources), state, policy)
        leaks.append(
            [(u.container.pod, u.device.gpu) for u in analysis.attribution.unallocated_use]
        )
    assert leaks[-1] == [("a", 0)]


def test_an_allocation_only_a_stale_answer_showed_is_not_remembered() -> None:
    """Pod a re-created under its name: the first answer its process meets predates it and
    still gives a/main GPU 0 (its predecessor's); the new pod got GPU 1 and its process
    runs on GPU 0: a leak from the first answer that postdates the process (an
    adversarial review: the stale answer's allocation was remembered, the leak hidden for good)."""
    policy = Policy()
    state = initial_state(policy, {})
    leaks = []
    for seq in range(1, 5):
        device = UUIDS[0] if seq == 1 else UUIDS[1]  # seq 1: the predecessor's allocation
        pod_resources = PodResourcesSnapshot(
            ok=True,
            timestamp=float(seq),
            containers=(ContainerDevices("ml", "a", "main", "nvidia.com/gpu", (device,)),),
            allocatable=ADVERTISED,
            allocatable_ok=True,
            listed=frozenset({("ml", "a", "main")}),
            sequence=seq,
            begun=seq,
        )
        analysis, state = analyse(snapshot(1000.0 + 10 * seq, pod_resources), state, policy)
        use = analysis.attribution.unallocated_use
        leaks.append([(u.container.pod, u.device.gpu) for u in use])
    assert leaks == [[], [("a", 0)], [("a", 0)], [("a", 0)]]


def test_an_owner_named_by_guess_is_not_remembered_as_allocated() -> None:
    """Pod a's `side` container (no GPU) runs on GPU 0, allocated to `main`; for one cycle
    the pod status does not list side's container id yet, so the process is named as
    main's, allocated: side's leak is still reported once it is named (an
    adversarial review: the guess was remembered as an allocation, the leak never reported)."""
    policy = Policy()
    state = initial_state(policy, {})
    leaks = []
    for seq in range(1, 5):
        listed = frozenset({("ml", "a", "main"), ("ml", "a", "side"), ("ml", "b", "main")})
        pod_resources = replace(answer(seq, devices=(0, 1), listed=(0, 1)), listed=listed)
        base = snapshot(1000.0 + 10 * seq, pod_resources)
        assert base.pod_meta is not None
        side = ("c" * 64, "side")
        containers = (("a" * 64, "main"),) if seq == 1 else (("a" * 64, "main"), side)
        pods = tuple(
            replace(p, containers=containers) if p.name == "a" else p for p in base.pod_meta.pods
        )
        processes = tuple(
            replace(p, container_id="c" * 64) if p.pid == 10 else p for p in base.processes
        )
        node = replace(base, pod_meta=replace(base.pod_meta, pods=pods), processes=processes)
        analysis, state = analyse(node, state, policy)
        use = analysis.attribution.unallocated_use
        leaks.append([(u.container.container, u.device.gpu) for u in use])
    assert leaks[1:] == [[("side", 0)]] * 3
