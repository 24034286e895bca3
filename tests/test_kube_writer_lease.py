"""One writer per node: two real exporters on one simulated node, one API stand-in.

Both run the whole production path (tests/harness.py for the first; ``second_exporter``
below builds the second the same way on the same simulated node, kubelet socket and API
stand-in). Each cycles on its own phase, 3 s after the other, as two real exporters
started apart would; only the holder of the node's coordination.k8s.io/v1 Lease writes
(exporter/reporting/lease.py), the other counts its writes as shadowed.

The writer thread runs on the real monotonic clock, so the Lease does too: a test of
an expired Lease gives it a duration of a few seconds and waits for it with a bounded
poll.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest

from exporter.agent import build_agent
from exporter.config import parse_config
from exporter.exposition.liveness import Liveness
from exporter.exposition.server import MetricsCache, bound_port, build_app, start_server
from exporter.reporting.lease import (
    MAX_OTHER_DURATION_S,
    decide,
    lease_body,
    parse_lease,
)
from exporter.reporting.writer import KubeReporter
from exporter.sim.environment import SimEnvironment
from exporter.sim.kube_writes import LeaseFault
from tests.harness import Harness, simulated_exporter
from tests.kube_writes import leave_condition
from tests.test_kube_condition_taints import dra_with_a_reset
from tests.test_kube_events import api, exclusive, quiet, until

NODE = "sim-two"
NAMESPACE = "gpu-exporter"
LEASE_ARGV = ("--kube-writer-lease-namespace", NAMESPACE)
LEASE = f"gpu-occupancy-exporter-{NODE}"  # the node's writer Lease (docs/kubernetes-events.md)
PHASE_S = 3.0  # the second exporter's cycles come this long after the first's


def two_gpus(node: str = NODE) -> dict[str, object]:
    """Pods a and b on GPUs 0 and 1; a fatal XID on GPU 0 at 15 s and on GPU 1 at 45 s:
    GPUFatalXID and GPUUnhealthy on each pod, GPUUnhealthy on the Node, the node
    condition True."""
    return {
        "node_name": node,
        "gpus": [{}, {}],
        "pods": [exclusive("a", 0), exclusive("b", 1)],
        "timeline": [
            {"at": 15, "xid": {"gpu": 0, "code": 48}},
            {"at": 45, "xid": {"gpu": 1, "code": 79}},
        ],
    }


@asynccontextmanager
async def second_exporter(
    h: Harness, argv: Sequence[str] = (), *, writer_on_simulated_clock: bool = False
) -> AsyncIterator[Harness]:
    """Another real exporter on ``h``'s simulated node and API stand-in (flags as
    tests/harness.py gives the first; ``writer_on_simulated_clock`` as there)."""
    paths = h.env.paths
    config = parse_config(
        [
            "--listen",
            "127.0.0.1:0",
            "--proc-root",
            str(paths.proc_root),
            "--kmsg-path",
            str(paths.kmsg),
            "--pod-resources-socket",
            str(paths.pod_resources_socket),
            "--node-name",
            paths.node_name,
            "--cgroup-root",
            str(paths.cgroup_root or "off"),
            *(["--kubeconfig", str(paths.kubeconfig)] if paths.kubeconfig else []),
            "--pod-resources-interval",
            "600",
            *argv,
        ],
        env={},
    )
    cache = MetricsCache()
    liveness = Liveness(cache, interval_s=config.interval_s, cycles=config.liveness_cycles)
    runner = await start_server(
        build_app(cache, paths.node_name, liveness=liveness), "127.0.0.1", 0
    )
    agent = build_agent(
        config,
        cache,
        wall_clock=h.env.node.wall_time,
        source_monotonic=h.env.node.now,
        monotonic=h.env.node.now if writer_on_simulated_clock else time.monotonic,
    )
    try:
        for source in agent.sources:
            source.start()
        if agent.reporter is not None:
            agent.reporter.start()
        await asyncio.gather(*(s.prime(10.0) for s in agent.sources))
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{bound_port(runner)}"
            yield Harness(h.env, agent, url, h.clock, session)
    finally:
        await runner.cleanup()
        await agent.close()


def lease_fault(mode: LeaseFault) -> Callable[[SimEnvironment], None]:
    """For ``simulated_exporter(before_start=...)``: the Lease API answers ``mode`` from
    the exporter's first request on."""

    def set_fault(env: SimEnvironment) -> None:
        assert env.kube_api is not None
        env.kube_api.writes.set_lease_fault(mode)

    return set_fault


