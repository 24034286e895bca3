"""Runs a simulated node's outer edge: NVML library, proc tree, kubelet, API server.

Only the things that cannot exist here are simulated; the exporter then reads them
through its normal code paths: pynvml over the simulated library object, files under a
temporary ``--proc-root``, the real gRPC client against a real gRPC server on a unix
socket, and the real ``kubernetes`` client against a small HTTP endpoint.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from exporter.model import MIRROR_POD_ANNOTATION
from exporter.sim.cgroupfs import CgroupTree
from exporter.sim.kernel_log import SimKernelLogWriter
from exporter.sim.kube_api import FakeKubeApi, pod_dict, write_kubeconfig
from exporter.sim.kube_writes import node_dict
from exporter.sim.node import SimNode
from exporter.sim.nvml_library import SimNvmlLibrary, install
from exporter.sim.paths import SimPaths
from exporter.sim.podresources_server import start_podresources_server
from exporter.sim.proctree import (
    gpu_fds,
    host_cgroup,
    kubepods_cgroup,
    remove_process,
    write_host_pids,
    write_process,
)
from exporter.sim.scenario import API_DATE_ABSENT, Scenario, SimPod, SimProcess

log = logging.getLogger(__name__)
SYNC_PERIOD_S = 0.2
# In memory where the machine has it: /proc is in memory too, and a disk-backed proc tree
# made the simulator's file writes (a dozen per new process) a benchmark's bottleneck.
_ROOT_PARENT = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else "/tmp"


class SimEnvironment:
    def __init__(
        self,
        scenario: Scenario,
        *,
        clock: Callable[[], float] | None = None,
        kube_api: bool = True,
        nvml: bool = True,
    ) -> None:
        self.node = SimNode(scenario, clock)
        self._with_kube_api = kube_api
        # False when the exporter runs in another process and loads the NVML library
        # there itself (sim/external.py), as a real libnvidia-ml is loaded in-process.
        self._with_nvml = nvml
        # unix socket paths must stay under 108 bytes, so keep the root short
        self._root = Path(tempfile.mkdtemp(prefix="gpusim-", dir=_ROOT_PARENT))
        self.paths = SimPaths(
            proc_root=self._root / "proc",
            kmsg=self._root / "kmsg",
            pod_resources_socket=self._root / "kubelet.sock",
            kubeconfig=self._root / "kubeconfig" if kube_api else None,
            node_name=scenario.node_name,
            cgroup_root=self._root / "cgroup" if scenario.has_cgroups else None,
        )
        self.cgroups: CgroupTree | None = None  # set by start() where there is a tree
        self.kube_api: FakeKubeApi | None = None
        self.kernel_log = SimKernelLogWriter(self.node, self.paths.kmsg, self.paths.proc_root)
        self._grpc: Any = None
        self._task: asyncio.Task[None] | None = None
        self.library: SimNvmlLibrary | None = None  # set by start()
        # pid -> (start time, cgroup, what was last written): a process's cgroup is fixed
        # at its first write (a deleted pod's process keeps it), the rest is rewritten
        # when it changes; a new start time is a new process on a reused pid.
        self._written: dict[int, tuple[int, str, tuple[object, ...]]] = {}
        self._kube_pods: dict[str, dict[str, Any]] = {}
        # The scenario's pods before any timeline event: a process first written after
        # its pod was deleted (a clock started late, --simulate-start) still lives in that
        # pod's cgroup, as on a node that had been running. Only these: churn's pods come
        # and go for ever, and this must not grow with them.
        self._first_pods = {f"{p.namespace}/{p.name}": p for p in scenario.pods}
        self._kube_slices: dict[str, dict[str, Any]] = {}
        self._kube_node: tuple[str, str] | None = None  # the Node's spec and labels published

    async def start(self) -> SimPaths:
        if self._with_nvml:
            self.library = install(self.node)
        self.paths.proc_root.mkdir(parents=True)
        write_host_pids(self.paths.proc_root)  # what only a host's live /proc shows
        if self.paths.cgroup_root is not None:
            self.cgroups = CgroupTree(self.paths.cgroup_root, self.node.scenario.cgroup_version)
        self.kernel_log.start()
        self.sync()
        self._grpc = await start_podresources_server(
            self.paths.pod_resources_socket,
            lambda: (
                self.node.container_devices(),
                self.node.allocatable_devices(),
                self.node.claim_devices(),
                self.node.listed_containers(),
            ),
        )
        if self._with_kube_api and self.paths.kubeconfig is not None:
            self.kube_api = FakeKubeApi()
            self.kube_api.server_time = self.node.api_time  # its Date header
            api_date = self.node.scenario.node_clock.api_date
            self.kube_api.date_absent = api_date == API_DATE_ABSENT
            if api_date is not None and api_date != API_DATE_ABSENT:
                self.kube_api.date_override = api_date
            self.kube_api.writes.set_node(node_dict(self.node.scenario.node_name))
            url = self.kube_api.start_in_thread()
            write_kubeconfig(self.paths.kubeconfig, url)
            self._sync_kube()
        self._task = asyncio.create_task(self._keep_in_sync(), name="sim-sync")
        log.info(
            "simulated node %s: %d GPU(s), %d pod(s), proc root %s",
            self.node.scenario.node_name,
            len(self.node.gpus),
            len(self.node.pods),
            self.paths.proc_root,
        )
        return self.paths

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._grpc is not None:
            await self._grpc.stop(grace=None)
        if self.kube_api is not None:
            self.kube_api.stop_in_thread()
        shutil.rmtree(self._root, ignore_errors=True)
        if self.library is not None:
            # As a driver's reference count would: did every nvmlInit get its nvmlShutdown?
            log.info(
                "simulated NVML library at stop: %s",
                "still initialised (an nvmlInit without nvmlShutdown)"
                if self.library.initialised
                else "not initialised (every nvmlInit was matched by nvmlShutdown)",
            )

    async def _keep_in_sync(self) -> None:
        while True:
            await asyncio.sleep(SYNC_PERIOD_S)
            try:
                await asyncio.to_thread(self.sync)
            except Exception:  # the simulator must not take the exporter down
                log.exception("simulator sync failed")

    def sync(self) -> None:
        """Bring the proc tree, the kernel log and the API server in line with the node's
        timeline."""
        node = self.node
        with node.lock:
            node.advance()
            self.kernel_log.sync()
            if self.cgroups is not None:
                self.cgroups.sync(node.pods, node.now())
            pods = {**self._first_pods, **{f"{p.namespace}/{p.name}": p for p in node.pods}}
            alive = {p.pid: p for p in node.processes if p.alive}
            for pid in set(self._written) - set(alive):
                remove_process(self.paths.proc_root, pid)
                del self._written[pid]
            for pid, proc in alive.items():
                written = self._written.get(pid)
                if written and written[0] != proc.start_time:
                    written = None  # the pid's earlier process is gone
                version = node.scenario.cgroup_version
                cgroup = written[1] if written else _cgroup(proc, pods, version)
                held = proc.holds_devices
                indexes = [proc.gpu, *proc.extra_gpus] if held is None else held
                fds = gpu_fds(node.gpus[i].minor for i in indexes)
                content = (proc.comm, proc.state, tuple(fds))
                if written == (proc.start_time, cgroup, content):
                    continue
                write_process(
                    self.paths.proc_root,
                    pid,
                    comm=proc.comm,
                    state=proc.state,
                    cgroup=cgroup,
                    fds=fds,
                    start_time=proc.start_time,
                )
                self._written[pid] = (proc.start_time, cgroup, content)
        if self.kube_api is not None:
            self._sync_kube()

    def _sync_kube(self) -> None:
        assert self.kube_api is not None
        node = self.node
        with node.lock:
            wanted = {
                pod.api_uid: pod_dict(
                    pod.namespace,
                    pod.name,
                    pod.api_uid,
                    node.scenario.node_name,
                    phase=pod.phase,
                    containers=[(c.name, c.container_id) for c in pod.containers if not c.init],
                    init_containers=[(c.name, c.container_id) for c in pod.containers if c.init],
                    resource_claims=node.resource_claims(pod),
                    limits={c.name: c.limits for c in pod.containers if c.limits},
                    owner=pod.owner,
                    labels=pod.labels,
                    annotations={MIRROR_POD_ANNOTATION: pod.uid} if pod.mirror_uid else None,
                    deletion_timestamp=(
                        node.api_time(pod.deletion_at) if pod.deletion_at is not None else None
                    ),
                    deletion_grace_s=pod.deletion_grace_s,
                )
                for pod in node.pods
            }
        for uid in set(self._kube_pods) - set(wanted):
            self.kube_api.delete_pod(uid)
        for uid, pod in wanted.items():
            if self._kube_pods.get(uid) != pod:
                self.kube_api.set_pod(pod)
        self._kube_pods = wanted
        self._sync_slices()
        self._sync_node()

    def _sync_node(self) -> None:
        """Publish the Node's spec and labels as the timeline set them (its status stays
        as the writes left it: the node condition is the exporter's)."""
        api = self.kube_api
        assert api is not None
        with self.node.lock:
            spec, labels = dict(self.node.node_spec), dict(self.node.node_labels)
        published = (json.dumps(spec, sort_keys=True), json.dumps(labels, sort_keys=True))
        if published == self._kube_node:
            return
        name = self.node.scenario.node_name
        node = api.writes.node(name) or node_dict(name)
        node["spec"] = {**node.get("spec", {}), **spec}
        node["metadata"]["labels"] = labels
        api.writes.set_node(node)
        self._kube_node = published

    def _sync_slices(self) -> None:
        """Publish the node's ResourceSlices as its DRA driver would."""
        api = self.kube_api
        assert api is not None
        slices = {s["metadata"]["name"]: s for s in self.node.resource_slices()}
        for name in set(self._kube_slices) - set(slices):
            api.delete_resource_slice(name)
        for name, obj in slices.items():
            if self._kube_slices.get(name) != obj:
                api.set_resource_slice(obj)
        self._kube_slices = slices


def _cgroup(proc: SimProcess, pods: dict[str, SimPod], version: int = 2) -> str:
    pod = pods.get(proc.pod or "")
    container = next((c for c in pod.containers if c.name == proc.container), None) if pod else None
    if pod and container:
        return kubepods_cgroup(pod.uid, container.container_id, qos=pod.qos, version=version)
    return host_cgroup("gpu-workload.service")
