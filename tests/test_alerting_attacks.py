"""An adversary's attacks on the alerting path (the chart's prometheusRule.alertLabels and
AlertmanagerConfig, and the shipped Alertmanager fragment merged into
kube-prometheus-stack's defaults). Each test states the property it holds; those that
fail show a bug found by the attack (the adversary's report says which and why).

Tools: the chart rendered in-process by the real Helm engine (tests/test_helm_chart.py's
helpers), Debian's promtool 2.42, amtool and prometheus-alertmanager 0.25.
"""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.e2e.stack import Child, free_port, http_get, wait_until
from tests.system_tools import require_tool
from tests.test_helm_chart import NAMESPACE, RELEASE, objects

# every test renders the chart or runs promtool/amtool/Alertmanager
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "gpu-occupancy-exporter"
SHIPPED = ROOT / "alerts" / "alertmanager" / "gpu-occupancy-exporter.alertmanager.yaml"
ALERTMANAGER_HINT = "apt-get install -y prometheus-alertmanager (Debian's package ships amtool)"
RECEIVER_OF = {"critical": "gpu-pager", "warning": "gpu-ticket", "info": "gpu-low-noise"}


def _refused(values: dict[str, Any]) -> bool:
    """True when the chart refuses the values (schema or template), else False."""
    try:
        helm.Chart.load(CHART).render(values, name=RELEASE, namespace=NAMESPACE)
    except (helm.HelmRenderError, helm.HelmValuesError):
        return True
    return False


def _rule_groups(alert_labels: dict[str, str]) -> list[dict[str, Any]]:
    values = {"prometheusRule": {"enabled": True, "alertLabels": alert_labels}}
    (rule,) = [o for o in objects(values) if o["kind"] == "PrometheusRule"]
    groups: list[dict[str, Any]] = rule["spec"]["groups"]
    return groups


def _promtool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), *args], capture_output=True, text=True, timeout=120, check=False
    )


# -- prometheusRule.alertLabels ----------------------------------------------------------------

# Values the schema lets through, the render accepts, and Prometheus cannot load: promtool
# (and Prometheus 2.42's rulefmt) refuses the whole rule file, so every GPU alert is gone.
UNLOADABLE = {
    "metric-name-label": {"__name__": "gpu"},
    "template-syntax-error": {"team": "{{ gpu-platform }}"},
}


@pytest.mark.parametrize("case", sorted(UNLOADABLE))
def test_alert_labels_the_chart_renders_are_rules_prometheus_loads(
    case: str, tmp_path: Path
) -> None:
    labels = UNLOADABLE[case]
    if _refused({"prometheusRule": {"enabled": True, "alertLabels": labels}}):
        return  # refused at install time: what a user can fix
    rules = tmp_path / "rendered.rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": _rule_groups(labels)}), "utf-8")
    result = _promtool("check", "rules", str(rules))
    assert result.returncode == 0, (
        f"alertLabels {labels} renders, and promtool refuses the rules: "
        + (result.stdout + result.stderr)[-400:]
    )


def _promtool_expect(
    tmp_path: Path,
    labels: dict[str, str],
    input_series: list[str],
    values: str,
    expr: str,
    eval_time: str,
    sample: dict[str, Any],
) -> subprocess.CompletedProcess[str]:
    """promtool test rules on the rules rendered with alertLabels: `expr` at eval_time
    must give exactly `sample` ({"labels": ..., "value": ...})."""
    rules = tmp_path / "rendered.rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": _rule_groups(labels)}), "utf-8")
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": s, "values": values} for s in input_series],
                "promql_expr_test": [
                    {"expr": expr, "eval_time": eval_time, "exp_samples": [sample]}
                ],
            }
        ],
    }
    path = tmp_path / "attack.test.yaml"
    path.write_text(yaml.safe_dump(test), "utf-8")
    return _promtool("test", "rules", str(path))


