"""Orphaned memory on the simulated node, through the real sources, over the timeline.

The ``orphans`` scenario is read by the real NVML source (pynvml over the simulated
library), procfs, the PodResources gRPC client, the pod watch against the fake API
server and the holder scan over the proc tree; attribution and orphan analysis run on
the snapshot those give, cycle by cycle, as the agent would. Expected values come
from the scenario object.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

from exporter.analysis.attribution import attribute
from exporter.analysis.orphans import (
    OrphanPolicy,
    driver_held,
    find_orphans,
    holder_request,
    orphan_holders,
)
from exporter.model import (
    KIND_DEAD_PROCESS,
    KIND_DELETED_POD,
    KIND_STUCK_PROCESS,
    KIND_UNATTRIBUTED,
    DriverHeld,
    HolderScan,
    HolderScanRequest,
    NodeSnapshot,
    OrphanedMemory,
    OrphanHolder,
    OrphanState,
    ProcessIdentity,
)
from exporter.sim.environment import SimEnvironment
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.proctree import gpu_fds, host_cgroup, write_process
from exporter.sim.scenario import (
    Scenario,
    ScenarioError,
    SimProcess,
    load_scenario,
    parse_scenario,
)
from exporter.sources import base
from exporter.sources.holder_scan import HolderScanSource
from exporter.sources.holders import scan_device_holders
from exporter.sources.kube import PodWatcher
from exporter.sources.nvml import NvmlSource
from exporter.sources.podresources.client import PodResourcesClient
from exporter.sources.procfs import ProcessReader
from tests.harness import simulated_exporter

STEP_S = 10
END_S = 150
POLICY = OrphanPolicy()  # the shipped defaults: 256 MiB, 3 cycles, 60 s grace
WATCH_TIMEOUT_S = 10.0


@dataclass
class Cycle:
    orphans: tuple[OrphanedMemory, ...]
    state: OrphanState
    holders: tuple[OrphanHolder, ...]
    driver_held: tuple[DriverHeld, ...]
    scanned: bool
    identities: dict[int, ProcessIdentity]
    watched_deleting: set[str]  # pod uids the watch shows with a deletion timestamp


async def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WATCH_TIMEOUT_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def run_timeline(scenario: Scenario, *, kube_api: bool) -> tuple[dict[int, Cycle], float]:
    """Every cycle from t=0 to END_S; also the node's epoch (wall time of t=0)."""
    clock = ManualClock()
    env = SimEnvironment(scenario, clock=clock, kube_api=kube_api)
    paths = await env.start()
    watcher = PodWatcher(paths.node_name, kubeconfig=str(paths.kubeconfig)) if kube_api else None
    client = PodResourcesClient(paths.pod_resources_socket)
    nvml = NvmlSource()
    procfs = ProcessReader(paths.proc_root)
    walks: list[int] = []

    def walk(*args: object, **kwargs: object) -> HolderScan:
        walks.append(t)
        return scan_device_holders(*args, **kwargs)  # type: ignore[arg-type]

    holders = HolderScanSource(paths.proc_root, walk=walk)
    state = OrphanState()
    request: HolderScanRequest | None = None  # what last cycle's analysis asked for
    cycles: dict[int, Cycle] = {}
    try:
        if watcher is not None:
            watcher.start()
        for t in range(0, END_S + 1, STEP_S):
            clock.now = float(t)
            await asyncio.to_thread(env.sync)
            if watcher is not None:
                w = watcher

                def in_step(w: PodWatcher = w) -> bool:
                    snap = w.snapshot()
                    seen = {(p.uid, p.deletion_timestamp is not None) for p in snap.pods}
                    want = {(p.uid, p.deletion_at is not None) for p in env.node.pods}
                    return snap.ok and seen == want

                await wait_until(in_step, f"the pod watch at t={t}")
            pod_resources = await client.fetch()
            now = env.node.wall_time()
            cycle = base.Cycle(now, holder_request=request)
            sample = await asyncio.to_thread(nvml.read, cycle)
            cycle.readings.nvml = sample
            scan = await asyncio.to_thread(holders.read, cycle)
            snapshot = NodeSnapshot(
                node_name=paths.node_name,
                nvml=sample,
                timestamp=now,
                processes=procfs.read(cycle),
                pod_resources=pod_resources,
                pod_meta=watcher.snapshot() if watcher is not None else None,
                holder_scan=scan,
            )
            orphans, state = find_orphans(
                snapshot, attribute(snapshot), state, now=now, policy=POLICY
            )
            request = holder_request(snapshot, orphans)
            cycles[t] = Cycle(
                orphans=orphans,
                state=state,
                holders=orphan_holders(snapshot, orphans),
                driver_held=driver_held(orphans, scan),
                scanned=t in walks,
                identities={p.pid: p for p in snapshot.processes},
                watched_deleting={
                    p.uid
                    for p in (snapshot.pod_meta.pods if snapshot.pod_meta else ())
                    if p.deletion_timestamp is not None
                },
            )
        return cycles, env.node.wall_time(0.0)
    finally:
        nvml.close()
        await client.close()
        if watcher is not None:
            await asyncio.to_thread(watcher.stop)
        await env.stop()


