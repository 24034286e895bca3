"""Orphaned memory on real hardware: a process allocates GPU memory, forks a child that inherits
the device files, and is SIGKILLed. The exporter must report the memory the driver still
holds and name the child as its holder."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from exporter.agent import build_agent
from exporter.config import parse_config
from exporter.exposition.server import MetricsCache
from tests.gpu.conftest import requires_gpu, requires_torch
from tests.gpu.workloads import WORKLOAD

pytestmark = [requires_gpu, requires_torch, pytest.mark.gpu]


async def test_forked_child_keeps_a_killed_parents_memory_and_is_named(
    real_nvml: None, tmp_path: Path
) -> None:
    script = tmp_path / "work.py"
    script.write_text(WORKLOAD)
    parent = subprocess.Popen(
        [sys.executable, str(script), "fork-hold", "120", "2048"], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert parent.stdout.readline().strip() == "ready"
    config = parse_config(
        [
            "--kube-api",
            "off",
            "--dcgm",
            "off",
            "--orphan-cycles",
            "2",
            "--orphan-threshold",
            "512",
            "--interval",
            "1",
        ],
        env={},
    )
    agent = build_agent(config, MetricsCache())
    try:
        await agent.start()
        await agent.cycle()
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        found = None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and found is None:
            await asyncio.sleep(1.0)
            await agent.cycle()
            analysis = agent.latest
            assert analysis is not None
            unattributed = [o for o in analysis.orphans if o.kind == "unattributed"]
            holders = [h for h in analysis.orphan_holders if h.pid == child]
            if unattributed and holders:
                found = (unattributed, holders)
        assert found is not None, "no unattributed memory with the child as holder in 30 s"
        unattributed, holders = found
        # unattributed memory is never unknown (no listed process in it)
        assert sum(o.memory_used_bytes or 0 for o in unattributed) >= 2048 * 2**20 * 0.9
        assert holders[0].role == "holder"
        print(f"orphaned: {unattributed}\nholders: {holders}")  # for docs/validation.md
    finally:
        os.kill(child, signal.SIGKILL)
        await agent.close()