def reporter(h: Harness) -> KubeReporter:
    assert h.agent.reporter is not None
    return h.agent.reporter


async def cycle(h: Harness) -> None:
    """One cycle of ``h`` at the clock's time, the kubelet's answer refreshed first."""
    await asyncio.to_thread(h.env.sync)
    await h.refresh_pod_resources()
    await h.cycle()


async def run_until(t_end: float, first: Harness, second: Harness | None = None) -> None:
    """Both exporters cycle every 10 s of simulated time, ``second`` PHASE_S after
    ``first``."""
    while first.clock() < t_end:
        first.clock.advance(PHASE_S)
        if second is not None:
            await cycle(second)
        first.clock.advance(10 - PHASE_S)
        await cycle(first)


def sent(h: Harness) -> int:
    """Events created and writes that went through, by this exporter."""
    events = sum(n for (_, r), n in reporter(h).event_counts().items() if r == "created")
    writes = sum(n for (_, r), n in reporter(h).write_counts().items() if r == "ok")
    return events + writes


def status_patches(h: Harness) -> int:
    return sum(1 for w in api(h).write_log if w.method == "PATCH" and w.path.endswith("/status"))


def lease(h: Harness, namespace: str = NAMESPACE) -> dict[str, Any]:
    found = api(h).lease(namespace, LEASE)
    assert found is not None, "no Lease for the node"
    return found


def me(h: Harness) -> str:
    """The exporter's holder identity."""
    lease = reporter(h)._lease
    assert lease is not None
    return lease.me


def shadowed(h: Harness, kind: str) -> int:
    return sum(n for (k, _), n in reporter(h).shadow_counts().items() if k == kind)


# A standby holds its writes until it has seen the holder renew (a renewal period, 10 s
# of real time for a writer on it), then counts them as shadowed.
SETTLE_S = 15.0


async def shadowing(h: Harness) -> None:
    """Until ``h``, a standby, has seen the holder renew: it shadows from then on."""
    lease = reporter(h)._lease
    assert lease is not None
    await until(lambda: lease.mode(lease._clock()) == "shadow", "a renewal seen", SETTLE_S)


async def settle(*hs: Harness) -> None:
    for h in hs:
        await until(reporter(h).settled, "the writer to send what it has", SETTLE_S)
        await quiet(h)


WRITES_ARGV = ("--node-condition",)  # and the defaults: Events on, the Lease on


async def one_exporter_alone() -> tuple[int, int]:
    """What one exporter writes on ``two_gpus`` over 70 s: (Events, status patches)."""
    async with simulated_exporter(two_gpus(), argv=WRITES_ARGV) as h:
        await run_until(70, h)
        await settle(h)
        return len(api(h).events()), status_patches(h)


async def two_exporters() -> tuple[int, int, Harness, Harness]:
    """The same with a second exporter on the node, started after the first's first
    cycle: (Events, status patches, the two harnesses after they stopped)."""
    async with simulated_exporter(two_gpus(), argv=WRITES_ARGV) as first:
        # the first's first turn: the Lease, then the condition False (a healthy node)
        await until(lambda: status_patches(first) >= 1, "the first's first write")
        async with second_exporter(first, WRITES_ARGV) as second:
            await run_until(70, first, second)
            await settle(first, second)
            return len(api(first).events()), status_patches(first), first, second


@pytest.mark.slow  # seconds of real time: the writer threads and the Lease run on it
async def test_two_exporters_on_one_node_write_what_one_alone_writes() -> None:
    alone_events, alone_patches = await one_exporter_alone()
    events, patches, first, second = await two_exporters()
    assert alone_events >= 5  # GPUFatalXID, GPUUnhealthy x2 pods, GPUUnhealthy Node
    assert (events, patches) == (alone_events, alone_patches)
    assert sent(first) > 0 and sent(second) == 0  # the standby wrote nothing
    assert shadowed(second, "event") == alone_events  # it computed and counted them
    assert shadowed(second, "node_condition") >= 1


