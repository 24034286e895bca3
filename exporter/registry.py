"""Every source, built from ``Config``: one line per source, in reading order.

Adding a source is a new file in ``exporter/sources/`` (a ``Source`` subclass) and one
line here. This module sits outside ``exporter.sources`` because it reads ``Config``;
the sources themselves know nothing of flags. The order is the order of reading within
a cycle: NVML first, since procfs and the holder scan read the pids it listed.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from exporter.config import Config, ConfigError
from exporter.reporting.kube_client import KubeWriteClient, KubeWriteError
from exporter.reporting.lease import WriterLease, identity
from exporter.reporting.recorder import rfc3339_micro
from exporter.reporting.writer import REQUEST_DEADLINE_S, KubeReporter, ReportingOptions
from exporter.sources.base import Source
from exporter.sources.cgroups import CgroupReader
from exporter.sources.dcgm import DcgmSource
from exporter.sources.device_taint_rules import DeviceTaintRuleWatcher
from exporter.sources.holder_scan import HolderScanSource
from exporter.sources.kmsg import KmsgReader
from exporter.sources.kube import PodWatcher
from exporter.sources.node_watch import NodeWatcher
from exporter.sources.nvml import NvmlSource
from exporter.sources.podresources.client import PodResourcesClient
from exporter.sources.podresources.source import PodResourcesSource
from exporter.sources.procfs import ProcessReader
from exporter.sources.resourceslices import ResourceSliceWatcher
from exporter.sources.xid import XidListener

log = logging.getLogger(__name__)


def build_sources(
    config: Config,
    *,
    wall_clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> tuple[Source, ...]:
    kube = kube_api_configured(config)
    if not kube and config.kube_api == "auto":
        log.info(
            "no Kubernetes API credentials found; pod names come from the kubelet "
            "only (use --kubeconfig, or run in-cluster)"
        )
    sources: list[Source | None] = [
        NvmlSource(
            clock=monotonic,
            slow_interval_s=config.slow_interval_s,
            gpm_interval_s=config.gpm_interval_s,
            process_utilization_interval_s=config.process_utilization_interval_s,
        ),
        dcgm_source(config) if config.dcgm.kind != "off" else None,
        ProcessReader(config.proc_root),
        HolderScanSource(config.proc_root),
        XidListener(clock=wall_clock, monotonic=monotonic),
        KmsgReader(
            path=config.kmsg_path, proc_root=config.proc_root, clock=wall_clock, monotonic=monotonic
        )
        if config.kmsg
        else None,
        PodResourcesSource(
            PodResourcesClient(
                config.pod_resources_socket,
                resource_names=config.resource_names,
                dra_drivers=config.dra_drivers,
            ),
            interval_s=config.pod_resources_interval_s,
            cycle_interval_s=config.interval_s,
            wall_clock=wall_clock,
        ),
        PodWatcher(config.node_name, kubeconfig=config.kubeconfig, wall_clock=wall_clock)
        if kube
        else None,
        ResourceSliceWatcher(
            config.node_name, kubeconfig=config.kubeconfig, drivers=config.dra_drivers
        )
        if kube and config.dra_drivers
        else None,
        NodeWatcher(config.node_name, kubeconfig=config.kubeconfig) if kube else None,
        DeviceTaintRuleWatcher(
            config.node_name, kubeconfig=config.kubeconfig, drivers=config.dra_drivers
        )
        if kube and config.dra_drivers
        else None,
        # after procfs, PodResources and the pod watch: it reads their readings
        CgroupReader(config.cgroup_root, clock=monotonic) if config.cgroup_root else None,
    ]
    return tuple(source for source in sources if source is not None)


def dcgm_source(config: Config) -> DcgmSource:
    return DcgmSource(
        config.dcgm,
        bindings_path=config.dcgm_bindings_path,
        library_path=config.dcgm_library_path,
        update_interval_s=min(config.interval_s, 1.0),
        # a share of the cycle, so that a slow host engine never stalls it
        read_deadline_s=min(1.0, config.interval_s / 4),
    )


def kube_api_configured(config: Config) -> bool:
    """``--kube-api auto`` uses the API only where credentials exist."""
    if config.kube_api == "off":
        return False
    if config.kubeconfig or os.environ.get("KUBERNETES_SERVICE_HOST"):
        return True
    default = os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    return Path(default.split(os.pathsep)[0]).is_file()


def build_reporter(
    config: Config,
    *,
    wall_clock: Callable[[], float] = time.time,
    monotonic: Callable[[], float] = time.monotonic,
) -> KubeReporter | None:
    """What the exporter writes to Kubernetes (exporter/reporting/), or None.

    Events follow ``--kube-events auto``: on where API credentials exist, quietly off
    where none do. The node condition and the taints were asked for by name, so without
    credentials they are a configuration error, not a silent no-op.
    """
    if config.snapshot:  # one look at the node: it tells nobody
        return None
    events = config.kube_events == "auto"
    if not (events or config.node_condition or config.dra_device_taints):
        return None
    asked = [
        flag
        for flag, on in (
            ("--node-condition", config.node_condition),
            ("--dra-device-taints", config.dra_device_taints),
        )
        if on
    ]
    if not kube_api_configured(config):
        if asked:
            raise ConfigError(
                f"{' and '.join(asked)} need the Kubernetes API, and none is configured: "
                "give --kubeconfig or run in-cluster (and leave --kube-api at auto)"
            )
        return None
    if config.dra_device_taints and not config.dra_drivers:
        raise ConfigError(
            "--dra-device-taints needs the DRA drivers whose devices are GPUs: "
            "set --dra-drivers (default gpu.nvidia.com)"
        )
    options = ReportingOptions(
        node_name=config.node_name,
        events=events,
        node_condition=config.node_condition,
        device_taints=config.dra_device_taints,
        taint_effect=config.dra_device_taint_effect,
        dra_drivers=config.dra_drivers,
        xid_window_s=config.health_xid_window_s,
        shadow=config.kube_writes_shadow,
    )
    kubeconfig = config.kubeconfig

    def client() -> KubeWriteClient:
        return KubeWriteClient(kubeconfig, deadline_s=REQUEST_DEADLINE_S)

    enabled = {
        kind
        for kind, on in (
            ("event", events),
            ("node_condition", config.node_condition),
            ("device_taint_rule", config.dra_device_taints),
        )
        if on
    }
    lease = None
    # One writer per node (reporting/lease.py); an exporter that shadows every kind it
    # has enabled writes nothing, so it does not compete for the Lease: held by it, the
    # Lease would keep a writing exporter on the node from sending anything.
    if config.kube_writer_lease_duration_s > 0 and enabled - config.kube_writes_shadow:
        lease = WriterLease(
            config.kube_writer_lease_namespace,
            config.node_name,
            identity(),
            duration_s=config.kube_writer_lease_duration_s,
            clock=monotonic,
            wall_micro=lambda: rfc3339_micro(wall_clock()),
            error_type=KubeWriteError,
        )
    return KubeReporter(
        options, client, clock=monotonic, wall=wall_clock, error_type=KubeWriteError, lease=lease
    )
