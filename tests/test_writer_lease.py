"""exporter/reporting/lease.py's pure decisions: who may take the node's Lease, when."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest

from exporter.reporting.lease import (
    LEASE_PREFIX,
    MAX_NAME,
    Record,
    WriterLease,
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


class LeaseStore:
    """The Lease API's storage semantics (create once, update only at the stored
    resourceVersion), in memory; ``failing`` makes every call fail with no answer."""

    def __init__(self) -> None:
        self.stored: dict[str, dict[str, Any]] = {}
        self.version = 0
        self.failing = False

    def _answer(self, body: dict[str, Any]) -> dict[str, Any]:
        if self.failing:
            raise TimeoutError("no answer")
        self.version += 1
        stored = copy.deepcopy(body)
        stored["metadata"]["resourceVersion"] = str(self.version)
        self.stored[stored["metadata"]["name"]] = stored
        return copy.deepcopy(stored)

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        if self.failing:
            raise TimeoutError("no answer")
        return copy.deepcopy(self.stored.get(name))

    def create_lease(self, namespace: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._answer(body)

    def replace_lease(self, namespace: str, name: str, body: dict[str, Any]) -> dict[str, Any]:
        version = self.stored[name]["metadata"]["resourceVersion"]
        assert body["metadata"]["resourceVersion"] == version, "a blind update"
        return self._answer(body)


def lease_of(me: str, clock: list[float]) -> WriterLease:
    return WriterLease(
        "gpu",
        "n1",
        me,
        clock=lambda: clock[0],
        wall_micro=lambda: f"2026-11-29T00:00:{clock[0]:09.6f}Z",
        error_type=TimeoutError,
    )


def run_both(
    store: LeaseStore, leases: list[WriterLease], clock: list[float], until: float
) -> None:
    while clock[0] < until:
        for lease in leases:
            lease.step(store, clock[0])
        clock[0] += 0.5


def test_a_standby_starting_beside_a_live_holder_logs_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its first read cannot show the holder renewing; the next ones do within a renewal
    period (adversarial review: every rolling update logged a WARNING "does not say who
    writes (last: no answer)" with nothing failing)."""
    store, clock = LeaseStore(), [0.0]
    holder, standby = lease_of("a", clock), lease_of("b", clock)
    run_both(store, [holder], clock, 5)
    with caplog.at_level(logging.INFO, logger="exporter.reporting.lease"):
        run_both(store, [holder, standby], clock, 200)
    assert (holder.state, standby.mode(clock[0])) == ("held", "shadow")
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_writes_held_past_a_duration_are_logged_at_warning_with_the_last_failure(
    caplog: pytest.LogCaptureFixture,
) -> None:
    store, clock = LeaseStore(), [0.0]
    store.failing = True
    lease = lease_of("a", clock)
    with caplog.at_level(logging.INFO, logger="exporter.reporting.lease"):
        run_both(store, [lease], clock, 29)
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []
        run_both(store, [lease], clock, 32)
    warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warned) == 1 and "last failure: no answer" in warned[0], warned
