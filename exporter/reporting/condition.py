"""The ``GPUUnhealthy`` node condition (pure): what it should say, and when to write it.

In node-problem-detector's style (pkg/exporters/k8sexporter/condition/manager.go): one
condition type this exporter owns, True while any GPU of the node is unhealthy or lost,
False once every GPU NVML lists is healthy, written with a strategic-merge PATCH of
``nodes/<name>/status`` (merged by ``type``, so other owners' conditions stay), and
re-sent as a heartbeat every ``HEARTBEAT_S`` (NPD's default is 5 minutes) when nothing
changed. ``lastTransitionTime`` moves only when the status changes.

When the exporter cannot tell (NVML down, no GPU listed, or no GPU unhealthy but one
whose health is unknown: its reading failed without hardware evidence) there is no
desired condition: the one on the Node is left as it is, never flipped to False for
want of evidence, nor to True on evidence that is not about the hardware.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.model import Analysis
from exporter.reporting.recorder import rfc3339_micro
from exporter.text import one_line

CONDITION_TYPE = "GPUUnhealthy"
HEARTBEAT_S = 300.0
MESSAGE_CHARS = 1024
GPUS_NAMED = 16


@dataclass(frozen=True, slots=True)
class NodeCondition:
    status: str  # "True" | "False"
    reason: str
    message: str


def desired_condition(analysis: Analysis) -> NodeCondition | None:
    """The condition this cycle's verdicts call for; None when they cannot tell.

    A GPU known unhealthy that NVML no longer lists (``Analysis.unlisted_unhealthy``)
    still counts: a GPU dropping out of the listing is no verdict of healthy. True needs
    one GPU unhealthy; False needs every GPU healthy (an unknown one, or a device
    advertised on a GPU NVML does not list, leaves it alone)."""
    if not analysis.node.nvml.ok or not analysis.health:
        return None
    # a UUID two GPUs share carries no hardware verdict: it counts as unknown
    shared = {h.uuid for h in analysis.health if sum(o.uuid == h.uuid for o in analysis.health) > 1}
    bad: list[tuple[str, str, tuple[str, ...]]] = [
        (str(h.gpu), h.uuid, tuple(r.reason for r in h.reasons if r.severity == "unhealthy"))
        for h in analysis.health
        if h.unhealthy and h.uuid not in shared
    ]
    bad += [("?", uuid, (*reasons, "not listed")) for uuid, reasons in analysis.unlisted_unhealthy]
    total = len(analysis.health) + len(analysis.unlisted_unhealthy)
    if not bad:
        # a device the kubelet or a DRA driver advertises on a GPU NVML does not list
        # (capacity counts it unhealthy): not every GPU is known healthy
        unseen = any(c.unhealthy for c in analysis.capacity)
        if shared or unseen or any(h.unknown for h in analysis.health):
            return None
        return NodeCondition("False", "GPUsHealthy", f"all {total} GPUs are healthy")
    lost = any("gpu_lost" in reasons for _, _, reasons in bad)
    head = f"{len(bad)} of {total} GPUs unhealthy: "
    # GPUs are named while they fit whole, so the count of the rest is never cut off
    room = MESSAGE_CHARS - len(head) - len("; and 99999 more")
    parts: list[str] = []
    for index, uuid, reasons in bad[:GPUS_NAMED]:
        part = f"GPU {index} ({uuid}): {', '.join(reasons)}"
        if sum(len(p) + 2 for p in parts) + len(part) > room:
            break
        parts.append(part)
    if len(bad) > len(parts):
        parts.append(f"and {len(bad) - len(parts)} more")
    message = one_line(head + "; ".join(parts), MESSAGE_CHARS)
    return NodeCondition("True", "GPULost" if lost else "GPUUnhealthy", message)


@dataclass(frozen=True, slots=True)
class SentCondition:
    condition: NodeCondition
    sent_at: float  # monotonic
    transition_wall: float  # epoch: lastTransitionTime


def condition_due(desired: NodeCondition | None, sent: SentCondition | None, now: float) -> bool:
    """A write is due on a change, or for the heartbeat."""
    if desired is None:
        return False
    return sent is None or sent.condition != desired or now - sent.sent_at >= HEARTBEAT_S


def condition_body(
    desired: NodeCondition, transition_wall: float, heartbeat_wall: float
) -> dict[str, Any]:
    return {
        "type": CONDITION_TYPE,
        "status": desired.status,
        "reason": desired.reason,
        "message": desired.message,
        "lastHeartbeatTime": rfc3339_seconds(heartbeat_wall),
        "lastTransitionTime": rfc3339_seconds(transition_wall),
    }


def rfc3339_seconds(epoch: float) -> str:
    """metav1.Time: whole seconds."""
    return rfc3339_micro(epoch)[:19] + "Z"
