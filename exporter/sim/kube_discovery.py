"""The API stand-in's discovery documents: what a real client (``kubectl``) asks first.

``kubectl`` resolves ``pod``, ``events`` or ``node`` to a group, version and resource
before it sends a request, from ``/api``, ``/apis`` and one resource list per
group/version. kubectl 1.32 asks for the aggregated form first (``Accept:
application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList, ...,
application/json``); an answer in plain ``application/json`` is the legacy form, which
it takes as a server without aggregated discovery does (client-go
``discovery/aggregated_discovery.go``, ``discovery_client.go`` ``GroupsAndMaybeResources``).
So only the legacy documents are served here: ``APIVersions`` at ``/api``,
``APIGroupList`` at ``/apis``, an ``APIResourceList`` per group/version, and ``/version``.

Core ``v1`` comes first in ``/api`` and is the group kubectl tries first, so ``kubectl get
events`` reads core/v1 Events although events.k8s.io/v1 serves the same objects (as on a
real cluster). What is listed is what the stand-in serves; resource.k8s.io's versions
come from the write side (``KubeWrites.resource_group``), which also answers
``/apis/resource.k8s.io`` and ``/apis/resource.k8s.io/<version>`` itself.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from aiohttp import web

# The Kubernetes release whose rules the stand-in keeps (kube_writes.py: 1.35 sources).
VERSION_INFO: dict[str, str] = {
    "major": "1",
    "minor": "35",
    "gitVersion": "v1.35.0-gpu-exporter-sim",
    "gitCommit": "0000000000000000000000000000000000000000",
    "gitTreeState": "clean",
    "buildDate": "2026-01-01T00:00:00Z",
    "goVersion": "go1.25.0",
    "compiler": "gc",
    "platform": "linux/amd64",
}

_READ = ["get", "list", "watch"]
# group/version -> (name, singular, namespaced, kind, verbs, short names)
_Resource = tuple[str, str, bool, str, Sequence[str], Sequence[str]]
CORE_V1: tuple[_Resource, ...] = (
    ("events", "event", True, "Event", _READ, ("ev",)),
    ("nodes", "node", False, "Node", ["get", "patch"], ("no",)),
    ("nodes/status", "", False, "Node", ["get", "patch"], ()),
    ("pods", "pod", True, "Pod", _READ, ("po",)),
)
EVENTS_V1: tuple[_Resource, ...] = (
    ("events", "event", True, "Event", ["create", "get", "list", "patch"], ("ev",)),
)


def resource_list(group_version: str, resources: Sequence[_Resource]) -> dict[str, Any]:
    """An ``APIResourceList`` as kube-apiserver serves it at ``/api/v1`` or
    ``/apis/<group>/<version>``."""
    return {
        "kind": "APIResourceList",
        "apiVersion": "v1",
        "groupVersion": group_version,
        "resources": [
            {
                "name": name,
                "singularName": singular,
                "namespaced": namespaced,
                "kind": kind,
                "verbs": list(verbs),
                **({"shortNames": list(short)} if short else {}),
            }
            for name, singular, namespaced, kind, verbs, short in resources
        ],
    }


def api_group(name: str, versions: Sequence[str]) -> dict[str, Any]:
    """An ``APIGroup``; the first version is the preferred one."""
    listed = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {
        "kind": "APIGroup",
        "apiVersion": "v1",
        "name": name,
        "versions": listed,
        "preferredVersion": listed[0],
    }


def mount_discovery(
    app: web.Application, other_groups: Callable[[], Sequence[Mapping[str, Any]]]
) -> None:
    """Serve ``/version``, ``/api``, ``/api/v1``, ``/apis`` and events.k8s.io's documents;
    ``other_groups`` gives the ``APIGroup`` of every further group served now (listed in
    ``/apis`` after events.k8s.io)."""

    async def version(_: web.Request) -> web.Response:
        return web.json_response(VERSION_INFO)

    async def core_versions(request: web.Request) -> web.Response:
        host = request.host or "127.0.0.1"
        return web.json_response(
            {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [{"clientCIDR": "0.0.0.0/0", "serverAddress": host}],
            }
        )

    async def core_v1(_: web.Request) -> web.Response:
        return web.json_response(resource_list("v1", CORE_V1))

    async def groups(_: web.Request) -> web.Response:
        listed = [api_group("events.k8s.io", ["v1"]), *other_groups()]
        return web.json_response({"kind": "APIGroupList", "apiVersion": "v1", "groups": listed})

    async def events_group(_: web.Request) -> web.Response:
        return web.json_response(api_group("events.k8s.io", ["v1"]))

    async def events_v1(_: web.Request) -> web.Response:
        return web.json_response(resource_list("events.k8s.io/v1", EVENTS_V1))

    r = app.router
    r.add_get("/version", version)
    r.add_get("/api", core_versions)
    r.add_get("/api/v1", core_v1)
    r.add_get("/apis", groups)
    r.add_get("/apis/events.k8s.io", events_group)
    r.add_get("/apis/events.k8s.io/v1", events_v1)
