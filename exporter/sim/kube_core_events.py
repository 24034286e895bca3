"""The core/v1 view of the Events the exporter writes as events.k8s.io/v1.

kube-apiserver stores one Event and serves it in both groups: ``kubectl describe`` and
``kubectl get events`` read ``/api/v1/.../events``, the exporter writes
``/apis/events.k8s.io/v1/...``. The two views differ only by field names, converted by
``Convert_v1_Event_To_core_Event`` (kubernetes ``pkg/apis/events/v1/conversion.go``,
lines 26-41: ``regarding`` -> ``involvedObject``, ``note`` -> ``message``,
``deprecatedSource`` -> ``source``, ``deprecatedFirstTimestamp``/``LastTimestamp``/
``Count`` -> ``firstTimestamp``/``lastTimestamp``/``count``; the other fields keep their
names) and by the core/v1 JSON names (k8s.io/api ``core/v1/types.go``, ``Event``:
``ReportingController`` is ``json:"reportingComponent"``; ``firstTimestamp``,
``lastTimestamp`` and ``eventTime`` have no ``omitempty``, so they are ``null`` when
unset). A core/v1 LIST selects by the field labels of ``AddFieldLabelConversionsForEvent``
(``pkg/apis/core/v1/conversion.go``): ``involvedObject.*``, ``reason``, ``type``,
``source``, ``reportingComponent``, ``metadata.name``, ``metadata.namespace``.

A LIST asked for ``as=Table`` (what ``kubectl get`` sends in its ``Accept`` header) is
answered with the ``meta.k8s.io/v1`` Table the server prints for Events: the columns of
``eventColumnDefinitions`` and the cells of ``printEvent`` (kubernetes
``pkg/printers/internalversion/printers.go``), every column as the server sends them
(``GenerateOptions{Wide: true}``: kubectl hides the priority-1 ones without ``-o wide``),
ages by ``duration.HumanDuration`` (apimachinery ``pkg/util/duration/duration.go``)
from the server's clock.

Read-only here, as nothing in the project writes core/v1 Events.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from aiohttp import web

from exporter.sim.kube_rules import bad_request, not_found
from exporter.sim.kube_selectors import FieldPath, SelectorError, parse_field_selector

CORE_EVENT_FIELDS: dict[str, FieldPath] = {
    "metadata.name": ("metadata", "name"),
    "metadata.namespace": ("metadata", "namespace"),
    "involvedObject.kind": ("involvedObject", "kind"),
    "involvedObject.namespace": ("involvedObject", "namespace"),
    "involvedObject.name": ("involvedObject", "name"),
    "involvedObject.uid": ("involvedObject", "uid"),
    "involvedObject.apiVersion": ("involvedObject", "apiVersion"),
    "involvedObject.resourceVersion": ("involvedObject", "resourceVersion"),
    "involvedObject.fieldPath": ("involvedObject", "fieldPath"),
    "reason": ("reason",),
    "reportingComponent": ("reportingComponent",),
    "source": ("source", "component"),
    "type": ("type",),
}

# events.k8s.io/v1 name -> core/v1 name, where they differ
_RENAMED = {
    "regarding": "involvedObject",
    "note": "message",
    "deprecatedSource": "source",
    "deprecatedFirstTimestamp": "firstTimestamp",
    "deprecatedLastTimestamp": "lastTimestamp",
    "deprecatedCount": "count",
    "reportingController": "reportingComponent",
}
_KEPT = (
    "metadata",
    "reason",
    "type",
    "eventTime",
    "series",
    "action",
    "related",
    "reportingInstance",
)


def core_event(event: Mapping[str, Any]) -> dict[str, Any]:
    """The core/v1 form of one events.k8s.io/v1 Event, as kube-apiserver serves it."""
    out: dict[str, Any] = {"kind": "Event", "apiVersion": "v1"}
    for name in _KEPT:
        if name in event:
            out[name] = copy.deepcopy(event[name])
    for v1_name, core_name in _RENAMED.items():
        if v1_name in event:
            out[core_name] = copy.deepcopy(event[v1_name])
    out.setdefault("involvedObject", {})
    out.setdefault("source", {})
    for never_omitted in ("firstTimestamp", "lastTimestamp", "eventTime"):
        out.setdefault(never_omitted, None)
    for never_omitted in ("reportingComponent", "reportingInstance"):
        out.setdefault(never_omitted, "")
    if out.get("count") == 0:
        del out["count"]  # int32 with omitempty
    return out


def _value(obj: Mapping[str, Any], path: FieldPath) -> Any:
    value: Any = obj
    for part in path:
        value = value.get(part) if isinstance(value, Mapping) else None
    return value


def select(events: list[dict[str, Any]], field_selector: str) -> list[dict[str, Any]]:
    """The core/v1 Events that ``fieldSelector`` (core/v1 labels) keeps; SelectorError for
    a label the real server refuses."""
    selector = parse_field_selector(field_selector, CORE_EVENT_FIELDS)
    converted = [core_event(e) for e in events]
    return [
        e
        for e in converted
        if all(((_value(e, path) or "") == value) == equal for path, value, equal in selector)
    ]


def human_duration(seconds: float) -> str:
    """apimachinery's ``duration.HumanDuration``: kubectl's and the server's ages."""
    whole = int(seconds)
    if whole < -1:
        return "<invalid>"
    if whole < 0:
        return "0s"
    if whole < 60 * 2:
        return f"{whole}s"
    minutes = whole // 60
    if minutes < 10:
        rest = whole % 60
        return f"{minutes}m{rest}s" if rest else f"{minutes}m"
    if minutes < 60 * 3:
        return f"{minutes}m"
    hours = minutes // 60
    if hours < 8:
        rest = minutes % 60
        return f"{hours}h{rest}m" if rest else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        rest = hours % 24
        return f"{hours // 24}d{rest}h" if rest else f"{hours // 24}d"
    if hours < 24 * 365 * 2:
        return f"{hours // 24}d"
    if hours < 24 * 365 * 8:
        days = hours // 24 % 365
        return f"{hours // 24 // 365}y{days}d" if days else f"{hours // 24 // 365}y"
    return f"{hours // 24 // 365}y"


