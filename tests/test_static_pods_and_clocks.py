"""Static pods and clocks: no false Warning from a UID or a
clock that is not what it seems, and the true ones still written.

- A static pod's processes run in a cgroup named by the kubelet's UID (the hash of its
  manifest), while the API shows its mirror pod under another UID, which carries the
  kubelet's in the ``kubernetes.io/config.mirror`` annotation.
- Windows (the fatal-XID window) run on the monotonic clock: a wall-clock step neither
  ends nor stretches them.
- Deadlines the API server sets (deletionTimestamp) are compared on the API server's
  clock, estimated from the ``Date`` header of its answers.

Each test runs the real exporter on the simulator (tests/harness.py) and reads the
Events the writer thread sent to the API stand-in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from email.utils import formatdate

import pytest

from exporter.analysis.attribution import attribute
from exporter.analysis.orphans import OrphanPolicy, find_orphans
from exporter.analysis.xid import XidLedger
from exporter.model import (
    KIND_DELETED_POD,
    MIRROR_POD_ANNOTATION,
    NodeSnapshot,
    OrphanedMemory,
    OrphanState,
    PodMeta,
    XidEvent,
)
from exporter.sim.scenario import API_DATE_ABSENT
from exporter.sources.kube import PodWatcher, pod_meta_from_dict
from exporter.sources.server_clock import ServerClock
from tests.harness import Harness, simulated_exporter
from tests.kube_writes import dra_with_a_reset, status_of
from tests.test_kube_events import api, exclusive, quiet, step, until
from tests.test_orphans import (
    CID_A,
    CID_B,
    GIB,
    T0,
    UID_A,
    UID_B,
    alive,
    gpu,
    gpu_with_pod_process,
    kubelet,
    meta,
    node,
    proc,
    watch,
)

GRACE_CYCLES = 12  # two minutes of 10 s cycles: twice the 60 s deleted-pod grace


def orphan_events(h: Harness) -> list[str]:
    return [e["note"] for e in api(h).events("reason=GPUOrphanedMemory")]


def static_pod_scenario(node: str) -> dict[str, object]:
    """A static pod (``static: true``: its mirror pod has another UID) using GPU 0, and
    an ordinary pod on GPU 1."""
    probe = exclusive(f"gpu-probe-{node}", 0)
    probe["namespace"] = "kube-system"
    probe["static"] = True
    return {"node_name": node, "gpus": [{}, {}], "pods": [probe, exclusive("b", 1)]}


async def run_cycles(h: Harness, cycles: int) -> None:
    for _ in range(cycles):
        await step(h)


async def test_a_static_pods_gpu_process_is_its_mirror_pods_and_no_orphan() -> None:
    async with simulated_exporter(static_pod_scenario("sim-static")) as h:
        await run_cycles(h, GRACE_CYCLES)
        await quiet(h)
        assert orphan_events(h) == []
        latest = h.agent.latest
        assert latest is not None
        assert latest.orphans == ()
        (row,) = [p for p in latest.attribution.processes if p.gpu == 0]
        assert (row.namespace, row.pod) == ("kube-system", "gpu-probe-sim-static")


async def test_a_deleted_pod_whose_process_lives_on_is_still_deleted_pod_memory() -> None:
    scenario = static_pod_scenario("sim-static-gone")
    scenario["timeline"] = [{"at": 20, "delete_pod": "ml/b"}]
    async with simulated_exporter(scenario) as h:
        await run_cycles(h, GRACE_CYCLES)
        await quiet(h)
        (note,) = orphan_events(h)
        assert "GPU 1" in note
        latest = h.agent.latest
        assert latest is not None
        assert [(o.gpu, o.kind) for o in latest.orphans] == [(1, "deleted_pod")]


@pytest.mark.parametrize(
    ("value", "read"),
    [
        (45, 45),
        (0, 0),
        (-5, None),
        ("30", None),
        (30.5, None),
        (True, None),
        (None, None),
        (2**63 - 1, 2**63 - 1),
        (2**63, None),  # beyond int64: no API server sends it
        # no float holds it: every cycle failed (adversarial review)
        pytest.param(10**400, None, id="10**400-None"),
    ],
)
def test_the_deletion_grace_period_is_a_whole_number_of_seconds_or_unknown(
    value: object, read: int | None
) -> None:
    metadata: dict[str, object] = {"uid": "u-1", "namespace": "ml", "name": "a"}
    metadata |= {"deletionTimestamp": "2026-11-28T12:00:00Z", "deletionGracePeriodSeconds": value}
    pod = pod_meta_from_dict({"metadata": metadata})
    assert pod is not None and pod.deletion_grace_period_s == read


def test_a_mirror_pod_is_keyed_by_its_static_pods_uid_and_a_bad_annotation_is_ignored() -> None:
    def meta(annotation: object) -> PodMeta | None:
        return pod_meta_from_dict(
            {
                "metadata": {
                    "uid": "11111111-2222-3333-4444-555555555555",
                    "namespace": "kube-system",
                    "name": "probe-node",
                    "annotations": {MIRROR_POD_ANNOTATION: annotation},
                }
            }
        )

    mirror = meta("0123456789ABCDEF0123456789abcdef")
    assert mirror is not None
    assert (mirror.uid, mirror.api_uid) == (
        "0123456789abcdef0123456789abcdef",
        "11111111-2222-3333-4444-555555555555",
    )
    for garbage in ("", "../etc", "x" * 32, 42, "0" * 4096):
        plain = meta(garbage)
        assert plain is not None
        assert (plain.uid, plain.api_uid) == ("11111111-2222-3333-4444-555555555555", None)


# -- 8a: windows on the monotonic clock ----------------------------------------------

XID_ARGV = ["--node-condition", "--dra-device-taints"]


def fatal_xid_then_step(step_by_s: float, node: str = "sim-dra-node") -> dict[str, object]:
    """The shipped ``dra`` scenario: a true XID 48 on GPU 0 (DRA device gpu-2) at 15 s,
    then at 40 s the node's wall clock steps by ``step_by_s`` (the monotonic clock does
    not)."""
    data = dra_with_a_reset(unhealthy_at=10_000, healthy_at=20_000)
    data["node_name"] = node
    data["timeline"] = [{"at": 15, "xid": {"gpu": 0, "code": 48}}]
    data["node_clock"] = {"steps": [{"at": 40, "by": step_by_s}]}
    return data


def reasons(h: Harness) -> list[str]:
    return sorted(e["reason"] for e in api(h).events(""))


async def test_a_forward_wall_clock_step_keeps_a_fatal_xids_fault() -> None:
    async with simulated_exporter(fatal_xid_then_step(7220), argv=XID_ARGV) as h:
        await run_cycles(h, 2)  # 20 s: the XID is in
        await until(lambda: len(api(h).device_taint_rules()) == 1, "the DeviceTaintRule")
        await until(lambda: status_of(h) == ("True", "GPUUnhealthy"), "the condition True")
        await run_cycles(h, 10)  # to 120 s, the wall clock 2 h 20 s ahead from 40 s
        await quiet(h)
        assert h.env.node.wall_time() - h.env.node.api_time() == 7220
        assert "GPUHealthy" not in reasons(h)
        assert status_of(h) == ("True", "GPUUnhealthy")
        assert len(api(h).device_taint_rules()) == 1
        latest = h.agent.latest
        assert latest is not None
        assert not next(g for g in latest.health if g.gpu == 0).healthy


async def test_a_backward_wall_clock_step_does_not_stretch_the_xid_window() -> None:
    argv = [*XID_ARGV, "--health-xid-window", "60"]
    async with simulated_exporter(fatal_xid_then_step(-7220), argv=argv) as h:
        await run_cycles(h, 6)  # 60 s: inside the window, the clock stepped back at 40 s
        await quiet(h)
        assert status_of(h) == ("True", "GPUUnhealthy")
        await run_cycles(h, 3)  # 90 s: the window (15 + 60 s) has passed
        await until(lambda: status_of(h) == ("False", "GPUsHealthy"), "the condition False")
        await until(lambda: api(h).device_taint_rules() == [], "the rule removed")
        assert "GPUHealthy" in reasons(h)


# -- 8b: deadlines on the API server's clock -----------------------------------------


def terminating_pod(
    node: str, ahead_s: float, step_s: float = 0.0, api_date: str | None = None
) -> dict[str, object]:
    """Pod ``a`` on GPU 0 asked to stop at 20 s with a 30 s grace (deletionTimestamp:
    50 s on the API server's clock); its process holds its memory and never exits. The
    node's wall clock is ``ahead_s`` ahead of the API server's, and steps by ``step_s``
    at 30 s, inside the graceful stop; ``api_date``: what the server sends as ``Date``
    (None: its clock; ``absent``: nothing)."""
    steps = [{"at": 30, "by": step_s}] if step_s else []
    clock: dict[str, object] = {"offset_s": ahead_s, "steps": steps}
    if api_date is not None:
        clock["api_date"] = api_date
    return {
        "node_name": node,
        "gpus": [{}, {}],
        "pods": [exclusive("a", 0), exclusive("b", 1)],
        "timeline": [{"at": 20, "terminate_pod": {"pod": "ml/a", "grace_s": 30}}],
        "node_clock": clock,
    }


# What the API server may send as Date instead of its clock: nothing (a proxy stripping
# it), garbage, and a well-formed date more than a day off. None of them gives an offset.
UNUSABLE_DATES = {
    "absent": API_DATE_ABSENT,
    "garbage": "yesterday",
    "a-year-off": "Sat, 28 Nov 2025 12:00:00 GMT",
}


async def cycles_until(h: Harness, at: float) -> None:
    while h.clock() < at:
        await step(h)


async def test_a_pod_in_its_graceful_stop_is_no_orphan_with_the_node_clock_ahead() -> None:
    async with simulated_exporter(terminating_pod("sim-ahead", 180)) as h:
        await cycles_until(h, 100)  # the deadline (50 s) + the 60 s grace not yet passed
        await quiet(h)
        assert orphan_events(h) == []
        offset = h.agent.latest.node.pod_meta.server_offset_s  # type: ignore[union-attr]
        assert offset is not None and 179 <= offset <= 182
        await cycles_until(h, 120)  # past it, the memory still held: a true orphan
        await quiet(h)
        (note,) = orphan_events(h)
        assert "GPU 0" in note and "deleted_pod" in note


@pytest.mark.parametrize("step_s", [7200.0, -7200.0])
async def test_a_wall_clock_step_inside_a_graceful_stop_neither_hastens_nor_loses_the_warning(
    step_s: float,
) -> None:
    """The stop (30 s from first sight at ~20 s) and the 60 s grace after it run on the
    monotonic clock: no Warning up to 100 s, one by 120 s, whichever way the clock steps."""
    async with simulated_exporter(terminating_pod(f"sim-step-{step_s < 0:d}", 0, step_s)) as h:
        await cycles_until(h, 100)
        await quiet(h)
        assert orphan_events(h) == []
        await cycles_until(h, 120)
        await quiet(h)
        (note,) = orphan_events(h)
        assert "GPU 0" in note and "deleted_pod" in note


@pytest.mark.parametrize("date", sorted(UNUSABLE_DATES))
async def test_no_usable_date_header_neither_hastens_nor_loses_the_warning(date: str) -> None:
    """The node's clock 180 s ahead and no Date to measure that by: the stop still ends
    30 s after the first sight (~20 s) on the monotonic clock, then the 60 s grace."""
    async with simulated_exporter(
        terminating_pod(f"sim-date-{date}", 180, api_date=UNUSABLE_DATES[date])
    ) as h:
        watch = h.agent.source("kube")
        assert isinstance(watch, PodWatcher)
        await cycles_until(h, 100)
        await quiet(h)
        assert orphan_events(h) == []
        assert watch.server_clock.offset_s() is None  # no Date was ever usable
        assert (watch.server_clock.rejected == 0) == (date == "absent")
        await cycles_until(h, 120)
        await quiet(h)
        (note,) = orphan_events(h)
        assert "GPU 0" in note and "deleted_pod" in note


# -- pure: the orphan grace and the XID window on their clocks ----------------------


@pytest.mark.parametrize("wall_step", [0.0, 7200.0, -7200.0])
@pytest.mark.parametrize("server_offset", [180.0, None, -86_400.0 * 400])
def test_a_terminating_pods_stop_ends_its_grace_after_first_sight_on_the_monotonic_clock(
    wall_step: float, server_offset: float | None
) -> None:
    """deletionTimestamp T0 + 30 (a 30 s grace asked at T0), first seen at elapsed 0: the
    deleted-pod grace (60 s) runs from elapsed 30, whatever the node's wall clock does
    (a 2 h step either way after the first sight) and whatever the server's Date said
    (an offset of 3 min, none, or a year off)."""
    deadline = T0 + 30
    pods = replace(
        watch(meta(UID_A, "api", CID_A, deletion=deadline, grace=30)),
        server_offset_s=server_offset,
    )
    snapshot = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=pods,
        pod_resources=kubelet(("ml", "api", 0)),
    )
    state = OrphanState()
    seen: dict[float, tuple[OrphanedMemory, ...]] = {}
    for elapsed in (0.0, 20.0, 40.0, 89.0, 90.0):
        wall = T0 + elapsed + (wall_step if elapsed else 0.0)
        seen[elapsed], state = find_orphans(
            snapshot,
            attribute(snapshot),
            state,
            now=wall,
            policy=OrphanPolicy(deleted_pod_grace_s=60),
            elapsed=elapsed,
        )
    assert [seen[e] for e in (0.0, 20.0, 40.0, 89.0)] == [(), (), (), ()]
    (orphan,) = seen[90.0]
    assert orphan.kind == KIND_DELETED_POD
    assert orphan.first_seen == T0 + 30 + wall_step  # the stop's end, on the node's clock


def test_an_exporter_started_during_a_graceful_stop_counts_its_whole_grace_again() -> None:
    """A restart forgets what it saw: a pod asked to stop an hour before (its
    deletionTimestamp long past) and first seen now is given its 45 s grace from now,
    then the 60 s deleted-pod grace; never less, whatever its timestamp says."""
    asked = T0 - 3600
    snapshot = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(meta(UID_A, "api", CID_A, deletion=asked + 45, grace=45)),
        pod_resources=kubelet(("ml", "api", 0)),
    )
    state = OrphanState()  # a fresh process
    seen: dict[float, tuple[OrphanedMemory, ...]] = {}
    for elapsed in (1000.0, 1044.0, 1104.0, 1105.0):
        seen[elapsed], state = find_orphans(
            snapshot,
            attribute(snapshot),
            state,
            now=T0 + elapsed - 1000,
            policy=OrphanPolicy(deleted_pod_grace_s=60),
            elapsed=elapsed,
        )
    assert [seen[e] for e in (1000.0, 1044.0, 1104.0)] == [(), (), ()]
    (orphan,) = seen[1105.0]
    assert orphan.kind == KIND_DELETED_POD
    assert orphan.first_seen == T0 + 45  # the stop's end as this process counts it


def test_a_shortened_grace_counts_from_the_request_that_shortened_it() -> None:
    """A second delete may only shorten the grace; the API server then moves the
    deletionTimestamp. Seen at 0 with 3600 s, shortened to 10 s at 500: the stop ends at
    510 for this judgement, not at 10 (the first sight plus the new grace)."""
    policy = OrphanPolicy(deleted_pod_grace_s=60)
    state = OrphanState()

    def judged(elapsed: float, deletion: float, grace: int) -> tuple[OrphanedMemory, ...]:
        nonlocal state
        snapshot = node(
            [gpu_with_pod_process()],
            [alive(10, UID_A, CID_A)],
            pod_meta=watch(meta(UID_A, "api", CID_A, deletion=deletion, grace=grace)),
            pod_resources=kubelet(("ml", "api", 0)),
        )
        found, state = find_orphans(
            snapshot, attribute(snapshot), state, now=T0 + elapsed, policy=policy, elapsed=elapsed
        )
        return found

    assert judged(0, T0 + 3600, 3600) == ()
    assert judged(500, T0 + 510, 10) == ()  # moved: counts from 500
    assert judged(569, T0 + 510, 10) == ()
    assert [o.kind for o in judged(570, T0 + 510, 10)] == [KIND_DELETED_POD]


def api_terminating_from_0() -> NodeSnapshot:
    """ml/api's process on GPU 0, the pod terminating (grace 30, deletionTimestamp T0+30),
    the kubelet still listing it."""
    return node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(meta(UID_A, "api", CID_A, deletion=T0 + 30, grace=30)),
        pod_resources=kubelet(("ml", "api", 0)),
    )


def test_terminating_sights_are_kept_through_a_watch_outage_and_dropped_with_the_process() -> None:
    policy = OrphanPolicy(deleted_pod_grace_s=60)
    terminating = api_terminating_from_0()
    outage = replace(terminating, pod_meta=watch(ok=False))
    _, state = find_orphans(
        terminating, attribute(terminating), OrphanState(), now=T0, policy=policy, elapsed=0
    )
    _, state = find_orphans(outage, attribute(outage), state, now=T0, policy=policy, elapsed=50)
    assert state.pod_terminating_since == {UID_A: (T0 + 30, 0, 30)}  # not restarted at 50
    found, state = find_orphans(
        terminating, attribute(terminating), state, now=T0 + 90, policy=policy, elapsed=90
    )
    assert [o.kind for o in found] == [KIND_DELETED_POD]
    exited = node([gpu_with_pod_process()], [], pod_meta=watch())
    _, state = find_orphans(exited, attribute(exited), state, now=T0, policy=policy, elapsed=91)
    assert state.pod_terminating_since == {}


def judge_each(
    policy: OrphanPolicy, snapshots: list[tuple[float, NodeSnapshot]]
) -> list[tuple[float, list[str]]]:
    """find_orphans over (elapsed, snapshot) in turn, one state: the kinds found each time."""
    state = OrphanState()
    kinds: list[tuple[float, list[str]]] = []
    for elapsed, snapshot in snapshots:
        found, state = find_orphans(
            snapshot, attribute(snapshot), state, now=T0 + elapsed, policy=policy, elapsed=elapsed
        )
        kinds.append((elapsed, [o.kind for o in found]))
    return kinds


def test_a_same_name_replacement_does_not_hide_the_old_pods_leak() -> None:
    """ml/api (UID_A) deleted with its process still holding memory, and a new ml/api
    (UID_B, a StatefulSet replica) running: the kubelet lists the name, but it is the
    new pod's (adversarial review: never reported)."""
    policy = OrphanPolicy(deleted_pod_grace_s=60)
    replaced = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(meta(UID_B, "api", CID_B)),
        pod_resources=kubelet(("ml", "api", 1)),
    )
    before = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(meta(UID_A, "api", CID_A)),
        pod_resources=kubelet(("ml", "api", 0)),
    )
    seen = judge_each(policy, [(0, before), (10, replaced), (69, replaced), (70, replaced)])
    assert seen == [(0, []), (10, []), (69, []), (70, [KIND_DELETED_POD])]


