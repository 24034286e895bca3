"""Why idle (exporter/analysis/why_idle.py) and the ledger's idle time by cause.

Pure tests of the window shares and the cause (counter resets, no periods, no PSI,
cgroup v1), then the split through the ledger and through ``analyse``: for every
allocation, at every cycle, the causes sum to its idle + no_process seconds.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable, Mapping

import pytest

from exporter.agent import policy_from
from exporter.analysis.cgroup_signals import cgroup_signals
from exporter.analysis.idle import IdlePolicy
from exporter.analysis.ledger import account_ledger
from exporter.analysis.pipeline import Policy, analyse, initial_state
from exporter.analysis.why_idle import (
    WhyIdlePolicy,
    cause_of,
    readings_by_key,
    stall_share,
    throttled_share,
    why_idle,
)
from exporter.config import ConfigError, parse_config
from exporter.exposition.metrics import ExpositionOptions, build_families
from exporter.model import (
    IDLE_CAUSES,
    Allocation,
    Analysis,
    AttributedProcess,
    Attribution,
    CgroupSnapshot,
    CgroupStats,
    ContainerDevices,
    ContainerGpuUsage,
    ContainerRef,
    DeviceRef,
    GpuSample,
    IdleCause,
    IdleReason,
    LedgerState,
    NodeSnapshot,
    NvmlSnapshot,
    Occupancy,
    PodMeta,
    PodMetaSnapshot,
    PodResourcesSnapshot,
    Pressure,
    ProcessIdentity,
)
from exporter.snapshot import render_json, render_text, why_idle_text
from tests.harness import Scrape, simulated_exporter

POLICY = WhyIdlePolicy(throttled_ratio=0.2, pressure_ratio=0.2)
IDLE = IdlePolicy(threshold_ratio=0.05, max_gap_s=60.0)


def stats(
    periods: int | None = None,
    throttled: int | None = None,
    *,
    cpu_us: int | None = None,
    io_us: int | None = None,
    version: int = 2,
    container_id: str = "c1",
) -> CgroupStats:
    return CgroupStats(
        "uid-1",
        container_id,
        version,
        nr_periods=periods,
        nr_throttled=throttled,
        throttled_usec=None,
        cpu_pressure=Pressure(cpu_us, None) if cpu_us is not None else None,
        io_pressure=Pressure(io_us, None) if io_us is not None else None,
    )


# -- shares ----------------------------------------------------------------------------


def test_the_throttled_share_is_periods_throttled_over_periods_in_the_window() -> None:
    assert throttled_share(stats(1000, 100), stats(1050, 120)) == pytest.approx(0.4)
    assert throttled_share(stats(1000, 100), stats(1050, 100)) == 0.0  # measured: none


@pytest.mark.parametrize(
    ("before", "now", "why"),
    [
        (stats(1000, 100), stats(1000, 100), "no period in the window: no quota or nothing ran"),
        (stats(1000, 100), stats(40, 10), "counters went back: the cgroup was recreated"),
        (stats(1000, 100), stats(1050, 90), "throttled went back alone"),
        (stats(1000, 100), stats(1010, 150), "more periods throttled than periods"),
        (stats(None, None), stats(1050, 120), "no cpu.stat before"),
        (stats(1000, 100), stats(1050, None), "a line missing now"),
    ],
)
def test_a_throttled_share_that_cannot_be_measured_is_unknown_not_zero(
    before: CgroupStats, now: CgroupStats, why: str
) -> None:
    assert throttled_share(before, now) is None, why


def test_a_stall_share_is_stall_time_over_the_window() -> None:
    assert stall_share(Pressure(1_000_000), Pressure(3_000_000), 5.0) == pytest.approx(0.4)
    # read a moment after the timestamp: a little over the window is clamped to 1
    assert stall_share(Pressure(0), Pressure(5_200_000), 5.0) == 1.0


@pytest.mark.parametrize(
    ("before", "now", "window_s"),
    [
        (None, Pressure(1), 5.0),  # no PSI before (or a kernel without it)
        (Pressure(1), None, 5.0),
        (Pressure(None), Pressure(10), 5.0),  # the some line absent
        (Pressure(3_000_000), Pressure(1_000), 5.0),  # went back: recreated cgroup
        (Pressure(0), Pressure(1_000), 0.0),  # no window
        (Pressure(0), Pressure(20_000_000), 5.0),  # 4 s per second: no reading
    ],
)
def test_a_stall_share_that_cannot_be_measured_is_unknown(
    before: Pressure | None, now: Pressure | None, window_s: float
) -> None:
    assert stall_share(before, now, window_s) is None


@pytest.mark.parametrize(
    ("throttled", "cpu", "io", "cause"),
    [
        (0.41, 0.35, 0.5, "cpu_throttled"),  # first that applies
        (0.2, 0.35, 0.5, "cpu_pressure"),  # at the threshold is not over it
        (0.1, 0.1, 0.5, "io_pressure"),
        (0.1, 0.1, 0.1, "unknown"),
        (None, 0.3, None, "cpu_pressure"),  # an unknown share gives no cause; others can
        (0.3, None, None, "cpu_throttled"),  # cgroup v1: throttling only
        (None, None, None, "unknown"),
    ],
)
def test_the_cause_is_the_first_share_over_its_threshold(
    throttled: float | None, cpu: float | None, io: float | None, cause: IdleCause
) -> None:
    assert cause_of(throttled, cpu, io, POLICY) == cause


def test_thresholds_come_from_the_policy() -> None:
    assert cause_of(0.3, None, None, WhyIdlePolicy(throttled_ratio=0.5)) == "unknown"
    assert cause_of(None, 0.1, None, WhyIdlePolicy(pressure_ratio=0.05)) == "cpu_pressure"


def test_a_pressure_share_exactly_at_the_ratio_is_no_pressure() -> None:
    """docs/metrics.md: a pressure cause needs a stall share *over* the ratio; at it
    (values binary floating point holds exactly, so equality is not luck) is none."""
    quarter = WhyIdlePolicy(throttled_ratio=0.5, pressure_ratio=0.25)
    assert cause_of(None, 0.25, None, quarter) == "unknown"
    assert cause_of(None, None, 0.25, quarter) == "unknown"
    assert cause_of(0.5, 0.25, 0.25, quarter) == "unknown"
    assert cause_of(None, 0.25, 0.375, quarter) == "io_pressure"  # cpu at the line: not it
    assert cause_of(None, 0.375, 0.25, quarter) == "cpu_pressure"


# -- containers, windows, naming -------------------------------------------------------

META = PodMetaSnapshot(
    ok=True,
    timestamp=0,
    pods=(PodMeta("uid-1", "train", "loader-0", containers=(("c1", "main"),)),),
)
MAIN = ContainerRef("train", "loader-0", "main")


def read(t: float, *containers: CgroupStats, ok: bool = True) -> CgroupSnapshot:
    return CgroupSnapshot(ok=ok, timestamp=t, containers=containers)


def judge(
    previous: Mapping[tuple[str, str], CgroupStats],
    previous_t: float | None,
    cgroups: CgroupSnapshot | None,
) -> tuple[IdleReason, ...]:
    """``why_idle`` with the containers named as the pod watch (META) names them."""
    snapshot = NodeSnapshot("n", NvmlSnapshot(ok=True, timestamp=0), pod_meta=META, cgroups=cgroups)
    signals = cgroup_signals(snapshot, Attribution())
    return why_idle(previous, previous_t, cgroups, signals, POLICY)


def test_a_window_needs_two_readings_of_the_same_cgroup() -> None:
    first = read(100.0, stats(1000, 100, cpu_us=0))
    (reason,) = judge({}, None, first)
    assert reason == IdleReason(MAIN, "unknown", None, None, None)  # nothing to compare
    then = read(105.0, stats(1050, 120, cpu_us=1_750_000))
    (reason,) = judge(readings_by_key(first), 100.0, then)
    assert reason.cause == "cpu_throttled"
    assert reason.throttled_ratio == pytest.approx(0.4)
    assert reason.cpu_pressure_ratio == pytest.approx(0.35)
    assert reason.io_pressure_ratio is None  # io.pressure not read: unknown, not 0


def test_cgroup_v1_judges_throttling_only_and_a_version_change_is_no_window() -> None:
    v1 = read(0.0, stats(1000, 100, version=1))
    (reason,) = judge(readings_by_key(v1), 0.0, read(5.0, stats(1100, 105, version=1)))
    assert reason.cause == "unknown" and reason.throttled_ratio == pytest.approx(0.05)
    assert reason.cpu_pressure_ratio is None and reason.io_pressure_ratio is None
    moved = read(5.0, stats(1100, 160, cpu_us=5, version=2))
    (reason,) = judge(readings_by_key(v1), 0.0, moved)
    assert reason == IdleReason(MAIN, "unknown", None, None, None)


def test_a_restarted_container_has_an_unknown_window_then_a_new_one() -> None:
    before = readings_by_key(read(0.0, stats(1000, 300)))
    (reason,) = judge(before, 0.0, read(5.0, stats(10, 8)))  # counters reset
    assert reason.cause == "unknown" and reason.throttled_ratio is None
    after = readings_by_key(read(5.0, stats(10, 8)))
    (reason,) = judge(after, 5.0, read(10.0, stats(60, 28)))
    assert reason.cause == "cpu_throttled"


def test_no_reading_or_a_source_down_or_an_unnamed_container_gives_no_reason() -> None:
    before = readings_by_key(read(0.0, stats(1000, 100)))
    assert judge(before, 0.0, None) == ()
    assert judge(before, 0.0, read(5.0, stats(1100, 200), ok=False)) == ()
    assert readings_by_key(read(5.0, stats(1, 1), ok=False)) == {}
    stranger = stats(1100, 200, container_id="other")  # read, but nobody can name it
    assert judge(before, 0.0, read(5.0, stranger)) == ()


# -- the split: conservation -----------------------------------------------------------


def _alloc(pod: str, index: int) -> Allocation:
    ref = ContainerRef("ns", pod, "c")
    return Allocation(
        ref, DeviceRef(index, f"GPU-{index}"), f"GPU-{index}", "nvidia.com/gpu", False
    )


def _gpu(index: int, sm: float | None) -> GpuSample:
    occupancy = Occupancy("gpm", sm_active=sm) if sm is not None else None
    return GpuSample(index=index, uuid=f"GPU-{index}", name="NVIDIA H100", occupancy=occupancy)


def idle_and_no_process(seconds: Iterable[tuple[str, float]]) -> float:
    return sum(s for state, s in seconds if state in ("idle", "no_process"))


def test_the_causes_sum_to_idle_and_no_process_over_many_random_cycles() -> None:
    """Random activity, processes, causes, steps (gaps and a failed listing included)
    over 400 cycles of three allocations: every cycle, every row's causes sum to its
    idle + no_process seconds, and each cause only ever grows."""
    rng = random.Random(24)
    pods = ["a", "b", "c"]
    allocations = [_alloc(p, i) for i, p in enumerate(pods)]
    state = LedgerState()
    last: dict[tuple[str, IdleCause], float] = {}
    for _ in range(400):
        gpus = [_gpu(i, rng.choice([None, 0.0, 0.01, 0.5])) for i in range(len(pods))]
        usage = [
            ContainerGpuUsage(a.container, a.device, 1 << 30, None, 1)
            for a in allocations
            if rng.random() < 0.6
        ]
        causes = {a.container: rng.choice(IDLE_CAUSES) for a in allocations if rng.random() < 0.8}
        listing = PodResourcesSnapshot(ok=rng.random() > 0.05, timestamp=0)
        state = account_ledger(
            state,
            allocations,
            usage,
            gpus,
            (),
            listing,
            elapsed_s=rng.choice([0.0, 5.0, 5.0, 7.5, 120.0]),
            policy=IDLE,
            causes=causes,
        )
        assert len(state.allocations) == len(pods)
        for row in state.allocations:
            assert [c for c, _ in row.idle_causes] == list(IDLE_CAUSES)
            total = sum(s for _, s in row.idle_causes)
            assert total == pytest.approx(idle_and_no_process(row.seconds), abs=1e-6)
            for cause, seconds in row.idle_causes:
                key = (row.container.pod, cause)
                assert seconds >= last.get(key, 0.0)
                last[key] = seconds
    assert all(last[(p, c)] > 0 for p in pods for c in IDLE_CAUSES)  # every path was taken


def test_the_cause_goes_only_to_idle_time_of_that_container() -> None:
    """A throttled container: its idle step goes to cpu_throttled; a busy step goes to no
    cause; another container without a reason gets unknown."""
    throttled = ContainerRef("ns", "a", "c")
    allocations = [_alloc("a", 0), _alloc("b", 1)]
    usage = [ContainerGpuUsage(a.container, a.device, 1, None, 1) for a in allocations]
    listed = PodResourcesSnapshot(ok=True, timestamp=0)
    state = LedgerState()
    for sm in (0.0, 0.0, 0.9):  # first cycle counts nothing; idle 10 s; busy 10 s
        gpus = [_gpu(0, sm), _gpu(1, 0.0)]
        state = account_ledger(
            state,
            allocations,
            usage,
            gpus,
            (),
            listed,
            elapsed_s=10.0,
            policy=IDLE,
            causes={throttled: "cpu_throttled"},
        )
    a, b = state.allocations
    assert {c: s for c, s in a.idle_causes if s} == {"cpu_throttled": 20.0}
    assert {c: s for c, s in b.idle_causes if s} == {"unknown": 30.0}


# -- through analyse and exposition ----------------------------------------------------


class Node:
    """Cycles of ``analyse`` for one whole GPU held by train/loader-0 (no process on it:
    the ledger counts no_process), with its cgroup counters."""

    def __init__(self) -> None:
        self.policy = Policy(idle=IDLE, why_idle=POLICY)
        self.state = initial_state(self.policy, {})

    def cycle(self, t: float, cgroups: CgroupSnapshot | None) -> Analysis:
        listing = PodResourcesSnapshot(
            ok=True,
            timestamp=t,
            containers=(
                ContainerDevices("train", "loader-0", "main", "nvidia.com/gpu", ("GPU-0",)),
            ),
        )
        nvml = NvmlSnapshot(ok=True, timestamp=t, gpus=(_gpu(0, 0.0),))
        snapshot = NodeSnapshot(
            "n", nvml, timestamp=t, pod_resources=listing, pod_meta=META, cgroups=cgroups
        )
        analysis, self.state = analyse(snapshot, self.state, self.policy)
        return analysis


def served(analysis: Analysis, family: str) -> dict[str, float]:
    """One allocation's samples of ``family`` by their cause / state label."""
    out: dict[str, float] = {}
    for metric in build_families(analysis, ExpositionOptions()):
        for sample in metric.samples:
            if sample.name == family:
                labels = dict(sample.labels)
                assert labels["pod"] == "loader-0" and labels["uuid"] == "GPU-0"
                out[labels.get("cause") or labels["state"]] = sample.value
    return out


