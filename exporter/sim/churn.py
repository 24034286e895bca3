"""A scenario's timeline plus churn, each simulated second's events made on demand.

A node that runs for months under short jobs sees pids, containers and pods come and go
all the time; a scenario's ``churn:`` block makes the simulated node do the same without
a timeline list that grows with the run (100,000 seconds of churn as a list would be
hundreds of MiB, in every process that holds the node). The simulated node only asks for
``len()`` and ``timeline[i]`` in order, so the events of one second are made when that
second is reached, from the second alone: two processes that load the same scenario (the
node process and the exporter's NVML library, see sim/external.py) see the same events.

Every second a worker process starts in one of the scenario's pods (on a whole or
time-sliced GPU) and exits ``worker_lifetime_s`` later, each pid used once. Every
``job_period_s`` a pod ``churn/job-N`` is created with ``job_device``, runs one process,
and is deleted ``job_lifetime_s`` later, so the pod watch, the PodResources answer and
the pod label sets churn too. With ``gpu_flap_period_s``, GPU ``gpu_flap`` falls off the
bus once a period (the driver raises XID 79 first, so NVML's event set and the kernel log
both see it) and comes back (same UUID) ``gpu_flap_down_s`` later.
"""

from __future__ import annotations

import bisect
import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

from exporter.sim.events import SimEvent

WORKER_PID_BASE = 3_000_000  # worker pid = base + second (pid_max is 4,194,304)
JOB_PID_BASE = 2_000_000  # job process pid = base + job number


@dataclass(frozen=True)
class Churn:
    seconds: int  # how long churn goes on
    worker_lifetime_s: int = 20
    job_period_s: int = 60
    job_lifetime_s: int = 45
    job_resource: str = "nvidia.com/gpu.shared"
    job_device: str = "gpu2::3"
    job_gpu: int = 2
    gpu_flap_period_s: int = 0  # 0: no GPU comes and goes
    gpu_flap: int = 0
    gpu_flap_down_s: int = 10


class ChurnTimeline(Sequence[SimEvent]):
    def __init__(
        self, base: Sequence[SimEvent], churn: Churn, hosts: Sequence[tuple[str, str, int]]
    ) -> None:
        if not hosts:
            raise ValueError("churn: the scenario has no pod process on a whole GPU to copy")
        self._base: dict[int, list[SimEvent]] = {}
        for event in base:
            self._base.setdefault(math.floor(event.at), []).append(event)
        self._churn = churn
        self._hosts = list(hosts)
        last = max([churn.seconds + churn.job_period_s + 1, *(s + 1 for s in self._base)])
        # The scenario's own events before time 0 (XIDs raised before the exporter
        # started: the kernel log's backlog) are kept; churn itself starts at second 1.
        self._start = min([0, *self._base])
        self._first = array("l")  # index of each second's first event, from _start on
        total = 0
        for second in range(self._start, last + 1):
            self._first.append(total)
            total += len(self._events_at(second))
        self._len = total
        self._cached: tuple[int | None, list[SimEvent]] = (None, [])

    def _events_at(self, second: int) -> list[SimEvent]:
        churn = self._churn
        events = list(self._base.get(second, ()))
        if 1 <= second <= churn.seconds:
            pod, container, gpu = self._hosts[second % len(self._hosts)]
            pid = WORKER_PID_BASE + second
            start = {"pid": pid, "gpu": gpu, "memory": "256MiB", "sm": 1, "comm": "churn_worker"}
            events.append(SimEvent(second, "start", {**start, "pod": pod, "container": container}))
        if 1 <= second - churn.worker_lifetime_s <= churn.seconds:
            pid = WORKER_PID_BASE + second - churn.worker_lifetime_s
            events.append(SimEvent(second, "exit", {"value": pid}))
        events.extend(self._job_events(second))
        period = churn.gpu_flap_period_s
        if period and 0 < second <= churn.seconds:
            if second % period == period // 2:  # the driver logs XID 79, then NVML says lost
                events.append(SimEvent(second, "xid", {"gpu": churn.gpu_flap, "code": 79}))
                events.append(SimEvent(second, "lose", {"value": churn.gpu_flap}))
            elif second % period == (period // 2 + churn.gpu_flap_down_s) % period:
                events.append(SimEvent(second, "restore", {"value": churn.gpu_flap}))
        return sorted(events, key=lambda e: e.at)

    def _job_events(self, second: int) -> list[SimEvent]:
        churn = self._churn
        job, at = divmod(second - churn.job_period_s // 2, churn.job_period_s)  # `at` s into job N
        if job < 0 or second - at >= churn.seconds:
            return []
        pod, pid = f"churn/job-{job}", JOB_PID_BASE + job
        args: dict[str, Any]
        if at == 0:
            devices = {churn.job_resource: [churn.job_device]}
            args = {"pod": pod, "containers": [{"name": "main", "devices": devices}]}
            return [SimEvent(second, "add_pod", args)]
        if at == 1:
            args = {"pid": pid, "gpu": churn.job_gpu, "memory": "2GiB", "sm": 10}
            return [SimEvent(second, "start", {**args, "pod": pod, "container": "main"})]
        if at == churn.job_lifetime_s - 5:
            return [SimEvent(second, "exit", {"value": pid})]
        if at == churn.job_lifetime_s:
            return [SimEvent(second, "delete_pod", {"value": pod})]
        return []

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> SimEvent: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[SimEvent]: ...
    def __getitem__(self, index: int | slice) -> SimEvent | Sequence[SimEvent]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._len))]
        if not 0 <= index < self._len:
            raise IndexError(index)
        slot = bisect.bisect_right(self._first, index) - 1
        second = self._start + slot
        if self._cached[0] != second:
            self._cached = (second, self._events_at(second))
        return self._cached[1][index - self._first[slot]]
