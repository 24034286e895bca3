"""Adversarial review of the Node watch and capacity's disrupted term (commit 5ba6797).

Each test is an attack. Tests named in ``BREAKS`` in the report fail on 5ba6797: they show
a bug (a Node whose blocking taint is not seen, a watch line that costs a relist, a Node
list that may take the process past its memory limit, a race in the API stand-in). The
others pin behaviour that held and is worth keeping (the watch that never answers, the
Node deleted and recreated, DRA device taints and a cordon counted once, the exporter
without the Kubernetes API).

Sources cited: kubernetes/kubernetes plugin/pkg/admission/extendedresourcetoleration/
admission.go (Admit: the toleration it adds is ``Key: <resource>, Operator: Exists,
Effect: NoSchedule``, one per extended resource the pod requests).
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.analysis.capacity import node_capacity, node_disruptions
from exporter.model import (
    AllocatableDevices,
    Allocation,
    ContainerRef,
    DeviceRef,
    GpuHealth,
    GpuSample,
    NodeScheduling,
    NodeSchedulingSnapshot,
    PodResourcesSnapshot,
    ResourceSliceSnapshot,
    SliceDevice,
)
from exporter.sim.kube_api import NODES, FakeKubeApi, write_kubeconfig
from exporter.sim.kube_writes import node_dict
from exporter.sources.node_watch import MAX_TAINTS, NodeWatcher, node_scheduling
from tests.harness import simulated_exporter
from tests.test_capacity_disrupted import SCENARIO, served
from tests.test_kube import NODE, fake, wait_for

__all__ = ["fake"]  # a fixture

TOLERATED: frozenset[str] = frozenset()  # the default: only the resource-keyed NoSchedule


def reasons_of(obj: dict[str, Any]) -> tuple[str, ...] | None:
    """What capacity concludes of a Node as the API would serialise it."""
    snapshot = NodeSchedulingSnapshot(ok=True, timestamp=0.0, node=node_scheduling(obj))
    return node_disruptions(snapshot, TOLERATED, "nvidia.com/gpu")


# -- 1. a blocking taint the reader does not see ----------------------------------------


def test_a_blocking_taint_past_the_first_max_taints_is_not_read_as_in_service() -> None:
    """BREAK: only the first MAX_TAINTS taints are read, so a NoSchedule taint after 64
    harmless ones is never seen and the node's free GPUs are served as allocatable.
    Kubernetes sets no limit on a Node's taints; a taint not read is no evidence that
    the node is in service."""
    harmless = [{"key": f"example.com/k{i}", "effect": "PreferNoSchedule"} for i in range(64)]
    node = {"spec": {"taints": [*harmless, {"key": "maintenance", "effect": "NoSchedule"}]}}
    assert len(harmless) == MAX_TAINTS
    assert reasons_of(node) != ()


@pytest.mark.parametrize(
    "taint",
    [
        {"key": "maintenance", "effect": 3},
        {"key": "maintenance", "effect": "NoSchedule\x00"},
        {"key": "maintenance", "effect": "x" * 100},
        "maintenance:NoSchedule",
    ],
    ids=["effect-not-a-string", "effect-unprintable", "effect-too-long", "not-an-object"],
)
def test_a_taint_that_cannot_be_read_is_not_read_as_in_service(taint: object) -> None:
    """BREAK: node_watch's docstring says a taint whose key or effect cannot be read
    "still blocks"; one whose effect cannot be read is kept with effect "" (not
    blocking) and one that is not an object is dropped, so the node reads in service."""
    assert reasons_of({"spec": {"taints": [taint]}}) != ()


def test_a_noexecute_taint_on_the_gpu_key_is_not_tolerated_by_default() -> None:
    """BREAK: the default tolerated key rests on the ExtendedResourceToleration admission
    plugin, whose toleration has effect NoSchedule only (admission.go, Admit). A pod
    with just that toleration does not tolerate nvidia.com/gpu:NoExecute: the scheduler
    keeps it off (and the taint evicts the running ones)."""
    node = {"spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoExecute"}]}}
    assert reasons_of(node) == ("node_taint",)


def test_the_gpu_pool_taint_is_not_known_tolerated_for_another_resource() -> None:
    """BREAK: ExtendedResourceToleration adds a toleration keyed by each extended resource
    the pod requests. A pod asking for time-sliced replicas under nvidia.com/gpu.shared
    (or a MIG resource, or a DRA claim: no extended resource at all) gets none for
    nvidia.com/gpu; yet an nvidia.com/gpu:NoSchedule taint is taken as tolerated for
    every resource of the node, so the replicas are served as allocatable."""
    gpus = [GpuSample(index=0, uuid="GPU-0")]
    replicas = ("GPU-0::0", "GPU-0::1")
    kubelet = PodResourcesSnapshot(
        ok=True,
        timestamp=0.0,
        allocatable=(AllocatableDevices("nvidia.com/gpu.shared", replicas),),
        allocatable_ok=True,
    )
    node = NodeScheduling(taints=(node_scheduling_taint("nvidia.com/gpu", "NoSchedule"),))
    (cap,) = node_capacity(
        gpus,
        [GpuHealth(0, "GPU-0")],
        kubelet,
        [],
        nvml_ok=True,
        scheduling=NodeSchedulingSnapshot(ok=True, timestamp=0.0, node=node),
    )
    assert (cap.resource, cap.healthy) == ("nvidia.com/gpu.shared", 2)
    assert (cap.disrupted, cap.allocatable) == (2, 0)


def node_scheduling_taint(key: str, effect: str) -> Any:
    (taint,) = node_scheduling({"spec": {"taints": [{"key": key, "effect": effect}]}}).taints
    return taint


# -- 2. held: the disrupted arithmetic on DRA devices -----------------------------------

DRIVER = "gpu.nvidia.com"


def dra_capacity(scheduling: NodeSchedulingSnapshot | None) -> Any:
    gpus = [GpuSample(index=i, uuid=f"GPU-{i}") for i in range(4)]
    health = [GpuHealth(i, f"GPU-{i}") for i in range(4)]
    devices = tuple(
        SliceDevice(
            DRIVER,
            "pool",
            f"gpu-{i}",
            (("uuid", f"GPU-{i}"),),
            ("NoSchedule",) if i in (1, 2) else (),
        )
        for i in range(4)
    )
    slices = ResourceSliceSnapshot(ok=True, timestamp=0.0, devices=devices)
    kubelet = PodResourcesSnapshot(ok=True, timestamp=0.0, allocatable=(), allocatable_ok=True)
    held = Allocation(
        ContainerRef("ml", "p", "c"), DeviceRef(2, "GPU-2", None), "pool/gpu-2", DRIVER, False
    )
    (cap,) = node_capacity(
        gpus, health, kubelet, [held], slices, nvml_ok=True, scheduling=scheduling
    )
    return cap


def test_a_tainted_dra_device_on_a_cordoned_node_counts_once_and_an_allocated_one_not_at_all() -> (
    None
):
    """HELD: gpu-1 (tainted, free) and gpu-2 (tainted, allocated): the cordon and the
    device taint on gpu-1 count it once in disrupted; gpu-2 is allocated, not disrupted."""
    cordoned = NodeSchedulingSnapshot(
        ok=True, timestamp=0.0, node=NodeScheduling(unschedulable=True)
    )
    cap = dra_capacity(cordoned)
    assert (cap.healthy, cap.allocated, cap.disrupted, cap.allocatable) == (4, 1, 3, 0)
    assert dict(cap.disrupted_by)["cordoned"] == 3
    assert dict(cap.disrupted_by)["device_taint"] == 1
    in_service = dra_capacity(NodeSchedulingSnapshot(ok=True, timestamp=0.0, node=NodeScheduling()))
    assert (in_service.disrupted, in_service.allocatable) == (1, 2)
    down = dra_capacity(NodeSchedulingSnapshot(ok=False, timestamp=0.0))
    assert (down.disrupted, down.allocatable, down.disrupted_by) == (None, None, ())


# -- 3. the watch against a hostile or broken API server --------------------------------


def start_watcher(url: str, tmp_path: Path, **kwargs: Any) -> NodeWatcher:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", url)
    watcher = NodeWatcher(NODE, kubeconfig=str(kubeconfig), **kwargs)
    watcher.start()
    return watcher


@pytest.fixture
def watching(fake: FakeKubeApi, tmp_path: Path) -> Iterator[NodeWatcher]:
    """A Node watch that has listed this node's Node and holds its watch open."""
    fake.writes.set_node(node_dict(NODE))
    watcher = start_watcher(fake.start_in_thread(), tmp_path)
    try:
        wait_for(lambda: watcher.snapshot().node is not None, 10.0, "the Node listed")
        wait_for(lambda: fake.watcher_count == 1, what="watch open")
        yield watcher
    finally:
        watcher.close()


