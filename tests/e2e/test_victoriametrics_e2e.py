"""The same simulated node on both backends: a real Prometheus, and vmagent ->
victoria-metrics with vmalert evaluating the same rules and writing its recordings back
(the shipped settings: tests/e2e/vm_stack.py; docs/victoriametrics.md).

One module-scoped run (~2 min):
1. start the exporter on tests/e2e/node-e2e.yaml (its last event at t=30 s), then
   Prometheus and victoria-metrics + vmagent with one scrape configuration (every
   second); once both have scraped the exporter, load the rules into both: every rule
   file of alerts/*.yaml and alerts/compat/*.yaml, every time constant on the e2e
   scale (shrink_rules.py with ``records=True``: a production minute is a second, every
   group's interval too), evaluated every second;
2. wait ``SETTLE_S`` after the rules loaded (past the scenario's last event, its windows,
   and the deepest chain of recording rules at a few evaluations per level on vmalert);
3. at one instant ``at``, read from both: every ``record:`` of every rule file and every
   query of every board of dashboards/*.json (panel targets, with Grafana's variables
   substituted as for "All": each variable's ``allValue``), as instant queries;
4. the tests compare: same label sets, values within ``tolerance``; the known
   differences are compared more loosely, never skipped, each with its reason
   (``EXCEPTIONS``, and ``allowed``: whatever reads the ledger's day/week/month figures
   or an energy counter).

Self-check: ``GPU_VM_E2E_BREAK=settings`` runs vmalert without the shipped datasource
parameter (VictoriaMetrics' default 30 s latency offset applies to its reads): the
chained right-sizing and compatibility rules then lag behind and the comparison fails.
``GPU_VM_E2E_BREAK=rule`` changes one recording rule's expression in vmalert's copy
only: the comparison must fail on that record.
"""

from __future__ import annotations

import functools
import json
import math
import os
import re
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.e2e import vm_stack
from tests.e2e.shrink_rules import write_shrunk_rules
from tests.e2e.stack import (
    JOB,
    NODE,
    Child,
    PromApi,
    free_port,
    http_get,
    prometheus_config,
    start_exporter,
    start_prometheus,
    wait_until,
    write_prometheus_config,
)
from tests.system_tools import VICTORIA_METRICS_HINT, require_tool
from tests.test_alert_rules import load_yaml
from tests.test_dashboards import dashboard_files, load, panels

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
ALERTS = ROOT / "alerts"
SCENARIO = HERE / "node-e2e.yaml"
BREAK = os.environ.get("GPU_VM_E2E_BREAK", "")

# Seconds. The scenario's last event is at t=30 and the longest window that must have
# passed it is the chargeback's [1h], 60 s on this scale (chat-c, deleted at t=20, leaves
# the hourly figures at t=80, the sums built on them a few evaluations later on
# vmalert); the rules load ~10 s after t=0. The deepest chain of recording rules (right-sizing:
# profile share -> profile memory -> rank1 ... rank5 -> suggestion, 8 levels) needs one
# evaluation on Prometheus and, on vmalert, a flush (up to 1 s) and a searchable row
# (within 1 s) per level: a few evaluations per level. 95 s after loading: t ~105 s.
SETTLE_S = 95
START_TIMEOUT_S = 60
EVALUATION_S = 1
SCRAPE_S = 1
EXPORTER_INTERVAL_S = 0.5  # as the Prometheus e2e: counters grow twice per scrape

# Grafana's built-ins for a panel at the e2e scale (test_prometheus_e2e.py's): a 2 s
# step, $__rate_interval = max($__interval + scrape interval, 4 x scrape interval).
BUILTINS = {"__interval": "2s", "__rate_interval": "4s"}
GRAFANA_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")


# --- tolerance and exceptions ------------------------------------------------------------

# Two scrapers read the exporter at different moments (up to one scrape interval apart),
# so a gauge that moved between their reads differs by that move: 10 %, and 1e-6
# absolute for values at 0. A rate or increase over a window (a range in the expression
# or in a record it reads: ``expanded``) differs besides by method: MetricsQL's
# rate/increase start from the last sample before the window and do not extrapolate,
# Prometheus' start from the first sample inside it and extrapolate towards the edges
# (VictoriaMetrics 1.79.5, docs/MetricsQL.md lines 17-18). The exporter's counters grow
# in whole sample cycles (0.5 s) and the dashboards' $__rate_interval is 4 s here: each
# end of the window can gain or lose a cycle, 2 x 0.5 / 4 = 25 %.
REL_TOL = 0.10
REL_TOL_WINDOW = 0.25
ABS_TOL = 1e-6
WINDOW = re.compile(r"\[(?:\d+(?:ms|s|m|h|d|w|y))+(?::[^\]]*)?\]")


