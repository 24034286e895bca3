"""Checking basic-auth passwords so that no client can stall anything else.

bcrypt is slow on purpose (~0.24 s of a core at cost 12), so a client that sends wrong
passwords as fast as it can is a denial of service unless its cost is bounded. Here:

- every check runs on one worker thread of its own (never the default executor, which
  runs the sample cycle), behind a queue of ``QUEUE_SIZE``; when that is full the answer
  is 503 at once, without hashing. The thread is a daemon: a check in progress never
  holds up the exit, and ``close()`` answers the queued ones at once;
- a password verified once is cached (``CACHE_SIZE`` entries, least recently used
  first out; the idea of exporter-toolkit's web/cache.go), keyed by a keyed hash of the
  password, never the password: a scraper pays bcrypt once per password, not per scrape;
- failed logins have a budget, per client address and in all (token buckets); a client
  over it gets 429 without hashing. Verified passwords are served from the cache and do
  not touch the budget, so a flood locks out new logins at worst, never a scraper that
  already got in;
- an unknown user is checked against a made-up hash of the highest cost configured,
  so an answer's timing does not tell whether a user exists (exporter-toolkit does the
  same with a fixed cost-10 hash, web/handler.go).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from functools import lru_cache

from exporter.exposition.web_config import bcrypt_cost

QUEUE_SIZE = 4  # checks waiting behind the one in progress
CACHE_SIZE = 100  # verified (user, password) pairs, as exporter-toolkit's cache
CLIENTS_TRACKED = 1024  # client addresses with a failed-login budget of their own
# Failed logins: a burst, then a sustained rate. A scraper with a wrong password every
# 15 s stays within its own budget and keeps seeing an honest 401.
CLIENT_BURST, CLIENT_PER_S = 10, 0.2
GLOBAL_BURST, GLOBAL_PER_S = 30, 2.0


class Verdict(Enum):
    ALLOWED = "allowed"
    DENIED = "denied"  # 401: wrong or missing credentials
    LIMITED = "limited"  # 429: too many failed logins, not hashed
    BUSY = "busy"  # 503: the password worker's queue is full (or it is closing)


class TokenBucket:
    """``burst`` tokens, refilled at ``per_s``; one failed login takes one."""

    def __init__(self, burst: float, per_s: float) -> None:
        self.burst, self.per_s = burst, per_s
        self.tokens = burst
        self._at: float | None = None

    def take(self, now: float) -> bool:
        if self._at is not None:
            self.tokens = min(self.burst, self.tokens + (now - self._at) * self.per_s)
        self._at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def give_back(self) -> None:
        self.tokens = min(self.burst, self.tokens + 1)

    def wait_s(self) -> float:
        """Seconds until the next token."""
        return max(0.0, (1 - self.tokens) / self.per_s)


@dataclass
class _Job:
    password: bytes
    hashed: bytes
    done: Callable[[bool | None], object]  # thread-safe: hands the result to the loop
    abandoned: threading.Event = field(default_factory=threading.Event)


class PasswordWorker:
    """One daemon thread that runs bcrypt, fed by a bounded queue."""

    def __init__(self, queue_size: int = QUEUE_SIZE) -> None:
        self._jobs: queue.Queue[_Job | None] = queue.Queue(maxsize=queue_size)
        self._thread: threading.Thread | None = None
        self._waiting: set[asyncio.Future[bool | None]] = set()
        self._closed = False
        self.checks_total = 0

    def check(self, password: bytes, hashed: bytes) -> asyncio.Future[bool | None] | None:
        """A future of the match (None: not checked, the worker closed); None when the
        queue is full. Call from the event loop."""
        if self._closed:
            return None
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool | None] = loop.create_future()

        def resolve(result: bool | None) -> None:
            if not future.done():
                future.set_result(result)

        job = _Job(password, hashed, lambda r: loop.call_soon_threadsafe(resolve, r))
        try:
            self._jobs.put_nowait(job)
        except queue.Full:
            return None
        self._waiting.add(future)

        def forget(done: asyncio.Future[bool | None]) -> None:
            job.abandoned.set()  # answered, cancelled or closed: the thread skips it
            self._waiting.discard(done)

        future.add_done_callback(forget)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="password-check", daemon=True)
            self._thread.start()
        return future

    def close(self) -> None:
        """Answer every waiting check with None now; the thread ends after its current
        one (a daemon: the process does not wait for it)."""
        self._closed = True
        for future in list(self._waiting):
            if not future.done():
                future.set_result(None)
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put_nowait(None)

    def _run(self) -> None:
        import bcrypt  # only where basic auth is configured

        while (job := self._jobs.get()) is not None:
            if job.abandoned.is_set():
                continue
            self.checks_total += 1
            try:
                matched = bool(bcrypt.checkpw(job.password, job.hashed))
            except ValueError:  # a malformed hash (refused at load; belt and braces)
                matched = False
            if not job.abandoned.is_set():
                try:
                    job.done(matched)
                except RuntimeError:  # the event loop closed meanwhile: nobody waits
                    return


class BasicAuth:
    """Decides a request's credentials against ``users`` (user -> bcrypt hash)."""

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._worker = PasswordWorker()
        self._key = os.urandom(32)  # the cache's keys mean nothing outside this process
        self._verified: OrderedDict[tuple[str, bytes], str] = OrderedDict()
        self._clients: OrderedDict[str, TokenBucket] = OrderedDict()
        self._global = TokenBucket(GLOBAL_BURST, GLOBAL_PER_S)
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
        budgets = (self._client_budget(client), self._global)
        if not self._take(budgets):
            self.retry_after_s = max(b.wait_s() for b in budgets)
            return Verdict.LIMITED
        target = hashed if hashed is not None else _fake_hash(_highest_cost(users))
        pending = self._worker.check(password.encode(), target.encode())
        matched = await pending if pending is not None else None
        if matched is None:
            for budget in budgets:
                budget.give_back()  # not checked: not a failed login
            return Verdict.BUSY
        if matched and hashed is not None:
            for budget in budgets:
                budget.give_back()
            self._verified[key] = hashed
            if len(self._verified) > CACHE_SIZE:
                self._verified.popitem(last=False)
            return Verdict.ALLOWED
        return Verdict.DENIED

    def close(self) -> None:
        self._worker.close()

    def _take(self, budgets: tuple[TokenBucket, ...]) -> bool:
        now = self._clock()
        taken = [b for b in budgets if b.take(now)]
        if len(taken) == len(budgets):
            return True
        for budget in taken:
            budget.give_back()
        return False

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
