"""The simulated node in a process of its own, so the exporter's figures are its own.

On a real node the only GPU code inside the exporter is libnvidia-ml; the proc tree, the
kubelet and the API server belong to other processes. ``serve()`` (``python -m
exporter.sim``) runs a simulated node's outer edge — proc tree, kernel log, kubelet gRPC
socket, API stand-in — and describes it in ``<dir>/node.json``; ``attach(dir)``, in the
exporter's process (``--simulated-node DIR``), loads the same scenario into the simulated
NVML library alone. Both sides derive the node's state from the scenario and a clock they
share, so they agree without talking: the real monotonic clock (``CLOCK_MONOTONIC`` is
one clock for every process of a machine), or a ``SharedClock`` file that a benchmark
advances faster than real time. ``NodeProcess`` runs ``serve`` under such a driver.
"""

from __future__ import annotations

import asyncio
import json
import mmap
import multiprocessing
import os
import signal
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from exporter.sim.cost_model import CostProfileError
from exporter.sim.node import SimNode, monotonic_clock
from exporter.sim.nvml_library import SimNvmlLibrary, install
from exporter.sim.paths import SimPaths
from exporter.sim.scenario import ScenarioError, load_scenario

if TYPE_CHECKING:
    from exporter.sim.environment import SimEnvironment

NODE_FILE = "node.json"
CLOCK_FILE = "clock"
_CLOCK = struct.Struct("d")


class SharedClock:
    """Simulated seconds in an 8-byte file that every process of the simulation maps."""

    def __init__(self, path: Path, *, create: bool = False) -> None:
        if create:
            path.write_bytes(_CLOCK.pack(0.0))
        with path.open("r+b") as f:
            self._map = mmap.mmap(f.fileno(), _CLOCK.size)

    def __call__(self) -> float:
        return float(_CLOCK.unpack_from(self._map)[0])

    def advance(self, seconds: float) -> None:
        _CLOCK.pack_into(self._map, 0, self() + seconds)


@dataclass(frozen=True)
class Attached:
    paths: SimPaths
    library: SimNvmlLibrary
    scenario_name: str


def _describe(
    directory: Path,
    scenario: str,
    paths: SimPaths,
    clock: dict[str, Any],
    cost: str | None = None,
) -> None:
    """Write node.json atomically: its presence says the node is ready."""
    data = {
        "scenario": scenario,
        "clock": clock,
        # the NVML cost profile every attached library applies (None: the scenario's)
        "cost": cost,
        "proc_root": str(paths.proc_root),
        "kmsg": str(paths.kmsg),
        "pod_resources_socket": str(paths.pod_resources_socket),
        "kubeconfig": str(paths.kubeconfig) if paths.kubeconfig else None,
        "node_name": paths.node_name,
        "cgroup_root": str(paths.cgroup_root) if paths.cgroup_root else None,
        "pid": os.getpid(),
    }
    tmp = directory / f".{NODE_FILE}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(directory / NODE_FILE)


def _clock(directory: Path, spec: dict[str, Any]) -> Callable[[], float]:
    if spec["kind"] == "shared":
        return SharedClock(directory / CLOCK_FILE)
    # start_s and speed: --simulate-start and --simulate-speed of the serving process
    return monotonic_clock(
        float(spec.get("start_s", 0.0)),
        float(spec.get("speed", 1.0)),
        origin=float(spec["monotonic_start"]),
    )


