"""How the simulated driver sleeps in ``nvmlEventSetWait``: as the real one does, in
``poll(2)``, so a signal cuts the sleep short.

nvml.h says of ``nvmlEventSetWait``: it "can return before specified timeout passes
(e.g. when interrupt arrives)", returning ``NVML_ERROR_TIMEOUT`` "if no event arrived in
specified timeout or interrupt arrived" (the same text in NVIDIA's NVML API reference,
https://docs.nvidia.com/deploy/nvml-api/group__nvmlEvents.html). The exporter's XID
listener relies on it to stop at once (exporter/sources/xid.py). Python's own waits
cannot model it: a lock, ``select`` and ``time.sleep`` retry after a signal (PEP 475), so
the simulated wait calls libc's ``poll`` through ctypes, which does not, on a pipe that
``SimNode`` writes to when its timeline moves (an XID raised, a test's ``sync()``).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import threading
from collections.abc import Iterator

_libc = ctypes.CDLL(None, use_errno=True)
LOOK_EVERY_S = 0.05  # a wait without a pipe looks at the node this often


class _PollFd(ctypes.Structure):
    _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


class Wakers:
    """The pipes of the waits under way; ``wake()`` makes each readable.

    Under the node's lock throughout, so a pipe is never written after it is closed (its
    descriptor number may belong to another file by then)."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._write_ends: set[int] = set()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[int | None]:
        """A pipe's read end for one wait, woken by ``wake()`` until the wait ends.

        Registered before the caller looks at the node's state, so a change between that
        look and the sleep still wakes it. None when no pipe can be made (the process is
        out of descriptors: a fault test): the caller then looks every ``LOOK_EVERY_S``.
        The driver's own descriptors were opened with the event set, long before."""
        try:
            read_end, write_end = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            yield None
            return
        with self._lock:
            self._write_ends.add(write_end)
        try:
            yield read_end
        finally:
            with self._lock:
                self._write_ends.discard(write_end)
                os.close(read_end)
                os.close(write_end)

    def wake(self) -> None:
        with self._lock:
            for write_end in self._write_ends:
                with contextlib.suppress(BlockingIOError):  # full: woken already
                    os.write(write_end, b"\0")


def sleep_interruptibly(read_end: int | None, seconds: float) -> bool:
    """Sleep up to ``seconds`` or until ``read_end`` is readable (drained); False when a
    signal arrived instead (``EINTR``), as the driver's ``poll`` would see it. Without a
    pipe, at most ``LOOK_EVERY_S``."""
    if read_end is None:
        entries, count, seconds = None, 0, min(seconds, LOOK_EVERY_S)
    else:
        entries, count = ctypes.byref(_PollFd(read_end, select.POLLIN, 0)), 1
    ready = _libc.poll(entries, count, max(0, round(seconds * 1000)))
    if ready < 0:
        err = ctypes.get_errno()
        if err == errno.EINTR:
            return False
        raise OSError(err, os.strerror(err))
    if ready and read_end is not None:
        with contextlib.suppress(BlockingIOError):
            while os.read(read_end, 64):
                pass
    return True
