"""The labels the exporter's series carry: the PromQL label filters the dashboards select
them with, and the legends that name them.

Filters are regexes so that "All" (``.*``) also matches series without the label, which
keeps the dashboards working where Prometheus adds no ``node`` label (the Helm chart's
ServiceMonitor relabels ``__meta_kubernetes_pod_node_name`` to ``node``; without it, pick
the exporter by ``instance``). Whole-GPU series are selected with ``gpu_instance=""``;
MIG instances with ``gpu_instance!=""`` (docs/metrics.md).
"""

from __future__ import annotations

EXPORTER_JOB = ".*gpu-occupancy-exporter.*"  # the chart's Service name, with any release prefix
# The exporter's targets, as the rule files select them: the Helm chart replaces this exact
# text with its prometheusRule.jobSelector in the dashboards as in the rules.
EXPORTER_SELECTOR = f'job=~"{EXPORTER_JOB}"'

# Label filters, by the labels a series carries.
NODE = 'job=~"$job", node=~"$node", instance=~"$instance"'
GPU = f'{NODE}, uuid=~"$gpu"'
NS = f'{NODE}, namespace=~"$namespace"'
POD = f'{GPU}, namespace=~"$namespace", pod=~"$pod"'
WHOLE = 'gpu_instance=""'
MIG = 'gpu_instance!=""'
SHARED_DEVICE = 'device_id=~".+::.+"'  # time-sliced replica IDs: GPU-…::N
CONTAINER_KEYS = "instance, namespace, pod, container, uuid"

GPU_LEGEND = "{{node}} GPU {{gpu}}"
POD_LEGEND = "{{namespace}}/{{pod}}/{{container}} · GPU {{gpu}}"


def activity(counter: str, selector: str) -> str:
    """An activity ratio (GPU-Util, SM active, ...) as the mean over Grafana's rate interval
    of its ``*_seconds_total`` counter, never the ``*_ratio`` gauge beside it: the gauge is
    the exporter's last sample window only (5-10 s by default), so a scrape every 30 s
    shows a slice of every 30 s and a periodic load aliases. ``$__rate_interval`` holds at
    least four scrapes (Grafana: max($__interval + scrape interval, 4 x scrape interval));
    docs/dashboards.md, "Activity: counters, not gauges"."""
    return f"rate({counter}{{{selector}}}[$__rate_interval])"
