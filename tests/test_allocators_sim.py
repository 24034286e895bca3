"""The simulated node reports one workload in each allocator's words (NVIDIA's device
plugin, GKE's device plugin, NVIDIA's DRA driver), and every form leads back to the same
physical GPUs through the exporter's real readers: the gRPC PodResources client, the
NVML source over the simulated library, and the ResourceSlice conversion."""

from __future__ import annotations

import copy
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from exporter.analysis.devices import DeviceResolver
from exporter.model import (
    AllocatableDevices,
    ClaimDevice,
    ContainerDevices,
    PodResourcesSnapshot,
    ResourceSliceSnapshot,
)
from exporter.sim.environment import SimEnvironment
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.scenario import Scenario, ScenarioError, load_scenario, parse_scenario
from exporter.sources.nvml import NvmlSource
from exporter.sources.podresources.client import PodResourcesClient
from exporter.sources.resourceslices import slice_devices

NODE = "node-a"
DRA = "gpu.nvidia.com"
G0, G1, G2 = (f"GPU-0000000{i}-0000-0000-0000-000000000000" for i in range(3))
MIG_A = "MIG-aaaaaaaa-0000-0000-0000-000000000000"
MIG_B = "MIG-bbbbbbbb-0000-0000-0000-000000000000"

# Minors follow PCI probe order, not NVML's index: GPU 0 is /dev/nvidia2.
WORKLOAD: dict[str, Any] = {
    "node_name": NODE,
    "gpus": [
        {"uuid": G0, "minor": 2},
        {"uuid": G1, "minor": 0},
        {
            "uuid": G2,
            "minor": 1,
            "mig": [
                {
                    "profile": "3g.40gb",
                    "gpu_instance_id": 1,
                    "memory_total": "40GiB",
                    "uuid": MIG_A,
                },
                {
                    "profile": "2g.20gb",
                    "gpu_instance_id": 5,
                    "memory_total": "20GiB",
                    "uuid": MIG_B,
                },
            ],
        },
    ],
    "pods": [
        {
            "namespace": "ml",
            "name": "train",
            "containers": [
                {
                    "name": "main",
                    "devices": {"nvidia.com/gpu": ["gpu0"], "example.com/nic": ["nic-7"]},
                    "processes": [{"gpu": 0, "memory": "10GiB"}],
                }
            ],
        },
        *(
            {
                "namespace": "ml",
                "name": f"chat-{k}",
                "containers": [
                    {"name": "main", "devices": {"nvidia.com/gpu.shared": [f"gpu1::{k}"]}}
                ],
            }
            for k in range(2)
        ),
        {
            "namespace": "nb",
            "name": "alice",
            "containers": [{"name": "main", "devices": {"nvidia.com/mig-3g.40gb": ["gpu2/mig0"]}}],
        },
        {
            "namespace": "nb",
            "name": "bob",
            "containers": [
                {"name": "main", "devices": {"nvidia.com/mig-2g.20gb": ["gpu2/mig1::0"]}}
            ],
        },
    ],
}


def workload(allocator: str, base: dict[str, Any] = WORKLOAD) -> Scenario:
    return parse_scenario({**copy.deepcopy(base), "allocator": allocator}, "test")


def node(allocator: str) -> SimNode:
    return SimNode(workload(allocator), ManualClock())


# -- what each allocator reports ---------------------------------------------------------


def test_nvidia_allocator_reports_uuids_and_replicas_under_the_scenarios_resource_names() -> None:
    sim = node("nvidia")

    assert sim.container_devices() == [
        ContainerDevices("ml", "train", "main", "nvidia.com/gpu", (G0,)),
        ContainerDevices("ml", "train", "main", "example.com/nic", ("nic-7",)),
        ContainerDevices("ml", "chat-0", "main", "nvidia.com/gpu.shared", (f"{G1}::0",)),
        ContainerDevices("ml", "chat-1", "main", "nvidia.com/gpu.shared", (f"{G1}::1",)),
        ContainerDevices("nb", "alice", "main", "nvidia.com/mig-3g.40gb", (MIG_A,)),
        ContainerDevices("nb", "bob", "main", "nvidia.com/mig-2g.20gb", (f"{MIG_B}::0",)),
    ]
    assert sim.allocatable_devices() == [
        AllocatableDevices("nvidia.com/gpu", (G0,)),
        AllocatableDevices("nvidia.com/gpu.shared", tuple(f"{G1}::{k}" for k in range(4))),
        AllocatableDevices("nvidia.com/mig-3g.40gb", (MIG_A,)),
        AllocatableDevices("nvidia.com/mig-2g.20gb", (MIG_B,)),
    ]
    assert sim.claim_devices() == []
    assert sim.resource_slices() == []


