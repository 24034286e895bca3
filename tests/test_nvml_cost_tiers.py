"""What a real GPU showed each NVML read to cost, and the cadence that follows from it.

On an H200 (driver 580.159.04, docs/validation.md) energy (field 83) took
3.2 ms a read and the thermal and hardware-slowdown durations (75, 270, 271) 0.66-0.79 ms
each: they are read in the slow tier, carried as read in between. The PCIe byte counters
(197/198) came as 32-bit values that wrap every ~130 ms under a copy: served only from a
64-bit answer. nvmlDeviceGetProcessUtilization took 1.3-2.4 ms even on an idle GPU: not
asked where every listing answered and none listed a process.

Read through the real pynvml over the simulated libnvidia-ml, whose counts
(``SimNvmlLibrary.calls``, ``.fields``) say what reached the driver.
"""

from __future__ import annotations

import logging
from collections import Counter

import pynvml
import pytest

from exporter.model import GpuSample
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import install
from exporter.sim.scenario import ScenarioError, parse_scenario
from exporter.sources import nvml_fields
from exporter.sources.nvml import NvmlSource
from tests.harness import simulated_exporter
from tests.test_nvml_cadence import R580, Node, sources  # noqa: F401 (fixture)

ENERGY = nvml_fields.TOTAL_ENERGY
DURATIONS = {*nvml_fields.POLICY_FIELDS.values(), *nvml_fields.CLOCK_EVENT_FIELDS.values()}
SLOW_ONLY = {ENERGY, *DURATIONS}
PCIE = set(nvml_fields.PCIE_BYTES_FIELDS)
UTILIZATION = "nvmlDeviceGetProcessUtilization"


def _asked(node: Node, t: float) -> tuple[GpuSample, Counter[int]]:
    """One cycle at ``t``: its GPU 0 and the field ids it asked."""
    before = Counter(node.library.calls.fields)
    gpu = node.at(t)[0]
    return gpu, Counter(node.library.calls.fields) - before


# -- energy and clock-event time: the slow tier -------------------------------------------


def test_energy_and_clock_event_time_are_read_in_the_slow_tier_and_carried_between(
    sources: list[NvmlSource],  # noqa: F811
) -> None:
    gpu = {"energy_mj": 1000, "power_mw": 100_000, "clock_event_reasons": 0x20}  # SW thermal
    node = Node({"gpus": [gpu]}, sources)
    first, asked = _asked(node, 0.0)
    assert set(asked) >= SLOW_ONLY
    assert first.slow_read and first.energy_millijoules == 1000
    read_at_0 = dict(first.clock_event_durations_ns)

    for t in (1.0, 10.0, 29.0):
        carried, asked = _asked(node, t)
        assert not set(asked) & SLOW_ONLY, t  # never asked between two slow reads
        assert not carried.slow_read
        assert carried.energy_millijoules == 1000  # as read at 0 s: not reset, not re-read
        assert dict(carried.clock_event_durations_ns) == read_at_0
        assert node.calls["nvmlDeviceGetFieldValues"] == 1  # the cycle's batch still goes

    fresh, asked = _asked(node, 30.0)
    assert set(asked) >= SLOW_ONLY and fresh.slow_read
    assert fresh.energy_millijoules == 1000 + 100_000 * 30
    durations = dict(fresh.clock_event_durations_ns)
    assert durations["sw_thermal_slowdown"] == read_at_0["sw_thermal_slowdown"] + 30 * 10**9
    assert node.errors == ()


def test_energy_without_its_field_falls_back_to_the_call_in_the_slow_tier(
    sources: list[NvmlSource],  # noqa: F811
) -> None:
    gpu = {
        "energy_mj": 1000,
        "power_mw": 100_000,
        "unsupported": ["NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION"],
    }
    node = Node({"gpus": [gpu]}, sources)
    assert node.at(0.0)[0].energy_millijoules == 1000  # the field NOT_SUPPORTED, then the call
    assert node.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1
    assert node.at(10.0)[0].energy_millijoules == 1000  # carried: neither field nor call
    assert node.calls["nvmlDeviceGetTotalEnergyConsumption"] == 0
    _, asked = _asked(node, 30.0)
    assert node.calls["nvmlDeviceGetTotalEnergyConsumption"] == 1
    assert ENERGY not in asked  # the field is not asked again on this handle
    assert node.source.sample().gpus[0].energy_millijoules == 1000 + 100_000 * 30
    assert node.errors == ()


