"""The capacity rows of the fault matrix: what ``gpu_node_devices`` says while the
evidence for it is missing (the kubelet down, NVML down, a GPU NVML cannot name, device
ids that name no GPU). Faults injected at the simulated node's edge (its kubelet's real
gRPC server, its libnvidia-ml), the real exporter scraped over HTTP, a figure measured
for docs/reliability.md. The rule under test is docs/health.md's "Unknown": a count
whose source is down is absent, a device no present source can judge is counted in
``state="unknown"``, and neither is ever counted healthy or allocatable."""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest

from exporter.model import AllocatableDevices
from exporter.sim.podresources_server import start_podresources_server
from tests.faults.conftest import RecordFault
from tests.faults.test_nvml_faults import until
from tests.harness import Harness, Scrape, simulated_exporter
from tests.test_podresources import sock, sock_dir

__all__ = ["sock", "sock_dir"]  # fixtures, shared with test_podresources

DEVICES = "gpu_node_devices"
GPU = "nvidia.com/gpu"


def pod(name: str, gpu: int, pid: int) -> dict[str, object]:
    return {
        "namespace": "ml",
        "name": name,
        "containers": [
            {
                "name": "main",
                "devices": {GPU: [f"gpu{gpu}"]},
                "processes": [{"pid": pid, "gpu": gpu, "memory": "1GiB", "comm": "python3"}],
            }
        ],
    }


def states(scrape: Scrape, resource: str = GPU) -> dict[str, float]:
    """The served states of one resource: a state that is absent is not in the dict."""
    return {labels["state"]: v for labels, v in scrape.find(DEVICES, resource=resource)}


def source_up(scrape: Scrape, source: str) -> float:
    return scrape.get("gpu_exporter_source_up", source=source)


def shown(found: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in sorted(found.items())) or "none"


async def test_capacity_kubelet_down(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "gpus": [{}, {}, {}, {}],
        "pods": [pod("a", 0, 501), pod("b", 1, 502)],
    }
    async with simulated_exporter(scenario) as h:
        await h.refresh_pod_resources()
        await h.advance(5)
        before = states(await h.scrape())
        assert before["allocated"] == 2 and before["allocatable"] == 2
        # The simulator offers no public way to stop its kubelet; its gRPC server is it.
        await h.env._grpc.stop(None)
        await h.refresh_pod_resources()
        await h.advance(5)
        down = await h.scrape()
        during = states(down)

    assert source_up(down, "podresources") == 0
    # Which devices are taken only the kubelet knows: neither count is served, least of
    # all "every GPU allocatable" (4 before the fix).
    assert "allocatable" not in during and "allocated" not in during
    # What NVML knows stays: its GPUs, each judged.
    assert during == {"advertised": 4, "healthy": 4, "unhealthy": 0, "unknown": 0}

    record_fault(
        "data-capacity-kubelet-down",
        expected="While the kubelet's PodResources API is down, gpu_node_devices serves no "
        "allocated and no allocatable count (unknown, absent), never every GPU as "
        "allocatable; NVML's GPUs and their health stay.",
        figure=f"kubelet up: {shown(before)}; kubelet down: {shown(during)} "
        f"(allocated and allocatable absent).",
    )


@pytest.mark.slow  # waits on NVML's real init retry backoff (1 s)
async def test_nvml_down_capacity_unknown(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "nvml_init_error": "DRIVER_NOT_LOADED",
        "gpus": [{}, {}, {}],
        "pods": [pod("a", 0, 501)],
    }
    async with simulated_exporter(scenario) as h:
        await h.refresh_pod_resources()
        await h.advance(5)
        down = await h.scrape()
        during = states(down)
        h.env.node.scenario.nvml_init_error = None  # the driver loads
        back, _, seconds = await until(
            h, lambda s: "healthy" in states(s), "health to be judged again"
        )
        after = states(back)

    assert source_up(down, "nvml") == 0 and source_up(down, "podresources") == 1
    # The kubelet's devices, none judged: unknown, never healthy (3 before the fix).
    assert during == {"advertised": 3, "unknown": 3, "allocated": 1}
    assert down.series("gpu_healthy") == {}
    assert after == {
        "advertised": 3,
        "healthy": 3,
        "unhealthy": 0,
        "unknown": 0,
        "allocated": 1,
        "allocatable": 2,
        "disrupted": 0,  # the Node is in service
    }

    record_fault(
        "nvml-down-capacity-unknown",
        expected="While NVML is down the kubelet's advertised devices are counted "
        "state=unknown; healthy, unhealthy and allocatable are absent, never healthy; "
        "once NVML answers they are judged again.",
        figure=f"NVML down: {shown(during)}; judged again {seconds:.1f} s after the driver "
        f"loaded: {shown(after)}.",
    )


