"""alerts/: valid Prometheus rules, unit-tested with promtool at every `for:` boundary,
documented in docs/runbooks.md, and built only from metrics the exporter documents.

promtool (Debian/Ubuntu: `apt-get install prometheus`) is required: without it these tests
fail rather than skip, because a rule file nobody checked is worse than none.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.system_tools import require_tool

ROOT = Path(__file__).resolve().parent.parent
ALERTS = ROOT / "alerts"
UNIT_TESTS = ALERTS / "tests"
# Opt-in rule files (the Helm chart renders them only when asked): held to the same checks.
COMPAT = ALERTS / "compat"
RUNBOOKS = ROOT / "docs" / "runbooks.md"
METRICS_DOC = ROOT / "docs" / "metrics.md"
RUNBOOK_BASE = (
    "https://github.com/gpu-occupancy-exporter/gpu-occupancy-exporter/blob/main/docs/runbooks.md"
)
SEVERITIES = {"critical", "warning", "info"}
NODE_OR_INSTANCE = "{{ with $labels.node }}{{ . }}{{ else }}{{ $labels.instance }}{{ end }}"

# Series Prometheus itself provides.
PROMETHEUS_METRICS = {"up", "ALERTS"}
# Recorded by the Helm chart's PrometheusRule only when chargeback.pricePerGpuHour is set
# (templates/prometheusrule.yaml; tests/test_helm_chart.py holds the rendered names to these).
CHART_RECORDED = {"model:gpu_price_per_gpu_hour:value", "namespace_owner:gpu_cost:increase1d"}


# --- helpers (tests/test_dashboards.py uses them too) --------------------------------


def require_promtool() -> str:
    return require_tool("promtool")


def run_promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_promtool(), *args],
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=120,
        check=False,
    )


def rule_files() -> list[Path]:
    return sorted(ALERTS.glob("*.yaml")) + sorted(COMPAT.glob("*.yaml"))


def unit_test_files() -> list[Path]:
    return sorted(UNIT_TESTS.glob("*.yaml"))


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def all_rules() -> list[dict[str, Any]]:
    return [rule for f in rule_files() for g in load_yaml(f)["groups"] for rule in g["rules"]]


def alerting_rules() -> list[dict[str, Any]]:
    return [r for r in all_rules() if "alert" in r]


def recorded_names() -> set[str]:
    return {r["record"] for r in all_rules() if "record" in r}


_DURATION = re.compile(r"(\d+)(ms|s|m|h|d|w|y)")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def duration_s(text: str) -> float:
    """A Prometheus duration ("1h30m", "5m", "90s") in seconds."""
    parts = _DURATION.findall(text)
    assert parts and "".join(n + u for n, u in parts) == text, f"bad duration {text!r}"
    return sum(int(n) * _UNIT_S[u] for n, u in parts)


_PROMQL_WORDS = {
    "and", "or", "unless", "bool", "offset", "by", "without", "on", "ignoring",
    "group_left", "group_right", "inf", "nan", "start", "end",
}  # fmt: skip


def referenced_metrics(expr: str) -> set[str]:
    """Metric names a PromQL expression reads (names in `{__name__=~"a|b"}` included).

    A lexical pass, enough for our own expressions: strings, label matchers, ranges and
    grouping clauses are removed first; what is left that is not a keyword, a number or a
    function call is a metric name.
    """
    names: set[str] = set()
    for op, value in re.findall(r'__name__\s*(=~|=)\s*"([^"]*)"', expr):
        names.update(value.split("|") if op == "=~" else [value])
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    text = re.sub(r"\b\d+(?:\.\d+)?(?:[eE][+-]?\d+)?(?:ms|s|m|h|d|w|y)?\b", " ", text)
    for match in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        word = match.group()
        if text[match.end() :].lstrip().startswith("(") or word.lower() in _PROMQL_WORDS:
            continue
        names.add(word)
    return names


def documented_metrics() -> set[str]:
    """Names a query may use for what docs/metrics.md lists (histograms by their series).
    A row may name several metrics of one type (`a`, `b`, `c` | counter |)."""
    rows = re.findall(
        r"^\| (`[a-z_][a-z0-9_]*`(?:, `[a-z_][a-z0-9_]*`)*) \| (gauge|counter|histogram) \|",
        METRICS_DOC.read_text(encoding="utf-8"),
        re.MULTILINE,
    )
    assert rows, "no metric rows found in docs/metrics.md"
    names = set()
    for cell, kind in rows:
        for name in re.findall(r"`([a-z_][a-z0-9_]*)`", cell):
            names.add(name)
            if kind == "histogram":
                names.update(f"{name}_{suffix}" for suffix in ("bucket", "sum", "count"))
    return names


def known_metrics() -> set[str]:
    return documented_metrics() | recorded_names() | CHART_RECORDED | PROMETHEUS_METRICS


def github_anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    slug = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return slug.replace(" ", "-")


def runbook_anchors() -> set[str]:
    text = RUNBOOKS.read_text(encoding="utf-8")
    return {github_anchor(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def unit_test_cases() -> list[tuple[str, float, bool]]:
    """(alertname, eval time in seconds, fires?) for every alert_rule_test case."""
    cases = []
    for path in unit_test_files():
        for group in load_yaml(path)["tests"]:
            for case in group.get("alert_rule_test", []):
                cases.append(
                    (case["alertname"], duration_s(case["eval_time"]), bool(case["exp_alerts"]))
                )
    return cases


# --- tests ---------------------------------------------------------------------------


def test_promtool_is_installed() -> None:
    require_promtool()


def test_there_are_rule_files_and_unit_tests() -> None:
    assert [p.relative_to(ALERTS).as_posix() for p in rule_files()] == [
        "gpu-occupancy-exporter.capacity.yaml",
        "gpu-occupancy-exporter.chargeback.yaml",
        "gpu-occupancy-exporter.recording.yaml",
        "gpu-occupancy-exporter.rightsizing.yaml",
        "gpu-occupancy-exporter.rules.yaml",
        "compat/dcgm-exporter-4.9.recording.yaml",
        "compat/dcgm-exporter.recording.yaml",
    ]
    assert unit_test_files()


@pytest.mark.parametrize("path", rule_files(), ids=lambda p: p.relative_to(ALERTS).as_posix())
def test_promtool_check_rules_accepts_the_rule_file(path: Path) -> None:
    result = run_promtool("check", "rules", "--lint=all", "--lint-fatal", str(path))
    assert result.returncode == 0, result.stdout


@pytest.mark.parametrize("path", unit_test_files(), ids=lambda p: p.name)
def test_promtool_unit_tests_pass(path: Path) -> None:
    result = run_promtool("test", "rules", path.name, cwd=path.parent)
    assert result.returncode == 0, result.stdout


def test_every_rule_file_is_loaded_by_a_unit_test_file() -> None:
    loaded = {
        (path.parent / f).resolve()
        for path in unit_test_files()
        for f in load_yaml(path)["rule_files"]
    }
    assert {p.resolve() for p in rule_files()} <= loaded


def test_every_alert_has_firing_and_quiet_unit_test_cases() -> None:
    cases = unit_test_cases()
    for rule in alerting_rules():
        name = rule["alert"]
        fires = [t for a, t, f in cases if a == name and f]
        quiet = [t for a, t, f in cases if a == name and not f]
        assert fires, f"{name}: no unit test case where it fires"
        assert quiet, f"{name}: no unit test case where it stays quiet"


def test_unit_tests_only_name_alerts_that_exist() -> None:
    names = {r["alert"] for r in alerting_rules()}
    assert {a for a, _, _ in unit_test_cases()} <= names


def _alerts_with_for() -> list[str]:
    return [r["alert"] for r in alerting_rules() if duration_s(r.get("for", "0s")) > 0]


@functools.cache
def _parsed(relative: Path) -> Any:
    return load_yaml(ALERTS / relative)


def copy_of_parsed(relative: Path) -> Any:
    """A file under alerts/, parsed once per module (the YAML parser took most of a
    for-duration test's time outside promtool): a deep copy, free to change."""
    return deepcopy(_parsed(relative))


def _run_unit_tests_with_for(tmp_path: Path, alert: str, new_for: str) -> str:
    """Copy alerts/ with the alert's `for:` changed; return promtool's output on failure.

    Only the unit test groups with an alert_rule_test case for the alert are run, all in one
    promtool process: promtool evaluates each group on its own (its own series, its own
    rule manager), and "alertname: <alert>," is printed only for a case of that alert, so
    the groups left out could not have reported it (they were most of promtool's time)."""
    copy = tmp_path / "alerts"
    shutil.copytree(ALERTS, copy)
    for path in sorted(copy.glob("*.yaml")):
        doc = copy_of_parsed(path.relative_to(copy))
        for group in doc["groups"]:
            for rule in group["rules"]:
                if rule.get("alert") == alert:
                    rule["for"] = new_for
        path.write_text(yaml.safe_dump(doc, sort_keys=False, width=1000), encoding="utf-8")
    selected = []
    for test_file in sorted((copy / "tests").glob("*.yaml")):
        unit = copy_of_parsed(test_file.relative_to(copy))
        groups = [
            group
            for group in unit["tests"]
            if any(case["alertname"] == alert for case in group.get("alert_rule_test", []))
        ]
        if not groups:
            continue
        unit["tests"] = groups
        test_file.write_text(yaml.safe_dump(unit, sort_keys=False, width=1000), encoding="utf-8")
        selected.append(test_file.name)
    assert selected, f"no unit test case names {alert}"
    result = run_promtool("test", "rules", *selected, cwd=copy / "tests")
    return result.stdout if result.returncode != 0 else ""


@pytest.mark.slow  # two promtool runs per alert (~1 s each alert)
@pytest.mark.parametrize("alert", _alerts_with_for())
def test_unit_tests_pin_the_for_duration(alert: str, tmp_path: Path) -> None:
    """Without its `for:` the alert must fire where a test expects quiet (it must not fire
    early), and with a `for:` half as long again it must miss a case where a test expects
    it (it must fire once `for:` has passed)."""
    rule = next(r for r in alerting_rules() if r["alert"] == alert)
    longer = f"{int(duration_s(rule['for']) * 1.5)}s"
    for new_for, what in (("0s", "firing before its for:"), (longer, "firing after its for:")):
        output = _run_unit_tests_with_for(tmp_path / new_for, alert, new_for)
        assert f"alertname: {alert}," in output, (
            f"{alert}: no unit test notices when for: is {new_for}; add a case checking {what}"
        )


def test_every_recording_rule_has_a_unit_test() -> None:
    tested = {
        case["expr"].strip()
        for path in unit_test_files()
        for group in load_yaml(path)["tests"]
        for case in group.get("promql_expr_test", [])
    }
    assert sorted(recorded_names() - tested) == []


def test_rule_names_are_unique() -> None:
    names = [r.get("alert") or r["record"] for r in all_rules()]
    assert sorted({n for n in names if names.count(n) > 1}) == []


@pytest.mark.parametrize("rule", alerting_rules(), ids=lambda r: r["alert"])
def test_alert_has_severity_summary_description_and_runbook(rule: dict[str, Any]) -> None:
    assert rule.get("labels", {}).get("severity") in SEVERITIES
    annotations = rule.get("annotations", {})
    for key in ("summary", "description", "runbook_url"):
        assert str(annotations.get(key, "")).strip(), f"{rule['alert']}: no {key}"
    assert annotations["runbook_url"] == f"{RUNBOOK_BASE}#{rule['alert'].lower()}"


# Alerts about no node: GPUExporterAbsent (nothing is scraped), and the cluster's failure
# headroom (alerts/gpu-occupancy-exporter.capacity.yaml: per GPU model, over every node)
CLUSTER_ALERTS = {"GPUExporterAbsent", "GPUClusterFailureHeadroomExhausted"}


@pytest.mark.parametrize("rule", alerting_rules(), ids=lambda r: r["alert"])
def test_annotations_name_the_node_with_an_instance_fallback(rule: dict[str, Any]) -> None:
    """Without the `node` relabelling a bare $labels.node would print nothing."""
    for key in ("summary", "description"):
        text = rule["annotations"][key]
        bare = text.replace(NODE_OR_INSTANCE, "")
        assert "$labels.node" not in bare, f"{rule['alert']} {key}: bare $labels.node"
        if rule["alert"] not in CLUSTER_ALERTS:
            assert NODE_OR_INSTANCE in text, f"{rule['alert']} {key}: names no node"


@pytest.mark.parametrize(
    "rule",
    [r for r in alerting_rules() if "$labels.uuid" in r["annotations"]["description"]],
    ids=lambda r: r["alert"],
)
def test_gpu_alerts_name_the_gpu_index_and_uuid(rule: dict[str, Any]) -> None:
    for key in ("summary", "description"):
        text = rule["annotations"][key]
        assert "$labels.gpu " in text and "$labels.uuid" in text, f"{rule['alert']} {key}"


def test_every_runbook_url_points_at_a_section_of_docs_runbooks() -> None:
    anchors = runbook_anchors()
    for rule in alerting_rules():
        url = rule["annotations"]["runbook_url"]
        base, _, anchor = url.partition("#")
        assert base == RUNBOOK_BASE, url
        assert anchor in anchors, f"{rule['alert']}: docs/runbooks.md has no #{anchor}"


def test_every_alert_section_in_the_runbooks_is_an_alert() -> None:
    sections = re.findall(r"^## (GPU\w+)\s*$", RUNBOOKS.read_text(encoding="utf-8"), re.MULTILINE)
    assert sorted(sections) == sorted(r["alert"] for r in alerting_rules())


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.get("alert") or r["record"])
def test_rules_read_only_documented_metrics(rule: dict[str, Any]) -> None:
    unknown = referenced_metrics(rule["expr"]) - known_metrics()
    assert not unknown, f"not in docs/metrics.md nor recorded here: {sorted(unknown)}"


