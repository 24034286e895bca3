"""gpu_occupancy_source: which source gives each GPU's occupancy (GPM, DCGM, or none).

Served end to end from the simulated node (NVML's GPM support as the simulated driver
answers it) and the DCGM stand-in (tests/fake_dcgm), plus the pure choice for the
cases a scrape cannot stage in one cycle."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.analysis.occupancy_source import occupancy_sources
from exporter.model import DcgmSnapshot, GpuSample, Occupancy
from exporter.sim.scenario import load_scenario
from tests.harness import Scrape, simulated_exporter

FAKE_BINDINGS = str(Path(__file__).parent / "fake_dcgm")
OPERATOR_HOSTENGINE = "nvidia-dcgm.gpu-operator.svc:5555"


def served_source(scrape: Scrape, gpu: str) -> str | None:
    """The one source served as 1 for the GPU; every source is served once."""
    series = scrape.find("gpu_occupancy_source", gpu=gpu)
    ones = [labels["source"] for labels, value in series if value == 1]
    assert series == [] or (len(series) == 3 and len(ones) == 1), series
    return ones[0] if ones else None


def a100_dcgm_state(path: Path, *, sm_active: float = 0.41) -> Path:
    """The Operator's host engine profiling both A100s of the a100 scenario."""
    gpus = load_scenario("a100").gpus
    state = {
        "hostengines": [OPERATOR_HOSTENGINE],
        "embedded": False,
        "gpus": [
            {
                "id": i,
                "uuid": f"GPU-{gpu.uuid.removeprefix('GPU-')}",
                "arch": "ampere",
                "name": "NVIDIA A100-SXM4-40GB",
                "fields": {"1002": sm_active if i == 0 else 0.0, "1003": 0.2},
            }
            for i, gpu in enumerate(gpus)
        ],
    }
    path.write_text(json.dumps(state))
    return path


async def test_a_pre_hopper_gpu_without_dcgm_says_gpu_util_only() -> None:
    async with simulated_exporter("a100", argv=["--dcgm", "off"]) as h:
        await h.advance(5)
        scrape = await h.scrape()
    for gpu in ("0", "1"):
        assert served_source(scrape, gpu) == "none"
        assert scrape.get("gpu_occupancy_source", gpu=gpu, source="gpm") == 0
        assert scrape.find("gpu_sm_active_ratio", gpu=gpu) == []
    assert scrape.get("gpu_utilization_ratio", gpu="0") == pytest.approx(0.92)


async def test_a_hopper_gpu_says_gpm_from_its_first_cycle_before_any_value() -> None:
    async with simulated_exporter("single-gpu", argv=["--dcgm", "off"]) as h:
        first = await h.scrape()
        await h.advance(5)
        later = await h.scrape()
    assert first.find("gpu_sm_active_ratio", gpu="0") == []  # GPM primes its buffers
    assert served_source(first, "0") == "gpm"
    assert served_source(later, "0") == "gpm"
    assert later.get("gpu_sm_active_ratio", gpu="0") == pytest.approx(0.63)


async def test_a100_occupancy_comes_from_the_operators_dcgm_host_engine(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_DCGM_STATE", str(a100_dcgm_state(tmp_path / "dcgm.json")))
    argv = ["--dcgm", "auto", "--dcgm-bindings-path", FAKE_BINDINGS]
    async with simulated_exporter("a100", argv=argv) as h:
        await h.advance(5)
        scrape = await h.scrape()
    assert scrape.get("gpu_exporter_source_up", source="dcgm") == 1
    assert served_source(scrape, "0") == "dcgm"
    assert served_source(scrape, "1") == "dcgm"
    assert scrape.get("gpu_sm_active_ratio", gpu="0") == pytest.approx(0.41)


async def test_a_blank_dcgm_cycle_keeps_dcgm_as_the_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = a100_dcgm_state(tmp_path / "dcgm.json")
    monkeypatch.setenv("FAKE_DCGM_STATE", str(state))
    argv = ["--dcgm", "auto", "--dcgm-bindings-path", FAKE_BINDINGS]
    async with simulated_exporter("a100", argv=argv) as h:
        await h.advance(5)
        assert served_source(await h.scrape(), "0") == "dcgm"
        data = json.loads(state.read_text())
        for entry in data["gpus"]:
            entry["fields"] = {}  # every profiling field blank (no update yet)
        state.write_text(json.dumps(data))
        await h.advance(5)
        blank = await h.scrape()
    assert blank.find("gpu_sm_active_ratio", gpu="0") == []
    assert served_source(blank, "0") == "dcgm"


async def test_dcgm_down_from_the_start_leaves_a100_at_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = a100_dcgm_state(tmp_path / "dcgm.json")
    data = json.loads(state.read_text())
    data["hostengines"] = []
    state.write_text(json.dumps(data))
    monkeypatch.setenv("FAKE_DCGM_STATE", str(state))
    argv = ["--dcgm", "auto", "--dcgm-bindings-path", FAKE_BINDINGS]
    async with simulated_exporter("a100", argv=argv) as h:
        await h.advance(5)
        scrape = await h.scrape()
    # under auto a node without DCGM is normal: no dcgm source is served
    assert scrape.find("gpu_exporter_source_up", source="dcgm") == []
    assert served_source(scrape, "0") == "none"


def gpu(**kwargs: object) -> GpuSample:
    base: dict[str, object] = {"index": 0, "uuid": "GPU-a", "name": None, "pci_bus_id": None}
    return GpuSample(**{**base, **kwargs})  # type: ignore[arg-type]


def test_unknown_gpm_support_or_a_failed_read_serves_no_source() -> None:
    assert occupancy_sources((gpu(gpm_supported=None),), None) == ()
    assert occupancy_sources((gpu(gpm_supported=False, error="GpuIsLost"),), None) == ()


def test_dcgm_profiled_without_values_this_cycle_is_dcgm_but_dcgm_down_is_not() -> None:
    up = DcgmSnapshot(ok=True, timestamp=0.0, profiled=("GPU-a",))
    down = DcgmSnapshot(ok=False, timestamp=0.0, profiled=("GPU-a",))
    assert occupancy_sources((gpu(gpm_supported=False),), up) == (("GPU-a", "dcgm"),)
    assert occupancy_sources((gpu(gpm_supported=False),), down) == (("GPU-a", "none"),)


def test_served_values_decide_over_capability() -> None:
    served = gpu(gpm_supported=True, occupancy=Occupancy(source="dcgm", sm_active=0.5))
    assert occupancy_sources((served,), None) == (("GPU-a", "dcgm"),)
