"""Every dashboard panel, with a job selected, against a real Prometheus (docs/dashboards.md,
"Tested against a real Prometheus").

The exporter runs on tests/e2e/node-dashboards.yaml (node-e2e.yaml's node, every metric a
panel reads, plus an unhealthy GPU shared by two containers with two reasons, cgroups
that split idle time into every why-idle cause, and the Node cordoned from t=10). A real
Prometheus scrapes it and evaluates the recording rules, the chargeback rules (their
group's interval on the e2e scale), the chart's cost rules, the right-sizing rules and
the capacity rules (unchanged: their only time constant is the alert's `for: 30m`, and
no panel reads the alert). Then every target of
every panel of every board is sent as Grafana sends it once a viewer has picked one
exporter: Job, Node and Instance each set to the single running target's value, escaped
as Grafana escapes a single value of a multi-value variable (`prometheusSpecialRegexEscape`
in grafana/grafana packages/grafana-prometheus/src/escaping.ts: a backslash before each
of `$^*{}[]+?.()|`, as `interpolateQueryExpr` in
public/app/plugins/datasource/prometheus/datasource.ts applies it), GPU, Namespace and
Pod left at All (their custom all value `.*` is passed unformatted: "skip formatting of
custom all values", public/app/features/templating/template_srv.ts); on the fleet board
the GPU model set to the simulated one. Range panels are read over the whole run, instant
ones at its end. A target that returns no series fails the run unless listed in
NO_DATA_ON_THE_SIMULATED_NODE with the reason the simulated node cannot produce it.

Before the recording rules kept `job`, the six panels reading `node:` and
`node_namespace:` series were empty here (they filter `job=~"$job"` on series without a
job label): the test failed on them, which is the mistake it guards against.

The three question panels are checked for what they must show, not only for rows:
- "Why idle" has rows for every cause the scenario drives, for the right owners;
- "Unhealthy GPUs and the pods on them" has one row per container on GPU 9 (two
  containers, reasons "row_remap_pending uncorrectable_ecc", no many-to-many error) and
  one for GPU 6;
- the weekly and monthly tables have a row per owner with GPU-hours held;
- the capacity row: the cluster's devices by state equal the one node's own series, the
  cordon shows as disrupted devices of reason `cordoned` (fleet board and node overview),
  and the failure headroom of the single counted node reads -allocated per resource,
  with one node counted and none left out.

Prometheus (`/usr/bin/prometheus`) is needed: without it the run skips with a one-line
reason, or fails in CI (tests/system_tools.py).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.stack import (
    JOB,
    Child,
    PromApi,
    free_port,
    http_get,
    simulation_start,
    start_exporter,
    start_prometheus,
    wait_until,
    write_prometheus_config,
)
from tests.e2e.test_prometheus_e2e import (
    RECORDING_RULES,
    SIMULATED_MODEL,
    chargeback_rules_for_run,
    chart_cost_rules_for_run,
    load_rules_after_first_scrape,
    rightsizing_rules_for_run,
)
from tests.system_tools import require_tool
from tests.test_alert_rules import ALERTS
from tests.test_dashboards import dashboard_files, load, panels

HERE = Path(__file__).resolve().parent
SCENARIO = HERE / "node-dashboards.yaml"
NODE = "sim-node-dashboards"
# The capacity rules: the waste board's "Capacity and failure headroom" row reads them.
CAPACITY_RULES = ALERTS / "gpu-occupancy-exporter.capacity.yaml"

# The run: the scenario's last event is at t=25 and orphans are judged two cycles and a
# 5 s grace later; 45 s of simulated time leaves every series in place, and 20 s of
# scrapes after the first gives every [5m] rate and [1h] increase several samples.
SIM_END_S = 45
MIN_SCRAPED_S = 20
START_TIMEOUT_S = 30
STEP_S = 2
# Grafana's built-ins for the run: $__rate_interval = max($__interval + scrape interval,
# 4 x scrape interval) with the 1 s scrape interval.
BUILTINS = {"__interval": f"{STEP_S}s", "__rate_interval": "4s"}
BUDGET_S = 90

WHY_IDLE = "Why idle: idle GPU-hours by owner and cause (time range)"
UNHEALTHY = "Unhealthy GPUs and the pods on them"
WEEKLY = "GPU-hours by owner, last 7 days"
MONTHLY = "GPU-hours by owner, last 30 days"
STATES = "Devices per model and resource by state"
DISRUPTED = "Disrupted devices by reason"
HEADROOM = "Failure headroom per model and resource"
SHARED = "nvidia.com/gpu.shared"  # the resource with free healthy replicas to cordon

# (board, panel title, refId) -> why the simulated node never gives it a series. Keep it
# minimal: test_the_allow_list_is_current fails on an entry that returned series.
NO_DATA_ON_THE_SIMULATED_NODE: dict[tuple[str, str, str], str] = {}


def grafana_regex_escape(value: str) -> str:
    """A single selected value of a multi-value variable, as Grafana's Prometheus data
    source writes it into a query (prometheusSpecialRegexEscape, classic behaviour)."""
    value = value.replace("\\", "\\\\\\\\")
    return re.sub(r"[$^*{}\[\]+?.()|]", lambda m: "\\\\" + m.group(0), value)


def selection(instance: str) -> dict[str, str]:
    """The viewer's choice: this one exporter; everything else All (`.*`)."""
    return {
        "job": grafana_regex_escape(JOB),
        "node": grafana_regex_escape(NODE),
        "instance": grafana_regex_escape(instance),
        "model": grafana_regex_escape(SIMULATED_MODEL),
        "gpu": ".*",
        "namespace": ".*",
        "pod": ".*",
    }