def attach(directory: Path) -> Attached:
    """Load the NVML library of the simulated node another process serves in
    ``directory``: the only part of the simulation inside the exporter."""
    try:
        data = json.loads((directory / NODE_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ScenarioError(
            f"{directory / NODE_FILE}: no simulated node described there ({exc}); "
            "start one with 'python -m exporter.sim SCENARIO --dir DIR'"
        ) from None
    scenario = load_scenario(data["scenario"])
    node = SimNode(scenario, _clock(directory, data["clock"]))
    kubeconfig = data["kubeconfig"]
    paths = SimPaths(
        proc_root=Path(data["proc_root"]),
        kmsg=Path(data["kmsg"]),
        pod_resources_socket=Path(data["pod_resources_socket"]),
        kubeconfig=Path(kubeconfig) if kubeconfig else None,
        node_name=data["node_name"],
        cgroup_root=Path(data["cgroup_root"]) if data.get("cgroup_root") else None,
    )
    try:
        # measured whole (benchmarks/): no call counting inside the measured process
        library = install(node, count_calls=False, cost=data.get("cost"))
    except CostProfileError as exc:
        raise ScenarioError(f"{directory / NODE_FILE}: {exc}") from None
    return Attached(paths, library, scenario.name)


async def serve(
    scenario: str,
    directory: Path,
    *,
    kube_api: bool = True,
    shared_clock: bool = False,
    start_s: float = 0.0,
    speed: float = 1.0,
    cost: str | None = None,
) -> SimEnvironment:
    """Start the node's outer edge (no NVML library) and describe it in ``directory``;
    ``start_s`` and ``speed`` set its monotonic clock (node.py ``monotonic_clock``);
    ``cost``, a cost profile (sim/cost_model.py) every exporter attached here applies in
    place of the scenario's ``cost:``."""
    from exporter.sim.environment import SimEnvironment  # not needed by attach()

    spec: dict[str, Any]
    if shared_clock:
        clock: Callable[[], float] = SharedClock(directory / CLOCK_FILE, create=True)
        spec = {"kind": "shared"}
    else:
        origin = time.monotonic()
        clock = monotonic_clock(start_s, speed, origin=origin)
        spec = {"kind": "monotonic", "monotonic_start": origin, "start_s": start_s, "speed": speed}
    env = SimEnvironment(load_scenario(scenario), clock=clock, kube_api=kube_api, nvml=False)
    paths = await env.start()
    _describe(directory, scenario, paths, spec, cost)
    return env


async def serve_until_signalled(
    scenario: str,
    directory: Path,
    *,
    kube_api: bool,
    start_s: float = 0.0,
    speed: float = 1.0,
    cost: str | None = None,
) -> None:
    env = await serve(
        scenario, directory, kube_api=kube_api, start_s=start_s, speed=speed, cost=cost
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await env.stop()
        (directory / NODE_FILE).unlink(missing_ok=True)


# -- a node process that a benchmark drives --------------------------------------------


def _node_process_main(scenario: str, directory: str, kube_api: bool, conn: Connection) -> None:
    """In the node process: serve, then answer the driver's commands until 'stop'."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver stops it

    async def main() -> None:
        env = await serve(scenario, Path(directory), kube_api=kube_api, shared_clock=True)
        conn.send("ready")
        try:
            while True:
                command = await asyncio.to_thread(conn.recv)
                if command == "stop":
                    break
                if command == "sync":
                    env.sync()
                elif command == "expire_history" and env.kube_api is not None:
                    env.kube_api.expire_history()
                conn.send("ok")
        finally:
            await env.stop()
        conn.send("stopped")

    asyncio.run(main())


class NodeProcess:
    """A simulated node in a child process on a ``SharedClock`` the driver advances:
    ``advance(s)`` moves simulated time and brings the node's files and servers up to it."""

    def __init__(self, scenario: str, directory: Path, *, kube_api: bool = True) -> None:
        self.directory = directory
        ctx = multiprocessing.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.process = ctx.Process(
            target=_node_process_main,
            args=(scenario, str(directory), kube_api, child),
            name="sim-node",
            daemon=True,
        )
        self.process.start()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            self.process.kill()
            raise RuntimeError(f"the simulated node {scenario!r} did not start within 60 s")
        self.clock = SharedClock(directory / CLOCK_FILE)

    def command(self, name: str) -> None:
        self._conn.send(name)
        if self._conn.recv() != "ok":
            raise RuntimeError(f"simulated node: {name} failed")

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.command("sync")

    def stop(self) -> None:
        if self.process.is_alive():
            self._conn.send("stop")
            self._conn.poll(10)
            self.process.join(10)
        if self.process.is_alive():
            self.process.kill()
