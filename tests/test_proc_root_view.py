"""The procfs source believes "no such pid" only from a live /proc of the host's pid
namespace (exporter/sources/procfs.py, ``host_view_problem``), and a cgroup file of junk
is no evidence of a host process. Driven through the real exporter on the simulated node,
with the proc root mangled on disk as a lost mount, a pod's own /proc or a corrupt tree
would leave it."""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path

import pytest

from exporter.sim.proctree import kubepods_cgroup, write_process
from exporter.sources.procfs import ProcessReader
from tests.harness import Harness, Scrape, simulated_exporter

PROCFS = {"source": "procfs"}
UID = "d7577106-ebf4-4c63-b5bb-ad0a3444afed"
CID = "5feceb66ffc86f38d952786c6d696c79c2dbc239dd4e91b46729d73a27fb57e9"
LOGGER = "exporter.sources.procfs"


def pod(name: str, gpu: int, *processes: dict[str, object]) -> dict[str, object]:
    return {
        "namespace": "ml",
        "name": name,
        "containers": [
            {"name": "main", "devices": {"nvidia.com/gpu": [f"gpu{gpu}"]}, "processes": processes}
        ],
    }


# Two pods, one with a process that really died holding 12 GiB (a dead_process orphan a
# live /proc must keep reporting), and a host process.
SCENARIO: dict[str, object] = {
    "gpus": [{}, {}, {}],
    "pods": [
        pod("a", 0, {"gpu": 0, "memory": "8GiB", "comm": "python3"}),
        pod(
            "b",
            1,
            {"gpu": 1, "memory": "4GiB", "comm": "python3"},
            {"gpu": 1, "memory": "12GiB", "comm": "python3", "alive": False},
        ),
    ],
    "host_processes": [{"gpu": 2, "memory": "1GiB", "comm": "dcgmproftester"}],
}


def owners(scrape: Scrape) -> list[str]:
    return sorted(labels["owner"] for labels, _ in scrape.find("gpu_process_memory_used_bytes"))


def orphan_series(scrape: Scrape) -> list[tuple[dict[str, str], float]]:
    return scrape.find("gpu_orphaned_processes") + scrape.find("gpu_orphaned_memory_bytes")


def procfs_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == LOGGER]


async def live_baseline(h: Harness) -> Scrape:
    await h.refresh_pod_resources()
    for _ in range(3):  # a dead pid is an orphan after 3 cycles (--orphan-cycles)
        await h.advance(5)
    scrape = await h.scrape()
    assert scrape.get("gpu_exporter_source_up", **PROCFS) == 1
    assert owners(scrape) == ["dead", "host", "pod", "pod"]
    (dead,) = scrape.find("gpu_orphaned_processes", kind="dead_process")
    assert dead[1] == 1  # the one real exit, seen through a live /proc
    return scrape


async def test_an_emptied_proc_root_is_procfs_down_never_every_process_dead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The hostPath mount lost (the proc root an empty directory): no pid is "gone"."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with simulated_exporter(SCENARIO, argv=["--per-process-metrics"], first_cycle=False) as h:
        live = await live_baseline(h)
        root = h.env.paths.proc_root
        away = root.with_name(root.name + ".away")
        logged_before = len(procfs_lines(caplog))
        os.rename(root, away)
        root.mkdir()
        cycles = 6
        for _ in range(cycles):
            await h.advance(5)
        down = await h.scrape()
        status = h.source("procfs").status()
        lines = procfs_lines(caplog)[logged_before:]

        shutil.rmtree(root)  # the simulator went on writing its uptime there
        os.rename(away, root)
        await h.advance(5)
        back = await h.scrape()
        recovered = procfs_lines(caplog)[logged_before + len(lines) :]

    assert down.get("gpu_exporter_source_up", **PROCFS) == 0
    assert status is not None and status.error == (
        f"proc root {root} shows no pid 1: not a live /proc of the host; mount the "
        "host's /proc and run with hostPID"
    )
    # not one pid more is dead; the real exit, confirmed before, stays (an unread /proc
    # says nothing of a process: docs/orphans.md)
    assert orphan_series(down) == orphan_series(live)
    assert owners(down) == ["unknown"] * 4
    reasons = {labels["reason"] for labels, _ in down.find("gpu_unattributed_memory_used_bytes")}
    assert reasons == {"process not read from /proc"}
    assert lines == [f"{status.error}; the owners of GPU processes are unknown until it is"]
    assert back.get("gpu_exporter_source_up", **PROCFS) == 1
    assert owners(back) == ["dead", "host", "pod", "pod"]
    assert recovered == [f"proc root {root} is a live /proc of the host again"]


def pod_namespace_proc(root: Path) -> None:
    """What a pod without hostPID sees at /proc: its own init as pid 1 and, as pid 2, a
    thread of it (a tid is readable at /proc/<tid> though not listed), none of the host's
    pids."""
    shutil.rmtree(root)
    write_process(root, 1, comm="gpu-occupancy-e", cgroup="0::/\n", ppid=0)
    write_process(root, 2, comm="asyncio_0", cgroup="0::/\n", ppid=0)
    write_process(root, 7, comm="sh", cgroup="0::/\n")


