"""The Helm chart, rendered and linted by real Helm, against the Kubernetes API schemas.

Helm runs in-process through ``helm-python-sdk`` (Helm's Go SDK as a shared library, no
``helm`` binary); built-in kinds are validated with ``kubernetes-validate`` (the API's
OpenAPI schemas, strict: unknown fields fail) for the oldest Kubernetes the chart
supports and the newest the package knows. The Prometheus Operator kinds have no schema
there: they are checked against a subset of their CRD schemas written below (the fields
the chart uses, unknown fields rejected, since the API server would silently prune them).
"""

from __future__ import annotations

import copy
import filecmp
import functools
import json
import re
import shutil
import subprocess
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from exporter.config import parse_config
from exporter.exposition.server import MetricsCache, build_app
from exporter.model import DEFAULT_SLOW_INTERVAL_S, DcgmMode
from exporter.model.families import select_families
from tests.test_alert_rules import CHART_RECORDED, referenced_metrics, run_promtool
from tests.test_helm_chart_alertmanager import ALERTMANAGER_CONFIG_SCHEMA

# ~250 chart renderings and API-schema validations (~16 s): the slow tier.
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "charts" / "gpu-occupancy-exporter"
SYNC_SCRIPT = ROOT / "charts" / "sync-files.sh"
RELEASE, NAMESPACE = "gpu", "gpu-monitoring"
FULLNAME = "gpu-gpu-occupancy-exporter"
KUBE_VERSIONS = ("1.25", kubernetes_validate.utils.latest_version())
DEFAULTS: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
SCHEMA: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())

# -- value sets: every value in values.yaml is changed by at least one of them ----------

# GPU models as gpu_info names them (alerts/tests/chargeback.test.yaml uses these two)
H100, A100 = "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-40GB"
# bcrypt("s3cret-scrape", cost 4): a real hash the exporter verifies
BCRYPT_HASH = "$2y$04$ApQcAfQRo6IFv80Z0R/i5Oiw2ZqqFGIl7LiexMPBNqTCT0DjmhkAm"
SCRAPE_PASSWORD = "s3cret-scrape"
RELABEL_JOB = {"sourceLabels": ["__meta_kubernetes_namespace"], "targetLabel": "cluster_ns"}
DROP_PER_PROCESS = {"sourceLabels": ["__name__"], "regex": "gpu_process_.*", "action": "drop"}
VALUE_SETS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "monitoring": {
        "serviceMonitor": {
            "enabled": True,
            "labels": {"release": "kube-prometheus-stack"},
            "interval": "30s",
            "scrapeTimeout": "10s",
            "honorLabels": False,
            "relabelings": [RELABEL_JOB],
            "metricRelabelings": [DROP_PER_PROCESS],
        },
        "podMonitor": {
            "enabled": True,
            "labels": {"release": "kube-prometheus-stack"},
            "interval": "1m",
            "scrapeTimeout": "15s",
            "honorLabels": False,
            "relabelings": [RELABEL_JOB],
            "metricRelabelings": [DROP_PER_PROCESS],
        },
        "prometheusRule": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}},
        "dashboards": {
            "enabled": True,
            "label": "grafana_dashboard_gpu",
            "labelValue": "yes",
            "namespace": "grafana",
            "annotations": {"grafana_folder": "GPUs"},
        },
    },
    "kube-api-off": {"kubeApi": "off"},
    "kube-api-off-unquoted-yaml": {"kubeApi": False},
    "dcgm-exporter-compat": {"prometheusRule": {"enabled": True, "dcgmExporterCompat": True}},
    # docs/alerting.md: routing labels on every alert, the AlertmanagerConfig with every
    # receiver kind (tests/test_helm_chart_alertmanager.py checks them in detail)
    "alertmanager-config": {
        "prometheusRule": {
            "enabled": True,
            "alertLabels": {"team": "gpu-platform", "cluster": "prod"},
        },
        "alertmanagerConfig": {
            "enabled": True,
            "labels": {"alertmanagerConfig": "gpu"},
            "receivers": {
                name: {
                    "webhookUrl": f"https://{name.lower()}.example.com/hook",
                    "pagerdutySecret": {"name": f"gpu-{name.lower()}", "key": "integration-key"},
                }
                for name in ("pager", "ticket", "lowNoise")
            },
        },
    },
    "alertmanager-config-no-namespace-label": {
        "prometheusRule": {"enabled": True},
        "alertmanagerConfig": {
            "enabled": True,
            "namespaceLabel": False,
            "receivers": {"pager": {"webhookUrl": "https://pager.example.com/hook"}},
        },
    },
    "chargeback-prices": {
        "prometheusRule": {"enabled": True},
        "chargeback": {"pricePerGpuHour": {H100: 2.5, A100: 1.25}},
    },
    "custom-runtime-class": {
        "nvidia": {
            "runtimeClassName": "nvidia-cdi",
            "visibleDevices": "GPU-0,GPU-1",
            "driverCapabilities": "utility,compute",
        }
    },
    "no-runtime-class": {"nvidia": {"runtimeClassName": ""}},
    "flags-and-extras": {
        "image": {
            "repository": "registry.example/gpu/exporter",
            "tag": "0.1.0-rc1",
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "registry-creds"}],
        "port": 9500,
        "interval": 2.5,
        "slowInterval": 60,
        "livenessCycles": 20,
        "podResourcesInterval": 20,
        "perProcessMetrics": True,
        "families": {"disable": ["gpu_clock_event_*", "gpu_fp*"], "enable": ["gpu_fp64_*"]},
        "resourceNames": ["nvidia.com/gpu", "nvidia.com/mig-*"],
        "logLevel": "debug",
        "logFormat": "text",
        "dcgm": {"mode": "127.0.0.1:5555", "bindingsPath": "/usr/local/dcgm/bindings/python3"},
        "extraArgs": ["--idle-threshold=0.1", "--xid-severity=13=fatal"],
        "extraEnv": [
            {"name": "GPU_EXPORTER_HEALTH_XID_WINDOW", "value": "7200"},
            {"name": "TZ", "value": "UTC"},
        ],
        "hostProc": {"hostPath": "/host-root/proc", "mountPath": "/hostproc"},
        "hostCgroup": {"hostPath": "/host-root/sys/fs/cgroup", "mountPath": "/hostcgroup"},
        "podResources": {"hostPath": "/var/lib/k0s/kubelet/pod-resources"},
        "gpuNodeSelectorTerms": [
            {"matchExpressions": [{"key": "gpu", "operator": "Exists"}]},
        ],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 1,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app": "other-exporter"}},
                        },
                    }
                ]
            }
        },
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"operator": "Exists"}],
        "priorityClassName": "",
        "updateStrategy": {"type": "RollingUpdate", "rollingUpdate": {"maxUnavailable": "20%"}},
        "terminationGracePeriodSeconds": 30,
        "podSecurityContext": {
            "runAsUser": 65534,
            "runAsGroup": 65534,
            "runAsNonRoot": True,
            "seccompProfile": {"type": "Localhost", "localhostProfile": "gpu.json"},
        },
        "securityContext": {
            "allowPrivilegeEscalation": True,
            "readOnlyRootFilesystem": False,
            "privileged": True,
            "capabilities": {"drop": ["NET_RAW"]},
        },
        "resources": {
            "requests": {"cpu": "50m", "memory": "160Mi"},
            "limits": {"cpu": "1", "memory": "512Mi"},
        },
        "livenessProbe": {
            "httpGet": {"path": "/metrics", "port": 9500},
            "initialDelaySeconds": 15,
            "periodSeconds": 30,
            "timeoutSeconds": 3,
            "failureThreshold": 5,
        },
        "readinessProbe": {
            "httpGet": {"path": "/metrics", "port": 9500},
            "periodSeconds": 5,
            "timeoutSeconds": 2,
            "failureThreshold": 6,
        },
        "podAnnotations": {"example.com/owner": "gpu-team"},
        "podLabels": {"team": "gpu"},
        "extraVolumes": [{"name": "dcgm", "hostPath": {"path": "/usr/local/dcgm"}}],
        "extraVolumeMounts": [{"name": "dcgm", "mountPath": "/usr/local/dcgm", "readOnly": True}],
        "service": {
            "type": "NodePort",
            "port": 19445,
            "annotations": {"example.com/scrape": "false"},
            "labels": {"exposed": "yes"},
        },
    },
    "digest-and-names": {
        "image": {"digest": "sha256:" + "ab" * 32},
        "nameOverride": "gpux",
        "fullnameOverride": "gpu-telemetry",
    },
    "network-policy": {
        "networkPolicy": {
            "enabled": True,
            "allowedNamespaces": ["monitoring", "observability"],
            "allowedPodLabels": {"app.kubernetes.io/name": "prometheus"},
            "extraFrom": [{"ipBlock": {"cidr": "10.0.0.0/8"}}],
        }
    },
    "network-policy-closed": {
        "networkPolicy": {"enabled": True, "allowedNamespaces": [], "allowedPodLabels": {}}
    },
    "kmsg": {"kmsg": {"enabled": True}},
    "holder-scan-ptrace": {"holderScan": {"sysPtrace": True}},
    "kmsg-unprivileged": {"kmsg": {"enabled": True, "privileged": False}},
    "no-dra-rbac": {"rbac": {"dra": False}},
    "existing-service-account": {
        "serviceAccount": {"create": False, "name": "gpu-reader"},
        "rbac": {"create": False},
    },
    "annotated-service-account": {
        "serviceAccount": {"name": "gpu-exporter", "annotations": {"example.com/role": "r"}}
    },
    "pod-monitor-without-service": {"service": {"enabled": False}, "podMonitor": {"enabled": True}},
    "on-delete-updates": {"updateStrategy": {"type": "OnDelete", "rollingUpdate": None}},
    "plain-cluster": {"driverUpgradeEviction": {"enabled": False}},
    "operator-26-7": {"gpuOperator": {"version": "v26.7.0"}},
    # -- platforms (tests/test_helm_chart_platforms.py checks what each one needs)
    "platform-gke": {"platform": "gke"},
    "platform-plain": {"platform": "plain"},
    "gke-custom-driver": {
        "platform": "gke",
        "gke": {"driverHostPath": "/var/lib/nvidia", "driverMountPath": "/opt/nvidia"},
    },
    "gke-example": yaml.safe_load((CHART / "examples" / "gke-values.yaml").read_text()),
    "custom-eviction-label": {
        "driverUpgradeEviction": {"enabled": True, "nodeLabel": "example.com/gpu-clients"},
        "nodeSelector": {"kubernetes.io/os": "linux"},
    },
    "mig-monitoring": {"migMonitoring": {"enabled": True}},
    "dcgm-auto-operator": {
        "dcgm": {"mode": "auto", "operatorNamespace": "gpu-ops,nvidia-gpu-operator"}
    },
    # tests/test_helm_chart_dcgm.py: the dcgm-bindings init container
    "dcgm-image-paths": {
        "dcgm": {
            "bindingsImage": {
                "repository": "registry.example.com/nvidia/dcgm",
                "tag": "4.2.3-1-ubuntu22.04",
                "pullPolicy": "Always",
                "bindingsDir": "/opt/dcgm/python3 /opt/dcgm3/python3",
                "libraryDir": "/opt/dcgm/lib",
            }
        }
    },
    "dcgm-no-bindings-image": {"dcgm": {"bindingsImage": {"enabled": False}}},
    "dcgm-image-digest": {"dcgm": {"bindingsImage": {"digest": "sha256:" + "ab" * 32}}},
    "operator-24-9": {"gpuOperator": {"version": "24.9.2"}},
    # tests/test_helm_chart_doctor.py
    "doctor-enforced": {
        "doctor": {"initContainer": {"enabled": True, "enforce": True, "timeout": 30}}
    },
    # tests/test_helm_chart_gmp.py: Google Managed Prometheus
    "gmp-pod-monitoring": {
        "googleManagedPrometheus": {"podMonitoring": {"enabled": True}, "interval": "15s"}
    },
    "gmp-cluster-pod-monitoring-secured": {
        "tls": {"enabled": True, "secretName": "gpu-exporter-tls"},
        "basicAuth": {"users": {"prometheus": BCRYPT_HASH}},
        "googleManagedPrometheus": {
            "clusterPodMonitoring": {"enabled": True},
            "timeout": "10s",
            "basicAuth": {
                "username": "prometheus",
                "secretName": "gmp-scrape",
                "passwordKey": "pass",
            },
        },
    },
    "gmp-behind-kube-rbac-proxy": {
        "tls": {"enabled": True, "secretName": "gpu-exporter-tls"},
        "kubeRbacProxy": {"enabled": True},
        "googleManagedPrometheus": {
            "podMonitoring": {"enabled": True},
            "bearerToken": {"secretName": "gmp-token", "key": "t"},
        },
    },
    # -- securing /metrics (tests/test_helm_chart_security.py serves what these render)
    "tls-basic-auth": {
        "tls": {"enabled": True, "secretName": "gpu-exporter-tls", "minVersion": "TLS13"},
        "basicAuth": {"users": {"prometheus": BCRYPT_HASH}},
        "webConfig": {"headers": {"X-Content-Type-Options": "nosniff"}},
        "serviceMonitor": {
            "enabled": True,
            "basicAuth": {
                "secretName": "prometheus-scrape",
                "usernameKey": "user",
                "passwordKey": "pass",
            },
            "tlsConfig": {"serverName": "gpu-exporter.example.internal"},
        },
        "podMonitor": {
            "enabled": True,
            "basicAuth": {
                "secretName": "prometheus-scrape",
                "usernameKey": "pod-user",
                "passwordKey": "pod-pass",
            },
            "tlsConfig": {"ca": {"configMap": {"name": "gpu-ca", "key": "ca.crt"}}},
        },
    },
    "mtls": {
        "tls": {
            "enabled": True,
            "secretName": "gpu-exporter-tls",
            "clientAuthType": "RequireAndVerifyClientCert",
            "clientCASecretName": "scraper-ca",
            "clientAllowedSans": ["prometheus.monitoring"],
        },
        "serviceMonitor": {
            "enabled": True,
            "tlsConfig": {
                "cert": {"secret": {"name": "prometheus-client", "key": "tls.crt"}},
                "keySecret": {"name": "prometheus-client", "key": "tls.key"},
            },
        },
    },
    "existing-web-config": {
        "tls": {"enabled": True, "secretName": "gpu-exporter-tls"},
        "webConfig": {"existingSecret": "gpu-web-config", "existingSecretKey": "web.yml"},
    },
    "kube-rbac-proxy": {
        "kubeApi": "off",
        "tls": {"enabled": True, "secretName": "gpu-exporter-tls"},
        "kubeRbacProxy": {
            "enabled": True,
            "image": {
                "repository": "registry.example/kube-rbac-proxy",
                "tag": "v0.20.2",
                "pullPolicy": "Always",
            },
            "upstreamPort": 19446,
            "allowedServiceAccounts": [{"namespace": "monitoring", "name": "prometheus-k8s"}],
            "resources": {
                "requests": {"cpu": "10m", "memory": "32Mi"},
                "limits": {"cpu": "200m", "memory": "128Mi"},
            },
            "extraArgs": ["--auth-token-audiences=gpu-exporter"],
        },
        "serviceMonitor": {"enabled": True},
    },
    "kube-rbac-proxy-token-secrets": {
        "tls": {"enabled": True, "secretName": "gpu-exporter-tls"},
        "kubeRbacProxy": {"enabled": True, "image": {"digest": "sha256:" + "cd" * 32}},
        "serviceMonitor": {
            "enabled": True,
            "bearerToken": {"secretName": "gpu-scraper-token", "key": "jwt"},
        },
        "podMonitor": {
            "enabled": True,
            "bearerToken": {"secretName": "gpu-scraper-token", "key": "pod-jwt"},
        },
    },
    # -- alert parameters and scheduling
    "rule-parameters": {
        "prometheusRule": {
            "enabled": True,
            "runbookUrlBase": "https://wiki.example.com/gpu/runbooks",
            "jobSelector": 'job=~".*gpu-telemetry.*"',
        },
        "fullnameOverride": "gpu-telemetry",
    },
    "tolerate-all": {"tolerateAll": True},
    "gke-priority-quota": {"priorityClassQuota": {"enabled": True, "pods": 500}},
    # -- what the exporter writes to Kubernetes
    "no-kube-events": {"kubeEvents": {"enabled": False}},
    "no-host-cgroup": {"hostCgroup": {"enabled": False}},
    "node-condition": {"nodeCondition": {"enabled": True}},
    "dra-device-taints": {"draDeviceTaints": {"enabled": True}},
    "dra-device-taints-no-schedule": {
        "draDeviceTaints": {"enabled": True, "effect": "NoSchedule"},
        "nodeCondition": {"enabled": True},
    },
    "kube-writes-shadow": {
        "kubeWrites": {"mode": "shadow"},
        "nodeCondition": {"enabled": True},
        "draDeviceTaints": {"enabled": True},
    },
    "kube-writes-shadow-kinds": {
        "kubeWrites": {"mode": "shadow", "shadowKinds": ["node_condition", "device_taint_rule"]},
        "nodeCondition": {"enabled": True},
    },
    "kube-writes-own-rbac": {
        "nodeCondition": {"enabled": True},
        "serviceAccount": {"create": False, "name": "gpu-writer"},
        "rbac": {"create": False},
    },
}

