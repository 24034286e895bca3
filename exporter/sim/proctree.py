"""A fake ``/proc`` tree for the simulator and tests.

It writes the same files, in the same formats, that the kernel shows for a process
(``cgroup``, ``stat``, ``comm``, and ``fd/<n>`` symlinks where asked), so the real
procfs source and the holder scan read it unchanged. Writes
are atomic for a concurrent reader: a new pid directory appears complete (built
aside, then renamed into place), files of an existing one are swapped with
``os.replace``, and a removed one disappears at once.

Each process has a start time (``stat`` field 22, clock ticks after boot), as on Linux:
an update keeps it, a new process on a pid gets a later one. A reader that knows a pid
by pid and start time thus sees a reused pid as the new process it is.

A host's /proc always shows pid 1 (init) and pid 2 (``kthreadd``, whose kernel threads only
the initial pid namespace sees): :func:`write_host_pids` writes both, so the tree passes
the procfs source's check that it reads the host's live /proc.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

# Kernel task names are TASK_COMM_LEN (16) bytes including the NUL.
_COMM_MAX_BYTES: Final = 15
# Valid ``stat`` state letters (fs/proc/array.c task_state_array, plus tracing stop).
_STATES: Final = frozenset("RSDTtXZPIWKx")
# Start times handed to new processes that name none: later for each, as the kernel's
# are (clock ticks after boot; this one booted ~5 hours before the first).
_next_start_time: Final = itertools.count(1_843_265)
_START_TIME_FIELD: Final = 19  # index of field 22 among the fields after "(comm)"

QOS_CLASSES: Final = ("guaranteed", "burstable", "besteffort")
RUNTIMES: Final = ("containerd", "crio", "docker")
DRIVERS: Final = ("systemd", "cgroupfs")
CGROUP_VERSIONS: Final = (1, 2)

_POD_UID: Final = re.compile(
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}|[0-9a-f]{32}"
)
_CONTAINER_ID: Final = re.compile(r"[0-9a-f]{64}")

# Controller lines of a typical legacy (v1-only) node, highest hierarchy id first as
# the kernel prints them. Every controller holds the process at the same path.
_V1_CONTROLLERS: Final = (
    "hugetlb",
    "memory",
    "devices",
    "pids",
    "perf_event",
    "cpu,cpuacct",
    "net_cls,net_prio",
    "blkio",
    "freezer",
    "cpuset",
    "name=systemd",
)
_SYSTEMD_SCOPE_PREFIX: Final = {"containerd": "cri-containerd", "crio": "crio", "docker": "docker"}


def kubepods_cgroup(
    pod_uid: str,
    container_id: str,
    *,
    qos: str = "burstable",
    runtime: str = "containerd",
    driver: str = "systemd",
    version: int = 2,
) -> str:
    """``/proc/<pid>/cgroup`` contents for a process in a pod's container.

    The paths are what the kubelet (per cgroup driver and QoS class) and the runtime
    (per its naming) really create, so the parser is tested against real shapes.
    ``pod_uid`` is a dashed UUID or a 32-hex static-pod UID, ``container_id`` the
    bare 64-hex id.
    """
    _check(version in CGROUP_VERSIONS, "version", version)
    path = kubepods_path(pod_uid, container_id, qos=qos, runtime=runtime, driver=driver)
    if version == 2:
        return f"0::{path}\n"
    count = len(_V1_CONTROLLERS)
    return "".join(f"{count - i}:{name}:{path}\n" for i, name in enumerate(_V1_CONTROLLERS))


def kubepods_path(
    pod_uid: str,
    container_id: str,
    *,
    qos: str = "burstable",
    runtime: str = "containerd",
    driver: str = "systemd",
) -> str:
    """The container's cgroup path (absolute, from the hierarchy's root) that
    :func:`kubepods_cgroup` names; the simulated cgroup tree (sim/cgroupfs.py) is
    written at the same path."""
    _check(_POD_UID.fullmatch(pod_uid) is not None, "pod_uid", pod_uid)
    _check(_CONTAINER_ID.fullmatch(container_id) is not None, "container_id", container_id)
    _check(qos in QOS_CLASSES, "qos", qos)
    _check(runtime in RUNTIMES, "runtime", runtime)
    _check(driver in DRIVERS, "driver", driver)

    if driver == "systemd":
        # systemd uses "-" for nesting, so the kubelet escapes the UID's dashes.
        uid = pod_uid.replace("-", "_")
        if qos == "guaranteed":
            pod = f"/kubepods.slice/kubepods-pod{uid}.slice"
        else:
            pod = f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{uid}.slice"
        path = f"{pod}/{_SYSTEMD_SCOPE_PREFIX[runtime]}-{container_id}.scope"
    else:
        qos_dir = "" if qos == "guaranteed" else f"/{qos}"
        leaf = f"crio-{container_id}" if runtime == "crio" else container_id
        path = f"/kubepods{qos_dir}/pod{pod_uid}/{leaf}"
    return path


def host_cgroup(unit: str = "sshd.service") -> str:
    """``/proc/<pid>/cgroup`` contents (v2) for a host service outside kubepods."""
    _check(bool(unit) and "/" not in unit and "\n" not in unit, "unit", unit)
    return f"0::/system.slice/{unit}\n"


def _check(ok: bool, name: str, value: object) -> None:
    if not ok:
        raise ValueError(f"invalid {name}: {value!r}")


def _stat_line(pid: int, comm: str, state: str, start_time: int, ppid: int = 1) -> str:
    """A ``/proc/<pid>/stat`` line with all 52 fields, shaped like a real one."""
    fields = [
        f"{pid} ({comm}) {state}",
        str(ppid),  # ppid (4): 0 for init and kthreadd, whose parent is the idle task
        str(pid),  # pgrp
        str(pid),  # session
        "0",  # tty_nr
        "-1",  # tpgid
        "4194560",  # flags (PF_FORKNOEXEC | PF_RANDOMIZE)
        "31402",  # minflt (10)
        "0",  # cminflt
        "12",  # majflt
        "0",  # cmajflt
        "5321",  # utime
        "804",  # stime (15)
        "0",  # cutime
        "0",  # cstime
        "20",  # priority
        "0",  # nice
        "12",  # num_threads (20)
        "0",  # itrealvalue
        str(start_time),  # starttime (clock ticks after boot; one per process)
        "35817193472",  # vsize
        "412031",  # rss (pages)
        "18446744073709551615",  # rsslim (25)
        "94528389586944",  # startcode
        "94528389611493",  # endcode
        "140728423517056",  # startstack
        "0",  # kstkesp
        "0",  # kstkeip (30)
        "0",  # signal
        "0",  # blocked
        "16781312",  # sigignore
        "134234626",  # sigcatch
        "1",  # wchan (35)
        "0",  # nswap
        "0",  # cnswap
        "17",  # exit_signal
        "3",  # processor
        "0",  # rt_priority (40)
        "0",  # policy
        "0",  # delayacct_blkio_ticks
        "0",  # guest_time
        "0",  # cguest_time
        "94528389624816",  # start_data (45)
        "94528389626184",  # end_data
        "94528414502912",  # start_brk
        "140728423523663",  # arg_start
        "140728423523694",  # arg_end
        "140728423523694",  # env_start (50)
        "140728423526382",  # env_end
        "0",  # exit_code (52)
    ]
    return " ".join(fields) + "\n"


def _truncate_comm(comm: str) -> str:
    """Cut to the kernel's 15 bytes, as ``stat`` and ``comm`` would show it."""
    return comm.encode()[:_COMM_MAX_BYTES].decode(errors="ignore")


