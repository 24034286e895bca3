"""Static pods and clocks (no false Warning from a UID or a clock step) as fault-matrix rows.

The real exporter runs on the simulator (tests/harness.py) and writes through the real
``kubernetes`` client to the API stand-in; each test counts the Events it wrote.
"""

from __future__ import annotations

from exporter.sources.kube import PodWatcher
from tests.faults.conftest import RecordFault
from tests.harness import Harness, simulated_exporter
from tests.kube_writes import status_of
from tests.test_kube_events import api, quiet, until
from tests.test_static_pods_and_clocks import (
    GRACE_CYCLES,
    UNUSABLE_DATES,
    XID_ARGV,
    cycles_until,
    fatal_xid_then_step,
    orphan_events,
    reasons,
    run_cycles,
    static_pod_scenario,
    terminating_pod,
)


async def test_a_static_pod_using_a_gpu_gets_no_orphaned_memory_warning(
    record_fault: RecordFault,
) -> None:
    async with simulated_exporter(static_pod_scenario("sim-static-fault")) as h:
        await run_cycles(h, GRACE_CYCLES)
        await quiet(h)
        events = orphan_events(h)
        latest = h.agent.latest
        assert latest is not None
        (row,) = [p for p in latest.attribution.processes if p.gpu == 0]
        assert events == [] and latest.orphans == ()
        assert (row.namespace, row.pod) == ("kube-system", "gpu-probe-sim-static-fault")
    record_fault(
        "static-pod-uses-gpu",
        expected="A static pod's processes (cgroup UID: the kubelet's hash of its "
        "manifest) are attributed to its mirror pod through the kubernetes.io/config.mirror "
        "annotation, never read as a deleted pod's; a deleted pod whose process lives on "
        "is still deleted_pod memory.",
        figure=f"0 GPUOrphanedMemory Events over {GRACE_CYCLES} cycles "
        f"({GRACE_CYCLES * 10} s), process attributed to kube-system/{row.pod}; "
        "before the fix: 1 Warning (deleted_pod, 60 s after start)",
    )


async def test_a_wall_clock_step_after_a_fatal_xid_keeps_the_fault(
    record_fault: RecordFault,
) -> None:
    async with simulated_exporter(fatal_xid_then_step(7220), argv=XID_ARGV) as h:
        await run_cycles(h, 2)  # 20 s: the XID 48 at 15 s is in
        await until(lambda: status_of(h) == ("True", "GPUUnhealthy"), "the condition True")
        await until(lambda: len(api(h).device_taint_rules()) == 1, "the DeviceTaintRule")
        await run_cycles(h, 10)  # to 120 s; the wall clock 2 h 20 s ahead from 40 s
        await quiet(h)
        healthy = reasons(h).count("GPUHealthy")
        rules = len(api(h).device_taint_rules())
        assert healthy == 0 and rules == 1
        assert status_of(h) == ("True", "GPUUnhealthy")
    record_fault(
        "wall-clock-steps-after-fatal-xid",
        expected="The fatal-XID window (--health-xid-window) runs on the monotonic clock: "
        "a wall-clock step forward keeps a true XID's verdict, condition and taint for the "
        "window, and a step back does not stretch it.",
        figure=f"step +7220 s 25 s after an XID 48: {healthy} GPUHealthy Events, condition "
        f"stays True and {rules} DeviceTaintRule kept over 10 cycles; before the fix: "
        "GPUHealthy, condition True -> False and the rule deleted in the cycle of the step",
    )


