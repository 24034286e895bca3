"""exposition/basic_auth.py with real bcrypt hashes: the cache, the failed-login budgets,
the bounded worker and its closing, the made-up hash for unknown users."""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import bcrypt
import pytest

from exporter.exposition.basic_auth import (
    CACHE_SIZE,
    CLIENT_BURST,
    CLIENT_PER_S,
    GLOBAL_BURST,
    GLOBAL_PER_S,
    QUEUE_SIZE,
    BasicAuth,
    PasswordWorker,
    Verdict,
)
from exporter.exposition.web_config import WebConfigError, bcrypt_cost, parse_web_config
from exporter.token_bucket import TokenBucket
from tests.clock import Clock
from tests.exporter_process import free_port, ready, start, terminate, wait_for

PASSWORD = "s3cret-scrape"


def hashed(password: str, cost: int = 4) -> str:
    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=cost)).decode()


async def test_a_verified_password_is_cached_and_costs_no_more_checks() -> None:
    auth = BasicAuth(clock=Clock())
    users = {"prometheus": hashed(PASSWORD)}
    assert await auth.check(users, "prometheus", PASSWORD, "10.0.0.1") is Verdict.ALLOWED
    assert auth.checks_total == 1
    for _ in range(20):
        assert await auth.check(users, "prometheus", PASSWORD, "10.0.0.1") is Verdict.ALLOWED
    assert auth.checks_total == 1
    # a new hash for the user (a reload) is checked again, not served from the cache
    users = {"prometheus": hashed(PASSWORD)}
    assert await auth.check(users, "prometheus", PASSWORD, "10.0.0.1") is Verdict.ALLOWED
    assert auth.checks_total == 2


async def test_the_cache_keeps_the_most_recent_entries_only() -> None:
    auth = BasicAuth(clock=Clock())
    users = {f"u{n}": hashed(PASSWORD) for n in range(CACHE_SIZE + 1)}
    for user in users:
        assert await auth.check(users, user, PASSWORD, user) is Verdict.ALLOWED
    assert auth.checks_total == CACHE_SIZE + 1
    assert await auth.check(users, "u1", PASSWORD, "u1") is Verdict.ALLOWED  # still cached
    assert auth.checks_total == CACHE_SIZE + 1
    assert await auth.check(users, "u0", PASSWORD, "u0") is Verdict.ALLOWED  # evicted
    assert auth.checks_total == CACHE_SIZE + 2


async def test_an_unknown_user_costs_a_check_like_a_known_one() -> None:
    """A made-up hash of the users' highest cost: 'no such user' takes as long as 'wrong
    password', so timing does not tell which names exist."""
    auth = BasicAuth(clock=Clock())
    users = {"fast": hashed(PASSWORD, 4), "prometheus": hashed(PASSWORD, 8)}
    began = time.perf_counter()
    assert await auth.check(users, "prometheus", "wrong", "a") is Verdict.DENIED
    known_s = time.perf_counter() - began
    began = time.perf_counter()
    assert await auth.check(users, "nobody", PASSWORD, "b") is Verdict.DENIED
    unknown_s = time.perf_counter() - began
    assert auth.checks_total == 2
    assert unknown_s > known_s / 3, (known_s, unknown_s)  # cost 8, not 4 (16x less)


async def test_missing_credentials_are_denied_without_a_check() -> None:
    auth = BasicAuth(clock=Clock())
    assert await auth.check({"u": hashed(PASSWORD)}, None, None, "a") is Verdict.DENIED
    assert auth.checks_total == 0


async def test_failed_logins_over_a_clients_budget_are_limited_without_a_check() -> None:
    clock = Clock()
    auth = BasicAuth(clock=clock)
    users = {"prometheus": hashed(PASSWORD)}
    for n in range(CLIENT_BURST):
        assert await auth.check(users, "prometheus", f"guess-{n}", "10.0.0.9") is Verdict.DENIED
    assert await auth.check(users, "prometheus", "again", "10.0.0.9") is Verdict.LIMITED
    assert auth.checks_total == CLIENT_BURST  # the limited one was not hashed
    assert auth.retry_after_s == pytest.approx(1 / CLIENT_PER_S)
    # other clients keep their own budget; the right password from the flooded address
    # is limited too until the budget refills (a verified one would be cached)
    assert await auth.check(users, "prometheus", "x", "10.0.0.10") is Verdict.DENIED
    clock.now += 1 / CLIENT_PER_S
    assert await auth.check(users, "prometheus", PASSWORD, "10.0.0.9") is Verdict.ALLOWED
    assert await auth.check(users, "prometheus", PASSWORD, "10.0.0.9") is Verdict.ALLOWED