# --- activity: counters, not gauges (docs/dashboards.md, "Activity: counters, not gauges")

# The activity gauges: each the mean of the exporter's last sample window only, so a scrape
# sees a slice of each scrape interval and a periodic load aliases. Rules read the
# `*_seconds_total` counter beside each, as a rate.
ACTIVITY_GAUGES = {
    "gpu_utilization_ratio": "gpu_utilization_seconds_total",
    "gpu_graphics_active_ratio": "gpu_graphics_active_seconds_total",
    "gpu_sm_active_ratio": "gpu_sm_active_seconds_total",
    "gpu_sm_occupancy_ratio": "gpu_sm_occupancy_seconds_total",
    "gpu_tensor_active_ratio": "gpu_tensor_active_seconds_total",
    "gpu_dram_active_ratio": "gpu_dram_active_seconds_total",
    "gpu_fp64_active_ratio": "gpu_fp64_active_seconds_total",
    "gpu_fp32_active_ratio": "gpu_fp32_active_seconds_total",
    "gpu_fp16_active_ratio": "gpu_fp16_active_seconds_total",
    "gpu_container_sm_utilization_ratio": "gpu_container_sm_seconds_total",
}
# Rules that read a gauge on purpose, with the reason: dcgm-exporter's GPU-Util is one NVML
# reading per DCGM update, as the gauge is (alerts/compat/dcgm-exporter.recording.yaml).
GAUGE_ON_PURPOSE = {
    "DCGM_FI_DEV_GPU_UTIL": "dcgm-exporter serves one NVML GPU-Util reading, as the gauge",
    "DCGM_FI_DEV_GPU_UTIL_RATIO": "the same field under dcgm-exporter 4.9's name",
}
# The shortest window a rate of an activity counter may use: four scrapes at 30 s, the
# slowest scrape interval the docs support, so a missed scrape still leaves two samples.
MIN_ACTIVITY_WINDOW_S = 120


