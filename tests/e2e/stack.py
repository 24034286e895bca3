"""The processes of the e2e test: the exporter on a simulated node and a real Prometheus.

Both run as child processes under coreutils' `timeout`, so even a test runner that is
killed outright leaves nothing running for longer than ``PROCESS_LIFETIME_S``; the test
stops them itself (SIGTERM, then SIGKILL) in its fixture's teardown.
"""

from __future__ import annotations

import base64
import json
import random
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import yaml

ROOT = Path(__file__).resolve().parents[2]
PROCESS_LIFETIME_S = 300  # hard ceiling per child process, whatever happens to the test
JOB = "e2e-gpu-occupancy-exporter"  # matches the rules' job=~".*gpu-occupancy-exporter.*"
NODE = "sim-node-e2e"
# The kubelet's PodResources list is refreshed every 30 s by default: on the e2e time
# scale (a production minute per second or faster) that is half an hour, and a deleted
# pod's allocation would outlive every rule's window. 2 s: still three refreshes inside
# a source's staleness limit (3 periods) on a busy machine.
POD_RESOURCES_INTERVAL_S = 2

T = TypeVar("T")


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def free_port() -> int:
    """A port free now, for a server started a moment later. Not one the kernel hands
    out itself (bind to 0, and every outgoing connection, take ports from the ephemeral
    range): between this check and the server's bind, another process's connection could
    take such a port (a fresh-clone CI run lost the exporter's port to one). Below that
    range only another test choosing at random can collide, and then rarely."""
    low, _ = _ephemeral_range()
    start = 10_000 if low > 12_000 else 1_024
    candidates = list(range(start, max(start + 1_000, low - 1)))
    random.shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # the old way, last
        s.bind(("127.0.0.1", 0))
        found: int = s.getsockname()[1]
        return found


@dataclass(frozen=True)
class Secured:
    """How the main exporter is reached: TLS with this CA, basic auth with this user."""

    ca_file: Path
    user: str
    password: str
    web_config: Path

    def context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.ca_file))

    def authorization(self) -> str:
        token = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        return f"Basic {token}"

    def scrape_config(self) -> dict[str, Any]:
        """What Prometheus needs to scrape it (scheme, CA, basic auth)."""
        return {
            "scheme": "https",
            "tls_config": {"ca_file": str(self.ca_file), "server_name": "localhost"},
            "basic_auth": {"username": self.user, "password": self.password},
        }


def http_get(url: str, timeout: float = 10.0, secured: Secured | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url)
    context = None
    if secured is not None:
        request.add_header("Authorization", secured.authorization())
        context = secured.context()
    try:
        with urllib.request.urlopen(request, timeout=timeout, context=context) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_until(
    check: Callable[[], T | None],
    *,
    timeout_s: float,
    what: str,
    interval_s: float = 0.5,
    diagnostics: Callable[[], str] = lambda: "",
) -> T:
    """Poll ``check`` until it returns something truthy; fail after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    last_error: Exception | None = None
    while True:
        try:
            result = check()
            if result:
                return result
        except (OSError, ValueError) as exc:  # not up yet: connection refused, bad JSON
            last_error = exc
        if time.monotonic() >= deadline:
            raise AssertionError(
                f"timed out after {timeout_s:.0f} s waiting for {what}"
                f"{f' (last error: {last_error})' if last_error else ''}\n{diagnostics()}"
            )
        time.sleep(interval_s)


class Child:
    """A child process with its output in a file, bounded in time, stopped by pid."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        cwd: Path = ROOT,
        lifetime_s: float = PROCESS_LIFETIME_S,
    ) -> None:
        self.name = name
        self.log_path = log_path
        self._log = log_path.open("wb")
        bounded = list(argv)
        if timeout := shutil.which("timeout"):
            bounded = [timeout, "--kill-after=10", str(int(lifetime_s)), *bounded]
        self.process = subprocess.Popen(
            bounded, cwd=cwd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    def running(self) -> bool:
        return self.process.poll() is None

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.running():
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)
        self._log.close()

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        if not self.running():
            raise AssertionError(
                f"{self.name} exited with status {self.process.returncode}:\n{self.log_tail()}"
            )


def simulation_start(exporter_log: str) -> float | None:
    """Unix time at which the simulated node's clock started (the scenario's t=0), from
    the exporter's first log line about it (text format: local time, milliseconds)."""
    match = re.search(
        r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) INFO +exporter\.sim\.environment: "
        r"simulated node",
        exporter_log,
        re.MULTILINE,
    )
    if match is None:
        return None
    return time.mktime(time.strptime(match[1], "%Y-%m-%d %H:%M:%S")) + int(match[2]) / 1000


