"""The data rows of the fault matrix: what the served numbers say while something else
fails (the kubelet down, a slow cycle, a lost GPU). Faults injected at the simulated
node's edge, the real exporter scraped over HTTP, a figure measured for
docs/reliability.md."""

from __future__ import annotations

import asyncio
import time

import pytest

from exporter.sources.kmsg import KmsgReader
from tests.faults.conftest import RecordFault
from tests.harness import Harness, Scrape, simulated_exporter

GiB = 2**30


def pod(name: str, gpu: int, pid: int) -> dict[str, object]:
    return {
        "namespace": "ml",
        "name": name,
        "containers": [
            {
                "name": "main",
                "devices": {"nvidia.com/gpu": [f"gpu{gpu}"]},
                "processes": [
                    {"pid": pid, "gpu": gpu, "memory": "8GiB", "sm": 50, "comm": "python3"}
                ],
            }
        ],
    }


def xids(scrape: Scrape, **labels: str) -> float:
    return sum(v for _, v in scrape.find("gpu_xid_errors_total", **labels))


async def test_data_xid_while_kubelet_down(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "gpus": [{}, {}],
        "pods": [pod("a", 0, 501), pod("b", 1, 502)],
        "timeline": [
            {"at": 10, "xid": {"gpu": 0, "code": 13}},
            {"at": 10, "xid": {"gpu": 1, "code": 48}},
        ],
    }
    async with simulated_exporter(scenario, argv=["--kmsg"]) as h:
        await h.refresh_pod_resources()
        await h.advance(5)
        assert (await h.scrape()).get("gpu_exporter_source_up", source="podresources") == 1
        # The simulator offers no public way to stop its kubelet; its gRPC server is it.
        await h.env._grpc.stop(None)
        await h.refresh_pod_resources()
        await h.advance(5)  # t=10: the XIDs, with the kubelet down
        down = await h.scrape()
        kubelet_up = down.get("gpu_exporter_source_up", source="podresources")
        assert kubelet_up == 0
        counted = xids(down)
        application = xids(down, gpu="0", xid="13", **{"class": "application"})
        fatal = xids(down, gpu="1", xid="48", **{"class": "fatal"})
        assert counted == 2  # both counted, once each (NVML and the kernel log)
        assert application == 1 and fatal == 1
        healthy = {gpu: down.get("gpu_healthy", gpu=gpu) for gpu in ("0", "1")}
        assert healthy == {"0": 1, "1": 0}  # and the verdict follows
        # the pods still own their memory through their cgroups and the pod watch
        owned = {name: down.get("gpu_container_memory_used_bytes", pod=name) for name in ("a", "b")}
        assert owned == {"a": 8 * GiB, "b": 8 * GiB}
        await h.advance(5)
        again = xids(await h.scrape()) - counted
        assert again == 0  # and not again on the next cycle

    record_fault(
        "data-xid-while-kubelet-down",
        expected="XIDs raised while the kubelet's PodResources API is down are counted once "
        "each, with their class, and the health verdict follows them the same cycle; the "
        "pods keep their memory through cgroups and the pod watch.",
        figure=f"{counted:.0f} of 2 XIDs counted ({application:.0f} application, "
        f"{fatal:.0f} fatal), {again:.0f} more on the next cycle, with "
        f"gpu_exporter_source_up{{source=podresources}} {kubelet_up:.0f}; gpu_healthy "
        f"{healthy['1']:.0f} for the fatal one's GPU and {healthy['0']:.0f} for the other "
        f"the same cycle; pods a and b kept {owned['a'] / GiB:.0f} and "
        f"{owned['b'] / GiB:.0f} GiB.",
    )


@pytest.mark.slow
async def test_data_xid_during_slow_cycle(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "gpus": [{"power_mw": 250_000}],
        # from t=10 one NVML query takes 1.2 s, as a driver busy with a GPU in trouble
        "call_errors": [
            {"call": "nvmlDeviceGetTemperature", "delay_s": 1.2, "from": 10, "until": 11}
        ],
        "timeline": [{"at": 12, "xid": {"gpu": 0, "code": 94}}],
    }
    async with simulated_exporter(scenario, argv=["--kmsg"]) as h:
        await h.advance(5)
        listener = h.xid_listener
        h.clock.now = 10.0
        await asyncio.to_thread(h.env.sync)
        started = time.perf_counter()
        slow = asyncio.create_task(h.agent.cycle())
        await asyncio.sleep(0.2)  # the cycle is inside the slow query now
        assert not slow.done()
        h.clock.now = 12.0  # the XID is raised while the cycle waits on NVML
        while listener.events_total == 0:
            assert time.perf_counter() - started < 5, "the XID was not delivered"
            await asyncio.sleep(0.02)
        delivered_s = time.perf_counter() - started
        scrape_started = time.perf_counter()
        during = await h.scrape()  # the previous cycle's output, at once
        scrape_s = time.perf_counter() - scrape_started
        assert xids(during) == 0
        await slow
        cycle_s = time.perf_counter() - started
        assert cycle_s >= 1.2
        await h.advance(5)  # and the kernel log's copy of it arrives
        after = await h.scrape()
        assert xids(after, xid="94") == 1  # counted, once
        kmsg = h.source("kmsg")
        assert isinstance(kmsg, KmsgReader) and kmsg.events_total == 1  # seen twice
        await h.advance(5)
        assert xids(await h.scrape()) == 1

    record_fault(
        "data-xid-during-slow-cycle",
        expected="An XID raised while a cycle is stuck in a slow NVML query is kept by the "
        "listener thread and counted once by the cycles that follow; scrapes meanwhile get "
        "the previous cycle's output at once.",
        figure=f"slow cycle {cycle_s:.2f} s; XID delivered {delivered_s:.2f} s into it and "
        f"counted 1 of 1 (not twice, though the kernel log reported it too); a scrape "
        f"during the slow cycle answered in {scrape_s * 1000:.0f} ms.",
    )


