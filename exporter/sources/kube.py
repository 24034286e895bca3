"""Pod metadata from the Kubernetes API: a node-scoped list + watch in one thread.

The API maps pod UID -> namespace/name and container ID -> container name, which turns
the cgroup identities read from /proc into pod labels. One daemon thread lists the
node's pods, then watches from the list's resourceVersion, and relists on any break
(410 Gone, a dropped connection, an error) and every ``resync_s`` as a safety net.

``kubernetes`` is imported only inside that thread: it costs ~20 MiB of RSS and a second
of start-up (its generated ``CoreV1Api`` would cost another ~21 MiB, so the one request
we need is built through ``ApiClient``), and with ``--kube-api off`` it is never loaded.
Pods are read as raw JSON rather than the client's models: cheaper per event, and
immune to model validation tripping over fields a newer API server adds or omits.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

from exporter.model import PodMeta, PodMetaSnapshot
from exporter.sources.backoff import Backoff

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
LIST_READ_TIMEOUT_S = 60.0
# CoreV1Api keyword -> query parameter, for the pod list and watch requests
_QUERY_NAMES = {
    "field_selector": "fieldSelector",
    "resource_version": "resourceVersion",
    "timeout_seconds": "timeoutSeconds",
    "allow_watch_bookmarks": "allowWatchBookmarks",
    "watch": "watch",
}
# A watch with no events is silent; the read timeout only has to outlast the window the
# server was asked to keep open, so a half-open connection is still noticed.
WATCH_READ_GRACE_S = 10.0
_MAX_ERROR_LEN = 300


def _parse_time(value: Any) -> float | None:
    """RFC 3339 (``2024-05-01T12:00:00Z``, optional fraction) -> epoch seconds."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


def bare_container_id(container_id: str) -> str:
    """``containerd://<id>`` / ``cri-o://<id>`` / ``docker://<id>`` -> ``<id>``.

    procfs reports the bare id found in the cgroup path; the two must compare equal.
    """
    _, sep, rest = container_id.partition("://")
    return (rest if sep else container_id).strip()


def _container_pairs(statuses: Any) -> Iterable[tuple[str, str]]:
    if not isinstance(statuses, list):
        return
    for status in statuses:
        if not isinstance(status, Mapping):
            continue
        cid = bare_container_id(str(status.get("containerID") or ""))
        name = status.get("name")
        if cid and isinstance(name, str):
            yield cid, name


def pod_meta_from_dict(pod: Mapping[str, Any]) -> PodMeta | None:
    """One pod as the API serialises it -> PodMeta; None without a UID.

    Containers come from the regular, init and ephemeral statuses, skipping those with
    no id yet (not started): only a started container can own a GPU process.
    """
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    uid = metadata.get("uid")
    if not isinstance(uid, str) or not uid:
        return None
    containers: list[tuple[str, str]] = []
    for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
        containers.extend(_container_pairs(status.get(key)))
    phase = status.get("phase")
    return PodMeta(
        uid=uid.lower(),
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        phase=phase if isinstance(phase, str) and phase else None,
        deletion_timestamp=_parse_time(metadata.get("deletionTimestamp")),
        containers=tuple(containers),
    )


def _one_line(text: str) -> str:
    line = " ".join(text.split())
    return line if len(line) <= _MAX_ERROR_LEN else line[: _MAX_ERROR_LEN - 1] + "…"


def describe_error(exc: BaseException) -> str:
    """A one-line message for the kinds of failure the client raises.

    ``ApiException`` and urllib3's ``MaxRetryError`` stringify to multi-line or
    object-repr noise; an operator wants "HTTP 403 Forbidden: <server message>" or
    "ConnectionRefusedError: Connection refused".
    """
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status > 0:  # kubernetes.client.ApiException
        reason = str(getattr(exc, "reason", "") or "")
        message = ""
        body = getattr(exc, "body", None)
        if body:
            try:
                decoded = json.loads(body)
                if isinstance(decoded, dict):
                    message = str(decoded.get("message") or "")
            except (TypeError, ValueError):
                message = str(body)
        text = f"HTTP {status} {reason}".strip()
        return _one_line(f"{text}: {message}" if message else text)
    # urllib3 wraps the socket error in MaxRetryError(reason=NewConnectionError(...));
    # the innermost OSError with an errno text is what an operator can act on.
    seen: set[int] = set()
    cur: BaseException | None = exc
    root: OSError | None = None
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.strerror:
            root = cur
        reason_exc = getattr(cur, "reason", None)
        cur = (
            reason_exc
            if isinstance(reason_exc, BaseException)
            else (cur.__cause__ or cur.__context__)
        )
    if root is not None:
        return _one_line(f"{type(root).__name__}: {root.strerror}")
    return _one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _in_cluster() -> bool:
    return bool(
        os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("KUBERNETES_SERVICE_PORT")
    )


