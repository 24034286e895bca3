"""DcgmSource against tests/fake_dcgm, a stand-in for DCGM's Python bindings.

The fake keeps the bindings' module names, signatures, constants and value shapes and
answers from a JSON state file (``FAKE_DCGM_STATE``) re-read on every call, so each
test owns its node and can change it mid-run. The bindings are top-level modules, so
every test starts and ends with them evicted from ``sys.modules`` and ``sys.path``
restored: no test sees another's imports.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.config import ConfigError, parse_config
from exporter.config import parse_dcgm_mode as parse_mode
from exporter.model import DcgmHealthIncident, DcgmMode, Occupancy
from exporter.sources.backoff import Backoff
from exporter.sources.dcgm import HELD_HINT, DcgmSource
from tests.conftest import DCGM_BINDING_MODULES as BINDING_MODULES

FAKE_BINDINGS = str(Path(__file__).parent / "fake_dcgm")
UUID_A = "GPU-aaaaaaaa-0000-0000-0000-000000000000"
UUID_B = "GPU-bbbbbbbb-0000-0000-0000-000000000000"
LOCAL = "127.0.0.1:5555"
OPERATOR = "nvidia-dcgm.gpu-operator.svc:5555"  # the GPU Operator's Service, default namespace
OPENSHIFT = "nvidia-dcgm.nvidia-gpu-operator.svc:5555"


class FakeNode:
    """The fake engine's state file plus the log of every binding call it served."""

    def __init__(self, tmp_path: Path) -> None:
        self.path = tmp_path / "dcgm-state.json"
        self.calls_log = tmp_path / "dcgm-calls.jsonl"
        self.state: dict[str, Any] = {
            "hostengines": [LOCAL],
            "gpus": [],
            "calls_log": str(self.calls_log),
        }
        self.write()

    def write(self, **changes: Any) -> None:
        self.state.update(changes)
        self.path.write_text(json.dumps(self.state))

    def calls(self, fn: str) -> list[dict[str, Any]]:
        return [c for c in self.all_calls() if c["fn"] == fn]

    def all_calls(self) -> list[dict[str, Any]]:
        if not self.calls_log.exists():
            return []
        return [json.loads(line) for line in self.calls_log.read_text().splitlines()]

    def tried(self) -> list[str]:
        """Host engines connected to, in order, then "embedded" if one was started."""
        return [
            c["target"].removeprefix("tcp://") if c["fn"] == "dcgmConnect_v3" else "embedded"
            for c in self.all_calls()
            if c["fn"] in ("dcgmConnect_v3", "dcgmStartEmbedded")
        ]


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNode:
    monkeypatch.setenv("FAKE_DCGM_STATE", str(tmp_path / "dcgm-state.json"))
    return FakeNode(tmp_path)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def make_source(clock: FakeClock) -> Iterator[Any]:
    made: list[DcgmSource] = []

    def make(
        mode: str | DcgmMode = "auto", bindings_path: str | None = FAKE_BINDINGS, **kw: Any
    ) -> DcgmSource:
        source = DcgmSource(
            parse_mode(mode) if isinstance(mode, str) else mode,
            bindings_path=bindings_path,
            clock=clock,
            backoff=Backoff(initial_s=1.0, max_s=8.0, jitter=0.0),
            **kw,
        )
        made.append(source)
        return source

    yield make
    for source in made:
        source.close()


def gpu(
    gpu_id: int, uuid: str, fields: dict[int, Any] | None = None, arch: str = "hopper"
) -> dict[str, Any]:
    by_name = {str(k): v for k, v in (fields or {}).items()}
    return {"id": gpu_id, "uuid": uuid, "arch": arch, "fields": by_name}


def all_fields(base: float) -> dict[int, float]:
    return {1001 + i: round(base + i / 100, 2) for i in range(8)}


# -- occupancy --------------------------------------------------------------------------


def measured(occupancy: Occupancy) -> Occupancy:
    """What DCGM measured, without the window it stands for (the read's time: the
    activity counters' business, tests/test_activity_counters.py)."""
    return dataclasses.replace(occupancy, window_end=None, window_s=None)


