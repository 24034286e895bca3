"""Readiness that means seeing GPUs: /readyz answers 503, with the reason, once the
exporter has been unable to see the node's GPUs for ``--ready-grace`` seconds: NVML down
(no driver library in the container, no driver loaded, no permission), or NVML up with no
GPU while the kubelet or a DRA driver advertises some (an unprivileged container on a
hardened NVIDIA container toolkit: docs/install.md, "Ready means it sees GPUs"). A pod
that is Ready then means a pod that monitors; /healthz is unchanged (a restart would not
help). The agent reports each cycle (``observe``); the server asks (``problem``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Final

log = logging.getLogger(__name__)

# NVML's error (exporter/sources/nvml_codes.py error_name: the exception class without
# "NVMLError_") -> what it most likely means in a Kubernetes pod
CAUSES: Final = {
    "LibraryNotFound": (
        "libnvidia-ml.so is not in the container: run the pod with the NVIDIA runtime "
        "(runtimeClassName: nvidia, the chart's runtimeClassName) or install the driver"
    ),
    "DriverNotLoaded": "no NVIDIA kernel driver is loaded on the node (driver not installed yet?)",
    "NoPermission": (
        "the container may not open /dev/nvidia*: run it privileged, or with the NVIDIA "
        "runtime and NVIDIA_VISIBLE_DEVICES=all accepted for it"
    ),
    "LibRmVersionMismatch": (
        "the driver library in the container does not match the kernel driver (a driver "
        "upgrade in progress: reboot or restart the driver container)"
    ),
}
HARDENED_TOOLKIT: Final = (
    "an unprivileged container on a hardened NVIDIA container toolkit "
    "(accept-nvidia-visible-devices-envvar-when-unprivileged = false) sees no GPU: run "
    "the exporter privileged (the chart's default) or through the NVIDIA runtime class"
)


def likely_cause(nvml_error: str | None) -> str:
    """One clause naming the likely cause of NVML being down."""
    name = (nvml_error or "").split(":", 1)[0].strip()
    return CAUSES.get(name, "see the exporter's log and docs/install.md, 'Troubleshooting'")


class Readiness:
    """Says why the exporter is not ready for lack of GPUs (None: it sees them, or has
    not been blind for the grace yet), logging once when that starts and once when it
    ends."""

    def __init__(self, *, grace_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self._grace_s = grace_s
        self._clock = clock
        self._blind_since: float | None = None
        self._why: str | None = None
        self._failing = False

    def observe(self, *, nvml_ok: bool, nvml_error: str | None, gpus: int, advertised: int) -> None:
        """One cycle's view: NVML up or not (with its error), the GPUs it listed, and the
        devices the kubelet and DRA drivers advertise (0: none, or not known)."""
        if not nvml_ok:
            why = f"NVML is down ({nvml_error or 'no error given'}): {likely_cause(nvml_error)}"
        elif gpus == 0 and advertised > 0:
            why = (
                f"NVML lists no GPU while the kubelet advertises {advertised} GPU device(s): "
                f"{HARDENED_TOOLKIT}"
            )
        else:
            why = None
        if why is None:
            self._blind_since = None
        elif self._blind_since is None:
            self._blind_since = self._clock()
        self._why = why

    def problem(self) -> str | None:
        """One line saying why the exporter is not ready, or None."""
        reason = None
        if self._why is not None and self._blind_since is not None:
            blind_s = self._clock() - self._blind_since
            if blind_s >= self._grace_s:
                reason = f"no GPU seen for {blind_s:.0f} s (--ready-grace {self._grace_s:g} s): "
                reason += self._why
        if reason is not None and not self._failing:
            log.error("not ready, /readyz answers 503: %s", reason)
        elif reason is None and self._failing:
            log.warning("ready again: the exporter sees the node's GPUs (/readyz answers 200)")
        self._failing = reason is not None
        return reason
