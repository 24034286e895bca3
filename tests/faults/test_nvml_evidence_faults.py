"""A hardware verdict needs hardware evidence.

Each fault is injected in the simulated libnvidia-ml (scenario ``call_errors``, a GPU
``lost`` at start), the real exporter runs with ``--node-condition`` and its Events on,
and what reaches the API stand-in is read back: the Warning Events by reason and every
``GPUUnhealthy`` status the exporter PATCHed. A reading that failed without NVML's word
that the GPU is lost (NVML_ERROR_UNKNOWN, a TypeError inside pynvml, NO_PERMISSION) is
unknown: counted, served as unreadable, never GPULost, never the condition True.
"""

from __future__ import annotations

from typing import Any

from tests.faults.conftest import RecordFault
from tests.harness import Harness, Scrape, simulated_exporter
from tests.test_kube_events import api, exclusive, quiet, step, until_equal

NVML = {"source": "nvml"}
CONDITION = "GPUUnhealthy"
CYCLES = 12


def written(h: Harness) -> list[str]:
    """Every ``GPUUnhealthy`` status the exporter PATCHed onto the Node, in order."""
    path = f"/api/v1/nodes/{h.env.node.scenario.node_name}/status"
    out: list[str] = []
    for w in api(h).write_log:
        if w.method != "PATCH" or w.path != path or not isinstance(w.body, dict):
            continue
        for c in w.body.get("status", {}).get("conditions", []):
            if c.get("type") == CONDITION:
                out.append(f"{c['status']}:{c['reason']}")
    return out


def condition(h: Harness) -> dict[str, Any] | None:
    node = api(h).node(h.env.node.scenario.node_name)
    assert node is not None
    found = [c for c in node["status"]["conditions"] if c["type"] == CONDITION]
    return found[0] if found else None


def warnings(h: Harness, reason: str) -> int:
    return len(api(h).events(f"reason={reason}"))


def unreadable(scrape: Scrape, gpu: str) -> bool:
    return bool(
        scrape.find("gpu_health_reason", gpu=gpu, reason="unreadable", **{"class": "unknown"})
    )


def one_gpu(node: str, call_errors: list[dict[str, object]]) -> dict[str, object]:
    """One GPU, one pod on it (a GPULost would land on the pod and the Node)."""
    return {
        "node_name": node,
        "gpus": [{}],
        "pods": [exclusive("a", 0)],
        "call_errors": call_errors,
    }


async def one_failed_reading(h: Harness) -> tuple[bool, bool, float]:
    """Run ``CYCLES`` cycles 10 s apart (the failure is at 20 s): whether the failing
    cycle served the GPU as unreadable with no ``gpu_healthy``, and the errors counted."""
    errors_before = (await h.scrape()).get("gpu_exporter_errors_total", **NVML)
    seen_unreadable = served_healthy = False
    for _ in range(CYCLES):
        latest = await step(h)
        scrape = await h.scrape()
        if h.clock() == 20:
            seen_unreadable = unreadable(scrape, "0")
            served_healthy = bool(scrape.find("gpu_healthy", gpu="0"))
            seen_unreadable &= [g.unknown for g in latest.health] == [True]
    await quiet(h)
    counted = (await h.scrape()).get("gpu_exporter_errors_total", **NVML) - errors_before
    return seen_unreadable, served_healthy, counted


async def one_temperature_read_failing(
    node: str, failure: dict[str, str]
) -> tuple[list[str], float]:
    """A GPU whose temperature read fails for one cycle (``failure``: the error or the
    exception raised): no GPULost or GPUUnhealthy Event, only ``False`` conditions
    written, the GPU unreadable that cycle and never served healthy, the failure
    counted. Returns the condition statuses written and the errors counted."""
    call = {"call": "nvmlDeviceGetTemperature", **failure, "gpu": 0, "from": 20, "until": 21}
    scenario = one_gpu(node, [call])
    async with simulated_exporter(scenario, argv=["--node-condition"]) as h:
        seen_unreadable, served_healthy, counted = await one_failed_reading(h)
        lost, unhealthy, statuses = warnings(h, "GPULost"), warnings(h, "GPUUnhealthy"), written(h)
        assert lost == 0 and unhealthy == 0
        assert statuses and all(s == "False:GPUsHealthy" for s in statuses)
        assert seen_unreadable and not served_healthy
        assert counted >= 1
    return statuses, counted


async def test_one_unknown_error_from_one_query_is_no_lost_gpu(record_fault: RecordFault) -> None:
    statuses, counted = await one_temperature_read_failing("sim-unknown", {"error": "UNKNOWN"})
    record_fault(
        "nvml-unknown-error-one-query",
        expected="One cycle of NVML_ERROR_UNKNOWN from nvmlDeviceGetTemperature is no "
        "hardware evidence: that cycle the GPU is served unreadable (gpu_health_reason "
        "reason=unreadable class=unknown, no gpu_healthy) and the error counted; no GPULost "
        "or GPUUnhealthy Event, the condition never True.",
        figure=f"0 GPULost, 0 GPUUnhealthy Events over {CYCLES} cycles; condition statuses "
        f"written: {', '.join(statuses)}; {counted:.0f} NVML error(s) counted; before the "
        f"fix: 2 GPULost Warnings (pod and Node) and the condition False -> True -> False.",
    )


async def test_a_type_error_inside_pynvml_is_no_lost_gpu(record_fault: RecordFault) -> None:
    statuses, counted = await one_temperature_read_failing("sim-binding", {"raise": "TypeError"})
    record_fault(
        "nvml-binding-type-error",
        expected="A TypeError raised inside pynvml (an answer the binding cannot decode) is "
        "the exporter's problem, not the GPU's: counted, the GPU served unreadable for "
        "that cycle; no GPULost or GPUUnhealthy Event, the condition never True.",
        figure=f"0 GPULost, 0 GPUUnhealthy Events over {CYCLES} cycles; condition statuses "
        f"written: {', '.join(statuses)}; {counted:.0f} NVML error(s) counted; before the "
        f"fix: 2 GPULost Warnings and the condition False -> True -> False.",
    )


