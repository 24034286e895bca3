"""What a scrape shows when NVML refuses or fails part of its work: the real exporter on
the simulated node (tests/harness.py), NVML failures injected with ``call_errors``."""

from __future__ import annotations

from tests.harness import simulated_exporter

NVML = {"source": "nvml"}


async def test_gpm_permission_loss_is_counted_while_nvml_and_the_gpu_stay_up() -> None:
    # DCGM issue #214: GPM answers NO_PERMISSION after a while in an unprivileged container
    scenario = {
        "gpus": [{"gpm": {"sm_active": 40}}],
        "call_errors": [
            {"call": "nvmlGpmSampleGet", "error": "NO_PERMISSION", "from": 10, "until": 30}
        ],
    }
    async with simulated_exporter(scenario) as h:
        await h.advance(5)
        before = await h.scrape()
        assert before.get("gpu_sm_active_ratio", gpu="0") == 0.4
        errors_before = before.get("gpu_exporter_errors_total", **NVML)

        await h.advance(5)  # t=10: refused
        refused = await h.scrape()
        assert refused.find("gpu_sm_active_ratio", gpu="0") == []  # absent, not zero
        assert refused.get("gpu_exporter_errors_total", **NVML) == errors_before + 1
        assert refused.get("gpu_exporter_source_up", **NVML) == 1  # NVML itself answers
        assert refused.get("gpu_up", gpu="0") == 1
        assert refused.get("gpu_healthy", gpu="0") == 1
        # (retries follow the source's real monotonic clock here; that they resume and
        # the figures come back is tests/test_nvml_source.py's manual-clock test)


async def test_a_device_count_that_fails_is_nvml_down_not_a_node_without_gpus() -> None:
    scenario = {
        "gpus": [{}, {}],
        "call_errors": [{"call": "nvmlDeviceGetCount_v2", "error": "UNKNOWN", "until": 1}],
    }
    async with simulated_exporter(scenario) as h:
        for _ in range(2):  # the next cycles too, until a retry counts the GPUs
            down = await h.scrape()
            assert down.get("gpu_exporter_source_up", **NVML) == 0
            assert down.get("gpu_exporter_nvml_up") == 0
            assert down.series("gpu_info") == {}
            await h.advance(5)
