"""Real-GPU tests: collected everywhere, run only where libnvidia-ml and a GPU exist.

Other tests in the same process may have put the simulated library under pynvml; the
``real_nvml`` fixture loads the real ``libnvidia-ml.so.1`` instead (the same thing
pynvml's own loader does), so these tests never measure the simulator.
"""

from __future__ import annotations

import ctypes
import importlib.util
from collections.abc import Iterator

import pynvml
import pytest


def _real_gpu_count() -> int:
    try:
        library = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0
    if library.nvmlInit_v2() != 0:
        return 0
    count = ctypes.c_uint(0)
    ok = library.nvmlDeviceGetCount_v2(ctypes.byref(count)) == 0
    library.nvmlShutdown()
    return count.value if ok else 0


GPU_COUNT = _real_gpu_count()
HAS_TORCH = importlib.util.find_spec("torch") is not None

requires_gpu = pytest.mark.skipif(GPU_COUNT == 0, reason="needs an NVIDIA GPU and driver")
requires_torch = pytest.mark.skipif(not HAS_TORCH, reason="needs torch to make GPU load")


@pytest.fixture
def real_nvml() -> Iterator[None]:
    with pynvml.libLoadLock:
        pynvml.nvmlLib = ctypes.CDLL("libnvidia-ml.so.1")
        pynvml._nvmlGetFunctionPointer_cache.clear()
    yield
    with pynvml.libLoadLock:
        pynvml.nvmlLib = None
        pynvml._nvmlGetFunctionPointer_cache.clear()
