"""Pure analysis: health verdicts, node capacity, idle allocations."""

from __future__ import annotations

import pytest

from exporter.analysis.capacity import node_capacity
from exporter.analysis.health import HealthPolicy, assess
from exporter.analysis.idle import IdlePolicy, account_idle
from exporter.model import (
    AllocatableDevices,
    Allocation,
    ContainerGpuUsage,
    ContainerRef,
    DeviceRef,
    GpuHealth,
    GpuSample,
    HealthReason,
    MigInstance,
    Occupancy,
    PodResourcesSnapshot,
    RemappedRows,
)

GOOD = GpuSample(
    index=0,
    uuid="GPU-a",
    ecc_uncorrected_volatile=0,
    retired_pages=0,
    remapped_rows=RemappedRows(0, 0, False, False),
    clock_event_reasons=0,
)


def reasons_of(gpu: GpuSample, **kwargs: object) -> list[tuple[str, str]]:
    (verdict,) = assess(
        [gpu],
        recent_fatal_xids=kwargs.get("xids", {}),  # type: ignore[arg-type]
        dcgm_failures=kwargs.get("dcgm", {}),  # type: ignore[arg-type]
        policy=HealthPolicy(retired_pages_limit=60),
    )
    return [(r.reason, r.severity) for r in verdict.reasons]


@pytest.mark.parametrize(
    ("changes", "extra", "expected"),
    [
        ({}, {}, []),
        ({"error": "GpuIsLost", "lost": True}, {}, [("gpu_lost", "unhealthy")]),
        ({"error": "ResetRequired", "lost": True}, {}, [("gpu_lost", "unhealthy")]),
        ({"error": "Unknown"}, {}, [("unreadable", "unknown")]),
        ({"error": "TypeError"}, {}, [("unreadable", "unknown")]),
        ({"error": "NoPermission"}, {}, [("unreadable", "unknown")]),
        ({}, {"xids": {"GPU-a": [79]}}, [("fatal_xid", "unhealthy")]),
        ({}, {"xids": {"GPU-other": [79]}}, []),
        ({"ecc_uncorrected_volatile": 2}, {}, [("uncorrectable_ecc", "unhealthy")]),
        (
            {"remapped_rows": RemappedRows(3, 1, False, True)},
            {},
            [("row_remap_failure", "unhealthy")],
        ),
        (
            {"remapped_rows": RemappedRows(0, 1, True, False)},
            {},
            [("row_remap_pending", "unhealthy")],
        ),
        ({"retired_pages": 59}, {}, []),
        ({"retired_pages": 60}, {}, [("retired_pages_limit", "unhealthy")]),
        ({"retired_pages": None}, {}, []),
        ({}, {"dcgm": {"GPU-a": ["mem"]}}, [("dcgm_health", "unhealthy")]),
        ({"recovery_action": 1}, {}, [("recovery_action", "unhealthy")]),
        ({"recovery_action": 0}, {}, []),
        ({"clock_event_reasons": 0x40}, {}, [("thermal_slowdown", "degraded")]),
        ({"clock_event_reasons": 0x20}, {}, [("thermal_slowdown", "degraded")]),
        ({"clock_event_reasons": 0x80}, {}, [("power_slowdown", "degraded")]),
        ({"clock_event_reasons": 0x1 | 0x4}, {}, []),  # idle and sw power cap are normal
    ],
    ids=[
        "healthy",
        "lost",
        "reset-required",
        "unknown-error-is-no-verdict",
        "binding-type-error-is-no-verdict",
        "no-permission-is-no-verdict",
        "fatal-xid",
        "xid-on-other-gpu",
        "ecc",
        "remap-failure",
        "remap-pending",
        "retired-below-limit",
        "retired-at-limit",
        "retired-unsupported",
        "dcgm",
        "recovery-gpu-reset",
        "recovery-none",
        "hw-thermal",
        "sw-thermal",
        "power-brake",
        "idle-and-power-cap-normal",
    ],
)
def test_each_health_reason_is_reported_with_its_severity(
    changes: dict[str, object], extra: dict[str, object], expected: list[tuple[str, str]]
) -> None:
    from dataclasses import replace

    assert reasons_of(replace(GOOD, **changes), **extra) == expected  # type: ignore[arg-type]


def test_degraded_gpu_stays_healthy_and_unhealthy_reason_makes_it_unhealthy() -> None:
    degraded = GpuHealth(0, "GPU-a", (HealthReason("thermal_slowdown", "degraded"),))
    broken = GpuHealth(
        0,
        "GPU-a",
        (HealthReason("thermal_slowdown", "degraded"), HealthReason("fatal_xid", "unhealthy")),
    )
    assert degraded.healthy and not broken.healthy


