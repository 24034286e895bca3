"""One writer per node: a coordination.k8s.io/v1 Lease named for the node.

Two exporters on one node (a DaemonSet rolling update with ``maxSurge``, two releases)
would each write every Event, condition and taint: 22 Warnings where one exporter writes
11. Only the holder of the node's Lease writes; another computes and counts its writes
as ``--kube-writes shadow`` does (exporter/reporting/writer.py, ``_shadowed``).

The protocol is client-go's leader election (kubernetes/client-go
tools/leaderelection/leaderelection.go, ``tryAcquireOrRenew``, ``isLeaseValid``,
``release``; resourcelock/leaselock.go for the Lease fields):

- A candidate takes the Lease only when its holder is empty or the record has not
  changed for ``leaseDurationSeconds`` **measured on this process's monotonic clock
  from when it first observed that record** (``observedTime``): the ``renewTime`` in
  the record is the other node's wall clock and is never compared with ours.
- A takeover or renewal is a PUT of the Lease read, carrying its ``resourceVersion``:
  the API server refuses it with 409 Conflict if anyone wrote the Lease in between, so
  of two candidates exactly one wins.
- The holder renews every third of the duration (the kubelet's node lease renews every
  quarter: pkg/kubelet/nodelease) and stops writing two thirds of the duration after its
  last successful renewal (client-go's ``RenewDeadline`` < ``LeaseDuration``), before
  any other may take over.
- A clean shutdown releases the Lease (holder emptied, duration 1 s, as client-go's
  ``release``), so the next exporter takes over at its next try, not a duration later.

- Never an update without a ``resourceVersion`` (it would be unconditional: it would
  overwrite whoever holds the Lease by then): the renewal carries the one of the
  server's answer to our last write; an answer without one is read again (GET) first.
- Another holder's ``leaseDurationSeconds`` is clamped (``parse_lease``): above
  ``MAX_OTHER_DURATION_S`` (3600 s, the most our flag allows) it counts as that; one
  that is no whole number > 0 (absent, a string, 0, negative) as our own duration.

What cannot be decided with the Lease: a Lease API that refuses us (403: the chart's
RBAC for leases missing; 404: the namespace does not exist) falls back to writing as
an exporter without the lease did, logged once and served as state ``refused``; it is
asked again every ``REFUSED_RETRY_S``. With no answer at all (API server down, 5xx,
an answer that cannot be used) a holder keeps writing until its renew deadline on its
own clock. After it, and for anyone that has not read the Lease or whose holder has
not been seen to renew within that holder's renew deadline, the state is ``unknown``
and writes are *held* (``mode``), neither sent nor shadowed: sending could double a
live holder's writes (nothing says there is none), shadowing could lose a Warning no
one sends (nothing says there is one). Whoever holds the Lease next sends them; an
exporter that then sees another holder renew counts them as shadowed. Only
``standby`` with a holder known to write shadows. Held, not for ever: writes held for
``UNREACHABLE_AFTER`` durations with no evidence of a live writer (this process taking
or renewing the Lease, or its record seen to change: a read of the same old record, a
409 or a failed update is none) make the state ``unreachable``: logged, and written as
``refused`` is (a doubled Warning is better than one never sent), asking again every
renewal period. That covers a Lease API that does not answer while the rest of the API
server does (a webhook, a flow-control rule), one that answers 409 to every update, and
one whose answers carry no resourceVersion. The record observed, and since when, is
kept through failed requests (client-go's observedRecord): a dead holder's old record
is not taken for a live one because an update failed. Warnings of one kind are logged
at most every ``WARN_QUIET_S``.

The decisions (``decide``, ``lease_body``, ``parse_lease``) are pure; ``WriterLease``
holds the observed record and makes the calls, from the writer thread only.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import secrets
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal, Protocol

log = logging.getLogger(__name__)

LEASE_PREFIX = "gpu-occupancy-exporter-"
MAX_NAME = 253  # a Lease's name is a DNS subdomain (RFC 1123), like a Node's
DEFAULT_DURATION_S = 30
RETRY_PERIOD_S = 2.0  # a non-holder's tries (client-go's default RetryPeriod)
REFUSED_RETRY_S = 300.0  # the Lease API refused us: ask again this much later
# Writes held this many of our durations (150 s at the default 30 s) with no evidence of
# a live writer (this process holding the Lease, or its record seen to change): written
# without a lease (state ``unreachable``), not held for ever.
UNREACHABLE_AFTER = 5
WARN_QUIET_S = 600.0  # one warning of a kind per this many seconds; the rest at debug
# Another holder's leaseDurationSeconds as this process counts it: a whole number of
# seconds in [1, MAX_OTHER_DURATION_S] as written; more is clamped to the most
# --kube-writer-lease-duration allows (exporter/config.py); anything else (absent, a
# string, 0, negative, fractional) reads as this process's own duration, the same flag
# every exporter of a release has. Never at once, never for good.
MAX_OTHER_DURATION_S = 3600
INT32_MAX = 2**31 - 1  # leaseTransitions is an int32 >= 0 (ValidateLeaseSpec)
LEASE_LABELS = {"app.kubernetes.io/name": "gpu-occupancy-exporter"}

LeaseState = Literal["held", "standby", "unknown", "refused", "unreachable"]
LEASE_STATES: tuple[LeaseState, ...] = ("held", "standby", "unknown", "refused", "unreachable")
Decision = Literal["renew", "acquire", "wait"]
# What the writer does with a write now: send it, count it as shadowed (another live
# holder sends it), or keep it until one of those is known (``WriterLease.mode``).
Mode = Literal["write", "shadow", "hold"]


class LeaseAnswerError(Exception):
    """A Lease answer that cannot be used (no resourceVersion to update it with): as no
    answer at all."""

    status: int | None = None


class LeaseError(Protocol):
    status: int | None


class LeaseClient(Protocol):
    """The Lease calls of ``kube_client.KubeWriteClient``."""

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None: ...
    def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]: ...
    def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]: ...


@dataclass(frozen=True)
class Record:
    """A Lease's spec as read (``LeaseSpecToLeaderElectionRecord``), and the
    ``resourceVersion`` a write of it must carry."""

    holder: str
    duration_s: int
    acquire_time: str | None
    renew_time: str | None
    transitions: int
    resource_version: str


def lease_name(node: str) -> str:
    """``gpu-occupancy-exporter-<node>``; a node name too long for that ends in a hash
    of it instead (still one Lease per node)."""
    name = LEASE_PREFIX + node
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(node.encode()).hexdigest()[:16]
    return LEASE_PREFIX + node[: MAX_NAME - len(LEASE_PREFIX) - 17].rstrip(".-") + "-" + digest


def identity(env: Mapping[str, str] | None = None) -> str:
    """This process among the node's exporters: the pod's name (POD_NAME, from the
    downward API; else the hostname) and a random token, as client-go's users do
    (hostname + "_" + a UUID), so a restarted container is a new holder."""
    env = os.environ if env is None else env
    return f"{env.get('POD_NAME') or socket.gethostname()}_{secrets.token_hex(8)}"


def parse_lease(obj: Mapping[str, Any], own_duration_s: int = DEFAULT_DURATION_S) -> Record:
    """The record of a Lease the API server sent. A missing holder reads as none (as
    client-go reads it); the duration is clamped (``MAX_OTHER_DURATION_S``: an unusable
    one reads as ``own_duration_s``), and leaseTransitions to [0, INT32_MAX - 1], so
    that our takeover's ``transitions + 1`` is valid."""
    meta = obj.get("metadata")
    spec = obj.get("spec")
    meta = meta if isinstance(meta, Mapping) else {}
    spec = spec if isinstance(spec, Mapping) else {}

    def text(value: object) -> str | None:
        return value if isinstance(value, str) else None

    def whole(value: object) -> int:
        return value if isinstance(value, int) and not isinstance(value, bool) else 0

    duration = whole(spec.get("leaseDurationSeconds"))
    return Record(
        holder=text(spec.get("holderIdentity")) or "",
        duration_s=min(duration, MAX_OTHER_DURATION_S) if duration > 0 else own_duration_s,
        acquire_time=text(spec.get("acquireTime")),
        renew_time=text(spec.get("renewTime")),
        transitions=min(max(whole(spec.get("leaseTransitions")), 0), INT32_MAX - 1),
        resource_version=text(meta.get("resourceVersion")) or "",
    )


