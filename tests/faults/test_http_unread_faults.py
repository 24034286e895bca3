"""The HTTP row "128 connections that never read their answers", against one real
``python -m exporter --simulate node-8gpu`` process: more raw sockets than
--http-max-connections each send ``GET /metrics`` and never read the ~100 KiB answer
(a 4 KiB receive buffer, so it stays in the exporter's send queue), re-sending every few
seconds and reconnecting when closed. A fresh scraper must still get a 200 within a
second, every time, and no never-reading connection may outlive the write deadline."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import pytest

from exporter.exposition.connections import DEFAULT_MAX_CONNECTIONS, WRITE_TIMEOUT_S
from tests.exporter_process import ready, start, terminate, wait_for
from tests.faults.conftest import RecordFault
from tests.faults.test_http_faults import Exporter, ms, percentile, scrape

pytestmark = pytest.mark.slow  # a real exporter process, ~15 s of attack

REQUEST = b"GET /metrics HTTP/1.1\r\nHost: exporter\r\n\r\n"  # no gzip: the whole ~100 KiB
ATTACKERS = DEFAULT_MAX_CONNECTIONS + 32
RESEND_S = 3.0
ATTACK_S = WRITE_TIMEOUT_S + 5.0  # long enough for the first ones to meet the deadline
PROBE_EVERY_S = 0.5
ANSWER_WITHIN_S = 1.0
GIVE_UP_S = 5.0  # a probe stops retrying after this (today's code: refused for ~10 s)


@pytest.fixture(scope="module")
def exporter() -> Iterator[Exporter]:
    url, process = start([*("--simulate", "node-8gpu", "--kube-api", "off", "--interval", "1")])
    try:
        wait_for(lambda: ready(url), process)
        yield Exporter(url, int(url.rsplit(":", 1)[1]), process.pid)
        assert process.poll() is None, "the exporter died under unread answers"
    finally:
        terminate(process)


TCP_ESTABLISHED = 1  # include/net/tcp_states.h; tcp_info's first byte is the state


def closed_by_server(sock: socket.socket) -> bool:
    """Reset or ended by the exporter. Asks the kernel for the state (tcp(7), TCP_INFO):
    reading would take the answer, and a reset socket still returns the bytes it holds."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 8)[0] != TCP_ESTABLISHED


@dataclass
class Attack:
    """``ATTACKERS`` sockets that send GET /metrics and never read; closed ones come back."""

    port: int
    socks: dict[socket.socket, float] = field(default_factory=dict)  # -> first request sent
    closed: int = 0
    lifetimes: list[float] = field(default_factory=list)  # of those the exporter closed

    async def open_one(self) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        try:
            await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
            sock.send(REQUEST)
        except OSError:  # refused or reset at once: try again at the next round
            sock.close()
            return
        self.socks[sock] = time.monotonic()

    def reap(self) -> None:
        """Forget the sockets the exporter closed, noting how long each lived."""
        now = time.monotonic()
        for sock, since in list(self.socks.items()):
            if closed_by_server(sock):
                self.closed += 1
                self.lifetimes.append(now - since)
                del self.socks[sock]
                sock.close()

    def oldest(self) -> float:
        now = time.monotonic()
        return max((now - since for since in self.socks.values()), default=0.0)

    async def resend(self) -> None:
        self.reap()
        for sock in self.socks:
            with contextlib.suppress(OSError):  # our buffer full, or just reset: reaped next
                sock.send(REQUEST)
        while len(self.socks) < ATTACKERS:
            await self.open_one()

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks.clear()


async def time_to_answer(url: str) -> float:
    """Seconds until a fresh scraper (a new connection each try) gets a 200."""
    began = time.monotonic()
    while time.monotonic() - began < GIVE_UP_S:
        try:
            status, _ = await scrape(url)
            if status == 200:
                return time.monotonic() - began
        except (aiohttp.ClientError, TimeoutError):
            pass  # refused at the cap: a scraper would try again
        await asyncio.sleep(0.05)
    return float("inf")


async def test_unread_answers_never_lock_out_scrapes(
    exporter: Exporter, record_fault: RecordFault
) -> None:
    fds_before = exporter.fds()
    attack = Attack(exporter.port)
    waits: list[float] = []
    fds_peak = fds_before
    oldest = 0.0
    try:
        await attack.resend()  # the first round: the cap is full of them
        await asyncio.sleep(0.5)
        began = last_resend = time.monotonic()
        while time.monotonic() - began < ATTACK_S:
            waits.append(await time_to_answer(exporter.url))
            fds_peak = max(fds_peak, exporter.fds())
            attack.reap()
            oldest = max(oldest, attack.oldest())
            if time.monotonic() - last_resend >= RESEND_S:
                await attack.resend()
                last_resend = time.monotonic()
            await asyncio.sleep(PROBE_EVERY_S)
        open_at_end = len(attack.socks)
    finally:
        attack.close()
    fds_after, settle_s = await exporter.settled_fds(fds_before + 2, within_s=3)
    p50, worst = percentile(waits, 0.5), max(waits)
    assert worst <= ANSWER_WITHIN_S, f"a fresh scraper waited {worst:.2f} s; all: {waits}"
    assert attack.closed >= DEFAULT_MAX_CONNECTIONS  # the stalled ones were closed
    longest = max([oldest, *attack.lifetimes])
    assert longest <= WRITE_TIMEOUT_S + 2.0  # none outlives the write deadline
    assert fds_peak <= fds_before + DEFAULT_MAX_CONNECTIONS + 8
    assert fds_after <= fds_before + 2
    record_fault(
        "http-unread-responses",
        expected=(
            f"{ATTACKERS} connections that send GET /metrics, never read the answer and "
            f"re-send every {RESEND_S:g} s never lock scrapes out: a connection waiting "
            "for its client to read is evictable when the cap is full, and closed "
            f"(reset) {WRITE_TIMEOUT_S:g} s after its request (the write deadline); a "
            f"fresh scraper gets a 200 within {ANSWER_WITHIN_S:g} s every time, and fds "
            "stay within the cap."
        ),
        figure=(
            f"{len(waits)} fresh scrapers over {ATTACK_S:g} s: time to a 200 p50 "
            f"{ms(p50)}, max {ms(worst)}; {attack.closed} never-reading connections "
            f"closed by the exporter (the longest-lived after {longest:.1f} s), "
            f"{open_at_end} open at the end; exporter fds {fds_before} before, peak "
            f"{fds_peak} (cap {DEFAULT_MAX_CONNECTIONS}), {fds_after} {settle_s:.1f} s "
            "after the attack."
        ),
    )
