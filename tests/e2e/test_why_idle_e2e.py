"""End to end on the shipped why-idle scenario (exporter/sim/scenarios/why-idle.yaml):
the exporter on the simulated node, a real Prometheus loading the alerting rules and the
right-sizing rules, checked through Prometheus' HTTP API (docs/e2e.md, "Why idle").

It proves two things of the why-idle signals against real exporter output:
- **GPUStarvedByCPU** fires for `train/loader-starved-0` (its GPU idle 60 % of the time,
  its container throttled in 40 % of CFS periods) and for no other pod: not
  `train/cpu-bound-0` (throttled as often, GPU busy), not `research/notebook-0` (idle,
  CPU to spare), not `serve/embedder-0` (busy at 8 % SM). Not even pending.
- the right-sizing records suggest **1g.10gb** for Deployment `serve/embedder` (6 GiB,
  8 % SM of an H100) and nothing for the two busy trainers, and the "Could run on" panel
  of dashboards/gpu-waste.json, its four targets sent as Grafana sends them, shows the
  embedder's row (suggestion, p95 memory, p95 SM active, time observed).

What is scaled, and why it stays honest (the simulator has no speed option: its clock
is the real one, so the scenario and the rules are scaled instead):
- The rules, by tests/e2e/shrink_rules.py with ``scale=30`` (one production minute = two
  e2e seconds; test_prometheus_e2e.py uses 60): GPUStarvedByCPU's `[15m]` windows and
  `for: 15m` become 30 s. The right-sizing file is shrunk with ``records=True``: its
  7-day ranges (`[6d23h59m30s]`) become `[20159s]` and its group's `interval: 1m`
  becomes 2 s, so each recorded sample still stands for one production minute and
  `:count7d`'s `* 60` still counts production seconds. Nothing else in an expression
  changes (`test_the_rightsizing_copy_changes_only_time_constants`).
- The node runs five times faster: the copy of the scenario differs from the shipped
  file only in GPU 0's duty period, 50 s -> 10 s (busy share unchanged, 30 %), and the
  exporter samples every 0.2 s instead of the e2e's usual 1 s, so a duty period still
  spans 50 sample cycles. Both matter. The ledger counts a cycle busy when the GPU
  computed in a small part of it, so each busy burst costs about one cycle of idle
  time: at 50 cycles a period the GPU reads ~68 % idle against the alert's 50 %; at 10
  (the shipped 50 s period at the default --interval 5) ~60 %. And a window
  shorter than a few duty periods swings with the phase: a 15 s window over the shipped
  50 s period goes from 0 to 100 % idle and would fire on every idle half-period
  however small the idle share. Production's 15m window spans 18 periods; the e2e's
  30 s spans 3, which holds the idle share within a few points of that (the run
  prints the range it measured). 0.1 s sampling with the rules' usual scale was tried:
  it is at the simulated GPM's 0.1 s refresh, so samples that came early read no
  activity and the GPU read 71 % idle, an easier pass than the truth.
The durations themselves are what the promtool unit tests (alerts/tests/starved.test.yaml,
rightsizing.test.yaml) prove; this run proves the expressions on real series.

Prometheus (`/usr/bin/prometheus`, Debian's package) is needed: without it the run skips
with a one-line reason, or fails in CI (tests/system_tools.py).
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
import yaml

from tests.e2e.shrink_rules import shrink_rules, time_constants_blanked, write_shrunk_rules
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
from tests.e2e.test_prometheus_e2e import substitute
from tests.system_tools import require_tool
from tests.test_alert_rules import ALERTS, load_yaml, run_promtool
from tests.test_dashboards import DASHBOARDS, load, panels

ROOT = Path(__file__).resolve().parents[2]
SCENARIO = ROOT / "exporter" / "sim" / "scenarios" / "why-idle.yaml"
NODE = "sim-why-idle"
ALERT_RULES = ALERTS / "gpu-occupancy-exporter.rules.yaml"
RECORDING_RULES = ALERTS / "gpu-occupancy-exporter.recording.yaml"
RIGHTSIZING_RULES = ALERTS / "gpu-occupancy-exporter.rightsizing.yaml"
WASTE_BOARD = DASHBOARDS / "gpu-waste.json"
PANEL = "Could run on"
ALERT = "GPUStarvedByCPU"
SUGGESTION = "namespace_owner_model:gpu_rightsizing_suggestion:info"

RULE_SCALE = 30  # production seconds per e2e second, for the rules (shrink_rules.py)
NODE_SPEEDUP = 5  # the scenario's duty period and the exporter's 1 s interval, divided by this
INTERVAL_S = 1.0 / NODE_SPEEDUP
WINDOW_S = 15 * 60 // RULE_SCALE  # GPUStarvedByCPU's [15m] and for: 15m on this scale

STARVED = {"namespace": "train", "pod": "loader-starved-0", "gpu": "0"}
QUIET_PODS = ("cpu-bound-0", "notebook-0", "embedder-0")
EMBEDDER = {"namespace": "serve", "owner_kind": "Deployment", "owner_name": "embedder"}
BUSY_TRAINERS = ("loader-starved", "cpu-bound")  # Job owners: need (most of) a whole GPU

# Budgets (seconds). Expected: the alert at most ~65 s after the first scrape (a 30 s
# window filling, then `for: 30s`), the suggestion within seconds; the rest is slack for
# a busy 2-core machine.
START_TIMEOUT_S = 30
WAIT_TIMEOUT_S = 120
POLL_S = 0.5


@dataclass
class Run:
    api: PromApi
    sim_t0: float
    first_scrape: float = 0.0
    end: float = 0.0
    # first time (s after the scenario's t=0) each (alert state, pod) was seen by polling
    seen: dict[tuple[str, str], float] = field(default_factory=dict)
    # every GPUStarvedByCPU instance in any state over the whole run (ALERTS history)
    alert_instances: list[dict[str, str]] = field(default_factory=list)
    suggestions: list[dict[str, str]] = field(default_factory=list)
    panel: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    panel_errors: list[str] = field(default_factory=list)
    health: list[tuple[str, str, str]] = field(default_factory=list)
    idle_share: tuple[float, float] = (math.nan, math.nan)  # starved pod, after the fill
    runtime_s: float = 0.0
    state: str = ""


def scenario_for_run(tmp: Path) -> Path:
    """The shipped scenario with every duty period divided by ``NODE_SPEEDUP``."""
    doc = yaml.safe_load(SCENARIO.read_text(encoding="utf-8"))
    for gpu in doc["gpus"]:
        if gpu.get("duty"):
            gpu["duty"] = {**gpu["duty"], "period_s": gpu["duty"]["period_s"] / NODE_SPEEDUP}
    path = tmp / "why-idle.e2e.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False), encoding="utf-8")
    return path


def panel_targets() -> list[tuple[str, str]]:
    """(refId, PromQL) of the "Could run on" panel's targets."""
    (panel,) = [p for p in panels(load(WASTE_BOARD)) if p.get("title") == PANEL]
    return [(t["refId"], t["expr"]) for t in panel["targets"]]


