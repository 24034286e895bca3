"""The simulated libnvidia-ml itself, driven only through pynvml's public API, and the
scenario loader's errors: what a developer sees when a scenario is wrong."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pynvml
import pytest

from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import install
from exporter.sim.scenario import SHIPPED, ScenarioError, load_scenario, parse_scenario

GiB = 1024**3

TWO_GPUS: dict[str, Any] = {
    "gpus": [
        {"uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000000", "power_mw": 123_000},
        {
            "uuid": "GPU-bbbbbbbb-0000-0000-0000-000000000000",
            "unsupported": ["nvmlDeviceGetPowerUsage"],
            "mig": [
                {"profile": "4g.40gb", "gpu_instance_id": 2, "compute_instance_id": 0},
                {"profile": "3g.40gb", "gpu_instance_id": 1, "compute_instance_id": 0},
            ],
        },
    ],
    "host_processes": [{"pid": 777, "gpu": 0, "memory": "1GiB", "sm": 10}],
    "timeline": [
        {"at": 30, "xid": {"gpu": 1, "code": 79}},
        {"at": 40, "xid": {"gpu": 0, "code": 31}},
    ],
}


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def run_nvml(scenario: dict[str, Any], clock: ManualClock) -> Iterator[SimNode]:
    node = SimNode(parse_scenario(scenario, "test"), clock)
    install(node)
    pynvml.nvmlInit()
    try:
        yield node
    finally:
        pynvml.nvmlShutdown()


@pytest.fixture
def node(clock: ManualClock) -> Iterator[SimNode]:
    yield from run_nvml(TWO_GPUS, clock)


# -- handles and identity ------------------------------------------------------------------


def test_device_count_and_handles_by_index_give_each_gpus_identity(node: SimNode) -> None:
    assert pynvml.nvmlDeviceGetCount() == 2
    uuids = [pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in range(2)]
    assert uuids == [
        "GPU-aaaaaaaa-0000-0000-0000-000000000000",
        "GPU-bbbbbbbb-0000-0000-0000-000000000000",
    ]
    h = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetName(h) == "NVIDIA H100 80GB HBM3"
    assert pynvml.nvmlDeviceGetPciInfo(h).busId == "00000000:18:00.0"
    assert pynvml.nvmlDeviceGetPowerUsage(h) == 123_000


def test_a_handle_index_past_the_last_gpu_is_an_invalid_argument(node: SimNode) -> None:
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetHandleByIndex(2)


def test_device_queries_before_init_raise_uninitialized(clock: ManualClock) -> None:
    install(SimNode(parse_scenario(TWO_GPUS, "test"), clock))
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        pynvml.nvmlDeviceGetCount()


def test_mig_handles_resolve_to_their_instance_and_back_to_the_parent(node: SimNode) -> None:
    parent = pynvml.nvmlDeviceGetHandleByIndex(1)
    assert pynvml.nvmlDeviceGetMigMode(parent) == [1, 1]
    assert pynvml.nvmlDeviceGetMaxMigDeviceCount(parent) == 7
    mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 1)
    assert pynvml.nvmlDeviceIsMigDeviceHandle(mig)
    assert not pynvml.nvmlDeviceIsMigDeviceHandle(parent)
    assert pynvml.nvmlDeviceGetGpuInstanceId(mig) == 1
    assert pynvml.nvmlDeviceGetComputeInstanceId(mig) == 0
    assert pynvml.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 3g.40gb"
    assert pynvml.nvmlDeviceGetUUID(mig) == node.gpus[1].mig[1].uuid
    assert pynvml.nvmlDeviceGetMemoryInfo(mig, version=pynvml.nvmlMemory_v2).total == 10 * GiB
    back = pynvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig)
    assert pynvml.nvmlDeviceGetUUID(back) == "GPU-bbbbbbbb-0000-0000-0000-000000000000"
    # slots past the configured instances do not exist
    with pytest.raises(pynvml.NVMLError_NotFound):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, 2)
    # a GPU not in MIG mode has no MIG handles at all
    whole = pynvml.nvmlDeviceGetHandleByIndex(0)
    assert pynvml.nvmlDeviceGetMigMode(whole) == [0, 0]
    with pytest.raises(pynvml.NVMLError_InvalidArgument):
        pynvml.nvmlDeviceGetMigDeviceHandleByIndex(whole, 0)


def test_gpu_util_is_not_supported_in_mig_mode(node: SimNode) -> None:
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetUtilizationRates(pynvml.nvmlDeviceGetHandleByIndex(1))


def test_process_listing_is_marshalled_into_pynvml_structs(node: SimNode) -> None:
    procs = pynvml.nvmlDeviceGetComputeRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0))
    assert [(p.pid, p.usedGpuMemory) for p in procs] == [(777, 1 * GiB)]
    assert (procs[0].gpuInstanceId, procs[0].computeInstanceId) == (0xFFFFFFFF, 0xFFFFFFFF)
    assert pynvml.nvmlDeviceGetGraphicsRunningProcesses(pynvml.nvmlDeviceGetHandleByIndex(0)) == []


def test_power_management_limit_and_pcie_throughput_answer_as_nvitop_reads_them(
    clock: ManualClock,
) -> None:
    """Two calls nvitop-exporter (the benchmark's peer) makes and our exporter does not."""
    gpu = {"uuid": "GPU-aaaaaaaa-0000-0000-0000-000000000000", "pcie_rx_bytes_per_s": 2048_000}
    for _ in run_nvml({"gpus": [gpu]}, clock):
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetPowerManagementLimit(handle) == 700_000  # the default
        assert pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) == 700_000
        assert pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_RX_BYTES) == 2000
        assert pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_TX_BYTES) == 0
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetPcieThroughput(handle, pynvml.NVML_PCIE_UTIL_COUNT)


