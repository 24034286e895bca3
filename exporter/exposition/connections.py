"""Slow, idle and non-reading clients cannot exhaust the exporter: a header-read deadline,
a write deadline and a cap on open connections, in front of aiohttp's request handler.

aiohttp has none of these: a client that opens a connection and sends half a request
line keeps a file descriptor (and a handler) until the keep-alive timer, which only
starts after a response; one that sends a request and never reads the answer keeps its
handler waiting to write for ever. Here each connection is in one of four states:

- *sending a header* (or silent since connecting): it must finish within
  ``header_timeout_s`` of its first byte (or of connecting), else it is closed;
- *answering*: a request arrived less than ``ANSWER_GRACE_S`` ago (the exporter answers
  from a cached render in milliseconds) and nothing of its answer is waiting;
- *waiting for the client to read*: bytes of its answers are still in aiohttp's buffer
  or the kernel's send queue. The client must take them within ``write_timeout_s`` of
  the request that started the wait, else the connection is reset and its bytes dropped;
- *idle*: nothing owed, between requests.

At most ``max_connections`` are open at once. When the cap is reached, a new connection
evicts the oldest one that is sending a header or has waited ``ANSWER_GRACE_S`` for its
client to read; failing that, the one idle the longest (RFC 9112 section 9.3.1 lets a
client retry a request on a kept-alive connection the server closed; aiohttp's and Go's
clients do). Only if every open connection is answering is the new one refused: to keep
a fresh scraper out, every one of them must send a request at least every
``ANSWER_GRACE_S`` and take every answer it is sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import resource
import socket
import struct
import termios
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from ssl import SSLContext

from aiohttp import web

log = logging.getLogger(__name__)

HEADER_END = b"\r\n\r\n"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 128
# Prometheus's default scrape_timeout: an answer not taken by then has no scraper
# waiting for it (https://prometheus.io/docs/prometheus/latest/configuration/configuration/).
WRITE_TIMEOUT_S = 10.0
# How long a request counts as being answered while nothing of its answer is waiting:
# a cached render is written in milliseconds (p99 77 ms under 200 scrapers on 2 cores).
ANSWER_GRACE_S = 0.25
# Linux's SIOCOUTQ (tcp(7)): bytes in a socket's send queue the peer has not acknowledged,
# i.e. not yet in its receive buffer. Same number as TIOCOUTQ.
_SIOCOUTQ: int | None = getattr(termios, "TIOCOUTQ", None)
# SO_LINGER on, 0 s: close() resets the connection and drops its queued bytes at once
# (socket(7)), instead of the kernel holding them for a client that does not read.
_RESET_ON_CLOSE = struct.pack("ii", 1, 0)

# File descriptors kept for everything but connections: /proc reads, NVML, the kubelet's
# and the API server's sockets, logs (the exporter holds ~16 at rest).
FD_RESERVE = 64

SLOW, IDLE = 0, 1  # eviction ranks: lower goes first


def fd_headroom_problem(max_connections: int, fd_limit: int) -> str | None:
    """Why the cap cannot hold under ``fd_limit`` (RLIMIT_NOFILE's soft limit), or None.
    Past the limit every accept fails with EMFILE before the cap is reached, and asyncio
    stops accepting for a second at a time, so nothing is evicted to make room."""
    if fd_limit == resource.RLIM_INFINITY or max_connections + FD_RESERVE <= fd_limit:
        return None
    return (
        f"--http-max-connections {max_connections} leaves fewer than {FD_RESERVE} of the "
        f"{fd_limit} file descriptors the process may open (RLIMIT_NOFILE) for anything "
        "else: accepts would fail before the cap does its work; lower the flag or raise "
        "the limit"
    )


@dataclass
class ConnectionStats:
    """Counts since start, for logs and tests."""

    open: int = 0
    accepted_total: int = 0
    refused_total: int = 0  # at the cap with nothing to evict
    evicted_total: int = 0  # slow, stalled or idle, closed to make room
    timed_out_total: int = 0  # header not finished in time
    write_timed_out_total: int = 0  # answers not taken in time
    _last_warning: float = field(default=0.0, repr=False)

    def warn(self, message: str, *args: object) -> None:
        """At most one warning a minute: a flood must not flood the log too."""
        now = time.monotonic()
        if now - self._last_warning >= 60.0:
            self._last_warning = now
            log.warning(message, *args)


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's handler, with the deadlines and the cap around it."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None  # the header deadline
        self._write_timer: asyncio.TimerHandle | None = None  # the write deadline
        self._tail = b""  # the last bytes seen, to find a header end split across reads
        self._in_header = True  # sending a request header (or not yet sent one)
        self._active_at = time.monotonic()  # connected, or the last whole request header
        self._waiting_since = 0.0  # the request that started the wait for the client

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        if not self._guard.admit(self):
            self.close()
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
            self._active_at = time.monotonic()
            self._disarm()
            if self.unsent() == 0:  # earlier answers all taken: a new wait begins
                self._waiting_since = self._active_at
                self._arm_write()
        self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._guard.release(self):  # refused ones never reached the handler
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # -- the guard's side ----------------------------------------------------------------

    def rank(self, now: float) -> int | None:
        """``SLOW`` (sending a header, or its client not reading), ``IDLE``, or None
        while it is being answered."""
        if self._in_header:
            return SLOW
        if self.unsent() > 0:
            return SLOW if now - self._waiting_since >= self._guard.answer_grace_s else None
        return IDLE if now - self._active_at >= self._guard.answer_grace_s else None

    @property
    def active_at(self) -> float:
        return self._active_at

    def unsent(self) -> int:
        """Bytes written for this client that it has not taken yet: aiohttp's buffer
        and the kernel's send queue (0 where the kernel cannot say)."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return 0
        queued = transport.get_write_buffer_size()
        sock = transport.get_extra_info("socket")
        if sock is not None and _SIOCOUTQ is not None:
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
                queued += struct.unpack("i", answer)[0]
            except OSError:
                pass
        return queued

    def close(self) -> None:
        """Reset: a client that is evicted or too slow gets no more bytes."""
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        sock = transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        transport.abort()

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

    def _arm_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
        loop = asyncio.get_running_loop()
        self._write_timer = loop.call_later(self._guard.write_timeout_s, self._write_expire)

    def _write_expire(self) -> None:
        """The write deadline: answers still not taken since the wait began."""
        self._write_timer = None
        if self.unsent() > 0:
            self._guard.stats.write_timed_out_total += 1
            self._guard.stats.warn(
                "HTTP: a client took none or part of its answer within %g s: connection reset",
                self._guard.write_timeout_s,
            )
            self.close()


class ConnectionGuard:
    """The protocol factory the listening socket uses: wraps aiohttp's own."""

    def __init__(
        self,
        inner_factory: Callable[[], asyncio.Protocol],
        *,
        header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        if header_timeout_s <= 0:
            raise ValueError(f"header_timeout_s must be > 0, got {header_timeout_s}")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if write_timeout_s <= 0:
            raise ValueError(f"write_timeout_s must be > 0, got {write_timeout_s}")
        self._inner_factory = inner_factory
        self.header_timeout_s = header_timeout_s
        self.max_connections = max_connections
        self.write_timeout_s = write_timeout_s
        self.answer_grace_s = ANSWER_GRACE_S
        self.stats = ConnectionStats()
        self._open: dict[_Guarded, None] = {}  # insertion order: oldest first
        self._evicted: dict[_Guarded, None] = {}  # closed, connection_lost still to come

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self._inner_factory(), self)

    def admit(self, conn: _Guarded) -> bool:
        if len(self._open) >= self.max_connections:
            victim = self._victim(time.monotonic())
            if victim is None:
                self.stats.refused_total += 1
                self.stats.warn(
                    "HTTP: %d connections open, all being answered: refusing new ones "
                    "(--http-max-connections)",
                    len(self._open),
                )
                return False
            self.stats.evicted_total += 1
            self.stats.warn(
                "HTTP: %d connections open: closing slow, non-reading or idle ones to "
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

    def _victim(self, now: float) -> _Guarded | None:
        """The oldest slow connection, else the one idle the longest, else None."""
        idlest: _Guarded | None = None
        for conn in self._open:  # oldest first
            rank = conn.rank(now)
            if rank == SLOW:
                return conn
            if rank == IDLE and (idlest is None or conn.active_at < idlest.active_at):
                idlest = conn
        return idlest

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
        write_timeout_s: float = WRITE_TIMEOUT_S,
        ssl_context: SSLContext | None = None,
    ) -> None:
        super().__init__(runner, ssl_context=ssl_context)
        server = runner.server
        assert server is not None
        self.guard = ConnectionGuard(
            server,
            header_timeout_s=header_timeout_s,
            max_connections=max_connections,
            write_timeout_s=write_timeout_s,
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
        problem = fd_headroom_problem(
            self.guard.max_connections, resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        )
        if problem:
            log.warning("HTTP: %s", problem)
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            self.guard,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=True,
            # asyncio hands a TLS connection to the guard only once its handshake is
            # done (sslproto.py, _on_handshake_complete): until then the header deadline
            # bounds it, instead of asyncio's 60 s.
            ssl_handshake_timeout=self.guard.header_timeout_s if self._ssl_context else None,
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]