def tolerance(a: float, b: float, rel: float = REL_TOL, absolute: float = ABS_TOL) -> bool:
    return abs(a - b) <= absolute + rel * max(abs(a), abs(b))


@dataclass(frozen=True)
class Allowed:
    """A known difference: compared with ``how`` instead of the default, for ``why``.

    ``labels``: the same label sets, values not compared; ``ranking``: the same number of
    series and the same values (topk picks among equal values as each engine does);
    ``abs:<x>``: the same label sets, values within the default tolerance or ``x``.
    ``always``: false where the difference depends on the scrapers' phase and may not
    show in a run (test_exceptions_are_still_needed does not ask it to)."""

    how: str
    why: str
    always: bool = True


NEW_COUNTER = (
    "an increase over a window that holds the ledger counter's first sample (the run is "
    "shorter than the window): MetricsQL counts a counter born inside the window from 0 "
    "(app/vmselect/promql/rollup.go, rollupDelta: the first value when it is below 10 "
    "deltas), Prometheus from its first sample, extrapolating at most half an interval; "
    "sums over time of it differ as much"
)
# The ledger's figures over windows longer than the run (on this scale a day is 24 min):
# every record and query that reads one is compared by label sets (``allowed``).
LONG_WINDOW_RECORDS = tuple(
    f"namespace_owner{m}_state:gpu_allocated_gpu_seconds:increase{w}"
    for m, w in (("_model", "1d"), ("", "1d"), ("", "7d"), ("", "30d"))
)
# What is allowed to differ, by record name or "board: panel refId", with the reason.
NEAR_ZERO_DIFFERENCE = (
    "the difference of two rates of counters that grow almost alike (GPU-Util and SM active "
    "on a GPU whose kernels fill every SM): both engines read it within 0.01 of 0, where "
    "the relative tolerance is meaningless (one CI run: Prometheus 0.0059, "
    "VictoriaMetrics -0.0012 and 0.0026)"
)
EXCEPTIONS: dict[str, Allowed] = {
    "gpu:gpu_utilization_minus_sm_active:ratio": Allowed(
        "abs:0.02", NEAR_ZERO_DIFFERENCE, always=False
    ),
    "gpu-node-overview.json: GPU-Util minus SM active A": Allowed(
        "abs:0.02", NEAR_ZERO_DIFFERENCE, always=False
    ),
    "namespace_owner_state:gpu_allocated_gpu_seconds:increase1h": Allowed(
        "abs:3",
        "chained on vmalert: the sum of an earlier evaluation of "
        "namespace_owner_model_state:...:increase1h (app/vmalert/README.md, Limitations; "
        "a few evaluations behind here), which moves by up to one GPU-second per "
        "evaluation and GPU: near 0 the relative tolerance does not cover it",
        always=False,
    ),
    "gpu-waste.json: Wasted GPUs by owner A": Allowed(
        "ranking",
        "topk(10) of owners of whom more than 10 tie at 0: each engine picks its own, by "
        "an order that follows the series' labels (the instance's port changes from run "
        "to run), so now and then both may pick the same ten: the one exception whose "
        "difference is chance (one local run of seven found an exception unused; which "
        "one was not kept)",
        always=False,
    ),
    "gpu-pods.json: Idle share of allocated devices (last hour) A": Allowed(
        "labels",
        "rate over [1h], longer than the run: Prometheus divides the extrapolated increase "
        "by the whole hour (0.02), MetricsQL by the time between the first and last "
        "samples (0.99): docs/MetricsQL.md line 18",
    ),
    "gpu-health-orphans.json: Fatal XIDs (range) A": Allowed(
        "labels",
        "increase over $__range of an XID counter created at 1 during the run: MetricsQL "
        "counts it (1), Prometheus sees no increase after its first sample (0): "
        "rollupDelta as above",
    ),
    "gpu-node-overview.json: NVLink errors (links with new errors) A": Allowed(
        "labels",
        "increase over [5m], longer than the run, of a counter born in it: as above",
        always=False,
    ),
    "gpu-health-orphans.json: Seconds since the last sample A": Allowed(
        "abs:1.5",
        "time() minus the exporter's last sample time as each scraper last read it: the "
        "two scrape at their own phase, up to one scrape interval (1 s) apart",
        always=False,
    ),
    "gpu-health-orphans.json: Sample cycle duration (p99) A": Allowed(
        "labels",
        "histogram_quantile(0.99) of the exporter's own cycle durations over a 4 s rate "
        "window: the two windows hold different cycles (8 or so), and the slowest of "
        "them sets the p99",
        always=False,
    ),
}


