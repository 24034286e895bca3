"""DRA DeviceTaintRules for unhealthy GPUs (pure): which rules should exist.

KEP-5055 (DRA device taints and tolerations) lets anyone with RBAC on
``resource.k8s.io`` ``devicetaintrules`` taint a device that a DRA driver publishes,
selected by driver, pool and device name (kubernetes/api resource/v1alpha3/types.go,
``DeviceTaintSelector``, v0.35.0). The effect ``None`` (added in Kubernetes 1.35) only
shows the taint: nothing is evicted or kept off, which is the default here.
``NoSchedule`` keeps new claims off the device and needs ``--dra-device-taint-effect``.

A GPU gets a rule while its verdict is unhealthy and a ResourceSlice of this node
publishes it (matched by the driver's ``uuid`` attribute); so does each MIG device the
driver publishes on it. When NVML or the slice
watch cannot tell, there is no desired set: the rules that exist are left alone.

A rule is owned by what it selects (``stale_rules``): it is deleted when the device
UUID it was made for (its name carries it) is judged healthy, when the device it
selects is published with another UUID (the GPU was replaced, or a MIG layout
re-created: same driver/pool/device name, new UUID), or when the device is gone (its
driver publishes the pool in a current slice list, without the device). A pool not
published at all (the driver restarting) or slices not read are no evidence: the
rule stays. A rule still wanted whose selector is not the one wanted (the driver
renamed the device: renumbered after a restart) is deleted and made again (``moved``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from exporter.model import Analysis
from exporter.reporting.events import CONTROLLER

TAINT_KEY = f"{CONTROLLER}/unhealthy"
MANAGED_BY = "app.kubernetes.io/managed-by"
NODE_LABEL = f"{CONTROLLER}/node"
EFFECTS = ("None", "NoSchedule")


@dataclass(frozen=True, slots=True, order=True)
class TaintRule:
    name: str
    driver: str
    pool: str
    device: str
    uuid: str
    reason: str  # the taint's value: the first unhealthy reason


def desired_rules(analysis: Analysis, drivers: tuple[str, ...]) -> frozenset[TaintRule] | None:
    """One rule per unhealthy GPU that a DRA driver of ``drivers`` publishes here;
    None when the verdicts or the slices are not known this cycle."""
    slices = analysis.node.resource_slices
    if not analysis.node.nvml.ok or slices is None or not slices.ok:
        return None
    # no hardware verdict can be pinned on a UUID two GPUs share: no rule for it
    shared = {h.uuid for h in analysis.health if sum(o.uuid == h.uuid for o in analysis.health) > 1}
    unhealthy = {
        h.uuid: next(r.reason for r in h.reasons if r.severity == "unhealthy")
        for h in analysis.health
        if h.unhealthy and h.uuid not in shared
    }
    # a MIG device the driver publishes (its uuid is the MIG UUID) is as unhealthy as
    # the GPU it is carved from
    parent = {m.uuid: g.uuid for g in analysis.node.nvml.gpus for m in g.mig_instances}
    rules = set()
    for device in slices.devices:
        if device.driver not in drivers:
            continue
        uuid = device.attribute("uuid")
        if not isinstance(uuid, str):
            continue
        gpu = parent.get(uuid, uuid)
        if gpu in unhealthy:
            name = rule_name(analysis.node.node_name, uuid)
            rules.add(
                TaintRule(name, device.driver, device.pool, device.name, uuid, unhealthy[gpu])
            )
    return frozenset(rules)


def healthy_devices(analysis: Analysis) -> frozenset[str]:
    """Lower-case UUIDs of the GPUs NVML judged healthy this cycle, and of their MIG
    devices: the only devices whose rules may be deleted (never for want of a verdict).
    GPUs that share a UUID are judged neither way."""
    if not analysis.node.nvml.ok:
        return frozenset()
    counts: dict[str, int] = {}
    for h in analysis.health:
        counts[h.uuid] = counts.get(h.uuid, 0) + 1
    healthy = {h.uuid for h in analysis.health if h.healthy and counts[h.uuid] == 1}
    migs = {m.uuid for g in analysis.node.nvml.gpus if g.uuid in healthy for m in g.mig_instances}
    return frozenset(u.lower() for u in healthy | migs)


Selector = tuple[str, str, str]  # (driver, pool, device): what a rule selects
Stale = Literal["healthy", "replaced", "gone", "moved"]


@dataclass(frozen=True, slots=True)
class Published:
    """The devices this node's DRA drivers publish, from a current slice list:
    selector -> lower-case ``uuid`` attribute ("" where the driver gives none)."""

    devices: Mapping[Selector, str]
    pools: frozenset[tuple[str, str]]  # (driver, pool) pairs with a device published


def published_devices(analysis: Analysis, drivers: tuple[str, ...]) -> Published | None:
    """None when the slices are not known this cycle (not watched, or not current)."""
    slices = analysis.node.resource_slices
    if slices is None or not slices.ok:
        return None
    devices: dict[Selector, str] = {}
    for device in slices.devices:
        if device.driver in drivers:
            uuid = device.attribute("uuid")
            key = (device.driver, device.pool, device.name)
            devices[key] = uuid.lower() if isinstance(uuid, str) else ""
    return Published(devices, frozenset((driver, pool) for driver, pool, _ in devices))


@dataclass(frozen=True, slots=True)
class ExistingRule:
    """A rule of ours as the API holds it: what it selects, and the lower-case UUID
    of the device it was made for (from its name, ``rule_device``)."""

    name: str
    selector: Selector | None  # None: its spec does not say (not as we write it)
    uuid: str


def made_rule(rule: TaintRule) -> ExistingRule:
    return ExistingRule(rule.name, (rule.driver, rule.pool, rule.device), rule.uuid.lower())


def existing_rule(name: str, obj: Mapping[str, Any]) -> ExistingRule:
    """``obj`` as listed; a selector is read only when it names all three."""
    spec = obj.get("spec")
    chosen = spec.get("deviceSelector") if isinstance(spec, dict) else None
    parts = (
        [chosen.get(k) for k in ("driver", "pool", "device")] if isinstance(chosen, dict) else []
    )
    ok = len(parts) == 3 and all(isinstance(p, str) and p for p in parts)
    selector = (str(parts[0]), str(parts[1]), str(parts[2])) if ok else None
    return ExistingRule(name, selector, rule_device(name))


def stale_rules(
    existing: Iterable[ExistingRule],
    wanted: Collection[str] | Mapping[str, Selector],
    healthy: frozenset[str],
    published: Published | None,
) -> dict[str, Stale]:
    """The rules not wanted this cycle whose marking no longer holds, and why: the
    device they were made for is ``healthy``; the device they select is published with
    another UUID (``replaced``); or its pool is published without it (``gone``). Any
    other rule stays: the exporter has no evidence about what it selects.

    With ``wanted`` a mapping (name -> selector), a wanted rule that selects anything
    else is stale too (``moved``): its name carries the device UUID, not the DRA
    device name, so a driver that renumbers its devices would leave it marking another
    GPU; it is deleted and made again with the selector wanted."""
    stale: dict[str, Stale] = {}
    for rule in existing:
        if rule.name in wanted:
            if isinstance(wanted, Mapping) and rule.selector != wanted[rule.name]:
                stale[rule.name] = "moved"
            continue
        if rule.uuid and rule.uuid in healthy:
            stale[rule.name] = "healthy"
            continue
        if published is None or rule.selector is None:
            continue
        now = published.devices.get(rule.selector)
        if now is None:
            if rule.selector[:2] in published.pools:
                stale[rule.name] = "gone"
        elif now and now != rule.uuid:
            stale[rule.name] = "replaced"
    return stale


def rule_name(node: str, uuid: str) -> str:
    """``gpu-occupancy-exporter-<node hash>-<device uuid>``: the node's hash keeps a rule
    of another node (or of another tool with our prefix) from taking the name."""
    token = hashlib.sha256(node.encode()).hexdigest()[:8]
    return f"{CONTROLLER}-{token}-{uuid.lower()}"[:253]


def rule_device(name: str) -> str:
    """The lower-case device UUID a rule of ours is named for ("" if not one of ours)."""
    prefix = f"{CONTROLLER}-"
    if not name.startswith(prefix):
        return ""
    _token, _, device = name[len(prefix) :].partition("-")
    return device


def rule_body(rule: TaintRule, version: str, node: str, effect: str) -> dict[str, Any]:
    return {
        "apiVersion": f"resource.k8s.io/{version}",
        "kind": "DeviceTaintRule",
        "metadata": {
            "name": rule.name,
            "labels": {MANAGED_BY: CONTROLLER, NODE_LABEL: node_label(node)},
        },
        "spec": {
            "deviceSelector": {"driver": rule.driver, "pool": rule.pool, "device": rule.device},
            "taint": {"key": TAINT_KEY, "value": rule.reason[:63], "effect": effect},
        },
    }


def label_selector(node: str) -> str:
    return f"{MANAGED_BY}={CONTROLLER},{NODE_LABEL}={node_label(node)}"


def node_label(node: str) -> str:
    """The node's name as a label value (at most 63 characters, alphanumeric at both
    ends). A longer name (a node's may have 253) keeps a prefix and a hash of the whole:
    cut alone, two nodes could share the label, and each would list and delete the
    other's rules."""
    if len(node) <= 63:
        return node
    digest = hashlib.sha256(node.encode()).hexdigest()[:10]
    return f"{node[:52].rstrip('-._')}-{digest}"
