"""Static pods and clocks (issue 40, items 7 and 8) as fault-matrix rows.

The real exporter runs on the simulator (tests/harness.py) and writes through the real
``kubernetes`` client to the API stand-in; each test counts the Events it wrote.
"""

from __future__ import annotations

from tests.faults.conftest import RecordFault
from tests.harness import simulated_exporter
from tests.test_kube_events import quiet
from tests.test_static_pods_and_clocks import (
    GRACE_CYCLES,
    orphan_events,
    run_cycles,
    static_pod_scenario,
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
