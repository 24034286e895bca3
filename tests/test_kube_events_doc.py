"""docs/kubernetes-events.md quotes real kubectl output (tests/kube_events_demo.py runs
Debian's kubectl against the API stand-in after the real exporter wrote its Events,
condition and taints): every quote between ``<!-- kubectl-output:<name> -->`` markers
must be what kubectl prints now, but for ages, clock stamps, uids and resourceVersions
(and column padding, which follows the widest age). On a difference, look at it, then
rewrite the quotes: ``.venv/bin/python tests/kube_events_demo.py --write-doc``."""

from __future__ import annotations

import pytest

from tests.kube_events_demo import (
    DOC,
    REGENERATE,
    Shown,
    block,
    normalized,
    play_dra,
    play_node_8gpu,
    quoted_blocks,
    write_doc,
)
from tests.system_tools import KUBECTL_HINT, require_tool

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def shown() -> list[Shown]:
    kubectl = require_tool("kubectl", KUBECTL_HINT)
    return play_node_8gpu(kubectl) + play_dra(kubectl)


def test_every_kubectl_quote_in_the_doc_is_what_kubectl_prints_now(shown) -> None:
    quoted = quoted_blocks(DOC.read_text(encoding="utf-8"))
    assert sorted(quoted) == sorted(s.name for s in shown), "a quote or a run is missing"
    stale = [s.name for s in shown if normalized(quoted[s.name]) != normalized(block(s))]
    assert not stale, f"docs/kubernetes-events.md: stale kubectl quotes {stale}; run {REGENERATE}"


def test_the_quotes_show_the_fatal_xid_the_lost_gpu_and_the_condition(shown) -> None:
    text = "\n".join(block(s) for s in shown)
    assert "Warning  GPUFatalXID" in text
    assert "GPULost" in text
    assert "type: GPUUnhealthy" in text
    assert "effect: None" in text


def test_normalized_hides_ages_and_stamps_but_keeps_counts_and_gpu_numbers() -> None:
    line = "  Warning  GPULost  5s (x3 over 2m55s)  gpu-exporter  GPU 7 lost, x8 link, 12.0 GiB"
    assert normalized(line) == [
        "Warning GPULost <age> (x3 over <age>) gpu-exporter GPU 7 lost, x8 link, 12.0 GiB"
    ]
    stamp = "    lastHeartbeatTime: '2026-11-25T17:01:46Z'\n    uid: dtr-0a1b\n"
    assert normalized(stamp) == ["lastHeartbeatTime: '<time>'", "uid: <uid>"]
    assert normalized("a 1m b") != normalized("a 1m c")


def test_write_doc_replaces_only_the_marked_quote() -> None:
    doc = "before\n<!-- kubectl-output:get-events -->\nold\n<!-- kubectl-output:end -->\nafter\n"
    new = Shown("get-events", "kubectl get events -A", "OUT\n", "OUT")
    assert write_doc(doc, [new]) == (
        "before\n<!-- kubectl-output:get-events -->\n```\n$ kubectl get events -A\nOUT\n```\n"
        "<!-- kubectl-output:end -->\nafter\n"
    )
