"""The one thread that writes to the API server: Events, the node condition, taints.

The sample cycle calls ``offer(analysis)`` and goes on: it computes what to tell (pure,
microseconds) and hands it over under a lock, never waiting on the network. Everything
else happens here, one request at a time, each with a deadline:

- **Bounded**: at most ``MAX_WAITING_INTENTS`` Event intents wait between two turns of
  the thread (the rest are dropped and counted); the condition and the taints are one
  desired state each, the latest replacing the one before.
- **Retried with backoff**: a request with no answer (refused, reset, past its
  deadline) or a 429/5xx is tried again after 1, 2, 4 ... ``MAX_BACKOFF_S`` seconds,
  at most ``MAX_TRIES`` times. While backing off, new Events are dropped and counted,
  never queued: the API server that is down gets one request per backoff step and kind
  of write (Events, the condition, the taints: at most three a minute once the backoff
  reaches 60 s) from this node, not a burst of everything that happened meanwhile. The
  kinds back off separately, so a refused condition does not silence the Events.
- **Counted**: ``gpu_exporter_events_total{reason,result}`` and
  ``gpu_exporter_kube_writes_total{kind,result}``; each kind of failure logged once
  per minute (exporter/logs.py).
- **Budgeted**: Events by the recorder's node budget; the node condition and each
  DeviceTaintRule by a token bucket (budget.py). A write that finds no token is
  deferred (``result="deferred"``, once per wait), never queued: the latest desired
  state is sent when a token comes.
- **Sent or shadowed in one place** (``_shadowed``): with ``--kube-writes shadow`` a
  write is computed, budgeted and remembered exactly as if it had been sent, then only
  counted (``gpu_exporter_kube_writes_shadowed_total{kind,reason}``) and logged. Reads
  (the Node's condition, the rule list) still happen. With a writer Lease
  (lease.py) a write is sent while this process holds it, shadowed only while another
  holder is known to write (``standby`` within that holder's renew deadline), and
  otherwise (``unknown``: a Lease outage, a holder gone quiet) held: it waits, bounded
  as everything here, until one of the two is known (``_route``).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, cast

from exporter.model import Analysis
from exporter.reporting.budget import CONDITION_BURST, CONDITION_PER_MINUTE, RuleBudgets
from exporter.reporting.condition import (
    CONDITION_TYPE,
    NodeCondition,
    SentCondition,
    condition_body,
    condition_due,
    desired_condition,
)
from exporter.reporting.device_taints import (
    ExistingRule,
    Published,
    Stale,
    TaintRule,
    desired_rules,
    existing_rule,
    healthy_devices,
    label_selector,
    made_rule,
    published_devices,
    rule_body,
    stale_rules,
)
from exporter.reporting.events import EventIntent, ObjectRef, event_intents
from exporter.reporting.lease import LeaseClient, LeaseState, Mode, WriterLease
from exporter.reporting.recorder import RESULTS, Recorder, Result, Write
from exporter.token_bucket import TokenBucket

log = logging.getLogger(__name__)

MAX_WAITING_INTENTS = 1024
MAX_TRIES = 3
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 60.0
REQUEST_DEADLINE_S = 5.0
IDLE_WAKE_S = 1.0  # a turn at least this often while anything waits to be sent
# With nothing waiting, only the node condition's heartbeat (HEARTBEAT_S, 300 s), the
# taint resync (TAINT_RESYNC_S) and the end of an inherited hold come due, each of them
# late by this much at most; every wake-up is part of the idle floor between cycles.
QUIET_WAKE_S = 10.0
TAINT_RESYNC_S = 600.0  # re-list our DeviceTaintRules (someone may have deleted one)
STOP_TIMEOUT_S = 2.0
WRITE_KINDS = ("node_condition", "device_taint_rule")
# every kind --kube-writes may shadow (exporter/config.py KUBE_WRITE_KINDS)
SHADOW_KINDS = ("event", *WRITE_KINDS)
WRITE_RESULTS = ("ok", "failed")


class WriteError(Protocol):
    status: int | None
    reason: str


class Client(Protocol):
    """What ``kube_client.KubeWriteClient`` offers (a Protocol, so tests and the
    writer agree on it without importing the kubernetes client)."""

    def create_event(self, body: dict[str, Any]) -> None: ...
    def patch_event(self, namespace: str, name: str, patch: dict[str, Any]) -> None: ...
    def node_conditions(self, node: str) -> list[dict[str, Any]]: ...
    def patch_node_conditions(self, node: str, conditions: list[dict[str, Any]]) -> None: ...
    def device_taint_rule_version(self) -> str | None: ...
    def list_device_taint_rules(
        self, version: str, label_selector: str
    ) -> list[dict[str, Any]]: ...
    def create_device_taint_rule(self, version: str, body: dict[str, Any]) -> None: ...
    def delete_device_taint_rule(self, version: str, name: str) -> None: ...
    def cut(self) -> None: ...
    def close(self) -> None: ...


@dataclass(frozen=True)
class ReportingOptions:
    node_name: str
    events: bool = True
    node_condition: bool = False
    device_taints: bool = False
    taint_effect: str = "None"
    dra_drivers: tuple[str, ...] = ()
    # How long a fatal XID keeps a GPU unhealthy (--health-xid-window): a condition or
    # taint left by an earlier run may rest on XIDs this run never saw, so it is kept
    # that long before this run's "healthy" may undo it.
    xid_window_s: float = 3600.0
    # --kube-writes: kinds (SHADOW_KINDS) computed and counted but never sent
    shadow: frozenset[str] = frozenset()


class _Backoff:
    """1, 2, 4 ... MAX_BACKOFF_S seconds between tries, per kind of write: a refused node
    condition must not silence the Events, nor the other way round."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._step = 0.0
        self._until = float("-inf")

    def active(self) -> bool:
        return self._clock() < self._until

    def failing(self) -> bool:
        """The last try failed: a retry comes due when the backoff runs out."""
        return self._step > 0

    def failed(self) -> None:
        self._step = min(MAX_BACKOFF_S, max(FIRST_BACKOFF_S, 2 * self._step))
        self._until = self._clock() + self._step

    def succeeded(self) -> None:
        self._step = 0.0
        self._until = float("-inf")


