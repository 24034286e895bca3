"""What the GPU host has, asked of the real driver library (never of the simulator)."""

from __future__ import annotations

import ctypes


def real_gpu_count() -> int:
    """GPUs the real ``libnvidia-ml.so.1`` counts; 0 without the library, a driver or a GPU."""
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
