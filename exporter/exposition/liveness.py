"""Liveness that means sampling: /healthz fails when no sample cycle has completed for
``--liveness-cycles`` intervals, so the kubelet restarts an exporter stuck in a call that
never returns (a hung NVML query), instead of probing a server that still answers with
ever older bytes. /readyz follows the same rule after its first-sample rule.

The age is that of the last rendered cycle (``MetricsCache.rendered_at``, monotonic):
a cycle that raised rendered nothing new, and the bytes served are as old as the last
one that did. Before the first cycle the allowance counts from the server's start and
is at least ``LIVENESS_STARTUP_GRACE_S`` (exporter/model/vocabulary.py): priming the
sources and a first ``nvmlInit`` on a node without persistence mode may take a while,
and the kubelet's probe must not kill a start-up that is merely slow.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from exporter.model.vocabulary import LIVENESS_DEFAULT_CYCLES, LIVENESS_STARTUP_GRACE_S

log = logging.getLogger(__name__)

# Past the moment the limit runs out, so that the check after it sees it run out.
NEXT_CHECK_MARGIN_S = 0.05


class Rendered(Protocol):
    """What liveness reads of ``server.MetricsCache``."""

    @property
    def rendered_at(self) -> float | None: ...


class Liveness:
    """Says why the exporter is not live (None: it is), logging once when it stops
    being live and once when it is again."""

    def __init__(
        self,
        cache: Rendered,
        *,
        interval_s: float,
        cycles: int = LIVENESS_DEFAULT_CYCLES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._cache = cache
        self._interval_s = interval_s
        self._cycles = cycles
        self._clock = clock
        self._started = clock()
        self._failing: str | None = None

    @property
    def limit_s(self) -> float:
        """Seconds without a completed cycle after which the exporter is not live."""
        return self._cycles * self._interval_s

    def problem(self) -> str | None:
        """One line saying why the exporter is not live, or None."""
        now = self._clock()
        rendered = self._cache.rendered_at
        if rendered is None:
            age, limit = now - self._started, max(self.limit_s, LIVENESS_STARTUP_GRACE_S)
            what = "no sample cycle has completed since start"
        else:
            age, limit = now - rendered, self.limit_s
            what = "no sample cycle has completed"
        reason = None
        if age > limit:
            reason = (
                f"{what} for {_seconds(age)} s (limit {_seconds(limit)} s: --liveness-cycles "
                f"{self._cycles} x --interval {self._interval_s:g} s); a call may be hung"
            )
        self._log_change(reason)
        return reason

    def _log_change(self, reason: str | None) -> None:
        if reason is not None and self._failing is None:
            log.error("not live, /healthz and /readyz answer 503: %s", reason)
        elif reason is None and self._failing is not None:
            log.warning("live again: a sample cycle completed (/healthz answers 200)")
        self._failing = reason

    async def watch(self) -> None:
        """Check when the exporter could stop being live, so the log says when sampling
        stopped even if nothing probes (a container run by hand); cancelled at shutdown."""
        while True:
            self.problem()
            await asyncio.sleep(self.seconds_to_next_check())

    def seconds_to_next_check(self) -> float:
        """Until the limit runs out if no cycle completes before (then the log says so at
        once), and at least an interval. Every interval while not live, to see it come
        back, and before the first cycle, whose render moves the limit from the start-up
        allowance to a cycle's (a hang in the first minute must be logged when its own
        limit runs out). Not every interval while live: each wake-up of the event loop
        costs CPU (0.1-0.3 ms on a small VM), and with the default 10 cycles this wakes
        about once in 9 intervals."""
        rendered = self._cache.rendered_at
        if self._failing is not None or rendered is None:
            return self._interval_s
        return max(self._interval_s, rendered + self.limit_s - self._clock() + NEXT_CHECK_MARGIN_S)


def _seconds(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.1f}"
