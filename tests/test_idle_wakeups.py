"""The idle floor between cycles is mostly wake-ups: on a small VM each one costs ~0.2-0.4
ms of CPU however little it does (benchmarks/README.md, "Idle floor"). These tests count
a quiet thread's wake-ups from the kernel's side (``voluntary_ctxt_switches`` of the
thread in /proc), so a timer that comes back shows here, not only in the benchmark."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, cast

import pytest

from exporter.reporting.writer import QUIET_WAKE_S, Client, KubeReporter, ReportingOptions


def _switches(native_id: int) -> int:
    for line in Path(f"/proc/self/task/{native_id}/status").read_text().splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    raise AssertionError("no voluntary_ctxt_switches")


def _thread(name: str) -> threading.Thread:
    return next(t for t in threading.enumerate() if t.name == name)


class _NothingToSend:
    """An API client the writer never needs: with nothing handed over it only closes."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    def cut(self) -> None:
        pass

    def close(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:
        self.asked.append(name)
        raise AssertionError(f"the writer asked the API server: {name}")


@pytest.mark.slow  # seconds of an idle writer, counted
def test_a_writer_with_nothing_to_send_sleeps_quietly() -> None:
    """Nothing handed over, nothing failed: the writer thread wakes every QUIET_WAKE_S
    (10 s), not every second; offer() wakes it when a cycle has news."""
    client = _NothingToSend()
    reporter = KubeReporter(ReportingOptions(node_name="n"), lambda: cast(Client, client))
    reporter.start()
    try:
        time.sleep(0.3)
        writer = _thread("kube-writer")
        assert writer.native_id is not None
        before = _switches(writer.native_id)
        time.sleep(3.2)
        woke = _switches(writer.native_id) - before
        assert writer.is_alive()
    finally:
        assert reporter.stop()
    assert QUIET_WAKE_S >= 10
    assert woke <= 1, f"{woke} wake-ups in 3.2 s"
    assert client.asked == []