def test_the_served_split_follows_the_cgroup_and_sums_to_the_ledger() -> None:
    """Cycle 0 counts nothing (and has no window); then 5 s each: throttled 10 % (under
    the threshold: unknown); throttled 40 %; the source down (unknown); the first cycle
    after it (no window: unknown); calm (unknown); io-stalled 40 %."""
    node = Node()
    readings: list[CgroupSnapshot | None] = [
        read(1000.0, stats(0, 0, cpu_us=0, io_us=0)),
        read(1005.0, stats(100, 10, cpu_us=0, io_us=0)),
        read(1010.0, stats(200, 50, cpu_us=100_000, io_us=0)),
        read(1015.0, stats(300, 90), ok=False),
        read(1020.0, stats(400, 130, cpu_us=200_000, io_us=0)),
        read(1025.0, stats(500, 140, cpu_us=300_000, io_us=100_000)),
        read(1030.0, stats(600, 150, cpu_us=400_000, io_us=2_100_000)),
    ]
    for i, cgroups in enumerate(readings):
        analysis = node.cycle(5.0 * i, cgroups)
        causes = served(analysis, "gpu_container_idle_gpu_seconds_total")
        states = served(analysis, "gpu_container_allocated_gpu_seconds_total")
        assert set(causes) == set(IDLE_CAUSES)  # every cause from the first cycle, at 0
        assert sum(causes.values()) == pytest.approx(states["idle"] + states["no_process"])
    assert causes == {
        "cpu_throttled": 5.0,
        "cpu_pressure": 0.0,
        "io_pressure": 5.0,
        "unknown": 20.0,
    }
    (reason,) = analysis.why_idle
    assert reason.io_pressure_ratio == pytest.approx(0.4)