def start_time_of(proc_root: Path, pid: int) -> int | None:
    """The start time ``<proc_root>/<pid>/stat`` shows; None when there is no process."""
    try:
        stat = (proc_root / str(pid) / "stat").read_text(encoding="utf-8")
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 1 :].split()
    return int(fields[_START_TIME_FIELD]) if len(fields) > _START_TIME_FIELD else None


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so a concurrent reader sees the old file or the new,
    never a part (the simulated /proc and cgroup trees both use it)."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def gpu_fds(minors: Iterable[int]) -> list[str]:
    """fd link targets of a CUDA process with ``/dev/nvidia<minor>`` open per minor.

    Like a real one: stdio, the control and UVM devices every client opens, then
    several descriptors per GPU (the driver hands out one per context and mapping).
    """
    links = ["/dev/null", "pipe:[40961]", "pipe:[40962]", "/dev/nvidiactl", "/dev/nvidia-uvm"]
    links += ["/dev/nvidia-uvm-tools", "anon_inode:[eventfd]", "socket:[51234]"]
    for minor in sorted(set(minors)):
        links += [f"/dev/nvidia{minor}", f"/dev/nvidia{minor}", "anon_inode:[eventfd]"]
    return links


def _write_fds(pid_dir: Path, targets: Sequence[str]) -> None:
    """Make ``pid_dir/fd`` hold exactly ``n -> targets[n]``, each swap atomic."""
    fd_dir = pid_dir / "fd"
    fd_dir.mkdir(exist_ok=True)
    for n, target in enumerate(targets):
        link = fd_dir / str(n)
        try:
            if os.readlink(link) == target:
                continue
        except OSError:
            pass
        tmp = pid_dir / f".fd{n}.tmp"  # outside fd/, so a reader never sees it
        tmp.unlink(missing_ok=True)
        os.symlink(target, tmp)
        os.replace(tmp, link)
    for entry in fd_dir.iterdir():
        if not entry.name.isdigit() or int(entry.name) >= len(targets):
            entry.unlink(missing_ok=True)


