"""Health verdicts per GPU (pure): which GPUs can be trusted with work.

A GPU is *unhealthy* when it needs an operator (lost, fatal XID within the window,
uncorrectable ECC since the driver loaded, a failed or pending row remap, the retired
page limit reached, a failing DCGM health system); it is *degraded* when it works but
slower (thermal or power slowdown). Degraded GPUs stay schedulable.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from exporter.analysis.xid import recovery_action_name
from exporter.model import GpuHealth, GpuSample, HealthReason

UNHEALTHY, DEGRADED = "unhealthy", "degraded"
# NVML clock-event bits that mean "slower because of heat or power", not "idle"
THERMAL_BITS = 0x20 | 0x40  # sw / hw thermal slowdown
POWER_BITS = 0x08 | 0x80  # hw slowdown / hw power brake
REASONS = (
    "gpu_lost",
    "fatal_xid",
    "uncorrectable_ecc",
    "row_remap_failure",
    "row_remap_pending",
    "retired_pages_limit",
    "recovery_action",
    "dcgm_health",
    "thermal_slowdown",
    "power_slowdown",
)


@dataclass(frozen=True)
class HealthPolicy:
    """Thresholds; each is a flag with a documented default (docs/health.md)."""

    xid_window_s: float = 3600.0
    retired_pages_limit: int = 60


def assess(
    gpus: Sequence[GpuSample],
    *,
    recent_fatal_xids: Mapping[str, Sequence[int]],
    dcgm_failures: Mapping[str, Sequence[str]],
    policy: HealthPolicy,
) -> tuple[GpuHealth, ...]:
    """``recent_fatal_xids``: GPU UUID -> fatal XID codes seen within the window.
    ``dcgm_failures``: GPU UUID -> DCGM health systems reporting failure."""
    return tuple(
        GpuHealth(
            gpu.index,
            gpu.uuid,
            tuple(
                _reasons(
                    gpu,
                    recent_fatal_xids.get(gpu.uuid, ()),
                    dcgm_failures.get(gpu.uuid, ()),
                    policy,
                )
            ),
        )
        for gpu in gpus
    )


def _reasons(
    gpu: GpuSample, fatal_xids: Sequence[int], dcgm: Sequence[str], policy: HealthPolicy
) -> list[HealthReason]:
    out: list[HealthReason] = []
    if gpu.error:
        out.append(HealthReason("gpu_lost", UNHEALTHY, gpu.error))
    if fatal_xids:
        codes = ",".join(str(x) for x in sorted(set(fatal_xids)))
        out.append(HealthReason("fatal_xid", UNHEALTHY, f"XID {codes}"))
    if gpu.ecc_uncorrected_volatile:
        out.append(
            HealthReason(
                "uncorrectable_ecc", UNHEALTHY, f"{gpu.ecc_uncorrected_volatile} since driver load"
            )
        )
    rows = gpu.remapped_rows
    if rows is not None and rows.failure:
        out.append(HealthReason("row_remap_failure", UNHEALTHY, "replace the GPU"))
    if rows is not None and rows.pending:
        out.append(HealthReason("row_remap_pending", UNHEALTHY, "reset the GPU"))
    if gpu.recovery_action:  # 0 is "none"
        out.append(
            HealthReason("recovery_action", UNHEALTHY, recovery_action_name(gpu.recovery_action))
        )
    if gpu.retired_pages is not None and gpu.retired_pages >= policy.retired_pages_limit:
        out.append(
            HealthReason("retired_pages_limit", UNHEALTHY, f"{gpu.retired_pages} pages retired")
        )
    if dcgm:
        out.append(HealthReason("dcgm_health", UNHEALTHY, ",".join(sorted(set(dcgm)))))
    reasons = gpu.clock_event_reasons or 0
    if reasons & THERMAL_BITS:
        out.append(HealthReason("thermal_slowdown", DEGRADED))
    if reasons & POWER_BITS:
        out.append(HealthReason("power_slowdown", DEGRADED))
    return out
