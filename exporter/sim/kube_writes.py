"""The API stand-in's write side: Events, a Node's status, DRA DeviceTaintRules.

``FakeKubeApi`` (kube_api.py) serves what the exporter watches; this module serves what
the exporter *writes*, mounted on the same aiohttp application (``FakeKubeApi.writes``),
so the exporter's write client (exporter/reporting/kube_client.py) runs its whole real
code path (kubeconfig, urllib3, content types, Status bodies) against it. What is served,
and the rules of the real kube-apiserver it keeps (Kubernetes 1.35 sources):

- ``events.k8s.io/v1`` Events: create (POST), PATCH (merge and strategic merge), GET one,
  LIST per namespace and cluster-wide with ``fieldSelector``. A create or a patch is
  validated as ``ValidateEventCreate``/``ValidateEventUpdate`` do
  (kubernetes pkg/apis/core/validation/events.go,
  https://github.com/kubernetes/kubernetes/blob/master/pkg/apis/core/validation/events.go);
  the rules are in kube_rules.py. The field labels a LIST may select by are those of
  ``AddFieldLabelConversionsForEvent`` (pkg/apis/events/v1/conversion.go).
- Nodes: GET one, and PATCH of ``/status``; a strategic merge patch merges
  ``status.conditions`` by ``type``, their ``patchMergeKey``
  (k8s.io/api core/v1/types.go, ``NodeStatus.Conditions``:
  ``patchStrategy:"merge" patchMergeKey:"type"``); a JSON merge patch (RFC 7386)
  replaces the list whole, as the real server does.
- DRA ``DeviceTaintRule`` (resource.k8s.io, KEP-5055): discovery of the group and its
  versions, create, LIST with ``labelSelector``, GET and DELETE. Every change is handed
  to ``on_taint_rule`` (kube_api mirrors the rules into a collection), and a LIST
  without ``labelSelector`` or a watch is answered by ``serve_taint_rules`` (kube_api's
  list + watch, with its resourceVersions and watch history). Kubernetes 1.33, 1.34
  and 1.35 define it in ``v1alpha3`` only (k8s.io/api tags v0.33.0, v0.34.0, v0.35.0:
  resource/v1alpha3/types.go; ``v1beta2`` and ``v1`` came after 1.35, ``introduced=1.36``),
  so ``DEFAULT_DEVICE_TAINT_VERSIONS`` is ``("v1alpha3",)`` (a real 1.35 cluster serves
  it only with ``--runtime-config=resource.k8s.io/v1alpha3=true`` and the
  ``DRADeviceTaints`` feature gate); ``set_device_taint_versions`` changes it.

- ``coordination.k8s.io/v1`` Leases (the exporter's per-node writer lease): GET one,
  create (POST), update (PUT). An update must carry ``metadata.resourceVersion`` and is
  refused with 409 Conflict when it is not the stored one (the Lease strategy has
  ``AllowUnconditionalUpdate`` false and ``AllowCreateOnUpdate`` true: kubernetes
  pkg/registry/coordination/lease/strategy.go); a PUT of a Lease that does not exist
  creates it. ``leaseDurationSeconds`` must be > 0 and ``leaseTransitions`` >= 0
  (pkg/apis/coordination/validation/validation.go). Lease requests go to their own log
  (``lease_log``) and faults (``set_lease_fault``: 403, 500, 409, garbage, an answer
  without its resourceVersion, no answer), so the Event and write counts of
  the other tests stay what they were.

Every write (POST, PATCH, DELETE) is recorded (``write_log``), and
``set_write_fault`` makes the writes (and the node GET) answer 403 or 500, answer
late, or not at all. Like kube_api's mutators, every public method here is thread-safe:
a test drives the store from its own thread while the server's loop runs in another.
"""

from __future__ import annotations

import asyncio
import copy
import json
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

from aiohttp import web

from exporter.sim.kube_rules import (
    NODE_MERGE_KEYS,
    FieldPath,
    Refused,
    bad_request,
    device_taint_rule_errors,
    event_create_errors,
    event_update_errors,
    get_path,
    invalid_error,
    merge_patch,
    micro_time_error,
    not_found,
    now_rfc3339,
    str_at,
    strategic_merge_patch,
)
from exporter.sim.kube_selectors import SelectorError, parse_field_selector

FaultMode = Literal["forbidden", "hang", "slow", "error"]
LeaseFault = Literal["forbidden", "error", "conflict", "garbage", "no-version", "hang"]

# k8s.io/api resource/v1alpha3/types.go at v0.35.0 (line 195) is the only DeviceTaintRule
# of Kubernetes 1.33-1.35; resource/v1beta2 and resource/v1 define it from 1.36.
DEFAULT_DEVICE_TAINT_VERSIONS: tuple[str, ...] = ("v1alpha3",)
KNOWN_RESOURCE_VERSIONS = ("v1", "v1beta2", "v1beta1", "v1alpha3")  # newest first

