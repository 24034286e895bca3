"""Memory truth: the running exporter's RSS beside the RSS of its imports alone.

Importing the packages a configuration uses costs most of the exporter's memory before
it reads anything (Python, aiohttp, grpcio, prometheus-client, pynvml, and the
``kubernetes`` client where an API server is configured), so a fixed RSS target says
more about those packages than about the exporter. The figure that is the exporter's own
is the distance from that floor: the running process's RSS minus the RSS of a process
that only imports what the running one imported.

How: the exporter runs as a user runs it (``python -m exporter --simulated-node DIR``,
``--interval 1``, scraped every 5 s in OpenMetrics) on ``node-8gpu`` with churn (the
simulator's ``churn:`` block, as benchmarks/soak.py: a new worker pid every second living
20 s, a pod ``churn/job-N`` created and deleted every 60 s, GPU 5 lost after an XID 79
and back every 600 s). It is started as ``python -m exporter`` is, through ``runpy``,
with an exit hook that writes the names in ``sys.modules`` (every module it imported,
whenever it did, the lazy imports of a source's first connection included; ``python -X
importtime`` misses those loaded by ``importlib.import_module``). After the run a fresh
interpreter imports exactly those modules, in the order they were first imported, and
reports its RSS: the import floor. The running exporter's RSS is sampled every few seconds
over the window; the figure is the last sample after a garbage collection has had time to
run, with the window's highest beside it.

Importing grpcio does not start gRPC core: its first channel does, and the code that runs
then maps about 4 MiB more of ``cygrpc.so`` (file-backed pages of a shared library, the
same at 1 GPU or 16, for 8 pods or 500). So the same floor process then makes one
PodResources round (``List`` and ``GetAllocatableResources``, the exporter's own client)
against the same simulated kubelet, before the node stops, and reports its RSS again: the
floor of the chosen packages imported and started. The target (within 6 MiB) is judged
against that floor; the distance from the import-only floor is reported beside it, with
its anonymous and file-backed parts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from processes import (
    OPENMETRICS_ACCEPT,
    ROOT,
    ExporterProcess,
    NodeServer,
    PeriodicScraper,
    all_sources_up,
    exporter_argv,
    free_port,
    memory_mib,
    running,
)

SCENARIO = "node-8gpu"
TARGET_OVER_FLOOR_MIB = 6.0
# Never imported by the floor: running them would start a program.
NOT_IMPORTED = ("__main__",)
# ``python -c MODULES_AT_EXIT ARGS...`` is ``python -m exporter ARGS...`` that writes the
# names in sys.modules to $EXPORTER_MODULES_FILE (JSON) on its way out.
MODULES_AT_EXIT = """
import atexit, json, os, runpy, sys
def _write():
    with open(os.environ["EXPORTER_MODULES_FILE"], "w") as f:
        json.dump(list(sys.modules), f)
atexit.register(_write)
runpy.run_module("exporter", run_name="__main__", alter_sys=True)
"""

# Input: {"modules": [...], "socket": the kubelet socket}. Output: the RSS after the imports,
# and again after one PodResources round has started gRPC core.
FLOOR_SCRIPT = """
import asyncio, gc, importlib, json, sys
from exporter import allocator
allocator.limit_arenas()  # the malloc settings the exporter sets before its threads start
asked = json.loads(sys.stdin.read())
failed = []
for name in asked["modules"]:
    try:
        importlib.import_module(name)
    except Exception as exc:  # a module that only imports inside its own package's set-up
        failed.append(f"{name}: {type(exc).__name__}")
def status():
    fields = dict(l.split(":", 1) for l in open("/proc/self/status") if ":" in l)
    mib = lambda k: int(fields[k].split()[0]) / 1024
    return {"rss": mib("VmRSS"), "anon": mib("RssAnon"), "file": mib("RssFile")}
imported = status()
from exporter.sources.podresources.client import PodResourcesClient
answer = asyncio.run(PodResourcesClient(asked["socket"]).fetch())
round_ok, error = answer.ok, answer.error
del answer
gc.collect()
print(json.dumps({**imported, "modules": len(sys.modules), "not_importable": len(failed),
                  "grpc_started": status(), "round_ok": round_ok, "error": error}))
