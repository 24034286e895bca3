"""The GPU-hour ledger and the energy split (exporter/analysis/ledger.py).

Pure tests over hand-built cycles (states, weights, gaps, the energy split), then the
real exporter on every shipped scenario: the served states of every allocation sum to
the GPU-equivalent time it was held, and the holders' energy sums to the GPU's.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import replace

import pytest

from exporter.analysis.idle import IdlePolicy
from exporter.analysis.ledger import account_ledger, compute_slices, gpu_slices
from exporter.analysis.pipeline import Policy, analyse, initial_state
from exporter.exposition.metrics import ExpositionOptions, build_families
from exporter.model import (
    LEDGER_STATES,
    AllocatableDevices,
    Allocation,
    AllocationLedger,
    Analysis,
    ContainerDevices,
    ContainerGpuUsage,
    ContainerRef,
    DeviceRef,
    GpuHealth,
    GpuSample,
    HealthReason,
    LedgerState,
    MigInstance,
    NodeSnapshot,
    NvmlSnapshot,
    Occupancy,
    PodResourcesSnapshot,
)
from tests.harness import Scrape, simulated_exporter

POLICY = IdlePolicy(threshold_ratio=0.05, max_gap_s=60.0)
H100 = "NVIDIA H100 80GB HBM3"


def ref(pod: str) -> ContainerRef:
    return ContainerRef("ns", pod, "c")


def alloc(
    pod: str, device_id: str, uuid: str | None, *, mig: str | None = None, shared: bool = False
) -> Allocation:
    resource = "nvidia.com/gpu.shared" if shared else "nvidia.com/gpu"
    gpu = None if uuid is None else int(uuid.rsplit("-", 1)[1])
    return Allocation(ref(pod), DeviceRef(gpu, uuid, mig), device_id, resource, shared)


def use(
    pod: str, uuid: str, sm: float | None, *, mig: str | None = None, processes: int = 1
) -> ContainerGpuUsage:
    gpu = int(uuid.rsplit("-", 1)[1])
    return ContainerGpuUsage(ref(pod), DeviceRef(gpu, uuid, mig), 1 << 30, sm, processes)


def gpu(
    index: int,
    *,
    sm: float | None = None,
    energy_mj: int | None = None,
    migs: Sequence[MigInstance] = (),
    **fields: object,
) -> GpuSample:
    return GpuSample(
        index=index,
        uuid=f"GPU-{index}",
        name=str(fields.pop("name", H100)),
        occupancy=Occupancy("gpm", sm_active=sm) if sm is not None else None,
        energy_millijoules=energy_mj,
        mig_instances=tuple(migs),
        **fields,  # type: ignore[arg-type]
    )


def mig(uuid: str, profile: str, sm: float | None) -> MigInstance:
    occupancy = Occupancy("gpm", sm_active=sm) if sm is not None else None
    gi = compute_slices(profile) or 0
    return MigInstance(0, uuid, gi, 0, profile, None, None, occupancy=occupancy)


def unhealthy(index: int) -> GpuHealth:
    return GpuHealth(index, f"GPU-{index}", (HealthReason("fatal_xid", "unhealthy"),))


def allocatable(*ids: str) -> PodResourcesSnapshot:
    return PodResourcesSnapshot(
        ok=True,
        timestamp=0,
        allocatable_ok=True,
        allocatable=(AllocatableDevices("nvidia.com/gpu.shared", ids),),
    )


LISTED = PodResourcesSnapshot(ok=True, timestamp=0)  # a PodResources listing that worked


class Ledger:
    """Cycles of the ledger, each ``elapsed`` after the last, with its state carried; the
    kubelet's listing worked unless ``pod_resources`` says otherwise."""

    def __init__(self) -> None:
        self.state = LedgerState()

    def cycle(
        self,
        allocations: Sequence[Allocation],
        gpus: Sequence[GpuSample],
        usage: Sequence[ContainerGpuUsage] = (),
        *,
        elapsed: float = 10.0,
        health: Sequence[GpuHealth] = (),
        pod_resources: PodResourcesSnapshot | None = LISTED,
    ) -> LedgerState:
        self.state = account_ledger(
            self.state,
            allocations,
            usage,
            gpus,
            health,
            pod_resources,
            elapsed_s=elapsed,
            policy=POLICY,
        )
        return self.state

    def seconds(self, pod: str) -> dict[str, float]:
        entry = self.entry(pod)
        return {state: s for state, s in entry.seconds if s}

    def entry(self, pod: str) -> AllocationLedger:
        (entry,) = [e for e in self.state.allocations if e.container.pod == pod]
        return entry

    def joules(self) -> dict[str, float]:
        return {e.container.pod: e.joules_total for e in self.state.energy}


# -- states ----------------------------------------------------------------------------


