"""Attribution: NVML processes x procfs identities x pod metadata x PodResources."""

from __future__ import annotations

from dataclasses import astuple, replace

import pytest

from exporter.analysis.attribution import attribute
from exporter.model import (
    Allocation,
    AttributedProcess,
    ContainerDevices,
    ContainerGpuUsage,
    ContainerRef,
    DeviceRef,
    GpuProcess,
    GpuSample,
    MigInstance,
    NodeSnapshot,
    NvmlSnapshot,
    PodMeta,
    PodMetaSnapshot,
    PodResourcesSnapshot,
    ProcessIdentity,
    ProcessUtilization,
    UnallocatedUse,
    UnattributedUse,
)

GiB = 1024**3
G0 = "GPU-00000000-0000-0000-0000-000000000000"
G1 = "GPU-11111111-1111-1111-1111-111111111111"
MIG_A = "MIG-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa"
MIG_B = "MIG-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb"
GPU_RESOURCE = "nvidia.com/gpu"
UID_A, UID_B, UID_C = "uid-a", "uid-b", "uid-c"
CID_A, CID_B, CID_C = "a" * 64, "b" * 64, "c" * 64


# ---------------------------------------------------------------------------
# Builders: the snapshot a test needs, with everything else left empty
# ---------------------------------------------------------------------------


def proc(pid: int, memory: int | None, gi: int | None = None, ci: int | None = None) -> GpuProcess:
    return GpuProcess(pid, memory, "compute", gpu_instance_id=gi, compute_instance_id=ci)


def sm(pid: int, percent: int, timestamp_us: int = 1) -> ProcessUtilization:
    return ProcessUtilization(pid, percent, 0, timestamp_us)


def gpu(
    index: int,
    uuid: str,
    *processes: GpuProcess,
    util: tuple[ProcessUtilization, ...] = (),
    migs: tuple[MigInstance, ...] = (),
) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=uuid,
        processes=processes,
        process_utilization=util,
        mig_instances=migs,
        mig_enabled=bool(migs),
    )


def mig(uuid: str, gi: int, ci: int, *processes: GpuProcess) -> MigInstance:
    return MigInstance(
        mig_index=gi,
        uuid=uuid,
        gpu_instance_id=gi,
        compute_instance_id=ci,
        profile="3g.40gb",
        memory_total_bytes=40 * GiB,
        memory_used_bytes=None,
        processes=processes,
    )


def ident(pid: int, pod_uid: str | None = None, cid: str | None = None) -> ProcessIdentity:
    return ProcessIdentity(pid=pid, alive=True, pod_uid=pod_uid, container_id=cid)


def pod(uid: str, name: str, *containers: tuple[str, str], phase: str = "Running") -> PodMeta:
    return PodMeta(uid=uid, namespace="ml", name=name, phase=phase, containers=containers)


def alloc(
    pod_name: str, container: str, *device_ids: str, resource: str = GPU_RESOURCE
) -> ContainerDevices:
    return ContainerDevices("ml", pod_name, container, resource, device_ids)


def node(
    *gpus: GpuSample,
    identities: tuple[ProcessIdentity, ...] = (),
    pods: tuple[PodMeta, ...] | None = (),
    allocations: tuple[ContainerDevices, ...] | None = (),
) -> NodeSnapshot:
    """``pods``/``allocations`` None: that source is absent."""
    return NodeSnapshot(
        node_name="node-1",
        nvml=NvmlSnapshot(ok=True, timestamp=0.0, gpus=gpus),
        processes=identities,
        pod_meta=None if pods is None else PodMetaSnapshot(ok=True, timestamp=0.0, pods=pods),
        pod_resources=(
            None
            if allocations is None
            else PodResourcesSnapshot(ok=True, timestamp=0.0, containers=allocations)
        ),
    )


def pod_row(
    pid: int,
    name: str,
    container: str,
    uid: str,
    *,
    index: int = 0,
    uuid: str = G0,
    memory: int | None,
    sm_ratio: float | None = None,
    allocated: bool | None = True,
) -> AttributedProcess:
    return AttributedProcess(
        gpu=index,
        uuid=uuid,
        mig_uuid=None,
        gpu_instance_id=None,
        compute_instance_id=None,
        pid=pid,
        memory_used_bytes=memory,
        sm_ratio=sm_ratio,
        kind="compute",
        owner="pod",
        namespace="ml",
        pod=name,
        container=container,
        allocated=allocated,
        pod_uid=uid,
    )


# ---------------------------------------------------------------------------
# Owners
# ---------------------------------------------------------------------------


