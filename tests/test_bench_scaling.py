"""The scaling benchmark's generated scenarios (benchmarks/scaling.py) load and hold what
each point claims: GPUs, processes, pods, and allocations the simulated kubelet can
resolve. Nothing is started: the benchmark itself takes minutes."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from exporter.sim.node import ManualClock, SimNode
from exporter.sim.scenario import load_scenario
from tests.bench_scripts import load

ROOT = Path(__file__).resolve().parent.parent


scaling = load("scaling")
POINTS = scaling.all_points()


def test_the_curve_has_the_grid_the_mig_node_and_the_time_sliced_gpu():
    names = [point.name for point, _ in POINTS]
    grid = {(p.gpus, p.processes) for p, _ in POINTS if p.kind == "grid"}
    assert grid == {(g, n) for g in (1, 8, 16) for n in (8, 64, 512)}
    assert "mig-8x7" in names and "timesliced-48" in names
    assert set(scaling.QUICK_POINTS) <= set(names)


@pytest.mark.parametrize(("point", "text"), POINTS, ids=[p.name for p, _ in POINTS])
def test_each_scenario_loads_with_its_counts(tmp_path, point, text):
    path = scaling.write_scenarios([(point, text)], tmp_path)[point.name]
    scenario = load_scenario(str(path))
    assert len(scenario.gpus) == point.gpus
    assert len(scenario.processes) == point.processes
    assert len(scenario.pods) == point.pods
    assert all(proc.pod is not None for proc in scenario.processes)
    # every device reference resolves, one allocation per pod, each device given once
    node = SimNode(scenario, ManualClock())
    allocations = node.container_devices()
    assert len(allocations) == point.pods
    devices = [d for a in allocations for d in a.device_ids]
    assert len(devices) == len(set(devices)) == point.pods
    busy = {proc.gpu for proc in scenario.processes}
    assert len(busy) == min(point.gpus, point.pods)  # every GPU gets work where pods suffice


def test_mig_node_is_seven_1g_instances_per_gpu_with_the_drivers_instance_ids(tmp_path):
    point, text = next((p, t) for p, t in POINTS if p.kind == "mig")
    scenario = load_scenario(str(scaling.write_scenarios([(point, text)], tmp_path)[point.name]))
    for gpu in scenario.gpus:
        assert [m.profile for m in gpu.mig] == ["1g.10gb"] * 7
        assert [m.gpu_instance_id for m in gpu.mig] == [7, 8, 9, 11, 12, 13, 14]
    per_instance = Counter((proc.gpu, proc.mig) for proc in scenario.processes)
    assert len(per_instance) == 56 and None not in {mig for _, mig in per_instance}


def test_time_sliced_gpu_gives_each_of_48_pods_its_own_replica(tmp_path):
    point, text = next((p, t) for p, t in POINTS if p.kind == "timesliced")
    scenario = load_scenario(str(scaling.write_scenarios([(point, text)], tmp_path)[point.name]))
    replicas = [ref for pod in scenario.pods for ref in pod.containers[0].devices.values()]
    assert sorted(r for refs in replicas for r in refs) == sorted(f"gpu0::{k}" for k in range(48))
