# ruff: noqa: E501
"""Stand-in for DCGM's ``dcgm_structs`` Python binding (tests only).

Mirrors the names, values and value shapes of NVIDIA DCGM's
``testing/python3/dcgm_structs.py`` (Apache-2.0, https://github.com/NVIDIA/DCGM) for
the subset ``exporter.sources.dcgm`` touches: status codes and the ``DCGMError``
class-per-code hierarchy, operation modes, group ids, health constants, and ctypes
structures whose ``c_char`` fields read back as ``str`` (``_DcgmStructure``).

Instead of loading ``libdcgm.so.4``, ``_dcgmInit`` consults the fake engine state
(see ``dcgm_agent``): ``"library_found": false`` reproduces a node without DCGM.
"""

from __future__ import annotations

import json
import os
import string
import sys
import threading
from ctypes import (
    Structure,
    Union,
    c_byte,
    c_char,
    c_double,
    c_int,
    c_int64,
    c_short,
    c_uint,
    c_uint32,
    c_ushort,
    sizeof,
)
from inspect import isclass
from typing import Any, ClassVar

DCGM_MAX_STR_LENGTH = 256
DCGM_MAX_NUM_DEVICES = 32
DCGM_MAX_BLOB_LENGTH = 4096
DCGM_GROUP_MAX_ENTITIES_V2 = 1024

DCGM_OPERATION_MODE_AUTO = 1
DCGM_OPERATION_MODE_MANUAL = 2

# dcgmGetGpuChipArchitecture's answers (DCGM 4.2.3+, testing/python3/dcgm_structs.py).
DCGM_CHIP_ARCH_OLDER = 1
DCGM_CHIP_ARCH_KEPLER = 2
DCGM_CHIP_ARCH_MAXWELL = 3
DCGM_CHIP_ARCH_PASCAL = 4
DCGM_CHIP_ARCH_VOLTA = 5
DCGM_CHIP_ARCH_TURING = 6
DCGM_CHIP_ARCH_AMPERE = 7
DCGM_CHIP_ARCH_ADA = 8
DCGM_CHIP_ARCH_HOPPER = 9
DCGM_CHIP_ARCH_BLACKWELL = 10
DCGM_CHIP_ARCH_T3X = 11
DCGM_CHIP_ARCH_COUNT = 11
DCGM_CHIP_ARCH_UNKNOWN = 0xFFFFFFFF

