"""The one shape every source has, and what a source may read during a cycle.

Modelled on node_exporter's ``collector/``: a small interface, a registry
(``exporter.registry``, outside this package since it reads ``Config``) that builds
every source from ``Config``, and
per-source self-metrics (``gpu_exporter_source_up``, ``gpu_exporter_errors``,
``gpu_exporter_source_read_seconds``) kept by the agent, not by each source.

A source is one of two kinds, with the same methods:

- *sampled* (NVML, DCGM, procfs, the holder scan): ``read()`` does the I/O, once per
  cycle, in the agent's worker thread;
- *background* (XID listener, kernel log, PodResources, pod watch, ResourceSlices):
  ``start()`` starts a thread (or ``run()`` is an asyncio task) that keeps a current
  snapshot; ``read()`` only hands that snapshot over.

``read()`` returns the source's reading and ``fill()`` puts it in its field of
``Cycle.readings`` (a typed ``Readings``: mypy checks each source's output against the
``NodeSnapshot`` field it fills). Sources never import one another; one that needs
another's reading (procfs needs the pids NVML listed) reads it from ``Cycle.readings``,
so the registry's order is the order of reading.

Every background loop runs under a ``Supervisor``: whatever escapes the loop's own error
handling (a bug, an answer nobody foresaw) is counted, logged once per distinct error and
reported as the source being down, and the loop starts again after a backoff. The same
record says when the loop last succeeded: a background source whose last success is
older than ``STALE_PERIODS`` of its periods reports down, whatever its last reading said,
so a loop that is stuck or gone can never leave the source up (docs/reliability.md,
"Supervised sources and liveness").
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from typing import ClassVar

from exporter.model import HolderScanRequest, Readings, SourceName, SourceStatus
from exporter.sources.backoff import Backoff
from exporter.text import one_line

log = logging.getLogger(__name__)

# A background source is down once its last success is older than this many of its
# periods: one late refresh is noise, three in a row is a loop that no longer works.
STALE_PERIODS = 3
# The fault key under which staleness is logged (once, like each distinct crash): the
# served reason carries the age, which changes every cycle, so it cannot be the key.
_STALE = "stale"


@dataclass
class Cycle:
    """One cycle's inputs to the sources: the time, last cycle's request for a holder
    scan (a finding of analysis), and the readings of the sources read so far."""

    timestamp: float
    holder_request: HolderScanRequest | None = None
    readings: Readings = field(default_factory=Readings)

    def gpu_pids(self) -> frozenset[int]:
        """Every pid NVML listed this cycle, on whole GPUs and MIG instances."""
        nvml = self.readings.nvml
        if nvml is None:
            return frozenset()
        return frozenset(p.pid for gpu in nvml.gpus for p in gpu.all_processes())


class Source:
    """Base of every source; subclasses set ``name`` and override ``read`` and ``fill``."""

    name: ClassVar[SourceName]  # gpu_exporter_source_up{source=...}

    def start(self) -> None:
        """Start a background thread, if the source has one."""

    async def run(self) -> None:
        """A background asyncio task, if the source has one (PodResources refreshes)."""

    async def prime(self, timeout_s: float) -> None:
        """Before the first cycle: get a first reading (refresh once, or wait up to
        ``timeout_s`` for a watch to list), so the first output is complete."""

    def request_refresh(self) -> None:
        """Ask a source refreshed on a schedule of its own to refresh soon (thread-safe;
        PodResources, when a pod's GPU process appears); the others ignore it."""

    def expect_cycle_at(self, at: float) -> None:
        """The agent's next cycle begins at ``at`` (``time.monotonic()``; thread-safe): a
        source refreshed on a schedule of its own may time a refresh to it rather than
        make one no cycle reads (PodResources); the others ignore it."""

    def read(self, cycle: Cycle) -> object:
        raise NotImplementedError

    def fill(self, cycle: Cycle) -> None:
        """Read, and put the reading in this source's field of ``cycle.readings``."""
        raise NotImplementedError

    def status(self) -> SourceStatus | None:
        """Up or down with a reason; None while there is nothing to report yet."""
        return None

    @property
    def errors_total(self) -> int:
        """Errors since start: the agent turns increments into ``gpu_exporter_errors``."""
        return 0

    def close(self) -> None:
        """Release what the source holds (threads stopped, handles closed)."""

    async def aclose(self) -> None:
        """Async release; defaults to ``close()`` in a worker thread."""
        await asyncio.to_thread(self.close)


class Supervisor:
    """The record of one background loop: when it last succeeded, what escaped it.

    The loop calls ``success()`` whenever it has current data (a refresh answered, a
    wait returned, a watch made progress); ``run_async``/``run_thread`` run the loop
    body, turning an exception that escapes it into ``crash()`` and a retry after
    backoff. ``judge()`` turns the source's own status into the one served: down while
    the last crash is unresolved or the last success is older than ``STALE_PERIODS``
    periods, with ``last_success`` filled in. Ages are measured on the monotonic clock
    (a wall-clock step never makes a source stale); the served time is the wall clock's.

    Each fault is logged once, when it starts, and its end once: a distinct crash, and a
    loop turning stale (a wait that never returns raises nothing, so without this line
    the source would go down in silence); ``_logged`` is the fault last logged.
    """

    def __init__(
        self,
        name: str,
        period_s: float,
        *,
        wall_clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        if not period_s > 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.name = name
        self.period_s = period_s
        self._wall_clock = wall_clock
        self._monotonic = monotonic
        self._since = monotonic()  # before a first success, staleness counts from here
        self._last_ok: float | None = None  # monotonic
        self._last_ok_wall: float | None = None
        self._crash: str | None = None  # why the loop last failed; None after a success
        self._logged: str | None = None  # the fault last logged (once per distinct fault)
        self._crashes = 0

    @property
    def crashes(self) -> int:
        """Exceptions that escaped the loop so far (added to the source's error total)."""
        return self._crashes

    @property
    def last_success(self) -> float | None:
        """Wall-clock time of the last success; None: none yet."""
        return self._last_ok_wall

    def restart(self) -> None:
        """The loop (re)starts: staleness before its first success counts from now."""
        self._since = self._monotonic()

    def success(self) -> None:
        """The loop has current data (cheap: called from loops many times a second)."""
        self._last_ok = self._monotonic()
        self._last_ok_wall = self._wall_clock()
        if self._crash is not None:
            log.info("%s source loop working again after: %s", self.name, self._crash)
            self._crash = self._logged = None

    def crash(self, exc: BaseException) -> None:
        """Count an exception that escaped the loop; log it once per distinct error."""
        self._crashes += 1
        text = one_line(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__)
        self._crash = text
        if self._first_report(text):
            log.error(
                "%s source loop failed, retrying with backoff: %s",
                self.name,
                text,
                exc_info=exc,
            )
        else:
            log.debug("%s source loop failed again: %s", self.name, text)

    def _first_report(self, fault: str) -> bool:
        """Whether ``fault`` is news: another fault than the one last logged."""
        if fault == self._logged:
            return False
        self._logged = fault
        return True

    def stale_for(self) -> float | None:
        """Seconds since the last success (or the start) when over the limit, else None."""
        age = self._monotonic() - (self._last_ok if self._last_ok is not None else self._since)
        return age if age > STALE_PERIODS * self.period_s else None

    def judge(self, status: SourceStatus) -> SourceStatus:
        """The source's own status, down while the loop is crashed or stale."""
        status = replace(status, last_success=self._last_ok_wall)
        if self._crash is not None:
            return replace(status, up=False, error=f"loop failed: {self._crash}")
        stale = self.stale_for()
        if stale is not None and status.up:
            since = "successful refresh" if self._last_ok is not None else "success since start"
            age = f"{stale:.0f}" if stale >= 10 else f"{stale:.1f}"
            error = f"no {since} for {age} s"
            if self._first_report(_STALE):
                log.warning(
                    "%s source is down: %s (more than %d periods of %g s); its loop is "
                    "stuck or gone",
                    self.name,
                    error,
                    STALE_PERIODS,
                    self.period_s,
                )
            return replace(status, up=False, error=error)
        if stale is None and self._logged == _STALE:
            self._logged = None
            log.info("%s source has current data again", self.name)
        return status

    async def run_async(
        self,
        step: Callable[[], Awaitable[float]],
        backoff: Backoff,
        pause: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """Call ``step`` forever; it returns the delay before its next call, waited out
        with ``pause`` (a source may end the wait early). An exception from either is
        ``crash()`` and the next call waits out ``backoff`` in full (cancellation ends
        the loop)."""
        self.restart()
        while True:
            try:
                delay = await step()
                backoff.reset()
                await pause(delay)
            except Exception as exc:
                self.crash(exc)
                await asyncio.sleep(backoff.next_delay())

    def run_thread(self, body: Callable[[], None], stop: threading.Event, backoff: Backoff) -> None:
        """A thread's target: run ``body`` (which loops until ``stop`` is set) again
        after backoff whenever it raises or returns before ``stop``."""
        self.restart()
        while not stop.is_set():
            try:
                body()
            except Exception as exc:
                if stop.is_set():
                    return
                self.crash(exc)
            if stop.is_set():
                return
            stop.wait(backoff.next_delay())