# -- minimal Prometheus Operator schemas (monitoring.coreos.com/v1, the fields we use) ---

DURATION = {
    "type": "string",
    "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$",
}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
RELABEL = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "sourceLabels": {
            "type": "array",
            "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"},
        },
        "separator": {"type": "string"},
        "targetLabel": {"type": "string"},
        "regex": {"type": "string"},
        "modulus": {"type": "integer"},
        "replacement": {"type": "string"},
        "action": {
            "enum": [
                *("replace", "keep", "drop", "hashmod", "labelmap", "labeldrop", "labelkeep"),
                *("lowercase", "uppercase", "keepequal", "dropequal"),
                *("Replace", "Keep", "Drop", "HashMod", "LabelMap", "LabelDrop", "LabelKeep"),
                *("Lowercase", "Uppercase", "KeepEqual", "DropEqual"),
            ]
        },
    },
}
SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"matchLabels": STRING_MAP, "matchExpressions": {"type": "array"}},
}
NAMESPACE_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "any": {"type": "boolean"},
        "matchNames": {"type": "array", "items": {"type": "string"}},
    },
}
# Scrape security (pkg/apis/monitoring/v1: Endpoint in types.go, HTTPConfig in
# http_config.go, SafeTLSConfig in tls_types.go, BasicAuth, SecretOrConfigMap in types.go,
# SafeAuthorization in prometheus_types.go).
KEY_SELECTOR = {
    "type": "object",
    "additionalProperties": False,
    "required": ["key"],
    "properties": {"name": {"type": "string"}, "key": {"type": "string"}, "optional": {}},
}
SECRET_OR_CONFIG_MAP = {
    "type": "object",
    "additionalProperties": False,
    "properties": {"secret": KEY_SELECTOR, "configMap": KEY_SELECTOR},
    "not": {"required": ["secret", "configMap"]},
}
TLS_VERSION = {"enum": ["TLS10", "TLS11", "TLS12", "TLS13"]}
SAFE_TLS_CONFIG = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "ca": SECRET_OR_CONFIG_MAP,
        "cert": SECRET_OR_CONFIG_MAP,
        "keySecret": KEY_SELECTOR,
        "serverName": {"type": "string"},
        "insecureSkipVerify": {"type": "boolean"},
        "minVersion": TLS_VERSION,
        "maxVersion": TLS_VERSION,
    },
}
HTTP_CONFIG = {
    "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
    "tlsConfig": SAFE_TLS_CONFIG,
    "basicAuth": {
        "type": "object",
        "additionalProperties": False,
        "properties": {"username": KEY_SELECTOR, "password": KEY_SELECTOR},
    },
    "authorization": {
        "type": "object",
        "additionalProperties": False,
        "properties": {"type": {"type": "string"}, "credentials": KEY_SELECTOR},
    },
}
POD_METRICS_ENDPOINT: dict[str, Any] = {
    "type": "object",
    "additionalProperties": False,
    "required": ["port"],
    # "Cannot be set at the same time as `basicAuth`..." (http_config.go)
    "not": {"required": ["basicAuth", "authorization"]},
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": DURATION,
        "scrapeTimeout": DURATION,
        "honorLabels": {"type": "boolean"},
        "relabelings": {"type": "array", "items": RELABEL},
        "metricRelabelings": {"type": "array", "items": RELABEL},
        **HTTP_CONFIG,
    },
}
# A ServiceMonitor endpoint also has bearerTokenFile (deprecated; PodMonitor has none).
ENDPOINT = {
    **POD_METRICS_ENDPOINT,
    "properties": {
        **POD_METRICS_ENDPOINT["properties"],
        "bearerTokenFile": {"type": "string", "pattern": "^/"},
    },
}
METADATA = {
    "type": "object",
    "required": ["name", "namespace"],
    "properties": {"name": {"type": "string"}, "labels": STRING_MAP},
}


def _crd(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"type": "string"},
            "metadata": METADATA,
            "spec": spec,
        },
    }