def test_occupancy_is_keyed_by_gpu_uuid_not_by_dcgm_gpu_id(
    node: FakeNode, make_source: Any
) -> None:
    # DCGM gpu ids need not match NVML indices; the UUID from the device attributes is the join key.
    node.write(gpus=[gpu(1, UUID_B, all_fields(0.10)), gpu(0, UUID_A, all_fields(0.50))])
    snap = make_source().sample()
    assert snap.ok and snap.error is None
    assert {uuid: measured(occ) for uuid, occ in snap.occupancy} == {
        UUID_A: Occupancy("dcgm", 0.50, 0.51, 0.52, 0.53, 0.54, 0.55, 0.56, 0.57),
        UUID_B: Occupancy("dcgm", 0.10, 0.11, 0.12, 0.13, 0.14, 0.15, 0.16, 0.17),
    }


def test_profiling_values_are_taken_as_ratios_not_percentages(
    node: FakeNode, make_source: Any
) -> None:
    node.write(gpus=[gpu(0, UUID_A, {1002: 0.97, 1003: 1.0004, 1004: 0.0})])
    [(_, occ)] = make_source().sample().occupancy
    assert (occ.sm_active, occ.sm_occupancy, occ.tensor_active) == (0.97, 1.0, 0.0)


def test_blank_sentinels_and_non_ok_statuses_become_none(node: FakeNode, make_source: Any) -> None:
    fields = {1001: "blank", 1002: 0.4, 1003: "not_supported", 1004: {"status": "NO_DATA"}}
    node.write(gpus=[gpu(0, UUID_A, fields)])  # 1005..1008 missing: DCGM has no value yet
    [(uuid, occ)] = make_source().sample().occupancy
    assert uuid == UUID_A
    assert measured(occ) == Occupancy("dcgm", sm_active=0.4)


def test_gpu_with_only_blank_values_is_left_out_so_gpm_can_stand_in(
    node: FakeNode, make_source: Any
) -> None:
    node.write(gpus=[gpu(0, UUID_A, {1002: 0.3}), gpu(1, UUID_B, {1002: "blank"})])
    snap = make_source().sample()
    assert [uuid for uuid, _ in snap.occupancy] == [UUID_A]


def test_watch_asks_for_the_eight_profiling_fields_at_the_update_interval(
    node: FakeNode, make_source: Any
) -> None:
    node.write(gpus=[gpu(0, UUID_A)])
    assert make_source(update_interval_s=0.5).open()
    [created] = node.calls("dcgmFieldGroupCreate")
    assert created["fieldIds"] == list(range(1001, 1009))
    [watch] = node.calls("dcgmWatchFields")
    assert watch["updateFreq"] == 500_000  # usec


@pytest.mark.parametrize(
    ("status", "error_class"),
    [
        ("PROFILING_NOT_SUPPORTED", "DCGMError_ProfilingNotSupported"),
        ("PROFILING_LIBRARY_ERROR", "DCGMError_ProfilingLibraryError"),  # Nsight holds them
        ("MODULE_NOT_LOADED", "DCGMError_ModuleNotLoaded"),
        ("GROUP_INCOMPATIBLE", "DCGMError_GroupIncompatible"),  # mixed GPU SKUs
    ],
)
def test_profiling_unavailable_keeps_health_and_says_why(
    node: FakeNode, make_source: Any, status: str, error_class: str
) -> None:
    node.write(
        gpus=[gpu(0, UUID_A, {1002: 0.5})],
        errors={"dcgmWatchFields": status},
        health={"incidents": [{"gpu": 0, "system": "PCIE", "health": "warn", "message": "replay"}]},
    )
    snap = make_source().sample()
    assert snap.ok
    assert snap.occupancy == ()
    assert snap.error is not None
    assert snap.error.startswith(f"profiling fields unavailable: {error_class}")
    assert snap.incidents == (DcgmHealthIncident(UUID_A, "pcie", "warn", "replay"),)


def test_too_many_profiling_passes_falls_back_to_the_core_fields(
    node: FakeNode, make_source: Any
) -> None:
    node.write(gpus=[gpu(0, UUID_A, all_fields(0.3))], max_profiling_fields=5)
    snap = make_source().sample()
    assert snap.ok and snap.error is None
    [(_, occ)] = snap.occupancy
    assert measured(occ) == Occupancy("dcgm", 0.3, 0.31, 0.32, 0.33, 0.34)  # no FP64/32/16
    assert [c["fieldIds"] for c in node.calls("dcgmFieldGroupCreate")] == [
        list(range(1001, 1009)),
        list(range(1001, 1006)),
    ]
    assert len(node.calls("dcgmFieldGroupDestroy")) == 1


