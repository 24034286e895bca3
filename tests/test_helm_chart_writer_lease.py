"""The chart's part of one writer per node: a Role on leases in the release namespace,
only where the exporter writes, and the pod's name and namespace from the downward API
(exporter/reporting/lease.py; docs/kubernetes-events.md, "One writer per node").
Rendered by real Helm (tests/test_helm_chart.py) and validated against the API schemas."""

from __future__ import annotations

import kubernetes_validate
import pytest

from exporter.config import parse_config
from tests.test_helm_chart import KUBE_VERSIONS, NAMESPACE, by_kind, container, env_of, one

pytestmark = pytest.mark.slow

LEASE_RULE = {
    "apiGroups": ["coordination.k8s.io"],
    "resources": ["leases"],
    "verbs": ["get", "create", "update"],
}
NO_WRITES = {"kubeEvents": {"enabled": False}}


def test_the_default_grants_get_create_update_on_leases_in_the_release_namespace() -> None:
    role, binding = one({}, "Role"), one({}, "RoleBinding")
    assert role["metadata"]["namespace"] == NAMESPACE
    assert role["rules"] == [LEASE_RULE]  # no delete, no list, no watch
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    account = one({}, "ServiceAccount")["metadata"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["name"], "namespace": NAMESPACE}
    ]
    for obj in (role, binding):
        for version in KUBE_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize(
    "values",
    [
        {"nodeCondition": {"enabled": True}, **NO_WRITES},
        {"draDeviceTaints": {"enabled": True}, **NO_WRITES},
    ],
)
def test_any_kind_of_write_alone_grants_the_lease(values: dict[str, object]) -> None:
    assert one(values, "Role")["rules"] == [LEASE_RULE]


def test_no_write_no_lease_role() -> None:
    assert not by_kind(NO_WRITES, "Role") and not by_kind(NO_WRITES, "RoleBinding")


def test_kube_api_off_or_rbac_create_false_renders_no_lease_role() -> None:
    for values in ({"kubeApi": "off"}, {"rbac": {"create": False}}):
        assert not by_kind(values, "Role"), values


def test_the_pod_name_and_namespace_come_from_the_downward_api_and_set_the_lease() -> None:
    env = env_of({})
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["POD_NAMESPACE"] == {"fieldRef": {"fieldPath": "metadata.namespace"}}
    resolved = {"NODE_NAME": "n", "POD_NAME": "gpu-abcde", "POD_NAMESPACE": NAMESPACE}
    config = parse_config(container({})["args"], resolved)
    assert config.kube_writer_lease_namespace == NAMESPACE
    assert config.kube_writer_lease_duration_s == 30
