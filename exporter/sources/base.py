"""The one shape every source has, and what a source may read during a cycle.

Modelled on node_exporter's ``collector/``: a small interface, a registry
(``exporter.registry``, outside this package since it reads ``Config``) that builds
every source from ``Config``, and
per-source self-metrics (``gpu_exporter_source_up``, ``gpu_exporter_errors``,
``gpu_exporter_source_read_seconds``) kept by the agent, not by each source.

A source is one of two kinds, with the same methods:

- *sampled* (NVML, DCGM, procfs, the holder scan): ``read()`` does the I/O, once per
  cycle, in the agent's worker thread;
- *background* (XID listener, kernel log, PodResources, pod watch, ResourceSlices):
  ``start()`` starts a thread (or ``run()`` is an asyncio task) that keeps a current
  snapshot; ``read()`` only hands that snapshot over.

``read()`` fills one field of ``NodeSnapshot`` (``field``). Sources never import one
another; one that needs another's reading (procfs needs the pids NVML listed) reads it
from ``Cycle.readings``, so the registry's order is the order of reading.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import ClassVar

from exporter.model import HolderScanRequest, NvmlSnapshot, SourceName, SourceStatus


@dataclass
class Cycle:
    """One cycle's inputs to the sources: the time, last cycle's request for a holder
    scan (a finding of analysis), and the readings of the sources read so far."""

    timestamp: float
    holder_request: HolderScanRequest | None = None
    readings: dict[str, object] = field(default_factory=dict)

    def gpu_pids(self) -> frozenset[int]:
        """Every pid NVML listed this cycle, on whole GPUs and MIG instances."""
        nvml = self.readings.get("nvml")
        if not isinstance(nvml, NvmlSnapshot):
            return frozenset()
        return frozenset(p.pid for gpu in nvml.gpus for p in gpu.all_processes())


class Source:
    """Base of every source; subclasses set ``name`` and ``field`` and override ``read``."""

    name: ClassVar[SourceName]  # gpu_exporter_source_up{source=...}
    field: ClassVar[str]  # the NodeSnapshot field read() fills

    def start(self) -> None:
        """Start a background thread, if the source has one."""

    async def run(self) -> None:
        """A background asyncio task, if the source has one (PodResources refreshes)."""

    async def prime(self, timeout_s: float) -> None:
        """Before the first cycle: get a first reading (refresh once, or wait up to
        ``timeout_s`` for a watch to list), so the first output is complete."""

    def read(self, cycle: Cycle) -> object:
        raise NotImplementedError

    def status(self) -> SourceStatus | None:
        """Up or down with a reason; None while there is nothing to report yet."""
        return None

    @property
    def errors_total(self) -> int:
        """Errors since start: the agent turns increments into ``gpu_exporter_errors``."""
        return 0

    def close(self) -> None:
        """Release what the source holds (threads stopped, handles closed)."""

    async def aclose(self) -> None:
        """Async release; defaults to ``close()`` in a worker thread."""
        await asyncio.to_thread(self.close)
