"""The HTTP rows of the fault matrix, against one real ``python -m exporter --simulate
node-8gpu`` process (its ~100 KiB exposition, the default connection cap of 128 and a
2 s header deadline): what a client sees, and the exporter's own fds and RSS after."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import aiohttp
import pytest

from exporter.exposition.connections import DEFAULT_MAX_CONNECTIONS
from tests.exporter_process import open_fds, ready, rss_bytes, start, terminate, wait_for
from tests.faults.conftest import RecordFault
from tests.test_slow_clients import HALF_REQUEST, closed_by_server, connect

pytestmark = pytest.mark.slow  # a real exporter process, thousands of sockets

HEADER_TIMEOUT_S = 2.0
MiB = 1024**2
# How long a closed connection's fd may take to go: returns as soon as it has gone, so
# only a failure waits it out. A loaded 2-core CI run took over 2 s (16 fds for 14).
SETTLE_S = 10.0
# What Prometheus sends (scrape.go's acceptHeader for the default scrape protocols).
PROMETHEUS_ACCEPT = (
    "application/openmetrics-text;version=1.0.0;q=0.5,text/plain;version=0.0.4;q=0.3,*/*;q=0.2"
)


# Connections accepted beyond the cap and not yet closed when the fds are sampled: 14 seen
# on a 2-core machine running a second test process beside this one (2026-11-29). Well
# below the 72 more that 200 scrapers hold without the cap, which the test must still see.
REFUSED_IN_FLIGHT = 32


@dataclass
class Exporter:
    url: str
    port: int
    pid: int

    def fds(self) -> int:
        return open_fds(self.pid)

    def rss(self) -> int:
        return rss_bytes(self.pid)

    async def settled_fds(self, at_most: int, within_s: float) -> tuple[int, float]:
        """Wait until the exporter holds at most ``at_most`` fds: (fds, seconds taken)."""
        began = time.monotonic()
        while (fds := self.fds()) > at_most and time.monotonic() - began < within_s:
            await asyncio.sleep(0.05)
        return fds, time.monotonic() - began


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    url, process = start(
        [
            *("--simulate", "node-8gpu", "--kube-api", "off", "--interval", "1"),
            *("--http-header-timeout", str(HEADER_TIMEOUT_S)),
        ]
    )
    try:
        wait_for(lambda: ready(url), process)
        yield Exporter(url, int(url.rsplit(":", 1)[1]), process.pid)
        assert process.poll() is None, "the exporter died during the HTTP faults"
    finally:
        terminate(process)


async def scrape(url: str, session: aiohttp.ClientSession | None = None) -> tuple[int, float]:
    """One Prometheus-like scrape: (status, seconds)."""
    began = time.perf_counter()
    own = session is None
    session = session or aiohttp.ClientSession()
    try:
        async with session.get(
            url + "/metrics",
            headers={"Accept": PROMETHEUS_ACCEPT, "Accept-Encoding": "gzip"},
            timeout=aiohttp.ClientTimeout(10),
        ) as response:
            await response.read()
            return response.status, time.perf_counter() - began
    finally:
        if own:
            await session.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms"


async def test_200_concurrent_scrapers(exporter: Exporter, record_fault: RecordFault) -> None:
    """200 Prometheus-like scrapers, each on its own kept-alive connection, three rounds.
    The cap (--http-max-connections, 128) holds: the exporter's fds (sampled from /proc
    all along) stay at the cap, so some scrapers' connections are closed (refused at
    once, or evicted while idle and made again), and none hangs."""
    fds_before, rss_before = exporter.fds(), exporter.rss()
    answered: list[float] = []
    refused: list[float] = []  # seconds until the client saw its connection closed
    made = 0  # TCP connections the scrapers opened
    fds_seen: list[int] = []

    async def connection_made(*_: object) -> None:
        nonlocal made
        made += 1

    tracing = aiohttp.TraceConfig()
    tracing.on_connection_create_end.append(connection_made)

    async def scraper() -> None:
        async with aiohttp.ClientSession(trace_configs=[tracing]) as session:
            for _ in range(3):
                began = time.perf_counter()
                try:
                    status, seconds = await scrape(exporter.url, session)
                    assert status == 200
                    answered.append(seconds)
                except aiohttp.ClientError:
                    refused.append(time.perf_counter() - began)
                await asyncio.sleep(0.3)

    async def sample_fds() -> None:
        while True:
            fds_seen.append(exporter.fds())
            await asyncio.sleep(0.01)

    began = time.monotonic()
    sampler = asyncio.create_task(sample_fds())
    try:
        await asyncio.gather(*(scraper() for _ in range(200)))
    finally:
        sampler.cancel()
    wall = time.monotonic() - began
    assert len(answered) + len(refused) == 600
    assert len(answered) >= 3 * DEFAULT_MAX_CONNECTIONS * 0.9
    # closed at once, not hung until the client's 10 s timeout (up to 1.6 s seen with
    # 8 test runs sharing 2 cores, before and after the write deadline came)
    assert not refused or max(refused) < 2.0
    p50, p99 = percentile(answered, 0.5), percentile(answered, 0.99)
    assert p99 < 2.0
    # The cap: connections beyond it were closed (without it each scraper makes one and
    # keeps it: 200), and the exporter's fds stayed at the cap but for moments (a
    # refused one lives a loop turn or two after its accept; without the cap: 200 more).
    assert made > 200
    fds_typical, fds_peak = sorted(fds_seen)[len(fds_seen) // 2], max(fds_seen)
    # + REFUSED_IN_FLIGHT: refused connections accepted and not yet closed, which on a
    # loaded 2-core CI machine outlast more samples (a fresh-clone CI run: 148 with 16
    # before, cap 128); without the cap the median is 200 over
    assert fds_typical <= fds_before + DEFAULT_MAX_CONNECTIONS + REFUSED_IN_FLIGHT
    fds_after, settle_s = await exporter.settled_fds(fds_before + 2, within_s=3)
    assert fds_after <= fds_before + 2
    rss_growth = exporter.rss() - rss_before
    assert rss_growth < 32 * MiB
    assert (await scrape(exporter.url))[0] == 200
    record_fault(
        "http-200-concurrent-scrapers",
        expected=(
            "200 concurrent kept-alive scrapers: the exporter's fds stay at "
            "--http-max-connections (default 128) over its own (the median of samples "
            "taken throughout; a refused connection lives a moment after its accept), "
            "connections beyond it are closed at once (refused, or evicted while idle) "
            "rather than left hanging, most scrapes are answered from the cached render, "
            "and the fds return to where they were."
        ),
        figure=(
            f"{len(answered)} of 600 scrapes answered (p50 {ms(p50)}, p99 {ms(p99)}, "
            f"gzip), {len(refused)} closed "
            f"({'at most ' + ms(max(refused)) if refused else 'none'}) at the cap of "
            f"{DEFAULT_MAX_CONNECTIONS}; the scrapers made {made} connections; exporter "
            f"fds {fds_before} before, median {fds_typical} and peak {fds_peak} during "
            f"({len(fds_seen)} samples), {fds_after} within {settle_s:.1f} s after; "
            f"{wall:.1f} s in all on 2 shared cores; RSS {rss_growth / MiB:+.1f} MiB."
        ),
    )


async def test_2000_idle_and_half_sent_connections(
    exporter: Exporter, record_fault: RecordFault
) -> None:
    """1,000 connections that say nothing and 1,000 that send half a request line, all
    held open by the client, with a scrape every 250: the cap evicts the oldest slow ones,
    scrapes go on, and the header deadline closes what is left."""
    fds_before, rss_before = exporter.fds(), exporter.rss()
    held: list[socket.socket] = []
    latencies: list[float] = []
    peak = fds_before
    try:
        for i in range(2000):
            held.append(await connect(exporter.port, HALF_REQUEST if i % 2 else b""))
            if len(held) % 250 == 0:
                status, seconds = await scrape(exporter.url)
                assert status == 200  # served while the flood goes on
                latencies.append(seconds)
                peak = max(peak, exporter.fds())
        flood_done = time.monotonic()
        assert await closed_by_server(held[0], within_s=2)  # evicted: closed, not hanging
        fds_after, _ = await exporter.settled_fds(fds_before + 2, within_s=HEADER_TIMEOUT_S + 2)
        closed_after = time.monotonic() - flood_done
    finally:
        for sock in held:
            sock.close()
    assert peak <= fds_before + DEFAULT_MAX_CONNECTIONS + 4
    assert fds_after <= fds_before + 2
    rss_growth = exporter.rss() - rss_before
    assert rss_growth < 32 * MiB
    record_fault(
        "http-2000-idle-connections",
        expected=(
            "2,000 idle or half-sent connections held open never take the exporter past "
            "--http-max-connections: the oldest slow ones are closed to admit new ones, "
            "scrapes are answered throughout, and the header deadline closes the rest."
        ),
        figure=(
            f"exporter fds peaked at {peak} ({fds_before} before, cap "
            f"{DEFAULT_MAX_CONNECTIONS}); 8 scrapes during the flood all 200, max "
            f"{ms(max(latencies))}; the held remainder closed {closed_after:.1f} s after "
            f"the flood (header timeout {HEADER_TIMEOUT_S:g} s), fds back to {fds_after}; "
            f"RSS {rss_growth / MiB:+.1f} MiB."
        ),
    )


async def send_and_read(port: int, payload: bytes, within_s: float = 5.0) -> tuple[bytes, float]:
    """Send ``payload`` on a fresh connection; what came back until the server closed
    it, and the seconds that took."""
    loop = asyncio.get_running_loop()
    sock = await connect(port)
    began = time.monotonic()
    reply = b""
    try:
        # closed while we were still sending: read what it said
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            await loop.sock_sendall(sock, payload)
        while time.monotonic() - began < within_s:
            try:
                chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), within_s)
            except ConnectionResetError:
                break
            if not chunk:
                break
            reply += chunk
    finally:
        sock.close()
    return reply, time.monotonic() - began


OVERSIZED = {
    "a 1 MiB header value": b"GET /metrics HTTP/1.1\r\nHost: e\r\nX-Big: "
    + b"a" * MiB
    + b"\r\n\r\n",
    "20,000 headers": b"GET /metrics HTTP/1.1\r\nHost: e\r\n"
    + b"".join(b"X-H%d: v\r\n" % i for i in range(20_000))
    + b"\r\n",
    "a 100 KiB URL": b"GET /" + b"a" * 100 * 1024 + b" HTTP/1.1\r\nHost: e\r\n\r\n",
}


async def test_oversized_headers_get_400_and_a_closed_connection(
    exporter: Exporter, record_fault: RecordFault
) -> None:
    fds_before, rss_before = exporter.fds(), exporter.rss()
    seen = {}
    for what, payload in OVERSIZED.items():
        reply, seconds = await send_and_read(exporter.port, payload)
        assert reply.startswith(b"HTTP/1.0 400 Bad Request"), (what, reply[:80])
        assert seconds < 1.0, what  # answered and closed, not read to the end
        seen[what] = seconds
    assert (await scrape(exporter.url))[0] == 200
    fds_after, _ = await exporter.settled_fds(fds_before, within_s=SETTLE_S)
    rss_growth = exporter.rss() - rss_before
    assert fds_after <= fds_before
    assert rss_growth < 16 * MiB
    record_fault(
        "http-oversized-headers",
        expected=(
            "A request whose header, header count or URL is oversized gets 400 and its "
            "connection closed (aiohttp's 8 KiB line and field limits) without the "
            "exporter reading or keeping it."
        ),
        figure=(
            "; ".join(f"{what}: 400 and closed in {ms(s)}" for what, s in seen.items())
            + f"; fds {fds_before} -> {fds_after}, RSS {rss_growth / MiB:+.1f} MiB."
        ),
    )


MALFORMED = {
    "TLS ClientHello": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03" + bytes(range(256)),
    "NUL in the method": b"G\x00T /metrics HTTP/1.1\r\nHost: e\r\n\r\n",
    "HTTP/9.9": b"GET /metrics HTTP/9.9\r\nHost: e\r\n\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "no Host in HTTP/1.1": b"GET /metrics HTTP/1.1\r\n\r\n",
    "header line without colon": b"GET /metrics HTTP/1.1\r\nHost e\r\n\r\n",
    "negative Content-Length": b"GET /metrics HTTP/1.1\r\nHost: e\r\nContent-Length: -5\r\n\r\n",
    "Content-Length with chunked": b"GET /metrics HTTP/1.1\r\nHost: e\r\n"
    b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    "bad chunk size": b"POST /metrics HTTP/1.1\r\nHost: e\r\n"
    b"Transfer-Encoding: chunked\r\n\r\nzz\r\n",
    "bare LF line ends": b"GET /healthz HTTP/1.1\nHost: e\n\n",
}


async def test_malformed_requests_get_400_and_the_exporter_serves_on(
    exporter: Exporter, record_fault: RecordFault
) -> None:
    fds_before = exporter.fds()
    slowest = 0.0
    for what, payload in MALFORMED.items():
        reply, seconds = await send_and_read(exporter.port, payload)
        assert reply.startswith(b"HTTP/1.0 400 Bad Request"), (what, reply[:80])
        assert seconds < 1.0, what
        slowest = max(slowest, seconds)
    assert (await scrape(exporter.url))[0] == 200
    fds_after, _ = await exporter.settled_fds(fds_before, within_s=SETTLE_S)
    assert fds_after <= fds_before
    record_fault(
        "http-malformed-requests",
        expected=(
            "Malformed requests (TLS or HTTP/2 bytes on the plain port, bad request "
            "lines, versions, header lines, lengths or chunking) each get 400 and a "
            "closed connection; the exporter serves on."
        ),
        figure=(
            f"{len(MALFORMED)} kinds, each 400 and closed within {ms(slowest)}; a scrape "
            f"after all of them 200; fds {fds_before} -> {fds_after}."
        ),
    )


async def slow_read(port: int, chunk: int, pause_s: float) -> tuple[int, int, float]:
    """GET /metrics uncompressed through a 4 KiB receive buffer, ``chunk`` bytes every
    ``pause_s``: (Content-Length, body bytes received, seconds)."""
    loop = asyncio.get_running_loop()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    began = time.monotonic()
    try:
        await loop.sock_connect(sock, ("127.0.0.1", port))
        await loop.sock_sendall(
            sock, b"GET /metrics HTTP/1.1\r\nHost: e\r\nConnection: close\r\n\r\n"
        )
        data = b""
        while True:
            got = await asyncio.wait_for(loop.sock_recv(sock, chunk), 30)
            if not got:
                break
            data += got
            await asyncio.sleep(pause_s)
    finally:
        sock.close()
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":", 1)[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return length, len(body), time.monotonic() - began


async def test_slow_readers_get_their_whole_response_while_scrapes_go_on(
    exporter: Exporter, record_fault: RecordFault
) -> None:
    fds_before, rss_before = exporter.fds(), exporter.rss()
    readers = [asyncio.create_task(slow_read(exporter.port, 4096, 0.02)) for _ in range(10)]
    latencies = []
    while not all(r.done() for r in readers):
        status, seconds = await scrape(exporter.url)
        assert status == 200
        latencies.append(seconds)
        await asyncio.sleep(0.05)
    results = [r.result() for r in readers]
    for length, received, _ in results:
        assert received == length > 50_000  # the whole, uncompressed exposition
    slowest = max(seconds for _, _, seconds in results)
    assert slowest > 0.5  # they really were slow
    p99 = percentile(latencies, 0.99)
    assert p99 < 1.0
    fds_after, _ = await exporter.settled_fds(fds_before, within_s=SETTLE_S)
    assert fds_after <= fds_before
    rss_growth = exporter.rss() - rss_before
    assert rss_growth < 16 * MiB
    record_fault(
        "http-slow-reader",
        expected=(
            "Slow readers of the full uncompressed exposition each get every byte, "
            "while other scrapes are answered as usual and no fd is left behind."
        ),
        figure=(
            f"10 readers at ~200 KiB/s through a 4 KiB receive buffer took up to "
            f"{slowest:.1f} s for {results[0][0] / 1024:.0f} KiB each; {len(latencies)} "
            f"scrapes meanwhile, p99 {ms(p99)}; fds {fds_before} -> {fds_after}, RSS "
            f"{rss_growth / MiB:+.1f} MiB."
        ),
    )