def state_after_one_step(
    allocation: Allocation,
    gpus: Sequence[GpuSample],
    usage: Sequence[ContainerGpuUsage] = (),
    health: Sequence[GpuHealth] = (),
) -> dict[str, float]:
    ledger = Ledger()
    ledger.cycle([allocation], gpus, usage, elapsed=0, health=health)  # first: no time
    ledger.cycle([allocation], gpus, usage, elapsed=10, health=health)
    return ledger.seconds(allocation.container.pod)


@pytest.mark.parametrize(
    ("gpus", "usage", "health", "expected"),
    [
        ([gpu(0, sm=0.6)], [use("p", "GPU-0", 0.5)], [], "busy"),
        # GPU-Util 100 %, SM activity 1 %: the tiny-kernels case is idle
        ([gpu(0, sm=0.01, utilization_gpu_percent=100)], [use("p", "GPU-0", 0.5)], [], "idle"),
        ([gpu(0, utilization_gpu_percent=3)], [use("p", "GPU-0", None)], [], "idle"),
        ([gpu(0, sm=0.9)], [], [], "no_process"),
        ([gpu(0, sm=0.9)], [use("p", "GPU-0", 0.5, processes=0)], [], "no_process"),
        ([gpu(0, sm=0.9)], [use("p", "GPU-0", 0.5)], [unhealthy(0)], "unhealthy"),
        ([gpu(0, error="GpuIsLost", lost=True)], [], [unhealthy(0)], "unhealthy"),
        ([gpu(1, sm=0.9)], [], [], "unknown"),  # NVML does not list GPU 0
        ([gpu(0, sm=0.9, processes_listed=False)], [], [], "unknown"),  # listing failed
        ([gpu(0)], [use("p", "GPU-0", 0.5)], [], "unknown"),  # no activity signal at all
    ],
    ids=[
        "busy",
        "idle-tiny-kernels",
        "idle-gpu-util",
        "no-process",
        "no-process-zero-count",
        "unhealthy",
        "unhealthy-lost",
        "unknown-unlisted",
        "unknown-listing-failed",
        "unknown-no-signal",
    ],
)
def test_each_state_takes_the_whole_step(
    gpus: list[GpuSample], usage: list[ContainerGpuUsage], health: list[GpuHealth], expected: str
) -> None:
    assert state_after_one_step(alloc("p", "GPU-0", "GPU-0"), gpus, usage, health) == {
        expected: 10.0
    }


@pytest.mark.parametrize(("sm", "expected"), [(0.25, "busy"), (0.125, "idle")])
def test_activity_exactly_at_the_idle_threshold_is_busy(sm: float, expected: str) -> None:
    """docs/metrics.md: ``busy`` is activity *at or above* ``--idle-threshold``. Values
    that binary floating point holds exactly (0.25, 0.125), so equality is not luck."""
    at_quarter = IdlePolicy(threshold_ratio=0.25, max_gap_s=60.0)
    held = alloc("p", "GPU-0", "GPU-0")
    state = LedgerState()
    for elapsed in (0.0, 10.0):  # the first cycle adds no time
        state = account_ledger(
            state,
            [held],
            [use("p", "GPU-0", 0.5)],
            [gpu(0, sm=sm)],
            (),
            LISTED,
            elapsed_s=elapsed,
            policy=at_quarter,
        )
    (entry,) = state.allocations
    assert {s: t for s, t in entry.seconds if t} == {expected: 10.0}


def test_a_replica_is_judged_by_its_own_sm_share_and_a_mig_instance_by_its_own_activity() -> None:
    busy_gpu = gpu(0, sm=0.95)
    lazy = alloc("lazy", "GPU-0::1", "GPU-0", shared=True)
    usage = [use("lazy", "GPU-0", 0.01)]
    cut = allocatable("GPU-0::0", "GPU-0::1")
    ledger = Ledger()
    ledger.cycle([lazy], [busy_gpu], usage, elapsed=0, pod_resources=cut)
    ledger.cycle([lazy], [busy_gpu], usage, pod_resources=cut)
    assert ledger.seconds("lazy") == {"idle": 5.0}  # 10 s x 1/2
    instance = alloc("nb", "MIG-a", "GPU-0", mig="MIG-a")
    quiet = gpu(0, sm=0.9, migs=[mig("MIG-a", "1g.10gb", None)])
    assert state_after_one_step(instance, [quiet], [use("nb", "GPU-0", None, mig="MIG-a")]) == {
        "unknown": pytest.approx(10 / 7)
    }


def test_a_device_that_stops_resolving_keeps_its_weight_and_counts_as_unknown() -> None:
    ledger = Ledger()
    held = alloc("nb", "MIG-a", "GPU-0", mig="MIG-a")
    on = [gpu(0, migs=[mig("MIG-a", "3g.40gb", 0.5)])]
    ledger.cycle([held], on, [use("nb", "GPU-0", None, mig="MIG-a")], elapsed=0)
    ledger.cycle([held], on, [use("nb", "GPU-0", None, mig="MIG-a")])
    gone = replace(held, device=DeviceRef(None, None))  # the instance is no longer listed
    ledger.cycle([gone], [], [])
    assert ledger.seconds("nb") == {"busy": pytest.approx(30 / 7), "unknown": pytest.approx(30 / 7)}
    # a device never sized has no ledger at all rather than a guessed one
    fresh = Ledger()
    fresh.cycle([alloc("x", "weird-id", None)], [], elapsed=0)
    assert fresh.cycle([alloc("x", "weird-id", None)], []).allocations == ()


