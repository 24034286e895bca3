"""The simulated node in a process of its own (exporter/sim/external.py) and churn made on
demand (exporter/sim/churn.py): what the benchmarks and the soak stand on."""

from __future__ import annotations

import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.agent import build_agent
from exporter.config import parse_config
from exporter.exposition.server import MetricsCache
from exporter.sim.churn import WORKER_PID_BASE
from exporter.sim.external import NodeProcess, attach
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.scenario import Scenario, ScenarioError, parse_scenario

EXE = [sys.executable, "-m"]


def churned(**churn: Any) -> Scenario:
    shipped = resources.files("exporter.sim").joinpath("scenarios/node-8gpu.yaml")
    data = yaml.safe_load(shipped.read_text())
    data["churn"] = churn
    return parse_scenario(data, "node-8gpu-churn")


def test_churn_events_are_the_same_in_every_load_of_the_scenario() -> None:
    first, second = churned(seconds=500), churned(seconds=500)
    assert len(first.timeline) == len(second.timeline) > 1000
    for i in (0, 1, 17, 500, len(first.timeline) - 1):
        assert first.timeline[i] == second.timeline[i]


def test_a_churning_node_keeps_a_bounded_set_of_processes_and_pods() -> None:
    clock = ManualClock()
    node = SimNode(churned(seconds=10_000, gpu_flap_period_s=100, gpu_flap=1), clock)
    quiet_clock = ManualClock()
    quiet = SimNode(churned(seconds=0), quiet_clock)  # node-8gpu's own timeline only
    seen_pids: set[int] = set()
    counts, pods, flap = [], [], []
    for _ in range(400):
        clock.advance(1.0)
        quiet_clock.advance(1.0)
        node.advance()
        quiet.advance()
        counts.append(len(node.processes) - len(quiet.processes))
        pods.append(len(node.pods) - len(quiet.pods))
        flap.append(node.gpus[1].lost)
        seen_pids |= {p.pid for p in node.processes if p.pid >= WORKER_PID_BASE}
    assert len(seen_pids) == 400  # a new worker every second, each pid used once
    assert max(counts) <= 20 + 1  # workers live 20 s, one job process at a time
    assert set(pods) == {0, 1}  # a job pod comes and goes
    assert any(flap) and not flap[-1] and flap.index(True) == 49  # lost at 50 s, back at 60 s


def test_churn_with_a_gpu_the_node_lacks_is_refused() -> None:
    with pytest.raises(ScenarioError, match=r"churn\.gpu_flap: the node has no GPU 9"):
        churned(seconds=10, gpu_flap=9)
    with pytest.raises(ScenarioError, match="'seconds'"):
        churned(worker_lifetime_s=5)


@pytest.mark.slow
async def test_an_exporter_attached_to_a_node_process_reads_every_source(tmp_path: Path) -> None:
    node = NodeProcess("node-8gpu", tmp_path)
    try:
        attached = attach(tmp_path)
        paths = attached.paths
        assert paths.kubeconfig is not None
        config = parse_config(paths.flags(), env={})
        agent = build_agent(config, MetricsCache())
        await agent.start()
        try:
            node.advance(1.0)
            await agent.cycle()
            node.advance(1.0)
            await agent.cycle()
            latest = agent.latest
            assert latest is not None
            assert [s.name for s in latest.node.sources if not s.up] == []
            pods = {(c.container.namespace, c.container.pod) for c in latest.attribution.containers}
            assert len(pods) >= 20  # node-8gpu's pods, named through the API stand-in
            # measured whole by benchmarks/: nothing counted inside the exporter's process
            assert not attached.library.calls.by_function
        finally:
            await agent.close()
    finally:
        node.stop()
    assert not node.process.is_alive()


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EXE, *args], capture_output=True, text=True, timeout=30)


@pytest.mark.slow
def test_simulated_node_flag_errors_are_one_line_and_exit_2(tmp_path: Path) -> None:
    missing = run("exporter", "--simulated-node", str(tmp_path))
    assert missing.returncode == 2
    assert "python -m exporter.sim SCENARIO --dir DIR" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    both = run("exporter", "--simulate", "single-gpu", "--simulated-node", str(tmp_path))
    assert both.returncode == 2 and "pick one" in both.stderr
    bad = run("exporter.sim", "no-such-scenario", "--dir", str(tmp_path))
    assert bad.returncode == 2 and "no-such-scenario" in bad.stderr