def test_a_failed_slow_read_leaves_energy_absent_until_the_next_one(
    sources: list[NvmlSource],  # noqa: F811
) -> None:
    failing = {
        "call": "nvmlDeviceGetFieldValues",
        "error": "NO_PERMISSION",
        "from": 29.5,
        "until": 30.5,
    }
    node = Node({"gpus": [{"energy_mj": 1000}], "call_errors": [failing]}, sources)
    assert node.at(0.0)[0].energy_millijoules == 1000
    failed = node.at(30.0)[0]
    assert failed.slow_read and failed.energy_millijoules is None  # never the value of 0 s
    assert failed.clock_event_durations_ns == ()
    assert node.at(31.0)[0].energy_millijoules is None  # not re-read before its time
    assert node.at(60.0)[0].energy_millijoules is not None


# -- PCIe byte counters: served only from a 64-bit answer ---------------------------------

PCIE_GPU = {"utilization_gpu": 80, "pcie_tx_bytes_per_s": 32e9, "pcie_rx_bytes_per_s": 31e9}


def test_a_32_bit_driver_answers_the_pcie_counters_as_unsigned_int_modulo_2_to_the_32(
    sources: list[NvmlSource],  # noqa: F811
) -> None:
    clock = ManualClock(10.0)
    scenario = {**R580, "pcie_counter_bits": 32, "gpus": [PCIE_GPU]}
    install(SimNode(parse_scenario(scenario, "narrow"), clock))
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        tx, rx = pynvml.nvmlDeviceGetFieldValues(handle, sorted(PCIE))
    finally:
        pynvml.nvmlShutdown()
    assert tx.valueType == rx.valueType == pynvml.NVML_VALUE_TYPE_UNSIGNED_INT
    assert tx.value.uiVal == int(32e9 * 10) % 2**32
    with pytest.raises(ScenarioError, match="pcie_counter_bits: 16 is not 32 or 64"):
        parse_scenario({"pcie_counter_bits": 16}, "bad")


