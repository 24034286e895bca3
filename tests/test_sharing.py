"""Shared GPUs: turns, memory headroom and growth, HAMi's promised limits.

Served tests run the real exporter on the simulator (pynvml over the simulated library,
the pod watch against the API stand-in) and read the numbers back from /metrics; the
pure tests pin the arithmetic at its edges.
"""

from __future__ import annotations

from typing import Any

import pytest

from exporter.analysis.limits import container_limits, quantity
from exporter.analysis.sharing import MemoryHistory, SharingPolicy, analyse_sharing
from exporter.model import (
    Allocation,
    ContainerGpuUsage,
    ContainerRef,
    DeviceRef,
    GpuSample,
    PodMeta,
    PodMetaSnapshot,
)
from exporter.sim.kube_api import pod_dict
from exporter.sources.kube import pod_meta_from_dict
from tests.harness import Scrape, simulated_exporter

GIB = 1024**3
MIB = 1024**2
HOG_PID = 30001
SHARED = "nvidia.com/gpu.shared"


def _tenant(name: str, replica: int, pid: int, memory: str, sm: int, **limits: Any) -> Any:
    container: dict[str, Any] = {
        "name": "main",
        "devices": {SHARED: [f"gpu0::{replica}"]},
        "processes": [{"pid": pid, "gpu": 0, "memory": memory, "sm": sm}],
    }
    if limits:
        container["limits"] = {
            k.replace("_", "-").replace("nvidia-com-", "nvidia.com/"): v for k, v in limits.items()
        }
    return {"namespace": "inference", "name": name, "containers": [container]}


def scenario(*, hog_sm: int = 90, waiter_sm: int = 3) -> dict[str, Any]:
    """One time-sliced H100 (replicas of GPU 0) shared by four pods; the hog grows by
    40 GiB at t=20 s. waiter-1 is HAMi-limited by MiB and cores, waiter-2 by a percentage
    of the device's memory, waiter-3 has no limit."""
    return {
        "gpus": [{"utilization_gpu": 99}, {"utilization_gpu": 0}],
        "pods": [
            _tenant("hog", 0, HOG_PID, "20GiB", hog_sm),
            _tenant(
                "waiter-1",
                1,
                30002,
                "6GiB",
                waiter_sm + 1,
                nvidia_com_gpumem="10240",
                nvidia_com_gpucores="30",
            ),
            _tenant("waiter-2", 2, 30003, "6GiB", waiter_sm, nvidia_com_gpumem_percentage="25"),
            _tenant("waiter-3", 3, 30004, "6GiB", waiter_sm),
            {
                "namespace": "train",
                "name": "alone",
                "containers": [
                    {
                        "name": "main",
                        "devices": {"nvidia.com/gpu": ["gpu1"]},
                        "limits": {"nvidia.com/gpucores": "50"},
                        "processes": [{"gpu": 1, "memory": "4GiB", "sm": 80}],
                    }
                ],
            },
        ],
        "timeline": [{"at": 20, "set_process": {"pid": HOG_PID, "memory": "60GiB"}}],
    }


async def served(data: dict[str, Any], *steps: float) -> list[Scrape]:
    out = []
    async with simulated_exporter(data) as h:
        for step in steps:
            await h.advance(step)
            out.append(await h.scrape())
    return out


def pod_value(scrape: Scrape, name: str, pod: str) -> float:
    return scrape.get(name, pod=pod)


async def test_a_hog_takes_ninety_percent_of_the_turns_while_three_others_wait() -> None:
    (scrape,) = await served(scenario(), 5)
    assert scrape.get("gpu_shared_containers", gpu="0") == 4
    assert scrape.get("gpu_shared_active_containers", gpu="0") == 4
    share = {
        p: pod_value(scrape, "gpu_container_sm_time_share_ratio", p)
        for p in ("hog", "waiter-1", "waiter-2", "waiter-3")
    }
    assert share == pytest.approx(
        {"hog": 0.9, "waiter-1": 0.04, "waiter-2": 0.03, "waiter-3": 0.03}
    )
    assert pod_value(scrape, "gpu_container_sm_fair_share_deviation_ratio", "hog") == (
        pytest.approx(0.65)
    )
    assert pod_value(scrape, "gpu_container_sm_fair_share_deviation_ratio", "waiter-3") == (
        pytest.approx(-0.22)
    )


async def test_fair_sharing_gives_each_active_container_an_equal_share() -> None:
    (scrape,) = await served(scenario(hog_sm=20, waiter_sm=20), 5)
    deviations = [v for _, v in scrape.find("gpu_container_sm_fair_share_deviation_ratio")]
    assert len(deviations) == 4
    assert max(abs(d) for d in deviations) < 0.02


async def test_an_exclusive_gpu_is_not_a_shared_one() -> None:
    (scrape,) = await served(scenario(), 5)
    assert scrape.find("gpu_shared_containers", gpu="1") == []
    assert scrape.find("gpu_container_sm_time_share_ratio", pod="alone") == []


async def test_headroom_is_total_minus_used_minus_reserved_and_the_grower_is_named() -> None:
    before, after, later = await served(scenario(), 5, 20, 300)
    for scrape in (before, after):
        total = scrape.get("gpu_memory_total_bytes", gpu="0")
        used = scrape.get("gpu_memory_used_bytes", gpu="0")
        reserved = scrape.get("gpu_memory_reserved_bytes", gpu="0")
        assert scrape.get("gpu_shared_memory_headroom_bytes", gpu="0") == total - used - reserved
    assert (
        before.get("gpu_shared_memory_headroom_bytes", gpu="0")
        - after.get("gpu_shared_memory_headroom_bytes", gpu="0")
        == 40 * GIB
    )
    assert pod_value(before, "gpu_container_memory_growth_bytes", "hog") == 0
    assert pod_value(after, "gpu_container_memory_growth_bytes", "hog") == 40 * GIB
    assert pod_value(after, "gpu_container_memory_growth_bytes", "waiter-1") == 0
    # five minutes later the growth is history: it no longer counts as recent
    assert pod_value(later, "gpu_container_memory_growth_bytes", "hog") == 0


