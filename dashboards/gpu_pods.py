"""GPU / Pods (gpu-pods.json): who uses the GPUs, per namespace and pod, on exclusive,
time-sliced and MIG GPUs; idle allocations and isolation leaks."""

from __future__ import annotations

from grafana_dashboard import dashboard
from grafana_panels import Json, bargauge, stat, table, target, timeseries
from series_labels import (
    CONTAINER_KEYS,
    GPU,
    GPU_LEGEND,
    MIG,
    NS,
    POD,
    POD_LEGEND,
    SHARED_DEVICE,
    activity,
)

# A container's SM share: the mean over the rate interval of its SM-seconds counter (the
# gauge gpu_container_sm_utilization_ratio shows the exporter's last sample window only).
SM_SECONDS = "gpu_container_sm_seconds_total"


def _series(metric: str, selector: str) -> str:
    """The metric's series under ``selector``; an activity counter as its rate."""
    return activity(metric, selector) if metric == SM_SECONDS else f"{metric}{{{selector}}}"


def _exclusive(metric: str) -> str:
    whole = f'{POD}, mig_uuid=""'
    return (
        f"{_series(metric, whole)} and on ({CONTAINER_KEYS}) "
        f'gpu_container_allocated{{{POD}, mig_uuid="", device_id!~".+::.+"}}'
    )


def _shared(metric: str) -> str:
    return (
        f"{_series(metric, POD)} and on ({CONTAINER_KEYS}) "
        f"gpu_container_allocated{{{POD}, {SHARED_DEVICE}}}"
    )


