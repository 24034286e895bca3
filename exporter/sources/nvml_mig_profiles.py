"""The GPU instance profiles a GPU offers, from nvmlDeviceGetGpuInstanceProfileInfoV.

nvml.h says of the call: "Information provided by this API is immutable throughout the
lifetime of a MIG mode", and that it answers NVML_ERROR_NOT_SUPPORTED "If device doesn't
support MIG or profile isn't supported" (the header's comment, e.g. NVIDIA/go-nvml
gen/nvml/nvml.h; https://docs.nvidia.com/deploy/nvml-api/group__nvmlMultiInstanceGPU.html).
So the profiles are read once per GPU handle and MIG mode (``ProfileCache``), never every
cycle. Each ``NVML_GPU_INSTANCE_PROFILE_*`` constant below pynvml's
``NVML_GPU_INSTANCE_PROFILE_COUNT`` is asked; NOT_SUPPORTED and INVALID_ARGUMENT (a
constant newer than the driver) skip that profile, as NVIDIA's go-nvlib does
(pkg/nvlib/device/device.go, ``VisitMigProfiles``). The ``V`` entry point and its v2 struct
(the first with the profile's ``name``) came with R470-era drivers: a driver without it
(FunctionNotFound) or that refuses the struct version offers no profiles here, never an
error. Any other failure (NoPermission) is counted and the read is tried again next cycle.

A profile whose answer no GPU could give is left out, never served as read: a name that
is not printable UTF-8, a memory size of 0 (unknown, not "no memory") or over
``MAX_MEMORY_MB``, a slice count outside 1..``MAX_SLICES`` (the A100 and H100 have 7;
one bogus count would otherwise become the whole GPU's and skew every share). The whole
GPU's slices are the largest plausible count.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from exporter.model import MigProfileInfo
from exporter.sources.nvml_codes import GPU_FAILED, error_name

log = logging.getLogger(__name__)

MIB = 1 << 20
MAX_SLICES = 8  # compute slices of a whole GPU: 7 on every MIG GPU so far (A30: 4)
MAX_MEMORY_MB = 1 << 24  # 16 TiB: far above any GPU's memory
_SKIP_PROFILE = (pynvml.NVMLError_NotSupported, pynvml.NVMLError_InvalidArgument)
_NO_PROFILES = (pynvml.NVMLError_FunctionNotFound, pynvml.NVMLError_ArgumentVersionMismatch)


def read_profiles(
    handle: Any, errors: Callable[[str, str], None]
) -> tuple[MigProfileInfo, ...] | None:
    """Every profile the GPU answers for; None when the read failed (counted in
    ``errors``) and should be tried again. A whole-GPU failure escapes."""
    found: list[tuple[str, int, int]] = []
    for constant in range(pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT):
        try:
            info = pynvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, constant)  # the V call
        except _SKIP_PROFILE:
            continue
        except _NO_PROFILES:
            return ()
        except GPU_FAILED:
            raise
        except pynvml.NVMLError as exc:
            errors("mig_profiles", error_name(exc))
            return None
        name = _profile_name(info.name)
        memory_mb, slices = int(info.memorySizeMB), int(info.sliceCount)
        if name and 0 < memory_mb <= MAX_MEMORY_MB and 0 < slices <= MAX_SLICES:
            found.append((name, memory_mb * MIB, slices))
        else:  # read once per GPU handle and MIG mode: a bounded number of lines
            log.warning(
                "NVML GPU instance profile %d answers name %r, %d MB, %d slices: no "
                "profile a GPU has; left out",
                constant,
                info.name,
                memory_mb,
                slices,
            )
    whole = max((slices for _, _, slices in found), default=0)
    return tuple(MigProfileInfo(name, size, slices, whole) for name, size, slices in found)


def _profile_name(raw: bytes | str) -> str:
    """``MIG 1g.10gb`` -> ``1g.10gb``; '' for a name that is not a profile's (not
    UTF-8, not printable)."""
    try:
        text = raw.decode() if isinstance(raw, bytes) else raw
    except UnicodeDecodeError:
        return ""
    return text.removeprefix("MIG ").strip() if text.isprintable() else ""


@dataclass
class ProfileCache:
    """One GPU's profiles, read again only when its MIG mode changes (a new handle gets a
    new cache: the source makes a new ``_Device`` when it re-opens a GPU)."""

    mode: bool | None = None
    profiles: tuple[MigProfileInfo, ...] | None = None  # None: not read yet, or failed

    def get(
        self, handle: Any, mig_enabled: bool | None, errors: Callable[[str, str], None]
    ) -> tuple[MigProfileInfo, ...]:
        if self.profiles is None or mig_enabled != self.mode:
            self.mode, self.profiles = mig_enabled, read_profiles(handle, errors)
        return self.profiles or ()