def gpu_series(scrape: Scrape, gpu: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    found: dict[str, list[tuple[dict[str, str], float]]] = {}
    for name, series in scrape.values.items():
        for labels, value in series.items():
            if ("gpu", gpu) in labels:
                found.setdefault(name, []).append((dict(labels), value))
    return found


async def idle_seconds(h: Harness) -> float:
    return (await h.scrape()).get("gpu_container_idle_allocated_seconds_total", pod="a")


async def test_data_lost_gpu_not_fresh(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "gpus": [{"gpm": {"sm_active": 40}}, {"gpm": {"sm_active": 0}}],
        "pods": [pod("a", 1, 501), pod("b", 0, 502)],
        "timeline": [{"at": 3, "xid": {"gpu": 1, "code": 13}}, {"at": 10, "lose": 1}],
    }
    async with simulated_exporter(scenario, argv=["--per-process-metrics"]) as h:
        await h.refresh_pod_resources()
        await h.advance(5)
        first = await h.scrape()
        before, other = gpu_series(first, "1"), set(gpu_series(first, "0"))
        for _ in range(3):  # lost for 3 cycles
            await h.advance(5)
        idle_at_loss = await idle_seconds(h)
        await h.advance(5)
        lost = await h.scrape()
        shown = gpu_series(lost, "1")
        # What stays: identity, state, kubelet facts and cumulative counters; no reading.
        assert set(shown) == {
            "gpu_info",
            "gpu_up",
            "gpu_healthy",
            "gpu_health_reason",
            "gpu_xid_errors_total",
            "gpu_container_allocated",
            "gpu_container_allocated_idle",
            "gpu_container_idle_allocated_seconds_total",
            # the ledger's counters stay (cumulative): the time held goes on, as unhealthy
            "gpu_container_allocated_gpu_seconds_total",
            "gpu_container_idle_gpu_seconds_total",  # the idle part by cause, kept as counted
            "gpu_container_energy_joules_total",
        }
        held = lost.find("gpu_container_allocated_gpu_seconds_total", pod="a")
        assert {labels["state"] for labels, value in held if value > 0} >= {"unhealthy"}
        assert lost.get("gpu_up", gpu="1") == 0 and lost.get("gpu_healthy", gpu="1") == 0
        assert lost.get("gpu_health_reason", gpu="1", reason="gpu_lost") == 1
        assert xids(lost, gpu="1") == 1  # a counter keeps its count
        assert await idle_seconds(h) == idle_at_loss  # a lost GPU is not idle time
        assert lost.get("gpu_container_allocated_idle", pod="a") == 0
        assert lost.find("gpu_container_memory_used_bytes", pod="a") == []
        assert lost.find("gpu_process_memory_used_bytes", pid="501") == []
        assert lost.find("gpu_orphaned_memory_bytes") == []  # its pod's memory is no orphan
        assert set(gpu_series(lost, "0")) == other  # the other GPU: everything
        assert lost.get("gpu_container_memory_used_bytes", pod="b") == 8 * GiB
        dropped = sorted(set(before) - set(shown))

    record_fault(
        "data-lost-gpu-not-fresh",
        expected="While a GPU is lost none of its readings is served from before (memory, "
        "utilization, power, occupancy, per-container and per-process series are absent); "
        "it shows gpu_up 0, unhealthy with reason gpu_lost, its identity, its cumulative "
        "XID counts and the kubelet's allocation, whose idle time stops growing.",
        figure=f"series of the lost GPU: {sum(len(v) for v in before.values())} before, "
        f"{sum(len(v) for v in shown.values())} while lost ({len(dropped)} metric names "
        f"dropped, e.g. {', '.join(dropped[:4])}); idle seconds frozen at "
        f"{idle_at_loss:.0f} s over the loss; the other GPU's series unchanged.",
    )