async def test_the_standby_serves_leader_0_and_the_holder_1() -> None:
    argv = [*LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv) as first:
        await until(lambda: reporter(first).lease_state() == "held", "the first to hold")
        async with second_exporter(first, argv) as second:
            # its writer thread's first look at the Lease runs on real time
            await until(lambda: reporter(second).lease_state() == "standby", "the second")
            await run_until(20, first, second)
            one, other = await first.scrape(), await second.scrape()
            held = lease(first)
    assert held["spec"]["holderIdentity"] == me(first)
    assert held["spec"]["leaseDurationSeconds"] == 30
    assert one.get("gpu_exporter_kube_writer_leader") == 1
    assert other.get("gpu_exporter_kube_writer_leader") == 0
    assert one.get("gpu_exporter_kube_writer_lease_state", state="held") == 1
    assert other.get("gpu_exporter_kube_writer_lease_state", state="standby") == 1
    assert other.get("gpu_exporter_kube_writer_lease_state", state="held") == 0


@pytest.mark.slow  # seconds of real time: the writer threads and the Lease run on it
async def test_a_clean_stop_hands_the_lease_over_at_once() -> None:
    """The holder stops (a rolling update): it empties the Lease's holder, and the
    other exporter takes it at its next try (every 2 s), not a duration (30 s) later;
    the next fault's Events are then written by it."""
    argv = ["--node-condition", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv) as first:
        await until(lambda: reporter(first).lease_state() == "held", "the first to hold")
        async with second_exporter(first, argv) as second:
            await run_until(30, first, second)  # GPU 0's fault, written by the first
            await settle(first, second)
            before = len(api(first).events())
            assert sent(second) == 0 and before > 0
            assert reporter(first).stop()  # a clean shutdown of the holder
            assert lease(first)["spec"]["holderIdentity"] == ""
            began = time.monotonic()
            await until(lambda: reporter(second).lease_state() == "held", "the takeover")
            took_s = time.monotonic() - began
            while second.clock() < 70:  # GPU 1's fault at 45 s: only the second cycles
                second.clock.advance(10)
                await cycle(second)
            await settle(second)
            after = api(second).events()
            held = lease(second)
        released = lease(second)  # the second stopped cleanly too
    assert took_s < 5.0  # its next try, well inside the 30 s duration
    assert held["spec"]["holderIdentity"] == me(second)
    assert held["spec"]["leaseTransitions"] == 1
    assert released["spec"]["holderIdentity"] == ""
    assert any("GPU 1" in e["note"] for e in after if e["reason"] == "GPUUnhealthy")
    assert sent(second) > 0


@pytest.mark.slow  # seconds of real time: the writer threads and the Lease run on it
async def test_a_killed_holder_is_taken_over_once_its_lease_expires() -> None:
    """The holder dies without releasing (its release refused, as a killed process
    sends none): the other takes the Lease only after the duration has passed on its
    own clock since it last saw the record change, then writes."""
    # 6 s: renewed every 2 s, so the other's last sight of a renewal is at most ~2 s
    # before the stop and the takeover comes ~4 s after it; a clean handover (the next
    # try, every 2 s) would come sooner
    argv = ["--node-condition", "--kube-writer-lease-duration", "6", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv) as first:
        await until(lambda: reporter(first).lease_state() == "held", "the first to hold")
        async with second_exporter(first, argv) as second:
            await run_until(20, first, second)
            assert reporter(second).lease_state() == "standby"
            api(first).set_lease_fault("error")  # the release gets a 500
            assert reporter(first).stop()
            api(first).set_lease_fault(None)
            holder = lease(first)["spec"]["holderIdentity"]
            assert holder == me(first)
            began = time.monotonic()
            await until(lambda: reporter(second).lease_state() == "held", "the takeover", 15.0)
            took_s = time.monotonic() - began
            while second.clock() < 70:
                second.clock.advance(10)
                await cycle(second)
            await settle(second)
    assert 2.0 < took_s < 6.0 + 2.0 + 2.0  # after expiry, not before; within a try of it
    assert sent(second) > 0


