"""Pod metadata from the Kubernetes API: a node-scoped list + watch in one thread.

The API maps pod UID -> namespace/name and container ID -> container name, which turns
the cgroup identities read from /proc into pod labels. The list + watch machinery
(relist on 410 or a break, resync, backoff, readable errors, the lazily imported
``kubernetes`` client) is ``kube_watch.KubeWatchSource``, shared with the
ResourceSlice watch; this module only says what a pod becomes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, ClassVar

from exporter.model import (
    MIRROR_POD_ANNOTATION,
    PodMeta,
    PodMetaSnapshot,
    SourceName,
    WatchCounts,
)
from exporter.sources.base import Cycle
from exporter.sources.kube_watch import KubeWatchSource, metadata_text

MAX_PODS = 5000
# What a pod says about its owner is read within the API's own limits: a kind is a
# DNS-1035 label once lowercased, 63 characters (CRD names validation, apiextensions-
# apiserver pkg/apis/apiextensions/validation/validation.go: IsDNS1035Label(strings.
# ToLower(names.Kind))); an object name a DNS subdomain, 253; a label value 63
# (https://kubernetes.io/docs/concepts/overview/working-with-objects/names/ and
# .../labels/#syntax-and-character-set). The API server lets one entry be the
# controller; entries past MAX_OWNER_REFERENCES are not looked at.
MAX_KIND_CHARS = 63
MAX_NAME_CHARS = 253
MAX_LABEL_VALUE_CHARS = 63
MAX_OWNER_REFERENCES = 16
TEMPLATE_HASH_LABEL = "pod-template-hash"  # apps/v1 DefaultDeploymentUniqueLabelKey
_KUBELET_UID = re.compile(
    r"[0-9a-fA-F]{32}|[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}"
)
_UNREADABLE = ("", "")  # names a controller that cannot be read: unknown, not "none"


def _parse_time(value: Any) -> float | None:
    """RFC 3339 (``2024-05-01T12:00:00Z``, optional fraction) -> epoch seconds."""
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.timestamp()


INT64_MAX = 2**63 - 1


def _whole_seconds(value: Any) -> int | None:
    """``deletionGracePeriodSeconds``, an int64 the API server keeps >= 0; anything else
    (absent, a string, a float, negative, beyond int64: no float holds 10**400) is
    None: the reader assumes the default."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= INT64_MAX:
        return None
    return value


def bare_container_id(container_id: str) -> str:
    """``containerd://<id>`` / ``cri-o://<id>`` / ``docker://<id>`` -> ``<id>``.

    procfs reports the bare id found in the cgroup path; the two must compare equal.
    """
    _, sep, rest = container_id.partition("://")
    return (rest if sep else container_id).strip()


def _container_pairs(statuses: Any) -> Iterable[tuple[str, str]]:
    if not isinstance(statuses, list):
        return
    for status in statuses:
        if not isinstance(status, Mapping):
            continue
        cid = bare_container_id(str(status.get("containerID") or ""))
        name = status.get("name")
        if cid and isinstance(name, str):
            yield cid, name


