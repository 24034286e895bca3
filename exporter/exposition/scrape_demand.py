"""Whether a cycle's exposition in one format is likely to be asked for: render it then.

A scraper asks at a steady rate: Prometheus scrapes each target once per
``scrape_interval`` (15 s to 1 min in most set-ups, with a fixed offset per target), and
the sample cycle runs every ``--interval`` (1 s by default). Rendering every format at
every cycle would render a body no one reads several times over. So each format keeps
the times of its last requests, and a cycle renders a format only when a request is
expected before the next cycle's render: when ``last request + gap`` falls before
``now + period + early``, ``gap`` being the shorter of the last two gaps between
requests and ``period`` the time since the previous cycle (so the next cycle renders
about ``period`` from now). ``early``, the smaller of ``SLACK`` x period and
``EARLY_MAX_S``, covers a scraper that comes a little early and a next cycle that
renders a little late. It was SLACK x period alone, 250 ms at 1 s: a scraper whose
requests came within 250 ms after a cycle's render had two cycles rendered for every
request, the first for nothing (a quarter of all phases; the benchmark's scraper sat
there, ~0.1 s after each render).

This decides only how fast a request is answered, never what it gets: a request that
finds this cycle unrendered (an unexpected client, a scraper that changed its interval)
renders it once on demand, and that request is counted for the next prediction. A
format asked for only once so far, or overdue, is rendered every cycle for
``KEEP_RENDERING_CYCLES`` cycles, as before this module existed; a scraper gone that
long costs nothing more, in CPU or in memory (``lapsed``: the renderer then drops what
it kept of that format's last render for reuse).

Requests are told apart by client (the peer's address, ``ClientDemands``): a Prometheus
HA pair, or a person with curl beside Prometheus, is two scrapers, each with its own
gaps, and a format is due when any of them is expected. At most ``MAX_CLIENTS`` clients
are remembered per format, the most recent: a flood of new addresses evicts old ones and
at worst renders the format every cycle, what every cycle cost before. Behind a proxy
(kube-rbac-proxy) every request has the proxy's address, and two scrapers make the
shorter gap the one between them: with near-identical offsets that gap is ~0, and the
format renders every cycle for a while after each pair; with offsets far apart, the
first of the pair may find its cycle unrendered and render it on demand (~10 ms on
node-8gpu).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

KEEP_RENDERING_CYCLES = 10
SLACK = 0.25
EARLY_MAX_S = 0.05
MAX_CLIENTS = 8  # per format


@dataclass
class ScrapeDemand:
    """The requests seen for one exposition format (monotonic seconds)."""

    last: float | None = None
    gap: float | None = None  # the shorter of the last two gaps between requests
    _last_gap: float | None = None

    def asked(self, now: float) -> None:
        if self.last is not None:
            gap = max(0.0, now - self.last)
            self.gap = gap if self._last_gap is None else min(gap, self._last_gap)
            self._last_gap = gap
        self.last = now

    def due(self, now: float, period: float | None) -> bool:
        """Whether a render at ``now`` is likely to be read before the next cycle's, the
        cycle running every ``period`` seconds (None: not known yet, render)."""
        if self.last is None:
            return False
        if period is None:
            return True
        keep = KEEP_RENDERING_CYCLES * period
        if self.gap is None:  # asked once: keep rendering a while, as for a new scraper
            return now - self.last < keep
        expected = self.last + self.gap
        early = min(SLACK * period, EARLY_MAX_S)
        return expected <= now + period + early and now - expected < keep

    def lapsed(self, now: float, period: float | None) -> bool:
        """Whether this client is gone: overdue (or, asked once, silent) for longer than
        ``KEEP_RENDERING_CYCLES`` cycles, so ``due`` stays false until it asks again."""
        if self.last is None:
            return True
        if period is None:
            return False
        since = self.last if self.gap is None else self.last + self.gap
        return now - since >= KEEP_RENDERING_CYCLES * period


class ClientDemands:
    """One format's demand, by client: the ``MAX_CLIENTS`` that asked most recently."""

    def __init__(self) -> None:
        self._by_client: OrderedDict[str, ScrapeDemand] = OrderedDict()

    def asked(self, client: str, now: float) -> None:
        demand = self._by_client.pop(client, None) or ScrapeDemand()
        demand.asked(now)
        self._by_client[client] = demand
        while len(self._by_client) > MAX_CLIENTS:
            self._by_client.popitem(last=False)

    def due(self, now: float, period: float | None) -> bool:
        return any(demand.due(now, period) for demand in self._by_client.values())

    def lapsed(self, now: float, period: float | None) -> bool:
        """Every client that asked for this format is gone."""
        return all(demand.lapsed(now, period) for demand in self._by_client.values())