class PodWatcher:
    """Keeps the pods of one node current; ``snapshot()`` is cheap and thread-safe.

    ``ok`` is True once a LIST succeeded and no attempt since has failed. A watch that
    breaks (410, dropped connection) is relisted at once without clearing ``ok``;
    only a failed LIST, or a watch failing again before any progress (then retried
    with backoff, 1 s doubling to 60 s), marks the source down.
    """

    def __init__(
        self,
        node_name: str,
        *,
        kubeconfig: str | None = None,
        resync_s: float = 300.0,
        watch_timeout_s: int = 60,
    ) -> None:
        if not node_name:
            raise ValueError("node_name must not be empty")
        if resync_s <= 0:
            raise ValueError(f"resync_s must be > 0, got {resync_s}")
        if watch_timeout_s < 1:
            raise ValueError(f"watch_timeout_s must be >= 1, got {watch_timeout_s}")
        self._node = node_name
        self._kubeconfig = kubeconfig
        self._resync_s = resync_s
        self._watch_timeout_s = watch_timeout_s
        self._selector = f"spec.nodeName={node_name}"
        self._lock = threading.Lock()
        self._pods: dict[str, PodMeta] = {}
        self._pods_tuple: tuple[PodMeta, ...] = ()
        self._ok = False
        self._error: str | None = "not started"
        self._snapshot = PodMetaSnapshot(ok=False, timestamp=time.time(), error=self._error)
        self._errors_total = 0
        self._active_watch: Any = None  # kubernetes.watch.Watch while a stream is open
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    # -- public ------------------------------------------------------------------------

    @property
    def node_name(self) -> str:
        return self._node

    @property
    def errors_total(self) -> int:
        """Failed list/watch attempts so far (410 Gone is routine and not counted)."""
        with self._lock:
            return self._errors_total

    def snapshot(self) -> PodMetaSnapshot:
        with self._lock:
            return self._snapshot

    def start(self) -> None:
        """Start the watch thread; a no-op while it runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        stopping = threading.Event()
        self._stopping = stopping
        with self._lock:
            self._set_status_locked(False, "waiting for the first pod list")
        self._thread = threading.Thread(
            target=self._run, args=(stopping,), name="pod-watcher", daemon=True
        )
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """End the thread, closing an open watch stream so it need not time out."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline:
            # Repeated: a stream opened just after the first stop() call would miss it.
            with self._lock:
                watch = self._active_watch
            if watch is not None:
                with contextlib.suppress(Exception):
                    watch.stop()
            thread.join(0.05)
        if thread.is_alive():
            log.warning("pod watcher thread did not stop within %.1f s", timeout)

    # -- state -------------------------------------------------------------------------

    def _set_status_locked(self, ok: bool, error: str | None) -> None:
        self._ok, self._error = ok, error
        self._snapshot = PodMetaSnapshot(
            ok=ok, timestamp=time.time(), error=error, pods=self._pods_tuple
        )

    def _pods_changed_locked(self) -> None:
        self._pods_tuple = tuple(
            sorted(self._pods.values(), key=lambda p: (p.namespace, p.name, p.uid))
        )
        self._set_status_locked(self._ok, self._error)

    def _fail(self, message: str, *, mark_down: bool, counted: bool) -> None:
        with self._lock:
            if counted:
                self._errors_total += 1
            was_ok, previous = self._ok, self._error
            if mark_down:
                self._set_status_locked(False, message)
        if mark_down and (was_ok or previous != message):  # once per distinct failure
            log.warning("pod metadata source down: %s", message)
        else:
            log.debug("pod watcher: %s", message)

    # -- worker thread -----------------------------------------------------------------

    def _run(self, stopping: threading.Event) -> None:
        try:
            from kubernetes import watch as k8s_watch
        except ImportError as exc:
            with self._lock:
                self._set_status_locked(False, f"kubernetes client unavailable: {exc}")
            return
        # return_type "object": events keep raw dicts, no model deserialisation.
        watch = k8s_watch.Watch(return_type="object")  # type: ignore[no-untyped-call]
        backoff = Backoff(initial_s=1.0, max_s=60.0)
        failures = 0  # consecutive, reset by watch progress (not by a LIST alone)
        v1: Any = None
        try:
            while not stopping.is_set():
                stage = "load config"
                try:
                    if v1 is None:
                        v1 = self._connect()
                    stage = "list pods"
                    rv = self._list(v1)
                    stage = "watch pods"
                    for _ in self._watch(v1, watch, rv, stopping):
                        failures = 0
                        backoff.reset()
                    continue  # resync due (or stopping): relist
                except Exception as exc:
                    if stopping.is_set():
                        break
                    gone = getattr(exc, "status", None) == 410
                    where = f"{stage} ({v1.configuration.host})" if v1 else stage
                    message = f"{where}: {describe_error(exc)}"
                    failures += 1
                    if stage == "watch pods" and failures == 1:
                        # Watches end routinely (410, proxies, API restarts): relist now.
                        self._fail(message, mark_down=False, counted=not gone)
                        continue
                    self._fail(message, mark_down=True, counted=not gone)
                stopping.wait(backoff.next_delay())
        finally:
            if v1 is not None:
                with contextlib.suppress(Exception):
                    v1.close()

    def _connect(self) -> Any:
        """An ApiClient on a private Configuration, so nothing global is touched."""
        from kubernetes import client, config

        cfg = client.Configuration()
        if self._kubeconfig is None and _in_cluster():
            config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
        else:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=self._kubeconfig, client_configuration=cfg, persist_config=False
            )
        return client.ApiClient(configuration=cfg)

    def _get_pods(self, api: Any, **kwargs: Any) -> Any:
        """GET /api/v1/pods exactly as ``CoreV1Api.list_pod_for_all_namespaces`` builds
        it, without loading ``CoreV1Api``: that generated module alone costs ~21 MiB of
        resident memory, for the one call a node agent makes. Returns the raw urllib3
        response (what ``watch.stream`` and ``_list`` read); keyword names are the
        CoreV1Api ones, so ``watch.stream`` can call this in its place.
        """
        kwargs.pop("_preload_content", None)
        timeout = kwargs.pop("_request_timeout", None)
        query = [(_QUERY_NAMES[key], value) for key, value in kwargs.items() if value is not None]
        method, url, headers, body, post = api.param_serialize(
            "GET",
            "/api/v1/pods",
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = api.call_api(method, url, headers, body, post, _request_timeout=timeout)
        return response.response

    def _list(self, v1: Any) -> str:
        """LIST this node's pods, replace the whole set; returns the resourceVersion."""
        resp = self._get_pods(
            v1,
            field_selector=self._selector,
            _request_timeout=(CONNECT_TIMEOUT_S, LIST_READ_TIMEOUT_S),
        )
        try:
            if not 200 <= resp.status <= 299:
                from kubernetes.client.exceptions import ApiException

                raise ApiException(http_resp=resp)  # reads status, reason, body
            body = json.loads(resp.data)
        finally:
            resp.release_conn()
        rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        if not rv:
            raise ValueError("pod list without metadata.resourceVersion")
        pods: dict[str, PodMeta] = {}
        for item in body.get("items") or ():
            meta = pod_meta_from_dict(item) if isinstance(item, Mapping) else None
            if meta is not None:
                pods[meta.uid] = meta
        with self._lock:
            was_ok = self._ok
            self._pods = pods
            self._ok, self._error = True, None
            self._pods_changed_locked()
        if not was_ok:
            log.info("pod metadata: listed %d pods on node %s", len(pods), self._node)
        return rv

    def _watch(self, v1: Any, watch: Any, rv: str, stopping: threading.Event) -> Iterable[None]:
        """Watch windows from ``rv`` until a resync is due; yields on each sign of health
        (an event, a window that ended cleanly) and raises when the stream breaks."""
        resync_at = time.monotonic() + self._resync_s
        while not stopping.is_set():
            remaining = resync_at - time.monotonic()
            if remaining <= 0:
                return
            window = max(1, min(self._watch_timeout_s, math.ceil(remaining)))
            with self._lock:
                self._active_watch = watch
            try:
                if stopping.is_set():
                    return
                stream = watch.stream(
                    functools.partial(self._get_pods, v1),
                    field_selector=self._selector,
                    resource_version=rv,
                    timeout_seconds=window,
                    allow_watch_bookmarks=True,
                    _request_timeout=(CONNECT_TIMEOUT_S, window + WATCH_READ_GRACE_S),
                )
                for event in stream:
                    if stopping.is_set():
                        return
                    rv = self._apply(event) or rv
                    yield
            finally:
                with self._lock:
                    self._active_watch = None
            if stopping.is_set():
                return
            with self._lock:  # the window closed cleanly: the data is current as of now
                self._set_status_locked(self._ok, self._error)
            yield

    def _apply(self, event: Mapping[str, Any]) -> str | None:
        """Apply one watch event; returns the resourceVersion it carries."""
        obj = event.get("raw_object", event.get("object"))
        if not isinstance(obj, Mapping):
            return None
        new_rv = (obj.get("metadata") or {}).get("resourceVersion")
        kind = event.get("type")
        if kind in ("ADDED", "MODIFIED", "DELETED"):
            meta = pod_meta_from_dict(obj)
            if meta is not None:
                with self._lock:
                    if kind == "DELETED":
                        changed = self._pods.pop(meta.uid, None) is not None
                    else:
                        changed = self._pods.get(meta.uid) != meta
                        self._pods[meta.uid] = meta
                    if changed:
                        self._pods_changed_locked()
        return str(new_rv) if new_rv else None
