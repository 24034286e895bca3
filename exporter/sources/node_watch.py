"""This node's own Node object: what it says about placing new pods here.

A healthy GPU that no pod holds is no capacity while the node is cordoned
(``spec.unschedulable``), under a NoSchedule or NoExecute taint, or while the GPU
Operator upgrades its driver (the node label ``nvidia.com/gpu-driver-upgrade-state``).
This source lists + watches the one Node named ``metadata.name=<node>`` (the same
machinery as the pod watch, ``kube_watch.KubeWatchSource``) and hands over what
capacity needs of it as a ``NodeSchedulingSnapshot``; analysis/capacity.py decides.

It needs get, list and watch on nodes (the chart's ClusterRole). A watch of one object
by name costs the API server one entry of its watch cache per node, as the kubelet's own
watch of its Node does, instead of a GET per node every few seconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, ClassVar

from exporter.model import (
    DRIVER_UPGRADE_STATE_LABEL,
    NodeScheduling,
    NodeSchedulingSnapshot,
    NodeTaint,
    SourceName,
    WatchCounts,
)
from exporter.sources.base import Cycle
from exporter.sources.kube_watch import KubeWatchSource, describe_error, http_status
from exporter.text import one_line

# A Node carries a handful of taints; far more is a broken or hostile answer, of which
# only this many are read; the ones past them count as one taint that cannot be read
# (it blocks: docs/capacity.md).
MAX_TAINTS = 64
# An effect that cannot be read: not PreferNoSchedule, so it blocks
UNREADABLE_EFFECT = "?"
# One Node is at most etcd's request limit, 1.5 MiB by default (etcd --max-request-bytes);
# the list of one name, or one of its watch lines, is refused over this.
MAX_NODE_BYTES = 4 * 1024 * 1024
MAX_TAINT_KEY_CHARS = 317  # a qualified name: a 253-character prefix, "/", 63 characters
MAX_TAINT_VALUE_CHARS = 63
MAX_LABEL_VALUE_CHARS = 63  # a label value's limit
FORBIDDEN_HINT = (
    "forbidden: the exporter's ClusterRole needs get, list and watch on nodes "
    "(the chart's rbac.yaml has them)"
)


def _text(value: Any, limit: int) -> str | None:
    if isinstance(value, str) and len(value) <= limit and value.isprintable():
        return value
    return None


def node_scheduling(obj: Mapping[str, Any]) -> NodeScheduling:
    """A Node as the API serialises it -> what capacity reads of it. ``unschedulable``
    and the label read as absent when of the wrong type (the label: "?", not in service);
    a taint that cannot be read (not an object, an unreadable effect, past the first
    ``MAX_TAINTS``) is kept with the effect "?", which blocks: docs/capacity.md."""
    spec = obj.get("spec")
    spec = spec if isinstance(spec, Mapping) else {}
    raw_taints = spec.get("taints")
    taints: list[NodeTaint] = []
    if raw_taints is not None and not isinstance(raw_taints, list):
        taints.append(NodeTaint("", "", UNREADABLE_EFFECT))
    raw_taints = raw_taints if isinstance(raw_taints, list) else []
    for raw in raw_taints[:MAX_TAINTS]:
        if not isinstance(raw, Mapping):
            taints.append(NodeTaint("", "", UNREADABLE_EFFECT))
            continue
        key = _text(raw.get("key"), MAX_TAINT_KEY_CHARS) or ""
        value = _text(raw.get("value"), MAX_TAINT_VALUE_CHARS) or ""
        effect = _text(raw.get("effect"), 32) or UNREADABLE_EFFECT
        taints.append(NodeTaint(key, value, effect))
    if len(raw_taints) > MAX_TAINTS:  # what the unread ones say is unknown: one that blocks
        taints.append(NodeTaint("", "", UNREADABLE_EFFECT))
    metadata = obj.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    state = labels.get(DRIVER_UPGRADE_STATE_LABEL) if isinstance(labels, Mapping) else None
    upgrade = None if state is None else (_text(state, MAX_LABEL_VALUE_CHARS) or "?")
    return NodeScheduling(
        unschedulable=spec.get("unschedulable") is True,
        taints=tuple(taints),
        driver_upgrade_state=upgrade,
    )


class NodeWatcher(KubeWatchSource[NodeScheduling, NodeScheduling, NodeSchedulingSnapshot]):
    """The Node named like this node; ``read()`` hands over its ``NodeSchedulingSnapshot``
    (``node`` None while the API has no Node of that name)."""

    name: ClassVar[SourceName] = "node"

    path: ClassVar[str] = "/api/v1/nodes"
    resource: ClassVar[str] = "nodes"
    singular: ClassVar[str] = "Node"
    thread_name: ClassVar[str] = "node-watcher"
    description: ClassVar[str] = "Node scheduling state"
    max_objects: ClassVar[int] = 1  # one name, one Node
    max_list_bytes: ClassVar[int] = MAX_NODE_BYTES
    max_line_bytes: ClassVar[int] = MAX_NODE_BYTES
    node_field: ClassVar[str] = "metadata.name"

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.node_scheduling = self.read(cycle)

    def _convert(self, obj: Mapping[str, Any]) -> NodeScheduling | None:
        return node_scheduling(obj)

    def _items(self, values: Iterable[NodeScheduling]) -> tuple[NodeScheduling, ...]:
        return tuple(values)

    def _snapshot(
        self,
        ok: bool,
        timestamp: float,
        error: str | None,
        items: tuple[NodeScheduling, ...],
        counts: WatchCounts,
    ) -> NodeSchedulingSnapshot:
        node = items[0] if items else None
        return NodeSchedulingSnapshot(
            ok=ok, timestamp=timestamp, error=error, node=node, counts=counts
        )

    def _explain(self, exc: BaseException) -> str:
        if http_status(exc) == 403:
            return one_line(f"{FORBIDDEN_HINT}; {describe_error(exc)}")
        return describe_error(exc)