def test_profiling_that_fits_in_no_pass_is_reported(node: FakeNode, make_source: Any) -> None:
    node.write(gpus=[gpu(0, UUID_A, all_fields(0.3))], max_profiling_fields=2)
    snap = make_source().sample()
    assert snap.ok and snap.occupancy == ()
    assert snap.error is not None and "DCGMError_ProfilingMultiPass" in snap.error


# -- health -----------------------------------------------------------------------------


def test_health_incidents_carry_uuid_system_result_and_message(
    node: FakeNode, make_source: Any
) -> None:
    incidents = [
        {"gpu": 1, "system": "MEM", "health": "fail", "message": "DBE detected\non GPU 1"},
        {"gpu": 0, "system": "THERMAL", "health": "warn", "message": "clocks throttled"},
    ]
    node.write(gpus=[gpu(0, UUID_A), gpu(1, UUID_B)], health={"incidents": incidents})
    snap = make_source().sample()
    assert snap.ok and snap.health == "fail"
    assert snap.incidents == (
        DcgmHealthIncident(UUID_B, "mem", "fail", "DBE detected on GPU 1"),
        DcgmHealthIncident(UUID_A, "thermal", "warn", "clocks throttled"),
    )


def test_first_sample_already_has_health_results(node: FakeNode, make_source: Any) -> None:
    # DCGM's first dcgmHealthCheck after dcgmHealthSet only builds state; the source
    # spends that call while connecting so the first cycle reports real results.
    node.write(
        gpus=[gpu(0, UUID_A)],
        health={"incidents": [{"gpu": 0, "system": "POWER", "health": "warn", "message": "x"}]},
    )
    source = make_source()
    assert source.sample().health == "warn"
    assert len(node.calls("dcgmHealthCheck")) == 2


def test_healthy_node_reports_pass_with_no_incidents(node: FakeNode, make_source: Any) -> None:
    node.write(gpus=[gpu(0, UUID_A)])
    snap = make_source().sample()
    assert (snap.ok, snap.health, snap.incidents) == (True, "pass", ())


def test_incident_on_a_non_gpu_entity_has_no_uuid(node: FakeNode, make_source: Any) -> None:
    incident = {"gpu": 0, "entity_group": 3, "system": "NVSWITCH_FATAL", "health": "fail"}
    node.write(gpus=[gpu(0, UUID_A)], health={"incidents": [incident]})
    [found] = make_source().sample().incidents
    assert (found.gpu_uuid, found.system, found.health) == (None, "nvswitch_fatal", "fail")


# -- connection modes -------------------------------------------------------------------


def test_auto_uses_the_local_host_engine_when_one_answers(node: FakeNode, make_source: Any) -> None:
    node.write(gpus=[gpu(0, UUID_A)])
    source = make_source("auto")
    assert source.open() and source.available
    assert source.connected_to == f"host engine {LOCAL}"
    assert node.tried() == [OPERATOR, OPENSHIFT, LOCAL]  # the Operator's Services first
    assert [c["timeoutMs"] for c in node.calls("dcgmConnect_v3")] == [1000, 1000, 1000]


def test_auto_finds_the_gpu_operator_host_engine_through_its_service(
    node: FakeNode, make_source: Any
) -> None:
    """The Operator's nvidia-dcgm has no hostNetwork, so nothing answers on 127.0.0.1;
    its Service (internalTrafficPolicy: Local) reaches this node's host engine."""
    node.write(hostengines=[OPERATOR], gpus=[gpu(0, UUID_A, {1002: 0.4})])
    source = make_source("auto")
    snap = source.sample()
    assert snap.ok and snap.occupancy[0][1].sm_active == 0.4
    assert source.connected_to == f"host engine {OPERATOR}"
    assert node.tried() == [OPERATOR]


