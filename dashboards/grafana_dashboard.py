"""A Grafana dashboard around its panels: rows laid out on the 24-column grid, panel ids,
the template variables, the GPU-alert annotations and the links between the dashboards."""

from __future__ import annotations

from collections.abc import Iterable

from grafana_panels import DS, Json
from grafana_variables import VARIABLES, datasource_variable

SCHEMA_VERSION = 39
TAG = "gpu-occupancy-exporter"


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
