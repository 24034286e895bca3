"""One workload, three allocators, one truth on /metrics.

The shipped ``gke-timesharing`` scenario is served three times, with its allocator set
to NVIDIA's device plugin (UUIDs, ``::N`` replicas), GKE's device plugin
(``nvidiaN[/giM][/vgpuK]``) and NVIDIA's DRA driver (ResourceClaims + a ResourceSlice
served by the Kubernetes API stand-in). Through the whole exporter (real gRPC
PodResources, real ``kubernetes`` watch, real HTTP scrape), every series about
attribution, leaks, idle reservations, orphans and capacity is the same on the three
nodes, apart from how the allocator names a device (``device_id``) and, for DRA, the
resource (the driver's name instead of an extended resource).
"""

from __future__ import annotations

import asyncio
import copy
from importlib import resources
from typing import Any

import pytest
import yaml

from tests.harness import Harness, Labels, Scrape, simulated_exporter

ALLOCATORS = ("nvidia", "gke", "dra")
DRA_DRIVER = "gpu.nvidia.com"

# Families whose value depends on allocation; compared across allocators.
COMPARED = (
    "gpu_container_allocated",
    "gpu_container_allocated_idle",
    "gpu_container_idle_allocated_seconds_total",
    "gpu_container_memory_used_bytes",
    "gpu_container_sm_active_ratio",
    "gpu_unallocated_use_memory_bytes",
    "gpu_unattributed_memory_bytes",
    "gpu_orphaned_memory_bytes",
    "gpu_node_devices",
    "gpu_exporter_unresolved_allocations",
)
NAMING_LABELS = {"device_id", "resource"}


def workload(allocator: str) -> dict[str, Any]:
    shipped = resources.files("exporter.sim").joinpath("scenarios/gke-timesharing.yaml")
    scenario = copy.deepcopy(yaml.safe_load(shipped.read_text(encoding="utf-8")))
    scenario["allocator"] = allocator
    # one node name: the simulator derives UUIDs and pids from it
    return dict(scenario)


def without_naming(series: dict[Labels, float]) -> dict[Labels, float]:
    out: dict[Labels, float] = {}
    for labels, value in series.items():
        key = frozenset((k, v) for k, v in labels if k not in NAMING_LABELS)
        out[key] = out.get(key, 0.0) + value  # capacity: one row per resource, summed
    return out


async def served(allocator: str, timeline: list[dict[str, Any]] | None = None) -> Scrape:
    scenario = workload(allocator)
    if timeline:
        scenario["timeline"] = timeline
    async with simulated_exporter(scenario) as h:
        await settle(h)
        return await h.scrape()


async def settle(h: Harness, seconds: int = 30) -> None:
    for _ in range(seconds // 10):
        await h.advance(10, cycle=False)
        await h.refresh_pod_resources()
        await h.cycle()


@pytest.fixture(scope="module")
def scrapes() -> dict[str, Scrape]:
    return {a: asyncio.run(served(a)) for a in ALLOCATORS}


def test_the_workload_is_attributed_and_allocated_on_every_allocator(
    scrapes: dict[str, Scrape],
) -> None:
    for allocator, s in scrapes.items():
        allocated = s.series("gpu_container_allocated")
        # 1 + 3 shared + 3 MIG + 1: eight allocated devices, every one resolved
        assert len(allocated) == 8, allocator
        assert all(dict(k)["uuid"] for k in allocated), allocator
        assert len(s.series("gpu_container_memory_used_bytes")) >= 8, allocator


def test_no_isolation_leak_and_nothing_unresolved_on_any_allocator(
    scrapes: dict[str, Scrape],
) -> None:
    for allocator, s in scrapes.items():
        leaks = {k: v for k, v in s.series("gpu_unallocated_use_memory_bytes").items() if v}
        assert not leaks, (allocator, leaks)
        assert all(v == 0 for v in s.series("gpu_exporter_unresolved_allocations").values())


@pytest.mark.parametrize("allocator", ["gke", "dra"])
def test_every_allocation_series_equals_the_nvidia_device_plugins(
    scrapes: dict[str, Scrape], allocator: str
) -> None:
    for family in COMPARED:
        if allocator == "dra" and family == "gpu_node_devices":
            continue  # DRA counts devices, not replicas: see the next test
        expected = without_naming(scrapes["nvidia"].series(family))
        got = without_naming(scrapes[allocator].series(family))
        assert got == expected, family


def test_dra_capacity_counts_the_resource_slices_devices(scrapes: dict[str, Scrape]) -> None:
    # A device plugin advertises a time-shared GPU once per replica (the inference GPU
    # as nvidia.com/gpu.shared x4 here); DRA advertises each device once and shares it
    # through one claim. So DRA capacity is the slice: GPUs 0, 1 and 3, and GPU 2's three
    # MIG devices (a GPU in MIG mode is published as its MIG devices only), all held.
    def states(s: Scrape) -> dict[str, float]:
        return {labels["state"]: v for labels, v in s.find("gpu_node_devices")}

    assert states(scrapes["dra"]) == {
        "advertised": 6,
        "healthy": 6,
        "unhealthy": 0,
        "unknown": 0,
        "allocated": 6,
        "allocatable": 0,
        "disrupted": 0,
    }
    by_state = without_naming(scrapes["nvidia"].series("gpu_node_devices"))
    nvidia = {dict(k)["state"]: v for k, v in by_state.items()}
    assert nvidia["advertised"] - states(scrapes["dra"])["advertised"] == 3  # 4 replicas, 1 GPU


def test_dra_allocations_name_the_driver_and_claim_devices(scrapes: dict[str, Scrape]) -> None:
    dra = scrapes["dra"].find("gpu_container_allocated")
    assert {labels["resource"] for labels, _ in dra} == {DRA_DRIVER}
    node = "sim-gke-node"  # the DRA driver's pool is the node's name
    assert all(labels["device_id"].startswith(f"{node}/gpu-") for labels, _ in dra)
    gke = scrapes["gke"].find("gpu_container_allocated")
    assert {labels["device_id"] for labels, _ in gke} >= {"nvidia2", "nvidia0/vgpu1", "nvidia1/gi5"}
    devices = scrapes["dra"].find("gpu_node_devices", state="advertised")
    assert {labels["resource"] for labels, _ in devices} == {DRA_DRIVER}


@pytest.mark.parametrize("allocator", ALLOCATORS)
async def test_a_lost_gpu_is_unhealthy_capacity_on_every_allocator(allocator: str) -> None:
    # GPU 3 (nvidia3 on GKE, gpu-3 for DRA) falls off the bus at 15 s.
    s = await served(allocator, [{"at": 15, "lose": 3}])
    unhealthy = sum(v for _, v in s.find("gpu_node_devices", state="unhealthy"))
    assert unhealthy == 1, allocator
    before = await served(allocator)
    healthy_before = sum(v for _, v in before.find("gpu_node_devices", state="healthy"))
    healthy = sum(v for _, v in s.find("gpu_node_devices", state="healthy"))
    assert healthy == healthy_before - 1, allocator