def test_the_family_can_be_turned_off() -> None:
    node = Node()
    analysis = node.cycle(0.0, read(0.0, stats(0, 0)))
    options = ExpositionOptions(families=frozenset({"gpu_container_allocated_gpu_seconds"}))
    names = {m.name for m in build_families(analysis, options)}
    assert "gpu_container_idle_gpu_seconds" not in names


# -- flags -----------------------------------------------------------------------------


def test_the_thresholds_are_flags_with_their_defaults() -> None:
    config = parse_config([], env={})
    assert (config.why_idle_throttled_ratio, config.why_idle_pressure_ratio) == (0.2, 0.2)
    config = parse_config(
        ["--why-idle-throttled-ratio", "0.5"], env={"GPU_EXPORTER_WHY_IDLE_PRESSURE_RATIO": "0.1"}
    )
    assert policy_from(config).why_idle == WhyIdlePolicy(throttled_ratio=0.5, pressure_ratio=0.1)
    snapshot = parse_config(["snapshot", "--why-idle-throttled-ratio", "0.3"], env={})
    assert snapshot.why_idle_throttled_ratio == 0.3  # the snapshot's WHY IDLE uses them too


@pytest.mark.parametrize("value", ["0", "1", "-0.1", "1.5", "nan", "inf", "lots"])
@pytest.mark.parametrize("flag", ["--why-idle-throttled-ratio", "--why-idle-pressure-ratio"])
def test_a_threshold_outside_0_to_1_is_one_line_naming_the_flag(flag: str, value: str) -> None:
    with pytest.raises(ConfigError) as raised:
        parse_config([f"{flag}={value}"], env={})
    message = str(raised.value)
    assert "\n" not in message and flag in message and "0.01..0.99" in message


