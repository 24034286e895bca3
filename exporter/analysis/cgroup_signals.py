"""GPU containers' cgroup counters, named (pure): ``CgroupStats`` -> ``ContainerCgroup``.

The cgroup source names a container as the kernel does, by pod UID and container id;
every per-container series is labelled namespace/pod/container. The pod watch maps one to
the other; without it (no API credentials) a GPU process's attribution does, for the
containers a process of which NVML listed (joined by pid: procfs says which cgroup the
pid is in, attribution says whose container that is). A container neither names stays
out: its series are absent, never guessed.
"""

from __future__ import annotations

from collections import Counter

from exporter.model import Attribution, ContainerCgroup, ContainerRef, NodeSnapshot

Key = tuple[str, str]  # (pod UID, bare container id)


def cgroup_signals(snapshot: NodeSnapshot, attribution: Attribution) -> tuple[ContainerCgroup, ...]:
    """Every container the cgroup source read this cycle, with its name, in name order;
    none when the source did not read (off) or could not (its root unreadable)."""
    cgroups = snapshot.cgroups
    if cgroups is None or not cgroups.ok:
        return ()
    names = container_names(snapshot, attribution)
    rows = [
        ContainerCgroup(names[(s.pod_uid, s.container_id)], s)
        for s in cgroups.containers
        if (s.pod_uid, s.container_id) in names
    ]
    return tuple(sorted(rows, key=lambda row: row.container))


def container_names(snapshot: NodeSnapshot, attribution: Attribution) -> dict[Key, ContainerRef]:
    """(pod UID, container id) -> container, from the pod watch, else from the GPU
    processes' attribution; one id per container. A restarted container whose old
    process lingers on the GPU (exiting, in D state) has two ids: the one the pod watch
    lists (containerStatuses) is the container, the other is left out. Two ids that
    only attribution names for one container are both left out: which is the live one
    is unknown, and a guess would give two series one label set."""
    names: dict[Key, ContainerRef] = {}
    meta = snapshot.pod_meta
    if meta is not None:
        for pod in meta.pods:
            for container_id, name in pod.containers:
                names[(pod.uid, container_id)] = ContainerRef(pod.namespace, pod.name, name)
    watched = set(names.values())
    attributed: dict[Key, ContainerRef] = {}
    by_pid = {p.pid: p for p in attribution.processes if p.owner == "pod"}
    for identity in snapshot.processes:
        process = by_pid.get(identity.pid)
        if process is None or identity.pod_uid is None or identity.container_id is None:
            continue
        key = (identity.pod_uid, identity.container_id)
        if key not in names and process.namespace and process.pod and process.container:
            ref = ContainerRef(process.namespace, process.pod, process.container)
            attributed.setdefault(key, ref)
    ids = Counter(attributed.values())
    names.update(
        (key, ref) for key, ref in attributed.items() if ref not in watched and ids[ref] == 1
    )
    return names
