"""The asyncio agent: owns the schedule, never the data's meaning.

- a sample loop at ``--interval``: NVML + /proc in a worker thread, then analysis and
  rendering (also off the loop), then the cached bytes are swapped in;
- a PodResources refresh loop at ``--pod-resources-interval`` with backoff, its result
  cached between refreshes;
- the pod watch in its own thread (``exporter.sources.kube``);
- the HTTP server, which only ever reads the cache.

A failing source degrades the output (``gpu_exporter_source_up 0``, an error counter,
missing labels); an exception inside a cycle is logged and counted, never fatal.
"""

from __future__ import annotations

import asyncio
import logging
import os
import platform
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.registry import CollectorRegistry

from exporter import __version__
from exporter.analysis.attribution import attribute
from exporter.config import Config
from exporter.exposition.metrics import ExpositionOptions, SnapshotCollector, build_families
from exporter.exposition.server import MetricsCache
from exporter.model import (
    Analysis,
    NodeSnapshot,
    NvmlSnapshot,
    PodMetaSnapshot,
    PodResourcesSnapshot,
    ProcessIdentity,
    SourceStatus,
)
from exporter.sources.backoff import Backoff
from exporter.sources.nvml import NvmlSource
from exporter.sources.podresources.client import PodResourcesClient
from exporter.sources.procfs import read_processes

log = logging.getLogger(__name__)
disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created: needless series
SAMPLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class PodMetaSource(Protocol):
    def start(self) -> None: ...
    def stop(self, timeout: float = 5.0) -> None: ...
    def snapshot(self) -> PodMetaSnapshot: ...
    @property
    def errors_total(self) -> int: ...


@dataclass
class SelfMetrics:
    """The exporter's own instruments, rendered with every cycle."""

    sample_duration: Histogram
    errors: Counter

    @classmethod
    def register(cls, registry: CollectorRegistry) -> SelfMetrics:
        build = Gauge(
            "gpu_exporter_build_info",
            "Exporter build; always 1.",
            ["version", "python_version"],
            registry=registry,
        )
        build.labels(__version__, platform.python_version()).set(1)
        return cls(
            sample_duration=Histogram(
                "gpu_exporter_sample_duration_seconds",
                "Wall time of one sample cycle: sources and analysis, up to rendering.",
                buckets=SAMPLE_BUCKETS,
                registry=registry,
            ),
            errors=Counter(
                "gpu_exporter_errors",
                "Errors by source: failed NVML queries, failed refreshes, failed cycles.",
                ["source"],
                registry=registry,
            ),
        )


def kube_api_configured(config: Config) -> bool:
    """``--kube-api auto`` uses the API only where credentials exist."""
    if config.kube_api == "off":
        return False
    if config.kubeconfig or os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    default = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    return Path(default.split(os.pathsep)[0]).is_file()


