"""The exporter's writes to the Kubernetes API: one request per call, each bounded.

Events (events.k8s.io/v1), the Node's ``GPUUnhealthy`` condition and DRA
DeviceTaintRules go through the real ``kubernetes`` client's ``ApiClient``, set up as the
watches set theirs up (exporter/sources/kube_watch.py, ``KubeWatch._connect``): a private
``Configuration``, no hidden urllib3 retries, no retry on ``Retry-After`` inside a call,
and every connection reachable by ``InFlight.cut`` (exporter/sources/kube_http.py). Each
call is one request inside ``InFlight(deadline_s)``: a server that is down, silent or
slow costs the writer thread at most ``deadline_s``, and ``cut()`` ends it sooner from
any thread. Answers are read up to ``MAX_ANSWER_BYTES``.

Requests are built with ``ApiClient.param_serialize``/``call_api``, exactly what the
generated ``EventsV1Api``/``CoreV1Api``/``ResourceV1alpha3Api`` methods do, without
loading those modules (~20 MiB of resident memory for a handful of paths).
``kubernetes`` is imported inside the calls, in the writer's thread, so an exporter that
writes nothing never loads it.

The node's writer Lease (coordination.k8s.io/v1, exporter/reporting/lease.py) is read
with GET, created with POST and renewed or taken over with PUT of the whole object,
as client-go's ``LeaseLock`` does (tools/leaderelection/resourcelock/leaselock.go).

Patch types: an Event update is a JSON merge patch (RFC 7386; Event fields carry no
patch strategy, so a strategic merge patch would do the same); the Node's conditions go
in a strategic merge patch of ``/status``, which merges ``status.conditions`` by
``type`` (``patchMergeKey`` of ``NodeStatus.Conditions``, k8s.io/api core/v1/types.go),
so other conditions (the kubelet's ``Ready``) are left alone, as node-problem-detector
does.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from exporter.sources.kube_http import DeadlineExceeded, InFlight, bounded_api_client
from exporter.text import one_line

# An answer larger than this is refused: a list of DeviceTaintRules of one node, a Node
# or an Event is a few KiB.
MAX_ANSWER_BYTES = 1024 * 1024
READ_BYTES = 64 * 1024
# resource.k8s.io versions that may serve DeviceTaintRules, newest first (KEP-5055:
# v1alpha3 in Kubernetes 1.33-1.35, v1beta2 and v1 from 1.36).
DEVICE_TAINT_VERSIONS = ("v1", "v1beta2", "v1alpha3")
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"


class KubeWriteError(Exception):
    """A write (or the read it needs) that did not succeed.

    ``status``: the HTTP status of the server's answer; None when there was no usable
    answer (connection refused or reset, deadline passed, request cut, answer too large
    or not JSON, no credentials). ``reason``: one line for logs, with the Status message
    of the server when it sent one.
    """

    def __init__(self, status: int | None, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def _read_bounded(response: Any, limit: int) -> bytes:
    """The whole body of a urllib3 response, refused once it passes ``limit`` bytes."""
    body = bytearray()
    while chunk := response.read(READ_BYTES):
        body += chunk
        if len(body) > limit:
            raise KubeWriteError(None, f"answer larger than {limit // (1024 * 1024)} MiB")
    return bytes(body)


def _status_message(data: bytes) -> str:
    """The ``message`` of a ``metav1.Status`` body; the text itself if it is not one."""
    try:
        decoded = json.loads(data)
    except ValueError:
        return data[:1024].decode("utf-8", errors="replace")
    if isinstance(decoded, Mapping):
        return str(decoded.get("message") or "")
    return ""


def _transport_reason(exc: BaseException) -> str:
    """One line for a failure with no answer: the innermost OS error (``Connection
    refused``) that urllib3's wrappers (``reason``, the cause chain) lead to, else the
    innermost wrapped error's type and text."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    innermost = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.strerror:
            return f"{type(cur).__name__}: {cur.strerror}"
        innermost = cur
        wrapped = getattr(cur, "reason", None)
        if not isinstance(wrapped, BaseException):
            args = cur.args  # ProtocolError("Connection aborted.", RemoteDisconnected())
            wrapped = args[1] if len(args) == 2 and isinstance(args[1], BaseException) else None
        cur = wrapped or cur.__cause__ or cur.__context__
    text = str(innermost)
    return f"{type(innermost).__name__}: {text}" if text else type(innermost).__name__