async def test_failed_checks_in_all_are_paced_not_refused() -> None:
    """Beyond the burst, failed checks wait for the pace (GLOBAL_PER_S) instead of being
    refused: a flood from many addresses slows checks down, it cannot answer 429 to an
    address that has failed nothing."""
    auth = BasicAuth(clock=Clock())
    users = {"prometheus": hashed(PASSWORD)}
    for n in range(GLOBAL_BURST):
        assert await auth.check(users, "prometheus", "x", f"10.1.0.{n}") is Verdict.DENIED
    began = time.perf_counter()
    assert await auth.check(users, "prometheus", "x", "10.2.0.1") is Verdict.DENIED
    assert await auth.check(users, "prometheus", "x", "10.2.0.2") is Verdict.DENIED
    assert time.perf_counter() - began >= 1.5 / GLOBAL_PER_S  # two tokens, less the refill
    assert auth.checks_total == GLOBAL_BURST + 2


async def test_a_second_request_from_an_address_whose_check_waits_is_limited_at_once() -> None:
    auth = BasicAuth(clock=Clock())
    users = {"prometheus": hashed(PASSWORD, 12)}  # ~0.25 s a check
    first = asyncio.create_task(auth.check(users, "prometheus", "x", "10.4.0.1"))
    await asyncio.sleep(0)
    assert await auth.check(users, "prometheus", "y", "10.4.0.1") is Verdict.LIMITED
    assert await first is Verdict.DENIED
    assert auth.checks_total == 1
    auth.close()


async def test_a_busy_answer_gives_the_addresses_token_back() -> None:
    """A 503 hashed nothing and a retry gains no rank (the rank is the address's), so it
    spends no budget: an address waiting its turn is never turned into a 429."""
    auth = BasicAuth(clock=Clock())
    users = {"prometheus": hashed(PASSWORD, 12)}
    queued = [
        asyncio.create_task(auth.check(users, "prometheus", "x", f"10.5.0.{n}"))
        for n in range(QUEUE_SIZE + 1)
    ]
    await asyncio.sleep(0.05)
    answers = [await auth.check(users, "prometheus", "x", "10.5.1.1") for _ in range(15)]
    assert answers == [Verdict.BUSY] * 15, answers
    auth.close()
    await asyncio.gather(*queued)


async def test_fresh_addresses_flooding_cannot_keep_out_an_address_seen_before_them() -> None:
    """An adversarial review's auth_fresh.py at the worker, on a frozen clock: the pace allows one
    failed check per step, a NEW address floods in each step (one request each, as 30 a
    second did), and Prometheus's address, never checked, retries every 4 steps. Ranked
    by each request's arrival it got 503 every time (an earlier newcomer always ranked
    ahead); ranked by when its address was first seen it displaces the later newcomers
    and is checked behind at most the QUEUE_SIZE that were waiting at its first try."""
    clock = Clock()
    worker = PasswordWorker(clock=clock)
    wrong, right = hashed("other").encode(), hashed(PASSWORD).encode()
    for n in range(GLOBAL_BURST):  # spend the burst: from here on, one check per step
        assert await _check(worker, f"10.7.0.{n}", b"x", wrong) is False
    flood = [worker.check(f"10.8.0.{n}", b"x", wrong) for n in range(QUEUE_SIZE)]
    tries: list[object] = []
    scraper: asyncio.Future[bool | None] | None = None
    for step in range(24):
        clock.now += 1 / GLOBAL_PER_S
        flood.append(worker.check(f"10.8.1.{step}", b"x", wrong))  # a new address each step
        if scraper is None and step % 4 == 0:
            answer = worker.check("127.0.0.2", PASSWORD.encode(), right)
            tries.append(answer)
            if not isinstance(answer, Verdict):
                scraper = answer
        if scraper is not None and scraper.done():
            break
        checks, waiting = worker.checks_total, scraper
        await _until(
            lambda c=checks, w=waiting: worker.checks_total > c or bool(w and w.done())  # type: ignore[misc]
        )
    worker.close()
    assert scraper is not None and scraper.result() is True, tries
    assert tries[0] is Verdict.BUSY and len(tries) == 2, tries  # in at its first retry
    assert step <= 4 + QUEUE_SIZE + 1, step  # behind the QUEUE_SIZE seen before it at most
    for answer in flood:
        if not isinstance(answer, Verdict):
            await answer


