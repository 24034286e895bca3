"""Stand-in for DCGM's ``dcgm_agent`` Python binding, with a fake host engine behind it.

The real module wraps ``libdcgm.so.4`` C calls one-to-one; this one keeps the same
function names, signatures, argument conversion (``str`` -> ``bytes``) and return
shapes (``c_void_p`` handles and ids, ctypes structures, ``_dcgmCheckReturn`` on every
status), and answers from a JSON state file named by ``FAKE_DCGM_STATE``. The file is
re-read on every call, so a test changes the node mid-run by rewriting it.

State keys (all optional)::

    library_found   bool, default true: false -> _dcgmInit raises LibraryNotFound
    library_dirs    ["/usr/lib/x86_64-linux-gnu", ...]: the system directories; with
                    this key the library is found only as a file libdcgm.so.4 in the
                    loader's directory argument, $LD_LIBRARY_PATH or one of these
                    (dcgm_structs._LoadDcgmLibrary), as DCGM 4 looks for it
    hostengines     ["127.0.0.1:5555", ...] addresses that accept connections; a
                    connected handle whose address disappears gets ConnectionNotValid
    failed_connect_waits  bool, default false: a connection that fails takes the
                    caller's ``timeoutMs`` (0: 5 s) first, as real DCGM 4 does: it
                    retries every 50 ms until the timeout (DcgmClientHandler.cpp
                    GetConnHandleForHostEngine), and a black-holed address (a
                    Service with internalTrafficPolicy Local and no endpoint on this
                    node) waits the whole timeout. Off by default to keep tests fast.
    embedded        bool, default true: dcgmStartEmbedded succeeds
    embedded_error  DCGM_ST_* suffix returned when embedded is false (default INIT_ERROR)
    gpus            [{"id": 0, "uuid": "GPU-...", "arch": "ampere",
                      "fields": {"1002": 0.5, ...}}]
                    a field value is a number, "blank", "not_supported", or
                    {"status": "NO_DATA"}; a missing field reads as blank. ``arch``
                    (default "hopper") is what dcgmGetGpuChipArchitecture answers
    chip_architecture  bool, default true: false -> libdcgm lacks
                    dcgmGetGpuChipArchitecture (before DCGM 4.2.3): FunctionNotFound
    profiling_held_by  name of another profiling client (e.g. "dcgm-exporter") that
                    holds the profiling counters of every pre-Hopper GPU: watching
                    profiling fields (1001-1099) on a group with such a GPU returns
                    ``profiling_held_status`` (default IN_USE, as dcgmproftester
                    reports "Another process is already using the profiling
                    infrastructure"). Hopper and newer (GPM) have no such limit.
    health          {"overall": "warn" (default: worst incident),
                     "incidents": [{"gpu": 0, "entity_group": 1, "system": "MEM",
                                    "health": "fail", "message": "...", "code": 0}]}
    max_profiling_fields  watching more profiling fields (1001-1099) at once than this
                    returns PROFILING_MULTI_PASS, as too many passes do on pre-Hopper
    errors          {"dcgmWatchFields": "PROFILING_NOT_SUPPORTED", ...} make that
                    function return that status
    calls_log       path of a JSON-lines file that receives every call (for assertions),
                    written when the call starts: ``dcgmConnect_v3`` entries carry the
                    ``target`` in the order tried, ``dcgmStartEmbedded`` marks an
                    embedded host engine

Behaviour kept from the real engine (docs of ``dcgmHealthCheck``): the first health
check after ``dcgmHealthSet`` only creates state and reports no incidents.
"""

from __future__ import annotations

import functools
import itertools
import json
import threading
import time
from collections.abc import Callable
from ctypes import CFUNCTYPE, POINTER, c_int32, c_uint32, c_void_p
from dataclasses import dataclass, field
from typing import Any, TypeVar

import dcgm_fields
import dcgm_structs
import dcgmvalue

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_PORT = 5555


