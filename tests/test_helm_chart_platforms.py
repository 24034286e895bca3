"""The chart's platforms (docs/install.md, "Platforms"): what each one renders.

`platform` decides how NVML reaches the pod and where it is scheduled: the GPU Operator
(its RuntimeClass and driver-upgrade eviction label), GKE (the host's driver directory,
LD_LIBRARY_PATH, a privileged container, GKE's accelerator label, the priority-class
quota) and a plain NVIDIA container toolkit node (neither RuntimeClass nor label). Real
Helm renders each one (tests/test_helm_chart.py lints them and validates every object
against the Kubernetes API schemas, through its value sets platform-*, gke-*).
"""

from __future__ import annotations

import json
from typing import Any

import helm_python as helm
import pytest
import yaml

from tests.test_helm_chart import (
    CHART,
    NAMESPACE,
    RELEASE,
    VALUE_SETS,
    _loaded,
    by_kind,
    container,
    env_of,
    pod_spec,
    render,
)
from tests.test_helm_chart_security import quota_admits

pytestmark = pytest.mark.slow

EVICTION_LABEL = "nvidia.com/gpu.deploy.client"
GKE_LABEL = "cloud.google.com/gke-accelerator"


def _node_keys(spec: dict[str, Any]) -> list[str]:
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    return [e["key"] for term in terms["nodeSelectorTerms"] for e in term["matchExpressions"]]


def _driver_mounts(values: dict[str, Any]) -> tuple[list[Any], list[Any]]:
    volumes = [v for v in pod_spec(values)["volumes"] if v["name"] == "nvidia-driver"]
    mounts = [m for m in container(values)["volumeMounts"] if m["name"] == "nvidia-driver"]
    return volumes, mounts


def test_the_default_platform_is_the_gpu_operator() -> None:
    assert yaml.safe_load((CHART / "values.yaml").read_text())["platform"] == "operator"
    spec = pod_spec({})
    assert spec["runtimeClassName"] == "nvidia"  # created by the Operator
    assert "nodeSelector" not in spec  # the label exists only from Operator v26.7.0
    paused = {"key": EVICTION_LABEL, "operator": "NotIn", "values": ["paused-for-driver-upgrade"]}
    required = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert all(paused in t["matchExpressions"] for t in required["nodeSelectorTerms"])
    assert GKE_LABEL not in _node_keys(spec)
    assert "LD_LIBRARY_PATH" not in env_of({})
    assert container({})["securityContext"]["privileged"] is False
    assert _driver_mounts({}) == ([], [])
    assert not by_kind({}, "ResourceQuota")