def test_alertname_in_alert_labels_is_refused(tmp_path: Path) -> None:
    """Prometheus sets `alertname` after the rule's labels: an alertLabels.alertname is
    dropped without a word (promtool shows the alert keeping its own name)."""
    labels = {"alertname": "GPUPlatform", "team": "gpu"}
    if _refused({"prometheusRule": {"enabled": True, "alertLabels": labels}}):
        return
    result = _promtool_expect(
        tmp_path,
        labels,
        ['gpu_exporter_source_up{source="kube",instance="n1:9400",job="j",node="n1"}'],
        "0x20",
        'count by (alertname) (ALERTS{alertstate="firing",source="kube"})',
        "15m",
        {"labels": '{alertname="GPUPlatform"}', "value": 1},
    )
    assert result.returncode == 0, (
        "alertLabels.alertname rendered and dropped by Prometheus: "
        + (result.stdout + result.stderr)[-600:]
    )


# Labels users add for routing that the exporter's own series also carry: every rule that
# yields two alerts differing only in that label now yields the same label set twice, and
# Prometheus fails the rule's evaluation ("vector contains metrics with the same labelset
# after applying alert labels"): not one alert of that rule fires, on any node.
# case -> (alertLabels, two series of one rule, the count expression, eval time, values)
COLLISIONS: dict[str, tuple[dict[str, str], list[str], str, str, str]] = {
    "source-two-sources-down": (
        {"source": "gpu-occupancy-exporter"},
        [
            f'gpu_exporter_source_up{{source="{s}",instance="n1:9400",job="j",node="n1"}}'
            for s in ("kube", "podresources")
        ],
        'count(ALERTS{alertname="GPUExporterSourceDown",alertstate="firing"})',
        "15m",
        "0x20",
    ),
    # docs/alerting.md offers alertLabels.namespace; two pods named alike in two
    # namespaces, time-slicing one GPU
    "namespace-two-namespaces-one-gpu": (
        {"namespace": "gpu-monitoring"},
        [
            "gpu_container_idle_allocated_seconds_total{"
            f'namespace="{ns}",pod="worker-0",container="main",instance="n1:9400",'
            'job="j",node="n1",gpu="0",uuid="GPU-a"}'
            for ns in ("team-a", "team-b")
        ],
        'count(ALERTS{alertname="GPUAllocatedButIdle"})',
        "90m",
        "0+60x120",
    ),
}


@pytest.mark.parametrize("case", sorted(COLLISIONS))
def test_alert_labels_never_merge_two_alerts_of_one_rule(case: str, tmp_path: Path) -> None:
    labels, series, expr, at, values = COLLISIONS[case]
    two = {"labels": "{}", "value": 2}
    # the attack's series give two alerts without alertLabels (else it proves nothing)
    baseline = _promtool_expect(tmp_path, {}, series, values, expr, at, two)
    assert baseline.returncode == 0, (baseline.stdout + baseline.stderr)[-600:]
    if _refused({"prometheusRule": {"enabled": True, "alertLabels": labels}}):
        return
    result = _promtool_expect(tmp_path, labels, series, values, expr, at, two)
    assert result.returncode == 0, (
        f"alertLabels {labels}: the rule's two alerts collide: "
        + (result.stdout + result.stderr)[-600:]
    )


# -- alertmanagerConfig.receivers: what reaches the AlertmanagerConfig as typed ---------------


def _pager(receiver: dict[str, Any]) -> dict[str, Any] | None:
    values = {
        "prometheusRule": {"enabled": True},
        "alertmanagerConfig": {"enabled": True, "receivers": {"pager": receiver}},
    }
    if _refused(values):
        return None
    (config,) = [o for o in objects(values) if o["kind"] == "AlertmanagerConfig"]
    pager: dict[str, Any] = next(r for r in config["spec"]["receivers"] if r["name"] == "gpu-pager")
    return pager


# Valid Secret names (DNS subdomains) and keys ([-._a-zA-Z0-9]+) that YAML reads as
# something else when written unquoted: a bool or a number fails the CRD's string type.
@pytest.mark.parametrize(
    "secret",
    [
        {"name": "1234", "key": "routing-key"},
        {"name": "yes", "key": "routing-key"},
        {"name": "pagerduty", "key": "true"},
        {"name": "pagerduty", "key": "1"},
    ],
    ids=["name-1234", "name-yes", "key-true", "key-1"],
)
def test_the_pagerduty_secret_reference_is_rendered_as_typed(secret: dict[str, str]) -> None:
    pager = _pager({"pagerdutySecret": secret})
    assert pager is not None, f"valid Secret reference {secret} refused"
    assert pager["pagerdutyConfigs"][0]["routingKey"] == secret


