"""The GPU-hour ledger (pure): who held which GPUs, what the time went on, and an
estimate of the energy each holder used (docs/metrics.md, "The GPU-hour ledger").

Each cycle adds ``step x weight`` GPU-equivalent seconds to exactly one state of every
allocation, so an allocation's states always sum to the GPU-equivalent time it was held
(conservation). ``step`` is the time since the last cycle, 0 for the first cycle and for
gaps over ``IdlePolicy.max_gap_s`` (the exporter was down: nobody saw that time).

The state, first that applies:
- ``unknown``: the device resolves to no GPU, NVML does not list the GPU (or is down),
  or no signal can judge its activity (a failed process listing, no activity counter);
- ``unhealthy``: the GPU's verdict is unhealthy (a lost GPU included);
- ``no_process``: no process of the container is on the device;
- ``busy`` / ``idle``: activity at or above / below ``--idle-threshold``, judged as
  idle time judges it (``exporter/analysis/activity.py``), so idle time = the ``idle``
  and ``no_process`` states divided by the weight.

The weight, in GPU-equivalents: a whole GPU 1; a MIG instance its compute slices over
the GPU's (``3g.40gb`` on an H100: 3/7); a time-sliced or MPS replica 1/replicas, with
replicas the replica ids the kubelet advertises for that device, else the allocations
on it. A MIG replica is both. An allocation whose size cannot be known (its device
resolves to no GPU and was never sized) has no ledger; one that was keeps its last weight.

Energy: NVML counts energy per GPU only (``nvmlDeviceGetTotalEnergyConsumption``), so
the GPU's delta over one cycle is split among the containers holding it: all of it to
the only holder; by each holder's part of the SM time the holders used (per-process
samples) on a time-shared GPU; by activity x compute slices of the held instances on a
MIG GPU. A delta that cannot be split (no holder, no SM time or no activity signal to
split by, a counter that went back, a gap) is not counted: the split sums to the GPU's
delta wherever it is counted.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from exporter.analysis.activity import UsageKey, activity, usage_index
from exporter.analysis.devices import DeviceResolver
from exporter.analysis.idle import IdlePolicy, counted_step
from exporter.model import (
    LEDGER_STATES,
    Allocation,
    AllocationLedger,
    ContainerEnergy,
    ContainerGpuUsage,
    ContainerRef,
    DeviceRef,
    GpuHealth,
    GpuSample,
    LedgerState,
    LedgerStateName,
    MigInstance,
    PodResourcesSnapshot,
)

# Compute slices of a MIG profile: "3g.40gb" -> 3; a compute instance smaller than its GPU
# instance, "1c.3g.40gb", has 1 (NVIDIA MIG User Guide, "Terminology" and
# "Supported MIG Profiles": https://docs.nvidia.com/datacenter/tesla/mig-user-guide/).
_PROFILE = re.compile(r"^(?:(?P<c>\d+)c\.)?(?P<g>\d+)g\.")
# Compute slices of a whole GPU, by model: the largest "Ng" profile the MIG User Guide
# lists for it (A30 and RTX PRO 6000 Blackwell: 4g; A100, H100, H200, B200: 7g).
_GPU_SLICES: tuple[tuple[str, int], ...] = (("A30", 4), ("RTX PRO 6000", 4))
DEFAULT_GPU_SLICES = 7

_DeviceKey = tuple[str, str | None]  # (GPU uuid, MIG uuid)
_EnergyKey = tuple[ContainerRef, str, str | None]  # (container, GPU uuid, MIG uuid)


def compute_slices(profile: str) -> int | None:
    """The compute slices a MIG profile names; None for a profile in no known form."""
    match = _PROFILE.match(profile)
    if match is None:
        return None
    return int(match["c"] or match["g"]) or None


def gpu_slices(gpu: GpuSample) -> int:
    """The compute slices of a whole GPU: its model's, else 7; never fewer than the
    largest instance it has."""
    name = gpu.name or ""
    known = next((n for model, n in _GPU_SLICES if model in name), DEFAULT_GPU_SLICES)
    seen = (_profile_gpu_slices(m.profile) for m in gpu.mig_instances)
    return max(known, *(s for s in seen if s is not None), 0)


def _profile_gpu_slices(profile: str) -> int | None:
    match = _PROFILE.match(profile)
    return int(match["g"]) if match is not None else None


def advertised_replicas(
    gpus: Sequence[GpuSample], pod_resources: PodResourcesSnapshot | None
) -> dict[_DeviceKey, int]:
    """(GPU uuid, MIG uuid) -> replica ids the kubelet advertises for that device
    (GetAllocatableResources); empty when it cannot say."""
    if pod_resources is None or not pod_resources.ok or not pod_resources.allocatable_ok:
        return {}
    resolver = DeviceResolver(gpus)
    out: dict[_DeviceKey, int] = defaultdict(int)
    for entry in pod_resources.allocatable:
        for device_id in entry.device_ids:
            found = resolver.device_id(device_id)
            if found.replica and found.uuid is not None:
                out[(found.uuid, found.mig_uuid)] += 1
    return dict(out)


def replicas(
    allocations: Iterable[Allocation], advertised: Mapping[_DeviceKey, int]
) -> dict[_DeviceKey, int]:
    """(GPU uuid, MIG uuid) -> how many replicas a shared device is cut into: the ids the
    kubelet advertises, and never fewer than the shared allocations on it (so the
    weights on one device never add up to more than the device)."""
    held: dict[_DeviceKey, int] = defaultdict(int)
    for a in allocations:
        if a.shared and a.device.uuid is not None:
            held[(a.device.uuid, a.device.mig_uuid)] += 1
    return {key: max(n, advertised.get(key, 0)) for key, n in held.items()}


def _instance(gpu: GpuSample | None, mig_uuid: str) -> MigInstance | None:
    if gpu is None:
        return None
    return next((m for m in gpu.mig_instances if m.uuid == mig_uuid), None)


def weight(
    a: Allocation, gpus: Mapping[str, GpuSample], cut: Mapping[_DeviceKey, int]
) -> float | None:
    """GPU-equivalents ``a`` holds; None when its size cannot be known."""
    device = a.device
    if device.uuid is None:
        return None  # which device, and so how big, is unknown
    size = 1.0
    if device.mig_uuid is not None:
        gpu = gpus.get(device.uuid)
        mig = _instance(gpu, device.mig_uuid)
        slices = compute_slices(mig.profile) if mig is not None else None
        if gpu is None or slices is None:
            return None
        size = slices / gpu_slices(gpu)
    if a.shared:
        size /= cut.get((device.uuid, device.mig_uuid), 1)
    return size


def state_of(
    a: Allocation,
    usage: Mapping[UsageKey, ContainerGpuUsage],
    gpus: Mapping[str, GpuSample],
    unhealthy: frozenset[str],
    threshold: float,
) -> LedgerStateName:
    """This cycle's state of one allocation (module doc: first that applies)."""
    uuid = a.device.uuid
    if uuid is None or uuid not in gpus:
        return "unknown"  # NVML does not list it (or is down): no evidence either way
    if uuid in unhealthy:
        return "unhealthy"
    judged = activity(a, usage, gpus)
    if judged.ratio is None:
        return "unknown"
    if not judged.has_process:
        return "no_process"
    return "busy" if judged.ratio >= threshold else "idle"


