"""Capacity from present evidence only (pure): what node_capacity says when a source is
down or silent about a device (docs/health.md, "Unknown")."""

from __future__ import annotations

from dataclasses import astuple, replace

import pytest

from exporter.analysis.capacity import node_capacity
from exporter.analysis.health import HealthPolicy, assess
from exporter.model import (
    AllocatableDevices,
    Allocation,
    Analysis,
    Attribution,
    ContainerRef,
    DeviceCapacity,
    DeviceRef,
    GpuSample,
    NodeSnapshot,
    NvmlSnapshot,
    PodResourcesSnapshot,
    ResourceSliceSnapshot,
    SliceDevice,
)
from exporter.reporting.condition import NodeCondition, desired_condition

GPUS = tuple(GpuSample(index=i, uuid=f"GPU-{i}") for i in range(4))
UUIDS = tuple(g.uuid for g in GPUS)
HEALTH = assess(GPUS, recent_fatal_xids={}, dcgm_failures={}, policy=HealthPolicy())
DRIVER = "gpu.nvidia.com"


def kubelet(*device_ids: str, ok: bool = True) -> PodResourcesSnapshot:
    return PodResourcesSnapshot(
        ok=ok,
        timestamp=0.0,
        allocatable_ok=ok,
        allocatable=(AllocatableDevices("nvidia.com/gpu", device_ids),) if ok else (),
    )


def held(device_id: str, resource: str = "nvidia.com/gpu") -> Allocation:
    return Allocation(
        ContainerRef("ns", "p", "c"), DeviceRef(None, None, None), device_id, resource, False
    )


def states(cap: DeviceCapacity) -> dict[str, int | None]:
    names = ("resource", "advertised", "healthy", "unhealthy", "allocated", "allocatable")
    return {**dict(zip(names[1:], astuple(cap)[1:], strict=False)), "unknown": cap.unknown}


def test_kubelet_down_leaves_allocation_unknown_never_all_allocatable() -> None:
    for down in (None, PodResourcesSnapshot(ok=False, timestamp=0.0, error="unavailable")):
        (cap,) = node_capacity(GPUS, HEALTH, down, [], nvml_ok=True)
        # NVML's GPUs stand in for what the kubelet advertises, and NVML judges them;
        # but which are taken only the kubelet knows.
        assert states(cap) == {
            "advertised": 4,
            "healthy": 4,
            "unhealthy": 0,
            "unknown": 0,
            "allocated": None,
            "allocatable": None,
        }


def test_nvml_down_leaves_health_unknown_never_healthy() -> None:
    (cap,) = node_capacity((), (), kubelet(*UUIDS), [held("GPU-1")], nvml_ok=False)
    assert states(cap) == {
        "advertised": 4,
        "healthy": None,
        "unhealthy": None,
        "unknown": 4,
        "allocated": 1,  # the kubelet's word alone
        "allocatable": None,  # needs both
    }


def test_both_down_counts_nothing() -> None:
    assert node_capacity((), (), None, [], nvml_ok=False) == ()


def test_an_advertised_gpu_nvml_cannot_see_is_unhealthy() -> None:
    # GPU 3 was lost before the exporter started: NVML lists it by index, without a UUID
    # (a placeholder name no kubelet id can match), so the kubelet's GPU-3 is unseen.
    lost = GpuSample(index=3, uuid="unknown-gpu-3", error="GpuIsLost", lost=True)
    gpus = (*GPUS[:3], lost)
    health = assess(gpus, recent_fatal_xids={}, dcgm_failures={}, policy=HealthPolicy())
    (cap,) = node_capacity(gpus, health, kubelet(*UUIDS), [held("GPU-3")], nvml_ok=True)
    assert states(cap) == {
        "advertised": 4,
        "healthy": 3,
        "unhealthy": 1,
        "unknown": 0,
        "allocated": 1,
        "allocatable": 3,
    }


def test_a_replica_of_an_unseen_gpu_is_unhealthy_too() -> None:
    pr = kubelet("GPU-0::0", "GPU-9::0", "GPU-9::1")
    (cap,) = node_capacity(GPUS, HEALTH, pr, [], nvml_ok=True)
    assert (cap.healthy, cap.unhealthy, cap.unknown) == (1, 2, 0)


@pytest.mark.parametrize(
    "device_id",
    [
        "fpga-0001",  # no form any GPU plugin uses
        "MIG-4f5e6d7c-0000-0000-0000-000000000000",  # a MIG UUID NVML does not list
        "nvidia9",  # a GKE device minor no GPU has
        "nvidia0/gi3",
    ],
)
def test_an_advertised_id_naming_no_gpu_is_unknown_not_healthy(device_id: str) -> None:
    (cap,) = node_capacity(GPUS, HEALTH, kubelet("GPU-0", device_id), [], nvml_ok=True)
    assert states(cap) == {
        "advertised": 2,
        "healthy": 1,
        "unhealthy": 0,
        "unknown": 1,
        "allocated": 0,
        "allocatable": 1,  # an unknown device is never counted allocatable
    }


