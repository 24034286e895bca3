"""The asyncio agent: owns the schedule, never the data's meaning.

- a sample loop at ``--interval``: every source is read in a worker thread (sampled
  sources do their I/O, background ones hand over their latest snapshot), then
  analysis and rendering run (also off the loop) and the cached bytes are swapped in;
- background sources run their own threads or asyncio tasks (PodResources refreshes,
  the pod and ResourceSlice watches, the XID and kernel-log readers);
- the HTTP server only ever reads the cache.

A failing source degrades the output (``gpu_exporter_source_up 0``, an error counter,
missing labels); an exception inside a cycle is logged and counted, never fatal.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import platform
import re
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from prometheus_client import Counter, Gauge, Histogram, disable_created_metrics
from prometheus_client.registry import CollectorRegistry

from exporter import __version__, allocator
from exporter.analysis.health import HealthPolicy
from exporter.analysis.idle import IdlePolicy
from exporter.analysis.orphans import OrphanPolicy
from exporter.analysis.pipeline import Policy, analyse, initial_state
from exporter.analysis.why_idle import WhyIdlePolicy
from exporter.config import Config
from exporter.exposition.metrics import ExpositionOptions, SnapshotCollector
from exporter.exposition.readiness import Readiness
from exporter.exposition.server import MetricsCache
from exporter.model import Analysis, NodeSnapshot, SourceStatus
from exporter.model.families import EXPERIMENTAL, STABLE
from exporter.registry import build_reporter, build_sources
from exporter.reporting.events import EVENT_REASONS
from exporter.reporting.health_log import log_transitions
from exporter.reporting.lease import LEASE_STATES
from exporter.reporting.recorder import RESULTS
from exporter.reporting.writer import WRITE_KINDS, WRITE_RESULTS, KubeReporter
from exporter.sources.base import Cycle, Source
from exporter.text import one_line

log = logging.getLogger(__name__)
disable_created_metrics()  # type: ignore[no-untyped-call]  # *_created: needless series
SAMPLE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
AGENT = "agent"  # gpu_exporter_errors{source="agent"}: failed cycles
# Shutdown (SIGTERM: a pod deleted, e.g. by a GPU Operator driver upgrade that waits for
# /dev/nvidia* to be closed) is bounded: a cycle in flight may finish, then every source
# closes at once; together well inside the chart's terminationGracePeriodSeconds (10 s).
CYCLE_GRACE_S = 2.0
CLOSE_TIMEOUT_S = 3.0
# Cycles between giving glibc's free pages back to the kernel (exporter/allocator.py).
TRIM_EVERY_CYCLES = 60
# The collector's young-generation threshold once start-up is over (Python's is 700).
# A cycle on node-8gpu builds some thousands of objects (readings, analysis, families)
# and drops the last cycle's, which are freed by reference counting; at 700 the collector
# ran ~6 times a cycle, traversing the half-built snapshot for ~0.7 ms and finding ~1.4
# cyclic objects a cycle (measured). At 5,000 it runs every ~8 cycles (~0.1 ms a cycle),
# and what waits for it is bounded by the threshold.
GC_YOUNG_THRESHOLD = 5000
# Shapes of unresolvable device ids logged (one line each) before the rest go unlogged:
# a kubelet inventing new shapes in every answer must not flood the log or grow the set.
UNRESOLVED_SHAPES_LOGGED = 256
# Characters of kubelet-provided text (device ids, names) that reach one log line.
LOGGED_TEXT_CHARS = 200


@dataclass
class SelfMetrics:
    """The exporter's own instruments, rendered with every cycle."""

    sample_duration: Histogram
    read_seconds: Gauge
    start_time: Gauge
    errors: Counter
    events: Counter
    kube_writes: Counter
    # registered only where a kind of write may be shadowed (--kube-writes shadow)
    kube_writes_shadowed: Counter | None = None
    # registered only with a writer Lease (--kube-writer-lease-duration > 0)
    kube_writer_leader: Gauge | None = None
    kube_writer_lease_state: Gauge | None = None

    @classmethod
    def register(cls, registry: CollectorRegistry) -> SelfMetrics:
        build = Gauge(
            "gpu_exporter_build_info",
            STABLE + "Exporter build; always 1.",
            ["version", "python_version"],
            registry=registry,
        )
        build.labels(__version__, platform.python_version()).set(1)
        return cls(
            sample_duration=Histogram(
                "gpu_exporter_sample_duration_seconds",
                STABLE + "Wall time of one sample cycle: sources and analysis, up to rendering.",
                buckets=SAMPLE_BUCKETS,
                registry=registry,
            ),
            start_time=Gauge(
                "gpu_exporter_start_timestamp_seconds",
                EXPERIMENTAL + "Unix time at which this exporter process started: each change is a "
                "restart (the alerts count restarts and carry an orphan's age across "
                "them with it).",
                registry=registry,
            ),
            read_seconds=Gauge(
                "gpu_exporter_source_read_seconds",
                EXPERIMENTAL + "Wall time of the last read of each source within a cycle.",
                ["source"],
                registry=registry,
            ),
            errors=Counter(
                "gpu_exporter_errors",
                STABLE + "Errors by source: failed NVML queries, failed refreshes, failed cycles.",
                ["source"],
                registry=registry,
            ),
            events=Counter(
                "gpu_exporter_events",
                EXPERIMENTAL + "Kubernetes Events by reason and what became of them: created, "
                "updated (a series count), rate_limited, dropped (API unreachable or too many "
                "waiting), failed (the API refused).",
                ["reason", "result"],
                registry=registry,
            ),
            kube_writes=Counter(
                "gpu_exporter_kube_writes",
                EXPERIMENTAL
                + "Writes of the node condition and DRA device taints to the Kubernetes API.",
                ["kind", "result"],
                registry=registry,
            ),
        )

    def register_shadowed(self, registry: CollectorRegistry) -> None:
        self.kube_writes_shadowed = Counter(
            "gpu_exporter_kube_writes_shadowed",
            EXPERIMENTAL + "Writes to the Kubernetes API computed and not sent "
            "(--kube-writes shadow), by kind (event, node_condition, device_taint_rule) "
            "and reason (the Event's or condition's reason, the taint's value, or why a "
            "rule is deleted).",
            ["kind", "reason"],
            registry=registry,
        )

    def register_lease(self, registry: CollectorRegistry) -> None:
        """One writer per node (exporter/reporting/lease.py)."""
        self.kube_writer_leader = Gauge(
            "gpu_exporter_kube_writer_leader",
            EXPERIMENTAL + "1 while this exporter sends the node's Kubernetes writes (it "
            "holds the node's writer Lease, or the Lease API refused it), 0 while it does not: "
            "it counts them as shadowed while another exporter is known to hold the Lease, "
            "and holds them back to send later while the Lease is unknown.",
            registry=registry,
        )
        self.kube_writer_lease_state = Gauge(
            "gpu_exporter_kube_writer_lease_state",
            EXPERIMENTAL + "The node's writer Lease as this exporter sees it: 1 for the "
            "current state (held, standby, unknown, refused, unreachable), 0 for the others.",
            ["state"],
            registry=registry,
        )
        for state in LEASE_STATES:
            self.kube_writer_lease_state.labels(state)
        self.kube_writer_leader.set(0)


