"""A small stand-in for the Kubernetes API server's list/watch endpoints.

The exporter's API sources are the real ``kubernetes`` client; faking the HTTP server
rather than the client keeps its whole code path (config loading, urllib3, chunked
watch streams, 410 handling) under test. Only what ``PodWatcher``,
``ResourceSliceWatcher``, ``NodeWatcher`` and ``DeviceTaintRuleWatcher`` use is served:
``GET /api/v1/pods``, ``GET /apis/resource.k8s.io/v1/resourceslices``,
``GET /api/v1/nodes`` and ``GET /apis/resource.k8s.io/<version>/devicetaintrules``, each
as a list or a watch, with ``fieldSelector`` (the Nodes and DeviceTaintRules are
``writes``'s, see there: ``writes.set_device_taint_rule``, ``delete_device_taint_rule``). Like
the real server, one resourceVersion counter (etcd's revision) spans the collections,
and compaction (``expire_history``) expires watches of all of them.

Mutators (``set_pod``, ``delete_pod``, ``set_resource_slice``, ``delete_resource_slice``,
``expire_history``, ``disconnect_watchers``, ``send_raw``, ``send_huge_line``,
``set_error``, ``set_resource_slices_served``, ``set_watch_garbage``,
``set_watch_bookmark_then_gone``, ``set_field_selector_ignored``) are thread-safe and
may be called from any thread, so a test can drive the fake while its event loop runs in
a background thread (``start_in_thread``) — needed because the watchers under test do
blocking HTTP.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import functools
import json
import os
import threading
import time
import uuid as uuidlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from email.utils import formatdate
from pathlib import Path
from typing import Any, Literal

import yaml
from aiohttp import web

from exporter.sim.kube_access import mount_access_review
from exporter.sim.kube_core_events import mount_core_events
from exporter.sim.kube_discovery import mount_discovery
from exporter.sim.kube_selectors import SelectorError, parse_field_selector
from exporter.sim.kube_writes import KubeWrites

# Real API servers close a watch after 30-60 min unless the client asks for less.
DEFAULT_WATCH_TIMEOUT_S = 1800.0
# Like etcd compaction: older events are forgotten and watches from before them get 410.
DEFAULT_MAX_HISTORY = 1000
# The API group/version of the controllers a scenario's pod may name as its owner.
_OWNER_API_VERSIONS = {
    "ReplicaSet": "apps/v1",
    "StatefulSet": "apps/v1",
    "DaemonSet": "apps/v1",
    "Job": "batch/v1",
}

_FieldPath = tuple[str, ...]
_POD_FIELDS: dict[str, _FieldPath] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "metadata.uid": ("metadata", "uid"),
    "spec.nodeName": ("spec", "nodeName"),
    "status.phase": ("status", "phase"),
}
# What the real server lets ResourceSlices be selected by (cluster-scoped objects)
_RESOURCE_SLICE_FIELDS: dict[str, _FieldPath] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "spec.nodeName": ("spec", "nodeName"),
    "spec.driver": ("spec", "driver"),
}

_Selector = tuple[tuple[_FieldPath, str, bool], ...]  # (field path, value, equal)
_QueueItem = tuple[
    Literal["event", "gone", "drop", "raw", "huge"], dict[str, Any] | bytes | int | None
]
# The pieces send_huge_line writes a long line in: the same bytes object each time, so
# a 300 MiB line costs the fake one block, not 300 MiB.
HUGE_LINE_BLOCK = 1024 * 1024

Resource = Literal["pods", "resourceslices", "nodes", "devicetaintrules"]


@dataclass(frozen=True, slots=True)
class _Collection:
    """How one served collection is addressed, keyed, selected and listed."""

    resource: Resource
    path: str
    key: _FieldPath  # the object's identity in the store
    fields: Mapping[str, _FieldPath]  # what fieldSelector may name
    list_kind: str
    api_version: str


PODS = _Collection("pods", "/api/v1/pods", ("metadata", "uid"), _POD_FIELDS, "PodList", "v1")
# What the real server lets Nodes be selected by (pkg/registry/core/node: NodeToSelectableFields)
_NODE_FIELDS: dict[str, _FieldPath] = {
    "metadata.name": ("metadata", "name"),
    "spec.unschedulable": ("spec", "unschedulable"),
}
NODES = _Collection("nodes", "/api/v1/nodes", ("metadata", "name"), _NODE_FIELDS, "NodeList", "v1")
RESOURCE_SLICES = _Collection(
    "resourceslices",
    "/apis/resource.k8s.io/v1/resourceslices",
    ("metadata", "name"),
    _RESOURCE_SLICE_FIELDS,
    "ResourceSliceList",
    "resource.k8s.io/v1",
)

# DeviceTaintRules (cluster-scoped): kept by ``writes`` (kube_writes.py), mirrored here to
# be listed and watched; the path is versioned (``writes`` routes it, and hands LISTs
# without labelSelector and watches to ``_serve_taint_rules``), so none is routed here.
DEVICE_TAINT_RULES = _Collection(
    "devicetaintrules",
    "/apis/resource.k8s.io/{version}/devicetaintrules",
    ("metadata", "name"),
    {"metadata.name": ("metadata", "name")},
    "DeviceTaintRuleList",
    "resource.k8s.io/v1alpha3",
)


@dataclass(slots=True)
class LoggedRequest:
    """One request the fake answered.

    A watch is logged when it opens and updated when it ends: ``outcome`` goes from
    ``"open"`` to ``"timeout"``, ``"expired"`` (``status`` becomes 410, as the in-stream
    ERROR event says), ``"dropped"`` (``disconnect_watchers``) or ``"closed"`` (the
    client went away). A list is ``"done"``. ``at`` is when it came and ``ended_at``
    when a watch ended (``time.monotonic()``), for request rates and gaps.
    """

    method: str
    path: str
    params: dict[str, str]
    watch: bool
    status: int
    outcome: str = "done"
    at: float = field(default_factory=time.monotonic)
    ended_at: float | None = None


@dataclass(eq=False, slots=True)
class _Watcher:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[_QueueItem]
    resource: Resource
    selector: _Selector
    events: list[dict[str, Any]] = field(default_factory=list)


def _field(obj: Mapping[str, Any], path: _FieldPath) -> Any:
    value: Any = obj
    for part in path:
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def _matches(obj: Mapping[str, Any], selector: _Selector) -> bool:
    return all(((_field(obj, path) or "") == value) == equal for path, value, equal in selector)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    """A ``metav1.Status`` body, as the API server sends for errors."""
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _rfc3339(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _container_status(name: str, container_id: str) -> dict[str, Any]:
    status: dict[str, Any] = {
        "name": name,
        "image": f"registry.example/{name}:latest",
        "imageID": "",
        "ready": bool(container_id),
        "restartCount": 0,
        "started": bool(container_id),
        "state": {"running": {}} if container_id else {"waiting": {"reason": "ContainerCreating"}},
    }
    if container_id:
        bare = container_id if "://" in container_id else f"containerd://{container_id}"
        status["containerID"] = bare
    return status


def pod_dict(
    namespace: str,
    name: str,
    uid: str,
    node: str,
    phase: str = "Running",
    containers: Sequence[tuple[str, str]] = (),
    deletion_timestamp: float | None = None,
    *,
    init_containers: Sequence[tuple[str, str]] = (),
    ephemeral_containers: Sequence[tuple[str, str]] = (),
    limits: Mapping[str, Mapping[str, str]] | None = None,
    owner: tuple[str, str] | None = None,
    labels: Mapping[str, str] | None = None,
    annotations: Mapping[str, str] | None = None,
    resource_claims: Sequence[str] = (),
    deletion_grace_s: float | None = None,
) -> dict[str, Any]:
    """Build a pod as the API server serialises it.

    ``containers`` are ``(name, id)``; an id without a ``scheme://`` is given
    ``containerd://``, and an empty id leaves ``containerID`` out (not started yet).
    ``limits``: container name -> its ``resources.limits`` (e.g. HAMi's resources).
    ``owner``: (kind, name) of the controller, written as the one ownerReferences entry
    with ``controller: true``, as a workload controller writes it.
    """
    metadata: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid}
    if labels:
        metadata["labels"] = dict(labels)
    if annotations:
        metadata["annotations"] = dict(annotations)
    if owner is not None:
        metadata["ownerReferences"] = [_controller_ref(namespace, *owner)]
    if deletion_timestamp is not None:
        metadata["deletionTimestamp"] = _rfc3339(deletion_timestamp)
        # the API server writes both together (30: the default terminationGracePeriodSeconds)
        metadata["deletionGracePeriodSeconds"] = int(
            30 if deletion_grace_s is None else deletion_grace_s
        )
    spec: dict[str, Any] = {
        "nodeName": node,
        "containers": [{"name": n, "image": f"registry.example/{n}:latest"} for n, _ in containers],
    }
    if resource_claims:  # DRA: each names a ResourceClaim of the pod's namespace
        spec["resourceClaims"] = [{"name": c, "resourceClaimName": c} for c in resource_claims]
    for container in spec["containers"]:
        if limits and limits.get(container["name"]):
            container["resources"] = {"limits": dict(limits[container["name"]])}
    status: dict[str, Any] = {
        "phase": phase,
        "containerStatuses": [_container_status(n, cid) for n, cid in containers],
    }
    if init_containers:
        spec["initContainers"] = [
            {"name": n, "image": f"registry.example/{n}:latest"} for n, _ in init_containers
        ]
        status["initContainerStatuses"] = [_container_status(n, c) for n, c in init_containers]
    if ephemeral_containers:
        spec["ephemeralContainers"] = [
            {"name": n, "image": f"registry.example/{n}:latest"} for n, _ in ephemeral_containers
        ]
        status["ephemeralContainerStatuses"] = [
            _container_status(n, c) for n, c in ephemeral_containers
        ]
    return {"metadata": metadata, "spec": spec, "status": status}


def _controller_ref(namespace: str, kind: str, name: str) -> dict[str, Any]:
    """An ownerReferences entry as metav1.NewControllerRef makes it (uid derived)."""
    group = _OWNER_API_VERSIONS.get(kind, "example.com/v1")
    uid = uuidlib.uuid5(uuidlib.NAMESPACE_URL, f"{namespace}/{kind}/{name}")
    return {
        "apiVersion": group,
        "kind": kind,
        "name": name,
        "uid": str(uid),
        "controller": True,
        "blockOwnerDeletion": True,
    }


def slice_device_dict(
    name: str,
    attributes: Mapping[str, str | int | bool] | None = None,
    *,
    versions: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """One ``Device`` of a resource.k8s.io/v1 ResourceSlice.

    ``attributes`` become the DeviceAttribute union member their type says (``int``,
    ``bool``, ``string``); ``versions`` are semantic versions (``{"version": ...}``).
    Names may be qualified (``resource.kubernetes.io/pcieRoot``) or not (the driver's).
    """
    union: dict[str, dict[str, Any]] = {}
    for key, value in (attributes or {}).items():
        kind = "bool" if isinstance(value, bool) else "int" if isinstance(value, int) else "string"
        union[key] = {kind: value}
    for key, version in (versions or {}).items():
        union[key] = {"version": version}
    return {"name": name, "attributes": union}


def resource_slice_dict(
    name: str,
    node: str,
    devices: Sequence[Mapping[str, Any]],
    *,
    driver: str = "gpu.nvidia.com",
    pool: str | None = None,
    generation: int = 1,
    resource_slice_count: int = 1,
) -> dict[str, Any]:
    """Build a ResourceSlice as the API server serialises it (resource.k8s.io/v1).

    ``pool`` defaults to the node name, as NVIDIA's driver names its per-node pool.
    """
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": driver,
            "nodeName": node,
            "pool": {
                "name": pool if pool is not None else node,
                "generation": generation,
                "resourceSliceCount": resource_slice_count,
            },
            "devices": [copy.deepcopy(dict(d)) for d in devices],
        },
    }


def write_kubeconfig(path: str | os.PathLike[str], server_url: str) -> Path:
    """Write a kubeconfig for a plain-http, unauthenticated server (the fake)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "fake", "cluster": {"server": server_url}}],
        "users": [{"name": "fake", "user": {}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        "current-context": "fake",
    }
    out = Path(path)
    out.write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    return out


class FakeKubeApi:
    """Pods and ResourceSlices in memory, served over HTTP with list + watch semantics of
    the API server.

    ``resourceVersion`` is one counter for all objects. History is kept so that a watch
    from an older version replays what it missed; ``expire_history`` forgets it, which
    is how a test provokes 410 Gone. ``set_resource_slices_served(False)`` makes it an
    API server without resource.k8s.io/v1 (before Kubernetes 1.34, or DRA disabled).
    """

    def __init__(self, *, max_history: int = DEFAULT_MAX_HISTORY) -> None:
        self._lock = threading.Lock()
        self._objects: dict[Resource, dict[str, dict[str, Any]]] = {
            "pods": {},
            "resourceslices": {},
            "nodes": {},
            "devicetaintrules": {},
        }
        self._rv = 1
        self._min_rv = 0  # a watch from below this has missed forgotten events: 410
        self._history: list[tuple[int, Resource, dict[str, Any]]] = []  # (rv, what, event)
        self._max_history = max_history
        self._watchers: set[_Watcher] = set()
        self._requests: list[LoggedRequest] = []
        # resource (None: every request) -> (code, reason, message, Retry-After or None)
        self._errors: dict[Resource | None, tuple[int, str, str, int | None]] = {}
        self._error_times: dict[Resource | None, int | None] = {}  # answers left (None: all)
        self._selector_ignored = False
        self._slices_served = True
        self._garbage: tuple[bytes, ...] = ()  # written over and over into each new watch
        self._bookmark_then_gone = False
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        # Events, Node status and DeviceTaintRules (kube_writes.py)
        # Its Nodes are the ones listed and watched here: every change to one (set_node,
        # a status patch) is published to the watches of /api/v1/nodes.
        self.writes: KubeWrites = KubeWrites(
            resource_slices_served=lambda: self._slices_served,
            on_node=lambda node: self._set(NODES, node),
            on_taint_rule=self._mirror_taint_rule,
            serve_taint_rules=self._serve_taint_rules,
        )
        # The server's clock for its Date header (None: aiohttp's, the real time), and a
        # Date value served instead of it (a broken or hostile server: garbage, far off),
        # or none at all (``date_absent``: a proxy that strips it).
        self.server_time: Callable[[], float] | None = None
        self.date_override: str | None = None
        self.date_absent = False

    # -- state, thread-safe ------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    @property
    def requests(self) -> list[LoggedRequest]:
        """A copy of the request log, oldest first."""
        with self._lock:
            return [replace(r, params=dict(r.params)) for r in self._requests]

    @property
    def watcher_count(self) -> int:
        """Watch streams open now."""
        with self._lock:
            return len(self._watchers)

    def pods(self) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(p) for p in self._objects["pods"].values()]

    def resource_slices(self) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(s) for s in self._objects["resourceslices"].values()]

    def set_pod(self, pod: Mapping[str, Any]) -> str:
        """Add or replace a pod (by ``metadata.uid``); returns its new resourceVersion."""
        return self._set(PODS, pod)

    def delete_pod(self, uid: str) -> bool:
        """Remove a pod; False if there was none with that UID."""
        return self._delete(PODS, uid)

    def set_resource_slice(self, obj: Mapping[str, Any]) -> str:
        """Add or replace a ResourceSlice (by ``metadata.name``; see
        ``resource_slice_dict``); returns its new resourceVersion."""
        return self._set(RESOURCE_SLICES, obj)

    def delete_resource_slice(self, name: str) -> bool:
        """Remove a ResourceSlice; False if there was none with that name."""
        return self._delete(RESOURCE_SLICES, name)

    def _mirror_taint_rule(self, name: str, rule: dict[str, Any] | None) -> None:
        """``writes``'s DeviceTaintRule ``name`` as it stands now (None: deleted)."""
        if rule is None:
            self._delete(DEVICE_TAINT_RULES, name)
        else:
            self._set(DEVICE_TAINT_RULES, rule)

    async def _serve_taint_rules(self, request: web.Request, version: str) -> web.StreamResponse:
        """A LIST or watch of ``writes``'s DeviceTaintRules at ``version``."""
        what = replace(DEVICE_TAINT_RULES, api_version=f"resource.k8s.io/{version}")
        return await self._handle(what, request)

    def _set(self, what: _Collection, obj_in: Mapping[str, Any]) -> str:
        obj = copy.deepcopy(dict(obj_in))
        key = _field(obj, what.key)
        if not isinstance(key, str) or not key:
            raise ValueError(f"a {what.resource} object needs {'.'.join(what.key)}")
        store = self._objects[what.resource]
        with self._lock:
            kind = "MODIFIED" if key in store else "ADDED"
            self._rv += 1
            obj["metadata"]["resourceVersion"] = str(self._rv)
            store[key] = obj
            self._publish_locked(what.resource, kind, obj)
            return str(self._rv)

    def _delete(self, what: _Collection, key: str) -> bool:
        with self._lock:
            obj = self._objects[what.resource].pop(key, None)
            if obj is None:
                return False
            self._rv += 1
            obj["metadata"]["resourceVersion"] = str(self._rv)
            self._publish_locked(what.resource, "DELETED", obj)
            return True

    def expire_history(self) -> None:
        """Forget all history: every open watch gets an in-stream 410 and ends, and a
        watch from any resourceVersion handed out so far is answered 410 Gone."""
        with self._lock:
            self._rv += 1  # a compaction revision, so a fresh list is watchable again
            self._min_rv = self._rv
            self._history.clear()
            for w in self._watchers:
                w.loop.call_soon_threadsafe(w.queue.put_nowait, ("gone", None))

    def disconnect_watchers(self) -> int:
        """Abort every open watch connection mid-stream (no final chunk); returns how
        many were open."""
        with self._lock:
            for w in self._watchers:
                w.loop.call_soon_threadsafe(w.queue.put_nowait, ("drop", None))
            return len(self._watchers)

    def send_raw(self, line: bytes) -> int:
        """Write ``line`` and a newline into every open watch stream as it is: a
        malformed event, as a broken server or proxy might send; returns how many were
        open."""
        with self._lock:
            for w in self._watchers:
                w.loop.call_soon_threadsafe(w.queue.put_nowait, ("raw", line))
            return len(self._watchers)

    def send_huge_line(self, size: int, *, resource: Resource | None = None) -> int:
        """Write one line of ``size`` bytes (then a newline) into every open watch
        stream (of ``resource`` only, if given): a syntactically valid ADDED event whose
        object carries one huge annotation, written in ``HUGE_LINE_BLOCK`` pieces (never
        materialised); returns how many streams it went to. Writing stops when the
        client goes away."""
        with self._lock:
            chosen = [w for w in self._watchers if resource in (None, w.resource)]
            for w in chosen:
                w.loop.call_soon_threadsafe(w.queue.put_nowait, ("huge", size))
            return len(chosen)

    def set_watch_garbage(self, lines: Sequence[bytes]) -> None:
        """Every watch opened from now on is answered with ``lines`` (each followed by a
        newline) written over and over for as long as it stays open, instead of events:
        a broken server or proxy. An empty sequence ends this for new watches."""
        with self._lock:
            self._garbage = tuple(lines)

    def set_watch_bookmark_then_gone(self, on: bool) -> None:
        """True: every watch opened from now on gets a BOOKMARK event at the current
        resourceVersion and then an in-stream 410 Gone (too old resource version), and
        ends; the loop a cluster whose history is compacted faster than it is watched
        shows. False ends this for new watches."""
        with self._lock:
            self._bookmark_then_gone = on

    def set_error(
        self,
        code: int | None,
        message: str = "",
        *,
        resource: Resource | None = None,
        retry_after: int | None = None,
        times: int | None = None,
    ) -> None:
        """Answer every request (or, with ``resource``, those for ``"pods"`` or
        ``"resourceslices"``) with this HTTP error (e.g. 403, 500) until cleared with
        ``set_error(None)`` (for the same ``resource``), or for the next ``times``
        requests only. ``retry_after`` adds a ``Retry-After`` header (seconds), as an
        API server under load answers 429 (API Priority and Fairness)."""
        with self._lock:
            if code is None:
                self._errors.pop(resource, None)
                self._error_times.pop(resource, None)
            else:
                reason = {401: "Unauthorized", 403: "Forbidden", 429: "TooManyRequests"}.get(
                    code, "InternalError"
                )
                text = message or f"fake API server error {code}"
                self._errors[resource] = (code, reason, text, retry_after)
                self._error_times[resource] = times

    def set_field_selector_ignored(self, ignored: bool) -> None:
        """True: list and watch every object of a collection whatever ``fieldSelector``
        asks (still validated), as a broken server or proxy might; False (the default)
        selects again."""
        with self._lock:
            self._selector_ignored = ignored

    def _take_error_locked(self, what: Resource) -> tuple[int, str, str, int | None] | None:
        """The error to answer a request for ``what`` with, if any (one use spent)."""
        for key in (what, None):
            error = self._errors.get(key)
            if error is None:
                continue
            left = self._error_times.get(key)
            if left is not None:
                if left <= 1:
                    self._errors.pop(key, None)
                    self._error_times.pop(key, None)
                else:
                    self._error_times[key] = left - 1
            return error
        return None

    def set_resource_slices_served(self, served: bool) -> None:
        """False: answer resource.k8s.io/v1 with 404, as an API server before Kubernetes
        1.34 (or with DRA disabled) does; True (the default) serves it again."""
        with self._lock:
            self._slices_served = served

    def _publish_locked(self, what: Resource, kind: str, obj: dict[str, Any]) -> None:
        event = {"type": kind, "object": copy.deepcopy(obj)}
        self._history.append((self._rv, what, event))
        if len(self._history) > self._max_history:
            dropped_rv, _, _ = self._history.pop(0)
            self._min_rv = max(self._min_rv, dropped_rv)
        for w in self._watchers:
            if w.resource == what and _matches(obj, w.selector):
                w.loop.call_soon_threadsafe(w.queue.put_nowait, ("event", event))

    def _log(
        self, request: web.Request, watch: bool, status: int, outcome: str = "done"
    ) -> LoggedRequest:
        record = LoggedRequest(
            request.method, request.path, dict(request.query), watch, status, outcome
        )
        with self._lock:
            self._requests.append(record)
        return record

    def _finish(self, record: LoggedRequest, outcome: str, status: int | None = None) -> None:
        with self._lock:
            record.outcome = outcome
            record.ended_at = time.monotonic()
            if status is not None:
                record.status = status

    # -- HTTP --------------------------------------------------------------------------

    async def _stamp_date(self, request: web.Request, response: web.StreamResponse) -> None:
        """Every answer's ``Date`` (RFC 9110 5.6.7) on the server's own clock, which
        need not be the node's (a node clock ahead of the API server's). aiohttp has
        stamped its own by now (``_prepare_headers`` runs before this hook): ``date_absent``
        takes it off."""
        if self.date_absent:
            response.headers.popall("Date", None)
        elif self.date_override is not None:
            response.headers["Date"] = self.date_override
        elif self.server_time is not None:
            response.headers["Date"] = formatdate(self.server_time(), usegmt=True)

    def app(self) -> web.Application:
        app = web.Application()
        app.on_response_prepare.append(self._stamp_date)
        for what in (PODS, RESOURCE_SLICES, NODES):
            app.router.add_get(what.path, functools.partial(self._handle, what))
        app.router.add_get("/api/v1/namespaces/{namespace}/pods/{name}", self._get_pod)
        self.writes.mount(app)
        mount_access_review(app, self.writes.forbids, self._reads_forbidden)
        # What a real client (kubectl) reads besides: discovery and core/v1 Events
        groups = self.writes.resource_group
        mount_discovery(app, lambda: [g] if (g := groups()) is not None else [])
        mount_core_events(
            app,
            lambda namespace: self.writes.events(namespace=namespace),
            lambda: str(self.writes.resource_version),
            # a Table's ages count on the server's clock, as its Date header does
            lambda: self.server_time() if self.server_time is not None else time.time(),
        )
        return app

    def _reads_forbidden(self, resource: str) -> bool:
        """Whether reads of ``resource`` are answered 403 now (``set_error``)."""
        with self._lock:
            error = self._errors.get(resource) or self._errors.get(None)  # type: ignore[call-overload, unused-ignore]
        return error is not None and error[0] == 403

    async def _get_pod(self, request: web.Request) -> web.Response:
        """One pod by namespace and name (``kubectl describe pod``), with the ``kind``
        and ``apiVersion`` a single GET carries."""
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        with self._lock:
            error = self._take_error_locked("pods")
            found = [
                copy.deepcopy(p)
                for p in self._objects["pods"].values()
                if p["metadata"].get("namespace") == namespace and p["metadata"]["name"] == name
            ]
        if error is not None:
            code, reason, message, _ = error
            self._log(request, False, code)
            return web.json_response(_status(code, reason, message), status=code)
        if not found:
            self._log(request, False, 404)
            message = f'pods "{name}" not found'
            details = {"name": name, "kind": "pods"}
            return web.json_response(
                {**_status(404, "NotFound", message), "details": details}, status=404
            )
        self._log(request, False, 200)
        return web.json_response({"kind": "Pod", "apiVersion": "v1", **found[0]})

    async def _handle(self, what: _Collection, request: web.Request) -> web.StreamResponse:
        watch = request.query.get("watch", "").lower() in ("true", "1")
        with self._lock:
            error = self._take_error_locked(what.resource)
            if what is RESOURCE_SLICES and not self._slices_served:
                # What kube-apiserver answers for a group/version it does not serve
                error = (404, "NotFound", "the server could not find the requested resource", None)
            ignore_selector = self._selector_ignored
        if error is not None:
            code, reason, message, retry_after = error
            self._log(request, watch, code)
            headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
            return web.json_response(_status(code, reason, message), status=code, headers=headers)
        try:
            selector = parse_field_selector(request.query.get("fieldSelector", ""), what.fields)
        except SelectorError as exc:
            self._log(request, watch, 400)
            return web.json_response(_status(400, "BadRequest", str(exc)), status=400)
        if ignore_selector:
            selector = ()
        if watch:
            return await self._watch(request, what.resource, selector)
        with self._lock:
            store = self._objects[what.resource]
            items = [copy.deepcopy(o) for o in store.values() if _matches(o, selector)]
            rv = self._rv
        items.sort(key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]))
        self._log(request, False, 200)
        body = {
            "kind": what.list_kind,
            "apiVersion": what.api_version,
            "metadata": {"resourceVersion": str(rv)},
            "items": items,
        }
        return web.json_response(body)

    async def _watch(
        self, request: web.Request, what: Resource, selector: _Selector
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        try:
            since = int(request.query.get("resourceVersion") or 0)
            timeout = float(request.query.get("timeoutSeconds") or DEFAULT_WATCH_TIMEOUT_S)
        except ValueError:
            self._log(request, True, 400)
            msg = "resourceVersion and timeoutSeconds must be integers"
            return web.json_response(_status(400, "BadRequest", msg), status=400)

        watcher = _Watcher(loop, asyncio.Queue(), what, selector)
        with self._lock:
            gone = since < self._min_rv if since else False
            if not gone:
                if since:
                    backlog = [e for rv, w, e in self._history if rv > since and w == what]
                else:  # no version: like the real server, start with the current state
                    backlog = [
                        {"type": "ADDED", "object": copy.deepcopy(o)}
                        for o in self._objects[what].values()
                    ]
                watcher.events = [e for e in backlog if _matches(e["object"], selector)]
                self._watchers.add(watcher)
            min_rv = self._min_rv
            garbage, gone_after_bookmark, rv_now = self._garbage, self._bookmark_then_gone, self._rv
        record = self._log(request, True, 410 if gone else 200, "expired" if gone else "open")

        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        if gone:
            await self._write_gone(resp, since, min_rv)
            await resp.write_eof()
            return resp
        outcome = "closed"  # unless the loop below says otherwise: the client left
        try:
            if garbage:
                await self._write_garbage(resp, garbage)
                return resp
            if gone_after_bookmark:
                bookmark = {
                    "type": "BOOKMARK",
                    "object": {"metadata": {"resourceVersion": str(rv_now)}},
                }
                await resp.write(json.dumps(bookmark).encode() + b"\n")
                await self._write_gone(resp, since, rv_now)
                outcome = "expired"
                self._finish(record, outcome, 410)
                await resp.write_eof()
                return resp
            for backlog_event in watcher.events:
                await resp.write(json.dumps(backlog_event).encode() + b"\n")
            deadline = loop.time() + timeout
            while (remaining := deadline - loop.time()) > 0:
                try:
                    kind, event = await asyncio.wait_for(watcher.queue.get(), remaining)
                except TimeoutError:
                    break
                if kind == "event":
                    await resp.write(json.dumps(event).encode() + b"\n")
                elif kind == "raw":
                    assert isinstance(event, bytes)
                    await resp.write(event + b"\n")
                elif kind == "huge":
                    assert isinstance(event, int)
                    await self._write_huge(resp, event)
                elif kind == "gone":
                    await self._write_gone(resp, since, self._min_rv)
                    outcome = "expired"
                    self._finish(record, outcome, 410)
                    break
                else:  # drop: close the socket without the terminating chunk
                    outcome = "dropped"
                    if request.transport is not None:
                        request.transport.abort()
                    return resp
            if outcome == "closed":  # left the loop normally: the window ran out
                outcome = "timeout"
        finally:
            with self._lock:
                self._watchers.discard(watcher)
            self._finish(record, outcome)
        await resp.write_eof()
        return resp

    @staticmethod
    async def _write_garbage(resp: web.StreamResponse, lines: tuple[bytes, ...]) -> None:
        """``lines`` over and over until the client goes away (the handler is then
        cancelled, or a write fails)."""
        payload = b"".join(line + b"\n" for line in lines)
        with contextlib.suppress(ConnectionError):
            while True:
                await resp.write(payload)

    @staticmethod
    async def _write_huge(resp: web.StreamResponse, size: int) -> None:
        head = b'{"type": "ADDED", "object": {"metadata": {"name": "huge", "uid": "huge", '
        head += b'"annotations": {"filler": "'
        tail = b'"}}, "spec": {"nodeName": ""}}}\n'
        block = b"x" * HUGE_LINE_BLOCK
        with contextlib.suppress(ConnectionError):  # the client dropped it: as it should
            await resp.write(head)
            left = max(0, size - len(head) - len(tail))
            while left > 0:
                await resp.write(block if left >= len(block) else block[:left])
                left -= len(block)
            await resp.write(tail)

    @staticmethod
    async def _write_gone(resp: web.StreamResponse, since: int, min_rv: int) -> None:
        """The real server reports an expired watch as an ERROR event in a 200 stream."""
        message = f"too old resource version: {since} ({min_rv})"
        event = {"type": "ERROR", "object": _status(410, "Expired", message)}
        await resp.write(json.dumps(event).encode() + b"\n")

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: any free port) in the running loop; returns the URL."""
        if self._runner is not None:
            raise RuntimeError("FakeKubeApi is already started")
        # handler_cancellation: a watch handler idles on its queue and would not notice
        # the client leaving until its timeout; real API servers release it at once.
        runner = web.AppRunner(
            self.app(), shutdown_timeout=1.0, access_log=None, handler_cancellation=True
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        bound_port = runner.addresses[0][1]
        return f"http://[{host}]:{bound_port}" if ":" in host else f"http://{host}:{bound_port}"

    async def stop(self) -> None:
        """Close open watches, then the listener; the pods are kept for a restart."""
        runner, self._runner = self._runner, None
        if runner is None:
            return
        self.disconnect_watchers()
        await asyncio.sleep(0)  # let the watch handlers see the drop
        await runner.cleanup()

    def start_in_thread(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Run the server on its own event loop in a daemon thread; returns the URL.

        For callers that block (tests driving a blocking client from the main thread).
        """
        if self._thread is not None:
            raise RuntimeError("FakeKubeApi is already running in a thread")
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="fake-kube-api", daemon=True)
        thread.start()
        try:
            url = asyncio.run_coroutine_threadsafe(self.start(host, port), loop).result(10)
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
            loop.close()
            raise
        self._thread, self._thread_loop = thread, loop
        return url

    def stop_in_thread(self) -> None:
        """Undo ``start_in_thread``; safe to call when not running."""
        thread, loop = self._thread, self._thread_loop
        if thread is None or loop is None:
            return
        self._thread = self._thread_loop = None
        try:
            asyncio.run_coroutine_threadsafe(self.stop(), loop).result(10)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5)
            loop.close()
