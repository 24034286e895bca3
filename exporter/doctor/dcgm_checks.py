"""DCGM: is a host engine (or an embedded one) reachable through the exporter's own
``DcgmSource``, and which GPUs give it profiling values."""

from __future__ import annotations

import time
from dataclasses import dataclass

from exporter.doctor.check import Check, degraded, ok
from exporter.model import DcgmMode
from exporter.sources.dcgm import DcgmSource

DCGM_FIX = (
    "run a DCGM host engine the exporter can reach: on a GPU Operator cluster its "
    "nvidia-dcgm (Operator value dcgm.enabled=true; --dcgm auto finds its Service), else "
    "--dcgm HOST:PORT (chart dcgm.mode); the chart copies DCGM's bindings and libdcgm "
    "from NVIDIA's DCGM image (dcgm.bindingsImage), or use an image with DCGM installed "
    "(--dcgm-bindings-path, chart dcgm.bindingsPath) (docs/dcgm.md, 'With the chart')"
)
# DCGM refreshes a watched field once per update interval (1 s, as DcgmSource asks):
# the first read after the watch is set up may find no value yet.
PROFILING_WAIT_S = 1.1
PROFILING_FIX = (
    "stop the other profiling client (dcgm-exporter, Nsight) on pre-Hopper GPUs, or point "
    "--dcgm at the host engine it uses; on a GPU DCGM cannot profile, occupancy comes "
    "from GPM where the GPU has it"
)


@dataclass(frozen=True)
class DcgmFindings:
    reach: Check
    profiled: frozenset[str] | None  # GPU UUIDs with profiling values; None: DCGM down
    note: str  # why profiling is unavailable, when DCGM says so


def check_dcgm(
    mode: DcgmMode, bindings_path: str | None, library_path: str | None = None
) -> DcgmFindings:
    """Blocking: connect, read once (profiling values need a second read a moment
    later, as DCGM updates its watches once a second), disconnect."""
    if mode.kind == "off":
        return DcgmFindings(
            degraded(
                "dcgm",
                "off (--dcgm off): no DCGM profiling or health; occupancy from GPM only",
                "--dcgm auto or --dcgm HOST:PORT (chart dcgm.mode) where DCGM is installed",
            ),
            None,
            "",
        )
    source = DcgmSource(mode, bindings_path=bindings_path, library_path=library_path)
    try:
        if not source.open():
            first = source.sample()
            return DcgmFindings(
                degraded("dcgm", f"DCGM not reachable: {first.error}", DCGM_FIX), None, ""
            )
        where = source.connected_to
        snapshot = source.sample()
        if snapshot.ok and not snapshot.occupancy:
            time.sleep(PROFILING_WAIT_S)
            snapshot = source.sample()
    finally:
        source.close()
    if not snapshot.ok:
        return DcgmFindings(
            degraded("dcgm", f"DCGM via {where} fails: {snapshot.error}", DCGM_FIX), None, ""
        )
    profiled = frozenset(snapshot.profiled) | {uuid for uuid, _ in snapshot.occupancy}
    return DcgmFindings(
        ok("dcgm", f"DCGM via {where}; health watches {snapshot.health or 'unavailable'}"),
        profiled,
        snapshot.error or "",
    )


def gpu_checks(findings: DcgmFindings, gpus: list[tuple[int, str]]) -> list[Check]:
    """``gpuN.dcgm``: whether DCGM profiles this GPU."""
    checks = []
    for index, uuid in gpus:
        name = f"gpu{index}.dcgm"
        if findings.profiled is None:
            checks.append(degraded(name, "DCGM not available: see dcgm", DCGM_FIX))
        elif uuid in findings.profiled:
            checks.append(ok(name, "DCGM profiles this GPU (SM activity, occupancy, tensor)"))
        else:
            why = f": {findings.note}" if findings.note else ""
            checks.append(
                degraded(name, f"DCGM reachable but gives no profiling fields{why}", PROFILING_FIX)
            )
    return checks
