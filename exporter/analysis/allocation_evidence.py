"""When a GPU process was first seen, against the kubelet's PodResources answers.

A container's use of a GPU it was not allocated is a leak only on an answer the kubelet
gave after the process was first seen (docs/attribution.md, "Isolation leaks"): an
answer begun before it may predate the pod (a new pod, a pod recreated under the same
name). The PodResources source numbers its refreshes (``sequence``) and says how many
had begun when it handed the answer to the cycle (``begun``); a process first seen with
N refreshes begun is judged only by an answer numbered above N. Counting refreshes, not
reading clocks, keeps this true across clock steps.

Pure: the memory goes in and comes out; it holds only the processes NVML lists now, so
it is as small as the set of GPU processes.
"""

from __future__ import annotations

from collections.abc import Mapping

from exporter.model import NodeSnapshot

# (pid, pod UID, container id): a pid reused by another container is a new sighting
ProcessKey = tuple[int, str | None, str | None]
# (pid, pod UID, container id, GPU UUID, MIG UUID or None for the whole GPU): a device a
# pod's process was seen allocated (attribution.py keeps them: Attribution.held)
HeldKey = tuple[int, str, str, str, str | None]


def settled_pids(
    snapshot: NodeSnapshot, first_seen: Mapping[ProcessKey, int]
) -> tuple[frozenset[int] | None, dict[ProcessKey, int]]:
    """The pids this cycle's answer postdates, and the memory for the next cycle.

    None when no order can be told (no answer, or one not numbered by a source): the
    attribution then judges the snapshot alone."""
    pod_resources = snapshot.pod_resources
    identities = {identity.pid: identity for identity in snapshot.processes}
    keys: set[ProcessKey] = set()
    for gpu in snapshot.nvml.gpus:
        listed = [*gpu.processes, *(p for mig in gpu.mig_instances for p in mig.processes)]
        for process in listed:
            identity = identities.get(process.pid)
            if identity is None:
                keys.add((process.pid, None, None))
            else:
                keys.add((process.pid, identity.pod_uid, identity.container_id))
    if pod_resources is None or not pod_resources.ok:
        # no answer to count against: a new process is recorded on the first cycle that
        # has one (with that cycle's count begun, so that answer does not judge it)
        return None, {key: first_seen[key] for key in keys if key in first_seen}
    memory = {key: first_seen.get(key, pod_resources.begun) for key in keys}
    if pod_resources.sequence == 0:
        return None, memory
    settled = frozenset(key[0] for key, begun in memory.items() if pod_resources.sequence > begun)
    # a pid two keys share (read as another container this cycle) is settled only if both are
    unsettled = {key[0] for key, begun in memory.items() if pod_resources.sequence <= begun}
    return settled - unsettled, memory
