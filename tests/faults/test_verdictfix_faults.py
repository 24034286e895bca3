"""Hardware verdicts: a UUID two GPUs share carries no hardware verdict, and the
simulated NVML answers RESET_REQUIRED (lost) and TIMEOUT (no verdict)."""

from __future__ import annotations

from typing import Any

from exporter.sim.scenario import parse_scenario
from tests.faults.conftest import RecordFault
from tests.harness import simulated_exporter
from tests.test_kube_events import api, exclusive, quiet, step

U = "GPU-aaaaaaaa-2222-3333-4444-555555555555"
ARGV = ["--node-condition", "--dra-device-taints"]
HEALTH_CALLS = (
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetPowerUsage",
)


def condition(h: Any) -> str | None:
    node = api(h).node("n1") or {}
    for c in node.get("status", {}).get("conditions", []):
        if c["type"] == "GPUUnhealthy":
            return f"{c['status']}:{c['reason']}"
    return None


async def test_two_gpus_one_uuid_lost_gets_no_rule_and_no_true_condition(
    record_fault: RecordFault,
) -> None:
    data = {
        "node_name": "n1",
        "allocator": "dra",
        "gpus": [{"uuid": U}, {"uuid": U}, {}],
        "pods": [exclusive("a", 0), exclusive("b", 1)],
        "timeline": [{"at": 40, "lose": 1}, {"at": 100, "restore": 1}],
    }
    async with simulated_exporter(parse_scenario(data, "dup-uuid"), argv=ARGV) as h:
        seen_rules: set[str] = set()
        seen_conditions: set[str | None] = set()
        for _ in range(15):
            await step(h, 10.0)
            seen_rules |= {r["metadata"]["name"] for r in api(h).device_taint_rules()}
            seen_conditions.add(condition(h))
        await quiet(h)
    assert seen_rules == set()
    assert not any(c and c.startswith("True") for c in seen_conditions), seen_conditions
    record_fault(
        "two-gpus-one-uuid-lost",
        expected="a GPU lost whose UUID another GPU shares gets no DeviceTaintRule and no "
        "condition True: no hardware verdict can be pinned on a shared UUID",
        figure="0 DeviceTaintRules over 150 s; conditions seen "
        f"{sorted(map(str, seen_conditions))}",
    )


async def test_reset_required_on_a_whole_gpu_is_lost_timeout_is_nothing(
    record_fault: RecordFault,
) -> None:
    def scenario(error: str) -> Any:
        return parse_scenario(
            {
                "node_name": "n1",
                "gpus": [{}, {}],
                "call_errors": [
                    {"call": c, "error": error, "gpu": 0, "from": 20} for c in HEALTH_CALLS
                ],
            },
            f"nvml-{error}",
        )

    found: dict[str, tuple[str | None, list[str]]] = {}
    for error in ("RESET_REQUIRED", "TIMEOUT"):
        async with simulated_exporter(scenario(error), argv=["--node-condition"]) as h:
            for _ in range(6):
                analysis = await step(h, 10.0)
            await quiet(h)
            reasons = [r.reason for g in analysis.health for r in g.reasons]
            found[error] = (condition(h), reasons)
    assert found["RESET_REQUIRED"][0] == "True:GPULost", found
    assert "gpu_lost" in found["RESET_REQUIRED"][1]
    assert found["TIMEOUT"][0] != "True:GPULost" and "gpu_lost" not in found["TIMEOUT"][1]
    assert not (found["TIMEOUT"][0] or "").startswith("True"), found
    record_fault(
        "nvml-reset-required",
        expected="NVML_ERROR_RESET_REQUIRED on every health read of a GPU is GPU lost "
        "(condition True, GPULost); NVML_ERROR_TIMEOUT is no verdict",
        figure=f"RESET_REQUIRED: {found['RESET_REQUIRED'][0]}; TIMEOUT: {found['TIMEOUT'][0]}",
    )


async def test_lost_gpu_replaced_at_its_index_ends_the_condition(
    record_fault: RecordFault,
) -> None:
    new = "GPU-11111111-2222-3333-4444-555555555555"
    data = {
        "node_name": "n1",
        "allocator": "dra",
        "gpus": [{}, {}],
        "pods": [exclusive("a", 0), exclusive("b", 1)],
        "timeline": [
            {"at": 30, "lose": 0},
            {"at": 100, "set": {"gpu": 0, "lost": False, "uuid": new}},
        ],
    }
    async with simulated_exporter(parse_scenario(data, "replaced"), argv=ARGV) as h:
        history: list[tuple[float, str | None]] = []
        for _ in range(20):
            await step(h, 10.0)
            history.append((h.clock(), condition(h)))
        await quiet(h)
        rules = api(h).device_taint_rules()
    assert any(c == "True:GPULost" for _, c in history), history  # the true side
    assert history[-1][1] == "False:GPUsHealthy", history
    cleared = next(t for t, c in history if t > 100 and c == "False:GPUsHealthy")
    assert rules == []
    record_fault(
        "lost-gpu-replaced-same-index",
        expected="a lost GPU replaced at its index by a GPU with a new UUID drops the old "
        "GPU's facts: the condition turns False once every listed GPU is healthy",
        figure=f"condition True:GPULost from the loss, False:GPUsHealthy at t={cleared:.0f} s "
        "(replaced at 100 s); before the fix True:GPULost through the end of the run",
    )
