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
import gc
import logging
import os
import platform
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Protocol

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.registry import CollectorRegistry

from exporter import __version__
from exporter.analysis.health import HealthPolicy
from exporter.analysis.idle import IdlePolicy
from exporter.analysis.orphans import OrphanPolicy
from exporter.analysis.pipeline import (
    Policy,
    analyse,
    holder_scan_needed,
    initial_state,
    with_holder_scan,
)
from exporter.config import Config
from exporter.exposition.metrics import ExpositionOptions, SnapshotCollector, build_families
from exporter.exposition.server import MetricsCache
from exporter.model import (
    Analysis,
    DcgmSnapshot,
    NodeSnapshot,
    NvmlSnapshot,
    PodMetaSnapshot,
    PodResourcesSnapshot,
    ProcessIdentity,
    SourceStatus,
    XidEvent,
)
from exporter.sources.backoff import Backoff
from exporter.sources.dcgm import DcgmSource
from exporter.sources.holders import scan_device_holders
from exporter.sources.kmsg import KmsgReader
from exporter.sources.nvml import NvmlSource
from exporter.sources.podresources.client import PodResourcesClient
from exporter.sources.procfs import ProcessReader
from exporter.sources.xid import XidListener

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
        self,
        config: Config,
        cache: MetricsCache,
        *,
        pod_meta: PodMetaSource | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.cache = cache
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = SnapshotCollector()
        self.registry.register(self.collector)
        self.self_metrics = SelfMetrics.register(self.registry)
        for source in ("nvml", "procfs", "podresources", "kube", "xid", "kmsg", "agent"):
            self.self_metrics.errors.labels(source)  # present from the start, at 0
        self.options = ExpositionOptions(per_process_metrics=config.per_process_metrics)
        self.nvml = NvmlSource()
        self.process_reader = ProcessReader(config.proc_root)
        self.pod_resources_client = PodResourcesClient(
            config.pod_resources_socket, resource_names=config.resource_names
        )
        self.pod_resources: PodResourcesSnapshot = PodResourcesSnapshot(
            ok=False, timestamp=time.time(), error="not fetched yet"
        )
        self.pod_meta = pod_meta
        self.wall_clock = wall_clock
        self.policy = Policy(
            health=HealthPolicy(
                xid_window_s=config.health_xid_window_s,
                retired_pages_limit=config.retired_pages_limit,
            ),
            orphans=OrphanPolicy(
                unattributed_threshold_bytes=config.orphan_threshold_bytes,
                unattributed_cycles=config.orphan_cycles,
                stuck_cycles=config.orphan_cycles,
                deleted_pod_grace_s=config.deleted_pod_grace_s,
            ),
            idle=IdlePolicy(
                threshold_ratio=config.idle_threshold, max_gap_s=max(60.0, 3 * config.interval_s)
            ),
        )
        self.state = initial_state(wall_clock(), self.policy, config.xid_severity)
        self._xid_lock = threading.Lock()
        self._xid_pending: list[XidEvent] = []
        self.xid_listener = XidListener(self._on_xid, clock=wall_clock)
        self.kmsg = (
            KmsgReader(
                self._on_xid, path=config.kmsg_path, proc_root=config.proc_root, clock=wall_clock
            )
            if config.kmsg
            else None
        )
        self.dcgm = (
            DcgmSource(
                config.dcgm,
                bindings_path=config.dcgm_bindings_path,
                update_interval_s=min(config.interval_s, 1.0),
            )
            if config.dcgm != "off"
            else None
        )
        self._dcgm_seen_up = False
        self._errors_seen: dict[str, int] = {}
        self._stopping = asyncio.Event()
        self._frozen = False
        self.latest: Analysis | None = None

    # -- lifecycle --------------------------------------------------------------------

    def start_background(self) -> None:
        """Start the threads that block on something external."""
        if self.pod_meta is not None:
            self.pod_meta.start()
        self.xid_listener.start()
        if self.kmsg is not None:
            self.kmsg.start()

    async def stop_background(self) -> None:
        await self.pod_resources_client.close()
        stoppers: list[Callable[[], None]] = [self.xid_listener.stop]
        if self.kmsg is not None:
            stoppers.append(self.kmsg.stop)
        if self.pod_meta is not None:
            stoppers.append(self.pod_meta.stop)
        await asyncio.gather(*(asyncio.to_thread(stop) for stop in stoppers))
        await asyncio.to_thread(self.nvml.close)
        if self.dcgm is not None:
            await asyncio.to_thread(self.dcgm.close)

    def _on_xid(self, event: XidEvent) -> None:
        """Called from the XID and kmsg threads; the next cycle picks the events up."""
        with self._xid_lock:
            self._xid_pending.append(event)

    def _take_xids(self) -> list[XidEvent]:
        with self._xid_lock:
            events, self._xid_pending = self._xid_pending, []
        return events

    async def run(self) -> None:
        self.start_background()
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
            await self.stop_background()

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
        timestamp = self.wall_clock()
        try:
            nvml, processes, dcgm = await asyncio.to_thread(self._read_host)
            snapshot = self._snapshot(nvml, processes, dcgm, timestamp)
            await asyncio.to_thread(self._analyse_and_render, snapshot, started)
        except Exception:
            self.self_metrics.errors.labels("agent").inc()
            log.exception("sample cycle failed; the previous output stays served")

    def _read_host(
        self,
    ) -> tuple[NvmlSnapshot, tuple[ProcessIdentity, ...], DcgmSnapshot | None]:
        nvml = self.nvml.sample()
        dcgm = self.dcgm.sample() if self.dcgm is not None else None
        errors = len(nvml.errors) + (0 if nvml.ok else 1)
        if errors:
            self.self_metrics.errors.labels("nvml").inc(errors)
        pids = {p.pid for g in nvml.gpus for p in g.processes}
        pids.update(p.pid for g in nvml.gpus for m in g.mig_instances for p in m.processes)
        return nvml, self.process_reader.read(pids), dcgm

    def _count_errors(self, source: str, total: int) -> None:
        """Turn a thread's running error total into increments of our counter."""
        new = total - self._errors_seen.get(source, 0)
        if new > 0:
            self.self_metrics.errors.labels(source).inc(new)
            self._errors_seen[source] = total

    def _snapshot(
        self,
        nvml: NvmlSnapshot,
        processes: tuple[ProcessIdentity, ...],
        dcgm: DcgmSnapshot | None,
        timestamp: float,
    ) -> NodeSnapshot:
        pod_meta = self.pod_meta.snapshot() if self.pod_meta is not None else None
        proc_ok = self.config.proc_root.is_dir()
        xid = self.xid_listener
        sources = [
            SourceStatus("nvml", nvml.ok, nvml.error),
            SourceStatus("procfs", proc_ok, None if proc_ok else "proc root missing"),
            SourceStatus("podresources", self.pod_resources.ok, self.pod_resources.error),
            SourceStatus("xid", xid.alive and xid.last_error is None, xid.last_error),
        ]
        self._count_errors("xid", xid.errors_total)
        if self.kmsg is not None:
            kmsg = self.kmsg
            sources.append(
                SourceStatus("kmsg", kmsg.alive and kmsg.last_error is None, kmsg.last_error)
            )
            self._count_errors("kmsg", kmsg.errors_total)
        if dcgm is not None:
            # 'auto' on a node without DCGM is normal: report the source only once it has
            # answered (or when a host engine was named explicitly).
            self._dcgm_seen_up = self._dcgm_seen_up or dcgm.ok
            if self._dcgm_seen_up or self.config.dcgm not in ("auto", "off"):
                sources.append(SourceStatus("dcgm", dcgm.ok, dcgm.error))
                if not dcgm.ok:
                    self.self_metrics.errors.labels("dcgm").inc()
        if self.pod_meta is not None and pod_meta is not None:
            sources.append(SourceStatus("kube", pod_meta.ok, pod_meta.error))
            self._count_errors("kube", self.pod_meta.errors_total)
        return NodeSnapshot(
            node_name=self.config.node_name,
            timestamp=timestamp,
            nvml=nvml,
            processes=processes,
            pod_resources=self.pod_resources,
            pod_meta=pod_meta,
            dcgm=dcgm,
            sources=tuple(sources),
        )

    def _analyse_and_render(self, snapshot: NodeSnapshot, started: float) -> None:
        analysis, self.state = analyse(snapshot, self.state, self._take_xids(), self.policy)
        request = holder_scan_needed(analysis, self.state, self.policy)
        if request is not None:  # only when unattributed memory needs a holder, bounded
            scan = scan_device_holders(
                self.config.proc_root,
                request.minors,
                exclude_pids=request.exclude_pids | {os.getpid()},
                start_pid=request.start_pid,
            )
            if scan.error:
                self.self_metrics.errors.labels("procfs").inc()
            analysis, self.state = with_holder_scan(analysis, self.state, scan, request)
        self.collector.set(build_families(analysis, self.options))
        self.self_metrics.sample_duration.observe(time.perf_counter() - started)
        self.cache.render(self.registry)
        self.latest = analysis
        if not self._frozen and (self.pod_meta is None or self.pod_meta.snapshot().ok):
            # Start-up is over: what is loaded now (kubernetes, pydantic,
            # prometheus_client: ~150k objects) lives as long as the process. Out of the
            # collector's view, it no longer costs 55-85 ms full collections.
            gc.collect()
            gc.freeze()
            self._frozen = True


def with_overrides(config: Config, **changes: object) -> Config:
    return replace(config, **changes)  # type: ignore[arg-type]
