"""The holder scan over a real temporary proc tree with real fd symlinks."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from exporter.model import ROLE_HOLDER, ROLE_MANAGEMENT, HolderScan
from exporter.sim.proctree import gpu_fds, host_cgroup, kubepods_cgroup, write_process
from exporter.sources.holders import (
    classify,
    scan_device_holders,
)

UID = "3f2a8c1e-5b7d-4e09-9a61-0c2d4b6e8f10"
CID = "c" * 64
NO_GPU = ["/dev/null", "pipe:[1]", "pipe:[2]", "socket:[3]"]
CONTROL_ONLY = [*NO_GPU, "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-modeset"]


def add(
    root: Path,
    pid: int,
    fds: Sequence[str],
    *,
    comm: str = "python3",
    cgroup: str | None = None,
    cmdline: str | None = None,
) -> None:
    write_process(root, pid, comm=comm, cgroup=cgroup or host_cgroup("x.service"), fds=fds)
    if cmdline is not None:
        (root / str(pid) / "cmdline").write_bytes(cmdline.replace(" ", "\0").encode() + b"\0")


def scan(
    root: Path,
    minors: Sequence[int],
    *,
    exclude_pids: Sequence[int] = (),
    deadline_s: float = 5.0,
    max_pids: int = 20000,
    start_pid: int = 0,
    clock: Callable[[], float] = time.monotonic,
) -> HolderScan:
    return scan_device_holders(
        root,
        minors,
        exclude_pids=exclude_pids,
        deadline_s=deadline_s,
        max_pids=max_pids,
        start_pid=start_pid,
        clock=clock,
    )


def test_a_forked_child_holding_the_device_is_found_by_minor_with_its_pod(tmp_path: Path) -> None:
    add(tmp_path, 5302, gpu_fds([3]), comm="pt_data_worker", cgroup=kubepods_cgroup(UID, CID))
    add(tmp_path, 6000, gpu_fds([1]))
    result = scan(tmp_path, [3])
    assert [(h.pid, h.minors, h.comm, h.role) for h in result.holders] == [
        (5302, (3,), "pt_data_worker", ROLE_HOLDER)
    ]
    holder = result.holders[0]
    assert (holder.pod_uid, holder.container_id, holder.state) == (UID, CID, "S")
    assert result.complete and result.scanned_pids == 2 and result.minors == (3,)


def test_only_wanted_minors_are_reported_for_a_process_holding_several(tmp_path: Path) -> None:
    add(tmp_path, 10, gpu_fds([0, 2, 5]))
    assert scan(tmp_path, [2, 5, 7]).holders[0].minors == (2, 5)


def test_control_and_uvm_device_files_alone_do_not_make_a_holder(tmp_path: Path) -> None:
    add(tmp_path, 10, CONTROL_ONLY)
    add(tmp_path, 11, [*NO_GPU, "/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia0 (deleted)"])
    add(tmp_path, 12, NO_GPU)
    result = scan(tmp_path, [0])
    assert result.holders == ()
    assert result.scanned_pids == 3


def test_pids_nvml_lists_and_the_exporter_itself_are_skipped(tmp_path: Path) -> None:
    add(tmp_path, os.getpid(), gpu_fds([0]), comm="gpu-occupancy-e")
    add(tmp_path, 4242, gpu_fds([0]))
    add(tmp_path, 4243, gpu_fds([0]))
    result = scan(tmp_path, [0], exclude_pids=[4242])
    assert [h.pid for h in result.holders] == [4243]
    assert result.scanned_pids == 1


def test_gpu_daemons_are_management_even_with_a_truncated_comm(tmp_path: Path) -> None:
    add(tmp_path, 812, gpu_fds([0, 1]), comm="nvidia-persistenced")
    add(tmp_path, 900, gpu_fds([0, 1]), comm="nv-hostengine")
    add(tmp_path, 901, gpu_fds([0]), comm="nvidia-device-plugin")
    add(tmp_path, 950, gpu_fds([1]), comm="python3")
    result = scan(tmp_path, [0, 1])
    roles = {h.pid: (h.comm, h.role) for h in result.holders}
    assert roles == {
        812: ("nvidia-persiste", ROLE_MANAGEMENT),  # the kernel keeps 15 bytes
        900: ("nv-hostengine", ROLE_MANAGEMENT),
        901: ("nvidia-device-p", ROLE_MANAGEMENT),
        950: ("python3", ROLE_HOLDER),
    }


def test_the_mps_server_is_a_holder_though_its_comm_matches_the_control_daemon(
    tmp_path: Path,
) -> None:
    add(tmp_path, 70, gpu_fds([0]), comm="nvidia-cuda-mps-server")
    add(tmp_path, 71, gpu_fds([0]), comm="nvidia-cuda-mps-control")
    add(
        tmp_path,
        72,
        gpu_fds([0]),
        comm="nvidia-cuda-mps-control",
        cmdline="/usr/bin/nvidia-cuda-mps-control -d",
    )
    roles = {h.pid: h.role for h in scan(tmp_path, [0]).holders}
    assert roles == {70: ROLE_HOLDER, 71: ROLE_HOLDER, 72: ROLE_MANAGEMENT}


def test_classify_prefers_the_full_name_from_cmdline() -> None:
    assert classify("nvidia-persiste") == ROLE_MANAGEMENT
    assert classify("python3", "/usr/bin/nvidia-persistenced") == ROLE_MANAGEMENT
    assert classify("nvidia-persiste", "/opt/venv/bin/python3") == ROLE_HOLDER
    assert classify(None) == ROLE_HOLDER
    assert classify("nvidia-smi") == ROLE_MANAGEMENT


def test_a_fifo_for_cmdline_does_not_stall_the_scan(tmp_path: Path) -> None:
    # Opening a FIFO with no writer for reading would wait for one, for good: the scan
    # goes on, and the holder is classified by its comm alone.
    add(tmp_path, 70, gpu_fds([0]), comm="nvidia-smi")
    (tmp_path / "70" / "cmdline").unlink(missing_ok=True)
    os.mkfifo(tmp_path / "70" / "cmdline")
    result = scan(tmp_path, [0])
    assert [(h.pid, h.role) for h in result.holders] == [(70, ROLE_MANAGEMENT)]


def test_the_walk_stops_at_the_deadline_and_says_it_was_truncated(tmp_path: Path) -> None:
    for pid in range(100, 110):
        add(tmp_path, pid, gpu_fds([0]))
    ticks = iter(range(1000))
    result = scan(tmp_path, [0], deadline_s=3.5, clock=lambda: float(next(ticks)))
    assert result.truncated and not result.complete and result.resume_pid == 103
    assert [h.pid for h in result.holders] == [100, 101, 102]


def test_the_walk_stops_after_max_pids_and_says_it_was_truncated(tmp_path: Path) -> None:
    for pid in range(100, 105):
        add(tmp_path, pid, gpu_fds([0]))
    result = scan(tmp_path, [0], max_pids=3)
    assert result.truncated and result.scanned_pids == 3 and result.resume_pid == 103
    assert [h.pid for h in result.holders] == [100, 101, 102]
    whole = scan(tmp_path, [0], max_pids=5)
    assert not whole.truncated and len(whole.holders) == 5 and whole.resume_pid is None


def test_a_truncated_walk_goes_on_from_where_it_stopped(tmp_path: Path) -> None:
    for pid in range(100, 105):
        add(tmp_path, pid, gpu_fds([0]))
    first = scan(tmp_path, [0], max_pids=3)
    rest = scan(tmp_path, [0], max_pids=3, start_pid=first.resume_pid or 0)
    assert [h.pid for h in rest.holders] == [103, 104]
    assert rest.scanned_pids == 2 and not rest.truncated


def test_an_unreadable_fd_table_makes_the_scan_incomplete(tmp_path: Path) -> None:
    add(tmp_path, 10, gpu_fds([0]))
    write_process(tmp_path, 11, comm="secret", cgroup=host_cgroup("x.service"))
    (tmp_path / "11" / "fd").symlink_to("fd")  # ELOOP: an OSError that is not "gone"
    result = scan(tmp_path, [0])
    assert [h.pid for h in result.holders] == [10]
    assert result.unreadable_pids == 1 and not result.complete


def test_a_pid_without_an_fd_directory_is_treated_as_exited(tmp_path: Path) -> None:
    write_process(tmp_path, 10, comm="gone", cgroup=host_cgroup("x.service"))
    (tmp_path / "20").mkdir()  # a directory whose files vanished
    result = scan(tmp_path, [0])
    assert result.holders == () and result.complete


def test_non_pid_entries_of_the_proc_root_are_ignored(tmp_path: Path) -> None:
    add(tmp_path, 10, gpu_fds([0]))
    (tmp_path / "self").symlink_to("10")
    (tmp_path / "sys").mkdir()
    result = scan(tmp_path, [0])
    assert [h.pid for h in result.holders] == [10] and result.scanned_pids == 1


def test_a_missing_proc_root_is_an_error_not_an_empty_result(tmp_path: Path) -> None:
    result = scan(tmp_path / "nope", [0])
    assert result.error is not None and not result.complete and result.holders == ()


def test_no_minors_means_no_walk(tmp_path: Path) -> None:
    add(tmp_path, 10, gpu_fds([0]))
    result = scan(tmp_path, [])
    assert result.scanned_pids == 0 and result.holders == ()


@pytest.mark.parametrize("fds", [gpu_fds([2]), [*NO_GPU, "/dev/nvidia2"]])
def test_one_descriptor_on_the_device_is_enough(tmp_path: Path, fds: list[str]) -> None:
    add(tmp_path, 10, fds)
    assert [h.minors for h in scan(tmp_path, [2]).holders] == [(2,)]
