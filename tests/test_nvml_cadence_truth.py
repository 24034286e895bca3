"""The cadence tiers under failure: a read that fails, or answers garbage, is unknown.

A slow-tier health fact whose read fails keeps the GPU's verdict (its series absent);
a field value that is not finite, answers another field, or is missing is that field
unknown and counted; an exception in one GPU's reads fails that GPU, never the sample.
Read through the real pynvml over the simulated libnvidia-ml, and end to end through
the real exporter on a simulated node (tests/harness.py) with the API stand-in.
"""

from __future__ import annotations

import pytest

from exporter.analysis.health import KnownFacts, with_known_facts
from exporter.model import GpuSample, RemappedRows
from tests.harness import simulated_exporter
from tests.test_kube_condition_taints import status_of
from tests.test_kube_events import api, quiet, step, until_equal

R580: dict[str, object] = {"driver_version": "580.65.06", "nvml_version": "13.580.65.06"}

# the fact, the scenario's GPU that shows it, the call that will fail, its series
FACTS = {
    "remap": ({"remapped_failure": True}, "nvmlDeviceGetRemappedRows", "gpu_row_remap_failed"),
    "ecc": ({"ecc_uncorrected": 3}, "nvmlDeviceGetTotalEccErrors", "gpu_ecc_errors_total"),
    "pages": ({"retired_pages_dbe": 70}, "nvmlDeviceGetRetiredPages", None),
}


# -- F1: a failed slow read keeps the verdict -------------------------------------------


def test_a_fact_not_read_is_judged_on_its_last_known_value_and_served_absent() -> None:
    failed = RemappedRows(0, 1, failure=True, pending=False)
    read = GpuSample(index=0, uuid="GPU-a", remapped_rows=failed, retired_pages=70)
    judged, known = with_known_facts((read,), {}, nvml_ok=True)
    assert judged == (read,)
    not_read = GpuSample(index=0, uuid="GPU-a")
    (judged_gpu,), carried = with_known_facts((not_read,), known, nvml_ok=True)
    assert (judged_gpu.remapped_rows, judged_gpu.retired_pages) == (failed, 70)
    assert carried == known
    # a fresh read replaces what was known; a GPU never read carries nothing
    fixed = GpuSample(index=0, uuid="GPU-a", remapped_rows=RemappedRows(0, 0, False, False))
    (judged_gpu,), carried = with_known_facts((fixed,), known, nvml_ok=True)
    assert judged_gpu.remapped_rows == RemappedRows(0, 0, False, False)
    assert judged_gpu.retired_pages == 70  # not read this cycle: still as last known
    assert with_known_facts((not_read,), {}, nvml_ok=True) == ((not_read,), {})


def test_known_facts_survive_nvml_down_and_a_lost_gpu_and_leave_with_the_gpu() -> None:
    known = {"GPU-a": KnownFacts(ecc_uncorrected_volatile=3)}
    assert with_known_facts((), known, nvml_ok=False) == ((), known)
    lost = GpuSample(index=0, uuid="GPU-a", error="GpuIsLost")
    assert with_known_facts((lost,), known, nvml_ok=True) == ((lost,), known)
    other = GpuSample(index=0, uuid="GPU-b")
    assert with_known_facts((other,), known, nvml_ok=True) == ((other,), {})
    twins = (GpuSample(index=0, uuid="GPU-a"), GpuSample(index=1, uuid="GPU-a"))
    assert with_known_facts(twins, known, nvml_ok=True) == (twins, {})


@pytest.mark.parametrize("fact", sorted(FACTS))
async def test_a_failed_slow_read_of_a_health_fact_keeps_the_gpu_unhealthy(fact: str) -> None:
    """GPU 0 is unhealthy by ``fact``; the slow read at 30 s is refused (NoPermission).
    Until the next slow read at 60 s the fact's series is absent, yet the GPU stays
    unhealthy for the same reason: no GPUHealthy Event, no second GPUUnhealthy, the node
    condition True throughout."""
    gpu, call, family = FACTS[fact]
    scenario: dict[str, object] = {
        **R580,
        "node_name": f"sim-f1-{fact}",
        "gpus": [gpu, {}],
        "call_errors": [
            {"call": call, "error": "NO_PERMISSION", "gpu": 0, "from": 25, "until": 35}
        ],
    }
    argv = ["--interval", "1", "--slow-interval", "30", "--node-condition"]
    async with simulated_exporter(scenario, argv=argv) as h:
        reasons: set[str] = set()
        for _ in range(7):  # 10 s to 70 s: slow reads at 0, 30 (refused) and 60 s
            latest = await step(h)
            (gpu0,) = [g for g in latest.health if g.gpu == 0]
            assert not gpu0.healthy, f"GPU 0 healthy at {h.clock()} s"
            reasons.update(r.reason for r in gpu0.reasons)
            if 30 <= h.clock() < 60 and family is not None:
                assert not (await h.scrape()).find(family, gpu="0"), h.clock()
            await until_equal(lambda: status_of(h), ("True", "GPUUnhealthy"), "True")
        assert len(reasons) == 1
        await quiet(h)
        assert api(h).events("reason=GPUHealthy") == []
        assert len(api(h).events("reason=GPUUnhealthy")) == 1
