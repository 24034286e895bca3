"""Event aggregation and rate limits, like the kubelet's recorders (pure, clock injected).

The rules, and where they come from (client-go, tools/events and tools/record):

- **One Event per (object, reason, GPU) per ``NEW_EVENT_EVERY_S``.** A repeat within it
  adds to the Event's ``series`` (count, last observed time) instead of creating a new
  object, as tools/events does for isomorphic events within its 6-minute window. Our key
  names the GPU, so two GPUs failing on one pod are two Events.
- **A series is sent at most every ``SERIES_FLUSH_S`` per Event**, with the count so
  far: an XID storm of 250 is one Event and a few PATCHes, never 250 writes.
- **A node-wide token bucket**: ``NODE_BURST`` writes at once, then one per
  ``60 / NODE_WRITES_PER_MINUTE`` seconds, for creates and PATCHes together (the older
  recorder's spam filter is a burst of 25 refilled at 1 per 300 s per object). New
  Events go before series updates; one that finds the bucket empty waits up to
  ``CREATE_WAIT_S`` for a token, then is not sent (``rate_limited``); a series update
  waits for a token as long as it takes, its count only grows. The wait counts while
  writes may be sent: time held (the writer Lease undecided, ``restart_waits``) is not
  spent from it.
- **Bounded memory**: at most ``MAX_SERIES`` keys (client-go's cache holds 4096); the
  oldest settled key is forgotten first. Full of Events with something to send (a
  create, or a series count), a new one more urgent (``URGENCY``) than the least urgent
  of them takes its place (that one's unsent occurrences are ``dropped``); one no more
  urgent is dropped itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from exporter.reporting.events import ACTION, CONTROLLER, EventIntent, ObjectRef
from exporter.token_bucket import TokenBucket

NEW_EVENT_EVERY_S = 600.0
SERIES_FLUSH_S = 30.0
NODE_BURST = 25
NODE_WRITES_PER_MINUTE = 12
MAX_SERIES = 4096
# How long a new Event may wait for a token of the node budget before it is given up.
CREATE_WAIT_S = 60.0
# While new Events wait for tokens, one token in this many goes to a due series update.
SERIES_SHARE = 4
# Which new Event gets the next token: a lost GPU first, then what makes a GPU
# unhealthy, then the rest; the Node before a pod (it speaks for all of them).
URGENCY = {
    "GPULost": 0,
    "GPUUnhealthy": 1,
    "GPUFatalXID": 2,
    "GPUOrphanedMemory": 3,
    "GPUIsolationLeak": 3,
    "GPUHealthy": 4,
}
# pkg/apis/core/validation/events.go: ReportingInstanceLengthLimit; metadata.name is a
# DNS subdomain (253).
REPORTING_INSTANCE_BYTES = 128
NAME_LIMIT = 253
# The namespace of Events about the Node (cluster-scoped), as client-go's recorder uses.
NODE_EVENT_NAMESPACE = "default"

Result = Literal["created", "updated", "rate_limited", "dropped", "failed"]
RESULTS: tuple[Result, ...] = ("created", "updated", "rate_limited", "dropped", "failed")


def rfc3339_micro(epoch: float) -> str:
    """MicroTime as the API spells it: 2026-11-25T16:32:17.123456Z."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class _Series:
    intent: EventIntent
    first_wall: float  # when first seen (eventTime)
    created_at: float  # monotonic: when this Event's window began
    waiting_since: float  # monotonic: since when a create waits for a token
    name: str | None = None  # set once the Event exists in the API
    sent_count: int = 0  # occurrences the API knows
    pending: int = 0  # occurrences not yet sent
    last_wall: float = 0.0  # last occurrence (series.lastObservedTime)
    last_sent: float = float("-inf")  # monotonic: the last write


@dataclass(frozen=True, slots=True)
class Write:
    """One request for the writer: create an Event or patch its series."""

    verb: Literal["create", "patch"]
    namespace: str
    name: str
    body: dict[str, Any]
    reason: str
    key: tuple[ObjectRef, str, str]
    count: int  # the series count this write makes known


