"""Static pods and clocks (issue 40, items 7 and 8): no false Warning from a UID or a
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

from exporter.model import MIRROR_POD_ANNOTATION, PodMeta
from exporter.sources.kube import pod_meta_from_dict
from tests.harness import Harness, simulated_exporter
from tests.test_kube_events import api, exclusive, quiet, step

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
