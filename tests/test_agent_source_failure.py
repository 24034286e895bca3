"""A sampled source whose read raises (a bug, or a fault nobody foresaw) is down in that
cycle's ``gpu_exporter_source_up``, with a reason, whatever its own status says: it
was left up while its reading was missing (an adversarial review)."""

from __future__ import annotations

from typing import ClassVar

from exporter.agent import Agent
from exporter.config import parse_config
from exporter.exposition.server import MetricsCache
from exporter.model import SourceName, SourceStatus
from exporter.sources.base import Cycle, Source


class Flaky(Source):
    """Stands in for a source whose read escapes; it claims to be up all the while."""

    name: ClassVar[SourceName] = "cgroups"

    def __init__(self) -> None:
        self.fail = True

    def fill(self, cycle: Cycle) -> None:
        if self.fail:
            raise PermissionError(13, "Permission denied", "/sys/fs/cgroup/kubepods.slice")

    def status(self) -> SourceStatus:
        return SourceStatus(self.name, True)


async def test_a_source_whose_read_raises_is_down_with_the_reason_then_up_again() -> None:
    config = parse_config(["--node-name", "n", "--kube-api", "off"], env={})
    source = Flaky()
    agent = Agent(config, MetricsCache(), [source], wall_clock=lambda: 100.0)
    await agent.cycle()
    assert agent.latest is not None
    (status,) = agent.latest.node.sources
    assert status.up is False
    assert status.error == "reading failed (PermissionError); see the exporter's log"
    assert status.last_success is None  # never up
    source.fail = False
    await agent.cycle()
    (status,) = agent.latest.node.sources
    assert status.up is True and status.last_success == 100.0
