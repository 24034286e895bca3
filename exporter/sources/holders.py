"""Who has ``/dev/nvidia<minor>`` open: a bounded walk of ``<proc-root>/*/fd``.

NVML lists processes by the CUDA context they created. Memory nobody lists is kept
alive by whoever still holds the device file the context was made on, typically a
child forked after CUDA initialised whose parent then died; ``fuser -v /dev/nvidia*``
finds it, and so does this walk. It reads every fd link of every pid, so the agent
runs it only for GPUs with unattributed memory, seldom, in a worker thread, and it
stops at a time and pid bound (reporting ``truncated``) rather than stall a cycle.

Only ``/dev/nvidia<N>`` counts: ``nvidiactl``, ``nvidia-uvm``, ``nvidia-modeset`` and
``nvidia-caps`` are opened by every NVIDIA client and name no GPU. A link is read as
the holder's mount namespace sees it; the NVIDIA container runtime keeps the host's
device names inside containers, so the minor matches ``nvmlDeviceGetMinorNumber``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Final

from exporter.model import ROLE_HOLDER, ROLE_MANAGEMENT, DeviceHolder, HolderRole, HolderScan
from exporter.sources.procfs import read_file_start, read_process

# Daemons that open every GPU (to keep the driver loaded, to watch health, to hand
# devices out) but allocate nothing: holding a device file is their job, not a leak.
MANAGEMENT_NAMES: Final = frozenset(
    {
        "nvidia-persistenced",
        "nv-hostengine",  # DCGM host engine
        "dcgm-exporter",
        "dcgmi",
        "nvidia-device-plugin",
        "gpu-feature-discovery",
        "nvidia-cuda-mps-control",
        "nvidia-smi",
    }
)
# Names that share a 15-byte comm with a management daemon but do allocate memory.
_ALLOCATING_NAMES: Final = frozenset({"nvidia-cuda-mps-server"})
_COMM_MAX_BYTES: Final = 15  # TASK_COMM_LEN - 1: the kernel truncates comm to this
_GPU_DEVICE: Final = re.compile(r"/dev/nvidia(\d+)")
_GPU_DEVICE_PREFIX: Final = "/dev/nvidia"
_CMDLINE_LIMIT: Final = 4096


def classify(comm: str | None, argv0: str | None = None) -> HolderRole:
    """``management`` for a known GPU daemon, else ``holder``.

    ``comm`` is cut to 15 bytes (``nvidia-persistenced`` reads ``nvidia-persiste``),
    so the full name comes from ``cmdline`` when there is one. A cut comm alone is
    management only when every known name with that prefix is, so the MPS server
    (which allocates) is never mistaken for the MPS control daemon.
    """
    if argv0:
        return ROLE_MANAGEMENT if os.path.basename(argv0) in MANAGEMENT_NAMES else ROLE_HOLDER
    if not comm:
        return ROLE_HOLDER
    if comm in MANAGEMENT_NAMES:
        return ROLE_MANAGEMENT
    if len(comm.encode()) < _COMM_MAX_BYTES:
        return ROLE_HOLDER
    matches = {
        name
        for name in MANAGEMENT_NAMES | _ALLOCATING_NAMES
        if name.encode()[:_COMM_MAX_BYTES].decode(errors="ignore") == comm
    }
    return ROLE_MANAGEMENT if matches and matches <= MANAGEMENT_NAMES else ROLE_HOLDER


def _argv0(proc_root: Path, pid: int) -> str | None:
    try:
        # a string, not a Path: pathlib (3.11) interns each pid's name (procfs._pid_dir);
        # read_file_start: a FIFO planted there must not stall the scan
        data = read_file_start(f"{proc_root}/{pid}/cmdline", _CMDLINE_LIMIT)
    except OSError:
        return None
    first = data.split(b"\0", 1)[0].decode(errors="replace")
    return first or None


def _held_minors(fd_dir: str, wanted: Collection[int]) -> set[int]:
    """Minors of ``wanted`` among the fd links; raises OSError if the dir is unreadable.

    Links are read relative to an open directory fd: a third faster than full paths,
    and this loop is the whole cost of the scan.
    """
    held: set[int] = set()
    dir_fd = os.open(fd_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for name in os.listdir(dir_fd):
            try:
                target = os.readlink(name, dir_fd=dir_fd)
            except OSError:  # closed between listing and reading
                continue
            if not target.startswith(_GPU_DEVICE_PREFIX):
                continue
            match = _GPU_DEVICE.fullmatch(target)
            if match and int(match[1]) in wanted:
                held.add(int(match[1]))
    finally:
        os.close(dir_fd)
    return held


def _pids(proc_root: Path) -> list[int]:
    with os.scandir(proc_root) as entries:
        return sorted(int(e.name) for e in entries if e.name.isdigit())


def scan_device_holders(
    proc_root: Path,
    minors: Collection[int],
    *,
    exclude_pids: Collection[int],
    deadline_s: float = 0.5,
    max_pids: int = 20000,
    start_pid: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> HolderScan:
    """Every pid (but ours and ``exclude_pids``) with one of ``minors`` open.

    Pids from ``start_pid`` up are walked in ascending order; when ``deadline_s``
    passes or ``max_pids`` fd tables were read, the walk stops with ``truncated=True``,
    what it found, and ``resume_pid`` for a later call to go on from, so a node with
    more processes than one walk allows is still covered over a few cycles.
    Blocking: run it in a worker thread.
    """
    started = clock()
    wanted = frozenset(minors)
    if not wanted:
        return HolderScan(minors=())
    skip = {os.getpid(), *exclude_pids}
    try:
        pids = _pids(proc_root)
    except OSError as exc:
        return HolderScan(
            minors=tuple(sorted(wanted)),
            error=f"{type(exc).__name__}: {exc.strerror or exc}",
            duration_s=clock() - started,
        )
    holders: list[DeviceHolder] = []
    scanned = unreadable = 0
    resume: int | None = None
    for pid in pids:
        if pid < start_pid or pid in skip:
            continue
        if scanned >= max_pids or clock() - started > deadline_s:
            resume = pid
            break
        scanned += 1
        try:
            held = _held_minors(f"{proc_root}/{pid}/fd", wanted)
        except (FileNotFoundError, NotADirectoryError, ProcessLookupError):
            continue  # exited meanwhile
        except OSError:
            unreadable += 1  # EACCES without CAP_SYS_PTRACE: we cannot know
            continue
        if not held:
            continue
        identity = read_process(proc_root, pid)
        if not identity.alive:
            continue
        holders.append(
            DeviceHolder(
                pid=pid,
                minors=tuple(sorted(held)),
                comm=identity.comm,
                role=classify(identity.comm, _argv0(proc_root, pid)),
                pod_uid=identity.pod_uid,
                container_id=identity.container_id,
                state=identity.state,
            )
        )
    return HolderScan(
        minors=tuple(sorted(wanted)),
        holders=tuple(holders),
        scanned_pids=scanned,
        unreadable_pids=unreadable,
        truncated=resume is not None,
        resume_pid=resume,
        duration_s=clock() - started,
    )