ENERGY_COUNTERS = ("gpu_energy_joules_total", "gpu_container_energy_joules_total")
ENERGY_STEPS = (
    "reads an energy counter, which the exporter serves in steps seconds apart (seen flat "
    "for 6 s, then a step): the two backends' last reads, and their windows, hold a "
    "step or not; MetricsQL also counts one between the sample before a window and the "
    "first inside it (docs/MetricsQL.md line 17), Prometheus does not"
)


# The activity counters read from GPM windows and per-process samples: the exporter adds
# to them once per --gpm-interval / --process-utilization-interval (both 10 s by default,
# which the e2e exporter keeps; tests/e2e/stack.py passes neither), while the windows
# that read them are 4-5 s on this scale (the rules' [2m] shrunk to the 5 s floor, the
# dashboards' $__rate_interval 4 s). GPU-Util's counter (NVML's samples, every cycle) is
# not among them.


def allowed(key: str, expr: str) -> Allowed | None:
    """How ``key`` (a record or a query; ``expr``: its expression with those of the
    records it reads, ``expanded``) is compared, if not the default way: its EXCEPTIONS
    entry; else by label sets when it is or reads one of the LONG_WINDOW_RECORDS, or
    reads an energy counter."""
    if key in EXCEPTIONS:
        return EXCEPTIONS[key]
    if key in LONG_WINDOW_RECORDS or any(r in expr for r in LONG_WINDOW_RECORDS):
        return Allowed("labels", NEW_COUNTER, always=key in LONG_WINDOW_RECORDS)
    if any(re.search(rf"\b{c}\b", expr) for c in ENERGY_COUNTERS):
        return Allowed("labels", ENERGY_STEPS, always=False)
    return None


def expanded(expr: str, record_exprs: dict[str, str], levels: int = 10) -> str:
    """``expr`` followed by the expressions of the records it reads, and of theirs: a
    query of a recorded rate is a windowed expression too."""
    seen: set[str] = set()
    out, frontier = expr, expr
    for _ in range(levels):
        found = [
            n for n in record_exprs if n not in seen and re.search(rf"\b{re.escape(n)}\b", frontier)
        ]
        if not found:
            break
        seen.update(found)
        frontier = "\n".join(record_exprs[n] for n in found)
        out += "\n" + frontier
    return out


# --- the run -----------------------------------------------------------------------------


Sample = dict[frozenset[tuple[str, str]], float]


@dataclass
class Answer:
    status: str
    error: str = ""
    samples: Sample = field(default_factory=dict)
    nan_dropped: int = 0  # Prometheus' NaN samples (MetricsQL drops NaN: never returned)


@dataclass
class Run:
    at: float = 0.0
    rules_loaded: float = 0.0
    records: dict[str, tuple[Answer, Answer]] = field(default_factory=dict)
    record_exprs: dict[str, str] = field(default_factory=dict)
    queries: dict[str, tuple[str, Answer, Answer]] = field(default_factory=dict)
    vmalert_errors: list[tuple[str, str]] = field(default_factory=list)
    prometheus_errors: list[tuple[str, str]] = field(default_factory=list)
    vmalert_rules: int = 0
    prometheus_rules: int = 0
    runtime_s: float = 0.0


def rule_sources() -> list[Path]:
    return [*sorted(ALERTS.glob("*.yaml")), *sorted((ALERTS / "compat").glob("*.yaml"))]


def rules_for_run(tmp: Path) -> list[Path]:
    """Every rule file on the e2e time scale (same copies for both backends)."""
    out = tmp / "rules"
    out.mkdir()
    return [
        write_shrunk_rules(p, out / f"{p.parent.name}-{p.name}", records=True)
        for p in rule_sources()
    ]


