"""The NVML cadence tiers (exporter/sources/nvml_cadence.py) and the field-value batch,
read through the real pynvml over the simulated libnvidia-ml, whose call counts
(``SimNvmlLibrary.calls``) say what reached the driver.

A slow fact keeps its last value between reads, is never re-read in between, is absent
(not carried) after a failed read, and goes with the handle of a GPU that was lost.
Fields that stand for a call of their own fall back to it on drivers that answer
NOT_SUPPORTED for the field.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from exporter.config import ConfigError, parse_config
from exporter.model import GpuSample
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import SimNvmlLibrary, install
from exporter.sim.scenario import parse_scenario
from exporter.sources import nvml_cadence
from exporter.sources.nvml import NvmlSource
from tests.bench_scripts import load

SLOW_S = 30.0
R580 = {"driver_version": "580.65.06", "nvml_version": "13.580.65.06"}
SLOW_CALLS = (
    "nvmlDeviceGetTotalEccErrors",
    "nvmlDeviceGetRetiredPages",
    "nvmlDeviceGetRemappedRows",
    "nvmlDeviceGetNvLinkState",
    "nvmlDeviceGetEnforcedPowerLimit",
    "nvmlDeviceGetMaxPcieLinkGeneration",
)


@pytest.fixture
def sources() -> Iterator[list[NvmlSource]]:
    made: list[NvmlSource] = []
    yield made
    for source in made:
        source.close()


class Node:
    def __init__(
        self, scenario: dict[str, object], made: list[NvmlSource], slow_s: float = SLOW_S
    ) -> None:
        self.clock = ManualClock()
        self.sim = SimNode(parse_scenario({**R580, **scenario}, "test"), self.clock)
        self.library: SimNvmlLibrary = install(self.sim)
        self.source = NvmlSource(clock=self.clock, slow_interval_s=slow_s)
        made.append(self.source)

    def at(self, t: float) -> tuple[GpuSample, ...]:
        """One cycle at simulated time ``t``; the calls it made in ``self.calls``."""
        self.clock.now = t
        before = Counter(self.library.calls.by_function)
        snapshot = self.source.sample()
        self.calls = Counter(self.library.calls.by_function) - before
        assert snapshot.ok
        self.errors = snapshot.errors
        return snapshot.gpus


def test_a_slow_counter_keeps_its_last_value_until_the_next_slow_read(
    sources: list[NvmlSource],
) -> None:
    node = Node(
        {
            "gpus": [{"ecc_corrected": 1, "nvlink_links": 2}],
            "timeline": [{"at": 10, "set": {"gpu": 0, "ecc_corrected": 9}}],
        },
        sources,
    )
    assert node.at(0.0)[0].ecc_corrected_total == 1
    assert all(node.calls[c] for c in SLOW_CALLS)  # the first cycle reads every tier

    carried = node.at(10.0)[0]
    assert carried.ecc_corrected_total == 1  # as last read: not reset, not re-read
    assert not any(node.calls[c] for c in SLOW_CALLS)
    assert node.calls["nvmlDeviceGetMigMode"] == 0  # the layout is read on change only
    assert node.at(29.0)[0].ecc_corrected_total == 1

    assert node.at(30.0)[0].ecc_corrected_total == 9  # the next slow read
    assert all(node.calls[c] for c in SLOW_CALLS)


def test_a_failed_slow_read_is_absent_until_the_next_one_never_the_carried_value(
    sources: list[NvmlSource],
) -> None:
    node = Node(
        {
            "gpus": [{"ecc_corrected": 4}],
            "call_errors": [
                {
                    "call": "nvmlDeviceGetTotalEccErrors",
                    "error": "NO_PERMISSION",
                    "from": 25,
                    "until": 35,
                }
            ],
        },
        sources,
    )
    assert node.at(0.0)[0].ecc_corrected_total == 4
    failed = node.at(30.0)[0]
    assert failed.ecc_corrected_total is None  # no series, not the value read at 0 s
    assert ("ecc", "NoPermission") in node.errors
    assert node.at(40.0)[0].ecc_corrected_total is None  # not re-read before its time
    assert node.at(60.0)[0].ecc_corrected_total == 4


def test_a_lost_gpu_drops_its_slow_values_and_its_new_handle_reads_them_afresh(
    sources: list[NvmlSource],
) -> None:
    node = Node(
        {
            "gpus": [{}, {"ecc_corrected": 2}],
            "timeline": [
                {"at": 5, "lose": 1},
                {"at": 8, "set": {"gpu": 1, "lost": False, "ecc_corrected": 7}},
            ],
        },
        sources,
    )
    assert node.at(0.0)[1].ecc_corrected_total == 2
    lost = node.at(5.0)[1]
    assert lost.error == "GpuIsLost" and lost.ecc_corrected_total is None
    back = node.at(10.0)[1]  # re-opened: a fresh slow read, not the old handle's values
    assert back.error is None and back.ecc_corrected_total == 7
    assert node.calls["nvmlDeviceGetTotalEccErrors"] and node.calls["nvmlDeviceGetMigMode"]


def test_nvlink_error_counters_come_from_fields_for_links_0_to_11_and_calls_beyond(
    sources: list[NvmlSource],
) -> None:
    errors = {1: {"crc_flit": 7, "replay": 2}, 14: {"crc_data": 3, "recovery": 1}}
    node = Node({"gpus": [{"nvlink_links": 18, "nvlink_errors": errors}]}, sources)
    links = {link.link: dict(link.errors) for link in node.at(0.0)[0].nvlinks}

    assert links[1] == {"crc_flit": 7, "crc_data": 0, "replay": 2, "recovery": 0}
    assert links[14] == {"crc_flit": 0, "crc_data": 3, "replay": 0, "recovery": 1}
    # 18 links x 4 counters: the 48 of links 0-11 in the slow field values, 24 by call
    assert node.calls["nvmlDeviceGetNvLinkErrorCounter"] == 6 * 4
    assert node.errors == ()


def test_a_field_the_driver_does_not_support_falls_back_to_its_own_call(
    sources: list[NvmlSource],
) -> None:
    unsupported = [
        "NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
        "NVML_FI_DEV_PCIE_REPLAY_COUNTER",
        "NVML_FI_DEV_NVLINK_CRC_FLIT_ERROR_COUNT_L0",
    ]
    gpu = {"energy_mj": 1000, "power_mw": 100_000, "pcie_replay": 3, "nvlink_links": 1}
    node = Node(
        {"gpus": [{**gpu, "nvlink_errors": {0: {"crc_flit": 5}}, "unsupported": unsupported}]},
        sources,
    )
    first = node.at(0.0)[0]  # each field answers NOT_SUPPORTED once, then its call answers
    assert first.energy_millijoules == 1000
    assert first.pcie_replay_count == 3
    assert dict(first.nvlinks[0].errors)["crc_flit"] == 5

    second = node.at(30.0)[0]
    assert second.energy_millijoules == 1000 + 100_000 * 30  # through the call from now on
    assert node.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1
    assert node.calls["nvmlDeviceGetPcieReplayCounter"] == 1
    assert node.calls["nvmlDeviceGetNvLinkErrorCounter"] == 1
    assert second.pcie_replay_count == 3 and dict(second.nvlinks[0].errors)["crc_flit"] == 5
    assert node.errors == ()


def test_energy_comes_from_the_field_where_the_driver_supports_it(
    sources: list[NvmlSource],
) -> None:
    node = Node({"gpus": [{"energy_mj": 1000, "power_mw": 100_000}]}, sources)
    node.at(0.0)  # reads every tier: the link count, the slow and the cycle's fields
    assert node.calls["nvmlDeviceGetFieldValues"] == 3
    assert node.at(10.0)[0].energy_millijoules == 1000  # the slow tier's, as read at 0 s
    assert node.calls["nvmlDeviceGetFieldValues"] == 1  # one per GPU and cycle
    assert node.at(30.0)[0].energy_millijoules == 1000 + 100_000 * 30
    assert node.calls["nvmlDeviceGetTotalEnergyConsumption"] == 0
    assert node.calls["nvmlDeviceGetFieldValues"] == 2  # the cycle's and the slow tier's


def test_power_comes_from_the_field_and_from_the_call_where_the_field_is_not_supported(
    sources: list[NvmlSource],
) -> None:
    ampere = {"power_mw": 250_000}  # field 185 supported: no nvmlDeviceGetPowerUsage
    ga100 = {"power_mw": 300_000, "unsupported": ["NVML_FI_DEV_POWER_AVERAGE"]}
    timeline = [
        {"at": 1, "set": {"gpu": i, "power_mw": mw}} for i, mw in enumerate((260_000, 310_000))
    ]
    node = Node({"gpus": [ampere, ga100], "timeline": timeline}, sources)
    first = node.at(0.0)  # GA100 answers NOT_SUPPORTED once, and its call the same cycle
    assert [g.power_milliwatts for g in first] == [250_000, 300_000]
    assert node.calls["nvmlDeviceGetPowerUsage"] == 1
    second = node.at(1.0)
    assert [g.power_milliwatts for g in second] == [260_000, 310_000]
    assert node.calls["nvmlDeviceGetPowerUsage"] == 1  # GA100's, through the call from now on
    assert node.calls["nvmlDeviceGetFieldValues"] == 2  # one per GPU and cycle
    assert node.errors == ()


def test_power_is_the_call_on_drivers_older_than_the_field(sources: list[NvmlSource]) -> None:
    node = Node({"driver_version": "515.105.01", "gpus": [{"power_mw": 90_000}]}, sources)
    assert node.at(0.0)[0].power_milliwatts == 90_000
    assert node.at(1.0)[0].power_milliwatts == 90_000
    assert node.calls["nvmlDeviceGetPowerUsage"] == 1  # never asked as a field: R525 added it
    assert node.errors == ()


def test_a_power_field_that_fails_leaves_power_absent_and_counted(
    sources: list[NvmlSource],
) -> None:
    node = Node({"gpus": [{"power_mw": 250_000, "field_answers": "nan"}]}, sources)
    gpu = node.at(0.0)[0]
    assert gpu.power_milliwatts is None  # never the call's value standing in, never 0
    assert ("power", "InvalidValue") in node.errors


def _process_calls(processes: int, made: list[NvmlSource]) -> int:
    procs = [{"gpu": 0, "memory": "100MiB", "sm": 5} for _ in range(processes)]
    pods = [
        {
            "namespace": "t",
            "name": "p",
            "containers": [
                {"name": "c", "devices": {"nvidia.com/gpu": ["gpu0"]}, "processes": procs}
            ],
        }
    ]
    node = Node({"gpus": [{}, {}], "pods": pods}, made)
    node.at(0.0)
    node.at(1.0)
    load_calls = load("calls")
    return sum(n for name, n in node.calls.items() if name in load_calls.PROCESS_CALLS)


def test_process_calls_grow_with_gpus_not_with_processes(sources: list[NvmlSource]) -> None:
    # pynvml asks each listing's size, then reads it: two calls per listing and GPU
    # whatever the number of processes in it
    assert _process_calls(4, sources) == _process_calls(64, sources)


def test_slow_interval_shorter_than_the_cycle_is_refused_in_one_line() -> None:
    with pytest.raises(ConfigError, match="--slow-interval 2 is shorter than --interval 5"):
        parse_config(["--interval", "5", "--slow-interval", "2"], env={})
    # given through the environment: the error names the variable to change, not the flag
    with pytest.raises(
        ConfigError,
        match=r"^GPU_EXPORTER_SLOW_INTERVAL=2 is shorter than --interval 5: .* give "
        r"GPU_EXPORTER_SLOW_INTERVAL=5 or more$",
    ):
        parse_config(["--interval", "5"], env={"GPU_EXPORTER_SLOW_INTERVAL": "2"})
    env = {"GPU_EXPORTER_INTERVAL": "60", "GPU_EXPORTER_SLOW_INTERVAL": "30"}
    with pytest.raises(ConfigError, match="=30 is shorter than GPU_EXPORTER_INTERVAL=60"):
        parse_config([], env=env)
    with pytest.raises(ConfigError, match="GPU_EXPORTER_SLOW_INTERVAL: 'abc' is not a number"):
        parse_config([], env={"GPU_EXPORTER_SLOW_INTERVAL": "abc"})
    config = parse_config(["--interval", "5"], env={})
    assert config.slow_interval_s == nvml_cadence.DEFAULT_SLOW_INTERVAL_S == 30.0
    # not given: the default follows a longer cycle instead of refusing it
    assert parse_config(["--interval", "60"], env={}).slow_interval_s == 60.0


def test_the_schedule_is_due_at_first_then_every_interval() -> None:
    schedule = nvml_cadence.SlowSchedule(30.0)
    assert schedule.due(0.0)
    schedule.done(0.0)
    assert not schedule.due(29.9) and schedule.due(30.0)


def test_the_schedule_with_an_offset_is_due_on_its_own_grid_never_later_than_the_interval() -> None:
    schedule = nvml_cadence.SlowSchedule(30.0, offset_s=nvml_cadence.offset(30.0, 1, 4, 100.0))
    assert schedule.offset_s == 107.5
    assert schedule.due(100.0)  # a new handle reads at once
    schedule.done(100.0)
    assert not schedule.due(107.4) and schedule.due(107.5)  # then at its place: 7.5 s later
    schedule.done(108.0)  # read at the first cycle past it
    assert not schedule.due(137.4) and schedule.due(137.5)  # the grid, not 108 + 30
    schedule.expire()  # an XID: due at once, and the grid goes on after it
    assert schedule.due(140.0)
    schedule.done(140.0)
    assert not schedule.due(167.4) and schedule.due(167.5)


def test_the_slow_reads_are_spread_over_the_interval_one_gpu_a_cycle(
    sources: list[NvmlSource],
) -> None:
    node = Node({"gpus": [{}, {}, {}, {}]}, sources, slow_s=4.0)
    node.at(0.0)
    assert node.calls["nvmlDeviceGetRemappedRows"] == 4  # every GPU reads every tier at start
    read_at: dict[int, list[float]] = {i: [0.0] for i in range(4)}
    for t in range(1, 13):
        node.at(float(t))
        # GPU i of 4 reads at i s past each 4 s: one GPU's slow reads a cycle, not four
        # in one cycle of four and none in the others
        assert node.calls["nvmlDeviceGetRemappedRows"] == 1, t
        read_at[t % 4].append(float(t))
    for times in read_at.values():  # never older than the interval
        assert all(b - a <= 4.0 for a, b in itertools.pairwise(times))


# Scenario keys that only slow (or layout) reads show (exporter/sim/scenario.py SimGpu).
SLOW_SCENARIO_KEYS = {
    "ecc_corrected",
    "ecc_uncorrected",
    "remapped_correctable",
    "remapped_uncorrectable",
    "remapped_pending",
    "remapped_failure",
    "retired_pages_sbe",
    "retired_pages_dbe",
    "pcie_replay",
    "pcie_max_generation",
    "pcie_max_width",
    "nvlink_inactive",
    "nvlink_errors",
    "fans",
    "power_limit_mw",
    "mig",
}


def test_the_golden_schedule_shows_every_slow_fact_the_shipped_timelines_set() -> None:
    """tests/golden/record.py compares /metrics at 160 s; with staggered slow reads each
    GPU last read its slow tier somewhere in the last --slow-interval, so a slow fact set
    later than that before the end would be compared as carried, not as read."""
    import yaml

    from tests.golden import record

    end = record.CYCLES * record.STEP_S
    scenarios = Path(nvml_cadence.__file__).parents[1] / "sim" / "scenarios"
    for path in sorted(scenarios.glob("*.yaml")):
        timeline = yaml.safe_load(path.read_text()).get("timeline") or []
        for event in timeline:
            keys = set(event.get("set") or {}) & SLOW_SCENARIO_KEYS
            if keys and event["at"] <= end:
                assert event["at"] <= end - record.SLOW_INTERVAL_S, (path.name, event)


def test_node_8gpu_makes_at_most_40_percent_of_the_calls_before_the_tiers() -> None:
    import asyncio
    import json

    calls = load("calls")
    before = json.loads(calls.BEFORE.read_text())
    now = asyncio.run(calls.count_calls(calls.load_scenario("node-8gpu"), cycles=30, warmup=1))
    assert now["per_cycle"] <= calls.TARGET_SHARE * before["per_cycle"], now["by_function"]
    assert now["by_function"].get("nvmlDeviceGetNvLinkErrorCounter", 0) < 2
