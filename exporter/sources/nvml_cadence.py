"""How often each NVML fact is read: the one place that says so.

On a real node every NVML call is an ioctl into the driver, some of them milliseconds
long, so a fact is read as often as it changes, not every cycle (the NVML call budget):

- ``cycle``: every sample cycle. What a scrape should see move: utilization (and
  GPU-Util's sample buffer, ``nvmlDeviceGetSamples``), memory, power, temperatures,
  clocks and why they are held down, the current PCIe link, traffic counters, the
  process listings, the recovery action.
- ``gpm``: a GPM window closes every ``--gpm-interval`` seconds (default 10, never
  faster than the cycle): ``nvmlGpmMetricsGet`` cost 1.9 ms a read on an H200
  (docs/validation.md), so reading it every second would be most of the exporter's
  NVML time. The occupancy gauges are the last window's mean; the activity counters
  (``gpu_*_active_seconds_total``, exporter/analysis/active_time.py) add every window,
  so ``rate()`` over a span longer than the window is exact: a longer window delays a
  counter's step, it does not lose time. A GPU (or GPU instance) whose buffers were only
  primed is sampled again at the next cycle, so its first window is one cycle long.
- ``process``: the per-process samples (``nvmlDeviceGetProcessUtilization``, 2.1-2.4
  ms a call on an H200; one call a read with room to spare, where pynvml's wrapper
  makes two, exporter/sources/nvml_sample_reads.py) every ``--process-utilization-interval``
  seconds (default 10): every sample the driver kept since the last read is taken (the
  ``lastSeenTimeStamp`` argument), so ``gpu_container_sm_seconds_total`` loses nothing
  the driver's history still holds; the per-container SM gauges stand between reads.
  A GPU with no process listed is not read at all (as before).

GPM and process reads are spread like the slow tier's (GPU i of N at i/N of the
interval), and a GPU seen for the first time reads them at its first cycle.
- ``slow``: every ``--slow-interval`` seconds (default 30, never faster than the cycle).
  Counters and states that move once in days or weeks: ECC totals, row remapping,
  retired pages, the PCIe link's best generation and width and its replay counter,
  NVLink state and error counters, fans, the enforced power limit. And counters that
  cost milliseconds a read, measured on an H200 (driver 580.159.04;
  benchmarks/real_nvml_fields.py): total energy (field 83 or
  nvmlDeviceGetTotalEnergyConsumption, 3.2 ms) and the time under each performance
  policy and clock-event reason (fields 74-79 and 269-271, read together; 75, 270 and
  271 took 0.66-0.79 ms each). dcgm-exporter collects every field every 30 s by
  default (NVIDIA/dcgm-exporter pkg/cmd/app.go: ``--collect-interval``/``-c``, Value
  30000, "Unit is milliseconds"). Every GPU reads them
  at its first cycle; after that GPU i of N reads them at i/N of the interval
  (``SlowSchedule``), so the slow reads are spread over the cycles of the interval
  rather than all paid in one cycle, and no GPU's are older than the interval.
- ``change``: read when the GPU's handle is (re)opened (start, a GPU back from being
  lost), and the MIG layout also at every slow read (``nvidia-smi mig -cgi`` changes it
  without an XID or a new handle), so a reconfiguration shows within ``--slow-interval``;
  sooner when a MIG device's read answers InvalidArgument or NotFound (its instance was
  destroyed): the layout is read again at the next cycle.

An XID in ``REREAD_XIDS`` (ECC, row remapping, page retirement) makes the GPU's slow tier
and layout due at the next cycle after the XID source delivered it: the NVML source reads
the XIDs the last cycle's readings carry (sources never import one another, and the XID
sources are read after NVML in a cycle), so such a fault shows within two cycles.

Between two slow reads the last values are served as they were read: never reset, never
re-read in between. A slow read that fails leaves that value absent until the next slow
read (as a failed read did before: no series, the error counted), so a carried value is
never the answer to a read that failed. A GPU that fails as a whole drops its carried
values with its handle: the next handle starts with a fresh slow read.
"""

from __future__ import annotations

import math
from typing import Literal

# the default period is stated in model, where config reads it
from exporter.model import DEFAULT_SLOW_INTERVAL_S as DEFAULT_SLOW_INTERVAL_S

Tier = Literal["cycle", "gpm", "process", "slow", "change"]