def describe(api: PromApi) -> str:
    lines = ["alerts (state, name, namespace/pod, gpu):"]
    try:
        for a in sorted(api.alerts(), key=lambda a: a["labels"]["alertname"]):
            lb = a["labels"]
            lines.append(
                f"  {a['state']:8} {lb['alertname']:32} "
                f"{lb.get('namespace', '')}/{lb.get('pod', '')} {lb.get('gpu', '')}"
            )
        for s in api.series(SUGGESTION):
            lines.append(f"  suggestion {s['metric']}")
    except (OSError, ValueError, KeyError, AssertionError) as exc:
        lines.append(f"  (Prometheus did not answer: {exc})")
    return "\n".join(lines)


def _done(run: Run) -> bool:
    starved = any(state == "firing" and pod == STARVED["pod"] for state, pod in run.seen if state)
    return starved and any(s.get("owner_name") == "embedder" for s in run.suggestions)


def poll(run: Run, prometheus: Child, exporter: Child) -> None:
    """Until the starved pod's alert fires and the embedder has a suggestion (bounded),
    noting when each alert state was first seen for each pod."""
    deadline = time.monotonic() + WAIT_TIMEOUT_S
    while True:
        prometheus.check_alive()
        exporter.check_alive()
        for item in run.api.series(f'ALERTS{{alertname="{ALERT}"}}'):
            key = (item["metric"]["alertstate"], item["metric"].get("pod", ""))
            if key not in run.seen:
                run.seen[key] = time.time() - run.sim_t0
                print(f"[why-idle t={run.seen[key]:5.1f} s] {ALERT} {key[0]} {key[1]}", flush=True)
        run.suggestions = [s["metric"] for s in run.api.series(SUGGESTION)]
        if _done(run) or time.monotonic() >= deadline:
            return
        time.sleep(POLL_S)