EVENTS_PREFIX = "/apis/events.k8s.io/v1"
RESOURCE_PREFIX = "/apis/resource.k8s.io"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
# Who a "forbidden" fault says was refused (the exporter's service account, as the chart makes it).
FAULT_USER = "system:serviceaccount:gpu-exporter:gpu-occupancy-exporter"

# What an events.k8s.io/v1 LIST may select by (pkg/apis/events/v1/conversion.go,
# AddFieldLabelConversionsForEvent), as paths into the v1 object.
EVENT_FIELDS: dict[str, FieldPath] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "reason": ("reason",),
    "type": ("type",),
    "reportingController": ("reportingController",),
    "regarding.kind": ("regarding", "kind"),
    "regarding.namespace": ("regarding", "namespace"),
    "regarding.name": ("regarding", "name"),
    "regarding.uid": ("regarding", "uid"),
    "regarding.apiVersion": ("regarding", "apiVersion"),
    "regarding.resourceVersion": ("regarding", "resourceVersion"),
    "regarding.fieldPath": ("regarding", "fieldPath"),
    "source": ("deprecatedSource", "component"),
}


@dataclass(slots=True)
class WriteRecord:
    """One write request the stand-in received. ``body`` is the decoded
    JSON (the raw text when it was not JSON); ``status`` is None while unanswered (a
    request held by the ``"hang"`` fault)."""

    method: str
    path: str
    content_type: str
    body: Any
    status: int | None = None
    at: float = field(default_factory=time.monotonic)


def _matches(obj: Mapping[str, Any], selector: Sequence[tuple[FieldPath, str, bool]]) -> bool:
    return all(((get_path(obj, *path) or "") == value) == equal for path, value, equal in selector)


# -- objects ---------------------------------------------------------------------------


def node_dict(name: str, conditions: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """A Node as the API server serialises it, with the kubelet's usual conditions
    (Ready True, the pressures False) unless ``conditions`` are given."""
    now = now_rfc3339()
    if conditions is None:
        conditions = [
            {
                "type": kind,
                "status": status,
                "reason": reason,
                "message": "",
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }
            for kind, status, reason in (
                ("MemoryPressure", "False", "KubeletHasSufficientMemory"),
                ("DiskPressure", "False", "KubeletHasNoDiskPressure"),
                ("PIDPressure", "False", "KubeletHasSufficientPID"),
                ("Ready", "True", "KubeletReady"),
            )
        ]
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "uid": f"node-uid-{name}",
            "labels": {
                "kubernetes.io/hostname": name,
            },
        },
        "spec": {},
        "status": {
            "conditions": [copy.deepcopy(dict(c)) for c in conditions],
            "addresses": [{"type": "Hostname", "address": name}],
        },
    }


def _label_selector(text: str) -> list[tuple[str, str, bool]]:
    """Equality terms of a ``labelSelector`` (``a=b,c==d,e!=f``); set-based terms are
    refused with 400 here (the real server has them; nothing here needs them)."""
    terms: list[tuple[str, str, bool]] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            continue
        equal = "!=" not in term
        key, sep, value = term.partition("!=" if not equal else "==" if "==" in term else "=")
        if not sep or not key.strip():
            raise SelectorError(f"unable to parse requirement: {term!r}")
        terms.append((key.strip(), value.strip(), equal))
    return terms


def _labels_match(obj: Mapping[str, Any], terms: Sequence[tuple[str, str, bool]]) -> bool:
    labels = get_path(obj, "metadata", "labels")
    labels = labels if isinstance(labels, Mapping) else {}
    return all((labels.get(k) == v) == equal for k, v, equal in terms)


# -- the store and its handlers ---------------------------------------------------------


