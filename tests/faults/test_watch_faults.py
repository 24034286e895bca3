"""The API server feeding the watches garbage, 410 loops and a line too long to hold.

Both watches (pods and ResourceSlices) run as in the exporter, the real ``kubernetes``
client configuration against the API stand-in ``exporter/sim/kube_api.py``, whose
fault knobs (``set_watch_garbage``, ``set_watch_bookmark_then_gone``, ``send_huge_line``)
inject each fault at the HTTP edge. What is measured is what the API server sees: the
LIST and WATCH requests it logs, against the budget docs/reliability.md states
("Watch pacing and the LIST budget").
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable

import pytest

from exporter.sim.kube_api import FakeKubeApi, pod_dict
from exporter.sources.kube_watch import FAILURES_DOWN, LIST_BURST, LIST_PERIOD_S, MALFORMED_DOWN
from tests.faults.conftest import RecordFault
from tests.faults.test_api_faults import PODS, SLICES, Watches, watches, watching
from tests.test_kube import CID_B, NODE, fake, wait_for
from tests.test_resourceslices import UUID_0, gpu, nvidia_slice

__all__ = ["fake", "watches"]  # fixtures

MIB = 1024 * 1024
FAULT_S = 12.0  # how long each fault runs while requests are counted
GARBAGE = (
    b"this is not JSON",
    b'{"type": "ADDED", "object": "not an object"}',
    b'{"type": "SURPRISE", "object": {"metadata": {"uid": "x", "name": "x"}}}',
    b'{"type": "ADDED"}',  # JSON but not a watch event: the stream cannot go on
)


@pytest.fixture(autouse=True)
def node_objects(fake: FakeKubeApi) -> None:
    """The node's one pod and its one GPU, published by the NVIDIA DRA driver."""
    fake.set_pod(pod_dict("ml", "trainer-0", "uid-1", NODE))
    fake.set_resource_slice(nvidia_slice("n1-a", NODE, gpu(0, UUID_0)))


def requests_between(fake: FakeKubeApi, path: str, began: float, ended: float) -> int:
    """LIST and WATCH requests for ``path`` the API server got in [began, ended)."""
    return sum(1 for r in fake.requests if r.path == path and began <= r.at < ended)


def budget(seconds: float) -> int:
    """The most LIST + WATCH requests one watch may make in ``seconds`` when no window
    runs its course: LISTs from a full bucket, a WATCH after each, and the WATCH that
    was open when the window began (docs/reliability.md)."""
    lists = LIST_BURST + int(seconds / LIST_PERIOD_S)
    return 2 * lists + 1


def relists(w: Watches, reason: str) -> list[int]:
    return [dict(x.snapshot().counts.relists).get(reason, 0) for x in w.both()]


def dropped(w: Watches, reason: str) -> list[int]:
    return [dict(x.snapshot().counts.dropped_lines).get(reason, 0) for x in w.both()]


def every_relist_counted(fake: FakeKubeApi, w: Watches) -> bool:
    """Each watch's relists by reason add up to its LISTs after the first."""
    made = [sum(1 for r in fake.requests if not r.watch and r.path == p) for p in (PODS, SLICES)]
    counted = [sum(n for _, n in x.snapshot().counts.relists) for x in w.both()]
    return counted == [n - 1 for n in made]


def under_fault(fake: FakeKubeApi, w: Watches, start: Callable[[], None]) -> tuple[int, int]:
    """Start a fault on every new watch, cut the open ones so they reconnect into it,
    and count each path's requests for ``FAULT_S``."""
    start()
    began = time.monotonic()
    fake.disconnect_watchers()
    time.sleep(FAULT_S)
    ended = time.monotonic()
    return (
        requests_between(fake, PODS, began, ended),
        requests_between(fake, SLICES, began, ended),
    )


@pytest.mark.slow  # runs the fault for 12 s
def test_api_garbage_event_stream(
    fake: FakeKubeApi, watches: Callable[[str], Watches], record_fault: RecordFault
) -> None:
    _, w = watching(fake, watches)
    counts = under_fault(fake, w, lambda: fake.set_watch_garbage(GARBAGE))

    limit = budget(FAULT_S)
    assert max(counts) <= limit, f"{counts} requests in {FAULT_S} s, budget {limit} per watch"
    for x in w.both():
        status = x.status()
        assert not status.up, f"{x.name} up while every watch line is garbage"
        assert "watch lines since the last clean watch window were malformed" in (
            status.error or ""
        )
    assert all(n >= MALFORMED_DOWN for n in dropped(w, "malformed"))
    assert every_relist_counted(fake, w)
    errors = [x.errors_total for x in w.both()]
    assert all(n >= 1 for n in errors)

    record_fault(
        "api-garbage-event-stream",
        expected="Watches answered with nothing but malformed lines stay within the LIST "
        "budget (backoff after every broken stream, at most 4 LISTs then one per 30 s), "
        f"count every dropped line, and go down once {MALFORMED_DOWN} malformed lines "
        "outnumber the good ones.",
        figure=f"{counts[0]} and {counts[1]} LIST+WATCH requests in {FAULT_S:.0f} s "
        f"({counts[0] / FAULT_S:.2f} and {counts[1] / FAULT_S:.2f} per s; budget "
        f"{limit}); {dropped(w, 'malformed')} lines dropped, both down, "
        f"{errors} errors counted",
    )


