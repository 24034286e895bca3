"""A real kubectl reads what the real exporter wrote, from the API stand-in.

The exporter plays node-8gpu to 175 s with ``--node-condition`` (a fatal XID 79 and then
a lost GPU 7 under ``debug/leaky-shell``, a recovery action on GPU 0, orphaned memory),
writing events.k8s.io/v1 Events and the ``GPUUnhealthy`` condition through the real
``kubernetes`` client; then Debian's ``kubectl`` runs against the same stand-in, as a
person would: discovery, a pod GET and the core/v1 Events with ``describe``'s field
selector, the server-printed Table of ``get events``, and the Node as YAML.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml

from tests.kube_events_demo import Shown, events_section, play
from tests.system_tools import KUBECTL_HINT, require_tool

pytestmark = pytest.mark.slow

POD = ("debug", "leaky-shell")
NODE = "sim-node-8gpu"
GPU7 = "GPU 7 (GPU-8d190fb5-2d58-5566-0cdc-9f520ab08939)"


def _commands(h: Any) -> list[tuple[str, list[str], Any]]:
    keep = str.rstrip
    return [
        ("describe-pod", ["describe", "pod", "-n", POD[0], POD[1]], keep),
        ("get-events", ["get", "events", "-A"], keep),
        (
            "get-node-events-wide",
            [
                "get",
                "events",
                "-n",
                "default",
                "-o",
                "wide",
                "--field-selector",
                f"involvedObject.kind=Node,involvedObject.name={NODE}",
            ],
            keep,
        ),
        ("get-node", ["get", "node", NODE, "-o", "yaml"], keep),
        ("version", ["version", "-o", "yaml"], keep),
    ]


@pytest.fixture(scope="module")
def shown() -> dict[str, Shown]:
    import asyncio

    kubectl = require_tool("kubectl", KUBECTL_HINT)
    runs = asyncio.run(play("node-8gpu", 175.0, ["--node-condition"], _commands, kubectl))
    return {s.name: s for s in runs}


def _rows(table: str) -> list[list[str]]:
    """kubectl's table as cells split on runs of 2+ spaces (cells hold single spaces)."""
    import re

    return [re.split(r" {2,}", line.strip()) for line in table.splitlines()]


def test_kubectl_describe_pod_lists_the_fatal_xid_and_lost_gpu_events_on_that_pod(shown) -> None:
    events = _rows(events_section(shown["describe-pod"].output))
    assert events[0] == ["Events:"]
    assert events[1] == ["Type", "Reason", "Age", "From", "Message"]
    by_reason = {row[1]: row for row in events[3:]}
    fatal = by_reason["GPUFatalXID"]
    assert fatal[0] == "Warning"
    assert fatal[3] == "gpu-occupancy-exporter"
    assert fatal[4].startswith(f"XID 79 (class fatal: GPU has fallen off the bus) on {GPU7}")
    assert by_reason["GPULost"][4].startswith(f"{GPU7} is lost (GpuIsLost)")
    # only this pod's Events: describe's field selector names the pod's UID
    assert all("GPUOrphanedMemory" not in row for row in events)


def test_kubectl_get_events_lists_pod_and_node_events_with_their_namespaces(shown) -> None:
    rows = _rows(shown["get-events"].output)
    assert rows[0] == ["NAMESPACE", "LAST SEEN", "TYPE", "REASON", "OBJECT", "MESSAGE"]
    seen = {(r[0], r[3], r[4]) for r in rows[1:]}
    assert ("debug", "GPUFatalXID", "pod/leaky-shell") in seen
    assert ("default", "GPULost", f"node/{NODE}") in seen
    assert ("default", "GPUUnhealthy", f"node/{NODE}") in seen
    assert all(r[2] == "Warning" for r in rows[1:] if r[3] != "GPUHealthy")


def test_kubectl_get_events_wide_names_the_exporter_as_source_and_a_count(shown) -> None:
    rows = _rows(shown["get-node-events-wide"].output)
    header = rows[0]
    assert header == [
        "LAST SEEN",
        "TYPE",
        "REASON",
        "OBJECT",
        "SUBOBJECT",
        "SOURCE",
        "MESSAGE",
        "FIRST SEEN",
        "COUNT",
        "NAME",
    ]
    lost = [r for r in rows[1:] if r[2] == "GPULost"]
    assert len(lost) == 1
    # an empty SUBOBJECT cell leaves one run of spaces: 9 cells
    assert lost[0][3] == f"node/{NODE}"
    assert lost[0][4] == f"gpu-occupancy-exporter, {NODE}"
    assert lost[0][7] == "1"
    assert all(r[3] == f"node/{NODE}" for r in rows[1:])


def test_kubectl_get_node_yaml_shows_the_gpu_unhealthy_condition_beside_ready(shown) -> None:
    node = yaml.safe_load(shown["get-node"].output)
    conditions = {c["type"]: c for c in node["status"]["conditions"]}
    ours = conditions["GPUUnhealthy"]
    assert (ours["status"], ours["reason"]) == ("True", "GPULost")
    assert ours["message"].startswith("2 of 8 GPUs unhealthy:")
    assert (
        "GPU 7 (GPU-8d190fb5-2d58-5566-0cdc-9f520ab08939): gpu_lost, fatal_xid" in ours["message"]
    )
    assert conditions["Ready"]["status"] == "True"  # the kubelet's, left as it was


def test_kubectl_reads_the_stand_ins_server_version(shown) -> None:
    version = yaml.safe_load(shown["version"].output)
    assert version["serverVersion"]["major"] == "1"
    assert version["serverVersion"]["minor"] == "35"