# Return codes (values copied from the real binding).
DCGM_ST_OK = 0
DCGM_ST_BADPARAM = -1
DCGM_ST_GENERIC_ERROR = -3
DCGM_ST_MEMORY = -4
DCGM_ST_NOT_CONFIGURED = -5
DCGM_ST_NOT_SUPPORTED = -6
DCGM_ST_INIT_ERROR = -7
DCGM_ST_NVML_ERROR = -8
DCGM_ST_PENDING = -9
DCGM_ST_UNINITIALIZED = -10
DCGM_ST_TIMEOUT = -11
DCGM_ST_VER_MISMATCH = -12
DCGM_ST_UNKNOWN_FIELD = -13
DCGM_ST_NO_DATA = -14
DCGM_ST_STALE_DATA = -15
DCGM_ST_NOT_WATCHED = -16
DCGM_ST_NO_PERMISSION = -17
DCGM_ST_GPU_IS_LOST = -18
DCGM_ST_RESET_REQUIRED = -19
DCGM_ST_FUNCTION_NOT_FOUND = -20
DCGM_ST_CONNECTION_NOT_VALID = -21
DCGM_ST_GPU_NOT_SUPPORTED = -22
DCGM_ST_GROUP_INCOMPATIBLE = -23
DCGM_ST_MAX_LIMIT = -24
DCGM_ST_LIBRARY_NOT_FOUND = -25
DCGM_ST_DUPLICATE_KEY = -26
DCGM_ST_GPU_IN_SYNC_BOOST_GROUP = -27
DCGM_ST_GPU_NOT_IN_SYNC_BOOST_GROUP = -28
DCGM_ST_REQUIRES_ROOT = -29
DCGM_ST_NVVS_ERROR = -30
DCGM_ST_INSUFFICIENT_SIZE = -31
DCGM_ST_FIELD_UNSUPPORTED_BY_API = -32
DCGM_ST_MODULE_NOT_LOADED = -33
DCGM_ST_IN_USE = -34
DCGM_ST_GROUP_IS_EMPTY = -35
DCGM_ST_PROFILING_NOT_SUPPORTED = -36
DCGM_ST_PROFILING_LIBRARY_ERROR = -37
DCGM_ST_PROFILING_MULTI_PASS = -38
DCGM_ST_DIAG_ALREADY_RUNNING = -39
DCGM_ST_DIAG_BAD_JSON = -40
DCGM_ST_DIAG_BAD_LAUNCH = -41
DCGM_ST_DIAG_UNUSED = -42
DCGM_ST_DIAG_THRESHOLD_EXCEEDED = -43
DCGM_ST_INSUFFICIENT_DRIVER_VERSION = -44
DCGM_ST_INSTANCE_NOT_FOUND = -45
DCGM_ST_COMPUTE_INSTANCE_NOT_FOUND = -46
DCGM_ST_CHILD_NOT_KILLED = -47
DCGM_ST_3RD_PARTY_LIBRARY_ERROR = -48
DCGM_ST_INSUFFICIENT_RESOURCES = -49
DCGM_ST_PLUGIN_EXCEPTION = -50
DCGM_ST_NVVS_ISOLATE_ERROR = -51
DCGM_ST_NVVS_BINARY_NOT_FOUND = -52
DCGM_ST_NVVS_KILLED = -53
DCGM_ST_PAUSED = -54
DCGM_ST_ALREADY_INITIALIZED = -55
DCGM_ST_NVML_NOT_LOADED = -56
DCGM_ST_NVML_DRIVER_TIMEOUT = -57
DCGM_ST_NVVS_NO_AVAILABLE_TEST = -58
DCGM_ST_MNDIAG_CONNECTION_NOT_AVAILABLE = -59
DCGM_ST_MNDIAG_CONNECTION_UNAUTHORIZED = -60
DCGM_ST_REMOTE_SSH_CONNECTION_FAILED = -61
DCGM_ST_CHILD_SPAWN_FAILED = -62
DCGM_ST_FILE_IO_ERROR = -63
DCGM_ST_CHILD_SIGNAL_RECEIVED = -64
DCGM_ST_CALLER_ALREADY_STOPPED = -65
DCGM_ST_DIAG_STOPPED = -66
DCGM_ST_GPUS_DETACHED = -67

DCGM_GROUP_DEFAULT = 0  # All the GPUs on the node are added to the group
DCGM_GROUP_EMPTY = 1  # Creates an empty group
DCGM_GROUP_ALL_GPUS = 0x7FFFFFFF
DCGM_GROUP_ALL_NVSWITCHES = 0x7FFFFFFE

# Library handle: ``None`` until ``_dcgmInit`` "loads" it, as in the real module.
dcgmLib: Any = None
libLoadLock = threading.Lock()
_dcgmLib_refcount = 0


