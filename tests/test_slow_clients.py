"""Slow and idle clients against the real aiohttp server behind ConnectionGuard: raw
sockets that send half a request or nothing, and a real aiohttp scrape beside them.
Thousands of them at once against a real exporter process is the fault matrix's
(tests/faults/test_http_faults.py)."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import aiohttp
import pytest

from exporter.exposition.connections import (
    ConnectionGuard,
    GuardedTCPSite,
    fd_headroom_problem,
)
from exporter.exposition.server import MetricsCache, build_app, start_server
from tests.harness import big_answer_cache, one_gauge_cache
from tests.tls_certs import authority

HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: exporter\r\nUser-Agent: slo"
WHOLE_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: exporter\r\n\r\n"
SCRAPE = b"GET /metrics HTTP/1.1\r\nHost: exporter\r\n\r\n"


@asynccontextmanager
async def serving(
    cache: MetricsCache | None = None, **limits: object
) -> AsyncIterator[tuple[int, ConnectionGuard]]:
    app = build_app(cache or one_gauge_cache(), "node-a")
    runner = await start_server(app, "127.0.0.1", 0, **limits)  # type: ignore[arg-type]
    try:
        (site,) = runner.sites
        assert isinstance(site, GuardedTCPSite)
        address = runner.addresses[0]
        yield int(address[1]), site.guard
    finally:
        await runner.cleanup()


async def connect(port: int, send: bytes = b"") -> socket.socket:
    sock = socket.socket()
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    if send:
        await asyncio.get_running_loop().sock_sendall(sock, send)
    return sock


async def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True when the server closed ``sock`` (EOF or reset) within ``within_s``."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            data = await asyncio.wait_for(loop.sock_recv(sock, 65536), 0.05)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return True
        if data == b"":
            return True
    return False


async def scrape(port: int) -> int:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(5)) as r,
    ):
        await r.read()
        return r.status


async def test_a_half_sent_request_is_closed_after_the_header_timeout() -> None:
    async with serving(header_timeout_s=0.3) as (port, guard):
        started = time.monotonic()
        sock = await connect(port, HALF_REQUEST)
        silent = await connect(port)  # connects and says nothing at all
        try:
            assert await closed_by_server(sock, within_s=3)
            assert await closed_by_server(silent, within_s=3)
            assert 0.25 <= time.monotonic() - started < 3
            assert guard.stats.timed_out_total == 2
            assert guard.stats.open == 0
        finally:
            sock.close()
            silent.close()


async def test_a_request_sent_slowly_but_in_time_is_answered() -> None:
    async with serving(header_timeout_s=1.0) as (port, _):
        sock = await connect(port, WHOLE_REQUEST[:10])
        try:
            await asyncio.sleep(0.3)
            await asyncio.get_running_loop().sock_sendall(sock, WHOLE_REQUEST[10:])
            reply = await asyncio.wait_for(asyncio.get_running_loop().sock_recv(sock, 4096), 3)
            assert reply.startswith(b"HTTP/1.1 200")
        finally:
            sock.close()


async def test_a_kept_alive_connection_is_not_cut_between_requests() -> None:
    # Prometheus keeps its connection open between scrapes: the header clock only runs
    # while a request is being sent, the write clock only while an answer is not taken.
    async with serving(header_timeout_s=0.3, write_timeout_s=0.3) as (port, guard):
        loop = asyncio.get_running_loop()
        sock = await connect(port, WHOLE_REQUEST)
        try:
            assert (await asyncio.wait_for(loop.sock_recv(sock, 4096), 3)).startswith(
                b"HTTP/1.1 200"
            )
            await asyncio.sleep(0.6)  # idle for twice the header timeout
            await loop.sock_sendall(sock, WHOLE_REQUEST)
            assert (await asyncio.wait_for(loop.sock_recv(sock, 4096), 3)).startswith(
                b"HTTP/1.1 200"
            )
            assert guard.stats.timed_out_total == 0
            assert guard.stats.write_timed_out_total == 0
        finally:
            sock.close()


async def test_at_the_cap_with_every_connection_busy_a_new_one_is_refused() -> None:
    # Connections in the middle of an answer the server took up just now are not
    # evicted for a newcomer from their own address. (A long grace, so that a loaded
    # test machine does not make them idle; an answer that is taken at once is not
    # "in the middle", nor are answers piled up by pipelining past them:
    # tests/test_connection_fairness.py.) Each asked for one ~1 MB answer.
    limits = {"header_timeout_s": 5.0, "max_connections": 3}
    async with serving(big_answer_cache(), **limits) as (port, guard):
        guard.answer_grace_s = 30.0
        busy = [await unread(port, requests=1, request=SCRAPE) for _ in range(3)]
        try:
            await asyncio.sleep(0.3)  # their answers are being written
            extra = await connect(port)
            try:
                assert await closed_by_server(extra, within_s=2)
                assert guard.stats.refused_total == 1
                assert guard.stats.open == 3
            finally:
                extra.close()
        finally:
            for sock in busy:
                sock.close()


async def unread(port: int, requests: int = 500, request: bytes = WHOLE_REQUEST) -> socket.socket:
    """A client that pipelines ``requests`` requests and reads none of the answers,
    through a 4 KiB receive buffer: most of the answers wait in the server's queues."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    await asyncio.get_running_loop().sock_sendall(sock, request * requests)
    return sock


