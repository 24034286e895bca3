"""What a scrape shows when NVML refuses or fails part of its work: the real exporter on
the simulated node (tests/harness.py), NVML failures injected with ``call_errors``.
(Refused queries, GPM's included, are the fault matrix's ``nvml-no-permission`` in
tests/faults/test_nvml_faults.py.)"""

from __future__ import annotations

from tests.harness import simulated_exporter

NVML = {"source": "nvml"}


async def test_a_device_count_that_fails_is_nvml_down_not_a_node_without_gpus() -> None:
    scenario = {
        "gpus": [{}, {}],
        "call_errors": [{"call": "nvmlDeviceGetCount_v2", "error": "UNKNOWN", "until": 12}],
    }
    async with simulated_exporter(scenario) as h:
        # the retries (backoff 1, 2, 4 s on the source's clock, the simulated one here)
        # at t = 5 and 10 fail too: down every cycle, never a node without GPUs
        for _ in range(3):
            down = await h.scrape()
            assert down.get("gpu_exporter_source_up", **NVML) == 0
            assert down.get("gpu_exporter_nvml_up") == 0
            assert down.series("gpu_info") == {}
            await h.advance(5)
        # t = 15: the count answers again, and the retry counts both GPUs
        up = await h.scrape()
        assert up.get("gpu_exporter_source_up", **NVML) == 1
        assert len(up.series("gpu_info")) == 2