def _advance(
    prior: AllocationLedger | None,
    a: Allocation,
    size: float,
    state: LedgerStateName,
    step: float,
) -> AllocationLedger:
    before = dict(prior.seconds) if prior is not None else {}
    added = step * size
    seconds = tuple((s, before.get(s, 0.0) + (added if s == state else 0.0)) for s in LEDGER_STATES)
    held = (prior.allocated_seconds if prior is not None else 0.0) + added
    return AllocationLedger(a.container, a.device, a.device_id, size, state, seconds, held)


def account_ledger(
    previous: LedgerState,
    allocations: Sequence[Allocation],
    containers: Sequence[ContainerGpuUsage],
    gpus: Sequence[GpuSample],
    health: Sequence[GpuHealth],
    pod_resources: PodResourcesSnapshot | None,
    *,
    elapsed_s: float,
    policy: IdlePolicy,
) -> LedgerState:
    """Carry the ledger and the energy split forward by one cycle. Allocations that
    disappeared drop out (their counters end with them)."""
    step = counted_step(elapsed_s, policy)
    by_uuid = {g.uuid: g for g in gpus}
    usage = usage_index(containers)
    unhealthy = frozenset(h.uuid for h in health if not h.healthy)
    cut = replicas(allocations, advertised_replicas(gpus, pod_resources))
    before = {(p.container, p.device_id): p for p in previous.allocations}
    ledger: list[AllocationLedger] = []
    for a in allocations:
        prior = before.get((a.container, a.device_id))
        size = weight(a, by_uuid, cut)
        if size is None:
            size = prior.weight if prior is not None else None
        if size is None:
            continue  # never sized: no ledger rather than a guessed one
        state = state_of(a, usage, by_uuid, unhealthy, policy.threshold_ratio)
        ledger.append(_advance(prior, a, size, state, step))
    energy, readings = account_energy(previous, allocations, containers, gpus, counted=step > 0)
    return LedgerState(tuple(ledger), energy, readings)


# -- energy ----------------------------------------------------------------------------