"""


@dataclass(frozen=True)
class FloorPlan:
    warmup_s: float  # after every source is up
    window_s: float  # RSS sampled over this long, churn going on
    sample_every_s: float = 5.0


FULL = FloorPlan(warmup_s=30, window_s=150)
QUICK = FloorPlan(warmup_s=10, window_s=40)


def churn_scenario(directory: Path, seconds: int) -> Path:
    """node-8gpu plus churn for ``seconds`` (benchmarks/soak.py's churning node)."""
    shipped = resources.files("exporter.sim").joinpath(f"scenarios/{SCENARIO}.yaml")
    data = yaml.safe_load(shipped.read_text(encoding="utf-8"))
    data["churn"] = {"seconds": seconds, "gpu_flap": 5, "gpu_flap_period_s": 600}
    path = directory / f"{SCENARIO}-churn.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def imported_modules(written: Path) -> list[str]:
    """The names the exit hook wrote, in import order, less the programs' mains."""
    names: list[str] = json.loads(written.read_text())
    return [n for n in names if n.rpartition(".")[2] not in NOT_IMPORTED]


def import_floor(modules: list[str], socket: Path) -> dict[str, Any]:
    """RSS of a fresh interpreter (same Python, same path) that imports ``modules``, and
    its RSS once one PodResources round on ``socket`` has started gRPC core."""
    done = subprocess.run(
        [sys.executable, "-c", FLOOR_SCRIPT],
        input=json.dumps({"modules": modules, "socket": str(socket)}),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=True,
    )
    result: dict[str, Any] = json.loads(done.stdout)
    if not result["round_ok"]:  # gRPC core not started: that floor would be too low
        raise RuntimeError(f"the floor's PodResources round failed: {result['error']}")
    return result


def malloc_setting() -> dict[str, str]:
    """The glibc malloc settings the exporter ran under: the environment's, else the
    exporter's own (exporter/allocator.py: two arenas, a 128 KiB mmap threshold, set by
    mallopt at start-up). The floor process runs under the same environment and sets the
    same defaults first."""
    return {
        name: os.environ.get(name, "unset: the exporter's mallopt default")
        for name in ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_")
    }


def measure(plan: FloorPlan) -> dict[str, Any]:
    """RSS of our exporter on churning node-8gpu, the import floor, and the distance."""
    with tempfile.TemporaryDirectory(prefix="gpusim-churn-") as tmp:
        seconds = int(plan.warmup_s + plan.window_s + 120)
        node = NodeServer(str(churn_scenario(Path(tmp), seconds)))
        try:
            port = free_port()
            written = Path(tmp) / "modules.json"
            argv = exporter_argv(node.dir, port, 1.0)
            assert argv[1:3] == ["-m", "exporter"]
            ours = ExporterProcess(
                [argv[0], "-c", MODULES_AT_EXIT, *argv[3:]],
                port,
                ready_when=all_sources_up(),
                env={"EXPORTER_MODULES_FILE": str(written)},
                name="gpu-occupancy-exporter",
            )
            samples: list[dict[str, float]] = []
            with running(ours), PeriodicScraper(port, 5.0, OPENMETRICS_ACCEPT):
                time.sleep(plan.warmup_s)
                deadline = time.monotonic() + plan.window_s
                while time.monotonic() < deadline:
                    samples.append(memory_mib(ours.pid))
                    time.sleep(plan.sample_every_s)
                samples.append(memory_mib(ours.pid))
            modules = imported_modules(written)  # running() stopped it: the hook has run
            floor = import_floor(modules, Path(node.description["pod_resources_socket"]))
        finally:
            node.stop()
    started = floor["grpc_started"]
    last = samples[-1]
    return {
        "scenario": f"{SCENARIO} with churn",
        "plan": plan.__dict__,
        "malloc": malloc_setting(),
        "running": last,
        "running_max_rss": max(s["rss"] for s in samples),
        "samples": samples,
        "floor": floor,
        "modules": len(modules),
        "over_floor_mib": last["rss"] - floor["rss"],
        "anon_over_floor_mib": last["anon"] - floor["anon"],
        "over_started_floor_mib": last["rss"] - started["rss"],
        "target_over_floor_mib": TARGET_OVER_FLOOR_MIB,
    }


if __name__ == "__main__":
    import argparse

    from machine import machine_line

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    out = measure(QUICK if args.quick else FULL)
    out.pop("samples")
    print(machine_line())
    print(json.dumps(out, indent=2))