RULE = {
    "type": "object",
    "additionalProperties": False,
    "required": ["expr"],
    "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
    "properties": {
        "alert": {"type": "string"},
        "record": {"type": "string"},
        "expr": {"type": ["string", "integer"]},
        "for": DURATION,
        "keep_firing_for": DURATION,
        "labels": STRING_MAP,
        "annotations": STRING_MAP,
    },
}
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "ServiceMonitor": _crd(
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "endpoints"],
            "properties": {
                "selector": SELECTOR,
                "namespaceSelector": NAMESPACE_SELECTOR,
                "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT},
            },
        }
    ),
    "PodMonitor": _crd(
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["selector", "podMetricsEndpoints"],
            "properties": {
                "selector": SELECTOR,
                "namespaceSelector": NAMESPACE_SELECTOR,
                "podMetricsEndpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": POD_METRICS_ENDPOINT,
                },
            },
        }
    ),
    "PrometheusRule": _crd(
        {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "groups": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "required": ["name", "rules"],
                        "properties": {
                            "name": {"type": "string", "minLength": 1},
                            "interval": DURATION,
                            "query_offset": DURATION,
                            "limit": {"type": "integer"},
                            "labels": STRING_MAP,
                            "rules": {"type": "array", "items": RULE},
                        },
                    },
                }
            },
        }
    ),
}


def _gmp_secret(namespaced: bool) -> dict[str, Any]:
    """GMP's SecretSelector: a PodMonitoring may not name a namespace (pod_types.go,
    "Namespace not allowed on PodMonitoring secret references")."""
    ref: dict[str, Any] = {"name": {"type": "string"}, "key": {"type": "string"}}
    if not namespaced:
        ref["namespace"] = {"type": "string"}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["secret"],
        "properties": {
            "secret": {
                "type": "object",
                "additionalProperties": False,
                "required": ["key", "name"],
                "properties": ref,
            }
        },
    }


def _gmp_crd(kind: str) -> dict[str, Any]:
    """A subset of prometheus-engine's monitoring.googleapis.com/v1 PodMonitoring and
    ClusterPodMonitoring schemas (charts/operator/crds/, pod_types.go at 2ffde4e): the
    fields the chart renders, unknown ones refused, a timeout needing an interval."""
    namespaced = kind == "PodMonitoring"
    secret = _gmp_secret(namespaced)
    metadata_keys = ["container", "node", "pod", "top_level_controller_name"]
    metadata_keys += ["top_level_controller_type"] + ([] if namespaced else ["namespace"])
    endpoint = {
        "type": "object",
        "additionalProperties": False,
        "required": ["interval", "port"],
        "properties": {
            "port": {"type": ["string", "integer"], "minLength": 1},
            "path": {"type": "string"},
            "interval": DURATION,
            "timeout": DURATION,
            "scheme": {"enum": ["http", "https"]},
            "tls": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "ca": secret,
                    "cert": secret,
                    "key": secret,
                    "serverName": {"type": "string"},
                    "insecureSkipVerify": {"type": "boolean"},
                    "minVersion": {"type": "string"},
                    "maxVersion": {"type": "string"},
                },
            },
            "basicAuth": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"username": {"type": "string"}, "password": secret},
            },
            "authorization": {
                "type": "object",
                "additionalProperties": False,
                "properties": {"type": {"type": "string"}, "credentials": secret},
            },
        },
        # at most one of basicAuth, authorization (and oauth2)
        "not": {"required": ["basicAuth", "authorization"]},
    }
    metadata: dict[str, Any] = {"type": "object", "required": ["name"]}
    metadata["properties"] = {"name": {"type": "string"}, "labels": STRING_MAP}
    if namespaced:
        metadata["required"] = ["name", "namespace"]
    else:
        metadata["not"] = {"required": ["namespace"]}
    return {
        "type": "object",
        "additionalProperties": False,
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {
            "apiVersion": {"const": "monitoring.googleapis.com/v1"},
            "kind": {"const": kind},
            "metadata": metadata,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "required": ["endpoints", "selector"],
                "properties": {
                    "selector": SELECTOR,
                    "endpoints": {"type": "array", "minItems": 1, "items": endpoint},
                    "targetLabels": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "metadata": {
                                "type": "array",
                                "uniqueItems": True,
                                "items": {"enum": metadata_keys},
                            },
                            "fromPod": {"type": "array", "maxItems": 100},
                        },
                    },
                },
            },
        },
    }


CRD_SCHEMAS["PodMonitoring"] = _gmp_crd("PodMonitoring")
CRD_SCHEMAS["ClusterPodMonitoring"] = _gmp_crd("ClusterPodMonitoring")
CRD_SCHEMAS["AlertmanagerConfig"] = ALERTMANAGER_CONFIG_SCHEMA

# -- sample alert and dashboard files, for a chart whose files/ content is known --------

SAMPLE_RULES = {
    "a-sample.rules.yaml": """\
groups:
  - name: sample.alerts
    rules:
      - alert: SampleGPUDown
        expr: gpu_up == 0
        for: 5m
        labels:
          severity: critical
        annotations:
          summary: GPU {{ $labels.gpu }} on {{ with $labels.node }}{{ . }}{{ end }} is down
          runbook_url: https://github.com/gpu-occupancy-exporter/gpu-occupancy-exporter/blob/main/docs/runbooks.md#samplegpudown
      - alert: SampleExporterDown
        expr: up{job=~".*gpu-occupancy-exporter.*"} == 0
        annotations:
          runbook_url: https://runbooks.example.org/other#kept
""",
    "b-sample.recording.yaml": """\
groups:
  - name: sample.recording
    interval: 1m
    rules:
      - record: node:gpu_utilization_ratio:avg
        expr: avg by (node, instance) (gpu_utilization_ratio)
""",
}
SAMPLE_DASHBOARDS = {
    "gpu_overview.json": json.dumps(
        {"title": "GPU {{ overview }}", "panels": [{"expr": 'sum(gpu_up{node="$node"})'}]},
        indent=2,
    )
    + "\n",
    "Pods.json": '{"title": "Pods"}',
}


def _chart_copy(tmp: Path, rules: dict[str, str], dashboards: dict[str, str]) -> Path:
    chart = tmp / "gpu-occupancy-exporter"
    shutil.copytree(CHART, chart)
    for sub, files in (("alerts", rules), ("dashboards", dashboards)):
        target = chart / "files" / sub
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        for name, text in files.items():
            (target / name).write_text(text)
    return chart


