"""Processes a benchmark measures from outside, as a user sees them.

``NodeServer`` runs a simulated node in its own process (``python -m exporter.sim``), so the
exporter under test holds only the simulated NVML library, as it holds libnvidia-ml on a
real node; ``ExporterProcess`` starts ``python -m exporter --simulated-node DIR`` (or any
other command, such as the peer) and waits until it serves. CPU is read from the kernel:
the sum over the process's threads of ``/proc/<pid>/task/<tid>/schedstat`` (nanoseconds
on the CPU), cross-checked against utime + stime in ``/proc/<pid>/stat`` (all threads,
dead ones too, in clock ticks).
"""

from __future__ import annotations

import http.client
import json
import math
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
CLOCK_TICK_S = 1 / os.sysconf("SC_CLK_TCK")
OPENMETRICS_ACCEPT = {"Accept": "application/openmetrics-text; version=1.0.0"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty list."""
    ranked = sorted(values)
    return ranked[max(0, min(len(ranked) - 1, math.ceil(q / 100 * len(ranked)) - 1))]


def summarise(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
        "mean": statistics.fmean(values),
    }


# -- what the kernel says about a process ------------------------------------------------


def cpu_ns(pid: int) -> int:
    """Nanoseconds all live threads of ``pid`` have run (schedstat)."""
    return sum(thread_cpu_ns(pid).values())


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Nanoseconds each live thread of ``pid`` has run (schedstat), by thread id."""
    out: dict[int, int] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):  # a thread that just exited
            continue
    return out


def cpu_ticks_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (every thread, exited ones included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) * CLOCK_TICK_S