# -- errors the way pynvml raises them -----------------------------------------------------


def test_a_gpus_unsupported_function_raises_not_supported_for_that_gpu_only(
    node: SimNode,
) -> None:
    with pytest.raises(pynvml.NVMLError_NotSupported):
        pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(1))
    assert pynvml.nvmlDeviceGetPowerUsage(pynvml.nvmlDeviceGetHandleByIndex(0)) == 123_000


def test_a_missing_function_raises_function_not_found(clock: ManualClock) -> None:
    scenario = {**TWO_GPUS, "missing_functions": ["nvmlDeviceGetMemoryInfo_v2"]}
    for _ in run_nvml(scenario, clock):
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetMemoryInfo(h, version=pynvml.nvmlMemory_v2)
        # v1 is still there, and its "used" includes the driver-reserved 512 MiB
        assert pynvml.nvmlDeviceGetMemoryInfo(h).used == 1 * GiB + 512 * 1024**2


def test_unversioned_wrapper_over_a_missing_v3_raises_library_mismatch(
    clock: ManualClock,
) -> None:
    scenario = {**TWO_GPUS, "missing_functions": ["nvmlDeviceGetComputeRunningProcesses_v3"]}
    for _ in run_nvml(scenario, clock):
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLLibraryMismatchError):
            pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses_v2(h)
        assert [(p.pid, p.usedGpuMemory) for p in procs] == [(777, 1 * GiB)]


def test_a_lost_gpu_answers_gpu_is_lost(clock: ManualClock) -> None:
    scenario = {**TWO_GPUS, "timeline": [{"at": 5, "lose": 0}]}
    for _ in run_nvml(scenario, clock):
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU) == 40
        clock.advance(5)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
        with pytest.raises(pynvml.NVMLError_GpuIsLost):
            pynvml.nvmlDeviceGetUUID(h)


def test_a_call_error_answers_only_in_its_window_and_on_its_gpu(clock: ManualClock) -> None:
    scenario = {
        **TWO_GPUS,
        "call_errors": [
            {"call": "nvmlDeviceGetCount_v2", "error": "UNKNOWN", "until": 5},
            {"call": "nvmlDeviceGetTemperature", "error": "NO_PERMISSION", "gpu": 0, "from": 5},
        ],
    }
    for _ in run_nvml(scenario, clock):
        with pytest.raises(pynvml.NVMLError_Unknown):
            pynvml.nvmlDeviceGetCount()
        h0, h1 = (pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(2))
        assert pynvml.nvmlDeviceGetTemperature(h0, pynvml.NVML_TEMPERATURE_GPU) == 40
        clock.advance(5)
        assert pynvml.nvmlDeviceGetCount() == 2
        with pytest.raises(pynvml.NVMLError_NoPermission):
            pynvml.nvmlDeviceGetTemperature(h0, pynvml.NVML_TEMPERATURE_GPU)
        assert pynvml.nvmlDeviceGetTemperature(h1, pynvml.NVML_TEMPERATURE_GPU) == 40