def decide(record: Record, observed_at: float, me: str, now: float) -> Decision:
    """What to do with a Lease read: renew ours, take one that is free or expired, or
    wait. Expiry is ``observed_at`` (this process's monotonic clock, when it first saw
    this record) plus the record's duration: never the record's own timestamps."""
    if record.holder == me:
        return "renew"
    if not record.holder or now >= observed_at + record.duration_s:
        return "acquire"
    return "wait"


def lease_body(
    name: str,
    namespace: str,
    holder: str,
    duration_s: int,
    *,
    acquire_time: str | None,
    renew_time: str | None,
    transitions: int,
    resource_version: str | None,
) -> dict[str, Any]:
    """A whole Lease for a create (no ``resourceVersion``) or a replace (with it)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": dict(LEASE_LABELS)}
    if resource_version:
        meta["resourceVersion"] = resource_version
    spec: dict[str, Any] = {
        "holderIdentity": holder,
        "leaseDurationSeconds": duration_s,
        "leaseTransitions": transitions,
    }
    if acquire_time is not None:
        spec["acquireTime"] = acquire_time
    if renew_time is not None:
        spec["renewTime"] = renew_time
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": meta,
        "spec": spec,
    }


class WriterLease:
    """The node's writer Lease as this process sees it. ``step`` makes at most one
    round of calls when one is due; ``writing`` says, without I/O, whether this
    process may write now."""

    def __init__(
        self,
        namespace: str,
        node: str,
        me: str,
        *,
        duration_s: int = DEFAULT_DURATION_S,
        clock: Callable[[], float],
        wall_micro: Callable[[], str],
        error_type: type[BaseException] = Exception,
    ) -> None:
        if duration_s < 1:
            raise ValueError(f"a Lease's duration is at least 1 s, got {duration_s}")
        self.namespace = namespace
        self.name = lease_name(node)
        self.me = me
        self.duration_s = duration_s
        self.renew_every_s = duration_s / 3
        self.renew_deadline_s = 2 * duration_s / 3
        self._clock = clock
        self._wall_micro = wall_micro  # the renewTime written (a MicroTime), for people
        self._error = error_type
        self.state: LeaseState = "unknown"
        self.holder = ""  # the holder last observed
        # The record an update carries the resourceVersion of (None: read it first),
        # and, apart from it, the record last observed and since when it has stood
        # unchanged (client-go's observedRecord/observedTime): a failed or refused
        # update does not make an old record new again, so a holder that stopped
        # renewing long ago never looks alive again because a request failed.
        self._record: Record | None = None
        self._seen: Record | None = None
        self._observed_at = -math.inf
        # The record was seen to change (someone wrote it) since this process first read
        # it: its holder is known to renew. A first sight is no such evidence (a dead
        # exporter's record looks the same): writes are then held, not shadowed.
        self._renewal_seen = False
        self._renewed_at = -math.inf  # our last successful acquire or renewal
        self._next_try = -math.inf
        self._refusal_logged = False
        self._conflicts = 0  # 409s in a row
        # Since when writes have been held with no evidence of a live writer (this
        # process holding, or the record seen to change); None: not held
        self._held_since: float | None = None
        self._held_warned = False  # this hold has been logged at warning
        self._last_failure = "none"
        self._warned_at: dict[str, float] = {}  # message -> when last logged at warning

    # -- what the writer asks ------------------------------------------------------------

    def writing(self, now: float) -> bool:
        """May this process write now: it holds the Lease within its renew deadline, or
        the Lease API refused us or has not answered for ``UNREACHABLE_AFTER`` durations
        (written as before the lease existed)."""
        if self.state in ("refused", "unreachable"):
            return True
        return self.state == "held" and now < self._renewed_at + self.renew_deadline_s

    def mode(self, now: float) -> Mode:
        """What the writer does with a write now. ``write``: this process may write
        (``writing``). ``shadow``: another holder is known alive and within its own
        renew deadline (this process saw it renew the record, less than two thirds of
        its duration ago on our clock), so it writes what we computed. ``hold``: neither
        is known (the Lease not read, its API failing, a holder gone quiet, a holder
        read once and not yet seen to renew): the write waits,
        bounded, until one of the two is known; never counted as shadowed."""
        if self.writing(now):
            return "write"
        record = self._seen
        if (
            self.state == "standby"
            and self._renewal_seen
            and record is not None
            and record.holder
            and record.holder != self.me
            and now < self._observed_at + 2 * record.duration_s / 3
        ):
            return "shadow"
        return "hold"

    def wait_s(self, now: float) -> float:
        """Seconds until the next round of calls is due (0: now)."""
        return max(0.0, self._next_try - now)

    # -- the calls -----------------------------------------------------------------------

    def step(self, client: LeaseClient, now: float) -> bool:
        """One round when due: renew, or read and take over when free or expired.
        Returns True when this process just became the holder (it was not before)."""
        if now < self._next_try:
            return False
        was = self.writing(now) and self.state == "held"
        self._next_try = now + RETRY_PERIOD_S  # unless the outcome says otherwise
        try:
            self._round(client, now)
        except (self._error, LeaseAnswerError) as exc:
            self._failed(exc, now)
        if self.state == "held" and self._renewed_at == now:
            self._next_try = now + self.renew_every_s
        self._check_held(now)
        return self.state == "held" and not was

    def _round(self, client: LeaseClient, now: float) -> None:
        record = self._record
        if (
            self.state == "held"
            and record is not None
            and record.resource_version
            and self.writing(now)
        ):
            # client-go's fast path: renew the record we wrote, no read first
            self._put(client, record, record.acquire_time, record.transitions, now)
            return
        obj = client.get_lease(self.namespace, self.name)
        if obj is None:
            self._record = None  # a 404 on the create is then the namespace's
            stamp = self._wall_micro()
            body = lease_body(
                self.name,
                self.namespace,
                self.me,
                self.duration_s,
                acquire_time=stamp,
                renew_time=stamp,
                transitions=0,
                resource_version=None,
            )
            self._took(client.create_lease(self.namespace, body), now)
            return
        read = parse_lease(obj, self.duration_s)
        if self._seen is None or _changed(self._seen, read):
            self._observed_at = now  # a change: its holder is alive as of now
            self._renewal_seen = self._seen is not None and read.holder != self.me
            if self._renewal_seen:
                self._evidence(now)  # someone else wrote it since: a live writer
        self._seen = self._record = read
        self.holder = read.holder
        decision = decide(read, self._observed_at, self.me, now)
        if decision == "wait":
            self._standby(now)
            return
        if decision == "renew":
            self._put(client, read, read.acquire_time, read.transitions, now)
        else:
            self._put(client, read, self._wall_micro(), read.transitions + 1, now)

    def _put(
        self,
        client: LeaseClient,
        record: Record,
        acquire_time: str | None,
        transitions: int,
        now: float,
    ) -> None:
        if not record.resource_version:
            # an update without one is unconditional: it would overwrite whoever holds
            # the Lease by then. Read it again at the next try.
            self._record = None
            raise LeaseAnswerError(
                f"Lease {self.namespace}/{self.name} read without a resourceVersion"
            )
        body = lease_body(
            self.name,
            self.namespace,
            self.me,
            self.duration_s,
            acquire_time=acquire_time,
            renew_time=self._wall_micro(),
            transitions=transitions,
            resource_version=record.resource_version,
        )
        self._took(client.replace_lease(self.namespace, self.name, body), now)

    def _took(self, answer: Mapping[str, Any], now: float) -> None:
        """The API server took our create or update. Its answer is the Lease as stored,
        with the resourceVersion our next renewal must carry; an answer without one (or
        not our Lease) leaves no record, so the next round reads the Lease first."""
        if self.state != "held":
            log.info(
                "this exporter now writes for the node (Lease %s/%s)", self.namespace, self.name
            )
        record = parse_lease(answer, self.duration_s) if isinstance(answer, Mapping) else None
        usable = record is not None and record.resource_version and record.holder == self.me
        self._record = record if usable else None
        if record is not None:
            self._seen = record
        self._renewal_seen = False
        self._observed_at = self._renewed_at = now
        self.holder = self.me
        self._evidence(now)
        self.state = "held"
        self._refusal_logged = False
        self._conflicts = 0

    def _evidence(self, now: float) -> None:
        """Someone is known to write: this process took or renewed the Lease, or its
        record was seen to change. The held time ends."""
        if self.state == "unreachable":
            self._warn(
                now,
                "answers",
                "the Lease API answers again (Lease %s/%s): this exporter writes only "
                "while it holds the Lease",
                self.namespace,
                self.name,
            )
        self._held_since = None

    def _warn(self, now: float, key: str, message: str, *args: object) -> None:
        """A warning at most once per ``WARN_QUIET_S`` per kind of message (the rest at
        debug): a Lease API that flaps must not flood the log."""
        if now - self._warned_at.get(key, -math.inf) >= WARN_QUIET_S:
            self._warned_at[key] = now
            log.warning(message, *args)
        else:
            log.debug(message, *args)

    def _check_held(self, now: float) -> None:
        """Writes held (``mode``: no holder known to write) start the clock; held for
        ``UNREACHABLE_AFTER`` durations with no evidence of a live writer, the state is
        ``unreachable`` and this process writes without a lease."""
        if self.state in ("refused", "unreachable") or self.mode(now) != "hold":
            return
        if self._held_since is None:
            # a standby's normal start: its first read cannot yet show the holder
            # renewing, which the next reads do within a renewal period
            self._held_since = now
            self._held_warned = False
            log.info(
                "the node's writer Lease %s/%s: Kubernetes writes are held until it shows "
                "who writes",
                self.namespace,
                self.name,
            )
            return
        held_for = now - self._held_since
        if held_for < UNREACHABLE_AFTER * self.duration_s:
            if held_for >= self.duration_s and not self._held_warned:
                self._held_warned = True
                self._warn(
                    now,
                    "held",
                    "the node's writer Lease %s/%s has not shown who writes for %d s (last "
                    "failure: %s): Kubernetes writes are held until it does; after %d s "
                    "without a live writer this exporter writes without a lease",
                    self.namespace,
                    self.name,
                    held_for,
                    self._last_failure,
                    UNREACHABLE_AFTER * self.duration_s,
                )
            return
        self._warn(
            now,
            "unreachable",
            "the node's writer Lease %s/%s has shown no live writer for %d s (last: %s): "
            "this exporter writes without a lease until it holds it or sees another "
            "renew it, so another exporter on this node may write the same; held writes "
            "are sent now",
            self.namespace,
            self.name,
            now - self._held_since,
            self._last_failure,
        )
        self.state = "unreachable"
        self._record = None
        self._next_try = now + self.renew_every_s

    def _standby(self, now: float) -> None:
        if self.state in ("unknown", "refused", "unreachable"):
            log.info(
                "exporter %s holds this node's Lease %s/%s: this one computes and counts "
                "its writes as shadowed until it holds the Lease",
                self.holder,
                self.namespace,
                self.name,
            )
        elif self.state == "held":
            log.warning(
                "exporter %s holds this node's Lease %s/%s now: this one stops writing "
                "(it computes and counts its writes as shadowed)",
                self.holder,
                self.namespace,
                self.name,
            )
        self.state = "standby"
        self._conflicts = 0
        expires = self._observed_at + (self._seen.duration_s if self._seen else 0)
        self._next_try = min(now + RETRY_PERIOD_S, max(now, expires))

    def _failed(self, exc: BaseException, now: float) -> None:
        status = getattr(exc, "status", None)
        log.debug("writer lease: %s", getattr(exc, "reason", exc))
        self._last_failure = _what(exc, status)
        if status == 409 or (status == 404 and self._record is not None):
            # someone else wrote (or deleted) the Lease since we read it: read again.
            # No evidence by itself that anyone writes (a webhook may answer 409 to
            # everything): the record read next says whether someone renews it.
            self._record = None
            if self.state == "held":
                self.state = "standby"
                self._warn(
                    now,
                    "conflict",
                    "this node's Lease %s/%s was written by another exporter: this one "
                    "stops writing until it holds it again",
                    self.namespace,
                    self.name,
                )
            elif self.state not in ("refused", "unreachable"):
                self.state = "standby"
            # re-read at the next turn, not a retry period later; but a 409 on that
            # re-read too (a Lease written in a loop, a webhook answering 409) waits the
            # retry period: never a request every turn
            self._conflicts += 1
            self._next_try = now if self._conflicts == 1 else now + RETRY_PERIOD_S
            if self.state == "unreachable":
                self._next_try = now + self.renew_every_s
            return
        if status in (401, 403, 404):
            if not self._refusal_logged:
                log.warning(
                    "the Lease API refused this exporter (HTTP %s on coordination.k8s.io "
                    "leases %s/%s): it writes without a lease, as every exporter on this "
                    "node will; the chart grants get, create and update on leases in its "
                    "namespace (--kube-writer-lease-namespace, POD_NAMESPACE)",
                    status,
                    self.namespace,
                    self.name,
                )
                self._refusal_logged = True
            self.state = "refused"
            self._record = None
            self._held_since = None
            self._next_try = now + REFUSED_RETRY_S
            return
        # no answer, 429 or 5xx (or an answer we cannot use): a holder writes on until
        # its renew deadline, a standby stays one while its holder is known to write
        # (``mode``), anyone else does not know (``_check_held`` counts how long)
        if self.state == "unreachable":
            self._next_try = now + self.renew_every_s
            return
        if self.state == "held":
            if not self.writing(now):
                self.state = "unknown"
        elif self.state != "standby" or self.mode(now) == "hold":
            self.state = "unknown"

    def release(self, client: LeaseClient) -> bool:
        """Give the Lease up on a clean shutdown (holder emptied, duration 1 s, as
        client-go's ``release``): the next exporter takes over at its next try. One
        request; False when it did not get through (the Lease then expires)."""
        record = self._record
        now = self._clock()
        if self.state != "held" or record is None or not self.writing(now):
            return True
        stamp = self._wall_micro()
        body = lease_body(
            self.name,
            self.namespace,
            "",
            1,
            acquire_time=stamp,
            renew_time=stamp,
            transitions=record.transitions,
            resource_version=record.resource_version,
        )
        try:
            client.replace_lease(self.namespace, self.name, body)
        except self._error as exc:
            log.info(
                "releasing the node's Lease failed (%s); it expires in %d s", exc, self.duration_s
            )
            return False
        self.state = "standby"
        self.holder = ""
        return True


def _what(exc: BaseException, status: int | None) -> str:
    """A failure in a few words, for a log line."""
    if isinstance(exc, LeaseAnswerError):
        return "an answer without a resourceVersion"
    return "no answer" if status is None else f"HTTP {status}"


def _changed(seen: Record, read: Record) -> bool:
    """Someone wrote the Lease since ``seen``: its spec differs, or its resourceVersion
    (where both have one: a renewal within the same microsecond of a stopped wall clock
    still is one)."""
    versions = seen.resource_version and read.resource_version
    return _spec(read) != _spec(seen) or bool(
        versions and read.resource_version != seen.resource_version
    )


def _spec(record: Record) -> tuple[object, ...]:
    """What tells a renewal: anything but the resourceVersion (client-go compares the
    whole observed record)."""
    return (
        record.holder,
        record.duration_s,
        record.acquire_time,
        record.renew_time,
        record.transitions,
    )


__all__ = [
    "DEFAULT_DURATION_S",
    "LEASE_STATES",
    "LeaseClient",
    "LeaseState",
    "Record",
    "WriterLease",
    "decide",
    "identity",
    "lease_body",
    "lease_name",
    "parse_lease",
]
