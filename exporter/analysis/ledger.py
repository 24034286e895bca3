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
replicas the replica ids the kubelet last advertised for that device, else the
allocations on it. A MIG replica is both. An allocation whose size cannot be known (its
device resolves to no GPU and was never sized, a profile larger than its GPU) has no
ledger; one that was keeps its last weight. One device id listed twice for a container
(under two resource names) is one allocation.

The ``idle`` and ``no_process`` part of each step also goes to one likely cause
(``exporter/analysis/why_idle.py``: the container's cgroup over the same cycle, else
``unknown``), so an allocation's causes always sum to those two states.

What is not known is carried, never dropped: while PodResources fails, every row goes on
in ``unknown`` (a row ends only when a listing that worked no longer has it); while NVML
does not list a device, its row keeps the GPU index, UUID and MIG labels NVML last gave,
so a series keeps one identity; a clock that steps back adds nothing
(``exporter/analysis/pipeline.py`` counts a step only past the latest time counted).

Energy: NVML counts energy per GPU only (``nvmlDeviceGetTotalEnergyConsumption``), so
the GPU's delta over one cycle is split among the containers holding it: all of it to
the only holder; by each holder's part of the SM time the holders used (per-process
samples) on a time-shared GPU; by activity x compute slices of the held instances on a
MIG GPU. A delta that cannot be split (no holder, no SM time or no activity signal to
split by, a counter that went back, a gap, a cycle without a PodResources listing) or
that no GPU could draw (over twice its power limit, or 2 x 1,500 W without one, for the
whole step) is not counted: the split sums to the GPU's delta wherever it is counted.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from exporter.analysis.activity import (
    UsageKey,
    activity,
    distinct_allocations,
    finite,
    usage_index,
)
from exporter.analysis.devices import DeviceResolver
from exporter.analysis.idle import IdlePolicy, counted_step
from exporter.model import (
    IDLE_CAUSES,
    LEDGER_STATES,
    Allocation,
    AllocationLedger,
    ContainerEnergy,
    ContainerGpuUsage,
    ContainerRef,
    DeviceRef,
    EnergyWindow,
    GpuHealth,
    GpuSample,
    IdleCause,
    LedgerState,
    LedgerStateName,
    MigIdentity,
    MigInstance,
    PodResourcesSnapshot,
)

# Compute slices of a MIG profile: "3g.40gb" -> 3; a compute instance smaller than its GPU
# instance, "1c.3g.40gb", has 1 (NVIDIA MIG User Guide, "Terminology" and
# "Supported MIG Profiles": https://docs.nvidia.com/datacenter/tesla/mig-user-guide/).
_PROFILE = re.compile(r"^(?:(?P<c>\d{1,2})c\.)?(?P<g>\d{1,2})g\.")
# Compute slices of a whole GPU, by model: the largest "Ng" profile the MIG User Guide
# lists for it (A30 and RTX PRO 6000 Blackwell: 4g; A100, H100, H200, B200: 7g).
_GPU_SLICES: tuple[tuple[str, int], ...] = (("A30", 4), ("RTX PRO 6000", 4))
DEFAULT_GPU_SLICES = 7
# Energy a GPU can plausibly draw over one step: twice its power limit, or twice this
# (above any GPU's board power: B200 1,000 W, GB200 1,200 W) when it reports none.
ENERGY_BOUND_W = 1500.0

_DeviceKey = tuple[str, str | None]  # (GPU uuid, MIG uuid)
# The states whose seconds are split by cause (analysis/why_idle.py).
IDLE_STATES: frozenset[LedgerStateName] = frozenset({"idle", "no_process"})
_EnergyKey = tuple[ContainerRef, str, str | None]  # (container, GPU uuid, MIG uuid)


