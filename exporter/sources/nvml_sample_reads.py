"""NVML's sample-buffer reads in one call each, with room to spare, where pynvml's
wrappers (pynvml.py 13.615.71) first call without a buffer for the count, then again
with one of that size: ``nvmlDeviceGetSamples`` and ``nvmlDeviceGetProcessUtilization``
(``ProcessUtilizationReader``; on an H200 a call cost 2.1-2.4 ms, the count query as
much as the read). A count past ``MAX_SAMPLES`` is refused
as garbage, never allocated: a driver (or a broken one) answering 2**32 would otherwise
have the exporter allocate 64 GiB.

The driver keeps a short history (seconds of 1/6 s samples per GPU, one entry per
process: docs/simulator.md, "Sample buffers"), far below the bound.
"""

from __future__ import annotations

import ctypes
from typing import Any

import pynvml

# GPU-Util samples: 1/6 s apart at the fastest (nvml.h: "between 1 second and 1/6 second,
# depending on the product"), so an hour's history; processes: far past what a GPU holds
MAX_SAMPLES = 21_600
MIN_ROOM = 32  # per-process entries asked for at first
SAMPLES_ROOM = 256  # GPU-Util samples asked for in one call


def get_samples(handle: Any, sampling_type: int, last_seen_us: int) -> tuple[int, list[Any]]:
    """(value type, samples newer than ``last_seen_us``), in one call with room for
    ``SAMPLES_ROOM`` samples (more than a driver's history holds: ~20 s of 1/6 s samples),
    where pynvml asks the count first; a driver that wants more room gets a second call
    of the size it names. Raises pynvml's NVMLError for a failed call (NotFound: none
    newer) and INSUFFICIENT_SIZE for a count past ``MAX_SAMPLES``."""
    fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetSamples")
    kind = ctypes.c_uint(0)
    seen = ctypes.c_ulonglong(last_seen_us)
    sampling = ctypes.c_uint(sampling_type)
    room = SAMPLES_ROOM
    for _ in range(2):
        count = ctypes.c_uint(room)
        samples = (pynvml.c_nvmlSample_t * room)()
        ret = fn(handle, sampling, seen, ctypes.byref(kind), ctypes.byref(count), samples)
        if ret == pynvml.NVML_SUCCESS:
            return kind.value, list(samples[: min(count.value, room)])
        if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE or count.value <= room:
            raise pynvml.NVMLError(ret)
        room = _bounded(count.value)
    raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)


class ProcessUtilizationReader:
    """``nvmlDeviceGetProcessUtilization`` in one call where pynvml makes two: on an H200
    each call cost 2.1-2.4 ms, the size query as much as the read (docs/validation.md).
    The buffer has room for twice the most entries any read returned so far (at least
    ``MIN_ROOM``), so the first call answers; only a GPU that outgrew it costs a second
    call, sized by the count NVML gives back (as pynvml sizes it), never past
    ``MAX_SAMPLES``. One reader per GPU."""

    def __init__(self) -> None:
        self._room = MIN_ROOM

    def read(self, handle: Any, last_seen_us: int) -> list[Any]:
        """Per-process samples newer than ``last_seen_us``; raises pynvml's NVMLError for
        a failed call (NotFound: none newer) and INSUFFICIENT_SIZE for a count past
        ``MAX_SAMPLES``."""
        fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetProcessUtilization")
        seen = ctypes.c_ulonglong(last_seen_us)
        room = self._room
        for _ in range(2):
            count = ctypes.c_uint(room)
            samples = (pynvml.c_nvmlProcessUtilizationSample_t * room)()
            ret = fn(handle, samples, ctypes.byref(count), seen)
            if ret == pynvml.NVML_SUCCESS:
                got = min(count.value, room)
                self._room = max(self._room, min(2 * got, MAX_SAMPLES))
                return list(samples[:got])
            if ret != pynvml.NVML_ERROR_INSUFFICIENT_SIZE or count.value <= room:
                raise pynvml.NVMLError(ret)
            room = _bounded(count.value)
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)


def _bounded(count: int) -> int:
    if count > MAX_SAMPLES:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    return count
