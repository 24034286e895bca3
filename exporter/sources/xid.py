"""XID listener: a dedicated thread blocked on an NVML event set.

XIDs are events, not state: polling would miss one raised and cleared between two
samples, and the kernel log is optional. So one daemon thread waits on
``nvmlEventSetWait_v2``; an XID is never delayed by the wait, which returns as soon as
one is raised. A timeout is the normal case and the moment to check the stop flag. Each
timeout is also a wake-up, part of the idle floor between cycles (~0.5-0.9 ms of CPU
each on a small VM, almost all of it the wake-up itself and the cold caches it meets:
the timeout path runs ~40 us warm), so the wait is long, ``WAIT_TIMEOUT_MS``, and
``stop()`` cuts it short with a signal: nvml.h says the wait "can return before specified
timeout passes (e.g. when interrupt arrives)", with ``NVML_ERROR_TIMEOUT`` "if no event
arrived in specified timeout or interrupt arrived"
(https://docs.nvidia.com/deploy/nvml-api/group__nvmlEvents.html). ``stop()`` sends
``INTERRUPT_SIGNAL`` (SIGURG, ignored by default) to the listener's thread while it
waits, again every ``INTERRUPT_EVERY_S`` until the thread ends; a do-nothing handler is
installed for it at ``start()`` so that it interrupts rather than being discarded. Where
no handler can be installed (``start()`` off the main thread, or the signal ignored by
someone else) the wait is ``UNINTERRUPTIBLE_WAIT_TIMEOUT_MS`` instead, which bounds
``stop()``. The wait is bounded below the agent's 3 s close as well, so a driver that
did not honour the interrupt would still stop in time. (The simulated library sleeps
in ``poll(2)`` as the driver does, and returns on a signal too: exporter/sim/wakeups.py.)
Each XID is kept, under a lock, until the agent's next cycle takes it with ``read()``
(the agent constructs the listener without ``on_event``); a test may pass ``on_event``
to receive each XID on the listener's thread instead.

Failure isolation:
- a GPU that cannot deliver events (NotSupported, FunctionNotFound, NoPermission) is
  skipped at registration and the others are listened to;
- a GPU lost during registration is skipped too, and the set is rebuilt after a backoff
  so it is picked up again once it comes back, without going deaf to the others;
- any other NVML error frees the set, backs off (1 s doubling to 30 s, stoppable) and
  re-creates the set, re-initialising NVML first when it was shut down under us.

Only XID events are registered: ECC errors are data the NVML source polls (its counters
are the truth), and a double-bit error also raises XID 48, which arrives here as an XID.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import pynvml

from exporter.model import SourceName, XidEvent
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle
from exporter.sources.nvml_codes import CANNOT_REGISTER_EVENTS, error_name, instance_id
from exporter.sources.threaded import ThreadedSource

log = logging.getLogger(__name__)

XID_EVENT: int = pynvml.nvmlEventTypeXidCriticalError
WAIT_TIMEOUT_MS = 2500  # a wait stop() can interrupt
UNINTERRUPTIBLE_WAIT_TIMEOUT_MS = 1000  # one it cannot: stop() waits this long at most
INTERRUPT_SIGNAL = signal.SIGURG
INTERRUPT_EVERY_S = 0.05  # a signal sent just before the wait began is lost: send again


def _interrupted(signum: int, frame: object) -> None:
    """The handler that lets ``INTERRUPT_SIGNAL`` cut a wait short; nothing to do."""


# Listeners (by id) between start() and stop(): our handler stays while any is there.
_WAITING: set[int] = set()


def interrupt_handler_ready() -> bool:
    """Whether ``INTERRUPT_SIGNAL`` interrupts a wait: our handler (installed here if the
    signal is at its default and this is the main thread) or another Python handler."""
    current = signal.getsignal(INTERRUPT_SIGNAL)
    if current is signal.SIG_DFL and threading.current_thread() is threading.main_thread():
        signal.signal(INTERRUPT_SIGNAL, _interrupted)
        return True
    return callable(current)  # else ignored on purpose, set outside Python, or not ours


def release_interrupt_handler() -> None:
    """Once no listener waits, our handler goes and the signal is back at its default
    (ignored), so one sent from outside while the event loop closes is not written to
    the loop's closed wake-up pipe (an adversarial review). Main thread only (Python's rule for
    setting handlers); elsewhere the handler stays, as harmless as before."""
    if threading.current_thread() is not threading.main_thread():
        return
    if not _WAITING and signal.getsignal(INTERRUPT_SIGNAL) is _interrupted:
        signal.signal(INTERRUPT_SIGNAL, signal.SIG_DFL)


def _address(handle: Any) -> int | None:
    """A device handle's pointer value: stable while the driver is loaded."""
    try:
        return ctypes.cast(handle, ctypes.c_void_p).value
    except (ctypes.ArgumentError, TypeError):
        return None


@dataclass
class _Registration:
    """One live event set and the GPUs registered on it."""

    event_set: Any
    by_uuid: dict[str, int] = field(default_factory=dict)  # uuid -> gpu index
    by_address: dict[int, tuple[int, str]] = field(default_factory=dict)
    skipped_lost: bool = False  # a GPU was lost: rebuild later to pick it up again


