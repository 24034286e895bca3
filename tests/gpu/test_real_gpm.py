"""GPM on a real Hopper-or-newer GPU: NVML against ``nvidia-smi dmon --gpm-metrics``, as
root and as an unprivileged user, and what NVML returns for too-short sample spacing.

The simulator integrates GPM percentages over any interval and never refuses a sample
(exporter/sim/nvml_library.py ``nvmlGpmMetricsGet``); NVML's documentation asks for
more than 100 ms between the two samples "due to the internal sample refresh rate"
(docs.nvidia.com/deploy/nvml-api/group__nvmlGpmFunctions.html), and DCGM issue #214
saw ``nvmlGpmSampleGet`` answer NO_PERMISSION (4) after minutes to an hour in an
unprivileged container. These checks show what the driver really does.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from tests.gpu import gpm_reader
from tests.gpu.conftest import (
    NVIDIA_SMI,
    Gpu,
    requires_gpu,
    requires_smi,
    requires_torch,
    return_name,
    smi_table,
)

pytestmark = [requires_gpu, pytest.mark.gpu]

NOBODY = 65534
LONG = os.environ.get("GPU_LONG") == "1"
LONG_S = float(os.environ.get("GPU_LONG_S", "1800"))


@pytest.fixture
def gpm_gpu(whole_gpu: Gpu) -> Gpu:
    try:
        supported = pynvml.nvmlGpmQueryDeviceSupport(whole_gpu.handle).isSupportedDevice
    except pynvml.NVMLError as exc:
        pytest.skip(f"GPU {whole_gpu.index} cannot be asked about GPM: {exc}")
    if not supported:
        pytest.skip(f"GPU {whole_gpu.index} has no GPM (Hopper or newer needed)")
    return whole_gpu


@pytest.fixture
def reader_dir() -> Iterator[Path]:
    """A world-readable copy of gpm_reader.py (pytest's tmp_path is private to its user)."""
    folder = Path(tempfile.mkdtemp(prefix="gpm-reader-"))
    folder.chmod(0o755)
    script = folder / "gpm_reader.py"
    script.write_text(Path(gpm_reader.__file__).read_text())
    script.chmod(0o644)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _user_kwargs(user: str) -> dict[str, Any]:
    """Popen arguments that run a child as ``user``; skips where that cannot be done."""
    root = os.geteuid() == 0
    if user == "privileged":
        if not root:
            pytest.skip("the privileged GPM reading needs root; run pytest as root")
        return {}
    if not root:
        return {}  # already unprivileged
    kwargs: dict[str, Any] = {"user": NOBODY, "group": NOBODY, "extra_groups": []}
    probe = subprocess.run(
        [sys.executable, "-c", "import pynvml"],
        capture_output=True,
        text=True,
        cwd="/",
        check=False,
        **kwargs,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"uid {NOBODY} cannot import pynvml with {sys.executable}: {last}")
    return kwargs


def _reader_records(output: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in output.read_text().splitlines() if line.startswith("{")]


def _dmon_smutil(output: str) -> list[float]:
    rows = smi_table(output)
    assert rows and "smutil" in rows[0], f"no smutil column in dmon output:\n{output[:400]}"
    return [float(r["smutil"]) for r in rows[1:] if r.get("smutil", "-") != "-"]


def _compare(records: list[dict[str, Any]], dmon: list[float], user: str, load: str) -> None:
    errors = sorted({f"{r['stage']}:{r['error']}" for r in records if "error" in r})
    ours = [
        float(r["metrics"]["sm_util"])
        for r in records
        if "metrics" in r and isinstance(r["metrics"]["sm_util"], int | float)
    ]
    first_error = next((r["t"] for r in records if "error" in r), None)
    start = records[0]["t"] if records else None
    after = f"{first_error - start:.0f} s" if first_error and start else "never"
    print(
        f"\nGPM {load}/{user}: {len(ours)} NVML windows, errors {errors or 'none'} "
        f"(first after {after}); NVML SM util mean "
        f"{statistics.fmean(ours) if ours else float('nan'):.1f} %, dmon smutil mean "
        f"{statistics.fmean(dmon) if dmon else float('nan'):.1f} % over {len(dmon)} rows"
    )
    if user == "privileged":
        assert not errors, f"GPM failed as root: {errors}"
    else:
        assert {e.split(":")[1] for e in errors} <= {"NoPermission"}, errors
        if not ours:
            return  # refused from the start: the observable is the refusal itself
    assert all(0.0 <= v <= 100.0 for v in ours), ours
    assert ours and dmon
    assert abs(statistics.fmean(ours) - statistics.fmean(dmon)) <= 10.0
    if load == "heavy":
        assert statistics.fmean(ours) > 50.0
    else:
        assert statistics.fmean(ours) < 10.0


def _measure(
    folder: Path, gpu: Gpu, users: list[str], seconds: float
) -> tuple[dict[str, list[dict[str, Any]]], list[float]]:
    """Readers (one per user) and dmon side by side for ``seconds``, writing to files
    (a pipe nobody reads for 30 minutes would fill and stall them)."""
    assert NVIDIA_SMI is not None
    dmon_args = ["dmon", "-i", str(gpu.index), "-s", "u", "--gpm-metrics", "2", "-d", "1"]
    commands: dict[str, tuple[list[str], dict[str, Any]]] = {
        "dmon": ([NVIDIA_SMI, *dmon_args, "-c", str(int(seconds))], {})
    }
    for user in users:
        script = str(folder / "gpm_reader.py")
        argv = [sys.executable, "-B", script, gpu.uuid, "1.0", str(seconds)]
        commands[user] = (argv, _user_kwargs(user))
    running = {}
    for key, (argv, kwargs) in commands.items():
        with (folder / f"{key}.out").open("w") as out:
            running[key] = subprocess.Popen(argv, stdout=out, cwd=folder, **kwargs)
    for key, process in running.items():
        assert process.wait(timeout=seconds + 60) == 0, f"{key} exited {process.returncode}"
    records = {user: _reader_records(folder / f"{user}.out") for user in users}
    return records, _dmon_smutil((folder / "dmon.out").read_text())


@requires_torch
@requires_smi
@pytest.mark.parametrize("user", ["privileged", "unprivileged"])
@pytest.mark.parametrize("load", ["heavy", "tiny"])
def test_gpm_sm_util_matches_nvidia_smi_dmon(
    gpm_gpu: Gpu, workload: Any, reader_dir: Path, load: str, user: str
) -> None:
    _user_kwargs(user)  # skip before starting the load
    workload(load, "40", uuid=gpm_gpu.uuid)
    time.sleep(2.0)
    records, dmon = _measure(reader_dir, gpm_gpu, [user], 10.0)
    _compare(records[user], dmon, user, load)


@pytest.mark.skipif(not LONG, reason="30-minute run: set GPU_LONG=1 (GPU_LONG_S to change)")
@requires_torch
@requires_smi
@pytest.mark.parametrize("load", ["heavy", "tiny"])
def test_gpm_keeps_answering_for_30_minutes_as_root_and_unprivileged(
    gpm_gpu: Gpu, workload: Any, reader_dir: Path, load: str
) -> None:
    users = ["unprivileged"] + (["privileged"] if os.geteuid() == 0 else [])
    for user in users:
        _user_kwargs(user)
    workload(load, str(LONG_S + 60), uuid=gpm_gpu.uuid)
    time.sleep(2.0)
    records, dmon = _measure(reader_dir, gpm_gpu, users, LONG_S)
    for user in users:
        _compare(records[user], dmon, user, load)


def _gpm_pair(handle: Any, spacing_s: float) -> tuple[float, str, dict[str, Any]]:
    """Two samples ``spacing_s`` apart: (elapsed ms, the call's answer, per-metric answers)."""
    first, second = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
    try:
        pynvml.nvmlGpmSampleGet(handle, first)
        started = time.perf_counter()
        time.sleep(spacing_s)
        pynvml.nvmlGpmSampleGet(handle, second)
        elapsed_ms = (time.perf_counter() - started) * 1000
        request = pynvml.c_nvmlGpmMetricsGet_t()
        request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
        request.sample1, request.sample2 = first, second
        request.numMetrics = len(gpm_reader.METRICS)
        for slot, metric_id in enumerate(gpm_reader.METRICS.values()):
            request.metrics[slot].metricId = metric_id
        try:
            pynvml.nvmlGpmMetricsGet(request)
        except pynvml.NVMLError as exc:
            return elapsed_ms, gpm_reader.name(exc), {}
        answers: dict[str, Any] = {}
        for slot, key in enumerate(gpm_reader.METRICS):
            metric = request.metrics[slot]
            ok = metric.nvmlReturn == pynvml.NVML_SUCCESS
            answers[key] = round(metric.value, 2) if ok else return_name(metric.nvmlReturn)
        return elapsed_ms, "Success", answers
    finally:
        pynvml.nvmlGpmSampleFree(first)
        pynvml.nvmlGpmSampleFree(second)


@requires_torch
def test_gpm_sample_spacing_5ms_vs_200ms(gpm_gpu: Gpu, workload: Any) -> None:
    """At 200 ms every metric is a percentage; below 100 ms NVML may refuse or return
    stale numbers, but never a value the exporter could not export (NaN, out of range)."""
    workload("heavy", "40", uuid=gpm_gpu.uuid)
    time.sleep(2.0)
    results: dict[float, list[tuple[float, str, dict[str, Any]]]] = {}
    for spacing in (0.005, 0.05, 0.1, 0.2):
        results[spacing] = [_gpm_pair(gpm_gpu.handle, spacing) for _ in range(5)]
        for elapsed, call, answers in results[spacing]:
            print(f"spacing {spacing * 1000:.0f} ms (took {elapsed:.1f} ms): {call} {answers}")
    for pairs in results.values():
        for _, _, answers in pairs:
            for value in answers.values():
                if isinstance(value, float):
                    assert math.isfinite(value) and 0.0 <= value <= 100.0, answers
    for _, call, answers in results[0.2]:
        assert call == "Success", call
        assert all(isinstance(v, float) for v in answers.values()), answers
        assert answers["sm_util"] > 50.0, answers