def test_twenty_thousand_unresolved_ids_are_one_count() -> None:
    ids = tuple(f"dev-{i:05d}" for i in range(20_000))
    allocations = [held("dev-00007"), held("GPU-2")]
    (cap,) = node_capacity(GPUS, HEALTH, kubelet(*UUIDS, *ids), allocations, nvml_ok=True)
    assert states(cap) == {
        "advertised": 20_004,
        "healthy": 4,
        "unhealthy": 0,
        "unknown": 20_000,
        "allocated": 2,
        "allocatable": 3,
    }
    assert cap.healthy is not None and cap.unhealthy is not None
    assert cap.healthy + cap.unhealthy + cap.unknown == cap.advertised  # no double count


def test_dra_devices_follow_the_same_rule() -> None:
    def device(name: str, uuid: str | None) -> SliceDevice:
        attributes = (("uuid", uuid),) if uuid else ()
        return SliceDevice(DRIVER, "node-1", name, attributes)

    slices = ResourceSliceSnapshot(
        ok=True,
        timestamp=0.0,
        devices=(
            device("gpu-0", "GPU-0"),
            device("gpu-9", "GPU-9"),  # published, not seen by NVML: unhealthy
            device("gpu-x", None),  # names no GPU: unknown
        ),
    )
    pr = PodResourcesSnapshot(ok=True, timestamp=0.0, allocatable_ok=True)
    (cap,) = node_capacity(GPUS, HEALTH, pr, [], slices, nvml_ok=True)
    assert (cap.resource, cap.advertised, cap.healthy, cap.unhealthy, cap.unknown) == (
        DRIVER,
        3,
        1,
        1,
        1,
    )
    (down,) = node_capacity(GPUS, HEALTH, None, [], slices, nvml_ok=True)
    assert (down.advertised, down.allocated, down.allocatable) == (3, None, None)
    # a pod's claims unreported (the kubelet's claims gate off): every DRA allocation
    # is unknown, whether or not a process runs (an adversarial review: "all free" between
    # a pod's kernels, absent during them)
    (gate_off,) = node_capacity(GPUS, HEALTH, pr, [], slices, nvml_ok=True, dra_unreported=True)
    assert (gate_off.advertised, gate_off.allocated, gate_off.allocatable) == (3, None, None)


def shared_replica(gpu: str) -> Allocation:
    return held(f"{gpu}::0", resource="nvidia.com/gpu.shared")


def older_kubelet() -> PodResourcesSnapshot:
    """List answers (allocations known), GetAllocatableResources does not (UNIMPLEMENTED:
    a kubelet before 1.21, or 1.21-1.22 with the feature gate off)."""
    return PodResourcesSnapshot(ok=True, timestamp=0.0, allocatable_ok=False)


def test_a_guessed_advertised_set_serves_no_allocation_counts() -> None:
    """Every GPU handed out as a time-sliced replica, which the guessed nvidia.com/gpu set
    cannot match: all allocatable was served (4), nothing allocated (0)."""
    allocations = [shared_replica(u) for u in UUIDS]
    (cap,) = node_capacity(GPUS, HEALTH, older_kubelet(), allocations, nvml_ok=True)
    assert states(cap) == {
        "advertised": 4,  # NVML's GPUs stand in, and NVML judges them
        "healthy": 4,
        "unhealthy": 0,
        "unknown": 0,
        "allocated": None,
        "allocatable": None,
    }


def test_a_guessed_set_serves_no_allocation_even_when_ids_match() -> None:
    """Even whole GPUs listed by UUID under nvidia.com/gpu: the plugin may also advertise
    replicas or MIG devices the guess does not hold, so what is free is not known."""
    (cap,) = node_capacity(GPUS, HEALTH, older_kubelet(), [held("GPU-1")], nvml_ok=True)
    assert (cap.allocated, cap.allocatable) == (None, None)


def test_an_advertised_set_from_the_kubelet_keeps_its_allocation_counts() -> None:
    (cap,) = node_capacity(GPUS, HEALTH, kubelet(*UUIDS), [held("GPU-1")], nvml_ok=True)
    assert (cap.allocated, cap.allocatable) == (1, 3)


def test_a_gpu_nvml_does_not_list_keeps_the_node_condition_from_saying_all_healthy() -> None:
    """NVML enumerates 3 of the 4 GPUs the kubelet advertises (one missing from the count
    at start): the 3 are healthy, but "all 3 GPUs are healthy" would clear a GPULost
    condition an earlier run set for the fourth (adversarial review). The condition is
    left as it is; with every advertised GPU listed it says False again."""
    listed = GPUS[:3]
    health = assess(listed, recent_fatal_xids={}, dcgm_failures={}, policy=HealthPolicy())
    capacity = node_capacity(listed, health, kubelet(*UUIDS), [], nvml_ok=True)
    node = NodeSnapshot(node_name="n1", nvml=NvmlSnapshot(ok=True, timestamp=0.0, gpus=listed))
    partial = Analysis(node=node, attribution=Attribution(), health=health, capacity=capacity)
    assert desired_condition(partial) is None
    whole = node_capacity(GPUS, HEALTH, kubelet(*UUIDS), [], nvml_ok=True)
    every = replace(partial, health=HEALTH, capacity=whole)
    assert desired_condition(every) == NodeCondition(
        "False", "GPUsHealthy", "all 4 GPUs are healthy"
    )
