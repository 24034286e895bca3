"""VictoriaMetrics as the backend: victoria-metrics stores, vmagent scrapes, vmalert
evaluates the shipped rule files and writes its recordings back (docs/victoriametrics.md).

Built on stack.py (``Child``, ``free_port``, ``wait_until``): every process runs under
coreutils' ``timeout`` and is stopped by pid. The settings the project ships for
VictoriaMetrics live here, once, for the e2e test (test_victoriametrics_e2e.py), the
fleet benchmark (benchmarks/fleet.py --backend victoriametrics) and the doc, which
quotes them:

- vmalert reads with ``nocache=1`` on ``-datasource.url`` (``vmalert_datasource_url``).
  VictoriaMetrics 1.79.5 moves an instant query's time back to ``now -
  -search.latencyOffset`` (30 s by default) unless the request carries ``nocache=1``
  (app/vmselect/prometheus/prometheus.go, QueryHandler); vmalert 1.79.5 passes any
  parameter of ``-datasource.url`` on (app/vmalert/README.md, "URL params"). Without it a
  rule reading another rule's recording sees it at least 30 s late: every level of a
  chain of recording rules lags by ceil((30 s + flush) / interval) evaluations.
- vmalert flushes its recordings every second (``-remoteWrite.flushInterval=1s``; with
  the default 5 s, a level of a chain evaluated every second, as in the e2e test, lags
  five evaluations; on a 15 s or longer interval either fits within one).
- vmalert evaluates at Prometheus' evaluation interval (``-evaluationInterval``).

With these, a recording rule that reads another one's output sees the previous
evaluation's (vmalert evaluates a group's rules one after the other but persists their
results asynchronously: app/vmalert/README.md, "Limitations"), so a chain N rules deep
is right N evaluation intervals after its inputs settle, no later. Prometheus sees the
current evaluation's: that lag is what stays different (docs/victoriametrics.md).
"""

from __future__ import annotations

import http.server
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.e2e.stack import (
    PROCESS_LIFETIME_S,
    Child,
    PromApi,
    Secured,
    free_port,
    http_get,
    prometheus_config,
    wait_until,
)

VM_BINARIES = ("victoria-metrics", "vmagent", "vmalert")
START_TIMEOUT_S = 60

# The shipped settings (module docstring; docs/victoriametrics.md quotes them).
DATASOURCE_PARAMS = "nocache=1"
VMALERT_FLUSH_INTERVAL = "1s"


def vmalert_datasource_url(vm_url: str, params: str = DATASOURCE_PARAMS) -> str:
    """``-datasource.url`` for vmalert: VictoriaMetrics with ``nocache=1``."""
    return f"{vm_url.rstrip('/')}?{params}" if params else vm_url.rstrip("/")


def vmalert_settings(
    vm_url: str, evaluation_interval_s: float, datasource_params: str = DATASOURCE_PARAMS
) -> list[str]:
    """The flags the project ships for vmalert reading from and writing to one
    single-node VictoriaMetrics at ``vm_url`` (``datasource_params=""``: without the
    shipped parameter, for a self-check)."""
    return [
        f"-datasource.url={vmalert_datasource_url(vm_url, datasource_params)}",
        f"-remoteWrite.url={vm_url}",
        f"-remoteWrite.flushInterval={VMALERT_FLUSH_INTERVAL}",
        f"-remoteRead.url={vm_url}",  # restores alert states on restart
        f"-evaluationInterval={evaluation_interval_s:g}s",
    ]


def vmagent_config(
    exporters: Mapping[str, int], secured: Secured | None = None, interval_s: float = 1.0
) -> dict[str, Any]:
    """The e2e Prometheus' scrape configuration (stack.prometheus_config: same job,
    targets, ``node`` labels, scheme and credentials), without what vmagent does not
    read (rules, evaluation interval): vmagent rejects unknown fields by default."""
    config = prometheus_config(exporters, [], secured)
    for job in config["scrape_configs"]:
        job["scrape_interval"] = f"{interval_s:g}s"
        job["scrape_timeout"] = f"{min(interval_s, 10):g}s"
    return {
        "global": {"scrape_interval": f"{interval_s:g}s"},
        "scrape_configs": config["scrape_configs"],
    }