def substitute(expr: str, values: dict[str, str], range_s: int) -> str:
    everything = {**BUILTINS, "__range": f"{range_s}s", **values}

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        if name not in everything:
            raise AssertionError(f"no value for ${name} in {expr!r}")
        return everything[name]

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


@dataclass(frozen=True)
class Answer:
    board: str
    title: str
    ref: str
    expr: str
    instant: bool
    status: str
    error: str
    result: list[dict[str, Any]]


@dataclass
class Run:
    api: PromApi
    instance: str = ""
    start: float = 0.0
    end: float = 0.0
    answers: list[Answer] = field(default_factory=list)
    runtime_s: float = 0.0

    def answer(self, title: str, ref: str = "A", board: str = "") -> Answer:
        (found,) = [
            a
            for a in self.answers
            if a.title == title and a.ref == ref and (not board or a.board == board)
        ]
        return found


# A stat panel's fallback for "nothing to count": stripped, or a misspelt metric would pass.
FALLBACK = re.compile(r"\s+or\s+vector\(0\)\s*$")


def ask(api: PromApi, expr: str, instant: bool, start: float, end: float) -> dict[str, Any]:
    if instant:
        return api.query(expr, end)
    return api.query_range(expr, start, end, STEP_S)


def read_every_panel(run: Run) -> list[Answer]:
    values = selection(run.instance)
    range_s = math.ceil(run.end - run.start)
    answers = []
    for path in dashboard_files():
        for panel in panels(load(path)):
            for t in panel.get("targets", []):
                expr = FALLBACK.sub("", substitute(t["expr"], values, range_s))
                instant = bool(t.get("instant"))
                data = ask(run.api, expr, instant, run.start, run.end)
                ok = data.get("status") == "success"
                answers.append(
                    Answer(
                        path.name,
                        panel["title"],
                        t["refId"],
                        expr,
                        instant,
                        data.get("status", "?"),
                        data.get("error", ""),
                        data["data"]["result"] if ok else [],
                    )
                )
    return answers


@pytest.fixture(scope="module")
def dashboards_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    binary = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("dashboards-e2e")
    began = time.monotonic()
    exporter_port, prom_port = free_port(), free_port()
    rules = [
        RECORDING_RULES,
        chargeback_rules_for_run(tmp),
        chart_cost_rules_for_run(tmp),
        rightsizing_rules_for_run(tmp),
        CAPACITY_RULES,
    ]
    config = tmp / "prometheus.yml"
    write_prometheus_config(config, {NODE: exporter_port}, [])
    children: list[Child] = []
    try:
        exporter_t0 = time.time()
        exporter = start_exporter(SCENARIO, exporter_port, tmp / "exporter.log")
        children.append(exporter)

        def ready() -> bool:
            exporter.check_alive()
            return http_get(f"http://127.0.0.1:{exporter_port}/readyz", timeout=2)[0] == 200

        wait_until(ready, timeout_s=START_TIMEOUT_S, what="the exporter's /readyz")
        sim_t0 = simulation_start(exporter.log_path.read_text(encoding="utf-8")) or exporter_t0
        prometheus = start_prometheus(binary, config, tmp / "tsdb", prom_port, tmp / "prom.log")
        children.append(prometheus)
        api = PromApi(prom_port)
        run = Run(api=api, instance=f"127.0.0.1:{exporter_port}")
        load_rules_after_first_scrape(prometheus, api, config, {NODE: exporter_port}, rules)
        run.start = time.time() - 1
        done_at = max(sim_t0 + SIM_END_S, run.start + MIN_SCRAPED_S)

        def finished() -> bool:
            prometheus.check_alive()
            exporter.check_alive()
            return time.time() >= done_at

        wait_until(
            finished, timeout_s=SIM_END_S + START_TIMEOUT_S, what="the scenario", interval_s=1
        )
        run.end = time.time()
        exporter.stop()
        run.answers = read_every_panel(run)
        run.runtime_s = time.monotonic() - began
        print(f"[dashboards e2e] {len(run.answers)} targets read; run took {run.runtime_s:.1f} s")
        yield run
    finally:
        for child in reversed(children):
            child.stop()


