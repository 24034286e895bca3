"""GPU / Health and orphaned memory (gpu-health-orphans.json): XID errors, health
verdicts and reasons, orphaned (zombie) GPU memory with its holders, and the exporter's
own health."""

from __future__ import annotations

from grafana_dashboard import dashboard
from grafana_panels import (
    ACTIVE_MAP,
    HEALTHY_MAP,
    UP_MAP,
    Json,
    stat,
    state_timeline,
    table,
    target,
    timeseries,
)
from series_labels import EXPORTER_SELECTOR, GPU, GPU_LEGEND, NODE, POD

# gpu_health_reason's `reason` values (docs/metrics.md, docs/health.md), in the order the
# "Unhealthy GPUs and the pods on them" table lists them. tests/test_dashboards.py holds
# this list to the documented one.
HEALTH_REASONS = (
    "gpu_lost",
    "fatal_xid",
    "uncorrectable_ecc",
    "row_remap_failure",
    "row_remap_pending",
    "retired_pages_limit",
    "recovery_action",
    "dcgm_health",
    "thermal_slowdown",
    "power_slowdown",
    "unreadable",
)
# One GPU as its own exporter's target serves it: the join key of every GPU-level series.
GPU_KEY = "job, instance, uuid"
ROW_LABELS = "job, node, instance, gpu, uuid, model, namespace, pod, container"


def unhealthy_gpus_and_pods() -> str:
    """One row per (unhealthy GPU, container allocated a device on it), or per unhealthy
    GPU where none is: node, GPU, UUID, model, its active reasons, namespace/pod/container.

    Every join is many-to-one on (job, instance, uuid), its right side one series per GPU
    by construction: the containers side stays on the left (``and``/``unless`` filter
    it, ``group_left`` adds the GPU's labels). ``gpu_healthy == 0 * on (uuid)
    gpu_container_allocated`` fails with "many-to-many" once two containers share a GPU;
    joining the reasons (two series for a GPU with two reasons) the same way fails too.
    So the reasons are folded into one label per GPU first: for each documented reason a
    one-series-per-GPU label ``r_<reason>`` ("<reason> " while active, else ""), added by
    ``group_left``, then ``label_join``ed into ``reasons``.
    """
    unhealthy = f"gpu_healthy{{{GPU}}} == 0"
    containers = (
        "max by (job, node, instance, gpu, uuid, namespace, pod, container) "
        f"(gpu_container_allocated{{{POD}}})"
    )
    # containers on an unhealthy GPU, and unhealthy GPUs with none
    rows = (
        f"(({containers}) and on ({GPU_KEY}) ({unhealthy})) "
        f"or (({unhealthy}) unless on ({GPU_KEY}) ({containers}))"
    )
    # value 1 for every unhealthy GPU, with no other label: the default of each per-GPU
    # label below (an unmatched `or on` branch)
    one = f"(max by ({GPU_KEY}) (gpu_healthy == 0) + 1)"
    # one model per GPU (topk: gpu_info can show a named model and model="" while NVML
    # cannot name the GPU); a GPU without gpu_info keeps its row with no model
    model = f"topk by ({GPU_KEY}) (1, max by ({GPU_KEY}, model) (gpu_info))"
    joined = f"({rows}) * on ({GPU_KEY}) group_left (model) ({model} or on ({GPU_KEY}) {one})"
    for reason in HEALTH_REASONS:
        active = (
            f'label_replace(max by ({GPU_KEY}) (gpu_health_reason{{reason="{reason}"}} == 1), '
            f'"r_{reason}", "{reason} ", "", "")'
        )
        joined += f" * on ({GPU_KEY}) group_left (r_{reason}) ({active} or on ({GPU_KEY}) {one})"
    labels = ", ".join(f'"r_{r}"' for r in HEALTH_REASONS)
    folded = f'label_join({joined}, "reasons", "", {labels})'
    # (a trailing space is left: trimming it takes a `$1`, which Grafana reads as a variable)
    return f"max by ({ROW_LABELS}, reasons) ({folded})"


