"""A token bucket for any layer that bounds a rate (stdlib only, imports nothing from the
exporter): the write budgets of ``exporter/reporting/budget.py``, the Event recorder's
node budget (``exporter/reporting/recorder.py``), the LIST budget of the Kubernetes
watches (``exporter/sources/backoff.py``, ``RateBudget``), and the failed-login budgets
and the bcrypt pace of ``exporter/exposition/basic_auth.py``.

Time is whatever the caller passes as ``now`` (monotonic seconds, or a test's clock):
the bucket reads no clock of its own. A ``now`` earlier than one already seen refills
nothing and takes nothing away; the bucket waits until time passes the latest ``now``
again. However long the gap, it holds ``burst`` tokens at most.
"""

from __future__ import annotations


class TokenBucket:
    """At most ``burst`` tokens, refilled at ``per_s`` a second, or ``per_minute`` a
    minute (one of the two). It starts full; its time starts at ``now``, or where none
    is given at the first ``take``.

    The refill is ``elapsed * rate / period`` in the unit the rate was given in (``per_minute``:
    ``elapsed * per_minute / 60``), so a rate a minute is not rounded into one a second."""

    def __init__(
        self,
        burst: float,
        per_s: float | None = None,
        *,
        per_minute: float | None = None,
        now: float | None = None,
    ) -> None:
        if per_s is not None and per_minute is None:
            self.rate, self.period_s = per_s, 1.0
        elif per_minute is not None and per_s is None:
            self.rate, self.period_s = per_minute, 60.0
        else:
            raise TypeError("a TokenBucket takes per_s or per_minute, one of the two")
        self.burst = burst
        self.tokens = burst
        self.at = now  # when ``tokens`` was last brought up to date (None: not yet)

    @classmethod
    def full_at(cls, burst: float, per_minute: float, now: float) -> TokenBucket:
        """Full at ``now``, refilled at ``per_minute`` (the write budgets' unit)."""
        return cls(burst, per_minute=per_minute, now=now)

    def _refill(self, now: float) -> None:
        if self.at is None:
            self.at = now
            return
        if now > self.at:
            self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate / self.period_s)
            self.at = now

    def take(self, now: float) -> bool:
        """One token if there is one; False: none now (the caller waits or refuses)."""
        self._refill(now)
        if self.tokens >= 1:
            self.tokens -= 1
            return True
        return False

    def give_back(self) -> None:
        """Return a token taken for something that did not happen (never above ``burst``)."""
        self.tokens = min(self.burst, self.tokens + 1)

    def available(self, now: float) -> float:
        """The tokens at ``now`` (fractions included), taking none."""
        self._refill(now)
        return self.tokens

    def full(self, now: float) -> bool:
        self._refill(now)
        return self.tokens >= self.burst

    def wait_s(self) -> float:
        """Seconds until the next token, as of the latest ``take`` or ``full``."""
        return max(0.0, (1 - self.tokens) * self.period_s / self.rate)