def account_energy(
    previous: LedgerState,
    allocations: Sequence[Allocation],
    containers: Sequence[ContainerGpuUsage],
    gpus: Sequence[GpuSample],
    *,
    counted: bool,
) -> tuple[tuple[ContainerEnergy, ...], dict[str, int]]:
    """Each holder's joules so far, and this cycle's energy readings (GPU uuid -> mJ).

    A holder's series exists from the first cycle its GPU reports an energy counter; it
    ends when the container no longer holds the device. ``counted`` False (the first
    cycle, a gap): no delta is split.
    """
    usage = usage_index(containers)
    readings = {
        g.uuid: g.energy_millijoules
        for g in gpus
        if not g.error and g.energy_millijoules is not None
    }
    totals: dict[_EnergyKey, ContainerEnergy] = {
        (e.container, e.device.uuid, e.device.mig_uuid): e
        for e in previous.energy
        if e.device.uuid is not None
    }
    held = _holders(allocations)
    out: dict[_EnergyKey, ContainerEnergy] = {}
    for gpu in gpus:
        mine = {k: d for k, d in held.items() if k[1] == gpu.uuid}
        if not mine:
            continue
        delta = _delta(gpu.uuid, readings, previous.energy_readings) if counted else None
        shares = split_energy(gpu, mine, usage) if delta is not None else None
        for key, device in mine.items():
            prior = totals.get(key)
            if prior is None and gpu.uuid not in readings:
                continue  # this GPU has no energy counter (yet): no series, not 0
            joules = (prior.joules_total if prior is not None else 0.0) + (
                delta * shares.get(key, 0.0) / 1000.0 if delta is not None and shares else 0.0
            )
            out[key] = ContainerEnergy(key[0], device, joules)
    for key, prior in totals.items():  # held, but its GPU is not listed this cycle
        if key not in out and key in held:
            out[key] = ContainerEnergy(key[0], held[key], prior.joules_total)
    return tuple(out[k] for k in sorted(out, key=_sort_key)), readings


def _sort_key(key: _EnergyKey) -> tuple[ContainerRef, str, str]:
    return key[0], key[1], key[2] or ""


def _holders(allocations: Iterable[Allocation]) -> dict[_EnergyKey, DeviceRef]:
    """(container, GPU uuid, MIG uuid) -> the device, for every resolved allocation (a
    container holding two replicas of one GPU holds it once)."""
    out: dict[_EnergyKey, DeviceRef] = {}
    for a in allocations:
        if a.device.uuid is not None:
            out[(a.container, a.device.uuid, a.device.mig_uuid)] = a.device
    return out


def _delta(uuid: str, now: Mapping[str, int], before: Mapping[str, int]) -> int | None:
    """The GPU's energy delta in mJ since the last cycle; None without two readings or
    when the counter went back (a driver reload resets it: that delta is unknown)."""
    if uuid not in now or uuid not in before:
        return None
    delta = now[uuid] - before[uuid]
    return delta if delta >= 0 else None


def split_energy(
    gpu: GpuSample,
    holders: Mapping[_EnergyKey, DeviceRef],
    usage: Mapping[UsageKey, ContainerGpuUsage],
) -> dict[_EnergyKey, float] | None:
    """Each holder's part of the GPU's energy (parts sum to 1), or None when it cannot be
    split. ``holders`` are the (container, uuid, MIG uuid) holding this GPU."""
    if gpu.mig_instances:
        return _split_mig(gpu, [k for k in holders if k[2] is not None])
    whole = [k for k in holders if k[2] is None]
    containers = {k[0] for k in whole}
    if len(containers) == 1:
        return {whole[0]: 1.0}  # the only holder: all of it, used or not
    used: dict[_EnergyKey, float] = {}
    for key in whole:
        row = usage.get((key[0], gpu.uuid, None))
        used[key] = (row.sm_ratio or 0.0) if row is not None else 0.0
    total = sum(used.values())
    if total <= 0:
        return None  # no holder had SM time in the samples: nothing to split by
    return {key: part / total for key, part in used.items()}


def _split_mig(gpu: GpuSample, held: Sequence[_EnergyKey]) -> dict[_EnergyKey, float] | None:
    """By activity x compute slices of the held instances; the holders of one instance
    (replicas of it) split its part evenly (per-process samples do not exist on MIG)."""
    by_instance: dict[str, list[_EnergyKey]] = defaultdict(list)
    for key in held:
        assert key[2] is not None
        by_instance[key[2]].append(key)
    weights: dict[str, float] = {}
    for mig_uuid in by_instance:
        mig = _instance(gpu, mig_uuid)
        active = mig.occupancy.sm_active if mig is not None and mig.occupancy else None
        slices = compute_slices(mig.profile) if mig is not None else None
        if active is None or slices is None:
            return None  # one unknown part makes every part unknown
        weights[mig_uuid] = active * slices
    total = sum(weights.values())
    if total <= 0:
        return None
    return {
        key: weights[mig_uuid] / total / len(keys)
        for mig_uuid, keys in by_instance.items()
        for key in keys
    }