async def _check(worker: PasswordWorker, client: str, password: bytes, hashed_: bytes) -> object:
    answer = worker.check(client, password, hashed_)
    return answer if isinstance(answer, Verdict) else await answer


async def _until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.005)


@pytest.mark.slow  # real bcrypt checks at the pace
async def test_an_address_not_checked_since_the_flood_goes_ahead_of_the_flooders() -> None:
    """The state after a restart or a new hash: Prometheus's password is not cached yet,
    while more addresses than the queue holds, each checked once already, keep it full
    of slow wrong passwords. Prometheus's address, never checked, takes the place of the
    most recently checked flooder and goes next, instead of getting 503 for ever."""
    auth = BasicAuth(clock=Clock())
    users = {"prometheus": hashed(PASSWORD, 4), "slow": hashed(PASSWORD, 12)}
    flooders = [f"10.6.0.{n}" for n in range(QUEUE_SIZE + 2)]
    for address in flooders:  # each flooder checked once (cheaply)
        assert await auth.check(users, "prometheus", "x", address) is Verdict.DENIED
    flood = [asyncio.create_task(auth.check(users, "slow", "x", address)) for address in flooders]
    await asyncio.sleep(0.05)  # the queue is full: the last flooders got 503
    assert sum(t.done() for t in flood) >= 1
    checks_before = auth.checks_total
    assert await auth.check(users, "prometheus", PASSWORD, "10.6.9.9") is Verdict.ALLOWED
    # checked right after the slow check in progress (two at most, on a slow CPU),
    # not behind the QUEUE_SIZE flooders waiting
    assert auth.checks_total - checks_before <= 3, auth.checks_total - checks_before
    verdicts = await asyncio.gather(*flood)
    assert Verdict.BUSY in verdicts  # the flooder it displaced, or those refused
    auth.close()


async def test_a_full_queue_is_answered_busy_at_once_and_close_answers_the_queued() -> None:
    auth = BasicAuth(clock=Clock())
    users = {"prometheus": hashed(PASSWORD, 12)}  # ~0.25 s a check
    checks = [
        asyncio.create_task(auth.check(users, "prometheus", "x", f"10.3.0.{n}"))
        for n in range(QUEUE_SIZE + 4)
    ]
    await asyncio.sleep(0.05)
    busy = [t for t in checks if t.done()]
    assert len(busy) >= 3 and all(t.result() is Verdict.BUSY for t in busy)
    began = time.perf_counter()
    auth.close()
    verdicts = await asyncio.gather(*checks)
    assert time.perf_counter() - began < 1.0  # one check in progress at most
    assert verdicts.count(Verdict.BUSY) >= QUEUE_SIZE + 3
    assert auth.checks_total <= 2
    assert await auth.check(users, "prometheus", PASSWORD, "a") is Verdict.BUSY  # closed


def test_a_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    bucket = TokenBucket(burst=2, per_s=0.5)
    assert bucket.take(0) and bucket.take(0) and not bucket.take(0)
    assert bucket.wait_s() == pytest.approx(2)
    assert not bucket.take(1.9) and bucket.take(2.0)
    assert bucket.take(100) and bucket.take(100) and not bucket.take(100)


@pytest.mark.parametrize(
    ("hashed_", "message"),
    [
        ("$2b$13$" + "a" * 53, "bcrypt cost 13 is above the ceiling of 12"),
        ("$2y$31$N9qo8uLOickgx2ZMRZoMyeIjZAgcfl7p92ldGxad68LJZdL17lhWy", "cost 31"),
        ("$2y$03$" + "a" * 53, "must be a bcrypt hash"),
        ("$2y$10$short", "must be a bcrypt hash"),
        ("$2x$10$" + "a" * 53, "must be a bcrypt hash"),
    ],
)
def test_a_hash_beyond_the_cost_ceiling_or_malformed_is_refused(hashed_: str, message: str) -> None:
    with pytest.raises(WebConfigError) as raised:
        parse_web_config({"basic_auth_users": {"u": hashed_}}, Path("/etc/web.yml"))
    assert message in str(raised.value) and "basic_auth_users.u" in str(raised.value)


