"""Every metric family the exporter can serve, and which are served.

``CATALOGUE`` is the single list of every metric the exporter can emit (name, type,
help): exposition builds from it, docs/metrics.md is checked against it and against real
output by the tests. It lives in ``model``, with the selection below, so that parsing
flags (``exporter.config``) loads neither exposition nor prometheus_client.

Which families are served: ``--families-disable`` / ``--families-enable``.
A family is selected by its name as served (the ``# TYPE`` line: counters without
``_total``) with shell-style globs (``*``, ``?``, ``[...]``). The order is fixed, whatever
the order of the flags: the defaults (``DEFAULT_OFF`` off, everything else on;
``--per-process-metrics`` turns ``gpu_process_*`` on), then ``--families-disable`` turns
off, then ``--families-enable`` turns on, so enable wins where both match:
``--families-disable '*' --families-enable 'gpu_memory_*'`` serves only memory (and the
exporter's own metrics). The exporter's own ``gpu_exporter_*`` families are always
served: the shipped alerts tell a dead or blind exporter from a quiet GPU by them.

A pattern that selects nothing is refused (a typo must not silently do nothing).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from fnmatch import fnmatchcase

from exporter.model.vocabulary import OCCUPANCY_FIELDS

GAUGE, COUNTER = "gauge", "counter"

# Stability levels, the first words of every family's HELP text (docs/metrics.md, "The
# metric contract"), as kube-state-metrics marks its families "[STABLE] " (its
# pkg/metric_generator/generator.go): here every level is spelled, so that the HELP line
# alone tells a user what may change. tests/test_metrics_doc.py holds docs/metrics.md to it.
STABLE = "[STABLE] "
EXPERIMENTAL = "[EXPERIMENTAL] "
DEPRECATED = "[DEPRECATED] "
LEVELS = {STABLE: "stable", EXPERIMENTAL: "experimental", DEPRECATED: "deprecated"}

CATALOGUE: dict[str, tuple[str, str]] = {
    # exporter self-metrics (the histogram, errors and build info live in the agent)
    "gpu_exporter_nvml_up": (
        GAUGE,
        DEPRECATED + 'To be removed in 0.3: use gpu_exporter_source_up{source="nvml"}. '
        "1 when NVML initialised and answered this cycle.",
    ),
    "gpu_exporter_source_up": (
        GAUGE,
        STABLE + "1 when the named source answered its last refresh.",
    ),
    "gpu_exporter_source_last_success_timestamp_seconds": (
        GAUGE,
        EXPERIMENTAL
        + "Unix time of the named source's last success (a background source goes down when "
        "this is older than 3 of its periods); absent until it first succeeds.",
    ),
    "gpu_exporter_last_sample_timestamp_seconds": (
        GAUGE,
        STABLE + "Unix time at which the last sample cycle started.",
    ),
    "gpu_exporter_kube_relists": (
        COUNTER,
        EXPERIMENTAL + "LISTs a Kubernetes list + watch made after its first, by reason: resync, "
        "expired (410 Gone), watch_failed, bad_stream (malformed or oversize lines), "
        "list_failed (docs/reliability.md).",
    ),
    "gpu_exporter_kube_watch_lines_dropped": (
        COUNTER,
        EXPERIMENTAL
        + "Watch lines a Kubernetes watch skipped: malformed, or oversize (over 16 MiB).",
    ),
    "gpu_exporter_kmsg_overruns": (
        COUNTER,
        EXPERIMENTAL
        + "Times the kernel log's ring buffer overwrote records before --kmsg read them: "
        "records lost, XIDs among them possibly (each is also an error of source kmsg).",
    ),
    "gpu_exporter_unresolved_allocations": (
        GAUGE,
        EXPERIMENTAL
        + "Allocated devices whose id no known form resolves to a GPU (docs/attribution.md).",
    ),
    "gpu_exporter_podresources_other_resource_devices": (
        GAUGE,
        EXPERIMENTAL
        + "Device ids the kubelet allocated under a resource name outside --resource-names "
        "that name a GPU of this node: add the name to the flag (docs/attribution.md).",
    ),
    # identity and state
    "gpu_info": (GAUGE, STABLE + "Static GPU identity; always 1."),
    "gpu_up": (GAUGE, STABLE + "1 when the GPU answered NVML this cycle, 0 when it failed (lost)."),
    "gpu_mig_mode_enabled": (GAUGE, STABLE + "1 when the GPU is in MIG mode."),
    "gpu_mig_info": (GAUGE, STABLE + "Static MIG instance identity; always 1."),
    "gpu_mig_profile_info": (
        GAUGE,
        EXPERIMENTAL
        + "A MIG GPU instance profile a GPU model on this node offers (NVML); always 1. "
        "One series per model and profile, whatever the GPU's MIG mode.",
    ),
    "gpu_mig_profile_memory_bytes": (
        GAUGE,
        EXPERIMENTAL
        + "Memory of a MIG GPU instance profile (gpu_mig_profile_info's memory_bytes as a "
        "value, for the right-sizing rules to compare).",
    ),
    "gpu_mig_profile_sm_share_ratio": (
        GAUGE,
        EXPERIMENTAL
        + "A MIG GPU instance profile's share of the GPU's SMs: compute_slices / gpu_slices.",
    ),
    # memory
    "gpu_memory_total_bytes": (GAUGE, STABLE + "Device (or MIG instance) memory."),
    "gpu_memory_used_bytes": (
        GAUGE,
        STABLE + "Memory in use, excluding driver-reserved memory (NVML memory info v2).",
    ),
    "gpu_memory_free_bytes": (GAUGE, STABLE + "Memory free for allocation."),
    "gpu_memory_reserved_bytes": (GAUGE, STABLE + "Memory the driver reserves for itself."),
    # utilisation and occupancy
    "gpu_utilization_ratio": (
        GAUGE,
        STABLE
        + "NVML GPU-Util: share of the sample window in which any kernel ran (not occupancy).",
    ),
    "gpu_memory_utilization_ratio": (
        GAUGE,
        STABLE + "Share of the sample window in which device memory was read or written.",
    ),
    "gpu_graphics_active_ratio": (
        GAUGE,
        STABLE + "GPM: share of time the graphics/compute engine was active.",
    ),
    "gpu_sm_active_ratio": (
        GAUGE,
        STABLE + "GPM: share of SMs busy, averaged over the last GPM window (--gpm-interval).",
    ),
    "gpu_occupancy_source": (
        GAUGE,
        EXPERIMENTAL + "1 for the source of the GPU's occupancy (gpm, dcgm, or none: "
        "GPU-Util only), 0 for the others.",
    ),
    "gpu_sm_occupancy_ratio": (GAUGE, STABLE + "GPM: resident warps relative to the SMs' maximum."),
    "gpu_tensor_active_ratio": (GAUGE, STABLE + "GPM: share of time tensor pipes were active."),
    "gpu_dram_active_ratio": (GAUGE, STABLE + "GPM: DRAM bandwidth used relative to the maximum."),
    "gpu_fp64_active_ratio": (GAUGE, STABLE + "GPM: share of time the FP64 pipe was active."),
    "gpu_fp32_active_ratio": (GAUGE, STABLE + "GPM: share of time the FP32 pipe was active."),
    "gpu_fp16_active_ratio": (GAUGE, STABLE + "GPM: share of time the FP16 pipe was active."),
    # activity as counters (exporter/analysis/active_time.py): rate() over any window is
    # the mean over that window, whatever the sample and scrape intervals
    "gpu_utilization_seconds": (
        COUNTER,
        EXPERIMENTAL + "Seconds one or more kernels was executing (GPU-Util x time, from "
        "NVML's sample buffer); rate() is GPU-Util's mean over the window.",
    ),
    **{
        f"gpu_{name}_seconds": (
            COUNTER,
            EXPERIMENTAL + f"gpu_{name}_ratio x seconds, over every GPM (or DCGM) window; "
            "rate() is the ratio's mean over the window.",
        )
        for name in OCCUPANCY_FIELDS
    },
    "gpu_activity_sampled_seconds": (
        COUNTER,
        EXPERIMENTAL + "Seconds the activity counters' windows covered, by signal (occupancy: "
        "GPM or DCGM; utilization: GPU-Util's samples); rate(active) / rate(this) is the mean "
        "over the time measured, across gaps.",
    ),
    # physical
    "gpu_temperature_celsius": (GAUGE, STABLE + "GPU die temperature."),
    "gpu_power_watts": (GAUGE, STABLE + "Power draw."),
    "gpu_power_limit_watts": (GAUGE, STABLE + "Enforced power limit."),
    "gpu_energy_joules": (COUNTER, STABLE + "Energy consumed since the driver loaded."),
    "gpu_sm_clock_hertz": (GAUGE, STABLE + "SM clock."),
    "gpu_memory_clock_hertz": (GAUGE, STABLE + "Memory clock."),
    "gpu_clock_event_active": (
        GAUGE,
        EXPERIMENTAL + "1 while the named clock-event (throttle) reason holds clocks down.",
    ),
    "gpu_clock_event_seconds": (
        COUNTER,
        EXPERIMENTAL
        + "Time the named NVML performance policy or clock-event reason held clocks down, "
        "since the driver loaded (reasons overlap: thermal includes both thermal slowdowns).",
    ),
    "gpu_memory_temperature_celsius": (GAUGE, STABLE + "Device memory (HBM) temperature."),
    "gpu_fan_speed_ratio": (
        GAUGE,
        EXPERIMENTAL
        + "Intended fan speed relative to its maximum (may exceed 1); absent on passively "
        "cooled GPUs.",
    ),
    # video engines
    "gpu_encoder_utilization_ratio": (
        GAUGE,
        EXPERIMENTAL + "Share of the sample window in which the video encoder (NVENC) was busy.",
    ),
    "gpu_decoder_utilization_ratio": (
        GAUGE,
        EXPERIMENTAL + "Share of the sample window in which the video decoder (NVDEC) was busy.",
    ),
    # interconnect
    "gpu_pcie_link_generation": (
        GAUGE,
        STABLE + "Current PCIe link generation; drops when the GPU idles (power management).",
    ),
    "gpu_pcie_link_max_generation": (
        GAUGE,
        STABLE + "Best PCIe link generation this GPU can reach in this slot.",
    ),
    "gpu_pcie_link_width": (GAUGE, STABLE + "Current PCIe link width (lanes)."),
    "gpu_pcie_link_max_width": (
        GAUGE,
        STABLE + "Best PCIe link width this GPU can reach in this slot.",
    ),
    "gpu_pcie_transmitted_bytes": (
        COUNTER,
        EXPERIMENTAL + "Bytes the GPU sent over PCIe since the driver loaded (R555+; may wrap).",
    ),
    "gpu_pcie_received_bytes": (
        COUNTER,
        EXPERIMENTAL
        + "Bytes the GPU received over PCIe since the driver loaded (R555+; may wrap).",
    ),
    "gpu_nvlink_active": (GAUGE, EXPERIMENTAL + "1 when the NVLink is up, 0 when it is down."),
    "gpu_nvlink_transmitted_bytes": (COUNTER, EXPERIMENTAL + "Data bytes sent over the NVLink."),
    "gpu_nvlink_received_bytes": (COUNTER, EXPERIMENTAL + "Data bytes received over the NVLink."),
    "gpu_nvlink_errors": (
        COUNTER,
        EXPERIMENTAL + "NVLink data-link errors by type: crc_flit, crc_data, replay, recovery.",
    ),
    # reliability
    "gpu_pcie_replays": (COUNTER, STABLE + "PCIe replay counter."),
    "gpu_ecc_errors": (
        COUNTER,
        STABLE + "ECC errors since the last reset of the aggregate counters.",
    ),
    "gpu_remapped_rows": (COUNTER, STABLE + "Memory rows remapped, by cause."),
    "gpu_row_remap_pending": (GAUGE, STABLE + "1 when a row remap waits for a GPU reset."),
    "gpu_row_remap_failed": (GAUGE, STABLE + "1 when a row remap failed (replace the GPU)."),
    "gpu_xid_errors": (COUNTER, STABLE + "XID errors by code and severity class (docs/xid.md)."),
    "gpu_xid_errors_before_start": (
        GAUGE,
        EXPERIMENTAL
        + "XIDs the kernel log (--kmsg) held from before this exporter started: history, "
        "not new errors (docs/xid.md).",
    ),
    "gpu_recovery_action": (
        GAUGE,
        EXPERIMENTAL + "1 for the recovery action the driver asks for (XID 154): none, gpu_reset, "
        "node_reboot, drain_p2p, drain_and_reset, ... (docs/xid.md).",
    ),
    # processes and attribution
    "gpu_processes": (GAUGE, STABLE + "Processes NVML lists on the device, by kind."),
    "gpu_container_memory_used_bytes": (
        GAUGE,
        STABLE + "GPU memory used by a container's processes. Memory by owner: adds up with "
        "gpu_unattributed_memory_used_bytes, at most gpu_memory_used_bytes (docs/metrics.md).",
    ),
    "gpu_container_sm_utilization_ratio": (
        GAUGE,
        STABLE + "Container's share of SM time from NVML per-process samples (sum, capped at 1).",
    ),
    "gpu_container_sm_seconds": (
        COUNTER,
        EXPERIMENTAL + "SM-seconds of the container's processes on the device (each process "
        "sample's SM share x the period it covers); rate() is its mean SM share.",
    ),
    "gpu_container_processes": (GAUGE, STABLE + "Processes of a container on the device."),
    "gpu_container_allocated": (
        GAUGE,
        STABLE + "1 for every device the kubelet allocated to a container.",
    ),
    "gpu_pod_owner_info": (
        GAUGE,
        EXPERIMENTAL + "The workload a pod that holds or uses a GPU belongs to: its controller, a "
        "ReplicaSet resolved to its Deployment and a Job to its CronJob by their naming "
        'conventions, owner_kind="Pod" without one (docs/metrics.md); always 1.',
    ),
    "gpu_unallocated_use_memory_bytes": (
        GAUGE,
        STABLE + "Memory a container uses on a device it was not allocated (isolation leak).",
    ),
    "gpu_unattributed_memory_used_bytes": (
        GAUGE,
        STABLE + "Memory of processes no container owns, by owner: host, dead (pid gone from "
        "/proc) or unknown (with reason). Memory by owner: adds up with "
        "gpu_container_memory_used_bytes.",
    ),
    "gpu_unattributed_processes": (GAUGE, STABLE + "Processes no container owns, with why."),
    # orphaned memory
    "gpu_orphaned_memory_bytes": (
        GAUGE,
        STABLE + "GPU memory held by no live, running container process, by kind: "
        "dead_process, deleted_pod, stuck_process, unattributed (docs/orphans.md). A view, "
        "not an owner: the process kinds are already in the memory-by-owner families "
        '(dead_process is gpu_unattributed_memory_used_bytes{owner="dead"}); never add them.',
    ),
    "gpu_orphaned_processes": (GAUGE, STABLE + "Processes behind orphaned memory, by kind."),
    "gpu_orphaned_memory_first_seen_timestamp_seconds": (
        GAUGE,
        STABLE + "When this kind of orphaned memory was first seen on the GPU (survives "
        "scrape gaps; resets when it clears).",
    ),
    "gpu_orphaned_holder_info": (
        GAUGE,
        EXPERIMENTAL + "A process holding the device files of a GPU with dead-process or "
        "unattributed memory; role is holder or management (daemons that open every GPU).",
    ),
    "gpu_orphaned_memory_driver_held": (
        GAUGE,
        EXPERIMENTAL + "1 when a complete scan found no process but management daemons holding "
        "the GPU's dead-process or unattributed memory (driver-held: reset the GPU); 0 when a "
        "holder exists.",
    ),
    # health and capacity
    "gpu_healthy": (GAUGE, STABLE + "1 when no 'unhealthy' health reason is active for the GPU."),
    "gpu_health_reason": (
        GAUGE,
        STABLE + "1 for each active health reason, with its class (unhealthy or degraded).",
    ),
    "gpu_node_devices": (
        GAUGE,
        STABLE + "Schedulable GPU devices of the node by resource and state: advertised, "
        "healthy, unhealthy, unknown (health not judged), allocated, allocatable, "
        "disrupted (healthy and free, but cordoned, tainted or in a driver upgrade; "
        "allocatable excludes them); a state whose source is down is absent.",
    ),
    "gpu_node_disrupted_devices": (
        GAUGE,
        EXPERIMENTAL + "Healthy, unallocated devices a new pod could not get, by resource and "
        "reason: cordoned, node_taint, device_taint, driver_upgrade (a device may count "
        "under several; docs/capacity.md). Absent when the Node cannot be read; without a Node "
        "watch (no Kubernetes API) only device_taint.",
    ),
    "gpu_container_idle_allocated_seconds": (
        COUNTER,
        DEPRECATED + 'Use gpu_container_allocated_gpu_seconds_total{state=~"idle|no_process"}. '
        "Seconds a container held a device while its activity stayed below the idle threshold.",
    ),
    "gpu_container_allocated_gpu_seconds": (
        COUNTER,
        EXPERIMENTAL
        + "GPU-equivalent seconds a container held a device (MIG instance: its slices of the "
        "GPU's; replica: 1/replicas), by state: busy, idle, no_process, unhealthy, unknown. "
        "The states sum to the time held.",
    ),
    "gpu_container_idle_gpu_seconds": (
        COUNTER,
        EXPERIMENTAL
        + "The idle and no_process GPU-equivalent seconds of gpu_container_allocated_gpu_seconds "
        "by likely cause, from the container's cgroup over the same cycle: cpu_throttled, "
        "cpu_pressure, io_pressure, unknown. A correlation, not a proof (docs/why-idle.md).",
    ),
    "gpu_container_energy_joules": (
        COUNTER,
        EXPERIMENTAL
        + "Estimated energy of a container on a GPU it holds: the GPU's energy counter split "
        "by SM time share (MIG: instance activity x slices); NVML has no per-process energy.",
    ),
    "gpu_container_allocated_idle": (
        GAUGE,
        STABLE + "1 while an allocated device is idle this cycle (see docs/health.md).",
    ),
    # shared GPUs (docs/shared-gpus.md)
    "gpu_shared_containers": (
        GAUGE,
        EXPERIMENTAL + "Containers with a process on a shared whole GPU.",
    ),
    "gpu_shared_active_containers": (
        GAUGE,
        EXPERIMENTAL
        + "Containers on a shared GPU that had SM time in this cycle's per-process samples "
        "(wanted the GPU; under time-slicing they took turns).",
    ),
    "gpu_shared_memory_headroom_bytes": (
        GAUGE,
        EXPERIMENTAL
        + "Memory the next allocation on a shared GPU can get: total - used - reserved.",
    ),
    "gpu_container_sm_time_share_ratio": (
        GAUGE,
        EXPERIMENTAL
        + "Container's share of the SM time all containers used on a shared GPU (sums to 1).",
    ),
    "gpu_container_sm_fair_share_deviation_ratio": (
        GAUGE,
        EXPERIMENTAL
        + "Container's SM time share minus an equal share of the containers that had work "
        "(positive: took more than its turn); only for containers that had work.",
    ),
    "gpu_container_memory_growth_bytes": (
        GAUGE,
        EXPERIMENTAL
        + "How far a container's memory on a shared GPU rose above its lowest point in the "
        "last 5 minutes.",
    ),
    "gpu_container_memory_limit_bytes": (
        GAUGE,
        EXPERIMENTAL + "Memory a container was promised on the device (HAMi nvidia.com/gpumem or "
        "gpumem-percentage); no series without a limit.",
    ),
    "gpu_container_sm_limit_ratio": (
        GAUGE,
        EXPERIMENTAL
        + "SM share a container was promised on the device (HAMi nvidia.com/gpucores / 100); "
        "no series without a limit.",
    ),
    # CPU starvation of GPU containers (--cgroup-root; docs/why-idle.md): cgroup counters
    # of containers that hold or use a GPU; absent where the kernel does not keep them
    "gpu_container_cpu_periods": (
        COUNTER,
        EXPERIMENTAL
        + "CFS enforcement periods in which a GPU container had runnable tasks and a CPU "
        "limit (cgroup cpu.stat nr_periods).",
    ),
    "gpu_container_cpu_throttled_periods": (
        COUNTER,
        EXPERIMENTAL
        + "Of those periods, the ones in which the container used up its CPU quota and was "
        "throttled (cpu.stat nr_throttled).",
    ),
    "gpu_container_cpu_throttled_seconds": (
        COUNTER,
        EXPERIMENTAL + "Time a GPU container's tasks were throttled by its CPU limit (cpu.stat "
        "throttled_usec; cgroup v1 throttled_time).",
    ),
    "gpu_container_cpu_pressure_seconds": (
        COUNTER,
        EXPERIMENTAL
        + "Time some (kind=some) or all (kind=full) of a GPU container's runnable tasks waited "
        "for a CPU (cpu.pressure total; cgroup v2 with PSI only).",
    ),
    "gpu_container_io_pressure_seconds": (
        COUNTER,
        EXPERIMENTAL
        + "Time some (kind=some) or all (kind=full) of a GPU container's tasks stalled on I/O "
        "(io.pressure total; cgroup v2 with PSI only).",
    ),
    "gpu_container_memory_pressure_seconds": (
        COUNTER,
        EXPERIMENTAL
        + "Time some (kind=some) or all (kind=full) of a GPU container's tasks stalled on "
        "memory: reclaim, refaults, swap-in (memory.pressure total; cgroup v2 with PSI only).",
    ),
    "gpu_process_memory_used_bytes": (
        GAUGE,
        EXPERIMENTAL + "Per-process memory (--per-process-metrics).",
    ),
    "gpu_process_sm_utilization_ratio": (
        GAUGE,
        EXPERIMENTAL + "Per-process SM share from NVML samples (--per-process-metrics).",
    ),
}


SELF_PREFIX = "gpu_exporter_"
PER_PROCESS = "gpu_process_*"

# Off unless enabled, with the reason. Every family that a shipped alert, recording rule
# or dashboard reads stays ON (tests/test_families.py holds this): the per-pipe
# gpu_fp{64,32,16}_active_ratio, which dcgm-exporter leaves out by default, are read by the
# dcgm-exporter compatibility rules and so stay on (docs/metrics.md, "Choosing families").
DEFAULT_OFF: dict[str, str] = {
    PER_PROCESS: "a pid label: one series per GPU process, new ones with every process",
}

_NAME = re.compile(r"[a-zA-Z0-9_:*?\[\]!-]+")


class FamilySelectionError(ValueError):
    """One line naming the flag and the pattern at fault."""


def stability(help_text: str) -> str | None:
    """The level a HELP text starts with (``stable``, ``experimental``, ``deprecated``)."""
    for prefix, level in LEVELS.items():
        if help_text.startswith(prefix):
            return level
    return None


def selectable() -> list[str]:
    """Families the flags may switch: every catalogued one but the exporter's own."""
    return sorted(name for name in CATALOGUE if not name.startswith(SELF_PREFIX))