def test_exclusive_gpu_with_pod_metadata_is_attributed_to_its_container() -> None:
    result = attribute(
        node(
            gpu(0, G0, proc(100, 3 * GiB), util=(sm(100, 42),)),
            identities=(ident(100, UID_A, CID_A),),
            pods=(pod(UID_A, "train", (CID_A, "trainer")),),
            allocations=(alloc("train", "trainer", G0),),
        )
    )

    assert result.processes == (
        pod_row(100, "train", "trainer", UID_A, memory=3 * GiB, sm_ratio=0.42),
    )
    assert result.containers == (
        ContainerGpuUsage(
            ContainerRef("ml", "train", "trainer"), DeviceRef(0, G0, None), 3 * GiB, 0.42, 1
        ),
    )
    assert result.allocations == (
        Allocation(
            ContainerRef("ml", "train", "trainer"), DeviceRef(0, G0, None), G0, GPU_RESOURCE, False
        ),
    )
    assert result.unallocated_use == ()
    assert result.unattributed == ()


def test_time_sliced_gpu_gives_each_pod_its_own_memory_and_sm() -> None:
    result = attribute(
        node(
            gpu(
                0,
                G0,
                proc(1, 1 * GiB),
                proc(2, 2 * GiB),
                proc(3, 3 * GiB),
                util=(sm(1, 10), sm(2, 20), sm(3, 30)),
            ),
            identities=(ident(1, UID_A, CID_A), ident(2, UID_B, CID_B), ident(3, UID_C, CID_C)),
            pods=(
                pod(UID_A, "a", (CID_A, "main")),
                pod(UID_B, "b", (CID_B, "main")),
                pod(UID_C, "c", (CID_C, "main")),
            ),
            allocations=(
                alloc("a", "main", f"{G0}::0"),
                alloc("b", "main", f"{G0}::1"),
                alloc("c", "main", f"{G0}::2"),
            ),
        )
    )

    assert result.containers == (
        ContainerGpuUsage(
            ContainerRef("ml", "a", "main"), DeviceRef(0, G0, None), 1 * GiB, 0.10, 1
        ),
        ContainerGpuUsage(
            ContainerRef("ml", "b", "main"), DeviceRef(0, G0, None), 2 * GiB, 0.20, 1
        ),
        ContainerGpuUsage(
            ContainerRef("ml", "c", "main"), DeviceRef(0, G0, None), 3 * GiB, 0.30, 1
        ),
    )
    assert [
        (a.container.pod, a.device.gpu, a.device.uuid, a.shared) for a in result.allocations
    ] == [
        ("a", 0, G0, True),
        ("b", 0, G0, True),
        ("c", 0, G0, True),
    ]
    assert [p.allocated for p in result.processes] == [True, True, True]
    assert result.unallocated_use == ()


def test_mig_processes_are_attributed_per_instance() -> None:
    # pid 10 is listed on the parent GPU with instance ids, pid 20 inside its MIG instance.
    migs = (mig(MIG_A, 1, 0), mig(MIG_B, 2, 0, proc(20, 2 * GiB)))
    result = attribute(
        node(
            gpu(0, G0, proc(10, 1 * GiB, gi=1, ci=0), migs=migs),
            identities=(ident(10, UID_A, CID_A), ident(20, UID_B, CID_B)),
            pods=(pod(UID_A, "a", (CID_A, "main")), pod(UID_B, "b", (CID_B, "main"))),
            allocations=(alloc("a", "main", MIG_A), alloc("b", "main", MIG_B)),
        )
    )

    assert [
        (p.pid, p.gpu, p.uuid, p.mig_uuid, p.gpu_instance_id, p.compute_instance_id, p.allocated)
        for p in result.processes
    ] == [(10, 0, G0, MIG_A, 1, 0, True), (20, 0, G0, MIG_B, 2, 0, True)]
    assert result.containers == (
        ContainerGpuUsage(
            ContainerRef("ml", "a", "main"), DeviceRef(0, G0, MIG_A), 1 * GiB, None, 1
        ),
        ContainerGpuUsage(
            ContainerRef("ml", "b", "main"), DeviceRef(0, G0, MIG_B), 2 * GiB, None, 1
        ),
    )
    assert result.allocations == (
        Allocation(
            ContainerRef("ml", "a", "main"), DeviceRef(0, G0, MIG_A), MIG_A, GPU_RESOURCE, False
        ),
        Allocation(
            ContainerRef("ml", "b", "main"), DeviceRef(0, G0, MIG_B), MIG_B, GPU_RESOURCE, False
        ),
    )


