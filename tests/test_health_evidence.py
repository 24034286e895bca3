"""A hardware verdict needs hardware evidence.

Pure checks of the rule at each step (the source's classification of NVML's codes, the
verdict, the transitions, the node condition, capacity), and the true side on the
simulated node: a GPU NVML really calls lost still gets its GPULost Events, the
condition True (reason GPULost) and a DeviceTaintRule. The faults themselves are rows of
the fault matrix (tests/faults/test_nvml_evidence_faults.py).
"""

from __future__ import annotations

import pynvml

from exporter.analysis.capacity import node_capacity
from exporter.analysis.health import HealthPolicy, assess
from exporter.model import GpuHealth, GpuSample, HealthReason, placeholder_uuid
from exporter.reporting.condition import desired_condition
from exporter.sources.nvml_codes import GPU_FAILED, GPU_LOST, error_name
from tests.harness import simulated_exporter
from tests.kube_writes import dra_with_a_reset, status_of
from tests.test_capacity_unknown import held, kubelet, states
from tests.test_kube_events import api, regarding, step, until, until_equal
from tests.test_transitions import cycle, health, kinds, run

LOST = HealthReason("gpu_lost", "unhealthy", "GpuIsLost")
UNREADABLE = HealthReason("unreadable", "unknown", "Unknown")


def verdict(sample: GpuSample) -> GpuHealth:
    (h,) = assess([sample], recent_fatal_xids={}, dcgm_failures={}, policy=HealthPolicy())
    return h


# -- which codes are hardware evidence ----------------------------------------------------


def test_only_gpu_is_lost_and_reset_required_are_nvmls_word_that_the_gpu_is_lost() -> None:
    assert {error_name(c(0)) for c in GPU_LOST} == {"GpuIsLost", "ResetRequired"}
    assert not isinstance(pynvml.NVMLError_Unknown(0), GPU_LOST)
    assert not isinstance(pynvml.NVMLError_NoPermission(0), GPU_LOST)
    assert isinstance(pynvml.NVMLError_Unknown(0), GPU_FAILED)  # stops the reading, no verdict


def test_a_reading_failed_without_hardware_evidence_is_unknown_and_a_lost_one_unhealthy() -> None:
    unknown = verdict(GpuSample(index=0, uuid="GPU-a", error="TypeError"))
    lost = verdict(GpuSample(index=0, uuid="GPU-a", error="GpuIsLost", lost=True))
    assert (unknown.unknown, unknown.unhealthy, unknown.healthy) == (True, False, False)
    assert (lost.unknown, lost.unhealthy) == (False, True)


# -- transitions ---------------------------------------------------------------------------


def test_an_unreadable_gpu_is_told_nothing_and_keeps_its_facts() -> None:
    unreadable = health((0, "GPU-a", (UNREADABLE,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    lost = health((0, "GPU-a", (LOST,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    (_, told, _, became, still), facts = run(
        cycle(),
        cycle(verdicts=unreadable),
        cycle(),
        cycle(verdicts=lost),
        cycle(verdicts=unreadable),
    )
    assert told == () and still == ()  # no GPULost, and no "back" while it cannot be read
    assert kinds(became) == ["gpu_lost"]
    assert facts.unhealthy == {"GPU-a": frozenset({"gpu_lost"})}


def test_a_gpu_lost_before_its_uuid_was_read_is_back_and_healthy_under_its_uuid() -> None:
    placeholder = placeholder_uuid(0)
    at_start = health((0, placeholder, (LOST,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    (became, back, after), facts = run(cycle(verdicts=at_start), cycle(), cycle())
    assert kinds(became) == ["gpu_lost"]
    assert kinds(back) == ["gpu_back", "gpu_healthy"]
    assert all(t.uuid == "GPU-a" for t in back)
    assert after == ()
    assert facts.unhealthy == {}


def test_an_unreadable_placeholder_leaves_no_fact() -> None:
    unread = health((0, placeholder_uuid(0), (UNREADABLE,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    (told, then), facts = run(cycle(verdicts=unread), cycle())
    assert told == () and then == ()
    assert facts.unhealthy == {}


# -- the node condition --------------------------------------------------------------------


def test_the_condition_is_left_alone_when_no_gpu_is_unhealthy_but_one_is_unknown() -> None:
    unknown = health((0, "GPU-a", (UNREADABLE,)), (1, "GPU-b", ()), (2, "GPU-m", ()))
    assert desired_condition(cycle(verdicts=unknown)) is None
    assert desired_condition(cycle()) is not None  # every GPU healthy: False


def test_the_condition_is_true_for_an_unhealthy_gpu_beside_an_unknown_one() -> None:
    mixed = health((0, "GPU-a", (UNREADABLE,)), (1, "GPU-b", (LOST,)), (2, "GPU-m", ()))
    desired = desired_condition(cycle(verdicts=mixed))
    assert desired is not None
    assert (desired.status, desired.reason) == ("True", "GPULost")
    assert desired.message.startswith("1 of 3 GPUs unhealthy: GPU 1 (GPU-b)")


# -- capacity ------------------------------------------------------------------------------


def test_an_unreadable_gpus_devices_count_unknown_not_healthy_or_unhealthy() -> None:
    gpus = (
        GpuSample(index=0, uuid="GPU-0"),
        GpuSample(index=1, uuid="GPU-1", error="Unknown"),
        GpuSample(index=2, uuid=placeholder_uuid(2), error="NoPermission"),
    )
    verdicts = assess(gpus, recent_fatal_xids={}, dcgm_failures={}, policy=HealthPolicy())
    (cap,) = node_capacity(
        gpus, verdicts, kubelet("GPU-0", "GPU-1", "GPU-2"), [held("GPU-0")], nvml_ok=True
    )
    assert states(cap) == {
        "advertised": 3,
        "healthy": 1,
        "unhealthy": 0,
        "unknown": 2,  # GPU-1 unreadable; GPU-2 may be the GPU NVML could not identify
        "allocated": 1,
        "allocatable": 0,
    }


# -- the true side on the simulated node ---------------------------------------------------


async def test_a_gpu_nvml_calls_lost_still_gets_gpu_lost_the_condition_and_a_taint() -> None:
    scenario = dra_with_a_reset(unhealthy_at=1000, healthy_at=2000)
    scenario["timeline"] = [{"at": 15, "lose": 0}]
    argv = ["--node-condition", "--dra-device-taints"]
    async with simulated_exporter(scenario, argv=argv) as h:
        await step(h)
        await until_equal(lambda: status_of(h), ("False", "GPUsHealthy"), "False at start")
        latest = await step(h)  # 20 s: GPU 0 is lost
        (gpu0,) = [g for g in latest.health if g.gpu == 0]
        assert gpu0.unhealthy and [r.reason for r in gpu0.reasons] == ["gpu_lost"]
        await until_equal(lambda: status_of(h), ("True", "GPULost"), "True, GPULost")
        await until(lambda: len(api(h).device_taint_rules()) == 1, "the DeviceTaintRule")
        (rule,) = api(h).device_taint_rules()
        assert rule["spec"]["taint"]["value"] == "gpu_lost"
        node = ("Node", "", h.env.node.scenario.node_name)
        await until(lambda: node in regarding(h, "GPULost"), "GPULost on the Node")
