"""The cgroup source (exporter/sources/cgroups.py): parsers, and reads of real cgroup
trees written in a temporary directory in the kernel's formats."""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest

from exporter.model import (
    CgroupStats,
    ContainerDevices,
    PodMeta,
    PodMetaSnapshot,
    PodResourcesSnapshot,
    Pressure,
    ProcessIdentity,
    Readings,
)
from exporter.sim.proctree import DRIVERS, QOS_CLASSES, RUNTIMES, kubepods_path
from exporter.sources.base import Cycle
from exporter.sources.cgroups import (
    MAX_CONTAINERS,
    MAX_LOOKUPS,
    READ_LIMIT,
    CgroupReader,
    parse_cpu_stat,
    parse_pressure,
)

UID = "d7577106-ebf4-4c63-b5bb-ad0a3444afed"
CID = "5feceb66ffc86f38d952786c6d696c79c2dbc239dd4e91b46729d73a27fb57e9"
CID2 = "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b"

# What a 6.x kernel writes (Documentation/admin-guide/cgroup-v2.rst, psi.rst).
CPU_STAT_V2 = (
    "usage_usec 8213429\nuser_usec 7392086\nsystem_usec 821343\n"
    "nr_periods 1200\nnr_throttled 480\nthrottled_usec 24000000\n"
    "nr_bursts 0\nburst_usec 0\n"
)
CPU_STAT_V1 = "nr_periods 1200\nnr_throttled 480\nthrottled_time 24000000000\n"
PSI = (
    "some avg10=35.00 avg60=34.12 avg300=33.80 total=21000000\n"
    "full avg10=17.50 avg60=17.06 avg300=16.90 total=10500000\n"
)


# -- parsers ------------------------------------------------------------------------------


def test_cpu_stat_v2_and_v1() -> None:
    assert parse_cpu_stat(CPU_STAT_V2, 2) == (1200, 480, 24_000_000)
    # v1 counts throttled time in nanoseconds (sched-bwc.rst, "Statistics")
    assert parse_cpu_stat(CPU_STAT_V1, 1) == (1200, 480, 24_000_000)


def test_cpu_stat_missing_lines_are_none_never_zero() -> None:
    assert parse_cpu_stat("usage_usec 5\nuser_usec 4\n", 2) == (None, None, None)
    assert parse_cpu_stat("nr_periods 10\n", 2) == (10, None, None)
    assert parse_cpu_stat("", 1) == (None, None, None)


def test_cpu_stat_garbage_gives_none_for_the_bad_lines_only() -> None:
    text = "nr_periods -3\nnr_throttled lots\nthrottled_usec 1 2\nnr_periods 7\n\x00\xff junk"
    # a negative or non-numeric value is no count; the first well-formed line counts
    assert parse_cpu_stat(text, 2) == (7, None, None)
    assert parse_cpu_stat("nr_periods 5\nnr_periods 9\n", 2) == (5, None, None)