def test_mig_process_is_not_attributed_to_a_sibling_instance_allocation() -> None:
    migs = (mig(MIG_A, 1, 0), mig(MIG_B, 2, 0, proc(20, GiB)))
    result = attribute(
        node(
            gpu(0, G0, migs=migs),
            identities=(ident(20, UID_A, CID_A),),
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", MIG_A),),
        )
    )

    assert result.unallocated_use == (
        UnallocatedUse(ContainerRef("ml", "a", "main"), DeviceRef(0, G0, MIG_B), GiB, 1),
    )


def test_whole_gpu_allocation_covers_its_mig_instances() -> None:
    result = attribute(
        node(
            gpu(0, G0, migs=(mig(MIG_A, 1, 0, proc(20, GiB)),)),
            identities=(ident(20, UID_A, CID_A),),
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", G0),),
        )
    )

    assert [p.allocated for p in result.processes] == [True]


def test_same_pid_listed_twice_on_a_device_is_counted_once() -> None:
    # On the parent GPU with instance ids but no memory, inside the instance with memory;
    # and a plain GPU that lists one pid twice.
    migs = (mig(MIG_A, 1, 0, proc(10, 5 * GiB)),)
    result = attribute(
        node(
            gpu(0, G0, proc(10, None, gi=1, ci=0), migs=migs),
            gpu(1, G1, proc(30, 2 * GiB), proc(30, 2 * GiB)),
            identities=(ident(10), ident(30)),
        )
    )

    assert [(p.gpu, p.mig_uuid, p.pid, p.memory_used_bytes) for p in result.processes] == [
        (0, MIG_A, 10, 5 * GiB),
        (1, None, 30, 2 * GiB),
    ]


def test_bare_gpu_listing_yields_to_the_mig_instance_listing_of_the_same_pid() -> None:
    migs = (mig(MIG_A, 1, 0, proc(10, GiB)),)
    result = attribute(node(gpu(0, G0, proc(10, GiB), migs=migs), identities=(ident(10),)))

    assert [(p.pid, p.mig_uuid, p.gpu_instance_id) for p in result.processes] == [(10, MIG_A, 1)]


def test_mig_ids_matching_no_instance_keep_the_ids_and_leave_allocation_unknown() -> None:
    result = attribute(
        node(
            gpu(0, G0, proc(10, GiB, gi=7, ci=0), migs=(mig(MIG_A, 1, 0),)),
            identities=(ident(10, UID_A, CID_A),),
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", MIG_A),),
        )
    )

    (row,) = result.processes
    assert (row.mig_uuid, row.gpu_instance_id, row.compute_instance_id) == (None, 7, 0)
    assert (row.owner, row.allocated) == ("pod", None)
    assert result.unallocated_use == ()


def test_process_outside_kubepods_is_owned_by_the_host() -> None:
    result = attribute(
        node(gpu(0, G0, proc(7, GiB)), identities=(ident(7),), allocations=(alloc("a", "m", G0),))
    )

    assert result.processes == (
        AttributedProcess(0, G0, None, None, None, 7, GiB, None, "compute", "host"),
    )
    assert result.containers == ()
    assert result.unattributed == (UnattributedUse(DeviceRef(0, G0, None), "host", None, GiB, 1),)


@pytest.mark.parametrize(
    "identities",
    [
        pytest.param((ProcessIdentity(pid=9, alive=False),), id="proc-dir-gone"),
        pytest.param(
            (ProcessIdentity(pid=9, alive=False, pod_uid=UID_A, container_id=CID_A),),
            id="gone-with-stale-pod",
        ),
    ],
)
def test_pid_without_a_live_process_is_dead(identities: tuple[ProcessIdentity, ...]) -> None:
    result = attribute(
        node(
            gpu(0, G0, proc(9, 2 * GiB)),
            identities=identities,
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", G0),),
        )
    )

    assert result.processes == (
        AttributedProcess(0, G0, None, None, None, 9, 2 * GiB, None, "compute", "dead"),
    )
    assert result.unattributed == (
        UnattributedUse(DeviceRef(0, G0, None), "dead", None, 2 * GiB, 1),
    )


def test_a_live_pid_whose_cgroup_was_unreadable_is_unknown_not_host() -> None:
    # a non-root exporter on a /proc it may not fully read: whose it is is not known
    result = attribute(
        node(
            gpu(0, G0, proc(9, 2 * GiB)),
            identities=(ProcessIdentity(pid=9, alive=True, comm="python3", cgroup_read=False),),
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", G0),),
        )
    )
    (row,) = result.processes
    assert (row.owner, row.reason) == ("unknown", "process not read from /proc")


