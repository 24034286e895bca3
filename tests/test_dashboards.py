"""dashboards/: generated, importable Grafana dashboards whose every query parses as PromQL
(checked by promtool) and reads only metrics the exporter documents or the recording rules
produce."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.test_alert_rules import (
    ACTIVITY_GAUGES,
    activity_rates,
    all_rules,
    known_metrics,
    referenced_metrics,
    run_promtool,
)

ROOT = Path(__file__).resolve().parent.parent
DASHBOARDS = ROOT / "dashboards"
DOC = ROOT / "docs" / "dashboards.md"
CHART_DASHBOARDS = ROOT / "charts" / "gpu-occupancy-exporter" / "files" / "dashboards"
DS = {"type": "prometheus", "uid": "${datasource}"}
MODERN_TYPES = {"row", "timeseries", "stat", "table", "bargauge", "gauge", "state-timeline"}
# Grafana's own variables, replaced by durations when checking the PromQL.
BUILTIN_DURATIONS = {"__rate_interval": "5m", "__interval": "1m", "__range": "1h"}
# Unit a panel must use when all its queries read metrics with this suffix and neither
# divide nor count (a ratio of bytes is a percentage; a count of anything is a count).
SUFFIX_UNITS = {
    "_bytes": {"bytes", "decbytes"},
    "_ratio": {"percentunit"},
    "_watts": {"watt"},
    "_celsius": {"celsius"},
    "_hertz": {"hertz"},
}

Json = dict[str, Any]


def load_generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("dashboards_generate", DASHBOARDS / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboard_files() -> list[Path]:
    return sorted(DASHBOARDS.glob("*.json"))


def load(path: Path) -> Json:
    board: Json = json.loads(path.read_text(encoding="utf-8"))
    return board


def panels(board: Json) -> Iterator[Json]:
    for panel in board["panels"]:
        yield panel
        yield from panel.get("panels", [])  # collapsed rows keep their panels inside


def queries(board: Json) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target, annotation and variable query."""
    for panel in panels(board):
        for t in panel.get("targets", []):
            yield f"panel {panel['id']} {panel['title']!r} {t['refId']}", t["expr"]
    for a in board["annotations"]["list"]:
        if "expr" in a:
            yield f"annotation {a['name']!r}", a["expr"]
    for v in board["templating"]["list"]:
        if v["type"] == "query":
            match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"], re.DOTALL)
            assert match, f"variable {v['name']}: not label_values(selector, label)"
            yield f"variable {v['name']}", match.group(1)


def substitute(expr: str) -> str:
    """Template variables -> values PromQL accepts: regex filters become `.*`."""

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return BUILTIN_DURATIONS.get(name, ".*")

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


def all_boards() -> list[tuple[str, Json]]:
    return [(p.name, load(p)) for p in dashboard_files()]


BOARDS = all_boards()
BOARD_IDS = [name for name, _ in BOARDS]
# Fleet level, from the chargeback recording rules, which keep no node, instance or GPU.
FLEET_BOARDS = {"gpu-waste.json"}
NODE_BOARDS = [(name, board) for name, board in BOARDS if name not in FLEET_BOARDS]


def test_the_four_dashboards_exist() -> None:
    assert BOARD_IDS == [
        "gpu-health-orphans.json",
        "gpu-node-overview.json",
        "gpu-pods.json",
        "gpu-waste.json",
    ]


def test_committed_dashboards_match_the_generator() -> None:
    """Every dashboard regenerated in memory, byte for byte the committed JSON and the Helm
    chart's copy of it."""
    generator = load_generator()
    generated = generator.build_all()
    assert sorted(generated) == BOARD_IDS
    assert sorted(p.name for p in CHART_DASHBOARDS.glob("*.json")) == BOARD_IDS
    for name, board in generated.items():
        text = generator.render(board)
        committed = (DASHBOARDS / name).read_text(encoding="utf-8")
        assert committed == text, f"{name} is out of date: run python dashboards/generate.py"
        chart_copy = (CHART_DASHBOARDS / name).read_text(encoding="utf-8")
        assert chart_copy == text, f"the chart's {name} is out of date: run charts/sync-files.sh"


