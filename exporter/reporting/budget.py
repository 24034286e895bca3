"""Write budgets for the node condition and the DeviceTaintRules (clock injected).

A GPU whose verdict flips every cycle would otherwise patch the Node's status and
create and delete its rule once per cycle (60 a minute at ``--interval 1``). Each kind
of write gets a token bucket (``exporter/token_bucket.py``): ``burst`` writes at once,
then ``per_minute``. A write that finds no token is deferred, not queued: the writer
keeps one desired state per object and sends the latest one when a token comes, so a
state that flipped back in the meantime costs nothing. Events have their own budget (recorder.py).
"""

from __future__ import annotations

from exporter.token_bucket import TokenBucket

# The node condition: five changes go at once (an incident that grows: a GPU unhealthy,
# a second one, one of them lost), then one write per 30 s at most; the 5-minute
# heartbeat is far inside it.
CONDITION_BURST = 5
CONDITION_PER_MINUTE = 2.0
# One DeviceTaintRule (one device): its create and delete at once, then one write a
# minute; a node's devices have a bucket each.
RULE_BURST = 2
RULE_PER_MINUTE = 1.0
# Buckets of rules kept at most (a full bucket is forgotten first; the rest are
# rules deferred now): bounds the memory whatever the slices publish.
MAX_RULE_BUCKETS = 4096


class RuleBudgets:
    """A token bucket per DeviceTaintRule name."""

    def __init__(self, burst: float = RULE_BURST, per_minute: float = RULE_PER_MINUTE) -> None:
        self._burst = burst
        self._per_minute = per_minute
        self._buckets: dict[str, TokenBucket] = {}

    def take(self, name: str, now: float) -> bool:
        bucket = self._buckets.get(name)
        if bucket is None:
            if len(self._buckets) >= MAX_RULE_BUCKETS:
                self._forget_full(now)
            bucket = TokenBucket.full_at(self._burst, self._per_minute, now)
            self._buckets[name] = bucket
        return bucket.take(now)

    def _forget_full(self, now: float) -> None:
        for name in [n for n, b in self._buckets.items() if b.full(now)]:
            del self._buckets[name]
        while len(self._buckets) >= MAX_RULE_BUCKETS:  # none full: the oldest goes
            del self._buckets[next(iter(self._buckets))]

    def __len__(self) -> int:
        return len(self._buckets)