def starved_idle_share(api: PromApi, start: float, end: float) -> tuple[float, float]:
    """Min and max of the alert's idle-share term for the starved pod once its window
    is full (the left-hand side of GPUStarvedByCPU on the e2e scale)."""
    sel = f'namespace="{STARVED["namespace"]}",pod="{STARVED["pod"]}"'
    expr = (
        f'sum(rate(gpu_container_allocated_gpu_seconds_total{{{sel},state=~"idle|no_process"}}[{WINDOW_S}s]))'
        f" / sum(rate(gpu_container_allocated_gpu_seconds_total{{{sel}}}[{WINDOW_S}s]))"
    )
    data = api.query_range(expr, start, end, 1)
    values = [float(v) for r in data.get("data", {}).get("result", []) for _, v in r["values"]]
    return (min(values), max(values)) if values else (math.nan, math.nan)


@pytest.fixture(scope="module")
def why_idle(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    binary = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("why-idle-e2e")
    began = time.monotonic()
    exporter_port, prom_port = free_port(), free_port()
    rules = [
        write_shrunk_rules(ALERT_RULES, tmp / "alerts.e2e.yaml", scale=RULE_SCALE),
        RECORDING_RULES,  # what some alerts read; verbatim, as in test_prometheus_e2e.py
        write_shrunk_rules(
            RIGHTSIZING_RULES, tmp / "rightsizing.e2e.yaml", records=True, scale=RULE_SCALE
        ),
    ]
    config = tmp / "prometheus.yml"
    write_prometheus_config(config, {NODE: exporter_port}, rules)
    children: list[Child] = []
    try:
        exporter_t0 = time.time()
        exporter = start_exporter(
            scenario_for_run(tmp), exporter_port, tmp / "exporter.log", interval_s=INTERVAL_S
        )
        children.append(exporter)

        def exporter_ready() -> bool:
            exporter.check_alive()
            return http_get(f"http://127.0.0.1:{exporter_port}/readyz", timeout=2)[0] == 200

        wait_until(exporter_ready, timeout_s=START_TIMEOUT_S, what="the exporter's /readyz")
        sim_t0 = simulation_start(exporter.log_path.read_text(encoding="utf-8")) or exporter_t0
        prometheus = start_prometheus(binary, config, tmp / "tsdb", prom_port, tmp / "prom.log")
        children.append(prometheus)
        api = PromApi(prom_port)

        def prometheus_ready() -> bool:
            prometheus.check_alive()
            return api.ready()

        wait_until(prometheus_ready, timeout_s=START_TIMEOUT_S, what="Prometheus' /-/ready")
        run = Run(api=api, sim_t0=sim_t0)
        wait_until(
            lambda: api.series(f'up{{job="{JOB}"}} == 1'),
            timeout_s=START_TIMEOUT_S,
            what="the first successful scrape",
            diagnostics=prometheus.log_tail,
        )
        run.first_scrape = time.time() - POLL_S
        print(f"[why-idle] exporter and Prometheus up after {time.monotonic() - began:.1f} s")

        poll(run, prometheus, exporter)
        run.end = time.time()
        run.state = describe(api)
        window = math.ceil(run.end - run.first_scrape) + 2
        run.alert_instances = [
            s["metric"]
            for s in api.series(f'max_over_time(ALERTS{{alertname="{ALERT}"}}[{window}s])')
        ]
        run.suggestions = [s["metric"] for s in api.series(SUGGESTION)]
        for ref, raw in panel_targets():
            data = api.query(substitute(raw, window), run.end)  # instant, as the table asks
            if data.get("status") != "success":
                run.panel_errors.append(f"{ref}: {data.get('error')}")
                continue
            run.panel[ref] = data["data"]["result"]
        loaded = {
            r.get("alert") or r["record"] for g in load_yaml(rules[2])["groups"] for r in g["rules"]
        }
        run.health = [
            (r["name"], r["health"], r.get("lastError", ""))
            for r in api.rules()
            if r["name"] in loaded | {ALERT}
        ]
        run.idle_share = starved_idle_share(api, run.first_scrape + WINDOW_S + 2, run.end)
        run.runtime_s = time.monotonic() - began
        print(
            f"[why-idle] run took {run.runtime_s:.1f} s; starved pod's {WINDOW_S} s idle share "
            f"{run.idle_share[0]:.2f}..{run.idle_share[1]:.2f}; suggestions "
            f"{[(s.get('owner_name'), s.get('suggestion')) for s in run.suggestions]}",
            flush=True,
        )
        yield run
    finally:
        for child in reversed(children):
            child.stop()


# --- the rewritten inputs (no Prometheus needed) --------------------------------------


def test_the_rightsizing_copy_changes_only_time_constants(tmp_path: Path) -> None:
    doc = load_yaml(RIGHTSIZING_RULES)
    shrunk = shrink_rules(doc, records=True, scale=RULE_SCALE)
    ranges: set[str] = set()
    for group, small in zip(doc["groups"], shrunk["groups"], strict=True):
        assert group["interval"] == "1m" and small["interval"] == "2s"
        for rule, rewritten in zip(group["rules"], small["rules"], strict=True):
            assert time_constants_blanked(rewritten["expr"]) == time_constants_blanked(rule["expr"])
            ranges |= set(re.findall(r"\[(\d[^\]:]*)\]", rewritten["expr"]))
    # [6d23h59m30s] / 30, and the SM-activity counter's rate [2m] / 30 (at the shrunk
    # rules' floor)
    assert ranges == {"20159s", "5s"}, ranges
    path = write_shrunk_rules(
        RIGHTSIZING_RULES, tmp_path / "rightsizing.yaml", records=True, scale=RULE_SCALE
    )
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout


def test_the_alert_rules_shrink_as_before_without_records() -> None:
    """``records`` is off by default: the recording rules and intervals of a file shrunk
    the usual way stay verbatim (test_prometheus_e2e.py's behaviour)."""
    doc = load_yaml(RIGHTSIZING_RULES)
    assert shrink_rules(doc) == {"groups": doc["groups"]}
    (starved,) = [
        r for g in shrink_rules(load_yaml(ALERT_RULES), scale=RULE_SCALE)["groups"]
        for r in g["rules"] if r.get("alert") == ALERT
    ]  # fmt: skip
    assert starved["for"] == f"{WINDOW_S}s" == "30s"
    assert f"[{WINDOW_S}s]" in starved["expr"] and "[15m]" not in starved["expr"]


def test_the_scenario_copy_differs_only_in_the_duty_period(tmp_path: Path) -> None:
    shipped = yaml.safe_load(SCENARIO.read_text(encoding="utf-8"))
    copy = yaml.safe_load(scenario_for_run(tmp_path).read_text(encoding="utf-8"))
    assert shipped["gpus"][0]["duty"] == {"period_s": 50, "busy": 0.3}
    assert copy["gpus"][0]["duty"] == {"period_s": 10.0, "busy": 0.3}
    copy["gpus"][0]["duty"] = shipped["gpus"][0]["duty"]
    assert copy == shipped


def test_the_panel_is_there() -> None:
    assert [ref for ref, _ in panel_targets()] == ["A", "B", "C", "D"]


# --- the run's results ------------------------------------------------------------------


def test_starved_by_cpu_fires_for_the_starved_pod(why_idle: Run) -> None:
    firing = [a for a in why_idle.alert_instances if a["alertstate"] == "firing"]
    assert any(all(a.get(k) == v for k, v in STARVED.items()) for a in firing), (
        f"{ALERT} never fired for {STARVED}\n{why_idle.state}"
    )


def test_starved_by_cpu_stays_quiet_for_every_other_pod(why_idle: Run) -> None:
    """Not firing, not even pending, at any evaluation of the run."""
    others = [a for a in why_idle.alert_instances if a.get("pod") != STARVED["pod"]]
    assert not others, f"{ALERT} for other pods: {others}\n{why_idle.state}"
    assert {a.get("pod") for a in why_idle.alert_instances} <= {STARVED["pod"]}
    assert not set(QUIET_PODS) & {a.get("pod") for a in why_idle.alert_instances}


def test_embedder_gets_1g10gb_and_the_busy_trainers_none(why_idle: Run) -> None:
    embedder = [s for s in why_idle.suggestions if all(s.get(k) == v for k, v in EMBEDDER.items())]
    assert [s.get("suggestion") for s in embedder] == ["1g.10gb"], (
        f"{why_idle.suggestions}\n{why_idle.state}"
    )
    trainers = [s for s in why_idle.suggestions if s.get("owner_name") in BUSY_TRAINERS]
    assert not trainers, f"busy trainers got suggestions: {trainers}"
    # and nothing else: the idle notebook (3 GiB, no SM activity) fits a 1g.10gb as well
    every = {(s["namespace"], s["owner_name"]): s["suggestion"] for s in why_idle.suggestions}
    assert every == {("serve", "embedder"): "1g.10gb", ("research", "notebook-0"): "1g.10gb"}


def test_could_run_on_panel_shows_the_embedder(why_idle: Run) -> None:
    """Each of the panel's targets (suggestion, p95 memory, p95 SM, observed) has the
    embedder's row, so Grafana's merge shows it with its evidence."""
    assert not why_idle.panel_errors, why_idle.panel_errors
    rows = {
        ref: [r for r in result if all(r["metric"].get(k) == v for k, v in EMBEDDER.items())]
        for ref, result in why_idle.panel.items()
    }
    assert sorted(rows) == ["A", "B", "C", "D"]
    assert all(len(found) == 1 for found in rows.values()), rows
    assert rows["A"][0]["metric"]["suggestion"] == "1g.10gb"
    memory, sm, observed = (float(rows[ref][0]["value"][1]) for ref in "BCD")
    assert 5.5 * 2**30 <= memory <= 6.5 * 2**30, memory  # the scenario's 6 GiB
    assert 0.05 <= sm <= 0.1, sm  # 8 % SM active
    assert observed >= 60, observed  # production seconds: at least one recorded minute


def test_the_loaded_rules_evaluate_without_error(why_idle: Run) -> None:
    names = {n for n, _, _ in why_idle.health}
    assert ALERT in names and SUGGESTION in names, names
    bad = [(n, h, e) for n, h, e in why_idle.health if h != "ok" or e]
    assert not bad, bad


def test_the_run_stays_within_its_budget(why_idle: Run) -> None:
    assert why_idle.runtime_s < 120, f"the why-idle e2e run took {why_idle.runtime_s:.0f} s"
