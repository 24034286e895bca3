"""Leak evidence: "not listed by the kubelet" is unknown, not "allocated nothing".

Each test runs the real exporter on a simulated node whose kubelet (the PodResources
gRPC stand-in) and API server (the stand-in the real ``kubernetes`` client writes to)
behave as each test describes, and counts the GPUIsolationLeak Warnings written. The
evidence rule (docs/attribution.md, "Isolation leaks"): a leak needs the kubelet to list
the container with no device covering the GPU, in an answer begun after the process was
first seen; init containers, MPS's daemons, pods whose claims the kubelet does not
report and devices under other resource names are each unknown by a named rule.
"""

from __future__ import annotations

import copy
from typing import Any

from exporter.sim.events import SimEvent
from exporter.sim.scenario import Scenario, load_scenario
from tests.faults.conftest import RecordFault
from tests.harness import Harness, simulated_exporter
from tests.test_kube_events import api, quiet, step

LEAK = "GPUIsolationLeak"


def leak_transitions(h: Harness) -> int:
    assert h.agent.latest is not None
    return sum(1 for t in h.agent.latest.transitions if t.kind == "isolation_leak")


async def run_cycles(h: Harness, cycles: int, *, refresh: bool = True) -> int:
    """``cycles`` cycles 10 s apart (each after a PodResources refresh, as the agent's
    refresh task would, unless ``refresh`` is False); the leak transitions they raised."""
    raised = 0
    for _ in range(cycles):
        if refresh:
            await step(h)
        else:
            await h.advance(10.0)
        raised += leak_transitions(h)
    return raised


async def leak_events(h: Harness) -> list[tuple[str, str]]:
    await quiet(h)
    return sorted(
        (e["regarding"].get("namespace", ""), e["regarding"]["name"])
        for e in api(h).events(f"reason={LEAK}")
    )


def node_8gpu(*events: dict[str, Any]) -> Scenario:
    """node-8gpu with only ``events`` on its timeline (its one true leak stays:
    debug/leaky-shell, allocated GPU 7, runs a process on GPU 6)."""
    scenario = copy.deepcopy(load_scenario("node-8gpu"))
    scenario.timeline = sorted(
        (
            SimEvent(at=float(e["at"]), action=k, args=v)
            for e in events
            for k, v in e.items()
            if k != "at"
        ),
        key=lambda e: e.at,
    )
    return scenario


TRUE_LEAK = [("debug", "leaky-shell")]


async def test_a_restarted_kubelets_empty_list_raises_no_isolation_leak(
    record_fault: RecordFault,
) -> None:
    # the kubelet restarts at 25 s and answers List with no pods for 20 s
    scenario = node_8gpu({"at": 25, "kubelet_restart": {"empty_for": 20}})
    async with simulated_exporter(scenario) as h:
        raised = await run_cycles(h, 12)
        events = await leak_events(h)
    assert events == TRUE_LEAK  # the true one, once; none from the empty answers
    assert raised == 1
    record_fault(
        "kubelet-restart-empty-list",
        expected="an empty List answer (a kubelet just restarted) is no evidence: the "
        "containers it leaves out are unknown, no GPUIsolationLeak Warning; the node's one "
        "true leak is still reported once",
        figure=f"{len(events)} GPUIsolationLeak Event over 12 cycles (the true leak, "
        "debug/leaky-shell); before the fix: 21 (20 false, one per GPU pod)",
    )


def pod(
    name: str,
    containers: list[dict[str, Any]],
    *,
    namespace: str = "ml",
) -> dict[str, Any]:
    return {"namespace": namespace, "name": name, "containers": containers}


def container(
    name: str,
    devices: dict[str, list[str]] | None = None,
    *,
    gpu: int | None = None,
    comm: str = "python3",
    init: bool = False,
    kind: str = "compute",
) -> dict[str, Any]:
    """A container; with ``gpu``, one process on that GPU."""
    processes = (
        []
        if gpu is None
        else [{"gpu": gpu, "memory": "1GiB", "sm": 20, "comm": comm, "kind": kind}]
    )
    found: dict[str, Any] = {"name": name, "devices": devices or {}, "processes": processes}
    if init:
        found["init"] = True
    return found


