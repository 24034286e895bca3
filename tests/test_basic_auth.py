"""exposition/basic_auth.py with real bcrypt hashes: the cache, the failed-login budgets,
the bounded worker and its closing, the made-up hash for unknown users."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import bcrypt
import pytest

from exporter.exposition.basic_auth import (
    CACHE_SIZE,
    CLIENT_BURST,
    CLIENT_PER_S,
    GLOBAL_BURST,
    QUEUE_SIZE,
    BasicAuth,
    TokenBucket,
    Verdict,
)
from exporter.exposition.web_config import WebConfigError, bcrypt_cost, parse_web_config

PASSWORD = "s3cret-scrape"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


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


async def test_failed_logins_have_a_budget_in_all() -> None:
    auth = BasicAuth(clock=Clock())
    users = {"prometheus": hashed(PASSWORD)}
    for n in range(GLOBAL_BURST):
        assert await auth.check(users, "prometheus", "x", f"10.1.0.{n}") is Verdict.DENIED
    assert await auth.check(users, "prometheus", "x", "10.2.0.1") is Verdict.LIMITED
    assert auth.checks_total == GLOBAL_BURST


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
