"""The simulated cgroup tree and GPU duty cycle (exporter/sim/cgroupfs.py,
``SimDuty``), the naming of cgroup readings (exporter/analysis/cgroup_signals.py), and
the cgroup series served end to end on the simulated node (tests/harness.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest

from exporter.analysis.cgroup_signals import cgroup_signals
from exporter.model import (
    AttributedProcess,
    Attribution,
    CgroupSnapshot,
    CgroupStats,
    ContainerRef,
    NodeSnapshot,
    NvmlSnapshot,
    PodMeta,
    PodMetaSnapshot,
    ProcessIdentity,
)
from exporter.sim.cgroupfs import CgroupTree
from exporter.sim.node import SimNode
from exporter.sim.proctree import kubepods_path
from exporter.sim.scenario import ScenarioError, SimDuty, load_scenario, parse_scenario
from exporter.sources.cgroups import parse_cpu_stat, parse_pressure
from tests.harness import simulated_exporter

UID = "d7577106-ebf4-4c63-b5bb-ad0a3444afed"
CID = "5feceb66ffc86f38d952786c6d696c79c2dbc239dd4e91b46729d73a27fb57e9"
FAMILIES = (
    "gpu_container_cpu_periods_total",
    "gpu_container_cpu_throttled_periods_total",
    "gpu_container_cpu_throttled_seconds_total",
    "gpu_container_cpu_pressure_seconds_total",
    "gpu_container_io_pressure_seconds_total",
    "gpu_container_memory_pressure_seconds_total",
)


def one_pod(cgroup: dict[str, Any] | None, **root: Any) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "trainer",
        "devices": {"nvidia.com/gpu": ["gpu0"]},
        "processes": [{"gpu": 0, "memory": "1GiB", "sm": 50}],
    }
    if cgroup is not None:
        container["cgroup"] = cgroup
    return {
        "gpus": [{}],
        "pods": [{"namespace": "ml", "name": "p-0", "uid": UID, "containers": [container]}],
        **root,
    }


# -- the tree -----------------------------------------------------------------------------


def test_the_tree_advances_with_simulated_time(tmp_path: Path) -> None:
    scenario = parse_scenario(one_pod({"throttled": 0.4, "cpu_pressure": 0.35}), "t")
    pod = scenario.pods[0]
    tree = CgroupTree(tmp_path / "cg", 2)
    directory = tmp_path / "cg" / kubepods_path(UID, pod.containers[0].container_id).lstrip("/")
    tree.sync(scenario.pods, 100.0)  # counters start when the tree first shows it
    assert parse_cpu_stat((directory / "cpu.stat").read_text(), 2) == (0, 0, 0)
    tree.sync(scenario.pods, 110.0)
    assert parse_cpu_stat((directory / "cpu.stat").read_text(), 2) == (100, 40, 2_000_000)
    tree.sync(scenario.pods, 130.0)
    stat = parse_cpu_stat((directory / "cpu.stat").read_text(), 2)
    assert stat == (300, 120, 6_000_000)
    cpu = parse_pressure((directory / "cpu.pressure").read_text())
    assert cpu is not None and cpu.some_us == 10_500_000 and cpu.full_us == 5_250_000
    io = parse_pressure((directory / "io.pressure").read_text())
    assert io is not None and io.some_us == 0  # the scenario's 0: the kernel's zero
    assert (tmp_path / "cg" / "cgroup.controllers").is_file()
    tree.sync([], 140.0)  # the pod is gone: so is its cgroup
    assert not directory.exists()


def test_v1_and_no_psi_trees_write_only_cpu_stat(tmp_path: Path) -> None:
    scenario = parse_scenario(one_pod({"throttled": 0.5}), "t")
    cid = scenario.pods[0].containers[0].container_id
    v1 = CgroupTree(tmp_path / "v1", 1)
    v1.sync(scenario.pods, 0.0)
    v1.sync(scenario.pods, 10.0)
    directory = tmp_path / "v1" / "cpu,cpuacct" / kubepods_path(UID, cid).lstrip("/")
    assert sorted(p.name for p in directory.iterdir() if not p.name.startswith(".")) == ["cpu.stat"]
    assert parse_cpu_stat((directory / "cpu.stat").read_text(), 1) == (100, 50, 2_500_000)
    no_psi = parse_scenario(one_pod({"throttled": 0.5, "psi": False}), "t")
    tree = CgroupTree(tmp_path / "v2", 2)
    tree.sync(no_psi.pods, 0.0)
    directory = tmp_path / "v2" / kubepods_path(UID, cid).lstrip("/")
    assert not (directory / "cpu.pressure").exists() and (directory / "cpu.stat").exists()


def test_containers_without_the_key_get_no_directory(tmp_path: Path) -> None:
    scenario = parse_scenario(one_pod(None), "t")
    assert scenario.has_cgroups is False
    tree = CgroupTree(tmp_path / "cg", 2)
    tree.sync(scenario.pods, 10.0)
    assert [p.name for p in (tmp_path / "cg").iterdir()] == ["cgroup.controllers"]


@pytest.mark.parametrize(
    ("cgroup", "message"),
    [
        ({"throttled": 1.5}, "throttled: 1.5 is not a share"),
        ({"cpu_pressure": "high"}, "cpu_pressure: 'high' is not a share"),
        ({"psi": "yes"}, "psi: expected true or false"),
        ({"periods_per_s": 0}, "periods_per_s: 0 is not above 0"),
        ({"thrott": 0.1}, "unknown key 'thrott'"),
    ],
)
def test_bad_cgroup_keys_are_one_line(cgroup: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(one_pod(cgroup), "t")


def test_bad_duty_and_version_are_one_line() -> None:
    with pytest.raises(ScenarioError, match=r"duty\.busy"):
        parse_scenario({"gpus": [{"duty": {"period_s": 10, "busy": 2}}]}, "t")
    with pytest.raises(ScenarioError, match=r"duty\.period_s"):
        parse_scenario({"gpus": [{"duty": {"period_s": 0, "busy": 0.5}}]}, "t")
    with pytest.raises(ScenarioError, match="cgroup_version: 3"):
        parse_scenario({"cgroup_version": 3}, "t")


# -- the GPU duty cycle -------------------------------------------------------------------


def test_duty_busy_time_is_exact_over_any_window() -> None:
    duty = SimDuty(period_s=50, busy=0.4)
    assert duty.busy_at(0) and duty.busy_at(19.9) and not duty.busy_at(20) and duty.busy_at(50)
    assert duty.busy_time(0, 50) == pytest.approx(20)
    assert duty.busy_time(10, 30) == pytest.approx(10)
    assert duty.busy_time(25, 45) == 0
    assert duty.busy_time(0, 500) == pytest.approx(200)
    assert SimDuty(10, 0.5, offset_s=5).busy_time(0, 10) == pytest.approx(5)


def test_a_duty_cycle_zeroes_activity_in_its_idle_part() -> None:
    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    scenario = parse_scenario(one_pod(None), "t")
    scenario.gpus[0].duty = SimDuty(period_s=50, busy=0.4)
    node = SimNode(scenario, clock)
    gpu = node.gpus[0]
    assert node.busy_now(gpu) and node.utilization_now(gpu) == 50
    clock.now = 30.0
    assert not node.busy_now(gpu) and node.utilization_now(gpu) == 0
    clock.now = 50.0
    # GPM integrates SM activity only over the busy 20 s of the first 50 s
    assert node.gpm_counters(0, None)["sm_active"] == pytest.approx(50 * 20)


# -- naming (pure) ------------------------------------------------------------------------


def snapshot_with(cgroups: CgroupSnapshot | None, **fields: Any) -> NodeSnapshot:
    return NodeSnapshot("n", NvmlSnapshot(ok=True, timestamp=0.0), cgroups=cgroups, **fields)


STATS = CgroupStats(UID, CID, 2, nr_periods=10, nr_throttled=4)


def test_signals_are_named_by_the_pod_watch() -> None:
    meta = PodMetaSnapshot(
        ok=True, timestamp=0.0, pods=(PodMeta(UID, "ml", "p-0", containers=((CID, "c"),)),)
    )
    other = CgroupStats("0" * 32, CID, 2, nr_periods=1)  # no pod of that UID: left out
    snapshot = snapshot_with(CgroupSnapshot(True, 1.0, containers=(STATS, other)), pod_meta=meta)
    (row,) = cgroup_signals(snapshot, Attribution())
    assert row.container == ContainerRef("ml", "p-0", "c") and row.stats is STATS


def test_signals_without_the_pod_watch_are_named_by_the_gpu_processes() -> None:
    identity = ProcessIdentity(9, True, UID, CID)
    process = AttributedProcess(
        gpu=0,
        uuid="GPU-1",
        mig_uuid=None,
        gpu_instance_id=None,
        compute_instance_id=None,
        pid=9,
        memory_used_bytes=1,
        sm_ratio=None,
        kind="compute",
        owner="pod",
        namespace="ml",
        pod="p-0",
        container="c",
    )
    snapshot = snapshot_with(CgroupSnapshot(True, 1.0, containers=(STATS,)), processes=(identity,))
    (row,) = cgroup_signals(snapshot, Attribution(processes=(process,)))
    assert row.container == ContainerRef("ml", "p-0", "c")


def test_no_signals_when_not_read_or_down() -> None:
    assert cgroup_signals(snapshot_with(None), Attribution()) == ()
    down = CgroupSnapshot(False, 1.0, error="gone", containers=(STATS,))
    assert cgroup_signals(snapshot_with(down), Attribution()) == ()


# -- served -------------------------------------------------------------------------------


def _where(pod: str) -> dict[str, str]:
    namespaces = {"loader-starved-0": "train", "cpu-bound-0": "train"}
    namespaces |= {"embedder-0": "serve", "notebook-0": "research"}
    return {"namespace": namespaces[pod], "pod": pod}


async def test_why_idle_serves_each_containers_counters() -> None:
    async with simulated_exporter("why-idle") as h:
        for _ in range(12):
            await h.advance(5)
        scrape = await h.scrape()
    assert scrape.get("gpu_exporter_source_up", source="cgroups") == 1
    starved = _where("loader-starved-0")
    # 60 s of the scenario's rates: 10 periods a second, 40 % throttled for half a period
    assert scrape.get("gpu_container_cpu_periods_total", **starved) == 600
    assert scrape.get("gpu_container_cpu_throttled_periods_total", **starved) == 240
    assert scrape.get("gpu_container_cpu_throttled_seconds_total", **starved) == 12
    cpu = "gpu_container_cpu_pressure_seconds_total"
    assert scrape.get(cpu, kind="some", **starved) == pytest.approx(21)
    assert scrape.get(cpu, kind="full", **starved) == pytest.approx(10.5)
    io = "gpu_container_io_pressure_seconds_total"
    assert scrape.get(io, kind="some", **starved) == pytest.approx(1.2)
    busy = _where("cpu-bound-0")
    assert scrape.get("gpu_container_cpu_throttled_periods_total", **busy) == 270
    # the notebook's kernel counts no throttling and no stall: real zeros, as read
    idle = _where("notebook-0")
    assert scrape.get("gpu_container_cpu_throttled_periods_total", **idle) == 0
    assert scrape.get(cpu, kind="some", **idle) == 0
    # every container that holds a GPU, and only those; labels namespace/pod/container
    for family in FAMILIES:
        pods = {labels["pod"] for labels, _ in scrape.find(family)}
        assert pods == {"loader-starved-0", "cpu-bound-0", "embedder-0", "notebook-0"}, family
    keys = {k for k, _ in scrape.find("gpu_container_cpu_periods_total")[0][0].items()}
    assert keys == {"namespace", "pod", "container"}
    # the starved pod's whole GPU: busy 15 s of every 50 s. Its SM activity comes from
    # GPM windows closed every 10 s (--gpm-interval), each the mean since the one
    # before, and a cycle's busy or idle follows the last window: 6 busy cycles and 6
    # idle in the 60 s counted (50 % idle; the true share is 70 %: the ledger's state is
    # as coarse as the GPM windows)
    seconds = "gpu_container_allocated_gpu_seconds_total"
    assert scrape.get(seconds, state="busy", **starved) == pytest.approx(30)
    assert scrape.get(seconds, state="idle", **starved) == pytest.approx(30)


async def test_a_node_without_cgroup_keys_serves_no_cgroup_series() -> None:
    """single-gpu (and every scenario without a ``cgroup:`` key) runs with
    --cgroup-root=off: no source, no series, not zeros, and never the host's tree."""
    async with simulated_exporter("single-gpu") as h:
        await h.advance(5)
        scrape = await h.scrape()
        assert h.agent.source("cgroups") is None
    assert not any(scrape.series(family) for family in FAMILIES)
    assert not scrape.find("gpu_exporter_source_up", source="cgroups")