def _extended_resources(spec: Any) -> Iterable[tuple[str, str, str]]:
    """(container, resource, quantity) for resources with a domain (``nvidia.com/...``):
    the limit, else the request, as HAMi reads them (docs/shared-gpus.md)."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("containers"), list):
        return
    for container in spec["containers"]:
        if not isinstance(container, Mapping) or not isinstance(container.get("name"), str):
            continue
        resources = container.get("resources") or {}
        if not isinstance(resources, Mapping):
            continue
        merged: dict[str, str] = {}
        for key in ("requests", "limits"):  # a limit wins over a request
            values = resources.get(key) or {}
            if isinstance(values, Mapping):
                merged.update({str(k): str(v) for k, v in values.items() if "/" in str(k)})
        for resource, value in sorted(merged.items()):
            yield container["name"], resource, value


def _bounded(value: Any, limit: int) -> str | None:
    """``value`` when it is a printable string of 1 to ``limit`` characters."""
    if isinstance(value, str) and 0 < len(value) <= limit and value.isprintable():
        return value
    return None


def controller_of(refs: Any) -> tuple[str, str] | None:
    """(kind, name) of the ownerReferences entry with ``controller: true``; None when
    there is none (a bare pod); ("", "") when one is named but cannot be read (a kind or
    name that is not a short printable string, or a list too long to look through)."""
    if refs is None:
        return None
    if not isinstance(refs, list):
        return _UNREADABLE
    for ref in refs[:MAX_OWNER_REFERENCES]:
        if not isinstance(ref, Mapping) or ref.get("controller") is not True:
            continue
        kind = _bounded(ref.get("kind"), MAX_KIND_CHARS)
        name = _bounded(ref.get("name"), MAX_NAME_CHARS)
        return (kind, name) if kind and name else _UNREADABLE
    return _UNREADABLE if len(refs) > MAX_OWNER_REFERENCES else None


def _template_hash(labels: Any) -> str | None:
    if not isinstance(labels, Mapping):
        return None
    return _bounded(labels.get(TEMPLATE_HASH_LABEL), MAX_LABEL_VALUE_CHARS)


def kubelet_uid(annotations: Any) -> str | None:
    """A mirror pod's static pod UID, the one its cgroups carry; None for other pods.

    The kubelet names a static pod by the md5 of its manifest (32 hex digits; the
    manifest's own ``metadata.uid`` when it sets one) and writes that UID into the
    mirror pod's ``kubernetes.io/config.mirror`` annotation (pkg/kubelet/config/common.go
    ``applyDefaults``; pkg/kubelet/pod/mirror_client.go ``CreateMirrorPod``). Only the
    forms a cgroup path can carry (procfs.py) are taken: anything else is no UID of a
    process we could see.
    """
    value = annotations.get(MIRROR_POD_ANNOTATION) if isinstance(annotations, Mapping) else None
    if not isinstance(value, str) or _KUBELET_UID.fullmatch(value) is None:
        return None
    return value.lower()


def pod_meta_from_dict(pod: Mapping[str, Any]) -> PodMeta | None:
    """One pod as the API serialises it -> PodMeta; None without a UID.

    A mirror pod is keyed by its static pod's UID (``kubelet_uid``), the one its
    processes' cgroups name, with the API's own UID in ``api_uid``.

    Containers come from the regular, init and ephemeral statuses, skipping those with
    no id yet (not started): only a started container can own a GPU process.
    """
    metadata = pod.get("metadata") or {}
    status = pod.get("status") or {}
    uid = metadata.get("uid")
    if not isinstance(uid, str) or not uid:
        return None
    node_uid = kubelet_uid(metadata.get("annotations"))
    containers: list[tuple[str, str]] = []
    for key in ("containerStatuses", "initContainerStatuses", "ephemeralContainerStatuses"):
        containers.extend(_container_pairs(status.get(key)))
    phase = status.get("phase")
    owner = controller_of(metadata.get("ownerReferences"))
    return PodMeta(
        uid=node_uid or uid.lower(),
        api_uid=uid.lower() if node_uid else None,
        namespace=str(metadata.get("namespace") or ""),
        name=str(metadata.get("name") or ""),
        phase=phase if isinstance(phase, str) and phase else None,
        deletion_timestamp=_parse_time(metadata.get("deletionTimestamp")),
        deletion_grace_period_s=_whole_seconds(metadata.get("deletionGracePeriodSeconds")),
        containers=tuple(containers),
        resources=tuple(_extended_resources(pod.get("spec"))),
        owner_kind=owner[0] if owner else None,
        owner_name=owner[1] if owner else None,
        pod_template_hash=_template_hash(metadata.get("labels")),
        resource_claims=_has_resource_claims(pod.get("spec")),
    )


def _has_resource_claims(spec: Any) -> bool:
    """Whether the pod references DRA ResourceClaims (``spec.resourceClaims``)."""
    claims = spec.get("resourceClaims") if isinstance(spec, Mapping) else None
    return isinstance(claims, list) and bool(claims)


class PodWatcher(KubeWatchSource[PodMeta, PodMeta, PodMetaSnapshot]):
    """This node's pods (``spec.nodeName``), keyed by UID; ``read()`` hands over the
    current ``PodMetaSnapshot``, pods sorted by namespace, name and UID."""

    name: ClassVar[SourceName] = "kube"

    path: ClassVar[str] = "/api/v1/pods"
    resource: ClassVar[str] = "pods"
    singular: ClassVar[str] = "pod"
    thread_name: ClassVar[str] = "pod-watcher"
    description: ClassVar[str] = "pod metadata"
    # The kubelet runs at most maxPods pods, 110 by default (KubeletConfiguration,
    # https://kubernetes.io/docs/reference/config-api/kubelet-config.v1beta1/); large
    # nodes raise it to a few hundred. Far more "pods of this node" is a broken server.
    max_objects: ClassVar[int] = MAX_PODS

    def fill(self, cycle: Cycle) -> None:
        cycle.readings.pod_meta = self.read(cycle)

    def _key(self, obj: Mapping[str, Any]) -> str | None:
        uid = metadata_text(obj, "uid")
        return uid.lower() if uid else None

    def _convert(self, obj: Mapping[str, Any]) -> PodMeta | None:
        return pod_meta_from_dict(obj)

    def _items(self, values: Iterable[PodMeta]) -> tuple[PodMeta, ...]:
        return tuple(sorted(values, key=lambda p: (p.namespace, p.name, p.uid)))

    def _snapshot(
        self,
        ok: bool,
        timestamp: float,
        error: str | None,
        items: tuple[PodMeta, ...],
        counts: WatchCounts,
    ) -> PodMetaSnapshot:
        return PodMetaSnapshot(
            ok=ok,
            timestamp=timestamp,
            error=error,
            pods=items,
            counts=counts,
            server_offset_s=self._server_clock.offset_s(),
        )