def alloc(
    device: str,
    uuid: str,
    resource: str = "nvidia.com/gpu",
    pod: str = "p",
    mig: str | None = None,
    shared: bool = False,
    gpu: int | None = 0,
) -> Allocation:
    return Allocation(
        ContainerRef("ns", pod, "c"), DeviceRef(gpu, uuid, mig), device, resource, shared
    )


def test_capacity_counts_healthy_advertised_minus_allocated_per_resource() -> None:
    gpus = [GpuSample(index=i, uuid=f"GPU-{i}") for i in range(4)]
    gpus.append(
        GpuSample(
            index=4,
            uuid="GPU-4",
            mig_instances=(
                MigInstance(0, "MIG-x", 1, 0, "3g.40gb", None, None),
                MigInstance(1, "MIG-y", 2, 0, "3g.40gb", None, None),
            ),
        )
    )
    health = [GpuHealth(g.index, g.uuid) for g in gpus]
    health[1] = GpuHealth(1, "GPU-1", (HealthReason("fatal_xid", "unhealthy"),))
    health[4] = GpuHealth(4, "GPU-4", (HealthReason("gpu_lost", "unhealthy"),))
    pr = PodResourcesSnapshot(
        ok=True,
        timestamp=0,
        allocatable_ok=True,
        allocatable=(
            AllocatableDevices("nvidia.com/gpu", ("GPU-0", "GPU-1", "GPU-2")),
            AllocatableDevices("nvidia.com/gpu.shared", ("GPU-3::0", "GPU-3::1", "GPU-3::2")),
            AllocatableDevices("nvidia.com/mig-3g.40gb", ("MIG-x", "MIG-y")),
        ),
    )
    allocations = [
        alloc("GPU-0", "GPU-0"),
        alloc("GPU-1", "GPU-1", pod="q"),
        alloc("GPU-3::1", "GPU-3", "nvidia.com/gpu.shared", shared=True),
        alloc("MIG-x", "GPU-4", "nvidia.com/mig-3g.40gb", mig="MIG-x"),
    ]
    got = {
        c.resource: (c.advertised, c.healthy, c.unhealthy, c.allocated, c.allocatable)
        for c in node_capacity(gpus, health, pr, allocations, nvml_ok=True)
    }
    assert got == {
        "nvidia.com/gpu": (3, 2, 1, 2, 1),  # GPU-2 is the only one left
        "nvidia.com/gpu.shared": (3, 3, 0, 1, 2),
        "nvidia.com/mig-3g.40gb": (2, 0, 2, 1, 0),  # parent GPU lost: both instances gone
    }


def test_capacity_falls_back_to_nvml_when_the_kubelet_cannot_say() -> None:
    gpus = [GpuSample(index=i, uuid=f"GPU-{i}") for i in range(2)]
    health = [GpuHealth(0, "GPU-0"), GpuHealth(1, "GPU-1", (HealthReason("x", "unhealthy"),))]
    # An older kubelet: List answers (allocations known), GetAllocatableResources not.
    pr = PodResourcesSnapshot(ok=True, timestamp=0, allocatable_ok=False)
    (cap,) = node_capacity(gpus, health, pr, [], nvml_ok=True)
    # NVML's GPUs and their health stand in; what of a guessed set is free is unknown
    assert (cap.resource, cap.advertised, cap.healthy, cap.unhealthy, cap.allocatable) == (
        "nvidia.com/gpu",
        2,
        1,
        1,
        None,
    )


def usage(
    uuid: str, processes: int, sm: float | None, mig: str | None = None, pod: str = "p"
) -> ContainerGpuUsage:
    return ContainerGpuUsage(
        ContainerRef("ns", pod, "c"), DeviceRef(0, uuid, mig), 1, sm, processes
    )


def idle_step(
    allocations: list[Allocation],
    containers: list[ContainerGpuUsage],
    gpus: list[GpuSample],
    previous: tuple = (),
    elapsed: float = 5.0,
) -> dict[str, tuple[bool, float]]:
    out = account_idle(
        previous,
        allocations,
        containers,
        gpus,
        elapsed_s=elapsed,
        policy=IdlePolicy(threshold_ratio=0.05, max_gap_s=60),
    )
    return {i.device_id: (i.idle_now, i.idle_seconds_total) for i in out}


def test_allocation_without_processes_is_idle_and_accumulates_time() -> None:
    gpus = [GpuSample(index=0, uuid="GPU-0", utilization_gpu_percent=90)]
    first = account_idle((), [alloc("GPU-0", "GPU-0")], [], gpus, elapsed_s=5, policy=IdlePolicy())
    second = account_idle(
        first, [alloc("GPU-0", "GPU-0")], [], gpus, elapsed_s=5, policy=IdlePolicy()
    )
    assert [(i.idle_now, i.idle_seconds_total) for i in second] == [(True, 10.0)]