@pytest.mark.slow  # seconds of real time: the writer threads and the Lease run on it
async def test_a_conflict_on_renewal_makes_this_exporter_a_standby() -> None:
    """Another exporter wrote the Lease (it took it over): our next renewal's PUT
    carries a stale resourceVersion, the API answers 409, and we stop writing."""
    # renewed every 2 s; the other's record expires for us 6 s after we read it
    argv = ["--node-condition", "--kube-writer-lease-duration", "6", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv) as h:
        await until(lambda: reporter(h).lease_state() == "held", "the exporter to hold")
        taken = lease(h)
        taken["spec"]["holderIdentity"] = "someone-else_0"
        api(h).set_lease(taken)  # a new resourceVersion
        await until(lambda: reporter(h).lease_state() == "standby", "the 409 on renewal", 5.0)
        conflicts = [w for w in api(h).lease_log if w.method == "PUT" and w.status == 409]
        assert conflicts
        assert not reporter(h).leading()
        h.clock.advance(15)  # GPU 0's fault: counted as shadowed, not written
        await cycle(h)
        await until(lambda: shadowed(h, "event") >= 3, "the fault's Events shadowed")
        await settle(h)
        assert api(h).events() == []
        assert lease(h)["spec"]["holderIdentity"] == "someone-else_0"


async def test_a_refused_lease_api_falls_back_to_writing() -> None:
    """403 on the Lease (the chart's RBAC for leases missing): the exporter writes as
    it did before the lease, says so in its state, and Events still get through."""
    async with simulated_exporter(
        two_gpus(), argv=[*LEASE_ARGV], first_cycle=False, before_start=lease_fault("forbidden")
    ) as h:
        await run_until(30, h)
        await settle(h)
        scrape = await h.scrape()
    assert reporter(h).lease_state() == "refused"
    assert scrape.get("gpu_exporter_kube_writer_leader") == 1
    assert scrape.get("gpu_exporter_kube_writer_lease_state", state="refused") == 1
    assert len(api(h).events()) > 0
    assert api(h).leases() == []


async def test_lease_duration_0_writes_without_a_lease() -> None:
    async with simulated_exporter(two_gpus(), argv=["--kube-writer-lease-duration", "0"]) as h:
        await run_until(30, h)
        await settle(h)
        scrape = await h.scrape()
    assert reporter(h).lease_state() is None
    assert api(h).lease_log == []
    assert "gpu_exporter_kube_writer_leader" not in scrape.names()
    assert len(api(h).events()) > 0


@pytest.mark.slow  # two real exporters
async def test_two_exporters_make_and_remove_a_device_taint_rule_once() -> None:
    """A DRA GPU asks for a reset at 15 s and is reset at 35 s: one create and one
    delete of its DeviceTaintRule reach the API, from the holder; the standby counts
    its own as shadowed."""
    argv = ["--dra-device-taints"]
    async with simulated_exporter(dra_with_a_reset(), argv=argv) as first:
        await until(lambda: reporter(first).lease_state() == "held", "the first to hold")
        async with second_exporter(first, argv) as second:
            await shadowing(second)  # else its writes are held, and the two coalesce
            await run_until(30, first, second)
            await until(lambda: len(api(first).device_taint_rules()) == 1, "the rule")
            await run_until(60, first, second)
            await until(lambda: api(first).device_taint_rules() == [], "the rule removed")
            await settle(first, second)
            writes = [
                (w.method, w.status) for w in api(first).write_log if "devicetaintrules" in w.path
            ]
    assert writes == [("POST", 201), ("DELETE", 200)]
    assert reporter(second).write_counts().get(("device_taint_rule", "ok"), 0) == 0
    assert shadowed(second, "device_taint_rule") == 2  # its create and its delete


