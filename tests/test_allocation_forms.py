"""Every allocation form resolves to the physical GPU; an unknown form is visible, never
wrong (analysis only: attribution, capacity and idle over hand-built snapshots)."""

from __future__ import annotations

from dataclasses import astuple, replace

import pytest

from exporter.analysis.attribution import attribute
from exporter.analysis.capacity import node_capacity
from exporter.analysis.devices import DeviceResolver
from exporter.analysis.health import HealthPolicy, assess
from exporter.model import (
    AllocatableDevices,
    ClaimDevice,
    ContainerDevices,
    DeviceRef,
    GpuSample,
    NodeSnapshot,
    PodResourcesSnapshot,
    ResourceSliceSnapshot,
    SliceDevice,
)
from tests.test_attribution import G0, G1, MIG_A, MIG_B, GiB, gpu, ident, mig, node, pod, proc

G2 = "GPU-22222222-2222-2222-2222-222222222222"
DRIVER = "gpu.nvidia.com"


def with_minor(sample: GpuSample, minor: int) -> GpuSample:
    return replace(sample, minor_number=minor)


# GPU 0 (minor 4) is MIG-partitioned, GPU 1 has minor 0, GPU 2 minor 7: minors are not
# indexes, as on a node where /dev/nvidiaN numbering follows the PCI probe order.
GPUS = (
    with_minor(gpu(0, G0, migs=(mig(MIG_A, 1, 0), mig(MIG_B, 2, 0))), 4),
    with_minor(gpu(1, G1), 0),
    with_minor(gpu(2, G2), 7),
)


def slices(*devices: tuple[str, str], ok: bool = True) -> ResourceSliceSnapshot:
    return ResourceSliceSnapshot(
        ok=ok,
        timestamp=0.0,
        devices=tuple(
            SliceDevice(DRIVER, "node-1", name, (("type", "gpu"), ("uuid", uuid)))
            for name, uuid in devices
        ),
    )


SLICES = slices(("gpu-0-mig-1", MIG_A), ("gpu-0-mig-2", MIG_B), ("gpu-1", G1), ("gpu-2", G2))


@pytest.mark.parametrize(
    ("device_id", "expected"),
    [
        ("nvidia0", ("gke", 1, G1, None, False)),
        ("nvidia7", ("gke", 2, G2, None, False)),
        ("nvidia7/vgpu3", ("gke", 2, G2, None, True)),
        ("nvidia4/gi1", ("gke", 0, G0, MIG_A, False)),
        ("nvidia4/gi2/vgpu0", ("gke", 0, G0, MIG_B, True)),
        (f"{G1}::2", ("nvidia", 1, G1, None, True)),
        (MIG_B, ("nvidia", 0, G0, MIG_B, False)),
        # a minor no GPU has, a GI the GPU lacks, a form nobody produces: unresolved
        ("nvidia9", ("unresolved", None, None, None, False)),
        ("nvidia4/gi5", ("unresolved", None, None, None, False)),
        ("nvidia1/vgpu", ("unresolved", None, None, None, False)),
        ("amd.com/gpu-0", ("unresolved", None, None, None, False)),
        ("", ("unresolved", None, None, None, False)),
    ],
)
def test_device_plugin_ids_resolve_by_form(
    device_id: str, expected: tuple[str, int | None, str | None, str | None, bool]
) -> None:
    found = DeviceResolver(GPUS).device_id(device_id)
    assert (found.form, found.gpu, found.uuid, found.mig_uuid, found.replica) == expected


def test_gke_minor_is_not_the_nvml_index() -> None:
    # nvidia0 is the GPU whose minor is 0 (NVML index 1), not NVML's GPU 0
    assert DeviceResolver(GPUS).device_id("nvidia0").uuid == G1


@pytest.mark.parametrize(
    ("device", "slice_snapshot", "expected"),
    [
        ("gpu-1", SLICES, (1, G1, None)),
        ("gpu-0-mig-2", SLICES, (0, G0, MIG_B)),
        ("gpu-9", SLICES, (None, None, None)),  # not published
        ("gpu-1", slices(("gpu-1", "GPU-not-on-this-node")), (None, None, None)),
        ("gpu-1", replace(SLICES, ok=False), (None, None, None)),  # slices unreadable
        ("gpu-1", None, (None, None, None)),  # DRA not watched
    ],
)
def test_dra_devices_resolve_through_the_resource_slices(
    device: str,
    slice_snapshot: ResourceSliceSnapshot | None,
    expected: tuple[int | None, str | None, str | None],
) -> None:
    found = DeviceResolver(GPUS, slice_snapshot).claim(DRIVER, "node-1", device)
    assert (found.gpu, found.uuid, found.mig_uuid) == expected


