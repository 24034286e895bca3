"""Health verdicts per GPU (pure): which GPUs can be trusted with work.

A GPU is *unhealthy* when it needs an operator (lost, fatal XID within the window,
uncorrectable ECC since the driver loaded, a failed or pending row remap, the retired
page limit reached, a failing DCGM health system); it is *degraded* when it works but
slower (thermal or power slowdown). Degraded GPUs stay schedulable.

A hardware verdict needs hardware evidence: a GPU whose reading failed is ``gpu_lost``
only when NVML said so (GPU_IS_LOST, RESET_REQUIRED: ``GpuSample.lost``); any other
failure (UNKNOWN, NoPermission, an exception in the binding) is ``unreadable``, of
severity *unknown*: no verdict either way (docs/health.md).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TypeVar

from exporter.analysis.xid import recovery_action_name
from exporter.model import GpuHealth, GpuSample, HealthReason, RemappedRows
from exporter.model.fast_init import fast_init

UNHEALTHY, DEGRADED, UNKNOWN = "unhealthy", "degraded", "unknown"
_T = TypeVar("_T")
# NVML clock-event bits that mean "slower because of heat or power", not "idle"
THERMAL_BITS = 0x20 | 0x40  # sw / hw thermal slowdown
POWER_BITS = 0x08 | 0x80  # hw slowdown / hw power brake
REASONS = (
    "gpu_lost",
    "unreadable",
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


@fast_init
@dataclass(frozen=True, slots=True)
class KnownFacts:
    """A GPU's health facts as last read (None: never read). A slow-tier read that fails
    (NoPermission, a timeout) answers nothing about the GPU, so its verdict stands on
    what the last successful read said (docs/health.md)."""

    ecc_uncorrected_volatile: int | None = None
    remapped_rows: RemappedRows | None = None
    retired_pages: int | None = None
    recovery_action: int | None = None


def _read(gpu: GpuSample) -> KnownFacts:
    return KnownFacts(
        gpu.ecc_uncorrected_volatile, gpu.remapped_rows, gpu.retired_pages, gpu.recovery_action
    )


def _merged(now: KnownFacts, before: KnownFacts) -> KnownFacts:
    """What was read this cycle, and the last known value of what was not."""
    return KnownFacts(
        _first(now.ecc_uncorrected_volatile, before.ecc_uncorrected_volatile),
        _first(now.remapped_rows, before.remapped_rows),
        _first(now.retired_pages, before.retired_pages),
        _first(now.recovery_action, before.recovery_action),
    )


def _first(value: _T | None, fallback: _T | None) -> _T | None:
    return fallback if value is None else value


def with_known_facts(
    gpus: Sequence[GpuSample], known: Mapping[str, KnownFacts], *, nvml_ok: bool
) -> tuple[tuple[GpuSample, ...], dict[str, KnownFacts]]:
    """The GPUs to judge, each health fact that was not read this cycle (None) filled in
    with its last known value, and the facts to carry on (GPU UUID -> facts).

    Only the verdict uses the filled-in samples: the series of a fact not read stay absent.
    A lost GPU is judged lost and keeps its facts for when it answers again; two GPUs under
    one UUID carry nothing (no fact about either can hold); while NVML is down everything
    is kept; a GPU that a working NVML no longer lists takes its facts with it."""
    if not nvml_ok:
        return tuple(gpus), dict(known)
    seen = Counter(g.uuid for g in gpus)
    judged: list[GpuSample] = []
    carried: dict[str, KnownFacts] = {}
    for gpu in gpus:
        before = known.get(gpu.uuid)
        if seen[gpu.uuid] > 1 or gpu.error:
            judged.append(gpu)
            if before is not None and seen[gpu.uuid] == 1:
                carried[gpu.uuid] = before
            continue
        facts = _read(gpu) if before is None else _merged(_read(gpu), before)
        if facts != KnownFacts():
            carried[gpu.uuid] = facts
        judged.append(
            gpu
            if before is None
            else replace(
                gpu,
                ecc_uncorrected_volatile=facts.ecc_uncorrected_volatile,
                remapped_rows=facts.remapped_rows,
                retired_pages=facts.retired_pages,
                recovery_action=facts.recovery_action,
            )
        )
    return tuple(judged), carried


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
        if gpu.lost:
            out.append(HealthReason("gpu_lost", UNHEALTHY, gpu.error))
        else:  # the exporter's or the driver interface's failure, not the GPU's
            out.append(HealthReason("unreadable", UNKNOWN, gpu.error))
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