# -- snapshot --------------------------------------------------------------------------


def test_the_snapshot_shows_why_an_idle_allocation_is_idle_with_its_evidence() -> None:
    """The ALLOCATED BUT IDLE table's WHY IDLE column: the cause and its share; unknown
    with the shares measured, or why nothing was (no window yet, no reading)."""
    node = Node()
    node.cycle(0.0, read(1000.0, stats(0, 0, cpu_us=0)))
    first = render_text(node.cycle(5.0, read(1005.0, stats(0, 0, cpu_us=0), ok=False)))
    assert row_of(first) == ["GPU-0", "5", "unknown", "(no", "cgroup", "reading)"]
    node.cycle(10.0, read(1010.0, stats(100, 10, cpu_us=0)))  # no window: down before
    calm = render_text(node.cycle(15.0, read(1015.0, stats(200, 20, cpu_us=50_000))))
    assert "unknown (cpu throttled 10%, cpu pressure 1%)" in calm
    starved = node.cycle(20.0, read(1020.0, stats(300, 61, cpu_us=1_800_000)))
    assert "cpu throttled 41%" in render_text(starved)
    (reason,) = json.loads(render_json(starved))["why_idle"]
    assert reason["cause"] == "cpu_throttled" and reason["throttled_ratio"] == 0.41
    assert reason["pod"] == "loader-0" and reason["io_pressure_ratio"] is None