async def test_no_psi_serves_throttling_without_pressure() -> None:
    async with simulated_exporter(one_pod({"throttled": 0.25, "psi": False})) as h:
        await h.advance(10)
        scrape = await h.scrape()
    assert scrape.get("gpu_container_cpu_throttled_periods_total", pod="p-0") == 25
    for family in FAMILIES[3:]:
        assert scrape.series(family) == {}, family


async def test_cgroup_v1_serves_throttling_without_pressure() -> None:
    async with simulated_exporter(one_pod({"throttled": 0.5}, cgroup_version=1)) as h:
        await h.advance(10)
        scrape = await h.scrape()
    assert scrape.get("gpu_container_cpu_throttled_seconds_total", pod="p-0") == 2.5
    assert scrape.get("gpu_container_processes", pod="p-0") == 1  # attributed from v1 lines
    for family in FAMILIES[3:]:
        assert scrape.series(family) == {}, family


def test_why_idle_is_shipped_with_the_pods_the_design_names() -> None:
    scenario = load_scenario("why-idle")
    pods = {f"{p.namespace}/{p.name}": p for p in scenario.pods}
    assert set(pods) == {
        "train/loader-starved-0",
        "train/cpu-bound-0",
        "serve/embedder-0",
        "research/notebook-0",
    }
    starved = pods["train/loader-starved-0"].containers[0].cgroup
    assert starved is not None and (starved.throttled, starved.cpu_pressure) == (0.4, 0.35)
    assert scenario.gpus[0].duty == SimDuty(50, 0.3)
    assert pods["serve/embedder-0"].owner == ("ReplicaSet", "embedder-6c9f8d7b5d")
    assert any(gpu.mig for gpu in scenario.gpus)
    assert copy.deepcopy(scenario).has_cgroups