def test_a_call_error_on_one_mig_device_leaves_its_siblings_and_parent_alone(
    clock: ManualClock,
) -> None:
    scenario = {
        **TWO_GPUS,
        "call_errors": [
            {"call": "nvmlDeviceGetUUID", "error": "INVALID_ARGUMENT", "gpu": 1, "mig": 1}
        ],
    }
    for node in run_nvml(scenario, clock):
        parent = pynvml.nvmlDeviceGetHandleByIndex(1)
        first, second = (pynvml.nvmlDeviceGetMigDeviceHandleByIndex(parent, i) for i in (0, 1))
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            pynvml.nvmlDeviceGetUUID(second)
        assert pynvml.nvmlDeviceGetUUID(first) == node.gpus[1].mig[0].uuid
        assert pynvml.nvmlDeviceGetUUID(parent) == "GPU-bbbbbbbb-0000-0000-0000-000000000000"


def test_a_driver_older_than_r535_has_only_the_throttle_reasons_name(clock: ManualClock) -> None:
    scenario = {"driver_version": "525.147.05", "gpus": [{"clock_event_reasons": 0x20}]}
    for _ in run_nvml(scenario, clock):
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        with pytest.raises(pynvml.NVMLError_FunctionNotFound):
            pynvml.nvmlDeviceGetCurrentClocksEventReasons(h)
        assert pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h) == 0x20
    newer = {"driver_version": "535.54.03", "gpus": [{"clock_event_reasons": 0x20}]}
    for _ in run_nvml(newer, clock):
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetCurrentClocksEventReasons(h) == 0x20


def _gpm_sm_active(first: Any, second: Any) -> float:
    request = pynvml.c_nvmlGpmMetricsGet_t()
    request.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    request.sample1, request.sample2 = first, second
    request.numMetrics = 1
    request.metrics[0].metricId = pynvml.NVML_GPM_METRIC_SM_UTIL
    pynvml.nvmlGpmMetricsGet(request)
    return float(request.metrics[0].value)


def test_gpm_samples_closer_than_the_refresh_period_read_zero(clock: ManualClock) -> None:
    for _ in run_nvml({"gpus": [{"gpm": {"sm_active": 60}}]}, clock):
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        a, b, c = (pynvml.nvmlGpmSampleAlloc() for _ in range(3))
        pynvml.nvmlGpmSampleGet(h, a)
        clock.advance(0.005)  # 5 ms: the counters have not refreshed
        pynvml.nvmlGpmSampleGet(h, b)
        assert _gpm_sm_active(a, b) == 0.0
        clock.advance(0.995)
        pynvml.nvmlGpmSampleGet(h, c)
        assert _gpm_sm_active(a, c) == pytest.approx(60.0)


def test_gpm_on_mig_measures_the_gpu_instance_with_all_its_compute_instances(
    clock: ManualClock,
) -> None:
    scenario = {
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
            {"gpu": 0, "mig": 0, "sm": 25},
            {"gpu": 0, "mig": 1, "sm": 45},
            {"gpu": 0, "mig": 2, "sm": 10},
        ],
    }
    for _ in run_nvml(scenario, clock):
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        a, b = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
        c, d = pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()
        pynvml.nvmlGpmMigSampleGet(h, 2, a)
        pynvml.nvmlGpmMigSampleGet(h, 1, c)
        clock.advance(5)
        pynvml.nvmlGpmMigSampleGet(h, 2, b)
        pynvml.nvmlGpmMigSampleGet(h, 1, d)
        assert _gpm_sm_active(a, b) == pytest.approx(70.0)  # both compute instances
        assert _gpm_sm_active(c, d) == pytest.approx(10.0)
        with pytest.raises(pynvml.NVMLError_NotFound):
            pynvml.nvmlGpmMigSampleGet(h, 7, a)


def test_nvml_init_fails_with_the_scenarios_driver_error(clock: ManualClock) -> None:
    install(SimNode(load_scenario("no-gpu"), clock))
    with pytest.raises(pynvml.NVMLError_DriverNotLoaded):
        pynvml.nvmlInit()