def policy_from(config: Config) -> Policy:
    return Policy(
        health=HealthPolicy(
            xid_window_s=config.health_xid_window_s,
            retired_pages_limit=config.retired_pages_limit,
        ),
        orphans=OrphanPolicy(
            unattributed_threshold_bytes=config.orphan_threshold_bytes,
            unattributed_cycles=config.orphan_cycles,
            stuck_cycles=config.orphan_cycles,
            dead_cycles=config.orphan_cycles,
            deleted_pod_grace_s=config.deleted_pod_grace_s,
        ),
        idle=IdlePolicy(
            threshold_ratio=config.idle_threshold, max_gap_s=max(60.0, 3 * config.interval_s)
        ),
        why_idle=WhyIdlePolicy(
            throttled_ratio=config.why_idle_throttled_ratio,
            pressure_ratio=config.why_idle_pressure_ratio,
        ),
        tolerated_taint_keys=frozenset(config.capacity_tolerated_taints),
    )


def build_agent(
    config: Config,
    cache: MetricsCache,
    *,
    wall_clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
    source_monotonic: Callable[[], float] | None = None,
    readiness: Readiness | None = None,
) -> Agent:
    """The one wiring of sources, analysis and exposition (server, snapshot, tests).
    ``monotonic`` paces the Kubernetes writes (their windows and budget); a simulated
    run whose clock runs faster than real time passes its own. ``source_monotonic``
    (default ``monotonic``) is the clock sources measure intervals by (the cgroup
    source's stall totals become shares of it): a simulated node whose counters follow
    its own clock passes that clock."""
    return Agent(
        config,
        cache,
        build_sources(config, wall_clock=wall_clock, monotonic=source_monotonic or monotonic),
        wall_clock=wall_clock,
        monotonic=source_monotonic or monotonic,  # the clock the sources stamp XIDs on
        reporter=build_reporter(config, wall_clock=wall_clock, monotonic=monotonic),
        readiness=readiness,
    )


