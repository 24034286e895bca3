"""Series per GPU on real hardware, next to docs/metrics.md's tables measured on the
simulator, and --families-disable on real NVML. Results go in docs/validation.md."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Sequence

import pytest
from prometheus_client.exposition import generate_latest

from exporter.agent import build_agent
from exporter.config import parse_config
from exporter.exposition.server import MetricsCache
from tests.cardinality import Measurement, unit_of
from tests.gpu.conftest import requires_gpu

pytestmark = [requires_gpu, pytest.mark.gpu]

OFF_HOST = ["--kube-api", "off", "--dcgm", "off", "--pod-resources-socket", "/nonexistent.sock"]


async def _served(argv: Sequence[str]) -> Measurement:
    """Two cycles a second apart (GPM needs two samples) of the real exporter."""
    agent = build_agent(parse_config([*OFF_HOST, *argv], env={}), MetricsCache())
    seen = Measurement()
    try:
        await agent.start()
        await agent.cycle()
        await asyncio.sleep(1.0)
        await agent.cycle()
        seen.add(generate_latest(agent.registry).decode())
    finally:
        await agent.close()
    return seen


def _per_gpu(m: Measurement) -> dict[str, Counter[str]]:
    """Series of each family per GPU uuid (whole-GPU scope only)."""
    out: dict[str, Counter[str]] = {}
    for family, series in m.series.items():
        for _, labels in series:
            scope, key = unit_of(dict(labels))
            if scope == "GPU":
                out.setdefault(key[0], Counter())[family] += 1
    return out


def test_real_series_per_gpu_and_disabled_families(real_nvml: None) -> None:
    default = asyncio.run(_served([]))
    everything = asyncio.run(_served(["--families-enable", "*"]))
    trimmed = asyncio.run(_served(["--families-disable", "gpu_clock_event_*,gpu_pcie_*"]))
    for name, m in (("default", default), ("everything", everything)):
        for uuid, families in _per_gpu(m).items():
            print(f"{name} {uuid}: {sum(families.values())} series", dict(sorted(families.items())))
    per_gpu = _per_gpu(default)
    assert per_gpu, "no per-GPU series served"
    for families in per_gpu.values():
        assert families["gpu_info"] == 1 and families["gpu_up"] == 1
    assert not {f for f in trimmed.series if f.startswith(("gpu_clock_event_", "gpu_pcie_"))}
    assert {f for f in trimmed.series if f.startswith("gpu_exporter_")} == {
        f for f in default.series if f.startswith("gpu_exporter_")
    }
