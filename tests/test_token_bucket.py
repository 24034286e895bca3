"""The one token bucket (exporter/token_bucket.py) that the write budgets and basic
auth's budgets share: refill, burst, a clock that goes backwards, a huge gap."""

from __future__ import annotations

import pytest

from exporter.token_bucket import TokenBucket


def test_it_starts_full_and_a_burst_goes_at_once() -> None:
    bucket = TokenBucket(3, per_s=1.0, now=10.0)
    assert [bucket.take(10.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.wait_s() == pytest.approx(1.0)


def test_it_refills_at_its_rate() -> None:
    bucket = TokenBucket(1, per_s=0.5, now=0.0)
    assert bucket.take(0.0)
    assert not bucket.take(1.9)  # 0.95 of a token
    assert bucket.take(2.0)
    assert not bucket.take(2.0)


def test_a_rate_a_minute_refills_per_minute() -> None:
    bucket = TokenBucket.full_at(5, 2.0, 100.0)  # the node condition's budget
    assert all(bucket.take(100.0) for _ in range(5))
    assert not bucket.take(129.9)
    assert bucket.take(130.0)  # 30 s at 2 a minute: exactly one token
    assert not bucket.take(130.0)


def test_without_now_its_time_starts_at_the_first_take() -> None:
    bucket = TokenBucket(1, per_s=1.0)
    assert bucket.take(1000.0)  # no refill from time zero: it was full anyway
    assert not bucket.take(1000.5)
    assert bucket.take(1001.0)


def test_a_clock_going_backwards_neither_refills_nor_drains() -> None:
    bucket = TokenBucket(2, per_s=1.0, now=100.0)
    assert bucket.take(100.0) and bucket.take(100.0)
    assert not bucket.take(40.0)  # 60 s back: nothing refilled
    assert bucket.tokens == 0
    assert not bucket.take(100.5)  # still waits for time past 100 s, not past 40 s
    assert bucket.tokens == pytest.approx(0.5)
    assert bucket.take(101.0)


def test_a_clock_going_backwards_with_tokens_left_takes_none_away() -> None:
    bucket = TokenBucket(2, per_s=1.0, now=100.0)
    assert bucket.take(100.0)
    assert bucket.take(-1e9)  # the token left is still there
    assert bucket.tokens == 0


def test_a_huge_gap_fills_it_to_its_burst_and_no_further() -> None:
    bucket = TokenBucket(3, per_s=1.0, now=0.0)
    assert all(bucket.take(0.0) for _ in range(3))
    assert bucket.full(1e18)
    assert bucket.tokens == 3
    assert [bucket.take(1e18) for _ in range(4)] == [True, True, True, False]


def test_a_token_given_back_never_overfills_it() -> None:
    bucket = TokenBucket(2, per_s=1.0, now=0.0)
    bucket.give_back()
    assert bucket.tokens == 2
    assert bucket.take(0.0)
    bucket.give_back()
    assert bucket.full(0.0)


def test_it_takes_one_rate_exactly() -> None:
    with pytest.raises(TypeError):
        TokenBucket(1)
    with pytest.raises(TypeError):
        TokenBucket(1, per_s=1.0, per_minute=60.0)
