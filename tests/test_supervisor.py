"""The supervisor of background loops (exporter/sources/base.py) and the liveness rule
(exporter/exposition/liveness.py), on clocks the tests move."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import pytest

from exporter.exposition.liveness import NEXT_CHECK_MARGIN_S, Liveness
from exporter.model import SourceStatus
from exporter.model.vocabulary import LIVENESS_STARTUP_GRACE_S as STARTUP_GRACE_S
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.nvml_library import install
from exporter.sim.scenario import parse_scenario
from exporter.sources.backoff import Backoff
from exporter.sources.base import STALE_PERIODS, Supervisor
from exporter.sources.xid import XidListener
from tests.clock import Clock


def supervisor(period_s: float = 10.0) -> tuple[Supervisor, Clock]:
    clock = Clock(1000.0)
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
    cache, clock = Cache(), Clock(1000.0)
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
    cache, clock = Cache(), Clock(1000.0)
    live = Liveness(cache, interval_s=1.0, cycles=2, clock=clock)
    clock.now += STARTUP_GRACE_S
    assert live.problem() is None
    clock.now += 1
    reason = live.problem()
    assert reason is not None and "since start" in reason


def test_liveness_checks_again_when_the_limit_would_run_out_not_every_interval() -> None:
    cache, clock = Cache(), Clock(1000.0)
    live = Liveness(cache, interval_s=1.0, cycles=10, clock=clock)
    # before the first cycle, every interval: the first render moves the limit from the
    # start-up allowance to a cycle's, and a hang after it must be logged on that limit
    assert live.seconds_to_next_check() == 1.0
    cache.rendered_at = clock.now
    clock.now += 3.0
    live.problem()
    assert live.seconds_to_next_check() == pytest.approx(7.0 + NEXT_CHECK_MARGIN_S)
    clock.now += 7.0 + NEXT_CHECK_MARGIN_S  # nothing rendered since: the check fails at once
    assert live.problem() is not None
    assert live.seconds_to_next_check() == 1.0  # every interval while not live
    cache.rendered_at = clock.now  # a cycle completed: live again
    clock.now += 9.5
    assert live.problem() is None
    assert live.seconds_to_next_check() == 1.0  # never sooner than an interval


async def test_liveness_watch_logs_a_hang_right_after_the_first_cycle_on_its_own_limit(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # The first cycle renders, then sampling stops. The watch, started before that cycle,
    # must log on the cycle's limit (0.1 s here), not on the start-up allowance (60 s).
    caplog.set_level(logging.INFO, logger="exporter.exposition.liveness")
    cache = Cache()
    live = Liveness(cache, interval_s=0.05, cycles=2)
    watching = asyncio.create_task(live.watch())
    try:
        await asyncio.sleep(0.12)
        cache.rendered_at = time.monotonic()
        for _ in range(100):  # 5 s at most
            await asyncio.sleep(0.05)
            if any(r.getMessage().startswith("not live") for r in caplog.records):
                break
        logged_after = time.monotonic() - cache.rendered_at
    finally:
        watching.cancel()
    assert [r.getMessage()[:8] for r in caplog.records] == ["not live"]
    assert logged_after < 2.0


def warnings_and_infos(caplog: pytest.LogCaptureFixture) -> list[tuple[int, str]]:
    return [
        (r.levelno, r.getMessage())
        for r in caplog.records
        if r.name == "exporter.sources.base" and r.levelno >= logging.INFO
    ]


def test_a_source_turning_stale_is_logged_once_and_its_recovery_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="exporter.sources.base")
    sup, clock = supervisor(10.0)
    sup.success()
    clock.now += 35
    for _ in range(50):  # a cycle a second judges it; the served age grows each time
        assert not sup.judge(UP).up
        clock.now += 1
    assert warnings_and_infos(caplog) == [
        (
            logging.WARNING,
            "podresources source is down: no successful refresh for 35 s (more than 3 "
            "periods of 10 s); its loop is stuck or gone",
        )
    ]
    sup.success()
    for _ in range(3):
        assert sup.judge(UP).up
    assert warnings_and_infos(caplog)[1:] == [
        (logging.INFO, "podresources source has current data again")
    ]
    clock.now += 31  # stale again: news again
    sup.judge(UP)
    assert [level for level, _ in warnings_and_infos(caplog)] == [
        logging.WARNING,
        logging.INFO,
        logging.WARNING,
    ]


def test_a_crash_of_a_stale_loop_is_still_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="exporter.sources.base")
    sup, clock = supervisor(1.0)
    clock.now += 5
    sup.judge(UP)
    sup.crash(ValueError("boom"))
    sup.judge(UP)
    levels = [r.levelno for r in caplog.records if r.name == "exporter.sources.base"]
    assert levels == [logging.WARNING, logging.ERROR]


class QuickXidListener(XidListener):
    """The real XID listener with a 0.2 s period (its class setting), so that three missed
    periods pass in well under a second of real time."""

    period_s = 0.2


@pytest.mark.slow  # waits out a 2 s hung call on real time
def test_a_hung_xid_event_wait_is_logged_when_it_goes_stale_and_when_it_answers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """nvmlEventSetWait that does not return (the simulated driver blocks the call): no
    exception, so only staleness can say so, once; once when the wait answers again."""
    caplog.set_level(logging.INFO, logger="exporter.sources.base")
    hang_s = 2.0
    scenario = parse_scenario(
        {
            "gpus": [{}],
            "call_errors": [
                {"call": "nvmlEventSetWait_v2", "error": None, "delay_s": hang_s, "from": 10}
            ],
        },
        "xid-hang",
    )
    clock = ManualClock()
    install(SimNode(scenario, clock))
    listener = QuickXidListener(wait_timeout_ms=50, backoff_initial_s=0.05, backoff_max_s=0.2)
    listener.start()
    try:
        assert _eventually(lambda: listener.registered == (0,) and listener.status().up)
        clock.advance(10)  # the next wait blocks for hang_s real seconds, then the next...
        assert _eventually(lambda: not listener.status().up, timeout_s=hang_s)
        down = listener.status()
        for _ in range(20):  # judged every cycle meanwhile: logged once
            listener.status()
            time.sleep(0.01)
        clock.advance(10)  # still hanging; then the driver answers promptly again
        scenario.call_errors[0].until = clock()
        assert _eventually(lambda: listener.status().up, timeout_s=3 * hang_s)
        for _ in range(5):
            listener.status()
    finally:
        listener.stop()
    assert down.error is not None and down.error.startswith("no successful refresh for ")
    assert [(level, text.split(":")[0]) for level, text in warnings_and_infos(caplog)] == [
        (logging.WARNING, "xid source is down"),
        (logging.INFO, "xid source has current data again"),
    ]


def _eventually(predicate: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()
