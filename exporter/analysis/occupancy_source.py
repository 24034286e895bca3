"""Which source gives each GPU's occupancy (SM activity and the rest): GPM, DCGM, or none.

A dashboard shows "GPU-Util only on this GPU" from this instead of an empty panel, and
an operator finds the pre-Hopper GPUs that need DCGM. The choice follows the values
actually served (pipeline.prefer_dcgm: DCGM's where it has them, else GPM's); in a cycle
without values it follows what the sources said they can do, so a first cycle (GPM only
primes its buffers), a blank DCGM read or a host engine that restarts does not flip a
GPU to "none". "none" needs evidence: NVML said GPM is not supported and DCGM's answer
is settled without a value for the GPU (DcgmSnapshot.settled: several reads gave none,
profiling is unavailable, or ``auto`` never found DCGM); a GPU whose GPM support is not
known yet, whose read failed, or whose DCGM answer is not settled has no source served.
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
    profiled = frozenset(dcgm.profiled) if dcgm is not None else frozenset()
    settled = dcgm is None or dcgm.settled
    out: list[tuple[str, OccupancySource]] = []
    for gpu in gpus:
        source = _source(gpu, profiled, settled)
        if source is not None:
            out.append((gpu.uuid, source))
    return tuple(out)


def _source(gpu: GpuSample, profiled: frozenset[str], settled: bool) -> OccupancySource | None:
    if gpu.error:
        return None
    served = gpu.occupancy or next((m.occupancy for m in gpu.mig_instances if m.occupancy), None)
    if served is not None:
        return "dcgm" if served.source == "dcgm" else "gpm"
    if gpu.uuid in profiled:
        return "dcgm"
    if gpu.gpm_supported is None:
        return None
    if gpu.gpm_supported:
        return "gpm"
    return "none" if settled else None