def write_process(
    proc_root: Path,
    pid: int,
    *,
    comm: str,
    state: str = "S",
    cgroup: str,
    fds: Sequence[str] | None = None,
    start_time: int | None = None,
    ppid: int = 1,
) -> None:
    """Create or update ``<proc_root>/<pid>`` with ``cgroup``, ``stat`` and ``comm``.

    ``comm`` is truncated to 15 bytes like the kernel's. A new pid directory is built
    aside and renamed into place, so a reader never sees it half-written. ``fds``
    (link targets, e.g. from :func:`gpu_fds`) makes ``fd/0..n`` symlinks; None leaves
    any ``fd`` directory as it is.

    ``start_time`` names the process: None updates the one on ``pid`` (or starts one
    with a start time later than any handed out before); another start time than the
    one there is a new process on a reused pid, so the old directory vanishes first and
    a new one appears, as when the kernel reaps a process and reuses its pid.
    """
    _check(pid > 0, "pid", pid)
    _check(state in _STATES, "state", state)
    _check(start_time is None or start_time >= 0, "start_time", start_time)
    _check(ppid >= 0, "ppid", ppid)
    comm = _truncate_comm(comm)
    proc_root.mkdir(parents=True, exist_ok=True)
    pid_dir = proc_root / str(pid)
    running = start_time_of(proc_root, pid)
    if start_time is not None and running is not None and running != start_time:
        remove_process(proc_root, pid)  # the old process is gone before its pid is reused
        running = None
    if start_time is None:
        start_time = running if running is not None else next(_next_start_time)
    stat = _stat_line(pid, comm, state, start_time, ppid)
    files = {"cgroup": cgroup, "stat": stat, "comm": f"{comm}\n"}
    if not pid_dir.is_dir():
        staging = Path(tempfile.mkdtemp(dir=proc_root, prefix=f".{pid}.", suffix=".tmp"))
        staging.chmod(0o555 | 0o200)  # /proc/<pid> is world-readable; owner may update
        try:
            for name, text in files.items():
                (staging / name).write_text(text, encoding="utf-8")
            if fds is not None:
                _write_fds(staging, fds)
            os.rename(staging, pid_dir)
            return
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)
            if not pid_dir.is_dir():  # not a lost race with another writer
                raise
    for name, text in files.items():
        write_atomic(pid_dir / name, text)
    if fds is not None:
        _write_fds(pid_dir, fds)


def write_host_pids(proc_root: Path) -> None:
    """Pid 1 (systemd, in ``init.scope``) and pid 2 (``kthreadd``, in the root cgroup),
    both children of the idle task (ppid 0) and started at boot, as on a host."""
    write_process(proc_root, 1, comm="systemd", cgroup="0::/init.scope\n", start_time=1, ppid=0)
    write_process(proc_root, 2, comm="kthreadd", cgroup="0::/\n", start_time=1, ppid=0)


def remove_process(proc_root: Path, pid: int) -> None:
    """Make ``<proc_root>/<pid>`` vanish at once, as when a process is reaped.

    Removing a pid that is not there is a no-op.
    """
    pid_dir = proc_root / str(pid)
    if not pid_dir.is_dir():
        return
    graveyard = Path(tempfile.mkdtemp(dir=proc_root, prefix=f".{pid}.", suffix=".removed"))
    try:
        os.rename(pid_dir, graveyard / "gone")
    except FileNotFoundError:
        pass  # removed concurrently
    finally:
        shutil.rmtree(graveyard, ignore_errors=True)