def test_a_same_name_replacement_verdict_stays_through_a_watch_outage() -> None:
    """The watch down for one cycle after the replacement verdict: the kubelet lists the
    name, but it cannot say whose uid it is (adversarial review: the orphan vanished and
    came back younger, and a watch down one cycle in five hid it for good)."""
    policy = OrphanPolicy(deleted_pod_grace_s=60)
    replaced = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(meta(UID_B, "api", CID_B)),
        pod_resources=kubelet(("ml", "api", 1)),
    )
    named = replace(replaced, pod_meta=watch(meta(UID_A, "api", CID_A)))
    outage = replace(replaced, pod_meta=watch(ok=False))
    seen = judge_each(
        policy,
        [(0, named), (10, replaced), (70, replaced), (80, outage), (90, replaced), (100, outage)],
    )
    assert seen == [(0, []), (10, []), *((t, [KIND_DELETED_POD]) for t in (70, 80, 90, 100))]


def test_a_pod_the_watch_has_not_delivered_is_no_watch_verdict_to_keep() -> None:
    """A time-sliced GPU, so a new pod cannot be named from an exclusive allocation; the
    watch answers once without it, then goes down: the kubelet lists it, and no verdict
    is kept for a pod never named (adversarial review: a deleted_pod Warning 60 s later
    for a running pod)."""
    policy = OrphanPolicy(deleted_pod_grace_s=60)
    shared = gpu(0, processes=[proc(10, 4 * GIB), proc(20, GIB)])
    lagging = node(
        [shared],
        [alive(10, UID_A, CID_A), alive(20, UID_B, CID_B)],
        pod_meta=watch(meta(UID_B, "x", CID_B)),
        pod_resources=kubelet(("ml", "new", 0), ("ml", "x", 0)),
    )
    down = replace(lagging, pod_meta=watch(ok=False))
    seen = judge_each(policy, [(0, lagging), *((t, down) for t in range(10, 310, 10))])
    assert all(kinds == [] for _, kinds in seen), seen


