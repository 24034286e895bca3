"""A clock a test moves by hand: pass it where the code takes ``clock=``/``monotonic=``."""

from __future__ import annotations


class Clock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