def test_bcrypt_cost_reads_well_formed_hashes_only() -> None:
    assert bcrypt_cost(hashed(PASSWORD, 5)) == 5
    assert bcrypt_cost("$2y$10$X0h1gDsPszWURQaxFh.zoubFi6DXncSjhoQNJgRrnGs7EsimhC7zG") == 10
    assert bcrypt_cost("plain") is None


def _get_metrics(port: int, source: str, user: str, password: str) -> int:
    """One GET /metrics from the loopback address ``source`` (all of 127/8 is loopback
    on Linux): the status, or 0 when the connection failed."""
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    request = (
        f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic {token}\r\n"
        "Connection: close\r\n\r\n"
    ).encode()
    try:
        with socket.create_connection(
            ("127.0.0.1", port), timeout=10, source_address=(source, 0)
        ) as conn:
            conn.sendall(request)
            head = conn.recv(64)
            while conn.recv(65536):
                pass
    except OSError:
        return 0
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0


def _bcrypt_check_s(config: Path) -> float:
    """The time one check of the config's hash takes on this machine now (median of 3)."""
    stored = config.read_text().split("'")[1].encode()
    times = []
    for _ in range(3):
        began = time.monotonic()
        bcrypt.checkpw(PASSWORD.encode(), stored)
        times.append(time.monotonic() - began)
    return sorted(times)[1]


@pytest.mark.slow  # a real exporter process and a flood of a few seconds
def test_a_flood_from_eight_addresses_does_not_lock_out_a_login_not_yet_cached(
    tmp_path: Path,
) -> None:
    """An adversarial review's auth_flood.py 8 0: eight addresses send wrong passwords (cost 12) as
    fast as they are answered; Prometheus, whose password is not cached yet (the state
    after a restart), tries once a second. It used to get 503 every time (the attackers'
    503s cost them nothing and refilled a queue of 4 first); now its address, checked
    less recently than any flooder, goes to the front and gets in within the bound
    docs/security.md states: one retry interval (1 s here) plus the checks ranked ahead
    of its first try (QUEUE_SIZE = 8 at the pace of 2 a second: ~4 s), so 5 s on a free
    core; where a check takes longer than the pace's step, 8 of the checks measured."""
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prom: '{hashed(PASSWORD, 12)}'\n")
    port = free_port()
    url, process = start(
        ["--simulate", "single-gpu", "--kube-api", "off", "--web-config-file", str(config)],
        port=port,
    )
    stop = threading.Event()
    answers: Counter[int] = Counter()

    def flood(source: str, user: str) -> None:
        n = 0
        while not stop.is_set():
            n += 1
            answers[_get_metrics(port, source, user, f"wrong-{n}")] += 1

    flooders = [
        threading.Thread(target=flood, args=(f"127.0.0.{k + 2}", "prom" if k % 2 else f"u{k}"))
        for k in range(8)
    ]
    try:
        wait_for(lambda: ready(url), process)
        for thread in flooders:
            thread.start()
        time.sleep(1.0)  # the flood is on: the queue is full
        began = time.monotonic()
        tries: list[int] = []
        while time.monotonic() - began < 12 and 200 not in tries:
            tries.append(_get_metrics(port, "127.0.0.1", "prom", PASSWORD))
            if tries[-1] != 200:
                time.sleep(1.0)
        waited_s = time.monotonic() - began
        check_s = _bcrypt_check_s(config)
    finally:
        stop.set()
        for thread in flooders:
            thread.join(timeout=15)
        terminate(process)
    assert sum(answers.values()) >= len(flooders), answers  # each flooder was answered
    assert 200 in tries, f"Prometheus got {tries} during the flood; the flood got {answers}"
    # docs/security.md's bound (docstring): 1 s + 8 checks at 2 a second, 5 s on a free
    # core; on a busy one a check can take longer than the pace's 0.5 s, and the bound is
    # the same formula at the check's cost measured here, under the same load
    step_s = max(1 / GLOBAL_PER_S, check_s)
    assert waited_s < 1.0 + QUEUE_SIZE * step_s, (waited_s, check_s, tries)
    assert set(answers) <= {401, 429, 503}, answers
    print(f"Prometheus got in after {waited_s:.2f} s ({tries}); the flood got {answers}")
