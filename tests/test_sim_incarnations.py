"""The simulator tells one incarnation of a pid or a pod from the next, as a node does:
a pid reused by a new process shows a new start time in ``/proc/<pid>/stat``, and a pod
added again under its name has a new UID and new container ids."""

from __future__ import annotations

from pathlib import Path

from exporter.sim.node import BOOT_TICKS, USER_HZ, ManualClock, SimNode
from exporter.sim.proctree import (
    host_cgroup,
    kubepods_cgroup,
    remove_process,
    start_time_of,
    write_process,
)
from exporter.sim.scenario import parse_scenario
from tests.harness import simulated_exporter

UID = "d7577106-ebf4-4c63-b5bb-ad0a3444afed"
CID = "5feceb66ffc86f38d952786c6d696c79c2dbc239dd4e91b46729d73a27fb57e9"


def test_an_update_keeps_the_start_time_and_a_new_process_gets_a_later_one(
    tmp_path: Path,
) -> None:
    write_process(tmp_path, 7, comm="a", state="R", cgroup=host_cgroup())
    first = start_time_of(tmp_path, 7)
    write_process(tmp_path, 7, comm="a", state="D", cgroup=host_cgroup())
    assert start_time_of(tmp_path, 7) == first  # the same process, another state
    remove_process(tmp_path, 7)
    assert start_time_of(tmp_path, 7) is None
    write_process(tmp_path, 7, comm="b", cgroup=host_cgroup())
    second = start_time_of(tmp_path, 7)
    assert first is not None and second is not None and second > first


def test_another_start_time_on_a_pid_replaces_its_directory(tmp_path: Path) -> None:
    write_process(tmp_path, 8, comm="old", cgroup=host_cgroup(), fds=["/dev/nvidia0"], start_time=5)
    write_process(tmp_path, 8, comm="new", cgroup=kubepods_cgroup(UID, CID), start_time=9)
    assert start_time_of(tmp_path, 8) == 9
    assert not (tmp_path / "8" / "fd").exists()  # a new directory: nothing of the old one
    write_process(tmp_path, 8, comm="new", state="R", cgroup=kubepods_cgroup(UID, CID))
    assert start_time_of(tmp_path, 8) == 9  # no start time given: the process there


def test_processes_started_later_have_later_start_times_even_in_one_second() -> None:
    scenario = parse_scenario(
        {
            "gpus": [{}],
            "host_processes": [{"pid": 500, "gpu": 0, "memory": "1GiB"}],
            "timeline": [
                {"at": 10, "exit": 500},
                {"at": 10, "start": {"pid": 500, "gpu": 0, "memory": "1GiB"}},
                {"at": 10, "start": {"pid": 501, "gpu": 0, "memory": "1GiB"}},
            ],
        },
        "test",
    )
    clock = ManualClock()
    node = SimNode(scenario, clock)
    (before,) = [p.start_time for p in node.processes]
    assert before == BOOT_TICKS
    clock.advance(10)
    node.advance()
    after = [p.start_time for p in node.processes]
    assert after == [BOOT_TICKS + 10 * USER_HZ, BOOT_TICKS + 10 * USER_HZ + 1]


def test_a_pod_added_again_under_its_name_is_a_new_pod() -> None:
    main = {"name": "main", "devices": {"nvidia.com/gpu": ["gpu0"]}}
    again = {"pod": "ml/a", "containers": [main]}
    scenario = parse_scenario(
        {
            "gpus": [{}],
            "pods": [{"namespace": "ml", "name": "a", "containers": [main]}],
            "timeline": [
                {"at": 1, "delete_pod": "ml/a"},
                {"at": 1, "add_pod": again},
                {"at": 2, "delete_pod": "ml/a"},
                {"at": 2, "add_pod": again},
                {"at": 3, "delete_pod": "ml/a"},
                {"at": 3, "add_pod": {**again, "uid": UID, "containers": [{**main, "id": CID}]}},
            ],
        },
        "test",
    )
    clock = ManualClock()
    node = SimNode(scenario, clock)
    seen = []
    for _ in range(4):
        (pod,) = node.pods
        seen.append((pod.uid, pod.containers[0].container_id))
        clock.advance(1)
        node.advance()
    assert len({uid for uid, _ in seen}) == 4
    assert len({cid for _, cid in seen}) == 4
    assert seen[-1] == (UID, CID)  # named ones are kept


async def test_a_pid_reused_by_another_pods_process_is_that_pods() -> None:
    def pod(name: str, gpu: int, processes: list[dict[str, object]]) -> dict[str, object]:
        devices = {"nvidia.com/gpu": [f"gpu{gpu}"]}
        return {
            "namespace": "ml",
            "name": name,
            "containers": [{"name": "main", "devices": devices, "processes": processes}],
        }

    reused = {"pid": 600, "gpu": 1, "memory": "4GiB", "comm": "trainer"}
    scenario: dict[str, object] = {
        "gpus": [{}, {}],
        "pods": [pod("a", 0, [{"pid": 600, "gpu": 0, "memory": "8GiB"}]), pod("b", 1, [])],
        # the pid's process exits and, within the same second, a process of pod b gets it
        "timeline": [
            {"at": 10, "exit": 600},
            {"at": 10, "start": {**reused, "pod": "ml/b", "container": "main"}},
        ],
    }
    async with simulated_exporter(scenario) as h:
        proc_root = h.env.paths.proc_root
        before = start_time_of(proc_root, 600)
        scrape = await h.scrape()
        assert scrape.get("gpu_container_memory_used_bytes", pod="a") == 8 * 2**30
        await h.advance(15)
        scrape = await h.scrape()
        assert scrape.find("gpu_container_memory_used_bytes", pod="a") == []
        assert scrape.get("gpu_container_memory_used_bytes", pod="b") == 4 * 2**30
        after = start_time_of(proc_root, 600)
        assert before is not None and after is not None and after > before
