"""Kubernetes Events through the real client: what ``kubectl`` would read back.

The real exporter runs in-process on a simulated node (tests/harness.py), its writer
thread sending through the real ``kubernetes`` client to the API stand-in, whose write
side (exporter/sim/kube_writes.py) validates every Event as kube-apiserver does and keeps
it. The tests read the Events back the way ``kubectl get events --field-selector`` and
``kubectl describe`` do, and check who hears what: each Event on the object
that was hit, none on a pod whose GPUs stayed healthy, a storm aggregated into one
Event with a count, the node's budget held, nothing written with ``--kube-events off``.

The writer is a thread: a test waits for what it sends with a bounded poll (``until``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from exporter.model import Analysis
from exporter.reporting.kube_client import KubeWriteClient, KubeWriteError
from exporter.reporting.recorder import NODE_BURST, NODE_WRITES_PER_MINUTE, SERIES_FLUSH_S
from exporter.reporting.writer import KubeReporter, ReportingOptions
from exporter.sim.kube_writes import KubeWrites
from exporter.sim.node import ManualClock
from tests.harness import Harness, simulated_exporter

CONTROLLER = "gpu-occupancy-exporter"
POLL_S = 5.0  # the longest a test waits for the writer thread to send something
EVENTS = "gpu_exporter_events_total"
Obj = tuple[str, str, str]  # (kind, namespace, name) of an Event's regarding object


async def until(predicate: Callable[[], bool], what: str, timeout_s: float = POLL_S) -> float:
    """Wait for the writer thread (a bounded poll); returns the seconds waited."""
    began = time.monotonic()
    while not predicate():
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        await asyncio.sleep(0.02)
    return time.monotonic() - began


async def until_equal(get: Callable[[], object], wanted: object, what: str) -> None:
    """``until`` for a value: on timeout, the assertion shows what there was instead."""
    try:
        await until(lambda: get() == wanted, what)
    except AssertionError:
        assert get() == wanted, f"waiting for {what}"


def api(h: Harness) -> KubeWrites:
    assert h.env.kube_api is not None
    return h.env.kube_api.writes


def about(event: dict[str, Any]) -> Obj:
    r = event["regarding"]
    return (r["kind"], r.get("namespace", ""), r["name"])


def regarding(h: Harness, reason: str) -> list[Obj]:
    """The objects the Events of ``reason`` are about, sorted."""
    return sorted(about(e) for e in api(h).events(f"reason={reason}"))


def node_obj(h: Harness) -> Obj:
    return ("Node", "", h.env.node.scenario.node_name)


def pod_uid(h: Harness, namespace: str, name: str) -> str:
    assert h.env.kube_api is not None
    for p in h.env.kube_api.pods():
        if (p["metadata"]["namespace"], p["metadata"]["name"]) == (namespace, name):
            return str(p["metadata"]["uid"]).lower()
    raise AssertionError(f"no pod {namespace}/{name} in the API")


def event_total(h: Harness, *results: str) -> int:
    """What the writer thread has counted so far, over every reason."""
    assert h.agent.reporter is not None
    return sum(n for (_, r), n in h.agent.reporter.event_counts().items() if r in results)


async def quiet(h: Harness, settle_s: float = 0.3) -> None:
    """Wait until the writer has stopped counting anything new for ``settle_s``, so that
    a test can assert what was *not* sent."""
    assert h.agent.reporter is not None
    reporter = h.agent.reporter
    last: dict[tuple[str, str], int] | None = None
    stable_since = time.monotonic()
    began = stable_since
    while True:
        now_counts = reporter.event_counts()
        if now_counts != last:
            last, stable_since = now_counts, time.monotonic()
        elif time.monotonic() - stable_since >= settle_s:
            return
        if time.monotonic() - began > POLL_S:
            raise AssertionError("the writer thread kept counting for 5 s")
        await asyncio.sleep(0.05)


async def step(h: Harness, seconds: float = 10.0) -> Analysis:
    """Move the clock, let the kubelet's PodResources answer for the pods the timeline
    added (as the agent's refresh task would), and run one cycle."""
    await h.advance(seconds, cycle=False)
    await asyncio.to_thread(h.env.sync)
    await h.refresh_pod_resources()
    await h.cycle()
    assert h.agent.latest is not None
    return h.agent.latest


def pod(
    name: str, devices: dict[str, list[str]], *, namespace: str = "ml", gpu: int | None = None
) -> dict[str, object]:
    """A scenario pod with one container; with ``gpu``, one process using it."""
    processes = [] if gpu is None else [{"gpu": gpu, "memory": "1GiB", "sm": 20}]
    return {
        "namespace": namespace,
        "name": name,
        "containers": [{"name": "main", "devices": devices, "processes": processes}],
    }


def exclusive(name: str, gpu: int) -> dict[str, object]:
    return pod(name, {"nvidia.com/gpu": [f"gpu{gpu}"]}, gpu=gpu)


def shared_gpu(pods: int, timeline: Iterable[dict[str, object]], node: str) -> dict[str, object]:
    """One GPU time-sliced among ``pods`` pods (replicas gpu0::0 ...)."""
    return {
        "node_name": node,
        "gpus": [{}],
        "pods": [pod(f"p{i}", {"nvidia.com/gpu.shared": [f"gpu0::{i}"]}) for i in range(pods)],
        "timeline": list(timeline),
    }


def xid_storm(count: int, start: float, span: float, code: int = 48) -> list[dict[str, object]]:
    return [{"at": start + span * i / count, "xid": {"gpu": 0, "code": code}} for i in range(count)]


# -- node-8gpu: every reason on the object it is about ------------------------------


async def test_node_8gpu_events_land_on_the_objects_that_were_hit() -> None:
    async with simulated_exporter("node-8gpu") as h:
        node = h.env.node.scenario.node_name
        unhealthy: set[str] = set()
        leaking: set[tuple[str, str]] = set()
        allocated: dict[tuple[str, str], set[str]] = {}
        while h.clock() < 170:
            latest = await step(h)
            unhealthy |= {g.uuid for g in latest.health if not g.healthy}
            leaking |= {
                (u.container.namespace, u.container.pod) for u in latest.attribution.unallocated_use
            }
            for a in latest.attribution.allocations:
                if a.device.uuid:
                    key = (a.container.namespace, a.container.pod)
                    allocated.setdefault(key, set()).add(a.device.uuid)
        uuid = {g.gpu: g.uuid for g in latest.health}
        shell = ("Pod", "debug", "leaky-shell")
        pretrain = ("Pod", "train", "llm-pretrain-0")
        wanted = {
            "GPUFatalXID": [shell],
            "GPULost": sorted([node_obj(h), shell]),
            "GPUUnhealthy": sorted([node_obj(h), node_obj(h), shell, pretrain]),
            "GPUIsolationLeak": [shell],
            # GPU 6: the fine-tune's SIGKILLed 12 GiB; GPU 1: pid 20077 killed at 120 s;
            # GPU 4: tiny-kernels' fork-orphaned 3 GiB
            "GPUOrphanedMemory": [node_obj(h)] * 3,
        }
        await until_equal(
            lambda: {r: regarding(h, r) for r in wanted}, wanted, "node-8gpu's Events"
        )
        await quiet(h)
        assert {r: regarding(h, r) for r in wanted} == wanted
        every = api(h).events()
        assert sorted({e["reason"] for e in every}) == sorted(wanted)

        # the fatal XID: on the pod holding GPU 7, by UID, the Node as related
        (fatal,) = api(h).events("reason=GPUFatalXID")
        assert fatal["regarding"]["uid"] == pod_uid(h, "debug", "leaky-shell")
        assert fatal["related"] == {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}
        assert fatal["metadata"]["namespace"] == "debug"
        assert "XID 79" in fatal["note"] and uuid[7] in fatal["note"]
        assert "class fatal" in fatal["note"] and "GPU 7" in fatal["note"]

        # the Node's own Events: UID = its name (as the kubelet's), in namespace default
        for e in api(h).events_regarding("Node", "", node):
            assert e["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node}
            assert e["metadata"]["namespace"] == "default"
            assert "related" not in e
        lost_node = api(h).events(f"reason=GPULost,regarding.kind=Node,regarding.name={node}")
        assert len(lost_node) == 1 and uuid[7] in lost_node[0]["note"]
        notes = sorted(e["note"] for e in api(h).events("reason=GPUUnhealthy,regarding.kind=Node"))
        assert any(uuid[0] in n and "recovery_action" in n for n in notes), notes
        assert any(uuid[7] in n and "fatal_xid" in n for n in notes), notes

        # every pod Event names its pod's UID and the Node
        for e in every:
            if e["regarding"]["kind"] == "Pod":
                _, ns, name = about(e)
                assert e["regarding"]["uid"] == pod_uid(h, ns, name)
                assert e["related"]["name"] == node
            assert e["type"] == "Warning"
            assert e["reportingController"] == CONTROLLER
            assert e["reportingInstance"] == node
            assert e["action"]
            assert "series" not in e  # each happened once

        (leak,) = api(h).events("reason=GPUIsolationLeak")
        assert uuid[6] in leak["note"] and "1.5 GiB" in leak["note"]
        orphans = {e["note"] for e in api(h).events("reason=GPUOrphanedMemory")}
        gpu6 = [n for n in orphans if uuid[6] in n]
        assert len(gpu6) == 1, orphans
        assert "12.0 GiB" in gpu6[0] and "dead_process" in gpu6[0]
        # the dead pid is named as listed, not as holding the memory: nothing holds it
        assert "listed for dead pid" in gpu6[0] and "held by" not in gpu6[0]

        # no Event about a pod whose GPUs all stayed healthy and that leaked nothing
        touched = {k for k, uuids in allocated.items() if uuids & unhealthy} | leaking
        assert touched == {("debug", "leaky-shell"), ("train", "llm-pretrain-0")}
        assert h.env.kube_api is not None
        healthy = {
            (p["metadata"]["namespace"], p["metadata"]["name"]) for p in h.env.kube_api.pods()
        } - touched
        assert len(healthy) >= 20  # batch-hog and hami-llm (added at 170) among them
        assert ("inference", "batch-hog") in healthy
        heard = {(ns, name) for kind, ns, name in map(about, every) if kind == "Pod"}
        assert not heard & healthy, f"Events about healthy pods: {sorted(heard & healthy)}"


async def test_a_gpu_that_recovers_gets_a_normal_gpu_healthy_event_on_the_node() -> None:
    scenario: dict[str, object] = {
        "node_name": "sim-recover",
        "gpus": [{}, {}],
        "pods": [exclusive("a", 0), exclusive("b", 1)],
        "timeline": [
            {"at": 15, "set": {"gpu": 0, "recovery_action": 1}},  # the driver asks for a reset
            {"at": 35, "set": {"gpu": 0, "recovery_action": 0}},  # done
        ],
    }
    async with simulated_exporter(scenario) as h:
        while h.clock() < 50:
            await step(h)
        node = node_obj(h)
        await until(lambda: regarding(h, "GPUHealthy") == [node], "GPUHealthy on the Node")
        await quiet(h)
        (healthy,) = api(h).events("reason=GPUHealthy")
        assert healthy["type"] == "Normal"
        assert "healthy again" in healthy["note"] and "GPU 0" in healthy["note"]
        assert regarding(h, "GPUUnhealthy") == sorted([node, ("Pod", "ml", "a")])
        assert api(h).events_regarding("Pod", "ml", "b") == []
        assert [e["reason"] for e in api(h).events_regarding("Pod", "ml", "a")] == [
            "GPUUnhealthy"
        ]  # the recovery is the Node's news


async def test_node_e2e_events_and_their_objects() -> None:
    async with simulated_exporter("tests/e2e/node-e2e.yaml") as h:
        while h.clock() < 60:
            latest = await step(h)
        uuid = {g.gpu: g.uuid for g in latest.health}
        node, shell = node_obj(h), ("Pod", "debug", "leaky-shell")
        wanted = {
            "GPUFatalXID": [shell],  # XID 79 on GPU 6 at 20 s
            "GPULost": sorted([node, shell]),  # lost at 21 s
            "GPUUnhealthy": sorted([node, shell]),
            "GPUIsolationLeak": [shell],  # its python3 on GPU 5
            # GPU 5: finetune's SIGKILLed 30 GiB; GPU 1: a stuck data worker; GPU 4: the
            # fork-orphaned 3 GiB
            "GPUOrphanedMemory": [node, node, node],
        }
        await until_equal(lambda: {r: regarding(h, r) for r in wanted}, wanted, "node-e2e's Events")
        await quiet(h)
        every = api(h).events()
        assert sorted({e["reason"] for e in every}) == sorted(wanted)
        pods = {(ns, name) for kind, ns, name in map(about, every) if kind == "Pod"}
        assert pods == {("debug", "leaky-shell")}  # nobody else's GPU was hit
        (leak,) = api(h).events("reason=GPUIsolationLeak")
        assert uuid[5] in leak["note"]
        (fatal,) = api(h).events("reason=GPUFatalXID")
        assert uuid[6] in fatal["note"] and "XID 79" in fatal["note"]
        kinds = sorted(
            k
            for e in api(h).events("reason=GPUOrphanedMemory")
            for k in ("dead_process", "stuck_process", "unattributed")
            if f"({k})" in e["note"]
        )
        assert kinds == ["dead_process", "stuck_process", "unattributed"]


# -- aggregation and the budget -------------------------------------------------------


async def test_an_xid_storm_is_one_event_per_pod_with_its_count() -> None:
    """250 fatal XIDs on one GPU between two cycles: one GPUFatalXID per pod of the GPU,
    counting 250, not 250 objects."""
    scenario = shared_gpu(2, xid_storm(250, start=11, span=8), "sim-storm")
    async with simulated_exporter(scenario) as h:
        await step(h)  # t=10: nothing yet
        await step(h)  # t=20: the storm
        pods = [("Pod", "ml", "p0"), ("Pod", "ml", "p1")]
        await until(lambda: regarding(h, "GPUFatalXID") == pods, "one GPUFatalXID per pod")
        await quiet(h)
        fatal = api(h).events("reason=GPUFatalXID")
        assert [e["series"]["count"] for e in fatal] == [250, 250]
        assert all("250 times" in e["note"] for e in fatal)
        creates = [w for w in api(h).write_log if w.method == "POST"]
        assert len([w for w in creates if w.body["reason"] == "GPUFatalXID"]) == 2


async def test_a_storm_across_cycles_is_one_event_whose_series_is_flushed() -> None:
    """The storm spread over three cycles: the first occurrences create the Event, the
    rest wait in its series and are sent as one PATCH per pod once ``SERIES_FLUSH_S``
    has passed. A writer of our own with a hand-moved clock (the agent's reporter runs
    on the monotonic clock, and the flush is 30 s) is handed each cycle's analysis, as
    the agent hands it over."""
    storm = [*xid_storm(100, 11, 8), *xid_storm(100, 21, 8), *xid_storm(50, 31, 8)]
    scenario = shared_gpu(2, storm, "sim-storm")
    async with simulated_exporter(scenario, argv=["--kube-events", "off"]) as h:
        assert h.agent.reporter is None and h.env.paths.kubeconfig is not None
        kubeconfig = str(h.env.paths.kubeconfig)
        clock = ManualClock()
        reporter = KubeReporter(
            ReportingOptions(node_name="sim-storm"),
            lambda: KubeWriteClient(kubeconfig),
            clock=clock,
            error_type=KubeWriteError,
        )
        reporter.start()
        try:
            reporter.offer(await step(h))  # t=10
            reporter.offer(await step(h))  # t=20: 100 XIDs
            await until(lambda: len(api(h).events("reason=GPUFatalXID")) == 2, "the storm's Events")
            assert [e["series"]["count"] for e in api(h).events("reason=GPUFatalXID")] == [
                100,
                100,
            ]
            reporter.offer(await step(h))  # t=30: 100 more
            reporter.offer(await step(h))  # t=40: 50 more
            await asyncio.sleep(0.5)  # the offers woke the writer: nothing is due before the flush
            assert [e["series"]["count"] for e in api(h).events("reason=GPUFatalXID")] == [
                100,
                100,
            ]
            clock.advance(SERIES_FLUSH_S)
            await until(
                lambda: (
                    [e["series"]["count"] for e in api(h).events("reason=GPUFatalXID")]
                    == [250, 250]
                ),
                "the series flushed with count 250",
            )
        finally:
            assert reporter.stop()
        fatal = api(h).events("reason=GPUFatalXID")
        assert sorted(map(about, fatal)) == [("Pod", "ml", "p0"), ("Pod", "ml", "p1")]
        writes = [
            (w.method, w.path.rsplit("/", 1)[-1])
            for w in api(h).write_log
            if w.body and (w.body.get("reason") == "GPUFatalXID" or w.method == "PATCH")
        ]
        names = sorted(e["metadata"]["name"] for e in fatal)
        assert sorted(writes) == sorted(
            [("POST", "events"), ("POST", "events")] + [("PATCH", n) for n in names]
        )


async def test_the_node_budget_holds_when_one_cycle_brings_more_than_the_burst() -> None:
    """A fatal XID on a GPU shared by 40 pods: 40 GPUFatalXID + 40 GPUUnhealthy on the
    pods + 1 on the Node in one cycle. NODE_BURST are created at once; the rest wait for
    the budget's refill (one token per 60 / NODE_WRITES_PER_MINUTE s, for up to
    CREATE_WAIT_S, then rate_limited: tests/test_event_recorder.py), never sent in a
    burst."""
    pods = 40
    scenario = shared_gpu(pods, [{"at": 5, "xid": {"gpu": 0, "code": 48}}], "sim-crowd")
    async with simulated_exporter(scenario) as h:
        await step(h)
        intents = 2 * pods + 1
        await until(
            lambda: event_total(h, "created") >= NODE_BURST,
            "the burst of new Events created",
        )
        waited = 2.0
        await asyncio.sleep(waited)
        refill = int(waited * NODE_WRITES_PER_MINUTE / 60) + 1
        reporter = h.agent.reporter
        assert reporter is not None
        created = event_total(h, "created")
        assert NODE_BURST <= created <= NODE_BURST + refill
        assert reporter.recorder.pending() == intents - created  # waiting, not sent
        posts = [w for w in api(h).write_log if w.method == "POST"]
        assert len(posts) == len(api(h).events()) == created
        await step(h)  # the counters reach the exposition at the next cycle
        scrape = await h.scrape()
        assert sum(v for _, v in scrape.find(EVENTS, result="created")) >= NODE_BURST


async def test_kube_events_off_writes_nothing() -> None:
    scenario: dict[str, object] = {
        "node_name": "sim-quiet",
        "gpus": [{}, {}],
        "pods": [exclusive("a", 0), exclusive("b", 1)],
        "timeline": [
            {"at": 5, "xid": {"gpu": 1, "code": 79}},
            {"at": 6, "lose": 1},
        ],
    }
    async with simulated_exporter(scenario, argv=["--kube-events", "off"]) as h:
        kinds = set()
        for _ in range(3):
            kinds |= {t.kind for t in (await step(h)).transitions}
        assert {"fatal_xid", "gpu_lost", "gpu_unhealthy"} <= kinds  # news to tell
        assert h.agent.reporter is None
        await asyncio.sleep(0.3)  # a writer, were there one, would have written by now
        assert api(h).write_log == []
        scrape = await h.scrape()
        assert scrape.series(EVENTS) == {}
        assert scrape.series("gpu_exporter_kube_writes_total") == {}


async def test_a_refusal_that_lasts_is_one_kind_of_log_line_not_one_per_event(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every refused Event logs the same template and arguments, so the log's repeat
    filter (exporter/logs.py) makes a 403 that lasts one line a minute."""
    caplog.set_level(logging.WARNING, logger="exporter.reporting.writer")
    scenario = shared_gpu(12, [{"at": 5, "xid": {"gpu": 0, "code": 48}}], "sim-refused")
    async with simulated_exporter(scenario) as h:
        api(h).set_write_fault("forbidden")
        await step(h)
        await until(lambda: event_total(h, "failed") >= 12, "the refused Events counted")
    refusals = [
        r
        for r in caplog.records
        if r.name == "exporter.reporting.writer" and "refused" in str(r.msg)
    ]
    assert len(refusals) >= 12
    assert len({(r.msg, r.args) for r in refusals}) == 1
    assert "RBAC" in refusals[0].getMessage()