def ensure_byte_strings() -> Callable[[F], F]:
    """As in the binding: every ``str`` argument reaches the C layer as UTF-8 bytes."""

    def decorator(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            newargs = tuple(bytes(a, "utf-8") if isinstance(a, str) else a for a in args)
            newkwargs = {
                k: bytes(v, "utf-8") if isinstance(v, str) else v for k, v in kwargs.items()
            }
            return fn(*newargs, **newkwargs)

        return wrapper  # type: ignore[return-value]

    return decorator


# ---------------------------------------------------------------------------
# The fake engine
# ---------------------------------------------------------------------------


@dataclass
class _Engine:
    kind: str  # "embedded" | "remote"
    address: str | None
    groups: dict[int, list[int]] = field(default_factory=dict)
    field_groups: dict[int, list[int]] = field(default_factory=dict)
    watched: set[tuple[int, int]] = field(default_factory=set)
    health_systems: dict[int, int] = field(default_factory=dict)
    health_primed: set[int] = field(default_factory=set)


_lock = threading.Lock()
_ids = itertools.count(1)
_engines: dict[int, _Engine] = {}


def _value(obj: Any) -> int:
    """Handles and ids arrive as ``c_void_p`` (or plain ints for the static groups)."""
    if isinstance(obj, c_void_p):
        return int(obj.value or 0)
    return int(obj)


def _status(name: str) -> int:
    return int(getattr(dcgm_structs, f"DCGM_ST_{name}"))


def _log(state: dict[str, Any], fn: str, **details: Any) -> None:
    path = state.get("calls_log")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"fn": fn, **details}) + "\n")


def _enter(fn: str, dcgm_handle: Any = None, **details: Any) -> tuple[dict[str, Any], _Engine]:
    """Common prologue: library loaded, call logged, injected error, live connection."""
    if dcgm_structs.dcgmLib is None:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_UNINITIALIZED)
    state = dcgm_structs._fake_state()
    _log(state, fn, **details)
    injected = state.get("errors", {}).get(fn)
    if injected:
        dcgm_structs._dcgmCheckReturn(_status(injected))
    engine = _engines.get(_value(dcgm_handle)) if dcgm_handle is not None else None
    if dcgm_handle is not None:
        if engine is None:
            dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_BADPARAM)
        assert engine is not None
        if engine.kind == "remote" and engine.address not in state.get("hostengines", []):
            dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_CONNECTION_NOT_VALID)
    return state, engine or _Engine(kind="none", address=None)


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _new_handle(engine: _Engine) -> c_void_p:
    with _lock:
        handle = next(_ids)
        _engines[handle] = engine
    return c_void_p(handle)


def _gpus(state: dict[str, Any]) -> list[dict[str, Any]]:
    return list(state.get("gpus", []))


def _group_gpus(engine: _Engine, state: dict[str, Any], group_id: int) -> list[int]:
    if group_id in (dcgm_structs.DCGM_GROUP_ALL_GPUS, dcgm_structs.DCGM_GROUP_DEFAULT):
        return [int(g["id"]) for g in _gpus(state)]
    if group_id not in engine.groups:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_NOT_CONFIGURED)
    return list(engine.groups[group_id])


# ---------------------------------------------------------------------------
# Admin
# ---------------------------------------------------------------------------


@ensure_byte_strings()
def dcgmInit() -> int:
    _enter("dcgmInit")
    return dcgm_structs.DCGM_ST_OK


@ensure_byte_strings()
def dcgmShutdown() -> int:
    _enter("dcgmShutdown")
    return dcgm_structs.DCGM_ST_OK


@ensure_byte_strings()
def dcgmStartEmbedded(opMode: int) -> c_void_p:
    state, _ = _enter("dcgmStartEmbedded", opMode=opMode)
    if not state.get("embedded", True):
        dcgm_structs._dcgmCheckReturn(_status(state.get("embedded_error", "INIT_ERROR")))
    return _new_handle(_Engine(kind="embedded", address=None))


@ensure_byte_strings()
def dcgmStopEmbedded(dcgm_handle: Any) -> int:
    _enter("dcgmStopEmbedded")
    with _lock:
        engine = _engines.pop(_value(dcgm_handle), None)
    if engine is None or engine.kind != "embedded":
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_BADPARAM)
    return dcgm_structs.DCGM_ST_OK


@ensure_byte_strings()
def dcgmConnect_v3(
    connection_string: bytes | str,  # bytes once ensure_byte_strings ran
    connectParams: Any,
    version: int = dcgm_structs.c_dcgmConnectV3Params_version,
) -> c_void_p:
    connectParams.version = version
    target = _text(connection_string)
    state, _ = _enter("dcgmConnect_v3", target=target, timeoutMs=int(connectParams.timeoutMs))
    scheme, _, address = target.partition("://")
    if scheme != "tcp" or not address:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_BADPARAM)
    if ":" not in address:
        address = f"{address}:{DEFAULT_PORT}"
    if address not in state.get("hostengines", []):
        if state.get("failed_connect_waits", False):
            time.sleep((int(connectParams.timeoutMs) or 5000) / 1000)
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_CONNECTION_NOT_VALID)
    return _new_handle(_Engine(kind="remote", address=address))