def test_the_generator_runs_as_a_script() -> None:
    """As the docs run it, from the repository root: its modules import each other by name."""
    result = subprocess.run(
        [sys.executable, "dashboards/generate.py", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_dashboard_is_importable(name: str, board: Json) -> None:
    assert board["schemaVersion"] >= 39
    assert board["uid"] and len(board["uid"]) <= 40
    assert board["title"]
    assert board.get("id") is None, "an exported id would clash on import"
    assert "__inputs" not in board, "datasources come from the variable, not import inputs"
    uids = [b["uid"] for _, b in BOARDS]
    titles = [b["title"] for _, b in BOARDS]
    assert len(set(uids)) == len(uids) and len(set(titles)) == len(titles)


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_panel_ids_are_unique(name: str, board: Json) -> None:
    ids = [p["id"] for p in panels(board)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids in {name}"


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_panels_stay_on_the_grid_without_overlapping(name: str, board: Json) -> None:
    taken: set[tuple[int, int]] = set()
    for p in panels(board):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        cells = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & taken, f"{p['title']!r} overlaps another panel"
        taken |= cells


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_everything_uses_the_datasource_variable(name: str, board: Json) -> None:
    variables = board["templating"]["list"]
    ds = [v for v in variables if v["type"] == "datasource"]
    assert [(v["name"], v["query"]) for v in ds] == [("datasource", "prometheus")]
    for v in variables:
        if v["type"] == "query":
            assert v["datasource"] == DS, f"variable {v['name']}"
    for p in panels(board):
        assert p.get("datasource") == DS, f"panel {p['title']!r}"
        for t in p.get("targets", []):
            assert t.get("datasource") == DS, f"panel {p['title']!r} target {t['refId']}"
    for a in board["annotations"]["list"]:
        assert a.get("datasource") == DS, f"annotation {a['name']!r}"
    # and no datasource UID hidden anywhere else
    text = json.dumps(board)
    uids = set(re.findall(r'"uid": "([^"]*)"', text)) - {board["uid"]}
    assert uids == {"${datasource}"}


@pytest.mark.parametrize(("name", "board"), NODE_BOARDS, ids=[n for n, _ in NODE_BOARDS])
def test_template_variables_cover_job_node_instance_and_gpu(name: str, board: Json) -> None:
    names = [v["name"] for v in board["templating"]["list"]]
    assert names[:5] == ["datasource", "job", "node", "instance", "gpu"]
    for v in board["templating"]["list"][1:]:
        # "All" must also match series without the label (no `node` relabelling)
        assert v["includeAll"] and v["allValue"] == ".*", v["name"]


def test_the_fleet_dashboard_filters_by_namespace_and_gpu_model_only() -> None:
    """Its series have no node, instance or GPU: such a filter would select nothing."""
    board = dict(BOARDS)["gpu-waste.json"]
    variables = board["templating"]["list"]
    assert [v["name"] for v in variables] == ["datasource", "namespace", "model"]
    for v in variables[1:]:
        assert v["includeAll"] and v["allValue"] == ".*", v["name"]
    for where, expr in queries(board):
        assert not re.search(r"\$(node|instance|gpu|pod)\b", expr), where


def test_the_cost_panels_say_when_no_prices_are_set() -> None:
    """The cost series exist only with the chart's chargeback.pricePerGpuHour."""
    board = dict(BOARDS)["gpu-waste.json"]
    cost = [p for p in panels(board) if "gpu_cost" in json.dumps(p.get("targets", []))]
    assert len(cost) >= 2
    for p in cost:
        assert "no prices set" in p["fieldConfig"]["defaults"]["noValue"].lower(), p["title"]


def test_the_pod_dashboards_filter_by_namespace_and_pod() -> None:
    for name, board in BOARDS:
        if name in ("gpu-pods.json", "gpu-health-orphans.json"):
            names = [v["name"] for v in board["templating"]["list"]]
            assert names[5:] == ["namespace", "pod"], name


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_every_variable_a_query_uses_is_defined(name: str, board: Json) -> None:
    defined = {v["name"] for v in board["templating"]["list"]} | set(BUILTIN_DURATIONS)
    for where, expr in queries(board):
        used = {a or b for a, b in re.findall(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", expr)}
        assert used <= defined, f"{where}: undefined {sorted(used - defined)}"


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_no_deprecated_panel_types(name: str, board: Json) -> None:
    types = {p["type"] for p in panels(board)}
    assert not types & {"graph", "singlestat", "table-old", "grafana-piechart-panel"}
    assert types <= MODERN_TYPES


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_every_panel_that_shows_data_sets_a_unit(name: str, board: Json) -> None:
    for p in panels(board):
        if p["type"] == "row":
            continue
        assert p.get("targets"), f"{p['title']!r} has no query"
        unit = p["fieldConfig"]["defaults"].get("unit")
        assert unit, f"{p['title']!r} has no unit"


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_units_match_the_metric_suffix(name: str, board: Json) -> None:
    for p in panels(board):
        exprs = [t["expr"] for t in p.get("targets", [])]
        if not exprs or any("/" in e or "count" in e for e in exprs):
            continue
        metrics = set().union(*(referenced_metrics(substitute(e)) for e in exprs))
        bases = {m.split(":")[1] if ":" in m else m for m in metrics}
        for suffix, units in SUFFIX_UNITS.items():
            if bases and all(b.endswith(suffix) for b in bases):
                unit = p["fieldConfig"]["defaults"]["unit"]
                assert unit in units, f"{p['title']!r}: {suffix} shown as {unit!r}"


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_every_query_reads_documented_or_recorded_metrics(name: str, board: Json) -> None:
    known = known_metrics()
    for where, expr in queries(board):
        metrics = referenced_metrics(substitute(expr))
        assert metrics, f"{where}: reads no metric"
        unknown = metrics - known
        assert not unknown, f"{where}: not in docs/metrics.md nor recorded: {sorted(unknown)}"


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_every_query_parses_as_promql(name: str, board: Json, tmp_path: Path) -> None:
    """promtool parses each rule's expr: every query becomes a recording rule."""
    found = list(queries(board))
    rules = [
        {"record": f"dashboard_query_{i}", "expr": substitute(expr)}
        for i, (_, expr) in enumerate(found)
    ]
    path = tmp_path / "queries.yaml"
    path.write_text(
        yaml.safe_dump({"groups": [{"name": name, "rules": rules}]}, width=1000), encoding="utf-8"
    )
    result = run_promtool("check", "rules", str(path))
    failing = [
        found[int(i)] for i in sorted(set(re.findall(r"dashboard_query_(\d+)", result.stdout)))
    ]
    assert result.returncode == 0, "\n".join(
        [result.stdout, *(f"{where}: {expr}" for where, expr in failing)]
    )


@pytest.mark.parametrize(("name", "board"), BOARDS, ids=BOARD_IDS)
def test_activity_panels_read_the_counters_over_the_rate_interval(name: str, board: Json) -> None:
    """No panel reads an activity gauge (the exporter's last sample window: a scrape sees a
    slice of each interval and a periodic load aliases); every activity counter is read as
    its rate over $__rate_interval, which holds at least four scrapes."""
    for where, expr in queries(board):
        metrics = referenced_metrics(substitute(expr))
        gauges = sorted(metrics & set(ACTIVITY_GAUGES))
        assert not gauges, f"{where}: reads {gauges}"
        counters = metrics & set(ACTIVITY_GAUGES.values())
        rates = activity_rates(expr)
        assert {c for c, _ in rates} == counters, f"{where}: a counter not read by rate()"
        assert all(w == "$__rate_interval" for _, w in rates), f"{where}: {rates}"


def test_the_activity_panels_are_there() -> None:
    """The panels that moved to the counters still show them (a check that reads nothing
    would pass the test above)."""
    read = [
        (name, c, w)
        for name, board in BOARDS
        for _, expr in queries(board)
        for c, w in activity_rates(expr)
    ]
    node = {c for n, c, _ in read if n == "gpu-node-overview.json"}
    pods = {c for n, c, _ in read if n == "gpu-pods.json"}
    assert node == {
        "gpu_utilization_seconds_total",
        "gpu_sm_active_seconds_total",
        "gpu_sm_occupancy_seconds_total",
        "gpu_tensor_active_seconds_total",
        "gpu_dram_active_seconds_total",
    }
    assert pods == {"gpu_container_sm_seconds_total", "gpu_sm_active_seconds_total"}


def test_the_dashboard_doc_describes_every_dashboard() -> None:
    text = DOC.read_text(encoding="utf-8")
    for name, board in BOARDS:
        assert f"dashboards/{name}" in text, name
        assert board["title"] in text, board["title"]


# --- the recording rules' labels and the panels' filters -----------------------------

_AGGREGATION_BY = re.compile(r"^\s*(?:sum|avg|max|min|count)\s+by\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)\{([^}]*)\}")
_MATCHER_LABEL = re.compile(r"(\w+)\s*(?:=~|!~|!=|=)")


def kept_labels_of_recording_rules() -> dict[str, set[str]]:
    """Recorded name -> the labels its result keeps, for rules that are one aggregation
    `agg by (labels) (...)` (the others keep their input's labels)."""
    kept: dict[str, set[str]] = {}
    for rule in all_rules():
        match = _AGGREGATION_BY.match(rule.get("expr", "")) if "record" in rule else None
        if match:
            kept[rule["record"]] = {label.strip() for label in match.group(1).split(",")}
    return kept


def test_no_panel_filters_a_recorded_series_by_a_label_its_rule_drops() -> None:
    """A panel filtering `node_namespace:…{job=~"$job"}` when the rule keeps no `job` goes
    blank as soon as a job is selected (it did, on six panels). Every label a panel
    matches on a recorded series must be one its rule keeps."""
    kept = kept_labels_of_recording_rules()
    assert "node_namespace:gpu_container_memory_used_bytes:sum" in kept
    wrong = []
    for name, board in BOARDS:
        for where, expr in queries(board):
            for metric, matchers in _SELECTOR.findall(expr):
                if metric in kept:
                    dropped = set(_MATCHER_LABEL.findall(matchers)) - kept[metric]
                    if dropped:
                        wrong.append(f"{name} {where}: {metric} has no {sorted(dropped)}")
    assert not wrong, "\n".join(wrong)


def test_the_unhealthy_table_knows_every_documented_health_reason() -> None:
    """The table folds each reason into one label by name: a reason it does not list
    would be missing from its rows."""
    load_generator()  # puts dashboards/ on sys.path: its modules import each other by name
    reasons: tuple[str, ...] = importlib.import_module("gpu_health_orphans").HEALTH_REASONS

    metrics_doc = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    (row,) = [
        line
        for line in metrics_doc.splitlines()
        if line.startswith("| `gpu_health_reason` | gauge |")  # the reference table's row
    ]
    documented = re.findall(r"`([a-z_]+)` \(class|`([a-z_]+)`[,;]", row.split("|")[5])
    documented = sorted({a or b for a, b in documented})
    assert documented == sorted(reasons)


def test_weekly_and_monthly_rules_add_up_consecutive_days() -> None:
    """`:increase7d` reads the daily rule 0..6 days back, `:increase30d` 0..29, each day
    once (a day missing or counted twice would be a day's error, silently)."""
    rules = {r["record"]: r["expr"] for r in all_rules() if "record" in r}
    daily = "namespace_owner_model_state:gpu_allocated_gpu_seconds:increase1d"
    for name, days in (("increase7d", 7), ("increase30d", 30)):
        expr = rules[f"namespace_owner_state:gpu_allocated_gpu_seconds:{name}"]
        reads = re.findall(rf"{daily}(?: offset (\d+)d)?", expr)
        assert sorted(int(n or 0) for n in reads) == list(range(days)), name
        labels = re.findall(r'"days_ago", "(\d+)"', expr)
        assert sorted(map(int, labels)) == list(range(days)), name


# --- capacity and failure headroom (alerts/gpu-occupancy-exporter.capacity.yaml) -----

CAPACITY_ROW = "Capacity and failure headroom"
CAPACITY_RULES = ROOT / "alerts" / "gpu-occupancy-exporter.capacity.yaml"


def rows_of(board: Json) -> dict[str, list[Json]]:
    """Row title -> the panels under it, in order."""
    rows: dict[str, list[Json]] = {}
    current: list[Json] = []
    for panel in board["panels"]:
        if panel["type"] == "row":
            current = rows.setdefault(panel["title"], list(panel.get("panels", [])))
        else:
            current.append(panel)
    return rows


def panel_titled(panels_: list[Json], title: str) -> Json:
    (found,) = [p for p in panels_ if p["title"] == title]
    return found


def exprs(panel: Json) -> list[str]:
    return [t["expr"] for t in panel["targets"]]


def column_names(panel: Json) -> list[str]:
    """A merged table's columns, by target order: the organize step's renames."""
    (organize,) = [t for t in panel["transformations"] if t["id"] == "organize"]
    rename = organize["options"]["renameByName"]
    return [rename[f"Value #{t['refId']}"] for t in panel["targets"]]


def steps(config: Json) -> list[tuple[float | None, str]]:
    return [(s["value"], s["color"]) for s in config["thresholds"]["steps"]]


def override(panel: Json, column: str) -> dict[str, Any]:
    (found,) = [o for o in panel["fieldConfig"]["overrides"] if o["matcher"]["options"] == column]
    return {p["id"]: p["value"] for p in found["properties"]}


def test_the_capacity_rules_record_what_the_capacity_row_reads() -> None:
    """The row reads these six recorded series; each keeps model and resource only (plus
    state or reason), which is what the panels' model filter and merge rely on."""
    kept = kept_labels_of_recording_rules()
    recorded = {
        r["record"]
        for g in yaml.safe_load(CAPACITY_RULES.read_text("utf-8"))["groups"]
        for r in g["rules"]
        if "record" in r
    }
    expected = {
        "model_resource_state:gpu_node_devices:sum": {"model", "resource", "state"},
        "model_resource_reason:gpu_node_disrupted_devices:sum": {"model", "resource", "reason"},
        "model_resource:gpu_node_loss_devices:max": {"model", "resource"},
        "model_resource:gpu_devices_free_after_node_loss:min": {"model", "resource"},
        "model_resource:gpu_nodes_counted:count": {"model", "resource"},
        "model_resource:gpu_nodes_left_out:count": {"model", "resource"},
    }
    assert recorded == set(expected)
    assert {name: kept[name] for name in expected} == expected
    row = rows_of(dict(BOARDS)["gpu-waste.json"])[CAPACITY_ROW]
    read = {m for p in row for e in exprs(p) for m in referenced_metrics(substitute(e))}
    assert read == set(expected)


def test_the_capacity_row_shows_devices_by_state_per_model_and_resource() -> None:
    row = rows_of(dict(BOARDS)["gpu-waste.json"])[CAPACITY_ROW]
    table = panel_titled(row, "Devices per model and resource by state")
    assert table["type"] == "table"
    assert column_names(table) == ["healthy", "allocated", "disrupted", "allocatable"]
    for t, state in zip(table["targets"], column_names(table), strict=True):
        assert t["instant"] and t["format"] == "table"
        # summed by (model, resource): no state nor __name__ column, so merge joins the rows
        assert t["expr"] == (
            "sum by (model, resource) (model_resource_state:gpu_node_devices:sum"
            f'{{model=~"$model", state="{state}"}})'
        )
    assert [t["id"] for t in table["transformations"]] == ["merge", "organize"]


def test_the_capacity_row_shows_disrupted_devices_by_reason_over_time() -> None:
    row = rows_of(dict(BOARDS)["gpu-waste.json"])[CAPACITY_ROW]
    panel = panel_titled(row, "Disrupted devices by reason")
    assert panel["type"] == "timeseries"
    assert exprs(panel) == ['model_resource_reason:gpu_node_disrupted_devices:sum{model=~"$model"}']
    assert "{{reason}}" in panel["targets"][0]["legendFormat"]
    # reasons overlap (a device blocked twice counts under each): stacking would add them
    assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "none"


def test_the_capacity_row_shows_failure_headroom_red_below_zero() -> None:
    row = rows_of(dict(BOARDS)["gpu-waste.json"])[CAPACITY_ROW]
    table = panel_titled(row, "Failure headroom per model and resource")
    assert column_names(table) == [
        "headroom",
        "largest node loss",
        "nodes counted",
        "nodes left out",
    ]
    assert exprs(table) == [
        f'sum by (model, resource) ({name}{{model=~"$model"}})'
        for name in (
            "model_resource:gpu_devices_free_after_node_loss:min",
            "model_resource:gpu_node_loss_devices:max",
            "model_resource:gpu_nodes_counted:count",
            "model_resource:gpu_nodes_left_out:count",
        )
    ]
    headroom = override(table, "headroom")
    assert headroom["color"] == {"mode": "thresholds"}
    assert steps(headroom) == [(None, "red"), (0, "green")]  # 0 is exactly enough: not red
    assert headroom["custom.cellOptions"]["type"] == "color-background"
    assert steps(override(table, "nodes left out"))[-1] == (1, "orange")

    over_time = panel_titled(row, "Failure headroom over time")
    assert exprs(over_time) == [
        'model_resource:gpu_devices_free_after_node_loss:min{model=~"$model"}'
    ]
    defaults = over_time["fieldConfig"]["defaults"]
    assert steps(defaults) == [(None, "red"), (0, "transparent")]
    assert defaults["custom"]["thresholdsStyle"]["mode"] in {"area", "line+area"}


def test_the_node_overview_shows_the_nodes_disrupted_devices_by_reason() -> None:
    """From the raw per-node series, filtered by the board's job, node and instance like
    its other node panels (the series has no GPU)."""
    row = rows_of(dict(BOARDS)["gpu-node-overview.json"])["Health and node capacity"]
    panel = panel_titled(row, "Disrupted devices by reason")
    assert panel["type"] == "timeseries"
    assert exprs(panel) == [
        'gpu_node_disrupted_devices{job=~"$job", node=~"$node", instance=~"$instance"}'
    ]
    assert panel["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "none"