def test_an_error_code_pynvml_has_no_text_for_reads_the_librarys_error_string(
    clock: ManualClock,
) -> None:
    install(SimNode(parse_scenario({"nvml_init_error": "NO_DATA"}, "test"), clock))
    with pytest.raises(pynvml.NVMLError) as caught:
        pynvml.nvmlInit()
    assert caught.value.value == pynvml.NVML_ERROR_NO_DATA
    assert str(caught.value)  # pynvml asks nvmlErrorString; that must not blow up


# -- XID events ----------------------------------------------------------------------------


def _xid_event_set() -> Any:
    event_set = pynvml.nvmlEventSetCreate()
    for i in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(i)
        supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
        assert supported & pynvml.nvmlEventTypeXidCriticalError
        pynvml.nvmlDeviceRegisterEvents(handle, pynvml.nvmlEventTypeXidCriticalError, event_set)
    return event_set


def test_event_set_wait_times_out_when_no_xid_is_due(node: SimNode, clock: ManualClock) -> None:
    event_set = _xid_event_set()
    try:
        clock.advance(29)
        started = time.monotonic()
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait(event_set, 100)
        assert time.monotonic() - started < 2.0
    finally:
        pynvml.nvmlEventSetFree(event_set)


def test_event_set_wait_returns_timeline_xids_in_order_once_each(
    node: SimNode, clock: ManualClock
) -> None:
    event_set = _xid_event_set()
    try:
        clock.advance(45)
        first = pynvml.nvmlEventSetWait(event_set, 100)
        assert first.eventType == pynvml.nvmlEventTypeXidCriticalError
        assert first.eventData == 79
        assert pynvml.nvmlDeviceGetUUID(first.device) == node.gpus[1].uuid
        assert first.gpuInstanceId == 0xFFFFFFFF
        second = pynvml.nvmlEventSetWait(event_set, 100)
        assert second.eventData == 31
        assert pynvml.nvmlDeviceGetUUID(second.device) == node.gpus[0].uuid
        with pytest.raises(pynvml.NVMLError_Timeout):
            pynvml.nvmlEventSetWait(event_set, 50)
    finally:
        pynvml.nvmlEventSetFree(event_set)


def test_a_waiting_event_set_wakes_when_an_xid_becomes_due(
    node: SimNode, clock: ManualClock
) -> None:
    event_set = _xid_event_set()
    got: list[int] = []

    def wait() -> None:
        got.append(pynvml.nvmlEventSetWait(event_set, 5000).eventData)

    waiter = threading.Thread(target=wait)
    started = time.monotonic()
    waiter.start()
    try:
        time.sleep(0.1)
        clock.advance(31)  # the XID 79 at t=30 is now due
        waiter.join(timeout=5)
        assert got == [79]
        assert time.monotonic() - started < 2.0
    finally:
        waiter.join(timeout=6)
        pynvml.nvmlEventSetFree(event_set)


def test_xids_raised_before_the_event_set_existed_are_not_replayed(
    node: SimNode, clock: ManualClock
) -> None:
    clock.advance(35)
    node.advance()  # the XID at t=30 happened before anyone listened
    event_set = _xid_event_set()
    try:
        clock.advance(10)
        assert pynvml.nvmlEventSetWait(event_set, 100).eventData == 31
    finally:
        pynvml.nvmlEventSetFree(event_set)


# -- scenario validation -------------------------------------------------------------------


def _error(data: object) -> str:
    with pytest.raises(ScenarioError) as caught:
        parse_scenario(data, "bad")
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_minor_number_defaults_to_the_index(node: SimNode) -> None:
    minors = [pynvml.nvmlDeviceGetMinorNumber(pynvml.nvmlDeviceGetHandleByIndex(i)) for i in (0, 1)]
    assert minors == [0, 1]


def test_a_gpus_minor_number_is_the_scenarios_not_its_index(clock: ManualClock) -> None:
    scenario = {"gpus": [{"minor": 3}, {"minor": 0}]}
    for _ in run_nvml(scenario, clock):
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in (0, 1)]
        assert [pynvml.nvmlDeviceGetMinorNumber(h) for h in handles] == [3, 0]


def test_two_gpus_with_one_minor_are_rejected_in_one_line() -> None:
    message = _error({"gpus": [{"minor": 1}, {}]})
    assert message == "gpus[1].minor: 1 is already GPU 0's minor"


def test_a_minor_that_is_not_a_number_is_named() -> None:
    assert _error({"gpus": [{"minor": "two"}]}) == (
        "gpus[0].minor: 'two' is not a device minor (0..255)"
    )