@ensure_byte_strings()
def dcgmDisconnect(dcgm_handle: Any) -> int:
    # A vanished host engine still lets the client tear its side down.
    with _lock:
        engine = _engines.pop(_value(dcgm_handle), None)
    _log(dcgm_structs._fake_state(), "dcgmDisconnect")
    if engine is None or engine.kind != "remote":
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_BADPARAM)
    return dcgm_structs.DCGM_ST_OK


# ---------------------------------------------------------------------------
# Discovery
# ---------------------------------------------------------------------------


@ensure_byte_strings()
def dcgmGetAllSupportedDevices(dcgm_handle: Any) -> list[int]:
    state, _ = _enter("dcgmGetAllSupportedDevices", dcgm_handle)
    return [int(g["id"]) for g in _gpus(state)]


@ensure_byte_strings()
def dcgmGetAllDevices(dcgm_handle: Any) -> list[int]:
    state, _ = _enter("dcgmGetAllDevices", dcgm_handle)
    return [int(g["id"]) for g in _gpus(state)]


_ARCHITECTURES = {
    name: int(getattr(dcgm_structs, f"DCGM_CHIP_ARCH_{name.upper()}"))
    for name in [
        *("older", "kepler", "maxwell", "pascal", "volta", "turing", "ampere", "ada"),
        *("hopper", "blackwell", "unknown"),
    ]
}


def _pre_hopper(gpu: dict[str, Any]) -> bool:
    return _ARCHITECTURES[gpu.get("arch", "hopper")] < dcgm_structs.DCGM_CHIP_ARCH_HOPPER


@ensure_byte_strings()
def dcgmGetGpuChipArchitecture(dcgm_handle: Any, gpuId: int) -> int:
    state, _ = _enter("dcgmGetGpuChipArchitecture", dcgm_handle, gpuId=gpuId)
    if not state.get("chip_architecture", True):
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_FUNCTION_NOT_FOUND)
    for gpu in _gpus(state):
        if int(gpu["id"]) == gpuId:
            return _ARCHITECTURES[gpu.get("arch", "hopper")]
    dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_BADPARAM)
    raise AssertionError("unreachable: _dcgmCheckReturn raises for BADPARAM")


@ensure_byte_strings()
def dcgmGetDeviceAttributes(
    dcgm_handle: Any, gpuId: int, version: int = dcgm_structs.dcgmDeviceAttributes_version3
) -> Any:
    state, _ = _enter("dcgmGetDeviceAttributes", dcgm_handle, gpuId=gpuId)
    if version != dcgm_structs.dcgmDeviceAttributes_version3:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_VER_MISMATCH)
    for gpu in _gpus(state):
        if int(gpu["id"]) == gpuId:
            attributes = dcgm_structs.c_dcgmDeviceAttributes_v3()
            attributes.version = version
            attributes.identifiers.uuid = gpu["uuid"]
            attributes.identifiers.deviceName = gpu.get("name", "NVIDIA H100 80GB HBM3")
            attributes.identifiers.pciBusId = gpu.get("pci_bus_id", f"00000000:{gpuId:02X}:00.0")
            return attributes
    dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_BADPARAM)


# ---------------------------------------------------------------------------
# Groups and field groups
# ---------------------------------------------------------------------------


@ensure_byte_strings()
def dcgmGroupCreate(dcgm_handle: Any, type: int, groupName: bytes | str | None) -> c_void_p:
    state, engine = _enter("dcgmGroupCreate", dcgm_handle, groupName=_text(groupName or b""))
    group_id = next(_ids)
    if type == dcgm_structs.DCGM_GROUP_DEFAULT:
        engine.groups[group_id] = [int(g["id"]) for g in _gpus(state)]
    else:
        engine.groups[group_id] = []
    return c_void_p(group_id)


@ensure_byte_strings()
def dcgmGroupDestroy(dcgm_handle: Any, group_id: Any) -> int:
    _, engine = _enter("dcgmGroupDestroy", dcgm_handle)
    if engine.groups.pop(_value(group_id), None) is None:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_NOT_CONFIGURED)
    return dcgm_structs.DCGM_ST_OK


@ensure_byte_strings()
def dcgmGroupAddDevice(dcgm_handle: Any, group_id: Any, gpu_id: int) -> int:
    state, engine = _enter("dcgmGroupAddDevice", dcgm_handle, gpu_id=gpu_id)
    members = engine.groups.get(_value(group_id))
    if members is None or gpu_id not in [int(g["id"]) for g in _gpus(state)]:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_BADPARAM)
    assert members is not None
    members.append(gpu_id)
    return dcgm_structs.DCGM_ST_OK