async def test_another_pid_namespaces_proc_is_procfs_down_never_every_process_dead(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    async with simulated_exporter(SCENARIO, argv=["--per-process-metrics"], first_cycle=False) as h:
        live = await live_baseline(h)
        root = h.env.paths.proc_root
        pod_namespace_proc(root)
        for _ in range(3):
            await h.advance(5)
        down = await h.scrape()
        status = h.source("procfs").status()

    assert down.get("gpu_exporter_source_up", **PROCFS) == 0
    assert status is not None and status.error == (
        f"proc root {root} shows pid 2 as 'asyncio_0', not kthreadd: the /proc of another "
        "pid namespace; mount the host's /proc and run with hostPID"
    )
    assert orphan_series(down) == orphan_series(live)
    assert owners(down) == ["unknown"] * 4
    warnings = [r for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING]
    assert len(warnings) == 1


async def test_a_proc_without_kthreadd_hidepid_or_a_lone_init_is_procfs_down() -> None:
    """A pod's /proc where the exporter is pid 1 with no thread 2 yet, or /proc mounted
    with hidepid=invisible for a reader that may not see kernel threads."""
    async with simulated_exporter(SCENARIO, argv=["--per-process-metrics"], first_cycle=False) as h:
        live = await live_baseline(h)
        root = h.env.paths.proc_root
        shutil.rmtree(root / "2")
        await h.advance(5)
        down = await h.scrape()
        status = h.source("procfs").status()

    assert down.get("gpu_exporter_source_up", **PROCFS) == 0
    assert status is not None and status.error is not None
    assert status.error.startswith(f"proc root {root} shows no pid 2 (kthreadd): ")
    assert orphan_series(down) == orphan_series(live)
    assert owners(down) == ["unknown"] * 4


async def test_a_cgroup_file_of_junk_is_owner_unknown_and_counted_never_host() -> None:
    """Every pid's stat and cgroup filled with random bytes (proc_attack.py garbage)."""
    noise = random.Random(21)
    async with simulated_exporter(SCENARIO, argv=["--per-process-metrics"], first_cycle=False) as h:
        await live_baseline(h)
        errors_before = (await h.scrape()).get("gpu_exporter_errors_total", **PROCFS)
        root = h.env.paths.proc_root
        junked = 0
        for pid_dir in root.iterdir():
            if not pid_dir.name.isdigit():
                continue
            for name in ("stat", "cgroup"):
                (pid_dir / name).write_bytes(noise.randbytes(4096))
            junked += 1
        cycles = 3
        for _ in range(cycles):
            await h.advance(5)
        junk = await h.scrape()

    assert junked == 2 + 3  # pid 1, pid 2 and the three live GPU processes
    # Unreadable evidence makes no claim: not down (every file was read), but no owner;
    # the pid whose directory is really gone is still the dead process it was.
    assert junk.get("gpu_exporter_source_up", **PROCFS) == 1
    assert owners(junk) == ["dead", "unknown", "unknown", "unknown"]
    unknown = junk.find("gpu_unattributed_memory_used_bytes", owner="unknown")
    assert {labels["reason"] for labels, _ in unknown} == {"cgroup file not understood"}
    assert [labels["kind"] for labels, _ in junk.find("gpu_orphaned_processes")] == ["dead_process"]
    # counted like an unreadable cgroup: once per live pid per cycle
    errors = junk.get("gpu_exporter_errors_total", **PROCFS) - errors_before
    assert errors == 3 * cycles


@pytest.mark.parametrize(
    "cgroup",
    [
        "0::/system.slice/dcgm.service\n",
        "0::/\n",
        "0::/system.slice/old.service (deleted)\n",
        "3:memory:/user.slice\n2:cpu,cpuacct:/user.slice\n1:name=systemd:/user.slice\n0::/\n",
    ],
)
def test_a_well_formed_cgroup_outside_kubepods_is_still_a_host_process(
    tmp_path: Path, cgroup: str
) -> None:
    write_process(tmp_path, 40, comm="dcgm", cgroup=cgroup)
    reader = ProcessReader(tmp_path)
    (identity,) = reader.identify([40])
    assert identity.alive and identity.pod_uid is None and identity.cgroup_parsed
    assert reader.errors_total == 0


@pytest.mark.parametrize(
    "cgroup",
    ["", "\n", "garbage\n", "0::system.slice\n", "x::/\n", "0::/\n\x00\xff junk\n"],
)
def test_a_cgroup_file_in_no_known_form_is_unparsed_counted_and_read_again(
    tmp_path: Path, cgroup: str
) -> None:
    write_process(tmp_path, 40, comm="python3", cgroup=cgroup)
    reader = ProcessReader(tmp_path)
    (identity,) = reader.identify([40])
    assert identity.alive and identity.pod_uid is None and not identity.cgroup_parsed
    assert reader.errors_total == 1
    # not remembered as a host process: repaired, the next read sees the pod
    (tmp_path / "40" / "cgroup").write_text(kubepods_cgroup(UID, CID))
    (again,) = reader.identify([40])
    assert again.pod_uid == UID and again.cgroup_parsed
