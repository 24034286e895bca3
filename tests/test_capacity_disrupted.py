"""The disrupted term of node capacity (docs/capacity.md): healthy, unallocated devices
that a new pod could still not get, by reason, and ``allocatable`` without them.

The pure rule (analysis/capacity.py) on frozen values first, then what the real exporter
serves on the simulated node when the timeline cordons, taints and labels its Node in the
API stand-in (the real ``kubernetes`` client watching it).
"""

from __future__ import annotations

from typing import Any

import pytest

from exporter.analysis.capacity import node_capacity, node_disruptions
from exporter.model import (
    Allocation,
    ContainerRef,
    DeviceRef,
    GpuHealth,
    GpuSample,
    NodeScheduling,
    NodeSchedulingSnapshot,
    NodeTaint,
    PodResourcesSnapshot,
)
from exporter.model.readings import AllocatableDevices
from exporter.sources.node_watch import MAX_TAINTS, node_scheduling
from tests.harness import Scrape, simulated_exporter

NONE: frozenset[str] = frozenset()  # the default: no key tolerated whatever the effect
GPU = "nvidia.com/gpu"


def watched(node: NodeScheduling | None, ok: bool = True) -> NodeSchedulingSnapshot:
    return NodeSchedulingSnapshot(ok=ok, timestamp=0.0, node=node)


@pytest.mark.parametrize(
    ("node", "reasons"),
    [
        (NodeScheduling(), ()),
        (NodeScheduling(unschedulable=True), ("cordoned",)),
        # the taint the API server adds to a cordoned node counts as the cordon
        (
            NodeScheduling(
                taints=(NodeTaint("node.kubernetes.io/unschedulable", "", "NoSchedule"),)
            ),
            ("cordoned",),
        ),
        (NodeScheduling(taints=(NodeTaint("maintenance", "x", "NoSchedule"),)), ("node_taint",)),
        (
            NodeScheduling(taints=(NodeTaint("node.kubernetes.io/not-ready", "", "NoExecute"),)),
            ("node_taint",),
        ),
        # a taint whose key could not be read still blocks
        (NodeScheduling(taints=(NodeTaint("", "", "NoSchedule"),)), ("node_taint",)),
        # GPU pods tolerate the GPU pool's own NoSchedule taint (ExtendedResourceToleration
        # adds it), not a NoExecute one; PreferNoSchedule only discourages
        (NodeScheduling(taints=(NodeTaint("nvidia.com/gpu", "present", "NoSchedule"),)), ()),
        (NodeScheduling(taints=(NodeTaint("nvidia.com/gpu", "", "NoExecute"),)), ("node_taint",)),
        # an effect that could not be read blocks
        (NodeScheduling(taints=(NodeTaint("maintenance", "", "?"),)), ("node_taint",)),
        (NodeScheduling(taints=(NodeTaint("maintenance", "x", "PreferNoSchedule"),)), ()),
        (NodeScheduling(driver_upgrade_state="drain-required"), ("driver_upgrade",)),
        (NodeScheduling(driver_upgrade_state="upgrade-failed"), ("driver_upgrade",)),
        (
            NodeScheduling(driver_upgrade_state="some-state-a-newer-operator-adds"),
            ("driver_upgrade",),
        ),
        (NodeScheduling(driver_upgrade_state="upgrade-required"), ()),
        (NodeScheduling(driver_upgrade_state="upgrade-done"), ()),
        (NodeScheduling(driver_upgrade_state=""), ()),
        (
            NodeScheduling(
                unschedulable=True,
                taints=(NodeTaint("maintenance", "", "NoExecute"),),
                driver_upgrade_state="cordon-required",
            ),
            ("cordoned", "driver_upgrade", "node_taint"),
        ),
    ],
)
def test_the_reasons_a_node_takes_its_free_gpus_out_of_capacity(
    node: NodeScheduling, reasons: tuple[str, ...]
) -> None:
    assert node_disruptions(watched(node), NONE, GPU) == reasons


def test_the_resource_keyed_toleration_is_that_resources_only() -> None:
    node = NodeScheduling(taints=(NodeTaint("nvidia.com/gpu", "present", "NoSchedule"),))
    # a pod asking for nvidia.com/gpu.shared gets no toleration for nvidia.com/gpu
    assert node_disruptions(watched(node), NONE, "nvidia.com/gpu.shared") == ("node_taint",)
    # unless the operator says GPU pods tolerate it (--capacity-tolerated-taints)
    said = frozenset({"nvidia.com/gpu"})
    assert node_disruptions(watched(node), said, "nvidia.com/gpu.shared") == ()
    noexec = NodeScheduling(taints=(NodeTaint("dedicated", "gpu", "NoExecute"),))
    assert node_disruptions(watched(noexec), frozenset({"dedicated"}), GPU) == ()