class KubeWrites:
    """Events, Nodes and DeviceTaintRules in memory, and the HTTP handlers that write
    and read them (``mount`` adds them to an aiohttp application).

    ``resource_slices_served`` tells discovery whether resource.k8s.io/v1 is served for
    ResourceSlices (kube_api's ``set_resource_slices_served``).
    """

    def __init__(
        self,
        *,
        resource_slices_served: Callable[[], bool] = lambda: True,
        on_node: Callable[[dict[str, Any]], object] | None = None,
        on_taint_rule: Callable[[str, dict[str, Any] | None], object] | None = None,
        serve_taint_rules: Callable[[web.Request, str], Awaitable[web.StreamResponse]]
        | None = None,
    ) -> None:
        self._lock = threading.Lock()
        # told of every Node as it stands after a change (kube_api publishes it to the
        # watches of /api/v1/nodes); called under this lock, so in the writes' order (it
        # takes kube_api's lock, which is never held while this one is asked for)
        self._on_node = on_node
        # told of every DeviceTaintRule as it stands after a change (None: deleted), under
        # this lock as on_node is: kube_api keeps them as a collection it lists and watches
        self._on_taint_rule = on_taint_rule
        # answers a LIST without labelSelector, and every watch, of devicetaintrules
        # (request, version): kube_api's list + watch of that collection, whose
        # resourceVersions a watch resumes from
        self._serve_taint_rules = serve_taint_rules
        self._events: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name)
        self._nodes: dict[str, dict[str, Any]] = {}
        self._taint_rules: dict[str, dict[str, Any]] = {}
        self._taint_versions = DEFAULT_DEVICE_TAINT_VERSIONS
        self._slices_served = resource_slices_served
        self._writes: list[WriteRecord] = []
        self._fault: FaultMode | None = None
        self._fault_only: str | None = None  # a part of the path the fault is limited to
        self._fault_delay_s = 0.0
        self._fault_times: int | None = None
        self._fault_generation = 0  # a hung request waits until this changes
        self._rv = 1
        self._leases: dict[tuple[str, str], dict[str, Any]] = {}  # (namespace, name)
        self._lease_log: list[WriteRecord] = []
        self._lease_fault: LeaseFault | None = None
        self._lease_fault_times: int | None = None
        self._lease_fault_generation = 0  # a hung Lease request waits until this changes

    # -- state, thread-safe ------------------------------------------------------------

    @property
    def write_log(self) -> list[WriteRecord]:
        """A copy of every write request received (POST, PATCH, DELETE), oldest first."""
        with self._lock:
            return [replace(r, body=copy.deepcopy(r.body)) for r in self._writes]

    @property
    def resource_version(self) -> int:
        """The store's resourceVersion now (what a LIST of it would say)."""
        with self._lock:
            return self._rv

    def events(
        self, field_selector: str = "", namespace: str | None = None
    ) -> list[dict[str, Any]]:
        """What ``kubectl get events.events.k8s.io -A --field-selector ...`` shows (one
        namespace with ``namespace``), sorted by namespace and name."""
        selector = parse_field_selector(field_selector, EVENT_FIELDS)
        with self._lock:
            found = [
                copy.deepcopy(e)
                for (ns, _), e in self._events.items()
                if (namespace is None or ns == namespace) and _matches(e, selector)
            ]
        return sorted(found, key=lambda e: (e["metadata"]["namespace"], e["metadata"]["name"]))

    def events_regarding(self, kind: str, namespace: str, name: str) -> list[dict[str, Any]]:
        """The Events about one object, as ``kubectl describe`` lists them."""
        selector = f"regarding.kind={kind},regarding.name={name}"
        return self.events(selector + (f",regarding.namespace={namespace}" if namespace else ""))

    def node(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            node = self._nodes.get(name)
            return copy.deepcopy(node) if node is not None else None

    def set_node(self, obj: Mapping[str, Any]) -> None:
        """Add or replace a Node (see ``node_dict``)."""
        node = copy.deepcopy(dict(obj))
        name = str_at(node, "metadata", "name")
        if not name:
            raise ValueError("a node needs metadata.name")
        with self._lock:
            node["metadata"]["resourceVersion"] = self._next_rv_locked()
            self._nodes[name] = node
            if self._on_node is not None:  # under the lock: watches see writes in order
                self._on_node(copy.deepcopy(node))

    def set_device_taint_rule(self, obj: Mapping[str, Any]) -> None:
        """Add a DeviceTaintRule as it would stand after an earlier run made it, with the
        ``metadata.creationTimestamp`` given (the API sets it on create: this is how a
        test makes one from long ago)."""
        rule = copy.deepcopy(dict(obj))
        name = str_at(rule, "metadata", "name")
        if not name:
            raise ValueError("a DeviceTaintRule needs metadata.name")
        with self._lock:
            rule["metadata"].setdefault("creationTimestamp", now_rfc3339())
            rule["metadata"]["resourceVersion"] = self._next_rv_locked()
            self._taint_rules[name] = rule
            self._taint_rule_changed_locked(name)

    def delete_device_taint_rule(self, name: str) -> bool:
        """Remove a DeviceTaintRule (as ``kubectl delete devicetaintrule`` does); False
        when there was none of that name."""
        with self._lock:
            if self._taint_rules.pop(name, None) is None:
                return False
            self._taint_rule_changed_locked(name)
            return True

    def _taint_rule_changed_locked(self, name: str) -> None:
        if self._on_taint_rule is not None:  # under the lock: watches see writes in order
            rule = self._taint_rules.get(name)
            self._on_taint_rule(name, copy.deepcopy(rule) if rule is not None else None)

    def device_taint_rules(self) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(r) for _, r in sorted(self._taint_rules.items())]

    def set_device_taint_versions(self, versions: Sequence[str]) -> None:
        """The resource.k8s.io versions that serve ``devicetaintrules`` (default:
        ``DEFAULT_DEVICE_TAINT_VERSIONS``, Kubernetes 1.35's); ``()``: none, as a
        cluster without the DRADeviceTaints feature."""
        unknown = set(versions) - set(KNOWN_RESOURCE_VERSIONS)
        if unknown:
            raise ValueError(f"unknown resource.k8s.io versions: {sorted(unknown)}")
        with self._lock:
            self._taint_versions = tuple(versions)

    def set_write_fault(
        self,
        mode: FaultMode | None,
        *,
        delay_s: float = 1.0,
        times: int | None = None,
        only: str | None = None,
    ) -> None:
        """Answer the write requests (and the node GET) badly until cleared with
        ``None``, or for the next ``times`` of them only: ``"forbidden"`` 403 (RBAC
        missing), ``"error"`` 500, ``"slow"`` the right answer after ``delay_s``,
        ``"hang"`` no answer at all (the request is held open until the fault is changed
        or cleared, then answered). ``only``: a part of the path the fault is limited to
        (``"/status"``: the node condition; ``"devicetaintrules"``; ``"/events"``)."""
        with self._lock:
            self._fault_only = only
            self._fault = mode
            self._fault_delay_s = delay_s
            self._fault_times = times if mode is not None else None
            self._fault_generation += 1

    def forbids(self, path: str) -> bool:
        """Whether a write to ``path`` would be answered 403 now (the write fault for
        writes, the lease fault for Leases), without spending a ``times`` use: what
        a SelfSubjectAccessReview answers from (sim/kube_access.py)."""
        with self._lock:
            if "/leases" in path:
                return self._lease_fault == "forbidden"
            only = self._fault_only
            return self._fault == "forbidden" and (only is None or only in path)

    # leases

    @property
    def lease_log(self) -> list[WriteRecord]:
        """A copy of every Lease request received (GET, POST, PUT), oldest first."""
        with self._lock:
            return [replace(r, body=copy.deepcopy(r.body)) for r in self._lease_log]

    def leases(self) -> list[dict[str, Any]]:
        with self._lock:
            return [copy.deepcopy(v) for _, v in sorted(self._leases.items())]

    def lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        with self._lock:
            found = self._leases.get((namespace, name))
            return copy.deepcopy(found) if found is not None else None

    def set_lease(self, obj: Mapping[str, Any]) -> None:
        """Write a Lease as another client would (a new ``resourceVersion``): how a
        test makes another exporter renew or take the node's lease."""
        lease = copy.deepcopy(dict(obj))
        namespace, name = str_at(lease, "metadata", "namespace"), str_at(lease, "metadata", "name")
        if not namespace or not name:
            raise ValueError("a Lease needs metadata.namespace and metadata.name")
        with self._lock:
            lease["apiVersion"], lease["kind"] = "coordination.k8s.io/v1", "Lease"
            lease["metadata"].setdefault("creationTimestamp", now_rfc3339())
            lease["metadata"]["resourceVersion"] = self._next_rv_locked()
            self._leases[(namespace, name)] = lease

    def set_lease_fault(self, mode: LeaseFault | None, *, times: int | None = None) -> None:
        """Answer the Lease requests badly until cleared with None, or for the next
        ``times`` only: 403 (``"forbidden"``: the RBAC for leases missing), 500
        (``"error"``), 409 Conflict on every request (``"conflict"``), 200 with a body
        that is not JSON (``"garbage"``), the request carried out but its answer without
        ``metadata.resourceVersion`` (``"no-version"``: a proxy or an old server that
        mangles it), or no answer at all (``"hang"``: held open until the fault is
        changed or cleared, then answered)."""
        with self._lock:
            self._lease_fault = mode
            self._lease_fault_times = times if mode is not None else None
            self._lease_fault_generation += 1

    async def _lease_request(
        self, request: web.Request, body: Any, handle: Callable[[], web.Response]
    ) -> web.Response:
        record = WriteRecord(request.method, request.path, request.content_type, body)
        with self._lock:
            self._lease_log.append(record)
            mode = self._lease_fault
            generation = self._lease_fault_generation
            if mode is not None and self._lease_fault_times is not None:
                self._lease_fault_times -= 1
                if self._lease_fault_times <= 0:
                    self._lease_fault, self._lease_fault_times = None, None
        if mode == "hang":
            await self._hang(lambda: self._lease_fault_generation, generation)
        forbidden = (
            f'leases.coordination.k8s.io is forbidden: User "{FAULT_USER}" cannot '
            f'{request.method.lower()} resource "leases" in API group '
            f'"coordination.k8s.io" (fake API server fault)'
        )
        if mode == "conflict":
            name = request.match_info.get("name", "")

            def handle() -> web.Response:
                raise Refused(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": '
                    "the object has been modified (fake API server fault)",
                    {"name": name, "group": "coordination.k8s.io", "kind": "leases"},
                )

        elif mode == "garbage":
            done = handle

            def handle() -> web.Response:
                done()  # carried out; the answer is what cannot be read
                return web.Response(status=200, text="<html>502 upstream</html>")

        elif mode == "no-version":
            done = handle

            def handle() -> web.Response:
                answer = done()
                lease = json.loads(cast(bytes, answer.body))
                if isinstance(lease.get("metadata"), dict):
                    lease["metadata"].pop("resourceVersion", None)
                return web.json_response(lease, status=answer.status)

        return self._answer(
            record, mode if mode in ("forbidden", "error") else None, forbidden, handle
        )

    async def _hang(self, generation_now: Callable[[], int], generation: int) -> None:
        """Never answer (a server that accepted and went quiet) until the fault that
        made this request hang is changed or cleared (its generation moves on)."""
        while True:
            with self._lock:
                if generation_now() != generation:
                    return
            await asyncio.sleep(0.02)

    def _answer(
        self,
        record: WriteRecord,
        mode: str | None,
        forbidden: str,
        handle: Callable[[], web.Response],
    ) -> web.Response:
        """``handle()``'s answer, or the fault's (``forbidden``: the 403's message),
        noted on ``record``."""
        try:
            if mode == "forbidden":
                raise Refused(403, "Forbidden", forbidden)
            if mode == "error":
                raise Refused(500, "InternalError", "fake API server error 500")
            response = handle()
        except Refused as refused:
            response = refused.response()
        with self._lock:
            record.status = response.status
        return response

    async def _get_lease(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]

        def handle() -> web.Response:
            lease = self.lease(namespace, name)
            if lease is None:
                raise not_found("leases.coordination.k8s.io", name)
            return web.json_response(lease)

        return await self._lease_request(request, None, handle)

    async def _create_lease(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]
        body = await _json_body(request)

        def handle() -> web.Response:
            lease = _lease_checked(body, namespace, None)
            name = lease["metadata"]["name"]
            with self._lock:
                if (namespace, name) in self._leases:
                    raise Refused(
                        409,
                        "AlreadyExists",
                        f'leases.coordination.k8s.io "{name}" already exists',
                        {"name": name, "group": "coordination.k8s.io", "kind": "leases"},
                    )
                return self._store_lease_locked(namespace, lease, 201)

        return await self._lease_request(request, body, handle)

    async def _update_lease(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        body = await _json_body(request)

        def handle() -> web.Response:
            lease = _lease_checked(body, namespace, name)
            with self._lock:
                old = self._leases.get((namespace, name))
                if old is None:  # AllowCreateOnUpdate
                    return self._store_lease_locked(namespace, lease, 201)
                given = str_at(lease, "metadata", "resourceVersion")
                if not given:
                    raise invalid_error(
                        "Lease",
                        "coordination.k8s.io",
                        name,
                        [
                            (
                                "metadata.resourceVersion",
                                "metadata.resourceVersion: Invalid value: 0x0: must be "
                                "specified for an update",
                            )
                        ],
                    )
                if given != old["metadata"]["resourceVersion"]:
                    raise Refused(
                        409,
                        "Conflict",
                        f'Operation cannot be fulfilled on leases.coordination.k8s.io "{name}": '
                        "the object has been modified; please apply your changes to the "
                        "latest version and try again",
                        {"name": name, "group": "coordination.k8s.io", "kind": "leases"},
                    )
                lease["metadata"]["creationTimestamp"] = old["metadata"].get("creationTimestamp")
                lease["metadata"]["uid"] = old["metadata"].get("uid")
                return self._store_lease_locked(namespace, lease, 200)

        return await self._lease_request(request, body, handle)

    def _store_lease_locked(
        self, namespace: str, lease: dict[str, Any], status: int
    ) -> web.Response:
        meta = lease["metadata"]
        meta["namespace"] = namespace
        meta.setdefault("uid", f"lease-{secrets.token_hex(8)}")
        if not meta.get("creationTimestamp"):
            meta["creationTimestamp"] = now_rfc3339()
        meta["resourceVersion"] = self._next_rv_locked()
        lease["apiVersion"], lease["kind"] = "coordination.k8s.io/v1", "Lease"
        self._leases[(namespace, meta["name"])] = lease
        return web.json_response(copy.deepcopy(lease), status=status)

    def _next_rv_locked(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _take_fault_locked(self, path: str = "") -> tuple[FaultMode | None, float, int]:
        only = self._fault_only
        if only is not None and only not in path:
            return None, 0.0, self._fault_generation
        mode, delay, generation = self._fault, self._fault_delay_s, self._fault_generation
        if mode is not None and self._fault_times is not None:
            self._fault_times -= 1
            if self._fault_times <= 0:
                self._fault, self._fault_times = None, None
                # a hang spent by ``times`` is still held until the next change
        return mode, delay, generation

    # -- HTTP --------------------------------------------------------------------------

    def mount(self, app: web.Application) -> None:
        r = app.router
        ns_events = EVENTS_PREFIX + "/namespaces/{namespace}/events"
        r.add_post(ns_events, self._create_event)
        r.add_get(ns_events, self._list_events)
        r.add_get(EVENTS_PREFIX + "/events", self._list_events)
        r.add_get(ns_events + "/{name}", self._get_event)
        r.add_patch(ns_events + "/{name}", self._patch_event)
        r.add_get("/api/v1/nodes/{name}", self._get_node)
        r.add_patch("/api/v1/nodes/{name}/status", self._patch_node_status)
        r.add_get(RESOURCE_PREFIX, self._resource_group)
        r.add_get(RESOURCE_PREFIX + "/{version}", self._resource_version)
        rules = RESOURCE_PREFIX + "/{version}/devicetaintrules"
        r.add_get(rules, self._list_taint_rules)
        r.add_post(rules, self._create_taint_rule)
        r.add_get(rules + "/{name}", self._get_taint_rule)
        r.add_delete(rules + "/{name}", self._delete_taint_rule)
        leases = "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        r.add_post(leases, self._create_lease)
        r.add_get(leases + "/{name}", self._get_lease)
        r.add_put(leases + "/{name}", self._update_lease)

    async def _write(
        self,
        request: web.Request,
        handle: Callable[[Any], web.Response],
        *,
        with_body: bool = True,
        recorded: bool = True,
    ) -> web.Response:
        """Record the request (a write), apply the fault, then answer with
        ``handle(body)``."""
        raw = await request.read() if with_body else b""
        try:
            body: Any = json.loads(raw) if raw else None
        except ValueError:
            body = raw.decode("utf-8", errors="replace")
        record = WriteRecord(request.method, request.path, request.content_type, body)
        with self._lock:
            if recorded:
                self._writes.append(record)
            mode, delay, generation = self._take_fault_locked(request.path)
        if mode == "hang":
            await self._hang(lambda: self._fault_generation, generation)
        elif mode == "slow":
            await asyncio.sleep(delay)
        forbidden = (
            f'{request.path} is forbidden: User "{FAULT_USER}" cannot '
            f"{request.method.lower()} this resource (fake API server fault)"
        )

        def answer() -> web.Response:
            if with_body and not isinstance(body, Mapping):
                raise bad_request("the body of the request was not a JSON object")
            return handle(body)

        return self._answer(record, mode, forbidden, answer)

    # events

    async def _create_event(self, request: web.Request) -> web.Response:
        namespace = request.match_info["namespace"]

        def handle(body: Mapping[str, Any]) -> web.Response:
            event = copy.deepcopy(dict(body))
            _check_type(event, "events.k8s.io/v1", "Event")
            meta = event.setdefault("metadata", {})
            if not isinstance(meta, dict):
                raise bad_request("metadata must be an object")
            if meta.get("namespace", namespace) not in (namespace, ""):
                raise bad_request(
                    "the namespace of the provided object does not match the namespace "
                    "sent on the request"
                )
            meta["namespace"] = namespace
            if not meta.get("name") and meta.get("generateName"):
                meta["name"] = str(meta["generateName"]) + secrets.token_hex(3)[:5]
            if (decode_error := micro_time_error(event)) is not None:
                raise bad_request(decode_error)
            name = str_at(event, "metadata", "name")
            errors = event_create_errors(event)
            if errors:
                raise invalid_error("Event", "events.k8s.io", name, errors)
            with self._lock:
                if (namespace, name) in self._events:
                    raise Refused(
                        409,
                        "AlreadyExists",
                        f'events.events.k8s.io "{name}" already exists',
                        {"name": name, "group": "events.k8s.io", "kind": "events"},
                    )
                event["apiVersion"], event["kind"] = "events.k8s.io/v1", "Event"
                meta["uid"] = f"event-{secrets.token_hex(8)}"
                meta["resourceVersion"] = self._next_rv_locked()
                meta["creationTimestamp"] = now_rfc3339()
                self._events[(namespace, name)] = event
                return web.json_response(copy.deepcopy(event), status=201)

        return await self._write(request, handle)

    async def _patch_event(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]

        def handle(patch: Mapping[str, Any]) -> web.Response:
            _check_patch_type(request)
            with self._lock:
                old = self._events.get((namespace, name))
                if old is None:
                    raise not_found("events.events.k8s.io", name)
                # No Event field has a patch strategy: both patch types merge the same.
                new = merge_patch(old, patch)
                if (decode_error := micro_time_error(new)) is not None:
                    raise bad_request(decode_error)
                new["metadata"]["resourceVersion"] = old["metadata"]["resourceVersion"]
                errors = event_update_errors(new, old)
                if errors:
                    raise invalid_error("Event", "events.k8s.io", name, errors)
                new["metadata"]["resourceVersion"] = self._next_rv_locked()
                self._events[(namespace, name)] = new
                return web.json_response(copy.deepcopy(new))

        return await self._write(request, handle)

    async def _get_event(self, request: web.Request) -> web.Response:
        namespace, name = request.match_info["namespace"], request.match_info["name"]
        with self._lock:
            event = copy.deepcopy(self._events.get((namespace, name)))
        if event is None:
            return not_found("events.events.k8s.io", name).response()
        return web.json_response(event)

    async def _list_events(self, request: web.Request) -> web.Response:
        try:
            items = self.events(
                request.query.get("fieldSelector", ""), request.match_info.get("namespace")
            )
        except SelectorError as exc:
            return bad_request(str(exc)).response()
        return web.json_response(self._list("events.k8s.io/v1", "EventList", items))

    def _list(self, api_version: str, kind: str, items: list[dict[str, Any]]) -> dict[str, Any]:
        with self._lock:
            rv = str(self._rv)
        return {
            "kind": kind,
            "apiVersion": api_version,
            "metadata": {"resourceVersion": rv},
            "items": items,
        }

    # nodes

    async def _get_node(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]

        def handle(_: Any) -> web.Response:
            node = self.node(name)
            if node is None:
                raise not_found("nodes", name)
            return web.json_response(node)

        return await self._write(request, handle, with_body=False, recorded=False)

    async def _patch_node_status(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]

        def handle(patch: Mapping[str, Any]) -> web.Response:
            strategic = _check_patch_type(request)
            with self._lock:
                old = self._nodes.get(name)
                if old is None:
                    raise not_found("nodes", name)
                # The status subresource keeps everything but status as it was
                # (nodeStatusStrategy.PrepareForUpdate).
                status_patch = {"status": patch["status"]} if "status" in patch else {}
                if strategic:
                    new = strategic_merge_patch(old, status_patch, NODE_MERGE_KEYS)
                else:
                    new = merge_patch(old, status_patch)
                new["metadata"] = copy.deepcopy(old["metadata"])
                new["metadata"]["resourceVersion"] = self._next_rv_locked()
                self._nodes[name] = new
                if self._on_node is not None:  # under the lock: watches see writes in order
                    self._on_node(copy.deepcopy(new))
            return web.json_response(copy.deepcopy(new))

        return await self._write(request, handle)

    # resource.k8s.io

    def _served_resources(self) -> dict[str, list[str]]:
        """version -> the resources this stand-in serves there."""
        with self._lock:
            taint_versions = self._taint_versions
        served: dict[str, list[str]] = {}
        for version in KNOWN_RESOURCE_VERSIONS:
            resources = []
            if version == "v1" and self._slices_served():
                resources.append("resourceslices")
            if version in taint_versions:
                resources.append("devicetaintrules")
            if resources:
                served[version] = resources
        return served

    def resource_group(self) -> dict[str, Any] | None:
        """resource.k8s.io's ``APIGroup`` as discovery lists it (``/apis``), or None
        while no version of it is served."""
        served = self._served_resources()
        if not served:
            return None
        versions = [{"groupVersion": f"resource.k8s.io/{v}", "version": v} for v in served]
        return {
            "kind": "APIGroup",
            "apiVersion": "v1",
            "name": "resource.k8s.io",
            "versions": versions,
            "preferredVersion": versions[0],
        }

    async def _resource_group(self, request: web.Request) -> web.Response:
        group = self.resource_group()
        if group is None:
            return Refused(
                404, "NotFound", "the server could not find the requested resource"
            ).response()
        return web.json_response(group)

    async def _resource_version(self, request: web.Request) -> web.Response:
        version = request.match_info["version"]
        resources = self._served_resources().get(version)
        if resources is None:
            return Refused(
                404, "NotFound", "the server could not find the requested resource"
            ).response()
        kinds = {"resourceslices": "ResourceSlice", "devicetaintrules": "DeviceTaintRule"}
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]
        return web.json_response(
            {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": f"resource.k8s.io/{version}",
                "resources": [
                    {
                        "name": name,
                        "singularName": kinds[name].lower(),
                        "namespaced": False,
                        "kind": kinds[name],
                        "verbs": verbs,
                    }
                    for name in resources
                ],
            }
        )

    def _taint_version(self, request: web.Request) -> str:
        version = request.match_info["version"]
        with self._lock:
            if version not in self._taint_versions:
                raise Refused(404, "NotFound", "the server could not find the requested resource")
        return version

    async def _list_taint_rules(self, request: web.Request) -> web.StreamResponse:
        try:
            version = self._taint_version(request)
            terms = _label_selector(request.query.get("labelSelector", ""))
        except Refused as refused:
            return refused.response()
        except SelectorError as exc:
            return bad_request(str(exc)).response()
        watch = request.query.get("watch", "").lower() in ("true", "1")
        if self._serve_taint_rules is not None and (watch or not terms):
            return await self._serve_taint_rules(request, version)
        items = [
            {**r, "apiVersion": f"resource.k8s.io/{version}"}
            for r in self.device_taint_rules()
            if _labels_match(r, terms)
        ]
        return web.json_response(
            self._list(f"resource.k8s.io/{version}", "DeviceTaintRuleList", items)
        )

    async def _get_taint_rule(self, request: web.Request) -> web.Response:
        try:
            version = self._taint_version(request)
        except Refused as refused:
            return refused.response()
        name = request.match_info["name"]
        with self._lock:
            rule = copy.deepcopy(self._taint_rules.get(name))
        if rule is None:
            return not_found("devicetaintrules.resource.k8s.io", name).response()
        rule["apiVersion"] = f"resource.k8s.io/{version}"
        return web.json_response(rule)

    async def _create_taint_rule(self, request: web.Request) -> web.Response:
        def handle(body: Mapping[str, Any]) -> web.Response:
            version = self._taint_version(request)
            rule = copy.deepcopy(dict(body))
            _check_type(rule, f"resource.k8s.io/{version}", "DeviceTaintRule")
            name = str_at(rule, "metadata", "name")
            errors = device_taint_rule_errors(rule)
            if errors:
                raise invalid_error("DeviceTaintRule", "resource.k8s.io", name, errors)
            with self._lock:
                if name in self._taint_rules:
                    raise Refused(
                        409,
                        "AlreadyExists",
                        f'devicetaintrules.resource.k8s.io "{name}" already exists',
                        {"name": name, "group": "resource.k8s.io", "kind": "devicetaintrules"},
                    )
                rule["apiVersion"], rule["kind"] = f"resource.k8s.io/{version}", "DeviceTaintRule"
                meta = rule["metadata"]
                meta["uid"] = f"dtr-{secrets.token_hex(8)}"
                meta["resourceVersion"] = self._next_rv_locked()
                meta["generation"] = 1
                meta["creationTimestamp"] = now_rfc3339()
                # "Added automatically during create or update if not set" (types.go)
                rule["spec"]["taint"].setdefault("timeAdded", now_rfc3339())
                self._taint_rules[name] = rule
                self._taint_rule_changed_locked(name)
                return web.json_response(copy.deepcopy(rule), status=201)

        return await self._write(request, handle)

    async def _delete_taint_rule(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]

        def handle(_: Any) -> web.Response:
            version = self._taint_version(request)
            with self._lock:
                rule = self._taint_rules.pop(name, None)
                if rule is not None:
                    self._taint_rule_changed_locked(name)
            if rule is None:
                raise not_found("devicetaintrules.resource.k8s.io", name)
            rule["apiVersion"] = f"resource.k8s.io/{version}"
            return web.json_response(rule)

        return await self._write(request, handle, with_body=False)


def _check_type(obj: Mapping[str, Any], api_version: str, kind: str) -> None:
    """The create handler's check (apiserver pkg/endpoints/handlers/create.go): a body
    that names another group/version or kind is refused with 400."""
    given_version, given_kind = obj.get("apiVersion"), obj.get("kind")
    if given_version and given_version != api_version:
        raise bad_request(
            f"the API version in the data ({given_version}) does not match the expected "
            f"API version ({api_version})"
        )
    if given_kind and given_kind != kind:
        raise bad_request(f"the kind in the data ({given_kind}) is not {kind}")


async def _json_body(request: web.Request) -> Any:
    raw = await request.read()
    try:
        return json.loads(raw) if raw else None
    except ValueError:
        return raw.decode("utf-8", errors="replace")


def _lease_checked(body: Any, namespace: str, name: str | None) -> dict[str, Any]:
    """A Lease to store, checked as the create/update handlers and ValidateLease
    (pkg/apis/coordination/validation/validation.go) do."""
    if not isinstance(body, Mapping):
        raise bad_request("the body of the request was not a JSON object")
    lease = copy.deepcopy(dict(body))
    _check_type(lease, "coordination.k8s.io/v1", "Lease")
    meta = lease.get("metadata")
    if not isinstance(meta, dict):
        raise bad_request("metadata must be an object")
    if meta.get("namespace", namespace) not in (namespace, ""):
        raise bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )
    given = meta.get("name")
    if name is not None and given != name:
        raise bad_request(
            f"the name of the object ({given}) does not match the name on the URL ({name})"
        )
    if not isinstance(given, str) or not given:
        raise invalid_error(
            "Lease",
            "coordination.k8s.io",
            "",
            [("metadata.name", "metadata.name: Required value: name or generateName is required")],
        )
    spec = lease.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    lease["spec"] = spec
    errors = []
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        errors.append(
            (
                "spec.leaseDurationSeconds",
                f"spec.leaseDurationSeconds: Invalid value: {duration}: must be greater than 0",
            )
        )
    transitions = spec.get("leaseTransitions")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        errors.append(
            (
                "spec.leaseTransitions",
                f"spec.leaseTransitions: Invalid value: {transitions}: must be greater than "
                "or equal to 0",
            )
        )
    if errors:
        raise invalid_error("Lease", "coordination.k8s.io", given, errors)
    return lease


def _check_patch_type(request: web.Request) -> bool:
    """True for a strategic merge patch, False for a JSON merge patch; any other type
    is 415 here (the real server also takes JSON patch and apply patches)."""
    if request.content_type == STRATEGIC_MERGE_PATCH:
        return True
    if request.content_type == MERGE_PATCH:
        return False
    raise Refused(
        415,
        "UnsupportedMediaType",
        f"the body of the request was in an unknown format - accepted media types "
        f"include: {MERGE_PATCH}, {STRATEGIC_MERGE_PATCH} (got {request.content_type})",
    )