# -- weights ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("allocations", "gpus", "pod_resources", "expected"),
    [
        ([alloc("p", "GPU-0", "GPU-0")], [gpu(0, sm=0.5)], LISTED, 1.0),
        (
            [alloc("p", "MIG-a", "GPU-0", mig="MIG-a")],
            [gpu(0, migs=[mig("MIG-a", "3g.40gb", 0.5)])],
            LISTED,
            3 / 7,
        ),
        (  # a compute instance of 1 slice inside a 3g GPU instance
            [alloc("p", "MIG-a", "GPU-0", mig="MIG-a")],
            [gpu(0, migs=[mig("MIG-a", "1c.3g.40gb", 0.5)])],
            LISTED,
            1 / 7,
        ),
        (  # an A30 has 4 compute slices
            [alloc("p", "MIG-a", "GPU-0", mig="MIG-a")],
            [gpu(0, name="NVIDIA A30", migs=[mig("MIG-a", "2g.12gb", 0.5)])],
            LISTED,
            2 / 4,
        ),
        (  # the kubelet advertises 4 replicas of GPU-0; one is held
            [alloc("p", "GPU-0::2", "GPU-0", shared=True)],
            [gpu(0, sm=0.5)],
            allocatable("GPU-0::0", "GPU-0::1", "GPU-0::2", "GPU-0::3", "GPU-1"),
            1 / 4,
        ),
        (  # the kubelet cannot say: the allocations on the GPU (here 2) cut it
            [
                alloc("p", "GPU-0::0", "GPU-0", shared=True),
                alloc("q", "GPU-0::1", "GPU-0", shared=True),
            ],
            [gpu(0, sm=0.5)],
            LISTED,
            1 / 2,
        ),
        (  # a replica of a MIG instance is both
            [alloc("p", "MIG-a::0", "GPU-0", mig="MIG-a", shared=True)],
            [gpu(0, migs=[mig("MIG-a", "2g.20gb", 0.5)])],
            allocatable("MIG-a::0", "MIG-a::1"),
            2 / 7 / 2,
        ),
    ],
    ids=["whole", "mig-3g", "mig-1c.3g", "mig-a30", "replica-of-4", "replicas-held", "mig-replica"],
)
def test_gpu_equivalent_weights(
    allocations: list[Allocation],
    gpus: list[GpuSample],
    pod_resources: PodResourcesSnapshot | None,
    expected: float,
) -> None:
    ledger = Ledger()
    ledger.cycle(allocations, gpus, elapsed=0, pod_resources=pod_resources)
    state = ledger.cycle(allocations, gpus, elapsed=10, pod_resources=pod_resources)
    entry = state.allocations[0]
    assert entry.weight == pytest.approx(expected)
    assert entry.allocated_seconds == pytest.approx(10 * expected)


def test_mig_slices_of_profiles_and_gpus() -> None:
    assert [compute_slices(p) for p in ("1g.10gb", "3g.40gb", "7g.80gb", "1c.3g.40gb")] == [
        1,
        3,
        7,
        1,
    ]
    assert compute_slices("1g.10gb+me") == 1 and compute_slices("weird") is None
    assert gpu_slices(gpu(0, name="NVIDIA A30")) == 4
    assert gpu_slices(gpu(0, name="NVIDIA H200")) == 7
    assert gpu_slices(gpu(0, name="something new")) == 7


# -- conservation and gaps ---------------------------------------------------------------


