"""Each of the exporter's own sources down, against the orphan and leak alerts: the real
exporter on the simulated node (tests/harness.py) with one source broken at its outer
edge, and what it served fed to ``promtool test rules`` with the shipped alert rules.

A source outage must never read as orphaned memory or an isolation leak: not knowing
who owns a process is not evidence that it died or escaped its allocation. Two outages
did before this suite: /proc missing made every pid a dead process's orphan, and the
API server down made every DRA pod's memory a deleted pod's (both fixed in exporter/).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

import exporter.sim
from exporter.model import SourceStatus
from exporter.sim.events import SimEvent
from exporter.sim.scenario import Scenario, load_scenario, parse_scenario
from tests.faults.conftest import RecordFault
from tests.harness import Harness, Scrape, simulated_exporter
from tests.test_alert_rules import ALERTS, run_promtool

pytestmark = pytest.mark.slow  # one simulated node per outage

ALERTS_UNDER_TEST = ("GPUOrphanedMemory", "GPUOrphanedMemoryLarge", "GPUIsolationLeak")
ORPHANED = "gpu_orphaned_memory_bytes"
FIRST_SEEN = "gpu_orphaned_memory_first_seen_timestamp_seconds"
LEAK = "gpu_unallocated_use_memory_bytes"
# What the three alerts read (GPUOrphanedMemoryLarge divides by the GPU's total).
ALERT_INPUTS = (ORPHANED, FIRST_SEEN, LEAK, "gpu_memory_total_bytes")
STEP_S = 200  # simulated seconds between cycles: past the 60 s deleted-pod grace at once
CYCLES = 5  # 1,000 s of outage: past the 3-cycle unattributed streak and the alerts' 600 s
SCENARIOS = Path(exporter.sim.__file__).parent / "scenarios"
HOLD_S = 1800  # the last served values held this long in promtool: past every for: 5m

Inject = Callable[[Harness], Awaitable[None]]


def scenario_with(name: str, **extra: Any) -> Scenario:
    data = yaml.safe_load((SCENARIOS / f"{name}.yaml").read_text())
    return parse_scenario({**data, **extra}, f"{name}-outage")


def nvml_errors(*calls: str, start: float = 0.0) -> Scenario:
    return scenario_with(
        "single-gpu",
        call_errors=[{"call": c, "error": "UNKNOWN", "from": start} for c in calls],
    )


async def nothing(h: Harness) -> None:
    """The outage is in the scenario (NVML call errors)."""


async def proc_root_missing(h: Harness) -> None:
    root = h.env.paths.proc_root
    root.rename(root.with_name("proc.away"))


async def kubelet_gone(h: Harness) -> None:
    await h.env._grpc.stop(grace=None)  # the real gRPC server; the socket goes with it


async def api_server_failing(h: Harness) -> None:
    api = h.env.kube_api
    assert api is not None
    api.set_error(500, "etcdserver: request timed out")
    api.disconnect_watchers()
    await watches_down(h, "kube", "resourceslices")


async def watches_down(h: Harness, *names: str) -> None:
    """A cut watch is routine; a watch source is down once its relist, after the first
    backoff step (0.4-0.8 s of real time), is refused too. Waits up to 10 s for that."""
    for _ in range(200):
        sources = [h.agent.source(n) for n in names]
        if all(s is None or not (s.status() or _UP).up for s in sources):
            return
        await asyncio.sleep(0.05)


_UP = SourceStatus("any", True)


async def kubelet_and_api_down(h: Harness) -> None:
    await kubelet_gone(h)
    await api_server_failing(h)


async def resourceslices_forbidden(h: Harness) -> None:
    api = h.env.kube_api
    assert api is not None
    api.set_error(403, "resourceslices is forbidden", resource="resourceslices")
    api.disconnect_watchers()
    await watches_down(h, "resourceslices")


@dataclass(frozen=True)
class Outage:
    source: str
    what: str
    scenario: Callable[[], Scenario]
    inject: Inject
    proc_tree_gone: bool = False  # the simulator cannot sync a tree that is gone
    # how the outage shows in what is served (default: the source's *_up reads 0)
    shows: Callable[[Scrape], bool] | None = None

    def visible_in(self, scrape: Scrape) -> bool:
        if self.shows is not None:
            return self.shows(scrape)
        return scrape.get("gpu_exporter_source_up", source=self.source) == 0


def gpu0_down(scrape: Scrape) -> bool:
    return scrape.get("gpu_up", gpu="0") == 0


def xid_errors(scrape: Scrape) -> bool:
    # the listener retries with backoff, so its *_up flaps; its error count grows
    return scrape.get("gpu_exporter_errors_total", source="xid") > 0


OUTAGES = (
    Outage(
        "nvml",
        "down: the device count fails every time",
        lambda: nvml_errors("nvmlDeviceGetCount_v2"),
        nothing,
    ),
    Outage(
        "nvml",
        "process listing fails mid-run",
        lambda: nvml_errors(
            "nvmlDeviceGetComputeRunningProcesses_v3",
            "nvmlDeviceGetComputeRunningProcesses_v2",
            start=1,
        ),
        nothing,
        shows=gpu0_down,
    ),
    Outage(
        "nvml",
        "memory info fails mid-run",
        lambda: nvml_errors("nvmlDeviceGetMemoryInfo_v2", "nvmlDeviceGetMemoryInfo", start=1),
        nothing,
        shows=gpu0_down,
    ),
    Outage(
        "xid",
        "the driver lacks nvmlEventSetWait_v2",
        lambda: scenario_with("single-gpu", missing_functions=["nvmlEventSetWait_v2"]),
        nothing,
        shows=xid_errors,
    ),
    Outage(
        "procfs",
        "--proc-root missing",
        lambda: load_scenario("single-gpu"),
        proc_root_missing,
        proc_tree_gone=True,
    ),
    Outage(
        "podresources", "kubelet socket gone", lambda: load_scenario("single-gpu"), kubelet_gone
    ),
    Outage(
        "kube", "API server answers 500", lambda: load_scenario("single-gpu"), api_server_failing
    ),
    Outage(
        "kube",
        "kubelet socket gone and API server answers 500",
        lambda: load_scenario("single-gpu"),
        kubelet_and_api_down,
    ),
    Outage(
        "kube",
        "API server answers 500 on a DRA node",
        lambda: load_scenario("dra"),
        api_server_failing,
    ),
    Outage(
        "resourceslices",
        "ResourceSlices forbidden on a DRA node",
        lambda: load_scenario("dra"),
        resourceslices_forbidden,
    ),
)


@dataclass
class Served:
    """What one run served: the alerts' inputs at each cycle, and the last scrape."""

    scrapes: list[Scrape]
    epoch: float  # wall-clock seconds of simulated time 0

    @property
    def last(self) -> Scrape:
        return self.scrapes[-1]


