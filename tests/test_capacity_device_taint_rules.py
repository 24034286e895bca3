"""DRA DeviceTaintRules in node capacity (docs/capacity.md, "DeviceTaintRules").

The pure matching (analysis/capacity.py, sources/device_taint_rules.py's reading of a
rule) on frozen values first; then the DeviceTaintRule watch against the API stand-in
(the real ``kubernetes`` client: discovery, list, watch, 404, 403); then what the real
exporter serves on the simulated DRA node when an admin's rule taints a free GPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.analysis.capacity import node_capacity, rule_matches
from exporter.model import (
    Allocation,
    ContainerRef,
    DeviceCapacity,
    DeviceRef,
    DeviceTaintRuleSelector,
    DeviceTaintRuleSnapshot,
    GpuHealth,
    GpuSample,
    NodeScheduling,
    NodeSchedulingSnapshot,
    PodResourcesSnapshot,
    ResourceSliceSnapshot,
    SliceDevice,
)
from exporter.model.readings import AllocatableDevices
from exporter.sim.kube_api import FakeKubeApi, write_kubeconfig
from exporter.sources.device_taint_rules import (
    FORBIDDEN_HINT,
    NOT_SERVED,
    DeviceTaintRuleWatcher,
    rule_selector,
)
from tests.harness import Scrape, simulated_exporter

DRIVER = "gpu.nvidia.com"
POOL = "node-a"
SCENARIOS = Path(__file__).resolve().parents[1] / "exporter" / "sim" / "scenarios"


def rule(
    name: str = "r",
    effect: str = "NoSchedule",
    *,
    driver: str | None = DRIVER,
    pool: str | None = None,
    device: str | None = None,
    selects: bool = True,
    opaque: bool = False,
) -> DeviceTaintRuleSelector:
    return DeviceTaintRuleSelector(name, effect, driver, pool, device, selects, opaque)


def rule_dict(
    name: str,
    effect: str = "NoSchedule",
    selector: dict[str, Any] | None = None,
    *,
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {"taint": {"key": "example.com/maintenance", "effect": effect}}
    if selector is not None:
        spec["deviceSelector"] = selector
    return {
        "apiVersion": "resource.k8s.io/v1alpha3",
        "kind": "DeviceTaintRule",
        "metadata": {"name": name, "labels": labels or {}},
        "spec": spec,
    }


# -- the pure rule -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "matches"),
    [
        (rule(), True),  # the driver's every device
        (rule(driver=None), True),  # the empty selector: every device
        (rule(pool=POOL, device="gpu-1"), True),
        (rule(pool=POOL, device="gpu-2"), False),
        (rule(pool="node-b"), False),
        (rule(driver="other.example.com"), False),
        (rule(driver=None, device="gpu-1"), True),  # pool and driver unset: any
        (rule(selects=False), False),  # no deviceSelector: no device
    ],
)
def test_exact_fields_must_all_match(selector: DeviceTaintRuleSelector, matches: bool) -> None:
    assert rule_matches(selector, DRIVER, POOL, "gpu-1") is matches


def test_reading_a_rule_keeps_the_exact_fields_and_flags_what_cannot_be_evaluated() -> None:
    exact = rule_dict("a", selector={"driver": DRIVER, "pool": POOL, "device": "gpu-1"})
    assert rule_selector(exact) == rule("a", pool=POOL, device="gpu-1")
    assert rule_selector(rule_dict("b")) == rule("b", driver=None, selects=False)
    assert rule_selector(rule_dict("c", selector={})) == rule("c", driver=None)
    # Kubernetes 1.33-1.34: a DeviceClass's selectors and CEL are not evaluated here
    cel = {"driver": DRIVER, "selectors": [{"cel": {"expression": "true"}}]}
    assert rule_selector(rule_dict("d", selector=cel)) == rule("d", opaque=True)
    klass = {"deviceClassName": "gpu.nvidia.com"}
    assert rule_selector(rule_dict("e", selector=klass)) == rule("e", driver=None, opaque=True)
    # a field that is not a name, or a selector that is not an object: which devices is unknown
    odd = rule_selector(rule_dict("f", selector={"driver": DRIVER, "device": 7}))
    assert odd == rule("f", opaque=True)
    broken = rule_dict("g")
    broken["spec"]["deviceSelector"] = "all"
    assert rule_selector(broken) == rule("g", driver=None, opaque=True)
    assert rule_selector({"metadata": {}}) is None
    unreadable_effect = rule_dict("h", selector={})
    unreadable_effect["spec"]["taint"]["effect"] = ["NoExecute"]
    assert rule_selector(unreadable_effect) == rule("h", "", driver=None)


# Two healthy DRA GPUs of this node's pool, gpu-0 allocated, gpu-1 free.
GPUS = [GpuSample(index=i, uuid=f"GPU-{i}") for i in range(2)]
HEALTH = [GpuHealth(i, f"GPU-{i}") for i in range(2)]
SLICES = ResourceSliceSnapshot(
    ok=True,
    timestamp=0.0,
    devices=tuple(SliceDevice(DRIVER, POOL, f"gpu-{i}", (("uuid", f"GPU-{i}"),)) for i in range(2)),
)
PODRES = PodResourcesSnapshot(
    ok=True,
    timestamp=0.0,
    allocatable=(AllocatableDevices("nvidia.com/gpu", ()),),
    allocatable_ok=True,
)
ALLOCATIONS = [
    Allocation(
        ContainerRef("ml", "train", "main"),
        DeviceRef(0, "GPU-0", None),
        f"{POOL}/gpu-0",
        DRIVER,
        False,
    )
]
IN_SERVICE = NodeSchedulingSnapshot(ok=True, timestamp=0.0, node=NodeScheduling())


def dra_capacity(
    rules: DeviceTaintRuleSnapshot | None, slices: ResourceSliceSnapshot = SLICES
) -> DeviceCapacity:
    (cap,) = [
        c
        for c in node_capacity(
            GPUS,
            HEALTH,
            PODRES,
            ALLOCATIONS,
            slices,
            nvml_ok=True,
            scheduling=IN_SERVICE,
            taint_rules=rules,
        )
        if c.resource == DRIVER
    ]
    return cap


def rules_of(*selectors: DeviceTaintRuleSelector, ok: bool = True) -> DeviceTaintRuleSnapshot:
    return DeviceTaintRuleSnapshot(ok=ok, timestamp=0.0, rules=selectors)


def test_allocation_fixture_is_what_the_capacity_reads() -> None:
    cap = dra_capacity(rules_of())
    assert (cap.healthy, cap.allocated, cap.disrupted, cap.allocatable) == (2, 1, 0, 1)
    assert dict(cap.disrupted_by)["device_taint"] == 0


@pytest.mark.parametrize("effect", ["NoSchedule", "NoExecute"])
def test_a_blocking_rule_on_the_free_gpu_disrupts_it(effect: str) -> None:
    cap = dra_capacity(rules_of(rule(effect=effect, pool=POOL, device="gpu-1")))
    assert (cap.disrupted, cap.allocatable) == (1, 0)
    assert dict(cap.disrupted_by)["device_taint"] == 1


@pytest.mark.parametrize("effect", ["None", "PreferNoSchedule", "SomeFutureEffect", ""])
def test_effect_none_and_unknown_effects_only_inform(effect: str) -> None:
    cap = dra_capacity(rules_of(rule(effect=effect)))
    assert (cap.disrupted, cap.allocatable) == (0, 1)


def test_a_rule_on_the_allocated_gpu_or_another_driver_changes_nothing() -> None:
    on_allocated = rule(pool=POOL, device="gpu-0")
    other = rule("o", driver="other.example.com")
    cap = dra_capacity(rules_of(on_allocated, other))
    assert (cap.disrupted, cap.allocatable) == (0, 1)


def test_a_device_tainted_by_its_slice_and_a_rule_counts_once() -> None:
    tainted = SliceDevice(DRIVER, POOL, "gpu-1", (("uuid", "GPU-1"),), ("NoExecute",))
    slices = ResourceSliceSnapshot(ok=True, timestamp=0.0, devices=(SLICES.devices[0], tainted))
    cap = dra_capacity(rules_of(rule(device="gpu-1"), rule("all", driver=None)), slices)
    assert (cap.disrupted, cap.allocatable) == (1, 0)
    assert dict(cap.disrupted_by)["device_taint"] == 1


def test_a_rule_that_cannot_be_evaluated_leaves_the_resource_unknown() -> None:
    cap = dra_capacity(rules_of(rule(opaque=True)))
    assert cap.disrupted is None and cap.allocatable is None
    assert "device_taint" not in dict(cap.disrupted_by)
    assert (cap.healthy, cap.allocated) == (2, 1)  # what is known stays served
    # ... unless its exact fields rule out every free device
    cap = dra_capacity(rules_of(rule(opaque=True, device="gpu-0")))
    assert (cap.disrupted, cap.allocatable) == (0, 1)
    # an opaque rule that only informs is nothing to evaluate
    cap = dra_capacity(rules_of(rule(effect="None", opaque=True)))
    assert (cap.disrupted, cap.allocatable) == (0, 1)


def test_rules_not_read_leave_dra_unknown_and_device_plugins_alone() -> None:
    plugin = AllocatableDevices("nvidia.com/gpu", ("GPU-0",))
    podres = PodResourcesSnapshot(
        ok=True, timestamp=0.0, allocatable=(plugin,), allocatable_ok=True
    )
    caps = {
        c.resource: c
        for c in node_capacity(
            GPUS,
            HEALTH,
            podres,
            ALLOCATIONS,
            SLICES,
            nvml_ok=True,
            scheduling=IN_SERVICE,
            taint_rules=rules_of(ok=False),
        )
    }
    assert caps[DRIVER].disrupted is None and caps[DRIVER].allocatable is None
    assert "device_taint" not in dict(caps[DRIVER].disrupted_by)
    assert (caps["nvidia.com/gpu"].disrupted, caps["nvidia.com/gpu"].allocatable) == (0, 1)
    # not watched at all (no --dra-drivers, no API): the slices' own taints only
    assert dra_capacity(None).allocatable == 1


# -- the watch against the API stand-in ---------------------------------------------------


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[tuple[FakeKubeApi, str]]:
    api = FakeKubeApi()
    url = api.start_in_thread()
    try:
        yield api, str(write_kubeconfig(tmp_path / "kubeconfig", url))
    finally:
        api.stop_in_thread()


def until(predicate: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def started(kubeconfig: str) -> DeviceTaintRuleWatcher:
    watcher = DeviceTaintRuleWatcher(
        "node-a", kubeconfig=kubeconfig, drivers=(DRIVER,), not_served_retry_s=0.1
    )
    watcher.start()
    return watcher


@pytest.mark.slow
def test_the_watch_lists_and_follows_rules_of_its_drivers(fake: tuple[FakeKubeApi, str]) -> None:
    api, kubeconfig = fake
    api.writes.set_device_taint_rule(rule_dict("mine", selector={"driver": DRIVER}))
    api.writes.set_device_taint_rule(rule_dict("theirs", selector={"driver": "x.example.com"}))
    api.writes.set_device_taint_rule(rule_dict("anyone", "None", selector={}))
    watcher = started(kubeconfig)
    try:
        until(lambda: watcher.snapshot().ok, "the first list")
        assert [r.name for r in watcher.snapshot().rules] == ["anyone", "mine"]
        assert watcher.version == "v1alpha3"
        api.writes.set_device_taint_rule(
            rule_dict("drain", selector={"driver": DRIVER, "device": "gpu-1"})
        )
        until(lambda: "drain" in {r.name for r in watcher.snapshot().rules}, "the added rule")
        assert api.writes.delete_device_taint_rule("mine")
        until(lambda: "mine" not in {r.name for r in watcher.snapshot().rules}, "the deletion")
        snap = watcher.snapshot()
        assert snap.ok and [r.name for r in snap.rules] == ["anyone", "drain"]
    finally:
        watcher.stop()
    lists = [r for r in api.requests if r.path.endswith("/devicetaintrules")]
    # one list, then watches from its resourceVersion; no node's fieldSelector sent
    assert [r.watch for r in lists][:2] == [False, True]
    assert all("fieldSelector" not in r.params for r in lists)
    assert all(r.path == "/apis/resource.k8s.io/v1alpha3/devicetaintrules" for r in lists)


@pytest.mark.slow
def test_the_newest_served_version_is_watched(fake: tuple[FakeKubeApi, str]) -> None:
    api, kubeconfig = fake
    api.writes.set_device_taint_versions(("v1beta2", "v1alpha3"))
    watcher = started(kubeconfig)
    try:
        until(lambda: watcher.snapshot().ok, "the first list")
        assert watcher.version == "v1beta2"
    finally:
        watcher.stop()


@pytest.mark.slow
def test_a_cluster_without_device_taint_rules_is_up_with_none(
    fake: tuple[FakeKubeApi, str],
) -> None:
    api, kubeconfig = fake
    api.writes.set_device_taint_versions(())
    watcher = started(kubeconfig)
    try:
        until(lambda: watcher.status().up, "the source up")
        assert watcher.snapshot().rules == ()
        # served later (the feature switched on): found by the next discovery
        api.writes.set_device_taint_versions(("v1alpha3",))
        api.writes.set_device_taint_rule(rule_dict("late", selector={"driver": DRIVER}))
        until(lambda: [r.name for r in watcher.snapshot().rules] == ["late"], "the rule")
    finally:
        watcher.stop()
    assert NOT_SERVED.startswith("DeviceTaintRules are not served")


@pytest.mark.slow
def test_a_refused_read_is_down_with_the_rbac_hint(fake: tuple[FakeKubeApi, str]) -> None:
    api, kubeconfig = fake
    api.set_error(403, "devicetaintrules is forbidden", resource="devicetaintrules")
    watcher = started(kubeconfig)
    try:
        waiting = "waiting for the first DeviceTaintRule list"
        until(lambda: watcher.snapshot().error != waiting, "the first list to fail")
        status = watcher.status()
    finally:
        watcher.stop()
    assert not status.up
    assert status.error is not None and FORBIDDEN_HINT in status.error


# -- served end to end ---------------------------------------------------------------------


def dra_with_a_free_gpu() -> dict[str, Any]:
    """The shipped ``dra`` scenario without the fine-tune, whose GPU is then free."""
    scenario = yaml.safe_load((SCENARIOS / "dra.yaml").read_text())
    scenario["pods"] = [p for p in scenario["pods"] if p["name"] != "finetune-x"]
    return scenario


def dra_served(scrape: Scrape) -> tuple[dict[str, float], dict[str, float]]:
    states = {labels["state"]: v for labels, v in scrape.find("gpu_node_devices", resource=DRIVER)}
    reasons = {
        labels["reason"]: v
        for labels, v in scrape.find("gpu_node_disrupted_devices", resource=DRIVER)
    }
    return states, reasons


@pytest.mark.slow
async def test_an_admins_rule_on_a_free_dra_gpu_is_served_as_a_device_taint() -> None:
    async with simulated_exporter(dra_with_a_free_gpu()) as h:
        api = h.env.kube_api
        assert api is not None
        await h.refresh_pod_resources()
        before = dra_served(await h.scrape())
        selector = {"driver": DRIVER, "pool": "sim-dra-node", "device": "gpu-3"}
        api.writes.set_device_taint_rule(rule_dict("drain-gpu-3", "NoSchedule", selector))
        await h.advance(5)
        tainted = dra_served(await h.scrape())
        assert api.writes.delete_device_taint_rule("drain-gpu-3")
        await h.advance(5)
        after = dra_served(await h.scrape())
        up = (await h.scrape()).get("gpu_exporter_source_up", source="devicetaintrules")

    assert up == 1
    assert before[0]["allocatable"] == 1 and before[1]["device_taint"] == 0
    assert tainted[0]["allocatable"] == 0 and tainted[0]["disrupted"] == 1
    assert tainted[1]["device_taint"] == 1
    assert after == before


@pytest.mark.slow
async def test_rules_that_cannot_be_read_leave_dra_allocatable_unknown() -> None:
    async with simulated_exporter(dra_with_a_free_gpu()) as h:
        api = h.env.kube_api
        assert api is not None
        await h.refresh_pod_resources()
        api.set_error(403, "devicetaintrules is forbidden", resource="devicetaintrules")
        api.expire_history()  # the watch must list again, and is refused
        scrape = await h.scrape()
        for _ in range(100):
            await h.advance(1)
            scrape = await h.scrape()
            if scrape.get("gpu_exporter_source_up", source="devicetaintrules") == 0:
                break
        states, reasons = dra_served(scrape)

    assert scrape.get("gpu_exporter_source_up", source="devicetaintrules") == 0
    assert states.get("healthy") == 6 and states.get("allocated") == 5
    assert "allocatable" not in states and "disrupted" not in states
    assert "device_taint" not in reasons and reasons.get("cordoned") == 0
