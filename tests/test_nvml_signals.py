"""NVLink, PCIe, video engines, throttle time, memory temperature and fans,
read through the real pynvml over the simulated libnvidia-ml, and served on /metrics.

What a driver or GPU does not support stays absent (no series), whether it answers
NOT_SUPPORTED or lacks the entry point (an older driver).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from exporter.model import GpuSample, NvLink, PcieLink
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import install
from exporter.sim.scenario import parse_scenario
from exporter.sources.nvml import NvmlSource
from tests.harness import simulated_exporter

GB = 1_000_000_000
NS = 1_000_000_000
R580 = {"driver_version": "580.65.06", "nvml_version": "13.580.65.06"}
ALL_ERRORS = ("crc_flit", "crc_data", "replay", "recovery")
HGX_GPU: dict[str, object] = {
    "utilization_gpu": 90,
    "nvlink_links": 4,
    "nvlink_inactive": [3],
    "nvlink_tx_bytes_per_s": 2 * GB,
    "nvlink_rx_bytes_per_s": 3 * GB,
    "nvlink_errors": {1: {"crc_flit": 7, "replay": 2}, 3: {"crc_flit": 5}},
}


@pytest.fixture
def sources() -> Iterator[list[NvmlSource]]:
    made: list[NvmlSource] = []
    yield made
    for source in made:
        source.close()


class Node:
    def __init__(self, scenario: dict[str, object], made: list[NvmlSource]) -> None:
        self.clock = ManualClock()
        self.sim = SimNode(parse_scenario(scenario, "test"), self.clock)
        install(self.sim)
        self.source = NvmlSource(clock=self.clock)
        made.append(self.source)

    def gpus_at(self, t: float) -> tuple[GpuSample, ...]:
        self.clock.now = t
        snapshot = self.source.sample()
        assert snapshot.ok
        self.errors = snapshot.errors
        return snapshot.gpus


# -- NVLink ------------------------------------------------------------------------------


def test_each_nvlink_has_its_state_data_bytes_and_error_counters(
    sources: list[NvmlSource],
) -> None:
    node = Node({**R580, "gpus": [HGX_GPU]}, sources)
    links = node.gpus_at(10.0)[0].nvlinks

    assert [link.link for link in links] == [0, 1, 2, 3]
    assert links[1] == NvLink(
        link=1,
        active=True,
        transmitted_bytes=20 * GB,  # 2 GB/s for 10 s, read in KiB and given back in bytes
        received_bytes=30 * GB,
        errors=(("crc_flit", 7), ("crc_data", 0), ("replay", 2), ("recovery", 0)),
    )
    assert [name for name, _ in links[0].errors] == list(ALL_ERRORS)
    # a link that was never up is not asked for error counters (four calls saved per link)
    assert links[3] == NvLink(link=3, active=False, transmitted_bytes=0, received_bytes=0)
    assert node.errors == ()


def test_a_gpu_without_nvlink_has_no_links(sources: list[NvmlSource]) -> None:
    node = Node({**R580, "gpus": [{"utilization_gpu": 50}]}, sources)
    assert node.gpus_at(1.0)[0].nvlinks == ()
    assert node.errors == ()


def test_a_link_that_goes_down_keeps_its_error_counters(sources: list[NvmlSource]) -> None:
    node = Node(
        {
            **R580,
            "gpus": [HGX_GPU],
            "timeline": [{"at": 30, "set": {"gpu": 0, "nvlink_inactive": [1, 3]}}],
        },
        sources,
    )
    node.gpus_at(10.0)
    link = node.gpus_at(40.0)[0].nvlinks[1]
    assert link.active is False
    assert dict(link.errors)["crc_flit"] == 7


def test_blackwell_without_the_error_counter_call_keeps_state_and_bytes(
    sources: list[NvmlSource],
) -> None:
    """R565 removed nvmlDeviceGetNvLinkErrorCounter on Blackwell: NOT_SUPPORTED."""
    gpu = {**HGX_GPU, "unsupported": ["nvmlDeviceGetNvLinkErrorCounter"]}
    node = Node({**R580, "gpus": [gpu]}, sources)
    links = node.gpus_at(10.0)[0].nvlinks
    assert [(link.active, link.errors) for link in links] == [
        (True, ()),
        (True, ()),
        (True, ()),
        (False, ()),
    ]
    assert links[0].transmitted_bytes == 20 * GB
    assert node.errors == ()


def test_nvlink_bytes_are_absent_where_the_throughput_fields_are_not_supported(
    sources: list[NvmlSource],
) -> None:
    gpu = {
        **HGX_GPU,
        "unsupported": [
            "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX",
            "NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX",
        ],
    }
    node = Node({**R580, "gpus": [gpu]}, sources)
    links = node.gpus_at(10.0)[0].nvlinks
    assert {(link.transmitted_bytes, link.received_bytes) for link in links} == {(None, None)}
    assert links[1].active and dict(links[1].errors)["crc_flit"] == 7
    assert node.errors == ()


# -- PCIe --------------------------------------------------------------------------------


def test_pcie_link_current_against_best_and_byte_counters_on_r555_and_newer(
    sources: list[NvmlSource],
) -> None:
    gpu = {
        "utilization_gpu": 80,
        "pcie_width": 8,
        "pcie_tx_bytes_per_s": 5_000_000,
        "pcie_rx_bytes_per_s": 7_000_000,
    }
    node = Node({**R580, "gpus": [gpu]}, sources)
    assert node.gpus_at(100.0)[0].pcie == PcieLink(
        generation=5,
        max_generation=5,
        width=8,
        max_width=16,
        transmitted_bytes=500_000_000,
        received_bytes=700_000_000,
    )


def test_an_idle_gpu_drops_its_pcie_generation_and_keeps_its_width(
    sources: list[NvmlSource],
) -> None:
    """NVIDIA: current generation and width "may be reduced when the GPU is not in use"."""
    node = Node({**R580, "gpus": [{"utilization_gpu": 0}, {"utilization_gpu": 40}]}, sources)
    idle, busy = node.gpus_at(1.0)
    assert idle.pcie is not None and busy.pcie is not None
    assert (idle.pcie.generation, idle.pcie.max_generation, idle.pcie.width) == (1, 5, 16)
    assert (busy.pcie.generation, busy.pcie.width) == (5, 16)


def test_drivers_before_r555_have_no_pcie_byte_counters(sources: list[NvmlSource]) -> None:
    gpu = {"utilization_gpu": 80, "pcie_tx_bytes_per_s": 5_000_000}
    node = Node({"driver_version": "550.90.07", "gpus": [gpu]}, sources)
    pcie = node.gpus_at(100.0)[0].pcie
    assert pcie is not None
    assert (pcie.transmitted_bytes, pcie.received_bytes) == (None, None)
    assert pcie.width == 16
    assert node.errors == ()


# -- throttle time -----------------------------------------------------------------------


def test_time_under_each_clock_event_reason_accumulates_in_nanoseconds(
    sources: list[NvmlSource],
) -> None:
    """SW thermal slowdown (0x20) from the start, SW power cap (0x4) added at t=40."""
    node = Node(
        {
            **R580,
            "gpus": [{"utilization_gpu": 90, "clock_event_reasons": 0x20}],
            "timeline": [{"at": 40, "set": {"gpu": 0, "clock_event_reasons": 0x24}}],
        },
        sources,
    )
    durations = dict(node.gpus_at(100.0)[0].clock_event_durations_ns)
    assert durations == {
        "sw_power_cap": 60 * NS,
        "thermal": 100 * NS,  # any thermal slowdown
        "sync_boost": 0,
        "board_limit": 0,
        "low_utilization": 0,
        "reliability": 0,
        "sw_thermal_slowdown": 100 * NS,
        "hw_thermal_slowdown": 0,
        "hw_power_brake_slowdown": 0,
    }


def test_drivers_before_r580_give_only_the_performance_policy_times(
    sources: list[NvmlSource],
) -> None:
    node = Node({"driver_version": "570.172.08", "gpus": [{"clock_event_reasons": 0x20}]}, sources)
    durations = dict(node.gpus_at(10.0)[0].clock_event_durations_ns)
    assert sorted(durations) == sorted(
        ["sw_power_cap", "thermal", "sync_boost", "board_limit", "low_utilization", "reliability"]
    )
    assert durations["thermal"] == 10 * NS


# -- memory temperature, fans, video engines ---------------------------------------------


def test_memory_temperature_is_read_right_even_where_r545_types_it_a_double(
    sources: list[NvmlSource],
) -> None:
    """nvbugs/4300930: R545 marks NVML_FI_DEV_MEMORY_TEMP a double but writes an unsigned
    int; read by its type it is a denormal near 0 (DCGM reads uiVal regardless)."""
    for driver in ("545.23.08", "580.65.06"):
        node = Node({"driver_version": driver, "gpus": [{"memory_temperature": 67}]}, sources)
        assert node.gpus_at(1.0)[0].memory_temperature_celsius == 67


def test_memory_temperature_unsupported_or_implausible_is_absent(
    sources: list[NvmlSource],
) -> None:
    node = Node(
        {
            "gpus": [
                {"unsupported": ["NVML_FI_DEV_MEMORY_TEMP"]},
                {"memory_temperature": 4000},
            ]
        },
        sources,
    )
    unsupported, garbage = node.gpus_at(1.0)
    assert unsupported.memory_temperature_celsius is None
    assert garbage.memory_temperature_celsius is None
    assert node.errors == (("memory_temperature", "ImplausibleValue"),)


def test_each_fan_reports_its_speed_and_passive_gpus_report_none(
    sources: list[NvmlSource],
) -> None:
    node = Node({"gpus": [{"fans": [38, 41]}, {}]}, sources)
    workstation, datacentre = node.gpus_at(1.0)
    assert workstation.fan_speeds_percent == ((0, 38), (1, 41))
    assert datacentre.fan_speeds_percent == ()
    assert node.errors == ()


def test_a_driver_without_the_fan_count_reports_one_fan(sources: list[NvmlSource]) -> None:
    node = Node(
        {
            "missing_functions": ["nvmlDeviceGetNumFans", "nvmlDeviceGetFanSpeed_v2"],
            "gpus": [{"fans": [55, 60]}],
        },
        sources,
    )
    assert node.gpus_at(1.0)[0].fan_speeds_percent == ((0, 55),)


def test_encoder_and_decoder_utilization_and_their_absence(sources: list[NvmlSource]) -> None:
    node = Node(
        {
            "gpus": [
                {"encoder_utilization": 12, "decoder_utilization": 35},
                {"unsupported": ["nvmlDeviceGetEncoderUtilization"]},
            ]
        },
        sources,
    )
    busy, no_encoder = node.gpus_at(1.0)
    assert (busy.encoder_utilization_percent, busy.decoder_utilization_percent) == (12, 35)
    assert (no_encoder.encoder_utilization_percent, no_encoder.decoder_utilization_percent) == (
        None,
        0,
    )


def test_field_values_refused_leave_those_signals_absent_and_count_errors(
    sources: list[NvmlSource],
) -> None:
    node = Node(
        {
            **R580,
            "gpus": [{**HGX_GPU, "pcie_tx_bytes_per_s": 1000}],
            "call_errors": [{"call": "nvmlDeviceGetFieldValues", "error": "NO_PERMISSION"}],
        },
        sources,
    )
    gpu = node.gpus_at(10.0)[0]
    assert gpu.memory_temperature_celsius is None and gpu.clock_event_durations_ns == ()
    assert gpu.pcie is not None and gpu.pcie.transmitted_bytes is None
    assert gpu.pcie.width == 16
    assert gpu.nvlinks == ()  # the link count is a field too: asked again next cycle
    assert ("field_values", "NoPermission") in node.errors


# -- served ------------------------------------------------------------------------------


async def test_node_8gpu_serves_interconnect_engines_and_throttle_time() -> None:
    async with simulated_exporter("node-8gpu", kube_api=False) as h:
        await h.advance(100)
        s = await h.scrape()
        for name in (
            "gpu_nvlink_transmitted_bytes",
            "gpu_nvlink_received_bytes",
            "gpu_nvlink_errors",
            "gpu_pcie_transmitted_bytes",
            "gpu_pcie_received_bytes",
            "gpu_clock_event_seconds",
        ):
            assert s.types[name] == "counter"
        # NVLink: GPUs 0 and 1 have 18 links each, the others none
        assert {labels["gpu"] for labels, _ in s.find("gpu_nvlink_active")} == {"0", "1"}
        assert len(s.find("gpu_nvlink_active", gpu="0")) == 18
        assert s.get("gpu_nvlink_errors_total", gpu="1", link="5", type="crc_flit") == 14
        assert s.get("gpu_nvlink_errors_total", gpu="1", link="4", type="replay") == 0
        tx = s.get("gpu_nvlink_transmitted_bytes_total", gpu="0", link="3")
        # PCIe: GPU 6 trained at x8 of x16; idle GPU 7 dropped to Gen1 of Gen5
        assert s.get("gpu_pcie_link_width", gpu="6") == 8
        assert s.get("gpu_pcie_link_max_width", gpu="6") == 16
        assert s.get("gpu_pcie_link_generation", gpu="7") == 1
        assert s.get("gpu_pcie_link_max_generation", gpu="7") == 5
        assert s.get("gpu_pcie_link_generation", gpu="0") == 5
        # engines, limits: GPU 2 decodes video; GPU 1 is SW-thermal throttled all along
        assert s.get("gpu_decoder_utilization_ratio", gpu="2") == 0.35
        assert s.get("gpu_encoder_utilization_ratio", gpu="2") == 0
        throttled = s.get("gpu_clock_event_seconds_total", gpu="1", reason="sw_thermal_slowdown")
        assert s.get("gpu_memory_temperature_celsius", gpu="0") == 76
        assert "gpu_fan_speed_ratio" not in s.types  # H100s are passively cooled

        await h.advance(30)
        later = await h.scrape()
        # GPU 1's marginal link got worse at t=120; counters only grow
        assert later.get("gpu_nvlink_errors_total", gpu="1", link="5", type="crc_flit") == 96
        assert later.get("gpu_nvlink_errors_total", gpu="1", link="5", type="recovery") == 1
        assert later.get("gpu_nvlink_transmitted_bytes_total", gpu="0", link="3") > tx
        throttled_later = later.get(
            "gpu_clock_event_seconds_total", gpu="1", reason="sw_thermal_slowdown"
        )
        assert throttled_later == pytest.approx(throttled + 30, abs=0.5)


async def test_fans_are_served_per_fan_as_a_ratio() -> None:
    scenario: dict[str, object] = {
        "gpus": [{"name": "NVIDIA RTX 6000 Ada Generation", "fans": [38, 120]}]
    }
    async with simulated_exporter(scenario, kube_api=False) as h:
        s = await h.scrape()
    assert s.get("gpu_fan_speed_ratio", gpu="0", fan="0") == 0.38
    assert s.get("gpu_fan_speed_ratio", gpu="0", fan="1") == 1.2  # may exceed its maximum