class KubeWriteClient:
    """The exporter's Kubernetes writes, one request per call (see the module docstring).

    Calls are made from one thread (the writer's); ``cut()`` and ``close()`` may come
    from any. The client connects lazily, at the first call, and again after a failed
    connect (no kubeconfig yet, say); every failure is a ``KubeWriteError``.
    """

    def __init__(self, kubeconfig: str | None, *, deadline_s: float = 5.0) -> None:
        if not deadline_s > 0:
            raise ValueError(f"deadline_s must be > 0, got {deadline_s}")
        self._kubeconfig = kubeconfig
        self._deadline_s = deadline_s
        self._lock = threading.Lock()
        self._api: Any = None
        self._flight: InFlight | None = None
        self._cut: InFlight | None = None  # the flight cut() ended, for its message
        self._closed = False

    # -- the calls -----------------------------------------------------------------------

    def create_event(self, body: Mapping[str, Any]) -> None:
        """POST an events.k8s.io/v1 Event into ``body.metadata.namespace``."""
        metadata = body.get("metadata")
        namespace = metadata.get("namespace") if isinstance(metadata, Mapping) else None
        if not isinstance(namespace, str) or not namespace:
            raise ValueError("an Event to create needs metadata.namespace")
        self._request(
            "POST",
            "/apis/events.k8s.io/v1/namespaces/{namespace}/events",
            {"namespace": namespace},
            body=body,
            what=f"create event in {namespace}",
        )

    def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any]) -> None:
        """Update an Event (its ``series``) with a JSON merge patch."""
        self._request(
            "PATCH",
            "/apis/events.k8s.io/v1/namespaces/{namespace}/events/{name}",
            {"namespace": namespace, "name": name},
            body=patch,
            content_type=MERGE_PATCH,
            what=f"patch event {namespace}/{name}",
        )

    def node_conditions(self, node: str) -> list[dict[str, Any]]:
        """The Node's ``status.conditions`` as the server has them now."""
        answer = self._request(
            "GET", "/api/v1/nodes/{name}", {"name": node}, what=f"get node {node}"
        )
        status = answer.get("status") if isinstance(answer, Mapping) else None
        conditions = status.get("conditions") if isinstance(status, Mapping) else None
        if not isinstance(conditions, list):
            return []
        return [dict(c) for c in conditions if isinstance(c, Mapping)]

    def patch_node_conditions(self, node: str, conditions: Sequence[Mapping[str, Any]]) -> None:
        """Set these conditions on the Node's status (a strategic merge patch: the
        conditions of other types are kept)."""
        self._request(
            "PATCH",
            "/api/v1/nodes/{name}/status",
            {"name": node},
            body={"status": {"conditions": [dict(c) for c in conditions]}},
            content_type=STRATEGIC_MERGE_PATCH,
            what=f"patch node {node} status",
        )

    def device_taint_rule_version(self) -> str | None:
        """The newest resource.k8s.io version whose discovery lists
        ``devicetaintrules``; None when none does (or the group is not served at all).
        A failed discovery raises: unknown is not "not served"."""
        group = self._request(
            "GET", "/apis/resource.k8s.io", None, what="discover resource.k8s.io", missing_ok=True
        )
        if group is None:
            return None
        listed = group.get("versions") if isinstance(group, Mapping) else None
        served = {v.get("version") for v in listed or () if isinstance(v, Mapping)}
        for version in DEVICE_TAINT_VERSIONS:
            if version not in served:
                continue
            resources = self._request(
                "GET",
                "/apis/resource.k8s.io/{version}",
                {"version": version},
                what=f"discover resource.k8s.io/{version}",
                missing_ok=True,
            )
            items = resources.get("resources") if isinstance(resources, Mapping) else None
            if isinstance(items, list) and any(
                isinstance(r, Mapping) and r.get("name") == "devicetaintrules" for r in items
            ):
                return version
        return None

    def list_device_taint_rules(self, version: str, label_selector: str) -> list[dict[str, Any]]:
        """The DeviceTaintRules whose labels match ``label_selector``."""
        answer = self._request(
            "GET",
            "/apis/resource.k8s.io/{version}/devicetaintrules",
            {"version": version},
            query=[("labelSelector", label_selector)] if label_selector else None,
            what="list devicetaintrules",
        )
        items = answer.get("items") if isinstance(answer, Mapping) else None
        return [dict(i) for i in items or () if isinstance(i, Mapping)]

    def create_device_taint_rule(self, version: str, body: Mapping[str, Any]) -> None:
        self._request(
            "POST",
            "/apis/resource.k8s.io/{version}/devicetaintrules",
            {"version": version},
            body=body,
            what="create devicetaintrule",
        )

    def delete_device_taint_rule(self, version: str, name: str) -> None:
        """Delete a DeviceTaintRule; one that is already gone (404) is success."""
        self._request(
            "DELETE",
            "/apis/resource.k8s.io/{version}/devicetaintrules/{name}",
            {"version": version, "name": name},
            what=f"delete devicetaintrule {name}",
            missing_ok=True,
        )

    # What the doctor subcommand asks before any write (exporter/doctor/kube_checks.py)

    def access_review(self, attributes: Mapping[str, str]) -> tuple[bool, str]:
        """Whether this client's identity may do what ``attributes`` (a
        ``ResourceAttributes``: verb, group, resource, subresource, namespace, name)
        describe, asked with a SelfSubjectAccessReview (authorization.k8s.io/v1), which
        every authenticated user may create: (allowed, the authorizer's reason)."""
        answer = self._request(
            "POST",
            "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews",
            None,
            body={
                "apiVersion": "authorization.k8s.io/v1",
                "kind": "SelfSubjectAccessReview",
                "spec": {"resourceAttributes": dict(attributes)},
            },
            what=f"access review {attributes.get('verb')} {attributes.get('resource')}",
        )
        status = answer.get("status") if isinstance(answer, Mapping) else None
        if not isinstance(status, Mapping):
            raise KubeWriteError(None, "access review: the answer has no status")
        allowed = status.get("allowed")
        if not isinstance(allowed, bool):  # not an answer either way
            raise KubeWriteError(None, f"access review: status.allowed is {allowed!r}")
        reason = str(status.get("reason") or status.get("evaluationError") or "")
        return allowed, one_line(reason)

    def node_pods(self, node: str, limit: int = 200) -> tuple[list[dict[str, Any]], bool]:
        """One page of the pods bound to ``node`` (the pod watch's own selector), and
        whether it is all of them (no ``metadata.continue`` token)."""
        answer = self._request(
            "GET",
            "/api/v1/pods",
            None,
            query=[("fieldSelector", f"spec.nodeName={node}"), ("limit", str(limit))],
            what=f"list pods on node {node}",
        )
        items = answer.get("items") if isinstance(answer, Mapping) else None
        meta = answer.get("metadata") if isinstance(answer, Mapping) else None
        more = isinstance(meta, Mapping) and bool(meta.get("continue"))
        return [dict(i) for i in items or () if isinstance(i, Mapping)], not more

    # coordination.k8s.io/v1 Leases: the node's writer lease (exporter/reporting/lease.py)

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The Lease, or None when there is none (404)."""
        answer = self._request(
            "GET",
            "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}",
            {"namespace": namespace, "name": name},
            what=f"get lease {namespace}/{name}",
            missing_ok=True,
        )
        return dict(answer) if isinstance(answer, Mapping) else None

    def create_lease(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """POST a Lease; 409 when another created it first."""
        answer = self._request(
            "POST",
            "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases",
            {"namespace": namespace},
            body=body,
            what=f"create lease in {namespace}",
        )
        return dict(answer) if isinstance(answer, Mapping) else {}

    def replace_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """PUT the whole Lease; its ``metadata.resourceVersion`` makes it conditional
        (409 Conflict when the Lease changed since it was read)."""
        answer = self._request(
            "PUT",
            "/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}",
            {"namespace": namespace, "name": name},
            body=body,
            what=f"update lease {namespace}/{name}",
        )
        return dict(answer) if isinstance(answer, Mapping) else {}

    def cut(self) -> None:
        """End the request in flight now (any thread); it fails with status None."""
        with self._lock:
            flight = self._flight
            self._cut = flight
        if flight is not None:
            flight.cut()

    def close(self) -> None:
        """Cut what is in flight and drop the connections; later calls fail."""
        with self._lock:
            self._closed = True
            api, self._api = self._api, None
        self.cut()
        if api is not None:
            api.rest_client.pool_manager.clear()

    # -- one request ---------------------------------------------------------------------

    def _connect(self) -> Any:
        """An ApiClient that makes one request per call, each reachable by
        ``InFlight.cut`` (``kube_http.bounded_api_client``)."""
        return bounded_api_client(self._kubeconfig)

    def _client(self) -> Any:
        with self._lock:
            if self._closed:
                raise KubeWriteError(None, "the Kubernetes write client is closed")
            if self._api is not None:
                return self._api
        try:
            api = self._connect()
        except Exception as exc:  # ConfigException, a kubeconfig that is not YAML, ...
            reason = one_line(f"no Kubernetes client configuration: {type(exc).__name__}: {exc}")
            raise KubeWriteError(None, reason) from exc
        with self._lock:
            self._api = api
        return api

    def _request(
        self,
        method: str,
        path: str,
        path_params: Mapping[str, str] | None,
        *,
        what: str,
        query: list[tuple[str, str]] | None = None,
        body: Mapping[str, Any] | None = None,
        content_type: str = "application/json",
        missing_ok: bool = False,
    ) -> Any:
        """Make one request; returns the decoded JSON answer (None for a 404 when
        ``missing_ok``). Raises ``KubeWriteError`` for anything else than a 2xx JSON
        answer within the deadline."""
        api = self._client()
        flight = InFlight(self._deadline_s, what)
        with self._lock:
            self._flight, self._cut = flight, None
        try:
            with flight:
                status, data = self._exchange(
                    api, flight, method, path, path_params, query, body, content_type
                )
        except KubeWriteError as exc:
            raise KubeWriteError(exc.status, one_line(f"{what}: {exc.reason}")) from exc
        except DeadlineExceeded as exc:
            raise KubeWriteError(None, one_line(f"{what}: request cut: {exc}")) from exc
        except Exception as exc:  # urllib3's errors, OSError, kubernetes' ApiException(0)
            with self._lock:
                cut = self._cut is flight
            reason = "request cut" if cut else _transport_reason(exc)
            raise KubeWriteError(None, one_line(f"{what}: {reason}")) from exc
        finally:
            with self._lock:
                self._flight = None
        if status == 404 and missing_ok:
            return None
        if not 200 <= status <= 299:
            message = _status_message(data)
            text = f"{what}: HTTP {status}" + (f": {message}" if message else "")
            raise KubeWriteError(status, one_line(text))
        try:
            return json.loads(data) if data else None
        except ValueError as exc:
            raise KubeWriteError(None, one_line(f"{what}: answer is not JSON")) from exc

    @staticmethod
    def _exchange(
        api: Any,
        flight: InFlight,
        method: str,
        path: str,
        path_params: Mapping[str, str] | None,
        query: list[tuple[str, str]] | None,
        body: Mapping[str, Any] | None,
        content_type: str,
    ) -> tuple[int, bytes]:
        """Send, and read the answer whole (bounded): (status, body)."""
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        method, url, headers, serialized, post = api.param_serialize(
            method,
            path,
            path_params=dict(path_params) if path_params else None,
            query_params=query,
            header_params=headers,
            body=dict(body) if body is not None else None,
            auth_settings=["BearerToken"],
        )
        deadline = flight.deadline_s
        answer = api.call_api(
            method, url, headers, serialized, post, _request_timeout=(deadline, deadline)
        )
        response = answer.response  # the urllib3 response, not read yet
        flight.attach_response(response)
        try:
            data = _read_bounded(response, MAX_ANSWER_BYTES)
        except BaseException:
            response.close()  # perhaps not read to its end: never reuse the connection
            raise
        finally:
            response.release_conn()
        return int(response.status), data