@ensure_byte_strings()
def dcgmGroupGetInfo(
    dcgm_handle: Any, group_id: Any, version: int = dcgm_structs.c_dcgmGroupInfo_version3
) -> Any:
    state, engine = _enter("dcgmGroupGetInfo", dcgm_handle)
    info = dcgm_structs.c_dcgmGroupInfo_v3()
    info.version = version
    members = _group_gpus(engine, state, _value(group_id))
    info.count = len(members)
    for i, gpu_id in enumerate(members):
        info.entityList[i].entityGroupId = dcgm_fields.DCGM_FE_GPU
        info.entityList[i].entityId = gpu_id
    return info


@ensure_byte_strings()
def dcgmFieldGroupCreate(
    dcgm_handle: Any, fieldIds: list[int], fieldGroupName: bytes | str
) -> c_void_p:
    _, engine = _enter("dcgmFieldGroupCreate", dcgm_handle, fieldIds=list(fieldIds))
    if not fieldIds:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_BADPARAM)
    field_group_id = next(_ids)
    engine.field_groups[field_group_id] = list(fieldIds)
    return c_void_p(field_group_id)


@ensure_byte_strings()
def dcgmFieldGroupDestroy(dcgm_handle: Any, fieldGroupId: Any) -> int:
    _, engine = _enter("dcgmFieldGroupDestroy", dcgm_handle)
    if engine.field_groups.pop(_value(fieldGroupId), None) is None:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_NO_DATA)
    return dcgm_structs.DCGM_ST_OK


# ---------------------------------------------------------------------------
# Field values
# ---------------------------------------------------------------------------


@ensure_byte_strings()
def dcgmWatchFields(
    dcgm_handle: Any,
    groupId: Any,
    fieldGroupId: Any,
    updateFreq: int,
    maxKeepAge: float,
    maxKeepSamples: int,
) -> int:
    state, engine = _enter(
        "dcgmWatchFields",
        dcgm_handle,
        updateFreq=updateFreq,
        maxKeepAge=maxKeepAge,
        maxKeepSamples=maxKeepSamples,
    )
    group_id, field_group_id = _value(groupId), _value(fieldGroupId)
    if not _group_gpus(engine, state, group_id):
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_GROUP_IS_EMPTY)
    if field_group_id not in engine.field_groups:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_NOT_CONFIGURED)
    limit = state.get("max_profiling_fields")
    profiling = [f for f in engine.field_groups[field_group_id] if 1001 <= f <= 1099]
    if limit is not None and len(profiling) > int(limit):
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_PROFILING_MULTI_PASS)
    members = set(_group_gpus(engine, state, group_id))
    if (
        profiling
        and state.get("profiling_held_by")
        and any(_pre_hopper(g) for g in _gpus(state) if int(g["id"]) in members)
    ):
        dcgm_structs._dcgmCheckReturn(_status(state.get("profiling_held_status", "IN_USE")))
    engine.watched.add((group_id, field_group_id))
    return dcgm_structs.DCGM_ST_OK


@ensure_byte_strings()
def dcgmUnwatchFields(dcgm_handle: Any, groupId: Any, fieldGroupId: Any) -> int:
    _, engine = _enter("dcgmUnwatchFields", dcgm_handle)
    engine.watched.discard((_value(groupId), _value(fieldGroupId)))
    return dcgm_structs.DCGM_ST_OK


@ensure_byte_strings()
def dcgmUpdateAllFields(dcgm_handle: Any, waitForUpdate: int) -> int:
    _enter("dcgmUpdateAllFields", dcgm_handle, waitForUpdate=int(waitForUpdate))
    return dcgm_structs.DCGM_ST_OK


dcgmFieldValueEnumeration_f = CFUNCTYPE(
    c_int32, c_uint32, POINTER(dcgm_structs.c_dcgmFieldValue_v1), c_int32, c_void_p
)
dcgmFieldValueEntityEnumeration_f = CFUNCTYPE(
    c_int32, c_uint32, c_uint32, POINTER(dcgm_structs.c_dcgmFieldValue_v1), c_int32, c_void_p
)


def _field_value(field_id: int, spec: Any, watched: bool) -> Any:
    value = dcgm_structs.c_dcgmFieldValue_v1()
    value.version = dcgm_structs.dcgmFieldValue_version1
    value.fieldId = field_id
    value.fieldType = ord(dcgm_fields.DCGM_FT_DOUBLE)
    value.ts = int(time.time() * 1_000_000)  # usec since the epoch
    value.status = dcgm_structs.DCGM_ST_OK
    if not watched:
        value.status = dcgm_structs.DCGM_ST_NOT_WATCHED
    elif isinstance(spec, dict):
        value.status = _status(spec["status"])
    elif spec is None or spec == "blank":
        value.value.dbl = dcgmvalue.DCGM_FP64_BLANK
    elif spec == "not_supported":
        value.value.dbl = dcgmvalue.DCGM_FP64_NOT_SUPPORTED
    else:
        value.value.dbl = float(spec)
    return value


