"""The chart's Alertmanager side, rendered by the real Helm engine (helm-python-sdk):

- prometheusRule.alertLabels on every alerting rule of the PrometheusRule, never on a
  recording rule, never overriding a label a rule sets (the render fails in one line);
  alertmanagerConfig.namespaceLabel's templated `namespace`;
- the AlertmanagerConfig (monitoring.coreos.com/v1alpha1, alertmanagerConfig.enabled):
  valid for a subset of its CRD schema, translated into plain Alertmanager configuration
  the way prometheus-operator does (``operator_translation`` below, with the source it
  follows), accepted by Debian's ``amtool check-config`` and routing like the shipped
  alerts/alertmanager/gpu-occupancy-exporter.alertmanager.yaml, which it must equal
  route for route and inhibition for inhibition.

docs/alerting.md describes what the operator does and what the chart does about it.
"""

from __future__ import annotations

import copy
import functools
import json
import subprocess
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import pytest
import yaml

from tests.system_tools import require_tool

# every test renders the chart (~0.3 s each) or runs amtool: the slow tier
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "gpu-occupancy-exporter"
SHIPPED = ROOT / "alerts" / "alertmanager" / "gpu-occupancy-exporter.alertmanager.yaml"
RELEASE, NAMESPACE = "gpu", "gpu-monitoring"
FULLNAME = "gpu-gpu-occupancy-exporter"
ALERTMANAGER_HINT = "apt-get install -y prometheus-alertmanager (Debian's package ships amtool)"
ROUTING_LABELS = {"team": "gpu-platform", "cluster": "prod"}
PAGERDUTY_KEY = "0123456789abcdef0123456789abcdef"  # what the Secret would hold
VALUES: dict[str, Any] = {
    "prometheusRule": {"enabled": True, "alertLabels": ROUTING_LABELS},
    "alertmanagerConfig": {
        "enabled": True,
        "labels": {"alertmanagerConfig": "gpu"},
        "receivers": {
            "pager": {
                "webhookUrl": "https://pager.example.com/hook",
                "pagerdutySecret": {"name": "gpu-pagerduty", "key": "routing-key"},
            },
            "ticket": {"webhookUrl": "https://tickets.example.com/hook"},
            "lowNoise": {"webhookUrl": "https://chat.example.com/hook"},
        },
    },
}

# -- a subset of the AlertmanagerConfig CRD schema -----------------------------------------
# prometheus-operator example/prometheus-operator-crd/monitoring.coreos.com_alertmanagerconfigs.yaml
# (v1alpha1) at 6adcebc: the fields the chart renders, unknown ones refused (the API server
# prunes them silently, and the operator decodes child routes with DisallowUnknownFields:
# pkg/apis/monitoring/v1alpha1/alertmanager_config_types.go, Route.ChildRoutes).
_DURATION = {
    "type": "string",
    "minLength": 1,
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
_MATCHERS = {
    "type": "array",
    "items": {
        "type": "object",
        "additionalProperties": False,
        "required": ["name"],
        "properties": {
            "name": {"type": "string", "minLength": 1},
            "value": {"type": "string"},
            "matchType": {"enum": ["!=", "=", "=~", "!~"]},
        },
    },
}
_ROUTE: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "receiver": {"type": "string"},
        "groupBy": {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
        "groupWait": _DURATION,
        "groupInterval": _DURATION,
        "repeatInterval": _DURATION,
        "matchers": _MATCHERS,
        "continue": {"type": "boolean"},
        "routes": {"type": "array", "items": {"$ref": "#/$defs/route"}},
    },
}
_SECRET_KEY = {
    "type": "object",
    "additionalProperties": False,
    "required": ["key"],
    "properties": {"name": {"type": "string"}, "key": {"type": "string"}},
}
ALERTMANAGER_CONFIG_SCHEMA: dict[str, Any] = {
    "$defs": {"route": _ROUTE},
    "type": "object",
    "additionalProperties": False,
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1alpha1"},
        "kind": {"const": "AlertmanagerConfig"},
        "metadata": {
            "type": "object",
            "required": ["name", "namespace"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            },
        },
        "spec": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "route": {"$ref": "#/$defs/route"},
                "inhibitRules": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "sourceMatch": _MATCHERS,
                            "targetMatch": _MATCHERS,
                            "equal": {"type": "array", "items": {"type": "string"}},
                        },
                    },
                },
                "receivers": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "webhookConfigs": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "url": {"type": "string"},
                                        "urlSecret": _SECRET_KEY,
                                        "sendResolved": {"type": "boolean"},
                                    },
                                },
                            },
                            "pagerdutyConfigs": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "additionalProperties": False,
                                    "properties": {
                                        "routingKey": _SECRET_KEY,
                                        "sendResolved": {"type": "boolean"},
                                    },
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


