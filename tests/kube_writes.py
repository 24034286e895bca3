"""Helpers for the tests of the node condition and the DRA DeviceTaintRules, run on the
simulated node (tests/harness.py) against the API stand-in
(exporter/sim/kube_writes.py): the scenarios, what the Node and the rules show, what an
earlier run left, and cycles that wait for the writer."""

from __future__ import annotations

import asyncio
import datetime
from importlib import resources
from typing import Any

import yaml

from tests.harness import Harness
from tests.test_kube_events import api, exclusive, quiet, step, until

CONDITION = "GPUUnhealthy"


def condition(h: Harness) -> dict[str, Any] | None:
    """Our condition on the Node, as ``kubectl get node -o yaml`` shows it."""
    node = api(h).node(h.env.node.scenario.node_name)
    assert node is not None
    found = [c for c in node["status"]["conditions"] if c["type"] == CONDITION]
    assert len(found) <= 1, found
    return found[0] if found else None


def status_of(h: Harness) -> tuple[str, str] | None:
    c = condition(h)
    return None if c is None else (c["status"], c["reason"])


def status_patches(h: Harness) -> int:
    path = f"/api/v1/nodes/{h.env.node.scenario.node_name}/status"
    return sum(1 for w in api(h).write_log if w.method == "PATCH" and w.path == path)


def recovering_gpu(node: str, unhealthy_at: float, healthy_at: float) -> dict[str, object]:
    """Two GPUs; GPU 0's driver asks for a reset at ``unhealthy_at`` (recovery action),
    done at ``healthy_at``."""
    return {
        "node_name": node,
        "gpus": [{}, {}],
        "pods": [exclusive("a", 0), exclusive("b", 1)],
        "timeline": [
            {"at": unhealthy_at, "set": {"gpu": 0, "recovery_action": 1}},
            {"at": healthy_at, "set": {"gpu": 0, "recovery_action": 0}},
        ],
    }


def dra_with_a_reset(unhealthy_at: float = 15, healthy_at: float = 35) -> dict[str, object]:
    """The shipped ``dra`` scenario, GPU 0 (DRA device gpu-2) asking for a reset a while."""
    text = resources.files("exporter.sim").joinpath("scenarios/dra.yaml").read_text()
    data: dict[str, object] = yaml.safe_load(text)
    data["timeline"] = [
        {"at": unhealthy_at, "set": {"gpu": 0, "recovery_action": 1}},
        {"at": healthy_at, "set": {"gpu": 0, "recovery_action": 0}},
    ]
    return data


def rfc3339(epoch: float) -> str:
    return datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def leave_condition(h: Harness, left: dict[str, str]) -> None:
    """The Node as an earlier run (or someone else) left it: ``left`` among its
    conditions."""
    node = api(h).node(h.env.node.scenario.node_name)
    assert node is not None
    node["status"]["conditions"].append(left)
    api(h).set_node(node)


async def leave_true_condition(h: Harness) -> None:
    """The Node as an earlier run left it: GPUUnhealthy True, heartbeat just now."""
    leave_condition(
        h,
        {
            "type": CONDITION,
            "status": "True",
            "reason": "GPUUnhealthy",
            "message": "1 of 2 GPUs unhealthy: GPU 0 (GPU-x): fatal_xid",
            "lastHeartbeatTime": rfc3339(h.env.node.wall_time()),
            "lastTransitionTime": rfc3339(h.env.node.wall_time() - 100),
        },
    )


async def left_rule(h: Harness, uuid: str) -> None:
    """A DeviceTaintRule an earlier run left for ``uuid`` (GPU 0, DRA device gpu-2)."""
    from exporter.reporting.device_taints import TaintRule, rule_body, rule_name
    from exporter.reporting.kube_client import KubeWriteClient

    assert h.env.paths.kubeconfig is not None
    client = KubeWriteClient(str(h.env.paths.kubeconfig))
    rule = TaintRule(
        rule_name("sim-dra-node", uuid),
        "gpu.nvidia.com",
        "sim-dra-node",
        "gpu-2",
        uuid,
        "fatal_xid",
    )
    await asyncio.to_thread(
        client.create_device_taint_rule,
        "v1alpha3",
        rule_body(rule, "v1alpha3", "sim-dra-node", "None"),
    )
    client.close()


async def settle(h: Harness) -> None:
    """Until the writer has acted on all it was handed (a whole turn since the last
    offer) and sent all it has, then counted nothing new a moment more."""
    assert h.agent.reporter is not None
    await until(h.agent.reporter.settled, "the writer settled")
    await quiet(h, settle_s=0.05)


async def cycles_to(h: Harness, at: float) -> None:
    """Cycles of 10 s up to ``at``, each one's writes done before the next (the writer
    thread reads the simulated clock when it runs: it must not fall cycles behind)."""
    while h.clock() < at:
        await step(h)
        await settle(h)