def test_cpu_stat_cut_at_the_read_limit_ignores_the_partial_last_line() -> None:
    padding = "x" * 100 + "\n"
    text = CPU_STAT_V2 + padding * (READ_LIMIT // len(padding))
    cut = (text + "nr_throttled 99999")[:READ_LIMIT]
    assert len(cut) == READ_LIMIT and not cut.endswith("\n")
    assert parse_cpu_stat(cut, 2) == (1200, 480, 24_000_000)


def test_pressure_some_and_full() -> None:
    assert parse_pressure(PSI) == Pressure(some_us=21_000_000, full_us=10_500_000)


def test_pressure_without_full_line_as_old_kernels_write_cpu_pressure() -> None:
    some = "some avg10=0.00 avg60=0.00 avg300=0.00 total=42\n"
    assert parse_pressure(some) == Pressure(some_us=42, full_us=None)


def test_pressure_garbage_and_empty_are_none() -> None:
    assert parse_pressure("") is None
    assert parse_pressure("some avg10=1.0 total=-5\nfull nothing\n") is None
    assert parse_pressure("\x00\x01\x02") is None
    assert parse_pressure("other total=5\n") is None


# -- the source over a real tree ----------------------------------------------------------


def write_container(
    base: Path, path: str, files: dict[str, str] | None = None, *, version: int = 2
) -> Path:
    directory = base.joinpath(*[p for p in path.split("/") if p])
    directory.mkdir(parents=True, exist_ok=True)
    default = {"cpu.stat": CPU_STAT_V2, "cpu.pressure": PSI, "io.pressure": PSI}
    default["memory.pressure"] = PSI
    if version == 1:
        default = {"cpu.stat": CPU_STAT_V1}
    for name, text in (default if files is None else files).items():
        (directory / name).write_text(text)
    return directory


def v2_root(tmp_path: Path) -> Path:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    return root


def gpu_process(
    path: str | None, version: int | None = 2, uid: str = UID, cid: str = CID
) -> ProcessIdentity:
    return ProcessIdentity(
        pid=4242,
        alive=True,
        pod_uid=uid,
        container_id=cid,
        comm="python3",
        state="R",
        cgroup_path=path,
        cgroup_version=version if path else None,
    )


def cycle_with(*processes: ProcessIdentity, **readings: object) -> Cycle:
    return Cycle(timestamp=0.0, readings=Readings(processes=processes, **readings))  # type: ignore[arg-type]


def test_reads_a_gpu_processs_container_at_the_path_procfs_named(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    path = kubepods_path(UID, CID)
    write_container(root, path)
    reader = CgroupReader(root, clock=lambda: 123.5)
    snapshot = reader.read(cycle_with(gpu_process(path)))
    assert snapshot.ok and snapshot.timestamp == 123.5 and snapshot.error is None
    full = Pressure(21_000_000, 10_500_000)
    assert snapshot.containers == (
        CgroupStats(UID, CID, 2, 1200, 480, 24_000_000, full, full, full),
    )
    assert reader.status().up is True


def test_v1_reads_cpu_stat_under_the_cpu_hierarchy_and_no_pressure(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    path = kubepods_path(UID, CID, driver="cgroupfs")
    write_container(root / "cpu,cpuacct", path, version=1)
    # a PSI file in a v1 tree is not read: v1 has no pressure interface
    (root / "cpu,cpuacct" / path.lstrip("/") / "cpu.pressure").write_text(PSI)
    stats = CgroupReader(root).read(cycle_with(gpu_process(path, 1))).containers
    assert stats == (CgroupStats(UID, CID, 1, 1200, 480, 24_000_000),)


def test_missing_files_are_none_with_one_log_line_per_cause(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A kernel without PSI: no pressure files. The fields are None (no series), never
    0, and the cause is logged once, not once per container or cycle."""
    root = v2_root(tmp_path)
    paths = [kubepods_path(UID, cid) for cid in (CID, CID2)]
    for path in paths:
        write_container(root, path, {"cpu.stat": CPU_STAT_V2})
    reader = CgroupReader(root)
    cycle = cycle_with(gpu_process(paths[0]), gpu_process(paths[1], cid=CID2))
    with caplog.at_level(logging.WARNING, logger="exporter.sources.cgroups"):
        for _ in range(3):
            snapshot = reader.read(cycle)
    assert [s.cpu_pressure for s in snapshot.containers] == [None, None]
    assert [s.io_pressure for s in snapshot.containers] == [None, None]
    assert [s.nr_periods for s in snapshot.containers] == [1200, 1200]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # one per missing file name
    assert all("PSI" in line and "absent" in line for line in lines)
    assert snapshot.ok and reader.status().up and reader.errors_total == 0


def test_an_unreadable_file_is_none_and_counted_as_an_error(tmp_path: Path) -> None:
    """A file that fails for another reason than absence (here EISDIR: a directory
    where the file should be) is an error of the source, and still no zero."""
    root = v2_root(tmp_path)
    path = kubepods_path(UID, CID)
    directory = write_container(root, path, {"cpu.stat": CPU_STAT_V2})
    (directory / "cpu.pressure").mkdir()
    reader = CgroupReader(root)
    (stats,) = reader.read(cycle_with(gpu_process(path))).containers
    assert stats.cpu_pressure is None and stats.nr_throttled == 480
    assert reader.errors_total == 1


def test_an_empty_or_garbage_file_is_none(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    path = kubepods_path(UID, CID)
    write_container(root, path, {"cpu.stat": "\x00garbage\n", "cpu.pressure": ""})
    (stats,) = CgroupReader(root).read(cycle_with(gpu_process(path))).containers
    assert (stats.nr_periods, stats.nr_throttled, stats.throttled_usec) == (None, None, None)
    assert stats.cpu_pressure is None


def test_a_huge_file_is_read_only_to_the_limit(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    path = kubepods_path(UID, CID)
    huge = CPU_STAT_V2 + "x" * (8 * READ_LIMIT) + "\nnr_periods 5\n"
    write_container(root, path, {"cpu.stat": huge})
    (stats,) = CgroupReader(root).read(cycle_with(gpu_process(path))).containers
    assert stats.nr_periods == 1200  # the line past the limit was never read


def test_root_missing_puts_the_source_down_unlike_a_container_without_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    reader = CgroupReader(tmp_path / "absent")
    with caplog.at_level(logging.WARNING, logger="exporter.sources.cgroups"):
        first = reader.read(cycle_with(gpu_process(kubepods_path(UID, CID))))
        reader.read(cycle_with())
    assert first.ok is False and first.containers == ()
    assert first.error is not None and "not a readable directory" in first.error
    status = reader.status()
    assert status.up is False and status.error == first.error
    assert len(caplog.records) == 1  # logged when it starts, not every cycle
    # A directory that is no cgroup hierarchy (an empty mount) is down too, with its reason.
    empty = tmp_path / "empty"
    empty.mkdir()
    snapshot = CgroupReader(empty).read(cycle_with())
    assert snapshot.ok is False and "neither a cgroup v2" in (snapshot.error or "")
    # ... and it recovers once the hierarchy is there
    (empty / "cgroup.controllers").write_text("cpu\n")
    again = CgroupReader(empty)
    assert again.read(cycle_with()).ok and again.status().up


def test_a_container_whose_cgroup_is_gone_is_left_out(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    snapshot = CgroupReader(root).read(cycle_with(gpu_process(kubepods_path(UID, CID))))
    assert snapshot.ok and snapshot.containers == ()  # unknown, not zero


def test_only_gpu_containers_are_read(tmp_path: Path) -> None:
    """Other containers' cgroups (every pod on the node) are never looked at."""
    root = v2_root(tmp_path)
    write_container(root, kubepods_path(UID, CID))
    write_container(root, kubepods_path(UID, CID2))
    host = ProcessIdentity(pid=1, alive=True, comm="sshd")
    dead = ProcessIdentity(pid=2, alive=False)
    snapshot = CgroupReader(root).read(cycle_with(host, dead, gpu_process(kubepods_path(UID, CID))))
    assert [s.container_id for s in snapshot.containers] == [CID]


def test_a_path_from_another_cgroup_namespace_falls_back_to_the_search(tmp_path: Path) -> None:
    """/proc/<pid>/cgroup read from inside a private cgroup namespace names the path
    relative to the reader's root (``/../..``): not a path under the mount."""
    root = v2_root(tmp_path)
    write_container(root, kubepods_path(UID, CID))
    hint = "/../../kubepods-burstable-pod" + UID.replace("-", "_") + ".slice/x.scope"
    (stats,) = CgroupReader(root).read(cycle_with(gpu_process(hint))).containers
    assert stats.nr_periods == 1200


# -- containers without a GPU process: found by the kubelet's cgroup names ---------------


def meta(*containers: tuple[str, str]) -> PodMetaSnapshot:
    pod = PodMeta(uid=UID, namespace="train", name="p-0", containers=containers)
    return PodMetaSnapshot(ok=True, timestamp=0.0, pods=(pod,))


def listed(*names: str) -> PodResourcesSnapshot:
    rows = tuple(
        ContainerDevices("train", "p-0", name, "nvidia.com/gpu", ("GPU-1",)) for name in names
    )
    return PodResourcesSnapshot(ok=True, timestamp=0.0, containers=rows)


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("qos", QOS_CLASSES)
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_an_allocated_container_without_processes_is_found(
    tmp_path: Path, driver: str, qos: str, runtime: str
) -> None:
    root = v2_root(tmp_path)
    write_container(root, kubepods_path(UID, CID, qos=qos, runtime=runtime, driver=driver))
    cycle = cycle_with(pod_resources=listed("trainer"), pod_meta=meta((CID, "trainer")))
    (stats,) = CgroupReader(root).read(cycle).containers
    assert (stats.pod_uid, stats.container_id, stats.nr_throttled) == (UID, CID, 480)


@pytest.mark.parametrize("driver", DRIVERS)
def test_v1_search_under_cpu_cpuacct(tmp_path: Path, driver: str) -> None:
    root = tmp_path / "cgroup"
    write_container(root / "cpu,cpuacct", kubepods_path(UID, CID, driver=driver), version=1)
    cycle = cycle_with(pod_resources=listed("trainer"), pod_meta=meta((CID, "trainer")))
    (stats,) = CgroupReader(root).read(cycle).containers
    assert stats.cgroup_version == 1 and stats.throttled_usec == 24_000_000


def test_a_container_without_a_gpu_or_a_pod_watch_entry_is_not_searched(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    write_container(root, kubepods_path(UID, CID))
    write_container(root, kubepods_path(UID, CID2))
    # the sidecar holds no GPU; the trainer is unknown to the pod watch: neither is read
    cycle = cycle_with(pod_resources=listed("trainer"), pod_meta=meta((CID2, "sidecar")))
    assert CgroupReader(root).read(cycle).containers == ()
    # without the pod watch there is no UID to look for
    cycle = cycle_with(pod_resources=listed("trainer"))
    assert CgroupReader(root).read(cycle).containers == ()


def test_the_found_path_is_kept_while_it_exists(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    directory = write_container(root, kubepods_path(UID, CID))
    reader = CgroupReader(root)
    cycle = cycle_with(pod_resources=listed("trainer"), pod_meta=meta((CID, "trainer")))
    assert len(reader.read(cycle).containers) == 1
    for name in ("cpu.stat", "cpu.pressure", "io.pressure", "memory.pressure"):
        (directory / name).unlink()
    directory.rmdir()  # the container restarted elsewhere (another QoS class here)
    write_container(root, kubepods_path(UID, CID, qos="guaranteed"))
    assert len(reader.read(cycle).containers) == 1


def test_at_most_max_lookups_a_cycle_and_the_rest_counted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = v2_root(tmp_path)
    processes = [
        gpu_process(None, cid=f"{n:064x}") for n in range(MAX_LOOKUPS + 5)
    ]  # none has a cgroup: each is searched (and not found), bounded all the same
    reader = CgroupReader(root)
    with caplog.at_level(logging.WARNING, logger="exporter.sources.cgroups"):
        reader.read(cycle_with(*processes))
        reader.read(cycle_with(*processes))
    assert reader.errors_total == 10
    caps = [r for r in caplog.records if "over the 1024 found" in r.getMessage()]
    assert len(caps) == 1


# -- hostile trees (adversarial review of why idle) --------------------------------------
# Each fault costs at most its own field or container, never the cycle or a neighbour.


@pytest.mark.parametrize(
    "value",
    [
        "9" * 400,  # parsed by int(), then an OverflowError in float(): every cycle failed
        "9" * 5000,  # past int()'s 4,300-digit limit: ValueError
        str(1 << 64),  # no u64
        "9" * 21,
        "\u00b2",  # SUPERSCRIPT TWO: str.isdigit() is True, int() raises
        "\u0661\u0662",  # ARABIC-INDIC DIGITS ONE TWO: int() accepted them as 12
        "12\u0663",
        "-1",
        "1e3",
    ],
)
def test_a_counter_that_is_no_u64_is_none(value: str) -> None:
    assert parse_cpu_stat(f"nr_periods {value}\nnr_throttled 4\n", 2) == (None, 4, None)
    psi = f"some avg10=0.00 avg60=0.00 avg300=0.00 total={value}\nfull total=7\n"
    assert parse_pressure(psi) == Pressure(None, 7)


def test_the_largest_u64_is_a_counter() -> None:
    largest = (1 << 64) - 1
    assert parse_cpu_stat(f"nr_periods {largest}\n", 2)[0] == largest
    assert parse_pressure(f"some total={largest}\n") == Pressure(largest, None)


def test_a_huge_counter_costs_its_field_only_and_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = v2_root(tmp_path)
    bad, good = kubepods_path(UID, CID), kubepods_path(UID, CID2)
    huge = "9" * 400
    write_container(root, bad, {"cpu.stat": f"nr_periods {huge}\nnr_throttled 1\n"})
    write_container(root, good)
    (root / bad.lstrip("/") / "cpu.pressure").write_text(f"some total={huge}\n")
    reader = CgroupReader(root)
    cycle = cycle_with(gpu_process(bad), gpu_process(good, cid=CID2))
    with caplog.at_level(logging.WARNING, logger="exporter.sources.cgroups"):
        for _ in range(3):
            snapshot = reader.read(cycle)
    rows = {s.container_id: s for s in snapshot.containers}
    assert rows[CID].nr_periods is None and rows[CID].nr_throttled == 1
    assert rows[CID].cpu_pressure == Pressure(None, None)
    assert rows[CID2].nr_periods == 1200 and rows[CID2].cpu_pressure is not None
    counters = [r.getMessage() for r in caplog.records if "ASCII digits" in r.getMessage()]
    assert len(counters) == 2, counters  # cpu.stat once, cpu.pressure once


def _read_in_thread(reader: CgroupReader, cycle: Cycle) -> list[object]:
    """The reader's result within 10 s, else [] (it blocked)."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(reader.read(cycle)), daemon=True)
    thread.start()
    thread.join(10)
    return result


@pytest.mark.parametrize("name", ["cpu.stat", "io.pressure"])
def test_a_fifo_where_a_file_should_be_is_none_and_never_blocks(tmp_path: Path, name: str) -> None:
    root = v2_root(tmp_path)
    path = kubepods_path(UID, CID)
    directory = write_container(root, path)
    (directory / name).unlink()
    os.mkfifo(directory / name)
    reader = CgroupReader(root)
    try:
        result = _read_in_thread(reader, cycle_with(gpu_process(path)))
    finally:  # release a reader blocked in open() (the bug) so the test can end
        with contextlib.suppress(OSError):
            os.close(os.open(directory / name, os.O_WRONLY | os.O_NONBLOCK))
    assert result, "the read blocked on a FIFO"
    (stats,) = result[0].containers  # type: ignore[attr-defined]
    if name == "cpu.stat":
        assert stats.nr_periods is None and stats.cpu_pressure is not None
    else:
        assert stats.io_pressure is None and stats.nr_periods == 1200
    assert reader.errors_total == 1


def test_a_device_where_a_file_should_be_is_none(tmp_path: Path) -> None:
    """A symlink to /dev/zero would read zeros forever (bounded, but no reading)."""
    root = v2_root(tmp_path)
    path = kubepods_path(UID, CID)
    directory = write_container(root, path)
    (directory / "cpu.stat").unlink()
    (directory / "cpu.stat").symlink_to("/dev/zero")
    (stats,) = CgroupReader(root).read(cycle_with(gpu_process(path))).containers
    assert stats.nr_periods is None and stats.cpu_pressure is not None


def test_a_path_over_path_max_is_searched_and_costs_nobody_anything(tmp_path: Path) -> None:
    """A GPU process in a cgroup nested past PATH_MAX (procfs reads 64 KiB): looking
    the path up raised ENAMETOOLONG and every container lost its reading."""
    root = v2_root(tmp_path)
    path, neighbour = kubepods_path(UID, CID), kubepods_path(UID, CID2)
    write_container(root, path)
    write_container(root, neighbour)
    deep = path + "/" + "/".join(["n" * 200] * 25)
    reader = CgroupReader(root)
    snapshot = reader.read(cycle_with(gpu_process(deep), gpu_process(neighbour, cid=CID2)))
    assert [s.nr_periods for s in snapshot.containers] == [1200, 1200]
    # a segment past NAME_MAX, above the container's own: no path the kernel wrote
    long_segment = "/" + "x" * 300 + path
    assert reader.read(cycle_with(gpu_process(long_segment))).containers[0].nr_periods == 1200


def test_a_process_in_a_sub_cgroup_reads_its_containers_cgroup(tmp_path: Path) -> None:
    """The quota, and so the throttling, is the container's: a nested leaf (systemd in
    the container, a delegated cgroup) has none, and may go at any time."""
    root = v2_root(tmp_path)
    path = kubepods_path(UID, CID)
    directory = write_container(root, path)
    write_container(directory, "worker", {"cpu.stat": "nr_periods 0\nnr_throttled 0\n"})
    (stats,) = CgroupReader(root).read(cycle_with(gpu_process(path + "/worker"))).containers
    assert (stats.nr_periods, stats.nr_throttled) == (1200, 480)


def test_a_hint_without_the_containers_segment_is_searched(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    write_container(root, kubepods_path(UID, CID))
    other = write_container(root, "/elsewhere", {"cpu.stat": "nr_periods 1\nnr_throttled 1\n"})
    assert other.is_dir()
    (stats,) = CgroupReader(root).read(cycle_with(gpu_process("/elsewhere"))).containers
    assert stats.nr_periods == 1200


# -- permissions: the chart runs the exporter as a non-root user -------------------------


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A directory another user can reach (pytest's tmp_path is the owner's only)."""
    base = Path(tempfile.mkdtemp(prefix="cgroup-test-"))
    base.chmod(0o755)
    try:
        yield base
    finally:
        for directory, _, _ in os.walk(base):
            os.chmod(directory, 0o755)
        shutil.rmtree(base)


def as_unprivileged(job: Callable[[], object]) -> object:
    """``job()``'s result, run as uid/gid 65534 (in a child process when we are root:
    root searches any directory) and passed back pickled."""
    if os.geteuid() != 0:
        return job()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        code = 0
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                result: object = job()
            except Exception as exc:  # the failure, reported to the parent
                result = f"raised {type(exc).__name__}: {exc}"
            with os.fdopen(write_end, "wb") as out:
                pickle.dump(result, out)
        except BaseException:
            code = 1
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as source:
        data = source.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


def test_a_pod_directory_that_cannot_be_searched_costs_that_container_only(
    shared_dir: Path,
) -> None:
    root = v2_root(shared_dir)
    other_uid = "11111111-2222-3333-4444-555555555555"
    write_container(root, kubepods_path(other_uid, CID2))
    locked = write_container(root, kubepods_path(UID, CID))
    locked.parent.chmod(0o700)  # the pod's directory: its owner only
    pods = (
        PodMeta(uid=other_uid, namespace="ns", name="ok", containers=((CID2, "c"),)),
        PodMeta(uid=UID, namespace="ns", name="locked", containers=((CID, "c"),)),
    )
    rows = tuple(
        ContainerDevices("ns", pod, "c", "nvidia.com/gpu", (f"GPU-{n}",))
        for n, pod in enumerate(("ok", "locked"))
    )
    cycle = cycle_with(
        gpu_process(kubepods_path(UID, CID)),  # with a hint, and searched too
        pod_meta=PodMetaSnapshot(ok=True, timestamp=0.0, pods=pods),
        pod_resources=PodResourcesSnapshot(ok=True, timestamp=0.0, containers=rows),
    )

    def job() -> object:
        reader = CgroupReader(root)
        snapshot = reader.read(cycle)
        return snapshot.ok, [s.container_id for s in snapshot.containers], reader.errors_total

    assert as_unprivileged(job) == (True, [CID2], 1)


def test_a_root_that_cannot_be_searched_puts_the_source_down_with_the_reason(
    shared_dir: Path,
) -> None:
    root = v2_root(shared_dir)
    root.chmod(0o700)

    def job() -> object:
        reader = CgroupReader(root)
        snapshot = reader.read(cycle_with())
        return snapshot.ok, snapshot.error, reader.status().up

    ok, error, up = cast(tuple[bool, str, bool], as_unprivileged(job))
    assert (ok, up) == (False, False)
    assert "cannot be read (Permission denied)" in error and "--cgroup-root off" in error


# -- the cap: a window that turns, slots only for containers found -----------------------


def test_over_the_cap_the_window_turns_so_no_container_is_starved(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    processes = []
    for n in range(MAX_CONTAINERS + 6):
        cid = f"{n:064x}"
        path = kubepods_path(UID, cid)
        write_container(root, path, {"cpu.stat": CPU_STAT_V2})
        processes.append(gpu_process(path, cid=cid))
    reader = CgroupReader(root)
    cycle = cycle_with(*processes)
    unread: list[set[str]] = []
    for _ in range(3):
        read = {s.container_id for s in reader.read(cycle).containers}
        assert len(read) == MAX_CONTAINERS
        unread.append({p.container_id or "" for p in processes} - read)
    assert unread[0] != unread[1] != unread[2] and not unread[0] & unread[1]
    assert reader.errors_total == 3 * 6


def test_containers_whose_cgroups_are_gone_use_no_slots(tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    gone = [gpu_process(None, cid=f"{n:064x}") for n in range(MAX_CONTAINERS)]
    real = "f" * 64  # sorted after every key that uses no slot
    write_container(root, kubepods_path(UID, real))
    processes = [*gone, gpu_process(kubepods_path(UID, real), cid=real)]
    reader = CgroupReader(root)
    assert [s.container_id for s in reader.read(cycle_with(*processes)).containers] == [real]
    assert reader.errors_total == 0