def write_vmagent_config(
    path: Path,
    exporters: Mapping[str, int],
    secured: Secured | None = None,
    interval_s: float = 1.0,
) -> Path:
    path.write_text(yaml.safe_dump(vmagent_config(exporters, secured, interval_s)), "utf-8")
    return path


def start_victoria_metrics(
    binary: str,
    data: Path,
    port: int,
    log_path: Path,
    extra: Sequence[str] = (),
    lifetime_s: float = PROCESS_LIFETIME_S,
) -> Child:
    return Child(
        "victoria-metrics",
        [
            binary,
            f"-storageDataPath={data}",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-loggerLevel=WARN",
            *extra,
        ],
        log_path,
        lifetime_s=lifetime_s,
    )


def start_vmagent(
    binary: str,
    config: Path,
    vm_url: str,
    port: int,
    buffer: Path,
    log_path: Path,
    lifetime_s: float = PROCESS_LIFETIME_S,
) -> Child:
    return Child(
        "vmagent",
        [
            binary,
            f"-promscrape.config={config}",
            f"-remoteWrite.url={vm_url}/api/v1/write",
            f"-remoteWrite.tmpDataPath={buffer}",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-loggerLevel=WARN",
        ],
        log_path,
        lifetime_s=lifetime_s,
    )


def start_vmalert(
    binary: str,
    rule_files: Sequence[Path],
    vm_url: str,
    port: int,
    notifier_url: str,
    log_path: Path,
    evaluation_interval_s: float,
    lifetime_s: float = PROCESS_LIFETIME_S,
    datasource_params: str = DATASOURCE_PARAMS,
) -> Child:
    return Child(
        "vmalert",
        [
            binary,
            *(f"-rule={p}" for p in rule_files),
            *vmalert_settings(vm_url, evaluation_interval_s, datasource_params),
            f"-notifier.url={notifier_url}",
            f"-httpListenAddr=127.0.0.1:{port}",
            "-loggerLevel=WARN",
        ],
        log_path,
        lifetime_s=lifetime_s,
    )


class _Accept(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class NullNotifier:
    """An Alertmanager stand-in that accepts and drops: vmalert 1.79.5 needs a
    ``-notifier.url`` when its rule files hold alerting rules, and no test here reads
    notifications (test_alertmanager_restart.py covers a real Alertmanager)."""

    def __init__(self) -> None:
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Accept)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class VmApi(PromApi):
    """VictoriaMetrics' Prometheus-compatible API, plus its own endpoints. Instant
    queries carry ``nocache=1`` (answer at the time asked, not moved back by
    -search.latencyOffset) unless ``nocache`` is false: as Grafana asks."""

    def __init__(self, port: int, nocache: bool = True) -> None:
        super().__init__(port)
        self.nocache = nocache

    def ready(self) -> bool:
        return http_get(f"{self.base}/health", timeout=2)[0] == 200

    def force_flush(self) -> None:
        """Make every sample received so far searchable (/internal/force_flush)."""
        http_get(f"{self.base}/internal/force_flush", timeout=10)

    def query(self, expr: str, at: float | None = None) -> dict[str, Any]:
        params: dict[str, str | float] = {"query": expr}
        if at:
            params["time"] = at
        if self.nocache:
            params["nocache"] = 1
        return self._get("/api/v1/query", **params)

    def series_count(self) -> int:
        """Series in the storage (/api/v1/series/count; an estimate over the retention,
        deleted series included: VictoriaMetrics' README, "Prometheus querying API")."""
        data = self._get("/api/v1/series/count")
        return int(data["data"][0])

    def own_metrics(self) -> str:
        return http_get(f"{self.base}/metrics")[1].decode()


