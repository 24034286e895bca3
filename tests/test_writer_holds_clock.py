"""The writer's holds on an earlier run's verdicts, against the node's wall clock
(windows on the monotonic clock, deadlines on the API server's clock).

A restarted exporter keeps an earlier run's ``GPUUnhealthy`` True and its
DeviceTaintRules for ``--health-xid-window`` (their verdicts may rest on XIDs this run
never saw). Each hold's end is fixed once, when read, as a deadline on the writer's
monotonic clock: a wall-clock step during the hold neither ends nor stretches it, and a
rule's hold counts from its ``creationTimestamp`` on the API server's clock, whatever
the node's own clock says. The real exporter runs on the simulated node
(tests/harness.py) with the writer on the simulated clock, writing to the API stand-in.
"""

from __future__ import annotations

import pytest

from tests.harness import simulated_exporter
from tests.kube_writes import (
    cycles_to,
    dra_with_a_reset,
    leave_true_condition,
    left_rule,
    recovering_gpu,
    settle,
    status_of,
    status_patches,
)
from tests.test_kube_events import api, until

WINDOW_S = 120
STEP_AT_S = 30


def stepped_restart(node: str, by_s: float) -> dict[str, object]:
    """Two GPUs healthy throughout; the node's wall clock steps by ``by_s`` at 30 s."""
    scenario = recovering_gpu(node, unhealthy_at=10_000, healthy_at=20_000)
    scenario["node_clock"] = {"steps": [{"at": STEP_AT_S, "by": by_s}]}
    return scenario


@pytest.mark.parametrize("by_s", [7200, -7200], ids=["forward-2h", "back-2h"])
async def test_an_inherited_true_condition_is_held_through_a_wall_clock_step(by_s: float) -> None:
    """+2 h during the hold: before the fix the hold (a wall-clock time) was over at
    once and the True went False in the cycle of the step. -2 h: the hold stretched by
    two hours. Now it ends 120 s after the heartbeat on the monotonic clock."""
    argv = ["--node-condition", "--health-xid-window", str(WINDOW_S)]
    async with simulated_exporter(
        stepped_restart("sim-hold-step", by_s),
        argv=argv,
        first_cycle=False,
        writer_on_simulated_clock=True,
    ) as h:
        await leave_true_condition(h)
        await cycles_to(h, STEP_AT_S + 30)  # 60 s: all healthy, the step 30 s behind
        await settle(h)
        assert h.env.node.wall_time() - h.env.node.api_time() == by_s
        assert status_of(h) == ("True", "GPUUnhealthy")
        assert status_patches(h) == 0
        await cycles_to(h, WINDOW_S - 10)  # 110 s: still inside the window
        await settle(h)
        assert status_of(h) == ("True", "GPUUnhealthy")
        await cycles_to(h, WINDOW_S + 10)  # 130 s: the hold's monotonic end is past
        await until(lambda: status_of(h) == ("False", "GPUsHealthy"), "the condition False")


async def test_a_gpu_this_run_sees_unhealthy_ends_the_hold_with_its_own_verdicts() -> None:
    """The rule kept: this run's own True (GPU 0 asks for a reset at 40 s, done at 60 s)
    ends the hold, so the healthy verdict after it goes out at once, step or no step."""
    scenario = recovering_gpu("sim-hold-own", unhealthy_at=40, healthy_at=60)
    scenario["node_clock"] = {"steps": [{"at": STEP_AT_S, "by": 7200}]}
    argv = ["--node-condition", "--health-xid-window", str(WINDOW_S)]
    async with simulated_exporter(
        scenario, argv=argv, first_cycle=False, writer_on_simulated_clock=True
    ) as h:
        await leave_true_condition(h)
        await cycles_to(h, 50)
        await until(lambda: status_of(h) == ("True", "GPUUnhealthy"), "this run's True")
        await cycles_to(h, 70)  # healthy again at 60 s, inside the window
        await until(lambda: status_of(h) == ("False", "GPUsHealthy"), "the condition False")


def rule_scenario(node_ahead_s: float, api_date: str | None = None) -> dict[str, object]:
    """The ``dra`` scenario, all healthy; the node's clock ``node_ahead_s`` ahead of the
    API server's (negative: behind); ``api_date``: the server's Date header
    (exporter/sim/scenario.py, ``absent``: none)."""
    data = dra_with_a_reset(unhealthy_at=10_000, healthy_at=20_000)
    data["node_clock"] = {"offset_s": node_ahead_s}
    if api_date is not None:
        data["node_clock"]["api_date"] = api_date  # type: ignore[index]
    return data


@pytest.mark.parametrize(
    ("ahead_s", "api_date"),
    [(180, None), (-180, None), (-400 * 86_400, "absent")],
    ids=["node-ahead-3min", "node-behind-3min", "node-behind-400d-no-date"],
)
async def test_an_inherited_rules_hold_ends_at_creation_plus_window_on_the_servers_clock(
    ahead_s: float, api_date: str | None
) -> None:
    """The rule's creationTimestamp is the API server's time. Before the fix it was
    compared with the node's wall clock: 3 min ahead, the 120 s hold was over before it
    began (the rule deleted in the first cycle); 3 min behind, it lasted 300 s. With no
    Date header to tell the server's time, the node's clock 400 days behind held the
    taint on a healthy GPU for 400 days; now the hold ends the window after start."""
    argv = ["--dra-device-taints", "--health-xid-window", str(WINDOW_S)]
    async with simulated_exporter(
        rule_scenario(ahead_s, api_date),
        argv=argv,
        first_cycle=False,
        writer_on_simulated_clock=True,
    ) as h:
        uuid = next(g.uuid for g in h.env.node.gpus if g.index == 0)
        created = h.clock()  # the stand-in stamps creationTimestamp on the server's clock
        await left_rule(h, uuid)
        await cycles_to(h, created + WINDOW_S - 20)  # 100 s after creation
        await settle(h)
        assert len(api(h).device_taint_rules()) == 1
        await cycles_to(h, created + WINDOW_S + 20)  # 140 s after creation
        await until(lambda: api(h).device_taint_rules() == [], "the rule removed")