def row_of(text: str) -> list[str]:
    """The words of the one ALLOCATED BUT IDLE row after its container name."""
    table = text.split("\nALLOCATED BUT IDLE\n")[1].split("\n\n")[0].splitlines()
    assert "WHY IDLE" in table[0]
    (row,) = table[1:]
    return row.split()[3:]


def test_why_idle_text_names_the_share_of_each_cause() -> None:
    assert why_idle_text(IdleReason(MAIN, "cpu_pressure", 0.1, 0.35, None)) == "cpu pressure 35%"
    assert why_idle_text(IdleReason(MAIN, "io_pressure", None, None, 0.5)) == "io pressure 50%"
    assert why_idle_text(IdleReason(MAIN, "unknown", None, None, None)) == "unknown (no window)"


# -- the simulated node ----------------------------------------------------------------

LEDGER_FAMILY = "gpu_container_allocated_gpu_seconds_total"
CAUSE_FAMILY = "gpu_container_idle_gpu_seconds_total"


def by_allocation(
    scrape: Scrape, family: str, label: str
) -> dict[tuple[str, str], dict[str, float]]:
    """(pod, device_id) -> {state or cause: seconds}."""
    out: dict[tuple[str, str], dict[str, float]] = {}
    for labels, value in scrape.find(family):
        out.setdefault((labels["pod"], labels["device_id"]), {})[labels[label]] = value
    return out


