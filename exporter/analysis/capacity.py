"""Node GPU capacity (pure): what the scheduler could still place on this node.

    allocatable = healthy advertised devices - allocated healthy devices - disrupted

``disrupted``: healthy devices no allocation holds that a new pod could still not get,
by reason (``DISRUPTION_REASONS``, docs/capacity.md): the node is cordoned, carries a
NoSchedule/NoExecute taint that GPU pods are not known to tolerate (any key but
``tolerated_taint_keys``), the GPU Operator is upgrading its driver, or (DRA) the
driver tainted the device itself NoSchedule/NoExecute, or a DeviceTaintRule does (below).
A device may count under several
reasons; ``disrupted`` counts it once. It rests on the Node watch: with no Node watched
(no Kubernetes API) it is ``None`` and ``allocatable`` keeps its older meaning (healthy
and not allocated); with the watch down, or no Node of this name, both are ``None``.

A DRA DeviceTaintRule "has the same effect as if the taint was specified directly in the
ResourceSlice" (k8s.io/api resource/v1alpha3/types.go at v0.35.0, lines 192-194), so a
device it selects with effect NoSchedule or NoExecute counts under ``device_taint`` too
(each device once, whether its slice, a rule, or both taint it); effect None, and any
effect this code does not know, does not ("Consumers must treat unknown effects like
None", the same file, line 140). ``rule_matches`` is the matching: a rule without a
``deviceSelector`` selects nothing, and every set field of ``driver``/``pool``/``device``
must equal the device's. A rule that also has ``deviceClassName`` or CEL ``selectors``
(Kubernetes 1.33-1.34) cannot be evaluated here: when its exact fields match a free device
of a resource, that resource's ``device_taint`` (so ``disrupted`` and ``allocatable``) is
unknown, neither counted disrupted nor allocatable. With the rule watch configured but
down (``ok`` False), every DRA resource's ``device_taint`` is unknown the same way;
device-plugin resources are untouched (a rule names DRA devices only).

Devices are counted per resource in the units the scheduler sees: whole GPUs, MIG
instances and time-sliced replicas of a device plugin's extended resource (in whatever
form the plugin names them), and the devices of a DRA driver's ResourceSlices (the
resource is then the driver's name). Each device is resolved to its physical GPU for
health.

Every count rests on a source that answered (docs/health.md, "Unknown"):

- health needs NVML. A device on a GPU NVML reports is healthy or unhealthy by that
  GPU's verdict; a device naming a GPU that NVML, up, does not report is unhealthy (the
  scheduler can hand it out, nothing can use it); a device that names no GPU at all, or
  any device while NVML is down, is *unknown* and never counted healthy;
- allocation needs the kubelet: while its PodResources answer is missing, ``allocated``
  and ``allocatable`` are ``None`` (served as absent), never 0 or "all free";
- allocation also needs the advertised set to be the kubelet's (or a DRA driver's). Where
  the kubelet lists allocations but cannot say what it advertises (no
  ``GetAllocatableResources``: kubelets before 1.21, or 1.21-1.22 with the feature gate
  off), NVML's GPUs stand in as one ``nvidia.com/gpu`` each: a guess. The device plugin
  may advertise them otherwise (time-sliced replicas under ``nvidia.com/gpu.shared``,
  MIG instances, ``GPU-...::N`` ids), and allocations of those match no guessed device,
  so ``allocated`` and ``allocatable`` of a guessed set are ``None`` too: never "all free"
  on a node whose every GPU is handed out in another form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from exporter.analysis.devices import DeviceResolver
from exporter.model import (
    DISRUPTION_REASONS,
    DRIVER_UPGRADE_IN_SERVICE,
    Allocation,
    DeviceCapacity,
    DeviceTaintRuleSelector,
    DeviceTaintRuleSnapshot,
    GpuHealth,
    GpuSample,
    NodeSchedulingSnapshot,
    PodResourcesSnapshot,
    ResourceSliceSnapshot,
    SliceDevice,
    placeholder_uuid,
)

NVML_RESOURCE = "nvidia.com/gpu"
# Taint effects that keep a new pod off (PreferNoSchedule only discourages); on a Node an
# effect that cannot be read ("?", sources/node_watch.py) blocks too
BLOCKING_EFFECTS = frozenset({"NoSchedule", "NoExecute"})
NOT_BLOCKING = "PreferNoSchedule"
# The taint the API server puts on a cordoned node (TaintNodeUnschedulable)
UNSCHEDULABLE_TAINT = "node.kubernetes.io/unschedulable"
# Taint keys GPU pods are said to tolerate, whatever the effect (--capacity-tolerated-taints;
# none by default). Besides them, a NoSchedule taint whose key is the resource's own name
# is tolerated for that resource's devices: the ExtendedResourceToleration admission
# plugin gives every pod that requests an extended resource the toleration
# {key: <resource>, operator: Exists, effect: NoSchedule}
# (kubernetes plugin/pkg/admission/extendedresourcetoleration/admission.go, Admit), and
# GPU node pools are tainted so (nvidia.com/gpu=present:NoSchedule on GKE).
DEFAULT_TOLERATED_TAINT_KEYS: frozenset[str] = frozenset()
_GPU_UUID_PREFIX = "GPU-"  # a physical GPU's UUID (MIG UUIDs name no physical GPU)

Verdict = Literal["healthy", "unhealthy", "unknown"]


def node_capacity(
    gpus: Sequence[GpuSample],
    health: Sequence[GpuHealth],
    pod_resources: PodResourcesSnapshot | None,
    allocations: Sequence[Allocation],
    slices: ResourceSliceSnapshot | None = None,
    *,
    nvml_ok: bool,
    unaccounted: frozenset[str] = frozenset(),
    dra_unreported: bool = False,
    scheduling: NodeSchedulingSnapshot | None = None,
    tolerated_taint_keys: frozenset[str] = DEFAULT_TOLERATED_TAINT_KEYS,
    taint_rules: DeviceTaintRuleSnapshot | None = None,
) -> tuple[DeviceCapacity, ...]:
    """Advertised devices come from the kubelet's GetAllocatableResources and the DRA
    ResourceSlices where they answer, else from NVML (one ``nvidia.com/gpu`` per GPU).
    ``nvml_ok``: NVML answered this cycle (``gpus`` and ``health`` are its word).
    ``unaccounted``: GPUs a pod's process uses that the answer does not account for
    (``Attribution.unaccounted_gpus``); a resource with a device on one that no listed
    allocation takes has unknown ``allocated`` and ``allocatable``. ``dra_unreported``: a
    pod's claims go unreported in the answer, so every DRA driver's are unknown.
    ``scheduling``: the Node watch's reading (None: not watched). ``taint_rules``: the
    DeviceTaintRule watch's reading (None: not watched)."""
    resolver = DeviceResolver(gpus, slices)
    # resource -> device ids the DRA driver or a DeviceTaintRule tainted NoSchedule/NoExecute
    device_tainted: dict[str, set[str]] = {}
    # resource -> device ids an opaque rule (CEL, a DeviceClass) may or may not select
    maybe_tainted: dict[str, set[str]] = {}
    rules_ok = taint_rules is None or taint_rules.ok
    rules = _rules_for(taint_rules, slices)
    # resource -> device id -> physical GPU UUID (None: names no GPU)
    advertised: dict[str, dict[str, str | None]] = {}
    kubelet_ok = pod_resources is not None and pod_resources.ok and pod_resources.allocatable_ok
    if kubelet_ok and pod_resources is not None:
        for entry in pod_resources.allocatable:
            devices = advertised.setdefault(entry.resource_name, {})
            for device_id in entry.device_ids:
                devices[device_id] = resolver.device_id(device_id).uuid
    if slices is not None and slices.ok:
        for device in slices.devices:
            uuid = resolver.claim(device.driver, device.pool, device.name).uuid
            key = f"{device.pool}/{device.name}"
            advertised.setdefault(device.driver, {})[key] = uuid or _published_gpu(device)
            if BLOCKING_EFFECTS.intersection(device.taint_effects):
                device_tainted.setdefault(device.driver, set()).add(key)
            for rule in rules:
                if rule_matches(rule, device.driver, device.pool, device.name):
                    into = maybe_tainted if rule.opaque else device_tainted
                    into.setdefault(device.driver, set()).add(key)
    guessed = not kubelet_ok and not advertised and bool(gpus)
    if guessed:
        advertised[NVML_RESOURCE] = {g.uuid: g.uuid for g in gpus}
    judge = _Judge(gpus, health, nvml_ok)
    # what is taken of a guessed set is unknown, whatever the kubelet lists (module doc)
    allocation_ok = pod_resources is not None and pod_resources.ok and not guessed
    allocated: dict[str, set[str]] = {}
    for a in allocations:
        allocated.setdefault(a.resource_name, set()).add(a.device_id)
    drivers = {d.driver for d in slices.devices} if slices is not None and slices.ok else set()
    counts = []
    for resource, devices in sorted(advertised.items()):
        taken = allocated.get(resource, set()) if allocation_ok else None
        if dra_unreported and resource in drivers:
            taken = None  # its claims' allocations are not in the answer
        if taken is not None and any(
            uuid in unaccounted and device not in taken for device, uuid in devices.items()
        ):
            taken = None  # one of them may be the unlisted container's
        tainted: set[str] | None = device_tainted.get(resource, set())
        if resource in drivers and not rules_ok:
            tainted = None  # the rules that may taint its devices could not be read
        watched = scheduling is not None
        node_reasons = node_disruptions(scheduling, tolerated_taint_keys, resource)
        maybe = maybe_tainted.get(resource, set())
        counts.append(
            _count(resource, devices, judge, taken, node_reasons, tainted, watched, maybe)
        )
    return tuple(counts)