class Recorder:
    """Aggregates intents into Events; ``next_write`` hands out the writes due now.

    Single-threaded (the writer's thread). ``clock`` is monotonic seconds, ``wall`` the
    epoch seconds that eventTime and lastObservedTime are written in.
    """

    def __init__(
        self,
        reporting_instance: str,
        *,
        clock: Callable[[], float],
        wall: Callable[[], float],
        new_event_every_s: float = NEW_EVENT_EVERY_S,
        series_flush_s: float = SERIES_FLUSH_S,
        burst: int = NODE_BURST,
        writes_per_minute: float = NODE_WRITES_PER_MINUTE,
        max_series: int = MAX_SERIES,
        create_wait_s: float = CREATE_WAIT_S,
    ) -> None:
        # the API allows 128 bytes (ReportingInstanceLengthLimit, events.go); a node name 253
        self.instance = reporting_instance[:REPORTING_INSTANCE_BYTES]
        self._clock = clock
        self._wall = wall
        self._new_every = new_event_every_s
        self._flush = series_flush_s
        self._max = max_series
        self._create_wait = create_wait_s
        self._budget = TokenBucket(burst, per_minute=writes_per_minute, now=clock())
        self._series: dict[tuple[ObjectRef, str, str], _Series] = {}
        self._last_ns = 0
        self._creates_since_patch = 0

    def __len__(self) -> int:
        return len(self._series)

    def pending(self) -> int:
        """Occurrences recorded and not yet sent."""
        return sum(s.pending for s in list(self._series.values()))

    # -- intents in ------------------------------------------------------------------

    def observe(
        self,
        intents: tuple[EventIntent, ...],
        keep: tuple[ObjectRef, str, str] | None = None,
    ) -> list[tuple[str, Result]]:
        """Record occurrences; returns (reason, result) for intents settled at once
        (dropped because the key table is full of Events with something to send).
        ``keep``: the Event whose write waits for its retry (settled by it, never
        displaced)."""
        now, clock_wall = self._clock(), self._wall()
        settled: list[tuple[str, Result]] = []
        full = False  # nothing is evictable (observing settles nothing): no more scans
        displaceable: list[_Series] | None = None  # when full: unsent, least urgent last
        for intent in intents:
            wall = clock_wall if intent.at is None else intent.at
            series = self._series.get(intent.key)
            if series is not None and now - series.created_at < self._new_every:
                series.pending += intent.count
                series.last_wall = wall
                continue
            if series is None and len(self._series) >= self._max and (full or not self._evict()):
                full = True
                if displaceable is None:  # all have something to send: the least urgent goes
                    displaceable = sorted(
                        (s for key, s in self._series.items() if key != keep), key=_urgency
                    )
                least = displaceable[-1] if displaceable else None
                if least is None or _rank(least.intent) <= _rank(intent):
                    settled.append((intent.reason, "dropped"))
                    continue
                displaceable.pop()
                del self._series[least.intent.key]
                settled.append((least.intent.reason, "dropped"))
            old = self._series.pop(intent.key, None)  # an old window: a new Event, a new name
            if old is not None and old.name is not None and old.pending:
                # its last series update never found a token: counted, not lost silently
                settled.append((intent.reason, "rate_limited"))
            self._series[intent.key] = _Series(
                intent, wall, now, now, pending=intent.count, last_wall=wall
            )
        return settled

    def _evict(self) -> bool:
        """Forget the oldest key with nothing left to send."""
        for key, series in self._series.items():
            if series.pending == 0:
                del self._series[key]
                return True
        return False

    # -- writes out ------------------------------------------------------------------

    def next_write(self) -> tuple[Write | None, list[tuple[str, Result]]]:
        """The next write due now, if any, and the intents settled on the way.

        New Events come first, most urgent first (``URGENCY``: a GPU lost before a leak,
        the Node before a pod): a series count only grows while it waits, a new Event is
        news. One that finds no token waits up to ``CREATE_WAIT_S`` for one (then it is
        ``rate_limited``). While creates wait, a due series update still gets every
        ``SERIES_SHARE``-th token, so a storm's count keeps moving too."""
        now = self._clock()
        settled: list[tuple[str, Result]] = []
        waiting: list[_Series] = []
        for key, series in list(self._series.items()):
            if series.pending == 0:
                if series.name is None or now - series.created_at >= self._new_every:
                    del self._series[key]  # settled, and its window is over
            elif series.name is None:
                waited = now - series.waiting_since >= self._create_wait
                if waited and self._budget.available(now) < 1:
                    settled.append((series.intent.reason, "rate_limited"))
                    del self._series[key]
                else:
                    waiting.append(series)
        patch = None
        if not waiting or self._creates_since_patch >= SERIES_SHARE:
            patch = next(
                (
                    s
                    for s in self._series.values()
                    if s.name is not None and s.pending and now - s.last_sent >= self._flush
                ),
                None,
            )
        if patch is not None and self._budget.take(now):
            self._creates_since_patch = 0
            return self._patch(patch, now), settled
        if waiting and self._budget.take(now):
            self._creates_since_patch += 1
            return self._create(min(waiting, key=_urgency), now), settled
        return None, settled

    def restart_waits(self) -> None:
        """Writes are held (the writer Lease undecided): the Events waiting to be
        created have not been waiting for a token; their ``CREATE_WAIT_S`` starts again
        when writes may go. Called on each turn that holds them."""
        now = self._clock()
        for series in self._series.values():
            if series.name is None:
                series.waiting_since = now

    def _create(self, series: _Series, now: float) -> Write:
        intent = series.intent
        count = series.sent_count + series.pending
        namespace = intent.regarding.namespace or NODE_EVENT_NAMESPACE
        # client-go's name: regarding's name and the time in ns, hex. Several Events in
        # one cycle share a time, so each takes the next nanosecond: names stay unique.
        self._last_ns = max(int(series.first_wall * 1e9), self._last_ns + 1)
        suffix = f".{self._last_ns:x}"
        # a pod's name may take all 253 characters a name has; the cut ends alphanumeric
        name = intent.regarding.name[: NAME_LIMIT - len(suffix)].rstrip(".-") + suffix
        body: dict[str, Any] = {
            "apiVersion": "events.k8s.io/v1",
            "kind": "Event",
            "metadata": {"name": name, "namespace": namespace},
            "eventTime": rfc3339_micro(series.first_wall),
            "reportingController": CONTROLLER,
            "reportingInstance": self.instance,
            "action": ACTION,
            "reason": intent.reason,
            "type": intent.type,
            "note": intent.note,
            "regarding": _reference(intent.regarding),
        }
        if intent.related is not None:
            body["related"] = _reference(intent.related)
        if count >= 2:  # the API wants a series to count at least 2
            body["series"] = {"count": count, "lastObservedTime": rfc3339_micro(series.last_wall)}
        series.last_sent = now
        return Write("create", namespace, name, body, intent.reason, intent.key, count)

    def _patch(self, series: _Series, now: float) -> Write:
        assert series.name is not None
        count = series.sent_count + series.pending
        body = {"series": {"count": count, "lastObservedTime": rfc3339_micro(series.last_wall)}}
        series.last_sent = now
        namespace = series.intent.regarding.namespace or NODE_EVENT_NAMESPACE
        return Write(
            "patch", namespace, series.name, body, series.intent.reason, series.intent.key, count
        )

    # -- what became of a write --------------------------------------------------------

    def sent(self, write: Write) -> Result:
        """The API took ``write``: its occurrences are known there."""
        series = self._series.get(write.key)
        if series is not None:
            if write.verb == "create":
                series.name = write.name
            series.pending = max(0, series.sent_count + series.pending - write.count)
            series.sent_count = write.count
        return "created" if write.verb == "create" else "updated"

    def lost(self, write: Write) -> None:
        """A series PATCH found no Event (expired or deleted): create it again, with the
        whole count, as client-go does on NotFound."""
        series = self._series.get(write.key)
        if series is not None:
            series.name = None
            series.pending += series.sent_count
            series.sent_count = 0

    def abandon(self, write: Write) -> None:
        """``write`` will not be retried: a new Event is forgotten; a series keeps its
        unsent occurrences for the next PATCH."""
        series = self._series.get(write.key)
        if series is not None and series.name is None:
            del self._series[write.key]

    def drop_unsent(
        self, keep: tuple[ObjectRef, str, str] | None = None
    ) -> list[tuple[str, Result]]:
        """The API server is unreachable: new Events waiting are dropped (counted), not
        queued; series keep their counts (one integer each) for when it is back. ``keep``
        is the Event whose write is being retried: it is settled by that retry (created
        or failed), not dropped as well."""
        settled: list[tuple[str, Result]] = []
        for key, series in list(self._series.items()):
            if series.name is None and series.pending and key != keep:
                settled.append((series.intent.reason, "dropped"))
                del self._series[key]
        return settled


def _rank(intent: EventIntent) -> tuple[int, int]:
    """How urgent a new Event is, lowest first: its reason, then the Node before a pod."""
    return (URGENCY.get(intent.reason, 5), 0 if intent.regarding.kind == "Node" else 1)


def _urgency(series: _Series) -> tuple[int, int, float]:
    return (*_rank(series.intent), series.created_at)


def _reference(ref: ObjectRef) -> dict[str, str]:
    out = {"apiVersion": "v1", "kind": ref.kind, "name": ref.name}
    if ref.namespace:
        out["namespace"] = ref.namespace
    if ref.uid:
        out["uid"] = ref.uid
    return out