class DCGMError(Exception):
    """One subclass per ``DCGM_ST_*`` code, e.g. ``DCGMError_ConnectionNotValid``."""

    _valClassMapping: ClassVar[dict[int, type[DCGMError]]] = {}
    _error_code_to_string: ClassVar[dict[int, str]] = {
        DCGM_ST_OK: "Success",
        DCGM_ST_BADPARAM: "Bad parameter passed to function",
        DCGM_ST_GENERIC_ERROR: "Generic unspecified error",
        DCGM_ST_MEMORY: "Out of memory error",
        DCGM_ST_NOT_CONFIGURED: "Setting not configured",
        DCGM_ST_NOT_SUPPORTED: "Feature not supported",
        DCGM_ST_INIT_ERROR: "DCGM initialization error",
        DCGM_ST_NVML_ERROR: "NVML error",
        DCGM_ST_PENDING: "Object is in a pending state",
        DCGM_ST_UNINITIALIZED: "Object is in an undefined state",
        DCGM_ST_TIMEOUT: "Timeout",
        DCGM_ST_VER_MISMATCH: "API version mismatch",
        DCGM_ST_UNKNOWN_FIELD: "Unknown field",
        DCGM_ST_NO_DATA: "No data is available",
        DCGM_ST_STALE_DATA: "Data is considered stale",
        DCGM_ST_NOT_WATCHED: "Field is not being updated",
        DCGM_ST_NO_PERMISSION: "Not permissioned",
        DCGM_ST_GPU_IS_LOST: "GPU is unreachable",
        DCGM_ST_RESET_REQUIRED: "GPU requires a reset",
        DCGM_ST_FUNCTION_NOT_FOUND: "Unable to find function",
        DCGM_ST_CONNECTION_NOT_VALID: "The connection to the host engine is not valid any longer",
        DCGM_ST_GPU_NOT_SUPPORTED: "This GPU is not supported by DCGM",
        DCGM_ST_GROUP_INCOMPATIBLE: "GPUs are incompatible with each other for the requested operation",
        DCGM_ST_MAX_LIMIT: "Max limit reached for the object",
        DCGM_ST_LIBRARY_NOT_FOUND: "DCGM library could not be found",
        DCGM_ST_DUPLICATE_KEY: "Duplicate key passed to function",
        DCGM_ST_GPU_IN_SYNC_BOOST_GROUP: "GPU is already a part of a sync boost group",
        DCGM_ST_GPU_NOT_IN_SYNC_BOOST_GROUP: "GPU is not a part of the sync boost group",
        DCGM_ST_REQUIRES_ROOT: "This operation is not supported when the host engine is running as non root",
        DCGM_ST_NVVS_ERROR: "DCGM GPU Diagnostic returned an error.",
        DCGM_ST_INSUFFICIENT_SIZE: "An input argument is not large enough",
        DCGM_ST_FIELD_UNSUPPORTED_BY_API: "The given field ID is not supported by the API being called",
        DCGM_ST_MODULE_NOT_LOADED: "This request is serviced by a module of DCGM that is not currently loaded",
        DCGM_ST_IN_USE: "The requested operation could not be completed because the affected resource is in use",
        DCGM_ST_GROUP_IS_EMPTY: "The specified group is empty, and this operation is incompatible with an empty group",
        DCGM_ST_PROFILING_NOT_SUPPORTED: "Profiling is not supported for this group of GPUs or GPU",
        DCGM_ST_PROFILING_LIBRARY_ERROR: "The third-party Profiling module returned an unrecoverable error",
        DCGM_ST_PROFILING_MULTI_PASS: "The requested profiling metrics cannot be collected in a single pass",
        DCGM_ST_DIAG_ALREADY_RUNNING: "A diag instance is already running, cannot run a new diag until the current one finishes",
        DCGM_ST_DIAG_BAD_JSON: "The GPU Diagnostic returned Json that cannot be parsed.",
        DCGM_ST_DIAG_BAD_LAUNCH: "Error while launching the GPU Diagnostic.",
        DCGM_ST_DIAG_UNUSED: "Unused error code",
        DCGM_ST_DIAG_THRESHOLD_EXCEEDED: "A field value met or exceeded the error threshold.",
        DCGM_ST_INSUFFICIENT_DRIVER_VERSION: "The installed driver version is insufficient for this API",
        DCGM_ST_INSTANCE_NOT_FOUND: "The specified GPU instance does not exist",
        DCGM_ST_COMPUTE_INSTANCE_NOT_FOUND: "The specified GPU compute instance does not exist",
        DCGM_ST_CHILD_NOT_KILLED: "Couldn't kill a child process within the retries",
        DCGM_ST_3RD_PARTY_LIBRARY_ERROR: "Detected an error in a 3rd-party library",
        DCGM_ST_INSUFFICIENT_RESOURCES: "Not enough resources available",
        DCGM_ST_PLUGIN_EXCEPTION: "Exception thrown from a diagnostic plugin",
        DCGM_ST_NVVS_ISOLATE_ERROR: "The diagnostic returned an error that indicates the need for isolation",
        DCGM_ST_NVVS_BINARY_NOT_FOUND: "The NVVS binary was not found in the specified location",
        DCGM_ST_NVVS_KILLED: "The NVVS process was killed by a signal",
        DCGM_ST_PAUSED: "The hostengine and all modules are paused",
        DCGM_ST_ALREADY_INITIALIZED: "The object is already initialized",
        DCGM_ST_NVML_NOT_LOADED: "NVML couldn't be loaded on this system",
        DCGM_ST_NVML_DRIVER_TIMEOUT: "NVML driver timeout error was detected",
        DCGM_ST_NVVS_NO_AVAILABLE_TEST: "The NVVS returns no available tests (NVVS_ST_TEST_NOT_FOUND)",
        DCGM_ST_MNDIAG_CONNECTION_NOT_AVAILABLE: "No connection is currently authorized for multi-node diagnostic",
        DCGM_ST_MNDIAG_CONNECTION_UNAUTHORIZED: "The connection is not authorized for multi-node diagnostic operations",
        DCGM_ST_REMOTE_SSH_CONNECTION_FAILED: "An SSH connection to a remote hostengine failed",
        DCGM_ST_CHILD_SPAWN_FAILED: "A child process could not be spawned",
        DCGM_ST_FILE_IO_ERROR: "A file operation failed",
        DCGM_ST_CHILD_SIGNAL_RECEIVED: "A child process received a signal",
        DCGM_ST_CALLER_ALREADY_STOPPED: "The caller is already stopped",
        DCGM_ST_DIAG_STOPPED: "The DCGM Diagnostic was stopped",
        DCGM_ST_GPUS_DETACHED: "Cannot perform the requested operation because the GPUs are detached",
    }
    value: int
    info: Any

    def __new__(typ, value: int) -> DCGMError:
        if typ == DCGMError:
            typ = DCGMError._valClassMapping.get(value, typ)
        obj = Exception.__new__(typ)
        obj.info = None
        obj.value = value
        return obj

    def __str__(self) -> str:
        msg = DCGMError._error_code_to_string.get(self.value, f"DCGM Error with code {self.value}")
        if self.info is not None:
            msg = msg.rstrip(".") + f": '{self.info}'"
        return msg

    def __eq__(self, other: object) -> bool:
        return isinstance(other, DCGMError) and self.value == other.value

    def __hash__(self) -> int:
        return hash(self.value)

    def SetAdditionalInfo(self, msg: Any) -> None:
        self.info = msg