def _retryable(exc: BaseException) -> bool:
    status = getattr(exc, "status", None)
    return status is None or status == 429 or status >= 500


class KubeReporter:
    def __init__(
        self,
        options: ReportingOptions,
        client_factory: Callable[[], Client],
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        error_type: type[BaseException] = Exception,
        lease: WriterLease | None = None,
    ) -> None:
        self.options = options
        # one writer per node (lease.py): None writes without asking anyone
        self._lease = lease
        self._client_factory = client_factory
        self._clock = clock
        self._wall = wall
        self._error = error_type  # what the client raises for a failed request
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: Client | None = None
        # handed over by offer()
        self._intents: list[EventIntent] = []
        self._overflow: dict[str, int] = {}
        self._condition: NodeCondition | None = None
        self._rules: frozenset[TaintRule] | None = None
        self._healthy: frozenset[str] = frozenset()  # devices NVML judged healthy
        self._published: Published | None = None  # what the DRA drivers publish now
        # offers that woke the thread, and the last of them a whole turn has acted on
        self._offered = 0
        self._turned = 0
        # counts, read by the agent every cycle
        self._events: dict[tuple[str, str], int] = {}
        self._writes: dict[tuple[str, str], int] = {}
        self._shadowed_writes: dict[tuple[str, str], int] = {}
        # the writer thread's own
        self.recorder = Recorder(options.node_name, clock=clock, wall=wall)
        self._retry: Write | None = None
        self._tries = 0
        self._event_backoff = _Backoff(clock)
        self._condition_backoff = _Backoff(clock)
        self._taint_backoff = _Backoff(clock)
        self._started_wall = wall()
        self._started = clock()
        # The holds on an earlier run's verdicts are deadlines on the monotonic clock,
        # fixed once when read (windows on the monotonic clock, deadlines on the API
        # server's): a wall-clock step later neither ends nor stretches them.
        self._hold_false_until: float | None = None  # None: the Node not read yet
        # rules listed at start and not yet wanted by this run -> held until (monotonic)
        self._inherited_rules: dict[str, float] = {}
        # how far the node's wall clock is ahead of the API server's (the pod watch's
        # estimate from Date headers, handed over with each cycle); None: unknown
        self._server_offset_s: float | None = None
        self._listed_once = False
        self._sent_condition: SentCondition | None = None
        # the Node's condition as last read: (status, lastTransitionTime); None: to read
        self._node_said: tuple[str, float | None] | None = None
        self._taint_version: str | bool | None = False  # False: not asked yet
        self._existing_rules: dict[str, ExistingRule] | None = None
        self._rules_listed_at = float("-inf")
        self._version_asked_at = float("-inf")
        # write budgets (budget.py): a write without a token waits, the latest state wins
        self._condition_budget = TokenBucket.full_at(CONDITION_BURST, CONDITION_PER_MINUTE, clock())
        self._condition_deferred = False
        self._rule_budgets = RuleBudgets()
        self._deferred_rules: set[str] = set()

    # -- the sample cycle's side --------------------------------------------------------

    def offer(self, analysis: Analysis) -> None:
        """Hand this cycle's news over; never blocks on the network."""
        opts = self.options
        at = analysis.node.timestamp
        intents = event_intents(analysis.transitions, opts.node_name, at) if opts.events else ()
        condition = desired_condition(analysis) if opts.node_condition else None
        rules = desired_rules(analysis, opts.dra_drivers) if opts.device_taints else None
        healthy = healthy_devices(analysis) if opts.device_taints else frozenset()
        published = published_devices(analysis, opts.dra_drivers) if opts.device_taints else None
        pod_meta = analysis.node.pod_meta
        offset = pod_meta.server_offset_s if pod_meta is not None else None
        wakes = bool(intents) or condition is not None or rules is not None
        with self._lock:
            if wakes:
                self._offered += 1
            if offset is not None:
                self._server_offset_s = offset
            room = MAX_WAITING_INTENTS - len(self._intents)
            self._intents.extend(intents[: max(room, 0)])
            for intent in intents[max(room, 0) :]:
                self._overflow[intent.reason] = self._overflow.get(intent.reason, 0) + 1
            if condition is not None:
                self._condition = condition
            if rules is not None:
                self._rules = rules
                self._healthy = healthy
                self._published = published
        if wakes:
            self._wake.set()

    def settled(self) -> bool:
        """Nothing handed over is waiting to be sent (a series count waiting for its
        flush time counts as waiting), and a whole turn of the thread has ended since the
        last ``offer()`` that woke it, so what it handed over was acted on: sent, held,
        or backed off. For tests and demos."""
        with self._lock:
            waiting = bool(self._intents) or self._turned != self._offered
        return not waiting and self._retry is None and self.recorder.pending() == 0

    def event_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._events)

    def write_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self._writes)

    def shadow_counts(self) -> dict[tuple[str, str], int]:
        """(kind, reason) -> writes computed and not sent (``--kube-writes shadow``)."""
        with self._lock:
            return dict(self._shadowed_writes)

    # -- sent or shadowed: the one place that decides ---------------------------------

    def writes_enabled(self, kind: str) -> bool:
        """Whether writes of ``kind`` (SHADOW_KINDS) go to the API server now."""
        return self._route(kind) == "write"

    def _route(self, kind: str) -> Mode:
        """What becomes of a write of ``kind`` now: sent (``write``); shadowed (``--kube-writes
        shadow``, or another exporter holds the node's Lease and is known to write);
        or held until one of those is known (the Lease's state is unknown: a write
        then could double another holder's, and shadowing it could lose a Warning no
        one sends). Held writes stay where they wait anyway, bounded: Events in the
        recorder (``MAX_SERIES`` keys, one count each), the condition and the taints as
        one desired state each."""
        if kind in self.options.shadow:
            return "shadow"
        if self._lease is None:
            return "write"
        return self._lease.mode(self._clock())

    # -- one writer per node (exporter/reporting/lease.py) ------------------------------

    def leading(self) -> bool:
        """This exporter holds the node's writer Lease (or has none to ask): another
        that holds it writes, this one shadows or holds (``_route``)."""
        return self._lease is None or self._lease.writing(self._clock())

    def lease_state(self) -> LeaseState | None:
        """The writer Lease as last seen (None: no lease configured). Any thread."""
        return self._lease.state if self._lease is not None else None

    def _lease_turn(self) -> None:
        """Renew the Lease, or try to take it, when due. Becoming the holder (a takeover,
        or the Lease regained after an outage) sends the condition again and re-lists
        the rules: what this process computed meanwhile was not sent, and another
        exporter may have written. The holds on an earlier run's condition and rules
        stay as this process first read them: its own verdicts since its start (also
        those computed while it could not write) are as good as any other exporter's
        on this node, and reading its own True back as an earlier run's held it an
        hour on a healthy GPU (an adversarial review)."""
        assert self._client is not None and self._lease is not None
        if self._lease.step(cast(LeaseClient, self._client), self._clock()):
            self._sent_condition = None
            self._node_said = None
            self._existing_rules = None

    def _shadowed(self, kind: str, reason: str, verb: str, name: str) -> Mode:
        """``shadow``: this write, computed and within its budget, is not sent; it is
        counted and logged instead, and the caller carries on as if the API had taken
        it. ``hold``: not sent and not counted; the caller leaves it waiting, as if it
        had not been computed. Every write of every kind passes here just before its
        request."""
        route = self._route(kind)
        if route != "shadow":
            return route
        with self._lock:
            key = (kind, reason)
            self._shadowed_writes[key] = self._shadowed_writes.get(key, 0) + 1
        # one line per write; as many as the write budgets let through (no more than
        # on mode would send), so no flood filter is needed at info level
        log.info("shadow: would %s %s %s (reason %s); not sent", verb, kind, name, reason)
        return "shadow"

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="kube-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> bool:
        """Stop the thread; a request in flight is cut. False if it did not end."""
        self._stopping.set()
        self._wake.set()
        client = self._client
        if client is not None:
            client.cut()
        if self._thread is not None:
            self._thread.join(timeout_s)
            return not self._thread.is_alive()
        return True

    # -- the writer thread ----------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping.is_set():
            self._wake.wait(self._wait_s())
            self._wake.clear()
            try:
                self._turn()
            except Exception:  # a bug here must not end the reporting for good
                log.exception("writing to the Kubernetes API failed")
                for backoff in (self._event_backoff, self._condition_backoff, self._taint_backoff):
                    backoff.failed()
        client = self._client
        if client is not None:
            if self._lease is not None:  # the next exporter takes over at once
                self._lease.release(cast(LeaseClient, client))
            client.close()

    def _wait_s(self) -> float:
        """How long the thread sleeps unless ``offer()`` wakes it: ``IDLE_WAKE_S`` while
        anything waits (an intent, an unsent count, a retry, a failed kind's backoff),
        else ``QUIET_WAKE_S``."""
        with self._lock:
            handed = bool(self._intents or self._overflow)
        backoffs = (self._event_backoff, self._condition_backoff, self._taint_backoff)
        waiting = (
            handed
            or self._retry is not None
            or self.recorder.pending() > 0
            or any(b.failing() for b in backoffs)
            or self._condition_deferred
            or bool(self._deferred_rules)
        )
        wait = IDLE_WAKE_S if waiting else QUIET_WAKE_S
        if self._lease is not None:  # its renewal or its next try
            wait = min(wait, max(self._lease.wait_s(self._clock()), 0.05))
        return wait

    def _turn(self) -> None:
        with self._lock:
            offered = self._offered
        try:
            self._act()
        finally:
            with self._lock:
                self._turned = offered

    def _act(self) -> None:
        with self._lock:
            intents, self._intents = self._intents, []
            overflow, self._overflow = self._overflow, {}
            condition, rules, healthy = self._condition, self._rules, self._healthy
            published = self._published
        for reason, n in overflow.items():
            self._count_event(reason, "dropped", n)
        self._settle(self.recorder.observe(tuple(intents), keep=self._retrying()))
        if self._event_backoff.active():
            self._settle(self.recorder.drop_unsent(keep=self._retrying()))
        if self._client is None:
            self._client = self._client_factory()
        if self._lease is not None:
            try:
                self._lease_turn()
            except Exception:  # a bug: the Lease's state stays as it was
                log.exception("the writer Lease's turn failed")
        if self._route("event") == "hold":
            self.recorder.restart_waits()  # a held Event has not waited for a token
        elif not self._event_backoff.active():
            self._guarded("Events", self._send_events, self._event_backoff)
        if (
            condition is not None
            and not self._condition_backoff.active()
            and self._route("node_condition") != "hold"
        ):
            send = functools.partial(self._send_condition, condition)
            self._guarded("the node condition", send, self._condition_backoff)
        if (
            rules is not None
            and not self._taint_backoff.active()
            and self._route("device_taint_rule") != "hold"
        ):
            taint = functools.partial(self._reconcile_taints, rules, healthy, published)
            self._guarded("DeviceTaintRules", taint, self._taint_backoff)

    def _guarded(self, what: str, write: Callable[[], None], backoff: _Backoff) -> None:
        """One kind of write; a bug it trips over (or an answer it cannot use) backs off
        that kind only, never the others."""
        try:
            write()
        except Exception:
            log.exception("writing %s to the Kubernetes API failed", what)
            backoff.failed()

    def _settle(self, settled: list[tuple[str, Result]]) -> None:
        for reason, result in settled:
            self._count_event(reason, result)

    def _count_event(self, reason: str, result: str, n: int = 1) -> None:
        with self._lock:
            self._events[(reason, result)] = self._events.get((reason, result), 0) + n

    def _count_write(self, kind: str, result: str) -> None:
        with self._lock:
            self._writes[(kind, result)] = self._writes.get((kind, result), 0) + 1

    def _retrying(self) -> tuple[ObjectRef, str, str] | None:
        """The key of the Event whose write waits for its next try, if any."""
        return self._retry.key if self._retry is not None else None

    def _send_events(self) -> None:
        """Send what is due, until nothing is or the API server stops answering."""
        assert self._client is not None
        while not self._stopping.is_set():
            write = self._retry
            if write is None:
                write, settled = self.recorder.next_write()
                self._settle(settled)
                if write is None:
                    return
                self._tries = 0
            route = self._shadowed("event", write.reason, write.verb, write.name)
            if route == "hold":
                self._retry = write  # sent (or shadowed) first once that is known
                self.recorder.restart_waits()
                return
            if route == "shadow":
                self._retry = None
                self.recorder.sent(write)  # as if taken: the series and budget go on
                continue
            try:
                if write.verb == "create":
                    self._client.create_event(write.body)
                else:
                    self._client.patch_event(write.namespace, write.name, write.body)
            except self._error as exc:
                if not self._event_failed(write, exc):
                    return
                continue
            self._retry = None
            self._event_backoff.succeeded()
            self._count_event(write.reason, self.recorder.sent(write))

    def _event_failed(self, write: Write, exc: BaseException) -> bool:
        """Decide a failed write's fate; False: back off now. Each log line is one
        template per kind of failure (the details at debug), so a refusal that lasts
        costs one line a minute, not one per Event."""
        status = getattr(exc, "status", None)
        log.debug("event %s %s: %s", write.verb, write.name, getattr(exc, "reason", exc))
        if write.verb == "patch" and status == 404:
            self._retry = None
            self.recorder.lost(write)  # expired or deleted: created again, whole count
            return True
        if _retryable(exc):
            self._tries += 1
            if self._tries < MAX_TRIES:
                self._retry = write
            else:
                self._retry = None
                self.recorder.abandon(write)
                self._count_event(write.reason, "failed")
            log.warning(
                "sending an Event to the Kubernetes API got %s; try %d of %d, new Events "
                "are dropped (counted) while it backs off",
                "no answer" if status is None else f"HTTP {status}",
                self._tries,
                MAX_TRIES,
            )
            self._event_backoff.failed()
            self._settle(self.recorder.drop_unsent(keep=self._retrying()))
            return False
        self._retry = None
        self.recorder.abandon(write)
        self._count_event(write.reason, "failed")
        if status == 403:
            log.warning(
                "the Kubernetes API refused an Event (HTTP 403): the exporter's RBAC needs "
                "create and patch on events.k8s.io events (chart: kubeEvents.enabled)"
            )
        elif status == 404:
            log.warning(
                "the Kubernetes API does not serve events.k8s.io/v1 (HTTP 404; Kubernetes "
                "1.19 and newer do); no Events can be written (--kube-events off stops trying)"
            )
        else:
            log.warning(
                "the Kubernetes API refused Event %s (HTTP %s); run with --log-level debug "
                "for its answer",
                write.reason,
                status,
            )
        return True

    def _send_condition(self, desired: NodeCondition) -> None:
        assert self._client is not None
        now, wall = self._clock(), self._wall()
        sent = self._sent_condition
        if not condition_due(desired, sent, now):
            self._condition_deferred = False  # what waited is what the Node says now
            return
        node = self.options.node_name
        try:
            if self._node_said is None:
                self._read_node_condition()
            assert self._node_said is not None and self._hold_false_until is not None
            if desired.status == "False" and now < self._hold_false_until:
                return  # an earlier run's True may rest on XIDs this run never saw
            if not self._condition_budget_ok(now):
                return  # sent when a token comes, as it is then
            if sent is None:  # the Node's, when it says the same status already
                said_status, said_transition = self._node_said
                kept = said_transition if said_status == desired.status else None
                transition = wall if kept is None else min(kept, wall)  # never in the future
            elif sent.condition.status != desired.status:
                transition = wall
            else:
                transition = sent.transition_wall
            body = condition_body(desired, transition, wall)
            route = self._shadowed("node_condition", desired.reason, "patch", node)
            if route == "hold":
                return  # sent as it is then, once this process may write
            shadowed = route == "shadow"
            if not shadowed:
                self._client.patch_node_conditions(node, [body])
        except self._error as exc:
            self._count_write("node_condition", "failed")
            log.debug("node condition: %s", getattr(exc, "reason", exc))
            log.warning(
                "reading or patching the %s condition on the Node failed (%s); it needs "
                "patch on nodes/status and get on nodes (chart: nodeCondition.enabled)",
                CONDITION_TYPE,
                "no answer" if getattr(exc, "status", None) is None else f"HTTP {exc.status}",  # type: ignore[attr-defined]
            )
            self._condition_backoff.failed()
            return
        self._sent_condition = SentCondition(desired, now, transition)
        if desired.status == "True":
            self._hold_false_until = float("-inf")  # from now on this run's own verdicts
        if not shadowed:
            self._count_write("node_condition", "ok")
        self._condition_backoff.succeeded()

    def _read_node_condition(self) -> None:
        """Read the Node's condition: before the first write, and again after the Lease
        was regained (another exporter may have written meanwhile). Its
        lastTransitionTime is kept when its status is the one sent next (a restart, or
        another exporter's write of the same verdict, is not a transition); otherwise
        the transition is now. Read again after a regain, not kept from start: reusing
        the first read's time for a later status put a False's lastTransitionTime years
        back after a Lease outage (found by an adversarial review).

        On the first read only, the hold: a True left by an earlier run is not turned
        False before ``xid_window_s`` after its last heartbeat: its verdict may rest on
        fatal XIDs this run cannot see (without --kmsg, XIDs from before start are
        unknown). The heartbeat is on this node's wall clock (the earlier run wrote it);
        the hold's end becomes a monotonic deadline here, once, so a later wall-clock
        step does not move it."""
        assert self._client is not None
        first = self._hold_false_until is None
        said: tuple[str, float | None] = ("Unknown", None)
        hold = float("-inf")
        now, wall = self._clock(), self._wall()
        for condition in self._client.node_conditions(self.options.node_name):
            if condition.get("type") != CONDITION_TYPE:
                continue
            status = condition.get("status")  # "True", "False" or "Unknown"; else unusable
            said = (
                status if isinstance(status, str) else "Unknown",
                _parse_time(condition.get("lastTransitionTime")),
            )
            if first and status == "True":
                seen = _parse_time(condition.get("lastHeartbeatTime")) or self._started_wall
                hold_wall = min(seen, self._started_wall) + self.options.xid_window_s
                hold = now + (hold_wall - wall)
                if wall < hold_wall:
                    log.info(
                        "the Node's %s condition is True from an earlier run; it is kept "
                        "until %s unless this run sees the GPUs recover first "
                        "(--health-xid-window)",
                        CONDITION_TYPE,
                        time.strftime("%H:%M:%S", time.gmtime(hold_wall)),
                    )
        self._node_said = said
        if first:
            self._hold_false_until = hold

    def _reconcile_taints(
        self, desired: frozenset[TaintRule], healthy: frozenset[str], published: Published | None
    ) -> None:
        """Create the rules of unhealthy GPUs; delete one when what it selects no longer
        calls for it (device_taints.stale_rules): NVML judged its device healthy this
        cycle, or the device it selects was replaced (a new UUID under its name) or is
        gone from a pool its driver still publishes. A device missing with its whole
        pool (the DRA driver restarting) is no evidence. A rule an earlier run left is
        deleted as healthy only ``xid_window_s`` after it was created (its verdict may
        rest on XIDs this run never saw): its creationTimestamp is on the API server's
        clock, so the hold ends at creation + window on that clock (the node's offset
        from it: the pod watch's Date-header estimate), turned into a monotonic deadline
        when listed. Replaced or gone, the hardware it marked is not there. One rule's
        failure does not hold up the others."""
        assert self._client is not None
        now = self._clock()
        try:
            version = self._taint_api_version(now)
            if version is None:
                return
            listed = None
            resync = now - self._rules_listed_at >= TAINT_RESYNC_S
            if self._route("device_taint_rule") == "shadow":
                resync = False  # shadowed: the rules as if written are the ones to keep
            if self._existing_rules is None or resync:
                listed = self._client.list_device_taint_rules(
                    version, label_selector(self.options.node_name)
                )
        except self._error as exc:
            self._taint_failed("listing", exc)
            self._taint_backoff.failed()
            return
        if listed is not None:
            created = {_name(r): _created(r) for r in listed if _name(r)}
            found = {_name(r): existing_rule(_name(r), r) for r in listed if _name(r)}
            if not self._listed_once:  # what an earlier run left, and held until when
                self._inherited_rules = {
                    name: self._rule_hold_until(when, now) for name, when in created.items()
                }
                self._listed_once = True
            self._existing_rules = found
            self._rules_listed_at = now
        if self._existing_rules is None:
            return
        wanted = {r.name: r for r in desired}
        for name in set(wanted) & set(self._inherited_rules):
            del self._inherited_rules[name]  # this run judges them now
        failures = 0
        missing = set(wanted) - self._existing_rules.keys()
        selectors = {name: (r.driver, r.pool, r.device) for name, r in wanted.items()}
        stale = stale_rules(self._existing_rules.values(), selectors, healthy, published)
        self._deferred_rules &= missing | stale.keys()  # the rest need no write now
        for name in sorted(missing):
            if self._rule_budget_ok(name, now):
                failures += not self._create_rule(version, wanted[name])
        for name, why in sorted(stale.items()):
            until = self._inherited_rules.get(name)
            if why == "healthy" and until is not None and now < until:
                continue
            if self._rule_budget_ok(name, now):
                deleted = self._delete_rule(version, name, why)
                failures += not deleted
                # moved: made again at once with the selector wanted, the pair on one
                # token (at most two writes a token), so the GPU is not left untainted
                # for a minute while the bucket refills
                if deleted and why == "moved":
                    failures += not self._create_rule(version, wanted[name])
        if failures:
            self._taint_backoff.failed()
        else:
            self._taint_backoff.succeeded()

    def _rule_hold_until(self, created: float | None, now: float) -> float:
        """The monotonic deadline of an inherited rule's hold: ``xid_window_s`` after
        its creation on the API server's clock, never more than ``xid_window_s`` from
        now (a rule is not made in the future: a node clock years behind held a taint
        for years). Unknown creation, or no estimate yet of how far this node's clock
        is from the server's: ``xid_window_s`` after this run's start (the node's own
        clock, perhaps stepped, does not stand in for the server's)."""
        window = self.options.xid_window_s
        with self._lock:
            offset = self._server_offset_s
        if created is None or offset is None:
            return self._started + window
        server_now = self._wall() - offset
        return now + min(window, max(0.0, created + window - server_now))

    # -- write budgets (budget.py) ----------------------------------------------------

    def _condition_budget_ok(self, now: float) -> bool:
        """A token for a node-status PATCH; without one the write is deferred (counted
        once per wait) and the latest desired condition goes when a token comes."""
        if self._condition_budget.take(now):
            self._condition_deferred = False
            return True
        if not self._condition_deferred:
            self._condition_deferred = True
            self._count_write("node_condition", "deferred")
            log.debug("node condition: write budget spent, the latest state waits")
        return False

    def _rule_budget_ok(self, name: str, now: float) -> bool:
        """A token of this rule's bucket for one create or delete; as above."""
        if self._rule_budgets.take(name, now):
            self._deferred_rules.discard(name)
            return True
        if name not in self._deferred_rules:
            self._deferred_rules.add(name)
            self._count_write("device_taint_rule", "deferred")
            log.debug("DeviceTaintRule %s: write budget spent, the latest state waits", name)
        return False

    def _create_rule(self, version: str, rule: TaintRule) -> bool:
        assert self._client is not None and self._existing_rules is not None
        body = rule_body(rule, version, self.options.node_name, self.options.taint_effect)
        route = self._shadowed("device_taint_rule", rule.reason, "create", rule.name)
        if route == "hold":
            return True  # made at a later turn, once this process may write
        if route == "shadow":
            self._existing_rules[rule.name] = made_rule(rule)  # as if made
            return True
        try:
            self._client.create_device_taint_rule(version, body)
        except self._error as exc:
            if getattr(exc, "status", None) != 409:
                self._taint_failed("creating", exc)
                return False
            # 409: it exists (our name carries this node's hash): a listing missed it
        self._existing_rules[rule.name] = made_rule(rule)
        self._count_write("device_taint_rule", "ok")
        log.warning(
            "tainted GPU %s (DRA device %s/%s/%s) with %s=%s:%s",
            rule.uuid,
            rule.driver,
            rule.pool,
            rule.device,
            body["spec"]["taint"]["key"],
            rule.reason,
            self.options.taint_effect,
        )
        return True

    def _delete_rule(self, version: str, name: str, why: Stale) -> bool:
        assert self._client is not None and self._existing_rules is not None
        route = self._shadowed("device_taint_rule", why, "delete", name)
        if route == "hold":
            return True  # deleted at a later turn, once this process may write
        if route == "shadow":
            self._existing_rules.pop(name, None)
            self._inherited_rules.pop(name, None)
            return True
        try:
            self._client.delete_device_taint_rule(version, name)
        except self._error as exc:
            self._taint_failed("deleting", exc)
            return False
        self._existing_rules.pop(name, None)
        self._inherited_rules.pop(name, None)
        self._count_write("device_taint_rule", "ok")
        log.info("removed DeviceTaintRule %s: %s", name, STALE_WORDS[why])
        return True

    def _taint_failed(self, doing: str, exc: BaseException) -> None:
        status = getattr(exc, "status", None)
        self._count_write("device_taint_rule", "failed")
        self._rules_listed_at = float("-inf")  # re-list before the next change
        log.debug("device taints: %s", getattr(exc, "reason", exc))
        if status == 403:
            log.warning(
                "%s a DeviceTaintRule was refused (HTTP 403): it needs get, list, create and "
                "delete on resource.k8s.io devicetaintrules (chart: draDeviceTaints.enabled)",
                doing,
            )
        else:
            log.warning(
                "%s a DeviceTaintRule failed (%s); run with --log-level debug for the answer",
                doing,
                "no answer" if status is None else f"HTTP {status}",
            )

    def _taint_api_version(self, now: float) -> str | None:
        """The resource.k8s.io version serving devicetaintrules, asked once (again
        after TAINT_RESYNC_S while none is served)."""
        assert self._client is not None
        if self._taint_version is False or (
            self._taint_version is None and now - self._version_asked_at >= TAINT_RESYNC_S
        ):
            self._version_asked_at = now
            self._taint_version = self._client.device_taint_rule_version()
            if self._taint_version is None:
                self._count_write("device_taint_rule", "failed")
                log.warning(
                    "this cluster serves no DeviceTaintRule API (resource.k8s.io v1alpha3 "
                    "with the DRADeviceTaintRules feature gate, Kubernetes 1.35+); no "
                    "device taints are written"
                )
        return self._taint_version if isinstance(self._taint_version, str) else None


STALE_WORDS: dict[Stale, str] = {
    "healthy": "its GPU is healthy again",
    "replaced": "the DRA device it selects is another GPU now (a new UUID under its name)",
    "gone": "its DRA driver no longer publishes the device it selects",
    "moved": "its GPU is published under another DRA device name now; made again for it",
}


def _parse_time(text: object) -> float | None:
    """An API timestamp as epoch seconds; None for anything else, also one no real
    server would send (before 1970, beyond 9999, an offset that overflows)."""
    if not isinstance(text, str) or len(text) > 64:
        return None
    from datetime import datetime

    try:
        when = datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except (ValueError, OverflowError, OSError):
        return None
    return when if 0 <= when < 253402300800 else None


def _name(rule: object) -> str:
    meta = rule.get("metadata") if isinstance(rule, dict) else None
    name = meta.get("name") if isinstance(meta, dict) else None
    return name if isinstance(name, str) else ""


def _created(rule: dict[str, Any]) -> float | None:
    meta = rule.get("metadata")
    return _parse_time(meta.get("creationTimestamp")) if isinstance(meta, dict) else None


__all__ = ["RESULTS", "WRITE_KINDS", "WRITE_RESULTS", "KubeReporter", "ReportingOptions"]
