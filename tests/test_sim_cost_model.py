"""The simulator's hardware cost model (exporter/sim/cost_model.py): a profile makes each
simulated NVML call spend the table's CPU time outside the GIL, per field for field
values; no profile costs nothing; an unknown profile is refused in one line, from the
scenario, from ``python -m exporter.sim --cost``, and from a node.json an exporter
attaches to. Driven through pynvml's public API, as the exporters call it."""

from __future__ import annotations

import ctypes
import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pynvml
import pytest

from exporter.sim.__main__ import main as sim_main
from exporter.sim.cost_model import (
    PROFILES,
    Costed,
    CostProfile,
    CostProfileError,
    spend,
)
from exporter.sim.external import _describe, attach
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import SimNvmlLibrary, install
from exporter.sim.paths import SimPaths
from exporter.sim.scenario import ScenarioError, load_scenario, parse_scenario

H200 = PROFILES["h200"]
R580 = {"driver_version": "580.159.04", "gpus": [{"name": "NVIDIA H200"}]}
KNOWN = "(known: h200, or none)"


@pytest.fixture(autouse=True)
def restored_library() -> Iterator[None]:
    """Put back whatever library pynvml held: these tests install costed ones."""
    saved = pynvml.nvmlLib
    yield
    with pynvml.libLoadLock:
        pynvml.nvmlLib = saved
        pynvml._nvmlGetFunctionPointer_cache.clear()


@contextmanager
def installed(scenario: dict[str, Any], cost: str | None = None) -> Iterator[Any]:
    install(SimNode(parse_scenario(scenario, "test"), ManualClock()), cost=cost)
    pynvml.nvmlInit()
    try:
        yield pynvml.nvmlDeviceGetHandleByIndex(0)
    finally:
        pynvml.nvmlShutdown()