def test_states_sum_to_the_gpu_equivalent_time_held_through_every_state() -> None:
    """Eleven cycles through every state, a gap and a replica count that changes: for each
    allocation the states sum to sum(step x weight) computed here, step by step."""
    whole = alloc("whole", "GPU-0", "GPU-0")
    part = alloc("part", "MIG-a", "GPU-1", mig="MIG-a")
    replica = alloc("replica", "GPU-2::0", "GPU-2", shared=True)
    allocations = [whole, part, replica]
    usage = [use("whole", "GPU-0", 0.5), use("part", "GPU-1", None, mig="MIG-a")]
    usage += [use("replica", "GPU-2", 0.3)]
    healthy = [gpu(0, sm=0.5), gpu(1, migs=[mig("MIG-a", "2g.20gb", 0.5)]), gpu(2, sm=0.5)]
    schedule: list[tuple[float, list[GpuSample], list[ContainerGpuUsage], list[GpuHealth]]] = [
        (0, healthy, usage, []),
        (10, healthy, usage, []),
        (5, [replace(g, occupancy=Occupancy("gpm", sm_active=0.01)) for g in healthy], usage, []),
        (10, healthy, [], []),  # no processes anywhere
        (7, healthy, usage, [unhealthy(0), unhealthy(1), unhealthy(2)]),
        (600, healthy, usage, []),  # the exporter was down: not counted
        (10, [healthy[2]], usage, []),  # GPUs 0 and 1 not listed
        (10, [replace(g, processes_listed=False) for g in healthy], usage, []),
        (3, healthy, usage, []),
        (10, [gpu(0, error="GpuIsLost", lost=True), *healthy[1:]], usage, [unhealthy(0)]),
        (10, healthy, usage, []),
    ]
    cuts = [allocatable("GPU-2::0", "GPU-2::1")] * 6 + [
        allocatable(*[f"GPU-2::{i}" for i in range(5)])
    ] * 5
    weights = {"whole": [1.0] * 11, "part": [2 / 7] * 11, "replica": [1 / 2] * 6 + [1 / 5] * 5}
    ledger = Ledger()
    expected: dict[str, float] = defaultdict(float)
    seen: dict[str, set[str]] = defaultdict(set)
    for i, ((elapsed, gpus, used, health), cut) in enumerate(zip(schedule, cuts, strict=True)):
        state = ledger.cycle(
            allocations, gpus, used, elapsed=elapsed, health=health, pod_resources=cut
        )
        step = elapsed if elapsed <= POLICY.max_gap_s else 0.0
        for entry in state.allocations:
            pod = entry.container.pod
            expected[pod] += step * weights[pod][i]
            seen[pod].add(entry.state)
            assert sum(s for _, s in entry.seconds) == pytest.approx(expected[pod])
            assert entry.allocated_seconds == pytest.approx(expected[pod])
            assert [s for s, _ in entry.seconds] == list(LEDGER_STATES)
    assert seen["whole"] == set(LEDGER_STATES)
    assert expected["whole"] == pytest.approx(75.0)


def test_gaps_and_the_first_cycle_add_nothing_and_a_gone_allocation_takes_its_counters() -> None:
    held = [alloc("p", "GPU-0", "GPU-0")]
    gpus = [gpu(0, sm=0.5, energy_mj=0)]
    usage = [use("p", "GPU-0", 0.5)]
    ledger = Ledger()
    assert ledger.cycle(held, gpus, usage, elapsed=0).allocations[0].allocated_seconds == 0
    ledger.cycle(held, [gpu(0, sm=0.5, energy_mj=1_000_000)], usage, elapsed=61)  # over 60 s
    assert ledger.seconds("p") == {} and ledger.joules() == {"p": 0.0}
    ledger.cycle(held, [gpu(0, sm=0.5, energy_mj=1_500_000)], usage, elapsed=60)  # up to 60 s
    assert ledger.seconds("p") == {"busy": 60.0} and ledger.joules() == {"p": 500.0}
    ledger.cycle([], gpus, [], elapsed=10)  # the pod went: its counters end with it
    assert ledger.state.allocations == () and ledger.state.energy == ()
    ledger.cycle(held, [gpu(0, sm=0.5, energy_mj=1_600_000)], usage, elapsed=10)
    assert ledger.seconds("p") == {"busy": 10.0}  # back: a new allocation from 0


# -- energy ----------------------------------------------------------------------------


def energy_step(
    allocations: Sequence[Allocation],
    before: Sequence[GpuSample],
    after: Sequence[GpuSample],
    usage: Sequence[ContainerGpuUsage],
    elapsed: float = 10.0,
) -> dict[str, float]:
    ledger = Ledger()
    ledger.cycle(allocations, before, usage, elapsed=0)
    ledger.cycle(allocations, after, usage, elapsed=elapsed)
    return ledger.joules()


def test_an_exclusive_container_gets_the_whole_delta_even_with_a_leak_on_its_gpu() -> None:
    usage = [use("owner", "GPU-0", 0.1), use("leaker", "GPU-0", 0.8)]
    joules = energy_step(
        [alloc("owner", "GPU-0", "GPU-0")],
        [gpu(0, sm=0.9, energy_mj=5_000_000)],
        [gpu(0, sm=0.9, energy_mj=8_000_000)],
        usage,
    )
    assert joules == {"owner": 3000.0}
    # holding a GPU it does not use: still all of it (an idle GPU draws power for it)
    held = [alloc("owner", "GPU-0", "GPU-0")]
    before, after = gpu(0, sm=0.0, energy_mj=0), gpu(0, sm=0.0, energy_mj=700_000)
    assert energy_step(held, [before], [after], []) == {"owner": 700.0}


