"""GPU / Waste and chargeback (gpu-waste.json): the fleet-level GPU-hour ledger of the
chargeback recording rules (who held GPUs, how much of it did no work and why, idle and free
capacity per GPU model, cost where prices are set), the right-sizing rules' "Could run on"
and energy per namespace. Filters: namespace and GPU model only."""

from __future__ import annotations

from grafana_dashboard import dashboard
from grafana_panels import Json, bargauge, base_panel, field_config, stat, table, target, timeseries

# The GPU-hour ledger's recording rules (alerts/gpu-occupancy-exporter.chargeback.yaml)
# and the chart's cost rule (chargeback.pricePerGpuHour).
HOURLY = "namespace_owner_state:gpu_allocated_gpu_seconds:increase1h"
DAILY = "namespace_owner_state:gpu_allocated_gpu_seconds:increase1d"
COST = "namespace_owner:gpu_cost:increase1d"
WASTE_STATES = 'state=~"idle|no_process|unhealthy"'
LEDGER_NS = 'namespace=~"$namespace"'
MODEL = 'model=~"$model"'
GPU_HOURS = "suffix: GPU-h"
OWNER_LEGEND = "{{namespace}} {{owner_kind}}/{{owner_name}}"
NO_PRICES = "No prices set (chart value chargeback.pricePerGpuHour)"


def _no_value(panel: Json, text: str) -> Json:
    """What the panel says instead of "No data" when its query has no series."""
    panel["fieldConfig"]["defaults"]["noValue"] = text
    return panel


WEEKLY = "namespace_owner_state:gpu_allocated_gpu_seconds:increase7d"
MONTHLY = "namespace_owner_state:gpu_allocated_gpu_seconds:increase30d"
OWNER = "namespace, owner_kind, owner_name"
# Idle time by likely cause (docs/why-idle.md); raw series, no recording rule.
IDLE_BY_CAUSE = "gpu_container_idle_gpu_seconds_total"


def held_and_wasted(title: str, description: str, rule: str) -> Json:
    """GPU-hours held and wasted per owner over one of the ledger's periods: one row per
    owner, the two instant queries merged on their labels."""
    only = f"{{{LEDGER_NS}}}"
    wasted = f"{{{WASTE_STATES}, {LEDGER_NS}}}"
    targets = [
        target(f"sum by ({OWNER}) ({rule}{only}) / 3600", instant=True, table=True),
        target(f"sum by ({OWNER}) ({rule}{wasted}) / 3600", instant=True, table=True),
    ]
    panel = base_panel(
        "table",
        title,
        description,
        targets,
        field_config(GPU_HOURS),
        {
            "showHeader": True,
            "cellHeight": "sm",
            "footer": {"show": True, "reducer": ["sum"], "fields": ""},
            "sortBy": [{"displayName": "held GPU-hours", "desc": True}],
        },
        12,
        8,
    )
    rename = {"Value #A": "held GPU-hours", "Value #B": "wasted GPU-hours"}
    panel["transformations"] = [
        {"id": "merge", "options": {}},
        {
            "id": "organize",
            "options": {"excludeByName": {"Time": True}, "indexByName": {}, "renameByName": rename},
        },
    ]
    return panel


