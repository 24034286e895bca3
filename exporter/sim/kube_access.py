"""SelfSubjectAccessReview (authorization.k8s.io/v1) for the API stand-in: "may I?",
answered from the stand-in's own permission model, so a client is told "denied" for
exactly the writes it would be refused with 403.

The model is the faults a test sets: ``set_write_fault("forbidden", only=PART)`` denies
the writes whose path holds ``PART`` (Events, the Node's status, DeviceTaintRules),
``set_lease_fault("forbidden")`` the Lease, and ``set_error(403, resource="pods")`` the
pod reads. The real server answers the same request shape
(https://kubernetes.io/docs/reference/kubernetes-api/authorization-resources/self-subject-access-review-v1/):
``spec.resourceAttributes`` in, ``status.allowed`` (and ``reason``) out, 201 Created.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from aiohttp import web

PATH = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"


def resource_path(attributes: Mapping[str, Any]) -> str:
    """The request path a write with these attributes goes to."""
    group = str(attributes.get("group") or "")
    resource = str(attributes.get("resource") or "")
    subresource = str(attributes.get("subresource") or "")
    namespace = str(attributes.get("namespace") or "")
    name = str(attributes.get("name") or "")
    version = {"events.k8s.io": "v1", "resource.k8s.io": "v1", "coordination.k8s.io": "v1"}
    base = f"/apis/{group}/{version.get(group, 'v1')}" if group else "/api/v1"
    path = base + (f"/namespaces/{namespace}" if namespace else "") + f"/{resource}"
    path += f"/{name}" if name else ""
    return path + (f"/{subresource}" if subresource else "")


def mount_access_review(
    app: web.Application,
    forbids: Callable[[str], bool],
    reads_forbidden: Callable[[str], bool],
) -> None:
    """``forbids(path)``: a write there is refused; ``reads_forbidden(resource)``: a
    get/list/watch of that resource is."""

    async def review(request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            attributes = body["spec"]["resourceAttributes"]
            if not isinstance(attributes, dict):
                raise TypeError
        except (ValueError, KeyError, TypeError):
            failure = {
                "kind": "Status",
                "status": "Failure",
                "code": 400,
                "reason": "BadRequest",
                "message": "spec.resourceAttributes is required",
            }
            return web.json_response(failure, status=400)
        verb = str(attributes.get("verb") or "")
        if verb in ("get", "list", "watch") and reads_forbidden(str(attributes.get("resource"))):
            denied = True
        else:
            denied = forbids(resource_path(attributes))
        status: dict[str, Any] = {"allowed": not denied}
        if denied:
            status["denied"] = False  # RBAC has no deny rules: merely not allowed
            status["reason"] = "no RBAC rule allows it (fake API server fault)"
        else:
            status["reason"] = "allowed by the fake API server"
        answer = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "metadata": {"creationTimestamp": None},
            "spec": {"resourceAttributes": attributes},
            "status": status,
        }
        return web.json_response(answer, status=201)

    app.router.add_post(PATH, review)
