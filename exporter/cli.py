"""Command line entry point: validate everything, bind, then start the sources."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from exporter import allocator
from exporter.agent import Agent, build_agent
from exporter.config import Config, ConfigError, fail, parse_config
from exporter.exposition.liveness import Liveness
from exporter.exposition.readiness import Readiness
from exporter.exposition.server import MetricsCache, build_app, start_server
from exporter.exposition.web_config import WebConfigError
from exporter.exposition.web_security import WebSecurity
from exporter.logs import setup_logging
from exporter.model.families import selectable
from exporter.snapshot import render_json, render_text
from exporter.sources.podresources.source import PodResourcesSource

if TYPE_CHECKING:
    from exporter.sim.environment import SimEnvironment
    from exporter.sim.paths import SimPaths
    from exporter.sim.scenario import Scenario

log = logging.getLogger("exporter")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv)
        scenario = _load_scenario(config.simulate) if config.simulate else None
    except ConfigError as exc:
        fail(str(exc))
    # A scrape waiting for the GIL while a cycle runs on the sample thread waits up to
    # the switch interval (5 ms by default). 0.5 ms keeps scrape latency tails short: on
    # node-8gpu, scraped every 10 ms while cycles run, p99 1.9 ms at 1 ms and 1.5 ms at
    # 0.5 ms (benchmarks/README.md). It only matters while two threads want the GIL.
    sys.setswitchinterval(0.0005)
    allocator.limit_arenas()  # before any thread starts (exporter/allocator.py says why)
    quiet = {"snapshot": "warning", "doctor": "error"}  # the report is the output
    command = "doctor" if config.doctor else "snapshot" if config.snapshot else None
    setup_logging(
        quiet[command] if command and config.log_level == "info" else config.log_level,
        config.log_format,
    )
    try:
        if config.simulated_node is not None:
            config = _attached(config)
        if config.snapshot:
            return asyncio.run(take_snapshot(config, scenario))
        if config.doctor:
            try:
                return asyncio.run(doctor(config, scenario))
            except KeyboardInterrupt:
                return 130  # interrupted: no report, and not "nothing missing"
        asyncio.run(serve(config, scenario))
    except ConfigError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass
    return 0


def _load_scenario(name: str) -> Scenario:
    """The simulator is imported only under ``--simulate``."""
    from exporter.sim.scenario import ScenarioError, load_scenario

    try:
        return load_scenario(name)
    except ScenarioError as exc:
        raise ConfigError(str(exc)) from None


async def _simulated(config: Config, scenario: Scenario) -> tuple[Config, SimEnvironment]:
    """Start the simulated node and point the flags at it instead of the host."""
    from exporter.sim.environment import SimEnvironment
    from exporter.sim.node import monotonic_clock

    clock = monotonic_clock(config.simulate_start_s, config.simulate_speed)
    sim = SimEnvironment(scenario, clock=clock, kube_api=config.kube_api != "off")
    return _pointed_at(config, await sim.start()), sim


def _attached(config: Config) -> Config:
    """Load only the NVML library of a simulated node another process serves."""
    from exporter.sim.external import attach
    from exporter.sim.scenario import ScenarioError

    assert config.simulated_node is not None
    try:
        attached = attach(config.simulated_node)
    except ScenarioError as exc:
        raise ConfigError(f"--simulated-node: {exc}") from None
    log.info(
        "simulated node %s (%s) served from %s; only its NVML library is loaded here",
        attached.paths.node_name,
        attached.scenario_name,
        config.simulated_node,
    )
    return _pointed_at(config, attached.paths)


def _pointed_at(config: Config, paths: SimPaths) -> Config:
    return replace(
        config,
        proc_root=paths.proc_root,
        kmsg_path=paths.kmsg,
        pod_resources_socket=paths.pod_resources_socket,
        kubeconfig=str(paths.kubeconfig) if paths.kubeconfig else None,
        kube_api=config.kube_api if paths.kubeconfig else "off",
        node_name=paths.node_name,
        cgroup_root=paths.cgroup_root,  # the simulated tree, or off: never the host's
    )


# Cycles a snapshot takes at most: --orphan-cycles beyond it would make an operator wait
# minutes for one report; such orphans are the server's to confirm.
SNAPSHOT_MAX_CYCLES = 10
# How long shutdown waits for a password check under way (one at bcrypt's highest cost
# allowed takes ~0.25 s of a core; more under load).
SECURITY_JOIN_S = 2.0


async def take_snapshot(config: Config, scenario: Scenario | None) -> int:
    """Cycles ``--window`` apart through the exporter's own code path, then print: two
    (GPM occupancy needs two samples), or ``--orphan-cycles`` of them (at most
    ``SNAPSHOT_MAX_CYCLES``), so that orphans confirmed over that many cycles can show.
    Exit status 1 when NVML was down: the report says why, a script can tell."""
    sim = None
    if scenario is not None:
        config, sim = await _simulated(config, scenario)
    agent = build_agent(config, MetricsCache())
    try:
        await agent.start()
        await agent.cycle()
        cycles = max(2, min(config.orphan_cycles + 1, SNAPSHOT_MAX_CYCLES))
        for n in range(1, cycles):
            window = asyncio.sleep(config.snapshot_window_s)
            if n == 1:  # within the window, so the cycles stay --window apart
                await asyncio.gather(window, _allocations_after_first_cycle(agent))
            else:
                await window
            await agent.cycle()
    finally:
        await agent.close()
        if sim is not None:
            await sim.stop()
    if agent.latest is None:
        raise ConfigError("no sample could be taken; run with --log-level debug to see why")
    render = render_json if config.snapshot_json else render_text
    sys.stdout.write(render(agent.latest))
    nvml = agent.latest.node.nvml
    if not nvml.ok:
        sys.stderr.write(f"gpu-occupancy-exporter snapshot: NVML is down: {nvml.error}\n")
        return 1
    return 0


async def doctor(config: Config, scenario: Scenario | None) -> int:
    """Check what the exporter with these flags depends on (exporter/doctor/); on the
    simulated node under ``--simulate``. Exit status 0 when no check is missing."""
    from exporter.doctor.check import exit_status
    from exporter.doctor.render import render_json as doctor_json
    from exporter.doctor.render import render_text as doctor_text
    from exporter.doctor.run import run_checks

    sim = None
    # What the checks run in-process (DCGM's bindings, a kubeconfig plugin) may print:
    # it goes to stderr, so that stdout holds the report alone (--json stays JSON).
    sys.stdout.flush()
    report = os.dup(1)
    os.dup2(2, 1)
    try:
        if scenario is not None:
            config, sim = await _simulated(config, scenario)
        try:
            checks = await run_checks(config, config.doctor_timeout_s)
        finally:
            if sim is not None:
                await sim.stop()
    finally:
        sys.stdout.flush()
        os.dup2(report, 1)
        os.close(report)
    text = (doctor_json if config.doctor_json else doctor_text)(checks)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        fail(f"doctor: cannot write the report to standard output: {exc.strerror or exc}")
    return exit_status(checks)


async def _allocations_after_first_cycle(agent: Agent) -> None:
    """A PodResources answer begun after the first cycle saw the processes: the only
    kind that can show a container's use as a leak (docs/attribution.md, "Isolation
    leaks"). The server asks for one when a process appears; a snapshot's cycles are
    closer together than its refreshes may be."""
    pod_resources = agent.source("podresources")
    if isinstance(pod_resources, PodResourcesSource):
        await pod_resources.refresh()


async def serve(config: Config, scenario: Scenario | None) -> None:
    cache = MetricsCache()
    security = None
    if config.web_config_file is not None:
        try:
            security = WebSecurity(config.web_config_file)
        except WebConfigError as exc:
            raise ConfigError(f"--web-config-file: {exc}") from None
    # under --simulate the landing page names the simulated node, not this host
    node = scenario.node_name if scenario is not None else config.node_name
    liveness = Liveness(cache, interval_s=config.interval_s, cycles=config.liveness_cycles)
    readiness = Readiness(grace_s=config.ready_grace_s)
    try:
        runner = await start_server(
            build_app(cache, node, security=security, liveness=liveness, readiness=readiness),
            config.listen_host,
            config.listen_port,
            header_timeout_s=config.http_header_timeout_s,
            max_connections=config.http_max_connections,
            ssl_context=security.server_context() if security else None,
        )
    except OSError as exc:
        raise ConfigError(
            f"--listen: cannot listen on {config.listen_host}:{config.listen_port}: "
            f"{exc.strerror or exc}; pick another port or stop the process using it"
        ) from None
    sim = None
    finished = True
    watching = asyncio.create_task(liveness.watch(), name="liveness")
    try:
        if scenario is not None:
            config, sim = await _simulated(config, scenario)
        agent = build_agent(config, cache, readiness=readiness)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        log.info(
            "serving on %s://%s:%d/metrics (node %s, interval %.1f s%s%s)",
            "https" if security and security.tls else "http",
            config.listen_host or "0.0.0.0",
            config.listen_port,
            config.node_name,
            config.interval_s,
            f", simulated: {scenario.name}" if scenario else "",
            ", basic auth" if security and security.config.basic_auth_users else "",
        )
        off = [name for name in selectable() if name not in config.families]
        log.info("metric families off: %s", ", ".join(off) or "none")
        finished = await agent.run()
        log.info("stopped")
    finally:
        watching.cancel()
        if security is not None:
            security.close()  # queued password checks answer 503 now, not after bcrypt
        await runner.cleanup()
        if security is not None:  # a thread inside bcrypt at exit aborts the interpreter
            await asyncio.to_thread(security.join, SECURITY_JOIN_S)
        if sim is not None:
            await sim.stop()
    if not finished:
        # A worker thread is stuck in a call that never returns (a hung GPU, say).
        # Waiting for it would keep /dev/nvidia* open until the kubelet's SIGKILL; the
        # kernel closes every file of a process that exits.
        log.warning("exiting without waiting for the stuck worker thread")
        logging.shutdown()
        os._exit(0)
