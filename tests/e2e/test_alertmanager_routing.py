"""End to end through the shipped Alertmanager configuration: who gets which alert.

The exporter on a simulated node (node-alertmanager-routing.yaml) is scraped by a real
Prometheus (Debian's 2.42) that loads the alerting rules exactly as the Helm chart
renders them (the real Helm engine, ``prometheusRule.alertLabels`` {team, cluster} and
``alertmanagerConfig.namespaceLabel`` applied), on the e2e time scale (shrink_rules.py).
It sends to a real Alertmanager (Debian's 0.25) loaded with
alerts/alertmanager/gpu-occupancy-exporter.alertmanager.yaml, routes and inhibitions
untouched: only the receivers' webhook URLs (each receiver its own path on a local
webhook, the ``default`` receiver too) and the subtree's group_wait / group_interval /
repeat_interval (2 s / 1 s / 1 h) are rewritten. docs/e2e.md ("Alertmanager routing")
describes the run; it shows:

- critical -> gpu-pager, warning -> gpu-ticket, info -> gpu-low-noise, nothing to the
  root receiver;
- one notification per node and GPU (never an empty group), each alert of a group
  from that one GPU;
- each shipped inhibition acting: GPUOrphanedMemory (under GPUOrphanedMemoryLarge, same
  GPU) and GPUNodeCapacityReduced (under GPUFatalXID / GPUUnhealthy, same node) firing
  in Prometheus and never notified;
- XID 79 paging once (GPUFatalXID, not GPUUnhealthy too);
- the routing labels the chart adds on every notified alert (team, cluster, and a
  node-level alert's namespace label expanded to the release namespace);
- a resolved notification when GPU 3's PCIe link is back at full width.

Without ``prometheus`` or ``prometheus-alertmanager`` it skips, or fails in CI
(tests/system_tools.py).
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.shrink_rules import shrink_rules
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
from tests.e2e.webhook import Notification, Webhook, serve_webhook
from tests.system_tools import require_tool

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCENARIO = HERE / "node-alertmanager-routing.yaml"
CHART = ROOT / "charts" / "gpu-occupancy-exporter"
ALERT_RULES = ROOT / "alerts" / "gpu-occupancy-exporter.rules.yaml"
SHIPPED = ROOT / "alerts" / "alertmanager" / "gpu-occupancy-exporter.alertmanager.yaml"
NODE = "sim-node-routing"
RELEASE, NAMESPACE = "gpu", "gpu-monitoring"
ROUTING_LABELS = {"team": "gpu-platform", "cluster": "e2e"}
ALERTMANAGER_HINT = "apt-get install -y prometheus-alertmanager"
START_TIMEOUT_S = 30
DONE_TIMEOUT_S = 60  # the last event (GPU 3's link back) is at t=28
POLL_S = 0.2
SETTLE_S = 3.0  # past the rewritten group_wait: an inhibited alert would have been sent

# (receiver, alertname, gpu) notified firing
EXPECTED_FIRING = {
    ("gpu-pager", "GPUUnhealthy", "0"),
    ("gpu-pager", "GPUFatalXID", "1"),
    ("gpu-pager", "GPUOrphanedMemoryLarge", "2"),
    ("gpu-ticket", "GPUPCIeLinkDegraded", "3"),
    ("gpu-low-noise", "GPUUtilizationWithoutSMActivity", "3"),
}
EXPECTED_RESOLVED = {("gpu-ticket", "GPUPCIeLinkDegraded", "3")}
# target alert (alertname, gpu) -> the inhibit rule's source alertnames
INHIBITED = {
    ("GPUOrphanedMemory", "2"): {"GPUOrphanedMemoryLarge"},
    ("GPUNodeCapacityReduced", ""): {"GPUUnhealthy", "GPUFatalXID"},
}


def chart_alert_groups() -> list[dict[str, Any]]:
    """The groups of alerts/gpu-occupancy-exporter.rules.yaml as the Helm chart renders
    them into its PrometheusRule (alertLabels and the namespace label applied)."""
    import helm_python as helm  # dev dependency; only this run needs it

    values = {
        "prometheusRule": {"enabled": True, "alertLabels": ROUTING_LABELS},
        "alertmanagerConfig": {
            "enabled": True,
            "receivers": {"ticket": {"webhookUrl": "https://tickets.example.com/"}},
        },
    }
    manifests = helm.Chart.load(CHART).render(
        values, name=RELEASE, namespace=NAMESPACE, is_install=True
    )
    rendered = yaml.safe_load(manifests["gpu-occupancy-exporter/templates/prometheusrule.yaml"])
    wanted = {g["name"] for g in yaml.safe_load(ALERT_RULES.read_text())["groups"]}
    groups = [g for g in rendered["spec"]["groups"] if g["name"] in wanted]
    assert {g["name"] for g in groups} == wanted
    return groups


def for_the_test(shipped: dict[str, Any], hook_port: int) -> dict[str, Any]:
    """The shipped config with local webhook URLs and short timings; nothing else."""
    config = copy.deepcopy(shipped)
    for receiver in config["receivers"]:
        url = f"http://127.0.0.1:{hook_port}/{receiver['name']}"
        resolved = all(w.get("send_resolved", True) for w in receiver.get("webhook_configs", []))
        receiver["webhook_configs"] = [{"url": url, "send_resolved": resolved}]
    (subtree,) = config["route"]["routes"]
    for route in (subtree, *subtree["routes"]):
        route.update({"group_wait": "2s", "group_interval": "1s", "repeat_interval": "1h"})
    return config


def routing_of(config: dict[str, Any]) -> Any:
    """What the test must not change: matchers, receivers, grouping, inhibitions."""
    timing = {"group_wait", "group_interval", "repeat_interval"}

    def route(r: dict[str, Any]) -> dict[str, Any]:
        kept = {k: v for k, v in r.items() if k not in timing and k != "routes"}
        return {**kept, "routes": [route(c) for c in r.get("routes", [])]}

    return route(config["route"]), config["inhibit_rules"], [r["name"] for r in config["receivers"]]


@dataclass
class Run:
    hook: Webhook
    firing_in_prometheus: set[tuple[str, str]] = field(default_factory=set)
    alert_labels: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    state: str = ""

    def notified(self, status: str) -> set[tuple[str, str, str]]:
        """(receiver, alertname, gpu) of each alert notified with ``status``."""
        return {
            (n.payload["receiver"], a["labels"]["alertname"], a["labels"].get("gpu", ""))
            for n in self.hook.posts()
            for a in n.payload["alerts"]
            if a["status"] == status
        }


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    prometheus_bin = require_tool("prometheus")
    alertmanager_bin = require_tool("prometheus-alertmanager", ALERTMANAGER_HINT)
    tmp = tmp_path_factory.mktemp("alertmanager-routing-e2e")
    shipped = yaml.safe_load(SHIPPED.read_text(encoding="utf-8"))
    hook = Webhook()
    server = serve_webhook(hook)
    config = for_the_test(shipped, server.server_address[1])
    assert routing_of(config) == routing_of(shipped)
    (tmp / "alertmanager.yml").write_text(yaml.safe_dump(config), "utf-8")
    rules = tmp / "alerts.e2e.yaml"
    shrunk = shrink_rules({"groups": chart_alert_groups()})
    rules.write_text(yaml.safe_dump(shrunk, sort_keys=False, width=1000), "utf-8")
    exporter_port, prom_port, am_port = free_port(), free_port(), free_port()
    prom_config = prometheus_config({NODE: exporter_port}, [rules])
    prom_config["alerting"] = {
        "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]
    }
    (tmp / "prometheus.yml").write_text(yaml.safe_dump(prom_config), "utf-8")
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
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            tmp / "alertmanager.log",
        )
        children.append(alertmanager)
        exporter = start_exporter(SCENARIO, exporter_port, tmp / "exporter.log")
        children.append(exporter)
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

        def firing_in_prometheus() -> set[tuple[str, str]]:
            return {
                (a["labels"]["alertname"], a["labels"].get("gpu", ""))
                for a in api.alerts()
                if a["state"] == "firing"
            }

        def done() -> bool:
            exporter.check_alive()
            prometheus.check_alive()
            alertmanager.check_alive()
            notified = run.notified("firing") >= EXPECTED_FIRING
            resolved = run.notified("resolved") >= EXPECTED_RESOLVED
            return notified and resolved and firing_in_prometheus() >= set(INHIBITED)

        try:
            wait_until(
                done,
                timeout_s=DONE_TIMEOUT_S,
                what="every expected notification and the inhibited alerts firing",
                interval_s=POLL_S,
            )
            time.sleep(SETTLE_S)  # an inhibited alert that got through would be sent by now
        except AssertionError as exc:
            run.state = str(exc)
        run.firing_in_prometheus = firing_in_prometheus()
        run.alert_labels = {
            (a["labels"]["alertname"], a["labels"].get("gpu", "")): a["labels"]
            for a in api.alerts()
        }
        posts = [
            (
                n.payload["receiver"],
                n.payload["status"],
                n.payload["groupLabels"],
                [
                    (a["status"], a["labels"]["alertname"], a["labels"].get("gpu"))
                    for a in n.payload["alerts"]
                ],
            )
            for n in hook.posts()
        ]
        run.state += f"\nnotifications (receiver, status, groupLabels, alerts): {json.dumps(posts)}"
        run.state += f"\nfiring in Prometheus: {sorted(run.firing_in_prometheus)}"
        yield run
    finally:
        for child in reversed(children):
            child.stop()
        server.shutdown()


def test_each_severity_reaches_its_receiver(routed: Run) -> None:
    notified = routed.notified("firing")
    assert notified >= EXPECTED_FIRING, f"missing {EXPECTED_FIRING - notified}{routed.state}"
    for n in routed.hook.posts():
        receiver = n.payload["receiver"]
        assert n.path == f"/{receiver}", routed.state
        want = {"gpu-pager": "critical", "gpu-ticket": "warning", "gpu-low-noise": "info"}
        assert receiver in want, f"an alert reached {receiver}{routed.state}"
        assert {a["labels"]["severity"] for a in n.payload["alerts"]} == {want[receiver]}


def _gpu_of(n: Notification) -> set[tuple[str, str]]:
    return {(a["labels"].get("node", ""), a["labels"].get("gpu", "")) for a in n.payload["alerts"]}


def test_one_group_per_node_and_gpu_never_an_empty_group(routed: Run) -> None:
    posts = routed.hook.posts()
    assert posts, routed.state
    for n in posts:
        groups = n.payload["groupLabels"]
        assert groups, f"an empty group {{}}: {n.payload['alerts']}{routed.state}"
        assert set(groups) <= {"cluster", "node", "instance", "gpu"}, groups
        assert groups["node"] == NODE and groups["cluster"] == ROUTING_LABELS["cluster"]
        assert len(_gpu_of(n)) == 1, f"one message for several GPUs: {_gpu_of(n)}"
        (node_gpu,) = _gpu_of(n)
        assert groups.get("gpu", "") == node_gpu[1], groups
    pager = [n for n in posts if n.payload["receiver"] == "gpu-pager"]
    assert {gpu for n in pager for _, gpu in _gpu_of(n)} == {"0", "1", "2"}, routed.state


@pytest.mark.parametrize("target", sorted(INHIBITED), ids=lambda t: t[0])
def test_each_shipped_inhibition_acts(routed: Run, target: tuple[str, str]) -> None:
    assert target in routed.firing_in_prometheus, f"{target} never fired{routed.state}"
    sources = {
        (name, gpu) for name, gpu in routed.firing_in_prometheus if name in INHIBITED[target]
    }
    assert sources, f"no source of {target}'s inhibition fired{routed.state}"
    notified = {(name, gpu) for _, name, gpu in routed.notified("firing")}
    assert target not in notified, f"{target} was notified despite {sources}{routed.state}"


def test_a_fatal_xid_pages_once(routed: Run) -> None:
    gpu1 = {name for receiver, name, gpu in routed.notified("firing") if gpu == "1"}
    assert gpu1 == {"GPUFatalXID"}, f"GPU 1's XID 79 notified as {gpu1}{routed.state}"


def test_every_notified_alert_carries_the_routing_labels(routed: Run) -> None:
    alerts = [a for n in routed.hook.posts() for a in n.payload["alerts"]]
    assert alerts, routed.state
    for a in alerts:
        labels = a["labels"]
        assert {k: labels.get(k) for k in ROUTING_LABELS} == ROUTING_LABELS, labels
        # no alert of this node is about a container: each gets the release namespace
        assert labels["namespace"] == NAMESPACE, labels
    capacity = routed.alert_labels[("GPUNodeCapacityReduced", "")]
    assert capacity["namespace"] == NAMESPACE and capacity["team"] == "gpu-platform"
    # a container's alert (pending by now: its `for: 1h` is 60 s here) keeps its pod's
    idle = routed.alert_labels.get(("GPUAllocatedButIdle", "2"))
    assert idle is not None, f"GPUAllocatedButIdle not pending{routed.state}"
    assert idle["namespace"] == "ml" and idle["team"] == "gpu-platform", idle


def test_a_cleared_condition_sends_resolved(routed: Run) -> None:
    resolved = routed.notified("resolved")
    assert resolved >= EXPECTED_RESOLVED, f"no resolved notification{routed.state}"
    assert ("GPUPCIeLinkDegraded", "3") not in routed.firing_in_prometheus
    # the pages stay firing: nothing else resolved
    assert resolved == EXPECTED_RESOLVED, routed.state
