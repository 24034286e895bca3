"""exporter/reporting/lease.py's pure decisions: who may take the node's Lease, when."""

from __future__ import annotations

from exporter.reporting.lease import (
    LEASE_PREFIX,
    MAX_NAME,
    Record,
    decide,
    lease_body,
    lease_name,
    parse_lease,
)

ME = "gpu-abcde_0123"


def record(
    holder: str, duration_s: int = 30, renew_time: str = "2026-11-28T15:00:00.000000Z"
) -> Record:
    return Record(holder, duration_s, renew_time, renew_time, 0, "7")


def test_ours_is_renewed_whatever_its_age() -> None:
    assert decide(record(ME), observed_at=0, me=ME, now=1000) == "renew"


def test_a_free_lease_is_taken_at_once() -> None:
    assert decide(record(""), observed_at=100, me=ME, now=100) == "acquire"


def test_anothers_lease_is_taken_only_a_duration_after_we_first_saw_it_unchanged() -> None:
    other = record("other_1")
    assert decide(other, observed_at=100, me=ME, now=129.9) == "wait"
    assert decide(other, observed_at=100, me=ME, now=130) == "acquire"


def test_the_records_own_timestamps_are_never_compared_with_our_clock() -> None:
    """A renewTime from 1970 or from next year (the other node's wall clock, skewed)
    decides nothing: only when we saw the record change does."""
    for stamp in ("1970-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z"):
        other = record("other_1", renew_time=stamp)
        assert decide(other, observed_at=100, me=ME, now=101) == "wait"
        assert decide(other, observed_at=100, me=ME, now=131) == "acquire"


def test_a_node_name_too_long_for_the_lease_name_ends_in_its_hash() -> None:
    assert lease_name("gpu-node-1") == LEASE_PREFIX + "gpu-node-1"
    long_a, long_b = "a" * 250, "a" * 249 + "b"
    assert len(lease_name(long_a)) <= MAX_NAME and len(lease_name(long_b)) <= MAX_NAME
    assert lease_name(long_a) != lease_name(long_b)


def test_a_lease_body_reads_back_as_its_record() -> None:
    body = lease_body(
        "n",
        "ns",
        ME,
        30,
        acquire_time="a",
        renew_time="r",
        transitions=2,
        resource_version="9",
    )
    assert parse_lease(body) == Record(ME, 30, "a", "r", 2, "9")


def test_an_unreadable_lease_reads_as_free_with_our_duration() -> None:
    """No holder; a duration that is no whole number > 0 reads as ours (never 0: a
    takeover at once; tests/test_kube_writer_lease.py has the clamp's cases)."""
    garbage = {"metadata": [], "spec": {"holderIdentity": 5, "leaseDurationSeconds": True}}
    assert parse_lease(garbage, own_duration_s=12) == Record("", 12, None, None, 0, "")