def idle_by_cause_per_owner() -> Json:
    """Idle GPU-hours in the dashboard's range per owner and likely cause. The owner join
    is the chargeback rules' (one owner per pod, the last one seen in the range; pods
    without an owner series are kept with an empty owner)."""
    idle = f"increase({IDLE_BY_CAUSE}{{{LEDGER_NS}}}[$__range])"
    owner = (
        "topk by (namespace, pod) (1, max by (namespace, pod, owner_kind, owner_name) "
        f"(last_over_time(gpu_pod_owner_info{{{LEDGER_NS}}}[$__range])))"
    )
    expr = (
        f"sum by ({OWNER}, cause) ("
        f"{idle} * on (namespace, pod) group_left (owner_kind, owner_name) {owner} "
        f"or {idle} unless on (namespace, pod) "
        f"last_over_time(gpu_pod_owner_info{{{LEDGER_NS}}}[$__range])"
        ") / 3600"
    )
    panel = table(
        "Why idle: idle GPU-hours by owner and cause (time range)",
        "The ledger's idle and no_process GPU-hours in the dashboard's range per owning "
        "workload and likely cause (gpu_container_idle_gpu_seconds_total, docs/why-idle.md): "
        "cpu_throttled (the container ran out of CPU quota), cpu_pressure, io_pressure "
        "(its tasks stalled waiting for CPU or block I/O), unknown (no CPU or I/O "
        "starvation seen, or no cgroup reading). A correlation, not a proof. Empty owner: "
        "pods without an owner series. Not filtered by GPU model.",
        expr,
        GPU_HOURS,
        w=14,
        rename={"Value": "idle GPU-hours"},
        sort_by="idle GPU-hours",
    )
    return panel


# The right-sizing recording rules (alerts/gpu-occupancy-exporter.rightsizing.yaml).
SUGGESTION = "namespace_owner_model:gpu_rightsizing_suggestion:info"
WORKLOAD = "on (namespace, owner_kind, owner_name, model)"


def could_run_on() -> Json:
    """One row per workload with a suggestion, and the evidence beside it: the 7-day p95s
    it rests on and how much of the week they cover (a table of merged instant queries)."""
    only = f"{{{LEDGER_NS}, {MODEL}}}"
    suggested = f"{SUGGESTION}{only}"
    evidence = [
        ("p95 memory", "namespace_owner_model:gpu_memory_used_bytes:p95_7d", "bytes"),
        ("p95 SM active", "namespace_owner_model:gpu_sm_active_ratio:p95_7d", "percentunit"),
        ("observed", "namespace_owner_model:gpu_rightsizing_observed_seconds:count7d", "s"),
    ]
    targets = [target(suggested, instant=True, table=True)] + [
        target(f"{name}{only} and {WORKLOAD} {suggested}", instant=True, table=True)
        for _, name, _ in evidence
    ]
    panel = base_panel(
        "table",
        "Could run on",
        "Workloads (owner and GPU model) holding whole GPUs that the smallest MIG profile of "
        "their model would hold with 20 % headroom over their 7-day p95 of GPU memory and of "
        "SM activity, or that could share a GPU by time-slicing (at most a quarter of its SMs "
        "and half its memory). Evidence beside each: the p95s and the time of the last 7 days "
        "they rest on. Workloads that need a whole GPU, or whose SM activity is unknown "
        "(no GPM), are not listed. Rules: alerts/gpu-occupancy-exporter.rightsizing.yaml.",
        targets,
        field_config("none"),
        {
            "showHeader": True,
            "cellHeight": "sm",
            "footer": {"show": False, "reducer": ["sum"], "fields": ""},
            "sortBy": [{"displayName": "p95 memory", "desc": True}],
        },
        24,
        8,
    )
    panel["fieldConfig"]["overrides"] = [
        {"matcher": {"id": "byName", "options": title}, "properties": [{"id": "unit", "value": u}]}
        for title, _, u in evidence
    ]
    hidden = {"Time": True, "__name__": True, "job": True, "Value #A": True}
    rename = {f"Value #{ref}": title for ref, (title, _, _) in zip("BCD", evidence, strict=True)}
    panel["transformations"] = [
        {"id": "merge", "options": {}},
        {
            "id": "organize",
            "options": {"excludeByName": hidden, "indexByName": {}, "renameByName": rename},
        },
    ]
    return panel


