"""The kernel log's clock against the clocks the exporter converts it with (no GPU needed).

/dev/kmsg stamps each record with printk's clock (``local_clock()``, microseconds since
boot); the kmsg reader turns that into wall time as ``now - /proc/uptime + stamp``
(exporter/sources/kmsg.py ``boot_epoch``), which assumes printk's clock runs with
CLOCK_BOOTTIME. If the two drift apart on long uptimes, a kmsg XID stamped that way and
its NVML twin land further apart than the ledger's de-duplication window (docs/xid.md,
"Timestamps"), which is why live records are stamped on arrival and only the backlog goes
through /proc/uptime. This check writes one marker record, reads its stamp back and
prints how far each conversion is off and how fast that grows: the error a backlog
XID's time carries on this host.
"""

from __future__ import annotations

import dataclasses
import os
import select
import time
import uuid

import pytest

from exporter.analysis.xid import XidLedger
from exporter.sources.kmsg import boot_epoch, parse_kmsg_record
from tests.gpu.conftest import requires_gpu

KMSG = "/dev/kmsg"


def _open(flags: int, why: str) -> int:
    try:
        return os.open(KMSG, flags)
    except OSError as exc:
        pytest.skip(f"cannot {why} {KMSG}: {exc.strerror} (needs root or CAP_SYSLOG)")


def _find(fd: int, marker: str, timeout_s: float = 2.0) -> tuple[int, float, str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            chunk = os.read(fd, 8192)
        except BlockingIOError:
            select.select([fd], [], [], 0.1)
            continue
        record = parse_kmsg_record(chunk.decode("utf-8", "replace"))
        if record is not None and marker in record[2]:
            return record
    raise AssertionError(f"marker {marker!r} not read back from {KMSG} in {timeout_s} s")


# No GPU is needed for the measurement, but it writes to the kernel log and depends on
# the host's clocks: it runs on the GPU hosts it is meant to validate, not in CI.
@requires_gpu
def test_kmsg_stamps_converted_through_uptime_match_wall_time() -> None:
    reader = _open(os.O_RDONLY | os.O_NONBLOCK, "read")
    try:
        os.lseek(reader, 0, os.SEEK_END)  # skip the backlog
        writer = _open(os.O_WRONLY, "write a marker to")
        marker = f"gpu-occupancy-exporter kmsg clock check {uuid.uuid4().hex[:8]}"
        try:
            wall = time.time()
            boot = time.clock_gettime(time.CLOCK_BOOTTIME)
            mono = time.clock_gettime(time.CLOCK_MONOTONIC)
            os.write(writer, f"<7>{marker}\n".encode())
        finally:
            os.close(writer)
        _, stamp, _ = _find(reader, marker)
    finally:
        os.close(reader)
    epoch = boot_epoch("/proc", time.time())
    assert epoch is not None, "cannot read /proc/uptime"
    converted_error = epoch + stamp - wall
    window = next(f.default for f in dataclasses.fields(XidLedger) if f.name == "dedup_window_s")
    assert isinstance(window, float)
    rate = (stamp - boot) / boot if boot > 0 else 0.0
    days = window / abs(rate) / 86400 if rate else float("inf")
    print(
        f"\nuptime {boot:.0f} s: kmsg stamp - CLOCK_BOOTTIME {(stamp - boot) * 1000:+.1f} ms, "
        f"- CLOCK_MONOTONIC {(stamp - mono) * 1000:+.1f} ms; uptime-converted stamp - wall "
        f"time {converted_error * 1000:+.1f} ms; drift {rate * 1e6:+.1f} ppm "
        f"(the {window:.0f} s de-dup window is used up after {days:.0f} days of uptime)"
    )
    assert abs(converted_error) <= window, (
        f"kmsg stamps converted through /proc/uptime are {converted_error:+.1f} s off wall "
        f"time, more than the {window:.0f} s de-dup window: printk's clock drifts here, "
        "backlog XID times are that far off"
    )