def test_a_node_that_cannot_be_read_is_unknown_never_in_service() -> None:
    assert node_disruptions(watched(None), NONE, GPU) is None  # no Node of this name
    assert node_disruptions(watched(NodeScheduling(), ok=False), NONE, GPU) is None
    assert node_disruptions(None, NONE, GPU) == ()  # not watched: see the next tests


def four_gpus() -> tuple[list[GpuSample], list[GpuHealth]]:
    gpus = [GpuSample(index=i, uuid=f"GPU-{i}") for i in range(4)]
    health = [GpuHealth(i, f"GPU-{i}") for i in range(4)]
    return gpus, health


def kubelet(allocated: list[str]) -> tuple[PodResourcesSnapshot, list[Allocation]]:
    snapshot = PodResourcesSnapshot(
        ok=True,
        timestamp=0.0,
        allocatable=(AllocatableDevices("nvidia.com/gpu", tuple(f"GPU-{i}" for i in range(4))),),
        allocatable_ok=True,
    )
    allocations = [
        Allocation(
            ContainerRef("ml", "p", "c"), DeviceRef(int(d[-1]), d, None), d, "nvidia.com/gpu", False
        )
        for d in allocated
    ]
    return snapshot, allocations


def capacity(scheduling: NodeSchedulingSnapshot | None, allocated: list[str]) -> Any:
    gpus, health = four_gpus()
    snapshot, allocations = kubelet(allocated)
    (cap,) = node_capacity(gpus, health, snapshot, allocations, nvml_ok=True, scheduling=scheduling)
    return cap


def test_a_cordoned_node_disrupts_its_free_gpus_not_the_ones_in_use() -> None:
    cap = capacity(watched(NodeScheduling(unschedulable=True)), ["GPU-0"])
    assert (cap.healthy, cap.allocated, cap.disrupted, cap.allocatable) == (4, 1, 3, 0)
    assert dict(cap.disrupted_by) == {
        "cordoned": 3,
        "node_taint": 0,
        "driver_upgrade": 0,
        "device_taint": 0,
    }
    # the equation holds per resource
    assert cap.allocatable == cap.healthy - cap.allocated - cap.disrupted


def test_two_reasons_count_each_device_once_in_the_total() -> None:
    node = NodeScheduling(unschedulable=True, driver_upgrade_state="drain-required")
    cap = capacity(watched(node), [])
    assert cap.disrupted == 4
    assert dict(cap.disrupted_by)["cordoned"] == dict(cap.disrupted_by)["driver_upgrade"] == 4


def test_a_node_in_service_disrupts_nothing() -> None:
    cap = capacity(watched(NodeScheduling()), ["GPU-0", "GPU-1"])
    assert (cap.disrupted, cap.allocatable) == (0, 2)


def test_an_unreadable_node_leaves_allocatable_unknown() -> None:
    for snapshot in (watched(None), watched(NodeScheduling(), ok=False)):
        cap = capacity(snapshot, [])
        assert (cap.healthy, cap.allocated, cap.disrupted, cap.allocatable) == (4, 0, None, None)
        assert cap.disrupted_by == ()


def test_without_a_node_watch_allocatable_keeps_its_older_meaning_and_disrupted_is_absent() -> None:
    cap = capacity(None, ["GPU-0"])
    assert (cap.disrupted, cap.allocatable) == (None, 3)
    assert dict(cap.disrupted_by) == {"device_taint": 0}


def test_node_scheduling_reads_what_it_needs_and_survives_a_hostile_node() -> None:
    node = node_scheduling(
        {
            "metadata": {
                "name": "n",
                "labels": {"nvidia.com/gpu-driver-upgrade-state": "drain-required"},
            },
            "spec": {
                "unschedulable": True,
                "taints": [
                    {"key": "a", "value": "b", "effect": "NoSchedule"},
                    "not a taint",
                    {"key": 7, "effect": ["NoExecute"]},
                ],
            },
        }
    )
    assert node == NodeScheduling(
        unschedulable=True,
        # what cannot be read is kept as a taint whose effect is "?": it blocks
        taints=(NodeTaint("a", "b", "NoSchedule"), NodeTaint("", "", "?"), NodeTaint("", "", "?")),
        driver_upgrade_state="drain-required",
    )
    # a cordon of the wrong type is no cordon; taints of the wrong type are one that blocks
    assert node_scheduling({"spec": {"unschedulable": "true", "taints": {"k": 1}}}) == (
        NodeScheduling(taints=(NodeTaint("", "", "?"),))
    )
    assert node_scheduling({"spec": None, "metadata": []}) == NodeScheduling()
    # past MAX_TAINTS, the rest count as one unreadable taint: a blocking one may be there
    many = {
        "spec": {"taints": [{"key": f"k{i}", "effect": "PreferNoSchedule"} for i in range(10_000)]}
    }
    read = node_scheduling(many).taints
    assert len(read) == MAX_TAINTS + 1 and read[-1] == NodeTaint("", "", "?")
    assert node_disruptions(watched(node_scheduling(many)), NONE, GPU) == ("node_taint",)
    weird = node_scheduling(
        {"metadata": {"labels": {"nvidia.com/gpu-driver-upgrade-state": "x" * 500}}}
    )
    assert weird.driver_upgrade_state == "?"  # unreadable: not "in service"