def test_pid_procfs_said_nothing_about_is_unknown_not_dead() -> None:
    # procfs down (no proc root): an exit was not seen, so no dead-process orphan
    result = attribute(
        node(
            gpu(0, G0, proc(9, 2 * GiB)),
            identities=(),
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", G0),),
        )
    )
    (row,) = result.processes
    assert (row.owner, row.reason) == ("unknown", "process not read from /proc")
    assert result.unattributed == (
        UnattributedUse(
            DeviceRef(0, G0, None), "unknown", "process not read from /proc", 2 * GiB, 1
        ),
    )
    assert result.containers == ()


def test_pod_uid_missing_from_metadata_is_a_pod_not_on_this_node() -> None:
    result = attribute(
        node(
            gpu(0, G0, proc(5, GiB)),
            identities=(ident(5, UID_B, CID_B),),
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", G0),),
        )
    )

    (row,) = result.processes
    assert (row.owner, row.reason, row.pod_uid, row.pod, row.allocated) == (
        "unknown",
        "pod not on this node",
        UID_B,
        None,
        None,
    )
    assert result.unattributed == (
        UnattributedUse(DeviceRef(0, G0, None), "unknown", "pod not on this node", GiB, 1),
    )


def test_unlisted_container_id_falls_back_to_the_pods_only_container_on_the_device() -> None:
    result = attribute(
        node(
            gpu(0, G0, proc(5, GiB)),
            identities=(ident(5, UID_A, CID_B),),  # restarted: status still has the old id
            pods=(pod(UID_A, "a", (CID_A, "main"), (CID_C, "sidecar")),),
            allocations=(alloc("a", "main", G0),),
        )
    )

    assert result.processes == (pod_row(5, "a", "main", UID_A, memory=GiB),)


def test_unlisted_container_id_without_a_sole_allocation_names_only_the_pod() -> None:
    result = attribute(
        node(
            gpu(0, G0, proc(5, GiB)),
            identities=(ident(5, UID_A, None),),
            pods=(pod(UID_A, "a", (CID_A, "main"), (CID_C, "aux")),),
            allocations=(alloc("a", "main", f"{G0}::0"), alloc("a", "aux", f"{G0}::1")),
        )
    )

    (row,) = result.processes
    assert (row.owner, row.namespace, row.pod, row.container, row.reason, row.allocated) == (
        "unknown",
        "ml",
        "a",
        None,
        "container id unknown",
        None,
    )
    assert result.containers == ()


# ---------------------------------------------------------------------------
# Without pod metadata: PodResources names exclusive devices only
# ---------------------------------------------------------------------------

NO_POD_META = [
    pytest.param(None, id="no-pod-metadata-source"),
    pytest.param(PodMetaSnapshot(ok=False, timestamp=0.0, error="Forbidden"), id="pod-meta-down"),
]


def without_pod_meta(snapshot: NodeSnapshot, pod_meta: PodMetaSnapshot | None) -> NodeSnapshot:
    return NodeSnapshot(
        node_name=snapshot.node_name,
        nvml=snapshot.nvml,
        processes=snapshot.processes,
        pod_resources=snapshot.pod_resources,
        pod_meta=pod_meta,
    )


@pytest.mark.parametrize("pod_meta", NO_POD_META)
def test_without_pod_metadata_exclusive_gpu_is_named_via_pod_resources(
    pod_meta: PodMetaSnapshot | None,
) -> None:
    snapshot = node(
        gpu(0, G0, proc(1, 4 * GiB), proc(2, GiB)),
        identities=(ident(1, UID_A, CID_A), ident(2, UID_A, CID_A)),
        allocations=(alloc("train", "trainer", G0),),
    )

    result = attribute(without_pod_meta(snapshot, pod_meta))

    assert [(p.owner, p.pod, p.container, p.allocated) for p in result.processes] == [
        ("pod", "train", "trainer", True),
        ("pod", "train", "trainer", True),
    ]
    assert result.containers == (
        ContainerGpuUsage(
            ContainerRef("ml", "train", "trainer"), DeviceRef(0, G0, None), 5 * GiB, None, 2
        ),
    )