def _key(a: Answer) -> tuple[str, str, str]:
    return (a.board, a.title, a.ref)


def test_every_panel_target_is_valid_promql_with_a_job_selected(dashboards_run: Run) -> None:
    bad = [a for a in dashboards_run.answers if a.status != "success"]
    assert not bad, "\n".join(f"{_key(a)}: {a.error}\n  {a.expr}" for a in bad)
    assert len(dashboards_run.answers) > 100, "every panel of every board was read"


def test_no_panel_is_blank_with_a_job_selected(dashboards_run: Run) -> None:
    empty = [
        a
        for a in dashboards_run.answers
        if a.status == "success" and not a.result and _key(a) not in NO_DATA_ON_THE_SIMULATED_NODE
    ]
    assert not empty, "panels without a series with Job, Node and Instance selected:\n" + "\n".join(
        f"{_key(a)}\n  {a.expr}" for a in empty
    )


def test_the_allow_list_is_current(dashboards_run: Run) -> None:
    keys = {_key(a): a for a in dashboards_run.answers}
    for key in NO_DATA_ON_THE_SIMULATED_NODE:
        assert key in keys, f"{key}: no such panel target"
        assert not keys[key].result, f"{key} returns series now: remove it from the list"


def _rows(answer: Answer) -> list[dict[str, str]]:
    return [dict(r["metric"], value=r["value"][1]) for r in answer.result]


def test_why_idle_splits_idle_time_by_cause_per_owner(dashboards_run: Run) -> None:
    """Each cause the scenario drives shows for the owner whose container it was, with
    idle GPU-hours above 0, and for no owner whose container the scenario did not starve."""
    rows = _rows(dashboards_run.answer(WHY_IDLE))
    hours = {
        (r.get("namespace", ""), r.get("owner_name", ""), r["cause"]): float(r["value"])
        for r in rows
    }
    for key in (
        ("batch", "nightly-batch", "cpu_throttled"),  # throttled 50 % of its CFS periods
        ("debug", "leaky-shell", "cpu_pressure"),  # a bare pod, its own owner; CPU stall 40 %
        ("research", "tiny-kernels", "io_pressure"),  # I/O some-stall 50 %
    ):
        assert hours.get(key, 0) > 0, f"{key} has no idle GPU-hours: {sorted(hours.items())}"
    starved = {("batch", "nightly-batch"), ("debug", "leaky-shell"), ("research", "tiny-kernels")}
    others = {k: v for k, v in hours.items() if k[:2] not in starved and k[2] != "unknown" and v}
    assert not others, f"starvation the scenario does not drive: {others}"
    assert {cause for _, _, cause in hours} <= {
        "cpu_throttled",
        "cpu_pressure",
        "io_pressure",
        "unknown",
    }


def test_unhealthy_gpus_list_every_pod_on_them_with_every_reason(dashboards_run: Run) -> None:
    """GPU 9: two containers (time-sliced replicas), two reasons; GPU 6: lost, one
    container. One row per container, no many-to-many error (the query succeeded)."""
    answer = dashboards_run.answer(UNHEALTHY)
    assert answer.status == "success", answer.error
    rows = _rows(answer)
    by_gpu: dict[str, list[dict[str, str]]] = {}
    for r in rows:
        by_gpu.setdefault(r["gpu"], []).append(r)
    assert sorted(by_gpu) == ["6", "9"], rows
    nine = sorted(by_gpu["9"], key=lambda r: r["pod"])
    assert [(r["namespace"], r["pod"], r["container"]) for r in nine] == [
        ("serve", "embed-a", "server"),
        ("serve", "embed-b", "server"),
    ]
    for r in nine:
        assert r["reasons"].split() == ["uncorrectable_ecc", "row_remap_pending"], r
        assert r["model"] == SIMULATED_MODEL and r["node"] == NODE and r["uuid"], r
    (six,) = by_gpu["6"]
    assert (six["namespace"], six["pod"]) == ("debug", "leaky-shell"), six
    assert "gpu_lost" in six["reasons"].split(), six