def test_auto_tries_remote_info_then_the_operator_service_then_localhost_then_embedded(
    node: FakeNode, make_source: Any
) -> None:
    node.write(hostengines=[], gpus=[gpu(0, UUID_A)])
    config = parse_config(
        ["--dcgm-operator-namespace", "gpu-ops"],
        env={"DCGM_REMOTE_HOSTENGINE_INFO": "dcgm.example"},
    )
    source = make_source(config.dcgm)
    assert source.sample().ok
    assert node.tried() == ["dcgm.example:5555", "nvidia-dcgm.gpu-ops.svc:5555", LOCAL, "embedded"]
    assert source.connected_to == "embedded host engine"


def test_remote_info_wins_when_it_answers(node: FakeNode, make_source: Any) -> None:
    node.write(hostengines=["[fd00::7]:5555", OPERATOR, LOCAL], gpus=[gpu(0, UUID_A)])
    mode = parse_mode("auto", remote_info="[fd00::7]:5555")
    source = make_source(mode)
    assert source.open() and source.connected_to == "host engine [fd00::7]:5555"
    assert node.tried() == ["[fd00::7]:5555"]


def test_no_operator_namespace_leaves_only_localhost_before_embedded(
    node: FakeNode, make_source: Any
) -> None:
    node.write(hostengines=[], gpus=[gpu(0, UUID_A)])
    assert make_source(parse_mode("auto", operator_namespaces="")).open()
    assert node.tried() == [LOCAL, "embedded"]


def test_embedded_engine_on_pre_hopper_gpus_is_announced_before_it_watches_profiling(
    node: FakeNode, make_source: Any, caplog: pytest.LogCaptureFixture
) -> None:
    node.write(
        hostengines=[],
        gpus=[gpu(0, UUID_A, {1002: 0.2}, arch="ampere"), gpu(1, UUID_B, {1002: 0.3})],
    )
    with caplog.at_level(logging.INFO, logger="exporter.sources.dcgm"):
        snap = make_source("auto").sample()
    assert snap.ok and len(snap.occupancy) == 2
    [warning] = [r for r in caplog.records if r.levelno == logging.WARNING]
    message = warning.getMessage()
    assert "embedded host engine on pre-Hopper" in message and UUID_A in message
    assert UUID_B not in message  # Hopper reads GPM: no exclusive counters
    assert "dcgm-exporter" in message and "--dcgm off" in message
    calls = [c["fn"] for c in node.all_calls()]
    assert calls.index("dcgmStartEmbedded") < calls.index("dcgmGetGpuChipArchitecture")
    assert calls.index("dcgmGetGpuChipArchitecture") < calls.index("dcgmWatchFields")


def test_embedded_engine_on_hopper_gpus_only_says_it_started(
    node: FakeNode, make_source: Any, caplog: pytest.LogCaptureFixture
) -> None:
    node.write(
        hostengines=[], gpus=[gpu(0, UUID_A, arch="hopper"), gpu(1, UUID_B, arch="blackwell")]
    )
    with caplog.at_level(logging.INFO, logger="exporter.sources.dcgm"):
        assert make_source("auto").open()
    assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
    assert any("started an embedded host engine" in r.getMessage() for r in caplog.records)


def test_dcgm_that_cannot_name_the_architecture_is_assumed_exclusive(
    node: FakeNode, make_source: Any, caplog: pytest.LogCaptureFixture
) -> None:
    node.write(hostengines=[], chip_architecture=False, gpus=[gpu(0, UUID_A)])
    with caplog.at_level(logging.WARNING, logger="exporter.sources.dcgm"):
        assert make_source("auto").open()
    assert any(UUID_A in r.getMessage() for r in caplog.records)


def test_shared_host_engine_is_never_warned_about(
    node: FakeNode, make_source: Any, caplog: pytest.LogCaptureFixture
) -> None:
    node.write(hostengines=[OPERATOR], gpus=[gpu(0, UUID_A, arch="ampere")])
    with caplog.at_level(logging.WARNING, logger="exporter.sources.dcgm"):
        assert make_source("auto").open()
    assert caplog.records == [] and node.calls("dcgmGetGpuChipArchitecture") == []


