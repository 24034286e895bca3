"""What NVML's answers mean, shared by the two NVML adapters (sampling and the XID
event thread) so they read errors and instance ids the same way."""

from __future__ import annotations

import pynvml

# NVML's "no value" for a GPU/compute instance id (a process or event outside MIG).
NOT_AVAILABLE_ID = 0xFFFFFFFF

# The device or driver cannot answer this: absent, never an error or a zero.
UNSUPPORTED = (
    pynvml.NVMLError_NotSupported,
    pynvml.NVMLError_FunctionNotFound,
    pynvml.NVMLError_NoPermission,
)


def error_name(exc: BaseException) -> str:
    """``NVMLError_GpuIsLost`` -> ``GpuIsLost``: short, stable, fit for a label."""
    return type(exc).__name__.removeprefix("NVMLError_")


def instance_id(value: int) -> int | None:
    """A MIG GPU/compute instance id, None outside MIG."""
    return None if value == NOT_AVAILABLE_ID else int(value)
