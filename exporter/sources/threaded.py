"""The lifecycle shared by sources that block on something external in a thread of
their own (the NVML event set, the kernel log): start, stop, liveness, counters, and
the XID events raised since the last cycle, handed over by ``read()``.

The thread runs ``_run`` under the source's ``Supervisor`` (exporter/sources/base.py):
an exception escaping it is counted, logged once and reported as down, and ``_run``
starts again after a backoff; ``_run`` calls ``self._supervisor.success()`` whenever it
is working (a wait returned, a read answered), so a thread stuck in a call goes stale.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from exporter.model import SourceStatus, XidEvent
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle, Source, Supervisor


class ThreadedSource(Source):
    """Subclasses implement ``_run`` and loop until ``self._stop`` is set.

    ``period_s`` is the longest a working ``_run`` goes between two successes (its
    waits are much shorter; this leaves room for registration, backoff while up, and a
    busy machine): stale after ``STALE_PERIODS`` of it.
    """

    thread_name = "source"
    period_s = 10.0

    def __init__(self, *, wall_clock: Callable[[], float] = time.time) -> None:
        self._supervisor = Supervisor(self.name, self.period_s, wall_clock=wall_clock)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors_total = 0
        self._events_total = 0
        self._last_error: str | None = None
        self._pending_lock = threading.Lock()
        self._pending: list[XidEvent] = []

    def start(self) -> None:
        """Start the thread; a no-op while it runs."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(
            target=self._supervisor.run_thread,
            args=(self._run, self._stop, Backoff(initial_s=1.0, max_s=30.0)),
            name=self.thread_name,
            daemon=True,
        )
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to finish and wait for it (one blocking wait at most)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def close(self) -> None:
        self.stop()

    def read(self, cycle: Cycle) -> tuple[XidEvent, ...]:
        """The events published since the last read."""
        with self._pending_lock:
            events, self._pending = self._pending, []
        return tuple(events)

    def status(self) -> SourceStatus:
        own = SourceStatus(self.name, self.alive and self._last_error is None, self._last_error)
        return self._supervisor.judge(own)

    def _publish(self, event: XidEvent) -> None:
        """Keep an event for the next ``read()`` (called from the source's thread)."""
        with self._pending_lock:
            self._pending.append(event)

    @property
    def alive(self) -> bool:
        """The thread runs (it may be backing off after an error)."""
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    @property
    def errors_total(self) -> int:
        """Failures so far, cumulative (the agent turns them into an error counter),
        exceptions that escaped ``_run`` included."""
        return self._errors_total + self._supervisor.crashes

    @property
    def events_total(self) -> int:
        """Events delivered so far (a test waits on it before running a cycle)."""
        return self._events_total

    @property
    def last_error(self) -> str | None:
        """Why the source is not working now; None while it works."""
        return self._last_error

    def _run(self) -> None:
        raise NotImplementedError