def test_gke_allocator_names_every_device_by_minor_as_nvidia_com_gpu() -> None:
    sim = node("gke")

    assert sim.container_devices() == [
        ContainerDevices("ml", "train", "main", "nvidia.com/gpu", ("nvidia2",)),
        ContainerDevices("ml", "train", "main", "example.com/nic", ("nic-7",)),
        ContainerDevices("ml", "chat-0", "main", "nvidia.com/gpu", ("nvidia0/vgpu0",)),
        ContainerDevices("ml", "chat-1", "main", "nvidia.com/gpu", ("nvidia0/vgpu1",)),
        ContainerDevices("nb", "alice", "main", "nvidia.com/gpu", ("nvidia1/gi1",)),
        ContainerDevices("nb", "bob", "main", "nvidia.com/gpu", ("nvidia1/gi5/vgpu0",)),
    ]
    # whole GPUs, replicas of time-shared devices (at least 4), MIG partitions by GI id
    assert sim.allocatable_devices() == [
        AllocatableDevices(
            "nvidia.com/gpu",
            (
                "nvidia2",
                *(f"nvidia0/vgpu{k}" for k in range(4)),
                "nvidia1/gi1",
                *(f"nvidia1/gi5/vgpu{k}" for k in range(4)),
            ),
        )
    ]
    assert sim.claim_devices() == []
    assert sim.resource_slices() == []


def test_dra_allocator_reports_claims_and_leaves_only_other_devices_to_device_plugins() -> None:
    sim = node("dra")

    assert sim.container_devices() == [
        ContainerDevices("ml", "train", "main", "example.com/nic", ("nic-7",))
    ]
    assert sim.allocatable_devices() == []
    got = [
        (c.namespace, c.pod, c.claim_namespace, c.claim_name, c.driver, c.pool, c.device)
        for c in sim.claim_devices()
    ]
    assert got == [
        ("ml", "train", "ml", "train-main-gpu", DRA, NODE, "gpu-2"),
        # one claim shared by both chat pods: the time-shared GPU
        ("ml", "chat-0", "ml", "gpu1-shared", DRA, NODE, "gpu-0"),
        ("ml", "chat-1", "ml", "gpu1-shared", DRA, NODE, "gpu-0"),
        ("nb", "alice", "nb", "alice-main-gpu", DRA, NODE, "gpu-1-mig-3g40gb-9-0"),
        ("nb", "bob", "nb", "gpu2-mig1-shared", DRA, NODE, "gpu-1-mig-2g20gb-14-4"),
    ]


def test_dra_claim_devices_carry_the_drivers_cdi_name_and_no_share_id() -> None:
    claims = node("dra").claim_devices()
    chat = [c for c in claims if c.claim_name == "gpu1-shared"]

    assert all(c.share_id is None for c in claims)
    assert chat[0].cdi_devices == chat[1].cdi_devices  # one claim, one claim UID
    (cdi,) = chat[0].cdi_devices
    assert cdi.startswith("k8s.gpu.nvidia.com/claim=") and cdi.endswith("-gpu-0")


def test_dra_resource_slice_is_the_api_object_with_whole_gpus_and_mig_devices() -> None:
    (obj,) = node("dra").resource_slices()

    assert (obj["apiVersion"], obj["kind"]) == ("resource.k8s.io/v1", "ResourceSlice")
    assert obj["metadata"]["name"].startswith(f"{NODE}-{DRA}-")
    spec = obj["spec"]
    assert (spec["driver"], spec["nodeName"]) == (DRA, NODE)
    assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    devices = {d.name: dict(d.attributes) for d in slice_devices(obj)}
    # the MIG-mode GPU is published only through its MIG devices
    assert sorted(devices) == ["gpu-0", "gpu-1-mig-2g20gb-14-4", "gpu-1-mig-3g40gb-9-0", "gpu-2"]
    assert (devices["gpu-2"]["type"], devices["gpu-2"]["uuid"]) == ("gpu", G0)
    mig = devices["gpu-1-mig-2g20gb-14-4"]
    assert (mig["type"], mig["uuid"], mig["parentUUID"], mig["profile"]) == (
        "mig",
        MIG_B,
        G2,
        "2g.20gb",
    )
    raw = {d["name"]: d["attributes"] for d in spec["devices"]}
    assert raw["gpu-0"]["driverVersion"] == {"version": "550.90.7"}  # semver, no "07"


def test_a_lost_gpu_stays_in_the_resource_slice() -> None:
    clock = ManualClock()
    lost_at_5 = {**WORKLOAD, "timeline": [{"at": 5, "lose": 0}]}
    sim = SimNode(workload("dra", lost_at_5), clock)
    before = sim.resource_slices()
    clock.advance(10)
    after = sim.resource_slices()  # applies the timeline first

    assert sim.gpus[0].lost
    assert after == before


