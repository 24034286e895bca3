"""Where a simulated node's files and sockets are, for the exporter's flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class SimPaths:
    """Where the exporter should look instead of the host's real paths."""

    proc_root: Path
    kmsg: Path  # the kernel log, for --kmsg-path
    pod_resources_socket: Path
    kubeconfig: Path | None
    node_name: str
    # The cgroup tree (sim/cgroupfs.py) for --cgroup-root; None: the scenario gives no
    # container a ``cgroup:`` key, so the exporter runs with --cgroup-root=off.
    cgroup_root: Path | None = None

    def flags(self) -> list[str]:
        """The exporter's flags that point it at this node (``--kube-api=off`` without
        an API stand-in, ``--cgroup-root=off`` without a cgroup tree: never the host's)."""
        return [
            f"--proc-root={self.proc_root}",
            f"--kmsg-path={self.kmsg}",
            f"--pod-resources-socket={self.pod_resources_socket}",
            f"--node-name={self.node_name}",
            f"--kubeconfig={self.kubeconfig}" if self.kubeconfig else "--kube-api=off",
            f"--cgroup-root={self.cgroup_root or 'off'}",
        ]
