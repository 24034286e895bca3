"""The PodResources source: refreshes the kubelet's allocations on its own schedule.

The kubelet rate-limits this API, so the refresh runs every ``--pod-resources-interval``
(backing off while the kubelet is down), not every cycle; ``read()`` hands the last
refresh to each cycle. The refresh task runs under a ``Supervisor``: an exception that
escapes a refresh is counted and the task goes on after a backoff, and a last good
refresh older than ``STALE_PERIODS`` intervals reports the source down.

A refresh also runs soon after ``request_refresh()``, which the agent calls when a GPU
process shows up in a container the cycle before did not see (a pod just started: the
kubelet allocated its devices before it started the container, so a refresh begun now
answers them). Its use is otherwise attributed against an answer from before the pod,
as use of a GPU it was never given, until the next scheduled refresh. Requests are
answered at most once per ``MIN_REQUESTED_GAP_S`` after the previous refresh began, and
not at all while the kubelet fails (the backoff stands). A refresh costs ~10-15 ms of
CPU on the reference VM, mostly gRPC core starting and ending its threads
(client.py says why the channel is not kept), so the schedule is 30 s by default and
new pods no longer wait for it.

Nor is a refresh made that no cycle reads: with cycles further apart than the schedule
(``--interval 600``, a refresh every 30 s: twenty of them per cycle), a scheduled
refresh waits until ``PREFETCH_S`` before the next cycle, which the agent announces
before each cycle runs (``expect_cycle_at``), so each cycle reads allocations about a second
old and the refresh costs one per cycle. A source never told of a cycle keeps the plain
schedule. The staleness period is then the cycle's interval, not the schedule's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import ClassVar

from exporter.model import PodResourcesSnapshot, SourceName, SourceStatus
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle, Source, Supervisor
from exporter.sources.podresources.client import PodResourcesClient

log = logging.getLogger(__name__)

# A requested refresh begins at least this long after the previous one began.
MIN_REQUESTED_GAP_S = 2.0
# A scheduled refresh put off until the next cycle begins this long before it: time
# for a refresh (~15 ms; two calls of at most 1 s each when the kubelet is slow).
PREFETCH_S = 1.0


class PodResourcesSource(Source):
    name: ClassVar[SourceName] = "podresources"

    def __init__(
        self,
        client: PodResourcesClient,
        *,
        interval_s: float = 30.0,
        cycle_interval_s: float | None = None,
        wall_clock: Callable[[], float] = time.time,
        min_requested_gap_s: float = MIN_REQUESTED_GAP_S,
    ) -> None:
        self._client = client
        self._interval_s = interval_s
        self._next_cycle_at: float | None = None  # monotonic, from expect_cycle_at()
        self._min_requested_gap_s = min_requested_gap_s
        # request_refresh() from any thread; the counts and the event live on the loop
        self._loop: asyncio.AbstractEventLoop | None = None
        self._requested = asyncio.Event()
        self._requests = 0
        self._requests_at_start = 0  # requests seen when the last refresh began
        self._started_at: float | None = None  # loop time the last refresh began
        # with cycles further apart than the schedule, a refresh per cycle (module doc)
        period_s = max(interval_s, cycle_interval_s or 0.0)
        self._supervisor = Supervisor(self.name, period_s, wall_clock=wall_clock)
        self._backoff = Backoff(initial_s=1.0, max_s=60.0)
        self._snapshot = PodResourcesSnapshot(
            ok=False, timestamp=time.time(), error="not fetched yet"
        )
        self._errors_total = 0
        self._inflight: asyncio.Task[None] | None = None  # the fetch under way
        # refreshes begun so far: a List answer is evidence about a process only if it
        # was begun after the process was first seen (docs/attribution.md)
        self._begun = 0
        self._other_names_logged: set[str] = set()  # resource names hinted at, once each

    @property
    def client(self) -> PodResourcesClient:
        return self._client

    @property
    def interval_s(self) -> float:
        """Seconds between scheduled refreshes (``--pod-resources-interval``)."""
        return self._interval_s

    @property
    def period_s(self) -> float:
        """The longest a working source goes between refreshes: the schedule's interval,
        or the cycle's where that is longer (stale after ``STALE_PERIODS`` of it)."""
        return self._supervisor.period_s

    def expect_cycle_at(self, at: float) -> None:
        self._next_cycle_at = at

    async def run(self) -> None:
        self._requested = asyncio.Event()  # of this loop: a later run() may have its own
        self._loop = asyncio.get_running_loop()
        await self._supervisor.run_async(
            self._step, Backoff(initial_s=1.0, max_s=60.0), pause=self._pause
        )

    def request_refresh(self) -> None:
        """Ask for a refresh soon (thread-safe; a no-op until ``run()`` has started, and
        after the event loop has closed)."""
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the exporter stops
            loop.call_soon_threadsafe(self._note_request)

    @property
    def requests_total(self) -> int:
        """Refreshes asked for by ``request_refresh()`` so far (a test waits on it)."""
        return self._requests

    def _note_request(self) -> None:
        self._requests += 1
        self._requested.set()

    async def _pause(self, delay: float) -> None:
        """Wait ``delay`` before the next refresh, or less when one is requested: then
        until ``min_requested_gap_s`` after the last refresh began; or longer, until just
        before the next cycle, when no cycle would read the refresh before then. While
        the kubelet fails, requests do not cut its backoff, nor do cycles lengthen it."""
        loop = asyncio.get_running_loop()
        until = loop.time() + delay
        while self._snapshot.ok:
            if self._requests > self._requests_at_start:
                began = self._started_at if self._started_at is not None else loop.time()
                until = min(until, began + self._min_requested_gap_s)
                break
            self._requested.clear()
            try:
                await asyncio.wait_for(self._requested.wait(), max(0.0, until - loop.time()))
            except TimeoutError:
                later = self._put_off(until)
                if later is None:
                    return
                until = later
        await asyncio.sleep(max(0.0, until - loop.time()))

    def _put_off(self, until: float) -> float | None:
        """When a refresh due at ``until`` would not be the one the next cycle reads: the
        time just before that cycle (module doc); None when it is due now."""
        cycle_at = self._next_cycle_at
        if cycle_at is None or cycle_at - PREFETCH_S <= until:
            return None
        return cycle_at - PREFETCH_S

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
        self._requests_at_start = self._requests
        self._started_at = asyncio.get_running_loop().time()
        previous_ok, previous_error = self._snapshot.ok, self._snapshot.error
        self._begun += 1  # numbered before the request is sent: read() says it has begun
        sequence = self._begun
        fetched = await self._client.fetch()
        self._snapshot = replace(fetched, sequence=sequence, begun=sequence)
        if self._snapshot.ok:
            self._supervisor.success()
            self._hint_other_names()
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

    def _hint_other_names(self) -> None:
        """Once per resource name outside --resource-names that the kubelet allocated
        devices under: a GPU among them is never called a leak, and
        gpu_exporter_podresources_other_resource_devices counts those naming a GPU."""
        names = {entry.resource_name for entry in self._snapshot.other_devices}
        new = sorted(names - self._other_names_logged)
        if new and len(self._other_names_logged) < 64:  # bounded: a few names on any node
            self._other_names_logged.update(new)
            log.info(
                "kubelet PodResources allocates devices under resource names outside "
                "--resource-names: %s; if they are GPUs, add them to the flag (until then "
                "their use is never called a leak; see "
                "gpu_exporter_podresources_other_resource_devices)",
                ", ".join(new),
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
        if snapshot.begun != self._begun:  # a refresh under way: its answer comes later
            return replace(snapshot, begun=self._begun)
        return snapshot

    def status(self) -> SourceStatus:
        own = SourceStatus(self.name, self._snapshot.ok, self._snapshot.error)
        return self._supervisor.judge(own)

    @property
    def errors_total(self) -> int:
        return self._errors_total + self._supervisor.crashes

    async def aclose(self) -> None:
        await self._client.close()
