"""What an API server may cost a watch, and the watch the API server: one request per
LIST (no retries hidden in the client), ``Retry-After`` honoured up to the backoff's
ceiling, objects of other nodes dropped, a ceiling on the objects kept, O(1) work per
event, a wall-clock deadline on every request, a bounded resourceVersion, and a stop()
that cuts whatever request the thread is in.

The real ``kubernetes`` client runs against the API stand-in
(``exporter/sim/kube_api.py``) or, for answers no API server would give (a reset, a
trickle, silence), a few lines of asyncio here. What is measured is what the server
sees: requests, and how long their connections stayed open.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest

from exporter.model import PodMeta
from exporter.sim.kube_api import FakeKubeApi, pod_dict
from exporter.sources.kube import MAX_PODS, PodWatcher
from exporter.sources.kube_watch import BACKOFF_MAX_S, LIST_BURST
from exporter.sources.resourceslices import ResourceSliceWatcher
from exporter.sources.watch_stream import MAX_RESOURCE_VERSION_BYTES, parse_event
from tests.test_kube import NODE, fake, synced, wait_for, watcher_factory, watching_one_pod
from tests.test_resourceslices import UUID_0, UUID_1, gpu, nvidia_slice

__all__ = ["fake"]  # a fixture

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, bool], Awaitable[None]]


class RawApi:
    """An HTTP/1.1 server on loopback that answers as ``handler`` says (raw bytes),
    logging each request: (watch?, when it came, when its connection ended)."""

    def __init__(self, handler: Handler) -> None:
        self._handler = handler
        self._lock = threading.Lock()
        self.requests: list[tuple[bool, float, float | None]] = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.Server | None = None

    def start(self) -> str:
        self._thread.start()

        async def serve() -> int:
            self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
            port: int = self._server.sockets[0].getsockname()[1]
            return port

        port = asyncio.run_coroutine_threadsafe(serve(), self._loop).result(5)
        return f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def lists(self) -> list[tuple[bool, float, float | None]]:
        with self._lock:
            return [r for r in self.requests if not r[0]]

    def watches(self) -> list[tuple[bool, float, float | None]]:
        with self._lock:
            return [r for r in self.requests if r[0]]

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        index = None
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                target = head.split(b"\r\n", 1)[0].split(b" ")[1]
                watch = b"watch=true" in target.lower() or b"watch=1" in target
                with self._lock:
                    index = len(self.requests)
                    self.requests.append((watch, time.monotonic(), None))
                await self._handler(reader, writer, watch)
                if writer.is_closing():
                    return
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:  # stop(): the test is over
            pass
        finally:
            if index is not None:
                with self._lock:
                    watch, at, _ = self.requests[index]
                    self.requests[index] = (watch, at, time.monotonic())
            writer.close()


def pod_list(pods: Iterable[dict[str, Any]] = ()) -> bytes:
    body = {"kind": "PodList", "metadata": {"resourceVersion": "5"}, "items": list(pods)}
    return json.dumps(body).encode()


async def answer_list(writer: asyncio.StreamWriter) -> None:
    body = pod_list([pod_dict("ml", "trainer", "uid-1", NODE)])
    head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
    writer.write(head + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    await writer.drain()


async def trickle(writer: asyncio.StreamWriter, every_s: float = 0.3) -> None:
    """A chunked 200 answer that sends one space at a time and never a newline."""
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n")
    writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
    while True:
        writer.write(b"1\r\n \r\n")
        await writer.drain()
        await asyncio.sleep(every_s)


@pytest.fixture
def make_watcher(tmp_path: Path) -> Iterator[Callable[..., PodWatcher]]:
    yield from watcher_factory(PodWatcher, tmp_path)


# -- 1. one request per LIST ---------------------------------------------------------------


@pytest.mark.slow  # seconds of real LIST budget
def test_a_429_is_one_request_and_the_lists_stay_within_the_budget(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    """An overloaded API server answers everything 429 with Retry-After: 1. urllib3's
    default Retry(3) made each budgeted LIST four requests, one a second."""
    fake.set_error(429, "too many requests", retry_after=1)
    watcher = make_watcher(fake.start_in_thread())
    began = time.monotonic()
    time.sleep(6.0)
    made = [r.at for r in fake.requests if not r.watch and r.at < began + 6.0]
    assert len(made) <= LIST_BURST, f"{len(made)} LISTs in 6 s"
    assert all(b - a >= 0.95 for a, b in itertools.pairwise(made))  # Retry-After
    assert watcher.errors_total == len(made)  # every request is one counted failure
    assert not watcher.status().up


@pytest.mark.slow  # seconds of real LIST budget
def test_resyncs_spend_the_list_budget_where_no_backoff_paces_them(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    """A resync is no failure, so no backoff paces it: with a resync due after every
    1 s watch window, only the LIST budget keeps this watch from listing once a second
    (docs/reliability.md: every LIST takes a token, the periodic resync included). The
    burst goes, then the next LIST waits ~30 s for its token."""
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE))
    watcher = make_watcher(fake.start_in_thread(), resync_s=0.01, watch_timeout_s=1)

    def lists() -> list[float]:
        return [r.at for r in fake.requests if not r.watch]

    wait_for(lambda: len(lists()) >= LIST_BURST, 4 * LIST_BURST, "the burst of LISTs")
    burst_ended = lists()[LIST_BURST - 1]
    # Without the budget the next resync LIST comes one watch window (1 s) later.
    while time.monotonic() < burst_ended + 2.0:
        time.sleep(0.1)
    assert len(lists()) == LIST_BURST, [round(at - lists()[0], 2) for at in lists()]
    assert dict(watcher.snapshot().counts.relists) == {"resync": LIST_BURST - 1}
    assert watcher.errors_total == 0  # nothing failed: no backoff was ever drawn


def test_a_reset_connection_is_one_request_not_four(
    make_watcher: Callable[..., PodWatcher],
) -> None:
    """urllib3's default Retry(3) retried a reset three times inside each LIST."""

    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, w: bool) -> None:
        writer.transport.abort()

    server = RawApi(reset)
    url = server.start()
    try:
        watcher = make_watcher(url)
        time.sleep(3.0)
        made = len(server.lists())
        # The first LIST, and the backoff's 0.4-0.8 s and 0.8-1.6 s waits between retries.
        assert 1 <= made <= 3, f"{made} LIST requests in 3 s"
        assert watcher.errors_total == made
        assert "retries" not in (watcher.status().error or "")  # none was made
        watcher.close()
    finally:
        server.stop()