def test_a_kubelet_only_verdict_is_not_kept_once_the_kubelet_lists_the_pod_again() -> None:
    """The watch down all along: a verdict from the kubelet's listing alone is the
    kubelet's, and ends when it lists the name again."""
    policy = OrphanPolicy(deleted_pod_grace_s=60)
    listed = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=watch(ok=False),
        pod_resources=kubelet(("ml", "api", 0)),
    )
    named = replace(listed, pod_meta=watch(meta(UID_A, "api", CID_A)))
    blip = replace(listed, pod_resources=kubelet())
    seen = judge_each(policy, [(0, named), (10, blip), (70, blip), (80, listed), (200, listed)])
    assert seen == [(0, []), (10, []), (70, [KIND_DELETED_POD]), (80, []), (200, [])]


def test_a_watch_outage_after_the_verdict_keeps_it() -> None:
    """Terminating (grace 30) from 0: deleted_pod at 90; the watch then down with the
    kubelet still listing the pod: the verdict stays (adversarial review: it cleared
    during the outage, the alert's for: started again, the Event came twice)."""
    policy = OrphanPolicy(deleted_pod_grace_s=60)
    terminating = api_terminating_from_0()
    outage = replace(terminating, pod_meta=watch(ok=False))
    seen = judge_each(policy, [(0, terminating), (90, terminating), (100, outage), (110, outage)])
    assert seen == [(0, []), *((t, [KIND_DELETED_POD]) for t in (90, 100, 110))]


