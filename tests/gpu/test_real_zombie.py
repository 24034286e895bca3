"""Orphaned memory on real hardware: a process allocates GPU memory, forks a child that
inherits the device files, and is SIGKILLed. The exporter must report the memory the
driver still holds and name the child as its holder.

Drivers differ in what they list afterwards, and either is accepted: the dead parent
still listed with its memory (``dead_process``: an H200 on driver 580.159.04 did this,
docs/orphans.md) or nobody listed (``unattributed``). In both the live child is the
holder, and the Event and log line never call the dead pid the holder."""

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
from exporter.model import KIND_DEAD_PROCESS, KIND_UNATTRIBUTED, HealthTransition
from exporter.reporting.events import describe
from tests.gpu.conftest import requires_gpu, requires_torch
from tests.gpu.workloads import WORKLOAD

pytestmark = [requires_gpu, requires_torch, pytest.mark.gpu]
HELD_MIB = 2048


def test_forked_child_keeps_a_killed_parents_memory_and_is_named(
    real_nvml: None, tmp_path: Path
) -> None:
    # asyncio.run, not an async test: a GPU host's Python may lack pytest-asyncio (the
    # H200's did)
    asyncio.run(_fork_kill_and_name(tmp_path))


async def _fork_kill_and_name(tmp_path: Path) -> None:
    script = tmp_path / "work.py"
    script.write_text(WORKLOAD)
    parent = subprocess.Popen(
        [sys.executable, str(script), "fork-hold", "120", str(HELD_MIB)],
        stdout=subprocess.PIPE,
        text=True,
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
    told: list[HealthTransition] = []
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
            told += [t for t in analysis.transitions if t.kind == "orphaned_memory"]
            holders = [h for h in analysis.orphan_holders if h.pid == child]
            gpus = {h.uuid for h in holders}
            orphans = [
                o
                for o in analysis.orphans
                if o.uuid in gpus and o.kind in (KIND_DEAD_PROCESS, KIND_UNATTRIBUTED)
            ]
            named = [t for t in told if t.uuid in gpus and any(h.pid == child for h in t.holders)]
            if orphans and holders and named:
                found = (orphans, holders, named, analysis.driver_held)
        assert found is not None, (
            "no dead_process or unattributed memory with the child named as holder (in the "
            f"series and in the Event) in 30 s; transitions: {told}"
        )
        orphans, holders, named, held = found
        kinds = {o.kind for o in orphans}
        print(f"driver listed the dead parent: {KIND_DEAD_PROCESS in kinds}; kinds {kinds}")
        # the memory is never unknown: the parent's listed bytes, or all of the excess
        assert sum(o.memory_used_bytes or 0 for o in orphans) >= HELD_MIB * 2**20 * 0.9
        assert holders[0].role == "holder"
        assert not any(v.only_drivers for v in held if v.uuid in {h.uuid for h in holders})
        for t in named:
            _, _, note = describe(t)
            assert f"pid {child}" in note
            if t.orphan_kind == KIND_DEAD_PROCESS:
                assert t.dead_pids == (parent.pid,)
                assert f"listed for dead pid {parent.pid}; held open by" in note, note
            assert f"held by pid {parent.pid}" not in note, note
        print(f"orphaned: {orphans}\nholders: {holders}\nnotes: {[describe(t)[2] for t in named]}")
    finally:
        os.kill(child, signal.SIGKILL)
        await agent.close()
