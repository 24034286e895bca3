"""Log set-up: readable text for people, one JSON object per line for collectors, and
flood control, so a fault that repeats (thousands of failed reads or accepts a second)
costs one line per period, not a disk of logs."""

from __future__ import annotations

import json
import logging
import sys
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass

# A repeated warning or error is logged at most once per this many seconds, with a count.
REPEAT_PERIOD_S = 60.0
# Kinds of record remembered at most (the oldest is forgotten): bounds the filter's memory
# whatever the messages say.
REPEAT_KINDS_MAX = 1024


@dataclass
class _Window:
    start: float  # when the last record of the kind was let through
    held: int = 0  # records of the kind held back since


class RepeatFilter(logging.Filter):
    """Lets one record of a kind through per ``period_s``; the next one after the period
    carries the count of those held back ("... (repeated 1,234 times in the last 60 s)").

    A kind is the logger, the level, the message template and the arguments that are not
    numbers: counts, pids and durations change between repeats of one fault, names (of a
    source, a socket) tell faults apart. Only warnings and errors are held back; a count
    of repeats held back when a fault stops rides on its next occurrence, if any.
    ``clock`` is injectable so tests need no waiting.
    """

    def __init__(
        self,
        period_s: float = REPEAT_PERIOD_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        max_kinds: int = REPEAT_KINDS_MAX,
    ) -> None:
        super().__init__()
        self.period_s = period_s
        self._clock = clock
        self._max_kinds = max_kinds
        self._kinds: dict[Hashable, _Window] = {}
        self._lock = threading.Lock()  # handlers call filters outside their own lock

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING or getattr(record, "once_per_change", False):
            return True  # a health transition is a change, logged once already
        kind = _kind(record)
        with self._lock:
            return self._let_through(record, kind, self._clock())

    def _let_through(self, record: logging.LogRecord, kind: Hashable, now: float) -> bool:
        window = self._kinds.get(kind)
        if window is not None and now - window.start < self.period_s:
            window.held += 1
            return False
        if window is not None and window.held:
            record.msg = (
                f"{record.getMessage()} (repeated {window.held:,} times "
                f"in the last {now - window.start:.0f} s)"
            )
            record.args = None
        self._kinds.pop(kind, None)  # re-inserted last: the dict's order is the age
        self._kinds[kind] = _Window(now)
        if len(self._kinds) > self._max_kinds:
            del self._kinds[next(iter(self._kinds))]
        return True


def _kind(record: logging.LogRecord) -> Hashable:
    args = record.args if isinstance(record.args, tuple) else (record.args,)
    # a name is short; a long argument is cut so that memory stays bounded
    names = tuple(repr(a)[:200] for a in args if not isinstance(a, int | float) and a is not None)
    return record.name, record.levelno, str(record.msg), names


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        extra = getattr(record, "fields", None)  # a health transition's facts (health_log)
        if isinstance(extra, dict):
            entry.update({k: v for k, v in extra.items() if k not in entry})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(level: str, fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s"))
    # On the handler, so every logger's records pass it: ours, and asyncio's
    # "socket.accept() out of system resource", logged per attempt at EMFILE.
    handler.addFilter(RepeatFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # third-party chatter stays at warning unless we debug
    for noisy in ("kubernetes", "urllib3", "aiohttp.access", "grpc"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