def test_dra_device_of_another_driver_or_pool_is_unresolved() -> None:
    resolver = DeviceResolver(GPUS, SLICES)
    assert not resolver.claim("other.example.com", "node-1", "gpu-1").resolved
    assert not resolver.claim(DRIVER, "node-2", "gpu-1").resolved


# ---------------------------------------------------------------------------
# Attribution over the forms
# ---------------------------------------------------------------------------

UID_A, UID_B = "aaaaaaaa-0000-0000-0000-000000000001", "bbbbbbbb-0000-0000-0000-000000000002"
CID_A, CID_B = "a" * 64, "b" * 64


def claim(
    pod_name: str, container: str, device: str, *, claim_name: str | None = None, share_id=None
) -> ClaimDevice:
    return ClaimDevice(
        "ml",
        pod_name,
        container,
        "ml",
        claim_name or f"{pod_name}-gpu",
        DRIVER,
        "node-1",
        device,
        share_id=share_id,
    )


def two_pods_on_gpu1(
    *,
    devices: tuple[ContainerDevices, ...] = (),
    claims: tuple[ClaimDevice, ...] = (),
    slice_snapshot: ResourceSliceSnapshot | None = SLICES,
) -> NodeSnapshot:
    base = node(
        *GPUS[:1],
        replace(GPUS[1], processes=(proc(10, 2 * GiB), proc(11, 3 * GiB))),
        GPUS[2],
        identities=(ident(10, UID_A, CID_A), ident(11, UID_B, CID_B)),
        pods=(pod(UID_A, "a", (CID_A, "main")), pod(UID_B, "b", (CID_B, "main"))),
        allocations=devices,
    )
    assert base.pod_resources is not None
    return replace(
        base,
        pod_resources=replace(base.pod_resources, claims=claims),
        resource_slices=slice_snapshot,
    )


def gke(pod_name: str, *ids: str) -> ContainerDevices:
    return ContainerDevices("ml", pod_name, "main", "nvidia.com/gpu", ids)


@pytest.mark.parametrize(
    "snapshot",
    [
        pytest.param(
            two_pods_on_gpu1(
                devices=(
                    ContainerDevices("ml", "a", "main", "nvidia.com/gpu", (f"{G1}::0",)),
                    ContainerDevices("ml", "b", "main", "nvidia.com/gpu", (f"{G1}::1",)),
                )
            ),
            id="nvidia-replicas",
        ),
        pytest.param(
            two_pods_on_gpu1(devices=(gke("a", "nvidia0/vgpu0"), gke("b", "nvidia0/vgpu1"))),
            id="gke-time-sharing",
        ),
        pytest.param(
            two_pods_on_gpu1(
                claims=(
                    claim("a", "main", "gpu-1", claim_name="shared"),
                    claim("b", "main", "gpu-1", claim_name="shared"),
                )
            ),
            id="dra-shared-claim",
        ),
    ],
)
def test_time_shared_gpu_is_attributed_per_pod_with_no_leak_in_every_form(
    snapshot: NodeSnapshot,
) -> None:
    result = attribute(snapshot)

    assert [
        (c.container.pod, *astuple(c.device)[:2], c.memory_used_bytes) for c in result.containers
    ] == [
        ("a", 1, G1, 2 * GiB),
        ("b", 1, G1, 3 * GiB),
    ]
    assert result.unallocated_use == ()
    assert all(a.shared and a.device == DeviceRef(1, G1) for a in result.allocations)


def test_dra_claim_shared_by_share_id_alone_is_shared() -> None:
    result = attribute(two_pods_on_gpu1(claims=(claim("a", "main", "gpu-1", share_id="s-1"),)))
    (allocation,) = result.allocations
    assert allocation.shared
    assert (allocation.device_id, allocation.resource_name, allocation.claim) == (
        "node-1/gpu-1",
        DRIVER,
        "ml/a-gpu",
    )


