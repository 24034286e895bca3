"""Slow and idle clients against the real aiohttp server behind ConnectionGuard: raw
sockets that send half a request or nothing, and a real aiohttp scrape beside them.
Thousands of them at once against a real exporter process is the fault matrix's
(tests/faults/test_http_faults.py)."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import aiohttp
import pytest

from exporter.exposition.connections import ConnectionGuard, GuardedTCPSite
from exporter.exposition.server import build_app, start_server
from tests.harness import one_gauge_cache

HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: exporter\r\nUser-Agent: slo"
WHOLE_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: exporter\r\n\r\n"


@asynccontextmanager
async def serving(**limits: float) -> AsyncIterator[tuple[int, ConnectionGuard]]:
    runner = await start_server(build_app(one_gauge_cache(), "node-a"), "127.0.0.1", 0, **limits)  # type: ignore[arg-type]
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
    # while a request is being sent.
    async with serving(header_timeout_s=0.3) as (port, guard):
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
        finally:
            sock.close()


async def test_at_the_cap_with_every_connection_busy_a_new_one_is_refused() -> None:
    # Connections whose request arrived just now are being answered: not evicted.
    async with serving(header_timeout_s=5.0, max_connections=3) as (port, guard):
        loop = asyncio.get_running_loop()
        busy = [await connect(port, WHOLE_REQUEST) for _ in range(3)]
        try:
            for sock in busy:  # each got its answer and stays kept alive
                assert (await asyncio.wait_for(loop.sock_recv(sock, 4096), 3)).startswith(
                    b"HTTP/1.1 200"
                )
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


def test_limits_are_validated() -> None:
    with pytest.raises(ValueError, match="header_timeout_s must be > 0"):
        ConnectionGuard(asyncio.Protocol, header_timeout_s=0)
    with pytest.raises(ValueError, match="max_connections must be >= 1"):
        ConnectionGuard(asyncio.Protocol, max_connections=0)
