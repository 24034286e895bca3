"""Slow and idle clients cannot exhaust the exporter: a header-read deadline and a cap
on open connections, in front of aiohttp's request handler.

aiohttp has neither: a client that opens a connection and sends half a request line
keeps a file descriptor (and a handler) until the keep-alive timer, which only starts
after a response. Here every connection must finish each request's header within
``header_timeout_s`` of its first byte (or of connecting), and at most
``max_connections`` are open at once. When the cap is reached, a new connection
evicts the oldest one that is still sending a header (a slow client) or has sent no
request for ``header_timeout_s`` (an idle keep-alive); only if every open connection
sent a request within that time is the new one refused. A scraper sends its whole
request at once, so it is not the one evicted, and scrapes keep being served while
thousands of half-sent or idle connections come and go.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from ssl import SSLContext

from aiohttp import web

log = logging.getLogger(__name__)

HEADER_END = b"\r\n\r\n"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 128


@dataclass
class ConnectionStats:
    """Counts since start, for logs and tests."""

    open: int = 0
    accepted_total: int = 0
    refused_total: int = 0  # at the cap with nothing to evict
    evicted_total: int = 0  # slow or idle, closed to make room
    timed_out_total: int = 0  # header not finished in time
    _last_warning: float = field(default=0.0, repr=False)

    def warn(self, message: str, *args: object) -> None:
        """At most one warning a minute: a flood must not flood the log too."""
        now = time.monotonic()
        if now - self._last_warning >= 60.0:
            self._last_warning = now
            log.warning(message, *args)


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's handler, with the deadline and the cap around it."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._tail = b""  # the last bytes seen, to find a header end split across reads
        self._in_header = True  # sending a request header (or not yet sent one)
        self._requested_at = 0.0  # when the last whole request header arrived

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if not self._guard.admit(self):
            transport.abort()
            return
        self._arm()
        self._inner.connection_made(transport)

    def data_received(self, data: bytes) -> None:
        if not self._in_header:  # a new request on a kept-alive connection
            self._in_header = True
            self._arm()
        seen = self._tail + data  # the tail is at most 3 bytes: a split "\r\n\r\n"
        if HEADER_END in seen:
            # The header is complete (GET requests have no body): the server answers
            # now; a next request, if any, starts the clock again.
            self._in_header = False
            self._requested_at = time.monotonic()
            self._disarm()
        self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._guard.release(self):  # refused ones never reached the handler
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # -- the guard's side ----------------------------------------------------------------

    def evictable(self, now: float) -> bool:
        """Sending a header, or idle since its last request for a header timeout."""
        return self._in_header or now - self._requested_at >= self._guard.header_timeout_s

    def close(self) -> None:
        if self._transport is not None and not self._transport.is_closing():
            self._transport.abort()

    def _arm(self) -> None:
        self._disarm()
        loop = asyncio.get_running_loop()
        self._timer = loop.call_later(self._guard.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expire(self) -> None:
        self._timer = None
        if self._in_header:
            self._guard.stats.timed_out_total += 1
            self.close()


class ConnectionGuard:
    """The protocol factory the listening socket uses: wraps aiohttp's own."""

    def __init__(
        self,
        inner_factory: Callable[[], asyncio.Protocol],
        *,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        if header_timeout_s <= 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        self._inner_factory = inner_factory
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.stats = ConnectionStats()
        self._open: dict[_Guarded, None] = {}  # insertion order: oldest first
        self._evicted: dict[_Guarded, None] = {}  # closed, connection_lost still to come

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self._inner_factory(), self)

    def admit(self, conn: _Guarded) -> bool:
        if len(self._open) >= self.max_connections:
            now = time.monotonic()
            victim = next((c for c in self._open if c.evictable(now)), None)
            if victim is None:
                self.stats.refused_total += 1
                self.stats.warn(
                    "HTTP: %d connections open, all in requests: refusing new ones "
                    "(--http-max-connections)",
                    len(self._open),
                )
                return False
            self.stats.evicted_total += 1
            self.stats.warn(
                "HTTP: %d connections open: closing the oldest slow or idle ones to "
                "admit new ones (--http-max-connections)",
                len(self._open),
            )
            del self._open[victim]
            self._evicted[victim] = None
            victim.close()
        self._open[conn] = None
        self.stats.accepted_total += 1
        self.stats.open = len(self._open)
        return True

    def release(self, conn: _Guarded) -> bool:
        """Forget ``conn``; True when its handler saw it open (not a refused one)."""
        admitted = conn in self._open or conn in self._evicted
        self._open.pop(conn, None)
        self._evicted.pop(conn, None)
        self.stats.open = len(self._open)
        return admitted


class GuardedTCPSite(web.BaseSite):
    """aiohttp's TCP site with a ``ConnectionGuard`` around its protocol factory."""

    __slots__ = ("_bound_port", "_host", "_port", "guard")

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str | None,
        port: int,
        *,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        ssl_context: SSLContext | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        server = runner.server
        assert server is not None
        self.guard = ConnectionGuard(
            server, header_timeout_s=header_timeout_s, max_connections=max_connections
        )
        self._host = host
        self._port = port
        self._bound_port: int | None = None

    @property
    def name(self) -> str:
        scheme = "https" if self._ssl_context else "http"
        return f"{scheme}://{self._host or '0.0.0.0'}:{self._bound_port or self._port}"

    async def start(self) -> None:
        await super().start()
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.guard,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
