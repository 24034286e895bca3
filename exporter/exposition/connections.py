"""Slow, idle and non-reading clients cannot exhaust the exporter, nor keep a scraper
out: a header-read deadline, a write deadline and a fair cap on open connections, in
front of aiohttp's request handler.

aiohttp has none of these: a client that opens a connection and sends half a request
line keeps a file descriptor (and a handler) until the keep-alive timer, which only
starts after a response; one that sends a request and never reads the answer keeps its
handler waiting to write for ever. Here each connection is held to two deadlines:

- while *sending a header* (or in its TLS handshake, or silent since connecting) it must
  finish within ``header_timeout_s`` of its first byte (or of connecting), else it is
  closed;
- bytes of its answers still in aiohttp's buffer or the kernel's send queue must be
  taken within ``write_timeout_s`` of the request that started the wait, else the
  connection is reset and its bytes dropped.

At most ``max_connections`` are open at once, TLS ones from before their handshake (the
TLS layer is added here, after the cap admits the TCP connection, not by asyncio's
server before it). At the cap a newcomer takes the place of one open connection, the
first in this order:

1. from the client address holding the most connections (a scraper has an address of
   its own: a flood from another cannot take its place);
2. not in the middle of an answer, before one that is (a request aiohttp handed to the
   handler less than ``ANSWER_GRACE_S`` ago, its answer not yet made or not yet taken);
   then not taking an answer, before one that is (bytes of its answer still unsent, fewer
   than when seen at least ``ANSWER_GRACE_S`` before, less than ``PROGRESS_S`` ago: a slow
   reader making progress, not a stalled one);
3. not fresh (younger than ``FRESH_S``, none of its requests taken up yet), before a
   fresh one, then at least ``MIN_AGE_S`` old, before a younger one (a fresh scraper's
   connection is the last of its address to go, whatever newcomers follow it);
4. sending a header or not reading its answers, before an idle one;
5. the oldest first.

A connection in the middle of an answer is never taken by a newcomer from an address
holding as many connections, less one: when every candidate is, the newcomer is refused.
Nothing a client sends marks its connection busy: only requests the server took up do,
for ``ANSWER_GRACE_S`` at most, and not once the client is not taking its answers (one
left untaken that long, or a request taken up while earlier answers were untaken: a
client pipelining requests it never reads keeps having them taken up). An idle
kept-alive connection closed this way costs a scraper nothing: RFC 9112 section 9.3.1
lets a client retry a request on a kept-alive connection the server closed; aiohttp's
and Go's clients do.
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
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from ssl import SSLContext, SSLError

from aiohttp import web

log = logging.getLogger(__name__)

HEADER_END = b"\r\n\r\n"
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_MAX_CONNECTIONS = 128
# Prometheus's default scrape_timeout: an answer not taken by then has no scraper
# waiting for it (https://prometheus.io/docs/prometheus/latest/configuration/configuration/).
WRITE_TIMEOUT_S = 10.0
# How long after aiohttp hands a request to the handler its answer counts as being made
# or written: a cached render is written in milliseconds (p99 77 ms under 200 scrapers
# on 2 cores).
ANSWER_GRACE_S = 0.25
# How long a connection whose unsent bytes went down when last seen counts as taking its
# answer: a slow honest reader (a 4 KiB receive buffer, 50 KiB/s) takes a 124 KB answer in
# 2.4 s and is seen going down many times a second under a flood; one that stops reading
# has its unsent bytes seen unchanged across ANSWER_GRACE_S and counts as not reading.
PROGRESS_S = 1.0
# A connection younger than this goes after older ones of its address: a scraper's new
# connection sends its request at once and is answered within this time.
MIN_AGE_S = 0.5
# A connection younger than this with none of its requests taken up yet goes after every
# other one of its address that is not (a scraper's request arrives in its first packet
# and is taken up within milliseconds): a flood of newcomers, each taken up at once, is
# not "fresh" for long, nor is a header sent slowly.
FRESH_S = 0.25
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

Handler = Callable[[web.BaseRequest], Awaitable[web.StreamResponse]]


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
    evicted_total: int = 0  # closed to make room for a newcomer
    timed_out_total: int = 0  # header not finished in time
    write_timed_out_total: int = 0  # answers not taken in time
    _last_warning: dict[str, float] = field(default_factory=dict, repr=False)

    def warn(self, message: str, *args: object) -> None:
        """At most one warning a minute of each kind: a flood must not flood the log
        too, nor one kind (closing some) hide another (refusing new ones)."""
        now = time.monotonic()
        last = self._last_warning.get(message)
        if last is None or now - last >= 60.0:
            self._last_warning[message] = now
            log.warning(message, *args)


class _Guarded(asyncio.Protocol):
    """One connection: aiohttp's handler, with the deadlines, the cap and (with a TLS
    context) the TLS layer around it."""

    def __init__(self, inner: asyncio.Protocol, guard: ConnectionGuard) -> None:
        self._inner = inner
        self._guard = guard
        self._raw: asyncio.Transport | None = None  # the TCP connection
        self._transport: asyncio.Transport | None = None  # what aiohttp writes to
        self._handshake: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None  # the header deadline
        self._write_timer: asyncio.TimerHandle | None = None  # the write deadline
        self._tail = b""  # the last bytes seen, to find a header end split across reads
        self._in_header = True  # in its TLS handshake or sending a request header
        self.address = ""  # the client's, for fairness between addresses
        self.opened_at = time.monotonic()
        self._dispatched_at = -1e9  # aiohttp last handed one of its requests to the handler
        self._in_handler = 0  # requests of it in the handler now
        self._waiting_since = 0.0  # the request that started the wait for the client
        self._piled = False  # a request was taken up while earlier answers were untaken
        self._last_unsent = 0  # unsent bytes when last seen going down (or up)
        self._observed_at = -1e9  # when _last_unsent was seen
        self._progressed_at = -1e9  # when its unsent bytes were last seen going down

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._raw = self._transport = transport
        peer = transport.get_extra_info("peername")
        self.address = str(peer[0]) if isinstance(peer, tuple) and peer else ""
        if not self._guard.admit(self):
            self.close()
            return
        self._arm()  # the header deadline bounds a TLS handshake too
        context = self._guard.ssl_context
        if context is None:
            self._inner.connection_made(transport)
        else:
            self._handshake = asyncio.get_running_loop().create_task(self._start_tls(context))

    async def _start_tls(self, context: SSLContext) -> None:
        """The TLS handshake, under the cap and the header deadline; aiohttp sees the
        connection only once it is done."""
        raw = self._raw
        assert raw is not None
        try:
            tls = await asyncio.get_running_loop().start_tls(
                raw,
                self,
                context,
                server_side=True,
                ssl_handshake_timeout=self._guard.header_timeout_s,
            )
        except (OSError, SSLError, ConnectionError, TimeoutError, RuntimeError):
            tls = None  # start_tls closed the connection
        if tls is None or tls.is_closing():
            # asyncio's TLS layer does not pass on the loss of a connection whose
            # handshake failed (sslproto.py, SSLProtocol.connection_lost).
            self._disarm()
            self._guard.release(self)
            return
        self._transport = tls
        self._arm()  # the first request's header: its own deadline, as before TLS
        self._inner.connection_made(tls)

    def data_received(self, data: bytes) -> None:
        if not self._in_header:  # a new request on a kept-alive connection
            self._in_header = True
            self._arm()
        seen = self._tail + data  # the tail is at most 3 bytes: a split "\r\n\r\n"
        if HEADER_END in seen:
            # The header is complete (GET requests have no body). This only stops the
            # header clock: bytes a client sends never count as a request being
            # answered (a body may hold "\r\n\r\n" too); see dispatched().
            self._in_header = False
            self._disarm()
        self._tail = seen[-3:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        return self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        if self._handshake is not None and not self._handshake.done():
            return  # its TCP connection, lost mid-handshake: _start_tls releases it
        if self._guard.release(self):  # refused ones never reached the handler
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()

    # -- aiohttp's request handler, through ConnectionGuard.track ------------------------

    def dispatched(self) -> None:
        """aiohttp handed a request of this connection to the handler: its answer is
        being made, and a wait for the client to take it begins unless one is on."""
        now = time.monotonic()
        self._dispatched_at = now
        self._in_handler += 1
        if self.observe(now) == 0:  # earlier answers all taken
            self._waiting_since = now
            self._arm_write()
        else:  # pipelined past answers it has not taken: no longer "answering"
            self._piled = True

    def handled(self) -> None:
        self._in_handler -= 1

    # -- the guard's side ----------------------------------------------------------------

    def answering(self, now: float) -> bool:
        """In the middle of an answer to a request taken up less than the grace ago:
        the handler is still making it, or it is not all taken yet. Never while it is
        not taking its answers: one left untaken for the grace, or a request taken up
        while earlier answers were still untaken. A client that pipelines requests and
        reads none keeps having them taken up (aiohttp answers them while the buffers
        have room), which renews the dispatches, not the wait for it; a client that
        waits for each answer before the next request (Prometheus) never piles."""
        grace = self._guard.answer_grace_s
        if now - self._dispatched_at >= grace:
            return False
        unsent = self.unsent()
        if unsent == 0:
            self._piled = False  # all taken: caught up
        elif self._piled or now - self._waiting_since >= grace:
            return False  # not taking its answers
        return self._in_handler > 0 or unsent > 0

    def observe(self, now: float) -> int:
        """Its unsent bytes now, noting whether they went down since last seen: a
        decrease is progress; more bytes (a new answer) start a new baseline; the same
        count is compared with the baseline, which stays put, so that a stall is told
        apart from a read only across at least ``ANSWER_GRACE_S``."""
        unsent = self.unsent()
        if unsent < self._last_unsent:
            self._progressed_at = now
        if unsent != self._last_unsent:
            self._last_unsent, self._observed_at = unsent, now
        return unsent

    def taking(self, now: float) -> bool:
        """Taking its answer, slowly: bytes still unsent, seen going down less than
        ``PROGRESS_S`` ago, or seen first less than ``ANSWER_GRACE_S`` ago (not yet
        judged), and no request taken up while earlier answers were untaken. Never
        past the write deadline (which closes it), and never a protection from
        eviction: only an order (after the connections that are not), so that clients
        that read slowly on every connection cannot keep a newcomer out."""
        unsent = self.observe(now)
        if unsent == 0:
            self._piled = False
            return False
        if self._piled:
            return False
        return (
            now - self._progressed_at < self._guard.progress_s
            or now - self._observed_at < self._guard.answer_grace_s
        )

    def fresh(self, now: float) -> bool:
        """Younger than ``FRESH_S`` and none of its requests taken up yet: a scraper's
        new connection, its request on the way."""
        return now - self.opened_at < self._guard.fresh_s and self._dispatched_at < self.opened_at

    def rank(self) -> int:
        """``SLOW`` (in its handshake, sending a header, or its client not reading) or
        ``IDLE``: an order between victims, never a protection."""
        return SLOW if self._in_header or self.unsent() > 0 else IDLE

    def unsent(self) -> int:
        """Bytes written for this client that it has not taken yet: aiohttp's buffer,
        the TLS layer's, the TCP transport's and the kernel's send queue (0 where the
        kernel cannot say)."""
        transport, raw = self._transport, self._raw
        if transport is None or raw is None or transport.is_closing():
            return 0
        queued = transport.get_write_buffer_size()
        if raw is not transport:
            queued += raw.get_write_buffer_size()
        sock = raw.get_extra_info("socket")
        if sock is not None and _SIOCOUTQ is not None:
            try:
                answer = fcntl.ioctl(sock.fileno(), _SIOCOUTQ, b"\0\0\0\0")
                queued += struct.unpack("i", answer)[0]
            except OSError:
                pass
        return queued

    def close(self) -> None:
        """Reset: a client that is evicted or too slow gets no more bytes."""
        raw = self._raw
        if raw is None or raw.is_closing():
            return
        sock = raw.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET_ON_CLOSE)
        raw.abort()

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
        ssl_context: SSLContext | None = None,
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
        self.ssl_context = ssl_context
        self.answer_grace_s = ANSWER_GRACE_S
        self.min_age_s = MIN_AGE_S
        self.fresh_s = FRESH_S
        self.progress_s = PROGRESS_S
        self.stats = ConnectionStats()
        self._open: dict[_Guarded, None] = {}  # insertion order: oldest first
        self._evicted: dict[_Guarded, None] = {}  # closed, connection_lost still to come
        self._by_handler: dict[object, _Guarded] = {}  # aiohttp's protocol: its connection
        self._per_address: dict[str, int] = {}  # open connections of each client address

    def __call__(self) -> asyncio.Protocol:
        return _Guarded(self._inner_factory(), self)

    def track(self, handler: Handler) -> Handler:
        """``handler`` (aiohttp's request handler), telling each connection when one of
        its requests is being answered: the server's word, not the client's bytes."""

        async def tracked(request: web.BaseRequest) -> web.StreamResponse:
            conn = self._by_handler.get(request.protocol)
            if conn is None:
                return await handler(request)
            conn.dispatched()
            try:
                return await handler(request)
            finally:
                conn.handled()

        return tracked

    def admit(self, conn: _Guarded) -> bool:
        if len(self._open) >= self.max_connections:
            victim = self._victim(conn.address, time.monotonic())
            if victim is None:
                self.stats.refused_total += 1
                self.stats.warn(
                    "HTTP: %d connections open, all in the middle of an answer: refusing "
                    "new ones (--http-max-connections)",
                    len(self._open),
                )
                return False
            self.stats.evicted_total += 1
            self.stats.warn(
                "HTTP: %d connections open: closing some (from the addresses holding the "
                "most) to admit new ones (--http-max-connections)",
                len(self._open),
            )
            self._forget(victim)
            self._evicted[victim] = None
            victim.close()
        self._open[conn] = None
        self._by_handler[conn._inner] = conn
        self._per_address[conn.address] = self._per_address.get(conn.address, 0) + 1
        self.stats.accepted_total += 1
        self.stats.open = len(self._open)
        return True

    def _victim(self, address: str, now: float) -> _Guarded | None:
        """The connection a newcomer from ``address`` takes the place of, or None: the
        order in this module's docstring."""
        newcomer_holds = self._per_address.get(address, 0)
        best: _Guarded | None = None
        best_key: tuple[int, bool, bool, bool, bool, int] | None = None
        for conn in self._open:  # oldest first: the first of equal keys wins
            holds = self._per_address[conn.address]
            answering = conn.answering(now)
            if answering and holds <= newcomer_holds + 1:
                continue  # would leave its address holding fewer than the newcomer's
            taking = conn.taking(now)  # also observes it: progress is seen at each choice
            fresh = conn.fresh(now)
            young = now - conn.opened_at < self.min_age_s
            head = (-holds, answering, taking, fresh, young)
            if best_key is not None and head > best_key[:5]:
                continue  # decided without rank()'s system call
            key = (*head, conn.rank())
            if best_key is None or key < best_key:
                best, best_key = conn, key
        return best

    def _forget(self, conn: _Guarded) -> None:
        del self._open[conn]
        self._by_handler.pop(conn._inner, None)
        left = self._per_address[conn.address] - 1
        if left:
            self._per_address[conn.address] = left
        else:
            del self._per_address[conn.address]

    def release(self, conn: _Guarded) -> bool:
        """Forget ``conn``; True when it was admitted (not a refused one)."""
        admitted = conn in self._open or conn in self._evicted
        if conn in self._open:
            self._forget(conn)
        self._evicted.pop(conn, None)
        self.stats.open = len(self._open)
        return admitted

    def close_handshakes(self) -> None:
        """Close the connections still in their TLS handshake: aiohttp, which closes the
        others at shutdown, does not know them yet."""
        for conn in [*self._open, *self._evicted]:
            if conn._handshake is not None and not conn._handshake.done():
                conn.close()


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
            ssl_context=ssl_context,
        )
        # Each handler aiohttp makes for a connection takes this attribute when it is
        # made (web_protocol.py, RequestHandler.__init__): every request is tracked.
        server.request_handler = self.guard.track(server.request_handler)
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
            # No ssl= here: asyncio would build each connection's TLS state (sslproto.py,
            # a 256 KiB buffer and more) before the guard saw it, outside the cap. The
            # guard adds TLS itself to the connections it admits (_Guarded._start_tls).
            backlog=self._backlog,
            reuse_address=True,
        )
        if self._server.sockets:
            self._bound_port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        await super().stop()
        self.guard.close_handshakes()
