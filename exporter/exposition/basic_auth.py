"""Checking basic-auth passwords so that no client can stall anything else, or keep
anyone else out.

bcrypt is slow on purpose (~0.24 s of a core at cost 12), so a client that sends wrong
passwords as fast as it can is a denial of service unless its cost is bounded, and a
queue that goes to whoever asks first is one too: a flood from a few addresses keeps it
full, and a login that is not cached yet (after a restart or a new hash) never gets in.
Here:

- every check runs on one worker thread of its own (never the default executor, which
  runs the sample cycle), at a pace: failed checks in all may come ``GLOBAL_BURST`` in a
  burst, then ``GLOBAL_PER_S`` a second; beyond that the next check waits its turn
  (nobody is refused for it). The thread is a daemon: a check in progress never holds up
  the exit, and ``close()`` answers the waiting ones at once;
- the queue is fair across client addresses: one check per address, waiting or running
  (a second request from it gets 429 at once), at most ``QUEUE_SIZE`` addresses waiting, and the
  address whose latest check is oldest goes first; among addresses never checked, the
  one first seen earliest (an address is remembered from its first request, answered
  503 or not, in a history of ``HISTORY_SIZE`` addresses). When the queue is full, a
  newcomer ranked ahead of a waiting one takes the place of the last (which gets 503);
  else the newcomer gets 503. A rank is the address's, not the request's: retrying
  cannot improve it, so an address that waits longest displaces any later newcomer on
  its next try, and any number of flooding addresses first seen after it, or checked
  once, cannot keep it out. Only never-checked addresses first seen before it go
  first, each once;
- a password verified once is cached (``CACHE_SIZE`` entries, least recently used
  first out; the idea of exporter-toolkit's web/cache.go), keyed by a keyed hash of the
  password, never the password: a scraper pays bcrypt once per password, not per scrape;
- failed logins have a budget per client address (a token bucket). A 503 gives its token
  back: it hashed nothing, and a retry gains no rank, so spending would only lock out,
  with 429, the address that waits its turn. A client over it gets 429
  without hashing. Verified passwords are served from the cache and do not touch it;
- an unknown user is checked against a made-up hash of the highest cost configured
  (exporter-toolkit uses a fixed cost-10 hash, web/handler.go). When users' costs
  differ, a wrong password for a cheaper user answers faster than one for an unknown
  user, so timing then tells that the cheaper user exists: ``web_security`` warns of
  it at start and at each reload (``web_config.mixed_cost_warning``).
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache

from exporter.exposition.web_config import bcrypt_cost
from exporter.token_bucket import TokenBucket

QUEUE_SIZE = 8  # client addresses with a check waiting (one each)
HISTORY_SIZE = 4096  # addresses whose latest check is remembered, for the queue's order
CACHE_SIZE = 100  # verified (user, password) pairs, as exporter-toolkit's cache
CLIENTS_TRACKED = 1024  # client addresses with a failed-login budget of their own
# Failed logins per address: a burst, then a sustained rate. A scraper with a wrong
# password every 15 s stays within its own budget and keeps seeing an honest 401.
CLIENT_BURST, CLIENT_PER_S = 10, 0.2
# The worker's pace for failed checks in all: at cost 12 at most ~0.5 of a core.
GLOBAL_BURST, GLOBAL_PER_S = 30, 2.0


class Verdict(Enum):
    ALLOWED = "allowed"
    DENIED = "denied"  # 401: wrong or missing credentials
    LIMITED = "limited"  # 429: over the address's budget, or its check already waits
    BUSY = "busy"  # 503: the queue is full of addresses ahead of this one (or closing)


@dataclass
class _Job:
    client: str
    password: bytes
    hashed: bytes
    rank: tuple[float, int]  # (the address's latest check, first seen): lowest goes first
    done: Callable[[bool | None], object]  # thread-safe: hands the result to the loop
    abandoned: threading.Event = field(default_factory=threading.Event)


class PasswordWorker:
    """One daemon thread that runs bcrypt at a pace, fed by a queue that is fair across
    client addresses (see the module's docstring)."""

    def __init__(
        self, queue_size: int = QUEUE_SIZE, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._queue_size = queue_size
        self._clock = clock  # the thread's pace and the addresses' latest checks
        self._lock = threading.Condition()
        self._pending: dict[str, _Job] = {}  # client address -> its one waiting check
        # address -> [first seen (an order), latest check (-inf: never)], latest seen last
        self._history: OrderedDict[str, list[float]] = OrderedDict()
        self._current: str | None = None  # the address whose check runs now
        self._first_seen = itertools.count()
        self._pace = TokenBucket(GLOBAL_BURST, GLOBAL_PER_S)
        self._thread: threading.Thread | None = None
        self._waiting: set[asyncio.Future[bool | None]] = set()
        self._closed = False
        self.checks_total = 0

    def check(
        self, client: str, password: bytes, hashed: bytes
    ) -> asyncio.Future[bool | None] | Verdict:
        """A future of the match (None: not checked: displaced, or the worker closed);
        or at once LIMITED (this address already has a check waiting or running) or BUSY (the
        queue is full of addresses ahead of it, or the worker closed). Call from the
        event loop."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool | None] = loop.create_future()

        def resolve(result: bool | None) -> None:
            if not future.done():
                future.set_result(result)

        with self._lock:
            seen = self._seen(client)
            if self._closed:
                return Verdict.BUSY
            if client in self._pending or client == self._current:
                return Verdict.LIMITED
            rank = (seen[1], int(seen[0]))
            if len(self._pending) >= self._queue_size:
                last = max(self._pending.values(), key=lambda j: j.rank)
                if rank >= last.rank:
                    return Verdict.BUSY
                del self._pending[last.client]  # checked more recently: gives way
                last.abandoned.set()
                last.done(None)
            job = _Job(
                client, password, hashed, rank, lambda r: loop.call_soon_threadsafe(resolve, r)
            )
            self._pending[client] = job
            self._lock.notify()
        self._waiting.add(future)

        def forget(done: asyncio.Future[bool | None]) -> None:
            job.abandoned.set()  # answered, cancelled or closed: the thread skips it
            self._waiting.discard(done)
            with self._lock:
                if self._pending.get(client) is job:
                    del self._pending[client]

        future.add_done_callback(forget)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="password-check", daemon=True)
            self._thread.start()
        return future

    def seen(self, client: str) -> None:
        """Note a request from ``client`` that did not reach the queue (429): it keeps
        its place in the history."""
        with self._lock:
            self._seen(client)

    def _seen(self, client: str) -> list[float]:
        """The address's history entry, made at its first request; the least recently
        seen address is forgotten beyond ``HISTORY_SIZE``. Call with the lock held."""
        entry = self._history.get(client)
        if entry is None:
            entry = self._history[client] = [next(self._first_seen), -math.inf]
            if len(self._history) > HISTORY_SIZE:
                self._history.popitem(last=False)
        self._history.move_to_end(client)
        return entry

    def close(self) -> None:
        """Answer every waiting check with None now; the thread ends after its current
        one (a daemon: the process does not wait for it)."""
        with self._lock:
            self._closed = True
            self._pending.clear()
            self._lock.notify_all()
        for future in list(self._waiting):
            if not future.done():
                future.set_result(None)

    def join(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) for the thread to finish the check it is in. A
        daemon thread still inside bcrypt when the interpreter finalizes aborts the
        process as it returns (pthread_exit unwinding through native frames: "FATAL:
        exception not rethrown", SIGABRT), so the exporter waits for it after close();
        one check at the highest cost allowed (BCRYPT_MAX_COST) takes ~0.25 s."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _next(self) -> _Job | None:
        """The waiting check whose address was checked least recently, once the pace
        allows; None when closed."""
        with self._lock:
            while True:
                if self._closed:
                    return None
                if not self._pending:
                    self._lock.wait()
                    continue
                now = self._clock()
                if not self._pace.take(now):
                    self._lock.wait(timeout=self._pace.wait_s())
                    continue
                job = min(self._pending.values(), key=lambda j: j.rank)
                del self._pending[job.client]
                self._current = job.client
                self._seen(job.client)[1] = now
                return job

    def _run(self) -> None:
        import bcrypt  # only where basic auth is configured

        while (job := self._next()) is not None:
            if job.abandoned.is_set():
                with self._lock:
                    self._current = None
                    self._pace.give_back()  # nothing was checked
                continue
            self.checks_total += 1
            try:
                matched = bool(bcrypt.checkpw(job.password, job.hashed))
            except ValueError:  # a malformed hash (refused at load; belt and braces)
                matched = False
            with self._lock:
                self._current = None
                if matched:
                    self._pace.give_back()  # the pace is for failed checks
            if not job.abandoned.is_set():
                try:
                    job.done(matched)
                except RuntimeError:  # the event loop closed meanwhile: nobody waits
                    return


class BasicAuth:
    """Decides a request's credentials against ``users`` (user -> bcrypt hash)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock  # the per-address budgets
        self._worker = PasswordWorker()
        self._key = os.urandom(32)  # the cache's keys mean nothing outside this process
        self._verified: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._clients: OrderedDict[str, TokenBucket] = OrderedDict()
        self.retry_after_s = 1.0  # for the latest LIMITED verdict: until a budget refills

    @property
    def checks_total(self) -> int:
        """bcrypt checks run so far."""
        return self._worker.checks_total

    async def check(
        self, users: Mapping[str, str], user: str | None, password: str | None, client: str
    ) -> Verdict:
        if user is None or password is None:
            return Verdict.DENIED
        hashed = users.get(user)
        key = (user, hashlib.blake2b(password.encode(), key=self._key).digest())
        if hashed is not None and self._verified.get(key) == hashed:
            self._verified.move_to_end(key)
            return Verdict.ALLOWED
        budget = self._client_budget(client)
        if not budget.take(self._clock()):
            self._worker.seen(client)
            self.retry_after_s = budget.wait_s()
            return Verdict.LIMITED
        target = hashed if hashed is not None else _fake_hash(_highest_cost(users))
        pending = self._worker.check(client, password.encode(), target.encode())
        if pending is Verdict.LIMITED:  # its own check waits: this one is no attempt
            budget.give_back()
            self.retry_after_s = 1.0
            return Verdict.LIMITED
        if isinstance(pending, Verdict):  # BUSY: nothing hashed, and a retry gains no rank
            budget.give_back()
            return pending
        matched = await pending
        if matched is None:  # displaced by an address ranked ahead, or closed
            budget.give_back()
            return Verdict.BUSY
        if matched and hashed is not None:
            budget.give_back()
            self._verified[key] = hashed
            if len(self._verified) > CACHE_SIZE:
                self._verified.popitem(last=False)
            return Verdict.ALLOWED
        return Verdict.DENIED

    def close(self) -> None:
        self._worker.close()

    def join(self, timeout_s: float) -> None:
        self._worker.join(timeout_s)

    def _client_budget(self, client: str) -> TokenBucket:
        budget = self._clients.get(client)
        if budget is None:
            budget = self._clients[client] = TokenBucket(CLIENT_BURST, CLIENT_PER_S)
            if len(self._clients) > CLIENTS_TRACKED:
                self._clients.popitem(last=False)
        self._clients.move_to_end(client)
        return budget


def _highest_cost(users: Mapping[str, str]) -> int:
    return max((bcrypt_cost(h) or 4 for h in users.values()), default=10)


@lru_cache(maxsize=32)
def _fake_hash(cost: int) -> str:
    """A well-formed hash of ``cost`` that no password matches: a fresh salt and a
    made-up checksum (checking against it costs the same as against a real one, and no
    hashing is needed to make it)."""
    import bcrypt

    return bcrypt.gensalt(rounds=cost).decode() + "IjZAgcfl7p92ldGxad68LJZdL17lhWy"