class Agent:
    def __init__(
        self, config: Config, cache: MetricsCache, *, pod_meta: PodMetaSource | None = None
    ) -> None:
        self.config = config
        self.cache = cache
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        self.self_metrics = SelfMetrics.register(self.registry)
        for source in ("nvml", "procfs", "podresources", "kube", "agent"):
            self.self_metrics.errors.labels(source)  # present from the start, at 0
        self.options = ExpositionOptions(per_process_metrics=config.per_process_metrics)
        self.nvml = NvmlSource()
        self.pod_resources_client = PodResourcesClient(
            config.pod_resources_socket, resource_names=config.resource_names
        )
        self.pod_resources: PodResourcesSnapshot = PodResourcesSnapshot(
            ok=False, timestamp=time.time(), error="not fetched yet"
        )
        self.pod_meta = pod_meta
        self._kube_errors_seen = 0
        self._stopping = asyncio.Event()
        self.latest: Analysis | None = None

    # -- lifecycle --------------------------------------------------------------------

    async def run(self) -> None:
        if self.pod_meta is not None:
            self.pod_meta.start()
        tasks = [
            asyncio.create_task(self._sample_loop(), name="sample-loop"),
            asyncio.create_task(self._pod_resources_loop(), name="podresources-loop"),
        ]
        try:
            await self._stopping.wait()
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.pod_resources_client.close()
            if self.pod_meta is not None:
                await asyncio.to_thread(self.pod_meta.stop)
            await asyncio.to_thread(self.nvml.close)

    def stop(self) -> None:
        self._stopping.set()

    async def _sample_loop(self) -> None:
        interval = self.config.interval_s
        next_at = time.monotonic()
        while True:
            await self.cycle()
            next_at += interval
            now = time.monotonic()
            if next_at < now:  # overran: skip missed slots rather than bunch up
                skipped = int((now - next_at) // interval) + 1
                log.warning(
                    "sample cycle overran the %.2f s interval; skipping %d slot(s)",
                    interval,
                    skipped,
                )
                next_at += skipped * interval
            await asyncio.sleep(next_at - now)

    async def _pod_resources_loop(self) -> None:
        backoff = Backoff(initial_s=1.0, max_s=60.0)
        while True:
            await self.refresh_pod_resources()
            if self.pod_resources.ok:
                backoff.reset()
                delay = self.config.pod_resources_interval_s
            else:
                delay = min(backoff.next_delay(), self.config.pod_resources_interval_s * 6)
            await asyncio.sleep(delay)

    async def refresh_pod_resources(self) -> None:
        previous_ok = self.pod_resources.ok
        self.pod_resources = await self.pod_resources_client.fetch()
        if not self.pod_resources.ok:
            self.self_metrics.errors.labels("podresources").inc()
            level = logging.WARNING if previous_ok else logging.DEBUG
            log.log(level, "kubelet PodResources unavailable: %s", self.pod_resources.error)
        elif not previous_ok:
            log.info(
                "kubelet PodResources connected (%d container allocations)",
                len(self.pod_resources.containers),
            )

    # -- one cycle --------------------------------------------------------------------

    async def cycle(self) -> None:
        started = time.perf_counter()
        try:
            nvml, processes = await asyncio.to_thread(self._read_host)
            snapshot = self._snapshot(nvml, processes)
            await asyncio.to_thread(self._analyse_and_render, snapshot, started)
        except Exception:
            self.self_metrics.errors.labels("agent").inc()
            log.exception("sample cycle failed; the previous output stays served")

    def _read_host(self) -> tuple[NvmlSnapshot, tuple[ProcessIdentity, ...]]:
        nvml = self.nvml.sample()
        errors = len(nvml.errors) + (0 if nvml.ok else 1)
        if errors:
            self.self_metrics.errors.labels("nvml").inc(errors)
        pids = {p.pid for g in nvml.gpus for p in g.processes}
        pids.update(p.pid for g in nvml.gpus for m in g.mig_instances for p in m.processes)
        return nvml, read_processes(self.config.proc_root, pids)

    def _snapshot(self, nvml: NvmlSnapshot, processes: tuple[ProcessIdentity, ...]) -> NodeSnapshot:
        pod_meta = self.pod_meta.snapshot() if self.pod_meta is not None else None
        sources = [
            SourceStatus("nvml", nvml.ok, nvml.error),
            SourceStatus(
                "procfs",
                self.config.proc_root.is_dir(),
                None if self.config.proc_root.is_dir() else "proc root missing",
            ),
            SourceStatus("podresources", self.pod_resources.ok, self.pod_resources.error),
        ]
        if self.pod_meta is not None and pod_meta is not None:
            sources.append(SourceStatus("kube", pod_meta.ok, pod_meta.error))
            new_errors = self.pod_meta.errors_total - self._kube_errors_seen
            if new_errors > 0:
                self.self_metrics.errors.labels("kube").inc(new_errors)
                self._kube_errors_seen += new_errors
        return NodeSnapshot(
            node_name=self.config.node_name,
            nvml=nvml,
            processes=processes,
            pod_resources=self.pod_resources,
            pod_meta=pod_meta,
            sources=tuple(sources),
        )

    def _analyse_and_render(self, snapshot: NodeSnapshot, started: float) -> None:
        analysis = Analysis(node=snapshot, attribution=attribute(snapshot))
        self.collector.set(build_families(analysis, self.options))
        self.self_metrics.sample_duration.observe(time.perf_counter() - started)
        self.cache.render(self.registry)
        self.latest = analysis


def with_overrides(config: Config, **changes: object) -> Config:
    return replace(config, **changes)  # type: ignore[arg-type]
