"""A node-scoped list + watch of one Kubernetes API collection, in one daemon thread.

Shared by the pod watch (``kube.PodWatcher``) and the ResourceSlice watch
(``resourceslices.ResourceSliceWatcher``): both list the objects of this node, then
watch from the list's resourceVersion, and relist on any break (410 Gone, a dropped
connection, an error) and every ``resync_s`` as a safety net. A subclass names the API
path and says how one object becomes a model value; everything that makes a watch
robust (backoff, the LIST budget, bounded watch lines, stopping an open stream, readable
errors) lives here once.

The thread is a small state machine (``Phase``): LIST (a first list, or a relist with a
reason), WATCH (one watch window), BACKOFF (a wait before the relist that follows a
failure). Every failure of either kind waits a jittered backoff (0.8 s doubling to
30 s, starting over only after 2 minutes without a failure: client-go's reflector), and
every LIST also needs a token of a per-watch budget (4 at once, one more per 30 s), so
no answer of the API server, however broken, makes the watch load it faster than that
(docs/reliability.md, "Watch pacing and the LIST budget").

``kubernetes`` is imported only inside the thread: it costs ~20 MiB of RSS and a second
of start-up (its generated ``CoreV1Api`` would cost another ~21 MiB, so the one request
we need is built through ``ApiClient``), and with ``--kube-api off`` it is never loaded.
Objects are read as raw JSON rather than the client's models: cheaper per event, and
immune to model validation tripping over fields a newer API server adds or omits. The
watch stream is read here too (``watch_stream``), not by ``kubernetes.watch.Watch``,
whose line reader buffers a line of any length.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import json
import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from exporter.model import SourceStatus, WatchCounts
from exporter.sources.backoff import Backoff, RateBudget
from exporter.sources.base import Cycle, Source, Supervisor
from exporter.sources.kube_http import (
    DeadlineExceeded,
    InFlight,
    bounded_api_client,
)
from exporter.sources.server_clock import ServerClock
from exporter.sources.watch_stream import (
    MAX_LINE_BYTES,
    LineTooLong,
    StreamBroken,
    WatchEvent,
    bounded_lines,
    parse_event,
    response_chunks,
    valid_resource_version,
)
from exporter.text import one_line

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 5.0
LIST_READ_TIMEOUT_S = 60.0
# A LIST's whole answer must have come within this (urllib3's read timeout bounds one
# read, not the answer): kube-apiserver itself ends a request after --request-timeout,
# 1 minute by default (https://kubernetes.io/docs/reference/command-line-tools-reference/
# kube-apiserver/). Over it, the request is cut and counts as a failed LIST.
LIST_DEADLINE_S = 60.0
# How long stop() waits for the thread: every request it may be in is cut at once, so it
# ends within moments, well inside the agent's close timeout (exporter/agent.py,
# CLOSE_TIMEOUT_S = 3 s). Only a TCP connect (CONNECT_TIMEOUT_S) cannot be cut; a thread
# still in one is left to end by itself (a daemon, it sees the stop when it returns).
STOP_WAIT_S = 2.0
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
# server was asked to keep open, so a half-open connection is still noticed. A window is
# also cut this long after it should have ended, whatever trickles in.
WATCH_READ_GRACE_S = 10.0
# A LIST answer is one node's objects: ~110 pods of a few KiB, a few ResourceSlices.
MAX_LIST_BYTES = 64 * 1024 * 1024

# Pacing, after client-go's reflector (tools/cache/reflector.go, NewReflectorWithOptions:
# NewExponentialBackoffManager(800ms, 30s, 2min, 2.0, 1.0)): every failure waits
# BACKOFF_INITIAL_S doubling to BACKOFF_MAX_S, drawn from [d * (1 - jitter), d], and the
# schedule starts over only after BACKOFF_QUIET_RESET_S without a failure.
BACKOFF_INITIAL_S = 0.8
BACKOFF_MAX_S = 30.0
BACKOFF_JITTER = 0.5
BACKOFF_QUIET_RESET_S = 120.0
# The LIST budget per watch: a bucket of LIST_BURST LISTs (a first LIST and three quick
# retries), refilled at one per LIST_PERIOD_S; a LIST waits for a token.
LIST_BURST = 4
LIST_PERIOD_S = 30.0
# Watch failures in a row, without a clean window between them, that mark the source
# down: its quick retries are spent, and what it serves is only as fresh as its last
# LIST (up to LIST_PERIOD_S old) until a watch window runs its course again.
FAILURES_DOWN = 4
# Malformed watch lines since the last clean window that, once they outnumber the good
# ones, mark the source down and break the stream off.
MALFORMED_DOWN = 10


def metadata_text(obj: Mapping[str, Any], field: str) -> str | None:
    """``metadata.<field>`` of an API object when it is a non-empty string; None for a
    missing or ill-typed one (a watch line is outside input: any shape may come)."""
    metadata = obj.get("metadata")
    value = metadata.get(field) if isinstance(metadata, Mapping) else None
    return value if isinstance(value, str) and value else None


def http_status(exc: BaseException) -> int | None:
    """The HTTP status of a ``kubernetes.client.ApiException``; None for other errors
    (and for the client's status 0, which means "no response")."""
    status = getattr(exc, "status", None)
    return status if isinstance(status, int) and status > 0 else None


def retry_after_s(exc: BaseException) -> float | None:
    """Seconds a 429 or 503 answer asks the client to wait (``Retry-After`` in seconds,
    RFC 9110 section 10.2.3); None for other answers and for a value that is not a
    number of seconds (an HTTP date is not honoured: the backoff applies)."""
    if http_status(exc) not in (429, 503):
        return None
    headers = getattr(exc, "headers", None)
    value = headers.get("Retry-After") if isinstance(headers, Mapping) else None
    try:
        seconds = float(value) if isinstance(value, str) and len(value) <= 16 else None
    except ValueError:
        return None
    return seconds if seconds is not None and 0 <= seconds < math.inf else None


def describe_error(exc: BaseException) -> str:
    """A one-line message for the kinds of failure the client raises.

    ``ApiException`` and urllib3's ``MaxRetryError`` stringify to multi-line or
    object-repr noise; an operator wants "HTTP 403 Forbidden: <server message>" or
    "ConnectionRefusedError: Connection refused".
    """
    if isinstance(exc, DeadlineExceeded):  # whatever the cut made the reading raise
        return one_line(f"request cut: {exc}")
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
    wrapped = exc  # the innermost error urllib3's wrappers (``reason``) lead to
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, OSError) and cur.strerror:
            root = cur
        reason_exc = getattr(cur, "reason", None)
        if isinstance(reason_exc, BaseException):
            wrapped = reason_exc
            # ProtocolError("Connection aborted.", RemoteDisconnected(...)) keeps its
            # cause among its arguments.
            args = reason_exc.args
            if len(args) == 2 and isinstance(args[1], BaseException):
                wrapped = args[1]
        cur = (
            reason_exc
            if isinstance(reason_exc, BaseException)
            else (cur.__cause__ or cur.__context__)
        )
    if root is not None:
        return one_line(f"{type(root).__name__}: {root.strerror}")
    # "MaxRetryError: ... Max retries exceeded" says nothing true (no request is retried)
    shown = wrapped if wrapped is not exc and str(wrapped) else exc
    return one_line(f"{type(shown).__name__}: {shown}" if str(shown) else type(shown).__name__)


