"""What NVML's answers mean, shared by the two NVML adapters (sampling and the XID
event thread) so they read errors and instance ids the same way."""

from __future__ import annotations

import pynvml

# NVML's "no value" for a GPU/compute instance id (a process or event outside MIG).
NOT_AVAILABLE_ID = 0xFFFFFFFF

# The device or driver cannot answer this: absent, never an error or a zero.
UNSUPPORTED = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound)
# The whole GPU stopped answering: the GPU fails this cycle, the others carry on.
GPU_FAILED = (pynvml.NVMLError_GpuIsLost, pynvml.NVMLError_Unknown)
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
