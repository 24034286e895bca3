"""A DeviceTaintRule is owned by what it selects.

``stale_rules`` (pure) decides which rules no longer mark anything the exporter judged;
the end-to-end cases run the real exporter on the simulated DRA node with the API
stand-in (the replaced GPU and the re-created MIG layout are fault rows in
tests/faults/test_writer_faults.py).
"""

from __future__ import annotations

from typing import Any

from exporter.reporting.device_taints import ExistingRule, Published, stale_rules
from tests.faults.test_writer_faults import MIG_LAYOUT, deletes, rules_by_device
from tests.harness import simulated_exporter
from tests.kube_writes import dra_with_a_reset
from tests.test_kube_events import api, quiet, step, until

SEL = ("gpu.nvidia.com", "node-a", "gpu-0")


def rule(uuid: str = "gpu-old", selector: tuple[str, str, str] | None = SEL) -> ExistingRule:
    return ExistingRule(f"r-{uuid}", selector, uuid)


def published(devices: dict[tuple[str, str, str], str]) -> Published:
    return Published(devices, frozenset((d, p) for d, p, _ in devices))


def test_a_rule_whose_device_is_healthy_is_stale_as_healthy() -> None:
    assert stale_rules([rule()], set(), frozenset({"gpu-old"}), None) == {"r-gpu-old": "healthy"}


def test_a_rule_whose_device_has_another_uuid_is_stale_as_replaced() -> None:
    now = published({SEL: "gpu-new"})
    assert stale_rules([rule()], set(), frozenset(), now) == {"r-gpu-old": "replaced"}


def test_a_rule_whose_device_left_a_published_pool_is_stale_as_gone() -> None:
    now = published({("gpu.nvidia.com", "node-a", "gpu-1"): "gpu-other"})
    assert stale_rules([rule()], set(), frozenset(), now) == {"r-gpu-old": "gone"}


def test_a_rule_stays_without_evidence() -> None:
    """Still the same UUID and not healthy; the pool missing as a whole; slices unknown;
    a selector we cannot read; a device published without a uuid attribute."""
    same = published({SEL: "gpu-old"})
    other_pool = published({("gpu.nvidia.com", "node-b", "gpu-0"): "x"})
    no_uuid = published({SEL: ""})
    for now in (same, other_pool, None, no_uuid):
        assert stale_rules([rule()], set(), frozenset(), now) == {}
    assert stale_rules([rule(selector=None)], set(), frozenset(), published({})) == {}


def test_a_wanted_rule_is_never_stale() -> None:
    now = published({SEL: "gpu-new"})
    assert stale_rules([rule()], {"r-gpu-old"}, frozenset({"gpu-old"}), now) == {}


async def test_mig_rules_of_instances_no_longer_published_are_deleted_as_gone() -> None:
    """GPU 2 (minor 1) is unhealthy with three MIG devices, each with a rule; its layout
    is cut to one instance while it stays unhealthy: the two devices no longer published
    lose their rules (the pool is still published), the one left keeps its rule."""
    scenario: dict[str, Any] = dra_with_a_reset()
    scenario["timeline"] = [
        {"at": 15, "set": {"gpu": 2, "recovery_action": 1}},
        {"at": 35, "set": {"gpu": 2, "mig": MIG_LAYOUT[:1]}},
    ]
    gone = ("gpu2/mig1", "gpu2/mig2")  # the pods on the instances taken away go too
    scenario["pods"] = [p for p in scenario["pods"] if not any(g in str(p) for g in gone)]
    async with simulated_exporter(scenario, argv=["--dra-device-taints"]) as h:
        await step(h)
        await step(h)
        await until(lambda: len(api(h).device_taint_rules()) == 3, "a rule per MIG device")
        first = sorted(rules_by_device(h))
        for _ in range(4):
            await step(h)
        await until(lambda: len(api(h).device_taint_rules()) == 1, "two rules deleted")
        await quiet(h)
        (left,) = api(h).device_taint_rules()
        device = left["spec"]["deviceSelector"]["device"]
        assert device.startswith("gpu-1-mig-3g40gb") and device in first
        assert left["spec"]["taint"]["value"] == "recovery_action"  # still unhealthy
        assert len(deletes(h)) >= 2
