"""A GPU that falls off the bus again and again: every XID counted once, on its GPU.

The soak (benchmarks/soak.py) found that from a GPU's second fall off the bus on, NVML's
copy of the XID 79 came without a GPU: the simulated driver gives a GPU back from being
lost a new handle (exporter/sim/nvml_library.py), the event set names the GPU by that
handle, and the listener only knew the handle it registered. The ledger then could not
pair it with the kernel log's copy (which names the PCI bus and resolves to the GPU), and
counted the XID twice, once on no GPU. These tests drive the real path: the simulated
node, the NVML listener, the kernel-log reader, the ledger and a scrape over HTTP.
"""

from __future__ import annotations

import asyncio
from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from exporter.agent import build_agent
from exporter.analysis.xid import XidKey, XidLedger
from exporter.config import parse_config
from exporter.exposition.server import MetricsCache
from exporter.model import XidEvent
from exporter.sim.external import NodeProcess, attach
from exporter.sim.node import ManualClock, SimNode
from exporter.sim.scenario import parse_scenario
from exporter.sources.kmsg import KmsgReader
from tests.harness import Scrape, simulated_exporter

PERIOD_S, DOWN_S = 30, 10


def flapping(flaps: int) -> dict[str, Any]:
    """Two GPUs; GPU 1 raises XID 79, falls off the bus and is back ``DOWN_S`` later,
    ``flaps`` times (as churn.py's ``gpu_flap`` does)."""
    timeline: list[dict[str, Any]] = []
    for n in range(flaps):
        at = 10 + n * PERIOD_S
        timeline += [
            {"at": at, "xid": {"gpu": 1, "code": 79}},
            {"at": at, "lose": 1},
            {"at": at + DOWN_S, "restore": 1},
        ]
    return {"gpus": [{}, {}], "timeline": timeline}


def xid_series(scrape: Scrape) -> dict[tuple[str, str], float]:
    return {
        (labels["gpu"], labels["xid"]): value
        for labels, value in scrape.find("gpu_xid_errors_total")
    }


@pytest.mark.parametrize("flaps", [2, 3])
async def test_each_fall_off_the_bus_is_counted_once_on_its_gpu(flaps: int) -> None:
    async with simulated_exporter(flapping(flaps), argv=["--kmsg"]) as h:
        for _ in range(flaps * PERIOD_S // 5):
            await h.advance(5)
        scrape = await h.scrape()
        kmsg = h.source("kmsg")
        assert isinstance(kmsg, KmsgReader)
        read_from_log = kmsg.events_total
    assert read_from_log == flaps  # the kernel log's copies were read...
    assert h.xid_listener.events_total == flaps  # ...and NVML's
    assert xid_series(scrape) == {("1", "79"): flaps}  # each pair counted once, on GPU 1
    assert scrape.get("gpu_healthy", gpu="1") == 0  # fatal XID within the health window


# -- the node in a process of its own (as the soak runs it) ----------------------------


def churned_node_8gpu(directory: Path, seconds: int, **churn: Any) -> Path:
    shipped = resources.files("exporter.sim").joinpath("scenarios/node-8gpu.yaml")
    data = yaml.safe_load(shipped.read_text())
    data["churn"] = {"seconds": seconds, **churn}
    path = directory / "node-8gpu-churn.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_a_churned_scenario_keeps_its_timeline_before_time_zero() -> None:
    """node-8gpu raises XID 13 on GPU 2 900 s before the exporter starts; churn made the
    timeline from second 0 on and dropped it."""
    shipped = resources.files("exporter.sim").joinpath("scenarios/node-8gpu.yaml")
    data = yaml.safe_load(shipped.read_text())
    data["churn"] = {"seconds": 100}
    scenario = parse_scenario(data, "node-8gpu-churn")
    node = SimNode(scenario, ManualClock())
    node.advance()
    assert [(x.at, x.gpu, x.code) for x in node.xids] == [(-900, 2, 13)]
    assert [e.at for e in scenario.timeline[:1]] == [-900]


@pytest.mark.slow
async def test_history_and_flaps_on_a_node_in_its_own_process(tmp_path: Path) -> None:
    """The soak's setting: the node serves its kernel log from another process, the
    exporter loads the same scenario's NVML library, churn flaps GPU 5 three times."""
    (tmp_path / "node").mkdir()
    period = 60
    node = NodeProcess(
        str(churned_node_8gpu(tmp_path, 3 * period, gpu_flap=5, gpu_flap_period_s=period)),
        tmp_path / "node",
    )
    try:
        attached = attach(tmp_path / "node")
        config = parse_config([*attached.paths.flags(), "--dcgm=off", "--kmsg"], env={})
        start = 1_700_000_000.0
        agent = build_agent(config, MetricsCache(), wall_clock=lambda: start + node.clock())
        for source in agent.sources:
            source.start()
        kmsg = agent.source("kmsg")
        assert isinstance(kmsg, KmsgReader)
        try:
            assert kmsg.wait_caught_up(30.0)
            for _ in range(3 * period):
                node.advance(1.0)
                await agent.cycle()
                await _kernel_log_read(kmsg, len(attached.library.node.xids))
            await agent.cycle()
            latest = agent.latest
            assert latest is not None
        finally:
            await agent.close()
    finally:
        node.stop()
    counts = {(c.gpu, c.xid): c.count for c in latest.xid_counts}
    before = {(c.gpu, c.xid): c.count for c in latest.xid_counts_before_start}
    assert before == {(2, 13): 1}  # the XID 13 from 900 s before start, as history
    assert counts[(5, 79)] == 3  # each of GPU 5's falls once...
    assert [key for key in counts if key[0] is None] == []  # ...and none on no GPU
    assert (2, 13) not in counts


async def _kernel_log_read(kmsg: KmsgReader, xids: int) -> None:
    """Wait (real time, simulated time standing still) until the reader has read every
    XID the node raised, its backlog included (as benchmarks/soak.py does)."""
    for _ in range(500):
        if kmsg.events_total >= xids:
            return
        await asyncio.sleep(0.01)


# -- a kernel-log XID on a PCI bus no GPU was ever seen on ----------------------------


def test_an_xid_on_an_unknown_bus_is_counted_once_with_nvmls_copy_that_names_no_gpu() -> None:
    """Real evidence of an XID on the node: counted with no GPU, never dropped, and the
    NVML copy that could not name its GPU either is the same XID, not a second one."""
    nvml = XidEvent(gpu=None, uuid=None, xid=79, timestamp=100.0, source="nvml")
    kmsg = XidEvent(
        gpu=None, uuid=None, xid=79, timestamp=101.0, source="kmsg", pci_bus_id="0000:99:00"
    )
    known = {"00000000:3B:00.0": (0, "GPU-a")}
    ledger = XidLedger().record([nvml], 100.0, known).record([kmsg], 101.0, known)
    assert dict(ledger.counts) == {XidKey(None, None, 79, "fatal"): 1}