@pytest.mark.slow  # two real exporters
async def test_a_shadow_exporter_leaves_the_lease_to_the_one_that_writes() -> None:
    """A release in shadow mode beside one that writes (a fleet-wide shadow rollout left
    running): the shadow exporter does not compete for the Lease, so the writing one
    sends every Event and condition it would send alone (an adversarial review: the shadow
    held the Lease and nothing reached the API)."""
    alone_events, alone_patches = await one_exporter_alone()
    shadow_argv = ["--kube-writes", "shadow", *WRITES_ARGV]
    async with (
        simulated_exporter(two_gpus(), argv=shadow_argv) as first,
        second_exporter(first, WRITES_ARGV) as second,
    ):
        await until(lambda: reporter(second).lease_state() == "held", "the writer")
        await run_until(70, first, second)
        await settle(first, second)
        events, patches = len(api(first).events()), status_patches(first)
        first_state = reporter(first).lease_state()
    assert first_state is None  # no Lease asked for: it writes nothing
    assert (events, patches) == (alone_events, alone_patches)
    assert sent(first) == 0 and shadowed(first, "event") == alone_events


def _condition(h: Harness) -> str | None:
    node = api(h).node(NODE) or {}
    for c in node.get("status", {}).get("conditions", []):
        if c.get("type") == "GPUUnhealthy":
            return f"{c['status']}:{c['reason']}"
    return None


@pytest.mark.slow  # the writer thread on the simulated clock, turns in real time
async def test_a_lease_regained_after_an_outage_writes_what_was_missed() -> None:
    """The only exporter on a DRA node holds the Lease; GPU 0 is lost at 30 s, the Lease
    API answers 500 from 50 s to 90 s, GPU 0 is back at 70 s. Once the Lease is held
    again, the condition goes False and the taint is deleted (an adversarial review: the
    Node stayed True:GPULost and the rule on the healthy GPU for good, its own True
    read back as an earlier run's and held an hour)."""
    scenario: dict[str, object] = {
        "node_name": NODE,
        "allocator": "dra",
        "gpus": [{}, {}],
        "pods": [exclusive("a", 0), exclusive("b", 1)],
        "timeline": [{"at": 30, "lose": 0}, {"at": 70, "restore": 0}],
    }
    argv = ["--node-condition", "--dra-device-taints", *LEASE_ARGV]
    async with simulated_exporter(
        scenario, argv=argv, writer_on_simulated_clock=True, first_cycle=False
    ) as h:
        leave_condition(h, EARLIER_FALSE)
        seen: set[str | None] = set()
        transitions: dict[str, str] = {}
        while h.clock() < 200:
            if h.clock() == 50:
                api(h).set_lease_fault("error")
            if h.clock() == 90:
                api(h).set_lease_fault(None)
            h.clock.advance(5)
            await cycle(h)
            await quiet(h)
            seen.add(_condition(h))
            transitions.setdefault(str(_condition(h)), _transition(h))
        final, rules = _condition(h), api(h).device_taint_rules()
    assert "True:GPULost" in seen  # the true side: the lost GPU was told
    assert final == "False:GPUsHealthy"
    assert rules == []
    # The earlier run's False kept its time until the loss; the False after the outage
    # is a new transition, after the True's (an adversarial review: it went back to 2020).
    assert transitions["False:GPUsHealthy"] == EARLIER_FALSE["lastTransitionTime"]
    assert _transition(h) > transitions["True:GPULost"] > EARLIER_FALSE["lastTransitionTime"]


EARLIER_FALSE = {
    "type": "GPUUnhealthy",
    "status": "False",
    "reason": "GPUsHealthy",
    "message": "",
    "lastHeartbeatTime": "2020-01-01T00:00:00Z",
    "lastTransitionTime": "2020-01-01T00:00:00Z",
}


def _transition(h: Harness) -> str:
    node = api(h).node(NODE) or {}
    (condition,) = [c for c in node["status"]["conditions"] if c["type"] == "GPUUnhealthy"]
    return str(condition["lastTransitionTime"])


# -- writer Lease follow-ups: a Lease outage loses no Warning; no update without a
# resourceVersion; another holder's duration clamped; answers an adversary may give