# -- 2. Retry-After, ours ------------------------------------------------------------------


def test_retry_after_is_honoured_counted_and_said(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher], caplog: pytest.LogCaptureFixture
) -> None:
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE))
    fake.set_error(429, "too many requests", retry_after=2, times=1)
    watcher = make_watcher(fake.start_in_thread())
    wait_for(lambda: watcher.status().up, 8.0, "up after the 429")
    made = [r.at for r in fake.requests if not r.watch]
    assert len(made) == 2 and made[1] - made[0] >= 1.9  # waited as asked, not 0.4-0.8 s
    assert watcher.errors_total == 1
    assert any("HTTP 429" in r.getMessage() for r in caplog.records)


def test_a_retry_after_of_a_day_waits_the_backoff_ceiling_and_stop_interrupts_it(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher], caplog: pytest.LogCaptureFixture
) -> None:
    """One 429 with Retry-After: 100000 switched the pod watch off for 27 hours, with
    the source down, no error counted, no log line, and a stop() that could not end it."""
    fake.set_error(429, "too many requests", retry_after=100000)
    watcher = make_watcher(fake.start_in_thread())
    wait_for(lambda: watcher.errors_total == 1, 5.0, "the 429 counted")
    assert "HTTP 429" in (watcher.status().error or "")
    wait_for(
        lambda: any("waiting at most 30 s" in r.getMessage() for r in caplog.records),
        2.0,
        "the capped wait said",
    )
    assert sum(1 for r in fake.requests if not r.watch) == 1
    began = time.monotonic()
    watcher.close()
    assert time.monotonic() - began < 1.0


def test_the_wait_after_a_429_is_retry_after_capped_at_the_backoff_ceiling() -> None:
    from kubernetes.client.exceptions import ApiException

    watcher = PodWatcher(NODE)
    for asked, low, high in (("100000", 30.0, 30.0), ("7", 7.0, 7.0), ("0", 0.4, 0.8)):
        exc = ApiException(status=429, reason="Too Many Requests")
        exc.headers = {"Retry-After": asked}
        delay = watcher._watch_failed(exc).delay_s
        assert low <= delay <= high, (asked, delay)
        watcher._backoff.reset()
    assert BACKOFF_MAX_S == 30.0
    exc = ApiException(status=500, reason="Internal")
    exc.headers = {"Retry-After": "100000"}  # only 429 and 503 ask for a wait
    assert watcher._watch_failed(exc).delay_s <= 0.8


# -- 3. other nodes, a ceiling, O(1) per event ---------------------------------------------


