"""Grafana template variables: the data source, and the label filters every dashboard
offers (job, node, instance, GPU, namespace, pod; namespace and GPU model on the fleet
board), by the name a dashboard asks for them with."""

from __future__ import annotations

from grafana_panels import DS, Json
from series_labels import EXPORTER_SELECTOR, NODE


def datasource_variable() -> Json:
    return {
        "name": "datasource",
        "label": "Data source",
        "type": "datasource",
        "query": "prometheus",
        "current": {},
        "hide": 0,
        "includeAll": False,
        "multi": False,
        "options": [],
        "refresh": 1,
        "regex": "",
        "skipUrlSync": False,
    }


def query_variable(name: str, label: str, query: str, description: str) -> Json:
    """Multi-select with an "All" that means ``.*`` (matches a missing label too)."""
    return {
        "name": name,
        "label": label,
        "description": description,
        "type": "query",
        "datasource": DS,
        "definition": query,
        "query": query,
        "refresh": 2,
        "includeAll": True,
        "allValue": ".*",
        "multi": True,
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
        "options": [],
        "regex": "",
        "sort": 1,
        "hide": 0,
        "skipUrlSync": False,
    }


CONTAINER_SERIES = (
    '{__name__=~"gpu_container_allocated|gpu_container_memory_used_bytes'
    '|gpu_unallocated_use_memory_bytes", ' + NODE
)
VARIABLES: dict[str, Json] = {
    "job": query_variable(
        "job",
        "Job",
        f"label_values(up{{{EXPORTER_SELECTOR}}}, job)",
        "Prometheus job of the exporter's targets: the jobs matching the Helm chart's "
        "prometheusRule.jobSelector. All also matches series without a job label.",
    ),
    "node": query_variable(
        "node",
        "Node",
        'label_values(gpu_info{job=~"$job"}, node)',
        "Kubernetes node (the `node` label the Helm chart's ServiceMonitor adds). Empty "
        "without that relabelling: use Instance.",
    ),
    "instance": query_variable(
        "instance",
        "Instance",
        'label_values(gpu_info{node=~"$node"}, instance)',
        "Exporter scrape target (pod IP:port).",
    ),
    "gpu": query_variable(
        "gpu",
        "GPU (UUID)",
        f"label_values(gpu_info{{{NODE}}}, uuid)",
        "Physical GPU; MIG instances belong to their GPU's UUID.",
    ),
    "namespace": query_variable(
        "namespace",
        "Namespace",
        f"label_values({CONTAINER_SERIES}}}, namespace)",
        "Namespaces with GPU allocations or GPU memory on the selected nodes.",
    ),
    "pod": query_variable(
        "pod",
        "Pod",
        f'label_values({CONTAINER_SERIES}, namespace=~"$namespace"}}, pod)',
        "Pods with GPU allocations or GPU memory.",
    ),
    # the fleet board (GPU / Waste): its recording rules keep no node, instance or GPU
    "ledger_namespace": query_variable(
        "namespace",
        "Namespace",
        "label_values(namespace_owner_state:gpu_allocated_gpu_seconds:increase1h, namespace)",
        "Namespaces that held GPUs in the last hour (the GPU-hour ledger's recording rules).",
    ),
    "model": query_variable(
        "model",
        "GPU model",
        "label_values(gpu_info, model)",
        "GPU model as NVML names it (gpu_info's `model`).",
    ),
}