def memory_mib(pid: int) -> dict[str, float]:
    """VmRSS, its anonymous and file-backed parts, and the peak (VmHWM), in MiB."""
    wanted = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "VmHWM": "peak"}
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in wanted:
            out[wanted[key]] = int(value.split()[0]) / 1024
    return out


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def threads(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


# -- scraping --------------------------------------------------------------------------


def get(port: int, path: str = "/metrics", headers: dict[str, str] | None = None) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            raise RuntimeError(f"{path} answered {response.status}")
        return body
    finally:
        conn.close()


def scrape_latencies(
    port: int, headers: dict[str, str], count: int, spacing_s: float, warmup: int = 20
) -> dict[str, Any]:
    """Per-request wall time (request sent to body read) over one keep-alive connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    times: list[float] = []
    size = 0
    try:
        for i in range(warmup + count):
            started = time.perf_counter()
            conn.request("GET", "/metrics", headers=headers)
            response = conn.getresponse()
            body = response.read()
            elapsed = time.perf_counter() - started
            if response.status != 200:
                raise RuntimeError(f"/metrics answered {response.status}")
            if i >= warmup:
                times.append(elapsed * 1000)
            size = len(body)
            time.sleep(max(0.0, spacing_s - elapsed))
    finally:
        conn.close()
    return {"ms": summarise(times), "body_bytes": size}


class PeriodicScraper:
    """Scrapes ``/metrics`` every ``every_s`` in a thread, as Prometheus would, while a
    CPU figure is taken (the cost of answering scrapes is part of the process's cost)."""

    def __init__(self, port: int, every_s: float, headers: dict[str, str]) -> None:
        self._port, self._every, self._headers = port, every_s, headers
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.scrapes = 0

    def _run(self) -> None:
        while not self._stop.wait(self._every):
            get(self._port, headers=self._headers)
            self.scrapes += 1

    def __enter__(self) -> PeriodicScraper:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


# How often cpu_per_second looks at each thread: a thread that starts and ends within the
# window (gRPC core's, which run only while a PodResources refresh has a channel open) is
# counted up to its last look, so at most this much of its life goes uncounted.
THREAD_POLL_S = 0.05


def cpu_per_second(pids: dict[str, int], seconds: float) -> dict[str, dict[str, float]]:
    """CPU milliseconds per wall second of each process over the same ``seconds``: each
    thread's schedstat, followed every ``THREAD_POLL_S`` so that threads which end within
    the window still count (a sum over the threads alive at both ends would miss them)."""
    start = time.monotonic()
    first = {name: thread_cpu_ns(pid) for name, pid in pids.items()}
    ticks = {name: cpu_ticks_s(pid) for name, pid in pids.items()}
    seen = {name: dict(threads) for name, threads in first.items()}
    ended = dict.fromkeys(pids, 0)  # ns of threads whose id was reused by a new one
    while (left := start + seconds - time.monotonic()) > 0:
        time.sleep(min(THREAD_POLL_S, left))
        for name, pid in pids.items():
            for tid, ns in thread_cpu_ns(pid).items():
                if ns < seen[name].get(tid, 0):  # a new thread under an old id
                    ended[name] += seen[name][tid] - first[name].pop(tid, 0)
                seen[name][tid] = ns
    elapsed = time.monotonic() - start
    out = {}
    for name, pid in pids.items():
        ran = ended[name] + sum(ns - first[name].get(tid, 0) for tid, ns in seen[name].items())
        out[name] = {
            "cpu_ms_per_s": ran / 1e6 / elapsed,
            "cpu_ms_per_s_stat": (cpu_ticks_s(pid) - ticks[name]) * 1000 / elapsed,
        }
    return out


# -- the processes -----------------------------------------------------------------------


class NodeServer:
    """``python -m exporter.sim SCENARIO --dir DIR``: a simulated node in its own process."""

    def __init__(self, scenario: str, *, kube_api: bool = True) -> None:
        self.scenario = scenario
        self._tmp = tempfile.TemporaryDirectory(prefix="gpusim-node-")
        self.dir = Path(self._tmp.name)
        self._log = tempfile.TemporaryFile()  # noqa: SIM115  # closed with the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "exporter.sim", scenario, "--dir", str(self.dir)]
            + ([] if kube_api else ["--kube-api", "off"]),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        deadline = time.monotonic() + 60
        while not (self.dir / "node.json").exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"simulated node {scenario!r} did not start: {self.log()}")
            time.sleep(0.05)
        self.description = json.loads((self.dir / "node.json").read_text())

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def stop(self) -> None:
        _terminate(self.proc)
        self._tmp.cleanup()


class ExporterProcess:
    """A metrics server under test on a free port; ``ready`` waits until it serves and
    ``ready_when`` holds for its /metrics body."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        *,
        ready_when: Callable[[bytes], bool] = lambda body: True,
        env: dict[str, str] | None = None,
        name: str = "exporter",
    ) -> None:
        self.name, self.port = name, port
        self._stderr: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115  # as above
        self.proc = subprocess.Popen(
            argv,
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=self._stderr,
            env={**os.environ, **(env or {})},
        )
        self._ready_when = ready_when

    @property
    def pid(self) -> int:
        return self.proc.pid

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited: {self.stderr()[-2000:]}")
            try:
                if self._ready_when(get(self.port)):
                    return
            except (OSError, RuntimeError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout_s} s: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read().decode(errors="replace")

    def stop(self) -> list[str]:
        """Stop it; returns what it wrote on stderr."""
        _terminate(self.proc)
        return self.stderr().splitlines()


def exporter_argv(node_dir: Path, port: int, interval_s: float, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "exporter",
        "--simulated-node",
        str(node_dir),
        "--listen",
        f"127.0.0.1:{port}",
        "--interval",
        f"{interval_s:g}",
        "--log-level",
        "warning",
        *extra,
    ]


def all_sources_up(kube_api: bool = True) -> Callable[[bytes], bool]:
    want = ["nvml", "procfs", "podresources", "xid"] + (["kube"] if kube_api else [])
    return lambda body: all(
        f'gpu_exporter_source_up{{source="{name}"}} 1.0'.encode() in body for name in want
    )


@contextmanager
def running(*processes: ExporterProcess, log: list[str] | None = None) -> Iterator[None]:
    """Wait for each to serve; stop them all on the way out, keeping their stderr."""
    try:
        for process in processes:
            process.wait_ready()
        yield
    finally:
        for process in processes:
            lines = process.stop()
            if log is not None:
                log.extend(f"{process.name}: {line}" for line in lines[-20:])


def _terminate(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