@pytest.mark.parametrize("pod_meta", NO_POD_META)
@pytest.mark.parametrize(
    "allocations",
    [
        pytest.param((alloc("a", "main", f"{G0}::0"),), id="one-replica"),
        pytest.param(
            (alloc("a", "main", f"{G0}::0"), alloc("b", "main", f"{G0}::1")), id="replicas"
        ),
        pytest.param((alloc("a", "main", G0), alloc("b", "main", G0)), id="two-containers"),
        pytest.param(
            (alloc("a", "main", G0, resource="nvidia.com/gpu.shared"),), id="shared-resource"
        ),
    ],
)
def test_without_pod_metadata_shared_gpu_stays_unknown(
    pod_meta: PodMetaSnapshot | None, allocations: tuple[ContainerDevices, ...]
) -> None:
    snapshot = node(gpu(0, G0, proc(1, GiB)), identities=(ident(1, UID_A, CID_A),))
    snapshot = NodeSnapshot(
        node_name=snapshot.node_name,
        nvml=snapshot.nvml,
        processes=snapshot.processes,
        pod_resources=PodResourcesSnapshot(ok=True, timestamp=0.0, containers=allocations),
        pod_meta=pod_meta,
    )

    result = attribute(snapshot)

    (row,) = result.processes
    assert (row.owner, row.reason, row.pod, row.allocated) == (
        "unknown",
        "shared GPU without pod metadata",
        None,
        None,
    )
    assert result.containers == ()


def test_without_pod_metadata_an_unreadable_process_keeps_an_exclusive_gpu_ambiguous() -> None:
    # pid 2 may be another pod's (a leak): pid 1 is not named the allocated container's
    result = attribute(
        node(
            gpu(0, G0, proc(1, GiB), proc(2, GiB)),
            identities=(
                ident(1, UID_B, CID_B),
                ProcessIdentity(pid=2, alive=True, cgroup_read=False),
            ),
            pods=None,
            allocations=(alloc("a", "main", G0),),
        )
    )

    assert [(p.owner, p.reason) for p in result.processes] == [
        ("unknown", "several pods on an exclusive GPU without pod metadata"),
        ("unknown", "process not read from /proc"),
    ]
    assert result.containers == ()


def test_without_pod_metadata_two_pods_on_an_exclusive_gpu_stay_unknown() -> None:
    # One of them leaks onto the GPU, and without metadata we cannot tell which.
    result = attribute(
        node(
            gpu(0, G0, proc(1, GiB), proc(2, GiB)),
            identities=(ident(1, UID_A, CID_A), ident(2, UID_B, CID_B)),
            pods=None,
            allocations=(alloc("a", "main", G0),),
        )
    )

    assert [(p.owner, p.reason) for p in result.processes] == [
        ("unknown", "several pods on an exclusive GPU without pod metadata"),
    ] * 2


def test_without_pod_metadata_an_unallocated_gpu_is_unknown_for_lack_of_metadata() -> None:
    result = attribute(
        node(
            gpu(0, G0),
            gpu(1, G1, proc(1, GiB)),
            identities=(ident(1, UID_A, CID_A),),
            pods=None,
            allocations=(alloc("a", "main", G0),),
        )
    )

    (row,) = result.processes
    assert (row.owner, row.reason, row.allocated) == ("unknown", "no pod metadata", None)


def test_without_pod_metadata_or_pod_resources_pods_are_unknown() -> None:
    result = attribute(
        node(
            gpu(0, G0, proc(1, GiB)),
            identities=(ident(1, UID_A, CID_A),),
            pods=None,
            allocations=None,
        )
    )

    assert [(p.owner, p.reason, p.pod_uid) for p in result.processes] == [
        ("unknown", "no pod metadata", UID_A)
    ]


# ---------------------------------------------------------------------------
# Allocations and isolation leaks
# ---------------------------------------------------------------------------


def test_container_using_a_gpu_it_was_not_allocated_is_an_isolation_leak() -> None:
    # NVIDIA_VISIBLE_DEVICES=all: allocated G0, also runs two processes on G1.
    result = attribute(
        node(
            gpu(0, G0, proc(1, GiB)),
            gpu(1, G1, proc(2, 2 * GiB), proc(3, None)),
            identities=(ident(1, UID_A, CID_A), ident(2, UID_A, CID_A), ident(3, UID_A, CID_A)),
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", G0),),
        )
    )

    assert [(p.gpu, p.pid, p.allocated) for p in result.processes] == [
        (0, 1, True),
        (1, 2, False),
        (1, 3, False),
    ]
    # pid 3's memory is unknown to NVML: the leak's size is unknown, not 2 GiB
    assert result.unallocated_use == (
        UnallocatedUse(ContainerRef("ml", "a", "main"), DeviceRef(1, G1, None), None, 2),
    )
    # the leak is still the container's usage
    assert [(c.device.gpu, c.memory_used_bytes, c.processes) for c in result.containers] == [
        (0, GiB, 1),
        (1, None, 2),
    ]