def start_exporter(
    scenario: Path,
    port: int,
    log_path: Path,
    secured: Secured | None = None,
    interval_s: float = 1.0,
    pod_resources_interval_s: int = POD_RESOURCES_INTERVAL_S,
) -> Child:
    return Child(
        "exporter",
        [
            sys.executable,
            "-m",
            "exporter",
            "--simulate",
            str(scenario),
            "--listen",
            f"127.0.0.1:{port}",
            "--interval",
            f"{interval_s:g}",
            # the e2e runs the rules' windows shrunk to seconds (e2e_rules): GPM windows
            # and per-process reads close every cycle, as a 10 s window does in minutes
            "--gpm-interval",
            f"{interval_s:g}",
            "--process-utilization-interval",
            f"{interval_s:g}",
            "--orphan-cycles",
            "2",
            "--deleted-pod-grace",
            "5",
            "--pod-resources-interval",
            str(pod_resources_interval_s),
            "--dcgm",
            "off",
            *(["--web-config-file", str(secured.web_config)] if secured else []),
        ],
        log_path,
    )


def prometheus_config(
    exporters: Mapping[str, int], rule_files: Sequence[Path], secured: Secured | None = None
) -> dict[str, Any]:
    """Scrape and evaluate every second; one target per exporter, labelled with its node.

    No exporters: the job stays but has no target (a ServiceMonitor that selects nothing).
    Prometheus then writes staleness markers for the target's series, so `up` is gone at
    once; removing the whole job instead would leave its last `up` sample visible for the
    5-minute lookback (a stopped scrape pool writes no staleness markers).
    """
    targets = [
        {"targets": [f"127.0.0.1:{port}"], "labels": {"node": node}}
        for node, port in exporters.items()
    ]
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {
                "job_name": JOB,
                "scrape_interval": "1s",
                "scrape_timeout": "1s",
                "static_configs": targets,
                **(secured.scrape_config() if secured else {}),
            }
        ],
    }


def write_prometheus_config(
    path: Path,
    exporters: Mapping[str, int],
    rule_files: Sequence[Path],
    secured: Secured | None = None,
) -> None:
    config = prometheus_config(exporters, rule_files, secured)
    path.write_text(yaml.safe_dump(config), "utf-8")


def start_prometheus(
    binary: str,
    config: Path,
    data: Path,
    port: int,
    log_path: Path,
    lifetime_s: float = PROCESS_LIFETIME_S,
) -> Child:
    return Child(
        "prometheus",
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={data}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--web.enable-lifecycle",
            "--log.level=warn",
        ],
        log_path,
        lifetime_s=lifetime_s,
    )


class PromApi:
    """The parts of Prometheus' HTTP API the test reads."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def ready(self) -> bool:
        return http_get(f"{self.base}/-/ready", timeout=2)[0] == 200

    def _get(self, path: str, **params: str | float) -> dict[str, Any]:
        url = f"{self.base}{path}"
        if params:
            url += "?" + urllib.parse.urlencode({k: str(v) for k, v in params.items()})
        status, body = http_get(url)
        try:
            data: dict[str, Any] = json.loads(body)
        except ValueError:
            data = {"status": "error", "error": f"HTTP {status}: {body[:200]!r}"}
        return data

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        return self._get("/api/v1/query", query=expr, **({"time": at} if at else {}))

    def query_range(self, expr: str, start: float, end: float, step: float) -> dict[str, Any]:
        return self._get("/api/v1/query_range", query=expr, start=start, end=end, step=step)

    def label_values(self, label: str, match: str, start: float, end: float) -> dict[str, Any]:
        params: dict[str, str | float] = {"match[]": match, "start": start, "end": end}
        return self._get(f"/api/v1/label/{urllib.parse.quote(label)}/values", **params)

    def series(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """The result of an instant query; fails on a query error."""
        data = self.query(expr, at)
        if data.get("status") != "success":
            raise AssertionError(f"query {expr!r} failed: {data.get('error')}")
        result: list[dict[str, Any]] = data["data"]["result"]
        return result

    def alerts(self) -> list[dict[str, Any]]:
        alerts: list[dict[str, Any]] = self._get("/api/v1/alerts")["data"]["alerts"]
        return alerts

    def rules(self) -> list[dict[str, Any]]:
        groups = self._get("/api/v1/rules")["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]

    def targets(self) -> list[dict[str, Any]]:
        targets: list[dict[str, Any]] = self._get("/api/v1/targets")["data"]["activeTargets"]
        return targets

    def reload(self) -> None:
        request = urllib.request.Request(f"{self.base}/-/reload", method="POST")
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200, f"reload answered {response.status}"