# -- rendering -------------------------------------------------------------------------------


@functools.cache
def _chart() -> helm.Chart:
    return helm.Chart.load(CHART)


@functools.cache
def _render(values_json: str) -> tuple[tuple[str, str], ...]:
    manifests = _chart().render(
        json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True
    )
    return tuple(sorted(manifests.items()))


def objects(values: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    found = []
    for path, text in _render(json.dumps(values, sort_keys=True)):
        if not path.endswith("NOTES.txt"):
            found += [d for d in yaml.safe_load_all(text) if d and d["kind"] == kind]
    return found


def one(values: dict[str, Any], kind: str) -> dict[str, Any]:
    (found,) = objects(values, kind)
    return found


def alerting_rules(values: dict[str, Any]) -> list[dict[str, Any]]:
    groups = one(values, "PrometheusRule")["spec"]["groups"]
    return [r for g in groups for r in g["rules"] if "alert" in r]


def recording_rules(values: dict[str, Any]) -> list[dict[str, Any]]:
    groups = one(values, "PrometheusRule")["spec"]["groups"]
    return [r for g in groups for r in g["rules"] if "record" in r]


def with_values(**changes: Any) -> dict[str, Any]:
    values = copy.deepcopy(VALUES)
    for dotted, value in changes.items():
        node = values
        *parents, last = dotted.split("__")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    return values


def amtool(*args: str) -> subprocess.CompletedProcess[str]:
    binary = require_tool("amtool", ALERTMANAGER_HINT)
    return subprocess.run([binary, *args], capture_output=True, text=True, timeout=30, check=False)


# -- (c) the PrometheusRule: alertLabels and the namespace label -----------------------------


def test_every_alerting_rule_carries_the_alert_labels_and_no_recording_rule_does() -> None:
    alerts = alerting_rules(VALUES)
    assert len(alerts) >= 20
    for rule in alerts:
        labels = rule["labels"]
        assert {k: labels.get(k) for k in ROUTING_LABELS} == ROUTING_LABELS, rule["alert"]
        assert labels["severity"] in ("critical", "warning", "info"), rule["alert"]
    records = recording_rules(VALUES)
    assert records
    for rule in records:
        assert not set(rule.get("labels", {})) & {*ROUTING_LABELS, "namespace"}, rule["record"]


def test_the_alerts_own_labels_stay_as_the_rule_files_set_them() -> None:
    """alertLabels add; everything else of a rule is what it was without them."""
    plain = alerting_rules({"prometheusRule": {"enabled": True}})
    labelled = alerting_rules(VALUES)
    assert [r["alert"] for r in plain] == [r["alert"] for r in labelled]
    for before, after in zip(plain, labelled, strict=True):
        added = {k: v for k, v in after["labels"].items() if k not in before["labels"]}
        assert set(added) == {*ROUTING_LABELS, "namespace"}, after["alert"]
        assert {k: after["labels"][k] for k in before["labels"]} == before["labels"]
        assert {k: v for k, v in after.items() if k != "labels"} == {
            k: v for k, v in before.items() if k != "labels"
        }


@pytest.mark.parametrize("key", ["severity", "namespace", "source", "node", "uuid", "alertname"])
def test_an_alert_label_the_alerts_already_carry_fails_the_render_in_one_line(key: str) -> None:
    values = with_values(prometheusRule__alertLabels={key: "page", "team": "gpu"})
    with pytest.raises(helm.HelmRenderError) as caught:
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(caught.value)
    line = next(m for m in message.splitlines() if f"prometheusRule.alertLabels.{key}:" in m)
    assert "a routing label must be a new one, e.g. team or cluster" in line, message


def test_an_alert_label_holding_a_template_fails_the_render_in_one_line() -> None:
    values = with_values(prometheusRule__alertLabels={"team": "{{ gpu-platform }}"})
    with pytest.raises(helm.HelmRenderError) as caught:
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)
    assert "routing labels are plain text" in str(caught.value)