@pytest.mark.slow
def test_a_node_event_whose_metadata_is_not_an_object_is_skipped_not_a_failed_watch(
    fake: FakeKubeApi, watching: NodeWatcher
) -> None:
    """BREAK: NodeWatcher._key reads ``(obj.get("metadata") or {}).get("name")``, which
    raises AttributeError for a string metadata; _apply calls it before anything checks
    the object, so one such line fails the watch window (an error counted, a relist)
    where a malformed line should be skipped and counted as dropped."""
    line = json.dumps({"type": "MODIFIED", "object": {"metadata": "garbage"}}).encode()
    fake.send_raw(line)
    time.sleep(1.0)
    snap = watching.snapshot()
    assert watching.errors_total == 0
    assert dict(snap.counts.relists).get("watch_failed", 0) == 0


@pytest.mark.slow
def test_the_node_deleted_then_recreated_is_unknown_then_read_again(
    fake: FakeKubeApi, watching: NodeWatcher
) -> None:
    """HELD: a DELETED event leaves no Node (capacity: unknown, never in service); the
    Node recreated cordoned is read as such."""
    assert fake._delete(NODES, NODE)
    wait_for(lambda: watching.snapshot().node is None, what="the Node gone")
    assert node_disruptions(watching.snapshot(), TOLERATED) is None
    recreated = node_dict(NODE)
    recreated["spec"] = {"unschedulable": True}
    fake.writes.set_node(recreated)
    wait_for(
        lambda: (node := watching.snapshot().node) is not None and node.unschedulable,
        what="the Node back, cordoned",
    )
    assert node_disruptions(watching.snapshot(), TOLERATED) == ("cordoned",)


