"""Command line entry point: validate everything, bind, then start the sources."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from exporter.agent import Agent, PodMetaSource, kube_api_configured, with_overrides
from exporter.config import Config, ConfigError, fail, parse_config
from exporter.exposition.server import MetricsCache, build_app, start_server
from exporter.logs import setup_logging
from exporter.sim.scenario import Scenario, ScenarioError, load_scenario
from exporter.snapshot import render_json, render_text

if TYPE_CHECKING:
    from exporter.sim.environment import SimPaths

log = logging.getLogger("exporter")


def main(argv: Sequence[str] | None = None) -> int:
    try:
        config = parse_config(sys.argv[1:] if argv is None else argv)
        scenario = load_scenario(config.simulate) if config.simulate else None
    except (ConfigError, ScenarioError) as exc:
        fail(str(exc))
    # A scrape waiting for the GIL while a cycle runs in its worker thread would wait
    # up to the default 5 ms switch interval; 1 ms keeps scrape latency tails short.
    sys.setswitchinterval(0.001)
    setup_logging(
        "warning" if config.snapshot and config.log_level == "info" else config.log_level,
        config.log_format,
    )
    try:
        asyncio.run(take_snapshot(config, scenario) if config.snapshot else serve(config, scenario))
    except ConfigError as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        pass
    return 0


async def take_snapshot(config: Config, scenario: Scenario | None) -> None:
    """Two cycles ``--window`` apart through the exporter's own code path, then print."""
    sim = None
    if scenario is not None:
        from exporter.sim.environment import SimEnvironment

        sim = SimEnvironment(scenario, kube_api=config.kube_api != "off")
        config = _simulated(config, await sim.start())
    agent = Agent(config, MetricsCache(), pod_meta=_pod_meta_source(config))
    try:
        agent.start_background()
        await agent.refresh_pod_resources()
        if agent.pod_meta is not None:
            deadline = asyncio.get_running_loop().time() + 5.0
            while not agent.pod_meta.snapshot().ok and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
        await agent.cycle()
        await asyncio.sleep(config.snapshot_window_s)
        await agent.cycle()
    finally:
        await agent.stop_background()
        if sim is not None:
            await sim.stop()
    if agent.latest is None:
        raise ConfigError("no sample could be taken; run with --log-level debug to see why")
    render = render_json if config.snapshot_json else render_text
    sys.stdout.write(render(agent.latest))


def _simulated(config: Config, paths: SimPaths) -> Config:
    return with_overrides(
        config,
        proc_root=paths.proc_root,
        pod_resources_socket=paths.pod_resources_socket,
        kubeconfig=str(paths.kubeconfig) if paths.kubeconfig else None,
        node_name=paths.node_name,
    )


async def serve(config: Config, scenario: Scenario | None) -> None:
    cache = MetricsCache()
    try:
        runner = await start_server(
            build_app(cache, config.node_name), config.listen_host, config.listen_port
        )
    except OSError as exc:
        raise ConfigError(
            f"--listen: cannot listen on {config.listen_host}:{config.listen_port}: "
            f"{exc.strerror or exc}; pick another port or stop the process using it"
        ) from None
    sim = None
    try:
        if scenario is not None:
            from exporter.sim.environment import SimEnvironment  # only when simulating

            sim = SimEnvironment(scenario, kube_api=config.kube_api != "off")
            config = _simulated(config, await sim.start())
        agent = Agent(config, cache, pod_meta=_pod_meta_source(config))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.stop)
        log.info(
            "serving on http://%s:%d/metrics (node %s, interval %.1f s%s)",
            config.listen_host or "0.0.0.0",
            config.listen_port,
            config.node_name,
            config.interval_s,
            f", simulated: {scenario.name}" if scenario else "",
        )
        await agent.run()
        log.info("stopped")
    finally:
        await runner.cleanup()
        if sim is not None:
            await sim.stop()


def _pod_meta_source(config: Config) -> PodMetaSource | None:
    if not kube_api_configured(config):
        if config.kube_api == "auto":
            log.info(
                "no Kubernetes API credentials found; pod names come from the kubelet "
                "only (use --kubeconfig, or run in-cluster)"
            )
        return None
    from exporter.sources.kube import PodWatcher  # imports kubernetes lazily, in its thread

    return PodWatcher(config.node_name, kubeconfig=config.kubeconfig)
