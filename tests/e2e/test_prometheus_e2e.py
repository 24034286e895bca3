"""End to end: the exporter on a simulated node, scraped by a real Prometheus that loads
the alerting rules (on an e2e time scale, see shrink_rules.py) and the recording rules,
checked through Prometheus' HTTP API. docs/e2e.md describes the run.

One module-scoped run (~70 s) plays the scenario tests/e2e/node-e2e.yaml:
1. start the exporter, then Prometheus (scrape and evaluation every second);
2. poll until every expected alert has fired (bounded; progress is printed);
3. while the exporter still runs: read its /metrics and every rule's health;
4. stop the exporter: GPUExporterDownDuringCriticalAlert must fire (a critical alert
   fires for it); meanwhile read every dashboard query and every recording rule over
   the window that ended when it still ran, and render the PNG plots; then drop its
   target from Prometheus' configuration: GPUExporterAbsent must fire.
The tests below then assert on what the run saw; each failure message carries the alert
states and the relevant lines of the exporter's last scrape.

Prometheus (`/usr/bin/prometheus`, Debian's `prometheus` package, as promtool) is
needed: without it the run skips with a one-line reason, or fails in CI
(tests/system_tools.py).

Self-check: `GPU_E2E_BREAK=rule` breaks GPUIsolationLeak's expression in the loaded copy,
`GPU_E2E_BREAK=query` breaks one dashboard query and `GPU_E2E_BREAK=compat` renames
DCGM_FI_DEV_GPU_TEMP in the loaded compatibility rules; each must make a test below fail.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import pytest
import yaml

from tests.e2e import render_plots
from tests.e2e.shrink_rules import (
    FLOOR_S,
    SCALE,
    shrink_duration,
    shrink_expr,
    time_constants_blanked,
    write_shrunk_rules,
)
from tests.e2e.stack import (
    JOB,
    NODE,
    Child,
    PromApi,
    Secured,
    free_port,
    http_get,
    simulation_start,
    start_exporter,
    start_prometheus,
    wait_until,
    write_prometheus_config,
)
from tests.system_tools import require_tool
from tests.test_alert_rules import (
    ALERTS,
    CHART_RECORDED,
    alerting_rules,
    duration_s,
    load_yaml,
    referenced_metrics,
    run_promtool,
)
from tests.test_dashboards import dashboard_files, load, panels
from tests.tls_certs import authority

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCENARIO = HERE / "node-e2e.yaml"
# The GKE and DRA nodes: one workload in two allocators' words, scraped by a second
# Prometheus (so the main node's plots and dashboard queries see only the main node).
FORMS_SCENARIO = HERE / "node-e2e-allocators.yaml"
GKE_NODE, DRA_NODE = "sim-gke-e2e", "sim-dra-e2e"
FORMS_LEAK = {"namespace": "debug", "pod": "leaky-notebook", "gpu": "3"}  # from t=20
ALERT_RULES = ALERTS / "gpu-occupancy-exporter.rules.yaml"
RECORDING_RULES = ALERTS / "gpu-occupancy-exporter.recording.yaml"
# cluster capacity per GPU model and failure headroom (the waste board's capacity row reads it)
CAPACITY_RULES = ALERTS / "gpu-occupancy-exporter.capacity.yaml"
# The GPU-hour ledger's rules (docs/dashboards.md, "Chargeback and waste"), and the cost
# rules the Helm chart renders with a price for the simulated GPUs' model (the
# simulator's default name, exporter/sim/scenario.py): the waste board's cost panels read them.
CHARGEBACK_RULES = ALERTS / "gpu-occupancy-exporter.chargeback.yaml"
# The right-sizing rules, which the waste board's "Could run on" panel reads: their 7-day
# ranges and 1m interval shrunk like the alerts' (shrink_rules.py, records=True).
RIGHTSIZING_RULES = ALERTS / "gpu-occupancy-exporter.rightsizing.yaml"
CHART = ROOT / "charts" / "gpu-occupancy-exporter"
SIMULATED_MODEL = "NVIDIA H100 80GB HBM3"
# dcgm-exporter's series rebuilt from ours (docs/migrating-from-dcgm-exporter.md), loaded
# into the main Prometheus, under which NVIDIA's own dcgm-exporter dashboard (a verbatim
# copy; its source in dcgm-exporter-dashboard.md) must work like the project's boards.
COMPAT_RULES = ALERTS / "compat" / "dcgm-exporter.recording.yaml"
NVIDIA_DASHBOARD = HERE / "dcgm-exporter-dashboard.json"
DOCS_IMG = ROOT / "docs" / "img"
BREAK = os.environ.get("GPU_E2E_BREAK", "")

# The alert rules' time scale for this run: one production hour becomes 30 s (SCALE is
# a minute to a second; the floor, FLOOR_S, stays). Twice SCALE because the slowest
# expected alert, GPUAllocatedButIdle (`[15m]` and `for: 1h`), then fires ~45 s after
# the simulation starts instead of ~80 s; every other window is at the floor or a few
# seconds above it either way. The recording rules' windows (chargeback, right-sizing)
# keep SCALE: they do not gate any wait, and a recorded sample stays a production minute.
RUN_SCALE = 2 * SCALE
# The main exporter's sample interval. GPUAllocatedButIdle compares a rate over 8 s with
# 0.9, and the ledger's counters grow in whole cycles: at 1 s cycles an 8 s window, which
# Prometheus' 1 s scrapes see in phase with them or not, holds 6 to 8 cycles (rate 0.86
# to 1.14: measured), so the alert's `for:` restarts at random. At 0.5 s cycles each
# scrape sees two of them (rate measured a flat 1.00); a late cycle costs 1/16 of the
# window, no more than one cost the [15s] window of 1 s cycles on the 60 scale.
MAIN_INTERVAL_S = 0.5

# Budgets (seconds). Every alert is expected ~45 s after the simulation starts (the last:
# GPUAllocatedButIdle, an 8 s rate window filling up, then `for: 30s`); the rest is slack
# for a slow, busy CI machine. An alert that never fires costs the whole ALERTS_TIMEOUT_S:
# about 3 minutes in all.
START_TIMEOUT_S = 30
ALERTS_TIMEOUT_S = 150
DOWN_TIMEOUT_S = 40
FORMS_TIMEOUT_S = 30
ABSENT_TIMEOUT_S = 50
POLL_S = 0.5

# Grafana's built-in variables for a query over the run: a 2 s step, and
# $__rate_interval = max($__interval + scrape interval, 4 x scrape interval).
STEP_S = 2
BUILTINS = {"__interval": f"{STEP_S}s", "__rate_interval": "4s"}
# A stat panel's fallback for "nothing to count"; stripped before counting series.
FALLBACK = re.compile(r"\s+or\s+vector\(0\)\s*$")


@dataclass(frozen=True)
class Expect:
    """Firing instances: each of ``must`` matches one; every one matches ``must`` or ``may``."""

    must: tuple[dict[str, str], ...]
    may: tuple[dict[str, str], ...] = ()


# What the scenario makes fire (labels as the rules produce them).
EXPECTED: dict[str, Expect] = {
    "GPUOrphanedMemory": Expect(
        (
            {"gpu": "5", "kind": "dead_process"},  # kill -9 at t=20
            {"gpu": "1", "kind": "stuck_process"},  # state D at t=25
            {"gpu": "4", "kind": "unattributed"},  # fork_orphan at t=25
            {"gpu": "2", "kind": "deleted_pod"},  # delete_pod at t=20
        )
    ),
    "GPUOrphanedMemoryLarge": Expect(({"gpu": "5"},)),  # 30 of 80 GiB
    "GPUFatalXID": Expect(({"gpu": "6", "xid": "79"},)),  # XID 31 on GPU 2 is not fatal
    # GPU 6's XID 79 (then lost) pages once, as GPUFatalXID: GPUUnhealthy stays quiet for
    # a GPU whose unhealthy reasons include a fatal XID (docs/runbooks.md), and no other
    # GPU is unhealthy, so it must not fire at all
    "GPUNodeCapacityReduced": Expect(({"resource": "nvidia.com/gpu", "node": NODE},)),
    "GPUThermalOrPowerSlowdown": Expect(({"gpu": "1"},)),
    # x8 of x16 under load; idle GPUs 6 and 7 sit at PCIe Gen1 of Gen5 and stay quiet
    "GPUPCIeLinkDegraded": Expect(({"gpu": "0"},)),
    "GPUUtilizationWithoutSMActivity": Expect(({"gpu": "4"},)),
    # GPU 8: batch-hog takes ~88 % of the turns; GPU 2's three chat pods share fairly enough
    "GPUTimeSliceHog": Expect(({"gpu": "8", "namespace": "inference", "pod": "batch-hog"},)),
    # GPU 8: llm-hami grows 22 GiB at t=25, leaving less than that
    "GPUSharedMemoryNearFull": Expect(({"gpu": "8"},)),
    "GPUAllocatedButIdle": Expect(
        # GPU 6's allocation is not idle once the GPU is lost (t=21): it is broken,
        # which GPUUnhealthy reports; idle time is not counted on a failed GPU
        ({"pod": "idle-reservation", "gpu": "7"}, {"pod": "tiny-kernels", "gpu": "4"}),
    ),
    "GPUIsolationLeak": Expect(({"namespace": "debug", "pod": "leaky-shell", "gpu": "5"},)),
}
# On the GKE and DRA nodes, only the real leak fires: no allocation is mistaken for one.
FORMS_EXPECTED: dict[str, Expect] = {
    "GPUIsolationLeak": Expect(({**FORMS_LEAK, "node": GKE_NODE}, {**FORMS_LEAK, "node": DRA_NODE}))
}
# Fire only once the exporter is stopped (step 4). It is stopped under a critical alert
# (GPUFatalXID on GPU 6), so its absence pages as loud as that: the critical
# GPUExporterDownDuringCriticalAlert, never the warning GPUExporterDown.
STOP_PHASE = ("GPUExporterDownDuringCriticalAlert", "GPUExporterAbsent")

# Dashboard panel queries allowed to return no series, with the reason. Keep it minimal:
# each entry must still be valid PromQL, and must really return nothing (else remove it).
NO_SERIES_IN_SIMULATION: dict[tuple[str, str, str], str] = {}

# Labels worth showing when describing an alert.
ALERT_KEYS = ("gpu", "kind", "xid", "namespace", "pod", "resource", "source", "node")


# --- the run -------------------------------------------------------------------------


@dataclass(frozen=True)
class QueryResult:
    board: str
    where: str
    expr: str
    mode: str  # range | instant | variable
    status: str
    error: str
    series: int


@dataclass
class Run:
    api: PromApi
    sim_t0: float  # Unix time of the scenario's t=0
    prom_start: float
    first_scrape: float = 0.0
    main_end: float = 0.0
    fired: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    state: str = ""  # alert states and targets at the end of the main phase
    scrape: str = ""  # the exporter's /metrics at the end of the main phase
    dashboards: list[QueryResult] = field(default_factory=list)
    recorded: dict[str, int] = field(default_factory=dict)
    rule_health: list[tuple[str, str, str]] = field(default_factory=list)
    plots: list[Path] = field(default_factory=list)
    stop_phase_fired: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    fired_over_run: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    stop_phase_state: str = ""
    runtime_s: float = 0.0
    # the second Prometheus, scraping the GKE and DRA nodes
    forms_fired: dict[str, list[dict[str, str]]] = field(default_factory=dict)
    forms_state: str = ""
    forms_unresolved: list[dict[str, Any]] = field(default_factory=list)
    forms_allocated: dict[str, int] = field(default_factory=dict)
    forms_without_gpu: list[dict[str, Any]] = field(default_factory=list)
    # the main exporter is served over TLS with basic auth
    main_target: dict[str, Any] = field(default_factory=dict)
    without_password: int = 0

    def scrape_lines(self, metrics: set[str]) -> str:
        """The lines of the last scrape for ``metrics`` (recorded names: their sources)."""
        names = {m.split(":")[1] if m.count(":") == 2 else m for m in metrics}
        lines = [
            line
            for line in self.scrape.splitlines()
            if line
            and not line.startswith("#")
            and any(re.match(rf"{re.escape(n)}(_bucket|_sum|_count)?[{{ ]", line) for n in names)
        ]
        shown = "\n".join(lines[:60]) + (f"\n... {len(lines) - 60} more" if len(lines) > 60 else "")
        return f"last scrape, {sorted(names)}:\n{shown or '(no such lines)'}"


def alert_names() -> list[str]:
    return [r["alert"] for r in alerting_rules()]


def _label_subset(labels: dict[str, str]) -> str:
    return ", ".join(f"{k}={labels[k]}" for k in ALERT_KEYS if labels.get(k))


def describe(api: PromApi) -> str:
    """Alert states and targets, for failure messages."""
    lines = ["Prometheus alerts (state, name, labels, active since):"]
    try:
        alerts = sorted(api.alerts(), key=lambda a: (a["labels"]["alertname"], a["state"]))
        for a in alerts:
            lines.append(
                f"  {a['state']:8} {a['labels']['alertname']:32} "
                f"{_label_subset(a['labels'])}  {a.get('activeAt', '')}"
            )
        if not alerts:
            lines.append("  (none pending or firing)")
        lines.append("targets:")
        for t in api.targets():
            lines.append(
                f"  {t['labels'].get('job')} {t['scrapeUrl']}: {t['health']} "
                f"last scrape {t.get('lastScrape')} {t.get('lastError') or ''}"
            )
    except (OSError, ValueError, KeyError) as exc:
        lines.append(f"  (Prometheus did not answer: {exc})")
    return "\n".join(lines)


def fired_since(api: PromApi, start: float) -> dict[str, list[dict[str, str]]]:
    """Every alert instance that was firing at some evaluation since ``start``."""
    window = math.ceil(time.time() - start) + 2
    fired: dict[str, list[dict[str, str]]] = {}
    for item in api.series(f'max_over_time(ALERTS{{alertstate="firing"}}[{window}s])'):
        labels = item["metric"]
        fired.setdefault(labels["alertname"], []).append(labels)
    return fired


def _matches(labels: dict[str, str], wanted: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in wanted.items())


def missing_instances(
    fired: dict[str, list[dict[str, str]]], expected: dict[str, Expect] = EXPECTED
) -> dict[str, list[dict[str, str]]]:
    """Expected firing instances not seen yet."""
    missing = {}
    for name, expect in expected.items():
        absent = [w for w in expect.must if not any(_matches(f, w) for f in fired.get(name, []))]
        if absent:
            missing[name] = absent
    return missing


def rule_file_for_run(tmp: Path) -> Path:
    path = write_shrunk_rules(ALERT_RULES, tmp / "alerts.e2e.rules.yaml", scale=RUN_SCALE)
    if BREAK == "rule":  # self-check: a broken expression must fail the run
        text = path.read_text(encoding="utf-8")
        broken = text.replace(
            "expr: gpu_unallocated_use_memory_bytes > 0",
            "expr: gpu_unallocated_used_memory_bytes > 0",
        )
        assert broken != text, "GPU_E2E_BREAK=rule: GPUIsolationLeak's expression changed"
        path.write_text(broken, encoding="utf-8")
    return path


def compat_rules_for_run(tmp: Path) -> Path:
    if BREAK != "compat":
        return COMPAT_RULES
    text = COMPAT_RULES.read_text(encoding="utf-8")  # self-check: NVIDIA's board must fail
    broken = text.replace("record: DCGM_FI_DEV_GPU_TEMP\n", "record: DCGM_FI_DEV_GPU_TEMPERATURE\n")
    assert broken != text, "GPU_E2E_BREAK=compat: DCGM_FI_DEV_GPU_TEMP's rule changed"
    path = tmp / COMPAT_RULES.name
    path.write_text(broken, encoding="utf-8")
    return path


def chargeback_rules_for_run(tmp: Path) -> Path:
    """The chargeback file with its group's `interval: 1m` on the e2e time scale (like the
    alerts' time constants: shrink_rules.py); expressions unchanged."""
    doc = load_yaml(CHARGEBACK_RULES)
    for group in doc["groups"]:
        if "interval" in group:
            group["interval"] = shrink_duration(group["interval"])
    path = tmp / CHARGEBACK_RULES.name
    path.write_text(yaml.safe_dump(doc, sort_keys=False, width=1000), encoding="utf-8")
    return path


