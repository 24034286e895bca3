"""The simulated node's kernel log (``/dev/kmsg`` format) and ``<proc-root>/uptime``.

Every XID the simulated driver raises is also printed to the kernel log, as the real
driver does (open-gpu-kernel-modules, kernel_rc.c), so ``--kmsg`` reads the same XIDs
the NVML event set delivers. XIDs the timeline raises at or before time 0 are in the log
before the exporter starts: its backlog, which the NVML event set never delivers.
A ``kmsg_overrun: N`` event leaves out N sequence numbers, as records the kernel's ring
overwrote before the reader read them would, followed by the newest record of the flood
that overwrote them: the reader sees the jump, as it does after ``/dev/kmsg`` answers
EPIPE.

Records are stamped with printk's clock, ``scenario.kernel_log.clock_lag_s`` behind
the CLOCK_BOOTTIME that ``uptime`` shows, as on a node that was suspended or whose
sched_clock drifted from NTP time: converting a record's stamp through ``uptime`` then
lands that far before the time the XID was raised.
"""

from __future__ import annotations

import os
from pathlib import Path

from exporter.sim.node import SimNode, XidRecord

NO_INSTANCE = 0xFFFFFFFF  # NVML's "no GPU/compute instance" in event data
_BOOT_LINES = (  # (printk seconds, text): records the reader must skip
    (0.0, "Linux version 6.8.0-simulated (gpu-occupancy-exporter simulator)"),
    (0.8, "nvidia: module license 'NVIDIA' taints kernel."),
)


class SimKernelLogWriter:
    """Appends the node's XIDs to a file in ``/dev/kmsg`` format and keeps ``uptime``."""

    def __init__(self, node: SimNode, path: Path, proc_root: Path) -> None:
        self._node = node
        self._path = path
        self._uptime = proc_root / "uptime"
        self._seq = 0
        self.xids_written = 0
        self._overwritten = 0  # of the node's kmsg_overwritten, already left out

    def start(self) -> None:
        """The boot messages and the driver's banner; XIDs follow from ``sync``."""
        version = self._node.scenario.driver_version
        banner = (1.0, f"NVRM: loading NVIDIA UNIX x86_64 Kernel Module  {version}")
        lines = [self._record(6, at, text) for at, text in (*_BOOT_LINES, banner)]
        self._path.write_text("".join(lines), encoding="utf-8")

    def sync(self) -> None:
        """Write ``uptime`` for now and log the XIDs raised since the last call (under
        the node's lock, after ``start``)."""
        log = self._node.scenario.kernel_log
        uptime = log.uptime_s + self._node.now()
        tmp = self._uptime.with_name("uptime.tmp")
        tmp.write_text(f"{uptime:.2f} {uptime * 3:.2f}\n", encoding="ascii")
        os.replace(tmp, self._uptime)
        lines = []
        lost = self._node.kmsg_overwritten - self._overwritten
        if lost:
            self._seq += lost  # logged, then overwritten before anyone read them
            self._overwritten = self._node.kmsg_overwritten
            at = log.uptime_s + self._node.now() - log.clock_lag_s
            lines.append(self._record(4, at, "simulated: the last of a flood of messages"))
        fresh = self._node.xids[self.xids_written :]
        lines += [self._xid(x) for x in fresh]
        if lines:
            with self._path.open("a", encoding="utf-8") as f:
                f.write("".join(lines))
            self.xids_written += len(fresh)

    def _xid(self, xid: XidRecord) -> str:
        """The driver's line (kernel_rc.c ``XID_PRINT_WITH_ATTR``), stamped on printk's clock."""
        log = self._node.scenario.kernel_log
        gpu = self._node.gpus[xid.gpu]
        domain, bus, device = _pci(gpu.pci_bus_id)
        where = f"PCI:{domain:04x}:{bus:02x}:{device:02x}"
        if xid.gpu_instance_id != NO_INSTANCE:
            where += f" GPU-I:{xid.gpu_instance_id:02d}"
            if xid.compute_instance_id != NO_INSTANCE:
                where += f" GPU-CI:{xid.compute_instance_id:02d}"
        text = f"NVRM: Xid ({where}): {xid.code}, pid='<unknown>', name=<unknown>, simulated"
        return self._record(3, log.uptime_s + xid.at - log.clock_lag_s, text)

    def _record(self, prio: int, at: float, text: str) -> str:
        """One record; ``at`` is seconds on printk's clock (since boot)."""
        self._seq += 1
        return f"{prio},{self._seq},{round(at * 1_000_000)},-;{text}\n"


def _pci(bus_id: str) -> tuple[int, int, int]:
    """NVML's ``00000000:18:00.0`` -> (domain, bus, device)."""
    domain, bus, rest = bus_id.split(":")
    return int(domain, 16), int(bus, 16), int(rest.split(".")[0], 16)
