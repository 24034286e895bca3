"""A node-scoped list + watch of one Kubernetes API collection, in one daemon thread.

Shared by the pod watch (``kube.PodWatcher``) and the ResourceSlice watch
(``resourceslices.ResourceSliceWatcher``): both list the objects of this node, then
watch from the list's resourceVersion, and relist on any break (410 Gone, a dropped
connection, an error) and every ``resync_s`` as a safety net. A subclass names the API
path and says how one object becomes a model value; everything that makes a watch
robust (backoff, stopping an open stream, readable errors) lives here once.

``kubernetes`` is imported only inside the thread: it costs ~20 MiB of RSS and a second
of start-up (its generated ``CoreV1Api`` would cost another ~21 MiB, so the one request
we need is built through ``ApiClient``), and with ``--kube-api off`` it is never loaded.
Objects are read as raw JSON rather than the client's models: cheaper per event, and
immune to model validation tripping over fields a newer API server adds or omits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from exporter.model import SourceStatus
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle, Source, Supervisor
from exporter.text import one_line

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
LIST_READ_TIMEOUT_S = 60.0
# Client keyword (as the generated API functions name them) -> query parameter, for
# the list and watch requests; ``watch.stream`` passes the same keywords.
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


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a ``kubernetes.client.ApiException``; None for other errors
    (and for the client's status 0, which means "no response")."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) and status > 0 else None


def describe_error(exc: BaseException) -> str:
    """A one-line message for the kinds of failure the client raises.

    ``ApiException`` and urllib3's ``MaxRetryError`` stringify to multi-line or
    object-repr noise; an operator wants "HTTP 403 Forbidden: <server message>" or
    "ConnectionRefusedError: Connection refused".
    """
    status = http_status(exc)
    if status is not None:  # kubernetes.client.ApiException
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
        return one_line(f"{text}: {message}" if message else text)
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
        return one_line(f"{type(root).__name__}: {root.strerror}")
    return one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)


def _in_cluster() -> bool:
    return bool(
        os.environ.get("KUBERNETES_SERVICE_HOST") and os.environ.get("KUBERNETES_SERVICE_PORT")
    )


class WatchSnapshot(Protocol):
    """What every snapshot a watch hands over has: ``status()`` is read from it."""

    @property
    def ok(self) -> bool: ...

    @property
    def error(self) -> str | None: ...


V = TypeVar("V")  # the model value one API object turns into (a PodMeta, a slice's devices)
I = TypeVar("I")  # noqa: E741 -- one item of the snapshot (a PodMeta, a SliceDevice)
S = TypeVar("S", bound=WatchSnapshot)  # the snapshot read() hands over


class KubeWatchSource(Source, Generic[V, I, S]):
    """Keeps the objects of one collection on one node current; ``snapshot()`` is cheap
    and thread-safe.

    Subclasses set ``path`` (the collection's URL), ``resource`` (its plural, used in
    messages: "list pods (https://...): HTTP 403 ..."), ``singular``, ``thread_name``
    and ``description``, and implement ``_key``/``_convert`` (one object -> its key and
    model value), ``_items`` (the current values -> the snapshot's sorted items) and
    ``_snapshot``. ``_explain`` and ``_retry_delay`` may say more about a failure.

    ``ok`` is True once a LIST succeeded and no attempt since has failed. A watch that
    breaks (410, a connection dropped after the server accepted the watch) is relisted
    at once without clearing ``ok``; only a failed LIST, or a watch failing again before
    any progress for another reason (refused, unreachable; then retried with backoff,
    1 s doubling to 60 s), marks the source down. Repeated breaks relist with the same
    backoff but leave the source up: each relist is current data.
    """

    path: ClassVar[str]
    resource: ClassVar[str]
    singular: ClassVar[str]  # "pod": "waiting for the first pod list"
    thread_name: ClassVar[str]
    description: ClassVar[str]  # "pod metadata": what is missing while it is down

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
        self._values: dict[str, V] = {}
        self._items_tuple: tuple[I, ...] = ()
        self._ok = False
        self._error: str | None = "not started"
        self._snapshot_now = self._snapshot(False, time.time(), self._error, ())
        self._errors_total = 0
        self._absent: str | None = None  # why the collection is empty by design, if it is
        self._first_result = threading.Event()  # a first LIST succeeded or failed
        self._active_watch: Any = None  # kubernetes.watch.Watch while a stream is open
        self._watch_accepted = False  # the last watch request was answered 2xx (thread's)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # A working watch ends a window every watch_timeout_s and relists every
        # resync_s (a collection not served here is asked about as seldom): the resync
        # is its period for staleness (exporter/sources/base.py).
        self._supervisor = Supervisor(self.name, resync_s)

    # -- subclass hooks ----------------------------------------------------------------

    def _key(self, obj: Mapping[str, Any]) -> str | None:
        """The object's identity in this collection (None: not one we can track)."""
        raise NotImplementedError

    def _convert(self, obj: Mapping[str, Any]) -> V | None:
        """The model value of one object; None: the object is not of interest (it is
        then dropped, so an object modified out of interest disappears)."""
        raise NotImplementedError

    def _items(self, values: Iterable[V]) -> tuple[I, ...]:
        """The current values as the snapshot's items, in a stable order."""
        raise NotImplementedError

    def _snapshot(self, ok: bool, timestamp: float, error: str | None, items: tuple[I, ...]) -> S:
        raise NotImplementedError

    def _explain(self, exc: BaseException) -> str:
        """One line saying what failed; subclasses add what to do about known causes."""
        return describe_error(exc)

    def _retry_delay(self, exc: BaseException, backoff: Backoff) -> float:
        """Seconds to wait before the next attempt after ``exc`` marked the source down."""
        return backoff.next_delay()

    def _not_served(self, exc: BaseException) -> bool:
        """True when ``exc`` says this cluster has no such collection at all (an API
        that is optional, like DRA): then the source is up with nothing in it."""
        return False

    # -- public ------------------------------------------------------------------------

    @property
    def node_name(self) -> str:
        return self._node

    @property
    def errors_total(self) -> int:
        """Failed list/watch attempts so far (410 Gone is routine and not counted), and
        exceptions that escaped the thread's loop."""
        with self._lock:
            return self._errors_total + self._supervisor.crashes

    def snapshot(self) -> S:
        """The current snapshot: the same object until something changes."""
        with self._lock:
            return self._snapshot_now

    def read(self, cycle: Cycle) -> S:
        """A background source: the cycle only takes what the thread keeps current."""
        return self.snapshot()

    def status(self) -> SourceStatus:
        snap = self.snapshot()
        return self._supervisor.judge(SourceStatus(self.name, snap.ok, snap.error))

    async def prime(self, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the first LIST to succeed or fail, so the first
        cycle has names (or says why not); returns at once when not started."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while (
            self._thread is not None and not self._first_result.is_set() and loop.time() < deadline
        ):
            await asyncio.sleep(0.02)

    def start(self) -> None:
        """Start the watch thread; a no-op while it runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        stopping = threading.Event()
        self._stopping = stopping
        with self._lock:
            self._set_status_locked(False, f"waiting for the first {self.singular} list")
        self._thread = threading.Thread(
            target=self._supervisor.run_thread,
            args=(functools.partial(self._run, stopping), stopping, Backoff(max_s=60.0)),
            name=self.thread_name,
            daemon=True,
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
            log.warning("%s thread did not stop within %.1f s", self.thread_name, timeout)

    def close(self) -> None:
        self.stop()

    # -- state -------------------------------------------------------------------------

    def _set_status_locked(self, ok: bool, error: str | None) -> None:
        if ok:  # listed, or the watch made progress: current data
            self._supervisor.success()
        self._ok, self._error = ok, error
        self._snapshot_now = self._snapshot(ok, time.time(), error, self._items_tuple)

    def _values_changed_locked(self) -> None:
        self._items_tuple = self._items(self._values.values())
        self._set_status_locked(self._ok, self._error)

    def _fail(self, message: str, *, mark_down: bool, counted: bool) -> None:
        with self._lock:
            if counted:
                self._errors_total += 1
            was_ok, previous = self._ok, self._error
            if mark_down:
                self._set_status_locked(False, message)
        if mark_down:
            self._first_result.set()
        if mark_down and (was_ok or previous != message):  # once per distinct failure
            log.warning("%s source down: %s", self.description, message)
        else:
            log.debug("%s: %s", self.thread_name, message)

    def _empty(self, message: str) -> None:
        """The collection does not exist here: up, nothing in it, said once at INFO."""
        with self._lock:
            first = self._absent is None
            self._absent = message
            self._values = {}
            self._items_tuple = self._items(())
            self._set_status_locked(True, None)
        self._first_result.set()
        if first:
            log.info("%s: %s; nothing to watch, asking again later", self.description, message)

    # -- worker thread -----------------------------------------------------------------

    def _run(self, stopping: threading.Event) -> None:
        try:
            from kubernetes import watch as k8s_watch
        except ImportError as exc:
            with self._lock:
                self._set_status_locked(False, f"kubernetes client unavailable: {exc}")
            self._first_result.set()
            return
        # return_type "object": events keep raw dicts, no model deserialisation.
        watch = k8s_watch.Watch(return_type="object")  # type: ignore[no-untyped-call]
        backoff = Backoff(initial_s=1.0, max_s=60.0)
        failures = 0  # consecutive, reset by watch progress (not by a LIST alone)
        api: Any = None
        try:
            while not stopping.is_set():
                stage = "load config"
                try:
                    if api is None:
                        api = self._connect()
                    stage = f"list {self.resource}"
                    rv = self._list(api)
                    stage = f"watch {self.resource}"
                    for _ in self._watch(api, watch, rv, stopping):
                        failures = 0
                        backoff.reset()
                    continue  # resync due (or stopping): relist
                except Exception as exc:
                    if stopping.is_set():
                        break
                    gone = http_status(exc) == 410
                    where = f"{stage} ({api.configuration.host})" if api else stage
                    message = f"{where}: {self._explain(exc)}"
                    if self._not_served(exc):
                        self._empty(message)
                        stopping.wait(self._retry_delay(exc, backoff))
                        continue
                    failures += 1
                    broke = stage.startswith("watch") and self._watch_accepted
                    if stage.startswith("watch") and (failures == 1 or gone or broke):
                        # Watches end routinely (410, proxies, API restarts): relist now.
                        # 410 Gone is never an outage: the relist is current data. (One
                        # resourceVersion spans all collections, so a quiet watch can be
                        # outrun by others' events again and again.) Nor is a watch the
                        # server accepted and a proxy then cut. Repeated ones wait.
                        self._fail(message, mark_down=False, counted=not gone)
                        if failures > 1:
                            stopping.wait(backoff.next_delay())
                        continue
                    self._fail(message, mark_down=True, counted=not gone)
                    stopping.wait(self._retry_delay(exc, backoff))
        finally:
            if api is not None:
                with contextlib.suppress(Exception):
                    api.close()

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

    def _get(self, api: Any, **kwargs: Any) -> Any:
        """GET ``path`` exactly as the generated ``list_*`` functions build it, without
        loading their modules (``CoreV1Api`` alone costs ~21 MiB of resident memory,
        for the one call a node agent makes). Returns the raw urllib3 response (what
        ``watch.stream`` and ``_list`` read); keyword names are the generated ones, so
        ``watch.stream`` can call this in their place.
        """
        kwargs.pop("_preload_content", None)
        timeout = kwargs.pop("_request_timeout", None)
        query = [(_QUERY_NAMES[key], value) for key, value in kwargs.items() if value is not None]
        method, url, headers, body, post = api.param_serialize(
            "GET",
            self.path,
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = api.call_api(method, url, headers, body, post, _request_timeout=timeout)
        return response.response

    def _list(self, api: Any) -> str:
        """LIST this node's objects, replace the whole set; returns the resourceVersion."""
        resp = self._get(
            api,
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
            raise ValueError(f"{self.resource} list without metadata.resourceVersion")
        values: dict[str, V] = {}
        for item in body.get("items") or ():
            if not isinstance(item, Mapping):
                continue
            key, value = self._key(item), self._convert(item)
            if key is not None and value is not None:
                values[key] = value
        with self._lock:
            was_ok = self._ok and self._absent is None
            self._absent = None
            self._values = values
            self._ok, self._error = True, None
            self._values_changed_locked()
        self._first_result.set()
        if not was_ok:
            log.info(
                "%s: listed %d %s on node %s",
                self.description,
                len(values),
                self.resource,
                self._node,
            )
        return rv

    def _watch(self, api: Any, watch: Any, rv: str, stopping: threading.Event) -> Iterable[None]:
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
                self._watch_accepted = False
                stream = watch.stream(
                    functools.partial(self._open_watch, api),
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

    def _open_watch(self, api: Any, **kwargs: Any) -> Any:
        """``_get`` for ``watch.stream``, noting whether the server accepted the watch."""
        response = self._get(api, **kwargs)
        self._watch_accepted = 200 <= response.status <= 299
        return response

    def _apply(self, event: Any) -> str | None:
        """Apply one watch event; returns the resourceVersion it carries. The client
        hands over a line that is not JSON as None: skipped, like any event without an
        object, rather than breaking a healthy watch."""
        if not isinstance(event, Mapping):
            log.debug("%s: skipped a malformed watch event", self.thread_name)
            return None
        obj = event.get("raw_object", event.get("object"))
        if not isinstance(obj, Mapping):
            return None
        new_rv = (obj.get("metadata") or {}).get("resourceVersion")
        kind = event.get("type")
        key = self._key(obj) if kind in ("ADDED", "MODIFIED", "DELETED") else None
        if key is not None:
            value = None if kind == "DELETED" else self._convert(obj)
            with self._lock:
                if value is None:
                    changed = self._values.pop(key, None) is not None
                else:
                    changed = self._values.get(key) != value
                    self._values[key] = value
                if changed:
                    self._values_changed_locked()
        return str(new_rv) if new_rv else None