def test_a_time_sliced_gpu_is_split_by_sm_time_share_and_sums_to_the_delta() -> None:
    held = [alloc(p, f"GPU-0::{i}", "GPU-0", shared=True) for i, p in enumerate("abcd")]
    usage = [use("a", "GPU-0", 0.6), use("b", "GPU-0", 0.3), use("c", "GPU-0", None)]
    usage.append(use("d", "GPU-0", 0.1))
    joules = energy_step(held, [gpu(0, energy_mj=0)], [gpu(0, energy_mj=4_000_000)], usage)
    assert joules == pytest.approx({"a": 2400.0, "b": 1200.0, "c": 0.0, "d": 400.0})
    assert sum(joules.values()) == pytest.approx(4000.0)
    # nobody had SM time in the samples: nothing to split by, nothing counted
    quiet = [use(p, "GPU-0", 0.0) for p in "abcd"]
    assert energy_step(held, [gpu(0, energy_mj=0)], [gpu(0, energy_mj=4_000_000)], quiet) == {
        p: 0.0 for p in "abcd"
    }


def test_a_mig_gpu_is_split_by_instance_activity_times_slices() -> None:
    held = [
        alloc("big", "MIG-a", "GPU-0", mig="MIG-a"),
        alloc("small", "MIG-b", "GPU-0", mig="MIG-b"),
        alloc("idle", "MIG-c", "GPU-0", mig="MIG-c"),
    ]
    instances = [mig("MIG-a", "3g.40gb", 0.5), mig("MIG-b", "1g.10gb", 0.5)]
    instances.append(mig("MIG-c", "2g.20gb", 0.0))
    before, after = gpu(0, energy_mj=0, migs=instances), gpu(0, energy_mj=2_000_000, migs=instances)
    joules = energy_step(held, [before], [after], [])
    # weights 0.5 x 3 and 0.5 x 1 of 2.0
    assert joules == pytest.approx({"big": 1500.0, "small": 500.0, "idle": 0.0})
    # one held instance without an activity signal: no part can be known
    blind = [*instances[:2], mig("MIG-c", "2g.20gb", None)]
    blind_after = gpu(0, energy_mj=2_000_000, migs=blind)
    assert energy_step(held, [before], [blind_after], []) == {"big": 0, "small": 0, "idle": 0}


def test_a_counter_that_goes_back_or_is_missing_is_not_counted() -> None:
    held, usage = [alloc("p", "GPU-0", "GPU-0")], [use("p", "GPU-0", 0.5)]
    ledger = Ledger()
    for energy_mj in (9_000_000, 1_000, 3_001_000, None, 4_001_000, 5_001_000):
        ledger.cycle(held, [gpu(0, sm=0.5, energy_mj=energy_mj)], usage, elapsed=5)
    # 9 MJ -> 1 kJ is a reset (a driver reload): not a delta; 1 kJ -> 3001 kJ counts; no
    # reading, then the first reading after it: no delta; 4001 -> 5001 kJ counts
    assert ledger.joules() == {"p": pytest.approx(4000.0)}
    # a GPU with no energy counter has no series (unknown), not 0
    none = Ledger()
    none.cycle(held, [gpu(0, sm=0.5)], usage, elapsed=0)
    assert none.cycle(held, [gpu(0, sm=0.5)], usage).energy == ()


# -- what is not known is carried (hostile inputs, through analyse) -------------------


class Node:
    """Cycles of the real analysis (``analyse``) of one node with one GPU model, and the
    ledger and energy series ``build_families`` serves from each."""

    def __init__(self) -> None:
        self.policy = Policy(idle=POLICY)
        self.state = initial_state(self.policy, {})

    def cycle(
        self,
        t: float,
        gpus: Sequence[GpuSample],
        containers: Sequence[ContainerDevices],
        *,
        nvml_ok: bool = True,
        listing_ok: bool = True,
        allocatable: Sequence[str] = (),
    ) -> Analysis:
        listing = PodResourcesSnapshot(
            ok=listing_ok,
            timestamp=t,
            containers=tuple(containers) if listing_ok else (),
            allocatable=(AllocatableDevices("nvidia.com/gpu", tuple(allocatable)),),
            allocatable_ok=bool(allocatable),
        )
        nvml = NvmlSnapshot(ok=nvml_ok, timestamp=t, gpus=tuple(gpus) if nvml_ok else ())
        snapshot = NodeSnapshot("n", nvml, timestamp=t, pod_resources=listing)
        analysis, self.state = analyse(snapshot, self.state, self.policy)
        return analysis