def pods() -> Json:
    idle = f"gpu_container_idle_allocated_seconds_total{{{POD}}}"
    return dashboard(
        "gpu-occupancy-pods",
        "GPU / Pods",
        "Who uses the GPUs: per-namespace and per-pod memory and SM share on exclusive, "
        "time-sliced and MIG GPUs, idle allocations and isolation leaks.",
        ["job", "node", "instance", "gpu", "namespace", "pod"],
        [
            (
                "Namespaces",
                [
                    bargauge(
                        "GPU memory by namespace",
                        "Now (recording rule).",
                        f"sum by (namespace) "
                        f"(node_namespace:gpu_container_memory_used_bytes:sum{{{NS}}})",
                        "{{namespace}}",
                        "bytes",
                        w=8,
                    ),
                    bargauge(
                        "SM share by namespace",
                        "Sum of the containers' SM shares: 100 % = one GPU's SMs fully "
                        "busy. MIG instances are not included (no per-process samples).",
                        f"sum by (namespace) "
                        f"(node_namespace:gpu_container_sm_utilization_ratio:sum{{{NS}}})",
                        "{{namespace}}",
                        "percentunit",
                        w=8,
                    ),
                    bargauge(
                        "Idle allocated GPU time (dashboard range)",
                        "Device time reserved and left idle over the selected range "
                        "(1 hour = one idle GPU-hour).",
                        f"sum by (namespace) (increase({idle}[$__range]))",
                        "{{namespace}}",
                        "s",
                        w=8,
                    ),
                    timeseries(
                        "Allocated devices by namespace",
                        "Devices the kubelet allocated, by extended resource.",
                        [
                            target(
                                f"sum by (namespace, resource) "
                                f"(node_namespace:gpu_container_allocated:sum{{{NS}}})",
                                "{{namespace}} {{resource}}",
                            )
                        ],
                        "short",
                        stacked=True,
                    ),
                    timeseries(
                        "Idle allocated devices by namespace",
                        "Allocated devices idle (5-minute average, recording rule).",
                        [
                            target(
                                f"sum by (namespace) (node_namespace:"
                                f"gpu_container_idle_allocated_seconds:rate5m{{{NS}}})",
                                "{{namespace}}",
                            )
                        ],
                        "short",
                        stacked=True,
                    ),
                ],
            ),
            (
                "Exclusive GPUs (one container per GPU)",
                [
                    timeseries(
                        "Memory per container",
                        "Containers allocated a whole GPU.",
                        [target(_exclusive("gpu_container_memory_used_bytes"), POD_LEGEND)],
                        "bytes",
                    ),
                    timeseries(
                        "SM share per container",
                        "From NVML per-process samples (sum over the container's processes): "
                        "the mean over the rate interval of its SM-seconds counter.",
                        [target(_exclusive(SM_SECONDS), POD_LEGEND)],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Time-sliced GPUs (shared, no isolation)",
                [
                    timeseries(
                        "Memory per container on shared GPUs",
                        "Containers allocated a time-sliced replica (GPU-…::N). "
                        "Nothing stops one from taking all the memory.",
                        [target(_shared("gpu_container_memory_used_bytes"), POD_LEGEND)],
                        "bytes",
                        stacked=True,
                    ),
                    timeseries(
                        "SM share per container on shared GPUs",
                        "Each container's share of the GPU's SM time (mean over the rate "
                        "interval of its SM-seconds counter).",
                        [target(_shared(SM_SECONDS), POD_LEGEND)],
                        "percentunit",
                        stacked=True,
                    ),
                    bargauge(
                        "Pods on each GPU",
                        "Pods with memory on the GPU now.",
                        f"count by (node, gpu, uuid) (count by (node, gpu, uuid, namespace,"
                        f' pod) (gpu_container_memory_used_bytes{{{GPU}, mig_uuid=""}}))',
                        GPU_LEGEND,
                        "short",
                    ),
                    table(
                        "Who shares with whom",
                        "Containers on GPUs used by more than one container, with their memory.",
                        f'gpu_container_memory_used_bytes{{{POD}, mig_uuid=""}} and on '
                        f"(instance, uuid) (count by (instance, uuid) "
                        f'(gpu_container_memory_used_bytes{{{GPU}, mig_uuid=""}}) > 1)',
                        "bytes",
                        rename={"Value": "memory"},
                        sort_by="memory",
                    ),
                ],
            ),
            (
                "Shared GPUs: turns, headroom, promised limits",
                [
                    timeseries(
                        "SM time share by container",
                        "Each container's part of the SM time all containers used on a shared "
                        "GPU (sums to 100 % per GPU). Processes take turns: one pod far above "
                        "its equal share while others wait is a hog (alert GPUTimeSliceHog). "
                        "Under MPS the share is of concurrent SM time (docs/shared-gpus.md).",
                        [target(f"gpu_container_sm_time_share_ratio{{{POD}}}", POD_LEGEND)],
                        "percentunit",
                        stacked=True,
                    ),
                    timeseries(
                        "Containers that wanted each shared GPU",
                        "Containers with SM time in the sample window (they took turns) and "
                        "all containers with a process on the GPU.",
                        [
                            target(
                                f"gpu_shared_active_containers{{{GPU}}}", "active " + GPU_LEGEND
                            ),
                            target(f"gpu_shared_containers{{{GPU}}}", "present " + GPU_LEGEND),
                        ],
                        "short",
                    ),
                    timeseries(
                        "Deviation from an equal share",
                        "Share minus 1 / active containers: +65 % is a pod that took 90 % of "
                        "the turns while three others waited.",
                        [
                            target(
                                f"gpu_container_sm_fair_share_deviation_ratio{{{POD}}}",
                                POD_LEGEND,
                            )
                        ],
                        "percentunit",
                    ),
                    timeseries(
                        "Memory headroom vs largest recent growth",
                        "What the next allocation can get (total - used - reserved) and the "
                        "largest growth of one container in the last 5 minutes: once the "
                        "headroom is below it, the next such growth fails (alert "
                        "GPUSharedMemoryNearFull). Nothing isolates the tenants' memory.",
                        [
                            target(
                                f"gpu_shared_memory_headroom_bytes{{{GPU}}}",
                                "headroom " + GPU_LEGEND,
                            ),
                            target(
                                f"max by (node, instance, gpu, uuid) "
                                f"(gpu_container_memory_growth_bytes{{{GPU}}})",
                                "largest growth " + GPU_LEGEND,
                            ),
                        ],
                        "bytes",
                    ),
                    table(
                        "Who grew (last 5 minutes)",
                        "Containers on shared GPUs whose memory rose above its lowest point "
                        "in the last 5 minutes.",
                        f"topk(10, gpu_container_memory_growth_bytes{{{POD}}} > 0)",
                        "bytes",
                        rename={"Value": "growth"},
                        sort_by="growth",
                    ),
                    table(
                        "Used vs promised (HAMi limits)",
                        "Memory used as a share of the memory HAMi promised the container "
                        "(nvidia.com/gpumem): above 100 % it is over its promise. HAMi-core "
                        "enforces the limit in user space, the driver does not.",
                        f"gpu_container_memory_used_bytes{{{POD}}} / on ({CONTAINER_KEYS}) "
                        f"gpu_container_memory_limit_bytes{{{POD}}}",
                        "percentunit",
                        rename={"Value": "of promise"},
                        sort_by="of promise",
                    ),
                ],
            ),
            (
                "MIG instances (hardware partitions)",
                [
                    timeseries(
                        "Memory per container on MIG instances",
                        "Per MIG instance.",
                        [
                            target(
                                f'gpu_container_memory_used_bytes{{{POD}, mig_uuid!=""}}',
                                POD_LEGEND + " {{mig_profile}}",
                            )
                        ],
                        "bytes",
                    ),
                    timeseries(
                        "SM active of each pod's MIG instance",
                        "The instance's SM activity (GPM), named after the pod it is allocated to.",
                        [
                            target(
                                activity("gpu_sm_active_seconds_total", f"{GPU}, {MIG}")
                                + " * on (instance, "
                                f"mig_uuid) group_left (namespace, pod, container) max by "
                                f"(instance, mig_uuid, namespace, pod, container) "
                                f'(gpu_container_allocated{{{POD}, mig_uuid!=""}})',
                                POD_LEGEND + " {{mig_profile}}",
                            )
                        ],
                        "percentunit",
                        ratio=True,
                    ),
                ],
            ),
            (
                "Idle allocations",
                [
                    table(
                        "Idle share of allocated devices (last hour)",
                        "Share of the last hour each allocated device stayed below the idle "
                        "threshold (alert GPUAllocatedButIdle above 90 % for an hour).",
                        f"rate({idle}[1h])",
                        "percentunit",
                        rename={"Value": "idle share"},
                        sort_by="idle share",
                    ),
                    timeseries(
                        "Allocated devices idle now",
                        "Per pod.",
                        [
                            target(
                                f"sum by (namespace, pod) (gpu_container_allocated_idle{{{POD}}})",
                                "{{namespace}}/{{pod}}",
                            )
                        ],
                        "short",
                        stacked=True,
                    ),
                ],
            ),
            (
                "Isolation leaks",
                [
                    stat(
                        "Containers using GPUs not allocated to them",
                        "e.g. NVIDIA_VISIBLE_DEVICES=all or a privileged pod (alert "
                        "GPUIsolationLeak).",
                        f"count(gpu_unallocated_use_memory_bytes{{{POD}}} > 0) or vector(0)",
                        "short",
                        w=6,
                        h=8,
                        thresholds=[(None, "green"), (1, "red")],
                    ),
                    table(
                        "Memory used on devices not allocated to the container",
                        "Now.",
                        f"gpu_unallocated_use_memory_bytes{{{POD}}}",
                        "bytes",
                        w=18,
                        rename={"Value": "memory"},
                        sort_by="memory",
                    ),
                ],
            ),
        ],
    )