def test_a_pagerduty_secret_without_its_key_is_refused() -> None:
    """`key: null` in a values file removes the default (Helm drops null keys), and the
    template writes `key:` with nothing: the CRD's SecretKeySelector requires `key`
    (k8s.io/api core/v1 types.go, SecretKeySelector.Key `json:"key"`)."""
    pager = _pager({"pagerdutySecret": {"name": "pagerduty", "key": None}})
    if pager is None:
        return
    key = pager["pagerdutyConfigs"][0]["routingKey"].get("key")
    assert isinstance(key, str) and key, f"rendered routingKey.key = {key!r}"


# -- the shipped fragment merged into kube-prometheus-stack's default config ------------------

# kube-prometheus-stack 88.5.3, charts/kube-prometheus-stack/values.yaml l. 553-592 at
# prometheus-community/helm-charts cf408a2 (alertmanager.config, templates left out)
KPS_DEFAULT = yaml.safe_load(
    """
global: {resolve_timeout: 5m}
inhibit_rules:
  - source_matchers: ['severity = critical']
    target_matchers: ['severity =~ warning|info']
    equal: ['namespace', 'alertname']
  - source_matchers: ['severity = warning']
    target_matchers: ['severity = info']
    equal: ['namespace', 'alertname']
  - source_matchers: ['alertname = InfoInhibitor']
    target_matchers: ['severity = info']
    equal: ['namespace']
  - target_matchers: ['alertname = InfoInhibitor']
route:
  group_by: ['namespace']
  group_wait: 30s
  group_interval: 5m
  repeat_interval: 12h
  receiver: 'null'
  routes:
  - receiver: 'null'
    matchers: ['alertname = "Watchdog"']
receivers:
- name: 'null'
"""
)


def _merged(tmp_path: Path) -> Path:
    """docs/alerting.md's merge: the subtree into routes, the receivers but `default`,
    the inhibit rules."""
    fragment = yaml.safe_load(SHIPPED.read_text(encoding="utf-8"))
    merged = json.loads(json.dumps(KPS_DEFAULT))
    merged["route"]["routes"].append(fragment["route"]["routes"][0])
    merged["receivers"] += [r for r in fragment["receivers"] if r["name"] != "default"]
    merged["inhibit_rules"] += fragment["inhibit_rules"]
    path = tmp_path / "alertmanager.yml"
    path.write_text(yaml.safe_dump(merged), "utf-8")
    return path


