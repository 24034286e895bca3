"""alerts/alertmanager/gpu-occupancy-exporter.alertmanager.yaml: a whole Alertmanager
configuration that Debian's ``amtool`` 0.25 accepts, whose routes send each severity of
every alert in alerts/*.yaml to its receiver, and whose
inhibitions act, checked against a real ``prometheus-alertmanager`` (its v2 API says which
alert is inhibited by which). docs/alerting.md explains the choices;
tests/e2e/test_alertmanager_routing.py plays them end to end.
"""

from __future__ import annotations

import json
import re
import subprocess
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.stack import Child, free_port, http_get, wait_until
from tests.system_tools import require_tool

ROOT = Path(__file__).resolve().parent.parent
SHIPPED = ROOT / "alerts" / "alertmanager" / "gpu-occupancy-exporter.alertmanager.yaml"
CHART_FILES = ROOT / "charts" / "gpu-occupancy-exporter" / "files"
ALERTMANAGER_HINT = "apt-get install -y prometheus-alertmanager (Debian's package ships amtool)"
RECEIVER_OF = {"critical": "gpu-pager", "warning": "gpu-ticket", "info": "gpu-low-noise"}


def alerts_in_rules() -> dict[str, str]:
    """alertname -> severity of every alerting rule of every rule file in alerts/."""
    found = {}
    for path in sorted((ROOT / "alerts").glob("*.yaml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        for group in doc["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    found[rule["alert"]] = rule["labels"]["severity"]
    assert set(found) >= {"GPUFatalXID", "GPUOrphanedMemory", "GPUAllocatedButIdle"}
    return found


def shipped() -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(SHIPPED.read_text(encoding="utf-8"))
    return config


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = require_tool("amtool", ALERTMANAGER_HINT)
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=30, check=False)


def route_of(labels: dict[str, str]) -> str:
    """The receivers ``amtool config routes test`` resolves the label set to."""
    pairs = [f"{k}={v}" for k, v in sorted(labels.items())]
    result = amtool("config", "routes", "test", f"--config.file={SHIPPED}", *pairs)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


# -- the file ------------------------------------------------------------------------------


def test_no_rule_file_glob_picks_it_up() -> None:
    """promtool, the chart (charts/sync-files.sh copies alerts/*.yaml) and
    tests/test_alert_rules.py read alerts/*.yaml, which does not recurse."""
    assert SHIPPED.parent.name == "alertmanager"
    assert SHIPPED not in set((ROOT / "alerts").glob("*.yaml"))
    assert not list(CHART_FILES.rglob(SHIPPED.name))
    assert "groups" not in shipped()


def test_amtool_accepts_it_as_a_whole_config() -> None:
    result = amtool("check-config", str(SHIPPED))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    assert "2 inhibit rules" in result.stdout, result.stdout


def test_amtool_refused_the_old_runbook_snippet_on_its_own(tmp_path: Path) -> None:
    """What docs/runbooks.md used to suggest (inhibit_rules alone) is not a config."""
    snippet = tmp_path / "snippet.yaml"
    snippet.write_text(yaml.safe_dump({"inhibit_rules": shipped()["inhibit_rules"]}))
    result = amtool("check-config", str(snippet))
    assert result.returncode != 0
    assert "no routes provided" in result.stdout + result.stderr


# -- routes ----------------------------------------------------------------------------------


@pytest.mark.slow  # ~20 amtool runs (~1.3 s)
def test_every_alert_reaches_the_receiver_of_its_severity() -> None:
    alerts = alerts_in_rules()
    assert set(alerts.values()) == set(RECEIVER_OF), alerts
    for name, severity in sorted(alerts.items()):
        labels = {"alertname": name, "severity": severity, "node": "n1", "instance": "i:9445"}
        assert route_of(labels) == RECEIVER_OF[severity], name


ROUTE_CASES = {
    "critical-with-team": (
        {"alertname": "GPUFatalXID", "severity": "critical", "team": "gpu-platform"},
        "gpu-pager",
    ),
    "warning-with-team-and-cluster": (
        {"alertname": "GPUExporterDown", "severity": "warning", "team": "gpu-platform"}
        | {"cluster": "prod"},
        "gpu-ticket",
    ),
    "info-of-a-pod": (
        {"alertname": "GPUAllocatedButIdle", "severity": "info", "namespace": "ml"},
        "gpu-low-noise",
    ),
    # a severity the rules do not use: the subtree's own receiver
    "unknown-severity": ({"alertname": "GPUSomethingNew", "severity": "page"}, "gpu-ticket"),
    # the team label alone does not take another alert into the subtree
    "not-the-exporters-alert": (
        {"alertname": "KubePodCrashLooping", "severity": "critical", "team": "gpu-platform"},
        "default",
    ),
}


@pytest.mark.parametrize("case", sorted(ROUTE_CASES))
def test_amtool_routes(case: str) -> None:
    labels, receiver = ROUTE_CASES[case]
    assert route_of(labels) == receiver


def test_grouping_is_per_node_and_gpu_and_timings_are_set() -> None:
    (subtree,) = shipped()["route"]["routes"]
    assert subtree["group_by"] == ["cluster", "node", "instance", "gpu"]
    assert "alertname" not in subtree["group_by"] and "..." not in subtree["group_by"]
    for route in subtree["routes"]:
        assert {"group_wait", "group_interval", "repeat_interval"} <= set(route), route
        assert not route.get("continue"), route


# -- inhibitions -----------------------------------------------------------------------------

_MATCHER = re.compile(r'^\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"(.*)"\s*$')


def _matches(matchers: list[str], labels: dict[str, str]) -> bool:
    """Alertmanager's matchers over the labels known statically (others pass)."""
    for text in matchers:
        found = _MATCHER.match(text)
        assert found, f"unparsed matcher {text!r}"
        name, op, value = found.groups()
        if name not in labels:
            continue
        actual = labels[name]
        ok = {
            "=": actual == value,
            "!=": actual != value,
            "=~": re.fullmatch(value, actual) is not None,
            "!~": re.fullmatch(value, actual) is None,
        }[op]
        if not ok:
            return False
    return True


def test_every_inhibit_rule_has_sources_and_targets_among_the_alerts() -> None:
    alerts = alerts_in_rules()
    for rule in shipped()["inhibit_rules"]:
        sources = {
            n
            for n, s in alerts.items()
            if _matches(rule["source_matchers"], {"alertname": n, "severity": s})
        }
        targets = {
            n
            for n, s in alerts.items()
            if _matches(rule["target_matchers"], {"alertname": n, "severity": s})
        }
        assert sources and targets, rule
        assert "cluster" in rule["equal"], rule
        # the dead rule of docs/runbooks.md: its source outlives none of its targets
        assert "GPUExporterDown" not in sources, rule


@pytest.fixture(scope="module")
def alertmanager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real Alertmanager with the shipped config as it is (its 30 s and longer
    group_wait send nothing during the test)."""
    binary = require_tool("prometheus-alertmanager", ALERTMANAGER_HINT)
    tmp = tmp_path_factory.mktemp("alertmanager")
    port = free_port()
    child = Child(
        "alertmanager",
        [
            binary,
            f"--config.file={SHIPPED}",
            f"--storage.path={tmp / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
        tmp / "alertmanager.log",
        lifetime_s=60,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until(
            lambda: http_get(f"{url}/-/ready", timeout=2)[0] == 200,
            timeout_s=20,
            what="Alertmanager's /-/ready",
            interval_s=0.1,
            diagnostics=child.log_tail,
        )
        yield url
    finally:
        child.stop()


GPU_A = {"cluster": "prod", "node": "n1", "instance": "10.0.0.1:9445", "gpu": "2"}
GPU_A |= {"uuid": "GPU-aaaa"}
GPU_B = GPU_A | {"gpu": "3", "uuid": "GPU-bbbb"}
NODE_A = {k: GPU_A[k] for k in ("cluster", "node", "instance")}

# case -> (source labels, target labels, inhibited?): label sets as the rules produce
# them (node, instance, gpu, uuid, severity; tests/e2e/test_alertmanager_routing.py sees
# the same on the wire)
INHIBIT_CASES: dict[str, tuple[dict[str, str], dict[str, str], bool]] = {
    "large-orphan-silences-the-orphan-warning": (
        GPU_A | {"alertname": "GPUOrphanedMemoryLarge", "severity": "critical"},
        GPU_A | {"alertname": "GPUOrphanedMemory", "severity": "warning", "kind": "zombie"},
        True,
    ),
    "unhealthy-gpu-silences-its-idle-pod": (
        GPU_A | {"alertname": "GPUUnhealthy", "severity": "critical"},
        GPU_A
        | {"alertname": "GPUAllocatedButIdle", "severity": "info", "namespace": "ml"}
        | {"pod": "trainer-0", "container": "trainer"},
        True,
    ),
    "not-another-gpu": (
        GPU_A | {"alertname": "GPUOrphanedMemoryLarge", "severity": "critical"},
        GPU_B | {"alertname": "GPUOrphanedMemory", "severity": "warning", "kind": "zombie"},
        False,
    ),
    "not-another-cluster": (
        GPU_A | {"alertname": "GPUOrphanedMemoryLarge", "severity": "critical"},
        GPU_A
        | {"alertname": "GPUOrphanedMemory", "severity": "warning", "kind": "zombie"}
        | {"cluster": "staging"},
        False,
    ),
    "not-an-isolation-leak": (
        GPU_A | {"alertname": "GPUFatalXID", "severity": "critical", "xid": "79"},
        GPU_A
        | {"alertname": "GPUIsolationLeak", "severity": "warning", "namespace": "ml"}
        | {"pod": "intruder", "container": "c"},
        False,
    ),
    "exporter-wide-critical-silences-no-node-warning": (
        NODE_A | {"alertname": "GPUExporterNVMLDown", "severity": "critical"},
        NODE_A
        | {"alertname": "GPUExporterSourceDown", "severity": "warning"}
        | {"source": "podresources"},
        False,
    ),
    "fatal-xid-silences-the-capacity-warning": (
        GPU_A | {"alertname": "GPUFatalXID", "severity": "critical", "xid": "79"},
        NODE_A
        | {"alertname": "GPUNodeCapacityReduced", "severity": "warning"}
        | {"resource": "nvidia.com/gpu"},
        True,
    ),
    "unhealthy-gpu-silences-the-capacity-warning": (
        GPU_B | {"alertname": "GPUUnhealthy", "severity": "critical"},
        NODE_A
        | {"alertname": "GPUNodeCapacityReduced", "severity": "warning"}
        | {"resource": "nvidia.com/gpu"},
        True,
    ),
    "not-another-nodes-capacity": (
        GPU_A | {"alertname": "GPUUnhealthy", "severity": "critical"},
        NODE_A
        | {"alertname": "GPUNodeCapacityReduced", "severity": "warning"}
        | {"resource": "nvidia.com/gpu", "instance": "10.0.0.2:9445", "node": "n2"},
        False,
    ),
}


def _post(url: str, alerts: list[dict[str, Any]]) -> None:
    request = urllib.request.Request(
        f"{url}/api/v2/alerts",
        data=json.dumps(alerts).encode(),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        assert response.status == 200


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(INHIBIT_CASES))
def test_inhibitions_in_a_real_alertmanager(alertmanager: str, case: str) -> None:
    source, target, inhibited = INHIBIT_CASES[case]
    # The cases share one Alertmanager: each gets its own instances (10.0.0.x becomes
    # <case>.x), so that no case's source can inhibit another's target, and a label to
    # find its alerts by.
    source, target = (
        labels | {"case": case, "instance": labels["instance"].replace("10.0.0", case)}
        for labels in (source, target)
    )
    _post(alertmanager, [{"labels": source}, {"labels": target}])

    def status() -> dict[str, Any] | None:
        status, body = http_get(f"{alertmanager}/api/v2/alerts?filter=case%3D%22{case}%22")
        found = {a["labels"]["alertname"]: a["status"] for a in json.loads(body)}
        return found if status == 200 and len(found) == 2 else None

    found = wait_until(status, timeout_s=5, what=f"the alerts of {case}", interval_s=0.05)
    assert found[source["alertname"]]["state"] == "active", found
    target_status = found[target["alertname"]]
    assert (target_status["state"] == "suppressed") is inhibited, target_status
    assert bool(target_status["inhibitedBy"]) is inhibited, target_status