def test_the_namespace_label_keeps_a_pods_namespace_and_else_is_the_release_namespace() -> None:
    template = "{{ with $labels.namespace }}{{ . }}{{ else }}" + NAMESPACE + "{{ end }}"
    for rule in alerting_rules(VALUES):
        assert rule["labels"]["namespace"] == template, rule["alert"]
    off = alerting_rules(with_values(alertmanagerConfig__namespaceLabel=False))
    assert not any("namespace" in r["labels"] for r in off)
    no_config = alerting_rules(with_values(alertmanagerConfig__enabled=False))
    assert not any("namespace" in r["labels"] for r in no_config)


# -- (a) the AlertmanagerConfig --------------------------------------------------------------


def test_no_alertmanager_config_by_default() -> None:
    assert not objects({}, "AlertmanagerConfig")
    assert not objects({"prometheusRule": {"enabled": True}}, "AlertmanagerConfig")


def test_the_alertmanager_config_is_valid_and_names_the_receivers_from_values() -> None:
    config = one(VALUES, "AlertmanagerConfig")
    jsonschema.validate(config, ALERTMANAGER_CONFIG_SCHEMA)
    assert config["metadata"]["namespace"] == NAMESPACE
    assert config["metadata"]["name"] == FULLNAME
    assert config["metadata"]["labels"]["alertmanagerConfig"] == "gpu"
    receivers = {r["name"]: r for r in config["spec"]["receivers"]}
    assert set(receivers) == {"gpu-pager", "gpu-ticket", "gpu-low-noise"}
    pager = receivers["gpu-pager"]
    assert pager["webhookConfigs"] == [
        {"url": "https://pager.example.com/hook", "sendResolved": True}
    ]
    assert pager["pagerdutyConfigs"] == [
        {"routingKey": {"name": "gpu-pagerduty", "key": "routing-key"}, "sendResolved": True}
    ]
    assert receivers["gpu-low-noise"]["webhookConfigs"][0]["sendResolved"] is False
    assert "pagerdutyConfigs" not in receivers["gpu-ticket"]


def test_the_schema_subset_rejects_unknown_fields() -> None:
    config = one(VALUES, "AlertmanagerConfig")
    config["spec"]["route"]["routes"][0]["group_wait"] = "30s"  # Alertmanager's spelling
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(config, ALERTMANAGER_CONFIG_SCHEMA)


def test_enabled_without_any_receiver_fails_the_render() -> None:
    values = {"alertmanagerConfig": {"enabled": True}}
    with pytest.raises(helm.HelmRenderError, match=r"alertmanagerConfig.enabled needs a receiver"):
        _chart().render(values, name=RELEASE, namespace=NAMESPACE)


# -- (b) as prometheus-operator would merge it into an Alertmanager's config -----------------
#
# prometheus-operator pkg/alertmanager/amcfg.go at commit 6adcebc (2026-08-08):
# - AddAlertmanagerConfigs (l. 351-408): each AlertmanagerConfig's route becomes a child
#   route of the root route, placed before the root's own children; its inhibit rules are
#   appended to the config's, its receivers too;
# - convertRoute (l. 549-601) and makeNamespacedString (l. 1778-1783): every receiver name
#   (the route's and its children's, and the receivers themselves, l. 785-786) becomes
#   "<namespace>/<name>/<receiver>";
# - convertMatchersV2 (l. 1674-1704) and Matcher.String
#   (pkg/apis/monitoring/v1alpha1/alertmanager_config_types.go l. 1436-1438): a matcher
#   with a matchType is written `name<op>"value"`;
# - getEnforcer (l. 248-265): with the default strategy (OnNamespace) the namespaceEnforcer
#   (l. 146-205) appends `namespace="<namespace>"` to the first-level route's matchers and
#   to both sides of each inhibit rule; with None the noopEnforcer adds nothing; in both
#   cases continueToNextRoute (l. 113-130) sets `continue: true` on the first-level route.
# The root route below is kube-prometheus-stack's default (charts/kube-prometheus-stack/
# values.yaml, alertmanager.config, l. 553-592 at cf408a2): receiver "null", group_by
# [namespace].