def activity_rates(expr: str) -> list[tuple[str, str]]:
    """(counter, window) for every rate over an activity counter in ``expr``."""
    counters = "|".join(ACTIVITY_GAUGES.values())
    return re.findall(rf"\brate\(\s*({counters})\b(?:\{{[^}}]*\}})?\[([^\]]+)\]\)", expr)


@pytest.mark.parametrize("rule", all_rules(), ids=lambda r: r.get("alert") or r["record"])
def test_rules_read_activity_from_the_counters(rule: dict[str, Any]) -> None:
    """No rule reads an activity gauge (save GAUGE_ON_PURPOSE); every activity counter is
    read as a rate over at least MIN_ACTIVITY_WINDOW_S."""
    name = rule.get("alert") or rule["record"]
    metrics = referenced_metrics(rule["expr"])
    gauges = sorted(metrics & set(ACTIVITY_GAUGES))
    if name not in GAUGE_ON_PURPOSE:
        assert not gauges, f"{name} reads {gauges}: use rate() of {ACTIVITY_GAUGES[gauges[0]]}"
    counters = metrics & set(ACTIVITY_GAUGES.values())
    rates = activity_rates(rule["expr"])
    assert {c for c, _ in rates} == counters, f"{name}: an activity counter not read by rate()"
    for counter, window in rates:
        assert duration_s(window) >= MIN_ACTIVITY_WINDOW_S, f"{name}: rate({counter}[{window}])"


