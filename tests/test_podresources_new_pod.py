"""A pod that starts between scheduled PodResources refreshes: its GPU process makes the
agent ask for a refresh (exporter/sources/podresources/source.py), so its use is
attributed to its allocation within seconds, not served as use of a GPU it was never
given until the schedule comes round (600 s here)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from tests.harness import Harness, simulated_exporter

MAIN: dict[str, Any] = {"name": "main", "devices": {"nvidia.com/gpu": ["gpu1"]}}
SCENARIO: dict[str, Any] = {
    "gpus": [{}, {}],
    "pods": [
        {
            "namespace": "ml",
            "name": "a",
            "containers": [
                {
                    "name": "main",
                    "devices": {"nvidia.com/gpu": ["gpu0"]},
                    "processes": [{"pid": 600, "gpu": 0, "memory": "1GiB"}],
                }
            ],
        }
    ],
    "timeline": [
        {"at": 5, "add_pod": {"pod": "ml/b", "containers": [MAIN]}},
        {
            "at": 5,
            "start": {"pid": 700, "gpu": 1, "memory": "2GiB", "pod": "ml/b", "container": "main"},
        },
    ],
}


async def test_a_new_pods_gpu_process_brings_its_allocation_within_seconds() -> None:
    async with simulated_exporter(SCENARIO) as h:
        source = h.pod_resources
        primed = source.read(None).timestamp  # type: ignore[arg-type]
        refreshing = asyncio.create_task(source.run())  # the refresh task, every 600 s
        try:
            # its first refresh, at once, answers before pod b exists
            while source.read(None).timestamp == primed:  # type: ignore[arg-type]
                await asyncio.sleep(0.01)
            await h.advance(1)
            asked = source.requests_total
            await h.advance(1)
            assert source.requests_total == asked  # the same containers: nothing asked

            await h.advance(3)  # pod b starts, its process on GPU 1
            assert source.requests_total == asked + 1
            # this cycle attributed it against the answer from before the pod
            assert allocated(h, 700) is not True

            deadline = time.monotonic() + 10  # the refresh begins 2 s after the last at most
            while allocated(h, 700) is not True:
                assert time.monotonic() < deadline, "pod b's allocation never came"
                await asyncio.sleep(0.2)
                await h.advance(1)
            scrape = await h.scrape()
            assert scrape.find("gpu_unallocated_use_memory_bytes", pod="b") == []
            assert source.requests_total == asked + 1  # asked once for the new container
        finally:
            refreshing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refreshing


def allocated(h: Harness, pid: int) -> bool | None:
    """Whether the last cycle found ``pid``'s container holding the GPU it uses."""
    assert h.agent.latest is not None
    (row,) = [p for p in h.agent.latest.attribution.processes if p.pid == pid]
    return row.allocated
