"""Findings of an adversarial review against the writer (Events, the node condition,
DeviceTaintRules, the writer Lease), each through the real client and the API stand-in.

B1: a DeviceTaintRule is named by node and UUID, not by DRA device name; a driver that
renumbers its devices (the simulator's ``dra_name``, docs/simulator.md) must not leave
the rule on the GPU that now has the old name.
"""

from __future__ import annotations

from exporter.reporting.device_taints import ExistingRule, stale_rules
from tests.harness import Harness, simulated_exporter
from tests.kube_writes import dra_with_a_reset
from tests.test_kube_events import api, step, until

SWAP_AT = 25.0


def renumbered_dra(unhealthy_at: float = 15) -> dict[str, object]:
    """The ``dra`` scenario, GPU 0 (minor 2, DRA device gpu-2) asking for a reset for
    good; at SWAP_AT the driver republishes with gpu-2 and gpu-0 swapped (GPU 1 is
    minor 0), as after a restart that renumbers."""
    data = dra_with_a_reset(unhealthy_at, 10_000)
    timeline = data["timeline"]
    assert isinstance(timeline, list)
    timeline += [
        {"at": SWAP_AT, "set": {"gpu": 0, "dra_name": "gpu-0"}},
        {"at": SWAP_AT, "set": {"gpu": 1, "dra_name": "gpu-2"}},
    ]
    return data


def selected(h: Harness) -> list[str]:
    """The DRA device names our DeviceTaintRules select."""
    return sorted(r["spec"]["deviceSelector"]["device"] for r in api(h).device_taint_rules())


async def test_a_renamed_dra_device_keeps_its_taint_and_the_old_name_loses_it() -> None:
    async with simulated_exporter(
        renumbered_dra(), argv=["--dra-device-taints"], writer_on_simulated_clock=True
    ) as h:
        await step(h)  # 10 s
        latest = await step(h)  # 20 s: GPU 0 asks for a reset
        await until(lambda: selected(h) == ["gpu-2"], "the rule on GPU 0 (gpu-2)")
        uuid0 = next(g.uuid for g in latest.health if g.gpu == 0).lower()
        assert h.env.kube_api is not None
        slices = h.env.kube_api.resource_slices()
        await step(h)  # 30 s: the driver swapped the names at 25 s
        # deleted and made again in the same turn, the pair on one token of the rule's
        # bucket (the create at 20 s took the other): not a minute untainted
        await until(lambda: selected(h) == ["gpu-0"], "the rule made again on gpu-0 (GPU 0)")
        writes = [w.method for w in api(h).write_log if "devicetaintrules" in w.path]
        assert writes == ["POST", "DELETE", "POST"], writes
        (rule,) = api(h).device_taint_rules()
        assert uuid0 in rule["metadata"]["name"]
        devices = {
            d["name"]: d["attributes"]["uuid"]["string"].lower()
            for s in h.env.kube_api.resource_slices()
            for d in s["spec"]["devices"]
        }
        assert devices["gpu-0"] == uuid0 and devices["gpu-2"] != uuid0
        assert slices != h.env.kube_api.resource_slices()  # the driver did republish


def test_a_wanted_rule_with_another_selector_is_stale_as_moved() -> None:
    rule = ExistingRule("r-gpu-a", ("gpu.nvidia.com", "node", "gpu-2"), "gpu-a")
    moved = {"r-gpu-a": ("gpu.nvidia.com", "node", "gpu-0")}
    assert stale_rules([rule], moved, frozenset(), None) == {"r-gpu-a": "moved"}
    same = {"r-gpu-a": ("gpu.nvidia.com", "node", "gpu-2")}
    assert stale_rules([rule], same, frozenset(), None) == {}
    assert stale_rules([rule], {"r-gpu-a"}, frozenset(), None) == {}  # names only: as before