async def test_a_node_clock_ahead_of_the_api_server_gives_no_warning_in_a_graceful_stop(
    record_fault: RecordFault,
) -> None:
    async with simulated_exporter(terminating_pod("sim-ahead-fault", 180)) as h:
        await cycles_until(h, 100)  # deadline at 50 s (server clock) + 60 s grace
        await quiet(h)
        inside = len(orphan_events(h))
        assert h.agent.latest is not None and h.agent.latest.node.pod_meta is not None
        offset = h.agent.latest.node.pod_meta.server_offset_s
        assert inside == 0
        assert offset is not None and 179 <= offset <= 182
        await cycles_until(h, 120)
        await quiet(h)
        past = orphan_events(h)
        assert len(past) == 1 and "deleted_pod" in past[0]
    record_fault(
        "node-clock-ahead-of-api-server",
        expected="A terminating pod's stop ends its own grace period "
        "(deletionGracePeriodSeconds) after the exporter first saw it terminating, on the "
        "monotonic clock, never before the server's deadline: no deleted-pod Warning "
        "inside the grace, one past it, whatever the node's clock says.",
        figure=f"node clock +180 s (estimated {offset:.0f} s): 0 GPUOrphanedMemory Events "
        "up to 100 s (deadline 50 s + 60 s grace), 1 (deleted_pod) at 110-120 s; before "
        "the fix: the Warning at 20 s, in the cycle the 30 s graceful stop began",
    )


async def warnings_inside_and_past_the_stop(h: Harness) -> tuple[int, int]:
    """GPUOrphanedMemory Events of ``terminating_pod`` up to 100 s (seen terminating at
    ~20 s + its 30 s stop + the 60 s grace: none) and by 120 s (exactly one, deleted_pod)."""
    await cycles_until(h, 100)
    await quiet(h)
    inside = len(orphan_events(h))
    await cycles_until(h, 120)
    await quiet(h)
    past = orphan_events(h)
    assert inside == 0
    assert len(past) == 1 and "deleted_pod" in past[0]
    return inside, len(past)


async def test_a_wall_clock_step_in_a_graceful_stop_neither_hastens_nor_loses_the_warning(
    record_fault: RecordFault,
) -> None:
    counts: dict[float, tuple[int, int]] = {}
    for step_s in (7200.0, -7200.0):
        async with simulated_exporter(
            terminating_pod(f"sim-step-fault-{step_s < 0:d}", 0, step_s)
        ) as h:
            counts[step_s] = await warnings_inside_and_past_the_stop(h)
    record_fault(
        "terminating-pod-across-wall-clock-step",
        expected="The graceful stop and the deleted-pod grace after it run on the monotonic "
        "clock from the first sight of the deletionTimestamp: a wall-clock step neither "
        "hastens nor loses the Warning.",
        figure=f"step +7200 s at 30 s: {counts[7200.0][0]} GPUOrphanedMemory Events up to "
        f"100 s, {counts[7200.0][1]} by 120 s; step -7200 s: {counts[-7200.0][0]} and "
        f"{counts[-7200.0][1]}; before the fix (deadline compared on the server's clock, "
        "estimated from Date headers): the Warning in the cycle of the +2 h step, inside "
        "the 30 s graceful stop",
    )


async def test_no_usable_date_from_the_api_server_neither_hastens_nor_loses_the_warning(
    record_fault: RecordFault,
) -> None:
    counts: dict[str, tuple[int, int]] = {}
    for date, value in sorted(UNUSABLE_DATES.items()):
        async with simulated_exporter(
            terminating_pod(f"sim-date-fault-{date}", 180, api_date=value)
        ) as h:
            watch = h.agent.source("kube")
            assert isinstance(watch, PodWatcher)
            counts[date] = await warnings_inside_and_past_the_stop(h)
            assert watch.server_clock.offset_s() is None
    record_fault(
        "terminating-pod-without-a-usable-date",
        expected="A terminating pod's stop is timed on the monotonic clock from the first "
        "sight of its deletionTimestamp, not on the API server's clock estimated from Date "
        "headers: without a usable Date the Warning comes neither early nor never.",
        figure="; ".join(
            f"Date {date}: {inside} GPUOrphanedMemory Events up to 100 s, {past} by 120 s"
            for date, (inside, past) in counts.items()
        )
        + "; before the fix (no offset: the deadline compared on the node's clock, 180 s "
        "ahead): the Warning at 20 s, in the cycle the 30 s graceful stop began",
    )