def process(scenario: Scenario, pid: int) -> SimProcess:
    return next(p for p in scenario.processes if p.pid == pid)


def event_args(scenario: Scenario, action: str) -> Mapping[str, object]:
    return next(e.args for e in scenario.timeline if e.action == action)


def fork(scenario: Scenario, *, parent_listed: bool) -> Mapping[str, object]:
    """The fork_orphan whose dead parent the driver keeps listing (GPU 0, as the H200
    did), or the one whose parent it drops (GPU 3)."""
    return next(
        e.args
        for e in scenario.timeline
        if e.action == "fork_orphan" and bool(e.args.get("parent_listed")) is parent_listed
    )


def pod_uid(scenario: Scenario, key: str) -> str:
    return next(p.uid for p in scenario.pods if f"{p.namespace}/{p.name}" == key)


def by_kind(
    orphans: tuple[OrphanedMemory, ...],
) -> dict[tuple[int, str], tuple[int | None, float]]:
    return {(o.gpu, o.kind): (o.memory_used_bytes, o.first_seen) for o in orphans}


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return load_scenario("orphans")


@pytest.fixture(scope="module")
def with_kube(scenario: Scenario) -> tuple[dict[int, Cycle], float]:
    return asyncio.run(run_timeline(scenario, kube_api=True))


@pytest.fixture(scope="module")
def without_kube(scenario: Scenario) -> tuple[dict[int, Cycle], float]:
    return asyncio.run(run_timeline(scenario, kube_api=False))


def expected(scenario: Scenario, epoch: float, t: int) -> dict[tuple[int, str], tuple[int, float]]:
    """What each kind should show at time t, from the scenario's processes and timeline.

    Every kind dates from the cycle its condition was first seen (t=30), confirmation
    windows included.
    """
    killed = process(scenario, int(str(fork(scenario, parent_listed=True)["pid"])))
    deleted_key = str(event_args(scenario, "delete_pod")["value"])
    deleted = next(p for p in scenario.processes if p.pod == deleted_key)
    stuck = process(scenario, int(str(event_args(scenario, "set_process")["pid"])))
    forked = process(scenario, int(str(fork(scenario, parent_listed=False)["pid"])))
    orphaned = process(scenario, int(str(event_args(scenario, "orphan")["value"])))
    at = 30  # every orphaning event of the scenario happens at t=30
    confirm = at + STEP_S * (POLICY.unattributed_cycles - 1)
    grace_end = at + int(POLICY.deleted_pod_grace_s)
    want: dict[tuple[int, str], tuple[int, float]] = {}
    if t >= at + STEP_S * (POLICY.dead_cycles - 1):
        want[(killed.gpu, KIND_DEAD_PROCESS)] = (killed.memory, epoch + at)
    if t >= at + STEP_S * (POLICY.stuck_cycles - 1):
        want[(stuck.gpu, KIND_STUCK_PROCESS)] = (stuck.memory, epoch + at)
    if t >= confirm:
        want[(forked.gpu, KIND_UNATTRIBUTED)] = (forked.memory, epoch + at)
        want[(orphaned.gpu, KIND_UNATTRIBUTED)] = (orphaned.memory, epoch + at)
    if t >= grace_end:
        want[(deleted.gpu, KIND_DELETED_POD)] = (deleted.memory, epoch + at)
    return want


@pytest.mark.parametrize("kube", ["with_kube", "without_kube"])
def test_each_kind_appears_with_its_bytes_when_due_and_keeps_its_first_seen(
    kube: str, scenario: Scenario, request: pytest.FixtureRequest
) -> None:
    cycles, epoch = request.getfixturevalue(kube)
    for t, cycle in cycles.items():
        assert by_kind(cycle.orphans) == expected(scenario, epoch, t), f"t={t}"


