"""The PodResources source: refreshes the kubelet's allocations on its own schedule.

The kubelet rate-limits this API, so the refresh runs every ``--pod-resources-interval``
(backing off while the kubelet is down), not every cycle; ``read()`` hands the last
refresh to each cycle. The refresh task runs under a ``Supervisor``: an exception that
escapes a refresh is counted and the task goes on after a backoff, and a last good
refresh older than ``STALE_PERIODS`` intervals reports the source down.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import ClassVar

from exporter.model import PodResourcesSnapshot, SourceName, SourceStatus
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle, Source, Supervisor
from exporter.sources.podresources.client import PodResourcesClient

log = logging.getLogger(__name__)


class PodResourcesSource(Source):
    name: ClassVar[SourceName] = "podresources"

    def __init__(
        self,
        client: PodResourcesClient,
        *,
        interval_s: float = 10.0,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._client = client
        self._interval_s = interval_s
        self._supervisor = Supervisor(self.name, interval_s, wall_clock=wall_clock)
        self._backoff = Backoff(initial_s=1.0, max_s=60.0)
        self._snapshot = PodResourcesSnapshot(
            ok=False, timestamp=time.time(), error="not fetched yet"
        )
        self._errors_total = 0
        self._inflight: asyncio.Task[None] | None = None  # the fetch under way

    @property
    def client(self) -> PodResourcesClient:
        return self._client

    async def run(self) -> None:
        await self._supervisor.run_async(self._step, Backoff(initial_s=1.0, max_s=60.0))

    async def _step(self) -> float:
        """One refresh; the delay before the next (backing off while the kubelet fails)."""
        await self.refresh()
        if self._snapshot.ok:
            self._backoff.reset()
            return self._interval_s
        return min(self._backoff.next_delay(), self._interval_s * 6)

    async def prime(self, timeout_s: float) -> None:
        await self.refresh()  # shares run()'s first fetch when both start together

    async def refresh(self) -> None:
        """Fetch once; a caller arriving while a fetch is under way shares it."""
        task = self._inflight
        if task is None:
            task = self._inflight = asyncio.create_task(self._fetch())
            task.add_done_callback(self._fetched)
        await task

    def _fetched(self, task: asyncio.Task[None]) -> None:
        if self._inflight is task:
            self._inflight = None

    async def _fetch(self) -> None:
        previous_ok, previous_error = self._snapshot.ok, self._snapshot.error
        self._snapshot = await self._client.fetch()
        if self._snapshot.ok:
            self._supervisor.success()
        if not self._snapshot.ok:
            self._errors_total += 1
            # Once per distinct failure: the first one at start-up too (a socket missing
            # from the start would otherwise never be logged), not every retry.
            changed = previous_ok or self._snapshot.error != previous_error
            level = logging.WARNING if changed else logging.DEBUG
            log.log(level, "kubelet PodResources unavailable: %s", self._snapshot.error)
        elif not previous_ok:
            log.info(
                "kubelet PodResources connected (%d container allocations)",
                len(self._snapshot.containers),
            )

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.pod_resources = self.read(cycle)

    def read(self, cycle: Cycle) -> PodResourcesSnapshot:
        """The last refresh; while the refresh task is crashed or stale, its allocations
        are no evidence of now: a failed snapshot saying why is handed over instead."""
        snapshot = self._snapshot
        if snapshot.ok:
            status = self.status()
            if not status.up:
                return PodResourcesSnapshot(
                    ok=False, timestamp=snapshot.timestamp, error=status.error
                )
        return snapshot

    def status(self) -> SourceStatus:
        own = SourceStatus(self.name, self._snapshot.ok, self._snapshot.error)
        return self._supervisor.judge(own)

    @property
    def errors_total(self) -> int:
        return self._errors_total + self._supervisor.crashes

    async def aclose(self) -> None:
        await self._client.close()