def test_a_process_missing_from_one_cycle_keeps_its_pods_first_sight() -> None:
    """A GPU or /proc read that misses the process at 80 s does not start the pod's
    graceful stop again (adversarial review: the verdict moved from 90 s to 180 s)."""
    policy = OrphanPolicy(deleted_pod_grace_s=60)
    pod = watch(meta(UID_A, "api", CID_A, deletion=T0 + 30, grace=30))
    terminating = node(
        [gpu_with_pod_process()],
        [alive(10, UID_A, CID_A)],
        pod_meta=pod,
        pod_resources=kubelet(("ml", "api", 0)),
    )
    missed = node([gpu(0)], [], pod_meta=pod, pod_resources=kubelet(("ml", "api", 0)))
    seen = judge_each(policy, [(0, terminating), (80, missed), (90, terminating)])
    assert seen == [(0, []), (80, []), (90, [KIND_DELETED_POD])]


def test_a_vanished_pods_grace_runs_on_the_monotonic_clock_through_a_wall_step() -> None:
    gone = node([gpu_with_pod_process()], [alive(10, UID_A, CID_A)], pod_meta=watch())
    policy = OrphanPolicy(deleted_pod_grace_s=60)
    state = OrphanState()
    for elapsed, wall in ((0, T0), (10, T0 + 10 + 7220), (59, T0 + 59 + 7220)):
        found, state = find_orphans(
            gone, attribute(gone), state, now=wall, policy=policy, elapsed=elapsed
        )
        assert found == (), elapsed
    found, state = find_orphans(
        gone, attribute(gone), state, now=T0 + 60 + 7220, policy=policy, elapsed=60
    )
    assert [o.kind for o in found] == [KIND_DELETED_POD]


