"""docs/kubernetes-events.md quotes tests/kube_events_demo.py: every quoted line (but the
times the writer stamps from the clock it ran at) must still be produced by that code.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.kube_events_demo import dra_with_a_fatal_xid, play

DOC = Path(__file__).resolve().parents[1] / "docs" / "kubernetes-events.md"
# Stamped by the writer from the simulated wall clock at the moment it ran: not replayable.
CLOCK_STAMPED = re.compile(r"^\s*(lastHeartbeatTime|lastTransitionTime|timeAdded):")


def _quoted_blocks() -> list[str]:
    return re.findall(r"```(?:yaml)?\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def _lines(text: str) -> list[str]:
    return [
        line.rstrip()
        for line in text.splitlines()
        if line.strip() and not line.startswith("$ ") and not CLOCK_STAMPED.match(line)
    ]


def _produced(results: dict[str, str]) -> set[str]:
    return {line for text in results.values() for line in _lines(text)}


@pytest.fixture(scope="module")
def node_8gpu() -> set[str]:
    import asyncio

    return _produced(asyncio.run(play("node-8gpu", 175.0, ["--node-condition"])))


def test_the_quoted_kubectl_output_is_what_the_demo_prints(node_8gpu: set[str]) -> None:
    block = next(b for b in _quoted_blocks() if "kubectl describe pod -n debug leaky-shell" in b)
    quoted = _lines(block)
    assert len(quoted) > 15
    missing = [line for line in quoted if line not in node_8gpu]
    assert not missing, "docs/kubernetes-events.md quotes lines the demo no longer prints:\n" + (
        "\n".join(missing)
    )


def test_the_quoted_device_taint_rule_is_what_the_demo_writes() -> None:
    import asyncio

    produced = _produced(asyncio.run(play(dra_with_a_fatal_xid(), 20.0, ["--dra-device-taints"])))
    block = next(b for b in _quoted_blocks() if b.startswith("apiVersion: resource.k8s.io"))
    quoted = _lines(block)
    assert "    effect: None" in quoted
    missing = [line for line in quoted if line not in produced]
    assert not missing, "\n".join(missing)
