"""The whole exporter process on a real GPU, beside nvitop-exporter on the same GPU.

What ``whole_process.py`` measures on the simulated node, here over the real
``libnvidia-ml.so.1``: both exporters at ``--interval 1``, each scraped every 5 s (ours in
OpenMetrics), CPU per second of each whole process over ``--seconds`` (every thread's
schedstat, ``processes.cpu_per_second``), RSS, then scrape latencies per format. Ours runs
with ``--kube-api off --dcgm off`` and no kubelet socket (NVML, /proc, the kernel log):
a GPU host outside Kubernetes. The peer is skipped, saying so, where nvitop-exporter is
not installed.

Usage (on a GPU host): ``python benchmarks/real_process.py [--seconds 30] [--json PATH]``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from processes import (  # noqa: E402
    ExporterProcess,
    PeriodicScraper,
    cpu_per_second,
    free_port,
    memory_mib,
    running,
    scrape_latencies,
)

OPENMETRICS = {"Accept": "application/openmetrics-text; version=1.0.0"}
TEXT: dict[str, str] = {}
WARMUP_S = 5.0


def _ours(port: int) -> ExporterProcess:
    argv = [
        sys.executable,
        "-m",
        "exporter",
        "--kube-api",
        "off",
        "--dcgm",
        "off",
        "--pod-resources-socket",
        "/nonexistent.sock",
        "--listen",
        f"127.0.0.1:{port}",
        "--interval",
        "1",
        "--log-level",
        "warning",
    ]
    return ExporterProcess(argv, port, name="ours")


def _peer(port: int) -> ExporterProcess | None:
    binary = shutil.which("nvitop-exporter")
    if binary is None:
        return None
    argv = [binary, "--bind-address", "127.0.0.1", "--port", str(port), "--interval", "1"]
    return ExporterProcess(argv, port, name="nvitop-exporter")


def measure(seconds: float, scrapes: int) -> dict[str, Any]:
    ours = _ours(free_port())
    peer = _peer(free_port())
    processes = [p for p in (ours, peer) if p is not None]
    log: list[str] = []
    result: dict[str, Any] = {"seconds": seconds, "peer": None if peer is None else peer.name}
    with running(*processes, log=log):
        time.sleep(WARMUP_S)
        scrapers = [PeriodicScraper(ours.port, 5.0, OPENMETRICS)]
        if peer is not None:
            scrapers.append(PeriodicScraper(peer.port, 5.0, TEXT))
        for scraper in scrapers:
            scraper.__enter__()
        try:
            result["cpu"] = cpu_per_second({p.name: p.pid for p in processes}, seconds)
        finally:
            for scraper in scrapers:
                scraper.__exit__()
        result["rss_mib"] = {p.name: memory_mib(p.pid) for p in processes}
        result["scrape_ms"] = {
            "ours_text": scrape_latencies(ours.port, TEXT, scrapes, 0.01),
            "ours_openmetrics": scrape_latencies(ours.port, OPENMETRICS, scrapes, 0.01),
        }
        if peer is not None:
            result["scrape_ms"]["peer_text"] = scrape_latencies(peer.port, TEXT, scrapes, 0.01)
    result["stderr_tail"] = log
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="CPU window (default 30)")
    parser.add_argument("--scrapes", type=int, default=200, help="scrapes per format (200)")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args()
    if not Path("/dev/nvidiactl").exists():
        print("error: no /dev/nvidiactl here; run on a GPU host", file=sys.stderr)
        return 2
    result = measure(args.seconds, args.scrapes)
    for name, cpu in result["cpu"].items():
        print(f"{name}: CPU {cpu['cpu_ms_per_s']:.2f} ms/s, RSS {result['rss_mib'][name]}")
    if "nvitop-exporter" in result["cpu"]:
        cpu = {name: figures["cpu_ms_per_s"] for name, figures in result["cpu"].items()}
        ratio = cpu["nvitop-exporter"] / cpu["ours"]
        print(f"CPU nvitop-exporter / ours: {ratio:.2f}x")
    for name, s in result["scrape_ms"].items():
        print(f"scrape {name}: {s}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