def dcgmExceptionClass(error_code: int) -> type[DCGMError] | None:
    return DCGMError._valClassMapping.get(error_code)


def _extractDCGMErrorsAsClasses() -> None:
    """``DCGM_ST_CONNECTION_NOT_VALID`` -> class ``DCGMError_ConnectionNotValid``."""
    this_module = sys.modules[__name__]
    for err_name in [x for x in dir(this_module) if x.startswith("DCGM_ST_")]:
        class_name = "DCGMError_" + string.capwords(err_name.replace("DCGM_ST_", ""), "_").replace(
            "_", ""
        )
        err_val = getattr(this_module, err_name)

        def gen_new(val: int) -> Any:
            def new(typ: type[DCGMError]) -> DCGMError:
                return DCGMError.__new__(typ, val)

            return new

        new_error_class = type(class_name, (DCGMError,), {"__new__": gen_new(err_val)})
        new_error_class.__module__ = __name__
        setattr(this_module, class_name, new_error_class)
        DCGMError._valClassMapping[err_val] = new_error_class


_extractDCGMErrorsAsClasses()


def _fake_state() -> dict[str, Any]:
    """The fake engine's state file, named by ``FAKE_DCGM_STATE`` (re-read on every call)."""
    path = os.environ.get("FAKE_DCGM_STATE")
    if not path:
        return {}
    with open(path, encoding="utf-8") as f:
        state: dict[str, Any] = json.load(f)
    return state


