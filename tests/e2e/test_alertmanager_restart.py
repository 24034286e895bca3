"""End to end through Alertmanager: the exporter killed under critical alerts.

The exporter on a simulated node (node-alertmanager.yaml: GPU 0 lost, GPU 1 after a
fatal XID 79 and lost) is scraped by a real Prometheus (Debian's 2.42) that loads the
alert rules on the e2e time scale (shrink_rules.py: 15 min -> 15 s, 5 min -> 5 s) and
sends to a real Alertmanager (Debian's ``prometheus-alertmanager``, 0.25) whose webhook
receiver is a small HTTP server in this test recording every notification. Once the
critical pages are out, the exporter is killed with SIGKILL. docs/e2e.md describes it;
docs/runbooks.md#when-the-exporter-is-gone the rules it checks:

- no "resolved" for a critical alert before its replacement pages (the held alerts
  stay firing in Prometheus meanwhile);
- the replacement is critical (GPUExporterDownDuringCriticalAlert), never the warning
  GPUExporterDown;
- GPU 1's fatal XID paged once (GPUFatalXID), not twice (GPUUnhealthy as well).

Without ``prometheus`` or ``prometheus-alertmanager`` it skips, or fails in CI
(tests/system_tools.py).
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.shrink_rules import write_shrunk_rules
from tests.e2e.stack import (
    Child,
    PromApi,
    free_port,
    http_get,
    prometheus_config,
    start_exporter,
    start_prometheus,
    wait_until,
)
from tests.e2e.webhook import Webhook, serve_webhook
from tests.system_tools import require_tool

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCENARIO = HERE / "node-alertmanager.yaml"
ALERT_RULES = ROOT / "alerts" / "gpu-occupancy-exporter.rules.yaml"
NODE = "sim-node-alertmanager"
ALERTMANAGER_HINT = "apt-get install -y prometheus-alertmanager"
START_TIMEOUT_S = 30
PAGES_TIMEOUT_S = 45  # lost at t=2, GPUUnhealthy's for: 5 s, Alertmanager's 0.2 s waits
REPLACEMENT_TIMEOUT_S = 14  # under the 15 s hold: the page must be carried before it ends
POLL_S = 0.2  # the webhook records locally: polling it is cheap, and each wait ends sooner
CRITICAL_PAGES = {("GPUUnhealthy", "0"), ("GPUFatalXID", "1")}


def alertmanager_config(webhook_port: int) -> dict[str, Any]:
    """One receiver; one group per alert and GPU, notified within a fifth of a second
    (a "resolved" too: the test would see one the sooner)."""
    return {
        "route": {
            "receiver": "hook",
            "group_by": ["alertname", "instance", "gpu"],
            "group_wait": "200ms",
            "group_interval": "200ms",
            "repeat_interval": "1h",
        },
        "receivers": [
            {
                "name": "hook",
                "webhook_configs": [
                    {"url": f"http://127.0.0.1:{webhook_port}/", "send_resolved": True}
                ],
            }
        ],
    }


def exporter_pid(child: Child) -> int:
    """The exporter's own pid: Child runs it under coreutils' `timeout`, which SIGKILL
    to the wrapper would not reach."""
    pid = child.process.pid
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return pid
    return int(children[0]) if children else pid


@dataclass
class Run:
    hook: Webhook
    killed_at: float = 0.0
    replaced_at: float | None = None
    firing_in_prometheus_when_replaced: set[tuple[str, str]] = field(default_factory=set)
    state: str = ""


@pytest.fixture(scope="module")
def killed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    prometheus_bin = require_tool("prometheus")
    alertmanager_bin = require_tool("prometheus-alertmanager", ALERTMANAGER_HINT)
    tmp = tmp_path_factory.mktemp("alertmanager-e2e")
    hook = Webhook()
    server = serve_webhook(hook)
    exporter_port, prom_port, am_port = free_port(), free_port(), free_port()
    (tmp / "alertmanager.yml").write_text(
        yaml.safe_dump(alertmanager_config(server.server_address[1])), "utf-8"
    )
    rules = write_shrunk_rules(ALERT_RULES, tmp / "alerts.e2e.yaml")
    config = prometheus_config({NODE: exporter_port}, [rules])
    config["alerting"] = {
        "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(config), "utf-8")
    children: list[Child] = []
    run = Run(hook=hook)
    try:
        alertmanager = Child(
            "alertmanager",
            [
                alertmanager_bin,
                f"--config.file={tmp / 'alertmanager.yml'}",
                f"--storage.path={tmp / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{am_port}",
                "--cluster.listen-address=",  # no gossip port: a single instance
                "--log.level=warn",
            ],
            tmp / "alertmanager.log",
        )
        children.append(alertmanager)
        exporter = start_exporter(SCENARIO, exporter_port, tmp / "exporter.log")
        children.append(exporter)
        # Prometheus starts with them: its first scrape comes only after its 5 s target
        # tick, and its first alert (none fires before a scrape) goes out after that,
        # by when Alertmanager (ready within a second) is waited for below.
        prometheus = start_prometheus(
            prometheus_bin, tmp / "prometheus.yml", tmp / "tsdb", prom_port, tmp / "prom.log"
        )
        children.append(prometheus)
        api = PromApi(prom_port)
        wait_until(
            lambda: http_get(f"http://127.0.0.1:{am_port}/-/ready", timeout=2)[0] == 200,
            timeout_s=START_TIMEOUT_S,
            what="Alertmanager's /-/ready",
            interval_s=POLL_S,
            diagnostics=alertmanager.log_tail,
        )
        wait_until(
            api.ready, timeout_s=START_TIMEOUT_S, what="Prometheus' /-/ready", interval_s=POLL_S
        )

        def paged() -> bool:
            exporter.check_alive()
            return hook.pages("firing") >= CRITICAL_PAGES

        wait_until(
            paged,
            timeout_s=PAGES_TIMEOUT_S,
            what=f"the critical pages {sorted(CRITICAL_PAGES)}",
            interval_s=POLL_S,
            diagnostics=lambda: f"{hook.alerts()}\n{exporter.log_tail()}",
        )
        os.kill(exporter_pid(exporter), signal.SIGKILL)
        run.killed_at = time.monotonic()

        def replaced() -> bool:
            return any(
                name.startswith("GPUExporterDown")
                for name, _ in hook.pages("firing", run.killed_at)
            )

        try:
            wait_until(
                replaced,
                timeout_s=REPLACEMENT_TIMEOUT_S,
                what="the exporter-down page",
                interval_s=POLL_S,
            )
            run.replaced_at = time.monotonic()
            run.firing_in_prometheus_when_replaced = {
                (a["labels"]["alertname"], a["labels"].get("gpu", ""))
                for a in api.alerts()
                if a["state"] == "firing"
            }
        except AssertionError as exc:
            run.state = str(exc)
        notified = [
            (round(t - run.killed_at, 1), a["status"], a["labels"]) for t, a in hook.alerts()
        ]
        run.state += f"\nnotified (s after the kill, status, labels): {json.dumps(notified)}"
        yield run
    finally:
        for child in reversed(children):
            child.stop()
        server.shutdown()


def test_killing_the_exporter_sends_no_resolved_for_a_critical_page(killed: Run) -> None:
    resolved = killed.hook.pages("resolved", killed.killed_at)
    assert not resolved & CRITICAL_PAGES, (
        f"resolved by the exporter's absence: {resolved}{killed.state}"
    )
    assert killed.replaced_at is not None, f"no replacement page{killed.state}"
    assert killed.firing_in_prometheus_when_replaced >= CRITICAL_PAGES, killed.state


def test_the_page_that_replaces_them_is_critical(killed: Run) -> None:
    assert killed.hook.severities("GPUExporterDownDuringCriticalAlert") == {"critical"}, (
        killed.state
    )
    assert not killed.hook.severities("GPUExporterDown"), (
        f"a warning replaced a critical page{killed.state}"
    )


def test_a_fatal_xid_pages_once(killed: Run) -> None:
    gpu1 = {name for name, gpu in killed.hook.pages("firing") if gpu == "1"}
    assert gpu1 == {"GPUFatalXID"}, f"GPU 1's fatal XID paged as {gpu1}{killed.state}"