def compute_slices(profile: str) -> int | None:
    """The compute slices a MIG profile names; None for a profile in no known form (a
    compute instance larger than its GPU instance included)."""
    match = _PROFILE.match(profile)
    if match is None:
        return None
    gpu_instance = int(match["g"])
    compute = int(match["c"]) if match["c"] is not None else gpu_instance
    return compute if 0 < compute <= gpu_instance else None


def gpu_slices(gpu: GpuSample) -> int:
    """The compute slices of a whole GPU: its model's, else 7. An instance claiming more
    (a profile NVML should never name) does not change it: that instance's own size is
    unknown (``instance_slices``), its siblings' stay as they are."""
    name = gpu.name or ""
    return next((n for model, n in _GPU_SLICES if model in name), DEFAULT_GPU_SLICES)


def instance_slices(gpu: GpuSample, mig: MigInstance) -> int | None:
    """The compute slices of one instance of ``gpu``; None when its profile is in no
    known form or claims more slices than the GPU has."""
    match = _PROFILE.match(mig.profile)
    slices = compute_slices(mig.profile)
    if match is None or slices is None or int(match["g"]) > gpu_slices(gpu):
        return None
    return slices


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
        if gpu is None or mig is None:
            return None
        slices = instance_slices(gpu, mig)
        if slices is None:
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
    row: AllocationLedger,
    state: LedgerStateName,
    step: float,
    cause: IdleCause = "unknown",
) -> AllocationLedger:
    """``row`` (identity and weight) with ``prior``'s totals advanced by one step; an
    idle or no_process step also goes to ``cause`` (so the causes sum to those states)."""
    before = dict(prior.seconds) if prior is not None else {}
    added = step * row.weight
    seconds = tuple((s, before.get(s, 0.0) + (added if s == state else 0.0)) for s in LEDGER_STATES)
    held = (prior.allocated_seconds if prior is not None else 0.0) + added
    was = dict(prior.idle_causes) if prior is not None else {}
    idle = added if state in IDLE_STATES else 0.0
    causes = tuple((c, was.get(c, 0.0) + (idle if c == cause else 0.0)) for c in IDLE_CAUSES)
    return AllocationLedger(
        row.container, row.device, row.device_id, row.weight, state, seconds, held, row.mig, causes
    )


def _identity(
    a: Allocation, prior: AllocationLedger | None, gpus: Mapping[str, GpuSample]
) -> tuple[DeviceRef, MigIdentity | None]:
    """The device a row names: as NVML lists it now, else as it last did (so a series
    keeps its labels while NVML is down or does not list the GPU)."""
    gpu = gpus.get(a.device.uuid) if a.device.uuid is not None else None
    if gpu is None:
        return (prior.device, prior.mig) if prior is not None else (a.device, None)
    if a.device.mig_uuid is None:
        return a.device, None
    mig = _instance(gpu, a.device.mig_uuid)
    if mig is None:
        return (prior.device, prior.mig) if prior is not None else (a.device, None)
    return a.device, MigIdentity(
        mig.uuid, mig.gpu_instance_id, mig.compute_instance_id, mig.profile
    )


