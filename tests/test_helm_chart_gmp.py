"""Managed platforms: Google Managed Prometheus objects, and GKE Autopilot refused.

Real Helm renders them; tests/test_helm_chart.py validates every value set's objects,
these among them, against subsets of prometheus-engine's CRD schemas (CRD_SCHEMAS).
"""

from __future__ import annotations

from typing import Any

import helm_python as helm
import pytest

from tests.test_helm_chart import BCRYPT_HASH, NAMESPACE, VALUE_SETS, by_kind, render

pytestmark = pytest.mark.slow

SELECTOR = {
    "app.kubernetes.io/instance": "gpu",
    "app.kubernetes.io/name": "gpu-occupancy-exporter",
}


def gmp(values: dict[str, Any], kind: str) -> list[dict[str, Any]]:
    return by_kind(values, kind)


def endpoint(values: dict[str, Any], kind: str) -> dict[str, Any]:
    (obj,) = gmp(values, kind)
    (ep,) = obj["spec"]["endpoints"]
    return ep


def test_nothing_for_gmp_by_default() -> None:
    assert gmp({}, "PodMonitoring") == [] and gmp({}, "ClusterPodMonitoring") == []


def test_a_pod_monitoring_selects_the_exporters_pods_in_its_namespace() -> None:
    (obj,) = gmp(VALUE_SETS["gmp-pod-monitoring"], "PodMonitoring")
    assert obj["apiVersion"] == "monitoring.googleapis.com/v1"
    assert obj["metadata"]["namespace"] == NAMESPACE
    assert obj["spec"]["selector"] == {"matchLabels": SELECTOR}
    assert obj["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "15s"}]
    # only node from the pod's metadata: pod and container stay the workload's labels
    assert obj["spec"]["targetLabels"] == {"metadata": ["node"]}


def test_a_cluster_pod_monitoring_leaves_namespace_to_the_series() -> None:
    values = VALUE_SETS["gmp-cluster-pod-monitoring-secured"]
    (obj,) = gmp(values, "ClusterPodMonitoring")
    assert "namespace" not in obj["metadata"]
    assert obj["spec"]["targetLabels"]["metadata"] == ["node"]
    ep = obj["spec"]["endpoints"][0]
    assert ep["scheme"] == "https" and ep["timeout"] == "10s"
    secret = {"name": "gpu-exporter-tls", "key": "ca.crt", "namespace": NAMESPACE}
    assert ep["tls"]["ca"] == {"secret": secret}
    assert ep["tls"]["serverName"] == f"gpu-gpu-occupancy-exporter.{NAMESPACE}.svc"
    password = {"name": "gmp-scrape", "key": "pass", "namespace": NAMESPACE}
    assert ep["basicAuth"] == {"username": "prometheus", "password": {"secret": password}}


def test_behind_kube_rbac_proxy_gmp_sends_the_token_of_a_secret_in_its_own_namespace() -> None:
    ep = endpoint(VALUE_SETS["gmp-behind-kube-rbac-proxy"], "PodMonitoring")
    assert ep["authorization"] == {
        "type": "Bearer",
        "credentials": {"secret": {"name": "gmp-token", "key": "t"}},
    }
    assert "namespace" not in ep["tls"]["ca"]["secret"]  # refused on a PodMonitoring


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"basicAuth": {"users": {"p": BCRYPT_HASH}}},
            "basicAuth.users is set: Google Managed Prometheus needs the password",
        ),
        (
            {"googleManagedPrometheus": {"basicAuth": {"secretName": "s"}}},
            "needs googleManagedPrometheus.basicAuth.username",
        ),
        (
            {"tls": {"enabled": True, "secretName": "t"}, "kubeRbacProxy": {"enabled": True}},
            "needs googleManagedPrometheus.bearerToken.secretName",
        ),
        (
            {"googleManagedPrometheus": {"bearerToken": {"secretName": "s"}}},
            "googleManagedPrometheus.bearerToken is for kubeRbacProxy.enabled",
        ),
        (
            {
                "tls": {
                    "enabled": True,
                    "secretName": "t",
                    "clientAuthType": "RequireAndVerifyClientCert",
                    "clientCASecretName": "ca",
                }
            },
            "does not give GMP a client certificate",
        ),
    ],
)
def test_gmp_settings_that_cannot_scrape_fail_with_what_to_change(
    values: dict[str, Any], message: str
) -> None:
    on = {"googleManagedPrometheus": {"clusterPodMonitoring": {"enabled": True}}}
    merged = {**values, "googleManagedPrometheus": {**on["googleManagedPrometheus"]}}
    merged["googleManagedPrometheus"].update(values.get("googleManagedPrometheus", {}))
    with pytest.raises(helm.HelmRenderError, match=message):
        render(merged)


