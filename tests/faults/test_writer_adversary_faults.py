"""An adversarial review's findings against the writer: fault-matrix rows.

The real exporter on a simulated DRA node writes to the API stand-in through the real
``kubernetes`` client (tests/test_writer_adversary_fixes.py has the unit-level tests).
"""

from __future__ import annotations

from tests.faults.conftest import RecordFault
from tests.harness import simulated_exporter
from tests.test_kube_events import api, step, until
from tests.test_writer_adversary_fixes import renumbered_dra, selected


async def test_taint_follows_a_renamed_dra_device(record_fault: RecordFault) -> None:
    async with simulated_exporter(
        renumbered_dra(), argv=["--dra-device-taints"], writer_on_simulated_clock=True
    ) as h:
        await step(h)
        latest = await step(h)  # 20 s: GPU 0 (gpu-2) asks for a reset, for good
        await until(lambda: selected(h) == ["gpu-2"], "the rule on gpu-2")
        uuid0 = next(g.uuid for g in latest.health if g.gpu == 0).lower()
        await step(h)  # 30 s: the driver swapped gpu-2 and gpu-0 at 25 s
        await until(lambda: selected(h) == ["gpu-0"], "the rule made again on gpu-0")
        for _ in range(5):  # it stays, and is not rewritten
            await step(h)
        (rule,) = api(h).device_taint_rules()
        assert uuid0 in rule["metadata"]["name"]
        assert rule["spec"]["deviceSelector"]["device"] == "gpu-0"
        writes = [w.method for w in api(h).write_log if "devicetaintrules" in w.path]
        assert writes == ["POST", "DELETE", "POST"], writes
    record_fault(
        "taint-on-renamed-dra-device",
        expected="a rule whose GPU the DRA driver publishes under another name is deleted "
        "and made again with the new selector in the same turn (the pair on one token); "
        "the healthy GPU that took the old name is not tainted",
        figure="the rule on gpu-0 at the first cycle after the rename (30 s, rename at 25 s), "
        "3 rule writes in 80 s; before the fix: the rule stayed on gpu-2 (a healthy GPU) "
        "and the unhealthy GPU was never tainted",
    )
