"""Taints owned by what they select, and write budgets.

The real exporter on a simulated DRA node (exporter/sim/scenarios/dra.yaml) writes to
the API stand-in through the real ``kubernetes`` client; what is read back is what
``kubectl get devicetaintrules`` and ``kubectl get node -o yaml`` would show.
"""

from __future__ import annotations

import asyncio
import datetime
from typing import Any

from exporter.reporting.device_taints import TaintRule, rule_body, rule_name
from tests.faults.conftest import RecordFault
from tests.harness import Harness, simulated_exporter
from tests.kube_writes import dra_with_a_reset
from tests.test_kube_events import api, quiet, step, until

NODE = "sim-dra-node"
DRIVER = "gpu.nvidia.com"
OLD_UUID = "GPU-0ld00000-0000-4000-8000-000000000000"  # the GPU that was replaced
# GPU 2 of the dra scenario (minor 1) in MIG mode, as the scenario lists it
MIG_LAYOUT = [
    {"profile": "3g.40gb", "gpu_instance_id": 1, "memory_total": "40GiB"},
    {"profile": "2g.20gb", "gpu_instance_id": 5, "memory_total": "20GiB"},
    {"profile": "1g.10gb", "gpu_instance_id": 13, "memory_total": "10GiB"},
]


def rfc3339(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


async def left_rule(h: Harness, uuid: str, device: str, *, age_s: float = 0.0) -> str:
    """A NoSchedule DeviceTaintRule an earlier run made for ``uuid`` on ``device``."""
    rule = TaintRule(rule_name(NODE, uuid), DRIVER, NODE, device, uuid, "gpu_lost")
    body = rule_body(rule, "v1alpha3", NODE, "NoSchedule")
    body["metadata"]["creationTimestamp"] = rfc3339(h.env.node.wall_time() - age_s)
    api(h).set_device_taint_rule(body)
    return rule.name


def rules_by_device(h: Harness) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for r in api(h).device_taint_rules():
        found.setdefault(r["spec"]["deviceSelector"]["device"], []).append(r["metadata"]["name"])
    return found


def deletes(h: Harness) -> list[str]:
    return [
        w.path.rsplit("/", 1)[1]
        for w in api(h).write_log
        if w.method == "DELETE" and "devicetaintrules" in w.path
    ]


def slice_uuid(h: Harness, device: str) -> str:
    assert h.env.kube_api is not None
    for s in h.env.kube_api.resource_slices():
        for d in s["spec"]["devices"]:
            if d["name"] == device:
                uuid: str = d["attributes"]["uuid"]["string"]
                return uuid
    raise AssertionError(f"no device {device} published")


async def test_a_rule_on_a_replaced_gpu_is_deleted_and_an_unhealthy_gpus_rule_stays(
    record_fault: RecordFault,
) -> None:
    """GPU 0 (DRA device gpu-2) was replaced while the exporter was down: the rule an
    earlier run made for the old GPU now selects the new, healthy one. GPU 3 (gpu-3)
    is unhealthy: its rule is made and kept."""
    scenario: dict[str, Any] = dra_with_a_reset(unhealthy_at=10_000, healthy_at=20_000)
    scenario["timeline"] = [{"at": 5, "set": {"gpu": 3, "recovery_action": 1}}]
    argv = ["--dra-device-taints", "--dra-device-taint-effect", "NoSchedule"]
    async with simulated_exporter(scenario, argv=argv, first_cycle=False) as h:
        new_uuid = slice_uuid(h, "gpu-2")
        assert new_uuid != OLD_UUID
        # made a minute ago: within --health-xid-window, which holds only a healthy verdict
        stale = await left_rule(h, OLD_UUID, "gpu-2", age_s=60)
        cycles = 0
        for _ in range(6):
            await step(h)
            cycles += 1
        await until(lambda: "gpu-2" not in rules_by_device(h), "the replaced GPU's rule deleted")
        await quiet(h)
        assert deletes(h) == [stale]
        by_device = rules_by_device(h)
        assert list(by_device) == ["gpu-3"]  # the unhealthy GPU keeps its rule
        (kept,) = api(h).device_taint_rules()
        assert kept["spec"]["taint"]["effect"] == "NoSchedule"
        assert kept["spec"]["taint"]["value"] == "recovery_action"
    record_fault(
        "taint-on-replaced-gpu",
        expected="a DeviceTaintRule whose DRA device now carries another UUID is deleted "
        "(it selects hardware the exporter did not judge); an unhealthy GPU's rule stays",
        figure=f"the stale NoSchedule rule deleted at the first cycle, the unhealthy GPU's "
        f"rule kept over {cycles} cycles; before the fix: the stale rule never deleted",
    )


async def test_mig_rules_are_deleted_when_the_layout_is_recreated_after_a_reset(
    record_fault: RecordFault,
) -> None:
    """GPU 2 (minor 1, three MIG devices) asks for a reset at 15 s: a rule on each MIG
    device. At 35 s it was reset and its layout made again (the same device names, new
    MIG UUIDs) while it still reports the reset pending; at 55 s it is healthy."""
    scenario: dict[str, Any] = dra_with_a_reset()
    scenario["timeline"] = [
        {"at": 15, "set": {"gpu": 2, "recovery_action": 1}},
        {"at": 35, "set": {"gpu": 2, "mig": MIG_LAYOUT}},
        {"at": 55, "set": {"gpu": 2, "recovery_action": 0}},
    ]
    argv = ["--dra-device-taints", "--dra-device-taint-effect", "NoSchedule"]
    async with simulated_exporter(scenario, argv=argv) as h:
        await step(h)
        await step(h)  # 20 s
        await until(lambda: len(api(h).device_taint_rules()) == 3, "a rule per MIG device")
        first = {r["metadata"]["name"] for r in api(h).device_taint_rules()}
        names = sorted(rules_by_device(h))
        assert all(n.startswith("gpu-1-mig-") for n in names), names
        before = {n: slice_uuid(h, n) for n in names}
        await step(h)
        await step(h)  # 40 s: the new layout, the GPU still unhealthy
        await until(lambda: all(slice_uuid(h, n) != before[n] for n in names), "new MIG UUIDs")
        await step(h)
        await until(
            lambda: (
                not first & {r["metadata"]["name"] for r in api(h).device_taint_rules()}
                and len(api(h).device_taint_rules()) == 3
            ),
            "the new MIG devices' rules in place of the old",
        )
        renamed = {r["spec"]["deviceSelector"]["device"] for r in api(h).device_taint_rules()}
        assert sorted(renamed) == names  # still unhealthy: the same devices stay tainted
        cycles = 0
        while True:  # 60 s on: healthy (the reset is read on the slow tier)
            latest = await step(h)
            cycles += 1
            if all(g.healthy for g in latest.health):
                break
            assert cycles < 10, [(g.gpu, g.reasons) for g in latest.health]
        await step(h)
        cycles += 1
        await until(lambda: api(h).device_taint_rules() == [], "the MIG rules deleted")
        await quiet(h)
        assert len(deletes(h)) == 6
    record_fault(
        "taints-after-mig-recreated",
        expected="the rules of MIG devices re-created under the same names with new UUIDs "
        "are deleted (replaced) and made again for the new devices while the GPU is "
        "unhealthy; once healthy, none is left",
        figure=f"3 NoSchedule rules at 20 s, replaced by 3 on the new MIG UUIDs, 0 left "
        f"{cycles} cycles after the GPU is healthy; before the fix: 3 left for good",
    )


def status_patches(h: Harness) -> int:
    path = f"/api/v1/nodes/{NODE}/status"
    return sum(1 for w in api(h).write_log if w.method == "PATCH" and w.path == path)


def rule_writes(h: Harness) -> int:
    return sum(
        1
        for w in api(h).write_log
        if w.method in ("POST", "DELETE") and "devicetaintrules" in w.path
    )


async def test_a_flapping_gpu_is_held_to_the_write_budgets_and_its_last_state_is_written(
    record_fault: RecordFault,
) -> None:
    """GPU 0 is lost every other second for a minute at --interval 1 (GPU_IS_LOST:
    hardware evidence, so the verdict flips each cycle), then falls off for good. The
    writer runs on the simulated clock, so its budgets refill as the minute passes."""
    from exporter.reporting.budget import (
        CONDITION_BURST,
        CONDITION_PER_MINUTE,
        RULE_BURST,
        RULE_PER_MINUTE,
    )

    flaps = 60
    scenario: dict[str, Any] = dra_with_a_reset()
    scenario["timeline"] = [
        *({"at": 5 + t, "set": {"gpu": 0, "lost": t % 2 == 0}} for t in range(flaps)),
        {"at": 5 + flaps, "set": {"gpu": 0, "lost": True}},  # for good
    ]
    argv = ["--interval", "1", "--node-condition", "--dra-device-taints", "--kube-events", "off"]
    async with simulated_exporter(scenario, argv=argv, writer_on_simulated_clock=True) as h:
        while h.clock() < 4:
            await step(h, 1.0)
        await until(lambda: status_patches(h) == 1, "the condition False at start")
        verdicts = []
        while h.clock() < 5 + flaps - 1:
            latest = await step(h, 1.0)
            verdicts.append(next(g.unhealthy for g in latest.health if g.gpu == 0))
            # pacing, not an assertion: the writer turns between two cycles, so each
            # flip is seen (more flips seen can only mean more writes)
            await asyncio.sleep(0.03)
        assert verdicts.count(True) >= flaps // 2 - 1 and verdicts.count(False) >= flaps // 2 - 1
        await asyncio.sleep(0.2)
        patches, rules = status_patches(h) - 1, rule_writes(h)
        minutes = flaps / 60
        assert patches <= CONDITION_BURST + CONDITION_PER_MINUTE * minutes + 1, patches
        assert rules <= RULE_BURST + RULE_PER_MINUTE * minutes + 1, rules
        assert h.agent.reporter is not None
        deferred = h.agent.reporter.write_counts()
        assert deferred.get(("node_condition", "deferred"), 0) >= 1
        assert deferred.get(("device_taint_rule", "deferred"), 0) >= 1
        # then lost for good: the latest state is written once a token comes
        for _ in range(8):
            await step(h, 10.0)
        await until(lambda: condition_reason(h) == ("True", "GPULost"), "the condition True")
        await until(lambda: len(api(h).device_taint_rules()) == 1, "the lost GPU's rule")
        (rule,) = api(h).device_taint_rules()
        assert rule["spec"]["deviceSelector"]["device"] == "gpu-2"
        assert rule["spec"]["taint"]["value"] == "gpu_lost"
    record_fault(
        "flapping-gpu-write-budget",
        expected="the node condition and each DeviceTaintRule are held to their budgets "
        "(condition: 5 at once, then 2 a minute; a rule: 2 at once, then 1 a minute); "
        "writes over budget are deferred, not queued, and the latest state is written "
        "when a token comes: a GPU lost for good ends with the condition True and its rule",
        figure=f"{patches} node-status PATCHes and {rules} rule writes over {flaps} flapping "
        f"cycles (60 s at --interval 1); then True/GPULost and the rule within 80 s; "
        f"before the fix: one PATCH and one rule write per flip",
    )


def condition_reason(h: Harness) -> tuple[str, str] | None:
    node = api(h).node(NODE)
    assert node is not None
    for c in node["status"]["conditions"]:
        if c["type"] == "GPUUnhealthy":
            return c["status"], c["reason"]
    return None