def test_the_stuck_state_reaches_the_proc_tree(
    with_kube: tuple[dict[int, Cycle], float], scenario: Scenario
) -> None:
    cycles, _ = with_kube
    pid = int(str(event_args(scenario, "set_process")["pid"]))
    assert cycles[20].identities[pid].state == "S"
    assert cycles[30].identities[pid].state == "D"


def test_a_pod_terminating_within_its_grace_is_not_flagged(
    with_kube: tuple[dict[int, Cycle], float], scenario: Scenario
) -> None:
    cycles, _ = with_kube
    key = str(event_args(scenario, "terminate_pod")["pod"])
    gpu = next(p.gpu for p in scenario.processes if p.pod == key)
    assert pod_uid(scenario, key) in cycles[END_S].watched_deleting  # the watch saw it
    assert all(o.gpu != gpu for c in cycles.values() for o in c.orphans)


def test_a_one_cycle_allocation_spike_is_seen_but_not_flagged(
    with_kube: tuple[dict[int, Cycle], float], scenario: Scenario
) -> None:
    cycles, _ = with_kube
    spiking = scenario.gpus[int(str(event_args(scenario, "set")["gpu"]))]
    streaks = {uuid: streak.cycles for uuid, streak in cycles[40].state.unattributed.items()}
    assert streaks.get(spiking.uuid) == 1  # the spike was seen, for one cycle
    assert all(o.gpu != spiking.index for c in cycles.values() for o in c.orphans)


def test_memory_on_mig_instances_is_fully_accounted(
    with_kube: tuple[dict[int, Cycle], float], scenario: Scenario
) -> None:
    cycles, _ = with_kube
    mig_gpus = {g.index for g in scenario.gpus if g.mig}
    assert mig_gpus
    assert all(o.gpu not in mig_gpus for c in cycles.values() for o in c.orphans)


def test_holders_are_scanned_for_dead_then_unattributed_memory_then_every_minute(
    with_kube: tuple[dict[int, Cycle], float],
) -> None:
    cycles, _ = with_kube
    # dead_process is confirmed after its cycles (from t=30) and asks; the scan answers
    # the next cycle
    dead = 30 + STEP_S * (POLICY.dead_cycles - 1) + STEP_S
    # unattributed is confirmed after its own and asks for GPUs a walk did not cover
    confirm = 30 + STEP_S * (POLICY.unattributed_cycles - 1)
    asked = confirm + STEP_S
    assert [t for t, c in cycles.items() if c.scanned] == sorted({dead, asked, asked + 60})


def test_the_forked_child_is_named_and_the_daemons_are_management(
    with_kube: tuple[dict[int, Cycle], float], scenario: Scenario
) -> None:
    cycles, _ = with_kube
    orphaned_gpu = process(scenario, int(str(event_args(scenario, "orphan")["value"]))).gpu
    every_gpu = list(range(len(scenario.gpus)))
    daemons = {p.pid: p for p in scenario.processes if p.holds_devices == every_gpu}
    plugin = next(p for p in daemons.values() if p.pod is not None)
    plugin_ns, plugin_pod = str(plugin.pod).split("/")
    rows = {
        (h.gpu, h.pid): (h.namespace, h.pod, h.container, h.comm, h.role)
        for h in cycles[END_S].holders
    }
    want: dict[tuple[int | None, int], tuple[object, ...]] = {}
    parents = []
    for listed in (True, False):  # the dead parent still listed (GPU 0) or not (GPU 3)
        forked = fork(scenario, parent_listed=listed)
        parent = process(scenario, int(str(forked["pid"])))
        namespace, pod = str(parent.pod).split("/")
        child = (parent.gpu, int(str(forked["child_pid"])))
        want[child] = (namespace, pod, parent.container, str(forked["comm"]), "holder")
        parents.append(parent.gpu)
    for gpu in (*parents, orphaned_gpu):
        for pid, daemon in daemons.items():
            named = (plugin_ns, plugin_pod, plugin.container) if daemon is plugin else (None,) * 3
            want[(gpu, pid)] = (*named, daemon.comm[:15], "management")
    assert rows == want


