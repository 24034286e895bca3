"""XID event registration on a real driver, whole GPUs and MIG.

The exporter's listener registers XID critical errors on each GPU's own handle, as the
device plugin does (k8s-device-plugin internal/rm/health.go ``registerDevices``), and
reads MIG attribution from the event's gpuInstanceId/computeInstanceId; the simulator
accepts registration on any handle (exporter/sim/nvml_library.py
``nvmlDeviceRegisterEvents``). What NVML answers on a MIG device handle itself, and
whether NO_PERMISSION appears without MIG monitoring rights (docs/validation.md), is
printed by the MIG check.
"""

from __future__ import annotations

import time
from typing import Any

import pynvml
import pytest

from exporter.sources.nvml_codes import error_name
from exporter.sources.xid import XidListener
from tests.gpu.conftest import requires_gpu

pytestmark = [requires_gpu, pytest.mark.gpu]

XID = pynvml.nvmlEventTypeXidCriticalError


def test_xid_event_set_registers_and_times_out_quietly(real_nvml: None) -> None:
    events: list[object] = []
    listener = XidListener(events.append)
    listener.start()
    try:
        time.sleep(3.0)
        assert listener.alive
        assert listener.registered, "no GPU accepted XID event registration"
        assert listener.errors_total == 0, listener.last_error
    finally:
        listener.stop()
    assert events == []  # a healthy GPU raises no XIDs in 3 s


def test_stop_interrupts_the_drivers_wait(real_nvml: None) -> None:
    """nvml.h: the wait returns NVML_ERROR_TIMEOUT "if ... interrupt arrived"; the
    listener's stop() relies on it (docs/xid.md). Record what this driver did in
    docs/validation.md either way."""
    listener = XidListener(lambda event: None)
    listener.start()
    try:
        time.sleep(1.0)  # registered, and inside a 2.5 s wait
        assert listener.wait_timeout_ms == 2500, "no handler for the interrupt signal"
    finally:
        started = time.monotonic()
        listener.stop()
        took = time.monotonic() - started
    print(f"stop() took {took:.3f} s with a {listener.wait_timeout_ms} ms wait")
    assert not listener.alive
    assert took < 0.5, f"the driver's wait did not return on the signal ({took:.2f} s)"
    assert listener.errors_total == 0, listener.last_error


def _register(handle: Any) -> dict[str, str]:
    """Supported event types, XID registration and a 200 ms wait on a fresh event set."""
    answers = {}
    try:
        supported = pynvml.nvmlDeviceGetSupportedEventTypes(handle)
        answers["supported"] = "xid" if supported & XID else f"no xid (mask {supported:#x})"
    except pynvml.NVMLError as exc:
        answers["supported"] = error_name(exc)
    event_set = pynvml.nvmlEventSetCreate()
    try:
        pynvml.nvmlDeviceRegisterEvents(handle, XID, event_set)
        answers["register"] = "Success"
        try:
            data = pynvml.nvmlEventSetWait_v2(event_set, 200)
            answers["wait"] = (
                f"event xid {data.eventData} gi {data.gpuInstanceId} ci {data.computeInstanceId}"
            )
        except pynvml.NVMLError as exc:
            answers["wait"] = error_name(exc)
    except pynvml.NVMLError as exc:
        answers["register"] = error_name(exc)
    finally:
        pynvml.nvmlEventSetFree(event_set)
    return answers


def _mig_gpus() -> list[tuple[int, Any]]:
    found = []
    for index in range(pynvml.nvmlDeviceGetCount()):
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        try:
            if pynvml.nvmlDeviceGetMigMode(handle)[0] == pynvml.NVML_DEVICE_MIG_ENABLE:
                found.append((index, handle))
        except pynvml.NVMLError_NotSupported:
            continue
    return found


def test_xid_events_register_on_mig_gpus_and_their_instances(nvml: None) -> None:
    gpus = _mig_gpus()
    if not gpus:
        pytest.skip("no GPU is in MIG mode")
    parents, instances = {}, {}
    for index, handle in gpus:
        parents[index] = _register(handle)
        for slot in range(pynvml.nvmlDeviceGetMaxMigDeviceCount(handle)):
            try:
                mig = pynvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)
            except pynvml.NVMLError:
                continue
            gi = pynvml.nvmlDeviceGetGpuInstanceId(mig)
            ci = pynvml.nvmlDeviceGetComputeInstanceId(mig)
            instances[f"gpu {index} mig {slot} (gi {gi}, ci {ci})"] = _register(mig)
    listener = XidListener(lambda event: None)
    listener.start()
    try:
        time.sleep(3.0)
        registered = listener.registered
    finally:
        listener.stop()
    print(f"\nMIG-mode GPUs: {parents}\ntheir instances: {instances}")
    print(f"exporter's listener registered GPUs {registered}")
    for index, answers in parents.items():
        assert answers["register"] == "Success", (index, answers)
        assert answers["wait"] == "Timeout", (index, answers)
    for label, answers in instances.items():
        assert answers["register"] not in {"GpuIsLost", "Unknown"}, (label, answers)
    assert set(parents) <= set(registered)