def listed(pod_resources: PodResourcesSnapshot | None) -> bool:
    """Whether this cycle's allocations are the kubelet's word: PodResources answered.
    Otherwise they are unknown, not none."""
    return pod_resources is not None and pod_resources.ok


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
    causes: Mapping[ContainerRef, IdleCause] | None = None,
) -> LedgerState:
    """Carry the ledger and the energy split forward by one cycle. Allocations that a
    PodResources listing no longer has drop out (their counters end with them); without
    a listing, every row goes on as ``unknown``. ``causes``: each container's likely
    cause of idle time this cycle (analysis/why_idle.py); one not named: unknown."""
    step = counted_step(elapsed_s, policy)
    readings = _readings(gpus)
    if not listed(pod_resources):
        carried = tuple(_advance(p, p, "unknown", step) for p in previous.allocations)
        windows = _restarted(gpus, readings)  # nobody knows who held what this cycle
        return LedgerState(carried, previous.energy, windows, previous.advertised)
    assert pod_resources is not None
    allocations = distinct_allocations(allocations)
    by_uuid = {g.uuid: g for g in gpus}
    usage = usage_index(containers)
    # an unknown GPU is no verdict: its rows are judged by activity, which is unknown
    unhealthy = frozenset(h.uuid for h in health if h.unhealthy)
    advertised = (
        advertised_replicas(gpus, pod_resources)
        if pod_resources.allocatable_ok
        else dict(previous.advertised)
    )
    cut = replicas(allocations, advertised)
    before = {(p.container, p.device_id): p for p in previous.allocations}
    ledger: list[AllocationLedger] = []
    for a in allocations:
        prior = before.get((a.container, a.device_id))
        size = weight(a, by_uuid, cut)
        if size is None:
            size = prior.weight if prior is not None else None
        if size is None:
            continue  # never sized: no ledger rather than a guessed one
        device, mig = _identity(a, prior, by_uuid)
        row = AllocationLedger(a.container, device, a.device_id, size, "unknown", (), 0.0, mig)
        state = state_of(a, usage, by_uuid, unhealthy, policy.threshold_ratio)
        cause = (causes or {}).get(a.container, "unknown")
        ledger.append(_advance(prior, row, state, step, cause))
    energy, windows = account_energy(previous, ledger, containers, gpus, readings, step_s=step)
    return LedgerState(tuple(ledger), energy, windows, advertised)


# -- energy ----------------------------------------------------------------------------


def _readings(gpus: Iterable[GpuSample]) -> dict[str, int]:
    """This cycle's energy counters, GPU uuid -> mJ."""
    return {
        g.uuid: g.energy_millijoules
        for g in gpus
        if not g.error and g.energy_millijoules is not None
    }


def account_energy(
    previous: LedgerState,
    ledger: Sequence[AllocationLedger],
    containers: Sequence[ContainerGpuUsage],
    gpus: Sequence[GpuSample],
    readings: Mapping[str, int],
    *,
    step_s: float,
) -> tuple[tuple[ContainerEnergy, ...], dict[str, EnergyWindow]]:
    """Each holder's joules so far: the rows of ``ledger`` (this cycle's, their devices
    as NVML last listed them) are the holders; and each GPU's energy window carried on.

    The counter is read in the NVML slow tier: a cycle that did not read it
    (``GpuSample.slow_read`` False, its value carried) adds its split to the GPU's window;
    the cycle that reads it again splits the delta since the last read by the window
    (``EnergyWindow``). Read every cycle, that is each cycle's delta by its own split.
    A holder's series exists from the first cycle its GPU reports an energy counter; it
    ends when the container no longer holds the device. ``step_s`` 0 (the first cycle, a
    gap): the window ends, and no delta is split until a read after it.
    """
    usage = usage_index(containers)
    totals: dict[_EnergyKey, ContainerEnergy] = {
        (e.container, e.device.uuid, e.device.mig_uuid): e
        for e in previous.energy
        if e.device.uuid is not None
    }
    held = _holders(ledger)
    out: dict[_EnergyKey, ContainerEnergy] = {}
    windows: dict[str, EnergyWindow] = {}
    for gpu in gpus:
        mine = {k: row for k, row in held.items() if k[1] == gpu.uuid}
        window = previous.energy_windows.get(gpu.uuid) if step_s > 0 else None
        parts: dict[_EnergyKey, float] | None = None
        if gpu.uuid in readings:
            if window is not None:
                shares = split_energy(gpu, mine, usage) if mine else None
                window = _widened(window, step_s, gpu.power_milliwatts, shares)
            if gpu.slow_read:
                parts = _parts(gpu, window, readings[gpu.uuid]) if window is not None else None
                window = EnergyWindow(readings[gpu.uuid])
            if window is not None:
                windows[gpu.uuid] = window
        for key, row in mine.items():
            prior = totals.get(key)
            if prior is None and gpu.uuid not in readings:
                continue  # this GPU has no energy counter (yet): no series, not 0
            joules = (prior.joules_total if prior is not None else 0.0) + (
                parts.get(key, 0.0) / 1000.0 if parts else 0.0
            )
            out[key] = ContainerEnergy(key[0], row.device, joules, row.mig)
    for key, prior in totals.items():  # held, but its GPU is not listed this cycle
        if key not in out and key in held:
            out[key] = ContainerEnergy(key[0], held[key].device, prior.joules_total, held[key].mig)
    return tuple(out[k] for k in sorted(out, key=_sort_key)), windows