def reset_by_server(sock: socket.socket) -> bool:
    """Without reading (tcp(7) TCP_INFO; 1 is ESTABLISHED)."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] != 1


async def test_a_client_that_does_not_read_is_reset_at_the_write_deadline() -> None:
    async with serving(write_timeout_s=0.5) as (port, guard):
        started = time.monotonic()
        sock = await unread(port)
        try:
            while not reset_by_server(sock) and time.monotonic() - started < 5:
                await asyncio.sleep(0.02)
            assert 0.45 <= time.monotonic() - started < 5
            assert guard.stats.write_timed_out_total == 1
            assert guard.stats.open == 0
        finally:
            sock.close()


async def test_at_the_cap_the_slow_go_first_then_the_idle() -> None:
    # One idle kept-alive scraper (the oldest), one client that does not read its
    # answers, one that sends half a header: the latter two make room first.
    async with serving(header_timeout_s=30.0, max_connections=3) as (port, guard):
        loop = asyncio.get_running_loop()

        async def kept_alive_scraper() -> socket.socket:
            sock = await connect(port, WHOLE_REQUEST)
            reply = await asyncio.wait_for(loop.sock_recv(sock, 4096), 3)
            assert reply.startswith(b"HTTP/1.1 200")
            return sock

        held = [idle := await kept_alive_scraper()]
        held += [stalled := await unread(port), half := await connect(port, HALF_REQUEST)]
        try:
            await asyncio.sleep(guard.answer_grace_s + 0.1)
            held += [await kept_alive_scraper(), await kept_alive_scraper()]
            assert reset_by_server(stalled)
            assert await closed_by_server(half, within_s=1)
            assert not reset_by_server(idle)
            await asyncio.sleep(guard.answer_grace_s + 0.1)
            held.append(await kept_alive_scraper())  # now the idle one goes
            assert reset_by_server(idle)
            assert (guard.stats.evicted_total, guard.stats.refused_total) == (3, 0)
        finally:
            for sock in held:
                sock.close()


async def test_a_tls_handshake_that_never_comes_is_closed_at_the_header_timeout(
    tmp_path: Path,
) -> None:
    ca = authority(tmp_path, "ca")
    pair = ca.issue(tmp_path, "exporter", server=True, sans=("127.0.0.1",))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(pair.cert, pair.key)
    async with serving(header_timeout_s=0.3, ssl_context=context) as (port, _):
        started = time.monotonic()
        silent = await connect(port)  # TCP, and not a byte of TLS
        try:
            assert await closed_by_server(silent, within_s=5)
            assert time.monotonic() - started < 5
        finally:
            silent.close()


def test_a_cap_beyond_the_fd_limit_is_named() -> None:
    assert fd_headroom_problem(128, 1024) is None
    problem = fd_headroom_problem(128, 100)
    assert problem is not None and "RLIMIT_NOFILE" in problem and "lower the flag" in problem


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="header_timeout_s must be > 0"):
        ConnectionGuard(asyncio.Protocol, header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections must be >= 1"):
        ConnectionGuard(asyncio.Protocol, max_connections=0)
    with pytest.raises(ValueError, match="write_timeout_s must be > 0"):
        ConnectionGuard(asyncio.Protocol, write_timeout_s=0)
