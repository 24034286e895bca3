"""A fake cgroup tree for the simulator: the files the cgroup source reads.

For every container with a ``cgroup:`` key in the scenario, the container's cgroup
directory is written at the path its processes' ``/proc/<pid>/cgroup`` names
(:func:`exporter.sim.proctree.kubepods_path`), with counters that grow with simulated
time at the scenario's rates, in the kernel's formats:

- cgroup v2 (``cgroup.controllers`` at the root): ``cpu.stat`` (``usage_usec`` ...
  ``nr_periods``, ``nr_throttled``, ``throttled_usec``, ``nr_bursts``, ``burst_usec``) and,
  where the scenario's kernel has PSI, ``cpu.pressure``, ``io.pressure``,
  ``memory.pressure``: ``some``/``full`` lines of ``avg10= avg60= avg300= total=`` (µs);
- cgroup v1: ``cpu,cpuacct/<path>/cpu.stat`` (``nr_periods``, ``nr_throttled``,
  ``throttled_time`` in ns) and nothing else: v1 has no pressure files.

Model (docs/simulator.md): the container's tasks are runnable in every CFS period
(``periods_per_s``, 10 for the default 100 ms period), the ``throttled`` share of them ran
out of quota, each for half its period; each PSI resource stalled ``some`` for its share
of every second and ``full`` for ``full`` x that. The CFS counters advance once per whole
simulated second (a second's periods accounted together), so the throttled share over
any window of a second or more is the scenario's share, not one period more or less by
where the window's ends fell. The counters start when the tree first shows the
container. Files are swapped atomically, as a reader of the real tree never sees half a
file.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Final

from exporter.sim.proctree import kubepods_path, write_atomic
from exporter.sim.scenario import SimCgroup, SimPod

V1_CPU_DIR: Final = "cpu,cpuacct"
_V2_CONTROLLERS: Final = "cpuset cpu io memory hugetlb pids rdma misc\n"
_THROTTLED_PART: Final = 0.5  # of a period, for each throttled one


def cpu_stat(cgroup: SimCgroup, seconds: float, version: int) -> str:
    """``cpu.stat`` after ``seconds`` of the container's life."""
    periods = int(cgroup.periods_per_s * int(seconds))
    throttled = int(cgroup.throttled * periods)
    period_us = 1e6 / cgroup.periods_per_s
    throttled_us = int(throttled * period_us * _THROTTLED_PART)
    if version == 1:
        nanoseconds = throttled_us * 1000
        return f"nr_periods {periods}\nnr_throttled {throttled}\nthrottled_time {nanoseconds}\n"
    usage = int(seconds * 1e6 * 0.8)
    return (
        f"usage_usec {usage}\nuser_usec {usage * 9 // 10}\nsystem_usec {usage // 10}\n"
        f"nr_periods {periods}\nnr_throttled {throttled}\nthrottled_usec {throttled_us}\n"
        "nr_bursts 0\nburst_usec 0\n"
    )


def pressure(share: float, full: float, seconds: float) -> str:
    """A PSI file whose ``some`` stall is ``share`` of the time, ``full`` of that full."""
    lines = []
    for kind, part in (("some", share), ("full", share * full)):
        avg = f"{part * 100:.2f}"
        total = int(part * seconds * 1e6)
        lines.append(f"{kind} avg10={avg} avg60={avg} avg300={avg} total={total}\n")
    return "".join(lines)


class CgroupTree:
    """Keeps ``root`` in line with the pods' ``cgroup:`` keys (``sync`` each step)."""

    def __init__(self, root: Path, version: int) -> None:
        self.root = root
        self.version = version
        self._born: dict[Path, float] = {}  # container directory -> simulated time first shown
        root.mkdir(parents=True, exist_ok=True)
        if version == 2:
            write_atomic(root / "cgroup.controllers", _V2_CONTROLLERS)
            self.base = root
        else:
            self.base = root / V1_CPU_DIR
            self.base.mkdir(exist_ok=True)

    def sync(self, pods: list[SimPod], now: float) -> None:
        """Write every simulated container's files as of ``now``; remove the directories
        of containers that are gone (a deleted pod's cgroup is removed by the kubelet)."""
        seen: set[Path] = set()
        for pod in pods:
            for container in pod.containers:
                if container.cgroup is None:
                    continue
                path = kubepods_path(pod.uid, container.container_id, qos=pod.qos)
                directory = self.base / path.lstrip("/")
                seen.add(directory)
                born = self._born.setdefault(directory, now)
                self._write_container(directory, container.cgroup, max(0.0, now - born))
        for gone in set(self._born) - seen:
            shutil.rmtree(gone, ignore_errors=True)
            del self._born[gone]

    def _write_container(self, directory: Path, cgroup: SimCgroup, seconds: float) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        write_atomic(directory / "cpu.stat", cpu_stat(cgroup, seconds, self.version))
        if self.version != 2 or not cgroup.psi:
            return
        write_atomic(
            directory / "cpu.pressure", pressure(cgroup.cpu_pressure, cgroup.full, seconds)
        )
        write_atomic(directory / "io.pressure", pressure(cgroup.io_pressure, cgroup.full, seconds))
        memory = pressure(cgroup.memory_pressure, cgroup.full, seconds)
        write_atomic(directory / "memory.pressure", memory)