# The capacity rules (alerts/gpu-occupancy-exporter.capacity.yaml, docs/capacity.md): one
# series per GPU model and resource (and state or reason), no node, instance or job.
CAPACITY_STATES = "model_resource_state:gpu_node_devices:sum"
DISRUPTED_BY_REASON = "model_resource_reason:gpu_node_disrupted_devices:sum"
HEADROOM = "model_resource:gpu_devices_free_after_node_loss:min"
NODE_LOSS = "model_resource:gpu_node_loss_devices:max"
NODES_COUNTED = "model_resource:gpu_nodes_counted:count"
NODES_LEFT_OUT = "model_resource:gpu_nodes_left_out:count"
STATE_COLUMNS = ("healthy", "allocated", "disrupted", "allocatable")
MODEL_RESOURCE_LEGEND = "{{model}} {{resource}}"
DEVICE_UNITS = (
    "One device of the resource as the scheduler counts it (a whole GPU, a replica, a MIG "
    "instance): never add resources up."
)


def model_resource_table(
    title: str, description: str, columns: list[tuple[str, str]], sort_by: str
) -> Json:
    """One row per GPU model and resource, one column per (title, series) instant query.
    Each query is summed `by (model, resource)` (one series each already), which drops
    `__name__` and the state, so that Grafana's merge joins the columns on model and
    resource. A state or figure the rules do not have is an empty cell, never 0."""
    targets = [
        target(f"sum by (model, resource) ({series})", instant=True, table=True)
        for _, series in columns
    ]
    panel = base_panel(
        "table",
        title,
        description,
        targets,
        field_config("short"),
        {
            "showHeader": True,
            "cellHeight": "sm",
            "footer": {"show": False, "reducer": ["sum"], "fields": ""},
            "sortBy": [{"displayName": sort_by, "desc": False}],
        },
        12,
        8,
    )
    rename = {f"Value #{ref}": name for ref, (name, _) in zip("ABCDEFGH", columns, strict=False)}
    panel["transformations"] = [
        {"id": "merge", "options": {}},
        {
            "id": "organize",
            "options": {"excludeByName": {"Time": True}, "indexByName": {}, "renameByName": rename},
        },
    ]
    return panel


def _cell_colours(column: str, steps: list[tuple[float | None, str]]) -> Json:
    """A table column whose cell background takes the colour of its threshold step."""
    return {
        "matcher": {"id": "byName", "options": column},
        "properties": [
            {"id": "color", "value": {"mode": "thresholds"}},
            {
                "id": "thresholds",
                "value": {
                    "mode": "absolute",
                    "steps": [{"color": c, "value": v} for v, c in steps],
                },
            },
            {"id": "custom.cellOptions", "value": {"type": "color-background", "mode": "basic"}},
        ],
    }


HEADROOM_STEPS: list[tuple[float | None, str]] = [(None, "red"), (0, "green")]


def capacity_states() -> Json:
    return model_resource_table(
        "Devices per model and resource by state",
        "Cluster-wide devices per GPU model and resource now "
        f"({CAPACITY_STATES}): healthy, allocated (pods hold them), disrupted (healthy and "
        "free but no new pod can get them: node cordoned, a NoSchedule/NoExecute node taint, "
        "a GPU Operator driver upgrade, a DRA device taint) and allocatable (healthy - "
        "allocated healthy - disrupted). A node adds to a state only while it serves it, so "
        "the columns add up only where no node is left out (see the headroom table); an "
        "empty cell: no node tells that state, which is unknown, not 0. Empty model: nodes "
        f"with several models or no gpu_info. {DEVICE_UNITS} Not filtered by namespace.",
        [(state, f'{CAPACITY_STATES}{{{MODEL}, state="{state}"}}') for state in STATE_COLUMNS],
        "model",
    )


def disrupted_by_reason() -> Json:
    return timeseries(
        "Disrupted devices by reason",
        "Healthy free devices no new pod can get, per GPU model, resource and reason "
        f"({DISRUPTED_BY_REASON}): cordoned, node_taint, driver_upgrade, device_taint "
        "(docs/capacity.md). A device blocked for two reasons counts under each, so the "
        "lines are not stacked and need not add up to the disrupted state. 0: nothing "
        "disrupted for that reason; no line: unknown (no node tells it, e.g. the Node "
        "watch is down). Not filtered by namespace.",
        [
            target(
                f"{DISRUPTED_BY_REASON}{{{MODEL}}}",
                MODEL_RESOURCE_LEGEND + " {{reason}}",
            )
        ],
        "short",
    )