def test_gke_mounts_the_hosts_driver_and_opens_the_devices_privileged() -> None:
    values = VALUE_SETS["platform-gke"]
    spec = pod_spec(values)
    assert "runtimeClassName" not in spec  # GKE has no NVIDIA runtime
    assert EVICTION_LABEL not in spec.get("nodeSelector", {})  # nor the Operator's label
    assert _node_keys(spec)[-1] == GKE_LABEL  # ORed with the default terms
    (volume,), (mount,) = _driver_mounts(values)
    assert volume["hostPath"] == {"path": "/home/kubernetes/bin/nvidia", "type": "Directory"}
    assert mount == {"name": "nvidia-driver", "mountPath": "/usr/local/nvidia", "readOnly": True}
    assert env_of(values)["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
    context = container(values)["securityContext"]
    assert context["privileged"] is True
    assert "allowPrivilegeEscalation" not in context  # the API rejects it with privileged
    assert context["capabilities"] == {"drop": ["ALL"]}
    (quota,) = by_kind(values, "ResourceQuota")
    assert quota_admits(spec, NAMESPACE, [quota])


def test_gke_driver_paths_are_values() -> None:
    values = VALUE_SETS["gke-custom-driver"]
    (volume,), (mount,) = _driver_mounts(values)
    assert volume["hostPath"]["path"] == "/var/lib/nvidia"
    assert mount["mountPath"] == "/opt/nvidia"
    assert env_of(values)["LD_LIBRARY_PATH"] == "/opt/nvidia/lib64"


def test_gke_in_kube_system_needs_no_quota() -> None:
    rendered = _loaded(CHART).render(
        {"platform": "gke"}, name=RELEASE, namespace="kube-system", is_install=True
    )
    assert not rendered.get("gpu-occupancy-exporter/templates/priorityclass-quota.yaml", "").strip()


def test_plain_uses_the_default_runtime_and_no_operator_label() -> None:
    values = VALUE_SETS["platform-plain"]
    spec = pod_spec(values)
    assert "runtimeClassName" not in spec
    assert "nodeSelector" not in spec
    assert GKE_LABEL not in _node_keys(spec)
    assert env_of(values)["NVIDIA_VISIBLE_DEVICES"] == "all"  # the toolkit's request
    assert "LD_LIBRARY_PATH" not in env_of(values)
    assert container(values)["securityContext"]["privileged"] is False
    assert _driver_mounts(values) == ([], [])
    assert not by_kind(values, "ResourceQuota")


def test_explicit_values_win_over_the_platform() -> None:
    gke_with_class = {"platform": "gke", "nvidia": {"runtimeClassName": "nvidia-cdi"}}
    assert pod_spec(gke_with_class)["runtimeClassName"] == "nvidia-cdi"
    operator_no_eviction = {"driverUpgradeEviction": {"enabled": False}}
    assert "nodeSelector" not in pod_spec(operator_no_eviction)
    plain_with_eviction = {"platform": "plain", "driverUpgradeEviction": {"enabled": True}}
    assert pod_spec(plain_with_eviction)["nodeSelector"] == {EVICTION_LABEL: "true"}
    gke_no_quota = {"platform": "gke", "priorityClassQuota": {"enabled": False}}
    assert not by_kind(gke_no_quota, "ResourceQuota")


def test_the_gke_example_renders_what_platform_gke_does() -> None:
    """Its explicit lines repeat the platform's picks: the same DaemonSet."""
    example = VALUE_SETS["gke-example"]
    assert example["platform"] == "gke"
    assert by_kind(example, "DaemonSet") == by_kind({"platform": "gke"}, "DaemonSet")
    (quota,) = by_kind(example, "ResourceQuota")
    assert quota["spec"]["hard"] == {"pods": str(example["priorityClassQuota"]["pods"])}


@pytest.mark.parametrize("platform", ["operator", "gke", "plain"])
def test_each_platform_lints_and_its_notes_name_it(platform: str) -> None:
    report = helm.lint(CHART, {"platform": platform}, strict=True, namespace=NAMESPACE)
    assert not report["errors"], report
    notes = render({"platform": platform})["gpu-occupancy-exporter/templates/NOTES.txt"]
    assert f"Platform: {platform}" in notes
    assert "pod-security.kubernetes.io/enforce=privileged" in notes
    assert ("RuntimeClass not found" in notes) == (platform == "operator")


def test_an_unknown_platform_is_refused_with_the_choices() -> None:
    with pytest.raises(helm.HelmValuesError, match="/platform"):
        _loaded(CHART).render({"platform": "eks"}, name=RELEASE, namespace=NAMESPACE)


# -- the dashboards' job selector -------------------------------------------------------

FILE_JOB = 'job=~".*gpu-occupancy-exporter.*"'


def _boards(selector: str) -> dict[str, str]:
    """Dashboard file name -> the JSON text the chart ships, with this job selector."""
    values = {"dashboards": {"enabled": True}, "prometheusRule": {"jobSelector": selector}}
    data: dict[str, str] = {}
    for config_map in by_kind(values, "ConfigMap"):
        data.update(config_map["data"])
    return data


def test_dashboards_get_the_charts_job_selector() -> None:
    selector = 'job="gpu-telemetry",namespace="gpu-monitoring"'
    boards = {name: json.loads(text) for name, text in _boards(selector).items()}
    with_job = 0
    for name, board in boards.items():
        text = json.dumps(board)
        assert FILE_JOB not in text, f"{name} keeps the file's job selector"
        variables = {v["name"]: v for v in board["templating"]["list"]}
        if "job" in variables:
            with_job += 1
            assert variables["job"]["query"] == f"label_values(up{{{selector}}}, job)", name
    assert with_job >= 3  # every per-node dashboard (the fleet one's series carry no job)
    orphans = json.dumps(boards["gpu-health-orphans.json"])
    assert json.dumps(f"avg(up{{{selector}, ")[1:-1] in orphans


def test_dashboards_keep_a_selector_with_backslashes_valid_json() -> None:
    selector = 'job=~"gpu\\\\.exporter.*"'  # PromQL: job=~"gpu\\.exporter.*"
    for board_text in _boards(selector).values():
        board = json.loads(board_text)  # still JSON
        for v in board["templating"]["list"]:
            if v["name"] == "job":
                assert v["query"] == f"label_values(up{{{selector}}}, job)"
