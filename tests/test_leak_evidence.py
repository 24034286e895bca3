"""The isolation-leak evidence rule (docs/attribution.md, "Isolation leaks"), pure parts:
a container the kubelet's answer does not name is unknown; a process is judged only by an
answer begun after it was first seen; MPS's daemons and other resource names are unknown;
and the true leak stays a leak."""

from __future__ import annotations

from dataclasses import replace

from exporter.analysis.allocation_evidence import settled_pids
from exporter.analysis.attribution import attribute, is_mps_daemon
from exporter.kubelet_api import api_pb2
from exporter.model import ContainerDevices, NodeSnapshot, PodResourcesSnapshot
from exporter.sim.podresources_server import build_pod_resources
from exporter.sources.podresources.answer import list_answer
from tests.harness import simulated_exporter
from tests.test_attribution import CID_A, G0, G1, UID_A, GiB, alloc, gpu, ident, node, pod, proc

A_MAIN = ("ml", "a", "main")


def leaking(listed: frozenset[tuple[str, str, str]] = frozenset({A_MAIN})) -> NodeSnapshot:
    """Pod a's main holds G0 and runs a process (pid 2) on G1 too."""
    snapshot = node(
        gpu(0, G0, proc(1, GiB)),
        gpu(1, G1, proc(2, GiB)),
        identities=(ident(1, UID_A, CID_A), ident(2, UID_A, CID_A)),
        pods=(pod(UID_A, "a", (CID_A, "main")),),
        allocations=(alloc("a", "main", G0),),
    )
    assert snapshot.pod_resources is not None
    return replace(snapshot, pod_resources=replace(snapshot.pod_resources, listed=listed))


def allocated(snapshot: NodeSnapshot, **kwargs: object) -> dict[int, bool | None]:
    return {p.pid: p.allocated for p in attribute(snapshot, **kwargs).processes}  # type: ignore[arg-type]


def with_answer(snapshot: NodeSnapshot, **fields: object) -> NodeSnapshot:
    assert snapshot.pod_resources is not None
    return replace(snapshot, pod_resources=replace(snapshot.pod_resources, **fields))  # type: ignore[arg-type]


def test_a_listed_container_on_a_gpu_it_was_not_given_is_a_leak() -> None:
    assert allocated(leaking()) == {1: True, 2: False}


def test_a_container_the_answer_does_not_name_is_unknown_not_unallocated() -> None:
    # an empty answer from a kubelet that has just restarted names nobody
    empty = with_answer(leaking(frozenset()), containers=())
    assert allocated(empty) == {1: None, 2: None}
    assert attribute(empty).unallocated_use == ()


def test_a_process_is_judged_only_by_an_answer_begun_after_it_was_first_seen() -> None:
    first = with_answer(leaking(), sequence=3, begun=3)  # answer 3 was under way or done
    settled, memory = settled_pids(first, {})
    assert settled == frozenset()
    assert allocated(first, settled=settled)[2] is None
    # answer 3 again, a later cycle: still not after the first sighting
    settled, memory = settled_pids(first, memory)
    assert settled == frozenset()
    later = with_answer(leaking(), sequence=4, begun=4)
    settled, memory = settled_pids(later, memory)
    assert settled == frozenset({1, 2})
    assert allocated(later, settled=settled) == {1: True, 2: False}


def test_the_first_seen_memory_keeps_only_what_nvml_lists_now() -> None:
    first = with_answer(leaking(), sequence=1, begun=1)
    _, memory = settled_pids(first, {})
    assert set(memory) == {(1, UID_A, CID_A), (2, UID_A, CID_A)}
    gone = replace(first, nvml=replace(first.nvml, gpus=(gpu(0, G0, proc(1, GiB)),)))
    _, memory = settled_pids(gone, memory)
    assert set(memory) == {(1, UID_A, CID_A)}


def test_a_pid_taken_by_another_container_is_a_new_sighting() -> None:
    first = with_answer(leaking(), sequence=1, begun=1)
    _, memory = settled_pids(first, {})
    reused = replace(first, processes=(ident(1, UID_A, CID_A), ident(2, UID_A, "d" * 64)))
    settled, _ = settled_pids(with_answer(reused, sequence=2, begun=2), memory)
    assert settled == frozenset({1})  # pid 2 is someone new: answer 2 may predate it


