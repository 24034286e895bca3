"""The pieces of the list + watch machinery one at a time: the pacing (backoff that
forgets only by time, the LIST budget), the bounded line reader and event parser, and the
watch thread's states (``KubeWatchSource._list_step``, ``_watch_step``,
``_watch_failed``, ``_watch_healthy``) with the API stand-in or none at all."""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from exporter.sim.kube_api import FakeKubeApi, pod_dict, write_kubeconfig
from exporter.sources.backoff import Backoff, RateBudget
from exporter.sources.kube import PodWatcher
from exporter.sources.kube_watch import (
    FAILURES_DOWN,
    LIST_BURST,
    MALFORMED_DOWN,
    MalformedStream,
    Phase,
    Step,
    WatchEndedEarly,
)
from exporter.sources.watch_stream import (
    LineTooLong,
    StreamBroken,
    WatchError,
    bounded_lines,
    parse_event,
)
from tests.clock import Clock
from tests.test_kube import NODE, fake, wait_for, watcher_factory, watching_one_pod

__all__ = ["fake"]  # a fixture


# -- pacing ------------------------------------------------------------------------------


def test_backoff_with_quiet_reset_starts_over_only_after_that_long_without_a_failure() -> None:
    clock = Clock(1000.0)
    backoff = Backoff(initial_s=0.8, max_s=30.0, rng=lambda: 0.0, quiet_reset_s=120, clock=clock)
    assert [backoff.next_delay() for _ in range(7)] == [0.8, 1.6, 3.2, 6.4, 12.8, 25.6, 30.0]
    clock.now += 30.0 + 119.0  # the last wait, then 119 s of health: not enough
    assert backoff.next_delay() == 30.0
    clock.now += 30.0 + 120.0
    assert backoff.next_delay() == 0.8
    assert backoff.failures == 1


def test_rate_budget_allows_a_burst_then_one_per_period() -> None:
    clock = Clock(1000.0)
    budget = RateBudget(burst=4, period_s=30.0, clock=clock)
    for _ in range(4):
        assert budget.wait_s() == 0
        budget.take()
    assert budget.wait_s() == pytest.approx(30.0)
    clock.now += 10
    assert budget.wait_s() == pytest.approx(20.0)
    clock.now += 20
    assert budget.wait_s() == 0
    budget.take()
    clock.now += 3600  # a long healthy hour refills the burst, no more
    for _ in range(4):
        budget.take()
    assert budget.wait_s() == pytest.approx(30.0)


def test_over_any_window_the_budget_allows_at_most_burst_plus_window_over_period() -> None:
    clock = Clock(1000.0)
    budget = RateBudget(burst=LIST_BURST, period_s=30.0, clock=clock)
    made = 0
    while clock.now < 1000.0 + 300:  # a caller that asks as often as it may
        wait = budget.wait_s()
        if wait > 0:
            clock.now += wait
            continue
        budget.take()
        made += 1
    assert made <= LIST_BURST + 300 / 30 + 1


# -- reading lines -----------------------------------------------------------------------


def test_bounded_lines_splits_across_chunks_and_drops_a_trailing_piece() -> None:
    chunks = [b'{"a"', b": 1}\n{", b'"b": 2}\n\n', b"cut mid-li"]
    assert list(bounded_lines(chunks, limit=64)) == [b'{"a": 1}', b'{"b": 2}', b""]


def test_bounded_lines_raises_before_holding_more_than_the_limit() -> None:
    held: list[int] = []

    def endless() -> Iterator[bytes]:
        for _ in range(1000):
            held.append(1)
            yield b"x" * 10

    with pytest.raises(LineTooLong):
        list(bounded_lines(endless(), limit=95))
    assert len(held) == 10  # stopped at the chunk that crossed the limit
    with pytest.raises(LineTooLong):
        list(bounded_lines([b"x" * 96 + b"\n"], limit=95))
    assert list(bounded_lines([b"x" * 95 + b"\n"], limit=95)) == [b"x" * 95]


def test_parse_event_skips_malformed_and_refuses_what_is_not_a_watch_event() -> None:
    event = parse_event(b'{"type": "ADDED", "object": {"metadata": {"resourceVersion": "7"}}}')
    assert event is not None and (event.kind, event.resource_version) == ("ADDED", "7")
    for line in (
        b"not JSON",
        b"\xff\xfe",
        b"[1, 2]",
        b'{"type": "ADDED", "object": "text"}',
        b'{"type": "SURPRISE", "object": {}}',
        b"   ",
    ):
        assert parse_event(line) is None, line
    with pytest.raises(StreamBroken):
        parse_event(b'{"type": "ADDED"}')
    with pytest.raises(StreamBroken):
        parse_event(b'{"type": "ERROR", "object": {"message": "no code"}}')
    with pytest.raises(WatchError) as gone:
        parse_event(
            b'{"type": "ERROR", "object": {"code": 410, "reason": "Expired", "message": "old"}}'
        )
    assert (gone.value.status, gone.value.reason) == (410, "Expired")


# -- the states --------------------------------------------------------------------------