def _LoadDcgmLibrary(libDcgmPath: str | None = None) -> None:
    """As DCGM 4's: ``libDcgmPath``/libdcgm.so.4, then each $LD_LIBRARY_PATH entry, then
    the system directories (testing/python3/dcgm_structs.py, ``_LoadDcgmLibrary``).
    Here the system directories are the state's ``library_dirs`` when it names them
    (a file named libdcgm.so.4 there counts as the library); without that key the
    library is found unless ``library_found`` is false."""
    global dcgmLib
    if dcgmLib is None:
        with libLoadLock:
            if dcgmLib is None:
                state = _fake_state()
                if "library_dirs" in state:
                    dirs = [libDcgmPath] if libDcgmPath else []
                    dirs += [d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d]
                    dirs += state["library_dirs"]
                    found = [d for d in dirs if os.path.isfile(os.path.join(d, "libdcgm.so.4"))]
                    if not found:
                        _dcgmCheckReturn(DCGM_ST_LIBRARY_NOT_FOUND)
                    log = state.get("calls_log")
                    if log:
                        with open(log, "a", encoding="utf-8") as f:
                            f.write(json.dumps({"fn": "_LoadDcgmLibrary", "from": found[0]}) + "\n")
                elif not state.get("library_found", True):
                    _dcgmCheckReturn(DCGM_ST_LIBRARY_NOT_FOUND)
                dcgmLib = object()


def _dcgmInit(libDcgmPath: str | None = None) -> None:
    _LoadDcgmLibrary(libDcgmPath)
    global _dcgmLib_refcount
    with libLoadLock:
        _dcgmLib_refcount += 1


def _dcgmCheckReturn(ret: int) -> int:
    if ret != DCGM_ST_OK:
        raise DCGMError(ret)
    return ret


def make_dcgm_version(struct: Any, ver: int) -> int:
    return int(sizeof(struct)) | (ver << 24)


class _WrappedStructure:
    def __init__(self, obj: Any) -> None:
        self.__dict__["_obj"] = obj

    def __getattr__(self, key: str) -> Any:
        value = getattr(self._obj, key)
        if isinstance(value, bytes):
            return value.decode("utf-8")
        if isclass(value):
            return _WrappedStructure(value)
        return value


class _DcgmStructure(Structure):
    """Like the real one: ``c_char`` arrays read back as ``str``, not ``bytes``."""

    def __getattribute__(self, key: str) -> Any:
        value = super().__getattribute__(key)
        if isinstance(value, bytes):
            return value.decode("utf-8")
        if isclass(value):
            return _WrappedStructure(value)
        return value

    def __setattr__(self, key: str, raw_value: Any) -> None:
        if isinstance(raw_value, str):
            raw_value = raw_value.encode("utf-8")
        super().__setattr__(key, raw_value)


class _PrintableStructure(_DcgmStructure):
    _fields_: ClassVar[Any] = []

    def __str__(self) -> str:
        parts = [f"{name}: {getattr(self, name)}" for name, _ in self._fields_]
        return self.__class__.__name__ + "(" + ", ".join(parts) + ")"

    def FieldsSizeof(self) -> int:
        return sum(int(sizeof(t)) for _, t in self._fields_)


class DcgmUnion(Union):
    def __getattribute__(self, key: str) -> Any:
        value = super().__getattribute__(key)
        if isinstance(value, bytes):
            return value.decode("utf-8")
        return value


class c_dcgmConnectV3Params_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("persistAfterDisconnect", c_uint),
        ("timeoutMs", c_uint),
    ]


c_dcgmConnectV3Params_version1 = make_dcgm_version(c_dcgmConnectV3Params_v1, 1)
c_dcgmConnectV3Params_version = c_dcgmConnectV3Params_version1


class c_dcgmGroupEntityPair_t(_PrintableStructure):
    _fields_ = [
        ("entityGroupId", c_uint32),
        ("entityId", c_uint32),
    ]


class c_dcgmGroupInfo_v3(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("count", c_uint),
        ("groupName", c_char * DCGM_MAX_STR_LENGTH),
        ("entityList", c_dcgmGroupEntityPair_t * DCGM_GROUP_MAX_ENTITIES_V2),
    ]


c_dcgmGroupInfo_version3 = make_dcgm_version(c_dcgmGroupInfo_v3, 3)


