"""NVML, the driver and each GPU: what the exporter's NVML source will be able to read.

The exporter's own ``NvmlSource`` initialises NVML and takes one sample (driver version,
GPU count, which GPUs answer, MIG mode); then each GPU is asked directly, through pynvml
as the source asks it, the questions a sample keeps to itself: is GPM supported and may
this process take a GPM sample, and may it list the GPU's processes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

from exporter.doctor.check import Check, degraded, missing, ok
from exporter.model import GpuSample
from exporter.sources.nvml import NvmlSource, process_listing_suffix
from exporter.sources.nvml_codes import UNSUPPORTED, error_name
from exporter.sources.nvml_listing import ProcessLister

RUNTIME_FIX = (
    "run the exporter with the NVIDIA container runtime so libnvidia-ml.so.1 and "
    "/dev/nvidia* are in its container (chart: platform / nvidia.runtimeClassName, "
    "nvidia.visibleDevices=all, nvidia.driverCapabilities=utility), and check that the "
    "driver is loaded on the host (nvidia-smi)"
)
NO_GPU_FIX = (
    "NVML lists no GPU although the container has NVML: give the container every GPU "
    "(NVIDIA_VISIBLE_DEVICES=all, chart nvidia.visibleDevices=all); on a hardened NVIDIA "
    "container toolkit (accept-nvidia-visible-devices-envvar-when-unprivileged = false) "
    "run it privileged or allow that setting"
)
PERMISSION_FIX = (
    "run the container privileged, or with the GPU devices and CAP_SYS_ADMIN (chart: "
    "securityContext.privileged=true)"
)
GPM_FIX = (
    "none on a pre-Hopper GPU: its occupancy comes from DCGM (see the dcgm check; the "
    "GPU Operator's host engine with dcgm.enabled=true) or only GPU-Util is served "
    '(gpu_occupancy_source{source="none"})'
)
_LISTINGS = (
    "nvmlDeviceGetComputeRunningProcesses",
    "nvmlDeviceGetGraphicsRunningProcesses",
    "nvmlDeviceGetMPSComputeRunningProcesses",
)


@dataclass(frozen=True)
class NvmlFindings:
    """The checks, and the GPUs found (index, UUID): the DCGM checks name them too."""

    checks: list[Check]
    gpus: list[tuple[int, str]]


def check_nvml(slow_interval_s: float = 0.0) -> NvmlFindings:
    """Blocking: run in a worker thread."""
    source = NvmlSource(slow_interval_s=slow_interval_s)
    try:
        snapshot = source.sample()
        if not snapshot.ok:
            return NvmlFindings(
                [missing("nvml", f"NVML cannot initialise: {snapshot.error}", RUNTIME_FIX)], []
            )
        checks = [
            ok(
                "nvml",
                f"NVML {snapshot.nvml_version or '?'}, CUDA driver API "
                f"{snapshot.cuda_driver_version or '?'}",
            ),
            _driver(snapshot.driver_version),
        ]
        if not snapshot.gpus:
            checks.append(missing("nvml.gpus", "NVML initialised but lists no GPU", NO_GPU_FIX))
            return NvmlFindings(checks, [])
        failed = [g for g in snapshot.gpus if g.error]
        names = sorted({g.name or "?" for g in snapshot.gpus})
        if failed:
            checks.append(
                degraded(
                    "nvml.gpus",
                    f"{len(snapshot.gpus)} GPU(s), {len(failed)} not readable: "
                    + ", ".join(f"gpu{g.index} {g.error}" for g in failed),
                    "a lost GPU needs a reset or the node drained (nvidia-smi -r); a "
                    f"permission error: {PERMISSION_FIX}",
                )
            )
        else:
            checks.append(ok("nvml.gpus", f"{len(snapshot.gpus)} GPU(s): {', '.join(names)}"))
        for gpu in snapshot.gpus:
            checks.extend(_per_gpu(gpu))
        return NvmlFindings(checks, [(g.index, g.uuid) for g in snapshot.gpus if not g.error])
    finally:
        source.close()


def _driver(version: str | None) -> Check:
    if not version:
        return degraded(
            "driver",
            "the driver version cannot be read (nvmlSystemGetDriverVersion failed)",
            "upgrade the NVIDIA driver to a supported branch (R535 or later)",
        )
    branch = version.split(".", 1)[0]
    if branch.isdigit() and int(branch) < 535:
        return degraded(
            "driver",
            f"driver {version}: before R535, some NVML calls the exporter uses are "
            "missing (clock-event reasons under their new name, the _v3 process "
            "listings); those series are absent",
            "upgrade the NVIDIA driver to R535 or later",
        )
    return ok("driver", f"driver {version}")


def _per_gpu(gpu: GpuSample) -> list[Check]:
    prefix = f"gpu{gpu.index}"
    if gpu.error:
        why = f"NVML cannot read this GPU ({gpu.error}): its own checks cannot run"
        return [
            degraded(f"{prefix}.{part}", why, "see nvml.gpus")
            for part in ("gpm", "mig", "processes")
        ]
    handle = pynvml.nvmlDeviceGetHandleByIndex(gpu.index)
    return [_gpm(prefix, handle, gpu), _mig(prefix, handle), _processes(prefix, handle, gpu)]


def _gpm(prefix: str, handle: Any, gpu: GpuSample) -> Check:
    name = f"{prefix}.gpm"
    try:
        supported = bool(pynvml.nvmlGpmQueryDeviceSupport(handle).isSupportedDevice)
    except UNSUPPORTED:
        supported = False
    except pynvml.NVMLError as exc:
        return degraded(name, f"GPM support cannot be read: {error_name(exc)}", PERMISSION_FIX)
    if not supported:
        return degraded(
            name,
            f"{gpu.name or 'this GPU'} has no GPM (Hopper and later have it): no SM "
            "occupancy, tensor or DRAM activity from NVML",
            GPM_FIX,
        )
    sample = pynvml.nvmlGpmSampleAlloc()
    try:
        if gpu.mig_enabled:
            gpu_instance = _first_gpu_instance(handle)
            if gpu_instance is None:
                return degraded(
                    name,
                    "MIG is on and no GPU instance is readable: GPM cannot be sampled",
                    f"create MIG instances (nvidia-smi mig -cgi ...) or see {prefix}.mig",
                )
            pynvml.nvmlGpmMigSampleGet(handle, gpu_instance, sample)
        else:
            pynvml.nvmlGpmSampleGet(handle, sample)
    except UNSUPPORTED:
        return degraded(name, "GPM sample: not supported", GPM_FIX)
    except pynvml.NVMLError as exc:
        return degraded(
            name,
            f"GPM is supported but a sample fails: {error_name(exc)} (no occupancy from "
            "NVML; an unprivileged container can lose GPM permission mid-run, "
            "DCGM issue #214)",
            PERMISSION_FIX,
        )
    finally:
        _quietly(pynvml.nvmlGpmSampleFree, sample)
    return ok(name, "GPM supported and sampled")


def _first_gpu_instance(handle: Any) -> int | None:
    try:
        mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
        return int(pynvml.nvmlDeviceGetGpuInstanceId(mig))
    except pynvml.NVMLError:
        return None


def _mig(prefix: str, handle: Any) -> Check:
    name = f"{prefix}.mig"
    try:
        current, pending = pynvml.nvmlDeviceGetMigMode(handle)
    except UNSUPPORTED:
        return ok(name, "not MIG-capable: whole GPU")
    except pynvml.NVMLError as exc:
        return degraded(
            name,
            f"MIG mode cannot be read: {error_name(exc)}; MIG instances are not reported",
            PERMISSION_FIX,
        )
    enabled = current == pynvml.NVML_DEVICE_MIG_ENABLE
    if current != pending:
        return degraded(
            name,
            f"MIG mode {'on' if enabled else 'off'}, a change to "
            f"{'on' if pending == pynvml.NVML_DEVICE_MIG_ENABLE else 'off'} is pending",
            "reset the GPU (nvidia-smi -r) or reboot the node to apply the pending MIG mode",
        )
    if not enabled:
        return ok(name, "MIG off: whole GPU")
    try:
        count = pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)
        found = 0
        for index in range(count):
            try:
                pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            except pynvml.NVMLError_NotFound:
                continue
            found += 1
    except pynvml.NVMLError as exc:
        return degraded(
            name, f"MIG on, but its instances cannot be read: {error_name(exc)}", PERMISSION_FIX
        )
    return ok(name, f"MIG on: {found} instance(s), each reported")


def _processes(prefix: str, handle: Any, gpu: GpuSample) -> Check:
    """May this process list the GPU's processes (on a MIG GPU: its first instance's)?"""
    name = f"{prefix}.processes"
    target = handle
    if gpu.mig_enabled:
        try:
            target = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, 0)
        except pynvml.NVMLError:
            return degraded(name, "MIG on with no readable instance: nothing to list", "")
    lister = ProcessLister()
    listed = 0
    suffix = process_listing_suffix()  # the entry points the exporter calls
    for listing in _LISTINGS:
        entry = listing + suffix
        try:
            listed += len(lister.list(entry, target))
        except UNSUPPORTED:
            continue
        except pynvml.NVMLError as exc:
            return missing(
                name,
                f"{entry} fails: {error_name(exc)}: no GPU process can be attributed to a pod",
                PERMISSION_FIX,
            )
    return ok(name, f"process listings answer, {suffix} ({listed} process(es) now)")


def _quietly(fn: Callable[..., object], *args: object) -> None:
    with contextlib.suppress(pynvml.NVMLError):
        fn(*args)