async def serve_through(scenario: Scenario, inject: Inject, *, proc_tree_gone: bool) -> Served:
    async with simulated_exporter(scenario) as h:
        scrapes = [await h.scrape()]
        await inject(h)
        for _ in range(CYCLES):
            if proc_tree_gone:  # the simulator writes under the proc root it no longer has
                h.clock.advance(STEP_S)
                await h.agent.cycle()
            else:
                await h.advance(STEP_S)
                await h.refresh_pod_resources()
            scrapes.append(await h.scrape())
        return Served(scrapes, h.env.node.wall_time(0))


def input_series(served: Served) -> list[dict[str, str]]:
    """promtool input_series: each alert input as served at each cycle (``_`` where
    absent), then its last value held for HOLD_S; timestamps rebased to simulated time."""
    keys = sorted(
        {(n, labels) for s in served.scrapes for n in ALERT_INPUTS for labels in s.series(n)}
    )
    out = []
    for name, labels in keys:
        values = []
        for scrape in served.scrapes:
            value = scrape.series(name).get(labels)
            if value is not None and name == FIRST_SEEN:
                value -= served.epoch
            values.append("_" if value is None else repr(value))
        if values[-1] != "_":
            values.append(f"{values[-1]}x{HOLD_S // STEP_S}")
        selector = ",".join(f'{k}="{v}"' for k, v in sorted(labels))
        out.append({"series": f"{name}{{{selector}}}", "values": " ".join(values)})
    return out


