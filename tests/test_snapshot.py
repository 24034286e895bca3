"""`gpu-occupancy-exporter snapshot`: one analysed sample for an operator on the node."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from exporter.sim.scenario import load_scenario


def snapshot(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "exporter", "snapshot", "--window", "0.2", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow  # a snapshot process on the 8-GPU simulated node (~2.5 s)
def test_snapshot_prints_gpus_pods_leaks_and_capacity_as_tables() -> None:
    result = snapshot("--simulate", "node-8gpu")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for section in (
        "GPUS",
        "MIG INSTANCES",
        "PODS",
        "ISOLATION LEAKS",
        "NODE CAPACITY",
        "NOT OWNED BY ANY CONTAINER",
    ):
        assert f"\n{section}" in out
    gpu_lines = [ln for ln in out.split("\nGPUS\n")[1].split("\n\n")[0].splitlines()[1:]]
    assert len(gpu_lines) == len(load_scenario("node-8gpu").gpus)
    # the tiny-kernels GPU: GPU-Util 100 % but SM activity 2 %
    tiny = next(ln for ln in gpu_lines if ln.startswith("4 "))
    assert "100%" in tiny and " 2%" in tiny
    assert "degraded: thermal_slowdown" in out
    assert "leaky-shell" in out.split("ISOLATION LEAKS")[1]


@pytest.mark.slow  # a snapshot process on the 8-GPU simulated node (~2.5 s)
def test_snapshot_json_carries_the_whole_analysis() -> None:
    result = snapshot("--simulate", "node-8gpu", "--json")
    assert result.returncode == 0, result.stderr
    data = json.loads(result.stdout)
    scenario = load_scenario("node-8gpu")
    assert len(data["node"]["nvml"]["gpus"]) == len(scenario.gpus)
    pods = {(c["namespace"], c["pod"]) for c in data["attribution"]["containers"]}
    with_processes = {
        (p.namespace, p.name)
        for p in scenario.pods
        if any(
            c
            for c in p.containers
            if any(q.pod == f"{p.namespace}/{p.name}" for q in scenario.processes)
        )
    }
    assert pods == with_processes
    assert all(h["healthy"] for h in data["health"])
    assert {c["resource"] for c in data["capacity"]} >= {"nvidia.com/gpu", "nvidia.com/gpu.shared"}


def test_snapshot_on_a_node_without_driver_says_nvml_is_down_and_exits_1() -> None:
    result = snapshot("--simulate", "no-gpu", "--kube-api", "off")
    assert result.returncode == 1, result.stderr
    assert "NVML DOWN" in result.stdout  # the report is still printed, saying why
    assert "NVML unavailable: DriverNotLoaded" in result.stdout
    assert result.stderr.strip().splitlines()[-1] == (
        "gpu-occupancy-exporter snapshot: NVML is down: DriverNotLoaded: Driver Not Loaded"
    )


def test_snapshot_help_lists_its_own_flags_and_the_source_flags() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "exporter", "snapshot", "--help"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 0
    for flag in ("--json", "--window", "--simulate", "--proc-root", "--pod-resources-socket"):
        assert flag in result.stdout


def test_snapshot_names_orphan_holders_and_driver_held_memory() -> None:
    from exporter.model import (
        Analysis,
        Attribution,
        DriverHeld,
        NodeSnapshot,
        NvmlSnapshot,
        OrphanedMemory,
        OrphanHolder,
    )
    from exporter.snapshot import render_text

    analysis = Analysis(
        node=NodeSnapshot(node_name="n", nvml=NvmlSnapshot(ok=True, timestamp=0.0)),
        attribution=Attribution(),
        orphans=(
            OrphanedMemory(3, "GPU-c", "unattributed", 2 * 1024**3, 0, 0.0),
            OrphanedMemory(4, "GPU-d", "unattributed", 1024**3, 0, 0.0),
        ),
        orphan_holders=(
            OrphanHolder(3, "GPU-c", 5302, "ml", "trainer", "main", "pt_data_worker", "holder"),
        ),
        driver_held=(DriverHeld(3, "GPU-c", False), DriverHeld(4, "GPU-d", True)),
    )
    out = render_text(analysis)
    assert "ORPHANED GPU MEMORY" in out
    assert "driver-held (no process holds the device; reset the GPU): GPU 4\n" in out
    holder_line = next(ln for ln in out.splitlines() if "5302" in ln)
    assert holder_line.split() == ["3", "5302", "pt_data_worker", "ml", "trainer", "main", "holder"]


@pytest.mark.slow  # a snapshot process on the simulated why-idle node (~2.5 s)
def test_snapshot_json_says_why_each_gpu_container_may_be_idle() -> None:
    """The why-idle scenario: the data-loader-starved pod's window reads CPU-throttled,
    the notebook with CPU to spare reads no cause (docs/why-idle.md)."""
    result = snapshot("--simulate", "why-idle", "--window", "1", "--json")
    assert result.returncode == 0, result.stderr
    causes = {r["pod"]: r["cause"] for r in json.loads(result.stdout)["why_idle"]}
    assert causes["loader-starved-0"] == "cpu_throttled"
    assert causes["notebook-0"] == "unknown"
