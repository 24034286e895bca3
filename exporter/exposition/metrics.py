"""Metric families built from one analysed snapshot.

``CATALOGUE`` is the single list of every metric the exporter can emit (name, type,
help); docs/metrics.md is checked against it and against real output by the tests.
Unknown values (``None``) produce no sample at all: "not supported" must never read as 0.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import get_args

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from exporter.analysis.xid import recovery_action_name
from exporter.model import (
    DROPPED_LINE_REASONS,
    OCCUPANCY_FIELDS,
    RELIST_REASONS,
    Analysis,
    AttributedProcess,
    ContainerRef,
    DeviceRef,
    GpuSample,
    MigInstance,
    Occupancy,
    PodMetaSnapshot,
    ProcessKind,
    ResourceSliceSnapshot,
    XidCount,
)

GAUGE, COUNTER = "gauge", "counter"

CATALOGUE: dict[str, tuple[str, str]] = {
    # exporter self-metrics (the histogram, errors and build info live in the agent)
    "gpu_exporter_nvml_up": (
        GAUGE,
        'Deprecated (removed in 0.3): use gpu_exporter_source_up{source="nvml"}. '
        "1 when NVML initialised and answered this cycle.",
    ),
    "gpu_exporter_source_up": (GAUGE, "1 when the named source answered its last refresh."),
    "gpu_exporter_source_last_success_timestamp_seconds": (
        GAUGE,
        "Unix time of the named source's last success (a background source goes down when "
        "this is older than 3 of its periods); absent until it first succeeds.",
    ),
    "gpu_exporter_last_sample_timestamp_seconds": (
        GAUGE,
        "Unix time at which the last sample cycle started.",
    ),
    "gpu_exporter_kube_relists": (
        COUNTER,
        "LISTs a Kubernetes list + watch made after its first, by reason: resync, "
        "expired (410 Gone), watch_failed, bad_stream (malformed or oversize lines), "
        "list_failed (docs/reliability.md).",
    ),
    "gpu_exporter_kube_watch_lines_dropped": (
        COUNTER,
        "Watch lines a Kubernetes watch skipped: malformed, or oversize (over 16 MiB).",
    ),
    "gpu_exporter_kmsg_overruns": (
        COUNTER,
        "Times the kernel log's ring buffer overwrote records before --kmsg read them: "
        "records lost, XIDs among them possibly (each is also an error of source kmsg).",
    ),
    "gpu_exporter_unresolved_allocations": (
        GAUGE,
        "Allocated devices whose id no known form resolves to a GPU (docs/attribution.md).",
    ),
    # identity and state
    "gpu_info": (GAUGE, "Static GPU identity; always 1."),
    "gpu_up": (GAUGE, "1 when the GPU answered NVML this cycle, 0 when it failed (lost)."),
    "gpu_mig_mode_enabled": (GAUGE, "1 when the GPU is in MIG mode."),
    "gpu_mig_info": (GAUGE, "Static MIG instance identity; always 1."),
    # memory
    "gpu_memory_total_bytes": (GAUGE, "Device (or MIG instance) memory."),
    "gpu_memory_used_bytes": (
        GAUGE,
        "Memory in use, excluding driver-reserved memory (NVML memory info v2).",
    ),
    "gpu_memory_free_bytes": (GAUGE, "Memory free for allocation."),
    "gpu_memory_reserved_bytes": (GAUGE, "Memory the driver reserves for itself."),
    # utilisation and occupancy
    "gpu_utilization_ratio": (
        GAUGE,
        "NVML GPU-Util: share of the sample window in which any kernel ran (not occupancy).",
    ),
    "gpu_memory_utilization_ratio": (
        GAUGE,
        "Share of the sample window in which device memory was read or written.",
    ),
    "gpu_graphics_active_ratio": (
        GAUGE,
        "GPM: share of time the graphics/compute engine was active.",
    ),
    "gpu_sm_active_ratio": (GAUGE, "GPM: share of SMs busy, averaged over the cycle."),
    "gpu_sm_occupancy_ratio": (GAUGE, "GPM: resident warps relative to the SMs' maximum."),
    "gpu_tensor_active_ratio": (GAUGE, "GPM: share of time tensor pipes were active."),
    "gpu_dram_active_ratio": (GAUGE, "GPM: DRAM bandwidth used relative to the maximum."),
    "gpu_fp64_active_ratio": (GAUGE, "GPM: share of time the FP64 pipe was active."),
    "gpu_fp32_active_ratio": (GAUGE, "GPM: share of time the FP32 pipe was active."),
    "gpu_fp16_active_ratio": (GAUGE, "GPM: share of time the FP16 pipe was active."),
    # physical
    "gpu_temperature_celsius": (GAUGE, "GPU die temperature."),
    "gpu_power_watts": (GAUGE, "Power draw."),
    "gpu_power_limit_watts": (GAUGE, "Enforced power limit."),
    "gpu_energy_joules": (COUNTER, "Energy consumed since the driver loaded."),
    "gpu_sm_clock_hertz": (GAUGE, "SM clock."),
    "gpu_memory_clock_hertz": (GAUGE, "Memory clock."),
    "gpu_clock_event_active": (
        GAUGE,
        "1 while the named clock-event (throttle) reason holds clocks down.",
    ),
    "gpu_clock_event_seconds": (
        COUNTER,
        "Time the named NVML performance policy or clock-event reason held clocks down, "
        "since the driver loaded (reasons overlap: thermal includes both thermal slowdowns).",
    ),
    "gpu_memory_temperature_celsius": (GAUGE, "Device memory (HBM) temperature."),
    "gpu_fan_speed_ratio": (
        GAUGE,
        "Intended fan speed relative to its maximum (may exceed 1); absent on passively "
        "cooled GPUs.",
    ),
    # video engines
    "gpu_encoder_utilization_ratio": (
        GAUGE,
        "Share of the sample window in which the video encoder (NVENC) was busy.",
    ),
    "gpu_decoder_utilization_ratio": (
        GAUGE,
        "Share of the sample window in which the video decoder (NVDEC) was busy.",
    ),
    # interconnect
    "gpu_pcie_link_generation": (
        GAUGE,
        "Current PCIe link generation; drops when the GPU idles (power management).",
    ),
    "gpu_pcie_link_max_generation": (
        GAUGE,
        "Best PCIe link generation this GPU can reach in this slot.",
    ),
    "gpu_pcie_link_width": (GAUGE, "Current PCIe link width (lanes)."),
    "gpu_pcie_link_max_width": (GAUGE, "Best PCIe link width this GPU can reach in this slot."),
    "gpu_pcie_transmitted_bytes": (
        COUNTER,
        "Bytes the GPU sent over PCIe since the driver loaded (R555+; may wrap).",
    ),
    "gpu_pcie_received_bytes": (
        COUNTER,
        "Bytes the GPU received over PCIe since the driver loaded (R555+; may wrap).",
    ),
    "gpu_nvlink_active": (GAUGE, "1 when the NVLink is up, 0 when it is down."),
    "gpu_nvlink_transmitted_bytes": (COUNTER, "Data bytes sent over the NVLink."),
    "gpu_nvlink_received_bytes": (COUNTER, "Data bytes received over the NVLink."),
    "gpu_nvlink_errors": (
        COUNTER,
        "NVLink data-link errors by type: crc_flit, crc_data, replay, recovery.",
    ),
    # reliability
    "gpu_pcie_replays": (COUNTER, "PCIe replay counter."),
    "gpu_ecc_errors": (COUNTER, "ECC errors since the last reset of the aggregate counters."),
    "gpu_remapped_rows": (COUNTER, "Memory rows remapped, by cause."),
    "gpu_row_remap_pending": (GAUGE, "1 when a row remap waits for a GPU reset."),
    "gpu_row_remap_failed": (GAUGE, "1 when a row remap failed (replace the GPU)."),
    "gpu_xid_errors": (COUNTER, "XID errors by code and severity class (docs/xid.md)."),
    "gpu_xid_errors_before_start": (
        GAUGE,
        "XIDs the kernel log (--kmsg) held from before this exporter started: history, "
        "not new errors (docs/xid.md).",
    ),
    "gpu_recovery_action": (
        GAUGE,
        "1 for the recovery action the driver asks for (XID 154): none, gpu_reset, "
        "node_reboot, drain_p2p, drain_and_reset, … (docs/xid.md).",
    ),
    # processes and attribution
    "gpu_processes": (GAUGE, "Processes NVML lists on the device, by kind."),
    "gpu_container_memory_used_bytes": (GAUGE, "GPU memory used by a container's processes."),
    "gpu_container_sm_utilization_ratio": (
        GAUGE,
        "Container's share of SM time from NVML per-process samples (sum, capped at 1).",
    ),
    "gpu_container_processes": (GAUGE, "Processes of a container on the device."),
    "gpu_container_allocated": (GAUGE, "1 for every device the kubelet allocated to a container."),
    "gpu_pod_owner_info": (
        GAUGE,
        "The workload a pod that holds or uses a GPU belongs to: its controller, a "
        "ReplicaSet resolved to its Deployment and a Job to its CronJob by their naming "
        'conventions, owner_kind="Pod" without one (docs/metrics.md); always 1.',
    ),
    "gpu_unallocated_use_memory_bytes": (
        GAUGE,
        "Memory a container uses on a device it was not allocated (isolation leak).",
    ),
    "gpu_unattributed_memory_used_bytes": (
        GAUGE,
        "Memory of processes no container owns (host, dead or unknown), with why.",
    ),
    "gpu_unattributed_processes": (GAUGE, "Processes no container owns, with why."),
    # orphaned memory
    "gpu_orphaned_memory_bytes": (
        GAUGE,
        "GPU memory held by no live, running container process, by kind: "
        "dead_process, deleted_pod, stuck_process, unattributed (docs/orphans.md).",
    ),
    "gpu_orphaned_processes": (GAUGE, "Processes behind orphaned memory, by kind."),
    "gpu_orphaned_memory_first_seen_timestamp_seconds": (
        GAUGE,
        "When this kind of orphaned memory was first seen on the GPU (survives "
        "scrape gaps; resets when it clears).",
    ),
    "gpu_orphaned_holder_info": (
        GAUGE,
        "A process holding the device files of a GPU with unattributed memory; "
        "role is holder or management (daemons that open every GPU).",
    ),
    "gpu_orphaned_memory_driver_held": (
        GAUGE,
        "1 when a complete scan found no process but management daemons holding "
        "the GPU's unattributed memory (driver-held: reset the GPU); 0 when a holder "
        "exists.",
    ),
    # health and capacity
    "gpu_healthy": (GAUGE, "1 when no 'unhealthy' health reason is active for the GPU."),
    "gpu_health_reason": (
        GAUGE,
        "1 for each active health reason, with its class (unhealthy or degraded).",
    ),
    "gpu_node_devices": (
        GAUGE,
        "Schedulable GPU devices of the node by resource and state: advertised, "
        "healthy, unhealthy, unknown (health not judged), allocated, allocatable; a "
        "state whose source is down is absent.",
    ),
    "gpu_container_idle_allocated_seconds": (
        COUNTER,
        'Deprecated: use gpu_container_allocated_gpu_seconds_total{state=~"idle|no_process"}. '
        "Seconds a container held a device while its activity stayed below the idle threshold.",
    ),
    "gpu_container_allocated_gpu_seconds": (
        COUNTER,
        "GPU-equivalent seconds a container held a device (MIG instance: its slices of the "
        "GPU's; replica: 1/replicas), by state: busy, idle, no_process, unhealthy, unknown. "
        "The states sum to the time held.",
    ),
    "gpu_container_energy_joules": (
        COUNTER,
        "Estimated energy of a container on a GPU it holds: the GPU's energy counter split "
        "by SM time share (MIG: instance activity x slices); NVML has no per-process energy.",
    ),
    "gpu_container_allocated_idle": (
        GAUGE,
        "1 while an allocated device is idle this cycle (see docs/health.md).",
    ),
    # shared GPUs (docs/shared-gpus.md)
    "gpu_shared_containers": (GAUGE, "Containers with a process on a shared whole GPU."),
    "gpu_shared_active_containers": (
        GAUGE,
        "Containers on a shared GPU that had SM time in this cycle's per-process samples "
        "(wanted the GPU; under time-slicing they took turns).",
    ),
    "gpu_shared_memory_headroom_bytes": (
        GAUGE,
        "Memory the next allocation on a shared GPU can get: total - used - reserved.",
    ),
    "gpu_container_sm_time_share_ratio": (
        GAUGE,
        "Container's share of the SM time all containers used on a shared GPU (sums to 1).",
    ),
    "gpu_container_sm_fair_share_deviation_ratio": (
        GAUGE,
        "Container's SM time share minus an equal share of the containers that had work "
        "(positive: took more than its turn); only for containers that had work.",
    ),
    "gpu_container_memory_growth_bytes": (
        GAUGE,
        "How far a container's memory on a shared GPU rose above its lowest point in the "
        "last 5 minutes.",
    ),
    "gpu_container_memory_limit_bytes": (
        GAUGE,
        "Memory a container was promised on the device (HAMi nvidia.com/gpumem or "
        "gpumem-percentage); no series without a limit.",
    ),
    "gpu_container_sm_limit_ratio": (
        GAUGE,
        "SM share a container was promised on the device (HAMi nvidia.com/gpucores / 100); "
        "no series without a limit.",
    ),
    "gpu_process_memory_used_bytes": (GAUGE, "Per-process memory (--per-process-metrics)."),
    "gpu_process_sm_utilization_ratio": (
        GAUGE,
        "Per-process SM share from NVML samples (--per-process-metrics).",
    ),
}

# NVML clock-event reason bits, by the name used in the ``reason`` label.
CLOCK_EVENT_REASONS = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
_OCCUPANCY_FIELDS = {f"gpu_{field}_ratio": field for field in OCCUPANCY_FIELDS}
# gpu_node_devices' ``state`` values: DeviceCapacity's fields (healthy + unhealthy +
# unknown = advertised; docs/health.md).
CAPACITY_STATES = ("advertised", "healthy", "unhealthy", "unknown", "allocated", "allocatable")

Labels = Mapping[str, str]


@dataclass(frozen=True)
class ExpositionOptions:
    # The families to serve (exporter/exposition/families.py); None: every one.
    families: Collection[str] | None = None


class FamilyBuilder:
    """Collects samples into families named by ``CATALOGUE``; skips ``None`` values and
    families that are switched off (before any sample is built: they cost nothing)."""

    def __init__(self, families: Collection[str] | None = None) -> None:
        self._families: dict[str, Metric] = {}
        self._served = families

    def wants(self, name: str) -> bool:
        """Whether ``name`` is served; callers skip building labels for it otherwise."""
        return self._served is None or name in self._served

    def add(self, name: str, labels: Labels, value: float | None) -> None:
        if value is None or not self.wants(name):
            return
        family = self._families.get(name)
        if family is None:
            kind, doc = CATALOGUE[name]
            family = self._families[name] = Metric(name, doc, kind)
        sample = f"{name}_total" if family.type == COUNTER else name
        family.add_sample(sample, dict(labels), float(value))

    def families(self) -> list[Metric]:
        return list(self._families.values())


def _device_labels(
    gpu: int | None,
    uuid: str | None,
    mig_uuid: str | None = None,
    migs: Mapping[str, dict[str, str]] | None = None,
) -> dict[str, str]:
    """``gpu`` and ``uuid`` (empty when unknown), plus the MIG instance's labels when the
    series belongs to one; the one place device labels are spelled."""
    labels = {"gpu": "" if gpu is None else str(gpu), "uuid": uuid or ""}
    if mig_uuid and migs:
        labels.update(migs.get(mig_uuid, {}))
    return labels


def _where(
    container: ContainerRef | None,
    device: DeviceRef,
    migs: Mapping[str, dict[str, str]] | None = None,
) -> dict[str, str]:
    """Labels of a per-container (or, without one, per-device) series."""
    labels = (
        {"namespace": container.namespace, "pod": container.pod, "container": container.container}
        if container is not None
        else {}
    )
    labels.update(_device_labels(device.gpu, device.uuid, device.mig_uuid, migs))
    return labels


def _mig_labels(mig: MigInstance) -> dict[str, str]:
    return {
        "gpu_instance": str(mig.gpu_instance_id),
        "compute_instance": str(mig.compute_instance_id),
        "mig_profile": mig.profile,
        "mig_uuid": mig.uuid,
    }


def _ratio(percent: int | None) -> float | None:
    return None if percent is None else percent / 100.0


def _scaled(value: int | None, factor: float) -> float | None:
    return None if value is None else value * factor


def _add_watch_counts(
    out: FamilyBuilder, source: str, watched: PodMetaSnapshot | ResourceSliceSnapshot | None
) -> None:
    """A list + watch's relists and dropped lines (``source`` is the watch source's
    name), every reason present from the start at 0 so that rate() sees the first."""
    if watched is None:  # that watch does not run
        return
    relists, dropped = dict(watched.counts.relists), dict(watched.counts.dropped_lines)
    for reason in RELIST_REASONS:
        labels = {"source": source, "reason": reason}
        out.add("gpu_exporter_kube_relists", labels, relists.get(reason, 0))
    for reason in DROPPED_LINE_REASONS:
        labels = {"source": source, "reason": reason}
        out.add("gpu_exporter_kube_watch_lines_dropped", labels, dropped.get(reason, 0))


def build_families(analysis: Analysis, options: ExpositionOptions) -> list[Metric]:
    out = FamilyBuilder(options.families)
    node = analysis.node
    nvml = node.nvml
    out.add("gpu_exporter_nvml_up", {}, 1 if nvml.ok else 0)
    out.add("gpu_exporter_last_sample_timestamp_seconds", {}, node.timestamp)
    for source in node.sources:
        out.add("gpu_exporter_source_up", {"source": source.name}, 1 if source.up else 0)
        out.add(  # absent (unknown) until the source first succeeds
            "gpu_exporter_source_last_success_timestamp_seconds",
            {"source": source.name},
            source.last_success,
        )
    _add_watch_counts(out, "kube", node.pod_meta)
    _add_watch_counts(out, "resourceslices", node.resource_slices)
    out.add("gpu_exporter_kmsg_overruns", {}, node.kmsg_overruns)  # absent without --kmsg
    migs: dict[str, dict[str, str]] = {}
    for gpu in nvml.gpus:
        _add_gpu(out, gpu, nvml.driver_version or "", nvml.cuda_driver_version or "")
        for mig in gpu.mig_instances:
            migs[mig.uuid] = _mig_labels(mig)
            _add_mig(out, gpu, mig)
    _add_attribution(out, analysis, migs)
    _add_orphans(out, analysis)
    _add_health(out, analysis, migs)
    _add_sharing(out, analysis)
    for owner in analysis.pod_owners:
        labels = {"namespace": owner.namespace, "pod": owner.pod, "owner_kind": owner.kind}
        out.add("gpu_pod_owner_info", {**labels, "owner_name": owner.name}, 1)
    return out.families()


def _add_gpu(out: FamilyBuilder, gpu: GpuSample, driver: str, cuda: str) -> None:
    labels = _device_labels(gpu.index, gpu.uuid)
    out.add("gpu_up", labels, 0 if gpu.error else 1)
    out.add(
        "gpu_info",
        {
            **labels,
            "model": gpu.name or "",
            "pci_bus_id": gpu.pci_bus_id or "",
            "minor_number": "" if gpu.minor_number is None else str(gpu.minor_number),
            "driver_version": driver,
            "cuda_driver_version": cuda,
        },
        1,
    )
    if gpu.error:
        return
    out.add(
        "gpu_mig_mode_enabled", labels, None if gpu.mig_enabled is None else int(gpu.mig_enabled)
    )
    out.add("gpu_memory_total_bytes", labels, gpu.memory_total_bytes)
    out.add("gpu_memory_used_bytes", labels, gpu.memory_used_bytes)
    out.add("gpu_memory_free_bytes", labels, gpu.memory_free_bytes)
    out.add("gpu_memory_reserved_bytes", labels, gpu.memory_reserved_bytes)
    out.add("gpu_utilization_ratio", labels, _ratio(gpu.utilization_gpu_percent))
    out.add("gpu_memory_utilization_ratio", labels, _ratio(gpu.utilization_memory_percent))
    _add_occupancy(out, labels, gpu.occupancy)
    out.add("gpu_temperature_celsius", labels, gpu.temperature_celsius)
    out.add("gpu_power_watts", labels, _scaled(gpu.power_milliwatts, 1e-3))
    out.add("gpu_power_limit_watts", labels, _scaled(gpu.power_limit_milliwatts, 1e-3))
    out.add("gpu_energy_joules", labels, _scaled(gpu.energy_millijoules, 1e-3))
    out.add("gpu_sm_clock_hertz", labels, _scaled(gpu.clock_sm_mhz, 1e6))
    out.add("gpu_memory_clock_hertz", labels, _scaled(gpu.clock_memory_mhz, 1e6))
    if gpu.clock_event_reasons is not None and out.wants("gpu_clock_event_active"):
        for reason, bit in CLOCK_EVENT_REASONS.items():
            out.add(
                "gpu_clock_event_active",
                {**labels, "reason": reason},
                1 if gpu.clock_event_reasons & bit else 0,
            )
    out.add("gpu_pcie_replays", labels, gpu.pcie_replay_count)
    _add_engines_and_limits(out, labels, gpu)
    _add_interconnect(out, labels, gpu)
    out.add("gpu_ecc_errors", {**labels, "type": "corrected"}, gpu.ecc_corrected_total)
    out.add("gpu_ecc_errors", {**labels, "type": "uncorrected"}, gpu.ecc_uncorrected_total)
    if gpu.recovery_action is not None:
        action = recovery_action_name(gpu.recovery_action)
        out.add("gpu_recovery_action", {**labels, "action": action}, 1)
    rows = gpu.remapped_rows
    if rows is not None:
        out.add("gpu_remapped_rows", {**labels, "cause": "correctable"}, rows.correctable)
        out.add("gpu_remapped_rows", {**labels, "cause": "uncorrectable"}, rows.uncorrectable)
        out.add("gpu_row_remap_pending", labels, int(rows.pending))
        out.add("gpu_row_remap_failed", labels, int(rows.failure))
    if gpu.processes_listed:  # a count of what NVML could not list would be a false 0
        _add_process_counts(out, labels, (p.kind for p in gpu.processes))


def _add_engines_and_limits(out: FamilyBuilder, labels: Labels, gpu: GpuSample) -> None:
    out.add("gpu_encoder_utilization_ratio", labels, _ratio(gpu.encoder_utilization_percent))
    out.add("gpu_decoder_utilization_ratio", labels, _ratio(gpu.decoder_utilization_percent))
    for reason, ns in gpu.clock_event_durations_ns:
        out.add("gpu_clock_event_seconds", {**labels, "reason": reason}, ns / 1e9)
    out.add("gpu_memory_temperature_celsius", labels, gpu.memory_temperature_celsius)
    for fan, percent in gpu.fan_speeds_percent:
        out.add("gpu_fan_speed_ratio", {**labels, "fan": str(fan)}, percent / 100.0)


def _add_interconnect(out: FamilyBuilder, labels: Labels, gpu: GpuSample) -> None:
    pcie = gpu.pcie
    if pcie is not None:
        out.add("gpu_pcie_link_generation", labels, pcie.generation)
        out.add("gpu_pcie_link_max_generation", labels, pcie.max_generation)
        out.add("gpu_pcie_link_width", labels, pcie.width)
        out.add("gpu_pcie_link_max_width", labels, pcie.max_width)
        out.add("gpu_pcie_transmitted_bytes", labels, pcie.transmitted_bytes)
        out.add("gpu_pcie_received_bytes", labels, pcie.received_bytes)
    for link in gpu.nvlinks:
        at = {**labels, "link": str(link.link)}
        out.add("gpu_nvlink_active", at, None if link.active is None else int(link.active))
        out.add("gpu_nvlink_transmitted_bytes", at, link.transmitted_bytes)
        out.add("gpu_nvlink_received_bytes", at, link.received_bytes)
        for kind, count in link.errors:
            out.add("gpu_nvlink_errors", {**at, "type": kind}, count)


def _add_mig(out: FamilyBuilder, gpu: GpuSample, mig: MigInstance) -> None:
    labels = {**_device_labels(gpu.index, gpu.uuid), **_mig_labels(mig)}
    out.add("gpu_mig_info", labels, 1)
    out.add("gpu_memory_total_bytes", labels, mig.memory_total_bytes)
    out.add("gpu_memory_used_bytes", labels, mig.memory_used_bytes)
    _add_occupancy(out, labels, mig.occupancy)
    if gpu.processes_listed:
        _add_process_counts(out, labels, (p.kind for p in mig.processes))


def _add_occupancy(out: FamilyBuilder, labels: Labels, occupancy: Occupancy | None) -> None:
    if occupancy is None:
        return
    for name, attr in _OCCUPANCY_FIELDS.items():
        out.add(name, labels, getattr(occupancy, attr))


def _add_process_counts(out: FamilyBuilder, labels: Labels, kinds: Iterable[ProcessKind]) -> None:
    if not out.wants("gpu_processes"):
        return
    counts: dict[ProcessKind, int] = dict.fromkeys(get_args(ProcessKind), 0)
    for kind in kinds:
        counts[kind] += 1
    for kind, count in counts.items():
        out.add("gpu_processes", {**labels, "kind": kind}, count)


def _add_attribution(
    out: FamilyBuilder,
    analysis: Analysis,
    migs: dict[str, dict[str, str]],
) -> None:
    attribution = analysis.attribution

    def where(gpu: int | None, uuid: str | None, mig_uuid: str | None) -> dict[str, str]:
        return _device_labels(gpu, uuid, mig_uuid, migs)

    for c in attribution.containers:
        labels = _where(c.container, c.device, migs)
        out.add("gpu_container_memory_used_bytes", labels, c.memory_used_bytes)
        out.add("gpu_container_sm_utilization_ratio", labels, c.sm_ratio)
        out.add("gpu_container_processes", labels, c.processes)
    for a in attribution.allocations:
        out.add(
            "gpu_container_allocated",
            {
                **_where(a.container, a.device, migs),
                "device_id": a.device_id,
                "resource": a.resource_name,
            },
            1,
        )
    unresolved: dict[str, int] = {}
    for a in attribution.allocations:
        unresolved[a.resource_name] = unresolved.get(a.resource_name, 0) + (not a.resolved)
    for resource, count in sorted(unresolved.items()):
        out.add("gpu_exporter_unresolved_allocations", {"resource": resource}, count)
    for leak in attribution.unallocated_use:
        out.add(
            "gpu_unallocated_use_memory_bytes",
            _where(leak.container, leak.device, migs),
            leak.memory_used_bytes,
        )
    for u in attribution.unattributed:
        labels = {**_where(None, u.device, migs), "owner": u.owner, "reason": u.reason or ""}
        out.add("gpu_unattributed_memory_used_bytes", labels, u.memory_used_bytes)
        out.add("gpu_unattributed_processes", labels, u.processes)
    if out.wants("gpu_process_memory_used_bytes") or out.wants("gpu_process_sm_utilization_ratio"):
        for p in attribution.processes:
            labels = _process_labels(p, where(p.gpu, p.uuid, p.mig_uuid))
            out.add("gpu_process_memory_used_bytes", labels, p.memory_used_bytes)
            out.add("gpu_process_sm_utilization_ratio", labels, p.sm_ratio)


def _add_orphans(out: FamilyBuilder, analysis: Analysis) -> None:
    for o in analysis.orphans:
        labels = {**_device_labels(o.gpu, o.uuid), "kind": o.kind}
        out.add("gpu_orphaned_memory_bytes", labels, o.memory_used_bytes)
        if o.kind != "unattributed":  # no process to count there, by definition
            out.add("gpu_orphaned_processes", labels, o.processes)
        out.add("gpu_orphaned_memory_first_seen_timestamp_seconds", labels, o.first_seen)
    for h in analysis.orphan_holders:
        out.add(
            "gpu_orphaned_holder_info",
            {
                **_device_labels(h.gpu, h.uuid),
                "pid": str(h.pid),
                "namespace": h.namespace or "",
                "pod": h.pod or "",
                "container": h.container or "",
                "comm": h.comm or "",
                "role": h.role,
            },
            1,
        )
    for held in analysis.driver_held:
        labels = _device_labels(held.gpu, held.uuid)
        out.add("gpu_orphaned_memory_driver_held", labels, int(held.only_drivers))


def _add_health(out: FamilyBuilder, analysis: Analysis, migs: dict[str, dict[str, str]]) -> None:
    for x in analysis.xid_counts:
        out.add("gpu_xid_errors", _xid_labels(x), x.count)
    for x in analysis.xid_counts_before_start:
        out.add("gpu_xid_errors_before_start", _xid_labels(x), x.count)
    for verdict in analysis.health:
        labels = _device_labels(verdict.gpu, verdict.uuid)
        out.add("gpu_healthy", labels, 1 if verdict.healthy else 0)
        for reason in verdict.reasons:
            out.add(
                "gpu_health_reason",
                {**labels, "reason": reason.reason, "class": reason.severity},
                1,
            )
    for cap in analysis.capacity:
        for state in CAPACITY_STATES:
            count = getattr(cap, state)
            if count is not None:  # None: its source is down (docs/health.md), not 0
                out.add("gpu_node_devices", {"resource": cap.resource, "state": state}, count)
    for idle in analysis.idle:
        labels = {**_where(idle.container, idle.device, migs), "device_id": idle.device_id}
        out.add("gpu_container_idle_allocated_seconds", labels, idle.idle_seconds_total)
        out.add("gpu_container_allocated_idle", labels, int(idle.idle_now))
    _add_ledger(out, analysis, migs)


def _add_ledger(out: FamilyBuilder, analysis: Analysis, migs: dict[str, dict[str, str]]) -> None:
    """The GPU-hour ledger: every state of every allocation from its first cycle (at 0,
    so that rate() sees the first increase), and each holder's energy estimate."""
    if out.wants("gpu_container_allocated_gpu_seconds"):
        for entry in analysis.ledger:
            labels = {**_where(entry.container, entry.device, migs), "device_id": entry.device_id}
            for state, seconds in entry.seconds:
                out.add("gpu_container_allocated_gpu_seconds", {**labels, "state": state}, seconds)
    for energy in analysis.energy:
        labels = _where(energy.container, energy.device, migs)
        out.add("gpu_container_energy_joules", labels, energy.joules_total)


