"""Log flood control (exporter/logs.py): a repeated error costs one line per period."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from exporter.logs import REPEAT_PERIOD_S, RepeatFilter, setup_logging
from tests.clock import Clock

Captured = tuple[logging.Logger, io.StringIO, Clock, RepeatFilter]


@pytest.fixture
def captured() -> Iterator[Captured]:
    """A logger writing through a RepeatFilter on a manual clock into a buffer."""
    clock = Clock(1000.0)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    repeat = RepeatFilter(60.0, clock=clock, max_kinds=4)
    handler.addFilter(repeat)
    logger = logging.getLogger("tests.logs.flood")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    yield logger, stream, clock, repeat
    logger.handlers.clear()
    logger.propagate = True


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


def test_a_repeated_error_logs_once_per_period_with_its_count(captured: Captured) -> None:
    logger, stream, clock, _ = captured
    for i in range(1235):
        clock.now += 0.04  # 49.4 s of an error every 40 ms
        logger.error("reading %s failed: %d of %d", "/proc", i, 1235)
    assert lines(stream) == ["ERROR tests.logs.flood: reading /proc failed: 0 of 1235"]
    clock.now += 11  # the period (60 s) is over
    logger.error("reading %s failed: %d of %d", "/proc", 7, 1235)
    assert lines(stream)[1:] == [
        "ERROR tests.logs.flood: reading /proc failed: 7 of 1235 "
        "(repeated 1,234 times in the last 60 s)"
    ]
    clock.now += 61  # nothing held back since: no count
    logger.error("reading %s failed: %d of %d", "/proc", 8, 1235)
    assert lines(stream)[2:] == ["ERROR tests.logs.flood: reading /proc failed: 8 of 1235"]


def test_names_tell_errors_apart_and_numbers_do_not(captured: Captured) -> None:
    logger, stream, _, _ = captured
    for _ in range(3):
        logger.error("reading source %s failed", "nvml")
        logger.error("reading source %s failed", "procfs")
        logger.warning("reading source %s failed", "nvml")  # another level: another kind
        logger.warning("overran the %.2f s interval; skipping %d slot(s)", 5.0, 3)
    assert len(lines(stream)) == 4


def test_info_and_debug_are_never_held_back(captured: Captured) -> None:
    logger, stream, _, _ = captured
    for _ in range(5):
        logger.info("serving")
        logger.debug("detail")
    assert len(lines(stream)) == 10


def test_the_kinds_remembered_are_bounded(captured: Captured) -> None:
    logger, stream, _, repeat = captured
    for i in range(100):
        logger.error("pod %s failed", f"pod-{i}")
    assert len(lines(stream)) == 100
    assert len(repeat._kinds) == 4  # max_kinds: the oldest are forgotten
    logger.error("pod %s failed", "pod-99")  # still remembered: held back
    logger.error("pod %s failed", "pod-0")  # forgotten: logged again
    assert lines(stream)[100:] == ["ERROR tests.logs.flood: pod pod-0 failed"]


def test_a_held_back_traceback_is_not_written(captured: Captured) -> None:
    logger, stream, _, _ = captured
    for _ in range(3):
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            logger.exception("socket.accept() out of system resource")
    assert stream.getvalue().count("Traceback") == 1


def test_setup_logging_puts_the_filter_on_every_logger_asyncio_too() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    try:
        setup_logging("info", "text")
        (handler,) = root.handlers
        (repeat,) = [f for f in handler.filters if isinstance(f, RepeatFilter)]
        assert repeat.period_s == REPEAT_PERIOD_S
        stream = io.StringIO()
        handler.setStream(stream)  # type: ignore[attr-defined]
        for _ in range(500):  # as asyncio's loop logs an accept at EMFILE
            logging.getLogger("asyncio").error("socket.accept() out of system resource")
        assert stream.getvalue().count("out of system resource") == 1
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)