def served(analysis: Analysis, family: str) -> dict[tuple[tuple[str, str], ...], float]:
    """The samples of one family, by their full label set (a duplicate would fail)."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for metric in build_families(analysis, ExpositionOptions()):
        for sample in metric.samples:
            if sample.name == family:
                key = tuple(sorted(sample.labels.items()))
                assert key not in out, f"duplicate series {key}"
                out[key] = sample.value
    return out


def holder(pod: str, resource: str, *ids: str) -> ContainerDevices:
    return ContainerDevices("ns", pod, "c", resource, ids)


def test_a_series_keeps_its_labels_and_total_while_nvml_does_not_list_its_gpu() -> None:
    """NVML down for one cycle: the whole GPU's and the MIG instance's series keep their
    label sets (gpu index, uuid, MIG labels) and totals; the step goes to unknown."""
    instance = mig("MIG-a", "3g.40gb", 0.5)
    holders = [
        holder("whole", "nvidia.com/gpu", "GPU-1"),
        holder("part", "nvidia.com/mig-3g.40gb", "MIG-a"),
    ]
    node = Node()
    ledger_keys: set[tuple[tuple[str, str], ...]] = set()
    energy_keys: set[tuple[tuple[str, str], ...]] = set()
    last: dict[tuple[tuple[str, str], ...], float] = {}
    for t, up in [(0, True), (10, True), (20, True), (30, False), (40, True), (50, True)]:
        gpus = [gpu(0, energy_mj=t * 100_000, migs=[instance]), gpu(1, energy_mj=t * 100_000)]
        analysis = node.cycle(t, gpus, holders, nvml_ok=up)
        ledger = served(analysis, "gpu_container_allocated_gpu_seconds_total")
        energy = served(analysis, "gpu_container_energy_joules_total")
        assert len(ledger) == 2 * len(LEDGER_STATES) and len(energy) == 2
        ledger_keys.update(ledger)
        energy_keys.update(energy)
        for key, value in {**ledger, **energy}.items():
            assert value >= last.get(key, 0.0), key  # no counter goes back
            last[key] = value
    assert len(ledger_keys) == 2 * len(LEDGER_STATES) and len(energy_keys) == 2
    part = dict(next(k for k in energy_keys if dict(k)["pod"] == "part"))
    assert part["gpu"] == "0" and part["uuid"] == "GPU-0" and part["mig_profile"] == "3g.40gb"
    unknown = {dict(k)["pod"]: v for k, v in last.items() if dict(k).get("state") == "unknown"}
    assert unknown == {"whole": 10.0, "part": pytest.approx(30 / 7)}
    # the delta across the outage spans two cycles and is not counted; the rest is
    assert {dict(k)["pod"]: v for k, v in last.items() if "state" not in dict(k)} == {
        "whole": pytest.approx(3000.0),
        "part": pytest.approx(3000.0),
    }


def test_a_failed_podresources_listing_carries_every_row_as_unknown() -> None:
    """One failed listing: the rows stay (ledger in unknown, energy and idle time as they
    were); a listing that worked and no longer has the container ends them."""
    held = [holder("p", "nvidia.com/gpu", "GPU-0")]
    node = Node()
    for t in (0, 10, 20):
        analysis = node.cycle(t, [gpu(0, sm=0.0, energy_mj=t * 100_000)], held)
    blip = node.cycle(30, [gpu(0, sm=0.0, energy_mj=3_000_000)], held, listing_ok=False)
    (row,) = blip.ledger
    assert {s: v for s, v in row.seconds if v} == {"no_process": 20.0, "unknown": 10.0}
    assert [e.joules_total for e in blip.energy] == [2000.0]  # not split: nothing added
    assert [i.idle_seconds_total for i in blip.idle] == [20.0]
    assert (
        served(blip, "gpu_container_allocated_gpu_seconds_total").keys()
        == served(analysis, "gpu_container_allocated_gpu_seconds_total").keys()
    )
    after = node.cycle(40, [gpu(0, sm=0.0, energy_mj=4_000_000)], held)
    (row,) = after.ledger
    assert {s: v for s, v in row.seconds if v} == {"no_process": 30.0, "unknown": 10.0}
    assert [e.joules_total for e in after.energy] == [3000.0]  # 30 -> 40 s only
    assert [i.idle_seconds_total for i in after.idle] == [30.0]
    gone = node.cycle(50, [gpu(0, sm=0.0, energy_mj=5_000_000)], [])
    assert gone.ledger == () and gone.energy == () and gone.idle == ()


def test_activity_that_is_not_a_number_is_no_signal() -> None:
    """NaN from GPM (or DCGM) is unknown, never idle; a MIG GPU's energy is then not
    split, and never becomes NaN."""
    nan = float("nan")
    assert state_after_one_step(
        alloc("p", "GPU-0", "GPU-0"), [gpu(0, sm=nan)], [use("p", "GPU-0", 0.5)]
    ) == {"unknown": 10.0}
    held = [alloc("a", "MIG-a", "GPU-0", mig="MIG-a"), alloc("b", "MIG-b", "GPU-0", mig="MIG-b")]
    instances = [mig("MIG-a", "3g.40gb", nan), mig("MIG-b", "3g.40gb", 0.5)]
    ledger = Ledger()
    for t in range(3):
        ledger.cycle(held, [gpu(0, energy_mj=1_000_000 * t, migs=instances)], elapsed=10)
    assert ledger.joules() == {"a": 0.0, "b": 0.0}


def test_a_replica_keeps_its_weight_while_the_kubelet_cannot_say_how_many_there_are() -> None:
    held = [alloc(p, f"GPU-0::{i}", "GPU-0", shared=True) for i, p in enumerate("ab")]
    four = allocatable(*[f"GPU-0::{i}" for i in range(4)])
    failed = replace(four, allocatable_ok=False, allocatable=())
    ledger = Ledger()
    for cut in (four, four, failed, four, failed):
        state = ledger.cycle(held, [gpu(0, sm=0.5)], pod_resources=cut)
        assert [e.weight for e in state.allocations] == [0.25, 0.25]
    assert ledger.entry("a").allocated_seconds == pytest.approx(12.5)  # 5 steps x 10 s / 4


def test_a_clock_that_steps_back_adds_nothing_until_it_has_caught_up() -> None:
    held = [holder("p", "nvidia.com/gpu", "GPU-0")]
    node = Node()
    for t in (100, 110, 80, 118):
        analysis = node.cycle(t, [gpu(0, sm=0.5)], held)
    assert analysis.ledger[0].allocated_seconds == 18.0  # the wall span 100 -> 118
    # a clock reset far back (over the gap bound) is a gap: counting starts again
    for t in (1_000, 300, 310):
        analysis = node.cycle(t, [gpu(0, sm=0.5)], held)
    assert analysis.ledger[0].allocated_seconds == 28.0


def test_an_energy_delta_no_gpu_could_draw_is_not_counted() -> None:
    held, usage = [alloc("p", "GPU-0", "GPU-0")], [use("p", "GPU-0", 0.5)]
    ledger = Ledger()
    # 700 W limit, 10 s steps: at most 2 x 700 W x 10 s = 14 kJ a step
    for energy_mj in (0, 14_000_000, 28_000_001, 28_000_002, 10**15):
        reading = gpu(0, sm=0.5, energy_mj=energy_mj, power_limit_milliwatts=700_000)
        ledger.cycle(held, [reading], usage)
    assert ledger.joules() == {"p": pytest.approx(14_000.001)}
    # no power limit: 2 x 1,500 W
    unbounded = Ledger()
    for energy_mj in (0, 30_000_000, 60_000_001):
        unbounded.cycle(held, [gpu(0, sm=0.5, energy_mj=energy_mj)], usage)
    assert unbounded.joules() == {"p": 30_000.0}


def test_one_device_listed_twice_for_a_container_is_held_once() -> None:
    """nvidia.com/gpu and nvidia.com/gpu.shared naming one id: one row, weight 1, and no
    duplicate series (``served`` fails on one)."""
    twice = [
        holder("p", "nvidia.com/gpu", "GPU-0"),
        holder("p", "nvidia.com/gpu.shared", "GPU-0"),
    ]
    node = Node()
    for t in (0, 10, 20):
        analysis = node.cycle(t, [gpu(0, sm=0.5, energy_mj=t * 1000)], twice)
    assert [(e.device_id, e.weight, e.allocated_seconds) for e in analysis.ledger] == [
        ("GPU-0", 1.0, 20.0)
    ]
    assert [i.idle_seconds_total for i in analysis.idle] == [20.0]  # no process: idle
    assert len(served(analysis, "gpu_container_allocated_gpu_seconds_total")) == 5
    assert len(served(analysis, "gpu_container_idle_allocated_seconds_total")) == 1


def test_a_profile_larger_than_its_gpu_does_not_shrink_its_siblings() -> None:
    instances = [mig("MIG-a", "3g.40gb", 0.5), mig("MIG-z", "999g.1gb", 0.5)]
    instances.append(mig("MIG-y", "8g.90gb", 0.5))
    odd = gpu(0, energy_mj=0, migs=instances)
    assert gpu_slices(odd) == 7
    held = [
        alloc(p, u, "GPU-0", mig=u) for p, u in (("a", "MIG-a"), ("z", "MIG-z"), ("y", "MIG-y"))
    ]
    ledger = Ledger()
    ledger.cycle(held, [odd], elapsed=0)
    state = ledger.cycle(held, [replace(odd, energy_millijoules=1_000_000)])
    assert [(e.container.pod, e.weight) for e in state.allocations] == [("a", 3 / 7)]
    assert ledger.joules() == {"a": 1000.0}  # the odd ones have no size: no part
    assert compute_slices("9" * 5000 + "g.x") is None and compute_slices("4c.3g.40gb") is None


# -- the real exporter on the shipped scenarios ----------------------------------------

SCENARIOS = ("single-gpu", "node-8gpu", "no-gpu", "orphans", "gke-timesharing", "dra")
STEP_S = 5.0
_REPLICA = re.compile(r"^(?P<base>.+?)(?:::\d+|/vgpu\d+)$")


def _key(labels: dict[str, str]) -> tuple[str, str, str, str]:
    return labels["namespace"], labels["pod"], labels["container"], labels["device_id"]


def expected_weights(scrape: Scrape, advertised: Sequence[str]) -> dict[tuple[str, ...], float]:
    """Each served allocation's weight, worked out here from its labels and what the
    simulated kubelet advertises (not from the exporter's code): a MIG profile's "Ng"
    over 7 (the simulated GPUs are H100s), a replica id 1 over the replica ids of its
    device, a DRA claim several containers share 1 over those containers."""
    rows = [labels for labels, _ in scrape.find("gpu_container_allocated")]
    per_id: dict[str, int] = defaultdict(int)
    for labels in rows:
        per_id[labels["device_id"]] += 1
    out: dict[tuple[str, ...], float] = {}
    for labels in rows:
        device_id = labels["device_id"]
        size = int(labels["mig_profile"].split("g.")[0]) / 7 if labels.get("mig_profile") else 1.0
        replica = _REPLICA.match(device_id)
        if replica is not None:
            base = replica["base"]
            size /= sum(1 for d in advertised if (m := _REPLICA.match(d)) and m["base"] == base)
        elif per_id[device_id] > 1:
            size /= per_id[device_id]
        out[_key(labels)] = size
    return out


def state_sums(scrape: Scrape) -> dict[tuple[str, ...], float]:
    sums: dict[tuple[str, ...], float] = defaultdict(float)
    for labels, value in scrape.find("gpu_container_allocated_gpu_seconds_total"):
        sums[_key(labels)] += value
    return dict(sums)


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS)
async def test_served_states_sum_to_the_time_held_on_every_shipped_scenario(scenario: str) -> None:
    """The golden schedule (5 s cycles to 160 s; node-8gpu on to 210 s, past the pods its
    timeline adds at 170 s and a replica count that grows from 4 to 5), the kubelet asked
    before every cycle: every allocation served at any cycle has all five states, and
    they add up to sum(5 s x its weight) over the cycles it was held."""
    cycles = 42 if scenario == "node-8gpu" else 32
    held: dict[tuple[str, ...], float] = defaultdict(float)
    async with simulated_exporter(scenario) as h:
        for _ in range(cycles):
            await h.advance(STEP_S, cycle=False)
            await h.refresh_pod_resources()
            await h.cycle()
            scrape = await h.scrape()
            advertised = [d for a in h.env.node.allocatable_devices() for d in a.device_ids]
            for key, size in expected_weights(scrape, advertised).items():
                held[key] += STEP_S * size
            sums = state_sums(scrape)
            assert set(sums) == set(expected_weights(scrape, advertised))
            for key, total in sums.items():
                assert total == pytest.approx(held[key]), key
            for labels, _ in scrape.find("gpu_container_allocated"):
                states = {
                    lab["state"]
                    for lab, _ in scrape.find(
                        "gpu_container_allocated_gpu_seconds_total",
                        pod=labels["pod"],
                        device_id=labels["device_id"],
                    )
                }
                assert states == set(LEDGER_STATES)
    if scenario != "no-gpu":
        assert held, "no allocation served"
    if scenario == "node-8gpu":  # the pods added at 170 s were held and counted
        assert any(key[1] == "batch-hog" and time > 0 for key, time in held.items())


@pytest.mark.slow
async def test_node_8gpu_ledger_and_energy_after_the_golden_schedule() -> None:
    """node-8gpu after the golden copy's schedule (32 cycles, 5 s apart): the states per
    pod, and every GPU's energy delta given out whole to its holders (the lost GPU 7 up
    to its last reading)."""
    async with simulated_exporter("node-8gpu") as h:
        first = await h.scrape()
        last_energy = _gpu_energy(first)
        for _ in range(32):
            await h.advance(STEP_S)
            scrape = await h.scrape()
            last_energy.update(_gpu_energy(scrape))
    per_pod: dict[str, dict[str, float]] = defaultdict(dict)
    for labels, value in scrape.find("gpu_container_allocated_gpu_seconds_total"):
        if value:
            per_pod[labels["pod"]][labels["state"]] = round(value, 3)
    assert per_pod["llm-pretrain-0"] == {"busy": 135.0, "unhealthy": 25.0}  # reset asked at 140
    assert per_pod["leaky-shell"] == {"idle": 145.0, "unhealthy": 15.0}  # lost at 151
    assert per_pod["tiny-kernels"] == {"idle": 160.0}  # 100 % GPU-Util, 2 % SM active
    assert per_pod["alice-jupyter"] == {"busy": round(160 * 3 / 7, 3)}
    assert per_pod["chat-a"] == {"busy": 40.0}  # one of 4 replicas
    assert per_pod["embedder-0"] == {"busy": 16.0}  # one of 10
    holders: dict[str, float] = defaultdict(float)
    for labels, value in scrape.find("gpu_container_energy_joules_total"):
        holders[labels["uuid"]] += value
    start = _gpu_energy(first)
    assert len(holders) == 8
    for uuid, given in holders.items():
        assert given == pytest.approx(last_energy[uuid] - start[uuid]), uuid
        assert given > 0


def _gpu_energy(scrape: Scrape) -> dict[str, float]:
    return {labels["uuid"]: v for labels, v in scrape.find("gpu_energy_joules_total")}
