"""The lifecycle shared by sources that block on something external in a thread of
their own (the NVML event set, the kernel log): start, stop, liveness, counters, and
the XID events raised since the last cycle, handed over by ``read()``."""

from __future__ import annotations

import threading

from exporter.model import SourceStatus, XidEvent
from exporter.sources.base import Cycle, Source


class ThreadedSource(Source):
    """Subclasses implement ``_run`` and loop until ``self._stop`` is set."""

    thread_name = "source"

    def __init__(self) -> None:
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
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
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
        return SourceStatus(self.name, self.alive and self._last_error is None, self._last_error)

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
        """Failures so far, cumulative (the agent turns them into an error counter)."""
        return self._errors_total

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