@pytest.mark.parametrize("status", ["IN_USE", "PROFILING_LIBRARY_ERROR"])
def test_counters_held_by_another_profiling_client_are_named_and_health_stays(
    node: FakeNode, make_source: Any, status: str
) -> None:
    """dcgm-exporter's own embedded engine (the GPU Operator default) holds an A100's
    counters: ours gets them refused, keeps health, and says who to blame."""
    node.write(
        hostengines=[],
        profiling_held_by="dcgm-exporter",
        profiling_held_status=status,
        gpus=[gpu(0, UUID_A, {1002: 0.5}, arch="ampere")],
        health={"incidents": [{"gpu": 0, "system": "MEM", "health": "fail", "message": "DBE"}]},
    )
    snap = make_source("auto").sample()
    assert snap.ok and snap.occupancy == ()
    assert snap.error is not None and snap.error.startswith("profiling fields unavailable: ")
    assert snap.error.endswith(f"({HELD_HINT})")
    assert [i.system for i in snap.incidents] == ["mem"]


def test_counters_of_hopper_gpus_are_not_exclusive(node: FakeNode, make_source: Any) -> None:
    node.write(
        hostengines=[], profiling_held_by="dcgm-exporter", gpus=[gpu(0, UUID_A, {1002: 0.5})]
    )
    snap = make_source("auto").sample()
    assert snap.ok and snap.error is None and snap.occupancy[0][1].sm_active == 0.5


def test_auto_falls_back_to_an_embedded_host_engine(node: FakeNode, make_source: Any) -> None:
    node.write(hostengines=[], gpus=[gpu(0, UUID_A, {1002: 0.2})])
    source = make_source("auto")
    snap = source.sample()
    assert snap.ok and source.connected_to == "embedded host engine"
    assert [uuid for uuid, _ in snap.occupancy] == [UUID_A]


def test_auto_reports_both_attempts_when_neither_works(node: FakeNode, make_source: Any) -> None:
    node.write(hostengines=[], embedded=False, embedded_error="NVML_NOT_LOADED")
    snap = make_source("auto").sample()
    assert not snap.ok and snap.error is not None
    assert f"host engine {LOCAL}: DCGMError_ConnectionNotValid" in snap.error
    assert "embedded host engine: DCGMError_NvmlNotLoaded" in snap.error
    assert "\n" not in snap.error


def test_explicit_host_engine_never_starts_an_embedded_one(
    node: FakeNode, make_source: Any
) -> None:
    node.write(hostengines=[LOCAL], gpus=[gpu(0, UUID_A)])
    source = make_source("10.0.0.7:5555")
    snap = source.sample()
    assert not snap.ok
    assert snap.error == (
        "host engine 10.0.0.7:5555: DCGMError_ConnectionNotValid: "
        "The connection to the host engine is not valid any longer"
    )
    assert node.calls("dcgmStartEmbedded") == []


def test_unreachable_host_engine_is_retried_with_backoff_until_it_answers(
    node: FakeNode, make_source: Any, clock: FakeClock
) -> None:
    node.write(hostengines=[], gpus=[gpu(0, UUID_A, {1002: 0.6})])
    source = make_source(LOCAL)

    def attempts() -> int:
        return len(node.calls("dcgmConnect_v3"))

    assert not source.sample().ok and attempts() == 1
    clock.now += 0.9  # inside the 1 s backoff: no new attempt, same error
    snap = source.sample()
    assert not snap.ok and snap.error is not None and "ConnectionNotValid" in snap.error
    assert attempts() == 1
    clock.now += 0.1
    assert not source.sample().ok and attempts() == 2  # next delay: 2 s
    node.write(hostengines=[LOCAL])
    clock.now += 1.9
    assert not source.sample().ok and attempts() == 2
    clock.now += 0.1
    snap = source.sample()
    assert snap.ok and attempts() == 3
    assert snap.occupancy[0][1].sm_active == 0.6


def test_host_engine_lost_mid_run_reconnects_after_backoff(
    node: FakeNode, make_source: Any, clock: FakeClock
) -> None:
    node.write(gpus=[gpu(0, UUID_A, {1002: 0.6})])
    source = make_source(LOCAL)
    assert source.sample().ok
    node.write(hostengines=[])  # nv-hostengine restarts
    snap = source.sample()
    assert not snap.ok and not source.available
    assert snap.error is not None
    assert snap.error.startswith(
        f"DCGM via host engine {LOCAL} failed: DCGMError_ConnectionNotValid"
    )
    node.write(hostengines=[LOCAL])
    assert not source.sample().ok  # still inside the backoff
    clock.now += 1.0
    snap = source.sample()
    assert snap.ok and source.available and snap.occupancy[0][0] == UUID_A


