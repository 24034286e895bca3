"""How far this node's wall clock is from the API server's, from its ``Date`` headers.

Times the API server stamps are on its clock: a DeviceTaintRule's
``creationTimestamp``, from which an earlier run's rule is held for the XID window
(reporting/writer.py). A node clock minutes off (no NTP, a step) would end that hold
early or late, so it is compared on the server's clock: node time minus ``offset_s()``.
A terminating pod's ``deletionTimestamp`` is not judged this way: its graceful stop is
timed on the monotonic clock from when it was first seen (analysis/orphans.py), which
neither a wall-clock step nor a wrong or absent ``Date`` can bring forward.

Every HTTP answer carries ``Date``, the moment the server made it (RFC 9110 section
6.6.1; whole seconds, IMF-fixdate). One sample is the node's wall clock when the answer
arrived minus that moment: the true offset plus up to a second of truncation and the
answer's transit. Samples are outside input, so a garbage or absurd header must not
move the estimate: one that does not parse, or puts the clocks more than
``MAX_OFFSET_S`` apart, is dropped (counted), and the estimate is the median of the last
``SAMPLES`` samples, which one wrong but plausible header cannot move far.
"""

from __future__ import annotations

import math
import statistics
import threading
from collections import deque
from collections.abc import Callable
from email.utils import parsedate_to_datetime
from typing import Final

SAMPLES: Final = 5  # the median of the last five answers' Date headers
# No node runs a day off and joins a cluster (TLS certificates and tokens carry times);
# a Date header that says so is broken, not a fact about the clock.
MAX_OFFSET_S: Final = 86_400.0
MAX_DATE_CHARS: Final = 64  # an IMF-fixdate is 29 characters


def date_seconds(value: object) -> float | None:
    """An HTTP ``Date`` value -> epoch seconds; None when it is no date."""
    if not isinstance(value, str) or not value or len(value) > MAX_DATE_CHARS:
        return None
    try:
        parsed = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if parsed.tzinfo is None:  # RFC 9110 dates are GMT; a zone-less one is not ours
        return None
    seconds = parsed.timestamp()
    return seconds if math.isfinite(seconds) else None


class ServerClock:
    """The API server's clock offset, estimated from its answers (thread-safe)."""

    def __init__(self, wall_clock: Callable[[], float]) -> None:
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._samples: deque[float] = deque(maxlen=SAMPLES)
        self.rejected = 0  # Date headers dropped: unparseable, or absurdly far

    def observe(self, headers: object) -> None:
        """Take one answer's ``Date`` header (``headers``: any mapping with ``get``)."""
        getter = getattr(headers, "get", None)
        value = getter("Date") if callable(getter) else None
        if value is None:
            return  # no header: nothing learned, nothing wrong
        served = date_seconds(value)
        now = self._wall_clock()
        with self._lock:
            if served is None or abs(now - served) > MAX_OFFSET_S:
                self.rejected += 1
                return
            self._samples.append(now - served)

    def offset_s(self) -> float | None:
        """How far the node's wall clock is ahead of the server's (negative: behind);
        None until an answer carried a usable ``Date``."""
        with self._lock:
            return statistics.median(self._samples) if self._samples else None
