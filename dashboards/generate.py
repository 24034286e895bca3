#!/usr/bin/env python3
"""Generate the Grafana dashboards in this folder from one description.

Generated rather than hand-kept so that every panel gets the same datasource variable,
label filters, units and layout, and a change to a selector changes it everywhere.
Edit this file, then run ``python dashboards/generate.py``; ``--check`` exits 1 when the
committed JSON differs (tests/test_dashboards.py does the same comparison).

Conventions: every panel and query uses the ``${datasource}`` variable (no datasource
UIDs); filters are regexes so "All" (``.*``) also matches series without the label, which
keeps the dashboards working where Prometheus adds no ``node`` label (the Helm chart's
ServiceMonitor relabels ``__meta_kubernetes_pod_node_name`` to ``node``; without it, pick
the exporter by ``instance``). Whole-GPU series are selected with ``gpu_instance=""``;
MIG instances with ``gpu_instance!=""`` (docs/metrics.md).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SCHEMA_VERSION = 39
TAG = "gpu-occupancy-exporter"
EXPORTER_JOB = ".*gpu-occupancy-exporter.*"  # the chart's Service name, with any release prefix
# The exporter's targets, as the rule files select them: the Helm chart replaces this exact
# text with its prometheusRule.jobSelector in the dashboards as in the rules.
EXPORTER_SELECTOR = f'job=~"{EXPORTER_JOB}"'
DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}

# Label filters, by the labels a series carries.
NODE = 'job=~"$job", node=~"$node", instance=~"$instance"'
GPU = f'{NODE}, uuid=~"$gpu"'
NS = f'{NODE}, namespace=~"$namespace"'
POD = f'{GPU}, namespace=~"$namespace", pod=~"$pod"'
WHOLE = 'gpu_instance=""'
MIG = 'gpu_instance!=""'
SHARED_DEVICE = 'device_id=~".+::.+"'  # time-sliced replica IDs: GPU-…::N
CONTAINER_KEYS = "instance, namespace, pod, container, uuid"

GPU_LEGEND = "{{node}} GPU {{gpu}}"
POD_LEGEND = "{{namespace}}/{{pod}}/{{container}} · GPU {{gpu}}"

Json = dict[str, Any]


# --- template variables --------------------------------------------------------------


def datasource_variable() -> Json:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
    }


def query_variable(name: str, label: str, query: str, description: str) -> Json:
    """Multi-select with an "All" that means ``.*`` (matches a missing label too)."""
    return {
        "name": name,
        "label": label,
        "description": description,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": query,
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
        "skipUrlSync": False,
    }


CONTAINER_SERIES = (
    '{__name__=~"gpu_container_allocated|gpu_container_memory_used_bytes'
    '|gpu_unallocated_use_memory_bytes", ' + NODE
)
VARIABLES: dict[str, Json] = {
    "job": query_variable(
        "job",
        "Job",
        f"label_values(up{{{EXPORTER_SELECTOR}}}, job)",
        "Prometheus job of the exporter's targets: the jobs matching the Helm chart's "
        "prometheusRule.jobSelector. All also matches series without a job label.",
    ),
    "node": query_variable(
        "node",
        "Node",
        'label_values(gpu_info{job=~"$job"}, node)',
        "Kubernetes node (the `node` label the Helm chart's ServiceMonitor adds). Empty "
        "without that relabelling: use Instance.",
    ),
    "instance": query_variable(
        "instance",
        "Instance",
        'label_values(gpu_info{node=~"$node"}, instance)',
        "Exporter scrape target (pod IP:port).",
    ),
    "gpu": query_variable(
        "gpu",
        "GPU (UUID)",
        f"label_values(gpu_info{{{NODE}}}, uuid)",
        "Physical GPU; MIG instances belong to their GPU's UUID.",
    ),
    "namespace": query_variable(
        "namespace",
        "Namespace",
        f"label_values({CONTAINER_SERIES}}}, namespace)",
        "Namespaces with GPU allocations or GPU memory on the selected nodes.",
    ),
    "pod": query_variable(
        "pod",
        "Pod",
        f'label_values({CONTAINER_SERIES}, namespace=~"$namespace"}}, pod)',
        "Pods with GPU allocations or GPU memory.",
    ),
    # the fleet board (GPU / Waste): its recording rules keep no node, instance or GPU
    "ledger_namespace": query_variable(
        "namespace",
        "Namespace",
        "label_values(namespace_owner_state:gpu_allocated_gpu_seconds:increase1h, namespace)",
        "Namespaces that held GPUs in the last hour (the GPU-hour ledger's recording rules).",
    ),
    "model": query_variable(
        "model",
        "GPU model",
        "label_values(gpu_info, model)",
        "GPU model as NVML names it (gpu_info's `model`).",
    ),
}


# --- panels --------------------------------------------------------------------------


def target(
    expr: str, legend: str = "__auto", *, instant: bool = False, table: bool = False
) -> Json:
    return {
        "datasource": DS,
        "expr": expr,
        "legendFormat": legend,
        "range": not instant,
        "instant": instant,
        "format": "table" if table else "time_series",
    }


def _field_config(
    unit: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    thresholds: list[tuple[float | None, str]] | None = None,
    mappings: list[Json] | None = None,
    custom: Json | None = None,
) -> Json:
    steps = [{"color": color, "value": value} for value, color in (thresholds or [(None, "green")])]
    defaults: Json = {
        "unit": unit,
        "color": {"mode": "thresholds" if thresholds else "palette-classic"},
        "thresholds": {"mode": "absolute", "steps": steps},
        "mappings": mappings or [],
    }
    if minimum is not None:
        defaults["min"] = minimum
    if maximum is not None:
        defaults["max"] = maximum
    if custom:
        defaults["custom"] = custom
    return {"defaults": defaults, "overrides": []}


def _panel(
    kind: str,
    title: str,
    description: str,
    targets: list[Json],
    field_config: Json,
    options: Json,
    w: int,
    h: int,
) -> Json:
    for ref, t in zip("ABCDEFGH", targets, strict=False):
        t["refId"] = ref
    return {
        "type": kind,
        "title": title,
        "description": description,
        "datasource": DS,
        "targets": targets,
        "fieldConfig": field_config,
        "options": options,
        "gridPos": {"w": w, "h": h},
    }


LEGEND_TABLE = {
    "displayMode": "table",
    "placement": "bottom",
    "showLegend": True,
    "calcs": ["mean", "max", "lastNotNull"],
}
TOOLTIP = {"mode": "multi", "sort": "desc"}
REDUCE_LAST = {"calcs": ["lastNotNull"], "fields": "", "values": False}


def timeseries(
    title: str,
    description: str,
    targets: list[Json],
    unit: str,
    *,
    w: int = 12,
    h: int = 8,
    ratio: bool = False,
    stacked: bool = False,
    bars: bool = False,
) -> Json:
    custom = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 20 if stacked or bars else 5,
        "showPoints": "never",
        "spanNulls": False,
        "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
    }
    fc = _field_config(
        unit,
        minimum=0 if ratio or stacked or bars else None,
        maximum=1 if ratio else None,
        custom=custom,
    )
    return _panel(
        "timeseries",
        title,
        description,
        targets,
        fc,
        {"legend": LEGEND_TABLE, "tooltip": TOOLTIP},
        w,
        h,
    )


def stat(
    title: str,
    description: str,
    expr: str,
    unit: str,
    *,
    w: int = 4,
    h: int = 4,
    thresholds: list[tuple[float | None, str]] | None = None,
) -> Json:
    fc = _field_config(unit, thresholds=thresholds or [(None, "blue")])
    options = {
        "reduceOptions": REDUCE_LAST,
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "textMode": "auto",
    }
    return _panel("stat", title, description, [target(expr)], fc, options, w, h)


def bargauge(
    title: str,
    description: str,
    expr: str,
    legend: str,
    unit: str,
    *,
    w: int = 12,
    h: int = 8,
    maximum: float | None = None,
) -> Json:
    fc = _field_config(
        unit,
        minimum=0,
        maximum=maximum,
        thresholds=[(None, "green"), (0.8 * maximum, "orange"), (0.95 * maximum, "red")]
        if maximum
        else None,
    )
    if maximum is None:
        fc["defaults"]["color"] = {"mode": "continuous-BlPu"}
    options = {
        "displayMode": "gradient",
        "orientation": "horizontal",
        "reduceOptions": REDUCE_LAST,
        "showUnfilled": True,
        "valueMode": "color",
        "namePlacement": "auto",
        "sizing": "auto",
        "minVizHeight": 16,
        "minVizWidth": 8,
        "maxVizHeight": 300,
    }
    return _panel(
        "bargauge", title, description, [target(expr, legend, instant=True)], fc, options, w, h
    )


def table(
    title: str,
    description: str,
    expr: str,
    unit: str,
    *,
    w: int = 12,
    h: int = 8,
    hide_value: bool = False,
    rename: dict[str, str] | None = None,
    sort_by: str = "Value",
) -> Json:
    hidden = {"Time": True, "__name__": True, "job": True}
    if hide_value:
        hidden["Value"] = True
    panel = _panel(
        "table",
        title,
        description,
        [target(expr, instant=True, table=True)],
        _field_config(unit),
        {
            "showHeader": True,
            "cellHeight": "sm",
            "footer": {"show": False, "reducer": ["sum"], "fields": ""},
            "sortBy": [] if hide_value else [{"displayName": sort_by, "desc": True}],
        },
        w,
        h,
    )
    panel["transformations"] = [
        {
            "id": "organize",
            "options": {"excludeByName": hidden, "indexByName": {}, "renameByName": rename or {}},
        }
    ]
    return panel


def state_timeline(
    title: str,
    description: str,
    targets: list[Json],
    unit: str,
    mappings: dict[str, tuple[str, str]],
    *,
    w: int = 12,
    h: int = 8,
) -> Json:
    """``mappings``: value -> (text, colour)."""
    fc = _field_config(
        unit,
        mappings=[
            {
                "type": "value",
                "options": {
                    value: {"text": text, "color": color, "index": i}
                    for i, (value, (text, color)) in enumerate(mappings.items())
                },
            }
        ],
        custom={"fillOpacity": 80, "lineWidth": 0},
    )
    options = {
        "mergeValues": True,
        "showValue": "never",
        "alignValue": "left",
        "rowHeight": 0.9,
        "legend": {"displayMode": "list", "placement": "bottom", "showLegend": False},
        "tooltip": TOOLTIP,
    }
    return _panel("state-timeline", title, description, targets, fc, options, w, h)


HEALTHY_MAP = {"1": ("healthy", "green"), "0": ("unhealthy", "red")}
UP_MAP = {"1": ("up", "green"), "0": ("down", "red")}
ACTIVE_MAP = {"1": ("active", "orange"), "0": ("clear", "transparent")}


# --- dashboards ----------------------------------------------------------------------


def layout(sections: Iterable[tuple[str, list[Json]]]) -> list[Json]:
    """Rows of panels, filled left to right; assigns ids and grid positions."""
    panels: list[Json] = []
    y = 0
    for title, row_panels in sections:
        panels.append(
            {
                "type": "row",
                "title": title,
                "collapsed": False,
                "panels": [],
                "datasource": DS,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
            }
        )
        y += 1
        x, line_h = 0, 0
        for p in row_panels:
            w, h = p["gridPos"]["w"], p["gridPos"]["h"]
            if x + w > 24:
                x, y, line_h = 0, y + line_h, 0
            p["gridPos"] = {"h": h, "w": w, "x": x, "y": y}
            x, line_h = x + w, max(line_h, h)
            panels.append(p)
        y += line_h
    for i, p in enumerate(panels, start=1):
        p["id"] = i
    return panels


NODE_ALERTS = 'node=~"$node", instance=~"$instance"'


def dashboard(
    uid: str,
    title: str,
    description: str,
    variables: list[str],
    sections: list[tuple[str, list[Json]]],
    *,
    alert_filter: str = NODE_ALERTS,
) -> Json:
    return {
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.4.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
        ],
        "annotations": {
            "list": [
                {
                    "name": "GPU alerts",
                    "datasource": DS,
                    "enable": True,
                    "hide": False,
                    "iconColor": "red",
                    "expr": f'ALERTS{{alertstate="firing", alertname=~"GPU.*", {alert_filter}}}',
                    "step": "60s",
                    "titleFormat": "{{alertname}}",
                    "textFormat": "{{node}}{{instance}} GPU {{gpu}} {{namespace}}/{{pod}}",
                    "useValueForTime": False,
                }
            ]
        },
        "description": description,
        "editable": True,
        "fiscalYearStartMonth": 0,
        "graphTooltip": 1,
        "id": None,
        "links": [
            {
                "title": "GPU dashboards",
                "type": "dashboards",
                "tags": [TAG],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
                "icon": "external link",
                "targetBlank": False,
                "tooltip": "",
                "url": "",
            }
        ],
        "panels": layout(sections),
        "refresh": "30s",
        "schemaVersion": SCHEMA_VERSION,
        "tags": [TAG, "gpu", "kubernetes"],
        "templating": {"list": [datasource_variable()] + [VARIABLES[v] for v in variables]},
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "timezone": "",
        "title": title,
        "uid": uid,
        "version": 1,
        "weekStart": "",
    }


def node_overview() -> Json:
    util = f"gpu_utilization_ratio{{{GPU}}}"
    sm = f"gpu_sm_active_ratio{{{GPU}, {WHOLE}}}"
    return dashboard(
        "gpu-occupancy-node-overview",
        "GPU / Node overview",
        "Per-node GPU view: GPU-Util next to true SM activity, memory, power, "
        "temperature, health and schedulable capacity.",
        ["job", "node", "instance", "gpu"],
        [
            (
                "Summary",
                [
                    stat(
                        "GPUs",
                        "GPUs the selected exporters see.",
                        f"count(gpu_info{{{GPU}}})",
                        "short",
                    ),
                    stat(
                        "Unhealthy GPUs",
                        "GPUs with an active `unhealthy` health reason.",
                        f"count(gpu_healthy{{{GPU}}} == 0) or vector(0)",
                        "short",
                        thresholds=[(None, "green"), (1, "red")],
                    ),
                    stat(
                        "GPU-Util (average)",
                        "NVML GPU-Util: share of time any kernel ran.",
                        f"avg({util})",
                        "percentunit",
                    ),
                    stat(
                        "SM active (average)",
                        "Share of SMs busy (GPM/DCGM): real work.",
                        f"avg({sm})",
                        "percentunit",
                    ),
                    stat(
                        "GPU memory used",
                        "Used / total over whole GPUs.",
                        f"sum(gpu_memory_used_bytes{{{GPU}, {WHOLE}}}) / "
                        f"sum(gpu_memory_total_bytes{{{GPU}, {WHOLE}}})",
                        "percentunit",
                        thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")],
                    ),
                    stat(
                        "Power draw",
                        "Total power of the selected GPUs.",
                        f"sum(gpu_power_watts{{{GPU}}})",
                        "watt",
                    ),
                ],
            ),
            (
                "GPU-Util vs SM activity (the 100 % utilisation lie)",
                [
                    timeseries(
                        "GPU-Util (NVML)",
                        "Share of the sample window in which any kernel was running. "
                        "One tiny kernel at a time reads 100 %.",
                        [target(util, GPU_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "SM active (GPM / DCGM)",
                        "Share of SMs busy: what the GPU actually did. Absent on GPUs "
                        "without GPM (before Hopper) unless DCGM provides it.",
                        [target(sm, GPU_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "GPU-Util minus SM active",
                        "How far GPU-Util overstates SM activity. Near 0: honest; near "
                        "1: busy-looking but idle SMs (alert "
                        "GPUUtilizationWithoutSMActivity).",
                        [target(f"gpu:gpu_utilization_minus_sm_active:ratio{{{GPU}}}", GPU_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "Node average: GPU-Util vs SM active",
                        "Averages over the node's GPUs (recording rules).",
                        [
                            target(
                                f"node:gpu_utilization_ratio:avg{{{NODE}}}", "{{node}} GPU-Util"
                            ),
                            target(f"node:gpu_sm_active_ratio:avg{{{NODE}}}", "{{node}} SM active"),
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "SM occupancy, tensor and DRAM activity",
                        "Resident warps vs maximum, tensor pipe activity and DRAM "
                        "bandwidth vs peak (GPM / DCGM).",
                        [
                            target(
                                f"gpu_sm_occupancy_ratio{{{GPU}, {WHOLE}}}",
                                GPU_LEGEND + " occupancy",
                            ),
                            target(
                                f"gpu_tensor_active_ratio{{{GPU}, {WHOLE}}}", GPU_LEGEND + " tensor"
                            ),
                            target(
                                f"gpu_dram_active_ratio{{{GPU}, {WHOLE}}}", GPU_LEGEND + " DRAM"
                            ),
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "MIG instances: SM active",
                        "SM activity per MIG instance (GPU-Util is not reported in MIG mode).",
                        [
                            target(
                                f"gpu_sm_active_ratio{{{GPU}, {MIG}}}",
                                GPU_LEGEND + " {{mig_profile}} GI {{gpu_instance}}",
                            )
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Memory",
                [
                    timeseries(
                        "Memory used",
                        "Excluding driver-reserved memory (NVML memory info v2).",
                        [target(f"gpu_memory_used_bytes{{{GPU}, {WHOLE}}}", GPU_LEGEND)],
                        "bytes",
                    ),
                    bargauge(
                        "Memory used / total",
                        "Now, per GPU.",
                        f"gpu_memory_used_bytes{{{GPU}, {WHOLE}}} / "
                        f"gpu_memory_total_bytes{{{GPU}, {WHOLE}}}",
                        GPU_LEGEND,
                        "percentunit",
                        maximum=1,
                    ),
                    timeseries(
                        "MIG instances: memory used",
                        "Per MIG instance.",
                        [
                            target(
                                f"gpu_memory_used_bytes{{{GPU}, {MIG}}}",
                                GPU_LEGEND + " {{mig_profile}} GI {{gpu_instance}}",
                            )
                        ],
                        "bytes",
                    ),
                    timeseries(
                        "Memory controller busy (NVML)",
                        "Share of the window in which device memory was read or written.",
                        [target(f"gpu_memory_utilization_ratio{{{GPU}}}", GPU_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Power, temperature, clocks",
                [
                    timeseries(
                        "Power draw and limit",
                        "Draw (solid) and enforced limit.",
                        [
                            target(f"gpu_power_watts{{{GPU}}}", GPU_LEGEND),
                            target(f"gpu_power_limit_watts{{{GPU}}}", GPU_LEGEND + " limit"),
                        ],
                        "watt",
                    ),
                    timeseries(
                        "Temperature",
                        "GPU die temperature, and device memory (HBM) temperature where the "
                        "GPU reports it.",
                        [
                            target(f"gpu_temperature_celsius{{{GPU}}}", GPU_LEGEND),
                            target(
                                f"gpu_memory_temperature_celsius{{{GPU}}}", GPU_LEGEND + " memory"
                            ),
                        ],
                        "celsius",
                    ),
                    timeseries(
                        "SM clock",
                        "Drops under load point at thermal or power slowdown.",
                        [target(f"gpu_sm_clock_hertz{{{GPU}}}", GPU_LEGEND)],
                        "hertz",
                    ),
                    state_timeline(
                        "Clock-event reasons holding clocks down",
                        "Throttle reasons other than idle and settings "
                        "(hw_* = slowdown: alert GPUThermalOrPowerSlowdown).",
                        [
                            target(
                                f'gpu_clock_event_active{{{GPU}, reason!~"gpu_idle|'
                                f'applications_clocks_setting|display_clock_setting"}}',
                                GPU_LEGEND + " {{reason}}",
                            )
                        ],
                        "bool_on_off",
                        ACTIVE_MAP,
                    ),
                ],
            ),
            (
                "Interconnect, video engines, time throttled",
                [
                    timeseries(
                        "PCIe throughput",
                        "Bytes per second over PCIe, from NVML's byte counters (drivers R555 "
                        "and newer).",
                        [
                            target(
                                f"rate(gpu_pcie_transmitted_bytes_total{{{GPU}}}"
                                "[$__rate_interval])",
                                GPU_LEGEND + " sent",
                            ),
                            target(
                                f"rate(gpu_pcie_received_bytes_total{{{GPU}}}[$__rate_interval])",
                                GPU_LEGEND + " received",
                            ),
                        ],
                        "Bps",
                    ),
                    timeseries(
                        "PCIe link against its best",
                        "Current link width and generation over the best this GPU can reach "
                        "in its slot (1 = full). Idle GPUs drop their generation to save "
                        "power; below 1 under load is a degraded link (alert "
                        "GPUPCIeLinkDegraded).",
                        [
                            target(
                                f"gpu_pcie_link_width{{{GPU}}} / gpu_pcie_link_max_width{{{GPU}}}",
                                GPU_LEGEND + " width",
                            ),
                            target(
                                f"gpu_pcie_link_generation{{{GPU}}} / "
                                f"gpu_pcie_link_max_generation{{{GPU}}}",
                                GPU_LEGEND + " generation",
                            ),
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "NVLink throughput",
                        "Data bytes per second over all of a GPU's NVLinks.",
                        [
                            target(
                                "sum by (node, instance, gpu, uuid) (rate("
                                f"gpu_nvlink_transmitted_bytes_total{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " sent",
                            ),
                            target(
                                "sum by (node, instance, gpu, uuid) (rate("
                                f"gpu_nvlink_received_bytes_total{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " received",
                            ),
                        ],
                        "Bps",
                    ),
                    timeseries(
                        "NVLink errors (links with new errors)",
                        "CRC, replay and recovery errors in the last 5 minutes, per link that "
                        "had any. A link that keeps logging them is marginal: reseat or "
                        "replace the board.",
                        [
                            target(
                                "sum by (node, instance, gpu, uuid, link, type) (increase("
                                f"gpu_nvlink_errors_total{{{GPU}}}[5m])) > 0",
                                GPU_LEGEND + " link {{link}} {{type}}",
                            )
                        ],
                        "short",
                    ),
                    timeseries(
                        "Share of time throttled, by reason",
                        "Share of each interval in which the reason held clocks down (NVML "
                        "violation time). Reasons overlap: thermal includes both thermal "
                        "slowdowns.",
                        [
                            target(
                                f'rate(gpu_clock_event_seconds_total{{{GPU}, reason!="low_'
                                'utilization"}[$__rate_interval]) > 0',
                                GPU_LEGEND + " {{reason}}",
                            )
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "Video encoder and decoder",
                        "NVENC / NVDEC busy time; video work does not show in GPU-Util.",
                        [
                            target(
                                f"gpu_encoder_utilization_ratio{{{GPU}}}", GPU_LEGEND + " NVENC"
                            ),
                            target(
                                f"gpu_decoder_utilization_ratio{{{GPU}}}", GPU_LEGEND + " NVDEC"
                            ),
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Health and node capacity",
                [
                    state_timeline(
                        "GPU health verdict",
                        "gpu_healthy per GPU (docs/health.md).",
                        [target(f"gpu_healthy{{{GPU}}}", GPU_LEGEND)],
                        "bool_yes_no",
                        HEALTHY_MAP,
                    ),
                    table(
                        "Active health reasons",
                        "Reasons behind unhealthy/degraded GPUs.",
                        f"gpu_health_reason{{{GPU}}} == 1",
                        "none",
                        hide_value=True,
                    ),
                    timeseries(
                        "Node devices by state",
                        "allocatable = healthy advertised - allocated (per extended resource); "
                        "unknown = advertised devices whose health no source can judge. A "
                        "state whose source (NVML, the kubelet) is down has no line meanwhile.",
                        [target(f"gpu_node_devices{{{NODE}}}", "{{node}} {{resource}} {{state}}")],
                        "short",
                    ),
                    bargauge(
                        "Devices by state now",
                        "Summed over the selected nodes; a node adds nothing to a state its "
                        "sources cannot tell now (see unknown).",
                        f"sum by (resource, state) (gpu_node_devices{{{NODE}}})",
                        "{{resource}} {{state}}",
                        "short",
                    ),
                ],
            ),
        ],
    )


def _exclusive(metric: str) -> str:
    return (
        f'{metric}{{{POD}, mig_uuid=""}} and on ({CONTAINER_KEYS}) '
        f'gpu_container_allocated{{{POD}, mig_uuid="", device_id!~".+::.+"}}'
    )


def _shared(metric: str) -> str:
    return (
        f"{metric}{{{POD}}} and on ({CONTAINER_KEYS}) "
        f"gpu_container_allocated{{{POD}, {SHARED_DEVICE}}}"
    )


def pods() -> Json:
    idle = f"gpu_container_idle_allocated_seconds_total{{{POD}}}"
    return dashboard(
        "gpu-occupancy-pods",
        "GPU / Pods",
        "Who uses the GPUs: per-namespace and per-pod memory and SM share on exclusive, "
        "time-sliced and MIG GPUs, idle allocations and isolation leaks.",
        ["job", "node", "instance", "gpu", "namespace", "pod"],
        [
            (
                "Namespaces",
                [
                    bargauge(
                        "GPU memory by namespace",
                        "Now (recording rule).",
                        f"sum by (namespace) "
                        f"(node_namespace:gpu_container_memory_used_bytes:sum{{{NS}}})",
                        "{{namespace}}",
                        "bytes",
                        w=8,
                    ),
                    bargauge(
                        "SM share by namespace",
                        "Sum of the containers' SM shares: 100 % = one GPU's SMs fully "
                        "busy. MIG instances are not included (no per-process samples).",
                        f"sum by (namespace) "
                        f"(node_namespace:gpu_container_sm_utilization_ratio:sum{{{NS}}})",
                        "{{namespace}}",
                        "percentunit",
                        w=8,
                    ),
                    bargauge(
                        "Idle allocated GPU time (dashboard range)",
                        "Device time reserved and left idle over the selected range "
                        "(1 hour = one idle GPU-hour).",
                        f"sum by (namespace) (increase({idle}[$__range]))",
                        "{{namespace}}",
                        "s",
                        w=8,
                    ),
                    timeseries(
                        "Allocated devices by namespace",
                        "Devices the kubelet allocated, by extended resource.",
                        [
                            target(
                                f"sum by (namespace, resource) "
                                f"(node_namespace:gpu_container_allocated:sum{{{NS}}})",
                                "{{namespace}} {{resource}}",
                            )
                        ],
                        "short",
                        stacked=True,
                    ),
                    timeseries(
                        "Idle allocated devices by namespace",
                        "Allocated devices idle (5-minute average, recording rule).",
                        [
                            target(
                                f"sum by (namespace) (node_namespace:"
                                f"gpu_container_idle_allocated_seconds:rate5m{{{NS}}})",
                                "{{namespace}}",
                            )
                        ],
                        "short",
                        stacked=True,
                    ),
                ],
            ),
            (
                "Exclusive GPUs (one container per GPU)",
                [
                    timeseries(
                        "Memory per container",
                        "Containers allocated a whole GPU.",
                        [target(_exclusive("gpu_container_memory_used_bytes"), POD_LEGEND)],
                        "bytes",
                    ),
                    timeseries(
                        "SM share per container",
                        "From NVML per-process samples (sum over the container's processes).",
                        [target(_exclusive("gpu_container_sm_utilization_ratio"), POD_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Time-sliced GPUs (shared, no isolation)",
                [
                    timeseries(
                        "Memory per container on shared GPUs",
                        "Containers allocated a time-sliced replica (GPU-…::N). "
                        "Nothing stops one from taking all the memory.",
                        [target(_shared("gpu_container_memory_used_bytes"), POD_LEGEND)],
                        "bytes",
                        stacked=True,
                    ),
                    timeseries(
                        "SM share per container on shared GPUs",
                        "Each container's share of the GPU's SM time.",
                        [target(_shared("gpu_container_sm_utilization_ratio"), POD_LEGEND)],
                        "percentunit",
                        stacked=True,
                    ),
                    bargauge(
                        "Pods on each GPU",
                        "Pods with memory on the GPU now.",
                        f"count by (node, gpu, uuid) (count by (node, gpu, uuid, namespace,"
                        f' pod) (gpu_container_memory_used_bytes{{{GPU}, mig_uuid=""}}))',
                        GPU_LEGEND,
                        "short",
                    ),
                    table(
                        "Who shares with whom",
                        "Containers on GPUs used by more than one container, with their memory.",
                        f'gpu_container_memory_used_bytes{{{POD}, mig_uuid=""}} and on '
                        f"(instance, uuid) (count by (instance, uuid) "
                        f'(gpu_container_memory_used_bytes{{{GPU}, mig_uuid=""}}) > 1)',
                        "bytes",
                        rename={"Value": "memory"},
                        sort_by="memory",
                    ),
                ],
            ),
            (
                "Shared GPUs: turns, headroom, promised limits",
                [
                    timeseries(
                        "SM time share by container",
                        "Each container's part of the SM time all containers used on a shared "
                        "GPU (sums to 100 % per GPU). Processes take turns: one pod far above "
                        "its equal share while others wait is a hog (alert GPUTimeSliceHog). "
                        "Under MPS the share is of concurrent SM time (docs/shared-gpus.md).",
                        [target(f"gpu_container_sm_time_share_ratio{{{POD}}}", POD_LEGEND)],
                        "percentunit",
                        stacked=True,
                    ),
                    timeseries(
                        "Containers that wanted each shared GPU",
                        "Containers with SM time in the sample window (they took turns) and "
                        "all containers with a process on the GPU.",
                        [
                            target(
                                f"gpu_shared_active_containers{{{GPU}}}", "active " + GPU_LEGEND
                            ),
                            target(f"gpu_shared_containers{{{GPU}}}", "present " + GPU_LEGEND),
                        ],
                        "short",
                    ),
                    timeseries(
                        "Deviation from an equal share",
                        "Share minus 1 / active containers: +65 % is a pod that took 90 % of "
                        "the turns while three others waited.",
                        [
                            target(
                                f"gpu_container_sm_fair_share_deviation_ratio{{{POD}}}",
                                POD_LEGEND,
                            )
                        ],
                        "percentunit",
                    ),
                    timeseries(
                        "Memory headroom vs largest recent growth",
                        "What the next allocation can get (total - used - reserved) and the "
                        "largest growth of one container in the last 5 minutes: once the "
                        "headroom is below it, the next such growth fails (alert "
                        "GPUSharedMemoryNearFull). Nothing isolates the tenants' memory.",
                        [
                            target(
                                f"gpu_shared_memory_headroom_bytes{{{GPU}}}",
                                "headroom " + GPU_LEGEND,
                            ),
                            target(
                                f"max by (node, instance, gpu, uuid) "
                                f"(gpu_container_memory_growth_bytes{{{GPU}}})",
                                "largest growth " + GPU_LEGEND,
                            ),
                        ],
                        "bytes",
                    ),
                    table(
                        "Who grew (last 5 minutes)",
                        "Containers on shared GPUs whose memory rose above its lowest point "
                        "in the last 5 minutes.",
                        f"topk(10, gpu_container_memory_growth_bytes{{{POD}}} > 0)",
                        "bytes",
                        rename={"Value": "growth"},
                        sort_by="growth",
                    ),
                    table(
                        "Used vs promised (HAMi limits)",
                        "Memory used as a share of the memory HAMi promised the container "
                        "(nvidia.com/gpumem): above 100 % it is over its promise. HAMi-core "
                        "enforces the limit in user space, the driver does not.",
                        f"gpu_container_memory_used_bytes{{{POD}}} / on ({CONTAINER_KEYS}) "
                        f"gpu_container_memory_limit_bytes{{{POD}}}",
                        "percentunit",
                        rename={"Value": "of promise"},
                        sort_by="of promise",
                    ),
                ],
            ),
            (
                "MIG instances (hardware partitions)",
                [
                    timeseries(
                        "Memory per container on MIG instances",
                        "Per MIG instance.",
                        [
                            target(
                                f'gpu_container_memory_used_bytes{{{POD}, mig_uuid!=""}}',
                                POD_LEGEND + " {{mig_profile}}",
                            )
                        ],
                        "bytes",
                    ),
                    timeseries(
                        "SM active of each pod's MIG instance",
                        "The instance's SM activity (GPM), named after the pod it is allocated to.",
                        [
                            target(
                                f"gpu_sm_active_ratio{{{GPU}, {MIG}}} * on (instance, "
                                f"mig_uuid) group_left (namespace, pod, container) max by "
                                f"(instance, mig_uuid, namespace, pod, container) "
                                f'(gpu_container_allocated{{{POD}, mig_uuid!=""}})',
                                POD_LEGEND + " {{mig_profile}}",
                            )
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Idle allocations",
                [
                    table(
                        "Idle share of allocated devices (last hour)",
                        "Share of the last hour each allocated device stayed below the idle "
                        "threshold (alert GPUAllocatedButIdle above 90 % for an hour).",
                        f"rate({idle}[1h])",
                        "percentunit",
                        rename={"Value": "idle share"},
                        sort_by="idle share",
                    ),
                    timeseries(
                        "Allocated devices idle now",
                        "Per pod.",
                        [
                            target(
                                f"sum by (namespace, pod) (gpu_container_allocated_idle{{{POD}}})",
                                "{{namespace}}/{{pod}}",
                            )
                        ],
                        "short",
                        stacked=True,
                    ),
                ],
            ),
            (
                "Isolation leaks",
                [
                    stat(
                        "Containers using GPUs not allocated to them",
                        "e.g. NVIDIA_VISIBLE_DEVICES=all or a privileged pod (alert "
                        "GPUIsolationLeak).",
                        f"count(gpu_unallocated_use_memory_bytes{{{POD}}} > 0) or vector(0)",
                        "short",
                        w=6,
                        h=8,
                        thresholds=[(None, "green"), (1, "red")],
                    ),
                    table(
                        "Memory used on devices not allocated to the container",
                        "Now.",
                        f"gpu_unallocated_use_memory_bytes{{{POD}}}",
                        "bytes",
                        w=18,
                        rename={"Value": "memory"},
                        sort_by="memory",
                    ),
                ],
            ),
        ],
    )


def health_orphans() -> Json:
    orphans = f"gpu_orphaned_memory_bytes{{{GPU}}}"
    return dashboard(
        "gpu-occupancy-health-orphans",
        "GPU / Health and orphaned memory",
        "XID errors, health verdicts and reasons, orphaned (zombie) GPU memory with its "
        "holders, and the exporter's own health.",
        ["job", "node", "instance", "gpu", "namespace", "pod"],
        [
            (
                "Summary",
                [
                    stat(
                        "Unhealthy GPUs",
                        "GPUs with an active `unhealthy` reason.",
                        f"count(gpu_healthy{{{GPU}}} == 0) or vector(0)",
                        "short",
                        thresholds=[(None, "green"), (1, "red")],
                    ),
                    stat(
                        "Degraded GPUs",
                        "GPUs slowed by heat or power.",
                        f"count(max by (instance, uuid) (gpu_health_reason{{{GPU}, "
                        f'class="degraded"}}) == 1) or vector(0)',
                        "short",
                        thresholds=[(None, "green"), (1, "orange")],
                    ),
                    stat(
                        "Fatal XIDs (range)",
                        "Fatal XID errors in the selected range.",
                        f'sum(increase(gpu_xid_errors_total{{{GPU}, class="fatal"}}'
                        f"[$__range])) or vector(0)",
                        "short",
                        thresholds=[(None, "green"), (1, "red")],
                    ),
                    stat(
                        "Orphaned GPU memory",
                        "All kinds, now.",
                        f"sum({orphans}) or vector(0)",
                        "bytes",
                        thresholds=[(None, "green"), (1, "orange")],
                    ),
                    stat(
                        "Orphaned processes",
                        "Processes holding orphaned memory, now.",
                        f"sum(gpu_orphaned_processes{{{GPU}}}) or vector(0)",
                        "short",
                        thresholds=[(None, "green"), (1, "orange")],
                    ),
                    stat(
                        "Exporters up",
                        "Share of exporter targets Prometheus can scrape.",
                        f"avg(up{{{EXPORTER_SELECTOR}, {NODE}}})",
                        "percentunit",
                        thresholds=[(None, "red"), (1, "green")],
                    ),
                ],
            ),
            (
                "XID errors",
                [
                    timeseries(
                        "XID errors by code",
                        "New XIDs per interval, by code and severity class (docs/xid.md).",
                        [
                            target(
                                f"sum by (node, gpu, uuid, xid, class) (increase("
                                f"gpu_xid_errors_total{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " XID {{xid}} ({{class}})",
                            )
                        ],
                        "short",
                        bars=True,
                    ),
                    table(
                        "XID errors seen",
                        "Counts since the exporter started (with --kmsg: "
                        "since the kernel log began).",
                        f"gpu_xid_errors_total{{{GPU}}}",
                        "short",
                        rename={"Value": "errors"},
                        sort_by="errors",
                    ),
                ],
            ),
            (
                "Health",
                [
                    state_timeline(
                        "GPU health verdict",
                        "gpu_healthy per GPU.",
                        [target(f"gpu_healthy{{{GPU}}}", GPU_LEGEND)],
                        "bool_yes_no",
                        HEALTHY_MAP,
                    ),
                    table(
                        "Active health reasons",
                        "unhealthy: take out of service; degraded: still schedulable but slower.",
                        f"gpu_health_reason{{{GPU}}} == 1",
                        "none",
                        hide_value=True,
                    ),
                    timeseries(
                        "ECC errors, remapped rows, PCIe replays",
                        "New per interval.",
                        [
                            target(
                                f"sum by (node, gpu, type) (increase(gpu_ecc_errors_total"
                                f"{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " ECC {{type}}",
                            ),
                            target(
                                f"sum by (node, gpu, cause) (increase("
                                f"gpu_remapped_rows_total{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " remapped rows {{cause}}",
                            ),
                            target(
                                f"sum by (node, gpu) (increase(gpu_pcie_replays_total"
                                f"{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " PCIe replays",
                            ),
                        ],
                        "short",
                        bars=True,
                    ),
                    state_timeline(
                        "Row remapping pending / failed",
                        "Pending: reset the GPU. Failed: replace it.",
                        [
                            target(f"gpu_row_remap_pending{{{GPU}}}", GPU_LEGEND + " pending"),
                            target(f"gpu_row_remap_failed{{{GPU}}}", GPU_LEGEND + " failed"),
                        ],
                        "bool_yes_no",
                        ACTIVE_MAP,
                    ),
                ],
            ),
            (
                "Orphaned GPU memory",
                [
                    timeseries(
                        "Orphaned memory by kind",
                        "dead_process, deleted_pod, stuck_process, unattributed.",
                        [
                            target(
                                f"sum by (node, gpu, uuid, kind) ({orphans})",
                                GPU_LEGEND + " {{kind}}",
                            )
                        ],
                        "bytes",
                        stacked=True,
                    ),
                    timeseries(
                        "Orphaned processes by kind",
                        "Processes per kind.",
                        [target(f"gpu_orphaned_processes{{{GPU}}}", GPU_LEGEND + " {{kind}}")],
                        "short",
                        stacked=True,
                    ),
                    table(
                        "Orphan holders",
                        "Processes holding orphaned memory: pid, command, and the pod they "
                        "belonged to. Kill or restart these to free the memory "
                        "(docs/runbooks.md#gpuorphanedmemory).",
                        f'gpu_orphaned_holder_info{{{GPU}, namespace=~"$namespace", pod=~"$pod"}}',
                        "none",
                        w=16,
                        hide_value=True,
                    ),
                    table(
                        "Orphaned for",
                        "Time since the exporter first saw each orphan.",
                        f"time() - gpu_orphaned_memory_first_seen_timestamp_seconds{{{GPU}}}",
                        "s",
                        w=8,
                        rename={"Value": "orphaned for"},
                        sort_by="orphaned for",
                    ),
                    timeseries(
                        "Memory of processes no container owns",
                        "owner host / dead / unknown, with the reason.",
                        [
                            target(
                                f"gpu_unattributed_memory_used_bytes{{{GPU}}}",
                                GPU_LEGEND + " {{owner}} {{reason}}",
                            )
                        ],
                        "bytes",
                        w=24,
                    ),
                ],
            ),
            (
                "Exporter",
                [
                    state_timeline(
                        "Sources up",
                        "nvml, procfs, podresources, kube, xid, dcgm.",
                        [target(f"gpu_exporter_source_up{{{NODE}}}", "{{node}} {{source}}")],
                        "bool_on_off",
                        UP_MAP,
                    ),
                    timeseries(
                        "Seconds since the last sample",
                        "Alert GPUExporterSamplesStale above 60 s.",
                        [
                            target(
                                f"time() - gpu_exporter_last_sample_timestamp_seconds{{{NODE}}}",
                                "{{node}}",
                            )
                        ],
                        "s",
                    ),
                    timeseries(
                        "Sample cycle duration (p99)",
                        "Sources and analysis per cycle.",
                        [
                            target(
                                f"histogram_quantile(0.99, sum by (le, node, instance) "
                                f"(rate(gpu_exporter_sample_duration_seconds_bucket"
                                f"{{{NODE}}}[$__rate_interval])))",
                                "{{node}}",
                            )
                        ],
                        "s",
                    ),
                    timeseries(
                        "Exporter errors",
                        "Failed queries and refreshes per second.",
                        [
                            target(
                                f"sum by (node, source) (rate(gpu_exporter_errors_total"
                                f"{{{NODE}}}[$__rate_interval]))",
                                "{{node}} {{source}}",
                            )
                        ],
                        "cps",
                    ),
                    state_timeline(
                        "NVML up",
                        "0: no driver, or libnvidia-ml not mounted.",
                        [target(f'gpu_exporter_source_up{{source="nvml", {NODE}}}', "{{node}}")],
                        "bool_on_off",
                        UP_MAP,
                        w=24,
                        h=5,
                    ),
                ],
            ),
        ],
    )


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
    panel = _panel(
        "table",
        "Could run on",
        "Workloads (owner and GPU model) holding whole GPUs that the smallest MIG profile of "
        "their model would hold with 20 % headroom over their 7-day p95 of GPU memory and of "
        "SM activity, or that could share a GPU by time-slicing (at most a quarter of its SMs "
        "and half its memory). Evidence beside each: the p95s and the time of the last 7 days "
        "they rest on. Workloads that need a whole GPU, or whose SM activity is unknown "
        "(no GPM), are not listed. Rules: alerts/gpu-occupancy-exporter.rightsizing.yaml.",
        targets,
        _field_config("none"),
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


def build_all() -> dict[str, Json]:
    """File name -> dashboard."""
    return {
        "gpu-node-overview.json": node_overview(),
        "gpu-pods.json": pods(),
        "gpu-health-orphans.json": health_orphans(),
        "gpu-waste.json": waste(),
    }


def render(board: Json) -> str:
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="exit 1 if a committed dashboard differs from the generated one",
    )
    args = parser.parse_args(argv)
    stale = []
    for name, board in build_all().items():
        path = HERE / name
        text = render(board)
        if args.check:
            if not path.exists() or path.read_text(encoding="utf-8") != text:
                stale.append(name)
        else:
            path.write_text(text, encoding="utf-8")
    if stale:
        print(
            f"out of date: {', '.join(stale)}; run python dashboards/generate.py", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