def test_the_allocator_key_is_validated_in_one_line() -> None:
    with pytest.raises(ScenarioError) as info:
        parse_scenario({"allocator": "amd"}, "test")
    assert str(info.value) == "allocator: 'amd' is not one of nvidia, gke, dra"


# -- every form leads to the same GPUs ---------------------------------------------------


@asynccontextmanager
async def running(scenario: Scenario) -> AsyncIterator[SimEnvironment]:
    env = SimEnvironment(scenario, clock=ManualClock(), kube_api=scenario.allocator == "dra")
    await env.start()
    try:
        yield env
    finally:
        await env.stop()


def placements(
    snapshot: PodResourcesSnapshot, resolver: DeviceResolver
) -> dict[tuple[str, str, str], set[tuple[str | None, str | None]]]:
    """(namespace, pod, container) -> the physical (GPU UUID, MIG UUID) it was given."""
    found: dict[tuple[str, str, str], set[tuple[str | None, str | None]]] = {}
    for c in snapshot.containers:
        for device_id in c.device_ids:
            if c.resource_name.startswith("nvidia.com/"):
                r = resolver.device_id(device_id)
                found.setdefault((c.namespace, c.pod, c.container), set()).add((r.uuid, r.mig_uuid))
    for claim in snapshot.claims:
        r = resolver.claim(claim.driver, claim.pool, claim.device)
        found.setdefault((claim.namespace, claim.pod, claim.container), set()).add(
            (r.uuid, r.mig_uuid)
        )
    return found


async def read_through_the_exporter(
    scenario: Scenario,
) -> tuple[dict[tuple[str, str, str], set[tuple[str | None, str | None]]], tuple[ClaimDevice, ...]]:
    async with running(scenario) as env:
        client = PodResourcesClient(env.paths.pod_resources_socket)
        try:
            snapshot = await client.fetch()
        finally:
            await client.close()
        nvml = NvmlSource(clock=env.node.clock)
        try:
            gpus = nvml.sample().gpus
        finally:
            nvml.close()
        published = env.kube_api.resource_slices() if env.kube_api is not None else []
    assert snapshot.ok, snapshot.error
    devices = tuple(d for obj in published for d in slice_devices(obj))
    resolver = DeviceResolver(gpus, ResourceSliceSnapshot(ok=True, timestamp=0.0, devices=devices))
    return placements(snapshot, resolver), snapshot.claims


@pytest.mark.parametrize("base", ["workload", "gke-timesharing", "dra"])
async def test_every_allocator_form_resolves_to_the_same_physical_gpus(base: str) -> None:
    scenario = workload("nvidia") if base == "workload" else load_scenario(base)
    forms = {}
    for allocator in ("nvidia", "gke", "dra"):
        variant = copy.deepcopy(scenario)
        variant.allocator = allocator
        forms[allocator], _ = await read_through_the_exporter(variant)

    assert forms["nvidia"], "the workload allocates GPUs"
    assert all(uuid is not None for got in forms["nvidia"].values() for uuid, _ in got)
    assert forms["gke"] == forms["nvidia"]
    assert forms["dra"] == forms["nvidia"]


async def test_the_dra_claims_reach_the_client_through_the_real_grpc_server() -> None:
    _, claims = await read_through_the_exporter(workload("dra"))

    assert claims == tuple(sorted(node("dra").claim_devices(), key=_order))


def _order(c: ClaimDevice) -> tuple[str, ...]:
    return (c.namespace, c.pod, c.container, c.claim_namespace, c.claim_name, c.device)


# -- device minors -----------------------------------------------------------------------


async def test_proc_tree_fds_open_each_gpus_minor_not_its_index() -> None:
    async with running(workload("nvidia")) as env:
        (proc,) = env.node.processes  # runs on GPU 0, whose minor is 2
        fd_dir = env.paths.proc_root / str(proc.pid) / "fd"
        links = {os.readlink(fd_dir / name) for name in os.listdir(fd_dir)}

    assert "/dev/nvidia2" in links
    assert "/dev/nvidia0" not in links


def test_shipped_gke_node_has_minors_that_are_not_indexes_and_a_shared_dra_claim() -> None:
    gke = load_scenario("gke-timesharing")
    dra = SimNode(load_scenario("dra"), ManualClock())

    assert gke.allocator == "gke"
    assert any(g.minor != g.index for g in gke.gpus)
    by_claim: dict[str, set[str]] = {}
    for c in dra.claim_devices():
        by_claim.setdefault(c.claim_name, set()).add(f"{c.pod}/{c.container}")
    assert max(len(users) for users in by_claim.values()) >= 2
    assert [p.name for p in dra.pods] == [p.name for p in gke.pods]  # the same workload