async def test_a_uuid_read_failing_at_first_open_leaves_no_phantom_gpu(
    record_fault: RecordFault,
) -> None:
    scenario = one_gpu(
        "sim-uuid",
        [{"call": "nvmlDeviceGetUUID", "error": "UNKNOWN", "gpu": 0, "until": 1}],
    )
    async with simulated_exporter(scenario, argv=["--node-condition"]) as h:
        first = await h.scrape()  # t=0: the UUID could not be read
        for _ in range(CYCLES):
            await step(h)
        await until_equal(
            lambda: (condition(h) or {}).get("message"), "all 1 GPUs are healthy", "False"
        )
        await quiet(h)
        scrape = await h.scrape()
        infos = [labels["uuid"] for labels, _ in scrape.find("gpu_info")]
        lost, statuses = warnings(h, "GPULost"), written(h)
        assert lost == 0
        assert all(s == "False:GPUsHealthy" for s in statuses)
        assert len(infos) == 1 and not infos[0].startswith("unknown-gpu")
        assert unreadable(first, "0")
        assert scrape.get("gpu_healthy", gpu="0") == 1
        assert h.agent.state.health.unhealthy == {}
    record_fault(
        "nvml-uuid-fails-at-open",
        expected="A transient failure reading a GPU's UUID while first opening it serves the "
        "GPU unreadable under a placeholder for that cycle and leaves no fact behind: no "
        "GPULost, no phantom GPU, the condition False ('all 1 GPUs are healthy') once it "
        "answers.",
        figure=f"0 GPULost Events; condition statuses written over {CYCLES} cycles: "
        f"{', '.join(statuses)}; 1 GPU served; before the fix: GPULost and the condition "
        f"True ('1 of 2 GPUs unhealthy' on a 1-GPU node) for the life of the process.",
    )


async def test_a_gpu_lost_at_start_and_reset_is_cleared_once_it_answers(
    record_fault: RecordFault,
) -> None:
    scenario: dict[str, object] = {
        "node_name": "sim-reset",
        "gpus": [{"lost": True}],
        "pods": [exclusive("a", 0)],
        "timeline": [{"at": 30, "set": {"gpu": 0, "lost": False}}],
    }
    async with simulated_exporter(scenario, argv=["--node-condition"]) as h:
        await until_equal(lambda: (condition(h) or {}).get("reason"), "GPULost", "True")
        assert warnings(h, "GPULost") >= 1  # a true lost GPU: told
        while h.clock() < 30:
            await step(h)
        await until_equal(
            lambda: (condition(h) or {}).get("message"), "all 1 GPUs are healthy", "False at 30 s"
        )
        cleared_at = h.clock()
        for _ in range(CYCLES):
            await step(h)
        await quiet(h)
        statuses, healthy = written(h), warnings(h, "GPUHealthy")
        last = condition(h)
        assert last is not None and last["status"] == "False"
        assert healthy == 1
        assert h.agent.state.health.unhealthy == {}
    record_fault(
        "nvml-lost-at-start-then-reset",
        expected="A GPU that answers GPU_IS_LOST from the start is lost (GPULost, condition "
        "True, reason GPULost); once it is reset and answers healthy, GPUHealthy is told and "
        "the condition goes False on that cycle; no fact is left under its placeholder.",
        figure=f"condition statuses written: {', '.join(statuses)}; False at t={cleared_at:.0f} "
        f"s (reset at 30 s); {healthy} GPUHealthy Event; before the fix: still True after "
        f"the reset ('1 of 2 GPUs unhealthy: GPU ? (unknown-gpu-0): gpu_lost, not listed' "
        f"on a 1-GPU node), no GPUHealthy.",
    )


async def test_no_permission_at_open_is_no_lost_gpu(record_fault: RecordFault) -> None:
    scenario: dict[str, object] = {
        "node_name": "sim-perm",
        "gpus": [{}, {}],
        "pods": [exclusive("a", 0), exclusive("b", 1)],
        "call_errors": [
            {"call": "nvmlDeviceGetHandleByIndex_v2", "error": "NO_PERMISSION", "gpu": 0}
        ],
    }
    async with simulated_exporter(scenario, argv=["--node-condition"]) as h:
        for _ in range(CYCLES):
            await step(h)
        await quiet(h)
        scrape = await h.scrape()
        lost, statuses = warnings(h, "GPULost"), written(h)
        assert lost == 0 and warnings(h, "GPUUnhealthy") == 0
        assert "True" not in {s.split(":")[0] for s in statuses}
        assert unreadable(scrape, "0") and not scrape.find("gpu_healthy", gpu="0")
        assert scrape.get("gpu_healthy", gpu="1") == 1
        assert scrape.get("gpu_exporter_errors_total", **NVML) >= CYCLES
    record_fault(
        "nvml-no-permission-at-open",
        expected="A GPU the exporter may not open (NO_PERMISSION from "
        "nvmlDeviceGetHandleByIndex) is unreadable, counted every cycle, health unknown: no "
        "GPULost, no condition True; with no GPU unhealthy and one unknown the condition is "
        "left as it is.",
        figure=f"0 GPULost Events over {CYCLES} cycles; condition statuses written: "
        f"{', '.join(statuses) or 'none'}; the other GPU served healthy; before the fix: "
        f"1 GPULost Warning (the Node's: no pod matches the placeholder) and the condition "
        f"True.",
    )