def unhealthy_table() -> Json:
    panel = table(
        "Unhealthy GPUs and the pods on them",
        "Which GPUs are unhealthy (gpu_healthy 0), why (every active reason of "
        "gpu_health_reason, docs/health.md), and which containers hold a device on each "
        "(gpu_container_allocated: whole GPUs, replicas and MIG instances of it). One row "
        "per container; a GPU no container holds has one row without a pod. Filtered by "
        "namespace and pod, a GPU whose containers are all filtered out shows no pod.",
        unhealthy_gpus_and_pods(),
        "none",
        w=24,
        hide_value=True,
    )
    order = ["node", "gpu", "uuid", "model", "reasons", "namespace", "pod", "container"]
    panel["transformations"][0]["options"]["indexByName"] = {n: i for i, n in enumerate(order)}
    panel["transformations"][0]["options"]["renameByName"] = {"gpu": "GPU", "uuid": "UUID"}
    return panel


def health_orphans() -> Json:
    orphans = f"gpu_orphaned_memory_bytes{{{GPU}}}"
    return dashboard(
        "gpu-occupancy-health-orphans",
        "GPU / Health and orphaned memory",
        "XID errors, health verdicts and reasons, orphaned (zombie) GPU memory with its "
        "holders, and the exporter's own health.",
        ["job", "node", "instance", "gpu", "namespace", "pod"],
        [
            (
                "Summary",
                [
                    stat(
                        "Unhealthy GPUs",
                        "GPUs with an active `unhealthy` reason.",
                        f"count(gpu_healthy{{{GPU}}} == 0) or vector(0)",
                        "short",
                        thresholds=[(None, "green"), (1, "red")],
                    ),
                    stat(
                        "Degraded GPUs",
                        "GPUs slowed by heat or power.",
                        f"count(max by (instance, uuid) (gpu_health_reason{{{GPU}, "
                        f'class="degraded"}}) == 1) or vector(0)',
                        "short",
                        thresholds=[(None, "green"), (1, "orange")],
                    ),
                    stat(
                        "Fatal XIDs (range)",
                        "Fatal XID errors in the selected range.",
                        f'sum(increase(gpu_xid_errors_total{{{GPU}, class="fatal"}}'
                        f"[$__range])) or vector(0)",
                        "short",
                        thresholds=[(None, "green"), (1, "red")],
                    ),
                    stat(
                        "Orphaned GPU memory",
                        "All kinds, now.",
                        f"sum({orphans}) or vector(0)",
                        "bytes",
                        thresholds=[(None, "green"), (1, "orange")],
                    ),
                    stat(
                        "Orphaned processes",
                        "Processes holding orphaned memory, now.",
                        f"sum(gpu_orphaned_processes{{{GPU}}}) or vector(0)",
                        "short",
                        thresholds=[(None, "green"), (1, "orange")],
                    ),
                    stat(
                        "Exporters up",
                        "Share of exporter targets Prometheus can scrape.",
                        f"avg(up{{{EXPORTER_SELECTOR}, {NODE}}})",
                        "percentunit",
                        thresholds=[(None, "red"), (1, "green")],
                    ),
                ],
            ),
            (
                "XID errors",
                [
                    timeseries(
                        "XID errors by code",
                        "New XIDs per interval, by code and severity class (docs/xid.md).",
                        [
                            target(
                                f"sum by (node, gpu, uuid, xid, class) (increase("
                                f"gpu_xid_errors_total{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " XID {{xid}} ({{class}})",
                            )
                        ],
                        "short",
                        bars=True,
                    ),
                    table(
                        "XID errors seen",
                        "Counts since the exporter started (with --kmsg: "
                        "since the kernel log began).",
                        f"gpu_xid_errors_total{{{GPU}}}",
                        "short",
                        rename={"Value": "errors"},
                        sort_by="errors",
                    ),
                ],
            ),
            (
                "Health",
                [
                    state_timeline(
                        "GPU health verdict",
                        "gpu_healthy per GPU.",
                        [target(f"gpu_healthy{{{GPU}}}", GPU_LEGEND)],
                        "bool_yes_no",
                        HEALTHY_MAP,
                    ),
                    table(
                        "Active health reasons",
                        "unhealthy: take out of service; degraded: still schedulable but slower.",
                        f"gpu_health_reason{{{GPU}}} == 1",
                        "none",
                        hide_value=True,
                    ),
                    unhealthy_table(),
                    timeseries(
                        "ECC errors, remapped rows, PCIe replays",
                        "New per interval.",
                        [
                            target(
                                f"sum by (node, gpu, type) (increase(gpu_ecc_errors_total"
                                f"{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " ECC {{type}}",
                            ),
                            target(
                                f"sum by (node, gpu, cause) (increase("
                                f"gpu_remapped_rows_total{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " remapped rows {{cause}}",
                            ),
                            target(
                                f"sum by (node, gpu) (increase(gpu_pcie_replays_total"
                                f"{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " PCIe replays",
                            ),
                        ],
                        "short",
                        bars=True,
                    ),
                    state_timeline(
                        "Row remapping pending / failed",
                        "Pending: reset the GPU. Failed: replace it.",
                        [
                            target(f"gpu_row_remap_pending{{{GPU}}}", GPU_LEGEND + " pending"),
                            target(f"gpu_row_remap_failed{{{GPU}}}", GPU_LEGEND + " failed"),
                        ],
                        "bool_yes_no",
                        ACTIVE_MAP,
                    ),
                ],
            ),
            (
                "Orphaned GPU memory",
                [
                    timeseries(
                        "Orphaned memory by kind",
                        "dead_process, deleted_pod, stuck_process, unattributed.",
                        [
                            target(
                                f"sum by (node, gpu, uuid, kind) ({orphans})",
                                GPU_LEGEND + " {{kind}}",
                            )
                        ],
                        "bytes",
                        stacked=True,
                    ),
                    timeseries(
                        "Orphaned processes by kind",
                        "Processes per kind.",
                        [target(f"gpu_orphaned_processes{{{GPU}}}", GPU_LEGEND + " {{kind}}")],
                        "short",
                        stacked=True,
                    ),
                    table(
                        "Orphan holders",
                        "Processes holding orphaned memory: pid, command, and the pod they "
                        "belonged to. Kill or restart these to free the memory "
                        "(docs/runbooks.md#gpuorphanedmemory).",
                        f'gpu_orphaned_holder_info{{{GPU}, namespace=~"$namespace", pod=~"$pod"}}',
                        "none",
                        w=16,
                        hide_value=True,
                    ),
                    table(
                        "Orphaned for",
                        "Time since the exporter first saw each orphan.",
                        f"time() - gpu_orphaned_memory_first_seen_timestamp_seconds{{{GPU}}}",
                        "s",
                        w=8,
                        rename={"Value": "orphaned for"},
                        sort_by="orphaned for",
                    ),
                    timeseries(
                        "Memory of processes no container owns",
                        "owner host / dead / unknown, with the reason.",
                        [
                            target(
                                f"gpu_unattributed_memory_used_bytes{{{GPU}}}",
                                GPU_LEGEND + " {{owner}} {{reason}}",
                            )
                        ],
                        "bytes",
                        w=24,
                    ),
                ],
            ),
            (
                "Exporter",
                [
                    state_timeline(
                        "Sources up",
                        "nvml, procfs, podresources, kube, xid, dcgm.",
                        [target(f"gpu_exporter_source_up{{{NODE}}}", "{{node}} {{source}}")],
                        "bool_on_off",
                        UP_MAP,
                    ),
                    timeseries(
                        "Seconds since the last sample",
                        "Alert GPUExporterSamplesStale above 60 s.",
                        [
                            target(
                                f"time() - gpu_exporter_last_sample_timestamp_seconds{{{NODE}}}",
                                "{{node}}",
                            )
                        ],
                        "s",
                    ),
                    timeseries(
                        "Sample cycle duration (p99)",
                        "Sources and analysis per cycle.",
                        [
                            target(
                                f"histogram_quantile(0.99, sum by (le, node, instance) "
                                f"(rate(gpu_exporter_sample_duration_seconds_bucket"
                                f"{{{NODE}}}[$__rate_interval])))",
                                "{{node}}",
                            )
                        ],
                        "s",
                    ),
                    timeseries(
                        "Exporter errors",
                        "Failed queries and refreshes per second.",
                        [
                            target(
                                f"sum by (node, source) (rate(gpu_exporter_errors_total"
                                f"{{{NODE}}}[$__rate_interval]))",
                                "{{node}} {{source}}",
                            )
                        ],
                        "cps",
                    ),
                    state_timeline(
                        "NVML up",
                        "0: no driver, or libnvidia-ml not mounted.",
                        [target(f'gpu_exporter_source_up{{source="nvml", {NODE}}}', "{{node}}")],
                        "bool_on_off",
                        UP_MAP,
                        w=24,
                        h=5,
                    ),
                ],
            ),
        ],
    )