def _since(stamp: Any, now: float) -> str:
    """``translateTimestampSince``: ``<unknown>`` for an unset time."""
    if not isinstance(stamp, str) or not stamp:
        return "<unknown>"
    return human_duration(now - datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp())


def _source(event: Mapping[str, Any]) -> str:
    """``formatEventSource``: the source, else the reporting controller and instance."""
    source = event.get("source") or {}
    component = source.get("component") or event.get("reportingComponent") or ""
    instance = source.get("host") or event.get("reportingInstance") or ""
    if not component:
        return ""
    return f"{component}, {instance}" if instance else component


# eventColumnDefinitions: (name, priority)
EVENT_COLUMNS = (
    ("Last Seen", 0),
    ("Type", 0),
    ("Reason", 0),
    ("Object", 0),
    ("Subobject", 1),
    ("Source", 1),
    ("Message", 0),
    ("First Seen", 1),
    ("Count", 1),
    ("Name", 1),
)


def event_row(event: Mapping[str, Any], now: float) -> list[Any]:
    """``printEvent``'s cells for one core/v1 Event, wide (every column)."""
    first = _since(event.get("firstTimestamp"), now)
    if not event.get("firstTimestamp"):
        first = _since(event.get("eventTime"), now)
    last = _since(event.get("lastTimestamp"), now) if event.get("lastTimestamp") else first
    count = event.get("count") or 0
    series = event.get("series")
    if series:
        last = _since(series.get("lastObservedTime"), now)
        count = series.get("count", 0)
    elif count == 0:
        count = 1  # "Singleton events don't have a count set in the new API."
    involved = event.get("involvedObject") or {}
    kind = str(involved.get("kind", "")).lower()
    target = f"{kind}/{involved['name']}" if involved.get("name") else kind
    return [
        last,
        event.get("type", ""),
        event.get("reason", ""),
        target,
        involved.get("fieldPath", ""),
        _source(event),
        str(event.get("message", "")).strip(),
        first,
        int(count),
        event["metadata"]["name"],
    ]


def event_table(
    events: list[dict[str, Any]], resource_version: str, now: float, include: str
) -> dict[str, Any]:
    """The ``meta.k8s.io/v1`` Table of core/v1 Events; ``include`` is the request's
    ``includeObject`` (``None``, ``Metadata``: the default, ``Object``)."""
    rows = []
    for event in events:
        row: dict[str, Any] = {"cells": event_row(event, now)}
        if include == "Object":
            row["object"] = event
        elif include != "None":
            row["object"] = {
                "kind": "PartialObjectMetadata",
                "apiVersion": "meta.k8s.io/v1",
                "metadata": event["metadata"],
            }
        rows.append(row)
    return {
        "kind": "Table",
        "apiVersion": "meta.k8s.io/v1",
        "metadata": {"resourceVersion": resource_version},
        "columnDefinitions": [
            {
                "name": name,
                "type": "integer" if name == "Count" else "string",
                "format": "name" if name == "Name" else "",
                "description": "",
                "priority": priority,
            }
            for name, priority in EVENT_COLUMNS
        ],
        "rows": rows,
    }


EventSource = Callable[[str | None], list[dict[str, Any]]]  # namespace -> v1 Events
ResourceVersion = Callable[[], str]


def mount_core_events(
    app: web.Application,
    events: EventSource,
    resource_version: ResourceVersion,
    now: Callable[[], float] = time.time,
) -> None:
    """Serve ``GET /api/v1/events``, ``/api/v1/namespaces/<ns>/events`` (with
    ``fieldSelector``; a Table when asked) and ``/api/v1/namespaces/<ns>/events/<name>``
    from ``events`` (the write side's events.k8s.io/v1 store, one namespace or all);
    ``now`` is the server's clock, for a Table's ages."""

    async def list_events(request: web.Request) -> web.Response:
        try:
            items = select(
                events(request.match_info.get("namespace")),
                request.query.get("fieldSelector", ""),
            )
        except SelectorError as exc:
            return bad_request(str(exc)).response()
        if "as=Table" in request.headers.get("Accept", ""):
            include = request.query.get("includeObject", "Metadata")
            return web.json_response(event_table(items, resource_version(), now(), include))
        return web.json_response(
            {
                "kind": "EventList",
                "apiVersion": "v1",
                "metadata": {"resourceVersion": resource_version()},
                "items": items,
            }
        )

    async def get_event(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        found = [
            e for e in events(request.match_info["namespace"]) if e["metadata"]["name"] == name
        ]
        if not found:
            return not_found("events", name).response()
        return web.json_response(core_event(found[0]))

    r = app.router
    r.add_get("/api/v1/events", list_events)
    r.add_get("/api/v1/namespaces/{namespace}/events", list_events)
    r.add_get("/api/v1/namespaces/{namespace}/events/{name}", get_event)
