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
from series_labels import EXPORTER_SELECTOR, GPU, GPU_LEGEND, NODE


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
