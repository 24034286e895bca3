"""GPU / Node overview (gpu-node-overview.json): per-node GPU-Util next to true SM
activity, memory, power, temperature, health and schedulable capacity."""

from __future__ import annotations

from grafana_dashboard import dashboard
from grafana_panels import (
    ACTIVE_MAP,
    HEALTHY_MAP,
    Json,
    bargauge,
    stat,
    state_timeline,
    table,
    target,
    timeseries,
)
from series_labels import GPU, GPU_LEGEND, MIG, NODE, WHOLE, activity


def node_overview() -> Json:
    util = activity("gpu_utilization_seconds_total", GPU)
    sm = activity("gpu_sm_active_seconds_total", f"{GPU}, {WHOLE}")
    return dashboard(
        "gpu-occupancy-node-overview",
        "GPU / Node overview",
        "Per-node GPU view: GPU-Util next to true SM activity, memory, power, "
        "temperature, health and schedulable capacity.",
        ["job", "node", "instance", "gpu"],
        [
            (
                "Summary",
                [
                    stat(
                        "GPUs",
                        "GPUs the selected exporters see.",
                        f"count(gpu_info{{{GPU}}})",
                        "short",
                    ),
                    stat(
                        "Unhealthy GPUs",
                        "GPUs with an active `unhealthy` health reason.",
                        f"count(gpu_healthy{{{GPU}}} == 0) or vector(0)",
                        "short",
                        thresholds=[(None, "green"), (1, "red")],
                    ),
                    stat(
                        "GPU-Util (average)",
                        "NVML GPU-Util: share of time any kernel ran (mean over the rate "
                        "interval, from its seconds counter).",
                        f"avg({util})",
                        "percentunit",
                    ),
                    stat(
                        "SM active (average)",
                        "Share of SMs busy (GPM/DCGM): real work (mean over the rate "
                        "interval, from its seconds counter).",
                        f"avg({sm})",
                        "percentunit",
                    ),
                    stat(
                        "GPU memory used",
                        "Used / total over whole GPUs.",
                        f"sum(gpu_memory_used_bytes{{{GPU}, {WHOLE}}}) / "
                        f"sum(gpu_memory_total_bytes{{{GPU}, {WHOLE}}})",
                        "percentunit",
                        thresholds=[(None, "green"), (0.8, "orange"), (0.95, "red")],
                    ),
                    stat(
                        "Power draw",
                        "Total power of the selected GPUs.",
                        f"sum(gpu_power_watts{{{GPU}}})",
                        "watt",
                    ),
                ],
            ),
            (
                "GPU-Util vs SM activity (the 100 % utilisation lie)",
                [
                    timeseries(
                        "GPU-Util (NVML)",
                        "Share of the time any kernel was running, the mean over the rate "
                        "interval of gpu_utilization_seconds_total (every second counted, "
                        "whatever the scrape). One tiny kernel at a time reads 100 %.",
                        [target(util, GPU_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "SM active (GPM / DCGM)",
                        "Share of SMs busy: what the GPU actually did, the mean over the "
                        "rate interval of gpu_sm_active_seconds_total. Absent on GPUs "
                        "without GPM (before Hopper) unless DCGM provides it.",
                        [target(sm, GPU_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "GPU-Util minus SM active",
                        "How far GPU-Util overstates SM activity. Near 0: honest; near "
                        "1: busy-looking but idle SMs (alert "
                        "GPUUtilizationWithoutSMActivity).",
                        [target(f"gpu:gpu_utilization_minus_sm_active:ratio{{{GPU}}}", GPU_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "Node average: GPU-Util vs SM active",
                        "Averages over the node's GPUs (recording rules: means over 2 "
                        "minutes of the seconds counters).",
                        [
                            target(
                                f"node:gpu_utilization_ratio:avg{{{NODE}}}", "{{node}} GPU-Util"
                            ),
                            target(f"node:gpu_sm_active_ratio:avg{{{NODE}}}", "{{node}} SM active"),
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "SM occupancy, tensor and DRAM activity",
                        "Resident warps vs maximum, tensor pipe activity and DRAM "
                        "bandwidth vs peak (GPM / DCGM), means over the rate interval of "
                        "their seconds counters.",
                        [
                            target(
                                activity("gpu_sm_occupancy_seconds_total", f"{GPU}, {WHOLE}"),
                                GPU_LEGEND + " occupancy",
                            ),
                            target(
                                activity("gpu_tensor_active_seconds_total", f"{GPU}, {WHOLE}"),
                                GPU_LEGEND + " tensor",
                            ),
                            target(
                                activity("gpu_dram_active_seconds_total", f"{GPU}, {WHOLE}"),
                                GPU_LEGEND + " DRAM",
                            ),
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "MIG instances: SM active",
                        "SM activity per MIG instance (GPU-Util is not reported in MIG mode).",
                        [
                            target(
                                activity("gpu_sm_active_seconds_total", f"{GPU}, {MIG}"),
                                GPU_LEGEND + " {{mig_profile}} GI {{gpu_instance}}",
                            )
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Memory",
                [
                    timeseries(
                        "Memory used",
                        "Excluding driver-reserved memory (NVML memory info v2).",
                        [target(f"gpu_memory_used_bytes{{{GPU}, {WHOLE}}}", GPU_LEGEND)],
                        "bytes",
                    ),
                    bargauge(
                        "Memory used / total",
                        "Now, per GPU.",
                        f"gpu_memory_used_bytes{{{GPU}, {WHOLE}}} / "
                        f"gpu_memory_total_bytes{{{GPU}, {WHOLE}}}",
                        GPU_LEGEND,
                        "percentunit",
                        maximum=1,
                    ),
                    timeseries(
                        "MIG instances: memory used",
                        "Per MIG instance.",
                        [
                            target(
                                f"gpu_memory_used_bytes{{{GPU}, {MIG}}}",
                                GPU_LEGEND + " {{mig_profile}} GI {{gpu_instance}}",
                            )
                        ],
                        "bytes",
                    ),
                    timeseries(
                        "Memory controller busy (NVML)",
                        "Share of the window in which device memory was read or written.",
                        [target(f"gpu_memory_utilization_ratio{{{GPU}}}", GPU_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Power, temperature, clocks",
                [
                    timeseries(
                        "Power draw and limit",
                        "Draw (solid) and enforced limit.",
                        [
                            target(f"gpu_power_watts{{{GPU}}}", GPU_LEGEND),
                            target(f"gpu_power_limit_watts{{{GPU}}}", GPU_LEGEND + " limit"),
                        ],
                        "watt",
                    ),
                    timeseries(
                        "Temperature",
                        "GPU die temperature, and device memory (HBM) temperature where the "
                        "GPU reports it.",
                        [
                            target(f"gpu_temperature_celsius{{{GPU}}}", GPU_LEGEND),
                            target(
                                f"gpu_memory_temperature_celsius{{{GPU}}}", GPU_LEGEND + " memory"
                            ),
                        ],
                        "celsius",
                    ),
                    timeseries(
                        "SM clock",
                        "Drops under load point at thermal or power slowdown.",
                        [target(f"gpu_sm_clock_hertz{{{GPU}}}", GPU_LEGEND)],
                        "hertz",
                    ),
                    state_timeline(
                        "Clock-event reasons holding clocks down",
                        "Throttle reasons other than idle and settings "
                        "(hw_* = slowdown: alert GPUThermalOrPowerSlowdown).",
                        [
                            target(
                                f'gpu_clock_event_active{{{GPU}, reason!~"gpu_idle|'
                                f'applications_clocks_setting|display_clock_setting"}}',
                                GPU_LEGEND + " {{reason}}",
                            )
                        ],
                        "bool_on_off",
                        ACTIVE_MAP,
                    ),
                ],
            ),
            (
                "Interconnect, video engines, time throttled",
                [
                    timeseries(
                        "PCIe throughput",
                        "Bytes per second over PCIe, from NVML's byte counters (drivers R555 "
                        "and newer).",
                        [
                            target(
                                f"rate(gpu_pcie_transmitted_bytes_total{{{GPU}}}"
                                "[$__rate_interval])",
                                GPU_LEGEND + " sent",
                            ),
                            target(
                                f"rate(gpu_pcie_received_bytes_total{{{GPU}}}[$__rate_interval])",
                                GPU_LEGEND + " received",
                            ),
                        ],
                        "Bps",
                    ),
                    timeseries(
                        "PCIe link against its best",
                        "Current link width and generation over the best this GPU can reach "
                        "in its slot (1 = full). Idle GPUs drop their generation to save "
                        "power; below 1 under load is a degraded link (alert "
                        "GPUPCIeLinkDegraded).",
                        [
                            target(
                                f"gpu_pcie_link_width{{{GPU}}} / gpu_pcie_link_max_width{{{GPU}}}",
                                GPU_LEGEND + " width",
                            ),
                            target(
                                f"gpu_pcie_link_generation{{{GPU}}} / "
                                f"gpu_pcie_link_max_generation{{{GPU}}}",
                                GPU_LEGEND + " generation",
                            ),
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "NVLink throughput",
                        "Data bytes per second over all of a GPU's NVLinks.",
                        [
                            target(
                                "sum by (node, instance, gpu, uuid) (rate("
                                f"gpu_nvlink_transmitted_bytes_total{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " sent",
                            ),
                            target(
                                "sum by (node, instance, gpu, uuid) (rate("
                                f"gpu_nvlink_received_bytes_total{{{GPU}}}[$__rate_interval]))",
                                GPU_LEGEND + " received",
                            ),
                        ],
                        "Bps",
                    ),
                    timeseries(
                        "NVLink errors (links with new errors)",
                        "CRC, replay and recovery errors in the last 5 minutes, per link that "
                        "had any. A link that keeps logging them is marginal: reseat or "
                        "replace the board.",
                        [
                            target(
                                "sum by (node, instance, gpu, uuid, link, type) (increase("
                                f"gpu_nvlink_errors_total{{{GPU}}}[5m])) > 0",
                                GPU_LEGEND + " link {{link}} {{type}}",
                            )
                        ],
                        "short",
                    ),
                    timeseries(
                        "Share of time throttled, by reason",
                        "Share of each interval in which the reason held clocks down (NVML "
                        "violation time). Reasons overlap: thermal includes both thermal "
                        "slowdowns.",
                        [
                            target(
                                f'rate(gpu_clock_event_seconds_total{{{GPU}, reason!="low_'
                                'utilization"}[$__rate_interval]) > 0',
                                GPU_LEGEND + " {{reason}}",
                            )
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                    timeseries(
                        "Video encoder and decoder",
                        "NVENC / NVDEC busy time; video work does not show in GPU-Util.",
                        [
                            target(
                                f"gpu_encoder_utilization_ratio{{{GPU}}}", GPU_LEGEND + " NVENC"
                            ),
                            target(
                                f"gpu_decoder_utilization_ratio{{{GPU}}}", GPU_LEGEND + " NVDEC"
                            ),
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Health and node capacity",
                [
                    state_timeline(
                        "GPU health verdict",
                        "gpu_healthy per GPU (docs/health.md).",
                        [target(f"gpu_healthy{{{GPU}}}", GPU_LEGEND)],
                        "bool_yes_no",
                        HEALTHY_MAP,
                    ),
                    table(
                        "Active health reasons",
                        "Reasons behind unhealthy/degraded GPUs.",
                        f"gpu_health_reason{{{GPU}}} == 1",
                        "none",
                        hide_value=True,
                    ),
                    timeseries(
                        "Node devices by state",
                        "allocatable = healthy advertised - allocated healthy - disrupted (per "
                        "extended resource); disrupted = healthy free devices no new pod can "
                        "get (cordon, node taint, driver upgrade, device taint: see the panel "
                        "below); unknown = advertised devices whose health no source can "
                        "judge. A state whose source (NVML, the kubelet, the Node watch) is "
                        "down has no line meanwhile.",
                        [target(f"gpu_node_devices{{{NODE}}}", "{{node}} {{resource}} {{state}}")],
                        "short",
                    ),
                    bargauge(
                        "Devices by state now",
                        "Summed over the selected nodes; a node adds nothing to a state its "
                        "sources cannot tell now (see unknown).",
                        f"sum by (resource, state) (gpu_node_devices{{{NODE}}})",
                        "{{resource}} {{state}}",
                        "short",
                    ),
                    timeseries(
                        "Disrupted devices by reason",
                        "The node's disrupted devices (healthy, held by no pod, but no new "
                        "pod can get them) per resource and reason "
                        "(gpu_node_disrupted_devices; docs/capacity.md): cordoned (kubectl "
                        "cordon), node_taint (a NoSchedule/NoExecute taint GPU pods are not "
                        "known to tolerate), driver_upgrade (the GPU Operator's upgrade "
                        "state), device_taint (a DRA device taint). A device blocked for two "
                        "reasons counts under each: not stacked. 0: nothing disrupted for "
                        "that reason; no line: unknown (the Node watch is down, or the "
                        "exporter runs without the Kubernetes API: then only device_taint).",
                        [
                            target(
                                f"gpu_node_disrupted_devices{{{NODE}}}",
                                "{{node}} {{resource}} {{reason}}",
                            )
                        ],
                        "short",
                        w=24,
                    ),
                ],
            ),
        ],
    )