def test_memory_nobody_but_the_daemons_holds_is_driver_held(
    with_kube: tuple[dict[int, Cycle], float], scenario: Scenario
) -> None:
    cycles, _ = with_kube
    dead = process(scenario, int(str(fork(scenario, parent_listed=True)["pid"]))).gpu
    forked = process(scenario, int(str(fork(scenario, parent_listed=False)["pid"]))).gpu
    orphaned = process(scenario, int(str(event_args(scenario, "orphan")["value"]))).gpu
    uuids = {g.index: g.uuid for g in scenario.gpus}
    expected = [
        DriverHeld(dead, uuids[dead], False),  # its forked child holds it
        DriverHeld(forked, uuids[forked], False),
        DriverHeld(orphaned, uuids[orphaned], True),
    ]
    assert cycles[END_S].driver_held == tuple(sorted(expected, key=lambda held: held.gpu))


def test_without_the_pod_watch_holders_are_found_but_not_named(
    without_kube: tuple[dict[int, Cycle], float], scenario: Scenario
) -> None:
    cycles, _ = without_kube
    for listed in (True, False):
        child = int(str(fork(scenario, parent_listed=listed)["child_pid"]))
        rows = [h for h in cycles[END_S].holders if h.pid == child]
        assert [(h.namespace, h.pod, h.container, h.role) for h in rows] == [
            (None, None, None, "holder")
        ]


def test_a_deleted_pods_process_keeps_its_old_cgroup(
    with_kube: tuple[dict[int, Cycle], float], scenario: Scenario
) -> None:
    cycles, _ = with_kube
    key = str(event_args(scenario, "delete_pod")["value"])
    pid = next(p.pid for p in scenario.processes if p.pod == key)
    assert cycles[END_S].identities[pid].alive
    assert cycles[END_S].identities[pid].pod_uid == pod_uid(scenario, key)


async def test_the_exporter_names_the_child_holding_a_dead_but_listed_parents_memory(
    scenario: Scenario, caplog: pytest.LogCaptureFixture
) -> None:
    """The whole exporter on GPU 0 of ``orphans``, the H200's behaviour: the driver keeps
    listing the SIGKILLed parent, so the memory is dead_process; the live forked child is
    served as its holder, the GPU is not driver-held, and the Event and the log line say
    the dead pid is listed, not that it holds the memory."""
    forked = fork(scenario, parent_listed=True)
    parent = process(scenario, int(str(forked["pid"])))
    child, gpu = str(forked["child_pid"]), str(parent.gpu)
    caplog.set_level(logging.WARNING, logger="exporter.health")
    async with simulated_exporter("orphans") as h:
        # t=60: the kill at 30, confirmed at 50 (3 cycles), the scan it asked for at 60
        for _ in range(6):
            await h.advance(10)
        scrape = await h.scrape()
        assert h.env.kube_api is not None
        writes = h.env.kube_api.writes
        note = ""
        deadline = time.monotonic() + WATCH_TIMEOUT_S  # the writer is a thread
        while not note and time.monotonic() < deadline:
            notes = [e["note"] for e in writes.events("reason=GPUOrphanedMemory")]
            note = next((n for n in notes if "(dead_process)" in n), "")
            await asyncio.sleep(0.02)
    dead = {"gpu": gpu, "kind": KIND_DEAD_PROCESS}
    assert scrape.get("gpu_orphaned_memory_bytes", **dead) == parent.memory
    # not unattributed as well: the listed dead pid accounts for the bytes
    kinds = [labels["kind"] for labels, _ in scrape.find("gpu_orphaned_memory_bytes", gpu=gpu)]
    assert kinds == [KIND_DEAD_PROCESS]
    namespace, pod = str(parent.pod).split("/")
    labels = {"gpu": gpu, "pid": child, "role": "holder", "namespace": namespace, "pod": pod}
    assert scrape.get("gpu_orphaned_holder_info", **labels) == 1
    assert scrape.get("gpu_orphaned_memory_driver_held", gpu=gpu) == 0
    said = (
        f"listed for dead pid {parent.pid}; held open by pid {child} {forked['comm']} "
        f"(pod {parent.pod})"
    )
    assert said in note, note
    assert f"held by pid {parent.pid}" not in note
    logged = [r.getMessage() for r in caplog.records if "(dead_process)" in r.getMessage()]
    assert len(logged) == 1 and said in logged[0], logged


# ---------------------------------------------------------------------------
# Scenario and proc tree support
# ---------------------------------------------------------------------------


def one_gpu_scenario(process: dict[str, object]) -> Scenario:
    return parse_scenario({"gpus": [{}, {}], "host_processes": [{"gpu": 0, **process}]}, "test")


