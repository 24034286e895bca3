"""gpu_occupancy_source: which source gives each GPU's occupancy (GPM, DCGM, or none).

Served end to end from the simulated node (NVML's GPM support as the simulated driver
answers it) and the DCGM stand-in (tests/fake_dcgm), plus the pure choice for the
cases a scrape cannot stage in one cycle."""

from __future__ import annotations

import json
import time
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


def test_dcgm_profiled_stays_dcgm_without_values_and_while_its_host_engine_is_down() -> None:
    up = DcgmSnapshot(ok=True, timestamp=0.0, profiled=("GPU-a",))
    down = DcgmSnapshot(ok=False, timestamp=0.0, profiled=("GPU-a",), settled=False)
    assert occupancy_sources((gpu(gpm_supported=False),), up) == (("GPU-a", "dcgm"),)
    assert occupancy_sources((gpu(gpm_supported=False),), down) == (("GPU-a", "dcgm"),)


def test_none_needs_dcgms_answer_settled() -> None:
    unsettled = DcgmSnapshot(ok=True, timestamp=0.0, settled=False)
    settled = DcgmSnapshot(ok=True, timestamp=0.0, settled=True)
    assert occupancy_sources((gpu(gpm_supported=False),), unsettled) == ()
    assert occupancy_sources((gpu(gpm_supported=False),), settled) == (("GPU-a", "none"),)
    # a GPM GPU needs no DCGM answer
    assert occupancy_sources((gpu(gpm_supported=True),), unsettled) == (("GPU-a", "gpm"),)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_host_engine_restart_never_flips_a_profiled_gpu_to_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DCGM connected with blank first reads, then values, then gone, then back blank:
    the source is unknown until DCGM has answered, then dcgm throughout (an adversarial review)."""
    from exporter.model import DcgmMode
    from exporter.sources.dcgm import SETTLE_READS, DcgmSource

    state = tmp_path / "dcgm.json"
    uuids = ("GPU-a", "GPU-b")

    def write(*, up: bool = True, values: bool = True) -> None:
        fields = {"1002": 0.4} if values else {}
        gpus = [
            {"id": i, "uuid": u, "arch": "ampere", "fields": fields} for i, u in enumerate(uuids)
        ]
        hostengines = [OPERATOR_HOSTENGINE] if up else []
        state.write_text(json.dumps({"hostengines": hostengines, "embedded": False, "gpus": gpus}))

    monkeypatch.setenv("FAKE_DCGM_STATE", str(state))
    clock = Clock()
    mode = DcgmMode("auto", remote_info=OPERATOR_HOSTENGINE)
    source = DcgmSource(mode, bindings_path=FAKE_BINDINGS, clock=clock)
    a100s = tuple(gpu(index=i, uuid=u, gpm_supported=False) for i, u in enumerate(uuids))

    def step() -> dict[str, str]:
        clock.now += 120  # past any backoff
        return dict(occupancy_sources(a100s, source.sample()))

    try:
        write(values=False)
        assert step() == {}  # connected, nothing yet: unknown, not "none"
        write()
        assert step() == {"GPU-a": "dcgm", "GPU-b": "dcgm"}
        write(values=False)
        assert step() == {"GPU-a": "dcgm", "GPU-b": "dcgm"}
        write(up=False)
        assert step() == {"GPU-a": "dcgm", "GPU-b": "dcgm"}  # down: still its source
        write(values=False)
        for _ in range(SETTLE_READS + 1):
            assert step() == {"GPU-a": "dcgm", "GPU-b": "dcgm"}
    finally:
        source.close()


def test_a_gpu_dcgm_never_profiles_becomes_none_once_settled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from exporter.model import DcgmMode
    from exporter.sources.dcgm import SETTLE_READS, DcgmSource

    state = tmp_path / "dcgm.json"
    gpus = [{"id": 0, "uuid": "GPU-a", "arch": "ampere", "fields": {}}]
    state.write_text(json.dumps({"hostengines": [OPERATOR_HOSTENGINE], "gpus": gpus}))
    monkeypatch.setenv("FAKE_DCGM_STATE", str(state))
    clock = Clock()
    source = DcgmSource(
        DcgmMode("auto", remote_info=OPERATOR_HOSTENGINE), bindings_path=FAKE_BINDINGS, clock=clock
    )
    a100 = (gpu(gpm_supported=False),)
    try:
        seen = [dict(occupancy_sources(a100, source.sample())) for _ in range(SETTLE_READS)]
        assert seen[:-1] == [{}] * (SETTLE_READS - 1)
        assert seen[-1] == {"GPU-a": "none"}
    finally:
        source.close()


async def test_a_named_host_engine_down_from_the_start_leaves_the_source_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    state = a100_dcgm_state(tmp_path / "dcgm.json")
    monkeypatch.setenv("FAKE_DCGM_STATE", str(state))
    argv = ["--dcgm", "10.255.0.1:5555", "--dcgm-bindings-path", FAKE_BINDINGS]
    async with simulated_exporter("a100", argv=argv) as h:
        await h.advance(5)
        scrape = await h.scrape()
    assert scrape.get("gpu_exporter_source_up", source="dcgm") == 0
    assert served_source(scrape, "0") is None


def test_served_values_decide_over_capability() -> None:
    served = gpu(gpm_supported=True, occupancy=Occupancy(source="dcgm", sm_active=0.5))
    assert occupancy_sources((served,), None) == (("GPU-a", "dcgm"),)


async def test_absent_host_engines_never_stall_the_sample_cycle(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chart's default on a GPU Operator without its host engine: auto tries three
    addresses, each costing DCGM 4's connect timeout (1 s in auto). The cycle waits at
    most its DCGM deadline (a quarter of --interval, at most 1 s), then goes on; the
    connect attempts finish on the worker thread (an adversarial review)."""
    state = a100_dcgm_state(tmp_path / "dcgm.json")
    data = json.loads(state.read_text())
    data["hostengines"] = []
    data["failed_connect_waits"] = True
    state.write_text(json.dumps(data))
    monkeypatch.setenv("FAKE_DCGM_STATE", str(state))
    argv = ["--dcgm", "auto", "--dcgm-bindings-path", FAKE_BINDINGS, "--interval", "2"]
    async with simulated_exporter("a100", argv=argv, first_cycle=False) as h:
        began = time.monotonic()
        await h.cycle()
        took = time.monotonic() - began
        scrape = await h.scrape()
    assert took < 2.0, f"a cycle took {took:.1f} s while DCGM connect attempts ran"
    assert served_source(scrape, "0") is None  # DCGM's answer not settled yet
    assert scrape.get("gpu_utilization_ratio", gpu="0") == pytest.approx(0.92)