def events_about_gpu(h: Harness, index: int) -> list[dict[str, Any]]:
    return [e for e in api(h).events() if f"GPU {index}" in e.get("note", "")]


async def outage(first: Harness, second: Harness | None, start: float, end: float) -> None:
    """Both cycle every 10 s of simulated time (the writers on it too) until 100 s; the
    Lease API answers 500 from ``start`` to ``end``."""
    while first.clock() < 100:
        if first.clock() == start:
            api(first).set_lease_fault("error")
        if first.clock() == end:
            api(first).set_lease_fault(None)
        first.clock.advance(PHASE_S)
        if second is not None:
            await cycle(second)
            await quiet(second)
        first.clock.advance(10 - PHASE_S)
        await cycle(first)
        await quiet(first)


@pytest.mark.slow  # the writer thread on the simulated clock, turns in real time
async def test_warnings_raised_during_a_lease_outage_are_sent_once_it_is_held_again() -> None:
    """The only exporter holds the Lease; its API answers 500 from 20 s to 80 s, so the
    holder's renew deadline (20 s after its last renewal) passes at ~40 s and its state
    is unknown; GPU 1's fatal XID comes at 45 s. Its Events wait and are sent once the
    Lease is held again, none counted as shadowed (an adversarial review: all were shadowed and
    never sent)."""
    argv = ["--node-condition", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv, writer_on_simulated_clock=True) as h:
        await until(lambda: reporter(h).lease_state() == "held", "the exporter to hold")
        await outage(h, None, 20, 80)
        await until(lambda: reporter(h).lease_state() == "held", "the Lease held again")
        await settle(h)
        gpu1 = events_about_gpu(h, 1)
    assert {e["reason"] for e in gpu1} >= {"GPUFatalXID", "GPUUnhealthy"}
    assert shadowed(h, "event") == 0


@pytest.mark.slow  # two exporters, writers on the simulated clock
async def test_two_exporters_through_a_lease_outage_send_each_warning_once() -> None:
    """Holder and standby through the same outage: each of GPU 1's Warnings reaches the
    API exactly once (the standby, past the holder's renew deadline, holds its writes
    too, and counts them as shadowed once it sees the holder renew)."""
    argv = ["--node-condition", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv, writer_on_simulated_clock=True) as first:
        await until(lambda: reporter(first).lease_state() == "held", "the first to hold")
        async with second_exporter(first, argv, writer_on_simulated_clock=True) as second:
            await until(lambda: reporter(second).lease_state() == "standby", "the second")
            await outage(first, second, 20, 80)
            await until(lambda: reporter(first).lease_state() == "held", "held again")
            await settle(first, second)
            gpu1 = events_about_gpu(first, 1)
    reasons = sorted(e["reason"] for e in gpu1)
    assert "GPUFatalXID" in reasons and "GPUUnhealthy" in reasons
    assert len(reasons) == len(set((e["reason"], about_key(e)) for e in gpu1))  # once each
    assert sent(second) == 0


def about_key(event: dict[str, Any]) -> tuple[str, str]:
    r = event["regarding"]
    return (r.get("kind", ""), r.get("name", ""))


def puts_without_a_version(h: Harness) -> list[object]:
    return [
        w.body
        for w in api(h).lease_log
        if w.method == "PUT"
        and not (isinstance(w.body, dict) and w.body.get("metadata", {}).get("resourceVersion"))
    ]


@pytest.mark.slow  # seconds of real time: the Lease renews every second
async def test_an_answer_without_a_resource_version_is_read_again_before_the_next_update() -> None:
    """The Lease's answers lose their resourceVersion (a mangling proxy): the holder
    never PUTs without one (an unconditional update overwrites whoever holds the Lease
    then): it reads the Lease again first, and keeps holding it (an adversarial review)."""
    argv = ["--kube-writer-lease-duration", "3", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv, first_cycle=False) as h:
        await until(lambda: reporter(h).lease_state() == "held", "the exporter to hold")
        api(h).set_lease_fault("no-version")
        began = len(api(h).lease_log)
        await until(lambda: len(api(h).lease_log) >= began + 6, "six Lease requests", 15.0)
        api(h).set_lease_fault(None)
        await asyncio.sleep(2.5)
        state, log_ = reporter(h).lease_state(), api(h).lease_log
    assert puts_without_a_version(h) == []
    assert [w.status for w in log_ if w.method == "PUT" and w.status not in (200, 201)] == []
    assert state == "held"