class WatchSnapshot(Protocol):
    """What every snapshot a watch hands over has: ``status()`` is read from it."""

    @property
    def ok(self) -> bool: ...

    @property
    def error(self) -> str | None: ...

    @property
    def timestamp(self) -> float: ...


class Phase(enum.Enum):
    """Where the watch thread is; each has one function (``KubeWatchSource._step``)."""

    LIST = "list"  # a first LIST, or a relist (with the reason it is one)
    WATCH = "watch"  # one watch window from the last resourceVersion
    BACKOFF = "backoff"  # waiting after a failure; a relist follows


@dataclass(frozen=True, slots=True)
class Step:
    """The thread's next state: ``reason`` says why the coming LIST is a relist (one of
    ``RELIST_REASONS``; None for the first LIST), ``delay_s`` how long BACKOFF waits."""

    phase: Phase
    reason: str | None = None
    delay_s: float = 0.0


class MalformedStream(Exception):
    """Too many malformed watch lines: the stream is broken off and the source is down."""


class WatchEndedEarly(Exception):
    """The server ended a watch window cleanly, but long before the time asked for."""


class TooManyObjects(Exception):
    """More objects for this node than the ceiling (``max_objects``): the set is not
    handed over at all, rather than cut short."""


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
    fails (410, refused, cut, ended long before its time, a line over the size limit)
    is relisted after the backoff without clearing ``ok``: the relist is current data.
    The source goes down on a failed LIST, on ``FAILURES_DOWN`` watch failures in a row
    without a clean window between them, and on ``MALFORMED_DOWN`` malformed lines that
    outnumber the good ones; the last two stay down through relists until a watch window
    runs its course (``_watch_trouble``).
    """

    path: ClassVar[str]
    resource: ClassVar[str]
    singular: ClassVar[str]  # "pod": "waiting for the first pod list"
    thread_name: ClassVar[str]
    description: ClassVar[str]  # "pod metadata": what is missing while it is down
    # The most objects of this node kept; more make the source down with nothing in it.
    max_objects: ClassVar[int]
    # The field that names this node in an object of the collection (fieldSelector)
    node_field: ClassVar[str] = "spec.nodeName"
    # False: a cluster-wide collection (DeviceTaintRules): no fieldSelector is sent and
    # every object is this node's concern (``_for_this_node``)
    node_scoped: ClassVar[bool] = True
    # The largest LIST answer and watch line read; a bigger one fails the attempt
    max_list_bytes: ClassVar[int] = MAX_LIST_BYTES
    max_line_bytes: ClassVar[int] = MAX_LINE_BYTES

    def __init__(
        self,
        node_name: str,
        *,
        kubeconfig: str | None = None,
        resync_s: float = 300.0,
        watch_timeout_s: int = 60,
        list_deadline_s: float = LIST_DEADLINE_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if not node_name:
            raise ValueError("node_name must not be empty")
        if resync_s <= 0:
            raise ValueError(f"resync_s must be > 0, got {resync_s}")
        if watch_timeout_s < 1:
            raise ValueError(f"watch_timeout_s must be >= 1, got {watch_timeout_s}")
        if not list_deadline_s > 0:
            raise ValueError(f"list_deadline_s must be > 0, got {list_deadline_s}")
        self._node = node_name
        self._kubeconfig = kubeconfig
        self._resync_s = resync_s
        self._watch_timeout_s = watch_timeout_s
        self._list_deadline_s = list_deadline_s
        # Asked of the server, and checked here too: a server (or proxy) that ignores
        # the selector must not fill the cache with the whole cluster's objects.
        self._selector = f"{self.node_field}={node_name}" if self.node_scoped else None
        self._lock = threading.Lock()
        self._values: dict[str, V] = {}
        # The snapshot is built when read, at most once per change: an event costs a
        # dict update, not a sort of every object (a watch may bring thousands a second).
        self._items_tuple: tuple[I, ...] = ()
        self._items_dirty = False
        self._stamp = time.time()  # when the status or the objects last changed
        self._ok = False
        self._error: str | None = "not started"
        self._relists: dict[str, int] = {}  # by reason (RELIST_REASONS)
        self._dropped_lines: dict[str, int] = {}  # by reason (DROPPED_LINE_REASONS)
        self._snapshot_now: S | None = None  # None: to be built at the next read
        self._errors_total = 0
        # The watch thread's own state, kept across restarts of its loop so that a
        # restart never refills the LIST budget or forgets the backoff.
        self._backoff = Backoff(
            initial_s=BACKOFF_INITIAL_S,
            max_s=BACKOFF_MAX_S,
            jitter=BACKOFF_JITTER,
            quiet_reset_s=BACKOFF_QUIET_RESET_S,
        )
        self._list_budget = RateBudget(burst=LIST_BURST, period_s=LIST_PERIOD_S)
        self._api: Any = None  # kubernetes.client.ApiClient once configured
        self._rv = ""  # the resourceVersion to watch from
        self._resync_at = 0.0  # monotonic time of the next scheduled relist
        self._watch_failures = 0  # in a row, since the last clean watch window
        self._lines_good = 0  # watch lines since the last clean window, for the
        self._lines_bad = 0  # malformed-share rule (MALFORMED_DOWN)
        self._watch_trouble: str | None = None  # why the watch keeps the source down
        self._absent: str | None = None  # why the collection is empty by design, if it is
        self._first_result = threading.Event()  # a first LIST succeeded or failed
        self._in_flight: InFlight | None = None  # the request being made, to cut at stop()
        self._retry_after_capped = False  # said once that a Retry-After was cut short
        self._foreign_logged = False  # said once that the server sent other nodes' objects
        self._watch_accepted = False  # the last watch request was answered 2xx (thread's)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        # A working watch ends a window every watch_timeout_s and relists every
        # resync_s (a collection not served here is asked about as seldom): the resync
        # is its period for staleness (exporter/sources/base.py).
        self._supervisor = Supervisor(self.name, resync_s)
        # The API server's clock, from its answers' Date headers: times it stamps are
        # compared on it (server_clock.py).
        self._server_clock = ServerClock(wall_clock)

    # -- subclass hooks ----------------------------------------------------------------

    def _key(self, obj: Mapping[str, Any]) -> str | None:
        """The object's identity in this collection (None: not one we can track); by
        default its name, unique for cluster-scoped objects (Nodes, ResourceSlices,
        DeviceTaintRules)."""
        return metadata_text(obj, "name")

    def _convert(self, obj: Mapping[str, Any]) -> V | None:
        """The model value of one object; None: the object is not of interest (it is
        then dropped, so an object modified out of interest disappears)."""
        raise NotImplementedError

    def _items(self, values: Iterable[V]) -> tuple[I, ...]:
        """The current values as the snapshot's items, in a stable order."""
        raise NotImplementedError

    def _snapshot(
        self,
        ok: bool,
        timestamp: float,
        error: str | None,
        items: tuple[I, ...],
        counts: WatchCounts,
    ) -> S:
        raise NotImplementedError

    def _explain(self, exc: BaseException) -> str:
        """One line saying what failed; subclasses add what to do about known causes."""
        return describe_error(exc)

    def _retry_delay(self, exc: BaseException, backoff: Backoff) -> float:
        """Seconds to wait before the next attempt after ``exc`` marked the source down."""
        return backoff.next_delay()

    def _for_this_node(self, obj: Mapping[str, Any]) -> bool:
        """Whether ``obj`` is one the field selector asked for (``node_field``); every
        object of a collection that is not ``node_scoped``."""
        if not self.node_scoped:
            return True
        outer, _, inner = self.node_field.partition(".")
        part = obj.get(outer)
        return isinstance(part, Mapping) and part.get(inner) == self._node

    def _collection_path(self) -> str:
        """The collection's URL path for the next request: ``path``, unless a subclass
        picks its version at run time (DeviceTaintRules)."""
        return self.path

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

    @property
    def server_clock(self) -> ServerClock:
        """The API server's clock as its answers' Date headers tell it."""
        return self._server_clock

    def snapshot(self) -> S:
        """The current snapshot: the same object until something changes, built here
        (sorting the objects only when they changed since the last one)."""
        with self._lock:
            snap = self._snapshot_now
            if snap is None:
                if self._items_dirty:
                    self._items_tuple = self._items(self._values.values())
                    self._items_dirty = False
                snap = self._snapshot(
                    self._ok, self._stamp, self._error, self._items_tuple, self._counts_locked()
                )
                self._snapshot_now = snap
            return snap

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

    def stop(self, timeout: float = STOP_WAIT_S) -> None:
        """End the thread, cutting the request it is in (a LIST, a watch stream, one
        not answered yet) so it need not time out."""
        self._stopping.set()
        thread, self._thread = self._thread, None
        if thread is None:
            return
        deadline = time.monotonic() + timeout
        while thread.is_alive() and time.monotonic() < deadline:
            # Repeated: a request made just after the first stop() call would miss it.
            with self._lock:
                flight = self._in_flight
            if flight is not None:
                flight.cut()
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
        self._stamp = time.time()
        self._snapshot_now = None

    def _values_changed_locked(self) -> None:
        """O(1): the sorted items are rebuilt by the next ``snapshot()``."""
        self._items_dirty = True
        self._set_status_locked(self._ok, self._error)

    def _overfull(self) -> None:
        """Over the ceiling: hand over nothing (unknown), never a set cut short."""
        with self._lock:
            self._values = {}
            self._values_changed_locked()

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
            self._values_changed_locked()
            self._set_status_locked(True, None)
        self._first_result.set()
        if first:
            log.info("%s: %s; nothing to watch, asking again later", self.description, message)

    # -- worker thread -----------------------------------------------------------------

    def _run(self, stopping: threading.Event) -> None:
        """The watch thread: one ``Step`` after another until ``stopping`` is set."""
        try:
            import kubernetes  # noqa: F401 -- only to say so once if it is missing
        except ImportError as exc:
            with self._lock:
                self._set_status_locked(False, f"kubernetes client unavailable: {exc}")
            self._first_result.set()
            return
        step = Step(Phase.LIST)
        try:
            while not stopping.is_set():
                step = self._step(step, stopping)
        finally:
            api, self._api = self._api, None
            if api is not None:
                with contextlib.suppress(Exception):
                    api.close()

    def _step(self, step: Step, stopping: threading.Event) -> Step:
        """Run one state; returns the next."""
        if step.phase is Phase.LIST:
            return self._list_step(step.reason, stopping)
        if step.phase is Phase.WATCH:
            return self._watch_step(stopping)
        stopping.wait(step.delay_s)  # BACKOFF
        return Step(Phase.LIST, step.reason)

    def _list_step(self, reason: str | None, stopping: threading.Event) -> Step:
        """LIST once the budget allows: WATCH next, or BACKOFF when it failed."""
        wait_s = self._list_budget.wait_s()
        if wait_s > 0:
            log.debug("%s: LIST budget spent, next LIST in %.1f s", self.thread_name, wait_s)
            stopping.wait(wait_s)
            return Step(Phase.LIST, reason)
        self._list_budget.take()
        if reason is not None:
            self._count(self._relists, reason)
        stage = "load config"
        try:
            if self._api is None:
                self._api = self._connect()
            stage = f"list {self.resource}"
            self._rv = self._list(self._api)
        except Exception as exc:
            if stopping.is_set():
                return Step(Phase.LIST)
            message = f"{self._where(stage)}: {self._explain(exc)}"
            if isinstance(exc, TooManyObjects):
                self._overfull()
            if self._not_served(exc):
                self._empty(message)
            else:
                self._fail(message, mark_down=True, counted=True)
            delay = self._retry_delay(exc, self._backoff)
            return Step(Phase.BACKOFF, "list_failed", self._asked_delay(exc, delay))
        self._resync_at = time.monotonic() + self._resync_s
        return Step(Phase.WATCH)

    def _watch_step(self, stopping: threading.Event) -> Step:
        """One watch window: WATCH again after a clean one, LIST when a resync is due,
        BACKOFF after a failure."""
        remaining = self._resync_at - time.monotonic()
        if remaining <= 0:
            return Step(Phase.LIST, "resync")
        window = max(1, min(self._watch_timeout_s, math.ceil(remaining)))
        began = time.monotonic()
        try:
            self._watch_window(window, stopping)
            lasted = time.monotonic() - began
            if not stopping.is_set() and lasted < window / 2:
                raise WatchEndedEarly(
                    f"the server ended the watch after {lasted:.1f} s of the {window} s asked"
                )
        except Exception as exc:
            if stopping.is_set():
                return Step(Phase.WATCH)
            return self._watch_failed(exc)
        if not stopping.is_set():
            self._watch_healthy()
        return Step(Phase.WATCH)

    def _watch_failed(self, exc: BaseException) -> Step:
        """Count a failed watch, mark the source down when the rules say so, and back
        off before the relist."""
        gone = http_status(exc) == 410
        if isinstance(exc, LineTooLong):
            self._count(self._dropped_lines, "oversize")
        if isinstance(exc, TooManyObjects):
            self._overfull()
        reason = (
            "bad_stream"
            if isinstance(exc, (LineTooLong, MalformedStream, TooManyObjects))
            else "expired"
            if gone
            else "watch_failed"
        )
        self._watch_failures += 1
        where = self._where(f"watch {self.resource}")
        message = f"{where}: {self._explain(exc)}"
        if isinstance(exc, (MalformedStream, TooManyObjects)):
            trouble: str | None = message
        elif self._watch_failures >= FAILURES_DOWN:
            trouble = (
                f"{where}: {FAILURES_DOWN} failures in a row without a clean watch window; "
                f"last: {self._explain(exc)}"
            )
        else:
            trouble = None
        if trouble is None:
            # 410 Gone is routine (one resourceVersion spans all collections, so a quiet
            # watch can be outrun by others' events); the rest are errors.
            self._fail(message, mark_down=False, counted=not gone)
        else:
            with self._lock:
                newly = self._watch_trouble is None
                self._watch_trouble = trouble
            # A 410 loop costs one counted error when it takes the source down.
            self._fail(trouble, mark_down=True, counted=not gone or newly)
        return Step(Phase.BACKOFF, reason, self._asked_delay(exc, self._backoff.next_delay()))

    def _asked_delay(self, exc: BaseException, delay: float) -> float:
        """``delay``, or longer when a 429/503 answer asked for it (``Retry-After``),
        but never over the backoff's ceiling: a server that asks for a day must not
        switch the watch off for a day (said once, when it first happens)."""
        asked = retry_after_s(exc)
        if asked is None:
            return delay
        if asked > BACKOFF_MAX_S and not self._retry_after_capped:
            self._retry_after_capped = True
            log.warning(
                "%s: the API server asked to wait %.0f s before the next request "
                "(HTTP %s, Retry-After); waiting at most %.0f s",
                self.description,
                asked,
                http_status(exc),
                BACKOFF_MAX_S,
            )
        return max(delay, min(asked, BACKOFF_MAX_S))

    def _watch_healthy(self) -> None:
        """A window ran its course: the data is current as of now, and failures and
        malformed lines before it are forgiven (the backoff forgets by time alone)."""
        self._watch_failures = 0
        self._lines_good = self._lines_bad = 0
        with self._lock:
            trouble, self._watch_trouble = self._watch_trouble, None
            if trouble is not None:
                self._set_status_locked(True, None)
            else:
                self._set_status_locked(self._ok, self._error)
        if trouble is not None:
            log.info("%s source up again: a watch window ran its course", self.description)

    def _where(self, stage: str) -> str:
        return f"{stage} ({self._api.configuration.host})" if self._api is not None else stage

    def _count(self, counts: dict[str, int], reason: str) -> None:
        """One more relist or dropped line; the snapshot carries the new totals."""
        with self._lock:
            counts[reason] = counts.get(reason, 0) + 1
            self._snapshot_now = None  # the next one carries the new totals

    def _counts_locked(self) -> WatchCounts:
        return WatchCounts(
            relists=tuple(sorted(self._relists.items())),
            dropped_lines=tuple(sorted(self._dropped_lines.items())),
        )

    def _connect(self) -> Any:
        """An ApiClient that makes one request per call, each reachable by
        ``InFlight.cut`` (``kube_http.bounded_api_client``)."""
        return bounded_api_client(self._kubeconfig)

    @contextlib.contextmanager
    def _bounded(self, deadline_s: float, what: str) -> Iterator[InFlight]:
        """A request and the reading of its answer, cut at ``deadline_s`` or stop()."""
        flight = InFlight(deadline_s, what)
        with self._lock:
            self._in_flight = flight
        try:
            with flight:
                yield flight
        finally:
            with self._lock:
                self._in_flight = None

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
            self._collection_path(),
            query_params=query,
            header_params={"Accept": "application/json"},
            auth_settings=["BearerToken"],
        )
        response = api.call_api(method, url, headers, body, post, _request_timeout=timeout)
        return response.response

    def _list(self, api: Any) -> str:
        """LIST this node's objects, replace the whole set; returns the resourceVersion.
        The source is up after it unless the watch keeps it down (``_watch_trouble``)."""
        with self._bounded(self._list_deadline_s, f"list {self.resource}") as flight:
            resp = self._get(
                api,
                field_selector=self._selector,
                _request_timeout=(CONNECT_TIMEOUT_S, LIST_READ_TIMEOUT_S),
            )
            flight.attach_response(resp)
            try:
                if not 200 <= resp.status <= 299:
                    raise _api_exception(resp)
                self._server_clock.observe(resp.headers)  # the list's snapshot reads it
                body = json.loads(_read_bounded(resp, self.max_list_bytes))
            except BaseException:
                resp.close()  # perhaps not read to its end: never reuse the connection
                raise
            finally:
                resp.release_conn()
        if not isinstance(body, Mapping):
            raise ValueError(f"{self.resource} list that is not a JSON object")
        metadata = body.get("metadata")
        rv = metadata.get("resourceVersion") if isinstance(metadata, Mapping) else None
        if not valid_resource_version(rv):
            raise ValueError(f"{self.resource} list without a valid metadata.resourceVersion")
        assert isinstance(rv, str)
        values: dict[str, V] = {}
        foreign = 0
        for item in body.get("items") or ():
            if not isinstance(item, Mapping):
                continue
            if not self._for_this_node(item):
                foreign += 1
                continue
            key, value = self._key(item), self._convert(item)
            if key is not None and value is not None:
                values[key] = value
                if len(values) > self.max_objects:
                    raise self._too_many()
        if foreign:
            self._other_nodes()
        with self._lock:
            was_ok = self._ok and self._absent is None
            self._absent = None
            self._values = values
            trouble = self._watch_trouble
            self._ok, self._error = (False, trouble) if trouble else (True, None)
            self._values_changed_locked()
        self._first_result.set()
        if not was_ok and trouble is None:
            log.info(
                "%s: listed %d %s on node %s",
                self.description,
                len(values),
                self.resource,
                self._node,
            )
        return rv

    def _watch_window(self, window: int, stopping: threading.Event) -> None:
        """Read one watch window from ``_rv``, applying events; returns when the server
        ends it (or on stop) and raises when it fails."""
        deadline_s = window + WATCH_READ_GRACE_S
        with self._bounded(deadline_s, f"watch {self.resource}") as flight:
            response = self._open_watch(
                self._api,
                watch=True,
                field_selector=self._selector,
                resource_version=self._rv,
                timeout_seconds=window,
                allow_watch_bookmarks=True,
                _request_timeout=(CONNECT_TIMEOUT_S, deadline_s),
            )
            flight.attach_response(response)
            try:
                if not 200 <= response.status <= 299:
                    raise _api_exception(response)
                self._server_clock.observe(response.headers)
                with self._lock:
                    self._snapshot_now = None  # it carries the server's clock offset
                for line in bounded_lines(response_chunks(response), self.max_line_bytes):
                    if stopping.is_set():
                        return
                    self._take_line(line)
            finally:
                # Closed, not drained: after a line over the limit the rest is never read.
                response.close()
                response.release_conn()

    def _take_line(self, line: bytes) -> None:
        """Apply one watch line, or count it as malformed (raising ``MalformedStream``
        once malformed lines pass ``MALFORMED_DOWN`` and outnumber the good ones)."""
        try:
            event = parse_event(line)
        except StreamBroken:
            self._malformed_line()
            raise
        if event is None:
            self._malformed_line()
            return
        self._lines_good += 1
        if event.kind == "BOOKMARK":  # only a newer version to resume from
            self._rv = event.resource_version or self._rv
            return
        self._rv = self._apply(event) or self._rv

    def _malformed_line(self) -> None:
        self._count(self._dropped_lines, "malformed")
        self._lines_bad += 1
        bad, seen = self._lines_bad, self._lines_bad + self._lines_good
        if bad >= MALFORMED_DOWN and bad > self._lines_good:
            raise MalformedStream(
                f"{bad} of the {seen} watch lines since the last clean watch window "
                "were malformed (not JSON, or no usable event)"
            )
        log.debug("%s: skipped a malformed watch line", self.thread_name)

    def _open_watch(self, api: Any, **kwargs: Any) -> Any:
        """``_get`` for a watch, noting whether the server accepted it."""
        response = self._get(api, **kwargs)
        self._watch_accepted = 200 <= response.status <= 299
        return response

    def _apply(self, event: WatchEvent) -> str | None:
        """Apply one ADDED/MODIFIED/DELETED event; returns the resourceVersion it
        carries. An object without a key we can track is skipped."""
        obj = event.obj
        key = self._key(obj)
        if key is None:
            return event.resource_version
        if event.kind == "DELETED":
            value = None
        elif self._for_this_node(obj):
            value = self._convert(obj)
        else:  # another node's (the selector ignored), or moved off this one: gone here
            self._other_nodes()
            value = None
        with self._lock:
            if value is None:
                changed = self._values.pop(key, None) is not None
            elif key not in self._values and len(self._values) >= self.max_objects:
                raise self._too_many()
            else:
                changed = self._values.get(key) != value
                self._values[key] = value
            if changed:
                self._values_changed_locked()
        return event.resource_version

    def _too_many(self) -> TooManyObjects:
        return TooManyObjects(
            f"more than {self.max_objects} {self.resource} for node {self._node}: "
            f"nothing is handed over rather than a part"
        )

    def _other_nodes(self) -> None:
        """The server sent objects of other nodes, despite the field selector: dropped
        here; said once, for it is the server (or a proxy) that needs fixing."""
        if self._foreign_logged:
            return
        self._foreign_logged = True
        log.warning(
            "%s: the API server sent %s of other nodes despite fieldSelector=%s; they "
            "are dropped, but each still costs a parse here: check the API server or "
            "a proxy in between",
            self.description,
            self.resource,
            self._selector,
        )


def _read_bounded(response: Any, limit: int) -> bytes:
    """The whole body of ``response``, refused once it passes ``limit`` bytes."""
    body = bytearray()
    for chunk in response_chunks(response):
        body += chunk
        if len(body) > limit:
            raise ValueError(f"answer larger than {limit // (1024 * 1024)} MiB")
    return bytes(body)


def _api_exception(response: Any) -> Exception:
    """``kubernetes.client.ApiException`` for an error answer, its body read up to
    64 KiB (the message is cut to one line anyway)."""
    from kubernetes.client.exceptions import ApiException

    body = response.read(64 * 1024)
    exc = ApiException(
        status=response.status,
        reason=response.reason,
        body=body.decode("utf-8", errors="replace") if isinstance(body, bytes) else body,
    )
    exc.headers = response.headers  # Retry-After, for retry_after_s
    return exc