@pytest.mark.parametrize("title", [WEEKLY, MONTHLY])
def test_weekly_and_monthly_gpu_hours_per_owner(dashboards_run: Run, title: str) -> None:
    held = _rows(dashboards_run.answer(title, "A"))
    owners = {(r["namespace"], r.get("owner_name", "")): float(r["value"]) for r in held}
    assert owners.get(("serve", "embed"), 0) > 0, owners  # two replicas of Deployment embed
    assert owners.get(("batch", "nightly-batch"), 0) > 0, owners
    wasted = _rows(dashboards_run.answer(title, "B"))
    assert any(float(r["value"]) > 0 for r in wasted), wasted


def _by_resource(answer: Answer) -> dict[str, float]:
    """A per-(model, resource) answer of the fleet board, on the simulated model."""
    rows = _rows(answer)
    assert {r["model"] for r in rows} == {SIMULATED_MODEL}, rows
    return {r["resource"]: float(r["value"]) for r in rows}


def _last(answer: Answer, **labels: str) -> float:
    """The last value of the range answer's one series with these labels."""
    (series,) = [r for r in answer.result if labels.items() <= r["metric"].items()]
    return float(series["values"][-1][1])


def test_the_capacity_row_shows_the_nodes_devices_by_state(dashboards_run: Run) -> None:
    """One node: the cluster's figures per resource are its own (node overview's bar
    gauge of gpu_node_devices, same instant), and the cordon shows as disrupted."""
    node = {
        (r["resource"], r["state"]): float(r["value"])
        for r in _rows(dashboards_run.answer("Devices by state now"))
    }
    resources = {resource for resource, _ in node}
    assert SHARED in resources, node
    for ref, state in zip(
        "ABCD", ("healthy", "allocated", "disrupted", "allocatable"), strict=True
    ):
        column = _by_resource(dashboards_run.answer(STATES, ref))
        assert column == {res: node[(res, state)] for res in resources}, state
    assert _by_resource(dashboards_run.answer(STATES, "C"))[SHARED] > 0


def test_the_cordon_shows_as_disrupted_by_reason(dashboards_run: Run) -> None:
    """Fleet board (recorded, per model) and node overview (raw, this node): the shared
    replicas the cordon took out read `cordoned` at the end, as many as are disrupted;
    the other reasons read 0 (told, not unknown)."""
    disrupted = _by_resource(dashboards_run.answer(STATES, "C"))[SHARED]
    assert disrupted > 0, "the scenario's cordon took no replica out"
    fleet = dashboards_run.answer(DISRUPTED, board="gpu-waste.json")
    node = dashboards_run.answer(DISRUPTED, board="gpu-node-overview.json")
    for answer in (fleet, node):
        assert _last(answer, resource=SHARED, reason="cordoned") == disrupted
        for reason in ("node_taint", "driver_upgrade", "device_taint"):
            assert _last(answer, resource=SHARED, reason=reason) == 0
    assert {r["metric"]["node"] for r in node.result} == {NODE}


def test_the_failure_headroom_of_one_node_is_minus_its_work(dashboards_run: Run) -> None:
    """The single counted node: nothing could take its work, so the headroom reads
    -allocated for each resource; its loss is allocatable + allocated; one node counted,
    none left out."""
    allocated = _by_resource(dashboards_run.answer(STATES, "B"))
    allocatable = _by_resource(dashboards_run.answer(STATES, "D"))
    headroom, loss, counted, left_out = (
        _by_resource(dashboards_run.answer(HEADROOM, ref)) for ref in "ABCD"
    )
    assert headroom == {res: -n for res, n in allocated.items()}
    assert loss == {res: allocatable[res] + n for res, n in allocated.items()}
    assert counted == {res: 1 for res in allocated}
    assert left_out == {res: 0 for res in allocated}
    assert any(v < 0 for v in headroom.values()), "the red case is shown"


def test_the_run_stays_within_its_budget(dashboards_run: Run) -> None:
    assert dashboards_run.runtime_s < BUDGET_S, f"{dashboards_run.runtime_s:.0f} s"
