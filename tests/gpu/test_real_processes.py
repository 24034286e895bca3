"""GPU processes on a real driver: the process listing and per-process utilization,
each against nvidia-smi and against what the exporter's NvmlSource reads.

The simulator lists each process with its exact memory, samples per-process SM use
every 100 ms with epoch-microsecond timestamps, returns only samples newer than
``lastSeenTimeStamp``, and answers NVML_ERROR_NOT_FOUND when there is none
(exporter/sim/nvml_library.py ``nvmlDeviceGetProcessUtilization``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import pynvml
import pytest

from exporter.sources.nvml import NvmlSource
from exporter.sources.nvml_codes import error_name
from tests.gpu.conftest import Gpu, requires_gpu, requires_smi, requires_torch, smi, smi_table

pytestmark = [requires_gpu, pytest.mark.gpu]

MIB = 2**20


def _smi_compute_apps(gpu: Gpu) -> dict[int, int | None]:
    """pid -> MiB from ``nvidia-smi --query-compute-apps`` ("[N/A]" -> None)."""
    out = smi(
        "-i",
        str(gpu.index),
        "--query-compute-apps=pid,used_memory",
        "--format=csv,noheader,nounits",
    )
    apps: dict[int, int | None] = {}
    for line in out.splitlines():
        if line.strip():
            pid, memory = (field.strip() for field in line.split(","))
            apps[int(pid)] = int(memory) if memory.isdigit() else None
    return apps


@requires_torch
@requires_smi
def test_process_listing_matches_nvidia_smi_compute_apps(whole_gpu: Gpu, workload: Any) -> None:
    pid = workload("hold", "60", "1024", uuid=whole_gpu.uuid).pid
    time.sleep(1.0)
    running = pynvml.nvmlDeviceGetComputeRunningProcesses(whole_gpu.handle)
    listed = {p.pid: p.usedGpuMemory for p in running}
    apps = _smi_compute_apps(whole_gpu)
    source = NvmlSource()
    try:
        snapshot = source.sample()
    finally:
        source.close()
    gpu = next(g for g in snapshot.gpus if g.uuid == whole_gpu.uuid)
    exported = {p.pid: p.memory_used_bytes for p in gpu.processes if p.kind == "compute"}
    print(f"\nNVML _v3 listing (bytes): {listed}\nnvidia-smi compute apps (MiB): {apps}")
    print(f"exporter (bytes): {exported}")
    assert pid in listed and pid in apps
    assert (listed[pid] or 0) >= 1024 * MIB
    assert set(listed) == set(apps)
    for each, memory in listed.items():
        in_mib = None if memory is None else memory / MIB
        assert (in_mib is None) == (apps[each] is None), each
        if in_mib is not None and apps[each] is not None:
            assert abs(in_mib - apps[each]) <= 1.0, (each, in_mib, apps[each])
    assert exported[pid] == listed[pid]
    assert set(exported) == set(listed)


@requires_torch
@requires_smi
def test_process_utilization_matches_nvidia_smi_pmon(whole_gpu: Gpu, workload: Any) -> None:
    pid = workload("heavy", "60", uuid=whole_gpu.uuid).pid
    time.sleep(3.0)
    since_us = int((time.time() - 3.0) * 1e6)
    samples = pynvml.nvmlDeviceGetProcessUtilization(whole_gpu.handle, since_us)
    now_us = time.time() * 1e6
    pmon = smi_table(smi("pmon", "-i", str(whole_gpu.index), "-s", "u", "-c", "1"))
    source = NvmlSource()
    try:
        exported = next(g for g in source.sample().gpus if g.uuid == whole_gpu.uuid)
    finally:
        source.close()
    print("\nNVML samples since 3 s ago (pid, timeStamp us, smUtil, memUtil):")
    for s in samples:
        print(f"  {s.pid} {s.timeStamp} {s.smUtil} {s.memUtil}")
    print(f"nvidia-smi pmon: {pmon}\nexporter: {exported.process_utilization}")
    mine = [s.smUtil for s in samples if s.pid == pid]
    assert mine, "NVML has no utilization sample for the busy process"
    stamps = [s.timeStamp for s in samples]
    assert all(since_us < t <= now_us + 1e6 for t in stamps), "not epoch us after lastSeen"
    rows = [r for r in pmon if r.get("pid") == str(pid)]
    assert rows and rows[0]["sm"] != "-", f"no pmon SM value for pid {pid}: {pmon}"
    row = rows[0]
    assert statistics.fmean(mine) > 50.0
    assert abs(statistics.fmean(mine) - int(row["sm"])) <= 25.0
    ours = [u.sm_percent for u in exported.process_utilization if u.pid == pid]
    assert ours and ours[0] > 50, exported.process_utilization


def test_process_utilization_on_an_idle_gpu_is_not_found(whole_gpu: Gpu) -> None:
    """The exporter reads NOT_FOUND as "no new samples" (not an error); pynvml raises a
    bare NVMLError(0) if the driver instead answers SUCCESS with no samples. Whether
    lastSeen=0 still returns samples of exited processes is printed: the exporter's
    first read uses 0 and would show them."""
    deadline = time.monotonic() + 10.0  # contexts of earlier checks' loads may linger
    while (running := pynvml.nvmlDeviceGetComputeRunningProcesses(whole_gpu.handle)) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    if running:
        pytest.skip(f"GPU {whole_gpu.index} has {len(running)} running process(es); needs idle")
    answers: dict[str, Any] = {}
    for label, since_us in (("lastSeen=now", int(time.time() * 1e6)), ("lastSeen=0", 0)):
        try:
            samples = pynvml.nvmlDeviceGetProcessUtilization(whole_gpu.handle, since_us)
            answers[label] = [(s.pid, s.timeStamp, s.smUtil) for s in samples]
        except pynvml.NVMLError as exc:
            answers[label] = error_name(exc)
    source = NvmlSource()
    try:
        snapshots = [source.sample(), source.sample()]
    finally:
        source.close()
    gpus = [next(g for g in s.gpus if g.uuid == whole_gpu.uuid) for s in snapshots]
    print(f"\nidle GPU {whole_gpu.index}: {answers}")
    print(f"exporter: {[g.process_utilization for g in gpus]}, errors {snapshots[1].errors}")
    assert answers["lastSeen=now"] == "NotFound"
    if isinstance(answers["lastSeen=0"], list):  # old samples of exited processes
        assert all(1e15 < stamp <= time.time() * 1e6 + 1e6 for _, stamp, _ in answers["lastSeen=0"])
    for snapshot in snapshots:
        assert "process_utilization" not in {name for name, _ in snapshot.errors}
    if answers["lastSeen=0"] == "NotFound":
        assert gpus[1].process_utilization == ()