def test_pods_of_other_nodes_are_dropped_when_the_server_ignores_the_selector(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher], caplog: pytest.LogCaptureFixture
) -> None:
    fake.set_field_selector_ignored(True)
    fake.set_pod(pod_dict("ml", "mine", "uid-1", NODE))
    for i in range(3):
        fake.set_pod(pod_dict("ml", f"other-{i}", f"uid-o{i}", f"other-node-{i}"))
    watcher = make_watcher(fake.start_in_thread())
    synced(watcher, 1)
    wait_for(lambda: fake.watcher_count == 1, what="watch open")
    for i in range(3, 50):  # through the watch now
        fake.set_pod(pod_dict("ml", f"other-{i}", f"uid-o{i}", f"other-node-{i}"))
    fake.set_pod(pod_dict("ml", "mine-2", "uid-2", NODE))
    snap = synced(watcher, 2)
    assert [p.name for p in snap.pods] == ["mine", "mine-2"]
    fake.set_pod(pod_dict("ml", "mine-2", "uid-2", "elsewhere"))  # moved off this node
    assert [p.name for p in synced(watcher, 1).pods] == ["mine"]
    said = [r for r in caplog.records if "of other nodes" in r.getMessage()]
    assert len(said) == 1


def test_resourceslices_of_other_nodes_are_dropped_when_the_server_ignores_the_selector(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    fake.set_field_selector_ignored(True)
    fake.set_resource_slice(nvidia_slice("mine", NODE, gpu(0, UUID_0)))
    fake.set_resource_slice(nvidia_slice("theirs", "other-node", gpu(1, UUID_1)))
    make = watcher_factory(ResourceSliceWatcher, tmp_path)
    watcher = next(make)(fake.start_in_thread())
    try:
        wait_for(lambda: watcher.snapshot().ok, what="listed")
        wait_for(lambda: fake.watcher_count == 1, what="watch open")
        fake.set_resource_slice(nvidia_slice("theirs-2", "other-node-2", gpu(2, UUID_1)))
        fake.set_resource_slice(nvidia_slice("mine-2", NODE, gpu(3, UUID_1)))
        wait_for(lambda: len(watcher.snapshot().devices) == 2, what="mine-2 applied")
        assert {d.name for d in watcher.snapshot().devices} == {"gpu-0", "gpu-3"}
    finally:
        next(make, None)


def added(uid: str, node: str = NODE, rv: int = 10) -> bytes:
    pod = pod_dict("ml", f"pod-{uid}", uid, node)
    pod["metadata"]["resourceVersion"] = str(rv)
    return json.dumps({"type": "ADDED", "object": pod}).encode()


def test_a_flood_of_pods_over_the_ceiling_hands_over_nothing(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    watcher = watching_one_pod(fake, make_watcher)
    fake.send_raw(b"\n".join(added(f"flood-{i}") for i in range(MAX_PODS)))
    wait_for(lambda: not watcher.status().up, 10.0, "down over the ceiling")
    snap = watcher.snapshot()
    assert snap.pods == () and not snap.ok
    assert f"more than {MAX_PODS} pods" in (snap.error or "")
    assert watcher.errors_total == 1
    # The relist after the backoff lists one pod; the source stays down (and empty of
    # anything but that list) until a watch window runs its course.
    wait_for(lambda: sum(1 for r in fake.requests if not r.watch) == 2, 5.0, "relisted")
    time.sleep(0.2)
    assert not watcher.status().up


def test_a_list_over_the_ceiling_hands_over_nothing(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    for i in range(MAX_PODS + 1):
        fake.set_pod(pod_dict("ml", f"p{i}", f"uid-{i}", NODE))
    watcher = make_watcher(fake.start_in_thread())
    wait_for(lambda: watcher.errors_total >= 1, 10.0, "the LIST refused")
    snap = watcher.snapshot()
    assert not snap.ok and snap.pods == ()
    assert f"more than {MAX_PODS} pods" in (snap.error or "")


class CountingPodWatcher(PodWatcher):
    """Counts how often the sorted snapshot items are built."""

    builds = 0

    def _items(self, values: Iterable[PodMeta]) -> tuple[PodMeta, ...]:
        self.builds += 1
        return super()._items(values)


def test_each_event_costs_a_dict_update_and_the_sort_happens_once_per_read() -> None:
    watcher = CountingPodWatcher(NODE)
    for i in range(2000):
        watcher._take_line(added(f"u{i:05d}", rv=i + 1))
    assert watcher.builds == 0
    snap = watcher.snapshot()
    assert watcher.builds == 1 and len(snap.pods) == 2000
    assert snap.pods == tuple(sorted(snap.pods, key=lambda p: (p.namespace, p.name, p.uid)))
    assert watcher.snapshot() is snap and watcher.builds == 1  # no change: the same one
    watcher._take_line(added("u00000", node="elsewhere", rv=3000))
    assert len(watcher.snapshot().pods) == 1999 and watcher.builds == 2


# -- 4. deadlines --------------------------------------------------------------------------


@pytest.mark.slow  # the watch deadline is its window (1 s) + 10 s
def test_a_trickling_watch_is_cut_at_its_deadline(
    make_watcher: Callable[..., PodWatcher], caplog: pytest.LogCaptureFixture
) -> None:
    """A byte every 0.3 s never trips urllib3's read timeout (one read): the watch
    stayed open past its window, the source up on frozen data."""
    caplog.set_level(logging.DEBUG, logger="exporter.sources.kube_watch")

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, w: bool) -> None:
        await (trickle(writer) if w else answer_list(writer))

    server = RawApi(handler)
    url = server.start()
    try:
        watcher = make_watcher(url, watch_timeout_s=1)
        wait_for(lambda: watcher.errors_total >= 1, 20.0, "the trickling watch failed")
        assert any("no complete answer within 11 s" in r.getMessage() for r in caplog.records)
        wait_for(lambda: server.watches()[0][2] is not None, 2.0, "the watch connection closed")
        first = server.watches()[0]
        assert first[2] is not None and first[2] - first[1] < 13.0  # cut, not left open
        assert dict(watcher.snapshot().counts.relists).get("watch_failed", 0) <= 1
    finally:
        server.stop()


def test_a_trickling_list_is_cut_at_its_deadline(make_watcher: Callable[..., PodWatcher]) -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, w: bool) -> None:
        await trickle(writer)

    server = RawApi(handler)
    url = server.start()
    try:
        watcher = make_watcher(url, list_deadline_s=1.5)
        wait_for(lambda: watcher.errors_total >= 1, 5.0, "the trickling LIST failed")
        assert "no complete answer within 1.5 s" in (watcher.status().error or "")
        wait_for(lambda: server.lists()[0][2] is not None, 2.0, "the LIST connection closed")
        first = server.lists()[0]
        assert first[2] is not None and first[2] - first[1] < 3.0
    finally:
        server.stop()


async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, w: bool) -> None:
    await asyncio.sleep(3600)