class VmalertApi:
    """The parts of vmalert's API the tests read."""

    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def ready(self) -> bool:
        return http_get(f"{self.base}/health", timeout=2)[0] == 200

    def groups(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = json.loads(http_get(f"{self.base}/api/v1/rules")[1])["data"][
            "groups"
        ]
        return groups

    def rules(self) -> list[dict[str, Any]]:
        return [rule for group in self.groups() for rule in group.get("rules", [])]

    def own_metrics(self) -> str:
        return http_get(f"{self.base}/metrics")[1].decode()


@dataclass
class VmStack:
    """victoria-metrics, vmagent scraping ``exporters`` into it, vmalert evaluating
    ``rule_files`` against it and writing back; ``stop()`` ends all of them."""

    vm: Child
    vmagent: Child
    vmalert: Child | None
    api: VmApi
    vmalert_api: VmalertApi
    vm_url: str
    notifier: NullNotifier
    children: list[Child] = field(default_factory=list)
    vmagent_url: str = ""

    def check_alive(self) -> None:
        for child in self.children:
            child.check_alive()

    def log_tails(self) -> str:
        return "\n".join(f"--- {c.name}:\n{c.log_tail()}" for c in self.children)

    def stop(self) -> None:
        for child in reversed(self.children):
            child.stop()
        self.notifier.close()


def start_vm_stack(
    binaries: Mapping[str, str],
    work: Path,
    exporters: Mapping[str, int],
    rule_files: Sequence[Path],
    *,
    secured: Secured | None = None,
    scrape_interval_s: float = 1.0,
    evaluation_interval_s: float = 1.0,
    vm_flags: Sequence[str] = (),
    lifetime_s: float = PROCESS_LIFETIME_S,
    start_vmalert_now: bool = True,
    start_timeout_s: float = START_TIMEOUT_S,
) -> VmStack:
    """Start the three (``binaries``: name -> path, e.g. from require_tool) and wait until
    VictoriaMetrics answers and vmagent has scraped every target once. With
    ``start_vmalert_now`` false, call ``start_rules`` later (after the first scrape,
    as the Prometheus e2e loads its rules)."""
    work.mkdir(parents=True, exist_ok=True)
    vm_port, agent_port = free_port(), free_port()
    vm_url = f"http://127.0.0.1:{vm_port}"
    notifier = NullNotifier()
    vm = start_victoria_metrics(
        binaries["victoria-metrics"],
        work / "vm-data",
        vm_port,
        work / "victoria-metrics.log",
        vm_flags,
        lifetime_s,
    )
    children = [vm]
    stack = VmStack(vm, vm, None, VmApi(vm_port), VmalertApi(0), vm_url, notifier, children)
    stack.vmagent_url = f"http://127.0.0.1:{agent_port}"
    try:
        config = write_vmagent_config(work / "vmagent.yml", exporters, secured, scrape_interval_s)
        stack.vmagent = start_vmagent(
            binaries["vmagent"],
            config,
            vm_url,
            agent_port,
            work / "vmagent-buffer",
            work / "vmagent.log",
            lifetime_s,
        )
        children.append(stack.vmagent)

        def vm_ready() -> bool:
            stack.check_alive()
            return stack.api.ready()

        wait_until(vm_ready, timeout_s=start_timeout_s, what="victoria-metrics' /health")

        def scraped() -> bool:
            stack.check_alive()
            stack.api.force_flush()
            up = stack.api.series('up{job=~".*gpu-occupancy-exporter.*"} == 1')
            return len(up) == len(exporters)

        wait_until(
            scraped,
            timeout_s=start_timeout_s,
            what="vmagent's first scrape of every target, in VictoriaMetrics",
            diagnostics=stack.log_tails,
        )
        if start_vmalert_now:
            start_rules(stack, binaries, work, rule_files, evaluation_interval_s, lifetime_s)
    except BaseException:
        stack.stop()
        raise
    return stack


def start_rules(
    stack: VmStack,
    binaries: Mapping[str, str],
    work: Path,
    rule_files: Sequence[Path],
    evaluation_interval_s: float = 1.0,
    lifetime_s: float = PROCESS_LIFETIME_S,
    datasource_params: str = DATASOURCE_PARAMS,
) -> None:
    """Start vmalert on ``rule_files`` and wait until it serves every group."""
    port = free_port()
    stack.vmalert = start_vmalert(
        binaries["vmalert"],
        rule_files,
        stack.vm_url,
        port,
        stack.notifier.url,
        work / "vmalert.log",
        evaluation_interval_s,
        lifetime_s,
        datasource_params,
    )
    stack.children.append(stack.vmalert)
    stack.vmalert_api = VmalertApi(port)

    def loaded() -> bool:
        stack.check_alive()
        return stack.vmalert_api.ready() and len(stack.vmalert_api.groups()) > 0

    wait_until(
        loaded, timeout_s=START_TIMEOUT_S, what="vmalert's groups", diagnostics=stack.log_tails
    )