def _routes_test(config: Path, labels: dict[str, str]) -> str:
    amtool = require_tool("amtool", ALERTMANAGER_HINT)
    pairs = [f"{k}={v}" for k, v in sorted(labels.items())]
    result = subprocess.run(
        [amtool, "config", "routes", "test", f"--config.file={config}", *pairs],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def _alerts() -> dict[str, str]:
    found = {}
    for path in sorted((ROOT / "alerts").glob("*.yaml")):
        for group in yaml.safe_load(path.read_text(encoding="utf-8"))["groups"]:
            for rule in group["rules"]:
                if "alert" in rule:
                    found[rule["alert"]] = rule["labels"]["severity"]
    return found


GPU = {"node": "n1", "instance": "10.0.0.1:9445", "job": "j", "gpu": "0", "uuid": "GPU-a"}
NODE = {k: GPU[k] for k in ("node", "instance", "job")}
CONTAINER = GPU | {"namespace": "ml", "pod": "p", "container": "c"}
# label sets as the expressions produce them; every alert on the same GPU and node (the
# worst case for inhibitions); the others are about one GPU
SHAPE = {
    "GPUClusterFailureHeadroomExhausted": {"model": "H100", "resource": "nvidia.com/gpu"},
    "GPUExporterAbsent": {},
    "GPUNodeCapacityReduced": NODE | {"resource": "nvidia.com/gpu"},
    "GPUExporterDown": NODE,
    "GPUExporterDownDuringCriticalAlert": NODE,
    "GPUExporterFlapping": NODE,
    "GPUExporterSourceDown": NODE | {"source": "kube"},
    "GPUExporterNVMLDown": NODE | {"source": "nvml"},
    "GPUExporterSamplesStale": NODE,
    "GPUAllocatedButIdle": CONTAINER,
    "GPUStarvedByCPU": CONTAINER,
    "GPUIsolationLeak": CONTAINER,
    "GPUTimeSliceHog": CONTAINER,
}


def test_merged_into_kube_prometheus_stack_every_alert_reaches_its_receiver(
    tmp_path: Path,
) -> None:
    config = _merged(tmp_path)
    check = subprocess.run(
        [require_tool("amtool", ALERTMANAGER_HINT), "check-config", str(config)],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert check.returncode == 0, check.stdout + check.stderr
    wrong = {}
    for name, severity in _alerts().items():
        labels = {"alertname": name, "severity": severity} | SHAPE.get(name, GPU)
        got = _routes_test(config, labels)
        if got != RECEIVER_OF[severity]:
            wrong[name] = got
    assert not wrong, wrong
    assert _routes_test(config, {"alertname": "Watchdog"}) == "null"


def test_another_products_gpu_alert_stays_with_the_root_receiver(tmp_path: Path) -> None:
    """The NVIDIA GPU Operator installs, on OpenShift, PrometheusRules whose alerts are
    named GPUOperator* (severity warning): gpu-operator
    assets/state-operator-metrics/0400_prometheus_rule_openshift.yaml l. 12-110,
    assets/state-node-status-exporter/0800_prometheus_rule_openshift.yaml l. 12-57;
    controllers/state_manager.go l. 1049-1050 (always deployed) and resource_manager.go
    l. 91-93 (openshift files only there). `alertname=~"GPU.*"` takes them."""
    config = _merged(tmp_path)
    for name in ("GPUOperatorReconciliationFailed", "GPUOperatorNodeDeploymentDriverFailed"):
        labels = {"alertname": name, "severity": "warning", "namespace": "nvidia-gpu-operator"}
        assert _routes_test(config, labels) == "null", name


def test_merged_no_critical_alert_is_ever_inhibited(tmp_path: Path) -> None:
    """Every alert of alerts/*.yaml firing at once on one GPU and node, plus
    kube-prometheus-stack's InfoInhibitor and Watchdog, in a real Alertmanager: no
    critical alert is inhibited; the inhibited ones are warnings and infos only."""
    binary = require_tool("prometheus-alertmanager", ALERTMANAGER_HINT)
    config = _merged(tmp_path)
    port = free_port()
    child = Child(
        "alertmanager",
        [
            binary,
            f"--config.file={config}",
            f"--storage.path={tmp_path / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--cluster.listen-address=",
            "--log.level=warn",
        ],
        tmp_path / "alertmanager.log",
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
        alerts = _alerts()
        posted = [
            {"labels": {"alertname": n, "severity": s} | SHAPE.get(n, GPU)}
            for n, s in alerts.items()
        ]
        posted += [
            {"labels": {"alertname": "InfoInhibitor", "severity": "none", "namespace": "ml"}},
            {"labels": {"alertname": "Watchdog", "severity": "none"}},
        ]
        request = urllib.request.Request(
            f"{url}/api/v2/alerts",
            data=json.dumps(posted).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            assert response.status == 200

        def inhibited() -> dict[str, str] | None:
            status, body = http_get(f"{url}/api/v2/alerts")
            found = json.loads(body) if status == 200 else []
            if len(found) != len(posted):
                return None
            return {
                a["labels"]["alertname"]: a["labels"]["severity"]
                for a in found
                if a["status"]["inhibitedBy"]
            }

        # inhibition is computed on read: a second read after all are in is the verdict
        wait_until(inhibited, timeout_s=5, what="every posted alert", interval_s=0.05)
        verdict = inhibited()
        assert verdict is not None
        assert "GPUOrphanedMemory" in verdict, verdict  # the rules act here at all
        assert not {n for n, s in verdict.items() if s == "critical"}, verdict
    finally:
        child.stop()