def test_process_left_behind_by_a_finished_pod_is_not_an_isolation_leak() -> None:
    # The kubelet released the Succeeded pod's GPU; its lingering process is a matter
    # for orphan detection, not a container using a GPU it was never given.
    result = attribute(
        node(
            gpu(0, G0, proc(1, GiB)),
            identities=(ident(1, UID_A, CID_A),),
            pods=(pod(UID_A, "a", (CID_A, "main"), phase="Succeeded"),),
            allocations=(alloc("a", "main", G0),),
        )
    )

    assert [(p.pod, p.allocated) for p in result.processes] == [("a", None)]
    assert result.unallocated_use == ()
    assert result.allocations == ()


def test_replica_of_a_gpu_covers_that_gpu() -> None:
    result = attribute(
        node(
            gpu(0, G0, proc(1, GiB)),
            identities=(ident(1, UID_A, CID_A),),
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", f"{G0}::3"),),
        )
    )

    assert [p.allocated for p in result.processes] == [True]
    assert result.unallocated_use == ()


@pytest.mark.parametrize(
    "pod_resources",
    [
        pytest.param(None, id="no-pod-resources-source"),
        pytest.param(
            PodResourcesSnapshot(
                ok=False,
                timestamp=0.0,
                error="socket missing",
                containers=(alloc("a", "main", G0),),
            ),
            id="pod-resources-down",
        ),
    ],
)
def test_without_pod_resources_allocation_is_unknown_and_no_leak_is_reported(
    pod_resources: PodResourcesSnapshot | None,
) -> None:
    snapshot = node(
        gpu(1, G1, proc(2, GiB)),
        identities=(ident(2, UID_A, CID_A),),
        pods=(pod(UID_A, "a", (CID_A, "main")),),
    )
    snapshot = NodeSnapshot(
        node_name=snapshot.node_name,
        nvml=snapshot.nvml,
        processes=snapshot.processes,
        pod_resources=pod_resources,
        pod_meta=snapshot.pod_meta,
    )

    result = attribute(snapshot)

    assert result.processes == (
        pod_row(2, "a", "main", UID_A, index=1, uuid=G1, memory=GiB, allocated=None),
    )
    assert result.unallocated_use == ()
    assert result.allocations == ()
    assert len(result.containers) == 1


def test_terminal_pod_allocations_are_dropped_but_a_recreated_pod_keeps_its_own() -> None:
    result = attribute(
        node(
            gpu(0, G0),
            gpu(1, G1),
            pods=(
                pod("old-job", "job", phase="Succeeded"),
                pod("old-web", "web", phase="Failed"),
                pod("new-web", "web", phase="Running"),  # same name, recreated
                pod("crash", "crashed", phase="Failed"),
            ),
            allocations=(
                alloc("job", "main", G0),
                alloc("web", "main", G1),
                alloc("crashed", "main", G0),
                alloc("unlisted", "main", G0),  # not in metadata (yet): kept
            ),
        )
    )

    assert [a.container.pod for a in result.allocations] == ["unlisted", "web"]


def test_terminal_phases_are_configurable() -> None:
    snapshot = node(
        gpu(0, G0),
        pods=(pod("u", "job", phase="Failed"), pod("v", "evicted", phase="Evicted")),
        allocations=(alloc("job", "main", G0), alloc("evicted", "main", G0)),
    )

    result = attribute(snapshot, terminal_phases=frozenset({"Evicted"}))

    assert [a.container.pod for a in result.allocations] == ["job"]