def anothers_lease_body() -> dict[str, Any]:
    """Another holder's Lease as the API serves it, for the duration tests to spoil."""
    return lease_body(
        "n",
        "ns",
        "other_1",
        1,
        acquire_time=None,
        renew_time=None,
        transitions=0,
        resource_version="7",
    )


@pytest.mark.parametrize("duration", ["30", 0, -5, None, 2.5, True])
def test_anothers_unusable_duration_counts_as_ours(duration: object) -> None:
    """A holder's leaseDurationSeconds that is no whole number of seconds > 0 neither
    hands the Lease over at once nor holds it for good: it reads as ours (30 s)."""
    body = anothers_lease_body()
    body["spec"]["leaseDurationSeconds"] = duration
    other = parse_lease(body, own_duration_s=30)
    assert decide(other, observed_at=100, me="me_1", now=129.9) == "wait"
    assert decide(other, observed_at=100, me="me_1", now=130) == "acquire"


def test_anothers_huge_duration_is_clamped() -> None:
    body = anothers_lease_body()
    body["spec"]["leaseDurationSeconds"] = 10**12
    other = parse_lease(body, own_duration_s=30)
    assert other.duration_s == MAX_OTHER_DURATION_S == 3600
    assert decide(other, observed_at=100, me="me_1", now=100 + 3599) == "wait"
    assert decide(other, observed_at=100, me="me_1", now=100 + 3600) == "acquire"


def test_anothers_transitions_out_of_range_still_make_a_valid_takeover() -> None:
    """A negative or int32-overflowing leaseTransitions must not make every takeover
    PUT invalid (422: leaseTransitions >= 0, int32)."""
    for bad in (-3, 2**31 - 1, 10**12):
        body = lease_body(
            "n",
            "ns",
            "",
            1,
            acquire_time=None,
            renew_time=None,
            transitions=0,
            resource_version="7",
        )
        body["spec"]["leaseTransitions"] = bad
        record = parse_lease(body)
        assert 0 <= record.transitions + 1 <= 2**31 - 1, bad


@pytest.mark.slow  # seconds of real time
async def test_a_lease_api_answering_409_to_everything_is_not_hammered() -> None:
    """409 Conflict on every Lease request (a flapping webhook, another client writing
    in a loop): one immediate re-read after a conflict, then the 2 s retry period, not
    a request every turn of the writer (20 a second)."""
    argv = ["--node-condition", "--kube-writer-lease-duration", "6", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv, first_cycle=False) as h:
        await until(lambda: reporter(h).lease_state() == "held", "the exporter to hold")
        api(h).set_lease_fault("conflict")
        began = len(api(h).lease_log)
        for _ in range(8):  # offers wake the writer, as cycles do
            h.clock.advance(0.5)
            await cycle(h)
            await asyncio.sleep(0.5)
        requests = len(api(h).lease_log) - began
        api(h).set_lease_fault(None)
        await until(lambda: reporter(h).lease_state() == "held", "held again", 10.0)
    assert requests <= 2 * (4 / 2 + 1) + 2, requests


@pytest.mark.slow  # seconds of real time: a hung request waits for its deadline
async def test_a_hanging_lease_api_stalls_neither_the_cycle_nor_the_writer() -> None:
    """The Lease API accepts and never answers: the sample cycle goes on at once (the
    writer thread makes the calls), each Lease request is cut at its deadline (5 s),
    and the holder keeps writing until its renew deadline."""
    argv = ["--node-condition", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv, first_cycle=False) as h:
        await until(lambda: reporter(h).lease_state() == "held", "the exporter to hold")
        api(h).set_lease_fault("hang")
        slowest = 0.0
        began = time.monotonic()
        while time.monotonic() - began < 7.0:
            t = time.monotonic()
            h.clock.advance(1)
            await cycle(h)
            slowest = max(slowest, time.monotonic() - t)
            await asyncio.sleep(0.2)
        held = reporter(h).leading()
        api(h).set_lease_fault(None)
        h.clock.advance(15)  # GPU 0's fatal XID: written
        await cycle(h)
        await until(lambda: len(api(h).events()) >= 3, "the fault's Events", 15.0)
    assert slowest < 1.0
    assert held  # within 20 s of its last renewal


