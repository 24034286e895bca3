"""Exponential backoff with jitter for sources that talk to something that can go away.

Each source that retries owns one: it asks ``next_delay()`` after a failure and calls
``reset()`` after a success, then waits that long in its own way — a thread waits on its
stop event (XID listener, kernel log, Kubernetes watches), an asyncio task sleeps
(PodResources refresh), a per-cycle reader skips its retry until the delay has passed
(NVML init, DCGM connect). The pacing rule lives here, so a kubelet or API server restart
never turns into a tight reconnect loop.

Two refinements for clients of a shared service (the Kubernetes watches), after
client-go's reflector (``tools/cache/reflector.go``, ``NewReflectorWithOptions``:
``NewExponentialBackoffManager(800ms, 30s, 2min, 2.0, 1.0)``): ``quiet_reset_s`` makes
the schedule start over only after that long without a failure, not on whatever the
caller counts as a success (a garbage event is not one); ``RateBudget`` caps how often a
costly request (a LIST) may be made at all, whatever the failures look like.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from exporter.token_bucket import TokenBucket


class Backoff:
    """Delays ``initial_s * factor**n`` capped at ``max_s``, each scaled by random jitter.

    Jitter is "equal jitter": the delay is drawn from ``[d * (1 - jitter), d]`` so many
    agents restarting together (a kubelet upgrade across a node pool) spread out, yet
    the delay never exceeds the cap and never collapses to zero.

    With ``quiet_reset_s`` the schedule also starts over by itself when a failure comes
    that long after the previous wait ended: only sustained health resets it.
    """

    def __init__(
        self,
        *,
        initial_s: float = 1.0,
        max_s: float = 60.0,
        factor: float = 2.0,
        jitter: float = 0.2,
        rng: Callable[[], float] = random.random,
        quiet_reset_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if initial_s <= 0:
            raise ValueError(f"initial_s must be > 0, got {initial_s}")
        if max_s < initial_s:
            raise ValueError(f"max_s ({max_s}) must be >= initial_s ({initial_s})")
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        if quiet_reset_s is not None and not quiet_reset_s > 0:
            raise ValueError(f"quiet_reset_s must be > 0, got {quiet_reset_s}")
        self._initial_s = initial_s
        self._max_s = max_s
        self._factor = factor
        self._jitter = jitter
        self._rng = rng
        self._quiet_reset_s = quiet_reset_s
        self._clock = clock
        self._failures = 0
        self._base = initial_s
        self._wait_ends = 0.0  # when the last delay handed out runs out (clock's time)

    @property
    def failures(self) -> int:
        """Consecutive failures since the last ``reset()``."""
        return self._failures

    def next_delay(self) -> float:
        """Record one more failure and return how long to wait before the next attempt."""
        quiet = self._quiet_reset_s
        if quiet is not None and self._failures and self._clock() - self._wait_ends >= quiet:
            self._failures = 0  # healthy for long enough: start over
        # Grow the base iteratively (not factor**failures) so days of failures never
        # overflow a float.
        base = (
            self._initial_s if self._failures == 0 else min(self._max_s, self._base * self._factor)
        )
        self._base = base
        self._failures += 1
        delay = base * (1.0 - self._jitter * self._rng())
        if self._quiet_reset_s is not None:
            self._wait_ends = self._clock() + delay
        return delay

    def reset(self) -> None:
        """Forget past failures after a success."""
        self._failures = 0


class RateBudget:
    """A token bucket: at most ``burst`` requests at once, then one per ``period_s``.

    Backoff paces retries after failures; a budget bounds the request rate whatever
    happens, so a failure mode nobody foresaw (a server that answers every watch with
    an event that forces a relist) still cannot make a client hammer a shared service.
    """

    def __init__(
        self, *, burst: int, period_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if burst < 1:
            raise ValueError(f"burst must be >= 1, got {burst}")
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self._period_s = period_s
        self._clock = clock
        self._bucket = TokenBucket(burst, per_s=1.0 / period_s, now=clock())

    def wait_s(self) -> float:
        """Seconds until a request may be made (0: now)."""
        missing = 1.0 - self._bucket.available(self._clock())
        return max(0.0, missing * self._period_s)

    def take(self) -> None:
        """Spend one request (call once ``wait_s()`` is 0)."""
        self._bucket.take(self._clock())