def _rules_for(
    taint_rules: DeviceTaintRuleSnapshot | None, slices: ResourceSliceSnapshot | None
) -> tuple[DeviceTaintRuleSelector, ...]:
    """The blocking rules that may select a device of this node's slices: one pass over
    the cluster's rules (thousands: one per unhealthy GPU where every node taints its
    own), so that each device is then checked against a handful, not all of them."""
    if taint_rules is None or slices is None or not slices.ok:
        return ()
    drivers = {d.driver for d in slices.devices}
    pools = {d.pool for d in slices.devices}
    return tuple(
        r
        for r in taint_rules.rules
        if blocks(r)
        and (r.driver is None or r.driver in drivers)
        and (r.pool is None or r.pool in pools)
    )


def blocks(rule: DeviceTaintRuleSelector) -> bool:
    """Whether the rule's taint keeps new pods off the devices it selects: NoSchedule or
    NoExecute; None and any effect not known here do not (module docstring)."""
    return rule.effect in BLOCKING_EFFECTS


def rule_matches(rule: DeviceTaintRuleSelector, driver: str, pool: str, device: str) -> bool:
    """Whether the rule's exact fields select the device ``driver``/``pool``/``device``
    (k8s.io/api resource/v1alpha3 DeviceTaintSelector: "All selector criteria must be
    satisfied", "The empty selector matches all devices. Without a selector, no devices
    are matched"). For an ``opaque`` rule True means only "may select": its CEL or
    DeviceClass part is not evaluated."""
    if not rule.selects:
        return False
    return (
        (rule.driver is None or rule.driver == driver)
        and (rule.pool is None or rule.pool == pool)
        and (rule.device is None or rule.device == device)
    )


