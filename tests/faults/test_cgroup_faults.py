"""The cgroup rows of the fault matrix: faults in the tree under ``--cgroup-root`` (the
host's /sys/fs/cgroup, read for the CPU throttling and pressure of GPU containers), the
behaviour asserted and a figure measured for docs/reliability.md. The rule for all of
them: a fault costs the field or the container it is in, never the cycle or a
neighbour; a root that cannot be read puts the source down with the reason."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import cast

from exporter.analysis.why_idle import WhyIdlePolicy, readings_by_key, why_idle
from exporter.model import (
    CgroupSnapshot,
    ContainerCgroup,
    ContainerRef,
    ProcessIdentity,
    Readings,
)
from exporter.sim.proctree import kubepods_path
from exporter.sources.base import Cycle
from exporter.sources.cgroups import MAX_CONTAINERS, PATH_MAX, CgroupReader
from tests.faults.conftest import RecordFault
from tests.harness import simulated_exporter
from tests.test_cgroups import (
    CPU_STAT_V2,
    as_unprivileged,
    shared_dir,  # noqa: F401  (a fixture)
    v2_root,
    write_container,
)

UID = "d7577106-ebf4-4c63-b5bb-ad0a3444afed"
CID = "5feceb66ffc86f38d952786c6d696c79c2dbc239dd4e91b46729d73a27fb57e9"
CID2 = "6b86b273ff34fce19d6b804eff5a3f5747ada4eaa22f1d49c01e52ddb7875b4b"
CGROUPS = {"source": "cgroups"}


def gpu_process(path: str | None, cid: str = CID, pid: int = 4242) -> ProcessIdentity:
    return ProcessIdentity(
        pid, True, pod_uid=UID, container_id=cid, comm="python3", state="R",
        cgroup_path=path, cgroup_version=2 if path else None,
    )  # fmt: skip


def cycle_with(*processes: ProcessIdentity) -> Cycle:
    return Cycle(timestamp=0.0, readings=Readings(processes=processes))


def two_containers(tmp_path: Path) -> tuple[Path, Path, str, str]:
    """A v2 root with a faulty-to-be container and its healthy neighbour."""
    root = v2_root(tmp_path)
    bad, good = kubepods_path(UID, CID), kubepods_path(UID, CID2)
    write_container(root, good)
    return root, write_container(root, bad), bad, good


async def test_cgroup_root_missing(record_fault: RecordFault, tmp_path: Path) -> None:
    later = tmp_path / "host-cgroup"  # --cgroup-root before the host's tree is mounted
    async with simulated_exporter("why-idle", argv=["--cgroup-root", str(later)]) as h:
        await h.advance(5)
        down = await h.scrape()
        assert down.get("gpu_exporter_source_up", **CGROUPS) == 0
        assert down.series("gpu_container_cpu_periods_total") == {}  # unknown, not 0
        assert down.get("gpu_up", gpu="0") == 1  # the rest of the node is served
        errors_down = down.get("gpu_exporter_errors_total", **CGROUPS)
        tree = h.env.paths.cgroup_root
        assert tree is not None
        later.symlink_to(tree)  # the mount appears
        started, cycles = time.monotonic(), 0
        while True:
            await h.advance(5)
            cycles += 1
            up = await h.scrape()
            if up.get("gpu_exporter_source_up", **CGROUPS) == 1:
                break
            assert cycles < 5, "the source never came up"
        recovery_s = time.monotonic() - started
        served = len(up.series("gpu_container_cpu_periods_total"))
        assert served == 4
    record_fault(
        "cgroup-root-missing",
        expected="A --cgroup-root that does not exist (or holds no cgroup hierarchy, or "
        "cannot be read) puts the cgroups source down with the reason and serves no "
        "cgroup series (unknown, never zeros); every other series is served; once the "
        "tree is there the next cycle reads it.",
        figure=f"{errors_down:.0f} errors counted over 2 cycles down; up again "
        f"{cycles} cycle after the tree appeared ({recovery_s:.2f} s); 0 -> {served} "
        "containers' series.",
    )


def test_cgroup_huge_number(record_fault: RecordFault, tmp_path: Path) -> None:
    root, directory, bad, good = two_containers(tmp_path)
    (directory / "cpu.stat").write_text(f"nr_periods {'9' * 400}\nnr_throttled \u00b2\n")
    (directory / "cpu.pressure").write_text(f"some total={'9' * 5000}\nfull total=\u0661\n")
    reader = CgroupReader(root)
    snapshot = reader.read(cycle_with(gpu_process(bad), gpu_process(good, CID2, 2)))
    rows = {s.container_id: s for s in snapshot.containers}
    assert (rows[CID].nr_periods, rows[CID].nr_throttled) == (None, None)
    pressure = rows[CID].cpu_pressure
    assert pressure is not None and pressure.some_us is None and pressure.full_us is None
    assert rows[CID].io_pressure is not None  # its sane files are still read
    assert rows[CID2].nr_periods == 1200 and snapshot.ok and reader.status().up
    lost = sum(v is None for v in (rows[CID].nr_periods, rows[CID].nr_throttled))
    record_fault(
        "cgroup-huge-number",
        expected="A counter in cpu.stat or a PSI file that is not 1 to 20 ASCII digits "
        "under 2^64 (hundreds of digits, a Unicode digit) is no reading: that field is "
        "absent, logged once; the container's other fields and its neighbours are read, "
        "and analysis and exposition never see a number a float cannot hold.",
        figure=f"{lost} of 3 cpu.stat fields and 2 of 2 cpu.pressure totals absent for "
        "the faulty container; 2 of 2 containers still read; the source stays up.",
    )


def test_cgroup_fifo(record_fault: RecordFault, tmp_path: Path) -> None:
    root, directory, bad, good = two_containers(tmp_path)
    (directory / "cpu.stat").unlink()
    os.mkfifo(directory / "cpu.stat")  # no writer: a blocking open would wait for ever
    (directory / "io.pressure").unlink()
    (directory / "io.pressure").symlink_to("/dev/zero")
    reader = CgroupReader(root)
    result: list[CgroupSnapshot] = []
    cycle = cycle_with(gpu_process(bad), gpu_process(good, CID2, 2))
    thread = threading.Thread(target=lambda: result.append(reader.read(cycle)), daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(10)
    took_ms = (time.monotonic() - started) * 1000
    with contextlib.suppress(OSError):  # release a reader blocked in open() (a regression)
        os.close(os.open(directory / "cpu.stat", os.O_WRONLY | os.O_NONBLOCK))
    assert result, "the read blocked on a FIFO"
    rows = {s.container_id: s for s in result[0].containers}
    assert rows[CID].nr_periods is None and rows[CID].io_pressure is None
    assert rows[CID].cpu_pressure is not None and rows[CID2].nr_periods == 1200
    assert reader.errors_total == 2
    record_fault(
        "cgroup-fifo",
        expected="A FIFO, a device or a symlink where a cgroup file should be is opened "
        "non-blocking and read only if it is a regular file: that file's series are "
        "absent and counted as errors; the cycle never blocks.",
        figure=f"a read of 2 containers with a FIFO and /dev/zero in place took "
        f"{took_ms:.1f} ms (was: blocked for ever); {reader.errors_total} errors counted.",
    )


def test_cgroup_permission_denied(record_fault: RecordFault, shared_dir: Path) -> None:  # noqa: F811
    root = v2_root(shared_dir)
    bad, good = kubepods_path(UID, CID), kubepods_path(UID, CID2, qos="guaranteed")
    write_container(root, good)
    write_container(root, bad).parent.chmod(0o700)  # the faulty pod's directory

    def job() -> object:
        reader = CgroupReader(root)
        snapshot = reader.read(cycle_with(gpu_process(bad), gpu_process(good, CID2, 2)))
        return [s.container_id for s in snapshot.containers], reader.errors_total

    assert as_unprivileged(job) == ([CID2], 1)
    root.chmod(0o700)

    def whole() -> object:
        reader = CgroupReader(root)
        snapshot = reader.read(cycle_with(gpu_process(good, CID2, 2)))
        return snapshot.ok, reader.status().up, snapshot.error

    ok, up, error = cast(tuple[bool, bool, str], as_unprivileged(whole))
    assert (ok, up) == (False, False) and "Permission denied" in str(error)
    record_fault(
        "cgroup-permission-denied",
        expected="A pod directory the (non-root) exporter may not search costs that "
        "container its series (counted, logged once), not its neighbours; a root it "
        "may not search puts the source down with the reason.",
        figure="as uid 65534: 1 of 2 containers read, 1 error counted; unsearchable root: "
        "source down, reason 'cannot be read (Permission denied)'.",
    )


def test_cgroup_long_path(record_fault: RecordFault, tmp_path: Path) -> None:
    root, _, bad, good = two_containers(tmp_path)
    deep = bad + "/" + "/".join(["n" * 200] * 25)  # nested past PATH_MAX under the container
    assert len(deep) > PATH_MAX
    reader = CgroupReader(root)
    snapshot = reader.read(cycle_with(gpu_process(deep), gpu_process(good, CID2, 2)))
    assert [s.nr_periods for s in snapshot.containers] == [1200, 1200]
    assert snapshot.ok and reader.errors_total == 0
    record_fault(
        "cgroup-long-path",
        expected="A GPU process whose cgroup path is longer than PATH_MAX (a deeply nested "
        "sub-cgroup) is read at its container's own cgroup (the path cut at the "
        "container's segment, else found by the kubelet's names); nothing is looked up "
        "past the kernel's limits.",
        figure=f"a {len(deep):,}-character path: 2 of 2 containers read, 0 errors (was: "
        "ENAMETOOLONG failed every container every cycle).",
    )


def test_cgroup_counter_reset(record_fault: RecordFault, tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    path = kubepods_path(UID, CID)
    directory = write_container(root, path, {"cpu.stat": CPU_STAT_V2})
    main = ContainerRef("ml", "p-0", "main")
    clock = iter([0.0, 5.0, 10.0])
    reader = CgroupReader(root, clock=lambda: next(clock))
    cycle = cycle_with(gpu_process(path))

    def judged(before: CgroupSnapshot, now: CgroupSnapshot) -> tuple[object, ...]:
        signals = [ContainerCgroup(main, s) for s in now.containers]
        (reason,) = why_idle(readings_by_key(before), before.timestamp, now, signals, POLICY)
        return reason.cause, reason.throttled_ratio

    first = reader.read(cycle)
    # the container restarted: a new cgroup, its counters from 0
    (directory / "cpu.stat").write_text("nr_periods 10\nnr_throttled 8\nthrottled_usec 9\n")
    reset = reader.read(cycle)
    assert judged(first, reset) == ("unknown", None)  # no negative or huge share
    (directory / "cpu.stat").write_text("nr_periods 60\nnr_throttled 28\nthrottled_usec 99\n")
    after = reader.read(cycle)
    assert judged(reset, after) == ("cpu_throttled", 0.4)
    record_fault(
        "cgroup-counter-reset",
        expected="A counter that goes back (the container restarted, its cgroup recreated) "
        "makes that window's shares unknown, never negative or huge; the next window "
        "is measured from the new counters. The counters are served as read: rate() "
        "handles a reset itself.",
        figure="window over the reset: cause unknown, throttled share absent; next 5 s "
        "window: 0.4 throttled (cpu_throttled).",
    )


def test_cgroup_over_the_cap(record_fault: RecordFault, tmp_path: Path) -> None:
    root = v2_root(tmp_path)
    extra = 6
    processes = []
    for n in range(MAX_CONTAINERS + extra):
        cid = f"{n:064x}"
        path = kubepods_path(UID, cid)
        write_container(root, path, {"cpu.stat": CPU_STAT_V2})
        processes.append(gpu_process(path, cid, n + 10))
    reader = CgroupReader(root)
    unread: set[str] = set()
    cycles = 0
    started = time.monotonic()
    while cycles == 0 or unread:
        read = {s.container_id for s in reader.read(cycle_with(*processes)).containers}
        unread = (unread or {p.container_id or "" for p in processes}) - read
        cycles += 1
        assert cycles < 10
    per_cycle_ms = (time.monotonic() - started) * 1000 / cycles
    record_fault(
        "cgroup-over-the-cap",
        expected=f"Over {MAX_CONTAINERS:,} GPU containers, each cycle reads {MAX_CONTAINERS:,} "
        "found ones, starting where the last stopped: no container is left unread for "
        "good; the rest are counted as errors and logged once; containers whose "
        "cgroups are gone use no slot.",
        figure=f"{MAX_CONTAINERS + extra:,} containers: every one read within {cycles} "
        f"cycles; {per_cycle_ms:.0f} ms a cycle.",
    )


POLICY = WhyIdlePolicy()
