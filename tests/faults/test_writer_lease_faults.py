"""One writer per node: two exporters on one node, a refused Lease API, and
a Lease API outage.

The exporters are the real ones on one simulated node and one API stand-in
(tests/test_kube_writer_lease.py has the two-exporter harness and the scenario: two
fatal XIDs over 70 s, with --node-condition).
"""

from __future__ import annotations

import logging

import pytest

from tests.faults.conftest import RecordFault
from tests.harness import simulated_exporter
from tests.test_kube_events import api, quiet, until
from tests.test_kube_writer_lease import (
    LEASE_ARGV,
    cycle,
    events_about_gpu,
    lease_fault,
    one_exporter_alone,
    outage,
    reporter,
    run_until,
    second_exporter,
    sent,
    settle,
    shadowed,
    two_exporters,
    two_gpus,
)


@pytest.mark.slow  # three real exporters, one after the other
async def test_two_exporters_one_node(record_fault: RecordFault) -> None:
    alone_events, alone_patches = await one_exporter_alone()
    events, patches, first, second = await two_exporters()
    assert alone_events >= 5
    assert (events, patches) == (alone_events, alone_patches)
    assert sent(first) > 0 and sent(second) == 0
    assert shadowed(second, "event") == alone_events

    record_fault(
        "two-exporters-one-node",
        expected="Only the holder of the node's writer Lease (coordination.k8s.io/v1, "
        "gpu-occupancy-exporter-<node>) writes; the other computes and counts its writes "
        "as shadowed: the API gets what one exporter alone writes.",
        figure=f"{events} Events and {patches} node-status patches from two exporters, "
        f"as from one alone ({alone_events}, {alone_patches}); the standby sent 0 and "
        f"shadowed {shadowed(second, 'event')} Events and "
        f"{shadowed(second, 'node_condition')} condition writes; before the fix: "
        "12 Events and 6 status patches (every Event twice, two condition writers)",
    )


async def test_writer_lease_api_refused(
    record_fault: RecordFault, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="exporter.reporting.lease")
    async with simulated_exporter(
        two_gpus(),
        argv=["--node-condition"],
        first_cycle=False,
        before_start=lease_fault("forbidden"),
    ) as h:
        await run_until(70, h)
        await settle(h)
        scrape = await h.scrape()
        requests = len(api(h).lease_log)
        events = len(api(h).events())
    refusals = [r for r in caplog.records if "refused this exporter" in r.getMessage()]
    assert reporter(h).lease_state() == "refused"
    assert scrape.get("gpu_exporter_kube_writer_leader") == 1
    assert scrape.get("gpu_exporter_kube_writer_lease_state", state="refused") == 1
    assert events >= 5 and sent(h) > events  # the Events and the condition written
    assert len(refusals) == 1 and requests == 1  # asked once, logged once (next: 300 s)

    record_fault(
        "writer-lease-api-refused",
        expected="A Lease API that refuses the exporter (403) is logged once and served "
        'as gpu_exporter_kube_writer_lease_state{state="refused"}; the exporter writes '
        "as it did without a lease (two exporters on such a node both write) and asks "
        "again 300 s later.",
        figure=f"{events} Events and the condition written over 70 s of simulated time; "
        f"{requests} Lease request, {len(refusals)} log line; leader 1, state refused; "
        "before the fix: no lease state served",
    )