def test_the_activity_checks_find_gauges_and_short_windows() -> None:
    assert activity_rates('rate(gpu_sm_active_seconds_total{gpu_instance=""}[2m]) - x') == [
        ("gpu_sm_active_seconds_total", "2m")
    ]
    assert activity_rates("increase(gpu_utilization_seconds_total[1m])") == []
    assert activity_rates("rate(gpu_container_sm_seconds_total[30s])") == [
        ("gpu_container_sm_seconds_total", "30s")
    ]
    read = {r.get("alert") or r["record"]: r["expr"] for r in all_rules()}
    assert set(GAUGE_ON_PURPOSE) <= set(read)
    for name in GAUGE_ON_PURPOSE:
        assert "gpu_utilization_ratio" in read[name], name


def test_the_metric_name_scanner_finds_names_and_skips_the_rest() -> None:
    expr = (
        'sum by (node, instance) (rate(gpu_a_total{job=~"x|y", b="1e3"}[5m] offset 1h)) '
        '/ on (uuid) group_left (kind) max(gpu_b{c!=""}) > 0.5 and time() - ns:gpu_c:sum '
        '> 1e3 or absent(up{job="z"}) unless {__name__=~"gpu_d|gpu_e", f="g"}'
    )
    assert referenced_metrics(expr) == {
        "gpu_a_total",
        "gpu_b",
        "ns:gpu_c:sum",
        "up",
        "gpu_d",
        "gpu_e",
    }
