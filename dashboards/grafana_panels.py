"""Grafana panel builders: time series, stat, bar gauge, table and state timeline panels
with their queries, units, thresholds and legends.

Every panel and query names its data source by the ``${datasource}`` variable (``DS``),
never by a UID. A panel's size is its ``gridPos`` width and height; grafana_dashboard's
``layout`` places it.
"""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]
DS: dict[str, str] = {"type": "prometheus", "uid": "${datasource}"}


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


def field_config(
    unit: str,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    thresholds: list[tuple[float | None, str]] | None = None,
    mappings: list[Json] | None = None,
    custom: Json | None = None,
) -> Json:
    """Defaults for every field of a panel: unit, colours, thresholds, value mappings."""
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


def base_panel(
    kind: str,
    title: str,
    description: str,
    targets: list[Json],
    field_config: Json,
    options: Json,
    w: int,
    h: int,
) -> Json:
    """A ``kind`` panel sized ``w`` by ``h``; its targets get refIds A, B, ... in order."""
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
    fc = field_config(
        unit,
        minimum=0 if ratio or stacked or bars else None,
        maximum=1 if ratio else None,
        custom=custom,
    )
    return base_panel(
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
    fc = field_config(unit, thresholds=thresholds or [(None, "blue")])
    options = {
        "reduceOptions": REDUCE_LAST,
        "colorMode": "value",
        "graphMode": "area",
        "justifyMode": "auto",
        "orientation": "auto",
        "textMode": "auto",
    }
    return base_panel("stat", title, description, [target(expr)], fc, options, w, h)


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
    fc = field_config(
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
    return base_panel(
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
    panel = base_panel(
        "table",
        title,
        description,
        [target(expr, instant=True, table=True)],
        field_config(unit),
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
    fc = field_config(
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
    return base_panel("state-timeline", title, description, targets, fc, options, w, h)


HEALTHY_MAP = {"1": ("healthy", "green"), "0": ("unhealthy", "red")}
UP_MAP = {"1": ("up", "green"), "0": ("down", "red")}
ACTIVE_MAP = {"1": ("active", "orange"), "0": ("clear", "transparent")}
