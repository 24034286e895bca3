"""The GPU instance profiles a simulated GPU offers, per model, as NVML answers them.

Taken from NVIDIA's MIG user guide, "Supported MIG Profiles"
(https://docs.nvidia.com/datacenter/tesla/mig-user-guide/supported-mig-profiles.html):
the A100 (40GB and 80GB), H100 80GB and H200 141GB tables. Each row is a profile name, its
fraction of the SMs as GPU slices (the ``Ng`` of the name, out of 7) and its fraction of
the memory (in eighths). The guide gives fractions, not byte counts: the simulated
``memorySizeMB`` is the fraction of the simulated GPU's memory. A real driver reports
somewhat less (``nvidia-smi mig -lgip`` on an H100 80GB shows 9.75 GiB for 1g.10gb,
79.25 GiB for 7g.80gb), which is what the exporter then serves.

The NVML profile argument is an ``NVML_GPU_INSTANCE_PROFILE_*`` constant (nvml.h):
1_SLICE 0x0, 2_SLICE 0x1, 3_SLICE 0x2, 4_SLICE 0x3, 7_SLICE 0x4, 1_SLICE_REV1 0x7 (the
``+me`` profile with the media engines), 1_SLICE_REV2 0x9 (the 1g profile with a quarter
of the memory); the profile ids are those ``nvidia-smi mig -lgip`` lists (19, 14, 9, 5,
0, 20, 15). Other models (and the H100 94GB / 96GB variants) answer NOT_SUPPORTED.
"""

from __future__ import annotations

from dataclasses import dataclass

import pynvml


@dataclass(frozen=True)
class SimProfile:
    constant: int  # NVML_GPU_INSTANCE_PROFILE_*: what nvmlDeviceGetGpuInstanceProfileInfoV takes
    profile_id: int  # the id the driver gives it (nvidia-smi mig -lgip's ID column)
    name: str  # e.g. "1g.10gb" (NVML names it "MIG 1g.10gb")
    slices: int  # GPU slices (the "Ng"), out of 7
    eighths: int  # memory, in eighths of the GPU's
    instances: int  # how many fit on one GPU


def _table(m1: str, m1q: str, m2: str, m3: str, m7: str) -> tuple[SimProfile, ...]:
    """The A100 / H100 / H200 layout, with the model's memory sizes in the names: 1g with
    an eighth (and its +me variant), 1g with a quarter, 2g with a quarter, 3g and 4g with
    half, 7g with all of it."""
    return (
        SimProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, f"1g.{m1}", 1, 1, 7),
        SimProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, f"1g.{m1}+me", 1, 1, 1),
        SimProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, f"1g.{m1q}", 1, 2, 4),
        SimProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, f"2g.{m2}", 2, 2, 3),
        SimProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, f"3g.{m3}", 3, 4, 2),
        SimProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, f"4g.{m3}", 4, 4, 1),
        SimProfile(pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, f"7g.{m7}", 7, 8, 1),
    )


# The guide's tables. The A100-40GB's 1g.10gb (1_SLICE_REV2) came with R525 drivers.
A100_40GB = _table("5gb", "10gb", "10gb", "20gb", "40gb")
A100_80GB = _table("10gb", "20gb", "20gb", "40gb", "80gb")
H100_80GB = _table("10gb", "20gb", "20gb", "40gb", "80gb")
H200_141GB = _table("18gb", "35gb", "35gb", "71gb", "141gb")
SMS = {"A100": 108, "H100": 132, "H200": 132}  # SMs of the whole GPU (NVIDIA datasheets)
GIB = 1 << 30


def profiles_for(model: str, memory_total: int) -> tuple[SimProfile, ...]:
    """The profiles a GPU of this NVML name and memory offers; () for none (NOT_SUPPORTED)."""
    if "A100" in model:
        return A100_40GB if memory_total <= 48 * GIB else A100_80GB
    if "H100" in model and 72 * GIB <= memory_total <= 88 * GIB:
        return H100_80GB
    if "H200" in model:
        return H200_141GB
    return ()


def multiprocessors(model: str, slices: int) -> int:
    """SMs of a profile: its share of the whole GPU's (the driver's own counts differ a
    little; nothing in the exporter reads them)."""
    total = next((count for family, count in SMS.items() if family in model), 0)
    return total * slices // 7