def test_watch_failures_back_off_and_mark_down_after_the_limit_until_a_clean_window() -> None:
    watcher = PodWatcher(NODE)
    with watcher._lock:
        watcher._set_status_locked(True, None)
    gone = WatchError(410, "Expired", "{}")
    steps = [watcher._watch_failed(gone) for _ in range(FAILURES_DOWN - 1)]
    assert [s.phase for s in steps] == [Phase.BACKOFF] * (FAILURES_DOWN - 1)
    assert [s.reason for s in steps] == ["expired"] * (FAILURES_DOWN - 1)
    delays = [s.delay_s for s in steps]
    assert delays == sorted(delays) and 0.4 <= delays[0] <= 0.8  # growing, jittered
    assert watcher.status().up and watcher.errors_total == 0  # 410s are routine

    step = watcher._watch_failed(gone)
    assert not watcher.status().up
    assert f"{FAILURES_DOWN} failures in a row" in (watcher.status().error or "")
    assert watcher.errors_total == 1  # the loop that took it down counts once
    watcher._watch_failed(gone)
    assert watcher.errors_total == 1
    assert step.delay_s >= delays[-1]

    watcher._watch_healthy()  # a window ran its course
    assert watcher.status().up and watcher.status().error is None


def test_other_watch_failures_are_counted_and_named_by_reason() -> None:
    watcher = PodWatcher(NODE)
    assert watcher._watch_failed(WatchEndedEarly("ended after 0.1 s")).reason == "watch_failed"
    assert watcher._watch_failed(StreamBroken("no object")).reason == "watch_failed"
    assert watcher._watch_failed(LineTooLong(16)).reason == "bad_stream"
    assert watcher.errors_total == 3
    assert dict(watcher.snapshot().counts.dropped_lines) == {"oversize": 1}


def test_a_malformed_stream_marks_down_at_once_and_stays_down_through_a_list() -> None:
    watcher = PodWatcher(NODE)
    with watcher._lock:
        watcher._set_status_locked(True, None)
    for _ in range(MALFORMED_DOWN - 1):
        watcher._take_line(b"garbage")
    assert watcher.status().up
    with pytest.raises(MalformedStream) as bad:
        watcher._take_line(b"garbage")
    step = watcher._watch_failed(bad.value)
    assert (step.phase, step.reason) == (Phase.BACKOFF, "bad_stream")
    assert not watcher.status().up
    assert dict(watcher.snapshot().counts.dropped_lines) == {"malformed": MALFORMED_DOWN}


def test_good_lines_keep_rare_malformed_ones_below_the_share() -> None:
    watcher = PodWatcher(NODE)
    good = b'{"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "9"}}}'
    for _ in range(3 * MALFORMED_DOWN):
        watcher._take_line(good)
        watcher._take_line(b"garbage")
    assert watcher._rv == "9"


@pytest.fixture
def make_watcher(tmp_path: Path) -> Iterator[Callable[..., PodWatcher]]:
    yield from watcher_factory(PodWatcher, tmp_path)


def test_list_step_waits_for_the_budget_and_counts_each_relist_by_reason(
    fake: FakeKubeApi, tmp_path: Path
) -> None:
    fake.set_pod(pod_dict("ml", "trainer", "uid-1", NODE))
    url = fake.start_in_thread()
    watcher = PodWatcher(NODE, kubeconfig=str(write_kubeconfig(tmp_path / "kc", url)))
    never = threading.Event()
    try:
        assert watcher._step(Step(Phase.LIST), never) == Step(Phase.WATCH)
        for _ in range(LIST_BURST - 1):
            assert watcher._step(Step(Phase.LIST, "resync"), never) == Step(Phase.WATCH)
        assert dict(watcher.snapshot().counts.relists) == {"resync": LIST_BURST - 1}
        stopping = threading.Event()
        stopping.set()  # the budget wait returns at once; no LIST is made
        assert watcher._step(Step(Phase.LIST, "resync"), stopping) == Step(Phase.LIST, "resync")
        assert sum(1 for r in fake.requests if not r.watch) == LIST_BURST
    finally:
        watcher.close()


@pytest.mark.slow  # waits out a backoff (0.4-0.8 s)
def test_an_endless_stream_of_skippable_garbage_marks_down_and_restarts_the_watch(
    fake: FakeKubeApi, make_watcher: Callable[..., PodWatcher]
) -> None:
    watcher = watching_one_pod(fake, make_watcher)
    fake.set_watch_garbage([b"not JSON", b'{"type": "ADDED", "object": 3}'])
    fake.disconnect_watchers()
    wait_for(lambda: not watcher.status().up, what="down on malformed lines")
    assert "were malformed" in (watcher.status().error or "")
    wait_for(
        lambda: sum(1 for r in fake.requests if not r.watch) >= 3,
        timeout=10,
        what="relisted after backoff",
    )
    time.sleep(0.2)
    assert not watcher.status().up  # a LIST alone does not clear it
    lists = [r.at for r in fake.requests if not r.watch]
    assert all(b - a >= 0.4 for a, b in itertools.pairwise(lists))