class Agent:
    def __init__(
        self,
        config: Config,
        cache: MetricsCache,
        sources: Sequence[Source],
        *,
        wall_clock: Callable[[], float] = time.time,
        reporter: KubeReporter | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        readiness: Readiness | None = None,
    ) -> None:
        self.config = config
        self.readiness = readiness  # told each cycle whether the node's GPUs are seen
        self.reporter = reporter  # writes Events etc. from its own thread
        self.cache = cache
        self.sources = tuple(sources)
        self.registry = CollectorRegistry(auto_describe=False)
        self.options = ExpositionOptions(families=config.families)
        self.collector = SnapshotCollector(self.options)
        self.registry.register(self.collector)
        self.self_metrics = SelfMetrics.register(self.registry)
        for name in (*(s.name for s in self.sources), AGENT):
            self.self_metrics.errors.labels(name)  # present from the start, at 0
        self.wall_clock = wall_clock
        self.self_metrics.start_time.set(wall_clock())
        self.monotonic = monotonic  # analysis measures its windows on it
        self.policy = policy_from(config)
        self.state = initial_state(self.policy, config.xid_classes)
        self._errors_seen: dict[str, int] = {}
        self._events_seen: dict[tuple[str, str], int] = {}
        self._writes_seen: dict[tuple[str, str], int] = {}
        self._shadow_seen: dict[tuple[str, str], int] = {}
        if reporter is not None:  # present from the start, at 0
            for reason in EVENT_REASONS:
                for result in RESULTS:
                    self.self_metrics.events.labels(reason, result)
            for kind in WRITE_KINDS:
                for outcome in WRITE_RESULTS:
                    self.self_metrics.kube_writes.labels(kind, outcome)
            if reporter.options.shadow:
                self.self_metrics.register_shadowed(self.registry)
            if reporter.lease_state() is not None:
                self.self_metrics.register_lease(self.registry)
        self._last_success: dict[str, float] = {}  # sampled sources: last cycle they were up
        self._unresolved_forms_logged: set[str] = set()  # at most UNRESOLVED_SHAPES_LOGGED
        self._unresolved_forms_full = False  # the "no more are logged" line is written
        self._stopping = asyncio.Event()
        self._stop_sampling = threading.Event()  # the sampling thread's copy of _stopping
        self._tasks: list[asyncio.Task[None]] = []
        self._frozen = False
        self._rendered_cycles = 0
        # (pod uid, container id) of the GPU processes the last cycle saw in pods
        self._gpu_containers: frozenset[tuple[str, str | None]] = frozenset()
        self.latest: Analysis | None = None

    def source(self, name: str) -> Source | None:
        return next((s for s in self.sources if s.name == name), None)

    # -- lifecycle --------------------------------------------------------------------

    async def start(self, *, prime_timeout_s: float = 5.0) -> None:
        """Start every background source, and give each a first reading."""
        for source in self.sources:
            source.start()
        if self.reporter is not None:
            self.reporter.start()
        self._tasks = [asyncio.create_task(s.run(), name=f"source-{s.name}") for s in self.sources]
        await asyncio.gather(*(s.prime(prime_timeout_s) for s in self.sources))

    async def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> bool:
        """Stop the background tasks and close every source at once (NVML's close is
        nvmlShutdown), waiting at most ``timeout_s``. False when a source did not finish:
        its worker thread is stuck in a call that cannot be interrupted, and is named."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.reporter is not None:  # a request in flight is cut; news not sent is lost
            await asyncio.to_thread(self.reporter.stop)
        closing = {asyncio.create_task(s.aclose()): s.name for s in self.sources}
        if not closing:
            return True
        done, pending = await asyncio.wait(closing, timeout=timeout_s)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                log.error("closing source %s failed: %s", closing[task], task.exception())
        if pending:
            log.warning(
                "source(s) %s did not close within %.0f s",
                ", ".join(sorted(closing[t] for t in pending)),
                timeout_s,
            )
        return not pending

    async def run(self) -> bool:
        """Sample until ``stop()``, then shut down within CYCLE_GRACE_S + CLOSE_TIMEOUT_S.

        True when everything finished; False when a worker thread is still busy (a call
        that never returns), which the caller should not wait for."""
        await self.start()
        loop = asyncio.get_running_loop()
        sampled: asyncio.Future[None] = loop.create_future()
        sampling = threading.Thread(
            target=self._sample_thread, args=(loop, sampled), name="sample-loop", daemon=True
        )
        sampling.start()
        try:
            await self._stopping.wait()
        finally:
            self._stop_sampling.set()
            # A cycle in flight may finish: closing NVML under it races its calls, and a
            # read starting after nvmlShutdown would initialise NVML again.
            done, _ = await asyncio.wait({sampled}, timeout=CYCLE_GRACE_S)
            if not done:
                log.warning(
                    "a sample cycle is still running after %.0f s; closing the sources anyway",
                    CYCLE_GRACE_S,
                )
            closed = await self.close()
        return bool(done) and closed

    def stop(self) -> None:
        self._stopping.set()
        self._stop_sampling.set()

    def _sample_thread(
        self, loop: asyncio.AbstractEventLoop, sampled: asyncio.Future[None]
    ) -> None:
        """The sample loop, on a thread of its own: a cycle, then a timed wait for the next
        slot. One wake-up per cycle; run from the event loop, each cycle cost three (the
        loop's timer, the hand-over to a worker thread, its result back to the loop), and
        a wake-up is 0.1-0.3 ms of CPU on a small VM (benchmarks/README.md)."""
        try:
            self._sample_loop()
        except BaseException:  # logged once; the thread ends and liveness then fails
            log.exception("the sample loop stopped; /healthz fails once cycles are missed")
        finally:
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                loop.call_soon_threadsafe(_set_done, sampled)

    def _sample_loop(self) -> None:
        interval = self.config.interval_s
        next_at = time.monotonic()
        while not self._stop_sampling.is_set():
            self._announce(next_at + interval)  # the cycle after this one, as planned
            self._cycle()
            if self._stop_sampling.is_set():  # stopped during the cycle: no overrun to report
                return
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
                self._announce(next_at)
            self._stop_sampling.wait(next_at - now)  # woken early by stop()

    def _announce(self, next_at: float) -> None:
        """Tell every source when the next cycle begins, before this one runs: a refresh
        due while it runs is then put off to the next (PodResources; source.py)."""
        for source in self.sources:
            source.expect_cycle_at(next_at)

    # -- one cycle --------------------------------------------------------------------

    async def cycle(self) -> None:
        """One cycle on a worker thread (tests and tools; ``run()`` samples on its own)."""
        await asyncio.to_thread(self._cycle)

    def _cycle(self) -> None:
        started = time.perf_counter()
        timestamp = self.wall_clock()
        try:
            self._read_analyse_render(timestamp, started)
        except Exception:
            self.self_metrics.errors.labels(AGENT).inc()
            log.exception("sample cycle failed; the previous output stays served")

    def _read_analyse_render(self, timestamp: float, started: float) -> None:
        snapshot = self._read_sources(timestamp)
        self._ask_allocations_of_new_containers(snapshot)
        self._analyse_and_render(snapshot, started)

    def _ask_allocations_of_new_containers(self, snapshot: NodeSnapshot) -> None:
        """A GPU process in a container the last cycle did not see: a pod just started,
        whose devices the last PodResources answer may predate. Ask for a refresh now
        rather than attribute its use against that answer until the next one
        (exporter/sources/podresources/source.py)."""
        containers = frozenset(
            (p.pod_uid, p.container_id) for p in snapshot.processes if p.alive and p.pod_uid
        )
        new = containers - self._gpu_containers
        self._gpu_containers = containers
        if new and (pod_resources := self.source("podresources")) is not None:
            pod_resources.request_refresh()

    def _read_sources(self, timestamp: float) -> NodeSnapshot:
        """Read every source in registry order into one snapshot."""
        latest = self.latest
        cycle = Cycle(timestamp, holder_request=latest.holder_request if latest else None)
        statuses: list[SourceStatus] = []
        for source in self.sources:
            began = time.perf_counter()
            failed: str | None = None
            try:
                source.fill(cycle)
            except Exception as exc:  # a source's bug must not cost the other sources' data
                self.self_metrics.errors.labels(source.name).inc()
                log.exception("reading source %s failed", source.name)
                failed = f"reading failed ({type(exc).__name__}); see the exporter's log"
            self.self_metrics.read_seconds.labels(source.name).set(time.perf_counter() - began)
            status = source.status()
            if status is not None and failed is not None:  # not up, whatever it says
                status = replace(status, up=False, error=failed)
            if status is not None:
                statuses.append(self._with_last_success(status, timestamp))
            self._count_errors(source.name, source.errors_total)
        snapshot = cycle.readings.snapshot(self.config.node_name, timestamp, tuple(statuses))
        return replace(snapshot, monotonic=self.monotonic())

    def _with_last_success(self, status: SourceStatus, timestamp: float) -> SourceStatus:
        """A background source knows its last success; a sampled one succeeded in the
        last cycle that found it up."""
        if status.last_success is not None:
            return status
        if status.up:
            self._last_success[status.name] = timestamp
        last = self._last_success.get(status.name)
        return status if last is None else replace(status, last_success=last)

    def _count_errors(self, name: str, total: int) -> None:
        """Turn a running error total (a source's, or the builds of the metric families
        that failed in a request, counted as the agent's) into increments of our
        counter."""
        new = total - self._errors_seen.get(name, 0)
        if new > 0:
            self.self_metrics.errors.labels(name).inc(new)
            self._errors_seen[name] = total

    def _count_writes(self, reporter: KubeReporter) -> None:
        """The writer thread's running totals, as increments of our counters."""
        state, metrics = reporter.lease_state(), self.self_metrics
        if state is not None and metrics.kube_writer_lease_state is not None:
            for each in LEASE_STATES:
                metrics.kube_writer_lease_state.labels(each).set(1 if each == state else 0)
            if metrics.kube_writer_leader is not None:
                metrics.kube_writer_leader.set(1 if reporter.leading() else 0)
        if metrics.kube_writes_shadowed is None and reporter.shadow_counts():
            # a writer Lease's standby counts its writes as shadowed too, from its first
            self.self_metrics.register_shadowed(self.registry)
        shadowed = self.self_metrics.kube_writes_shadowed
        for seen, totals, counter in (
            (self._events_seen, reporter.event_counts(), self.self_metrics.events),
            (self._writes_seen, reporter.write_counts(), self.self_metrics.kube_writes),
            *([(self._shadow_seen, reporter.shadow_counts(), shadowed)] if shadowed else []),
        ):
            for labels, total in totals.items():
                new = total - seen.get(labels, 0)
                if new > 0:
                    counter.labels(*labels).inc(new)
                    seen[labels] = total

    def _analyse_and_render(self, snapshot: NodeSnapshot, started: float) -> None:
        analysis, self.state = analyse(snapshot, self.state, self.policy)
        self._log_unresolved(analysis)
        log_transitions(analysis.transitions)
        if self.reporter is not None:
            self.reporter.offer(analysis)  # never waits on the API server
            self._count_writes(self.reporter)
        self._count_errors(AGENT, self.collector.failed_builds)
        formats = self.cache.due()
        # Built here when rendered here (the collector also builds while builds fail, so
        # that a failing build fails the cycle); else by the first request that wants it.
        self.collector.set(analysis, build_now=bool(formats))
        self.self_metrics.sample_duration.observe(time.perf_counter() - started)
        self.cache.render(self.registry, formats)
        self.latest = analysis
        if self.readiness is not None:
            nvml = analysis.node.nvml
            self.readiness.observe(
                nvml_ok=nvml.ok,
                nvml_error=nvml.error,
                gpus=len(nvml.gpus),
                advertised=sum(c.advertised for c in analysis.capacity),
            )
        if not self._frozen and self._settled():
            # Start-up is over: what is loaded now (kubernetes, pydantic,
            # prometheus_client: ~150k objects) lives as long as the process. Out of the
            # collector's view, it no longer costs 55-85 ms full collections.
            gc.collect()
            gc.freeze()
            gc.set_threshold(GC_YOUNG_THRESHOLD, *gc.get_threshold()[1:])
            self._frozen = True
        self._rendered_cycles += 1
        if self._rendered_cycles % TRIM_EVERY_CYCLES == 0:
            allocator.trim()

    def _settled(self) -> bool:
        """The pod watch (which loads the kubernetes client) has listed, or is off."""
        kube = self.source("kube")
        status = kube.status() if kube is not None else None
        return kube is None or (status is not None and status.up)

    def _log_unresolved(self, analysis: Analysis) -> None:
        """One log line per new shape of device id no form resolves, for the first
        ``UNRESOLVED_SHAPES_LOGGED`` shapes, then one line saying that no more are logged
        (gpu_exporter_unresolved_allocations still counts every one). The kubelet's text
        goes through ``one_line``: a newline in an id must not forge a log line."""
        for a in analysis.attribution.allocations:
            if a.resolved:
                continue
            form = one_line(
                f"{a.resource_name} {id_shape(a.device_id[:LOGGED_TEXT_CHARS])}",
                2 * LOGGED_TEXT_CHARS,
            )
            if form in self._unresolved_forms_logged:
                continue
            if len(self._unresolved_forms_logged) >= UNRESOLVED_SHAPES_LOGGED:
                if not self._unresolved_forms_full:
                    self._unresolved_forms_full = True
                    log.warning(
                        "%d shapes of unresolvable device ids logged; further shapes are "
                        "not logged, gpu_exporter_unresolved_allocations still counts "
                        "every unresolved allocation",
                        UNRESOLVED_SHAPES_LOGGED,
                    )
                return
            self._unresolved_forms_logged.add(form)
            log.warning(
                "allocation %s of %s/%s (%s) names no GPU this exporter can resolve; "
                "it is counted in gpu_exporter_unresolved_allocations and never "
                "reported as an isolation leak (see docs/attribution.md)",
                one_line(a.device_id, LOGGED_TEXT_CHARS),
                one_line(a.container.namespace, LOGGED_TEXT_CHARS),
                one_line(a.container.pod, LOGGED_TEXT_CHARS),
                one_line(a.resource_name, LOGGED_TEXT_CHARS),
            )


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def id_shape(device_id: str) -> str:
    """A device id with its numbers and hex runs blanked: ``accel-3`` -> ``accel-N``."""
    return re.sub(r"[0-9a-fA-F]{8,}|\d+", "N", device_id)
