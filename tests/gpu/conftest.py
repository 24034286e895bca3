"""Real-GPU tests: collected everywhere, run only where libnvidia-ml and a GPU exist.

Other tests in the same process may have put the simulated library under pynvml; the
``real_nvml`` fixture loads the real ``libnvidia-ml.so.1`` instead (the same thing
pynvml's own loader does), so these tests never measure the simulator.

Each test prints what it observed (``pytest -s``) for docs/validation.md and asserts
what must hold, so a run on hardware can fail where the simulator's model is wrong.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest

from exporter.sources.nvml_codes import error_name
from tests.gpu.host import real_gpu_count
from tests.gpu.workloads import WORKLOAD

GPU_COUNT = real_gpu_count()
HAS_TORCH = importlib.util.find_spec("torch") is not None
NVIDIA_SMI = shutil.which("nvidia-smi")

requires_gpu = pytest.mark.skipif(GPU_COUNT == 0, reason="needs an NVIDIA GPU and driver")
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch to make GPU load")
requires_smi = pytest.mark.skipif(NVIDIA_SMI is None, reason="needs nvidia-smi on PATH")


@pytest.fixture
def real_nvml() -> Iterator[None]:
    with pynvml.libLoadLock:
        pynvml.nvmlLib = ctypes.CDLL("libnvidia-ml.so.1")
        pynvml._nvmlGetFunctionPointer_cache.clear()
    yield
    with pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()


@pytest.fixture
def nvml(real_nvml: None) -> Iterator[None]:
    """Real NVML, initialised for direct pynvml calls (init is reference-counted)."""
    pynvml.nvmlInit()
    yield
    pynvml.nvmlShutdown()


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    handle: Any


@pytest.fixture
def whole_gpu(nvml: None) -> Gpu:
    """The first GPU not in MIG mode: whole-GPU GPM, process and memory checks need one."""
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            mig_on = pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE
        except pynvml.NVMLError_NotSupported:
            mig_on = False
        if not mig_on:
            return Gpu(index, pynvml.nvmlDeviceGetUUID(handle), handle)
    pytest.skip("every GPU is in MIG mode; this check needs a whole GPU")


@pytest.fixture
def workload(tmp_path: Path) -> Iterator[Any]:
    """``start(mode, seconds, *args, uuid=None)``: a workload from workloads.py, once ready.

    ``uuid`` pins it to that GPU (CUDA_VISIBLE_DEVICES accepts GPU UUIDs), so the GPU a
    check measures is the one under load on a multi-GPU machine.
    """
    script = tmp_path / "work.py"
    script.write_text(WORKLOAD)
    started: list[subprocess.Popen[str]] = []

    def start(*args: str, uuid: str | None = None) -> subprocess.Popen[str]:
        env = dict(os.environ)
        if uuid is not None:
            env["CUDA_VISIBLE_DEVICES"] = uuid
        process = subprocess.Popen(
            [sys.executable, str(script), *args], stdout=subprocess.PIPE, text=True, env=env
        )
        started.append(process)
        assert process.stdout is not None
        while process.stdout.readline().strip() != "ready":
            assert process.poll() is None, "workload died before it was ready"
        return process

    yield start
    for process in started:
        process.kill()
        process.wait()


def return_name(code: int) -> str:
    """An nvmlReturn_t by its short name: 0 -> "Success", 4 -> "NoPermission"."""
    return "Success" if code == pynvml.NVML_SUCCESS else error_name(pynvml.NVMLError(code))


def smi(*args: str, timeout_s: float = 60.0) -> str:
    """nvidia-smi's stdout; a failing nvidia-smi fails the test with its stderr."""
    assert NVIDIA_SMI is not None
    done = subprocess.run(
        [NVIDIA_SMI, *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert done.returncode == 0, f"nvidia-smi {' '.join(args)}: {done.stderr.strip()}"
    return done.stdout


def smi_table(text: str) -> list[dict[str, str]]:
    """Rows of ``nvidia-smi dmon``/``pmon`` output, keyed by the first '#' header line.

    Later '#' lines (units, repeated headers) are skipped; "-" stays "-" (no value).
    """
    names: list[str] | None = None
    rows = []
    for line in text.splitlines():
        if line.startswith("#"):
            names = names or line.lstrip("#").split()
            continue
        if names and line.strip():
            rows.append(dict(zip(names, line.split(), strict=False)))
    return rows
