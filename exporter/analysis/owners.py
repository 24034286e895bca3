"""Who owns a GPU pod: its controller, resolved to the workload a team names.

The pod watch reads only pods, so an owner is resolved from what a pod says about itself
(its controller reference and its ``pod-template-hash`` label), by the conventions the
Kubernetes controllers follow when they name what they create:

- ReplicaSet -> Deployment: the Deployment controller names the ReplicaSet
  ``<deployment>-<hash>`` and labels its pods ``pod-template-hash=<hash>``
  (kubernetes pkg/controller/deployment/sync.go, ``getNewReplicaSet``:
  ``Name: d.Name + "-" + podTemplateSpecHash``). A ReplicaSet whose name does not end in
  the pod's hash (one made by hand, or adopted) stays a ReplicaSet.
- Job -> CronJob: the CronJob controller names a Job ``<cronjob>-<scheduled time>``,
  minutes since the epoch (pkg/controller/cronjob/cronjob_controllerv2.go ``getJobName``
  with utils.go ``getTimeHashInMinutes``: 8 digits from 1989 to 2160); the controller
  before Kubernetes 1.21 wrote seconds (10 digits). A Job name that does not end in
  ``-`` and a number that reads as a scheduled time, in minutes or in seconds, between
  2015-01-01 (before CronJobs existed) and a day after the snapshot, stays a Job: a
  date a person put in a name (``backup-20240501``) is no schedule. The Job's own owner
  is not read (no Job watch): this is a convention, and a Job made by hand with such a
  name resolves too.
- Any other controller (StatefulSet, DaemonSet, an operator's kind) is given as is.
- A pod with no controller is its own owner: kind "Pod", name the pod's.
- A controller reference that could not be read is unknown: no owner at all.

Only pods that hold an allocation or whose processes use a GPU get an owner (the rest
of a node's pods are no one's GPU bill), and only while the pod watch is up: a pod the
watch cannot vouch for now has an unknown owner, not a guessed one.
"""

from __future__ import annotations

import re
from collections import defaultdict

from exporter.model import Attribution, PodMeta, PodMetaSnapshot, PodOwner

BARE_POD = "Pod"
_CRONJOB_SUFFIX = re.compile(r"[1-9][0-9]{7,9}")  # written with %d: no leading zero
# The earliest scheduled time a CronJob's Job can name: 2015-01-01T00:00:00Z, before
# CronJobs existed (ScheduledJob, their first name, came in Kubernetes 1.4, 2016).
EARLIEST_SCHEDULE_S = 1_420_070_400
# How far past the snapshot a scheduled time may be: the controller names a Job for the
# time it was due, never later than now; a day covers clocks that disagree.
SCHEDULE_SLACK_S = 86_400.0


def scheduled_time(number: str, now: float) -> bool:
    """Whether ``number`` reads as a CronJob's scheduled time at ``now``: minutes since
    the epoch (Kubernetes 1.21 on) or seconds (before), within the plausible range."""
    if not _CRONJOB_SUFFIX.fullmatch(number):
        return False
    value = int(number)
    latest = now + SCHEDULE_SLACK_S
    return any(EARLIEST_SCHEDULE_S <= value * unit <= latest for unit in (60, 1))


def resolve_owner(pod: PodMeta, *, now: float) -> tuple[str, str] | None:
    """(kind, name) of the workload ``pod`` belongs to at ``now`` (the snapshot's time,
    seconds since the epoch); None when unknown."""
    if pod.owner_kind is None:
        return (BARE_POD, pod.name) if pod.name else None
    kind, name = pod.owner_kind, pod.owner_name or ""
    if not kind or not name:
        return None
    head, _, tail = name.rpartition("-")
    if kind == "ReplicaSet" and head and pod.pod_template_hash == tail:
        return "Deployment", head
    if kind == "Job" and head and scheduled_time(tail, now):
        return "CronJob", head
    return kind, name


def pod_owners(
    pod_meta: PodMetaSnapshot | None, attribution: Attribution, *, now: float
) -> tuple[PodOwner, ...]:
    """The owners of the pods that hold or use a GPU, by namespace and pod, at ``now``.

    Two pods of one name (a pod deleted and made again) that resolve to different owners
    leave the owner unknown; one being deleted gives way to one that is not."""
    if pod_meta is None or not pod_meta.ok:
        return ()
    wanted = {a.container for a in attribution.allocations}
    wanted.update(c.container for c in attribution.containers)
    wanted.update(u.container for u in attribution.unallocated_use)
    pods = {(c.namespace, c.pod) for c in wanted}
    by_name: dict[tuple[str, str], list[PodMeta]] = defaultdict(list)
    for pod in pod_meta.pods:
        if (pod.namespace, pod.name) in pods:
            by_name[(pod.namespace, pod.name)].append(pod)
    out = []
    for (namespace, name), same in sorted(by_name.items()):
        live = [p for p in same if p.deletion_timestamp is None] or same
        owners = {resolve_owner(p, now=now) for p in live}
        owner = owners.pop() if len(owners) == 1 else None
        if owner is not None:
            out.append(PodOwner(namespace, name, *owner))
    return tuple(out)