def failure_headroom() -> Json:
    panel = model_resource_table(
        "Failure headroom per model and resource",
        "Devices still free after losing the node whose loss hurts most, once its work is "
        f'placed again ({HEADROOM}; docs/capacity.md, "Failure headroom"): Σ allocatable '
        "- the largest node loss (one node's allocatable + allocated, "
        f"{NODE_LOSS}), over the counted nodes. Red below 0: that many devices of work would "
        "find no place (alert GPUClusterFailureHeadroomExhausted after 30 minutes). A "
        "model with one counted node reads -allocated. Nodes left out (allocatable, "
        "allocated or disrupted unknown) are in neither term: with any left out the "
        "figure is the counted nodes' alone, not a bound on the cluster's. One node lost, "
        f"devices not pod shapes. {DEVICE_UNITS} Not filtered by namespace.",
        [
            ("headroom", f"{HEADROOM}{{{MODEL}}}"),
            ("largest node loss", f"{NODE_LOSS}{{{MODEL}}}"),
            ("nodes counted", f"{NODES_COUNTED}{{{MODEL}}}"),
            ("nodes left out", f"{NODES_LEFT_OUT}{{{MODEL}}}"),
        ],
        "headroom",
    )
    panel["fieldConfig"]["overrides"] = [
        _cell_colours("headroom", HEADROOM_STEPS),
        _cell_colours("nodes left out", [(None, "transparent"), (1, "orange")]),
    ]
    return panel


def failure_headroom_over_time() -> Json:
    panel = timeseries(
        "Failure headroom over time",
        f"{HEADROOM} per GPU model and resource; the area below 0 is red: losing the node "
        "whose loss hurts most would leave work with no free device. A gap: no node of "
        "the model counted for the resource then.",
        [target(f"{HEADROOM}{{{MODEL}}}", MODEL_RESOURCE_LEGEND)],
        "short",
    )
    defaults = panel["fieldConfig"]["defaults"]
    defaults["thresholds"]["steps"] = [
        {"color": color, "value": value} for value, color in [(None, "red"), (0, "transparent")]
    ]
    defaults["custom"]["thresholdsStyle"] = {"mode": "line+area"}
    return panel