def test_a_list_the_server_never_answers_is_a_counted_failure(
    make_watcher: Callable[..., PodWatcher],
) -> None:
    server = RawApi(silent)
    url = server.start()
    try:
        watcher = make_watcher(url, list_deadline_s=1.0)
        wait_for(lambda: watcher.errors_total >= 1, 5.0, "the unanswered LIST counted")
        assert not watcher.status().up
    finally:
        server.stop()


def test_stop_cuts_a_request_that_has_no_answer_yet(
    make_watcher: Callable[..., PodWatcher],
) -> None:
    server = RawApi(silent)
    url = server.start()
    try:
        watcher = make_watcher(url)
        wait_for(lambda: len(server.lists()) == 1, what="the LIST sent")
        thread = watcher._thread
        began = time.monotonic()
        watcher.close()
        assert time.monotonic() - began < 1.0  # the agent gives all sources 3 s
        assert thread is not None and not thread.is_alive()
    finally:
        server.stop()


# -- 5. resourceVersion --------------------------------------------------------------------


def test_a_resource_version_out_of_bounds_makes_the_event_malformed() -> None:
    def bookmark(rv: object) -> bytes:
        return json.dumps(
            {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": rv}}}
        ).encode()

    assert parse_event(bookmark("123456")) is not None
    assert parse_event(bookmark("x" * MAX_RESOURCE_VERSION_BYTES)) is not None
    assert parse_event(bookmark(None)) is not None  # none at all: the last one stays
    for bad in ("9" * (MAX_RESOURCE_VERSION_BYTES + 1), "12&watch=false", "1 2", 7, [1]):
        assert parse_event(bookmark(bad)) is None, bad


def test_a_huge_bookmark_resource_version_never_reaches_the_next_watch_url(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    watcher = watching_one_pod(fake, make_watcher)
    huge = "9" * (1024 * 1024)
    fake.send_raw(
        json.dumps({"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": huge}}}).encode()
    )
    wait_for(
        lambda: dict(watcher.snapshot().counts.dropped_lines).get("malformed") == 1,
        what="the bookmark dropped",
    )
    fake.disconnect_watchers()
    wait_for(lambda: sum(1 for r in fake.requests if r.watch) >= 2, 5.0, "watched again")
    again = [r for r in fake.requests if r.watch][1]
    assert len(again.params.get("resourceVersion", "")) <= MAX_RESOURCE_VERSION_BYTES
