"""GPU instance profiles (nvmlDeviceGetGpuInstanceProfileInfoV) over the simulated
libnvidia-ml: the tables of NVIDIA's MIG user guide per model, read once per GPU handle
and MIG mode, and "no profiles" (never an error or a crash) where a GPU or driver cannot
answer."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pynvml
import pytest

from exporter.model import MigProfileInfo
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import install
from exporter.sim.scenario import parse_scenario
from exporter.sources.nvml import NvmlSource
from exporter.sources.nvml_mig_profiles import MAX_SLICES, MIB, read_profiles

GiB = 1024**3
CALL = "nvmlDeviceGetGpuInstanceProfileInfoV"


@pytest.fixture
def sources() -> Iterator[list[NvmlSource]]:
    made: list[NvmlSource] = []
    yield made
    for source in made:
        source.close()


def start(made: list[NvmlSource], scenario: dict[str, object]) -> tuple[NvmlSource, ManualClock]:
    clock = ManualClock()
    node = SimNode(parse_scenario(scenario, "test"), clock)
    install(node)
    source = NvmlSource(clock=clock)
    made.append(source)
    return source, clock


def profiles(source: NvmlSource, clock: ManualClock, t: float) -> tuple[MigProfileInfo, ...]:
    clock.now = t
    snap = source.sample()
    assert snap.ok and snap.gpus[0].error is None
    return snap.gpus[0].mig_profiles


def test_an_h100_offers_the_guides_profiles_with_or_without_mig_mode(
    sources: list[NvmlSource],
) -> None:
    mig = [{"profile": "3g.40gb", "gpu_instance_id": 1, "compute_instance_id": 0}]
    source, clock = start(sources, {"gpus": [{}, {"mig": mig}]})  # H100 80GB HBM3
    clock.now = 0.0
    snap = source.sample()
    whole, partitioned = snap.gpus
    assert whole.mig_enabled is False and partitioned.mig_enabled is True
    assert whole.mig_profiles == partitioned.mig_profiles
    assert [
        (p.name, p.memory_bytes, p.compute_slices, p.gpu_slices) for p in whole.mig_profiles
    ] == [
        ("1g.10gb", 10 * GiB, 1, 7),
        ("2g.20gb", 20 * GiB, 2, 7),
        ("3g.40gb", 40 * GiB, 3, 7),
        ("4g.40gb", 40 * GiB, 4, 7),
        ("7g.80gb", 80 * GiB, 7, 7),
        ("1g.10gb+me", 10 * GiB, 1, 7),
        ("1g.20gb", 20 * GiB, 1, 7),
    ]  # in NVML_GPU_INSTANCE_PROFILE_* order; memory: the guide's fraction of 80 GiB
    assert snap.errors == ()


@pytest.mark.parametrize(
    ("model", "memory", "names"),
    [
        (
            "NVIDIA A100-SXM4-40GB",
            "40GiB",
            {"1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"},
        ),
        (
            "NVIDIA A100-SXM4-80GB",
            "80GiB",
            {"1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"},
        ),
        (
            "NVIDIA H200",
            "141GiB",
            {"1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"},
        ),
    ],
)
def test_a100_and_h200_tables(
    sources: list[NvmlSource], model: str, memory: str, names: set[str]
) -> None:
    source, clock = start(sources, {"gpus": [{"name": model, "memory_total": memory}]})
    assert {p.name for p in profiles(source, clock, 0.0)} == names


def test_profiles_are_read_once_per_handle_not_every_cycle(sources: list[NvmlSource]) -> None:
    # From t=1 the call would fail: a source that asked again would lose them and count it.
    scenario = {"gpus": [{}], "call_errors": [{"call": CALL, "error": "NO_PERMISSION", "from": 1}]}
    source, clock = start(sources, scenario)
    first = profiles(source, clock, 0.0)
    assert len(first) == 7
    for t in (5.0, 10.0):
        clock.now = t
        snap = source.sample()
        assert snap.gpus[0].mig_profiles == first
        assert snap.errors == ()


@pytest.mark.parametrize(
    "scenario",
    [
        {"gpus": [{"name": "NVIDIA L4", "memory_total": "24GiB"}]},  # no MIG on this model
        {"gpus": [{"unsupported": [CALL]}]},  # the GPU answers NOT_SUPPORTED
        {"gpus": [{}], "missing_functions": [CALL]},  # a driver without the V entry point
    ],
    ids=["model-without-mig", "not-supported", "function-not-found"],
)
def test_a_gpu_or_driver_that_cannot_answer_offers_no_profiles_and_no_error(
    sources: list[NvmlSource], scenario: dict[str, object]
) -> None:
    source, clock = start(sources, scenario)
    for t in (0.0, 5.0):
        clock.now = t
        snap = source.sample()
        gpu = snap.gpus[0]
        assert gpu.error is None and gpu.memory_total_bytes is not None  # the GPU is read
        assert gpu.mig_profiles == ()
        assert snap.errors == ()


def test_a_refused_read_is_counted_and_tried_again_until_it_answers(
    sources: list[NvmlSource],
) -> None:
    scenario = {"gpus": [{}], "call_errors": [{"call": CALL, "error": "NO_PERMISSION", "until": 7}]}
    source, clock = start(sources, scenario)
    for t in (0.0, 5.0):
        clock.now = t
        snap = source.sample()
        assert snap.gpus[0].error is None and snap.gpus[0].mig_profiles == ()
        assert snap.errors == (("mig_profiles", "NoPermission"),)  # once, not once per profile
    assert len(profiles(source, clock, 10.0)) == 7


# -- answers no GPU gives (adversarial review of why idle) -------------------------------
# The simulated driver answers its model's table; these answers come from a stand-in
# for the pynvml call itself (the outer edge), as a broken driver would give them.


def answered(monkeypatch: pytest.MonkeyPatch, rows: dict[int, SimpleNamespace]) -> None:
    def info(handle: object, constant: int) -> SimpleNamespace:
        if constant in rows:
            return rows[constant]
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    monkeypatch.setattr(pynvml, "nvmlDeviceGetGpuInstanceProfileInfo", info)


def row(name: bytes, slices: int, memory_mb: int) -> SimpleNamespace:
    return SimpleNamespace(name=name, sliceCount=slices, memorySizeMB=memory_mb)


def test_implausible_profiles_are_left_out_not_served_as_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    answered(
        monkeypatch,
        {
            0: row(b"MIG 1g.10gb", 1, 0),  # no memory size: unknown, was served as 0
            1: row(b"MIG 2g.20gb", 2, 20_000),
            2: row(b"MIG 3g.40gb", 3, 40_000),
            3: row(b"MIG 7g.80gb", 2**32 - 1, 80_000),  # was the whole GPU: 1/2^32 shares
            4: row(b"MIG 7g.80gb", 7, 2**64 - 1),  # no GPU has 16 EiB
            5: row(b"\xff\xfe MIG", 1, 1),  # not UTF-8: was served with U+FFFD
            6: row(b"MIG 4g.40gb", 4, 40_000),
        },
    )
    errors: list[tuple[str, str]] = []
    found = read_profiles(object(), lambda *e: errors.append(e))
    assert found is not None and errors == []
    assert [(p.name, p.memory_bytes, p.compute_slices, p.gpu_slices) for p in found] == [
        ("2g.20gb", 20_000 * MIB, 2, 4),
        ("3g.40gb", 40_000 * MIB, 3, 4),
        ("4g.40gb", 40_000 * MIB, 4, 4),
    ]  # gpu_slices: the largest plausible count


def test_the_largest_plausible_slice_count_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    answered(monkeypatch, {0: row(b"MIG 8g.96gb", MAX_SLICES, 96_000)})
    found = read_profiles(object(), lambda *e: None)
    assert found is not None and [p.gpu_slices for p in found] == [MAX_SLICES]