async def test_hami_limits_are_served_next_to_use_and_absent_without_a_limit() -> None:
    (scrape,) = await served(scenario(), 5)
    total = scrape.get("gpu_memory_total_bytes", gpu="0")
    assert pod_value(scrape, "gpu_container_memory_limit_bytes", "waiter-1") == 10240 * MIB
    assert pod_value(scrape, "gpu_container_sm_limit_ratio", "waiter-1") == pytest.approx(0.3)
    assert pod_value(scrape, "gpu_container_memory_limit_bytes", "waiter-2") == int(total / 4)
    assert scrape.find("gpu_container_sm_limit_ratio", pod="waiter-2") == []
    assert scrape.find("gpu_container_memory_limit_bytes", pod="waiter-3") == []
    assert scrape.find("gpu_container_sm_limit_ratio", pod="waiter-3") == []
    assert pod_value(scrape, "gpu_container_sm_limit_ratio", "alone") == pytest.approx(0.5)
    # used vs promised: waiter-1 uses 6 GiB of its 10 GiB
    used = pod_value(scrape, "gpu_container_memory_used_bytes", "waiter-1")
    assert used == 6 * GIB


def test_the_pod_watch_reads_extended_limits_and_falls_back_to_requests() -> None:
    pod = pod_dict(
        "ml",
        "p",
        "uid-1",
        "node",
        containers=[("main", "a" * 64), ("side", "b" * 64)],
        limits={"main": {"nvidia.com/gpumem": "4096", "cpu": "2"}},
    )
    pod["spec"]["containers"][1]["resources"] = {"requests": {"nvidia.com/gpucores": "20"}}
    meta = pod_meta_from_dict(pod)
    assert meta is not None
    assert meta.resources == (
        ("main", "nvidia.com/gpumem", "4096"),
        ("side", "nvidia.com/gpucores", "20"),
    )


def test_quantities_parse_as_kubernetes_spells_them() -> None:
    assert quantity("10240") == 10240
    assert quantity("4k") == 4000
    assert quantity("1Gi") == GIB
    assert quantity("lots") is None
    assert quantity("") is None


DEVICE = DeviceRef(0, "GPU-a")
A, B = ContainerRef("ns", "a", "main"), ContainerRef("ns", "b", "main")
H100 = GpuSample(
    index=0,
    uuid="GPU-a",
    memory_total_bytes=80 * GIB,
    memory_used_bytes=70 * GIB,
    memory_reserved_bytes=GIB,
)


def test_no_samples_means_no_shares_not_zero_shares() -> None:
    rows = (
        ContainerGpuUsage(A, DEVICE, GIB, None, 1),
        ContainerGpuUsage(B, DEVICE, GIB, None, 1),
    )
    shared, shares, _ = analyse_sharing(
        rows, (), (H100,), MemoryHistory(), now=0.0, policy=SharingPolicy()
    )
    assert shared[0].active_containers == 0
    assert shared[0].memory_headroom_bytes == 9 * GIB
    assert [(s.sm_time_share, s.fair_share_deviation) for s in shares] == [(None, None)] * 2


def test_a_single_tenant_of_a_declared_shared_replica_is_still_shared() -> None:
    rows = (ContainerGpuUsage(A, DEVICE, GIB, 0.5, 1),)
    allocation = Allocation(A, DEVICE, "GPU-a::0", SHARED, shared=True)
    shared, shares, _ = analyse_sharing(
        rows, (allocation,), (H100,), MemoryHistory(), now=0.0, policy=SharingPolicy()
    )
    assert (shared[0].containers, shared[0].active_containers) == (1, 1)
    assert (shares[0].sm_time_share, shares[0].fair_share_deviation) == (1.0, 0.0)


def test_a_zero_or_malformed_promise_is_no_limit() -> None:
    pods = PodMetaSnapshot(
        ok=True,
        timestamp=0.0,
        pods=(
            PodMeta(
                "u",
                "ns",
                "a",
                resources=(
                    ("main", "nvidia.com/gpumem", "0"),
                    ("main", "nvidia.com/gpucores", "x"),
                ),
            ),
        ),
    )
    rows = (ContainerGpuUsage(A, DEVICE, GIB, 0.5, 1),)
    assert container_limits(pods, rows, (), (H100,)) == ()


def test_growth_is_use_now_minus_the_least_use_in_the_window_and_steady_use_keeps_one_sample() -> (
    None
):
    """Against the definition, over a walk of ups, downs and plateaus: growth is the
    use now minus the least use of the window (the last 300 s, now included)."""
    policy = SharingPolicy()
    uses = [5, 5, 7, 3, 3, 9, 9, 9, 4, 6, 6, 2, 8] * 40  # 520 cycles, 10 s apart
    history = MemoryHistory()
    for cycle, use in enumerate(uses):
        now = cycle * 10.0
        rows = (
            ContainerGpuUsage(A, DEVICE, use * GIB, None, 1),
            ContainerGpuUsage(B, DEVICE, GIB, None, 1),
        )
        _, shares, history = analyse_sharing(rows, (), (H100,), history, now=now, policy=policy)
        window = [u for c, u in enumerate(uses[: cycle + 1]) if c * 10.0 > now - 300.0]
        assert shares[0].memory_growth_bytes == (use - min(window)) * GIB
    assert len(history.samples[(B, "GPU-a")]) == 1  # B's use never moved