def test_unexpected_dcgm_error_mid_run_is_contained(
    node: FakeNode, make_source: Any, clock: FakeClock
) -> None:
    node.write(gpus=[gpu(0, UUID_A, {1002: 0.6})])
    source = make_source()
    assert source.sample().ok
    node.write(errors={"dcgmGetLatestValues": "GENERIC_ERROR"})
    snap = source.sample()
    assert not snap.ok and snap.error is not None and "DCGMError_GenericError" in snap.error
    node.write(errors={})
    clock.now += 1.0
    assert source.sample().ok


def test_host_engine_failing_during_set_up_is_reported_not_bypassed(
    node: FakeNode, make_source: Any
) -> None:
    node.write(gpus=[gpu(0, UUID_A)], errors={"dcgmGroupCreate": "GENERIC_ERROR"})
    snap = make_source("auto").sample()
    assert snap.error == (
        f"DCGM set-up via host engine {LOCAL} failed: "
        "DCGMError_GenericError: Generic unspecified error"
    )
    assert node.calls("dcgmStartEmbedded") == []
    assert len(node.calls("dcgmDisconnect")) == 1  # the half-set-up connection is released


def test_close_releases_watches_group_and_connection(node: FakeNode, make_source: Any) -> None:
    node.write(gpus=[gpu(0, UUID_A)])
    source = make_source(LOCAL)
    assert source.open()
    source.close()
    assert not source.available
    for fn in ("dcgmFieldGroupDestroy", "dcgmGroupDestroy", "dcgmDisconnect"):
        assert len(node.calls(fn)) == 1, fn


def test_node_without_supported_gpus_is_ok_and_empty(node: FakeNode, make_source: Any) -> None:
    snap = make_source().sample()
    assert (snap.ok, snap.occupancy, snap.incidents, snap.health) == (True, (), (), None)
    assert node.calls("dcgmGroupCreate") == []


@pytest.mark.slow  # one real connect timeout (1 s)
def test_close_during_a_connect_sequence_waits_for_one_attempt_only(
    node: FakeNode, make_source: Any
) -> None:
    """DCGM 4 spends the whole connect timeout on every absent host engine; shutting down
    (SIGTERM for a driver upgrade) must not wait for the rest of auto's list."""
    node.write(hostengines=[], failed_connect_waits=True, gpus=[gpu(0, UUID_A)])
    source = make_source(parse_mode("auto", operator_namespaces="a,b,c,d"))  # 5 x 1 s
    opener = threading.Thread(target=source.open)
    opener.start()
    deadline = time.monotonic() + 5
    while not node.calls("dcgmConnect_v3") and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    source.close()
    opener.join(5)
    assert not opener.is_alive() and time.monotonic() - started < 1.8
    assert node.tried() == ["nvidia-dcgm.a.svc:5555"]  # no further host engine, no embedded
    assert not source.available and not source.open()


# -- bindings ---------------------------------------------------------------------------


def test_missing_bindings_give_a_clear_error(
    node: FakeNode, make_source: Any, tmp_path: Path
) -> None:
    empty = tmp_path / "bindings"
    empty.mkdir()
    source = make_source(bindings_path=str(empty))
    assert not source.open()
    snap = source.sample()
    assert not snap.ok and snap.error is not None
    assert f"DCGM Python bindings not found in {empty}" in snap.error
    assert "No module named 'pydcgm'" in snap.error
    assert "--dcgm-bindings-path" in snap.error


def test_bindings_path_that_is_not_a_directory_is_named(
    node: FakeNode, make_source: Any, tmp_path: Path
) -> None:
    missing = tmp_path / "nowhere"
    snap = make_source(bindings_path=str(missing)).sample()
    assert snap.error == f"DCGM bindings path {missing} is not a directory"


def test_missing_libdcgm_is_reported_without_trying_embedded(
    node: FakeNode, make_source: Any
) -> None:
    node.write(library_found=False)
    snap = make_source("auto").sample()
    assert snap.error == "libdcgm: DCGMError_LibraryNotFound: DCGM library could not be found"
    assert node.calls("dcgmStartEmbedded") == []