def _add_sharing(out: FamilyBuilder, analysis: Analysis) -> None:
    for g in analysis.shared_gpus:
        labels = _device_labels(g.device.gpu, g.device.uuid)
        out.add("gpu_shared_containers", labels, g.containers)
        out.add("gpu_shared_active_containers", labels, g.active_containers)
        out.add("gpu_shared_memory_headroom_bytes", labels, g.memory_headroom_bytes)
    for c in analysis.container_shares:
        labels = _where(c.container, c.device)
        out.add("gpu_container_sm_time_share_ratio", labels, c.sm_time_share)
        out.add("gpu_container_sm_fair_share_deviation_ratio", labels, c.fair_share_deviation)
        out.add("gpu_container_memory_growth_bytes", labels, c.memory_growth_bytes)
    for limit in analysis.container_limits:
        labels = _where(limit.container, limit.device)
        out.add("gpu_container_memory_limit_bytes", labels, limit.memory_limit_bytes)
        out.add("gpu_container_sm_limit_ratio", labels, limit.sm_limit_ratio)


def _xid_labels(x: XidCount) -> dict[str, str]:
    labels = _device_labels(x.gpu, x.uuid)
    if x.gpu_instance_id is not None:  # a MIG XID names the instance it happened in
        labels["gpu_instance"] = str(x.gpu_instance_id)
        ci = x.compute_instance_id
        labels["compute_instance"] = "" if ci is None else str(ci)
    return {**labels, "xid": str(x.xid), "class": x.severity}


def _process_labels(p: AttributedProcess, device: dict[str, str]) -> dict[str, str]:
    return {
        **device,
        "pid": str(p.pid),
        "kind": p.kind,
        "owner": p.owner,
        "namespace": p.namespace or "",
        "pod": p.pod or "",
        "container": p.container or "",
    }


class SnapshotCollector(Collector):
    """Serves the families of the latest cycle; replaced wholesale each cycle."""

    def __init__(self) -> None:
        self._families: list[Metric] = []

    def set(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)