class c_dcgmDeviceIdentifiers_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("brandName", c_char * DCGM_MAX_STR_LENGTH),
        ("deviceName", c_char * DCGM_MAX_STR_LENGTH),
        ("pciBusId", c_char * DCGM_MAX_STR_LENGTH),
        ("serial", c_char * DCGM_MAX_STR_LENGTH),
        ("uuid", c_char * DCGM_MAX_STR_LENGTH),
        ("vbios", c_char * DCGM_MAX_STR_LENGTH),
        ("inforomImageVersion", c_char * DCGM_MAX_STR_LENGTH),
        ("pciDeviceId", c_uint32),
        ("pciSubSystemId", c_uint32),
        ("driverVersion", c_char * DCGM_MAX_STR_LENGTH),
        ("virtualizationMode", c_uint32),
    ]


class c_dcgmDeviceAttributes_v3(_PrintableStructure):
    # The real struct also has clockSets, thermalSettings, powerLimits, memoryUsage and
    # settings around ``identifiers``; the exporter reads only ``identifiers``.
    _fields_ = [
        ("version", c_uint),
        ("identifiers", c_dcgmDeviceIdentifiers_v1),
    ]


dcgmDeviceAttributes_version3 = make_dcgm_version(c_dcgmDeviceAttributes_v3, 3)


class c_dcgmFieldValue_v1_value(DcgmUnion):
    _fields_ = [
        ("i64", c_int64),
        ("dbl", c_double),
        ("str", c_char * DCGM_MAX_STR_LENGTH),
        ("blob", c_byte * DCGM_MAX_BLOB_LENGTH),
    ]


class c_dcgmFieldValue_v1(_PrintableStructure):
    _fields_ = [
        ("version", c_uint),
        ("fieldId", c_ushort),
        ("fieldType", c_short),
        ("status", c_int),
        ("ts", c_int64),
        ("value", c_dcgmFieldValue_v1_value),
    ]


dcgmFieldValue_version1 = make_dcgm_version(c_dcgmFieldValue_v1, 1)

DCGM_HEALTH_WATCH_PCIE = 0x1
DCGM_HEALTH_WATCH_NVLINK = 0x2
DCGM_HEALTH_WATCH_PMU = 0x4
DCGM_HEALTH_WATCH_MCU = 0x8
DCGM_HEALTH_WATCH_MEM = 0x10
DCGM_HEALTH_WATCH_SM = 0x20
DCGM_HEALTH_WATCH_INFOROM = 0x40
DCGM_HEALTH_WATCH_THERMAL = 0x80
DCGM_HEALTH_WATCH_POWER = 0x100
DCGM_HEALTH_WATCH_DRIVER = 0x200
DCGM_HEALTH_WATCH_NVSWITCH_NONFATAL = 0x400
DCGM_HEALTH_WATCH_NVSWITCH_FATAL = 0x800
DCGM_HEALTH_WATCH_CONNECTX = 0x1000
DCGM_HEALTH_WATCH_ALL = 0xFFFFFFFF

DCGM_HEALTH_RESULT_PASS = 0
DCGM_HEALTH_RESULT_WARN = 10
DCGM_HEALTH_RESULT_FAIL = 20


class c_dcgmDiagErrorDetail_t(_PrintableStructure):
    _fields_ = [
        ("msg", c_char * 1024),
        ("code", c_uint),
    ]


DCGM_HEALTH_WATCH_MAX_INCIDENTS_V2 = DCGM_GROUP_MAX_ENTITIES_V2


class c_dcgmIncidentInfo_t(_PrintableStructure):
    _fields_ = [
        ("system", c_uint),
        ("health", c_uint32),
        ("error", c_dcgmDiagErrorDetail_t),
        ("entityInfo", c_dcgmGroupEntityPair_t),
    ]


class c_dcgmHealthResponse_v5(_PrintableStructure):
    _fields_ = [
        ("version", c_uint32),
        ("overallHealth", c_uint32),
        ("incidentCount", c_uint32),
        ("incidents", c_dcgmIncidentInfo_t * DCGM_HEALTH_WATCH_MAX_INCIDENTS_V2),
    ]


dcgmHealthResponse_version5 = make_dcgm_version(c_dcgmHealthResponse_v5, 5)