def served(scrape: Scrape) -> tuple[dict[str, float], dict[str, float]]:
    states = {
        labels["state"]: v
        for labels, v in scrape.find("gpu_node_devices", resource="nvidia.com/gpu")
    }
    reasons = {
        labels["reason"]: v
        for labels, v in scrape.find("gpu_node_disrupted_devices", resource="nvidia.com/gpu")
    }
    return states, reasons


SCENARIO: dict[str, object] = {
    "gpus": [{}, {}, {}],
    "pods": [
        {
            "namespace": "ml",
            "name": "train-0",
            "containers": [
                {
                    "name": "main",
                    "devices": {"nvidia.com/gpu": ["gpu0"]},
                    "processes": [{"gpu": 0, "memory": "2GiB", "comm": "python"}],
                }
            ],
        }
    ],
    "timeline": [
        {"at": 10, "node": {"unschedulable": True}},
        {
            "at": 20,
            "node": {
                "unschedulable": False,
                "taints": [
                    {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},
                    {"key": "maintenance", "value": "disk", "effect": "NoExecute"},
                ],
            },
        },
        {
            "at": 30,
            "node": {
                "taints": [],
                "labels": {"nvidia.com/gpu-driver-upgrade-state": "pod-restart-required"},
            },
        },
        {"at": 40, "node": {"labels": {"nvidia.com/gpu-driver-upgrade-state": "upgrade-done"}}},
    ],
}


@pytest.mark.slow
async def test_the_exporter_serves_the_disrupted_term_as_the_node_changes() -> None:
    async with simulated_exporter(SCENARIO) as h:
        await h.refresh_pod_resources()
        seen = []
        for at in (5, 15, 25, 35, 45):
            await h.advance(at - h.clock())
            seen.append(served(await h.scrape()))
        assert h.agent.source("node") is not None
        up = (await h.scrape()).get("gpu_exporter_source_up", source="node")

    assert up == 1
    zero = {"cordoned": 0, "node_taint": 0, "driver_upgrade": 0, "device_taint": 0}
    in_service = ({"healthy": 3, "allocated": 1, "disrupted": 0, "allocatable": 2}, zero)
    expected = [
        in_service,
        ({"healthy": 3, "allocated": 1, "disrupted": 2, "allocatable": 0}, {**zero, "cordoned": 2}),
        # the GPU pool's own taint is tolerated, the maintenance one is not
        (
            {"healthy": 3, "allocated": 1, "disrupted": 2, "allocatable": 0},
            {**zero, "node_taint": 2},
        ),
        (
            {"healthy": 3, "allocated": 1, "disrupted": 2, "allocatable": 0},
            {**zero, "driver_upgrade": 2},
        ),
        in_service,
    ]
    for (states, reasons), (want_states, want_reasons) in zip(seen, expected, strict=True):
        assert {k: states.get(k) for k in want_states} == want_states
        assert reasons == want_reasons


@pytest.mark.slow
async def test_a_node_watch_refused_leaves_allocatable_unknown_not_all_free() -> None:
    async with simulated_exporter(SCENARIO) as h:
        await h.refresh_pod_resources()
        assert h.env.kube_api is not None
        h.env.kube_api.set_error(403, "nodes is forbidden", resource="nodes")
        h.env.kube_api.expire_history()  # the watch must list again, and is refused
        scrape = await h.scrape()
        for _ in range(100):
            await h.advance(1)
            scrape = await h.scrape()
            if scrape.get("gpu_exporter_source_up", source="node") == 0:
                break
        states, reasons = served(scrape)

    assert scrape.get("gpu_exporter_source_up", source="node") == 0
    assert states.get("healthy") == 3 and states.get("allocated") == 1
    assert "allocatable" not in states and "disrupted" not in states
    assert reasons == {}