def test_interval_is_required_and_validated_by_the_schema() -> None:
    with pytest.raises(helm.HelmValuesError):
        render({"googleManagedPrometheus": {"podMonitoring": {"enabled": True}, "interval": ""}})
    with pytest.raises(helm.HelmValuesError):
        render({"googleManagedPrometheus": {"timeout": "ten seconds"}})


def test_gke_autopilot_is_refused_with_the_reason_and_the_way_out() -> None:
    with pytest.raises(helm.HelmRenderError) as failed:
        render({"platform": "gke-autopilot"})
    message = str(failed.value)
    assert "GKE Autopilot admits no privileged, hostPath or hostPID pods" in message
    assert "platform: gke" in message and "managed DCGM metrics" in message


# -- an adversarial review's findings ------------------------------------------------------

ON = {"clusterPodMonitoring": {"enabled": True}}


def test_the_network_policy_admits_gmps_collectors() -> None:
    """GMP scrapes from its collector DaemonSet in gmp-system (prometheus-engine
    charts/operator/templates/collector.yaml); the policy's default peer is `monitoring`."""
    values = {"networkPolicy": {"enabled": True}, "googleManagedPrometheus": ON}
    (policy,) = by_kind(values, "NetworkPolicy")
    peers = policy["spec"]["ingress"][0]["from"]
    assert {
        "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gmp-system"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "collector"}},
    } in peers
    (without,) = by_kind({"networkPolicy": {"enabled": True}}, "NetworkPolicy")
    assert len(without["spec"]["ingress"][0]["from"]) == 1


@pytest.mark.parametrize(
    ("interval", "timeout", "refused"),
    [("10s", "15s", True), ("1m30s", "1m31s", True), ("1m", "60s", False), ("1m", "500ms", False)],
)
def test_a_timeout_longer_than_the_interval_is_refused_as_gmp_would(
    interval: str, timeout: str, refused: bool
) -> None:
    values = {"googleManagedPrometheus": {**ON, "interval": interval, "timeout": timeout}}
    if refused:
        with pytest.raises(helm.HelmRenderError, match="is longer than its interval"):
            render(values)
    else:
        assert endpoint(values, "ClusterPodMonitoring")["timeout"] == timeout


def test_both_kinds_at_once_are_refused() -> None:
    both = {"podMonitoring": {"enabled": True}, "clusterPodMonitoring": {"enabled": True}}
    with pytest.raises(helm.HelmRenderError, match="not both"):
        render({"googleManagedPrometheus": both})


def test_a_basic_auth_user_the_exporter_does_not_know_is_refused() -> None:
    values = {
        "basicAuth": {"users": {"prometheus": BCRYPT_HASH}},
        "googleManagedPrometheus": {**ON, "basicAuth": {"username": "nobody", "secretName": "s"}},
    }
    with pytest.raises(helm.HelmRenderError, match=r'"nobody" is not one of basicAuth\.users'):
        render(values)


def test_a_year_is_no_gmp_duration() -> None:
    with pytest.raises(helm.HelmValuesError):
        render({"googleManagedPrometheus": {**ON, "interval": "1y"}})