def test_the_xid_window_is_measured_on_the_monotonic_clock() -> None:
    xid = XidEvent(gpu=0, uuid="GPU-a", xid=48, timestamp=T0, source="nvml", monotonic=100.0)
    ledger = XidLedger(retention_s=3600).record([xid], now=100.0)
    # the wall clock stepped 2 h ahead: the ledger never looks at it
    assert ledger.recent_fatal(since_ts=160.0 - 3600) == {"GPU-a": [48]}
    assert ledger.record([], now=3699.0).recent_fatal(3699.0 - 3600) == {"GPU-a": [48]}
    assert ledger.record([], now=3701.0).recent_fatal(3701.0 - 3600) == {}


# -- the API server's clock from its Date headers ------------------------------------


def test_the_server_clock_offset_is_the_median_of_its_date_headers() -> None:
    now = [1_800_000_000.0]
    clock = ServerClock(lambda: now[0])
    assert clock.offset_s() is None  # nothing learned yet: callers use the node's clock
    served = now[0] - 180
    for _ in range(3):
        clock.observe({"Date": formatdate(served, usegmt=True)})
    assert clock.offset_s() == 180.0
    clock.observe({"Date": formatdate(served - 30, usegmt=True)})  # one plausible outlier
    assert clock.offset_s() == 180.0