def test_pcie_byte_counters_answered_in_32_bits_are_unknown_never_asked_again_logged_once(
    sources: list[NvmlSource],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = Node({"pcie_counter_bits": 32, "gpus": [PCIE_GPU, PCIE_GPU]}, sources)
    asked_first: Counter[int] = Counter()
    for t in (0.0, 1.0, 2.0, 30.0):
        before = Counter(node.library.calls.fields)
        gpus = node.at(t)
        asked = Counter(node.library.calls.fields) - before
        asked_first = asked_first or asked
        for gpu in gpus:
            assert gpu.pcie is not None and gpu.pcie.width == 16  # the link is still served
            assert (gpu.pcie.transmitted_bytes, gpu.pcie.received_bytes) == (None, None)
        assert not set(asked) & PCIE or t == 0.0, t
        assert node.errors == ()  # what the driver does every time: not an error
    assert {fid: asked_first[fid] for fid in PCIE} == {fid: 2 for fid in PCIE}  # once per GPU
    logged = [r.getMessage() for r in caplog.records if "PCIe byte counters" in r.getMessage()]
    assert len(logged) == 2, logged  # one line per GPU, not one per cycle
    assert "GPU 0: driver 580.65.06" in logged[0] and "value type 1" in logged[0]
    assert "wraps within a second at link speed" in logged[0]


def test_pcie_byte_counters_answered_in_64_bits_are_served_every_cycle(
    sources: list[NvmlSource],  # noqa: F811
    caplog: pytest.LogCaptureFixture,
) -> None:
    node = Node({"gpus": [PCIE_GPU]}, sources)
    for t in (0.0, 1.0):
        gpu, asked = _asked(node, t)
        assert set(asked) >= PCIE
        assert gpu.pcie is not None and gpu.pcie.transmitted_bytes == int(32e9 * t)
    assert not [r for r in caplog.records if "PCIe byte counters" in r.getMessage()]


@pytest.mark.parametrize("bits", [32, 64])
async def test_the_exporter_serves_pcie_byte_series_only_on_a_64_bit_driver(
    bits: int, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="exporter.sources.nvml")
    scenario: dict[str, object] = {**R580, "pcie_counter_bits": bits, "gpus": [PCIE_GPU]}
    async with simulated_exporter(scenario, kube_api=False) as h:
        for _ in range(3):
            await h.advance(1)
        s = await h.scrape()
    served = s.find("gpu_pcie_transmitted_bytes_total") + s.find("gpu_pcie_received_bytes_total")
    logged = [r for r in caplog.records if "PCIe byte counters" in r.getMessage()]
    assert s.find("gpu_pcie_link_width", gpu="0")  # the link itself is served either way
    if bits == 32:
        assert served == [] and len(logged) == 1  # absent, never 0; one line says why
    else:
        assert len(served) == 2 and all(v > 0 for _, v in served) and logged == []


# -- per-process samples: only where there are processes ----------------------------------

PROCESS = {"pid": 500, "gpu": 0, "memory": "1GiB", "sm": 70}


def test_no_process_utilization_read_where_every_listing_answered_empty(
    sources: list[NvmlSource],  # noqa: F811
) -> None:
    node = Node({"gpus": [{}, {}], "host_processes": [PROCESS]}, sources)
    for t in (0.0, 1.0, 2.0):
        busy, idle = node.at(t)
        assert [(u.pid, u.sm_percent) for u in busy.process_utilization] == [(500, 70)]
        assert idle.process_utilization == () and idle.processes_listed
        # one call with room to spare, where pynvml asks the size first: GPU 0's only
        assert node.calls[UTILIZATION] == 1, t


def test_a_listing_that_failed_is_no_evidence_of_an_idle_gpu(
    sources: list[NvmlSource],  # noqa: F811
) -> None:
    refused = {
        "call": "nvmlDeviceGetGraphicsRunningProcesses_v3",
        "error": "NO_PERMISSION",
        "gpu": 0,
    }
    node = Node({"gpus": [{}], "call_errors": [refused]}, sources)
    (gpu,) = node.at(0.0)
    assert not gpu.processes_listed
    assert node.calls[UTILIZATION] == 1  # asked as before (answers NotFound: no samples)


def test_a_process_after_skipped_reads_gets_its_own_samples_never_the_gone_ones(
    sources: list[NvmlSource],  # noqa: F811
) -> None:
    """Pid 500 (70 % SM) exits at 1 s; the GPU is empty at 2 s (no read); pid 600 starts
    at 2.5 s with no SM time yet. At 3 s the driver still holds pid 500's samples of its
    last second (newer than the last timestamp seen, docs/simulator.md "Sample
    buffers"): those are read (its own, stamped 1 s; attribution joins samples to listed
    pids only), never pid 500's reading of 0 s standing in, and none for pid 600; at 4 s
    pid 600 has 20 % for 0.5 s, averaged from the last timestamp seen before the skip."""
    start = {"gpu": 0, "memory": "1GiB", "sm": 0, "pid": 600}
    node = Node(
        {
            "gpus": [{}],
            "host_processes": [PROCESS],
            "timeline": [
                {"at": 1, "exit": 500},
                {"at": 2.5, "start": start},
                {"at": 3.5, "set_process": {"pid": 600, "sm": 20}},
            ],
        },
        sources,
    )
    assert [(u.pid, u.sm_percent) for u in node.at(0.0)[0].process_utilization] == [(500, 70)]
    assert node.at(2.0)[0].process_utilization == ()
    assert node.calls[UTILIZATION] == 0
    (gpu,) = node.at(3.0)
    assert [p.pid for p in gpu.processes] == [600]
    assert node.calls[UTILIZATION] == 1  # asked again, in one call
    assert [
        (u.pid, u.sm_percent, u.timestamp_us % 10_000_000) for u in gpu.process_utilization
    ] == [(500, 70, 1_000_000)]
    (gpu,) = node.at(4.0)
    # one entry per process, averaged since the last timestamp seen (1 s): 20 % for its
    # last 0.5 s of those 3 s
    assert [(u.pid, u.sm_percent) for u in gpu.process_utilization] == [(600, 3)]
    assert node.errors == ()


def test_the_slow_interval_help_names_every_family_it_makes_as_old(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An operator who sets --slow-interval 3600 learns from --help that energy and the
    clock-event time are then up to an hour old, not only the counters of days or weeks."""
    from exporter.config import parse_config

    with pytest.raises(SystemExit):
        parse_config(["--help"])
    text = " ".join(capsys.readouterr().out.split()).replace("- ", "-")  # argparse wraps at -
    start = text.index("--slow-interval SECONDS")
    help_text = text[start : start + 700]
    assert "energy" in help_text and "clock-event time" in help_text, help_text