def test_mps_daemons_are_never_a_leak() -> None:
    assert is_mps_daemon("nvidia-cuda-mps")  # control daemon and server, cut to 15 bytes
    assert not is_mps_daemon("python3") and not is_mps_daemon(None)
    snapshot = leaking()
    server = replace(ident(2, UID_A, CID_A), comm="nvidia-cuda-mps")
    assert allocated(replace(snapshot, processes=(ident(1, UID_A, CID_A), server)))[2] is None


def test_a_gpu_under_another_resource_name_is_unknown_and_counted() -> None:
    other = (ContainerDevices("ml", "a", "main", "example.com/gpu", (G1,)),)
    snapshot = with_answer(leaking(), other_devices=other)
    result = attribute(snapshot)
    assert {p.pid: p.allocated for p in result.processes} == {1: True, 2: None}
    assert result.other_resource_devices == (("example.com/gpu", 1),)


def test_a_pod_with_claims_the_kubelet_does_not_report_is_unknown() -> None:
    snapshot = leaking()
    assert snapshot.pod_meta is not None
    claiming = replace(snapshot.pod_meta.pods[0], resource_claims=True)
    snapshot = replace(snapshot, pod_meta=replace(snapshot.pod_meta, pods=(claiming,)))
    assert allocated(snapshot)[2] is None
    # with the gate on the kubelet reports the pod's claims: judged as usual
    assert allocated(with_answer(snapshot, claims_reported=frozenset({("ml", "a")})))[2] is False


def test_a_process_first_seen_while_the_kubelet_is_down_waits_for_a_later_answer() -> None:
    down = with_answer(leaking(), ok=False, sequence=0, begun=0)
    settled, memory = settled_pids(down, {})
    assert (settled, memory) == (None, {})  # nothing recorded against no answer
    back = with_answer(leaking(), sequence=7, begun=7)  # may have begun before the process
    settled, memory = settled_pids(back, memory)
    assert settled == frozenset() and set(memory.values()) == {7}


def test_an_unnumbered_answer_is_judged_alone() -> None:
    settled, memory = settled_pids(leaking(), {})
    assert settled is None and memory
    assert settled_pids(replace(leaking(), pod_resources=None), memory)[0] is None
    assert PodResourcesSnapshot(ok=True, timestamp=0.0).sequence == 0


def test_the_list_answer_names_every_container_and_what_the_flag_leaves_out() -> None:
    pods = build_pod_resources(
        [
            ContainerDevices("ml", "a", "main", "nvidia.com/gpu", (G0,)),
            ContainerDevices("ml", "a", "side", "example.com/gpu", (G1,)),
        ],
        listed=[("ml", "a", "main"), ("ml", "a", "side"), ("ml", "b", "idle")],
    )
    raw = api_pb2.ListPodResourcesResponse(pod_resources=pods).SerializeToString()
    answer = list_answer(raw, ("nvidia.com/gpu",), frozenset({"gpu.nvidia.com"}))
    assert answer.listed == {("ml", "a", "main"), ("ml", "a", "side"), ("ml", "b", "idle")}
    assert [(c.container, c.device_ids) for c in answer.containers] == [("main", (G0,))]
    assert [(c.resource_name, c.device_ids) for c in answer.other_devices] == [
        ("example.com/gpu", (G1,))
    ]
    assert answer.claims_reported == frozenset()


async def test_the_podresources_source_numbers_its_refreshes() -> None:
    scenario: dict[str, object] = {"gpus": [{}], "pods": []}
    async with simulated_exporter(scenario, first_cycle=False) as h:
        first = h.pod_resources.read(None)  # type: ignore[arg-type]
        await h.refresh_pod_resources()
        second = h.pod_resources.read(None)  # type: ignore[arg-type]
    assert (first.sequence, first.begun) == (1, 1)  # the priming refresh
    assert (second.sequence, second.begun) == (2, 2)