def broken_for_vmalert(files: list[Path], tmp: Path) -> list[Path]:
    """Self-check ``rule``: one record's expression changed in vmalert's copy only."""
    if BREAK != "rule":
        return files
    out = tmp / "broken"
    out.mkdir()
    copies = []
    for path in files:
        text = path.read_text("utf-8")
        broken = text.replace(  # the window is left as the shrunk copy has it
            "expr: avg by (job, node, instance) (rate(gpu_utilization_seconds_total[",
            "expr: 0.5 * avg by (job, node, instance) (rate(gpu_utilization_seconds_total[",
        )
        copies.append(out / path.name)
        copies[-1].write_text(broken, "utf-8")
    assert any(
        c.read_text("utf-8") != p.read_text("utf-8") for c, p in zip(copies, files, strict=True)
    ), "GPU_VM_E2E_BREAK=rule: node:gpu_utilization_ratio:avg's expression changed"
    return copies


def records() -> dict[str, str]:
    """Every ``record:`` of every rule file, with its expression(s)."""
    found: dict[str, str] = {}
    for path in rule_sources():
        for group in load_yaml(path)["groups"]:
            for rule in group["rules"]:
                if "record" in rule:
                    found[rule["record"]] = found.get(rule["record"], "") + rule["expr"]
    return found


def substitute(expr: str, board: dict[str, Any], range_s: int) -> str:
    """Grafana's interpolation with every variable at "All": its ``allValue`` (``.*``)."""
    values = {**BUILTINS, "__range": f"{range_s}s"}
    for v in board.get("templating", {}).get("list", []):
        if v.get("includeAll"):
            values[v["name"]] = v.get("allValue") or ".*"

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"{board.get('title')}: no value for variable ${name}"
        return values[name]

    return GRAFANA_VARIABLE.sub(value, expr)