@pytest.mark.parametrize(
    ("value", "held"), [(True, None), (False, []), ("all", [0, 1]), ([1], [1])]
)
def test_holds_devices_takes_true_false_all_or_gpu_indices(
    value: object, held: list[int] | None
) -> None:
    assert one_gpu_scenario({"holds_devices": value}).processes[0].holds_devices == held


@pytest.mark.parametrize("value", ["some", [2], [True], 1])
def test_holds_devices_refuses_anything_else_in_one_line(value: object) -> None:
    with pytest.raises(ScenarioError, match=r"holds_devices"):
        one_gpu_scenario({"holds_devices": value})


def test_fork_orphan_leaves_an_unlisted_child_holding_the_parents_gpu() -> None:
    scenario = parse_scenario(
        {
            "gpus": [{}, {}],
            "host_processes": [{"pid": 10, "gpu": 1, "memory": "3GiB", "comm": "python3"}],
            "timeline": [{"at": 5, "fork_orphan": {"pid": 10}}],
        },
        "test",
    )
    clock = ManualClock()
    node = SimNode(scenario, clock)
    clock.advance(5)
    node.advance()
    [child] = node.processes
    assert (child.gpu, child.memory, child.listed, child.holds_devices) == (1, 0, False, [1])
    assert child.pid != 10 and child.comm == "python3"
    assert node.gpus[1].unaccounted_memory == 3 * 1024**3
    assert node.listed_processes(1) == []


def test_fork_orphan_with_parent_listed_keeps_the_dead_parent_in_nvmls_list() -> None:
    """What an H200 on driver 580.159.04 did: the SIGKILLed parent stays listed with its
    memory, gone from /proc, while the unlisted child holds the device file."""
    scenario = parse_scenario(
        {
            "gpus": [{}, {}],
            "host_processes": [{"pid": 10, "gpu": 1, "memory": "3GiB", "comm": "python3"}],
            "timeline": [
                {"at": 5, "fork_orphan": {"pid": 10, "child_pid": 11, "parent_listed": True}}
            ],
        },
        "test",
    )
    clock = ManualClock()
    node = SimNode(scenario, clock)
    clock.advance(5)
    node.advance()
    parent, child = node.processes
    assert (parent.pid, parent.alive, parent.listed, parent.memory) == (10, False, True, 3 * 2**30)
    assert (child.pid, child.alive, child.listed, child.holds_devices) == (11, True, False, [1])
    assert node.gpus[1].unaccounted_memory == 0  # the listed dead pid accounts for it
    assert [p.pid for p in node.listed_processes(1)] == [10]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        ({"pid": 10, "parent_listed": "yes"}, r"parent_listed: 'yes' is not true or false"),
        ({"pid": 10, "keep_parent": True}, r"unknown key 'keep_parent'"),
        ({"child_pid": 11}, r"needs 'pid'"),
    ],
)
def test_fork_orphan_refuses_bad_arguments_in_one_line(args: dict[str, object], says: str) -> None:
    with pytest.raises(ScenarioError, match=says):
        parse_scenario({"gpus": [{}], "timeline": [{"at": 5, "fork_orphan": args}]}, "test")


def test_terminate_pod_sets_the_deletion_deadline_to_request_time_plus_grace() -> None:
    scenario = parse_scenario(
        {
            "gpus": [{}],
            "pods": [{"namespace": "a", "name": "b"}],
            "timeline": [{"at": 7, "terminate_pod": {"pod": "a/b", "grace_s": 45}}],
        },
        "test",
    )
    clock = ManualClock()
    node = SimNode(scenario, clock)
    clock.advance(7)
    node.advance()
    assert node.pods[0].deletion_at == 52
    assert node.wall_time(52) - node.wall_time(0) == 52


def test_fd_links_are_rewritten_in_place_and_extra_ones_removed(tmp_path: Path) -> None:
    write_process(tmp_path, 10, comm="x", cgroup=host_cgroup(), fds=gpu_fds([0, 1]))
    write_process(tmp_path, 10, comm="x", cgroup=host_cgroup(), fds=["/dev/null", "/dev/nvidia3"])
    fd_dir = tmp_path / "10" / "fd"
    assert {p.name: os.readlink(p) for p in fd_dir.iterdir()} == {
        "0": "/dev/null",
        "1": "/dev/nvidia3",
    }
    assert sorted(p.name for p in (tmp_path / "10").iterdir()) == ["cgroup", "comm", "fd", "stat"]