def test_exclusive_dra_claim_is_not_shared_and_names_its_mig_device() -> None:
    result = attribute(two_pods_on_gpu1(claims=(claim("a", "main", "gpu-0-mig-1"),)))
    (allocation,) = result.allocations
    assert not allocation.shared
    assert allocation.device == DeviceRef(0, G0, MIG_A)


def test_real_leak_is_still_a_leak_on_gke() -> None:
    # pod b holds GPU 2 (nvidia7) but runs on GPU 1 (nvidia0), which pod a holds
    result = attribute(two_pods_on_gpu1(devices=(gke("a", "nvidia0"), gke("b", "nvidia7"))))
    assert [(u.container.pod, u.device.gpu) for u in result.unallocated_use] == [("b", 1)]


@pytest.mark.parametrize(
    "snapshot",
    [
        pytest.param(
            two_pods_on_gpu1(devices=(gke("a", "accel-0"), gke("b", "accel-1"))), id="unknown-form"
        ),
        pytest.param(
            two_pods_on_gpu1(
                claims=(claim("a", "main", "gpu-1"), claim("b", "main", "gpu-1")),
                slice_snapshot=None,
            ),
            id="dra-without-slices",
        ),
    ],
)
def test_unresolved_allocation_is_never_a_leak_and_never_a_uuid(snapshot: NodeSnapshot) -> None:
    result = attribute(snapshot)

    assert result.unallocated_use == ()
    assert {p.allocated for p in result.processes} == {None}  # cannot tell, not "no"
    assert [
        (a.container.pod, a.device.gpu, a.device.uuid, a.resolved) for a in result.allocations
    ] == [
        ("a", None, None, False),
        ("b", None, None, False),
    ]
    # per-pod numbers do not need the allocation: cgroup + pod watch still name them
    assert [c.container.pod for c in result.containers] == ["a", "b"]


# ---------------------------------------------------------------------------
# Capacity: the kubelet's devices, whatever their form; unhealthy follows the GPU
# ---------------------------------------------------------------------------


def test_gke_devices_of_a_lost_gpu_count_as_unhealthy() -> None:
    lost = replace(GPUS[2], error="GpuIsLost", lost=True)
    gpus = (GPUS[0], GPUS[1], lost)
    health = assess(gpus, recent_fatal_xids={}, dcgm_failures={}, policy=HealthPolicy())
    pod_resources = PodResourcesSnapshot(
        ok=True,
        timestamp=0.0,
        allocatable_ok=True,
        allocatable=(
            AllocatableDevices(
                "nvidia.com/gpu",
                ("nvidia4/gi1", "nvidia4/gi2", "nvidia0", *(f"nvidia7/vgpu{k}" for k in range(4))),
            ),
        ),
        containers=(gke("a", "nvidia7/vgpu0"), gke("b", "nvidia0")),
    )
    allocations = attribute(replace(node(*gpus), pod_resources=pod_resources)).allocations

    (cap,) = node_capacity(gpus, health, pod_resources, allocations, nvml_ok=True)

    assert (cap.advertised, cap.healthy, cap.unhealthy, cap.allocated, cap.allocatable) == (
        7,
        3,
        4,
        2,
        2,
    )


def test_dra_capacity_counts_the_slice_devices_of_the_driver() -> None:
    gpus = (GPUS[0], replace(GPUS[1], error="GpuIsLost", lost=True), GPUS[2])
    health = assess(gpus, recent_fatal_xids={}, dcgm_failures={}, policy=HealthPolicy())
    pod_resources = PodResourcesSnapshot(
        ok=True,
        timestamp=0.0,
        allocatable_ok=True,
        claims=(claim("a", "main", "gpu-2"), claim("b", "main", "gpu-0-mig-1")),
    )
    allocations = attribute(
        replace(node(*gpus), pod_resources=pod_resources, resource_slices=SLICES)
    ).allocations

    (cap,) = node_capacity(gpus, health, pod_resources, allocations, SLICES, nvml_ok=True)

    assert cap.resource == DRIVER
    assert (cap.advertised, cap.healthy, cap.unhealthy, cap.allocated, cap.allocatable) == (
        4,
        3,
        1,
        2,
        1,
    )