def cpu_us(call: Callable[[], object], times: int) -> float:
    """Median thread CPU (µs) of ``call``, ``times`` times."""
    spent = []
    for _ in range(times):
        started = time.thread_time_ns()
        call()
        spent.append((time.thread_time_ns() - started) / 1000)
    return sorted(spent)[len(spent) // 2]


def fields_us(handle: Any, ids: list[int]) -> float:
    return cpu_us(partial(pynvml.nvmlDeviceGetFieldValues, handle, ids), 5)


def test_a_profile_spends_the_tables_cpu_per_call() -> None:
    """Energy (3,089 µs) and GPM metrics (1,855 µs) cost their figure over what the
    same call costs without a profile, within generous bounds."""
    energy = pynvml.nvmlDeviceGetTotalEnergyConsumption
    with installed(R580) as handle:
        python_us = cpu_us(partial(energy, handle), 10)
        count_us = cpu_us(pynvml.nvmlDeviceGetCount, 10)
    with installed({**R580, "cost": "h200"}) as handle:
        costed_us = cpu_us(partial(energy, handle), 10)
        costed_count_us = cpu_us(pynvml.nvmlDeviceGetCount, 10)
    figure = H200.calls_us["nvmlDeviceGetTotalEnergyConsumption"]
    assert 0.9 * figure <= costed_us - python_us <= 1.3 * figure + 200
    # a cheap call: the 1 µs figure, plus what reading the clock costs (a few µs)
    assert costed_count_us - count_us < 100


def test_field_values_are_costed_per_field_requested() -> None:
    with installed({**R580, "cost": "h200"}) as handle:
        cheap = fields_us(handle, [pynvml.NVML_FI_DEV_POWER_INSTANT])  # field 186
        energy = fields_us(handle, [83])
        both = fields_us(handle, [83, 75, 270])
    assert cheap < 500  # 4 µs and Python's cost, far below any costly field
    assert 0.9 * 3222 <= energy - cheap <= 1.3 * 3222 + 200
    assert 0.9 * (3222 + 794 + 662) <= both - cheap <= 1.3 * (3222 + 794 + 662) + 200
    # the table's arithmetic: costly fields by id, anything else the cheap figure
    assert H200.field_us([83, 75]) == 3222 + 794
    assert H200.field_us([99_999]) == H200.cheap_field_us
    assert H200.call_us("nvmlDeviceGetSamples", ()) == H200.cheap_call_us


def test_the_cost_is_spent_outside_the_gil() -> None:
    """While one thread spends a 50 ms call, another that wakes every millisecond keeps
    running: with the GIL held through the call (and no forced switch for 10 s) it
    could not wake once."""
    library = SimNvmlLibrary(SimNode(parse_scenario(R580, "test"), ManualClock()))
    slow = CostProfile("slow", "a test", {"nvmlDeviceGetCount_v2": 50_000.0}, {}, 1.0, 4.0)
    count_call = Costed(library, slow).nvmlDeviceGetCount_v2
    spend(1)  # map the buffer first: not part of the call
    wakes = 0
    stop = threading.Event()

    def sleeper() -> None:
        nonlocal wakes
        while not stop.is_set():
            time.sleep(0.001)
            wakes += 1

    switch = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    thread = threading.Thread(target=sleeper)
    try:
        thread.start()
        time.sleep(0.02)
        before = wakes
        started = time.thread_time_ns()
        count_call(ctypes.byref(ctypes.c_uint()))
        spent_ms = (time.thread_time_ns() - started) / 1e6
        during = wakes - before
    finally:
        stop.set()
        thread.join()
        sys.setswitchinterval(switch)
    assert spent_ms >= 49
    assert during >= 5, f"the other thread woke {during} times in a 50 ms call"


def test_no_profile_costs_nothing_and_none_overrides_the_scenario() -> None:
    energy = pynvml.nvmlDeviceGetTotalEnergyConsumption
    with installed(R580) as handle:
        assert not isinstance(pynvml.nvmlLib, Costed)
        assert cpu_us(partial(energy, handle), 5) < 1000  # Python's cost only
    with installed({**R580, "cost": "h200"}, cost="none") as handle:
        assert not isinstance(pynvml.nvmlLib, Costed)
        assert cpu_us(partial(energy, handle), 5) < 1000
    with installed({**R580, "cost": "none"}):
        assert not isinstance(pynvml.nvmlLib, Costed)
    with installed(R580, cost="h200"):  # the override alone turns it on
        assert isinstance(pynvml.nvmlLib, Costed)


def test_an_unknown_profile_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(ScenarioError) as scenario_error:
        parse_scenario({**R580, "cost": "h100"}, "test")
    assert str(scenario_error.value) == f"cost: unknown cost profile 'h100' {KNOWN}"
    with pytest.raises(ScenarioError, match="not a cost profile's name"):
        parse_scenario({**R580, "cost": 200}, "test")

    node = SimNode(parse_scenario(R580, "test"), ManualClock())
    saved = pynvml.nvmlLib
    with pytest.raises(CostProfileError, match=r"'h100' \(known: h200"):
        install(node, cost="h100")
    assert pynvml.nvmlLib is saved  # refused before anything was installed

    with pytest.raises(SystemExit) as exit_:
        sim_main(["single-gpu", "--dir", str(tmp_path), "--cost", "h100"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"argument --cost: unknown cost profile 'h100' {KNOWN}")


def described(tmp_path: Path, cost: str | None) -> Path:
    """A node.json as ``python -m exporter.sim single-gpu --dir DIR [--cost]`` writes it
    (the files it names need not exist for the library alone)."""
    paths = SimPaths(tmp_path / "proc", tmp_path / "kmsg", tmp_path / "pr.sock", None, "n")
    clock = {"kind": "monotonic", "monotonic_start": time.monotonic()}
    _describe(tmp_path, "single-gpu", paths, clock, cost)
    return tmp_path


def test_the_node_process_cost_reaches_the_attached_library(tmp_path: Path) -> None:
    """What --cost writes in node.json is what attach() (--simulated-node, and the
    peer's benchmarks/peer.py) installs."""
    assert json.loads((described(tmp_path, "h200") / "node.json").read_text())["cost"] == "h200"
    attach(tmp_path)
    assert isinstance(pynvml.nvmlLib, Costed) and pynvml.nvmlLib.cost is H200
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        spent = cpu_us(partial(pynvml.nvmlDeviceGetTotalEnergyConsumption, handle), 3)
    finally:
        pynvml.nvmlShutdown()
    assert spent >= 0.9 * H200.calls_us["nvmlDeviceGetTotalEnergyConsumption"]

    attach(described(tmp_path, None))  # no --cost: the scenario's (single-gpu: none)
    assert not isinstance(pynvml.nvmlLib, Costed)
    with pytest.raises(ScenarioError, match=r"node\.json: cost: unknown cost profile 'x'"):
        attach(described(tmp_path, "x"))


def test_the_benchmarks_h200_nodes_load() -> None:
    """benchmarks/hardware_cost.py's cases: 4 H200s with 7 GPU processes, one idle H200;
    no cost key, so the node process's --cost decides."""
    folder = Path(__file__).resolve().parent.parent / "benchmarks" / "scenarios"
    four = load_scenario(str(folder / "h200-4gpu.yaml"))
    idle = load_scenario(str(folder / "h200-idle.yaml"))
    assert (len(four.gpus), len(four.processes), four.cost) == (4, 7, None)
    assert (len(idle.gpus), len(idle.processes), idle.cost) == (1, 0, None)
    assert {g.name for g in four.gpus + idle.gpus} == {"NVIDIA H200"}