@ensure_byte_strings()
def dcgmGetLatestValues(
    dcgm_handle: Any, groupId: Any, fieldGroupId: Any, enumCB: Any, userData: Any
) -> int:
    """Calls ``enumCB(gpuId, values, numValues, userData)`` once per GPU, as the C side does.

    The real call passes ``py_object(userData)`` to C, which hands the object's address
    back to the callback; ``id()`` is that address in CPython.
    """
    state, engine = _enter("dcgmGetLatestValues", dcgm_handle)
    group_id, field_group_id = _value(groupId), _value(fieldGroupId)
    field_ids = engine.field_groups.get(field_group_id)
    if field_ids is None:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_NOT_CONFIGURED)
    assert field_ids is not None
    watched = (group_id, field_group_id) in engine.watched
    by_id = {int(g["id"]): g for g in _gpus(state)}
    for gpu_id in _group_gpus(engine, state, group_id):
        specs = by_id.get(gpu_id, {}).get("fields", {})
        values = (dcgm_structs.c_dcgmFieldValue_v1 * len(field_ids))(
            *(_field_value(fid, specs.get(str(fid)), watched) for fid in field_ids)
        )
        enumCB(gpu_id, values, len(field_ids), id(userData))
    return dcgm_structs.DCGM_ST_OK


# ---------------------------------------------------------------------------
# Health
# ---------------------------------------------------------------------------

_RESULTS = {
    "pass": dcgm_structs.DCGM_HEALTH_RESULT_PASS,
    "warn": dcgm_structs.DCGM_HEALTH_RESULT_WARN,
    "fail": dcgm_structs.DCGM_HEALTH_RESULT_FAIL,
}


@ensure_byte_strings()
def dcgmHealthSet(dcgm_handle: Any, groupId: Any, systems: int) -> int:
    state, engine = _enter("dcgmHealthSet", dcgm_handle, systems=systems)
    group_id = _value(groupId)
    _group_gpus(engine, state, group_id)
    engine.health_systems[group_id] = systems
    engine.health_primed.discard(group_id)
    return dcgm_structs.DCGM_ST_OK


@ensure_byte_strings()
def dcgmHealthGet(dcgm_handle: Any, groupId: Any) -> int:
    _, engine = _enter("dcgmHealthGet", dcgm_handle)
    return engine.health_systems.get(_value(groupId), 0)


@ensure_byte_strings()
def dcgmHealthCheck(
    dcgm_handle: Any, groupId: Any, version: int = dcgm_structs.dcgmHealthResponse_version5
) -> Any:
    if version != dcgm_structs.dcgmHealthResponse_version5:
        dcgm_structs._dcgmCheckReturn(dcgm_structs.DCGM_ST_VER_MISMATCH)
    state, engine = _enter("dcgmHealthCheck", dcgm_handle)
    group_id = _value(groupId)
    members = _group_gpus(engine, state, group_id)
    response = dcgm_structs.c_dcgmHealthResponse_v5()
    response.version = version
    response.overallHealth = dcgm_structs.DCGM_HEALTH_RESULT_PASS
    systems = engine.health_systems.get(group_id, 0)
    if group_id not in engine.health_primed:
        engine.health_primed.add(group_id)  # first check: state only, no results
        return response
    health = state.get("health", {})
    worst = dcgm_structs.DCGM_HEALTH_RESULT_PASS
    count = 0
    for incident in health.get("incidents", []):
        system = int(getattr(dcgm_structs, f"DCGM_HEALTH_WATCH_{incident['system']}"))
        entity_group = int(incident.get("entity_group", dcgm_fields.DCGM_FE_GPU))
        if not systems & system:
            continue
        if entity_group == dcgm_fields.DCGM_FE_GPU and incident["gpu"] not in members:
            continue
        result = _RESULTS[incident["health"]]
        slot = response.incidents[count]
        slot.system = system
        slot.health = result
        slot.error.msg = incident.get("message", "")
        slot.error.code = int(incident.get("code", 0))
        slot.entityInfo.entityGroupId = entity_group
        slot.entityInfo.entityId = int(incident["gpu"])
        worst = max(worst, result)
        count += 1
    response.incidentCount = count
    overall = health.get("overall")
    response.overallHealth = _RESULTS[overall] if overall else worst
    return response