class XidListener(ThreadedSource):
    """Waits on NVML's event set in its own daemon thread; each XID goes to ``on_event``
    if one is given, else it is kept for the next cycle's ``read()``."""

    name: ClassVar[SourceName] = "xid"

    thread_name = "xid-listener"

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.xid_events = self.read(cycle)

    def __init__(
        self,
        on_event: Callable[[XidEvent], None] | None = None,
        *,
        wait_timeout_ms: int = WAIT_TIMEOUT_MS,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        rebuild_after_lost_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(wall_clock=clock)
        self._monotonic = monotonic  # what the XID window is measured on
        # Up with nothing to listen to, it waits up to backoff_max_s between looks.
        self._supervisor.period_s = max(self.period_s, backoff_max_s)
        self._on_event = on_event or self._publish
        self._wait_timeout_ms = wait_timeout_ms
        self._backoff = Backoff(initial_s=backoff_initial_s, max_s=backoff_max_s)
        self._rebuild_after_lost_s = rebuild_after_lost_s
        self._clock = clock
        self._initialised = False
        self._library: object = None  # pynvml's library when this thread initialised it
        self._registered: tuple[int, ...] = ()
        self._interruptible = False  # decided at start()
        self._waiting = False  # the thread is inside nvmlEventSetWait (under _wait_lock)
        self._wait_lock = threading.Lock()

    # -- public surface ---------------------------------------------------------------

    @property
    def registered(self) -> tuple[int, ...]:
        """GPU indices the current event set listens to; empty while backing off."""
        return self._registered

    @property
    def wait_timeout_ms(self) -> int:
        """How long one wait lasts with no XID: ``WAIT_TIMEOUT_MS`` (or the one given)
        where ``stop()`` can interrupt it, at most ``UNINTERRUPTIBLE_WAIT_TIMEOUT_MS``
        where it cannot."""
        if self._interruptible:
            return self._wait_timeout_ms
        return min(self._wait_timeout_ms, UNINTERRUPTIBLE_WAIT_TIMEOUT_MS)

    def start(self) -> None:
        self._interruptible = interrupt_handler_ready()
        _WAITING.add(id(self))
        super().start()

    async def aclose(self) -> None:
        """Stop in a worker thread, then, back on the event loop's thread, let go of the
        signal handler (the agent's close, at shutdown)."""
        await asyncio.to_thread(self.close)
        release_interrupt_handler()  # no signal is sent once stop() has returned

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the thread to finish, interrupting its wait, and wait for it."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            deadline = time.monotonic() + timeout_s
            while thread.is_alive() and (remaining := deadline - time.monotonic()) > 0:
                self._interrupt(thread)
                thread.join(min(INTERRUPT_EVERY_S, remaining))
        _WAITING.discard(id(self))

    def _interrupt(self, thread: threading.Thread) -> None:
        """Signal the thread if it is in a wait: under the lock it needs to leave the
        wait's bookkeeping, so it is alive while signalled (a signal to a thread that
        has ended is undefined behaviour)."""
        if not self._interruptible or thread.ident is None:
            return
        with self._wait_lock:
            if self._waiting:
                signal.pthread_kill(thread.ident, INTERRUPT_SIGNAL)

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                delay = self._session()
                if delay > 0:
                    self._stop.wait(delay)
        finally:
            self._registered = ()
            if self._initialised and pynvml.nvmlLib is self._library:
                # NVML init is reference-counted: this balances our own nvmlInit only, on
                # the library it was made on (one replaced since, as a test installing
                # another simulated library while this thread outlived its stop, is not
                # ours to shut down)
                with contextlib.suppress(pynvml.NVMLError):
                    pynvml.nvmlShutdown()
            self._initialised = False

    def _session(self) -> float:
        """One event set from creation to failure (or stop); returns the delay before
        the next one."""
        registration: _Registration | None = None
        try:
            self._ensure_initialised()
            registration = self._register()
            self._supervisor.success()  # listening (or, with nothing to listen to, up)
            if not registration.by_uuid:
                # nothing to listen to (no GPU, or none supports events): look again later
                return self._backoff.next_delay()
            rebuild_at = (
                time.monotonic() + self._rebuild_after_lost_s if registration.skipped_lost else None
            )
            while not self._stop.is_set():
                if rebuild_at is not None and time.monotonic() >= rebuild_at:
                    log.info("rebuilding the XID event set to pick up lost GPUs")
                    return 0.0
                self._wait_once(registration)
            return 0.0
        except pynvml.NVMLError as exc:
            self._fail(exc)
            if isinstance(exc, pynvml.NVMLError_Uninitialized):
                self._initialised = False
            return self._backoff.next_delay()
        except Exception:  # a bug here must degrade to "no XIDs", never kill the thread
            self._errors_total += 1
            self._last_error = "internal"
            log.exception("XID listener failed unexpectedly")
            return self._backoff.next_delay()
        finally:
            self._registered = ()
            if registration is not None:
                try:
                    pynvml.nvmlEventSetFree(registration.event_set)
                except pynvml.NVMLError as exc:
                    log.debug("freeing the XID event set failed: %s", error_name(exc))

    def _ensure_initialised(self) -> None:
        if not self._initialised:
            pynvml.nvmlInit()
            self._library = pynvml.nvmlLib
            self._initialised = True

    def _register(self) -> _Registration:
        registration = _Registration(event_set=pynvml.nvmlEventSetCreate())
        try:
            for index in range(pynvml.nvmlDeviceGetCount()):
                self._register_gpu(registration, index)
        except pynvml.NVMLError:
            pynvml.nvmlEventSetFree(registration.event_set)
            raise
        self._registered = tuple(sorted(registration.by_uuid.values()))
        log.info("listening for XID events on GPU(s) %s", list(self._registered))
        return registration

    def _register_gpu(self, registration: _Registration, index: int) -> None:
        try:
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            uuid = pynvml.nvmlDeviceGetUUID(handle)
            try:
                supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
            except CANNOT_REGISTER_EVENTS:
                supported = XID_EVENT  # cannot ask: try XIDs and let registration decide
            if not supported & XID_EVENT:
                log.info("GPU %d does not deliver XID events; not listening to it", index)
                return
            pynvml.nvmlDeviceRegisterEvents(handle, XID_EVENT, registration.event_set)
        except CANNOT_REGISTER_EVENTS as exc:
            log.info("GPU %d cannot register XID events (%s); skipped", index, error_name(exc))
            return
        except pynvml.NVMLError_GpuIsLost as exc:
            self._fail(exc, f"GPU {index} lost during registration")
            registration.skipped_lost = True
            return
        registration.by_uuid[uuid] = index
        address = _address(handle)
        if address is not None:
            registration.by_address[address] = (index, uuid)

    def _wait_once(self, registration: _Registration) -> None:
        with self._wait_lock:
            self._waiting = True
        try:
            data = pynvml.nvmlEventSetWait_v2(registration.event_set, self.wait_timeout_ms)
        except pynvml.NVMLError_Timeout:  # also what an interrupt returns (nvml.h)
            self._recovered()
            return
        finally:
            with self._wait_lock:
                self._waiting = False
        self._recovered()
        if not int(data.eventType) & XID_EVENT:
            return
        gpu, uuid = self._identify(registration, data.device)
        self._events_total += 1
        self._deliver(
            self._on_event,
            XidEvent(
                gpu=gpu,
                uuid=uuid,
                xid=int(data.eventData),
                timestamp=self._clock(),
                monotonic=self._monotonic(),
                source="nvml",
                gpu_instance_id=instance_id(data.gpuInstanceId),
                compute_instance_id=instance_id(data.computeInstanceId),
            ),
        )

    def _recovered(self) -> None:
        """A wait answered: we listen again, so the last error is history."""
        self._backoff.reset()
        self._last_error = None
        self._supervisor.success()

    def _identify(self, registration: _Registration, device: Any) -> tuple[int | None, str | None]:
        """Which registered GPU raised the event: by UUID, else by handle.

        The handle fallback matters for XID 79, where the fallen GPU may no longer
        answer a UUID query. The handle it was registered with may be gone too: a GPU
        back from being lost can be handed a new handle while the event set still
        delivers its events, so an unknown handle is looked up among the registered
        GPUs' current handles (``_rehandle``).
        """
        try:
            uuid = pynvml.nvmlDeviceGetUUID(device)
        except pynvml.NVMLError:
            uuid = None
        if uuid is not None and uuid in registration.by_uuid:
            return registration.by_uuid[uuid], uuid
        address = _address(device)
        if address is None:
            return None, uuid
        known = registration.by_address.get(address) or self._rehandle(registration, address)
        return known if known is not None else (None, uuid)

    def _rehandle(self, registration: _Registration, address: int) -> tuple[int, str] | None:
        """The registered GPU whose handle is now ``address``, remembered in place of its
        old handle; None when no registered GPU has it.

        Without this, the second XID 79 of a GPU that fell off the bus, came back and
        fell again came without a GPU: the ledger could not pair it with the kernel
        log's copy, which names the GPU by its PCI bus, and counted it twice. One handle
        query per registered GPU, and only for an event whose handle is unknown.
        """
        for uuid, index in registration.by_uuid.items():
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            except pynvml.NVMLError:
                continue
            if _address(handle) != address:
                continue
            stale = [a for a, (i, _) in registration.by_address.items() if i == index]
            for old in stale:  # one handle per GPU, however often it comes back
                del registration.by_address[old]
            registration.by_address[address] = (index, uuid)
            log.info("GPU %d has a new NVML handle (back from being lost?)", index)
            return index, uuid
        return None

    def _deliver(self, callback: Callable[..., None], *args: Any) -> None:
        """A failing consumer (a closed event loop) must not kill the listener."""
        try:
            callback(*args)
        except Exception:
            self._errors_total += 1
            log.exception("XID callback failed")

    def _fail(self, exc: pynvml.NVMLError, context: str = "XID event set failed") -> None:
        self._errors_total += 1
        self._last_error = error_name(exc)
        log.warning("%s: %s", context, self._last_error)