async def test_nvml_gpu_lost_before_start(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "gpus": [{}, {"lost": True}, {}],
        "pods": [pod("a", 0, 501)],
    }
    async with simulated_exporter(scenario) as h:
        await h.refresh_pod_resources()
        await h.advance(5)
        s = await h.scrape()
        lost_uuid = h.env.node.gpus[1].uuid

    found = states(s)
    # The kubelet advertises the lost GPU by its UUID, which NVML cannot read: unhealthy,
    # not healthy (3 healthy before the fix).
    assert found == {
        "advertised": 3,
        "healthy": 2,
        "unhealthy": 1,
        "unknown": 0,
        "allocated": 1,
        "allocatable": 1,
        "disrupted": 0,  # the Node is in service
    }
    # NVML names it by index only: a placeholder uuid that no kubelet id can match.
    ((labels, verdict),) = s.find("gpu_healthy", gpu="1")
    assert verdict == 0 and labels["uuid"] == "unknown-gpu-1" != lost_uuid
    assert s.get("gpu_health_reason", gpu="1", reason="gpu_lost") == 1
    assert not any(lost_uuid in dict(k).values() for k in s.series("gpu_healthy"))

    record_fault(
        "nvml-gpu-lost-before-start",
        expected="A GPU lost before the exporter starts (its UUID unreadable) is unhealthy "
        "twice over: gpu_healthy 0 with reason gpu_lost under gpu=<index>, "
        "uuid=unknown-gpu-<index>, and the kubelet's device for it, which NVML cannot see, "
        "counted unhealthy in gpu_node_devices, not healthy.",
        figure=f"gpu_node_devices: {shown(found)}; gpu_healthy{{gpu=1,"
        f"uuid={labels['uuid']}}} {verdict:g}.",
    )


async def timed_cycles(h: Harness, n: int) -> list[float]:
    """Wall seconds of ``n`` sample cycles, 5 s of simulated time apart."""
    out = []
    for _ in range(n):
        began = time.perf_counter()
        await h.advance(5)
        out.append(time.perf_counter() - began)
    return out


async def test_kubelet_unresolvable_device_ids(sock: Path, record_fault: RecordFault) -> None:
    count = 20_000
    bogus = tuple(f"vendor.example/dev-{i:05d}" for i in range(count))
    argv = ["--pod-resources-socket", str(sock)]
    scenario: dict[str, object] = {"gpus": [{}, {}], "pods": [pod("a", 0, 501)]}
    async with simulated_exporter(scenario, argv=argv) as h:
        node = h.env.node
        extra = {"on": False}

        def answer() -> tuple[object, ...]:
            advertised = node.allocatable_devices()
            if extra["on"]:  # the same resource, 20,000 ids more
                advertised = [
                    AllocatableDevices(a.resource_name, (*a.device_ids, *bogus)) for a in advertised
                ]
            return (node.container_devices(), advertised, node.claim_devices())

        server = await start_podresources_server(sock, answer)  # type: ignore[arg-type]
        try:
            await h.refresh_pod_resources()
            baseline_s = statistics.median(await timed_cycles(h, 5))
            extra["on"] = True
            began = time.perf_counter()
            await h.refresh_pod_resources()
            refresh_s = time.perf_counter() - began
            cycle_s = statistics.median(await timed_cycles(h, 5))
            async with h.session.get(h.url + "/metrics") as response:
                size = len(await response.read())
            s = await h.scrape()
        finally:
            await server.stop(None)

    assert source_up(s, "podresources") == 1
    found = states(s)
    # Counted once, as unknown: not healthy, not allocatable (20,002 healthy before).
    assert found == {
        "advertised": count + 2,
        "healthy": 2,
        "unhealthy": 0,
        "unknown": count,
        "allocated": 1,
        "allocatable": 1,
        "disrupted": 0,  # the Node is in service
    }
    # Counts only: no series names an advertised id, whatever the kubelet sends.
    assert len(s.series(DEVICES)) == 7
    assert not any("dev-0" in v for series in s.values.values() for k in series for _, v in k)
    assert cycle_s < 1.0  # a sample cycle, not a stall

    record_fault(
        "kubelet-unresolvable-device-ids",
        expected="Advertised device ids that name no GPU are counted in "
        "gpu_node_devices{state=unknown}, never healthy or allocatable, and never as "
        "labels: the served series do not grow with the kubelet's answer.",
        figure=f"{count:,} ids in one gRPC answer: refresh {refresh_s * 1000:.0f} ms; "
        f"sample cycle {cycle_s * 1000:.0f} ms median vs {baseline_s * 1000:.0f} ms "
        f"without them; served {shown(found)} in {len(s.series(DEVICES))} series, "
        f"/metrics {size / 1024:.0f} KiB.",
    )