@pytest.mark.slow
def test_a_node_list_that_never_answers_leaves_disruptions_unknown_and_reads_stay_instant(
    tmp_path: Path,
) -> None:
    """HELD: a server that accepts the connection and never answers: prime() returns at
    its timeout, read() stays a snapshot, the Node is unknown (never in service), and the
    LIST is cut at its deadline."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    watcher = start_watcher(url, tmp_path, list_deadline_s=1.0)
    try:
        began = time.monotonic()
        asyncio.run(watcher.prime(0.5))
        assert time.monotonic() - began < 3.0
        read_began = time.perf_counter()
        snap = watcher.snapshot()
        assert time.perf_counter() - read_began < 0.5  # not the LIST's 1 s
        assert not snap.ok and snap.node is None
        assert node_disruptions(snap, TOLERATED) is None
        wait_for(lambda: "request cut" in (watcher.snapshot().error or ""), 5.0, "LIST cut")
        assert node_disruptions(watcher.snapshot(), TOLERATED) is None
    finally:
        watcher.close()
        server.close()
        for conn in held:
            conn.close()


@pytest.mark.slow
def test_a_node_list_far_larger_than_any_node_is_refused(fake: FakeKubeApi, tmp_path: Path) -> None:
    """BREAK: the Node watch inherits the pod watch's 64 MiB LIST bound. One Node is at
    most ~1.5 MiB (etcd's request limit), but a 58 MiB Node list was measured here to
    take the process from 60 MiB RSS to a 322 MiB peak (the chart's limit is 256Mi):
    a hostile or broken answer OOM-kills the exporter. A list 8x etcd's limit must be
    refused, not parsed."""
    big = node_dict(NODE)
    taint = {"key": "example.com/k", "value": "v" * 60, "effect": "PreferNoSchedule"}
    big["spec"] = {"taints": [taint] * 130_000}  # ~12 MiB of JSON
    fake.writes.set_node(big)
    del big
    watcher = start_watcher(fake.start_in_thread(), tmp_path)
    try:
        wait_for(
            lambda: watcher.snapshot().error != "waiting for the first Node list",
            20.0,
            "the first LIST's outcome",
        )
        snap = watcher.snapshot()
        assert not snap.ok and snap.node is None, "a 12 MiB Node list was parsed"
    finally:
        watcher.close()


# -- 4. the API stand-in -----------------------------------------------------------------


@pytest.mark.slow
def test_the_stand_in_serves_the_node_its_writes_hold_after_concurrent_writes() -> None:
    """BREAK (simulator): KubeWrites.set_node (and the nodes/status PATCH) call on_node
    after releasing their lock, so two writes of the Node at once can reach the API's
    store in the other order: the Node served to the watch is then the older one, for
    good, and the harness's _node_watch_caught_up waits 2 s and goes on silently. 45 of
    300 pairs diverged in a run here."""
    api = FakeKubeApi()
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    diverged = 0
    try:
        for _ in range(200):
            barrier = threading.Barrier(2)

            def put(cordoned: bool, barrier: threading.Barrier = barrier) -> None:
                node = node_dict("racing")
                node["spec"] = {"unschedulable": cordoned}
                barrier.wait()
                api.writes.set_node(node)

            threads = [threading.Thread(target=put, args=(v,)) for v in (True, False)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(5.0)
            written = api.writes.node("racing")
            assert written is not None
            (listed,) = [n for n in api_nodes(api) if n["metadata"]["name"] == "racing"]
            if node_scheduling(written) != node_scheduling(listed):
                diverged += 1
    finally:
        sys.setswitchinterval(interval)
    assert diverged == 0, f"{diverged} of 200 concurrent write pairs left the two apart"


def api_nodes(api: FakeKubeApi) -> list[dict[str, Any]]:
    """The Nodes the stand-in lists and watches (its store)."""
    return [json.loads(json.dumps(n)) for n in api._objects["nodes"].values()]


# -- 5. held: without the Kubernetes API ------------------------------------------------


@pytest.mark.slow
async def test_without_the_kube_api_allocatable_is_served_and_no_node_reason_is() -> None:
    """HELD: --kube-api off: no Node watch; allocatable is healthy - allocated (the
    documented upper bound) even while the timeline cordons the Node, disrupted is
    absent, and of the reasons only device_taint (0) is served (docs/metrics.md)."""
    async with simulated_exporter(SCENARIO, kube_api=False) as h:
        await h.refresh_pod_resources()
        await h.advance(15)  # the timeline cordons the Node at 10
        states, reasons = served(await h.scrape())
        assert h.agent.source("node") is None
    assert states["allocatable"] == states["healthy"] - states["allocated"] == 2
    assert "disrupted" not in states
    assert reasons == {"device_taint": 0}
