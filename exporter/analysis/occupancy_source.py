"""Which source gives each GPU's occupancy (SM activity and the rest): GPM, DCGM, or none.

A dashboard shows "GPU-Util only on this GPU" from this instead of an empty panel, and
an operator finds the pre-Hopper GPUs that need DCGM. The choice follows the values
actually served (pipeline.prefer_dcgm: DCGM's where it has them, else GPM's); in a cycle
without values it follows what the sources said they can do, so a first cycle (GPM only
primes its buffers) or a blank DCGM read does not flip a GPU to "none". "none" needs
evidence: NVML said GPM is not supported and DCGM gave no value for the GPU; a GPU
whose GPM support is not known yet, or whose read failed, has no source served.
"""

from __future__ import annotations

from typing import Literal

from exporter.model import DcgmSnapshot, GpuSample

OccupancySource = Literal["gpm", "dcgm", "none"]
OCCUPANCY_SOURCES: tuple[OccupancySource, ...] = ("gpm", "dcgm", "none")


def occupancy_sources(
    gpus: tuple[GpuSample, ...], dcgm: DcgmSnapshot | None
) -> tuple[tuple[str, OccupancySource], ...]:
    """(GPU UUID, source) for every GPU whose source is known, in the order given."""
    profiled = frozenset(dcgm.profiled) if dcgm is not None and dcgm.ok else frozenset()
    out: list[tuple[str, OccupancySource]] = []
    for gpu in gpus:
        source = _source(gpu, profiled)
        if source is not None:
            out.append((gpu.uuid, source))
    return tuple(out)


def _source(gpu: GpuSample, profiled: frozenset[str]) -> OccupancySource | None:
    if gpu.error:
        return None
    served = gpu.occupancy or next((m.occupancy for m in gpu.mig_instances if m.occupancy), None)
    if served is not None:
        return "dcgm" if served.source == "dcgm" else "gpm"
    if gpu.uuid in profiled:
        return "dcgm"
    if gpu.gpm_supported is None:
        return None
    return "gpm" if gpu.gpm_supported else "none"