@pytest.fixture(scope="session")
def sample_chart(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The chart with the sample alert rules and dashboards in place of the repo's."""
    return _chart_copy(tmp_path_factory.mktemp("sample"), SAMPLE_RULES, SAMPLE_DASHBOARDS)


# -- rendering --------------------------------------------------------------------------


@functools.cache
def _loaded(path: Path) -> helm.Chart:
    return helm.Chart.load(path)


@functools.cache
def _render_cached(path: Path, values_json: str) -> tuple[tuple[str, str], ...]:
    manifests = _loaded(path).render(
        json.loads(values_json), name=RELEASE, namespace=NAMESPACE, is_install=True
    )
    return tuple(sorted(manifests.items()))


def render(values: dict[str, Any], chart: Path = CHART) -> dict[str, str]:
    """Template path -> rendered text, as `helm template` would print it."""
    return dict(_render_cached(chart, json.dumps(values, sort_keys=True)))


def objects(values: dict[str, Any], chart: Path = CHART) -> list[dict[str, Any]]:
    """Every rendered Kubernetes object (NOTES.txt left out)."""
    found: list[dict[str, Any]] = []
    for path, text in render(values, chart).items():
        if path.endswith("NOTES.txt"):
            continue
        found.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return found


def by_kind(values: dict[str, Any], kind: str, chart: Path = CHART) -> list[dict[str, Any]]:
    return [o for o in objects(values, chart) if o["kind"] == kind]


def one(values: dict[str, Any], kind: str, chart: Path = CHART) -> dict[str, Any]:
    found = by_kind(values, kind, chart)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def pod_spec(values: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = one(values, "DaemonSet")["spec"]["template"]["spec"]
    return spec


def containers(values: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The pod's containers by name: the exporter, and kube-rbac-proxy when enabled."""
    found = {c["name"]: c for c in pod_spec(values)["containers"]}
    assert set(found) <= {"exporter", "kube-rbac-proxy"}, found.keys()
    return found


def container(values: dict[str, Any]) -> dict[str, Any]:
    return containers(values)["exporter"]


def env_of(values: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(values)["env"]}


def rule_groups(directory: Path) -> list[dict[str, Any]]:
    """Groups of every rule file in the directory, in Helm's (sorted) file order."""
    groups: list[dict[str, Any]] = []
    for path in sorted(directory.glob("*.yaml")):
        groups.extend(yaml.safe_load(path.read_text())["groups"])
    return groups


ALL_SETS = pytest.mark.parametrize("name", sorted(VALUE_SETS))

# -- lint, render, validate ------------------------------------------------------------


def test_helm_sdk_is_helm_v4_and_loads_the_chart() -> None:
    assert helm.helm_sdk_version().startswith("v4.")
    chart = _loaded(CHART)
    assert chart.name == "gpu-occupancy-exporter"
    assert chart.values == DEFAULTS


def test_chart_app_version_is_the_package_version() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    metadata = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert metadata["appVersion"] == pyproject["project"]["version"]
    assert one({}, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["image"] == (
        f"gpu-occupancy-exporter:{pyproject['project']['version']}"
    )


@ALL_SETS
def test_chart_lints_without_warnings(name: str) -> None:
    report = helm.lint(CHART, VALUE_SETS[name], strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@ALL_SETS
@pytest.mark.parametrize("which", ["repo-files", "sample-files"])
def test_every_rendered_object_is_valid_for_the_kubernetes_api(
    name: str, which: str, sample_chart: Path
) -> None:
    chart = CHART if which == "repo-files" else sample_chart
    rendered = objects(VALUE_SETS[name], chart)
    assert rendered
    for obj in rendered:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in CRD_SCHEMAS:
            jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
            continue
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                path = ".".join(str(p) for p in exc.path)
                pytest.fail(f"{where} is invalid for Kubernetes {version}: {path}: {exc.message}")
        if obj["kind"] != "ClusterRole" and obj["kind"] != "ClusterRoleBinding":
            assert obj["metadata"]["namespace"] in (NAMESPACE, "grafana"), where


def test_crd_subset_schemas_reject_unknown_fields() -> None:
    monitor = copy.deepcopy(one(VALUE_SETS["monitoring"], "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["scrapeInterval"] = "30s"  # not a field: pruned silently
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, CRD_SCHEMAS["ServiceMonitor"])


@ALL_SETS
def test_rendered_flags_are_accepted_by_the_exporter(name: str) -> None:
    values = VALUE_SETS[name]
    env = {k: v for k, v in env_of(values).items() if isinstance(v, str)}
    env["NODE_NAME"] = "gpu-node-1"  # the downward API's spec.nodeName
    config = parse_config(container(values)["args"], env)
    merged = _loaded(CHART).merge_values(values)
    assert config.node_name == "gpu-node-1"
    if merged["kubeRbacProxy"]["enabled"]:  # behind the proxy: loopback only
        assert config.listen_host == "127.0.0.1"
        assert config.listen_port == merged["kubeRbacProxy"]["upstreamPort"]
    else:
        assert config.listen_host == "" and config.listen_port == merged["port"]
    assert config.interval_s == merged["interval"]
    # an empty slowInterval passes no flag: the exporter's default, or a longer interval
    slow = merged["slowInterval"] or max(DEFAULT_SLOW_INTERVAL_S, merged["interval"])
    assert config.slow_interval_s == slow
    assert config.liveness_cycles == merged["livenessCycles"]
    assert config.pod_resources_interval_s == merged["podResourcesInterval"]
    assert str(config.proc_root) == merged["hostProc"]["mountPath"]
    cgroup = merged["hostCgroup"]
    assert config.cgroup_root == (Path(cgroup["mountPath"]) if cgroup["enabled"] else None)
    assert config.kube_api == ("off" if merged["kubeApi"] in ("off", False) else "auto")
    assert config.per_process_metrics is merged["perProcessMetrics"]
    assert config.families == select_families(
        ",".join(merged["families"]["enable"]),
        ",".join(merged["families"]["disable"]),
        per_process=merged["perProcessMetrics"],
    )
    assert config.log_format == merged["logFormat"] and config.log_level == merged["logLevel"]
    assert config.kmsg is merged["kmsg"]["enabled"]
    assert config.kube_events == ("auto" if merged["kubeEvents"]["enabled"] else "off")
    assert config.node_condition is merged["nodeCondition"]["enabled"]
    assert config.dra_device_taints is merged["draDeviceTaints"]["enabled"]
    if config.dra_device_taints:
        assert config.dra_device_taint_effect == merged["draDeviceTaints"]["effect"]
    writes = merged["kubeWrites"]
    shadowed = set(writes["shadowKinds"] or ("event", "node_condition", "device_taint_rule"))
    assert config.kube_writes_shadow == (shadowed if writes["mode"] == "shadow" else set())
    mounts = {m["mountPath"] for m in container(values)["volumeMounts"]}
    assert str(config.pod_resources_socket.parent) in mounts
    if merged["resourceNames"]:
        assert list(config.resource_names) == merged["resourceNames"]


def test_slow_interval_is_passed_when_set_and_refused_below_the_interval() -> None:
    assert not any(a.startswith("--slow-interval") for a in container({})["args"])
    assert "--slow-interval=5" in container({"slowInterval": 5})["args"]
    with pytest.raises(
        helm.HelmRenderError,
        match=r"slowInterval 2 is shorter than interval 5: .* set slowInterval to 5 or more",
    ):
        render({"slowInterval": 2, "interval": 5})


def test_extra_args_come_last_and_extra_env_is_passed() -> None:
    values = VALUE_SETS["flags-and-extras"]
    args = container(values)["args"]
    assert args[-2:] == values["extraArgs"]
    env = env_of(values)
    assert env["GPU_EXPORTER_HEALTH_XID_WINDOW"] == "7200" and env["TZ"] == "UTC"
    config = parse_config(args, {"NODE_NAME": "n", "GPU_EXPORTER_HEALTH_XID_WINDOW": "7200"})
    assert config.idle_threshold == 0.1 and config.health_xid_window_s == 7200
    assert config.dcgm == DcgmMode("hostengine", "127.0.0.1:5555")
    assert config.dcgm_bindings_path == "/usr/local/dcgm/bindings/python3"


# -- host access, security, probes --------------------------------------------------------


def test_daemonset_shares_the_host_pid_namespace() -> None:
    for name, values in VALUE_SETS.items():
        assert pod_spec(values)["hostPID"] is True, name


def test_host_proc_and_pod_resources_are_mounted_read_only() -> None:
    spec, main = pod_spec({}), container({})
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert volumes["host-proc"]["hostPath"]["path"] == "/proc"
    assert mounts["host-proc"] == {"name": "host-proc", "mountPath": "/host/proc", "readOnly": True}
    assert "--proc-root=/host/proc" in main["args"]
    assert volumes["pod-resources"]["hostPath"]["path"] == "/var/lib/kubelet/pod-resources"
    assert mounts["pod-resources"]["mountPath"] == "/var/lib/kubelet/pod-resources"
    assert mounts["pod-resources"]["readOnly"] is True
    assert "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock" in main["args"]


def test_host_cgroup_is_mounted_read_only_and_passed_or_turned_off() -> None:
    """--cgroup-root (docs/why-idle.md): the host's /sys/fs/cgroup read-only by default;
    hostCgroup.enabled false mounts nothing and turns the source off, never leaving the
    exporter to read the container's own /sys/fs/cgroup."""
    spec, main = pod_spec({}), container({})
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["name"]: m for m in main["volumeMounts"]}
    assert volumes["host-cgroup"]["hostPath"] == {"path": "/sys/fs/cgroup", "type": "Directory"}
    assert mounts["host-cgroup"] == {
        "name": "host-cgroup",
        "mountPath": "/host/sys/fs/cgroup",
        "readOnly": True,
    }
    assert "--cgroup-root=/host/sys/fs/cgroup" in main["args"]
    assert str(parse_config(main["args"], {"NODE_NAME": "n"}).cgroup_root) == "/host/sys/fs/cgroup"
    off = {"hostCgroup": {"enabled": False}}
    assert "host-cgroup" not in {v["name"] for v in pod_spec(off)["volumes"]}
    assert "host-cgroup" not in {m["name"] for m in container(off)["volumeMounts"]}
    assert "--cgroup-root=off" in container(off)["args"]
    assert parse_config(container(off)["args"], {"NODE_NAME": "n"}).cgroup_root is None
    moved = container({"hostCgroup": {"mountPath": "/hostcg"}})
    assert "--cgroup-root=/hostcg" in moved["args"]


@ALL_SETS
def test_every_host_path_is_mounted_read_only(name: str) -> None:
    values = VALUE_SETS[name]
    host_volumes = {v["name"] for v in pod_spec(values)["volumes"] if "hostPath" in v}
    for mount in container(values)["volumeMounts"]:
        if mount["name"] in host_volumes:
            assert mount.get("readOnly") is True, f"{name}: {mount['mountPath']} is writable"


def test_default_security_context_is_hardened() -> None:
    spec, main = pod_spec({}), container({})
    assert main["securityContext"] == {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "privileged": False,
        "capabilities": {"drop": ["ALL"]},
    }
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    # root only for the root-owned pod-resources socket and NVML's device nodes
    assert spec["securityContext"]["runAsUser"] == 0
    assert spec["enableServiceLinks"] is False


def test_run_as_user_is_configurable() -> None:
    context = pod_spec(VALUE_SETS["flags-and-extras"])["securityContext"]
    assert context["runAsUser"] == 65534 and context["runAsNonRoot"] is True


def test_kmsg_mounts_the_kernel_log_with_cap_syslog_in_a_privileged_container() -> None:
    main = container(VALUE_SETS["kmsg"])
    assert {"--kmsg", "--kmsg-path=/dev/kmsg"} <= set(main["args"])
    context = main["securityContext"]
    assert context["privileged"] is True
    assert "allowPrivilegeEscalation" not in context  # the API rejects it with privileged
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["SYSLOG"]}
    volumes = {v["name"]: v for v in pod_spec(VALUE_SETS["kmsg"])["volumes"]}
    assert volumes["kmsg"]["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}


def test_holder_scan_can_read_fd_tables_with_cap_sys_ptrace_only() -> None:
    context = container(VALUE_SETS["holder-scan-ptrace"])["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["SYS_PTRACE"]}
    assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
    both = {"holderScan": {"sysPtrace": True}, "kmsg": {"enabled": True, "privileged": False}}
    assert container(both)["securityContext"]["capabilities"]["add"] == ["SYS_PTRACE", "SYSLOG"]


def test_kmsg_unprivileged_keeps_the_hardening() -> None:
    context = container(VALUE_SETS["kmsg-unprivileged"])["securityContext"]
    assert context["privileged"] is False and context["allowPrivilegeEscalation"] is False
    assert context["capabilities"]["add"] == ["SYSLOG"]
    assert "--kmsg" not in container({})["args"]


def test_probes_use_the_exporters_health_endpoints_on_the_metrics_port() -> None:
    main = container({})
    (port,) = main["ports"]
    assert port == {"name": "metrics", "containerPort": 9445, "protocol": "TCP"}
    assert main["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "metrics"}
    assert main["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "metrics"}
    # /healthz fails after livenessCycles x interval without a cycle (50 s by default);
    # the probe restarts the container at most 30 s later (three failures).
    probe = main["livenessProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] <= 30
    assert "--liveness-cycles=10" in main["args"]
    app = build_app(MetricsCache(), "n")
    routes = {r.resource.canonical for r in app.router.routes() if r.resource is not None}
    assert {"/healthz", "/readyz", "/metrics"} <= routes


def test_resources_cover_the_benchmarked_memory() -> None:
    """Requests at least the measured RSS (benchmarks/results), limits 2x above it."""
    results = ROOT / "benchmarks" / "results"
    report = next(
        (p for p in (results / "latest.md", results / "latest-quick.md") if p.is_file()), None
    )
    rss = [90.0]  # the target, while no benchmark has been recorded
    if report is not None:
        rss += [
            float(m)
            for line in report.read_text().splitlines()
            if "RSS" in line and "growth" not in line
            for m in re.findall(r"\|\s*([0-9.]+) MiB", line)
        ]
    resources = container({})["resources"]

    def mib(quantity: str) -> float:
        assert quantity.endswith("Mi"), quantity
        return float(quantity[:-2])

    assert mib(resources["requests"]["memory"]) >= max(rss)
    assert mib(resources["limits"]["memory"]) >= 2 * max(rss)
    assert resources["requests"]["cpu"] and resources["limits"]["cpu"]


def test_no_value_set_requests_a_gpu() -> None:
    for name, values in VALUE_SETS.items():
        for each in containers(values).values():
            resources = each.get("resources", {})
            names = {*resources.get("requests", {}), *resources.get("limits", {})}
            assert not [n for n in names if n.startswith("nvidia.com/")], name


# -- NVIDIA runtime and scheduling -------------------------------------------------------


def test_nvidia_runtime_is_reached_through_the_runtime_class_and_env() -> None:
    assert pod_spec({})["runtimeClassName"] == "nvidia"
    env = env_of({})
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert env["NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


def test_runtime_class_is_configurable_or_absent() -> None:
    custom = VALUE_SETS["custom-runtime-class"]
    assert pod_spec(custom)["runtimeClassName"] == "nvidia-cdi"
    assert env_of(custom)["NVIDIA_DRIVER_CAPABILITIES"] == "utility,compute"
    assert "runtimeClassName" not in pod_spec(VALUE_SETS["no-runtime-class"])


def test_scheduled_on_gpu_nodes_only_by_default() -> None:
    spec = pod_spec({})
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    selected = [
        (e["key"], e["operator"], e["values"])
        for term in terms["nodeSelectorTerms"]
        for e in term["matchExpressions"]
    ]
    paused = ("nvidia.com/gpu.deploy.client", "NotIn", [PAUSED])  # leaves a paused node
    assert selected == [  # two terms: ORed
        ("nvidia.com/gpu.present", "In", ["true"]),
        paused,
        ("feature.node.kubernetes.io/pci-10de.present", "In", ["true"]),
        paused,
    ]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec[
        "tolerations"
    ]
    assert spec["priorityClassName"] == "system-node-critical"


def test_custom_node_terms_and_affinity_combine() -> None:
    spec = pod_spec(VALUE_SETS["flags-and-extras"])
    terms = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    paused = {"key": "nvidia.com/gpu.deploy.client", "operator": "NotIn", "values": [PAUSED]}
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [*term["matchExpressions"], paused]}
        for term in VALUE_SETS["flags-and-extras"]["gpuNodeSelectorTerms"]
    ]
    assert "podAntiAffinity" in spec["affinity"]
    assert "priorityClassName" not in spec
    own: dict[str, Any] = {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}}
    assert pod_spec({"affinity": own})["affinity"] == own  # an explicit nodeAffinity wins


# -- GPU Operator driver upgrades and MIG monitoring ---------------------------------------

# k8s-driver-manager (cmd/driver-manager/main.go): maybeSetPaused turns "true" into this,
# and maybeSetTrue turns it back once the new driver is loaded.
PAUSED = "paused-for-driver-upgrade"
OPERATOR_NODE = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.deploy.client": "true"}


def _term_matches(term: dict[str, Any], labels: dict[str, str]) -> bool:
    for e in term.get("matchExpressions", []):
        value, values = labels.get(e["key"]), e.get("values", [])
        if not {
            "In": value in values,
            "NotIn": value not in values,
            "Exists": value is not None,
            "DoesNotExist": value is None,
        }[e["operator"]]:
            return False
    return True


def runs_on(spec: dict[str, Any], labels: dict[str, str]) -> bool:
    """The DaemonSet controller's node predicate: nodeSelector AND one required node
    affinity term. A running daemon pod on a node that stops matching is deleted."""
    if any(labels.get(k) != v for k, v in spec.get("nodeSelector", {}).items()):
        return False
    required = spec.get("affinity", {}).get("nodeAffinity", {})
    required = required.get("requiredDuringSchedulingIgnoredDuringExecution")
    return required is None or any(_term_matches(t, labels) for t in required["nodeSelectorTerms"])


def driver_manager_waits_for(daemonset: dict[str, Any], key: str) -> bool:
    """k8s-driver-manager's WaitForPodsWithNodeSelector (internal/kubernetes/client.go):
    pods owned by a DaemonSet whose spec.nodeSelector has the key, whatever its value."""
    return daemonset["kind"] == "DaemonSet" and key in daemonset["spec"]["template"]["spec"].get(
        "nodeSelector", {}
    )


# A GPU node as each GPU Operator labels it: every version sets nvidia.com/gpu.present
# (state_manager.go, v23.9.0 lines 46-47); only v26.7.0 and later set
# nvidia.com/gpu.deploy.client=true (commit 45fb0db6e, state_manager.go lines 108-124),
# which only their k8s-driver-manager (v0.12.0) pauses (cmd/driver-manager/main.go).
OPERATOR_24_NODE = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.deploy.driver": "true"}


@pytest.mark.parametrize("version", ["", "23.9.0", "v24.9.2", "26.3.3"])
def test_the_default_schedules_on_every_operator_and_leaves_a_paused_node(version: str) -> None:
    """The default used to select on nvidia.com/gpu.deploy.client=true, which
    Operators before v26.7.0 never set: no pod at all. Now (version unknown to `helm
    template`, or older) a NotIn expression: it runs on both kinds of node, and leaves one
    whose label the driver manager paused (not waited for: no nodeSelector)."""
    values = {"gpuOperator": {"version": version}}
    daemonset = one(values, "DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    assert runs_on(spec, OPERATOR_24_NODE)
    assert runs_on(spec, OPERATOR_NODE)
    assert not runs_on(spec, {**OPERATOR_NODE, "nvidia.com/gpu.deploy.client": PAUSED})
    assert not driver_manager_waits_for(daemonset, "nvidia.com/gpu.deploy.client")


@pytest.mark.parametrize("version", ["26.7.0", "v26.7.1", "27.1.0"])
def test_driver_upgrade_evicts_the_exporter_and_brings_it_back(version: str) -> None:
    """From v26.7.0, before unloading the driver the GPU Operator's driver manager pauses
    nvidia.com/gpu.deploy.client and waits for the DaemonSet pods selecting on it; a
    drain would skip them. The exporter must be one, or /dev/nvidia* stays open."""
    daemonset = one({"gpuOperator": {"version": version}}, "DaemonSet")
    spec = daemonset["spec"]["template"]["spec"]
    assert driver_manager_waits_for(daemonset, "nvidia.com/gpu.deploy.client")
    assert runs_on(spec, OPERATOR_NODE)
    assert not runs_on(spec, {**OPERATOR_NODE, "nvidia.com/gpu.deploy.client": PAUSED})
    assert runs_on(spec, OPERATOR_NODE)  # label restored after the upgrade: back again
    assert not runs_on(spec, OPERATOR_24_NODE)  # why it needs the version


def test_plain_clusters_turn_the_eviction_label_off() -> None:
    plain_node = {"feature.node.kubernetes.io/pci-10de.present": "true"}
    assert runs_on(pod_spec({}), plain_node)  # the NotIn expression admits a missing label
    spec = pod_spec(VALUE_SETS["plain-cluster"])
    assert "nodeSelector" not in spec and runs_on(spec, plain_node)
    notes = render({"gpuOperator": {"version": "26.7.0"}})
    assert (
        "driverUpgradeEviction.enabled=false" in notes["gpu-occupancy-exporter/templates/NOTES.txt"]
    )


def test_eviction_label_is_configurable_and_merges_with_the_node_selector() -> None:
    """k8s-driver-manager pauses a custom label too (NODE_LABEL_FOR_GPU_POD_EVICTION)."""
    values = VALUE_SETS["custom-eviction-label"]
    assert pod_spec(values)["nodeSelector"] == {
        "kubernetes.io/os": "linux",
        "example.com/gpu-clients": "true",
    }
    assert driver_manager_waits_for(one(values, "DaemonSet"), "example.com/gpu-clients")


def toolkit_accepts(main: dict[str, Any]) -> bool:
    """nvidia-container-runtime-hook: NVIDIA_MIG_MONITOR_DEVICES in a container without
    CAP_SYS_ADMIN in its bounding set panics ("cannot set MIG_MONITOR_DEVICES in non
    privileged container"; container_config.go, internal/config/image/privileged.go)."""
    env = {e["name"] for e in main["env"]}
    context = main.get("securityContext", {})
    bounding = {
        f"CAP_{c.removeprefix('CAP_')}" for c in context.get("capabilities", {}).get("add", [])
    }
    return "NVIDIA_MIG_MONITOR_DEVICES" not in env or (
        context.get("privileged") is True or "CAP_SYS_ADMIN" in bounding
    )


def test_mig_monitoring_grants_what_the_container_toolkit_demands() -> None:
    main = container(VALUE_SETS["mig-monitoring"])
    assert env_of(VALUE_SETS["mig-monitoring"])["NVIDIA_MIG_MONITOR_DEVICES"] == "all"
    assert toolkit_accepts(main)
    context = main["securityContext"]
    assert context["capabilities"] == {"drop": ["ALL"], "add": ["SYS_ADMIN"]}
    assert context["privileged"] is False and "allowPrivilegeEscalation" not in context
    notes = render(VALUE_SETS["mig-monitoring"])["gpu-occupancy-exporter/templates/NOTES.txt"]
    assert "CAP_SYS_ADMIN for MIG monitoring" in notes


def test_mig_monitoring_is_off_by_default() -> None:
    assert "NVIDIA_MIG_MONITOR_DEVICES" not in env_of({})
    assert "add" not in container({})["securityContext"]["capabilities"]
    for name, values in VALUE_SETS.items():
        assert toolkit_accepts(container(values)), name


def test_dcgm_operator_namespace_reaches_the_exporter() -> None:
    config = parse_config(container(VALUE_SETS["dcgm-auto-operator"])["args"], {"NODE_NAME": "n"})
    assert config.dcgm.hostengines == (
        "nvidia-dcgm.gpu-ops.svc:5555",
        "nvidia-dcgm.nvidia-gpu-operator.svc:5555",
        "127.0.0.1:5555",
    )
    assert not [a for a in container({})["args"] if a.startswith("--dcgm-operator-namespace")]


# -- Kubernetes API access ---------------------------------------------------------------


POD_RULE = {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
# The exporter's own Node, watched by name (docs/capacity.md): read whenever pods are
NODE_READ_RULE = {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "watch"]}
RESOURCE_SLICE_RULE = {
    "apiGroups": ["resource.k8s.io"],
    "resources": ["resourceslices"],
    "verbs": ["get", "list", "watch"],
}
# DeviceTaintRules are read (list + watch, cluster-wide) with rbac.dra, as ResourceSlices are
DEVICE_TAINT_READ_RULE = {
    "apiGroups": ["resource.k8s.io"],
    "resources": ["devicetaintrules"],
    "verbs": ["get", "list", "watch"],
}
DRA_READ_RULES = [RESOURCE_SLICE_RULE, DEVICE_TAINT_READ_RULE]
# What the exporter writes (docs/kubernetes-events.md): each rule only while its value is on.
EVENTS_RULE = {
    "apiGroups": ["events.k8s.io"],
    "resources": ["events"],
    "verbs": ["create", "patch"],
}
NODE_STATUS_RULE = {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]}
DEVICE_TAINT_RULE = {
    "apiGroups": ["resource.k8s.io"],
    "resources": ["devicetaintrules"],
    "verbs": ["get", "list", "create", "delete"],
}
WRITE_FLAGS = ("--kube-events", "--node-condition", "--dra-device-taint")


def test_api_watches_get_a_service_account_with_read_access_to_pods_and_slices() -> None:
    """Read access to pods and slices; the one default write is Events (kubeEvents)."""
    account = one({}, "ServiceAccount")
    role, binding = one({}, "ClusterRole"), one({}, "ClusterRoleBinding")
    assert role["rules"] == [POD_RULE, NODE_READ_RULE, *DRA_READ_RULES, EVENTS_RULE]
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": NAMESPACE}
    ]
    assert pod_spec({})["serviceAccountName"] == account["metadata"]["name"] == FULLNAME
    assert "--kube-api=auto" in container({})["args"]


def test_rbac_dra_false_drops_only_the_dra_read_rules() -> None:
    values = VALUE_SETS["no-dra-rbac"]
    assert one(values, "ClusterRole")["rules"] == [POD_RULE, NODE_READ_RULE, EVENTS_RULE]
    assert one(values, "ClusterRoleBinding")["roleRef"] == one({}, "ClusterRoleBinding")["roleRef"]
    assert container(values)["args"] == container({})["args"]  # RBAC only, same flags


@pytest.mark.parametrize("name", ["kube-api-off", "kube-api-off-unquoted-yaml"])
def test_kube_api_off_creates_no_rbac_and_mounts_no_token(name: str) -> None:
    kinds = {o["kind"] for o in objects(VALUE_SETS[name])}
    assert not kinds & {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    spec = pod_spec(VALUE_SETS[name])
    assert spec["automountServiceAccountToken"] is False and "serviceAccountName" not in spec
    assert "--kube-api=off" in container(VALUE_SETS[name])["args"]


def test_existing_service_account_is_used_without_creating_rbac() -> None:
    values = VALUE_SETS["existing-service-account"]
    kinds = {o["kind"] for o in objects(values)}
    assert not kinds & {"ServiceAccount", "ClusterRole", "ClusterRoleBinding"}
    assert pod_spec(values)["serviceAccountName"] == "gpu-reader"
    annotated = one(VALUE_SETS["annotated-service-account"], "ServiceAccount")
    assert annotated["metadata"]["name"] == "gpu-exporter"
    assert annotated["metadata"]["annotations"] == {"example.com/role": "r"}


# -- what the exporter writes to Kubernetes: Events, Node condition, DeviceTaintRules ------


def write_flags(values: dict[str, Any]) -> list[str]:
    return [a for a in container(values)["args"] if a.startswith(WRITE_FLAGS)]


def notes_of(values: dict[str, Any]) -> str:
    return render(values)["gpu-occupancy-exporter/templates/NOTES.txt"]


def test_events_are_on_by_default_with_create_and_patch_on_events_only() -> None:
    """kubeEvents.enabled leaves the exporter's own default (auto: on with credentials)."""
    rules = one({}, "ClusterRole")["rules"]
    assert EVENTS_RULE in rules
    assert not [r for r in rules if "nodes/status" in r["resources"]]
    # DeviceTaintRules are read (rbac.dra), never written
    assert [r for r in rules if "devicetaintrules" in r["resources"]] == [DEVICE_TAINT_READ_RULE]
    assert [r for r in rules if "nodes" in r["resources"]] == [NODE_READ_RULE]  # reads only
    assert write_flags({}) == []
    notes = notes_of({})
    assert "Writes Warning Events" in notes and "reportingComponent=gpu-occupancy-exporter" in notes
    assert "GPUUnhealthy condition" not in notes and "DeviceTaintRule" not in notes


def test_kube_events_off_drops_the_events_rule_and_passes_the_flag() -> None:
    values = VALUE_SETS["no-kube-events"]
    assert one(values, "ClusterRole")["rules"] == [POD_RULE, NODE_READ_RULE, *DRA_READ_RULES]
    assert write_flags(values) == ["--kube-events=off"]
    assert "Writes" not in notes_of(values)


def test_node_condition_adds_node_status_patch() -> None:
    values = VALUE_SETS["node-condition"]
    rules = one(values, "ClusterRole")["rules"]
    assert rules == [POD_RULE, NODE_READ_RULE, *DRA_READ_RULES, EVENTS_RULE, NODE_STATUS_RULE]
    assert write_flags(values) == ["--node-condition"]
    assert "Writes the GPUUnhealthy condition" in notes_of(values)


def test_dra_device_taints_add_the_device_taint_rule_rule_and_both_flags() -> None:
    values = VALUE_SETS["dra-device-taints"]
    rules = one(values, "ClusterRole")["rules"]
    assert rules == [POD_RULE, NODE_READ_RULE, *DRA_READ_RULES, EVENTS_RULE, DEVICE_TAINT_RULE]
    assert write_flags(values) == ["--dra-device-taints", "--dra-device-taint-effect=None"]
    assert "Writes a DeviceTaintRule (effect None)" in notes_of(values)


def test_dra_device_taint_effect_no_schedule_is_rendered() -> None:
    values = VALUE_SETS["dra-device-taints-no-schedule"]
    assert write_flags(values) == [
        "--node-condition",
        "--dra-device-taints",
        "--dra-device-taint-effect=NoSchedule",
    ]
    rules = one(values, "ClusterRole")["rules"]
    assert rules[-2:] == [NODE_STATUS_RULE, DEVICE_TAINT_RULE]
    assert "effect NoSchedule" in notes_of(values)


def test_the_taint_effect_alone_changes_nothing() -> None:
    """Without draDeviceTaints.enabled the effect passes no flag and grants nothing."""
    values = {"draDeviceTaints": {"effect": "NoSchedule"}}
    assert write_flags(values) == [] and one(values, "ClusterRole") == one({}, "ClusterRole")


@pytest.mark.parametrize("key", ["nodeCondition", "draDeviceTaints"])
def test_writes_without_kube_api_are_refused_with_what_to_change(key: str) -> None:
    """kubeApi off mounts no API token and renders no RBAC: the write could never happen."""
    with pytest.raises(helm.HelmRenderError, match=rf"{key}\.enabled needs kubeApi: auto"):
        render({"kubeApi": "off", key: {"enabled": True}})


def test_kube_api_off_renders_no_write_rule_or_note() -> None:
    """Events follow kubeApi (--kube-api off also means no events): no RBAC, no flag."""
    values = VALUE_SETS["kube-api-off"]
    assert not by_kind(values, "ClusterRole")
    assert write_flags(values) == [] and "Writes" not in notes_of(values)


def test_kube_writes_shadow_passes_the_flag_keeps_the_rbac_and_says_so() -> None:
    """Shadow still reads the Node and the rules, and switching to on is one value: the
    RBAC is the same as with writes on."""
    values = VALUE_SETS["kube-writes-shadow"]
    assert write_flags(values)[-1] == "--dra-device-taint-effect=None"
    assert "--kube-writes=shadow" in container(values)["args"]
    on = {k: v for k, v in values.items() if k != "kubeWrites"}
    assert one(values, "ClusterRole")["rules"] == one(on, "ClusterRole")["rules"]
    assert "Shadow mode (kubeWrites.mode=shadow)" in notes_of(values)
    assert not [a for a in container(on)["args"] if a.startswith("--kube-writes")]
    assert "Shadow mode" not in notes_of(on)


def test_kube_writes_shadow_kinds_are_passed_as_one_flag() -> None:
    values = VALUE_SETS["kube-writes-shadow-kinds"]
    args = container(values)["args"]
    assert "--kube-writes=shadow=node_condition,device_taint_rule" in args
    assert "for node_condition, device_taint_rule" in notes_of(values)


def test_the_canary_rollout_in_install_md_renders_two_releases_on_disjoint_pools() -> None:
    """docs/install.md, "Switching Kubernetes writes on", step 2, as written there."""
    text = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    section = text.split("### Switching Kubernetes writes on", 1)[1]
    block = section.split("```yaml", 1)[1].split("```", 1)[0]
    shadow, canary = (yaml.safe_load(doc) for doc in block.split("---"))
    assert "--kube-writes=shadow" in container(shadow)["args"]
    assert not [a for a in container(canary)["args"] if a.startswith("--kube-writes")]
    pool = "cloud.google.com/gke-nodepool"
    gpu = {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.deploy.client": "true"}
    spec = pod_spec(shadow)
    assert runs_on(spec, {**gpu, pool: "gpu-a100"})
    assert not runs_on(spec, {**gpu, pool: "gpu-canary"})
    spec = pod_spec(canary)
    assert runs_on(spec, {**gpu, pool: "gpu-canary"})
    assert not runs_on(spec, {**gpu, pool: "gpu-a100"})


@pytest.mark.parametrize(
    "writes", [{"mode": "off"}, {"mode": True}, {"mode": "shadow", "shadowKinds": ["pods"]}]
)
def test_a_kube_writes_value_outside_the_schema_is_refused(writes: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmValuesError, match="/kubeWrites"):
        render({"kubeWrites": writes})


def test_writes_with_rbac_create_false_name_the_rules_to_grant() -> None:
    values = VALUE_SETS["kube-writes-own-rbac"]
    assert not by_kind(values, "ClusterRole")
    assert write_flags(values) == ["--node-condition"]
    notes = notes_of(values)
    assert "rbac.create is false" in notes and "ServiceAccount gpu-writer" in notes


# -- Service, Prometheus Operator, alerts, dashboards -------------------------------------


def test_service_exposes_the_metrics_port() -> None:
    service = one({}, "Service")
    assert service["spec"]["ports"] == [
        {"name": "metrics", "port": 9445, "targetPort": "metrics", "protocol": "TCP"}
    ]
    pod_labels = one({}, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert not by_kind(VALUE_SETS["pod-monitor-without-service"], "Service")


def test_monitoring_is_off_by_default() -> None:
    kinds = {o["kind"] for o in objects({})}
    assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule", "ConfigMap"}
    assert not kinds & {"NetworkPolicy"}


def test_service_monitor_and_pod_monitor_select_the_exporter() -> None:
    values = VALUE_SETS["monitoring"]
    service = one(values, "Service")
    monitor, pod_monitor = one(values, "ServiceMonitor"), one(values, "PodMonitor")
    selected = monitor["spec"]["selector"]["matchLabels"]
    assert selected.items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    assert endpoint["interval"] == "30s" and endpoint["metricRelabelings"] == [DROP_PER_PROCESS]
    pod_labels = one(values, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert pod_monitor["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pod_monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    notes = render(values)["gpu-occupancy-exporter/templates/NOTES.txt"]
    assert "scrapes every pod twice" in notes


def test_default_monitors_keep_workload_labels_and_add_the_node() -> None:
    values = {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}
    for endpoint in (
        one(values, "ServiceMonitor")["spec"]["endpoints"][0],
        one(values, "PodMonitor")["spec"]["podMetricsEndpoints"][0],
    ):
        assert endpoint["honorLabels"] is True
        assert {
            "sourceLabels": ["__meta_kubernetes_pod_node_name"],
            "targetLabel": "node",
        } in endpoint["relabelings"]
        drops = [r for r in endpoint["relabelings"] if r.get("action") == "labeldrop"]
        assert drops and re.fullmatch(drops[0]["regex"], "pod")


def test_service_monitor_without_a_service_is_refused() -> None:
    with pytest.raises(helm.HelmRenderError, match=r"needs service\.enabled"):
        render({"serviceMonitor": {"enabled": True}, "service": {"enabled": False}})


def test_prometheus_rule_holds_exactly_the_groups_of_the_alert_files() -> None:
    """General over whatever alerts/*.yaml the repository holds (none: no object)."""
    expected = rule_groups(ROOT / "alerts")
    rules = by_kind(VALUE_SETS["monitoring"], "PrometheusRule")
    if not expected:
        assert rules == []
        return
    (rule,) = rules
    assert rule["spec"]["groups"] == expected
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_dcgm_exporter_compat_rules_are_rendered_only_when_asked_for() -> None:
    """alerts/compat/ (dcgm-exporter's series, docs/migrating-from-dcgm-exporter.md): both
    generations, 4.5.3-4.8.2's names and 4.9's (which builds on the former), come after the
    other groups with prometheusRule.dcgmExporterCompat, and not without."""
    compat = rule_groups(ROOT / "alerts" / "compat")
    assert sorted(g["name"] for g in compat) == ["dcgm-exporter-4.9-compat", "dcgm-exporter-compat"]
    (on,) = by_kind(VALUE_SETS["dcgm-exporter-compat"], "PrometheusRule")
    assert on["spec"]["groups"] == rule_groups(ROOT / "alerts") + compat
    (off,) = by_kind({"prometheusRule": {"enabled": True}}, "PrometheusRule")
    assert off["spec"]["groups"] == rule_groups(ROOT / "alerts")


COST_GROUP = "gpu-occupancy-exporter.chargeback.cost"
CHARGEBACK_TESTS = ROOT / "alerts" / "tests" / "chargeback.test.yaml"


def test_no_cost_rules_without_prices() -> None:
    """chargeback.pricePerGpuHour defaults to {}: the alert files' groups and nothing more."""
    assert DEFAULTS["chargeback"] == {"pricePerGpuHour": {}}
    (rule,) = by_kind({"prometheusRule": {"enabled": True}}, "PrometheusRule")
    assert rule["spec"]["groups"] == rule_groups(ROOT / "alerts")
    recorded = {r.get("record") for g in rule["spec"]["groups"] for r in g["rules"]}
    assert not recorded & CHART_RECORDED


def test_prices_render_a_price_series_per_model_and_the_cost_rule() -> None:
    (rule,) = by_kind(VALUE_SETS["chargeback-prices"], "PrometheusRule")
    *files, cost = rule["spec"]["groups"]
    assert files == rule_groups(ROOT / "alerts")
    assert cost["name"] == COST_GROUP and cost["interval"] == "1m"
    prices = [r for r in cost["rules"] if r["record"] == "model:gpu_price_per_gpu_hour:value"]
    assert sorted((r["labels"]["model"], r["expr"]) for r in prices) == [
        (A100, "vector(1.25)"),
        (H100, "vector(2.5)"),
    ]
    assert {r["record"] for r in cost["rules"]} == CHART_RECORDED
    assert cost["rules"][-1]["record"] == "namespace_owner:gpu_cost:increase1d"


def test_prices_without_the_prometheus_rule_render_nothing() -> None:
    values = {"chargeback": {"pricePerGpuHour": {H100: 2.5}}}
    assert not by_kind(values, "PrometheusRule")


def _cost_unit_test(rule_file: Path) -> dict[str, Any]:
    """alerts/tests/chargeback.test.yaml's day of steady use, priced: H100 2.5 and A100
    1.25 per GPU-hour. Per day, ml's trainer holds 48 H100-hours (120), web's infer and
    its owner-less replica 12 A100-hours each (15), web's debug-0 24 (30); batch's GPU
    has no model, so no price and no cost."""
    steady = yaml.safe_load(CHARGEBACK_TESTS.read_text())["tests"][0]
    cost = "namespace_owner:gpu_cost:increase1d"
    return {
        "rule_files": [str(rule_file)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": steady["input_series"],
                "promql_expr_test": [
                    {
                        "expr": cost,
                        "eval_time": "1510m",
                        "exp_samples": [
                            {
                                "labels": cost + '{namespace="ml",owner_kind="Deployment",'
                                'owner_name="trainer"}',
                                "value": 120,
                            },
                            {
                                "labels": cost + '{namespace="web",owner_kind="Deployment",'
                                'owner_name="infer"}',
                                "value": 15,
                            },
                            {"labels": cost + '{namespace="web"}', "value": 15},
                            {
                                "labels": cost + '{namespace="web",owner_kind="Pod",'
                                'owner_name="debug-0"}',
                                "value": 30,
                            },
                        ],
                    },
                    {
                        "expr": "model:gpu_price_per_gpu_hour:value",
                        "eval_time": "10m",
                        "exp_samples": [
                            {
                                "labels": f'model:gpu_price_per_gpu_hour:value{{model="{A100}"}}',
                                "value": 1.25,
                            },
                            {
                                "labels": f'model:gpu_price_per_gpu_hour:value{{model="{H100}"}}',
                                "value": 2.5,
                            },
                        ],
                    },
                ],
            }
        ],
    }


def _groups_feeding(groups: list[dict[str, Any]], outputs: set[str]) -> list[dict[str, Any]]:
    """The groups whose rules compute ``outputs``, and those whose records (or alerts, for a
    rule reading ALERTS) those rules read, transitively; in their rendered order."""
    kept: list[dict[str, Any]] = []
    needed = set(outputs)
    while True:
        more = [
            group
            for group in groups
            if group not in kept
            and any(
                rule.get("record") in needed
                or ("alert" in rule and needed & {"ALERTS", "ALERTS_FOR_STATE"})
                for rule in group["rules"]
            )
        ]
        if not more:
            return [group for group in groups if group in kept]
        kept += more
        for group in more:
            for rule in group["rules"]:
                needed |= referenced_metrics(str(rule["expr"]))


def test_rendered_cost_rules_pass_promtool_and_give_the_known_cost(tmp_path: Path) -> None:
    """The PrometheusRule with prices, as Prometheus would load it: promtool's lint, and a
    day of known use priced to a known cost per namespace and owner.

    The day is evaluated on the rendered groups that the cost and the price are computed
    from (the cost group and the chargeback ledger it reads): the others record nothing
    those read, so they cannot change either, and evaluating them every minute of the day
    took two thirds of the test's time."""
    (rule,) = by_kind(VALUE_SETS["chargeback-prices"], "PrometheusRule")
    rules = tmp_path / "rendered.rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    check = run_promtool("check", "rules", "--lint=all", "--lint-fatal", str(rules))
    assert check.returncode == 0, check.stdout
    cost, price = "namespace_owner:gpu_cost:increase1d", "model:gpu_price_per_gpu_hour:value"
    feeding = _groups_feeding(rule["spec"]["groups"], {cost, price})
    assert any(r.get("record") == cost for g in feeding for r in g["rules"])
    rules = tmp_path / "rendered.cost.rules.yaml"
    rules.write_text(yaml.safe_dump({"groups": feeding}, sort_keys=False))
    unit = tmp_path / "cost.test.yaml"
    unit.write_text(yaml.safe_dump(_cost_unit_test(rules), sort_keys=False, width=1000))
    result = run_promtool("test", "rules", str(unit))
    assert result.returncode == 0, result.stdout


def test_prometheus_rule_from_sample_files_keeps_prometheus_templates(sample_chart: Path) -> None:
    rule = one(VALUE_SETS["monitoring"], "PrometheusRule", sample_chart)
    expected = rule_groups(sample_chart / "files" / "alerts")
    assert [g["name"] for g in expected] == ["sample.alerts", "sample.recording"]
    assert rule["spec"]["groups"] == expected
    summary = rule["spec"]["groups"][0]["rules"][0]["annotations"]["summary"]
    assert "{{ $labels.gpu }}" in summary  # not evaluated by Helm


def test_no_prometheus_rule_without_alert_files(tmp_path: Path) -> None:
    chart = _chart_copy(tmp_path, {}, {})
    assert not by_kind(VALUE_SETS["monitoring"], "PrometheusRule", chart)
    assert not by_kind(VALUE_SETS["monitoring"], "ConfigMap", chart)
    notes = render(VALUE_SETS["monitoring"], chart)["gpu-occupancy-exporter/templates/NOTES.txt"]
    assert "no PrometheusRule was created" in notes and "no ConfigMap was created" in notes


def test_a_file_that_is_not_a_rule_file_fails_the_render(tmp_path: Path) -> None:
    chart = _chart_copy(tmp_path, {"notes.yaml": "owner: gpu-team\n"}, {})
    with pytest.raises(helm.HelmRenderError, match="not a Prometheus rule file"):
        render(VALUE_SETS["monitoring"], chart)


def _dashboard_data(values: dict[str, Any], chart: Path) -> dict[str, str]:
    data: dict[str, str] = {}
    label, label_value = values["dashboards"]["label"], values["dashboards"]["labelValue"]
    for config_map in by_kind(values, "ConfigMap", chart):
        assert config_map["metadata"]["labels"][label] == label_value
        assert not data.keys() & config_map["data"].keys()
        data.update(config_map["data"])
    return data


def test_dashboard_config_maps_hold_exactly_the_dashboard_files() -> None:
    """General over whatever dashboards/*.json the repository holds (none: no object)."""
    expected = {p.name: p.read_text() for p in sorted((ROOT / "dashboards").glob("*.json"))}
    assert _dashboard_data(VALUE_SETS["monitoring"], CHART) == expected
    for name, text in expected.items():  # a ConfigMap key, and the sidecar's file name
        assert re.fullmatch(r"[-._a-zA-Z0-9]+", name), name
        assert len(text.encode()) < 900 * 1024, f"{name} nears the 1 MiB ConfigMap limit"


def test_dashboards_from_sample_files_are_labelled_for_the_grafana_sidecar(
    sample_chart: Path,
) -> None:
    values = VALUE_SETS["monitoring"]
    assert _dashboard_data(values, sample_chart) == SAMPLE_DASHBOARDS
    maps = {m["metadata"]["name"]: m for m in by_kind(values, "ConfigMap", sample_chart)}
    assert sorted(maps) == [f"{FULLNAME}-dashboard-gpu-overview", f"{FULLNAME}-dashboard-pods"]
    for config_map in maps.values():
        assert config_map["metadata"]["namespace"] == "grafana"
        assert config_map["metadata"]["annotations"] == {"grafana_folder": "GPUs"}
    default_label = {"dashboards": {"enabled": True}}
    for config_map in by_kind(default_label, "ConfigMap", sample_chart):
        assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
        assert config_map["metadata"]["namespace"] == NAMESPACE


def _differences(source: Path, copy_dir: Path, pattern: str) -> list[str]:
    originals = {p.name for p in source.glob(pattern)}
    copies = {p.name for p in copy_dir.glob(pattern)}
    problems = [f"missing copy of {n}" for n in sorted(originals - copies)]
    problems += [f"stale copy {n}" for n in sorted(copies - originals)]
    problems += [
        f"{n} differs"
        for n in sorted(originals & copies)
        if not filecmp.cmp(source / n, copy_dir / n, shallow=False)
    ]
    return problems


def test_chart_copies_of_alerts_and_dashboards_are_up_to_date() -> None:
    problems = _differences(ROOT / "alerts", CHART / "files" / "alerts", "*.yaml")
    problems += _differences(ROOT / "alerts" / "compat", CHART / "files" / "compat", "*.yaml")
    problems += _differences(ROOT / "dashboards", CHART / "files" / "dashboards", "*.json")
    assert not problems, f"run charts/sync-files.sh: {problems}"


def test_sync_script_adds_updates_and_removes_copies(tmp_path: Path) -> None:
    (tmp_path / "charts").mkdir()
    shutil.copy2(SYNC_SCRIPT, tmp_path / "charts" / "sync-files.sh")
    files = tmp_path / "charts" / "gpu-occupancy-exporter" / "files"
    (files / "alerts").mkdir(parents=True)
    (files / "alerts" / "gone.rules.yaml").write_text("groups: []\n")
    (tmp_path / "alerts" / "tests").mkdir(parents=True)
    (tmp_path / "alerts" / "gpu.rules.yaml").write_text("groups: []\n")
    (tmp_path / "alerts" / "tests" / "gpu.test.yaml").write_text("tests: []\n")
    (tmp_path / "dashboards").mkdir()
    (tmp_path / "dashboards" / "gpu.json").write_text("{}\n")
    script = ["bash", str(tmp_path / "charts" / "sync-files.sh")]

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*script, *args], capture_output=True, text=True, timeout=30, check=False
        )

    assert run("--check").returncode == 1
    assert run().returncode == 0
    assert sorted(p.name for p in (files / "alerts").iterdir()) == ["gpu.rules.yaml"]
    assert (files / "dashboards" / "gpu.json").read_text() == "{}\n"
    assert run("--check").returncode == 0
    (tmp_path / "dashboards" / "gpu.json").write_text('{"title": "changed"}\n')
    check = run("--check")
    assert check.returncode == 1 and "files/dashboards/gpu.json" in check.stdout


# -- NetworkPolicy -------------------------------------------------------------------------


def test_network_policy_admits_only_the_configured_sources_to_the_metrics_port() -> None:
    values = VALUE_SETS["network-policy"]
    policy = one(values, "NetworkPolicy")
    pod_labels = one(values, "DaemonSet")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = policy["spec"]["ingress"]
    assert rule["ports"] == [{"port": 9445, "protocol": "TCP"}]
    assert rule["from"] == [
        {
            "namespaceSelector": {
                "matchExpressions": [
                    {
                        "key": "kubernetes.io/metadata.name",
                        "operator": "In",
                        "values": ["monitoring", "observability"],
                    }
                ]
            },
            "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}},
        },
        {"ipBlock": {"cidr": "10.0.0.0/8"}},
    ]


def test_network_policy_with_no_sources_admits_nothing() -> None:
    policy = one(VALUE_SETS["network-policy-closed"], "NetworkPolicy")
    assert policy["spec"]["ingress"] == []  # an empty `from` would admit everyone


def test_network_policy_pod_labels_alone_match_in_every_namespace() -> None:
    values = {"networkPolicy": {"enabled": True, "allowedNamespaces": [], "allowedPodLabels": {}}}
    values["networkPolicy"]["allowedPodLabels"] = {"app": "prometheus"}
    (rule,) = one(values, "NetworkPolicy")["spec"]["ingress"]
    assert rule["from"] == [
        {"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "prometheus"}}}
    ]


# -- values.yaml and its schema ------------------------------------------------------------

BAD_VALUES: dict[str, tuple[dict[str, Any], str]] = {
    "interval-not-a-number": ({"interval": "fast"}, "/interval"),
    "interval-too-small": ({"interval": 0.01}, "/interval"),
    "liveness-cycles-too-few": ({"livenessCycles": 1}, "/livenessCycles"),
    "interval-too-large": ({"interval": 7200}, "/interval"),
    "slow-interval-not-a-number": ({"slowInterval": "slow"}, "/slowInterval"),
    "slow-interval-too-small": ({"slowInterval": 0.01}, "/slowInterval"),
    "slow-interval-too-large": ({"slowInterval": 7200}, "/slowInterval"),
    "pod-resources-interval-too-large": ({"podResourcesInterval": 86400}, "/podResources"),
    "unknown-top-level-key": ({"intervall": 5}, "intervall"),
    "unknown-nested-key": ({"serviceMonitor": {"enable": True}}, "enable"),
    "families-regex": ({"families": {"disable": ["gpu_fp.*"]}}, "/families/disable/0"),
    "families-not-a-list": ({"families": {"enable": "gpu_fp*"}}, "/families/enable"),
    "kube-api-choice": ({"kubeApi": "maybe"}, "/kubeApi"),
    "log-format-choice": ({"logFormat": "xml"}, "/logFormat"),
    "port-type": ({"port": "9445"}, "/port"),
    "port-range": ({"port": 70000}, "/port"),
    "extra-args-not-a-list": ({"extraArgs": "--interval=1"}, "/extraArgs"),
    "extra-env-without-name": ({"extraEnv": [{"value": "x"}]}, "/extraEnv"),
    "enabled-not-a-bool": ({"prometheusRule": {"enabled": "yes"}}, "/prometheusRule/enabled"),
    "dcgm-mode": ({"dcgm": {"mode": "on"}}, "/dcgm/mode"),
    "relative-proc-path": ({"hostProc": {"mountPath": "host/proc"}}, "/hostProc/mountPath"),
    "proc-over-proc": ({"hostProc": {"mountPath": "/proc"}}, "/hostProc/mountPath"),
    "gpu-request": ({"resources": {"requests": {"nvidia.com/gpu": 1}}}, "nvidia.com/gpu"),
    "gpu-limit": ({"resources": {"limits": {"nvidia.com/mig-1g.10gb": 1}}}, "nvidia.com/mig"),
    "image-digest": ({"image": {"digest": "latest"}}, "/image/digest"),
    "rbac-dra-not-a-bool": ({"rbac": {"dra": "yes"}}, "/rbac/dra"),
    "eviction-label-not-a-key": (
        {"driverUpgradeEviction": {"nodeLabel": "gpu clients"}},
        "/driverUpgradeEviction/nodeLabel",
    ),
    "mig-monitoring-not-a-bool": ({"migMonitoring": {"enabled": "yes"}}, "/migMonitoring/enabled"),
    "platform-unknown": ({"platform": "eks"}, "/platform"),
    "gke-relative-driver-path": ({"gke": {"driverHostPath": "home/nvidia"}}, "/gke/driverHostPath"),
    "operator-namespace": (
        {"dcgm": {"operatorNamespace": "GPU_Operator"}},
        "/dcgm/operatorNamespace",
    ),
    "kube-events-not-a-bool": ({"kubeEvents": {"enabled": "off"}}, "/kubeEvents/enabled"),
    "node-condition-unknown-key": ({"nodeCondition": {"type": "GPUUnhealthy"}}, "type"),
    "dra-taint-effect-no-execute": (
        {"draDeviceTaints": {"enabled": True, "effect": "NoExecute"}},
        "/draDeviceTaints/effect",
    ),
    "dra-taint-effect-lowercase": (
        {"draDeviceTaints": {"effect": "noschedule"}},
        "/draDeviceTaints/effect",
    ),
    "price-negative": ({"chargeback": {"pricePerGpuHour": {H100: -1}}}, "/chargeback"),
    "price-not-a-number": ({"chargeback": {"pricePerGpuHour": {H100: "2.5"}}}, "/chargeback"),
    "price-not-a-map": ({"chargeback": {"pricePerGpuHour": [2.5]}}, "/chargeback"),
}


@pytest.mark.parametrize("name", sorted(BAD_VALUES))
def test_schema_rejects_bad_values(name: str) -> None:
    values, where = BAD_VALUES[name]
    with pytest.raises(helm.HelmValuesError, match=re.escape(where)):
        _loaded(CHART).render(values, name=RELEASE, namespace=NAMESPACE)
    report = helm.lint(CHART, values, strict=True)
    assert report["errors"], f"helm lint accepted {values}"


def test_schema_accepts_every_value_set_and_the_defaults() -> None:
    for values in [DEFAULTS, *VALUE_SETS.values()]:
        _loaded(CHART).validate_schema(values)


def _leaves(tree: dict[str, Any], prefix: tuple[str, ...] = ()) -> Iterator[tuple[str, ...]]:
    """Paths of values.yaml's leaves: scalars, lists and empty maps."""
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            yield from _leaves(value, (*prefix, key))
        else:
            yield (*prefix, key)


def _get(tree: dict[str, Any], path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return _MISSING
        tree = tree[key]
    return tree


def _with(tree: dict[str, Any], path: tuple[str, ...], value: Any) -> dict[str, Any]:
    result = copy.deepcopy(tree)
    node = result
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return result


_MISSING = object()
LEAVES = sorted(_leaves(DEFAULTS))


@pytest.mark.parametrize("path", LEAVES, ids=[".".join(p) for p in LEAVES])
def test_every_value_changes_the_rendered_output(path: tuple[str, ...], sample_chart: Path) -> None:
    """Some value set sets it, and putting its default back changes what Helm renders."""
    default = _get(DEFAULTS, path)
    setting = [
        name
        for name, values in VALUE_SETS.items()
        if _get(values, path) is not _MISSING and _get(values, path) != default
    ]
    assert setting, f"no value set in this file changes {'.'.join(path)}; add one"
    for name in setting:
        values = VALUE_SETS[name]
        try:
            restored = render(_with(values, path, default), sample_chart)
        except helm.HelmRenderError:
            return  # the value is what makes this set render at all
        if render(values, sample_chart) != restored:
            return
    pytest.fail(f"{'.'.join(path)} has no effect on the output in value sets {setting}")


def test_every_value_is_documented_in_install_md() -> None:
    """Top-level keys, and the keys of the objects the schema closes, in docs/install.md."""
    doc = (ROOT / "docs" / "install.md").read_text()
    missing = []
    for key, value in DEFAULTS.items():
        names = [key]
        properties = SCHEMA["properties"][key]
        if isinstance(value, dict) and properties.get("additionalProperties") is False:
            names = [f"{key}.{sub}" for sub in value]
        missing += [n for n in names if f"`{n}`" not in doc]
    assert not missing, f"docs/install.md's values reference lacks {missing}"