def _restarted(gpus: Iterable[GpuSample], readings: Mapping[str, int]) -> dict[str, EnergyWindow]:
    """A window from this cycle's reading on each GPU whose counter it read, none
    elsewhere: what went before this cycle cannot be split."""
    return {
        g.uuid: EnergyWindow(readings[g.uuid]) for g in gpus if g.slow_read and g.uuid in readings
    }


def _widened(
    window: EnergyWindow,
    step_s: float,
    power_mw: int | None,
    shares: Mapping[_EnergyKey, float] | None,
) -> EnergyWindow:
    """``window`` with one more cycle of ``step_s``: each holder's ``shares`` of it (None:
    it cannot be split, so it only adds to the total)."""
    by_power, by_time = dict(window.by_power), dict(window.by_time)
    power = float(power_mw) if power_mw is not None else 0.0
    for key, share in (shares or {}).items():
        by_power[key] = by_power.get(key, 0.0) + share * power * step_s
        by_time[key] = by_time.get(key, 0.0) + share * step_s
    return EnergyWindow(
        window.millijoules,
        window.elapsed_s + step_s,
        window.power_total + power * step_s,
        window.power_known and power_mw is not None,
        by_power,
        by_time,
        window.cycles + 1,
        dict(shares or {}),
    )


def _parts(gpu: GpuSample, window: EnergyWindow, now_mj: int) -> dict[_EnergyKey, float] | None:
    """Each holder's mJ of the delta since the window's read; None when there is no delta
    to split: no time counted, the counter went back (a driver reload resets it), or it
    rose by more than the GPU could draw in that time (a corrupt reading is no meter).
    By power x step where every cycle's power was read, else by step."""
    delta = now_mj - window.millijoules
    limit_mw = gpu.power_limit_milliwatts or ENERGY_BOUND_W * 1000.0
    if window.elapsed_s <= 0 or delta < 0 or delta > 2 * limit_mw * window.elapsed_s:
        return None  # mW x s = mJ
    if window.cycles == 1:  # that cycle's own split, to the bit (not share x w / w)
        return {key: delta * share for key, share in window.last_shares.items()}
    if window.power_known and window.power_total > 0:
        weights, total = window.by_power, window.power_total
    else:
        weights, total = window.by_time, window.elapsed_s
    return {key: delta * weight / total for key, weight in weights.items()}


def _sort_key(key: _EnergyKey) -> tuple[ContainerRef, str, str]:
    return key[0], key[1], key[2] or ""


def _holders(ledger: Iterable[AllocationLedger]) -> dict[_EnergyKey, AllocationLedger]:
    """(container, GPU uuid, MIG uuid) -> a ledger row of it, for every row whose GPU is
    known (a container holding two replicas of one GPU holds it once)."""
    out: dict[_EnergyKey, AllocationLedger] = {}
    for row in ledger:
        if row.device.uuid is not None:
            out.setdefault((row.container, row.device.uuid, row.device.mig_uuid), row)
    return out


def split_energy(
    gpu: GpuSample,
    holders: Mapping[_EnergyKey, object],
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
        used[key] = (finite(row.sm_ratio) or 0.0) if row is not None else 0.0
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
        active = finite(mig.occupancy.sm_active) if mig is not None and mig.occupancy else None
        slices = instance_slices(gpu, mig) if mig is not None else None
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
