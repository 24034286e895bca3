"""The writer's hold on an earlier run's verdict across a wall-clock step (its windows
on the monotonic clock) as a fault-matrix row.

The real exporter runs on the simulator (tests/harness.py), its writer on the simulated
clock, and patches the Node through the real ``kubernetes`` client to the API stand-in.
"""

from __future__ import annotations

from tests.faults.conftest import RecordFault
from tests.harness import simulated_exporter
from tests.kube_writes import cycles_to, leave_true_condition, status_of, status_patches
from tests.test_kube_events import until
from tests.test_writer_holds_clock import STEP_AT_S, WINDOW_S, stepped_restart


async def test_an_inherited_true_condition_outlives_a_forward_wall_clock_step(
    record_fault: RecordFault,
) -> None:
    argv = ["--node-condition", "--health-xid-window", str(WINDOW_S)]
    async with simulated_exporter(
        stepped_restart("sim-hold-fault", 7200),
        argv=argv,
        first_cycle=False,
        writer_on_simulated_clock=True,
    ) as h:
        await leave_true_condition(h)
        await cycles_to(h, WINDOW_S - 10)  # 110 s, the wall clock 2 h ahead from 30 s
        held = status_of(h)
        patches = status_patches(h)
        assert held == ("True", "GPUUnhealthy") and patches == 0
        await cycles_to(h, WINDOW_S + 10)
        await until(lambda: status_of(h) == ("False", "GPUsHealthy"), "the condition False")
    record_fault(
        "writer-hold-survives-wall-clock-step",
        expected="An earlier run's GPUUnhealthy True (and DeviceTaintRule) is held for "
        "--health-xid-window as a deadline on the monotonic clock, fixed when read: a "
        "wall-clock step during the hold neither ends nor stretches it, and a rule's hold "
        "ends at its creationTimestamp plus the window on the API server's clock.",
        figure=f"step +7200 s at {STEP_AT_S} s into a {WINDOW_S} s hold: condition True "
        f"and {patches} status patches up to {WINDOW_S - 10} s, False by {WINDOW_S + 10} s; "
        "before the fix: False in the first cycle after the step",
    )