def promtool_quiet(groups: list[tuple[str, Served]], tmp_path: Path) -> str:
    """Run every group against the shipped rules expecting the three alerts quiet at
    every 5 minutes to the end; promtool's output ('' when all held)."""
    end = CYCLES * STEP_S + HOLD_S
    tests = [
        {
            "name": name,
            "interval": f"{STEP_S}s",
            "input_series": input_series(served) or [{"series": "up", "values": "1"}],
            "alert_rule_test": [
                {"eval_time": f"{t}s", "alertname": alert, "exp_alerts": []}
                for t in range(300, end + 1, 300)
                for alert in ALERTS_UNDER_TEST
            ],
        }
        for name, served in groups
    ]
    path = tmp_path / "outages.test.yaml"
    rules = str(ALERTS / "gpu-occupancy-exporter.rules.yaml")
    path.write_text(yaml.safe_dump({"rule_files": [rules], "tests": tests}, sort_keys=False))
    result = run_promtool("test", "rules", path.name, cwd=tmp_path)
    return "" if result.returncode == 0 else result.stdout


def over_zero(scrape: Scrape, name: str) -> int:
    return sum(1 for v in scrape.series(name).values() if v > 0)


def served_state(outage: Outage, served: Served) -> str:
    """A few words on what the exporter served at the end of the outage."""
    last = served.last
    down = [
        f"{labels['source']}_up=0" for labels, v in last.find("gpu_exporter_source_up") if v == 0
    ]
    owners = sorted(
        {
            f"{labels['owner']}/{labels['reason']}" if labels.get("reason") else labels["owner"]
            for labels, _ in last.find("gpu_unattributed_memory_used_bytes")
        }
    )
    gpus_up = sum(1 for _, v in last.find("gpu_up") if v == 1)
    return (
        f"{', '.join(down) or 'every source up'}, gpu_up=1 on {gpus_up} GPU(s), "
        f"unattributed owners {owners or 'none'}"
    )


async def test_no_source_outage_fires_an_orphan_or_leak_alert(
    record_fault: RecordFault, tmp_path: Path
) -> None:
    runs = []
    for outage in OUTAGES:
        served = await serve_through(
            outage.scenario(), outage.inject, proc_tree_gone=outage.proc_tree_gone
        )
        label = f"{outage.source}: {outage.what}"
        assert outage.visible_in(served.last), label
        for i, scrape in enumerate(served.scrapes):
            assert over_zero(scrape, ORPHANED) == 0, f"{label}: orphans served at cycle {i}"
            assert over_zero(scrape, LEAK) == 0, f"{label}: a leak served at cycle {i}"
        runs.append((outage, served))
    quiet = await asyncio.to_thread(
        promtool_quiet, [(f"{o.source}: {o.what}", s) for o, s in runs], tmp_path
    )
    assert quiet == "", quiet

    # The control: a real orphan, served and converted the same way, does fire.
    kill = SimEvent(at=1, action="kill", args={"value": 4242})
    control_scenario = load_scenario("single-gpu")
    control_scenario.timeline = [kill]
    control = await serve_through(control_scenario, nothing, proc_tree_gone=False)
    assert over_zero(control.last, ORPHANED) == 1
    fired = await asyncio.to_thread(promtool_quiet, [("control", control)], tmp_path)
    assert "alertname: GPUOrphanedMemory," in fired, fired
    assert "alertname: GPUOrphanedMemoryLarge," in fired, fired

    table = "; ".join(f"{o.source} ({o.what}): {served_state(o, s)}" for o, s in runs)
    record_fault(
        "data-source-outage-no-false-alerts",
        expected=(
            "With any one of the exporter's sources down (NVML, XID, procfs, PodResources, "
            "the pod watch, ResourceSlices) no orphan or unallocated-use series is served "
            "and GPUOrphanedMemory, GPUOrphanedMemoryLarge and GPUIsolationLeak stay quiet "
            "in promtool over the served series; a real dead process's memory fires both "
            "orphan alerts through the same path."
        ),
        figure=(
            f"{len(runs)} outages x {CYCLES} cycles {STEP_S} s apart, held {HOLD_S} s: "
            f"0 orphan and 0 leak series, 0 alerts. Served: {table}. Fixed on the way: "
            "--proc-root missing served every pid as a dead_process orphan; the API "
            "server down served every DRA pod as a deleted_pod orphan."
        ),
    )