def test_sm_activity_beats_gpu_util_for_the_tiny_kernels_case() -> None:
    tiny = GpuSample(
        index=0,
        uuid="GPU-0",
        utilization_gpu_percent=100,
        occupancy=Occupancy("gpm", sm_active=0.01),
    )
    busy = GpuSample(
        index=0,
        uuid="GPU-0",
        utilization_gpu_percent=100,
        occupancy=Occupancy("gpm", sm_active=0.6),
    )
    no_gpm = GpuSample(index=0, uuid="GPU-0", utilization_gpu_percent=3)
    a = [alloc("GPU-0", "GPU-0")]
    c = [usage("GPU-0", 2, 0.5)]
    assert idle_step(a, c, [tiny]) == {"GPU-0": (True, 5.0)}
    assert idle_step(a, c, [busy]) == {"GPU-0": (False, 0.0)}
    assert idle_step(a, c, [no_gpm]) == {"GPU-0": (True, 5.0)}


def test_shared_replica_uses_the_containers_own_share_not_the_gpus() -> None:
    gpu = GpuSample(
        index=0,
        uuid="GPU-0",
        utilization_gpu_percent=100,
        occupancy=Occupancy("gpm", sm_active=0.9),
    )
    a = [
        alloc("GPU-0::0", "GPU-0", shared=True, pod="busy"),
        alloc("GPU-0::1", "GPU-0", shared=True, pod="lazy"),
    ]
    c = [usage("GPU-0", 1, 0.85, pod="busy"), usage("GPU-0", 1, 0.01, pod="lazy")]
    assert idle_step(a, c, [gpu]) == {"GPU-0::0": (False, 0.0), "GPU-0::1": (True, 5.0)}


def test_mig_allocation_without_a_signal_is_not_judged_and_gaps_are_not_counted() -> None:
    gpu = GpuSample(
        index=0, uuid="GPU-0", mig_instances=(MigInstance(0, "MIG-x", 1, 0, "1g.10gb", None, None),)
    )
    a = [alloc("MIG-x", "GPU-0", "nvidia.com/mig-1g.10gb", mig="MIG-x")]
    assert idle_step(a, [usage("GPU-0", 1, None, mig="MIG-x")], [gpu]) == {"MIG-x": (False, 0.0)}
    # no process on the instance: idle, but an exporter outage (gap > max) adds nothing
    assert idle_step(a, [], [gpu], elapsed=600) == {"MIG-x": (True, 0.0)}


def test_allocation_on_a_lost_or_unknown_gpu_is_not_counted_as_idle() -> None:
    lost = GpuSample(index=0, uuid="GPU-0", error="GpuIsLost", lost=True)
    a = [alloc("GPU-0", "GPU-0"), alloc("GPU-9", "GPU-9", pod="q")]
    assert idle_step(a, [], [lost]) == {"GPU-0": (False, 0.0), "GPU-9": (False, 0.0)}


def test_docs_health_table_lists_exactly_the_reasons_the_analysis_knows() -> None:
    import re
    from pathlib import Path

    from exporter.analysis.health import REASONS

    doc = (Path(__file__).parent.parent / "docs" / "health.md").read_text()
    assert set(
        re.findall(r"^\| `([a-z_]+)` \| (?:unhealthy|degraded|unknown) \|", doc, re.M)
    ) == set(REASONS)


def test_a_dcgm_failure_stands_while_dcgm_is_down_and_clears_only_when_it_says_so() -> None:
    """A host engine restarting is no verdict of healthy: the GPU it called failing stays
    unhealthy until DCGM answers again without the failure."""
    from exporter.analysis.pipeline import Policy, analyse, initial_state
    from exporter.model import (
        DcgmHealthIncident,
        DcgmSnapshot,
        GpuSample,
        NodeSnapshot,
        NvmlSnapshot,
    )

    gpu = GpuSample(index=0, uuid="GPU-a")
    failing = DcgmSnapshot(
        ok=True, timestamp=0.0, incidents=(DcgmHealthIncident("GPU-a", "pcie", "fail", "x"),)
    )
    down = DcgmSnapshot(ok=False, timestamp=0.0, error="host engine restarting")
    passing = DcgmSnapshot(ok=True, timestamp=0.0)
    policy = Policy()
    state = initial_state(policy, {})
    verdicts = []
    for t, dcgm in enumerate((failing, down, down, passing)):
        snapshot = NodeSnapshot(
            node_name="n",
            nvml=NvmlSnapshot(ok=True, timestamp=t, gpus=(gpu,)),
            timestamp=t,
            dcgm=dcgm,
        )
        analysis, state = analyse(snapshot, state, policy)
        (health,) = analysis.health
        verdicts.append(health.healthy)
    assert verdicts == [False, False, False, True]