def chart_cost_rules_for_run(tmp: Path) -> Path:
    """The cost group exactly as the Helm chart renders it with a price for the simulated
    model (chargeback.pricePerGpuHour), its interval shrunk like the chargeback group's."""
    import helm_python as helm  # dev dependency; only this run needs it

    manifests = helm.Chart.load(CHART).render(
        {
            "prometheusRule": {"enabled": True},
            "chargeback": {"pricePerGpuHour": {SIMULATED_MODEL: 2.5}},
        },
        name="e2e",
        namespace="monitoring",
        is_install=True,
    )
    (text,) = [t for name, t in manifests.items() if name.endswith("prometheusrule.yaml")]
    (rule,) = [d for d in yaml.safe_load_all(text) if d]
    (group,) = [g for g in rule["spec"]["groups"] if g["name"].endswith(".chargeback.cost")]
    group["interval"] = shrink_duration(group["interval"])
    path = tmp / "chargeback-cost.rules.yaml"
    path.write_text(yaml.safe_dump({"groups": [group]}, sort_keys=False, width=1000), "utf-8")
    return path


def rightsizing_rules_for_run(tmp: Path) -> Path:
    return write_shrunk_rules(RIGHTSIZING_RULES, tmp / RIGHTSIZING_RULES.name, records=True)


