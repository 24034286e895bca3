"""Health transitions as Kubernetes Events and log lines (pure): who hears what.

| transition      | reason             | type    | regarding                        |
|-----------------|--------------------|---------|----------------------------------|
| fatal_xid       | GPUFatalXID        | Warning | each pod allocated the GPU / MIG |
| gpu_lost        | GPULost            | Warning | those pods and the Node          |
| gpu_unhealthy   | GPUUnhealthy       | Warning | those pods and the Node          |
| gpu_healthy     | GPUHealthy         | Normal  | the Node                         |
| isolation_leak  | GPUIsolationLeak   | Warning | the pod using a GPU not its own  |
| orphaned_memory | GPUOrphanedMemory  | Warning | the Node                         |

The log tells every transition (also a GPU back, orphaned memory cleared, a source down
or up) with the same words as the Event's note.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from exporter.analysis.xid import XID_DESCRIPTION
from exporter.model import ROLE_HOLDER, HealthTransition, PodRef
from exporter.text import one_line

CONTROLLER = "gpu-occupancy-exporter"
# events.k8s.io/v1 limits the note to 1 KiB (NoteLengthLimit in kubernetes
# pkg/apis/core/validation/events.go); text from outside is cut well before that.
NOTE_CHARS = 1000
NOTE_BYTES = 1024
NAME_CHARS = 120  # of a pod, container, comm or detail inside a note
WARNING: Final = "Warning"
NORMAL: Final = "Normal"
ACTION = "Sampled"  # what the exporter did when it saw the fact: sampled the GPU

EventType = Literal["Warning", "Normal"]


@dataclass(frozen=True, slots=True, order=True)
class ObjectRef:
    """An Event's ``regarding`` or ``related``: a Pod or the Node."""

    kind: Literal["Node", "Pod"]
    name: str
    namespace: str = ""  # the Node: cluster-scoped
    uid: str | None = None


@dataclass(frozen=True, slots=True)
class EventIntent:
    """One Event to record; ``key`` is what repeats are aggregated by:
    (regarding, reason, GPU or MIG instance)."""

    regarding: ObjectRef
    related: ObjectRef | None
    reason: str
    type: EventType
    note: str
    device: str  # GPU or MIG UUID ("" when none is known)
    count: int = 1  # occurrences this intent stands for (an XID storm in one cycle)
    at: float | None = None  # epoch seconds of the sample that saw it (eventTime)

    @property
    def key(self) -> tuple[ObjectRef, str, str]:
        return (self.regarding, self.reason, self.device)


