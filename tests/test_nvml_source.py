"""NvmlSource over the simulated libnvidia-ml: every value is the scenario's, read
through pynvml's real marshalling; failures stay confined to the query or GPU at fault."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pynvml
import pytest

from exporter.analysis.health import HealthPolicy, assess
from exporter.model import GpuProcess, NvmlSnapshot, ProcessUtilization, RemappedRows
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import SIM_EPOCH_S, install
from exporter.sim.scenario import NVML_ERROR_CODES, Scenario, load_scenario, parse_scenario
from exporter.sources.nvml import NvmlSource

GiB = 1024**3
MiB = 1024**2
EPOCH_US = SIM_EPOCH_S * 1_000_000

RICH_UUID = "GPU-11111111-2222-3333-4444-555555555555"
RICH: dict[str, object] = {
    "driver_version": "560.35.03",
    "nvml_version": "12.560.35.03",
    "cuda_driver_version": 12060,
    "gpus": [
        {
            "uuid": RICH_UUID,
            "name": "NVIDIA A100-SXM4-80GB",
            "pci_bus_id": "00000000:3B:00.0",
            "memory_total": "80GiB",
            "memory_reserved": "1GiB",
            "unaccounted_memory": "2GiB",
            "utilization_gpu": 73,
            "utilization_memory": 41,
            "temperature": 66,
            "power_mw": 301_500,
            "power_limit_mw": 400_000,
            "energy_mj": 5_000_000,
            "clock_sm": 1410,
            "clock_memory": 1593,
            "clock_event_reasons": 0x4 | 0x20,  # SW power cap + SW thermal slowdown
            "pcie_replay": 7,
            "ecc_corrected": 12,
            "ecc_uncorrected": 1,
            "remapped_correctable": 3,
            "remapped_uncorrectable": 2,
            "remapped_pending": True,
            "remapped_failure": False,
        },
        {"temperature": 35},
    ],
    "host_processes": [
        {"pid": 1001, "gpu": 0, "memory": "10GiB", "sm": 60, "kind": "compute"},
        {"pid": 1002, "gpu": 0, "memory": "512MiB", "sm": 0, "kind": "graphics"},
        {"pid": 1003, "gpu": 0, "memory": "3GiB", "sm": 25, "kind": "mps"},
        {"pid": 1004, "gpu": 1, "memory": "1GiB", "sm": 10},
    ],
}
# GPU 0: listed processes + memory no process accounts for; v2 "used" excludes reserved.
RICH_USED = 10 * GiB + 512 * MiB + 3 * GiB + 2 * GiB
RICH_PROCESSES = (
    GpuProcess(pid=1001, memory_used_bytes=10 * GiB, kind="compute"),
    GpuProcess(pid=1002, memory_used_bytes=512 * MiB, kind="graphics"),
    GpuProcess(pid=1003, memory_used_bytes=3 * GiB, kind="mps"),
)


@dataclass
class Sim:
    node: SimNode
    clock: ManualClock
    source: NvmlSource

    def sample_at(self, t: float) -> NvmlSnapshot:
        self.clock.now = t
        return self.source.sample()


@pytest.fixture
def sim() -> Iterator[list[Sim]]:
    """Builds simulated nodes on demand and closes their sources afterwards."""
    made: list[Sim] = []
    yield made
    for s in made:
        s.source.close()


def start(made: list[Sim], scenario: dict[str, object] | str | Scenario) -> Sim:
    if isinstance(scenario, dict):
        scenario = parse_scenario(scenario, "test")
    elif isinstance(scenario, str):
        scenario = load_scenario(scenario)
    clock = ManualClock()
    node = SimNode(scenario, clock)
    install(node)
    s = Sim(node, clock, NvmlSource(clock=clock))
    made.append(s)
    return s


# -- values ------------------------------------------------------------------------------


def test_every_nvml_reading_equals_the_scenario_value(sim: list[Sim]) -> None:
    s = start(sim, RICH)
    snap = s.sample_at(0.0)

    assert snap.ok and snap.error is None and snap.errors == ()
    assert (snap.driver_version, snap.nvml_version, snap.cuda_driver_version) == (
        "560.35.03",
        "12.560.35.03",
        "12.6",
    )
    assert len(snap.gpus) == 2
    gpu = snap.gpus[0]
    assert gpu.error is None
    assert (gpu.index, gpu.uuid, gpu.name, gpu.pci_bus_id, gpu.minor_number) == (
        0,
        RICH_UUID,
        "NVIDIA A100-SXM4-80GB",
        "00000000:3B:00.0",
        0,
    )
    assert gpu.memory_total_bytes == 80 * GiB
    assert gpu.memory_reserved_bytes == 1 * GiB
    assert gpu.memory_used_bytes == RICH_USED
    assert gpu.memory_free_bytes == 80 * GiB - 1 * GiB - RICH_USED
    assert (gpu.utilization_gpu_percent, gpu.utilization_memory_percent) == (73, 41)
    assert gpu.temperature_celsius == 66
    assert (gpu.power_milliwatts, gpu.power_limit_milliwatts) == (301_500, 400_000)
    assert gpu.energy_millijoules == 5_000_000
    assert (gpu.clock_sm_mhz, gpu.clock_memory_mhz) == (1410, 1593)
    assert gpu.clock_event_reasons == 0x24
    assert gpu.pcie_replay_count == 7
    assert (gpu.ecc_corrected_total, gpu.ecc_uncorrected_total) == (12, 1)
    assert gpu.remapped_rows == RemappedRows(
        correctable=3, uncorrectable=2, pending=True, failure=False
    )
    assert gpu.mig_enabled is False
    assert gpu.mig_instances == ()
    assert gpu.processes == RICH_PROCESSES
    # the other GPU is its own device with its own derived identity and values
    other = snap.gpus[1]
    assert other.uuid.startswith("GPU-") and other.uuid != RICH_UUID
    assert (other.pci_bus_id, other.minor_number, other.temperature_celsius) == (
        "00000000:28:00.0",
        1,
        35,
    )
    assert other.processes == (GpuProcess(pid=1004, memory_used_bytes=1 * GiB, kind="compute"),)


def test_energy_counter_grows_with_power_over_simulated_time(sim: list[Sim]) -> None:
    s = start(sim, RICH)
    assert s.sample_at(0.0).gpus[0].energy_millijoules == 5_000_000
    # 301.5 W for 10 s = 3015 J
    assert s.sample_at(10.0).gpus[0].energy_millijoules == 5_000_000 + 3_015_000


def test_per_process_sm_samples_come_once_per_driver_window(sim: list[Sim]) -> None:
    s = start(sim, RICH)
    first = s.sample_at(0.0).gpus[0].process_utilization
    # only processes with SM activity have samples; memory util is the sim's sm // 2
    assert first == (
        ProcessUtilization(pid=1001, sm_percent=60, memory_percent=30, timestamp_us=EPOCH_US),
        ProcessUtilization(pid=1003, sm_percent=25, memory_percent=12, timestamp_us=EPOCH_US),
    )
    # same 100 ms driver window: NVML says NOT_FOUND, "no new samples"; the previous
    # samples stand (so per-container SM series don't flap), and it is no error
    again = s.sample_at(0.05)
    assert again.gpus[0].process_utilization == first
    assert again.errors == ()
    later = s.sample_at(1.0).gpus[0].process_utilization
    assert [(u.pid, u.sm_percent, u.timestamp_us) for u in later] == [
        (1001, 60, EPOCH_US + 1_000_000),
        (1003, 25, EPOCH_US + 1_000_000),
    ]


def test_previous_sm_samples_stand_in_for_missing_new_ones_for_ten_seconds_only(
    sim: list[Sim],
) -> None:
    quiet_at_5 = {
        **RICH,
        "timeline": [{"at": 5, "set_process": {"pid": pid, "sm": 0}} for pid in (1001, 1003)],
    }
    s = start(sim, quiet_at_5)
    first = s.sample_at(0.0).gpus[0].process_utilization
    assert len(first) == 2
    # the driver's history: at 6 s it returns each process's samples up to 5 s, when
    # they stopped running kernels (docs/simulator.md, "Sample buffers")
    last = s.sample_at(6.0).gpus[0].process_utilization
    assert [(u.pid, u.timestamp_us) for u in last] == [
        (1001, EPOCH_US + 5_000_000),
        (1003, EPOCH_US + 5_000_000),
    ]
    # from then on no sample is newer (NOT_FOUND): the last ones stand, for 10 s only,
    # with no SM time (theirs was counted when they were read)
    standing = tuple(replace(u, sm_seconds=0.0) for u in last)
    assert s.sample_at(12.0).gpus[0].process_utilization == standing  # 6 s after the read
    assert s.sample_at(16.5).gpus[0].process_utilization == ()  # 10.5 s: too old, dropped


def test_no_sample_since_a_read_seconds_ago_on_a_gpu_reading_idle_is_idle(
    sim: list[Sim],
) -> None:
    """NotFound a second and more after the last answer, with GPU-Util reading 0: no
    process ran a kernel since, so no reading stands (a time-shared replica judged by
    its SM share reads idle at once, not busy on its last burst's figure)."""
    idle_at_5 = {
        **RICH,
        "timeline": [
            *({"at": 5, "set_process": {"pid": pid, "sm": 0}} for pid in (1001, 1003)),
            {"at": 5, "set": {"gpu": 0, "utilization_gpu": 0}},
        ],
    }
    s = start(sim, idle_at_5)
    assert len(s.sample_at(0.0).gpus[0].process_utilization) == 2
    assert len(s.sample_at(6.0).gpus[0].process_utilization) == 2  # samples up to 5 s
    gpu = s.sample_at(8.0).gpus[0]
    assert gpu.utilization_gpu_percent == 0
    assert gpu.process_utilization == ()


def test_between_two_reads_no_reading_stands_on_a_gpu_reading_idle(sim: list[Sim]) -> None:
    """Per-process reads every 10 s: between two, the last readings stand while the GPU
    is busy, and not while GPU-Util reads 0 (a second and more after the last answer)."""
    idle_at_3 = {**RICH, "timeline": [{"at": 3, "set": {"gpu": 0, "utilization_gpu": 0}}]}
    s = start(sim, idle_at_3)
    s.source.close()
    s.source = NvmlSource(clock=s.clock, process_utilization_interval_s=10.0)
    assert len(s.sample_at(0.0).gpus[0].process_utilization) == 2  # read (a baseline)
    assert len(s.sample_at(1.0).gpus[0].process_utilization) == 2  # read again after it
    assert len(s.sample_at(2.0).gpus[0].process_utilization) == 2  # stands: busy
    gpu = s.sample_at(5.0).gpus[0]  # not due; GPU-Util 0 since 3 s
    assert gpu.utilization_gpu_percent == 0
    assert gpu.process_utilization == ()


def test_timeline_set_of_a_size_field_changes_what_nvml_reports(sim: list[Sim]) -> None:
    scenario = {**RICH, "timeline": [{"at": 5, "set": {"gpu": 0, "memory_reserved": "4GiB"}}]}
    s = start(sim, scenario)
    assert s.sample_at(0.0).gpus[0].memory_reserved_bytes == 1 * GiB
    gpu = s.sample_at(6.0).gpus[0]
    assert gpu.memory_reserved_bytes == 4 * GiB
    assert gpu.memory_used_bytes == RICH_USED
    assert gpu.memory_free_bytes == 80 * GiB - 4 * GiB - RICH_USED


# -- unsupported and missing functions ---------------------------------------------------


def test_not_supported_queries_give_none_not_zero_and_are_not_errors(sim: list[Sim]) -> None:
    unsupported = [
        "nvmlDeviceGetPowerUsage",
        "nvmlDeviceGetTotalEnergyConsumption",
        "nvmlDeviceGetTemperature",
        "nvmlDeviceGetRemappedRows",
        "nvmlDeviceGetPcieReplayCounter",
        "nvmlDeviceGetTotalEccErrors",
        "nvmlDeviceGetProcessUtilization",
    ]
    s = start(sim, {"gpus": [{"unsupported": unsupported}, {}]})
    snap = s.sample_at(0.0)
    gpu, other = snap.gpus
    assert gpu.error is None
    assert gpu.power_milliwatts is None
    assert gpu.energy_millijoules is None
    assert gpu.temperature_celsius is None
    assert gpu.remapped_rows is None
    assert gpu.pcie_replay_count is None
    assert gpu.ecc_corrected_total is None and gpu.ecc_uncorrected_total is None
    assert gpu.process_utilization == ()
    # what the GPU does support is still read
    assert gpu.memory_total_bytes == 80 * GiB
    assert gpu.power_limit_milliwatts == 700_000
    # the other GPU supports everything
    assert (other.power_milliwatts, other.temperature_celsius) == (70_000, 40)
    assert other.remapped_rows == RemappedRows(0, 0, False, False)
    assert snap.errors == ()


def test_a_query_refused_for_lack_of_permission_is_absent_and_counted_not_unsupported(
    sim: list[Sim],
) -> None:
    scenario = {
        "gpus": [{"ecc_uncorrected": 2}],
        "call_errors": [{"call": "nvmlDeviceGetTotalEccErrors", "error": "NO_PERMISSION"}],
    }
    s = start(sim, scenario)
    for t in (0.0, 5.0):  # asked again every cycle, never switched off
        snap = s.sample_at(t)
        assert snap.ok and snap.gpus[0].error is None
        assert snap.gpus[0].ecc_uncorrected_total is None
        assert snap.errors == (("ecc", "NoPermission"),) * 3
    s.node.scenario.call_errors.clear()  # permission granted
    assert s.sample_at(10.0).gpus[0].ecc_uncorrected_total == 2


def test_missing_v3_process_listings_fall_back_to_v2_and_still_list_every_kind(
    sim: list[Sim],
) -> None:
    scenario = {
        **RICH,
        "missing_functions": [
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetGraphicsRunningProcesses_v3",
            "nvmlDeviceGetMPSComputeRunningProcesses_v3",
        ],
    }
    s = start(sim, scenario)
    snap = s.sample_at(0.0)
    assert snap.gpus[0].processes == RICH_PROCESSES
    assert snap.errors == ()


def test_missing_memory_info_v2_falls_back_to_v1_where_used_includes_reserved(
    sim: list[Sim],
) -> None:
    s = start(sim, {**RICH, "missing_functions": ["nvmlDeviceGetMemoryInfo_v2"]})
    gpu = s.sample_at(0.0).gpus[0]
    assert gpu.memory_total_bytes == 80 * GiB
    assert gpu.memory_used_bytes == RICH_USED + 1 * GiB
    assert gpu.memory_free_bytes == 80 * GiB - RICH_USED - 1 * GiB
    assert gpu.memory_reserved_bytes is None


def test_clock_event_reasons_fall_back_to_the_throttle_name_on_r525_to_r530_drivers(
    sim: list[Sim],
) -> None:
    # R525 exports only nvmlDeviceGetCurrentClocksThrottleReasons (same bits)
    scenario: dict[str, object] = {
        "driver_version": "525.147.05",
        "gpus": [{"clock_event_reasons": 0x20 | 0x4}],
    }
    s = start(sim, scenario)
    snap = s.sample_at(0.0)
    assert snap.gpus[0].clock_event_reasons == 0x20 | 0x4
    assert snap.errors == ()
    # so the thermal slowdown is seen there too
    (health,) = assess(snap.gpus, recent_fatal_xids={}, dcgm_failures={}, policy=HealthPolicy())
    assert [r.reason for r in health.reasons] == ["thermal_slowdown"]


def test_clock_event_reasons_are_absent_where_neither_name_exists(sim: list[Sim]) -> None:
    scenario: dict[str, object] = {
        "driver_version": "525.147.05",
        "missing_functions": ["nvmlDeviceGetCurrentClocksThrottleReasons"],
        "gpus": [{"clock_event_reasons": 0x20}],
    }
    snap = start(sim, scenario).sample_at(0.0)
    assert snap.gpus[0].clock_event_reasons is None
    assert snap.errors == ()


# -- GPU failures --------------------------------------------------------------------------


def test_a_gpu_lost_from_the_start_is_isolated_and_the_others_are_read(sim: list[Sim]) -> None:
    s = start(sim, {"gpus": [{}, {"lost": True}, {"temperature": 50}]})
    snap = s.sample_at(0.0)
    assert snap.ok
    lost = snap.gpus[1]
    assert lost.error == "GpuIsLost"
    assert lost.memory_used_bytes is None and lost.processes == ()
    assert [g.error for g in snap.gpus] == [None, "GpuIsLost", None]
    assert snap.gpus[2].temperature_celsius == 50
    assert snap.errors == (("gpu", "GpuIsLost"),)


def test_a_gpu_lost_mid_run_keeps_its_identity_and_is_reopened_when_it_returns(
    sim: list[Sim],
) -> None:
    scenario = {
        "gpus": [{"power_mw": 100_000}, {"power_mw": 200_000}],
        "timeline": [{"at": 10, "lose": 1}, {"at": 30, "set": {"gpu": 1, "lost": False}}],
    }
    s = start(sim, scenario)
    before = s.sample_at(0.0).gpus[1]
    assert before.error is None and before.power_milliwatts == 200_000

    for t in (10.0, 20.0):  # every cycle while it is lost, not only the first
        snap = s.sample_at(t)
        lost = snap.gpus[1]
        assert lost.error == "GpuIsLost"
        assert (lost.uuid, lost.name, lost.pci_bus_id, lost.minor_number) == (
            before.uuid,
            before.name,
            before.pci_bus_id,
            before.minor_number,
        )
        assert lost.power_milliwatts is None
        assert snap.gpus[0].error is None and snap.gpus[0].power_milliwatts == 100_000

    back = s.sample_at(30.0)
    assert back.errors == ()
    assert back.gpus[1].error is None
    assert back.gpus[1].uuid == before.uuid
    assert back.gpus[1].power_milliwatts == 200_000


def test_an_unexpected_nvml_error_on_one_gpu_fails_that_gpu_not_the_cycle(
    sim: list[Sim],
) -> None:
    # a GPU that cannot even say its UUID: nothing can be read from it, the rest can
    s = start(sim, {"gpus": [{}, {"unsupported": ["nvmlDeviceGetUUID"]}, {}]})
    snap = s.sample_at(0.0)
    assert snap.ok
    assert [g.error for g in snap.gpus] == [None, "NotSupported", None]
    assert snap.gpus[1].uuid == "unknown-gpu-1"
    assert snap.gpus[2].memory_total_bytes == 80 * GiB


# -- NVML unavailable ----------------------------------------------------------------------


def test_no_driver_gives_a_snapshot_that_says_nvml_is_down(sim: list[Sim]) -> None:
    s = start(sim, "no-gpu")
    snap = s.sample_at(0.0)
    assert not snap.ok
    assert snap.gpus == ()
    assert snap.error is not None and snap.error.startswith("DriverNotLoaded")


def test_an_init_error_pynvml_has_no_text_for_still_gives_a_down_snapshot(
    sim: list[Sim],
) -> None:
    s = start(sim, {"nvml_init_error": "NO_DATA", "gpus": [{}]})
    snap = s.sample_at(0.0)
    assert not snap.ok
    assert (snap.error or "").startswith("NoData: ")


def test_nvml_init_is_retried_only_after_a_growing_backoff(sim: list[Sim]) -> None:
    s = start(sim, {"nvml_init_error": "DRIVER_NOT_LOADED", "gpus": [{}]})
    assert (s.sample_at(0.0).error or "").startswith("DriverNotLoaded")
    # the driver's answer changes; the source only notices when it tries again
    s.node.scenario.nvml_init_error = NVML_ERROR_CODES["NO_PERMISSION"]
    # first delay is 1 s less up to 20 % jitter, so at 0.5 s it has not retried
    assert (s.sample_at(0.5).error or "").startswith("DriverNotLoaded")
    assert (s.sample_at(1.0).error or "").startswith("NoPermission")
    # the driver comes up; the second delay is 2 s less jitter (>= 1.6 s)
    s.node.scenario.nvml_init_error = None
    waiting = s.sample_at(2.5)
    assert not waiting.ok and (waiting.error or "").startswith("NoPermission")
    up = s.sample_at(3.5)
    assert up.ok and up.error is None
    assert len(up.gpus) == 1 and up.gpus[0].memory_total_bytes == 80 * GiB


def test_a_failed_device_count_is_a_failed_sample_retried_with_backoff(sim: list[Sim]) -> None:
    # nvmlInit succeeds but nvmlDeviceGetCount does not, until t=3
    scenario = {
        "gpus": [{}, {}],
        "call_errors": [{"call": "nvmlDeviceGetCount_v2", "error": "UNKNOWN", "until": 3}],
    }
    s = start(sim, scenario)
    for t in (0.0, 0.5, 1.0, 2.0):  # never "ok with no GPUs"
        down = s.sample_at(t)
        assert not down.ok, t
        assert down.gpus == ()
        assert (down.error or "").startswith("Unknown")
        assert not pynvml.nvmlLib.initialised  # NVML shut down again, not left half-open
    up = s.sample_at(3.0)  # retried at 1.0 + 1.6..2 s
    assert up.ok and up.error is None
    assert len(up.gpus) == 2 and all(g.error is None for g in up.gpus)


# -- MIG -----------------------------------------------------------------------------------


def test_mig_instances_carry_ids_profile_memory_and_their_processes(sim: list[Sim]) -> None:
    s = start(sim, "node-8gpu")
    scenario = s.node.scenario
    gpu = s.sample_at(0.0).gpus[3]
    assert gpu.error is None
    assert gpu.mig_enabled is True
    # the driver reports no GPU-Util (and no per-process samples) in MIG mode
    assert gpu.utilization_gpu_percent is None
    assert gpu.utilization_memory_percent is None
    assert gpu.process_utilization == ()
    assert gpu.processes == ()
    assert gpu.occupancy is None  # occupancy is per instance in MIG mode
    # whole-GPU memory: every MIG process' memory
    assert gpu.memory_used_bytes == (22 * GiB + 300 * MiB) + (9 * GiB + 300 * MiB) + (
        6 * GiB + 300 * MiB
    )
    expected = [
        (0, 1, 0, "3g.40gb", 40 * GiB, 22 * GiB + 300 * MiB),
        (1, 5, 0, "2g.20gb", 20 * GiB, 9 * GiB + 300 * MiB),
        (2, 13, 0, "1g.10gb", 10 * GiB, 6 * GiB + 300 * MiB),
    ]
    assert [
        (
            m.mig_index,
            m.gpu_instance_id,
            m.compute_instance_id,
            m.profile,
            m.memory_total_bytes,
            m.memory_used_bytes,
        )
        for m in gpu.mig_instances
    ] == expected
    assert [m.uuid for m in gpu.mig_instances] == [m.uuid for m in scenario.gpus[3].mig]
    for mig, slot in zip(gpu.mig_instances, range(3), strict=True):
        sim_procs = [p for p in scenario.processes if p.gpu == 3 and p.mig == slot]
        assert mig.processes == tuple(
            GpuProcess(
                pid=p.pid,
                memory_used_bytes=p.memory,
                kind="compute",
                gpu_instance_id=mig.gpu_instance_id,
                compute_instance_id=mig.compute_instance_id,
            )
            for p in sim_procs
        )
        assert len(mig.processes) == 2


def test_mig_occupancy_is_per_instance_from_its_own_processes(sim: list[Sim]) -> None:
    s = start(sim, "node-8gpu")
    assert all(m.occupancy is None for m in s.sample_at(0.0).gpus[3].mig_instances)
    migs = s.sample_at(10.0).gpus[3].mig_instances
    # SM activity per instance = its processes' SM shares (40 %, 15 %, 70 %)
    assert [m.occupancy.sm_active if m.occupancy else None for m in migs] == pytest.approx(
        [0.40, 0.15, 0.70]
    )
    assert all(m.occupancy is not None and m.occupancy.source == "gpm" for m in migs)


MIG_GPU: dict[str, object] = {
    "gpus": [
        {
            "mig": [
                {"profile": "1c.3g.40gb", "gpu_instance_id": 2, "compute_instance_id": 0},
                {"profile": "2c.3g.40gb", "gpu_instance_id": 2, "compute_instance_id": 1},
                {"profile": "3g.40gb", "gpu_instance_id": 1, "compute_instance_id": 0},
            ]
        }
    ],
    "host_processes": [
        {"pid": 2001, "gpu": 0, "mig": 0, "sm": 25, "memory": "1GiB"},
        {"pid": 2002, "gpu": 0, "mig": 1, "sm": 45, "memory": "2GiB"},
        {"pid": 2003, "gpu": 0, "mig": 2, "sm": 10, "memory": "3GiB"},
    ],
}


def _healthy(snap: NvmlSnapshot) -> bool:
    verdicts = assess(snap.gpus, recent_fatal_xids={}, dcgm_failures={}, policy=HealthPolicy())
    return all(not v.reasons for v in verdicts)


@pytest.mark.parametrize(
    "call",
    ["nvmlDeviceGetGpuInstanceId", "nvmlDeviceGetComputeInstanceId", "nvmlDeviceGetUUID"],
)
def test_a_mig_device_whose_identity_cannot_be_read_is_left_out_and_its_gpu_stays_healthy(
    sim: list[Sim], call: str
) -> None:
    scenario = {
        **MIG_GPU,
        "call_errors": [{"call": call, "error": "INVALID_ARGUMENT", "gpu": 0, "mig": 1}],
    }
    s = start(sim, scenario)
    for t in (0.0, 5.0):
        snap = s.sample_at(t)
        gpu = snap.gpus[0]
        assert gpu.error is None
        assert [
            (m.mig_index, m.gpu_instance_id, m.compute_instance_id) for m in gpu.mig_instances
        ] == [
            (0, 2, 0),
            (2, 1, 0),
        ]
        assert gpu.mig_instances[0].processes[0].pid == 2001
        assert snap.errors == (("mig_identity", "InvalidArgument"),)
        assert _healthy(snap)


def test_mig_handles_that_fail_leave_the_gpu_without_instances_but_healthy(
    sim: list[Sim],
) -> None:
    scenario = {
        **MIG_GPU,
        "call_errors": [
            {"call": "nvmlDeviceGetMigDeviceHandleByIndex", "error": "NO_PERMISSION", "gpu": 0}
        ],
    }
    snap = start(sim, scenario).sample_at(0.0)
    gpu = snap.gpus[0]
    assert gpu.error is None and gpu.mig_enabled is True
    assert gpu.mig_instances == ()
    assert gpu.memory_total_bytes == 80 * GiB  # the whole GPU is still read
    assert snap.errors and set(snap.errors) == {("mig_handle", "NoPermission")}
    assert _healthy(snap)


def test_a_mig_device_whose_memory_cannot_be_read_is_kept_without_memory(
    sim: list[Sim],
) -> None:
    scenario = {
        **MIG_GPU,
        "call_errors": [
            {"call": "nvmlDeviceGetMemoryInfo_v2", "error": "INVALID_ARGUMENT", "gpu": 0, "mig": 2}
        ],
    }
    snap = start(sim, scenario).sample_at(0.0)
    gpu = snap.gpus[0]
    assert gpu.error is None
    migs = {m.mig_index: m for m in gpu.mig_instances}
    assert sorted(migs) == [0, 1, 2]
    assert migs[2].memory_total_bytes is None and migs[2].memory_used_bytes is None
    assert migs[0].memory_used_bytes == 1 * GiB
    assert snap.errors == (("memory", "InvalidArgument"),)
    assert _healthy(snap)


def test_memory_refused_without_mig_monitoring_rights_is_an_error_not_a_lost_gpu(
    sim: list[Sim],
) -> None:
    # in a container without NVIDIA_MIG_MONITOR_DEVICES, a MIG GPU's memory query answers
    # NO_PERMISSION (NVIDIA/nvidia-container-toolkit#842, NVIDIA/k8s-device-plugin#399)
    scenario = {
        **MIG_GPU,
        "call_errors": [{"call": "nvmlDeviceGetMemoryInfo_v2", "error": "NO_PERMISSION", "gpu": 0}],
    }
    s = start(sim, scenario)
    for t in (0.0, 5.0):  # asked again, and counted, every cycle
        snap = s.sample_at(t)
        gpu = snap.gpus[0]
        assert gpu.error is None
        assert gpu.memory_total_bytes is None and gpu.memory_used_bytes is None
        assert [m.memory_total_bytes for m in gpu.mig_instances] == [None, None, None]
        assert snap.errors == (("memory", "NoPermission"),) * 4  # the GPU and its 3 MIG devices
        assert _healthy(snap)


def test_compute_instances_of_one_gpu_instance_share_its_gpm_figures(sim: list[Sim]) -> None:
    # GPM measures a GPU instance; NVML wants > 100 ms between its two samples, so the
    # GPU instance is sampled once per cycle and both compute instances show that window
    s = start(sim, MIG_GPU)
    s.sample_at(0.0)
    for t in (10.0, 15.0):
        migs = s.sample_at(t).gpus[0].mig_instances
        sm = [m.occupancy.sm_active if m.occupancy else None for m in migs]
        assert sm == pytest.approx([0.70, 0.70, 0.10]), t
        assert migs[0].occupancy == migs[1].occupancy


# -- GPM occupancy -------------------------------------------------------------------------


def test_first_cycle_primes_gpm_and_yields_no_occupancy(sim: list[Sim]) -> None:
    s = start(sim, "single-gpu")
    assert s.sample_at(0.0).gpus[0].occupancy is None


def test_gpm_occupancy_between_two_cycles_equals_the_scenario_values(sim: list[Sim]) -> None:
    s = start(sim, "single-gpu")
    s.sample_at(0.0)
    occ = s.sample_at(10.0).gpus[0].occupancy
    assert occ is not None and occ.source == "gpm"
    # set in the scenario: sm_active 63, sm_occupancy 38, tensor 44, dram 29
    assert occ.sm_active == pytest.approx(0.63)
    assert occ.sm_occupancy == pytest.approx(0.38)
    assert occ.tensor_active == pytest.approx(0.44)
    assert occ.dram_active == pytest.approx(0.29)
    # derived: graphics = GPU-Util 87 %, FP pipes from the one process' 63 % SM share
    assert occ.graphics_active == pytest.approx(0.87)
    assert occ.fp64_active == pytest.approx(0.0)
    assert occ.fp32_active == pytest.approx(0.63 * 0.2)
    assert occ.fp16_active == pytest.approx(0.63 * 0.1)


def test_a_gpm_value_that_is_not_a_number_is_no_value(sim: list[Sim]) -> None:
    # NaN passes through min/max clamping and would compare below every idle threshold
    s = start(sim, {"gpus": [{"gpm": {"sm_active": float("nan"), "sm_occupancy": float("inf")}}]})
    s.sample_at(0.0)
    occ = s.sample_at(10.0).gpus[0].occupancy
    assert occ is not None and occ.sm_active is None and occ.sm_occupancy is None


def test_gpm_occupancy_is_the_time_average_across_a_mid_window_change(sim: list[Sim]) -> None:
    scenario = {
        "gpus": [{"gpm": {"sm_active": 80, "sm_occupancy": 40}}],
        "timeline": [{"at": 10, "set": {"gpu": 0, "gpm": {"sm_active": 20, "sm_occupancy": 10}}}],
    }
    s = start(sim, scenario)
    s.sample_at(0.0)
    occ = s.sample_at(20.0).gpus[0].occupancy  # 10 s at 80 %, 10 s at 20 %
    assert occ is not None
    assert occ.sm_active == pytest.approx(0.5)
    assert occ.sm_occupancy == pytest.approx(0.25)
    occ = s.sample_at(30.0).gpus[0].occupancy  # the whole window after the change
    assert occ is not None and occ.sm_active == pytest.approx(0.2)


def test_gpm_windows_follow_the_sample_cycles_not_the_scenario_events(sim: list[Sim]) -> None:
    scenario = {
        "gpus": [{"gpm": {"sm_active": 80}}],
        "timeline": [{"at": 10, "set": {"gpu": 0, "gpm": {"sm_active": 20}}}],
    }
    s = start(sim, scenario)
    s.sample_at(0.0)
    first = s.sample_at(5.0).gpus[0].occupancy
    second = s.sample_at(15.0).gpus[0].occupancy  # 5 s at 80 %, 5 s at 20 %
    assert first is not None and first.sm_active == pytest.approx(0.8)
    assert second is not None and second.sm_active == pytest.approx(0.5)


def test_tiny_kernels_read_full_gpu_util_while_gpm_shows_idle_sms(sim: list[Sim]) -> None:
    s = start(sim, "node-8gpu")
    s.sample_at(0.0)
    gpu = s.sample_at(10.0).gpus[4]
    assert gpu.utilization_gpu_percent == 100
    assert gpu.occupancy is not None
    assert gpu.occupancy.sm_active == pytest.approx(0.018)
    assert gpu.occupancy.sm_occupancy == pytest.approx(0.004)


def test_gpu_without_gpm_has_no_occupancy_and_no_error(sim: list[Sim]) -> None:
    s = start(sim, {"gpus": [{"gpm_supported": False}, {"gpm": {"sm_active": 50}}]})
    s.sample_at(0.0)
    snap = s.sample_at(10.0)
    assert snap.gpus[0].occupancy is None
    assert snap.gpus[1].occupancy is not None
    assert snap.gpus[1].occupancy.sm_active == pytest.approx(0.5)
    assert snap.errors == ()


def test_recovery_action_field_is_read_and_absent_where_the_driver_lacks_it(
    sim: list[Sim],
) -> None:
    scenario = {
        "gpus": [{"recovery_action": 0}, {"recovery_action": None}],
        "timeline": [{"at": 5, "set": {"gpu": 0, "recovery_action": 2}}],
    }
    s = start(sim, scenario)
    first = s.sample_at(0.0)
    assert [g.recovery_action for g in first.gpus] == [0, None]
    assert first.errors == ()  # an unsupported field is no error
    assert s.sample_at(6.0).gpus[0].recovery_action == 2  # NODE_REBOOT, after XID 154


def test_a_gpu_that_comes_back_does_not_leak_the_drivers_gpm_buffers() -> None:
    from exporter.sim.node import ManualClock, SimNode
    from exporter.sim.nvml_library import install
    from exporter.sim.scenario import parse_scenario

    scenario = parse_scenario(
        {
            "gpus": [{}, {}],
            "timeline": [
                {"at": 5, "set": {"gpu": 1, "lost": True}},
                {"at": 10, "set": {"gpu": 1, "lost": False}},
            ],
        },
        "flaky",
    )
    clock = ManualClock()
    library = install(SimNode(scenario, clock))
    source = NvmlSource(clock=clock)
    try:
        for t in (0.0, 1.0):
            clock.now = t
            source.sample()
        assert len(library._gpm_samples) == 4  # two buffers per GPU
        clock.now = 6.0
        assert source.sample().gpus[1].error == "GpuIsLost"
        for t in (11.0, 12.0):  # re-opened with fresh buffers, the old ones freed
            clock.now = t
            snapshot = source.sample()
        assert snapshot.gpus[1].error is None and snapshot.gpus[1].occupancy is not None
        assert len(library._gpm_samples) == 4
    finally:
        source.close()
    assert library._gpm_samples == {}  # close() frees everything


def test_gpm_losing_permission_is_counted_logged_once_retried_and_comes_back(
    sim: list[Sim], caplog: pytest.LogCaptureFixture
) -> None:
    # DCGM issue #214: nvmlGpmSampleGet answers NO_PERMISSION after a while in an
    # unprivileged container; here from t=20 until t=60
    scenario = {
        "gpus": [{"gpm": {"sm_active": 50}}, {"gpm": {"sm_active": 30}}],
        "call_errors": [
            {
                "call": "nvmlGpmSampleGet",
                "error": "NO_PERMISSION",
                "gpu": 0,
                "from": 20,
                "until": 60,
            }
        ],
    }
    s = start(sim, scenario)
    caplog.set_level(logging.INFO, logger="exporter.sources.nvml")
    snaps = {t: s.sample_at(float(t)) for t in range(0, 90, 5)}
    occupancy = {
        t: (snap.gpus[0].occupancy.sm_active if snap.gpus[0].occupancy else None)
        for t, snap in snaps.items()
    }
    assert occupancy[5] == occupancy[15] == pytest.approx(0.5)
    assert all(occupancy[t] is None for t in range(20, 65, 5))
    assert occupancy[85] == pytest.approx(0.5)  # back, not switched off for good
    for t, snap in snaps.items():
        assert snap.ok and snap.gpus[0].error is None, t  # NVML itself is fine
        other = snap.gpus[1].occupancy  # the other GPU is not affected
        assert t == 0 or (other is not None and other.sm_active == pytest.approx(0.3))
    # every attempt is an error; retries back off (1, 2, 4, 8 s less jitter), so the
    # cycle at 40 s does not try
    for t in (20, 25, 30, 35):
        assert snaps[t].errors == (("gpm", "NoPermission"),), t
    assert snaps[40].errors == ()
    # one line when it starts failing, one when it works again
    lines = [r.getMessage() for r in caplog.records if "GPM" in r.getMessage()]
    assert len(lines) == 2
    assert "NoPermission" in lines[0] and "GPU 0" in lines[0]
    assert "GPU 0" in lines[1]