async def no_leak_over(
    scenario: dict[str, Any], cycles: int = 6
) -> tuple[int, list[tuple[str, str]]]:
    async with simulated_exporter(scenario) as h:
        raised = await run_cycles(h, cycles)
        return raised, await leak_events(h)


async def test_a_pods_process_seen_before_the_next_allocation_answer_raises_no_leak(
    record_fault: RecordFault,
) -> None:
    # At 15 s, before any refresh: pod ml/b starts on GPU 1 (not in the last answer), and
    # ml/c is deleted and recreated under the same name on GPU 2 (the last answer lists
    # ml/c/main with GPU 1, its old device). The cycle at 20 s reads that old answer.
    scenario: dict[str, Any] = {
        "node_name": "new-pods",
        "gpus": [{}, {}, {}],
        "pods": [
            pod("a", [container("main", {"nvidia.com/gpu": ["gpu0"]}, gpu=0)]),
            pod("c", [container("main", {"nvidia.com/gpu": ["gpu1"]})]),
        ],
        "timeline": [
            {"at": 15, "delete_pod": "ml/c"},
            {
                "at": 15,
                "add_pod": {
                    "pod": "ml/c",
                    "containers": [{"name": "main", "devices": {"nvidia.com/gpu": ["gpu2"]}}],
                },
            },
            {
                "at": 15,
                "add_pod": {
                    "pod": "ml/b",
                    "containers": [{"name": "main", "devices": {"nvidia.com/gpu": ["gpu1"]}}],
                },
            },
            {
                "at": 15,
                "start": {
                    "pid": 800,
                    "gpu": 2,
                    "memory": "2GiB",
                    "pod": "ml/c",
                    "container": "main",
                },
            },
            {
                "at": 15,
                "start": {
                    "pid": 900,
                    "gpu": 1,
                    "memory": "2GiB",
                    "pod": "ml/b",
                    "container": "main",
                },
            },
        ],
    }
    async with simulated_exporter(scenario) as h:
        raised = await run_cycles(h, 1)  # 10 s: refreshed, before the pods
        raised += await run_cycles(h, 1, refresh=False)  # 20 s: the answer from 10 s
        raised += await run_cycles(h, 5)
        events = await leak_events(h)
    assert (raised, events) == (0, [])
    record_fault(
        "new-pod-before-allocation-refresh",
        expected="a pod's process seen before the next PodResources answer is unknown until "
        "an answer begun after it was first seen: no GPUIsolationLeak Warning",
        figure="0 GPUIsolationLeak Events over 7 cycles (a new pod, and a pod recreated "
        "under the same name on another GPU, both read once against the older answer); "
        "before the fix: 2",
    )


async def test_an_init_container_on_a_gpu_raises_no_leak(record_fault: RecordFault) -> None:
    # A TensorRT engine build in an init container: List never names init containers.
    build = container("build-engine", {"nvidia.com/gpu": ["gpu0"]}, gpu=0, init=True)
    scenario: dict[str, Any] = {
        "node_name": "init-containers",
        "gpus": [{}],
        "pods": [pod("trt", [build, container("server", {"nvidia.com/gpu": ["gpu0"]})])],
    }
    raised, events = await no_leak_over(scenario)
    assert (raised, events) == (0, [])
    record_fault(
        "init-container-uses-gpu",
        expected="an init container's GPU process is unknown (the kubelet's List names only "
        "spec.containers): no GPUIsolationLeak Warning",
        figure="0 GPUIsolationLeak Events over 6 cycles; before the fix: 1 per pod start",
    )