@pytest.mark.slow  # 21 cycles of the why-idle scenario, scraped each (~2 s)
@pytest.mark.parametrize("scenario", ["why-idle", "node-8gpu"])
async def test_on_the_simulated_node_idle_time_goes_to_the_cause_the_cgroup_shows(
    scenario: str,
) -> None:
    """5 s cycles after the first, over two of the starved pod's 50 s duty periods (105 s
    counted): at every cycle every allocation's causes sum to its idle + no_process
    seconds. On why-idle, the starved pod's idle time all goes to cpu_throttled; the
    CPU-bound pod's GPU is busy (no idle time to explain); the notebook's idle time has
    no CPU cause (unknown). On node-8gpu, tiny-kernels' kernel loop is throttled (40 %):
    its idle time goes to cpu_throttled; the other pods are quiet (unknown)."""
    async with simulated_exporter(scenario) as h:
        for _ in range(21):
            await h.advance(5.0, cycle=False)
            await h.refresh_pod_resources()
            await h.cycle()
            scrape = await h.scrape()
            states = by_allocation(scrape, LEDGER_FAMILY, "state")
            causes = by_allocation(scrape, CAUSE_FAMILY, "cause")
            assert causes.keys() == states.keys() and states
            for key, split in causes.items():
                assert set(split) == set(IDLE_CAUSES), key
                assert sum(split.values()) == pytest.approx(
                    idle_and_no_process(states[key].items())
                )
    pods = {pod: split for (pod, _), split in causes.items()}
    if scenario == "node-8gpu":
        tiny = pods.pop("tiny-kernels")
        assert tiny["cpu_throttled"] == pytest.approx(105.0) == sum(tiny.values())
        assert all(s == 0 for split in pods.values() for c, s in split.items() if c != "unknown")
        assert any(split["unknown"] > 0 for split in pods.values())
        return
    starved = pods["loader-starved-0"]
    assert starved["cpu_throttled"] >= 50.0  # idle 30 s of every 50 s
    assert starved["cpu_throttled"] == pytest.approx(sum(starved.values()))
    assert sum(pods["cpu-bound-0"].values()) == 0.0
    notebook = pods["notebook-0"]
    assert notebook["unknown"] == pytest.approx(105.0) == sum(notebook.values())


