"""GPU process listings in one NVML call each, where pynvml's wrappers make two.

pynvml's ``nvmlDeviceGet{Compute,Graphics,MPSCompute}RunningProcesses_v3`` (and ``_v2``)
first call with a count of 0 to learn how many processes there are, then again with an
array of twice that plus 5, and turn every entry into a Python object attribute by
attribute (pynvml.py 13.615.71, ``nvmlDeviceGetComputeRunningProcesses_v3``). NVML takes
the array's size in ``infoCount`` and answers NVML_SUCCESS with the number it wrote, or
NVML_ERROR_INSUFFICIENT_SIZE with the number it needs; "the number of elements might
change in time. Allocate more space for infos table in case new compute processes are
spawned" (nvml.h, as the NVML API reference gives it:
https://docs.nvidia.com/deploy/nvml-api/group__nvmlDeviceQueries.html,
nvmlDeviceGetComputeRunningProcesses_v3). So one call with room to spare answers, and
only a GPU that has outgrown the room costs a second call, sized as pynvml sizes it. On
node-8gpu that is 24 of a cycle's 172 calls, each an ioctl on a real driver.

The array always has twice the entries the call is told of: drivers 535.43.02 to
535.86.05 wrote 32-byte entries through ``_v3`` where pynvml's struct has 24 (the source
then reads ``_v2``; exporter/sources/nvml.py says how it knows), and a driver writing
wider entries than the caller's must still stay inside the array.
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import pynvml

from exporter.sources.nvml_codes import number_field

# NVML_VALUE_NOT_AVAILABLE in an unsigned long long: the memory is not known (WDDM)
NOT_AVAILABLE_ULL = 0xFFFF_FFFF_FFFF_FFFF
MIN_ROOM = 32  # entries asked for at first
# Far past what a GPU holds (each process has a CUDA context of its own in GPU memory): a
# count that needs more room is refused as garbage, never allocated.
MAX_ROOM = 4096


class ListedProcess(NamedTuple):
    pid: int
    used_memory: int | None  # None: NVML_VALUE_NOT_AVAILABLE
    gpu_instance_id: int
    compute_instance_id: int


class ProcessLister:
    """Lists processes through an NVML entry point, with room for the most processes
    any listing needed so far (twice that plus 5, as pynvml sizes its second call)."""

    def __init__(self) -> None:
        self._room = MIN_ROOM

    def list(self, entry_point: str, handle: Any) -> list[ListedProcess]:
        """The processes the entry point lists; raises pynvml's NVMLError for a failed
        call, and INSUFFICIENT_SIZE for a count past ``MAX_ROOM`` or one that outgrew the
        room twice (never a listing cut short)."""
        call = pynvml._nvmlGetFunctionPointer(entry_point)
        room = self._room
        for _ in range(2):
            count = ctypes.c_uint(room)
            infos = (pynvml.c_nvmlProcessInfo_v3_t * (2 * room))()
            returned = call(handle, ctypes.byref(count), infos)
            if returned == pynvml.NVML_SUCCESS and count.value <= room:
                return [_listed(infos[i]) for i in range(count.value)]
            if returned not in (pynvml.NVML_SUCCESS, pynvml.NVML_ERROR_INSUFFICIENT_SIZE):
                raise pynvml.NVMLError(returned)
            # too small, or a success that claims more entries than the room held: the
            # listing is not served cut short, it is asked again with room for them
            room = count.value * 2 + 5
            if room > MAX_ROOM:
                break
            self._room = max(self._room, room)
        # still too small (processes started between the calls), or a count past belief
        raise pynvml.NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)


def _listed(info: Any) -> ListedProcess:
    get = number_field
    memory = get(info, "usedGpuMemory")
    return ListedProcess(
        pid=get(info, "pid"),
        used_memory=None if memory == NOT_AVAILABLE_ULL else memory,
        gpu_instance_id=get(info, "gpuInstanceId"),
        compute_instance_id=get(info, "computeInstanceId"),
    )