async def test_dra_pods_on_a_kubelet_that_does_not_report_claims_raise_no_leak(
    record_fault: RecordFault,
) -> None:
    scenario: dict[str, Any] = {
        "node_name": "dra-no-gate",
        "allocator": "dra",
        "kubelet_reports_claims": False,
        "gpus": [{}, {}],
        "pods": [
            pod(f"dra-{g}", [container("main", {"nvidia.com/gpu": [f"gpu{g}"]}, gpu=g)])
            for g in range(2)
        ],
    }
    raised, events = await no_leak_over(scenario)
    assert (raised, events) == (0, [])
    record_fault(
        "dra-claims-not-reported",
        expected="a pod with resourceClaims whose claims the kubelet's List does not report "
        "(KubeletPodResourcesDynamicResources off, the default through 1.33) is unknown: no "
        "GPUIsolationLeak Warning",
        figure="0 GPUIsolationLeak Events over 6 cycles, 2 DRA pods; before the fix: 2 "
        "(one per DRA pod)",
    )


async def test_gpus_under_a_resource_name_outside_the_flag_raise_no_leak(
    record_fault: RecordFault,
) -> None:
    scenario: dict[str, Any] = {
        "node_name": "other-resource",
        "gpus": [{}, {}],
        "pods": [
            pod(f"p{g}", [container("main", {"example.com/gpu": [f"gpu{g}"]}, gpu=g)])
            for g in range(2)
        ],
    }
    async with simulated_exporter(scenario) as h:
        raised = await run_cycles(h, 6)
        events = await leak_events(h)
        hint = (await h.scrape()).get(
            "gpu_exporter_podresources_other_resource_devices", resource="example.com/gpu"
        )
    assert (raised, events) == (0, [])
    assert hint == 2
    record_fault(
        "gpu-under-unlisted-resource-name",
        expected="a device id under a resource name outside --resource-names that names a "
        "GPU here makes its container's use unknown, and "
        "gpu_exporter_podresources_other_resource_devices{resource} hints at the flag",
        figure="0 GPUIsolationLeak Events over 6 cycles, 2 pods, hint 2 for "
        "example.com/gpu; before the fix: 2 (one per GPU pod) and no hint",
    )


async def test_the_device_plugins_mps_daemon_raises_no_leak(record_fault: RecordFault) -> None:
    # NVIDIA's device plugin runs `nvidia-cuda-mps-control -d` in a container requesting
    # no GPU; the daemon's server process is what NVML lists on the shared GPU.
    daemon = container("mps-control-daemon-ctr", gpu=0, comm="nvidia-cuda-mps-server")
    clients = [
        pod(
            f"chat-{i}",
            [container("main", {"nvidia.com/gpu.shared": [f"gpu0::{i}"]}, gpu=0, kind="mps")],
        )
        for i in range(2)
    ]
    scenario: dict[str, Any] = {
        "node_name": "mps",
        "gpus": [{}],
        "pods": [
            pod(
                "nvidia-device-plugin-mps-control-daemon-x7k2p", [daemon], namespace="gpu-operator"
            ),
            *clients,
        ],
    }
    raised, events = await no_leak_over(scenario)
    assert (raised, events) == (0, [])
    record_fault(
        "mps-control-daemon",
        expected="MPS's control daemon and server (comm nvidia-cuda-mps) are the shared "
        "GPU's infrastructure, never a leak: no GPUIsolationLeak Warning",
        figure="0 GPUIsolationLeak Events over 6 cycles; before the fix: 1 per shared GPU "
        "at every exporter start",
    )


async def test_the_operators_cuda_validator_raises_no_leak(record_fault: RecordFault) -> None:
    # gpu-operator's validator pod: vectorAdd in the privileged init container
    # cuda-validation, then a main container that only reports success.
    check = container(
        "cuda-validation", {"nvidia.com/gpu": ["gpu0"]}, gpu=0, comm="vectorAdd", init=True
    )
    scenario: dict[str, Any] = {
        "node_name": "validator",
        "gpus": [{}],
        "pods": [
            pod(
                "nvidia-cuda-validator-5x2kq",
                [check, container("nvidia-cuda-validator")],
                namespace="gpu-operator",
            )
        ],
    }
    raised, events = await no_leak_over(scenario)
    assert (raised, events) == (0, [])
    record_fault(
        "operator-cuda-validator",
        expected="the GPU Operator's nvidia-cuda-validator runs vectorAdd in an init "
        "container: unknown by the init-container rule, no GPUIsolationLeak Warning",
        figure="0 GPUIsolationLeak Events over 6 cycles; before the fix: 1 per validator run",
    )