@pytest.mark.slow  # two exporters, their writers on the simulated clock
async def test_writer_lease_outage_keeps_warnings(record_fault: RecordFault) -> None:
    argv = ["--node-condition", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv, writer_on_simulated_clock=True) as first:
        await until(lambda: reporter(first).lease_state() == "held", "the first to hold")
        async with second_exporter(first, argv, writer_on_simulated_clock=True) as second:
            await until(lambda: reporter(second).lease_state() == "standby", "the second")
            await outage(first, second, 20, 80)  # GPU 1's fatal XID at 45 s
            await until(lambda: reporter(first).lease_state() == "held", "held again")
            await settle(first, second)
            gpu1 = events_about_gpu(first, 1)
    keys = [(e["reason"], e["regarding"]["kind"], e["regarding"]["name"]) for e in gpu1]
    assert {"GPUFatalXID", "GPUUnhealthy"} <= {reason for reason, _, _ in keys}
    assert len(keys) == len(set(keys))  # each Warning once
    assert shadowed(first, "event") == 0 and sent(second) == 0

    record_fault(
        "writer-lease-outage-keeps-warnings",
        expected="While the Lease API fails, the holder writes until its renew deadline "
        "(2/3 of the duration after its last renewal, on its monotonic clock); after it, "
        "and on a standby whose holder is no longer known to write, Events, the condition "
        "and taint writes are held (bounded: the recorder's 4096 keys, one desired state "
        "each), not shadowed: the exporter that holds the Lease next sends them, the "
        "other counts them as shadowed.",
        figure=f"GPU 1's {len(keys)} Warnings raised 25 s into a 60 s Lease outage sent "
        "once each after it, 0 shadowed by the holder, 0 sent by the standby; before "
        "the fix: 0 sent (all counted as shadowed)",
    )


@pytest.mark.slow  # the writer thread on the simulated clock, turns in real time
async def test_writer_lease_api_unreachable(
    record_fault: RecordFault, caplog: pytest.LogCaptureFixture
) -> None:
    """The Lease API answers 500 from the start (the API server up for the rest): the
    Warnings are held while the Lease may still decide, then, 150 s (5 durations) of
    failures on, the exporter writes without a lease and says so, once; the Lease
    answering again makes it the holder (an adversarial review: held, and logged at debug only,
    for as long as the outage lasted)."""
    caplog.set_level(logging.WARNING, logger="exporter.reporting.lease")
    argv = ["--node-condition", *LEASE_ARGV]
    async with simulated_exporter(
        two_gpus(),
        argv=argv,
        writer_on_simulated_clock=True,
        first_cycle=False,
        before_start=lease_fault("error"),
    ) as h:
        events_before: int | None = None
        while h.clock() < 240:
            h.clock.advance(10)
            await cycle(h)
            await quiet(h)
            if h.clock() == 140:
                events_before = len(api(h).events())
                assert reporter(h).lease_state() == "unknown"
        await settle(h)
        events_after, state = len(api(h).events()), reporter(h).lease_state()
        requests = len(api(h).lease_log)
        scrape = await h.scrape()
        api(h).set_lease_fault(None)
        h.clock.advance(10)
        await cycle(h)
        await until(lambda: reporter(h).lease_state() == "held", "the Lease held again")
    assert events_before == 0 and events_after >= 4  # both fatal XIDs' Warnings
    assert state == "unreachable"
    assert scrape.get("gpu_exporter_kube_writer_leader") == 1
    assert scrape.get("gpu_exporter_kube_writer_lease_state", state="unreachable") == 1
    said = [r.getMessage() for r in caplog.records if r.name == "exporter.reporting.lease"]
    first = [m for m in said if "has not shown who writes" in m]
    fallback = [m for m in said if "writes without a lease until it holds it" in m]
    again = [m for m in said if "answers again" in m]
    assert (len(first), len(fallback), len(again)) == (1, 1, 1)
    assert requests <= 150 / 2 + 90 / 10 + 2  # every 2 s while held, 10 s after

    record_fault(
        "writer-lease-api-unreachable",
        expected="Writes are held while the Lease may still decide; after 5 durations "
        "(150 s) with no usable answer the state is unreachable, logged once at warning: "
        "the held Warnings are sent and the exporter writes without a lease, asking "
        "every 10 s; the Lease's first answer makes it the holder, logged once.",
        figure=f"0 Events in the first 140 s, {events_after} by 240 s; {requests} Lease "
        f"requests in 240 s; {len(first)}+{len(fallback)}+{len(again)} warning lines "
        "(held past a duration, fallback, answered again); before the fix: 0 Events for the "
        "whole outage, nothing logged above debug",
    )