def test_bindings_that_blow_up_on_import_do_not_escape(
    node: FakeNode, make_source: Any, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "pydcgm.py").write_text("raise RuntimeError('half-installed DCGM')\n")
    snap = make_source(bindings_path=str(broken)).sample()
    assert not snap.ok
    assert snap.error == "DCGM set-up failed: RuntimeError: half-installed DCGM"


def test_off_never_imports_the_bindings(node: FakeNode, make_source: Any) -> None:
    path_before = list(sys.path)
    source = make_source("off")
    assert not source.enabled
    assert not source.open()
    snap = source.sample()
    assert (snap.ok, snap.error) == (False, "DCGM disabled (--dcgm off)")
    assert [m for m in BINDING_MODULES if m in sys.modules] == []
    assert sys.path == path_before
    assert not node.calls_log.exists()


def test_bindings_are_imported_only_when_opened(node: FakeNode, make_source: Any) -> None:
    source = make_source("auto")
    assert "pydcgm" not in sys.modules
    source.open()
    assert sys.modules["pydcgm"].__file__ == str(Path(FAKE_BINDINGS) / "pydcgm.py")


# -- --dcgm values ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("auto", DcgmMode("auto")),
        ("OFF", DcgmMode("off")),
        ("10.0.0.7:5555", DcgmMode("hostengine", "10.0.0.7:5555")),
        ("dcgm.gpu-operator.svc:5555", DcgmMode("hostengine", "dcgm.gpu-operator.svc:5555")),
        ("[::1]:5555", DcgmMode("hostengine", "[::1]:5555")),
    ],
)
def test_parse_mode_accepts(value: str, expected: DcgmMode) -> None:
    assert parse_mode(value) == expected


@pytest.mark.parametrize("value", ["", "localhost", ":5555", "host:", "host:0", "host:99999"])
def test_parse_mode_rejects(value: str) -> None:
    with pytest.raises(ValueError, match="--dcgm must be 'auto', 'off' or HOST:PORT"):
        parse_mode(value)


@pytest.mark.parametrize(
    ("env", "argv", "expected"),
    [
        ({}, [], (OPERATOR, OPENSHIFT, LOCAL)),
        # dcgm-exporter's variable; a bare HOST means DCGM's default port
        (
            {"DCGM_REMOTE_HOSTENGINE_INFO": "nvidia-dcgm"},
            [],
            ("nvidia-dcgm:5555", OPERATOR, OPENSHIFT, LOCAL),
        ),
        ({"DCGM_REMOTE_HOSTENGINE_INFO": "127.0.0.1:5555"}, [], (LOCAL, OPERATOR, OPENSHIFT)),
        (
            {},
            ["--dcgm-operator-namespace", "gpu, ops "],
            ("nvidia-dcgm.gpu.svc:5555", "nvidia-dcgm.ops.svc:5555", LOCAL),
        ),
        ({"GPU_EXPORTER_DCGM_OPERATOR_NAMESPACE": ""}, [], (LOCAL,)),
        # an explicit host engine is the only one, whatever the environment says
        ({"DCGM_REMOTE_HOSTENGINE_INFO": "x:1"}, ["--dcgm", "10.0.0.7:5555"], ("10.0.0.7:5555",)),
        ({"DCGM_REMOTE_HOSTENGINE_INFO": "x:1"}, ["--dcgm", "off"], ()),
    ],
)
def test_auto_host_engines_come_from_the_environment_and_the_namespace_flag(
    env: dict[str, str], argv: list[str], expected: tuple[str, ...]
) -> None:
    assert parse_config(argv, env=env).dcgm.hostengines == expected


@pytest.mark.parametrize(
    ("env", "argv", "message"),
    [
        (
            {"DCGM_REMOTE_HOSTENGINE_INFO": "host:port"},
            [],
            "DCGM_REMOTE_HOSTENGINE_INFO: 'host:port' is not HOST:PORT",
        ),
        (
            {},
            ["--dcgm-operator-namespace", "GPU_Operator"],
            "--dcgm-operator-namespace: 'GPU_Operator'",
        ),
    ],
)
def test_bad_host_engine_settings_are_one_line_errors(
    env: dict[str, str], argv: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(argv, env=env)
