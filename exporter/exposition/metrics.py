"""Metric families built from one analysed snapshot.

``CATALOGUE`` (exporter/model/families.py) is the single list of every metric the
exporter can emit (name, type, help); docs/metrics.md is checked against it and against
real output by the tests.
Unknown values (``None``) produce no sample at all: "not supported" must never read as 0.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import get_args

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from exporter.analysis.active_time import UTILIZATION
from exporter.analysis.occupancy_source import OCCUPANCY_SOURCES
from exporter.analysis.xid import recovery_action_name
from exporter.model import (
    DROPPED_LINE_REASONS,
    OCCUPANCY_FIELDS,
    RELIST_REASONS,
    ActiveTime,
    Analysis,
    AttributedProcess,
    ContainerRef,
    DeviceRef,
    GpuSample,
    MigIdentity,
    MigInstance,
    Occupancy,
    PodMetaSnapshot,
    ProcessKind,
    ResourceSliceSnapshot,
    XidCount,
)
from exporter.model.families import CATALOGUE, COUNTER

log = logging.getLogger(__name__)

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
CAPACITY_STATES = (
    "advertised",
    "healthy",
    "unhealthy",
    "unknown",
    "allocated",
    "allocatable",
    "disrupted",
)

Labels = Mapping[str, str]


@dataclass(frozen=True)
class ExpositionOptions:
    # The families to serve (exporter/model/families.py); None: every one.
    families: Collection[str] | None = None


class FamilyBuilder:
    """Collects samples into families named by ``CATALOGUE``; skips ``None`` values and
    families that are switched off (before any sample is built: they cost nothing)."""

    def __init__(self, families: Collection[str] | None = None) -> None:
        # family name -> (the family, the name of its samples)
        self._families: dict[str, tuple[Metric, str]] = {}
        self._served = families

    def wants(self, name: str) -> bool:
        """Whether ``name`` is served; callers skip building labels for it otherwise."""
        return self._served is None or name in self._served

    def add(self, name: str, labels: Labels, value: float | None) -> None:
        # ~1,300 calls a cycle on node-8gpu: the samples go straight into the family's
        # list (what Metric.add_sample does, one call less), nothing is looked up twice.
        if value is None or not self.wants(name):
            return
        try:
            # -0.0 is served as 0 (the same number to Prometheus): the writer reuses an
            # unchanged family's text, and Python holds -0.0 == 0.0 (render.py)
            number = float(value) + 0.0
        except OverflowError:  # an int past a float's range (sources bound theirs): none
            return
        family, sample_name = self._families.get(name) or self._family(name)
        family.samples.append(Sample(sample_name, _non_empty(labels), number))

    def _family(self, name: str) -> tuple[Metric, str]:
        kind, doc = CATALOGUE[name]
        sample_name = f"{name}_total" if kind == COUNTER else name
        entry = self._families[name] = (Metric(name, doc, kind), sample_name)
        return entry

    def families(self) -> list[Metric]:
        return [family for family, _ in self._families.values()]


def _non_empty(labels: Labels) -> dict[str, str]:
    """The labels that have a value. Prometheus treats a label with an empty value as one
    that is not set (https://prometheus.io/docs/concepts/data_model/; prometheus/docs#548),
    so an empty value is never served: a host process's holder series has no ``pod``, an
    unattributed process with no reason has no ``reason``; selectors such as ``pod=""``
    still match (docs/metrics.md, "Sums that are safe"). Always a copy: a caller may go on
    to reuse its dict."""
    if all(labels.values()):  # most label sets (a C-speed check and copy)
        return dict(labels)
    return {k: v for k, v in labels.items() if v}


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


def _mig_labels(mig: MigInstance | MigIdentity) -> dict[str, str]:
    return {
        "gpu_instance": str(mig.gpu_instance_id),
        "compute_instance": str(mig.compute_instance_id),
        "mig_profile": mig.profile,
        "mig_uuid": mig.uuid,
    }


def _ratio(percent: int | None) -> float | None:
    return None if percent is None else percent / 100.0


def _scaled(value: int | None, factor: float) -> float | None:
    try:
        return None if value is None else value * factor
    except OverflowError:  # an int past a float's range: no value, never a crash
        return None


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
    sources = dict(analysis.occupancy_sources)
    active = analysis.active_time
    for gpu in nvml.gpus:
        _add_gpu(out, gpu, nvml.driver_version or "", nvml.cuda_driver_version or "")
        _add_occupancy_source(out, gpu, sources.get(gpu.uuid))
        if not gpu.error:
            labels = _device_labels(gpu.index, gpu.uuid)
            _add_active_time(out, labels, gpu.uuid, gpu.occupancy, active)
            # where gpu_utilization_ratio is, and the sample buffer answered
            if gpu.utilization_window is not None and gpu.utilization_gpu_percent is not None:
                _add_active(out, labels, gpu.uuid, active, UTILIZATION, "gpu_utilization_seconds")
        for mig in gpu.mig_instances:
            migs[mig.uuid] = _mig_labels(mig)
            _add_mig(out, gpu, mig, active)
    _add_mig_profiles(out, nvml.gpus)
    _add_attribution(out, analysis, migs)
    _add_orphans(out, analysis)
    _add_health(out, analysis, migs)
    _add_sharing(out, analysis)
    for owner in analysis.pod_owners:
        labels = {"namespace": owner.namespace, "pod": owner.pod, "owner_kind": owner.kind}
        out.add("gpu_pod_owner_info", {**labels, "owner_name": owner.name}, 1)
    _add_cgroup_signals(out, analysis)
    return out.families()


# gpu_container_<resource>_pressure_seconds_total: CgroupStats' PSI fields by resource
_PRESSURE_FAMILIES = {
    "gpu_container_cpu_pressure_seconds": "cpu_pressure",
    "gpu_container_io_pressure_seconds": "io_pressure",
    "gpu_container_memory_pressure_seconds": "memory_pressure",
}


def _add_cgroup_signals(out: FamilyBuilder, analysis: Analysis) -> None:
    """The cgroup counters of GPU containers, as read: a field not read (a file the
    kernel does not have, cgroup v1's pressure) has no series, never a zero."""
    for row in analysis.cgroup_signals:
        c, stats = row.container, row.stats
        labels = {"namespace": c.namespace, "pod": c.pod, "container": c.container}
        out.add("gpu_container_cpu_periods", labels, stats.nr_periods)
        out.add("gpu_container_cpu_throttled_periods", labels, stats.nr_throttled)
        out.add("gpu_container_cpu_throttled_seconds", labels, _scaled(stats.throttled_usec, 1e-6))
        for name, attr in _PRESSURE_FAMILIES.items():
            pressure = getattr(stats, attr)
            if pressure is None:
                continue
            out.add(name, {**labels, "kind": "some"}, _scaled(pressure.some_us, 1e-6))
            out.add(name, {**labels, "kind": "full"}, _scaled(pressure.full_us, 1e-6))


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


def _add_mig(out: FamilyBuilder, gpu: GpuSample, mig: MigInstance, active: ActiveTime) -> None:
    labels = {**_device_labels(gpu.index, gpu.uuid), **_mig_labels(mig)}
    out.add("gpu_mig_info", labels, 1)
    out.add("gpu_memory_total_bytes", labels, mig.memory_total_bytes)
    out.add("gpu_memory_used_bytes", labels, mig.memory_used_bytes)
    _add_occupancy(out, labels, mig.occupancy)
    _add_active_time(out, labels, mig.uuid, mig.occupancy, active)
    if gpu.processes_listed:
        _add_process_counts(out, labels, (p.kind for p in mig.processes))


def _add_mig_profiles(out: FamilyBuilder, gpus: Iterable[GpuSample]) -> None:
    """``gpu_mig_profile_*``: once per GPU model and profile (eight H100s offer one
    set), so the series do not grow with the GPUs; a model whose GPUs disagree (one read
    under another MIG mode) keeps the first GPU's."""
    wanted = (
        "gpu_mig_profile_info",
        "gpu_mig_profile_memory_bytes",
        "gpu_mig_profile_sm_share_ratio",
    )
    if not any(out.wants(name) for name in wanted):
        return
    seen: set[tuple[str, str]] = set()
    for gpu in gpus:
        model = gpu.name or ""
        for profile in gpu.mig_profiles:
            if (model, profile.name) in seen:
                continue
            seen.add((model, profile.name))
            labels = {
                "model": model,
                "profile": profile.name,
                "memory_bytes": str(profile.memory_bytes),
                "compute_slices": str(profile.compute_slices),
                "gpu_slices": str(profile.gpu_slices),
            }
            out.add("gpu_mig_profile_info", labels, 1)
            # PromQL cannot read a label as a number: the rules compare these values.
            named = {"model": model, "profile": profile.name}
            out.add("gpu_mig_profile_memory_bytes", named, profile.memory_bytes)
            share = profile.compute_slices / profile.gpu_slices if profile.gpu_slices else None
            out.add("gpu_mig_profile_sm_share_ratio", named, share)


def _add_occupancy_source(out: FamilyBuilder, gpu: GpuSample, source: str | None) -> None:
    """One series per possible source, 1 for the GPU's: a change of source is a change of
    value, not a series that ends (absent while the source is not known)."""
    if source is None or not out.wants("gpu_occupancy_source"):
        return
    labels = _device_labels(gpu.index, gpu.uuid)
    for name in OCCUPANCY_SOURCES:
        out.add("gpu_occupancy_source", {**labels, "source": name}, int(name == source))


def _add_occupancy(out: FamilyBuilder, labels: Labels, occupancy: Occupancy | None) -> None:
    if occupancy is None:
        return
    for name, attr in _OCCUPANCY_FIELDS.items():
        out.add(name, labels, getattr(occupancy, attr))


_ACTIVE_FAMILIES = {name: f"gpu_{name}_seconds" for name in OCCUPANCY_FIELDS}


def _add_active_time(
    out: FamilyBuilder, labels: Labels, uuid: str, occupancy: Occupancy | None, active: ActiveTime
) -> None:
    """The occupancy counters of a device, served exactly where its gauges are (a
    reading this cycle, each metric the reading has): no reading, no series."""
    if occupancy is None:
        return
    for name, family in _ACTIVE_FAMILIES.items():
        if getattr(occupancy, name) is not None:
            _add_active(out, labels, uuid, active, name, family)


def _add_active(
    out: FamilyBuilder, labels: Labels, uuid: str, active: ActiveTime, metric: str, family: str
) -> None:
    """A device's counter of ``metric`` and, beside it, the seconds it covered."""
    total = active.devices.get(uuid, {}).get(metric)
    if total is None:
        return
    out.add(family, labels, total)
    covered = active.sampled.get(uuid, {}).get(metric)
    out.add("gpu_activity_sampled_seconds", {**labels, "signal": metric}, covered)


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
        # from the container's first per-process reading on, while it has processes
        # on the device: a counter does not come and go with the readings standing in
        # (a GPU idle between bursts has none), as the gauge beside it does
        out.add(
            "gpu_container_sm_seconds",
            labels,
            analysis.active_time.containers.get((c.container, c.device)),
        )
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
    for resource, count in attribution.other_resource_devices:
        out.add("gpu_exporter_podresources_other_resource_devices", {"resource": resource}, count)
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
        if not verdict.unknown:  # unknown: neither 1 nor 0 (docs/health.md)
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
        for why, devices in cap.disrupted_by:
            disrupted = {"resource": cap.resource, "reason": why}
            out.add("gpu_node_disrupted_devices", disrupted, devices)
    for idle in analysis.idle:
        labels = {**_where(idle.container, idle.device, migs), "device_id": idle.device_id}
        out.add("gpu_container_idle_allocated_seconds", labels, idle.idle_seconds_total)
        out.add("gpu_container_allocated_idle", labels, int(idle.idle_now))
    _add_ledger(out, analysis)


def _add_ledger(out: FamilyBuilder, analysis: Analysis) -> None:
    """The GPU-hour ledger: every state of every allocation from its first cycle (at 0,
    so that rate() sees the first increase), and each holder's energy estimate. Their
    device labels are the rows' own (as NVML last listed the device), not this cycle's
    listing: a series keeps one identity while NVML is down."""
    by_state = out.wants("gpu_container_allocated_gpu_seconds")
    by_cause = out.wants("gpu_container_idle_gpu_seconds")
    if by_state or by_cause:
        for entry in analysis.ledger:
            labels = _held(entry.container, entry.device, entry.mig)
            labels["device_id"] = entry.device_id
            for state, seconds in entry.seconds if by_state else ():
                out.add("gpu_container_allocated_gpu_seconds", {**labels, "state": state}, seconds)
            for cause, seconds in entry.idle_causes if by_cause else ():
                out.add("gpu_container_idle_gpu_seconds", {**labels, "cause": cause}, seconds)
    for energy in analysis.energy:
        labels = _held(energy.container, energy.device, energy.mig)
        out.add("gpu_container_energy_joules", labels, energy.joules_total)


def _held(container: ContainerRef, device: DeviceRef, mig: MigIdentity | None) -> dict[str, str]:
    labels = _where(container, device)
    if mig is not None and device.mig_uuid == mig.uuid:
        labels.update(_mig_labels(mig))
    return labels


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
    """Serves the families of the latest cycle's analysis; replaced wholesale each cycle.

    A cycle that renders no format (exporter/exposition/scrape_demand.py) need not build
    them: they are built by the first collect after ``set``, once per analysis, under a
    lock (the cycle's render and a request's may collect at once). ``set`` builds them at
    once when the cycle renders (``build_now``), after any failed build until one
    succeeds, and at least every ``BUILD_AT_LEAST_EVERY`` cycles: a build that keeps
    failing fails cycles (counted, logged, the liveness probe not renewed) within that
    many cycles of its start, scraped or not.

    A failed build never costs a scrape. The analysis set before the failing one, if it
    was never built, is built in its place (the latest completed cycle's data); else the
    families built last stay served, and their
    gpu_exporter_last_sample_timestamp_seconds says how old they are. A build that fails
    in a request's collect is logged, counted in ``failed_builds`` for the agent, and
    never retried for that analysis (a flood of requests costs one build).
    """

    BUILD_AT_LEAST_EVERY = 10

    def __init__(
        self,
        options: ExpositionOptions | None = None,
        build: Callable[[Analysis, ExpositionOptions], list[Metric]] | None = None,
    ) -> None:
        self._options = options or ExpositionOptions()
        self._build_families = build or build_families
        self._families: list[Metric] = []
        self._pending: Analysis | None = None
        self._unbuilt_before: Analysis | None = None  # replaced by _pending, never built
        self._sets_since_build = 0
        self._lock = threading.Lock()
        self.last_build_failed = False
        self.failed_builds = 0  # builds that failed in a request's collect

    def set(self, analysis: Analysis, *, build_now: bool = True) -> None:
        """The cycle's analysis; built here (raising what the build raises) with
        ``build_now``, after a failed build, or when none was built for a while."""
        with self._lock:
            self._unbuilt_before, self._pending = self._pending, analysis
            self._sets_since_build += 1
            if (
                build_now
                or self.last_build_failed
                or self._sets_since_build >= self.BUILD_AT_LEAST_EVERY
            ):
                self._build()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            if self._pending is not None:
                try:
                    self._build()
                except Exception:
                    self.failed_builds += 1
                    log.exception(
                        "building the latest cycle's metrics failed; the previous ones stay served"
                    )
            return iter(self._families)

    def _build(self) -> None:
        analysis, self._pending = self._pending, None
        earlier, self._unbuilt_before = self._unbuilt_before, None
        assert analysis is not None
        self._sets_since_build = 0
        try:
            self._families = self._build_families(analysis, self._options)
        except Exception:
            self.last_build_failed = True
            if earlier is not None:  # the last completed cycle's, rather than older ones
                with contextlib.suppress(Exception):
                    self._families = self._build_families(earlier, self._options)
            raise
        self.last_build_failed = False