# Every NVML read of the source, by the query name its errors are counted under
# (gpu_exporter_errors_total's reason aside, the names of exporter/sources/nvml.py).
READS: dict[str, Tier] = {
    # every cycle
    "memory": "cycle",
    "utilization": "cycle",
    "temperature": "cycle",
    "power": "cycle",  # field NVML_FI_DEV_POWER_AVERAGE (R525+), else the call (never _INSTANT)
    "clock_sm": "cycle",
    "clock_memory": "cycle",
    "clock_event_reasons": "cycle",
    "memory_temperature": "cycle",  # field value
    "pcie_bytes": "cycle",  # field values; never again on a GPU that answers them in 32 bits
    "nvlink_bytes": "cycle",  # field values, per link
    "recovery_action": "cycle",  # field value
    "pcie_link": "cycle",  # current generation and width (idle power management moves them)
    "encoder_utilization": "cycle",
    "decoder_utilization": "cycle",
    "nvmlDeviceGetComputeRunningProcesses": "cycle",
    "nvmlDeviceGetGraphicsRunningProcesses": "cycle",
    "nvmlDeviceGetMPSComputeRunningProcesses": "cycle",
    "utilization_samples": "cycle",
    "process_utilization": "process",
    "gpm": "gpm",
    "gpm_metrics": "gpm",
    # the slow tier
    "energy": "slow",  # field NVML_FI_DEV_TOTAL_ENERGY_CONSUMPTION, else the call
    "clock_event_time": "slow",  # field values
    "ecc": "slow",
    "remapped_rows": "slow",
    "retired_pages": "slow",
    "pcie_link_max": "slow",
    "pcie_replay": "slow",  # field NVML_FI_DEV_PCIE_REPLAY_COUNTER, else the call
    "nvlink_state": "slow",
    "nvlink_errors": "slow",  # per-link fields (links 0-11), else the call
    "fans": "slow",
    "fan_speed": "slow",
    "power_limit": "slow",
    # on change
    "pci_info": "change",
    "name": "change",
    "minor_number": "change",
    "nvlink_count": "change",
    "mig_mode": "change",
    "mig_count": "change",
    "mig_handle": "change",
    "mig_identity": "change",
    "mig_profiles": "change",
}

# The served families whose values come from slow or on-change reads, and so may be as
# old as --slow-interval (docs/metrics.md states it in each row; tests hold the two equal).
FAMILY_TIERS: dict[str, Tier] = {
    "gpu_energy_joules": "slow",
    "gpu_clock_event_seconds": "slow",
    "gpu_ecc_errors": "slow",
    "gpu_remapped_rows": "slow",
    "gpu_row_remap_pending": "slow",
    "gpu_row_remap_failed": "slow",
    "gpu_pcie_link_max_generation": "slow",
    "gpu_pcie_link_max_width": "slow",
    "gpu_pcie_replays": "slow",
    "gpu_nvlink_active": "slow",
    "gpu_nvlink_errors": "slow",
    "gpu_fan_speed_ratio": "slow",
    "gpu_power_limit_watts": "slow",
    "gpu_info": "change",
    "gpu_mig_mode_enabled": "change",
    "gpu_mig_info": "change",
    "gpu_mig_profile_info": "change",
    "gpu_mig_profile_memory_bytes": "change",
    "gpu_mig_profile_sm_share_ratio": "change",
}


# XIDs after which a GPU's slow tier and MIG layout are read again at the next cycle,
# rather than up to --slow-interval later: each says that a slow fact just changed
# (docs.nvidia.com/deploy/xid-errors, "XID catalog"): 48 double-bit ECC error, 63 ECC
# page retirement or row remapping recorded, 64 ... failed, 92 high single-bit ECC
# rate, 94 contained and 95 uncontained ECC error (on MIG, the instance is recovered).
REREAD_XIDS = frozenset({48, 63, 64, 92, 94, 95})


def normalize_bus_id(bus_id: str) -> tuple[int, int, int] | None:
    """(domain, bus, device) of "00000000:3B:00.0" (NVML) or "0000:3b:00" (kernel log)."""
    parts = bus_id.strip().lower().removeprefix("pci:").split(".")[0].split(":")
    try:
        domain, bus, dev = (int(p, 16) for p in (["0", *parts] if len(parts) == 2 else parts))
    except ValueError:
        return None
    return domain, bus, dev


class SlowSchedule:
    """When a GPU's slow tier is due: at its first read (a new handle), then at each point
    of its own grid, ``offset_s`` + k * ``interval_s`` on the source's clock, at the first
    cycle that reaches it (``interval_s`` 0: every cycle).

    The NVML source gives GPU i of N the offset i * interval / N (``offset``), so the slow
    reads are spread over the interval: each cycle pays for about N * cycle / interval
    GPUs' slow reads instead of one cycle in interval / cycle paying for all of them. Two
    reads of a GPU are never further apart than ``interval_s`` plus the cycle that reaches
    the grid point, as with a period counted from the last read: the first gap after a
    new handle and the gap after an XID's re-read (``expire``) are shorter, never longer.
    """

    def __init__(self, interval_s: float, offset_s: float = 0.0) -> None:
        self.interval_s = interval_s
        self.offset_s = offset_s
        self._next_at: float | None = None  # None: due at the next cycle

    def due(self, now: float) -> bool:
        return self.interval_s <= 0 or self._next_at is None or now >= self._next_at

    def done(self, now: float) -> None:
        """Read at ``now``: next due at the first grid point after it."""
        if self.interval_s > 0:
            periods = math.floor((now - self.offset_s) / self.interval_s) + 1
            self._next_at = self.offset_s + periods * self.interval_s

    def expire(self) -> None:
        """Due at the next cycle (an XID in ``REREAD_XIDS`` named the GPU)."""
        self._next_at = None


def offset(interval_s: float, index: int, count: int, epoch_s: float = 0.0) -> float:
    """GPU ``index`` of ``count``'s place in the slow interval: ``index`` / ``count`` of
    it after ``epoch_s`` (when the source first initialised)."""
    return epoch_s + interval_s * index / max(count, 1)
