"""What NVML's answers mean, shared by the two NVML adapters (sampling and the XID
event thread) so they read errors and instance ids the same way."""

from __future__ import annotations

import pynvml

# NVML's "no value" for a GPU/compute instance id (a process or event outside MIG).
NOT_AVAILABLE_ID = 0xFFFFFFFF

# The device or driver cannot answer this: absent, never an error or a zero.
UNSUPPORTED = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
# NVML's own word that the GPU itself failed: hardware evidence, the GPU is lost.
# nvml.h (NVIDIA/go-nvml gen/nvml/nvml.h, nvmlReturn_t): NVML_ERROR_GPU_IS_LOST = 15 "The
# GPU has fallen off the bus or has otherwise become inaccessible", NVML_ERROR_RESET_REQUIRED
# = 16 "The GPU requires a reset before it can be used again" (pynvml: NVMLError_GpuIsLost,
# NVMLError_ResetRequired, made by _extractNVMLErrorsAsClasses). No other code says it of
# one GPU: NVML_ERROR_UNKNOWN is "an internal driver error", returned "on any unexpected
# error"; IRQ_ISSUE and INSUFFICIENT_POWER from nvmlDeviceGetHandleByIndex name "any
# attached devices", not this one.
GPU_LOST = (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_ResetRequired)
# The whole GPU stopped answering: its reading fails this cycle, the others carry on.
# UNKNOWN among them, as a GPU that answers it to one query is not read further; it is no
# verdict on the GPU (health unknown, exporter/analysis/health.py).
GPU_FAILED = (*GPU_LOST, pynvml.NVMLError_Unknown)
# NoPermission is not among them: the driver could answer, only not to this process,
# and that can start mid-run (GPM in an unprivileged container, DCGM issue #214) and
# end again. Sampling counts it as an error and keeps asking; the XID listener skips
# a GPU that will not register events for either reason.
CANNOT_REGISTER_EVENTS = (*UNSUPPORTED, pynvml.NVMLError_NoPermission)


# A numeric field of one of pynvml's structures, read through ctypes' own field descriptor.
# pynvml's ``_PrintableStructure`` reads every attribute through a Python
# ``__getattribute__`` that decodes bytes (pynvml.py, class _PrintableStructure), ~3x the
# time of the plain read for a number; the sample cycle reads ~1,200 such fields on
# node-8gpu (field values, GPM metrics, memory, process samples). Text fields go through
# pynvml as ever.
number_field = object.__getattribute__
# The same for writing a number into a request structure pynvml hands to the driver.
set_number_field = object.__setattr__


def error_name(exc: BaseException) -> str:
    """``NVMLError_GpuIsLost`` -> ``GpuIsLost``: short, stable, fit for a label."""
    return type(exc).__name__.removeprefix("NVMLError_")


def instance_id(value: int) -> int | None:
    """A MIG GPU/compute instance id, None outside MIG."""
    return None if value == NOT_AVAILABLE_ID else int(value)