def test_a_bad_allocator_is_one_line_naming_the_choices() -> None:
    assert _error({"allocator": ["gke"]}) == ("allocator: ['gke'] is not one of nvidia, gke, dra")


def test_a_call_error_with_an_unknown_code_is_named() -> None:
    with pytest.raises(ScenarioError, match=r"call_errors\[0\]\.error: 'DENIED'"):
        parse_scenario({"call_errors": [{"call": "nvmlGpmSampleGet", "error": "DENIED"}]}, "t")


def test_a_call_error_on_a_mig_instance_the_gpu_lacks_is_rejected() -> None:
    with pytest.raises(ScenarioError, match=r"call_errors\[0\]\.mig"):
        parse_scenario(
            {
                "gpus": [{}],
                "call_errors": [
                    {"call": "nvmlDeviceGetUUID", "error": "UNKNOWN", "gpu": 0, "mig": 0}
                ],
            },
            "t",
        )


def test_unknown_top_level_key_is_named() -> None:
    assert _error({"gpus": [{}], "gpu_count": 8}).startswith("bad: unknown key 'gpu_count'")


def test_unknown_gpu_key_is_named_with_its_gpu() -> None:
    message = _error({"gpus": [{}, {"colour": "green"}]})
    assert message.startswith("gpus[1]: unknown key 'colour'")


def test_unknown_gpu_defaults_key_is_named() -> None:
    message = _error({"gpu_defaults": {"wattage": 700}, "gpus": [{}]})
    assert message.startswith("gpu_defaults: unknown key 'wattage'")


def test_bad_size_names_the_field_and_the_value() -> None:
    message = _error({"gpus": [{"memory_total": "lots"}]})
    assert message == "gpus[0].memory_total: 'lots' is not a size (use bytes or e.g. 80GiB)"


def test_bad_mig_size_names_the_mig_field() -> None:
    message = _error({"gpus": [{"mig": [{"memory_total": "big"}]}]})
    assert message.startswith("gpus[0].mig[0].memory_total: 'big' is not a size")


def test_process_on_a_gpu_index_the_node_lacks_is_rejected() -> None:
    message = _error({"gpus": [{}, {}], "host_processes": [{"gpu": 2}]})
    assert message == "host_processes[0].gpu: 2 is not a GPU index (0..1)"


def test_process_on_a_mig_instance_the_gpu_lacks_is_rejected() -> None:
    message = _error({"gpus": [{}], "host_processes": [{"pid": 9, "gpu": 0, "mig": 0}]})
    assert message == "pid 9: GPU 0 has no MIG instance 0"


def test_unknown_scenario_path_says_why_and_lists_the_shipped_names(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ScenarioError) as caught:
        load_scenario(str(missing))
    message = str(caught.value)
    assert "\n" not in message
    assert message == (
        f"cannot read scenario {str(missing)!r}: No such file or directory; "
        f"use a file path or one of {', '.join(SHIPPED)}"
    )
    assert {"single-gpu", "node-8gpu", "no-gpu"} <= set(SHIPPED)


def test_invalid_yaml_names_the_scenario_and_the_line(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("gpus:\n  - {temperature: 40\n  - power_mw: [\n", encoding="utf-8")
    with pytest.raises(ScenarioError) as caught:
        load_scenario(str(path))
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("scenario 'broken' is not valid YAML at line ")


def test_a_scenario_file_loads_by_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.yaml"
    path.write_text("node_name: n1\ngpus:\n  - {power_mw: 5000}\n", encoding="utf-8")
    scenario = load_scenario(str(path))
    assert (scenario.name, scenario.node_name, scenario.gpus[0].power_mw) == ("mine", "n1", 5000)


# -- call counting -------------------------------------------------------------------------


@pytest.mark.parametrize("count_calls", [True, False])
def test_calls_are_counted_only_where_asked(clock: ManualClock, count_calls: bool) -> None:
    library = install(SimNode(parse_scenario(TWO_GPUS, "test"), clock), count_calls=count_calls)
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetPowerUsage(handle) == 123_000  # answered either way
    finally:
        pynvml.nvmlShutdown()
    counted = library.calls.by_function
    if count_calls:
        assert counted["nvmlDeviceGetPowerUsage"] == 1
        assert counted["nvmlDeviceGetHandleByIndex_v2"] == 1
    else:
        assert not counted