# -- adversarial review of why idle ------------------------------------------------------

OLD, NEW = "a" * 64, "b" * 64


def _process(pid: int, container_id: str) -> tuple[ProcessIdentity, AttributedProcess]:
    """A GPU process of train/loader-0/main in the cgroup of ``container_id``."""
    identity = ProcessIdentity(pid, True, pod_uid="uid-1", container_id=container_id)
    attributed = AttributedProcess(
        0, "GPU-0", None, None, None, pid, 1 << 30, None, "compute", "pod",
        namespace="train", pod="loader-0", container="main",
    )  # fmt: skip
    return identity, attributed


def _signals(
    watch: PodMetaSnapshot | None, *processes: tuple[ProcessIdentity, AttributedProcess]
) -> list[tuple[ContainerRef, str]]:
    cgroups = read(0.0, stats(900_000, 800_000, container_id=OLD), stats(10, 0, container_id=NEW))
    snapshot = NodeSnapshot(
        "n",
        NvmlSnapshot(ok=True, timestamp=0.0),
        timestamp=0.0,
        processes=tuple(p for p, _ in processes),
        pod_meta=watch,
        cgroups=cgroups,
    )
    attribution = Attribution(processes=tuple(a for _, a in processes))
    return [
        (row.container, row.stats.container_id) for row in cgroup_signals(snapshot, attribution)
    ]


def test_a_restarted_container_with_its_old_process_lingering_is_one_row_the_watchs_id() -> None:
    """The old container's process is still on the GPU (exiting, D state); the pod watch
    lists the new id. Both ids named the container: two series with one label set."""
    watch = PodMetaSnapshot(
        ok=True,
        timestamp=0,
        pods=(PodMeta("uid-1", "train", "loader-0", containers=((NEW, "main"),)),),
    )
    assert _signals(watch, _process(77, OLD)) == [(MAIN, NEW)]
    assert _signals(watch, _process(77, OLD), _process(78, NEW)) == [(MAIN, NEW)]


def test_two_ids_only_attribution_names_for_one_container_are_both_unknown() -> None:
    """Without the pod watch nothing says which id is the live container: no guess."""
    assert _signals(None, _process(77, OLD), _process(78, NEW)) == []
    assert _signals(None, _process(77, OLD)) == [(MAIN, OLD)]


def test_counters_past_a_floats_range_give_no_share_and_no_series_never_a_crash() -> None:
    """The source bounds counters to u64; past a float's range, analysis and exposition
    must still not fail the cycle (an OverflowError there froze every later cycle)."""
    huge = 10**400
    assert stall_share(Pressure(0, None), Pressure(huge, None), 5.0) is None
    node = Node()
    node.cycle(0.0, read(0.0, stats(0, 0, cpu_us=0)))
    big = CgroupStats("uid-1", "c1", 2, huge, 1, huge, Pressure(huge, huge))
    analysis = node.cycle(5.0, read(5.0, big))
    (reason,) = analysis.why_idle
    assert reason.cause == "unknown" and reason.cpu_pressure_ratio is None
    names = {m.name for m in build_families(analysis, ExpositionOptions())}
    assert "gpu_container_cpu_throttled_periods" in names  # the sane counter is served
    periods = [
        s
        for m in build_families(analysis, ExpositionOptions())
        for s in m.samples
        if s.name == "gpu_container_cpu_periods_total"
    ]
    assert periods == []