def node_disruptions(
    scheduling: NodeSchedulingSnapshot | None,
    tolerated_taint_keys: frozenset[str],
    resource: str = "",
) -> tuple[str, ...] | None:
    """The reasons that keep new pods of ``resource`` off every device of it on the node,
    sorted; () when none does; None when it cannot be told (the watch is down, or no Node
    of this name). With no Node watched at all, () (see the module's docstring)."""
    if scheduling is None:
        return ()
    if not scheduling.ok or scheduling.node is None:
        return None
    node = scheduling.node
    reasons = set()
    if node.unschedulable:
        reasons.add("cordoned")
    for taint in node.taints:
        if taint.effect == NOT_BLOCKING:
            continue
        if taint.key == UNSCHEDULABLE_TAINT:
            reasons.add("cordoned")
        elif taint.key in tolerated_taint_keys:
            continue
        elif not (taint.key == resource and taint.effect == "NoSchedule"):
            reasons.add("node_taint")
    upgrade = node.driver_upgrade_state
    if upgrade is not None and upgrade not in DRIVER_UPGRADE_IN_SERVICE:
        reasons.add("driver_upgrade")
    return tuple(sorted(reasons))


class _Judge:
    """One device's health from NVML's word on its physical GPU."""

    def __init__(self, gpus: Sequence[GpuSample], health: Sequence[GpuHealth], nvml_ok: bool):
        self._ok = nvml_ok
        self._reported = {g.uuid for g in gpus}
        self._unhealthy = {h.uuid for h in health if h.unhealthy}
        self._unknown = {h.uuid for h in health if h.unknown}
        # a GPU NVML lists but whose UUID it could not read, for no hardware reason: a
        # device NVML does not report may be that one
        self._unidentified = any(h.unknown and h.uuid == placeholder_uuid(h.gpu) for h in health)

    @property
    def ok(self) -> bool:
        return self._ok

    def __call__(self, uuid: str | None) -> Verdict:
        if not self._ok or uuid is None or uuid in self._unknown:
            return "unknown"
        if uuid not in self._reported and self._unidentified:
            return "unknown"
        if uuid not in self._reported or uuid in self._unhealthy:
            return "unhealthy"  # a GPU NVML cannot see is not one a pod can use
        return "healthy"