def dashboard_queries() -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(where, raw expr, board) for every panel target of dashboards/*.json."""
    for path in dashboard_files():
        board = load(path)
        for panel in panels(board):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    where = f"{path.name}: {panel['title']} {target['refId']}"
                    yield where, target["expr"], board


def answer(data: dict[str, Any]) -> Answer:
    if data.get("status") != "success":
        return Answer(str(data.get("status")), str(data.get("error", "")))
    result = data["data"]["result"]
    if data["data"]["resultType"] == "scalar":
        result = [{"metric": {}, "value": result}]
    out = Answer("success")
    for item in result:
        value = float(item["value"][1])
        if math.isnan(value):
            out.nan_dropped += 1
            continue
        out.samples[frozenset(item["metric"].items())] = value
    return out


def prometheus_up(api: PromApi, child: Child) -> bool:
    child.check_alive()
    return api.ready() and len(api.series(f'up{{job="{JOB}"}} == 1')) == 1


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    prometheus_binary = require_tool("prometheus")
    binaries = {b: require_tool(b, VICTORIA_METRICS_HINT) for b in vm_stack.VM_BINARIES}
    tmp = tmp_path_factory.mktemp("vm-e2e")
    began = time.monotonic()
    rules = rules_for_run(tmp)
    exporter_port, prom_port = free_port(), free_port()
    children: list[Child] = []
    stack: vm_stack.VmStack | None = None
    run = Run()
    try:
        exporter = start_exporter(
            SCENARIO, exporter_port, tmp / "exporter.log", interval_s=EXPORTER_INTERVAL_S
        )
        children.append(exporter)
        wait_until(
            lambda: http_get(f"http://127.0.0.1:{exporter_port}/readyz", timeout=2)[0] == 200,
            timeout_s=START_TIMEOUT_S,
            what="the exporter's /readyz",
        )
        config = tmp / "prometheus.yml"
        write_prometheus_config(config, {NODE: exporter_port}, [])
        prometheus = start_prometheus(
            prometheus_binary, config, tmp / "tsdb", prom_port, tmp / "prom.log"
        )
        children.append(prometheus)
        api = PromApi(prom_port)
        stack = vm_stack.start_vm_stack(
            binaries,
            tmp / "vm",
            {NODE: exporter_port},
            [],
            scrape_interval_s=SCRAPE_S,
            evaluation_interval_s=EVALUATION_S,
            start_vmalert_now=False,
        )
        wait_until(
            functools.partial(prometheus_up, api, prometheus),
            timeout_s=START_TIMEOUT_S,
            what="Prometheus' first scrape",
            diagnostics=prometheus.log_tail,
        )
        # The rules load into both within a second of each other.
        write_prometheus_config(config, {NODE: exporter_port}, rules)
        api.reload()
        vm_rules = broken_for_vmalert(rules, tmp)
        # self-check "settings": without nocache=1 the latency offset applies again
        params = "" if BREAK == "settings" else vm_stack.DATASOURCE_PARAMS
        vm_stack.start_rules(
            stack, binaries, tmp / "vm", vm_rules, EVALUATION_S, datasource_params=params
        )
        run.rules_loaded = time.time()
        print(f"[vm-e2e] both backends evaluating after {time.monotonic() - began:.1f} s")
        deadline = run.rules_loaded + SETTLE_S
        while time.time() < deadline:
            exporter.check_alive()
            prometheus.check_alive()
            stack.check_alive()
            time.sleep(1)
        stack.api.force_flush()
        run.at = math.floor(time.time()) - 1.0
        run.prometheus_rules = len(api.rules())
        run.vmalert_rules = len(stack.vmalert_api.rules())
        run.prometheus_errors = [
            (r["name"], r["lastError"]) for r in api.rules() if r.get("lastError")
        ]
        run.vmalert_errors = [
            (r["name"], r["lastError"]) for r in stack.vmalert_api.rules() if r.get("lastError")
        ]
        run.record_exprs = records()
        for name in run.record_exprs:
            run.records[name] = (
                answer(api.query(name, run.at)),
                answer(stack.api.query(name, run.at)),
            )
        range_s = math.ceil(run.at - run.rules_loaded)
        for where, raw, board in dashboard_queries():
            expr = substitute(raw, board, range_s)
            run.queries[where] = (
                expr,
                answer(api.query(expr, run.at)),
                answer(stack.api.query(expr, run.at)),
            )
        run.runtime_s = time.monotonic() - began
        nans = [
            (key, p.nan_dropped, v.nan_dropped)
            for key, p, v in [
                *((n, p, v) for n, (p, v) in run.records.items()),
                *((w, p, v) for w, (_, p, v) in run.queries.items()),
            ]
            if p.nan_dropped or v.nan_dropped
        ]
        print(f"[vm-e2e] NaN samples left out (Prometheus, VictoriaMetrics): {nans or 'none'}")
        print(f"[vm-e2e] compared at {run.at:.0f} after {run.runtime_s:.1f} s")
        (tmp / "comparison.json").write_text(json.dumps(report(run), indent=1), "utf-8")
        yield run
    finally:
        if stack is not None:
            stack.stop()
        for child in reversed(children):
            child.stop()


# --- comparing ---------------------------------------------------------------------------


def _labels(key: frozenset[tuple[str, str]]) -> str:
    return "{" + ", ".join(f"{k}={v!r}" for k, v in sorted(key)) + "}"


def differences(prom: Answer, vm: Answer, expr: str = "", how: str = "") -> list[str]:
    """What differs between the two answers (empty: the same), compared the default way
    (tolerance by ``expr``: windowed or not) or as ``how`` says (``Allowed``)."""
    if prom.status != "success" or vm.status != "success":
        return [
            f"status: Prometheus {prom.status} {prom.error}; VictoriaMetrics {vm.status} {vm.error}"
        ]
    if how == "ranking":
        ours, theirs = sorted(prom.samples.values()), sorted(vm.samples.values())
        if len(ours) == len(theirs) and all(
            tolerance(x, y) for x, y in zip(ours, theirs, strict=True)
        ):
            return []
        return [f"ranking: Prometheus {ours}, VictoriaMetrics {theirs}"]
    out = []
    for key in sorted(prom.samples.keys() - vm.samples.keys(), key=_labels)[:5]:
        out.append(f"only in Prometheus: {_labels(key)} = {prom.samples[key]:g}")
    for key in sorted(vm.samples.keys() - prom.samples.keys(), key=_labels)[:5]:
        out.append(f"only in VictoriaMetrics: {_labels(key)} = {vm.samples[key]:g}")
    if how == "labels":
        return out
    rel = REL_TOL_WINDOW if WINDOW.search(expr) else REL_TOL
    absolute = float(how.removeprefix("abs:")) if how.startswith("abs:") else ABS_TOL
    for key in sorted(prom.samples.keys() & vm.samples.keys(), key=_labels):
        a, b = prom.samples[key], vm.samples[key]
        if not tolerance(a, b, rel, absolute):
            out.append(f"value: {_labels(key)}: Prometheus {a:g}, VictoriaMetrics {b:g}")
    return out


def compared(run: Run, strict: bool = False) -> dict[str, list[str]]:
    """Every record and query with its differences; ``strict``: ignoring EXCEPTIONS."""

    def compare(key: str, expr: str, prom: Answer, vm: Answer) -> list[str]:
        full = expanded(expr, run.record_exprs)
        exception = None if strict else allowed(key, full)
        return differences(prom, vm, full, exception.how if exception else "")

    found = {
        name: compare(name, run.record_exprs[name], p, v) for name, (p, v) in run.records.items()
    }
    for where, (expr, p, v) in run.queries.items():
        found[where] = compare(where, expr, p, v)
    return found


def report(run: Run) -> dict[str, Any]:
    found = compared(run)
    return {
        "at": run.at,
        "differences": {k: v for k, v in found.items() if v},
        "strict": {k: v for k, v in compared(run, strict=True).items() if v},
        "queries": {w: expr for w, (expr, _, _) in run.queries.items()},
    }


def _failures(found: dict[str, list[str]], keys: Iterable[str]) -> str:
    bad = {k: found[k] for k in keys if found[k]}
    return "\n".join(f"{k}:\n  " + "\n  ".join(v[:8]) for k, v in sorted(bad.items()))


def test_every_rule_file_loads_and_evaluates_without_error(both: Run) -> None:
    assert both.vmalert_rules == both.prometheus_rules > 0, (
        f"vmalert serves {both.vmalert_rules} rules, Prometheus {both.prometheus_rules}"
    )
    assert not both.vmalert_errors, f"vmalert rule errors: {both.vmalert_errors[:5]}"
    assert not both.prometheus_errors, f"Prometheus rule errors: {both.prometheus_errors[:5]}"


def test_every_recorded_series_matches(both: Run) -> None:
    """Every ``record:`` of every rule file: the same series, values within tolerance."""
    assert both.records, "no recording rules found"
    failures = _failures(compared(both), both.records)
    assert not failures, (
        f"recorded series differ between Prometheus and VictoriaMetrics at {both.at:.0f}:\n"
        + failures
    )


def test_every_dashboard_query_matches(both: Run) -> None:
    """Every panel query of every board, as an instant query at the same instant."""
    assert both.queries, "no dashboard queries found"
    failures = _failures(compared(both), both.queries)
    assert not failures, (
        f"dashboard queries differ between Prometheus and VictoriaMetrics at {both.at:.0f}:\n"
        + failures
    )


def test_the_comparison_is_not_empty(both: Run) -> None:
    """Most records and queries answer with series on both sides: an empty answer on
    both sides compares equal, so a run that saw nothing would pass the tests above."""
    recorded = [n for n, (p, _) in both.records.items() if p.samples]
    answered = [w for w, (_, p, _) in both.queries.items() if p.samples]
    assert len(recorded) >= 0.8 * len(both.records), (
        f"only {len(recorded)} of {len(both.records)} records have series: "
        f"{sorted(set(both.records) - set(recorded))}"
    )
    assert len(answered) >= 0.8 * len(both.queries), (
        f"only {len(answered)} of {len(both.queries)} dashboard queries have series: "
        f"{sorted(set(both.queries) - set(answered))}"
    )


def test_exceptions_are_still_needed(both: Run) -> None:
    """Each listed exception must name a record or query that exists, and differ when
    compared the default way (else remove it)."""
    found = compared(both, strict=True)
    unused = [k for k, e in EXCEPTIONS.items() if e.always and k in found and not found[k]]
    unknown = [k for k in EXCEPTIONS if k not in found]
    assert not unused and not unknown, f"unused exceptions: {unused}; unknown: {unknown}"


def test_vmagent_scrapes_with_the_prometheus_scrape_config() -> None:
    """vmagent's configuration is the e2e Prometheus' scrape configuration, without
    the fields vmagent rejects (no binary needed)."""
    mine = vm_stack.vmagent_config({NODE: 1234})
    theirs = prometheus_config({NODE: 1234}, [])
    assert mine["scrape_configs"] == theirs["scrape_configs"]
    assert set(mine) == {"global", "scrape_configs"}
    assert set(mine["global"]) == {"scrape_interval"}