def waste() -> Json:
    """Fleet level, from the chargeback recording rules: no node, instance or GPU filter
    (the rules keep none of those labels), only namespace and GPU model."""
    wasted_1d = f"{DAILY}{{{WASTE_STATES}, {LEDGER_NS}}}"
    return dashboard(
        "gpu-occupancy-waste",
        "GPU / Waste and chargeback",
        "Fleet-level GPU-hour ledger: who held GPUs, how much of it did no work and why, "
        "idle and free capacity per GPU model, and cost where prices are set.",
        ["ledger_namespace", "model"],
        [
            (
                "Summary",
                [
                    stat(
                        "Wasted, last hour",
                        "Share of the GPU-hours held in the last hour that were idle, had no "
                        "process or sat on an unhealthy GPU (unknown time counts in the total "
                        "only).",
                        f"sum({HOURLY}{{{WASTE_STATES}, {LEDGER_NS}}}) / "
                        f"sum({HOURLY}{{{LEDGER_NS}}})",
                        "percentunit",
                        thresholds=[(None, "green"), (0.2, "orange"), (0.5, "red")],
                    ),
                    stat(
                        "GPU-hours held, last day",
                        "GPU-equivalent hours (a MIG instance counts its slices, a shared "
                        "replica 1/replicas), every state.",
                        f"sum({DAILY}{{{LEDGER_NS}}}) / 3600",
                        GPU_HOURS,
                    ),
                    stat(
                        "GPU-hours wasted, last day",
                        "idle + no_process + unhealthy.",
                        f"sum({wasted_1d}) / 3600",
                        GPU_HOURS,
                        thresholds=[(None, "orange")],
                    ),
                    stat(
                        "Idle allocated GPUs",
                        "Allocated GPU-equivalents doing nothing now (5-minute average).",
                        f"sum(model:gpu_idle_allocated_gpus:avg5m{{{MODEL}}})",
                        "short",
                        thresholds=[(None, "green"), (1, "orange")],
                    ),
                    stat(
                        "Free devices",
                        "Devices a new pod can surely get now, every resource (whole GPUs, "
                        "replicas and MIG devices alike: see the per-model panel).",
                        f"sum(model:gpu_free_devices:sum{{{MODEL}}})",
                        "short",
                    ),
                    _no_value(
                        stat(
                            "Cost, last day",
                            "GPU-hours held times the model's price (chargeback.pricePerGpuHour).",
                            f"sum({COST}{{{LEDGER_NS}}})",
                            "none",
                        ),
                        "no prices set",
                    ),
                ],
            ),
            (
                "Who wastes",
                [
                    table(
                        "Top wasters by owner, last day",
                        "GPU-hours idle, without a process or on an unhealthy GPU, per "
                        "namespace and owning workload (gpu_pod_owner_info; empty owner: "
                        "pods without an owner series).",
                        f"topk(20, sum by (namespace, owner_kind, owner_name) ({wasted_1d}) "
                        "/ 3600)",
                        GPU_HOURS,
                        w=14,
                        rename={"Value": "wasted GPU-hours"},
                        sort_by="wasted GPU-hours",
                    ),
                    bargauge(
                        "Waste ratio by namespace, last hour",
                        "namespace:gpu_waste_ratio:ratio1h.",
                        f"namespace:gpu_waste_ratio:ratio1h{{{LEDGER_NS}}}",
                        "{{namespace}}",
                        "percentunit",
                        w=10,
                        maximum=1,
                    ),
                ],
            ),
            (
                "Waste by state over time",
                [
                    timeseries(
                        "GPUs held by state",
                        "GPU-equivalents held in each ledger state, averaged over the hour "
                        "before each point (busy, idle, no_process, unhealthy, unknown).",
                        [target(f"sum by (state) ({HOURLY}{{{LEDGER_NS}}}) / 3600", "{{state}}")],
                        "short",
                        stacked=True,
                    ),
                    timeseries(
                        "Waste ratio by namespace",
                        "Share of the last hour's GPU-hours wasted, per namespace.",
                        [
                            target(
                                f"namespace:gpu_waste_ratio:ratio1h{{{LEDGER_NS}}}", "{{namespace}}"
                            )
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "Wasted GPUs by owner",
                        "GPU-equivalents wasted per owner, averaged over the hour before each "
                        "point; the 10 largest now.",
                        [
                            target(
                                f"topk(10, sum by (namespace, owner_kind, owner_name) "
                                f"({HOURLY}{{{WASTE_STATES}, {LEDGER_NS}}}) / 3600)",
                                OWNER_LEGEND,
                            )
                        ],
                        "short",
                        w=24,
                        stacked=True,
                    ),
                ],
            ),
            (
                "Why idle",
                [
                    idle_by_cause_per_owner(),
                    timeseries(
                        "Idle GPUs by cause",
                        "GPU-equivalents allocated and idle or without a process, by likely "
                        "cause (docs/why-idle.md), averaged over each interval.",
                        [
                            target(
                                f"sum by (cause) (rate({IDLE_BY_CAUSE}{{{LEDGER_NS}}}"
                                "[$__rate_interval]))",
                                "{{cause}}",
                            )
                        ],
                        "short",
                        w=10,
                        stacked=True,
                    ),
                ],
            ),
            (
                "GPU-hours per week and month",
                [
                    held_and_wasted(
                        "GPU-hours by owner, last 7 days",
                        "GPU-hours each owner held in the last 7 days (every state), and how "
                        "many of them were wasted (idle, no_process, unhealthy): "
                        f"{WEEKLY}, the daily ledger of each of the 7 days added up "
                        "(exact: docs/dashboards.md). The footer adds the rows up.",
                        WEEKLY,
                    ),
                    held_and_wasted(
                        "GPU-hours by owner, last 30 days",
                        f"The same over 30 days ({MONTHLY}). Needs 31 days of Prometheus "
                        "retention: days older than the data are missing from the sum.",
                        MONTHLY,
                    ),
                ],
            ),
            (
                "Capacity per GPU model",
                [
                    timeseries(
                        "Idle allocated GPUs per model",
                        "GPU-equivalents allocated but idle or without a process "
                        "(model:gpu_idle_allocated_gpus:avg5m).",
                        [target(f"model:gpu_idle_allocated_gpus:avg5m{{{MODEL}}}", "{{model}}")],
                        "short",
                        w=8,
                        stacked=True,
                    ),
                    timeseries(
                        "Free devices per model",
                        "Allocatable devices per model and resource (model:gpu_free_devices:sum; "
                        "empty model: nodes with several models).",
                        [
                            target(
                                f"model:gpu_free_devices:sum{{{MODEL}}}",
                                "{{model}} {{resource}}",
                            )
                        ],
                        "short",
                        w=8,
                    ),
                    timeseries(
                        "Waste ratio per model",
                        "model:gpu_waste_ratio:ratio1h (empty model: GPUs NVML does not list).",
                        [target(f"model:gpu_waste_ratio:ratio1h{{{MODEL}}}", "{{model}}")],
                        "percentunit",
                        w=8,
                        ratio=True,
                    ),
                ],
            ),
            (
                "Capacity and failure headroom",
                [
                    capacity_states(),
                    disrupted_by_reason(),
                    failure_headroom(),
                    failure_headroom_over_time(),
                ],
            ),
            (
                "Right-sizing",
                [_no_value(could_run_on(), "No workload that less than a whole GPU would hold")],
            ),
            (
                "Cost",
                [
                    _no_value(
                        table(
                            "Cost by namespace and owner, last day",
                            "namespace_owner:gpu_cost:increase1d: GPU-hours held (every state) "
                            "times the price of their model. Rendered by the Helm chart only "
                            "with chargeback.pricePerGpuHour; models without a price are left "
                            "out.",
                            f"{COST}{{{LEDGER_NS}}}",
                            "none",
                            rename={"Value": "cost"},
                            sort_by="cost",
                        ),
                        NO_PRICES,
                    ),
                    _no_value(
                        timeseries(
                            "Cost by namespace",
                            "The last day's cost at each point.",
                            [
                                target(
                                    f"sum by (namespace) ({COST}{{{LEDGER_NS}}})", "{{namespace}}"
                                )
                            ],
                            "none",
                            stacked=True,
                        ),
                        NO_PRICES,
                    ),
                ],
            ),
            (
                "Energy",
                [
                    timeseries(
                        "Power per namespace",
                        "Energy per container (an estimate: the GPU's energy split by share "
                        "of SM time; docs/metrics.md) per second, summed per namespace.",
                        [
                            target(
                                f"sum by (namespace) (rate(gpu_container_energy_joules_total"
                                f"{{{LEDGER_NS}}}[$__rate_interval]))",
                                "{{namespace}}",
                            )
                        ],
                        "watt",
                        stacked=True,
                    ),
                    table(
                        "Energy per namespace over the time range",
                        "kWh per namespace in the dashboard's time range (estimate).",
                        f"sum by (namespace) (increase(gpu_container_energy_joules_total"
                        f"{{{LEDGER_NS}}}[$__range])) / 3600000",
                        "kwatth",
                        rename={"Value": "energy"},
                        sort_by="energy",
                    ),
                ],
            ),
        ],
        alert_filter=LEDGER_NS,
    )