@pytest.mark.parametrize(
    ("device_id", "resource", "expected"),
    [
        pytest.param(G1, GPU_RESOURCE, (1, G1, None, False), id="gpu-uuid"),
        pytest.param(f"{G1}::4", GPU_RESOURCE, (1, G1, None, True), id="replica"),
        pytest.param(G1, "nvidia.com/gpu.shared", (1, G1, None, True), id="shared-resource-name"),
        pytest.param(MIG_A, "nvidia.com/mig-3g.40gb", (0, G0, MIG_A, False), id="mig-uuid"),
        pytest.param(f"{MIG_A}::1", GPU_RESOURCE, (0, G0, MIG_A, True), id="mig-replica"),
        pytest.param(f"MIG-{G0}/2/0", GPU_RESOURCE, (0, G0, MIG_B, False), id="legacy-mig-id"),
        pytest.param(
            "GPU-99999999-9999-9999-9999-999999999999::2",
            GPU_RESOURCE,
            (None, "GPU-99999999-9999-9999-9999-999999999999", None, True),
            id="unknown-replica",
        ),
        # a MIG id that matches no instance does not name its GPU: unresolved, no uuid
        pytest.param("MIG-unknown", GPU_RESOURCE, (None, None, None, False), id="junk"),
        pytest.param(f"MIG-{G0}/9/0", GPU_RESOURCE, (None, None, None, False)),
        pytest.param("vendor.example/accel-3", GPU_RESOURCE, (None, None, None, False)),
    ],
)
def test_device_ids_resolve_to_their_physical_gpu(
    device_id: str, resource: str, expected: tuple[int | None, str | None, str | None, bool]
) -> None:
    result = attribute(
        node(
            gpu(0, G0, migs=(mig(MIG_A, 1, 0), mig(MIG_B, 2, 0))),
            gpu(1, G1),
            allocations=(alloc("a", "main", device_id, resource=resource),),
        )
    )

    (allocation,) = result.allocations
    assert allocation.device_id == device_id
    assert allocation.resource_name == resource
    assert (*astuple(allocation.device), allocation.shared) == expected


def test_allocations_are_listed_without_nvml() -> None:
    snapshot = NodeSnapshot(
        node_name="node-1",
        nvml=NvmlSnapshot(ok=False, timestamp=0.0, error="LibraryNotFound"),
        pod_resources=PodResourcesSnapshot(
            ok=True, timestamp=0.0, containers=(alloc("a", "main", G0, f"{G0}::1"),)
        ),
    )

    result = attribute(snapshot)

    assert result.processes == ()
    assert [(a.device.gpu, a.device.uuid, a.shared) for a in result.allocations] == [
        (None, G0, False),
        (None, G0, True),
    ]


# ---------------------------------------------------------------------------
# Aggregates
# ---------------------------------------------------------------------------


def mixed_node() -> NodeSnapshot:
    """Two pods time-slicing G0 (one with two processes), a MIG pod, host and dead pids."""
    return node(
        gpu(
            0,
            G0,
            proc(1, 3 * GiB),
            proc(2, None),
            proc(3, 5 * GiB),
            proc(4, GiB),
            proc(5, 7 * GiB),
            util=(sm(1, 70), sm(2, 50), sm(3, 5, timestamp_us=1), sm(3, 15, timestamp_us=9)),
        ),
        gpu(1, G1, migs=(mig(MIG_A, 1, 0, proc(6, 2 * GiB), proc(7, 4 * GiB)),)),
        identities=(
            ident(1, UID_A, CID_A),
            ident(2, UID_A, CID_A),
            ident(3, UID_B, CID_B),
            ident(4),
            ProcessIdentity(pid=5, alive=False),
            ident(6, UID_C, CID_C),
            ident(7, UID_C, CID_C),
        ),
        pods=(
            pod(UID_A, "a", (CID_A, "main")),
            pod(UID_B, "b", (CID_B, "main")),
            pod(UID_C, "c", (CID_C, "main")),
        ),
        allocations=(
            alloc("a", "main", f"{G0}::0"),
            alloc("b", "main", f"{G0}::1"),
            alloc("c", "main", MIG_A),
        ),
    )


def test_container_memory_is_the_sum_of_its_processes_memory() -> None:
    result = attribute(mixed_node())

    assert [
        (c.container.pod, c.device.gpu, c.device.mig_uuid, c.memory_used_bytes, c.processes)
        for c in result.containers
    ] == [
        ("a", 0, None, None, 2),  # pid 2's memory is unknown: so is the sum, not 3 GiB
        ("b", 0, None, 5 * GiB, 1),
        ("c", 1, MIG_A, 6 * GiB, 2),
    ]
    pod_rows = [p for p in result.processes if p.owner == "pod"]
    assert sum(c.processes for c in result.containers) == len(pod_rows)
    assert result.unattributed == (
        UnattributedUse(DeviceRef(0, G0, None), "dead", None, 7 * GiB, 1),
        UnattributedUse(DeviceRef(0, G0, None), "host", None, GiB, 1),
    )


def test_sm_ratio_is_the_latest_sample_and_container_sums_are_capped() -> None:
    result = attribute(mixed_node())

    assert {p.pid: p.sm_ratio for p in result.processes} == {
        1: 0.70,
        2: 0.50,
        3: 0.15,  # the later of its two samples
        4: None,
        5: None,
        6: None,
        7: None,
    }
    assert {c.container.pod: c.sm_ratio for c in result.containers} == {
        "a": 1.0,  # 0.70 + 0.50, capped
        "b": 0.15,
        "c": None,  # no samples at all (MIG has no per-process utilisation)
    }


