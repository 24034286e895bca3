"""The exporter's Kubernetes writes under a failing API server: it never holds sampling.

The real exporter runs on a simulated node (tests/harness.py) and writes Events through
the real ``kubernetes`` client to the API stand-in (exporter/sim/kube_writes.py), whose
``set_write_fault`` answers 403, answers late or never answers; "down" is the stand-in
stopped and started again on its port. Each test runs the same three phases:

1. no fault: cycles timed (the baseline), the first Events created;
2. the fault: three cycles, each bringing three new Events (a fatal XID on a new GPU:
   GPUFatalXID and GPUUnhealthy on its pod, GPUUnhealthy on the Node), timed; every one
   of those nine Events must be settled exactly once (created, dropped or failed);
3. the fault cleared: a new Event must get through.

What is measured is the cycle's wall time (``Harness.cycle``: the simulator's sync and
the whole sample cycle) with and without the fault, against the interval (10 s) and the
write deadline (5 s) a cycle would show if it waited on the writer.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import yaml

from exporter.reporting.writer import REQUEST_DEADLINE_S
from exporter.sim.kube_writes import node_dict
from tests.faults.conftest import RecordFault
from tests.harness import Harness, simulated_exporter
from tests.kube_writes import (
    condition,
    dra_with_a_reset,
    recovering_gpu,
    status_of,
    status_patches,
)
from tests.test_kube_events import api, exclusive, quiet, step, until

FAULT_GPUS = (1, 2, 3)  # a fatal XID on each during the fault, one per cycle
NEW_EVENTS = 3 * len(FAULT_GPUS)  # GPUFatalXID + GPUUnhealthy on the pod, GPUUnhealthy Node
CYCLE_BOUND_S = 2.0  # well under the 10 s interval and the 5 s write deadline
RECOVERY_POLL_S = 12.0  # after a fault: the writer's backoff (1, 2, 4 s) may run out first


def six_gpus(node: str) -> dict[str, object]:
    """Pods g0..g5, one GPU each. Fatal XIDs: GPU 0 at 15 s (before the fault), GPUs
    1-3 at 35, 45, 55 s (one per faulted cycle). From 65 s, every 10 s, a pod starts a
    process on a GPU not its own: a new GPUIsolationLeak Event each cycle after the
    fault, the news that must get through once it clears (a reason of its own, so the
    fault's Events can be counted exactly)."""
    timeline: list[dict[str, object]] = [{"at": 15, "xid": {"gpu": 0, "code": 48}}]
    timeline += [{"at": 25 + 10 * g, "xid": {"gpu": g, "code": 48}} for g in FAULT_GPUS]
    leaks = [(p, g) for p in (5, 4, 3, 2, 1, 0) for g in range(6) if g != p]
    timeline += [
        {
            "at": 65 + 10 * i,
            "start": {
                "pid": 50000 + i,
                "gpu": g,
                "memory": "256MiB",
                "sm": 1,
                "comm": "python3",
                "pod": f"ml/g{p}",
                "container": "main",
            },
        }
        for i, (p, g) in enumerate(leaks)
    ]
    return {
        "node_name": node,
        "gpus": [{} for _ in range(6)],
        "pods": [exclusive(f"g{i}", i) for i in range(6)],
        "timeline": timeline,
    }


async def timed_step(h: Harness) -> float:
    began = time.perf_counter()
    await step(h)
    return time.perf_counter() - began


@dataclass
class Phases:
    baseline_s: list[float] = field(default_factory=list)
    fault_s: list[float] = field(default_factory=list)
    recovered_s: float = 0.0  # fault cleared -> the first new Event in the API

    def cycles(self) -> str:
        base, fault = self.baseline_s, self.fault_s
        return (
            f"cycles {statistics.median(base) * 1000:.0f} ms median, "
            f"{max(base) * 1000:.0f} ms max without the fault; "
            f"{statistics.median(fault) * 1000:.0f} ms median, "
            f"{max(fault) * 1000:.0f} ms max under it"
        )

    def assert_cycles_not_held(self) -> None:
        assert max(self.fault_s) < CYCLE_BOUND_S, self.cycles()


async def run_phases(
    h: Harness,
    start: Callable[[], object],
    clear: Callable[[], object],
    *,
    during: Callable[[], None] = lambda: None,
    shown: Callable[[dict[str, int]], bool] | None = None,
) -> Phases:
    """Baseline, fault (``during`` runs after each faulted cycle), recovery: cycles until
    a GPUIsolationLeak Event is in the API. The fault is cleared once ``shown`` holds
    for the settled counts (default: all the fault's Events settled)."""
    phases = Phases()
    while h.clock() < 30:
        phases.baseline_s.append(await timed_step(h))
    await until(lambda: len(api(h).events_regarding("Pod", "ml", "g0")) == 2, "g0's Events")
    start()
    while h.clock() < 60:
        phases.fault_s.append(await timed_step(h))
        during()
    await until(
        lambda: (shown or (lambda c: sum(c.values()) >= 3 + NEW_EVENTS))(settled(h)),
        "the fault to show in the counts",
        RECOVERY_POLL_S,
    )
    clear()
    cleared = time.monotonic()
    while not api(h).events("reason=GPUIsolationLeak"):
        if time.monotonic() - cleared > RECOVERY_POLL_S:
            raise AssertionError("no new Event got through after the fault cleared")
        await step(h)
        await asyncio.sleep(0.3)
    phases.recovered_s = time.monotonic() - cleared
    await quiet(h)
    return phases


def settled(
    h: Harness, reasons: tuple[str, ...] = ("GPUFatalXID", "GPUUnhealthy")
) -> dict[str, int]:
    """How the Events of ``reasons`` (before and during the fault) were settled: result
    -> count. Each Event is settled once."""
    assert h.agent.reporter is not None
    out: dict[str, int] = {}
    for (reason, result), n in h.agent.reporter.event_counts().items():
        if reason in reasons:
            out[result] = out.get(result, 0) + n
    return out


def faulted_events(h: Harness) -> int:
    """The API's Events about the GPUs that failed during the fault, on their pods."""
    return sum(
        len(api(h).events(f"reason={reason},regarding.name=g{g}"))
        for g in FAULT_GPUS
        for reason in ("GPUFatalXID", "GPUUnhealthy")
    )


def faulted_node_events(h: Harness) -> int:
    """The Node's GPUUnhealthy Events about those GPUs (the recorder sends them first:
    the more urgent)."""
    return sum(
        1
        for e in api(h).events("reason=GPUUnhealthy,regarding.kind=Node")
        if any(f"GPU {g} (" in e["note"] for g in FAULT_GPUS)
    )


def assert_each_settled_once(counts: dict[str, int]) -> None:
    """Phase 1's three Events were created; the fault's nine each settled once."""
    assert sum(counts.values()) == 3 + NEW_EVENTS, counts
    assert counts.get("created", 0) >= 3, counts


# -- the API server -------------------------------------------------------------------


async def test_kube_writes_api_down(record_fault: RecordFault) -> None:
    async with simulated_exporter(six_gpus("sim-down")) as h:
        kube = h.env.kube_api
        assert kube is not None and h.env.paths.kubeconfig is not None
        config = yaml.safe_load(h.env.paths.kubeconfig.read_text())
        port = int(config["clusters"][0]["cluster"]["server"].rsplit(":", 1)[1])
        phases = await run_phases(
            h,
            kube.stop_in_thread,
            lambda: kube.start_in_thread("127.0.0.1", port),
            shown=lambda c: c.get("dropped", 0) >= 1,  # the first refused try's backoff
        )
        counts = settled(h)
    phases.assert_cycles_not_held()
    # each of the nine Events of the outage is settled once: dropped (not queued while
    # backing off), failed (its tries spent) or created by the retry after the outage
    assert_each_settled_once(counts)
    # created: phase 1's three, and at most the one Event whose write was being retried
    # when the server came back (its tries not spent), created once, not also dropped
    retried = faulted_events(h) + faulted_node_events(h)
    assert retried <= 1 and counts.get("created", 0) == 3 + retried
    assert counts.get("dropped", 0) >= NEW_EVENTS - 1, counts

    record_fault(
        "kube-writes-api-down",
        expected="With the API server down, sample cycles run as before; the Events due "
        "are retried with backoff (1, 2, 4 s, 3 tries) and those that come meanwhile are "
        "dropped and counted, never queued; once the server is back, new Events get "
        "through.",
        figure=f"{phases.cycles()}; the outage's {NEW_EVENTS} Events: "
        f"{counts.get('dropped', 0)} dropped, {counts.get('failed', 0)} failed, "
        f"{retried} created by the retry after it, 0 queued; "
        f"the first new Event {phases.recovered_s:.1f} s after the server came back",
    )


async def test_kube_writes_403(record_fault: RecordFault) -> None:
    async with simulated_exporter(six_gpus("sim-403")) as h:
        writes = api(h)
        phases = await run_phases(
            h, lambda: writes.set_write_fault("forbidden"), lambda: writes.set_write_fault(None)
        )
        counts = settled(h)
        refused = sum(1 for w in writes.write_log if w.status == 403)
    phases.assert_cycles_not_held()
    assert faulted_events(h) == 0
    assert_each_settled_once(counts)
    assert counts.get("failed", 0) == NEW_EVENTS, counts
    assert refused == NEW_EVENTS  # refused is final: tried once each, no retry storm

    record_fault(
        "kube-writes-403",
        expected="Event writes the API server refuses (403: RBAC missing) are counted "
        "failed, each tried once, never retried; sampling goes on; once allowed, new "
        "Events get through.",
        figure=f"{phases.cycles()}; {counts.get('failed', 0)} of {NEW_EVENTS} Events "
        f"failed after {refused} requests; the first new Event "
        f"{phases.recovered_s:.1f} s after the fault cleared",
    )


@pytest.mark.slow  # a slow API server, waited out
async def test_kube_writes_slow(record_fault: RecordFault) -> None:
    """Three writes answered 1 s late (the API server under load)."""
    delay_s = 1.0
    async with simulated_exporter(six_gpus("sim-slow")) as h:
        writes = api(h)
        phases = await run_phases(
            h,
            lambda: writes.set_write_fault("slow", delay_s=delay_s, times=3),
            lambda: writes.set_write_fault(None),
        )
        counts = settled(h)
    phases.assert_cycles_not_held()
    assert faulted_events(h) == 2 * len(FAULT_GPUS)  # slow, but all of them created
    assert_each_settled_once(counts)
    assert counts.get("created", 0) == 3 + NEW_EVENTS, counts

    record_fault(
        "kube-writes-slow",
        expected="Event writes answered late (within the 5 s deadline) are sent one "
        "after another by the writer thread while sample cycles go on at their pace; "
        "none is lost.",
        figure=f"{phases.cycles()}; writes answered {delay_s:.0f} s late: "
        f"{counts.get('created', 0)} Events created, 0 dropped or failed",
    )


@pytest.mark.slow  # a write hangs until its 5 s deadline
async def test_kube_writes_hang(record_fault: RecordFault) -> None:
    """The first write of the fault is never answered: the writer gives up at its
    deadline; cycles run meanwhile. At the end, a write hanging at shutdown is cut."""
    async with simulated_exporter(six_gpus("sim-hang")) as h:
        writes = api(h)
        held_during: list[bool] = []

        def held() -> bool:
            return any(w.status is None for w in writes.write_log)

        try:
            phases = await run_phases(
                h,
                lambda: writes.set_write_fault("hang", times=1),
                lambda: None,  # one write hangs; the writer gives up on it at the deadline
                during=lambda: held_during.append(held()),
            )
            counts = settled(h)
            # shut down with a write hanging: the request in flight is cut
            writes.set_write_fault("hang")
            leaks = len(writes.events("reason=GPUIsolationLeak"))
            await step(h)  # the next leak: a new Event, whose create hangs
            await until(
                lambda: sum(1 for w in writes.write_log if w.status is None) == 2,
                "the create to hang",
            )
            reporter = h.agent.reporter
            assert reporter is not None
            began = time.monotonic()
            stopped = await asyncio.to_thread(reporter.stop)
            stop_s = time.monotonic() - began
        finally:
            writes.set_write_fault(None)  # answer what the stand-in still holds
    phases.assert_cycles_not_held()
    assert any(held_during), "no faulted cycle ran while a write was held"
    assert_each_settled_once(counts)
    assert counts.get("dropped", 0) >= 1, counts
    assert stopped and stop_s < 2.0
    assert len(api(h).events("reason=GPUIsolationLeak")) >= leaks

    record_fault(
        "kube-writes-hang",
        expected="An Event write the API server never answers is given up at its 5 s "
        "deadline and retried after a backoff; sample cycles run meanwhile (a cycle "
        "that waited would take 5 s); Events due during the hang are dropped and "
        "counted; later ones get through; shutdown cuts a request in flight.",
        figure=f"{phases.cycles()} (write deadline {REQUEST_DEADLINE_S:.0f} s); "
        f"{sum(held_during)} of {len(held_during)} faulted cycles ran while the write "
        f"was held; {counts.get('dropped', 0)} Events dropped; the first new Event "
        f"{phases.recovered_s:.1f} s after the writer gave up on it; stop with a write "
        f"hanging {stop_s * 1000:.0f} ms",
    )


# -- the condition and the taints ----------------------------------------------------


async def test_kube_writes_condition_nvml_down(record_fault: RecordFault) -> None:
    """NVML down (the driver not loaded) at start, under a GPUUnhealthy condition a
    previous run left True: the exporter cannot tell, so it leaves the condition as it
    is; once NVML is up and the GPUs healthy, it writes False."""
    scenario = recovering_gpu("sim-blind", 1000, 2000)
    scenario["nvml_init_error"] = "DRIVER_NOT_LOADED"
    async with simulated_exporter(scenario, argv=["--node-condition"]) as h:
        node = h.env.node.scenario.node_name
        before = [
            *node_dict(node)["status"]["conditions"],
            {
                "type": "GPUUnhealthy",
                "status": "True",
                "reason": "GPULost",
                "message": "1 of 2 GPUs unhealthy: GPU 0 (GPU-before-restart): gpu_lost",
                "lastHeartbeatTime": "2026-01-01T00:00:00Z",
                "lastTransitionTime": "2026-01-01T00:00:00Z",
            },
        ]
        api(h).set_node(node_dict(node, before))
        blind = 0
        for _ in range(6):
            latest = await step(h)
            blind += not latest.node.nvml.ok
        await quiet(h)
        kept = condition(h)
        patches_blind = status_patches(h)
        h.env.node.scenario.nvml_init_error = None  # the driver loads
        driver_loaded = time.monotonic()
        while status_of(h) != ("False", "GPUsHealthy"):
            if time.monotonic() - driver_loaded > RECOVERY_POLL_S:
                raise AssertionError(f"condition still {status_of(h)} with NVML up")
            await step(h)
            await asyncio.sleep(0.1)
        told_s = time.monotonic() - driver_loaded
    assert blind == 6
    assert patches_blind == 0
    assert kept == before[-1]  # not flipped, not even a heartbeat
    assert status_patches(h) == 1

    record_fault(
        "kube-writes-condition-nvml-down",
        expected="While NVML is down the GPUUnhealthy node condition is left as it is "
        "(unknown is not healthy): no PATCH, no heartbeat; once NVML answers, the "
        "condition says what the GPUs are.",
        figure=f"{blind} cycles with NVML down: {patches_blind} node status PATCHes, "
        f"condition left True; written False {told_s:.1f} s after the driver loaded "
        "(NVML's init backoff)",
    )


async def test_kube_writes_no_device_taint_api(
    record_fault: RecordFault, caplog: pytest.LogCaptureFixture
) -> None:
    """A cluster that serves no DeviceTaintRule API (before 1.33, or the feature gate
    off): asked once, counted failed, logged once; Events and sampling carry on."""
    caplog.set_level(logging.WARNING, logger="exporter.reporting.writer")
    async with simulated_exporter(
        dra_with_a_reset(15, 1000), argv=["--dra-device-taints"], first_cycle=False
    ) as h:
        api(h).set_device_taint_versions(())
        cycles = [await timed_step(h) for _ in range(6)]  # GPU 0 unhealthy from 15 s
        await until(lambda: len(api(h).events("reason=GPUUnhealthy")) == 2, "the Events")
        await quiet(h)
        await step(h)  # the counters reach the exposition
        scrape = await h.scrape()
        failed = scrape.get(
            "gpu_exporter_kube_writes_total", kind="device_taint_rule", result="failed"
        )
        rules = api(h).device_taint_rules()
        taint_writes = [w for w in api(h).write_log if "devicetaintrules" in w.path]
    logged = [r for r in caplog.records if "serves no DeviceTaintRule API" in r.getMessage()]
    assert failed == 1
    assert len(logged) == 1
    assert rules == [] and taint_writes == []
    assert max(cycles) < CYCLE_BOUND_S

    record_fault(
        "kube-writes-no-device-taint-api",
        expected="With --dra-device-taints on a cluster that serves no DeviceTaintRule "
        "API, the exporter asks discovery once (again after 10 minutes), counts it "
        "failed, logs it once, writes no rule, and carries on with Events and sampling.",
        figure=f"{len(cycles)} cycles (GPU unhealthy from the second), "
        f"{max(cycles) * 1000:.0f} ms max: device_taint_rule failed {failed:.0f}, "
        f"{len(logged)} log line, 0 rule writes; both GPUUnhealthy Events created",
    )