def recording_rules(*paths: Path) -> list[dict[str, Any]]:
    return [r for p in paths for g in load_yaml(p)["groups"] for r in g["rules"]]


def served_metrics(scrape: str) -> set[str]:
    """Names of the series in an exposition (counters with their `_total`)."""
    return set(re.findall(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", scrape, re.MULTILINE))


def wait_for_expected_alerts(api: PromApi, run: Run, prometheus: Child, exporter: Child) -> None:
    deadline = time.monotonic() + ALERTS_TIMEOUT_S
    seen: dict[tuple[str, str], str] = {}
    while True:
        prometheus.check_alive()
        exporter.check_alive()
        for a in api.alerts():
            key = (a["labels"]["alertname"], _label_subset(a["labels"]))
            if seen.get(key) != a["state"]:
                seen[key] = a["state"]
                print(
                    f"[e2e t={time.time() - run.sim_t0:5.1f} s] {a['state']:8} {key[0]} {key[1]}",
                    flush=True,
                )
        missing = missing_instances(fired_since(api, run.prom_start))
        if not missing or time.monotonic() >= deadline:
            if missing:
                print(f"[e2e] gave up waiting for {missing}", flush=True)
            return
        time.sleep(POLL_S)


def substitute(expr: str, range_s: int) -> str:
    """Grafana's variables for a query over the whole run; filters become `.*`."""
    values = {**BUILTINS, "__range": f"{range_s}s"}

    def value(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        return values.get(name, ".*")

    return re.sub(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)", value, expr)


def dashboard_queries() -> Iterator[tuple[str, str, str, str, str]]:
    """(board, where, expr, mode, label) for every panel target, annotation and variable of
    the project's boards and NVIDIA's; ``label`` is the variable's label for mode ``variable``."""
    for path in [*dashboard_files(), NVIDIA_DASHBOARD]:
        board = load(path)
        for panel in panels(board):
            for t in panel.get("targets", []):
                mode = "instant" if t.get("instant") else "range"
                yield path.name, f"{panel['title']} {t['refId']}", t["expr"], mode, ""
        for a in board["annotations"]["list"]:
            if "expr" in a:
                yield path.name, f"annotation {a['name']}", a["expr"], "range", ""
        for v in board["templating"]["list"]:
            if v["type"] == "query":
                match = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["query"], re.DOTALL)
                assert match, f"{path.name} variable {v['name']}: not label_values(...)"
                yield path.name, f"variable {v['name']}", match.group(1), "variable", match[2]


def _fetch(api: PromApi, expr: str, mode: str, label: str, start: float, end: float) -> Any:
    if mode == "variable":
        return api.label_values(label, expr, start, end)
    if mode == "instant":
        return api.query(expr, end)
    return api.query_range(expr, start, end, STEP_S)


def run_dashboard_queries(api: PromApi, start: float, end: float) -> list[QueryResult]:
    """Each query as Grafana would send it (status), and its series counted without a
    stat panel's `or vector(0)` fallback, which would answer even for a misspelt metric."""
    results = []
    range_s = math.ceil(end - start)
    for board, where, raw, mode, label in dashboard_queries():
        if BREAK == "query" and where == "Orphan holders A":  # self-check
            raw = raw.replace("gpu_orphaned_holder_info", "gpu_orphaned_holders_info")
        expr = substitute(raw, range_s)
        data = _fetch(api, expr, mode, label, start, end)
        checked = FALLBACK.sub("", expr)
        if checked != expr and data.get("status") == "success":
            data = _fetch(api, checked, mode, label, start, end)
        ok = data.get("status") == "success"
        result: Any = data.get("data", []) if ok else []
        if mode != "variable" and ok:
            result = result["result"]
        results.append(
            QueryResult(
                board,
                where,
                checked,
                mode,
                data.get("status", "?"),
                data.get("error", ""),
                len(result),
            )
        )
    return results


E2E_USER, E2E_PASSWORD = "prometheus", "e2e-scrape-password"


def secure_main_exporter(tmp: Path) -> Secured:
    """The main exporter serves over TLS with basic auth (--web-config-file), as a
    compliance baseline would have it; Prometheus scrapes it with the CA and password."""
    ca = authority(tmp, "e2e-ca")
    server = ca.issue(tmp, "e2e-server", server=True, sans=("127.0.0.1", "localhost"))
    hashed = bcrypt.hashpw(E2E_PASSWORD.encode(), bcrypt.gensalt(rounds=4)).decode()
    web_config = tmp / "web-config.yml"
    web_config.write_text(
        yaml.safe_dump(
            {
                "tls_server_config": {"cert_file": str(server.cert), "key_file": str(server.key)},
                "basic_auth_users": {E2E_USER: hashed},
            }
        ),
        encoding="utf-8",
    )
    return Secured(ca.path, E2E_USER, E2E_PASSWORD, web_config)


def dra_variant(tmp: Path) -> Path:
    """The allocation-forms node as a DRA node: claims + a ResourceSlice instead of
    GKE's device names, under its own node name."""
    scenario = load_yaml(FORMS_SCENARIO)
    scenario.update(allocator="dra", node_name=DRA_NODE)
    path = tmp / "node-e2e-dra.yaml"
    path.write_text(yaml.safe_dump(scenario, sort_keys=False), encoding="utf-8")
    return path


def read_allocation_forms_run(api: PromApi, run: Run, prometheus: Child) -> None:
    """The GKE and DRA nodes ran alongside the main node; their leak fired long ago
    (t=20 + the rule's `for`). Wait briefly for it if not, then record what fired."""

    def leak_fired() -> bool:
        prometheus.check_alive()
        return not missing_instances(fired_since(api, run.prom_start), FORMS_EXPECTED)

    try:
        wait_until(leak_fired, timeout_s=FORMS_TIMEOUT_S, what="the GKE and DRA leaks")
    except AssertionError as exc:
        print(f"[e2e] {exc}", flush=True)
    run.forms_fired = fired_since(api, run.prom_start)
    run.forms_state = describe(api)
    run.forms_unresolved = api.series("gpu_exporter_unresolved_allocations > 0")
    run.forms_without_gpu = api.series('gpu_container_allocated{uuid=""}')
    run.forms_allocated = {
        item["metric"]["node"]: int(float(item["value"][1]))
        for item in api.series("count by (node) (gpu_container_allocated)")
    }
    print(f"[e2e] GKE and DRA nodes: fired {sorted(run.forms_fired)}", flush=True)


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    binary = require_tool("prometheus")
    tmp = tmp_path_factory.mktemp("e2e")
    began = time.monotonic()
    exporter_port, prom_port = free_port(), free_port()
    rules = [rule_file_for_run(tmp), RECORDING_RULES]
    chargeback = [chargeback_rules_for_run(tmp), chart_cost_rules_for_run(tmp)]
    rightsizing = rightsizing_rules_for_run(tmp)
    main_rules = [*rules, compat_rules_for_run(tmp), *chargeback, rightsizing, CAPACITY_RULES]
    config = tmp / "prometheus.yml"
    secured = secure_main_exporter(tmp)
    forms_ports = {GKE_NODE: free_port(), DRA_NODE: free_port()}
    forms_config = tmp / "prometheus-forms.yml"
    # Both Prometheus servers start without rules (see load_rules_after_first_scrape).
    write_prometheus_config(config, {NODE: exporter_port}, [], secured)
    write_prometheus_config(forms_config, forms_ports, [])
    forms_scenarios = {GKE_NODE: FORMS_SCENARIO, DRA_NODE: dra_variant(tmp)}
    children: list[Child] = []
    try:
        exporter_t0 = time.time()
        exporter = start_exporter(
            SCENARIO, exporter_port, tmp / "exporter.log", secured, interval_s=MAIN_INTERVAL_S
        )
        children.append(exporter)
        forms_exporters = {
            node: start_exporter(forms_scenarios[node], port, tmp / f"exporter-{node}.log")
            for node, port in forms_ports.items()
        }
        children.extend(forms_exporters.values())

        def ready(child: Child, port: int, secured: Secured | None = None) -> bool:
            child.check_alive()
            scheme = "https" if secured else "http"
            url = f"{scheme}://127.0.0.1:{port}/readyz"
            return http_get(url, timeout=2, secured=secured)[0] == 200

        wait_until(
            functools.partial(ready, exporter, exporter_port, secured),
            timeout_s=START_TIMEOUT_S,
            what="the exporter's /readyz",
        )
        for node, child in forms_exporters.items():
            wait_until(
                functools.partial(ready, child, forms_ports[node]),
                timeout_s=START_TIMEOUT_S,
                what=f"the {node} exporter's /readyz",
            )
        # the scenario's t=0; the exporter process started a little earlier
        sim_t0 = simulation_start(exporter.log_path.read_text(encoding="utf-8")) or exporter_t0
        prometheus = start_prometheus(binary, config, tmp / "tsdb", prom_port, tmp / "prom.log")
        children.append(prometheus)
        api = PromApi(prom_port)
        forms_prom_port = free_port()
        forms_prometheus = start_prometheus(
            binary, forms_config, tmp / "tsdb-forms", forms_prom_port, tmp / "prom-forms.log"
        )
        children.append(forms_prometheus)
        forms_api = PromApi(forms_prom_port)
        run = Run(api=api, sim_t0=sim_t0, prom_start=time.time())
        load_rules_after_first_scrape(
            prometheus, api, config, {NODE: exporter_port}, main_rules, secured
        )
        # Prometheus applies new targets on a 5 s tick: the first sample comes a little
        # after /-/ready. The plots start there.
        run.first_scrape = time.time() - POLL_S
        load_rules_after_first_scrape(forms_prometheus, forms_api, forms_config, forms_ports, rules)
        print(f"[e2e] exporter and Prometheus up after {time.monotonic() - began:.1f} s")

        wait_for_expected_alerts(api, run, prometheus, exporter)
        run.main_end = time.time()
        run.fired = fired_since(api, run.prom_start)
        run.state = describe(api)
        main_url = f"https://127.0.0.1:{exporter_port}/metrics"
        run.scrape = http_get(main_url, secured=secured)[1].decode()
        run.main_target = next((t for t in api.targets() if t["labels"].get("node") == NODE), {})
        run.without_password = http_get(
            main_url, secured=dataclasses.replace(secured, password="wrong")
        )[0]
        run.rule_health = [(r["name"], r["health"], r.get("lastError", "")) for r in api.rules()]
        print(f"[e2e] main phase done after {time.monotonic() - began:.1f} s; stopping exporter")
        # Stopped now, so that GPUExporterDownDuringCriticalAlert's `for:` runs while the
        # rest is read: every query below is over [prom_start, main_end] or at main_end,
        # all samples the exporter had served before it stopped.
        exporter.stop()
        stopped_at = time.time()

        read_allocation_forms_run(forms_api, run, forms_prometheus)
        for child in (forms_prometheus, *forms_exporters.values()):
            child.stop()  # not needed any more: their CPU goes to the rest of the run
        run.dashboards = run_dashboard_queries(api, run.prom_start, run.main_end)
        with_series = sum(1 for r in run.dashboards if r.series)
        print(f"[e2e] {len(run.dashboards)} dashboard queries, {with_series} with series")
        run.recorded = {
            r["record"]: len(api.series(r["record"], run.main_end))
            for r in recording_rules(RECORDING_RULES, COMPAT_RULES, *chargeback, rightsizing)
        }
        events = render_plots.load_events(SCENARIO)
        window = {"start": run.first_scrape, "end": run.main_end, "t0": sim_t0}
        run.plots = render_plots.render_all(api, **window, events=events, out_dir=tmp / "img")
        if os.environ.get("E2E_WRITE_IMAGES") == "1":
            render_plots.render_all(api, **window, events=events, out_dir=DOCS_IMG)
            print(f"[e2e] wrote the plots to {DOCS_IMG}")

        def stop_fired(name: str, since: float) -> bool:
            """Firing at some evaluation since ``since`` (ALERTS history: the reading
            above may outlast a firing that ends when the held alerts' windows do)."""
            return bool(fired_since(api, since).get(name))

        since = stopped_at
        for name, timeout_s in zip(STOP_PHASE, (DOWN_TIMEOUT_S, ABSENT_TIMEOUT_S), strict=True):
            if name == "GPUExporterAbsent":  # the target goes away entirely
                write_prometheus_config(config, {}, main_rules, secured)
                api.reload()
                since = time.time()
            try:
                wait_until(
                    functools.partial(stop_fired, name, since), timeout_s=timeout_s, what=name
                )
                print(f"[e2e] {name} firing after {time.monotonic() - began:.1f} s")
            except AssertionError as exc:
                print(f"[e2e] {exc}")
        run.stop_phase_state = describe(api)
        run.fired_over_run = fired_since(api, run.prom_start)
        run.stop_phase_fired = {n: run.fired_over_run.get(n, []) for n in STOP_PHASE}
        run.runtime_s = time.monotonic() - began
        print(f"[e2e] run took {run.runtime_s:.1f} s")
        yield run
    finally:
        for child in reversed(children):
            child.stop()


def load_rules_after_first_scrape(
    prometheus: Child,
    api: PromApi,
    config: Path,
    exporters: dict[str, int],
    rule_files: list[Path],
    secured: Secured | None = None,
) -> None:
    """Wait until Prometheus is ready and has scraped every target once, then load the
    rules (a reload: rules apply at once, the unchanged scrape configuration keeps its
    targets). Prometheus applies new targets only on a 5 s tick, twice over (discovery,
    then the scrape manager), so its first scrape comes 5-11 s after it starts: with the
    rules loaded from the start, `absent(up)` would hold for that long, and
    GPUExporterAbsent's `for:` on this run's scale (8 s) could run out before any target
    existed. The exporter's own alerts are about exporters that were scraped."""

    def prometheus_ready() -> bool:
        prometheus.check_alive()
        return api.ready()

    wait_until(prometheus_ready, timeout_s=START_TIMEOUT_S, what="Prometheus' /-/ready")
    wait_until(
        lambda: len(api.series(f'up{{job="{JOB}"}} == 1')) == len(exporters),
        timeout_s=START_TIMEOUT_S,
        what="the first successful scrape of every target",
        diagnostics=lambda: describe(api) + "\n" + prometheus.log_tail(),
    )
    write_prometheus_config(config, exporters, rule_files, secured)
    api.reload()
    wait_until(lambda: len(api.rules()) > 0, timeout_s=START_TIMEOUT_S, what="the rules to load")


# --- the rule rewriting (no Prometheus needed) ----------------------------------------

_LITERALS = re.compile(r"\[([^\]]+)\]|offset\s+(\w+)|time\(\)\s*-[^<>=!]*?>\s*(\d+(?:\.\d+)?)")


def _shrunk_alerts() -> list[tuple[dict[str, Any], dict[str, Any]]]:
    return [(rule, {**rule, "expr": shrink_expr(rule["expr"])}) for rule in alerting_rules()]


def test_shrinking_divides_every_for_by_the_scale_with_a_floor() -> None:
    for rule in alerting_rules():
        if "for" in rule:
            expected = max(math.ceil(duration_s(rule["for"]) / SCALE), FLOOR_S)
            assert shrink_duration(rule["for"]) == f"{expected}s", rule["alert"]
    assert shrink_duration("1h") == "60s" and shrink_duration("2m") == f"{FLOOR_S}s"


def test_shrinking_changes_only_time_constants() -> None:
    for rule, shrunk in _shrunk_alerts():
        assert time_constants_blanked(shrunk["expr"]) == time_constants_blanked(rule["expr"])
        if _LITERALS.search(rule["expr"]):
            assert shrunk["expr"] != rule["expr"], f"{rule['alert']}: nothing was shrunk"


def test_no_time_constant_of_production_size_is_left() -> None:
    """Every range, offset and age in the loaded copy is at most a minute."""
    for _, shrunk in _shrunk_alerts():
        for rng, offset, age in _LITERALS.findall(shrunk["expr"]):
            for part in rng.split(":") if rng else [offset or age]:  # a subquery: both
                seconds = float(part) if age else duration_s(part)
                assert FLOOR_S <= seconds <= 60, f"{shrunk['alert']}: {rng or offset or age}"


def test_shrinking_examples() -> None:
    assert shrink_expr("increase(x[10m]) > 0 unless x offset 10m") == (
        "increase(x[10s]) > 0 unless x offset 10s"
    )
    assert shrink_expr("(time() - min by (a) (ts)\n > 600)") == "(time() - min by (a) (ts)\n > 10)"
    assert shrink_expr("time() - ts > 60") == f"time() - ts > {FLOOR_S}"
    assert shrink_expr("rate(x[15m]) > 0.9") == "rate(x[15s]) > 0.9"
    assert (
        shrink_expr("max_over_time(timestamp(x)[1h:1m])") == "max_over_time(timestamp(x)[60s:5s])"
    )


def test_the_rewritten_rule_file_passes_promtool(tmp_path: Path) -> None:
    path = write_shrunk_rules(ALERT_RULES, tmp_path / "rules.yaml")
    result = run_promtool("check", "rules", str(path))
    assert result.returncode == 0, result.stdout
    original = [r["alert"] for g in load_yaml(ALERT_RULES)["groups"] for r in g["rules"]]
    assert [r["alert"] for g in load_yaml(path)["groups"] for r in g["rules"]] == original


def test_the_expectations_name_real_alerts() -> None:
    assert set(EXPECTED) | set(STOP_PHASE) <= set(alert_names())


# --- the run's results ----------------------------------------------------------------


def test_expected_alerts_fire(e2e: Run) -> None:
    missing = missing_instances(e2e.fired)
    assert not missing, (
        f"alerts that never fired (expected instances): {json.dumps(missing)}\n{e2e.state}\n"
        + e2e.scrape_lines(
            {
                m
                for r in alerting_rules()
                if r["alert"] in missing
                for m in referenced_metrics(r["expr"])
            }
        )
    )


def test_expected_alerts_fire_only_for_the_expected_gpus_and_pods(e2e: Run) -> None:
    for name, expect in EXPECTED.items():
        allowed = expect.must + expect.may
        extra = [f for f in e2e.fired.get(name, []) if not any(_matches(f, w) for w in allowed)]
        assert not extra, f"{name} fired for {[_label_subset(f) for f in extra]}\n{e2e.state}"


def test_other_alerts_stay_quiet(e2e: Run) -> None:
    """Nothing else fires while the exporter runs: not the exporter's own alerts (all its
    sources are up, samples are fresh) and not the stop-phase alerts."""
    quiet = set(alert_names()) - set(EXPECTED)
    assert quiet >= {"GPUExporterSourceDown", "GPUExporterNVMLDown", "GPUExporterSamplesStale"}
    noisy = {name: e2e.fired[name] for name in quiet & set(e2e.fired)}
    assert not noisy, f"fired but should not have: {json.dumps(noisy)}\n{e2e.state}"


def test_exporter_down_and_absent_fire_once_it_is_gone(e2e: Run) -> None:
    for name in STOP_PHASE:
        assert e2e.stop_phase_fired[name], f"{name} did not fire\n{e2e.stop_phase_state}"
    after_stop = {
        name: e2e.fired_over_run[name]
        for name in set(alert_names()) - set(EXPECTED) - set(STOP_PHASE)
        if name in e2e.fired_over_run
    }
    assert not after_stop, f"fired after the stop: {after_stop}\n{e2e.stop_phase_state}"


def test_every_rule_evaluates_without_error(e2e: Run) -> None:
    bad = [(n, h, e) for n, h, e in e2e.rule_health if h != "ok" or e]
    assert not bad, f"rules with evaluation errors: {bad}"
    names = {n for n, _, _ in e2e.rule_health}
    assert set(alert_names()) <= names and set(e2e.recorded) <= names


def test_every_recording_rule_produces_series(e2e: Run) -> None:
    """The project's recording rules, the chargeback and right-sizing rules and the
    chart's cost rules."""
    project = recording_rules(RECORDING_RULES, CHARGEBACK_RULES, RIGHTSIZING_RULES)
    names = {r["record"] for r in project} | CHART_RECORDED
    assert names <= set(e2e.recorded)
    empty = [name for name, count in e2e.recorded.items() if count == 0 and name in names]
    assert not empty, f"recording rules without series: {empty}\n" + e2e.scrape_lines(
        {m for r in project if r["record"] in empty for m in referenced_metrics(r["expr"])}
    )


def test_every_dashboard_query_is_valid_promql(e2e: Run) -> None:
    errors = [r for r in e2e.dashboards if r.status != "success"]
    assert not errors, "\n".join(f"{r.board} {r.where}: {r.error}\n  {r.expr}" for r in errors)
    assert len(e2e.dashboards) > 70  # every panel of the four boards was read


def test_every_dashboard_query_returns_series(e2e: Run) -> None:
    empty = [
        r
        for r in e2e.dashboards
        if r.status == "success"
        and r.series == 0
        and (r.board, *r.where.rsplit(" ", 1)) not in NO_SERIES_IN_SIMULATION
    ]
    assert not empty, (
        "\n\n".join(
            f"{r.board} {r.where} ({r.mode}) returned no series:\n  {r.expr}\n"
            + e2e.scrape_lines(referenced_metrics(r.expr))
            for r in empty
        )
        + f"\n\n{e2e.state}"
    )


def test_every_compat_rule_produces_series_where_the_exporter_serves_its_source(
    e2e: Run,
) -> None:
    """Each dcgm-exporter compatibility rule whose source series the exporter served in
    this run records series (the rest read NVML features the e2e node does not model)."""
    rules = recording_rules(COMPAT_RULES)
    recorded = {r["record"] for r in rules}
    served = served_metrics(e2e.scrape)
    fed = [r["record"] for r in rules if referenced_metrics(r["expr"]) - recorded <= served]
    print(f"[e2e] compat rules without a served source: {sorted(recorded - set(fed))}")
    read_by_nvidia = {
        m
        for q in dashboard_queries()
        if q[0] == NVIDIA_DASHBOARD.name
        for m in referenced_metrics(q[2])
    }
    assert read_by_nvidia <= set(fed), sorted(read_by_nvidia - set(fed))
    empty = [name for name in fed if e2e.recorded[name] == 0]
    assert not empty, f"compat rules without series: {empty}\n" + e2e.scrape_lines(
        {m for r in rules if r["record"] in empty for m in referenced_metrics(r["expr"])}
    )


def test_nvidia_dcgm_exporter_dashboard_works_on_the_compat_rules(e2e: Run) -> None:
    """Every query of NVIDIA's own dcgm-exporter dashboard (its panels and its `instance`
    and `gpu` variables, read from an unchanged copy) returns series from this exporter
    through alerts/compat/dcgm-exporter.recording.yaml."""
    expected = [q for q in dashboard_queries() if q[0] == NVIDIA_DASHBOARD.name]
    board = [r for r in e2e.dashboards if r.board == NVIDIA_DASHBOARD.name]
    assert len(board) == len(expected) >= 10, [r.where for r in board]
    bad = [r for r in board if r.status != "success" or r.series == 0]
    assert not bad, "\n\n".join(
        f"{r.where} ({r.mode}): {r.status} {r.error}, {r.series} series\n  {r.expr}\n"
        + e2e.scrape_lines(referenced_metrics(r.expr))
        for r in bad
    )


def test_the_no_series_list_is_current(e2e: Run) -> None:
    by_key = {(r.board, *r.where.rsplit(" ", 1)): r for r in e2e.dashboards}
    for key, reason in NO_SERIES_IN_SIMULATION.items():
        assert key in by_key, f"{key} ({reason}): no such panel query any more"
        assert by_key[key].series == 0, f"{key} returns series now: remove it from the list"


def test_plots_are_png_images(e2e: Run) -> None:
    assert sorted(p.name for p in e2e.plots) == sorted(render_plots.FILES.values())
    for path in e2e.plots:
        data = path.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n", path
        width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
        assert width >= 800 and height >= 400, (path, width, height)
        assert len(data) > 30_000, f"{path}: {len(data)} bytes, suspiciously little drawn"


def test_the_run_stays_within_its_budget(e2e: Run) -> None:
    assert e2e.runtime_s < 240, f"the e2e run took {e2e.runtime_s:.0f} s"


# --- the GKE and DRA nodes ---------------------------------------------------------------


def test_gke_and_dra_nodes_resolve_every_allocation(e2e: Run) -> None:
    # 8 devices each: an exclusive GPU, 3 time-shared replicas, 3 MIG devices, 1 GPU
    assert e2e.forms_allocated == {GKE_NODE: 8, DRA_NODE: 8}, e2e.forms_state
    assert not e2e.forms_without_gpu, e2e.forms_without_gpu
    assert not e2e.forms_unresolved, e2e.forms_unresolved


def test_isolation_leak_fires_on_gke_and_dra_nodes_for_the_real_leak_only(e2e: Run) -> None:
    missing = missing_instances(e2e.forms_fired, FORMS_EXPECTED)
    assert not missing, f"did not fire: {json.dumps(missing)}\n{e2e.forms_state}"
    for name, expect in FORMS_EXPECTED.items():
        extra = [
            f for f in e2e.forms_fired.get(name, []) if not any(_matches(f, w) for w in expect.must)
        ]
        assert not extra, f"{name} fired for {[_label_subset(f) for f in extra]}\n{e2e.forms_state}"


def test_nothing_else_fires_on_gke_and_dra_nodes(e2e: Run) -> None:
    noisy = {n: f for n, f in e2e.forms_fired.items() if n not in FORMS_EXPECTED}
    assert not noisy, f"fired but should not have: {json.dumps(noisy)}\n{e2e.forms_state}"


# --- TLS and basic auth --------------------------------------------------------------


def test_prometheus_scrapes_the_main_exporter_over_tls_with_basic_auth(e2e: Run) -> None:
    target = e2e.main_target
    assert target.get("scrapeUrl", "").startswith("https://"), target
    assert target.get("health") == "up", target
    assert e2e.without_password == 401
