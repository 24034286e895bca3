"""DCGM through the whole agent: preferred over GPM, its health feeds the verdict."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exporter.sim.scenario import load_scenario
from tests.harness import simulated_exporter

FAKE_BINDINGS = str(Path(__file__).parent / "fake_dcgm")


@pytest.fixture
def dcgm_state(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fake host engine's state: GPU 0 of single-gpu profiled at SM active 0.25,
    with a failing memory health system. (Only the environment is patched: the fake
    bindings stand where DCGM's own would be installed.)"""
    uuid = f"GPU-{load_scenario('single-gpu').gpus[0].uuid.removeprefix('GPU-')}"
    state = tmp_path / "dcgm.json"
    state.write_text(
        json.dumps(
            {
                "hostengines": ["127.0.0.1:5555"],
                "gpus": [
                    {
                        "id": 0,
                        "uuid": uuid,
                        "fields": {
                            "1001": 0.3,
                            "1002": 0.25,
                            "1003": 0.12,
                            "1004": 0.05,
                            "1005": 0.2,
                            "1006": 0.0,
                            "1007": 0.1,
                            "1008": 0.02,
                        },
                    }
                ],
                "health": {
                    "incidents": [
                        {
                            "gpu": 0,
                            "entity_group": 1,
                            "system": "MEM",
                            "health": "fail",
                            "message": "DBE detected",
                            "code": 0,
                        }
                    ]
                },
            }
        )
    )
    monkeypatch.setenv("FAKE_DCGM_STATE", str(state))
    return state


async def test_dcgm_occupancy_replaces_gpm_and_its_health_failure_marks_the_gpu(
    dcgm_state: Path,
) -> None:
    argv = ["--dcgm", "auto", "--dcgm-bindings-path", FAKE_BINDINGS]
    async with simulated_exporter("single-gpu", argv=argv) as h:
        await h.advance(5)
        scrape = await h.scrape()
    # single-gpu's GPM says 0.63 SM active; DCGM's 0.25 wins
    assert scrape.get("gpu_sm_active_ratio", gpu="0") == pytest.approx(0.25)
    assert scrape.get("gpu_tensor_active_ratio", gpu="0") == pytest.approx(0.05)
    assert scrape.get("gpu_exporter_source_up", source="dcgm") == 1
    assert scrape.get("gpu_healthy", gpu="0") == 0
    assert scrape.get("gpu_health_reason", gpu="0", reason="dcgm_health") == 1


async def test_without_dcgm_gpm_is_used_and_no_dcgm_source_is_reported() -> None:
    async with simulated_exporter("single-gpu", argv=["--dcgm", "auto"]) as h:
        await h.advance(5)
        scrape = await h.scrape()
    assert scrape.get("gpu_sm_active_ratio", gpu="0") == pytest.approx(0.63)
    assert scrape.find("gpu_exporter_source_up", source="dcgm") == []
    assert scrape.get("gpu_healthy", gpu="0") == 1


async def test_an_explicit_host_engine_that_is_down_is_reported_as_a_source_down(
    dcgm_state: Path,
) -> None:
    argv = ["--dcgm", "10.255.0.1:5555", "--dcgm-bindings-path", FAKE_BINDINGS]
    async with simulated_exporter("single-gpu", argv=argv) as h:
        scrape = await h.scrape()
    assert scrape.get("gpu_exporter_source_up", source="dcgm") == 0
    assert scrape.get("gpu_exporter_errors_total", source="dcgm") >= 1


async def test_auto_reaches_the_gpu_operator_host_engine_through_its_service(
    dcgm_state: Path,
) -> None:
    """No hostNetwork, nothing on 127.0.0.1: the Operator's nvidia-dcgm Service in the
    namespace the chart names is where auto finds this node's host engine."""
    state = json.loads(dcgm_state.read_text())
    state["hostengines"] = ["nvidia-dcgm.gpu-ops.svc:5555"]
    state["embedded"] = False
    dcgm_state.write_text(json.dumps(state))
    argv = ["--dcgm", "auto", "--dcgm-bindings-path", FAKE_BINDINGS]
    argv += ["--dcgm-operator-namespace", "gpu-ops"]
    async with simulated_exporter("single-gpu", argv=argv) as h:
        await h.advance(5)
        scrape = await h.scrape()
    assert scrape.get("gpu_exporter_source_up", source="dcgm") == 1
    assert scrape.get("gpu_sm_active_ratio", gpu="0") == pytest.approx(0.25)
