"""Kernel log reader for XIDs (``--kmsg``): the driver's own record of every XID.

Why read it when NVML has an event set: the kernel ring buffer keeps XIDs raised while
the exporter was not running (a restart, a crash loop, the minutes before the DaemonSet
pod started), and it names MIG instances and the faulting process. It is optional
because it needs read access to ``/dev/kmsg`` (CAP_SYSLOG or a privileged container).

``/dev/kmsg`` gives one record per read, ``<prio>,<seq>,<usec>,<flags>[,...];message``,
with ``usec`` counted from boot; opening it starts at the oldest record still in the
buffer, so the backlog is read first and new records follow. The driver prints
(open-gpu-kernel-modules, kernel_rc.c)::

    NVRM: Xid (PCI:0000:3b:00): 79, pid='<unknown>', name=<unknown>, GPU has fallen off the bus.
    NVRM: Xid (PCI:0000:3b:00 GPU-I:01 GPU-CI:00): 31, pid=1234, name=python, Ch 00000008, ...
    NVRM: Xid (PCI:0000:3b:00): 43, pid=1234, name=python, Ch 00000008
    NVRM: Xid (0000:03:00): 14, Channel 00000001                       (older drivers)

The reader parses those into ``XidEvent(source="kmsg")`` naming the PCI bus only; the
ledger (analysis/xid.py) resolves the GPU and de-duplicates against NVML.

Time. ``usec`` is printk's clock, ``local_clock()`` (kernel/printk/printk.c,
``vprintk_store``): sched_clock, which stops while the machine is suspended and is not
disciplined by NTP (Documentation/timers/timekeeping.rst), while ``/proc/uptime`` is
CLOCK_BOOTTIME (fs/proc/uptime.c). ``now - uptime + usec`` therefore lands early by the
time spent suspended, and off by the clocks' drift on a long uptime -- easily more than
the ledger's 5 s de-duplication window. So a record read live (after the backlog) is
stamped with the reader's clock when it arrives, as the NVML listener stamps its events;
only records that were already in the log (the backlog, and those missed while the log
was closed after an error) are stamped through /proc/uptime, which is approximate.
Records of the backlog read at the first open are marked ``backlog``: they were raised
before the exporter started, and analysis keeps them apart from new XIDs.

Overruns. The ring buffer is fixed in size: a kernel that logs faster than the reader
reads (a flood of messages, a reader starved of CPU, or a log closed after an error)
overwrites records before they are read, XIDs among them. ``/dev/kmsg`` then fails one
read with EPIPE and resumes at the oldest record left (kernel/printk/printk.c,
``devkmsg_read``: "our last seen message is gone, return error and reset"), so the next
record's sequence number jumps. Each jump is one overrun: counted (served as
``gpu_exporter_kmsg_overruns_total``, and in ``gpu_exporter_errors_total{source="kmsg"}``)
and logged with the number of records lost; XIDs lost in it are not seen at all.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import re
import select
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

from exporter.model import SourceName, XidEvent
from exporter.sources.backoff import Backoff
from exporter.sources.base import Cycle
from exporter.sources.procfs import read_file_start
from exporter.sources.threaded import ThreadedSource

log = logging.getLogger(__name__)

READ_SIZE = 8192  # larger than any record (a read smaller than a record fails EINVAL)
# /dev/kmsg hands out whole records; only a regular file named by --kmsg-path can hold a
# "line" without end. What is held while waiting for its newline stops here.
MAX_PENDING = 64 * 1024
_RECORD = re.compile(r"^(\d+),(\d+),(\d+)(?:,[^;]*)?;(.*)$")
_RECORD_HEAD = re.compile(rb"^\d+,(\d+),")  # the sequence number of a record cut short
_XID = re.compile(
    r"NVRM: Xid \((?:PCI:)?"
    r"(?P<pci>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)"
    r"(?P<attr>[^)]*)\): (?P<xid>\d+)(?:,\s*(?P<detail>.*))?$"
)
_GPU_INSTANCE = re.compile(r"\bGPU-I:(\d+)")
_COMPUTE_INSTANCE = re.compile(r"\bGPU-CI:(\d+)")


def parse_kmsg_record(line: str) -> tuple[int, float, str] | None:
    """``"4,1227,437812449,c;NVRM: ..."`` -> ``(seq, seconds since boot, message)``.

    Continuation lines (" KEY=value" dictionary entries) and anything else that is not a
    record header give None.
    """
    match = _RECORD.match(line.rstrip("\r\n"))
    if match is None:
        return None
    return int(match.group(2)), int(match.group(3)) / 1_000_000, match.group(4)


def parse_xid_message(msg: str) -> tuple[str, int, str] | None:
    """``"NVRM: Xid (PCI:0000:3b:00): 79, pid=..., ..."`` -> ``("0000:3b:00", 79, "pid=...")``.

    The bus id is returned as printed; the detail is everything after the code (the
    pid/name part and the driver's text), or "" when the line stops at the code.
    """
    match = _XID.search(msg.rstrip())
    if match is None:
        return None
    return match.group("pci"), int(match.group("xid")), match.group("detail") or ""


def parse_xid_attribution(msg: str) -> tuple[int | None, int | None]:
    """MIG attribution from the parenthesis: ``(PCI:... GPU-I:01 GPU-CI:00)`` -> (1, 0)."""
    match = _XID.search(msg.rstrip())
    if match is None:
        return None, None
    attr = match.group("attr")
    gi = _GPU_INSTANCE.search(attr)
    ci = _COMPUTE_INSTANCE.search(attr)
    return (int(gi.group(1)) if gi else None, int(ci.group(1)) if ci else None)


UPTIME_MAX_BYTES = 64
MAX_UPTIME_S = 100 * 365 * 86400.0  # a longer uptime is no clock's


def boot_epoch(proc_root: str | Path, now: float) -> float | None:
    """Epoch seconds of boot: ``now`` minus ``<proc-root>/uptime``.

    ``now`` and uptime are read together, so the offset is good to the 10 ms resolution
    of /proc/uptime -- but it is boot on CLOCK_BOOTTIME, not on printk's clock (module
    docstring): only records that did not arrive live are stamped through it.
    """
    try:  # "12345.67 54321.00\n": a few dozen bytes; a longer file is not /proc's
        text = read_file_start(Path(proc_root, "uptime"), UPTIME_MAX_BYTES)
        uptime = float(text.decode("ascii").split()[0])
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None
    if not math.isfinite(uptime) or not 0 <= uptime < MAX_UPTIME_S:
        return None
    return now - uptime


class KmsgReader(ThreadedSource):
    """Reads the kernel log backlog, then follows it, from a daemon thread.

    Live records are stamped when read; records already in the log when it was opened
    are stamped through /proc/uptime, and those of the first open are ``backlog``.
    ``last_error`` says why the log cannot be read (e.g. "EACCES"), or "uptime" when
    records that were already in the log are stamped at read time too;
    ``errors_total`` counts open/read failures and failing callbacks.

    Works on ``/dev/kmsg`` (a character device: one record per read, EAGAIN when
    drained, EPIPE when records were overwritten before we read them) and on a regular
    file in the same format (tests, replay), which is polled for appended lines.
    """

    name: ClassVar[SourceName] = "kmsg"

    thread_name = "kmsg-reader"

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.kmsg_events = self.read(cycle)
        cycle.readings.kmsg_overruns = self.overruns_total

    def __init__(
        self,
        on_event: Callable[[XidEvent], None] | None = None,
        *,
        path: str | Path = "/dev/kmsg",
        proc_root: str | Path = "/proc",
        poll_interval_s: float = 0.5,
        backoff_initial_s: float = 1.0,
        backoff_max_s: float = 30.0,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(wall_clock=clock)
        self._on_event = on_event or self._publish
        self._monotonic = monotonic  # what the XID window is measured on
        self._path = Path(path)
        self._proc_root = Path(proc_root)
        self._poll_interval_s = poll_interval_s
        self._backoff = Backoff(initial_s=backoff_initial_s, max_s=backoff_max_s)
        self._clock = clock
        self._caught_up = threading.Event()  # the first open's backlog has been read
        self._draining = True  # reading what the log held when it was opened
        self._last_seq = -1
        self._overruns_total = 0
        self._overrun_logged_at: float | None = None  # monotonic; one line a minute at most

    # -- public surface ---------------------------------------------------------------

    def wait_caught_up(self, timeout_s: float) -> bool:
        """Wait until the backlog present at start has been read."""
        return self._caught_up.wait(timeout_s)

    @property
    def overruns_total(self) -> int:
        """Times the kernel overwrote records before this reader read them (a jump in
        the records' sequence numbers, after EPIPE on /dev/kmsg), since start."""
        return self._overruns_total

    # -- the thread -------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                fd = os.open(self._path, os.O_RDONLY | os.O_NONBLOCK)
            except OSError as exc:
                self._fail(exc)
                self._stop.wait(self._backoff.next_delay())
                continue
            try:
                self._follow(fd)
            except OSError as exc:
                self._fail(exc)
                self._stop.wait(self._backoff.next_delay())
            finally:
                os.close(fd)

    def _follow(self, fd: int) -> None:
        self._last_error = None  # the log is open again
        self._draining = True
        boot = boot_epoch(self._proc_root, self._clock())
        if boot is None:
            self._errors_total += 1
            self._last_error = "uptime"
            log.warning(
                "cannot read %s/uptime: kernel-log backlog XIDs are stamped when read",
                self._proc_root,
            )
        pending = b""
        skipping = False  # inside a line longer than MAX_PENDING
        while not self._stop.is_set():
            try:
                chunk = os.read(fd, READ_SIZE)
            except BlockingIOError:  # /dev/kmsg drained: wait for the next record
                self._idle()
                select.select([fd], [], [], self._poll_interval_s)
                continue
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    # The ring buffer wrapped past our position; the next read resumes
                    # at the oldest record still there, whose sequence number says how
                    # many were lost (counted in _handle: a regular file has no EPIPE).
                    continue
                if exc.errno == errno.EINTR:
                    continue
                raise
            if not chunk:  # regular file at EOF: poll for appended lines
                self._idle()
                self._stop.wait(self._poll_interval_s)
                continue
            self._backoff.reset()
            self._supervisor.success()
            pending += chunk
            *lines, pending = pending.split(b"\n")
            if skipping and lines:  # the end of a line too long to keep
                lines, skipping = lines[1:], False
            if len(pending) > MAX_PENDING:  # no record is this long: drop what is held
                if not skipping:  # the record was read, not lost: no overrun at the next
                    self._skipped(pending)
                pending, skipping = b"", True
            for line in lines:
                self._handle(line.decode("utf-8", "replace"), boot)

    def _idle(self) -> None:
        self._supervisor.success()  # read to the end: what the log holds is ours
        self._draining = False  # from here on, records arrive as the kernel logs them
        if not self._caught_up.is_set():
            self._caught_up.set()
            log.info("kernel log backlog read; following %s", self._path)

    def _handle(self, line: str, boot: float | None) -> None:
        record = parse_kmsg_record(line)
        if record is None:
            return
        seq, since_boot, message = record
        if seq <= self._last_seq:  # re-read after a reopen
            return
        if self._last_seq >= 0 and seq > self._last_seq + 1:
            self._overrun(seq - self._last_seq - 1)
        self._last_seq = seq
        parsed = parse_xid_message(message)
        if parsed is None:
            return
        pci, xid, detail = parsed
        gi, ci = parse_xid_attribution(message)
        # Live: our clock now, comparable with the NVML listener's. Already in the log:
        # printk's stamp through /proc/uptime, approximate (module docstring).
        stale = boot + since_boot if self._draining and boot is not None else None
        wall, elapsed = self._clock(), self._monotonic()
        event = XidEvent(
            gpu=None,
            uuid=None,
            xid=xid,
            timestamp=wall if stale is None else stale,
            # an old record is as old on the monotonic clock as the wall clock says now
            monotonic=elapsed if stale is None else elapsed - max(0.0, wall - stale),
            source="kmsg",
            gpu_instance_id=gi,
            compute_instance_id=ci,
            pci_bus_id=pci,
            message=detail or None,
            backlog=not self._caught_up.is_set(),
        )
        self._events_total += 1
        try:
            self._on_event(event)
        except Exception:  # a closed consumer must not stop the reader
            self._errors_total += 1
            log.exception("kmsg XID callback failed")

    def _skipped(self, head: bytes) -> None:
        """A record dropped for its length still takes its sequence number."""
        match = _RECORD_HEAD.match(head)
        if match is not None:
            self._last_seq = max(self._last_seq, int(match.group(1)))

    def _overrun(self, lost: int) -> None:
        """Records between the last one read and this one were overwritten unread."""
        self._overruns_total += 1
        self._errors_total += 1
        now = time.monotonic()
        if self._overrun_logged_at is None or now - self._overrun_logged_at >= 60.0:
            self._overrun_logged_at = now
            log.warning(
                "kernel log overrun: %d records were overwritten before they were read "
                "(XIDs among them are lost; %d overruns since start)",
                lost,
                self._overruns_total,
            )

    def _fail(self, exc: OSError) -> None:
        self._errors_total += 1
        self._last_error = errno.errorcode.get(exc.errno or 0, type(exc).__name__)
        log.warning("cannot read %s: %s", self._path, exc.strerror or exc)