def _matcher(m: dict[str, str]) -> str:
    value = m.get("value", "").replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'{m["name"]}{m["matchType"]}"{value}"'


def _route(route: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {"receiver": prefix + route["receiver"]}
    if "groupBy" in route:
        out["group_by"] = route["groupBy"]
    for ours, theirs in (
        ("groupWait", "group_wait"),
        ("groupInterval", "group_interval"),
        ("repeatInterval", "repeat_interval"),
    ):
        if ours in route:
            out[theirs] = route[ours]
    if route.get("matchers"):
        out["matchers"] = [_matcher(m) for m in route["matchers"]]
    if route.get("continue"):
        out["continue"] = True
    if route.get("routes"):
        out["routes"] = [_route(r, prefix) for r in route["routes"]]
    return out


def _receiver(receiver: dict[str, Any], prefix: str, secrets: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"name": prefix + receiver["name"]}
    if "webhookConfigs" in receiver:
        out["webhook_configs"] = [
            {"url": w["url"], "send_resolved": w.get("sendResolved", True)}
            for w in receiver["webhookConfigs"]
        ]
    if "pagerdutyConfigs" in receiver:
        out["pagerduty_configs"] = [
            {
                "routing_key": secrets[f"{p['routingKey']['name']}/{p['routingKey']['key']}"],
                "send_resolved": p.get("sendResolved", True),
            }
            for p in receiver["pagerdutyConfigs"]
        ]
    return out


def operator_translation(
    config: dict[str, Any], secrets: dict[str, str], strategy: str = "OnNamespace"
) -> dict[str, Any]:
    """kube-prometheus-stack's default Alertmanager config with ``config`` merged in."""
    namespace, name = config["metadata"]["namespace"], config["metadata"]["name"]
    prefix = f"{namespace}/{name}/"
    enforce = [f'namespace="{namespace}"'] if strategy == "OnNamespace" else []
    spec = config["spec"]
    route = _route(spec["route"], prefix)
    route["matchers"] = route.get("matchers", []) + enforce
    route["continue"] = True
    inhibit = [
        {
            "source_matchers": [_matcher(m) for m in rule["sourceMatch"]] + enforce,
            "target_matchers": [_matcher(m) for m in rule["targetMatch"]] + enforce,
            "equal": rule["equal"],
        }
        for rule in spec["inhibitRules"]
    ]
    return {
        "route": {
            "receiver": "null",
            "group_by": ["namespace"],
            "routes": [route, {"receiver": "null", "matchers": ['alertname="Watchdog"']}],
        },
        "inhibit_rules": inhibit,
        "receivers": [{"name": "null"}]
        + [_receiver(r, prefix, secrets) for r in spec["receivers"]],
    }


SECRETS = {"gpu-pagerduty/routing-key": PAGERDUTY_KEY}
PREFIX = f"{NAMESPACE}/{FULLNAME}/"


@pytest.fixture(scope="module")
def translated(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("operator") / "alertmanager.yaml"
    merged = operator_translation(one(VALUES, "AlertmanagerConfig"), SECRETS)
    path.write_text(yaml.safe_dump(merged), "utf-8")
    return path


def test_amtool_accepts_the_operators_translation(translated: Path) -> None:
    result = amtool("check-config", str(translated))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 inhibit rules" in result.stdout and "4 receivers" in result.stdout


def _routes_test(config: Path, labels: dict[str, str]) -> str:
    pairs = [f"{k}={v}" for k, v in sorted(labels.items())]
    result = amtool("config", "routes", "test", f"--config.file={config}", *pairs)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


ROUTES = {
    # a node-level alert with the chart's namespace label: ours (`continue: true` lets
    # later siblings match too; none does, and the root's "null" only takes alerts that
    # no child matched)
    "node-critical": (
        {"alertname": "GPUFatalXID", "severity": "critical", "namespace": NAMESPACE},
        f"{PREFIX}gpu-pager",
    ),
    "node-warning": (
        {"alertname": "GPUExporterDown", "severity": "warning", "namespace": NAMESPACE},
        f"{PREFIX}gpu-ticket",
    ),
    "info": (
        {"alertname": "GPUUtilizationWithoutSMActivity", "severity": "info"}
        | {"namespace": NAMESPACE},
        f"{PREFIX}gpu-low-noise",
    ),
    # the limit: a container's alert keeps its pod's namespace and never reaches this
    # AlertmanagerConfig under the OnNamespace strategy
    "pod-namespace": (
        {"alertname": "GPUAllocatedButIdle", "severity": "info", "namespace": "ml"},
        "null",
    ),
    # and without any namespace label (namespaceLabel false) nothing does
    "no-namespace-label": ({"alertname": "GPUFatalXID", "severity": "critical"}, "null"),
}


@pytest.mark.parametrize("case", sorted(ROUTES))
def test_operator_translation_routes(translated: Path, case: str) -> None:
    labels, receivers = ROUTES[case]
    assert _routes_test(translated, labels) == receivers


def test_with_the_none_strategy_every_gpu_alert_is_routed(tmp_path: Path) -> None:
    path = tmp_path / "none.yaml"
    merged = operator_translation(one(VALUES, "AlertmanagerConfig"), SECRETS, "None")
    path.write_text(yaml.safe_dump(merged), "utf-8")
    assert amtool("check-config", str(path)).returncode == 0
    labels = {"alertname": "GPUAllocatedButIdle", "severity": "info", "namespace": "ml"}
    assert _routes_test(path, labels) == f"{PREFIX}gpu-low-noise"


def test_the_chart_routes_and_inhibits_as_the_shipped_file_does() -> None:
    """The translation, with the operator's namespace matchers, receiver prefixes and
    `continue` taken back out, is the shipped file's subtree and inhibit rules."""
    merged = operator_translation(one(VALUES, "AlertmanagerConfig"), SECRETS, "None")
    ours = merged["route"]["routes"][0]
    del ours["continue"]

    def unprefixed(route: dict[str, Any]) -> dict[str, Any]:
        route = {**route, "receiver": route["receiver"].removeprefix(PREFIX)}
        if "routes" in route:
            route["routes"] = [unprefixed(r) for r in route["routes"]]
        return route

    shipped = yaml.safe_load(SHIPPED.read_text(encoding="utf-8"))
    (subtree,) = shipped["route"]["routes"]
    assert unprefixed(ours) == subtree
    assert merged["inhibit_rules"] == shipped["inhibit_rules"]
    receivers = {r["name"].removeprefix(PREFIX) for r in merged["receivers"]} - {"null"}
    assert receivers == {r["name"] for r in shipped["receivers"]} - {"default"}


def test_promtool_accepts_the_labelled_rules(tmp_path: Path) -> None:
    """The templated `namespace` and the alertLabels are valid rule labels (Prometheus
    2.42 also loads them in tests/e2e/test_alertmanager_routing.py)."""
    promtool = require_tool("promtool")
    rules = tmp_path / "rendered.rules.yaml"
    groups = one(VALUES, "PrometheusRule")["spec"]["groups"]
    rules.write_text(yaml.safe_dump({"groups": groups}), "utf-8")
    result = subprocess.run(
        [promtool, "check", "rules", str(rules)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def notes(values: dict[str, Any]) -> str:
    rendered = dict(_render(json.dumps(values, sort_keys=True)))
    return rendered[f"{CHART.name}/templates/NOTES.txt"]


def test_the_notes_say_which_alertmanager_must_select_the_resource() -> None:
    text = notes(VALUES)
    assert "Created AlertmanagerConfig" in text
    assert f"alertmanagerConfigNamespaceSelector: namespace {NAMESPACE}" in text
    for label, value in VALUES["alertmanagerConfig"].get("labels", {}).items():
        assert f'"{label}":"{value}"' in text
    warning = "prometheusRule.enabled is false: the AlertmanagerConfig routes alerts"
    assert (warning in text) is (not VALUES.get("prometheusRule", {}).get("enabled", False))
    assert warning in notes(with_values(prometheusRule__enabled=False))
    assert "Created AlertmanagerConfig" not in notes(with_values(alertmanagerConfig__enabled=False))
