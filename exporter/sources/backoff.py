"""Exponential backoff with jitter for sources that talk to something that can go away.

Each source that retries owns one: it asks ``next_delay()`` after a failure and calls
``reset()`` after a success, then waits that long in its own way — a thread waits on its
stop event (XID listener, kernel log, Kubernetes watches), an asyncio task sleeps
(PodResources refresh), a per-cycle reader skips its retry until the delay has passed
(NVML init, DCGM connect). The pacing rule lives here, so a kubelet or API server restart
never turns into a tight reconnect loop.
"""

from __future__ import annotations

import random
from collections.abc import Callable


class Backoff:
    """Delays ``initial_s * factor**n`` capped at ``max_s``, each scaled by random jitter.

    Jitter is "equal jitter": the delay is drawn from ``[d * (1 - jitter), d]`` so many
    agents restarting together (a kubelet upgrade across a node pool) spread out, yet
    the delay never exceeds the cap and never collapses to zero.
    """

    def __init__(
        self,
        *,
        initial_s: float = 1.0,
        max_s: float = 60.0,
        factor: float = 2.0,
        jitter: float = 0.2,
        rng: Callable[[], float] = random.random,
    ) -> None:
        if initial_s <= 0:
            raise ValueError(f"initial_s must be > 0, got {initial_s}")
        if max_s < initial_s:
            raise ValueError(f"max_s ({max_s}) must be >= initial_s ({initial_s})")
        if factor < 1:
            raise ValueError(f"factor must be >= 1, got {factor}")
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), got {jitter}")
        self._initial_s = initial_s
        self._max_s = max_s
        self._factor = factor
        self._jitter = jitter
        self._rng = rng
        self._failures = 0
        self._base = initial_s

    @property
    def failures(self) -> int:
        """Consecutive failures since the last ``reset()``."""
        return self._failures

    def next_delay(self) -> float:
        """Record one more failure and return how long to wait before the next attempt."""
        # Grow the base iteratively (not factor**failures) so days of failures never
        # overflow a float.
        base = (
            self._initial_s if self._failures == 0 else min(self._max_s, self._base * self._factor)
        )
        self._base = base
        self._failures += 1
        return base * (1.0 - self._jitter * self._rng())

    def reset(self) -> None:
        """Forget past failures after a success."""
        self._failures = 0