def test_container_sm_ratio_adds_only_the_sampled_processes() -> None:
    result = attribute(
        node(
            gpu(0, G0, proc(1, GiB), proc(2, GiB), proc(3, GiB), util=(sm(1, 20), sm(3, 25))),
            identities=(ident(1, UID_A, CID_A), ident(2, UID_A, CID_A), ident(3, UID_A, CID_A)),
            pods=(pod(UID_A, "a", (CID_A, "main")),),
            allocations=(alloc("a", "main", G0),),
        )
    )

    (usage,) = result.containers
    assert usage.sm_ratio == pytest.approx(0.45)
    assert usage.processes == 3


def test_output_order_does_not_depend_on_input_order() -> None:
    snapshot = mixed_node()
    reversed_gpus = tuple(
        GpuSample(
            index=g.index,
            uuid=g.uuid,
            processes=tuple(reversed(g.processes)),
            process_utilization=tuple(reversed(g.process_utilization)),
            mig_instances=tuple(reversed(g.mig_instances)),
        )
        for g in reversed(snapshot.nvml.gpus)
    )
    assert snapshot.pod_resources is not None
    shuffled = NodeSnapshot(
        node_name=snapshot.node_name,
        nvml=NvmlSnapshot(ok=True, timestamp=0.0, gpus=reversed_gpus),
        processes=tuple(reversed(snapshot.processes)),
        pod_resources=PodResourcesSnapshot(
            ok=True,
            timestamp=0.0,
            containers=tuple(reversed(snapshot.pod_resources.containers)),
        ),
        pod_meta=snapshot.pod_meta,
    )

    assert attribute(shuffled) == attribute(snapshot)
    assert [(p.gpu, p.pid) for p in attribute(snapshot).processes] == [
        (0, 1),
        (0, 2),
        (0, 3),
        (0, 4),
        (0, 5),
        (1, 6),
        (1, 7),
    ]


# ---------------------------------------------------------------------------
# The allocations are resolved again only when what they come from changed
# ---------------------------------------------------------------------------


def _gpu_with_minor(index: int, uuid: str, minor: int) -> GpuSample:
    return GpuSample(index=index, uuid=uuid, minor_number=minor)


def test_the_same_snapshots_reuse_the_allocations_and_a_changed_gpu_identity_does_not() -> None:
    """The sources hand over the same snapshot objects until something changes, and a
    cycle's GPUs are new objects even when nothing about their identity changed: the
    allocations are reused then. GKE's ``nvidia<minor>`` ids resolve through the device
    minor, so a GPU whose minor changed under the same PodResources answer resolves anew."""
    first = node(
        _gpu_with_minor(0, G0, 0),
        _gpu_with_minor(1, G1, 1),
        allocations=(alloc("a", "main", "nvidia1"),),
    )
    same_again = replace(
        first,
        nvml=replace(first.nvml, gpus=(_gpu_with_minor(0, G0, 0), _gpu_with_minor(1, G1, 1))),
    )
    swapped = replace(
        first,
        nvml=replace(first.nvml, gpus=(_gpu_with_minor(0, G0, 1), _gpu_with_minor(1, G1, 0))),
    )
    a = attribute(first).allocations
    assert [x.device for x in a] == [DeviceRef(1, G1, None)]
    assert attribute(same_again).allocations is a
    assert [x.device for x in attribute(swapped).allocations] == [DeviceRef(0, G0, None)]
    # another PodResources answer with equal content is a new snapshot: resolved again
    assert first.pod_resources is not None
    fresh = replace(first, pod_resources=replace(first.pod_resources))
    assert attribute(fresh).allocations == a
    moved = replace(
        first,
        pod_resources=PodResourcesSnapshot(
            ok=True, timestamp=1.0, containers=(alloc("a", "main", "nvidia0"),)
        ),
    )
    assert [x.device for x in attribute(moved).allocations] == [DeviceRef(0, G0, None)]


def test_a_pod_that_finished_under_the_same_pod_resources_answer_loses_its_allocation() -> None:
    running = node(
        gpu(0, G0),
        pods=(pod(UID_A, "a", (CID_A, "main")),),
        allocations=(alloc("a", "main", G0),),
    )
    assert len(attribute(running).allocations) == 1
    assert running.pod_meta is not None
    done = replace(
        running,
        pod_meta=replace(
            running.pod_meta, pods=(pod(UID_A, "a", (CID_A, "main"), phase="Succeeded"),)
        ),
    )
    assert attribute(done).allocations == ()