@pytest.mark.slow  # three real exporters, seconds of real time
async def test_three_exporters_one_lease_one_writer_and_a_takeover_after_a_death() -> None:
    """Three exporters on one node: exactly one holds the Lease and writes; when it dies
    without releasing, exactly one of the two others takes over, after the duration."""
    argv = ["--node-condition", "--kube-writer-lease-duration", "6", *LEASE_ARGV]
    async with simulated_exporter(two_gpus(), argv=argv) as first:
        await until(lambda: reporter(first).lease_state() == "held", "the first to hold")
        async with (
            second_exporter(first, argv) as second,
            second_exporter(first, argv) as third,
        ):
            hs = (first, second, third)
            await until(
                lambda: [reporter(x).lease_state() for x in hs] == ["held", "standby", "standby"],
                "two standbys",
            )
            await run_until(30, first, second)
            await cycle(third)
            await settle(*hs)
            assert sent(second) == 0 and sent(third) == 0 and sent(first) > 0
            api(first).set_lease_fault("error")  # the dying holder's release gets a 500
            assert reporter(first).stop()
            api(first).set_lease_fault(None)
            began = time.monotonic()
            await until(
                lambda: "held" in (reporter(second).lease_state(), reporter(third).lease_state()),
                "a takeover",
                15.0,
            )
            took_s = time.monotonic() - began
            await asyncio.sleep(3.0)
            states = sorted(str(reporter(x).lease_state()) for x in (second, third))
            writers = [x for x in (second, third) if reporter(x).leading()]
    assert 2.0 < took_s < 6.0 + 2.0 + 2.0
    assert states == ["held", "standby"]
    assert len(writers) == 1


def dead_holder_and(mode: LeaseFault) -> Callable[[SimEnvironment], None]:
    """For ``before_start``: the Lease held by an exporter that died (a restarted pod's
    old identity, never renewed again), and the Lease API answering ``mode``."""

    def set_up(env: SimEnvironment) -> None:
        assert env.kube_api is not None
        stamp = "2026-01-01T00:00:00.000000Z"
        env.kube_api.writes.set_lease(
            lease_body(
                LEASE,
                NAMESPACE,
                "old-pod_deadbeef",
                30,
                acquire_time=stamp,
                renew_time=stamp,
                transitions=0,
                resource_version=None,
            )
        )
        env.kube_api.writes.set_lease_fault(mode)

    return set_up


@pytest.mark.slow  # the writer thread on the simulated clock, turns in real time
@pytest.mark.parametrize("mode", ["conflict", "no-version"])
async def test_a_dead_holder_and_a_lease_that_cannot_be_taken_lose_no_warning(
    mode: LeaseFault,
) -> None:
    """A dead exporter's identity in the Lease, and every Lease request answered 409, or
    every answer without a resourceVersion: the writes are held (never shadowed: no
    renewal was ever seen), then written once 150 s have shown no live writer
    (an adversarial review: shadowed and lost, or held for good, nothing logged)."""
    argv = ["--node-condition", *LEASE_ARGV]
    async with simulated_exporter(
        two_gpus(),
        argv=argv,
        writer_on_simulated_clock=True,
        first_cycle=False,
        before_start=dead_holder_and(mode),
    ) as h:
        while h.clock() < 200:
            h.clock.advance(10)
            await cycle(h)
            await quiet(h)
        await settle(h)
        events, state = len(api(h).events()), reporter(h).lease_state()
    assert state == "unreachable"
    assert shadowed(h, "event") == 0
    assert events >= 4  # both fatal XIDs' Warnings, on the pods and the Node