def always_served() -> frozenset[str]:
    return frozenset(name for name in CATALOGUE if name.startswith(SELF_PREFIX))


def patterns(text: str) -> list[str]:
    """A comma-separated list of globs; blanks and empty entries are ignored."""
    return [p.strip() for p in text.split(",") if p.strip()]


def matching(pattern: str, names: Iterable[str]) -> set[str]:
    return {name for name in names if fnmatchcase(name, pattern)}


def select_families(
    enable: str = "", disable: str = "", *, per_process: bool = False
) -> frozenset[str]:
    """The names of the families to serve (the exporter's own included)."""
    names = selectable()
    on = set(names)
    for pattern in DEFAULT_OFF:
        on -= matching(pattern, names)
    if per_process:
        on |= matching(PER_PROCESS, names)
    for pattern in patterns(disable):
        on -= _checked(pattern, names, "--families-disable")
    for pattern in patterns(enable):
        on |= _checked(pattern, names, "--families-enable")
    return frozenset(on) | always_served()


DEFAULT_FAMILIES = select_families()


def _checked(pattern: str, names: list[str], flag: str) -> set[str]:
    found = matching(pattern, names)
    if found:
        return found
    where = f"{flag}: {pattern!r}"
    if not _NAME.fullmatch(pattern):
        raise FamilySelectionError(
            f"{where} is not a glob over metric family names (letters, digits, _ and "
            "the wildcards * ? [...]; e.g. 'gpu_fp*')"
        )
    if pattern.startswith(SELF_PREFIX) or matching(pattern, always_served()):
        raise FamilySelectionError(
            f"{where} names only the exporter's own metrics ({SELF_PREFIX}*), "
            "which are always served"
        )
    bare = pattern.removesuffix("_total")
    if bare != pattern and any(CATALOGUE[n][0] == COUNTER for n in matching(bare, names)):
        raise FamilySelectionError(
            f"{where} matches no metric family: counters are named without _total (use {bare!r})"
        )
    raise FamilySelectionError(
        f"{where} matches no metric family (names as in docs/metrics.md, e.g. 'gpu_clock_event_*')"
    )