def test_a_garbage_or_absurd_date_header_does_not_move_the_offset() -> None:
    now = 1_800_000_000.0
    clock = ServerClock(lambda: now)
    clock.observe({"Date": formatdate(now - 5, usegmt=True)})
    for garbage in (
        "yesterday",
        "",
        "Thu, 01 Jan 1970 00:00:00 GMT",  # 57 years off
        "Fri, 31 Dec 9999 23:59:59 GMT",
        "Mon, 32 Foo 2026 99:99:99 GMT",
        "Mon, 01 Jan 2027 00:00:00",  # no zone
        "x" * 10_000,
        42,
    ):
        clock.observe({"Date": garbage})
    assert clock.offset_s() == 5.0
    assert clock.rejected == 8
    clock.observe({})  # no header at all: nothing learned, nothing wrong
    assert (clock.offset_s(), clock.rejected) == (5.0, 8)


async def test_garbage_date_headers_from_the_api_server_do_not_move_the_offset() -> None:
    async with simulated_exporter(terminating_pod("sim-garbage-date", 180)) as h:
        api_server = h.env.kube_api
        watch = h.agent.source("kube")
        assert api_server is not None and isinstance(watch, PodWatcher)
        garbage = ("yesterday", "Thu, 01 Jan 1970 00:00:00 GMT", "x" * 300)

        def dropped(count: int) -> Callable[[], bool]:
            return lambda: watch.server_clock.rejected >= count

        for i, value in enumerate(garbage):
            await until(lambda: api_server.watcher_count > 0, "a watch open")
            api_server.date_override = value
            api_server.disconnect_watchers()  # it reopens: answers with the header
            await until(dropped(i + 1), "the Date dropped")
        api_server.date_override = None
        await until(lambda: watch.snapshot().ok, "the watch up")
        await cycles_until(h, 100)
        await quiet(h)
        offset = h.agent.latest.node.pod_meta.server_offset_s  # type: ignore[union-attr]
        assert offset is not None and 179 <= offset <= 182
        assert orphan_events(h) == []
