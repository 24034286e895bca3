"""The exporter as a user sees it: a whole process on a node, beside a peer exporter.

The simulated ``node-8gpu`` runs in its own process (``NodeServer``); our exporter and
the peer (nvitop-exporter, where the ``bench`` extra is installed; otherwise a second
instance of ours) each load only the simulated NVML library, as they would load
libnvidia-ml, and run side by side at ``--interval 1`` while each is scraped every 5 s.
Figures: CPU per second of each whole process (all threads), the idle floor between
cycles (an exporter at ``--interval 600`` after its first cycle), RSS, scrape latency in
each format while the other exporter runs, and /metrics size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from peer import peer_available, peer_command
from processes import (
    OPENMETRICS_ACCEPT,
    ExporterProcess,
    NodeServer,
    PeriodicScraper,
    all_sources_up,
    cpu_per_second,
    exporter_argv,
    free_port,
    get,
    memory_mib,
    open_fds,
    running,
    scrape_latencies,
    threads,
)

SCENARIO = "node-8gpu"
SCRAPE_EVERY_S = 5.0
FORMATS: dict[str, dict[str, str]] = {
    "text": {},
    "openmetrics": OPENMETRICS_ACCEPT,
    "gzip": {"Accept-Encoding": "gzip"},
}


@dataclass(frozen=True)
class ProcessPlan:
    warmup_s: float  # after every source is up, before CPU is measured
    cpu_window_s: float
    idle_window_s: float
    scrapes: int  # per exporter and format
    scrape_spacing_s: float = 0.01


FULL = ProcessPlan(warmup_s=15, cpu_window_s=60, idle_window_s=30, scrapes=1000)
QUICK = ProcessPlan(warmup_s=6, cpu_window_s=15, idle_window_s=10, scrapes=200)


def measure(plan: ProcessPlan) -> dict[str, Any]:
    log: list[str] = []
    node = NodeServer(SCENARIO)
    try:
        ours_port, peer_port = free_port(), free_port()
        ours = ExporterProcess(
            exporter_argv(node.dir, ours_port, 1.0),
            ours_port,
            ready_when=all_sources_up(),
            name="gpu-occupancy-exporter",
        )
        unavailable = peer_available()
        if unavailable is None:
            peer = ExporterProcess(
                peer_command(node.dir, peer_port, 1.0), peer_port, name="nvitop-exporter"
            )
        else:
            peer = ExporterProcess(
                exporter_argv(node.dir, peer_port, 1.0),
                peer_port,
                ready_when=all_sources_up(),
                name="second gpu-occupancy-exporter",
            )
        result: dict[str, Any] = {"peer": peer.name, "peer_unavailable": unavailable}
        with running(ours, peer, log=log):
            time.sleep(plan.warmup_s)
            with (
                PeriodicScraper(ours.port, SCRAPE_EVERY_S, OPENMETRICS_ACCEPT),
                PeriodicScraper(peer.port, SCRAPE_EVERY_S, {}),
            ):
                cpu = cpu_per_second({"ours": ours.pid, "peer": peer.pid}, plan.cpu_window_s)
            result["cpu"] = cpu
            result["memory"] = {"ours": memory_mib(ours.pid), "peer": memory_mib(peer.pid)}
            result["fds"] = {"ours": open_fds(ours.pid), "peer": open_fds(peer.pid)}
            result["threads"] = {"ours": threads(ours.pid), "peer": threads(peer.pid)}
            result["scrapes"] = {
                "ours": {
                    fmt: scrape_latencies(ours.port, headers, plan.scrapes, plan.scrape_spacing_s)
                    for fmt, headers in FORMATS.items()
                },
                "peer": {
                    "text": scrape_latencies(peer.port, {}, plan.scrapes, plan.scrape_spacing_s)
                },
            }
            result["series"] = {
                "ours": _series(get(ours.port)),
                "peer": _series(get(peer.port)),
            }
        result["idle"] = idle_floor(node, plan, log)
    finally:
        node.stop()
    result["stderr"] = [line for line in log if "WARNING" in line or "ERROR" in line][-20:]
    return result


def idle_floor(node: NodeServer, plan: ProcessPlan, log: list[str]) -> dict[str, float]:
    """CPU between cycles: an exporter whose next cycle is 10 minutes away."""
    port = free_port()
    idle = ExporterProcess(
        exporter_argv(node.dir, port, 600.0),
        port,
        ready_when=all_sources_up(),
        name="idle gpu-occupancy-exporter",
    )
    with running(idle, log=log):
        time.sleep(plan.warmup_s)
        return cpu_per_second({"idle": idle.pid}, plan.idle_window_s)["idle"]


def _series(body: bytes) -> int:
    return sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
