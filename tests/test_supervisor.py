"""The supervisor of background loops (exporter/sources/base.py) and the liveness rule
(exporter/exposition/liveness.py), on clocks the tests move."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from exporter.exposition.liveness import STARTUP_GRACE_S, Liveness
from exporter.model import SourceStatus
from exporter.sources.backoff import Backoff
from exporter.sources.base import STALE_PERIODS, Supervisor


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def supervisor(period_s: float = 10.0) -> tuple[Supervisor, Clock]:
    clock = Clock()
    return Supervisor("podresources", period_s, monotonic=clock, wall_clock=lambda: 5e8), clock


UP = SourceStatus("podresources", True)


def test_a_source_is_up_until_its_last_success_is_older_than_three_periods() -> None:
    sup, clock = supervisor(10.0)
    sup.success()
    clock.now += STALE_PERIODS * 10.0
    assert sup.judge(UP).up
    clock.now += 5
    judged = sup.judge(UP)
    assert not judged.up and judged.error == "no successful refresh for 35 s"
    assert judged.last_success == 5e8  # the wall clock's time of the success
    sup.success()
    assert sup.judge(UP).up


def test_a_source_that_never_succeeded_goes_stale_from_its_start() -> None:
    sup, clock = supervisor(1.0)
    assert sup.judge(UP).up and sup.judge(UP).last_success is None
    clock.now += 3.5
    assert sup.judge(UP).error == "no success since start for 3.5 s"


def test_a_down_source_keeps_its_own_reason_when_also_stale() -> None:
    sup, clock = supervisor(1.0)
    clock.now += 100
    down = SourceStatus("podresources", False, "socket missing")
    assert sup.judge(down) == down


def test_a_crash_is_counted_logged_once_per_distinct_error_and_down_until_a_success(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="exporter.sources.base")
    sup, _ = supervisor()
    sup.success()
    for _ in range(3):
        sup.crash(AttributeError("'NoneType' object has no attribute 'pod_resources'"))
    sup.crash(ValueError("other"))
    judged = sup.judge(UP)
    assert sup.crashes == 4
    assert not judged.up and judged.error == "loop failed: ValueError: other"
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 2  # the AttributeError once, the ValueError once
    sup.success()
    assert sup.judge(UP).up
    sup.crash(ValueError("other"))  # after a recovery the same error is news again
    assert len([r for r in caplog.records if r.levelno >= logging.ERROR]) == 3


async def test_run_async_goes_on_after_an_exception_with_backoff() -> None:
    sup, _ = supervisor()
    calls: list[int] = []

    async def step() -> float:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        if len(calls) >= 4:
            await asyncio.Event().wait()  # park
        return 0.0

    task = asyncio.create_task(sup.run_async(step, Backoff(initial_s=0.01, max_s=0.01)))
    while len(calls) < 4:
        await asyncio.sleep(0.005)
    assert not task.done() and sup.crashes == 1
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_run_thread_runs_the_body_again_after_it_raised() -> None:
    sup, _ = supervisor()
    stop = threading.Event()
    runs: list[int] = []

    def body() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise OSError("the log went away")
        sup.success()
        stop.wait()

    thread = threading.Thread(
        target=sup.run_thread, args=(body, stop, Backoff(initial_s=0.01, max_s=0.01))
    )
    thread.start()
    try:
        for _ in range(500):
            if len(runs) >= 3 and sup.judge(UP).up:
                break
            threading.Event().wait(0.01)
        assert len(runs) == 3 and sup.crashes == 2 and sup.judge(UP).up
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


class Cache:
    rendered_at: float | None = None


def test_liveness_fails_after_k_intervals_without_a_cycle_and_logs_each_change_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.exposition.liveness")
    cache, clock = Cache(), Clock()
    live = Liveness(cache, interval_s=5.0, cycles=10, clock=clock)
    cache.rendered_at = clock.now
    clock.now += 50
    assert live.problem() is None
    clock.now += 1
    for _ in range(3):
        reason = live.problem()
    assert reason is not None and reason.startswith("no sample cycle has completed for 51 s")
    assert "--liveness-cycles 10 x --interval 5 s" in reason and "\n" not in reason
    cache.rendered_at = clock.now
    assert live.problem() is None and live.problem() is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("not live") and messages[1].startswith("live again")


def test_liveness_allows_a_slow_start_at_least_the_startup_grace() -> None:
    cache, clock = Cache(), Clock()
    live = Liveness(cache, interval_s=1.0, cycles=2, clock=clock)
    clock.now += STARTUP_GRACE_S
    assert live.problem() is None
    clock.now += 1
    reason = live.problem()
    assert reason is not None and "since start" in reason
