"""The Kubernetes API: reachable with the exporter's credentials, and RBAC for each
write the exporter with these flags would make, asked with SelfSubjectAccessReviews
(authorization.k8s.io/v1) through the exporter's own bounded client."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from exporter.config import Config
from exporter.doctor.check import Check, degraded, missing, ok
from exporter.model import PodResourcesSnapshot
from exporter.reporting.kube_client import KubeWriteClient, KubeWriteError
from exporter.reporting.lease import lease_name

API_FIX = (
    "give the exporter API access: in-cluster, its service account (chart kubeApi: auto, "
    "rbac.create=true); elsewhere --kubeconfig"
)
PODS_FIX = (
    'grant get, list, watch on pods (apiGroups [""]) to the exporter\'s service account '
    "(chart rbac.create=true)"
)


@dataclass(frozen=True)
class Write:
    """One kind of write, its flag, and the RBAC rule it needs."""

    name: str  # the check's name
    kind: str  # KUBE_WRITE_KINDS, or "lease"
    enabled_by: str  # the flag (or chart value) that turns it on
    rule: str  # the RBAC rule, as a ClusterRole or Role states it
    attributes: tuple[dict[str, str], ...]  # one SelfSubjectAccessReview each


@dataclass(frozen=True)
class KubeFindings:
    checks: list[Check]
    pods: list[dict[str, Any]] | None  # this node's pods; None: not read
    complete: bool = True  # False: only the first page of them was read


def writes(config: Config) -> list[tuple[Write, bool]]:
    """Every write the exporter can make, and whether these flags make it (sent, not
    shadowed)."""
    node = config.node_name
    on = config.kube_api != "off"
    events = on and config.kube_events == "auto"
    condition = on and config.node_condition
    taints = on and config.dra_device_taints
    shadow = config.kube_writes_shadow
    sent = {
        "event": events and "event" not in shadow,
        "node_condition": condition and "node_condition" not in shadow,
        "device_taint_rule": taints and "device_taint_rule" not in shadow,
    }
    lease = any(sent.values()) and config.kube_writer_lease_duration_s > 0
    ns = config.kube_writer_lease_namespace

    def attrs(verbs: tuple[str, ...], **kw: str) -> tuple[dict[str, str], ...]:
        return tuple({"verb": v, **kw} for v in verbs)

    return [
        (
            Write(
                "rbac.events",
                "event",
                "--kube-events auto (the default; chart kubeEvents.enabled)",
                'apiGroups ["events.k8s.io"], resources ["events"], verbs ["create", "patch"]',
                attrs(("create", "patch"), group="events.k8s.io", resource="events"),
            ),
            sent["event"],
        ),
        (
            Write(
                "rbac.node_status",
                "node_condition",
                "--node-condition (chart nodeCondition.enabled)",
                'apiGroups [""], resources ["nodes/status"], verbs ["patch"]; '
                'resources ["nodes"], verbs ["get"]',
                (
                    {"verb": "patch", "resource": "nodes", "subresource": "status", "name": node},
                    {"verb": "get", "resource": "nodes", "name": node},
                ),
            ),
            sent["node_condition"],
        ),
        (
            Write(
                "rbac.device_taint_rules",
                "device_taint_rule",
                "--dra-device-taints (chart draDeviceTaints.enabled)",
                'apiGroups ["resource.k8s.io"], resources ["devicetaintrules"], '
                'verbs ["get", "list", "create", "delete"]',
                attrs(
                    ("get", "list", "create", "delete"),
                    group="resource.k8s.io",
                    resource="devicetaintrules",
                ),
            ),
            sent["device_taint_rule"],
        ),
        (
            Write(
                "rbac.lease",
                "lease",
                "any write sent with --kube-writer-lease-duration above 0",
                f'a Role in {ns}: apiGroups ["coordination.k8s.io"], resources ["leases"], '
                'verbs ["get", "create", "update"]',
                attrs(
                    ("get", "create", "update"),
                    group="coordination.k8s.io",
                    resource="leases",
                    namespace=ns,
                    name=lease_name(node),
                ),
            ),
            lease,
        ),
    ]


# The Kubernetes checks' whole budget, in --timeout units: one pod list and the access
# reviews (one per verb of each write; the writes these flags make are asked first).
BUDGET_TIMEOUTS = 6


def check_kube(
    config: Config, timeout_s: float, progress: list[Check] | None = None
) -> KubeFindings:
    """Blocking: each request has ``timeout_s`` (the client cuts it then). Each check is
    appended to ``progress`` as soon as it is made, so a caller whose deadline passes
    keeps the finished ones."""
    progress = [] if progress is None else progress
    if config.kube_api == "off":
        off = degraded(
            "kube_api",
            "off (--kube-api off): pod and container names only where the kubelet "
            "allocated the GPU; no Events",
            "--kube-api auto (chart kubeApi: auto) with " + API_FIX.split(": ", 1)[1],
        )
        return KubeFindings(
            [off, *(_not_made(w, "--kube-api off") for w, _ in writes(config))], None
        )
    client = KubeWriteClient(config.kubeconfig, deadline_s=timeout_s)
    try:
        try:
            pods, complete = client.node_pods(config.node_name)
            more = "" if complete else " (the first page; more exist)"
            api = ok("kube_api", f"pods of node {config.node_name} listed: {len(pods)}{more}")
        except KubeWriteError as exc:
            pods = None
            if exc.status == 403:
                api = degraded("kube_api", f"reachable, but {exc.reason}", PODS_FIX)
            elif exc.status is not None:
                api = degraded("kube_api", exc.reason, API_FIX)
            else:
                return KubeFindings(
                    [
                        degraded("kube_api", f"not reachable: {exc.reason}", API_FIX),
                        *(
                            unknown(w, sent, "the API is not reachable")
                            for w, sent in writes(config)
                        ),
                    ],
                    None,
                )
        progress.append(api)
        for write, sent in sorted(writes(config), key=lambda ws: not ws[1]):
            progress.append(_review(client, write, sent))
        order = {w.name: i for i, (w, _) in enumerate(writes(config))}
        checks = [api, *sorted(progress[1:], key=lambda c: order.get(c.name, 0))]
        return KubeFindings(checks, pods, complete)
    finally:
        client.close()


def _review(client: KubeWriteClient, write: Write, sent: bool) -> Check:
    denied: list[str] = []
    for attributes in write.attributes:
        try:
            allowed, reason = client.access_review(attributes)
        except KubeWriteError as exc:
            return unknown(write, sent, f"SelfSubjectAccessReview failed: {exc.reason}")
        if not allowed:
            denied.append(attributes["verb"] + (f" ({reason})" if reason else ""))
    if not denied:
        verbs = ", ".join(a["verb"] for a in write.attributes)
        if sent:
            return ok(write.name, f"allowed: {verbs}")
        return ok(write.name, f"not made ({write.enabled_by} off); RBAC allows it already")
    fix = f"grant the exporter's service account {write.rule}"
    if sent:
        return missing(write.name, f"denied: {'; '.join(denied)}", fix)
    return ok(
        write.name,
        f"not made ({write.enabled_by} off); before turning it on, {fix} "
        f"(denied now: {'; '.join(denied)})",
    )


def unknown(write: Write, sent: bool, why: str) -> Check:
    if not sent:
        return _not_made(write, f"{write.enabled_by} off")
    return degraded(write.name, f"cannot tell: {why}", API_FIX)


def _not_made(write: Write, why: str) -> Check:
    return ok(write.name, f"no such write is made ({why})")


def dra_check(
    pods: list[dict[str, Any]] | None,
    answer: PodResourcesSnapshot | None,
    drivers: tuple[str, ...],
    complete: bool = True,
) -> Check:
    """Does the kubelet report the DRA claims of this node's pods (``dynamic_resources``
    in its PodResources answer)?"""
    name = "podresources.dra"
    fix = (
        "turn on the kubelet feature gate KubeletPodResourcesDynamicResources (off by "
        "default through Kubernetes 1.33)"
    )
    if answer is None or not answer.ok:
        return degraded(name, "cannot tell: PodResources not read (see podresources)", fix)
    if pods is None:
        if answer.claims_reported:
            return ok(name, f"the kubelet reports DRA claims ({len(answer.claims)} device(s))")
        return degraded(
            name, "cannot tell whether pods here use DRA: the Kubernetes API was not read", API_FIX
        )
    claimants = {
        (p["metadata"].get("namespace", ""), p["metadata"].get("name", ""))
        for p in pods
        if isinstance(p.get("metadata"), dict)
        and isinstance(p.get("spec"), dict)
        and p["spec"].get("resourceClaims")
    }
    if not claimants and not complete:
        return degraded(
            name,
            f"cannot tell: no resource claim among the first {len(pods)} pods read, and "
            "the node has more",
            fix,
        )
    if not claimants:
        return ok(name, "no pod on this node has a resource claim: DRA not in use here")
    unreported = sorted(claimants - answer.claims_reported)
    if not unreported:
        shown = f"{len(claimants)} pod(s) with claims, all reported"
        if not drivers:
            return degraded(
                name,
                f"{shown}, but --dra-drivers is empty: their devices are not resolved",
                "--dra-drivers gpu.nvidia.com (the default)",
            )
        return ok(name, shown)
    named = ", ".join(f"{ns}/{pod}" for ns, pod in unreported[:5])
    return degraded(
        name,
        f"the kubelet reports no DRA claims for {len(unreported)} pod(s) with resource "
        f"claims ({named}): their GPUs are not attributed",
        fix,
    )