def fit_note(note: str) -> str:
    """One line, within the API's limit of 1,024 bytes (Go counts bytes, not
    characters: a pod name in Chinese costs three each)."""
    text = one_line(note, NOTE_CHARS)
    while len(text.encode()) > NOTE_BYTES:
        text = text[: len(text) - (len(text.encode()) - NOTE_BYTES) // 4 - 1]
    return text


def node_ref(node_name: str) -> ObjectRef:
    """The Node as the kubelet names it in its own events: UID = the node's name
    (kubelet.go: ``nodeRef := &v1.ObjectReference{..., UID: types.UID(nodeName)}``)."""
    return ObjectRef("Node", node_name, "", node_name)


def pod_ref(pod: PodRef) -> ObjectRef:
    return ObjectRef("Pod", pod.name, pod.namespace, pod.uid)


def _gpu(t: HealthTransition) -> str:
    index = "?" if t.gpu is None else str(t.gpu)
    text = f"GPU {index} ({t.uuid or 'unknown UUID'})"
    if t.mig_uuid:
        text += f" MIG instance {t.mig_uuid}"
    elif t.gpu_instance_id is not None:
        text += f" MIG GPU instance {t.gpu_instance_id}"
    return text


def _bytes(value: int | None) -> str:
    return "an unknown amount" if value is None else f"{value / 2**30:.1f} GiB"


def _reasons(t: HealthTransition) -> str:
    return "; ".join(
        f"{r.reason} ({one_line(r.detail, NAME_CHARS)})" if r.detail else r.reason
        for r in t.reasons
    )


def _holders(t: HealthTransition) -> str:
    """The holders, those that keep the memory before the management daemons that open
    every GPU (tagged), so the process to act on comes first."""
    named = []
    for h in sorted(t.holders, key=lambda h: h.role != ROLE_HOLDER):
        who = f"pid {h.pid}"
        if h.comm:
            who += f" {one_line(h.comm, NAME_CHARS)}"
        if h.pod:
            who += f" (pod {one_line(f'{h.namespace}/{h.pod}', NAME_CHARS)})"
        if h.role != "holder":
            who += f" [{h.role}]"
        named.append(who)
    return ", ".join(named)


def _dead_pids(t: HealthTransition) -> str:
    """The listed dead pids as words (dead pid 533; dead pids 533, 534), with those not
    named counted."""
    if not t.dead_pids:
        return "dead processes"
    text = ("dead pid " if len(t.dead_pids) == 1 else "dead pids ") + ", ".join(
        str(pid) for pid in t.dead_pids
    )
    more = t.count - len(t.dead_pids)
    return f"{text} and {more} more" if more > 0 else text


def describe(t: HealthTransition) -> tuple[str, EventType, str]:
    """(reason, type, note): the words the Event and the log line share."""
    gpu = _gpu(t)
    if t.kind == "fatal_xid":
        meaning = XID_DESCRIPTION.get(t.xid or 0, "not in the XID catalogue")
        times = "once" if t.count == 1 else f"{t.count} times"
        note = (
            f"XID {t.xid} (class {t.xid_class}: {meaning}) on {gpu}, {times} since the "
            "last sample. Work on this GPU may have failed; see docs/kubernetes-events.md."
        )
        return "GPUFatalXID", WARNING, note
    if t.kind == "gpu_lost":
        note = (
            f"{gpu} is lost ({one_line(t.detail, NAME_CHARS)}): NVML cannot reach it. Work "
            "on it fails until the GPU is reset or the node rebooted."
        )
        return "GPULost", WARNING, note
    if t.kind == "gpu_back":
        return "GPUBack", NORMAL, f"{gpu} answers NVML again."
    if t.kind == "gpu_unhealthy":
        return "GPUUnhealthy", WARNING, f"{gpu} is unhealthy: {_reasons(t)}."
    if t.kind == "gpu_healthy":
        return "GPUHealthy", NORMAL, f"{gpu} is healthy again."
    if t.kind == "isolation_leak":
        c = t.container
        who = f"container {one_line(c.container, NAME_CHARS)}" if c else "a container"
        note = (
            f"{who} of this pod uses {gpu}, which was not allocated to it, holding "
            f"{_bytes(t.memory_bytes)} of its memory: GPU isolation is broken."
        )
        return "GPUIsolationLeak", WARNING, note
    if t.kind == "orphaned_memory":
        holders = _holders(t)
        size = _bytes(t.memory_bytes)
        if not holders and not t.holders_scanned:  # no evidence either way: unknown
            found = "its holders are not known (no complete scan of /proc covered this GPU)"
        elif t.orphan_kind == "dead_process":
            found = f"held open by {holders}" if holders else "no live process holding it was found"
        else:
            found = f"held by {holders}" if holders else "no process holding it was found"
        # the dead pid is what NVML lists, never the holder
        held = f"listed for {_dead_pids(t)}; {found}" if t.orphan_kind == "dead_process" else found
        note = f"{size} of GPU memory on {gpu} is orphaned ({t.orphan_kind}): {held}."
        return "GPUOrphanedMemory", WARNING, note
    if t.kind == "orphaned_memory_cleared":
        return (
            "GPUOrphanedMemoryCleared",
            NORMAL,
            f"orphaned memory ({t.orphan_kind}) on {gpu} is gone.",
        )
    if t.kind == "source_down":
        detail = one_line(t.detail, NAME_CHARS) or "no reason given"
        return "SourceDown", WARNING, f"source {t.source} is down: {detail}"
    return "SourceUp", NORMAL, f"source {t.source} is up again."


# Transitions that become Events, and on which objects: "pods", "node" or both.
_EVENT_TARGETS: dict[str, tuple[str, ...]] = {
    "fatal_xid": ("pods",),
    "gpu_lost": ("pods", "node"),
    "gpu_unhealthy": ("pods", "node"),
    "gpu_healthy": ("node",),
    "isolation_leak": ("pods",),
    "orphaned_memory": ("node",),
}


# Every reason an Event of ours can carry (gpu_exporter_events_total is present for each).
EVENT_REASONS = (
    "GPUFatalXID",
    "GPULost",
    "GPUUnhealthy",
    "GPUHealthy",
    "GPUIsolationLeak",
    "GPUOrphanedMemory",
)


def event_intents(
    transitions: tuple[HealthTransition, ...], node_name: str, at: float | None = None
) -> tuple[EventIntent, ...]:
    """The Events one cycle's transitions call for; pod events name the Node as related.
    ``at``: when the cycle sampled them (the Events' eventTime)."""
    node = node_ref(node_name)
    out: list[EventIntent] = []
    for t in transitions:
        targets = _EVENT_TARGETS.get(t.kind, ())
        if not targets:
            continue
        reason, kind, note = describe(t)
        note = fit_note(note)
        device = t.mig_uuid or t.uuid or ""
        occurrences = t.count if t.kind == "fatal_xid" else 1  # else count is processes
        if "pods" in targets:
            for pod in t.pods:
                out.append(
                    EventIntent(pod_ref(pod), node, reason, kind, note, device, occurrences, at)
                )
        if "node" in targets:
            out.append(EventIntent(node, None, reason, kind, note, device, occurrences, at))
    return tuple(out)