def _count(
    resource: str,
    devices: dict[str, str | None],
    judge: _Judge,
    taken: set[str] | None,
    node_reasons: tuple[str, ...] | None,
    device_tainted: set[str] | None,
    watched: bool,
    maybe_tainted: frozenset[str] | set[str] = frozenset(),
) -> DeviceCapacity:
    verdicts = {d: judge(uuid) for d, uuid in devices.items()}
    healthy = {d for d, v in verdicts.items() if v == "healthy"}
    unhealthy = sum(1 for v in verdicts.values() if v == "unhealthy")
    unknown = len(verdicts) - len(healthy) - unhealthy
    allocated = None if taken is None else len(devices.keys() & taken)
    free = healthy - taken if judge.ok and taken is not None else None
    disrupted: set[str] | None = None
    by_reason: dict[str, int] = {}
    # device taints cannot be told: the rules were not read, or an opaque rule may
    # select a free device
    taints_known = free is not None and device_tainted is not None and not (free & maybe_tainted)
    if free is not None and node_reasons is not None:
        # every reason that can be told, 0 included: an absent one is unknown
        known = DISRUPTION_REASONS if watched else ("device_taint",)
        by_reason = {r: len(free) if r in node_reasons else 0 for r in known}
        disrupted = set(free) if node_reasons else set()
        if taints_known and device_tainted is not None:
            tainted = free & device_tainted
            disrupted |= tainted
            by_reason["device_taint"] = len(tainted)
        else:
            del by_reason["device_taint"]
            # the total is unknown unless every free device is disrupted anyway
            disrupted = disrupted if disrupted == free else None
    return DeviceCapacity(
        resource=resource,
        advertised=len(devices),
        healthy=len(healthy) if judge.ok else None,
        unhealthy=unhealthy if judge.ok else None,
        allocated=allocated,
        allocatable=None if free is None or disrupted is None else len(free - disrupted),
        unknown=unknown,
        # not watched: the node's part is not known, so no total (module docstring)
        disrupted=len(disrupted) if disrupted is not None and watched else None,
        disrupted_by=tuple(sorted(by_reason.items())),
    )


def _published_gpu(device: SliceDevice) -> str | None:
    """The physical GPU a DRA driver publishes for a device NVML does not report (its
    ``uuid`` attribute, when that is a GPU's UUID): None for anything else."""
    uuid = device.attribute("uuid")
    return uuid if isinstance(uuid, str) and uuid.startswith(_GPU_UUID_PREFIX) else None