@pytest.mark.slow  # runs the fault for 12 s
def test_api_bookmark_410_loop(
    fake: FakeKubeApi, watches: Callable[[str], Watches], record_fault: RecordFault
) -> None:
    _, w = watching(fake, watches)
    counts = under_fault(fake, w, lambda: fake.set_watch_bookmark_then_gone(True))

    limit = budget(FAULT_S)
    assert max(counts) <= limit, f"{counts} requests in {FAULT_S} s, budget {limit} per watch"
    for x in w.both():
        status = x.status()
        assert not status.up, f"{x.name} up while no watch stays open"
        assert f"{FAILURES_DOWN} failures in a row without a clean watch window" in (
            status.error or ""
        )
    expired = relists(w, "expired")
    assert all(n >= FAILURES_DOWN - 2 for n in expired)  # after the cut, 410 after 410
    assert every_relist_counted(fake, w)
    # The cut is an error; the 410s are routine, except the one that took it down.
    assert [x.errors_total for x in w.both()] == [2, 2]
    assert all(r.status == 410 for r in fake.requests[-4:] if r.watch)

    record_fault(
        "api-bookmark-410-loop",
        expected="Watches answered with a BOOKMARK and then 410 Gone, over and over, back "
        "off after every 410 and stay within the LIST budget; each relist is counted "
        f"(reason expired) and {FAILURES_DOWN} failures in a row mark the source down, "
        "counting one error.",
        figure=f"{counts[0]} and {counts[1]} LIST+WATCH requests in {FAULT_S:.0f} s "
        f"({counts[0] / FAULT_S:.2f} and {counts[1] / FAULT_S:.2f} per s; budget "
        f"{limit}); {expired} relists for 410, both down",
    )


class PeakRss:
    """Samples this process's resident set every 2 ms in a thread; ``stop()`` returns
    the highest growth over the first sample, in bytes."""

    def __init__(self) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.base = self.peak = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, self._rss())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak - self.base


@pytest.mark.slow  # streams up to 300 MiB over loopback
def test_api_huge_watch_line(
    fake: FakeKubeApi, watches: Callable[[str], Watches], record_fault: RecordFault
) -> None:
    _, w = watching(fake, watches)
    rss = PeakRss()
    sent_at = time.monotonic()
    assert fake.send_huge_line(300 * MIB, resource="pods") == 1
    wait_for(
        lambda: (
            dropped(w, "oversize")[0] == 1
            and sum(1 for r in fake.requests if not r.watch and r.path == PODS) == 2
            and fake.watcher_count == 2
        ),
        timeout=30,
        what="the long line dropped, the pods relisted and watched again",
    )
    resumed_s = time.monotonic() - sent_at
    fake.set_pod(pod_dict("ml", "after", "uid-2", NODE, containers=[("main", CID_B)]))
    wait_for(lambda: len(w.pods.snapshot().pods) == 2, what="an event on the new watch")
    growth = rss.stop()

    assert growth < 50 * MIB, f"RSS grew {growth / MIB:.0f} MiB reading one watch line"
    assert dropped(w, "oversize") == [1, 0]
    assert relists(w, "bad_stream") == [1, 0]
    assert every_relist_counted(fake, w)
    assert [x.errors_total for x in w.both()] == [1, 0]
    assert w.pods.status().up and w.slices.status().up  # one relist: current data
    cut = next(r for r in fake.requests if r.watch and r.path == PODS and r.outcome != "open")
    assert cut.outcome == "closed"  # dropped by the exporter, not read to its end

    record_fault(
        "api-huge-watch-line",
        expected="A watch line over 16 MiB is dropped without being read whole: the "
        "connection is closed, the line and the relist counted (oversize, bad_stream), "
        "the watch relisted after the backoff, and RSS stays within 50 MiB of before.",
        figure=f"one 300 MiB line: peak RSS growth {growth / MIB:.1f} MiB; dropped and "
        f"watching again {resumed_s:.2f} s after it was sent; 1 error, source up",
    )
