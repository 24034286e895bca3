"""Stand-in for DCGM's ``pydcgm`` Python binding (tests only).

The real ``pydcgm`` re-exports ``DcgmHandle``, ``DcgmGroup``, ``DcgmSystem``,
``DcgmFieldGroup`` (and more) from sibling modules; here the classes the exporter uses
live in this one file, with the real constructors' signatures and the same calls into
``dcgm_agent`` (NVIDIA DCGM ``testing/python3/``, https://github.com/NVIDIA/DCGM):

- ``DcgmHandle(handle=None, ipAddress=None, opMode=AUTO, persistAfterDisconnect=False,
  unixSocketPath=None, timeoutMs=0)``: ``ipAddress`` None starts an embedded host
  engine, otherwise ``dcgmConnect_v3("tcp://" + ipAddress)``; both first run
  ``dcgm_structs._dcgmInit()`` (loads libdcgm) and ``dcgm_agent.dcgmInit()``.
- ``DcgmGroup(handle, groupId=None, groupName=None, groupType=DCGM_GROUP_EMPTY)`` with
  ``.samples`` (``WatchFields``, ``GetLatest``) and ``.health`` (``Set``, ``Check``).
- ``DcgmFieldGroup(handle, name="", fieldIds=None, fieldGroupId=None)``.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, ClassVar

import dcgm_agent
import dcgm_field_helpers
import dcgm_fields
import dcgm_structs


class DcgmException(Exception):
    pass


class DcgmHandle:
    handleLock = threading.Lock()
    handles: ClassVar[list[DcgmHandle]] = []

    def __init__(
        self,
        handle: Any = None,
        ipAddress: str | None = None,
        opMode: int = dcgm_structs.DCGM_OPERATION_MODE_AUTO,
        persistAfterDisconnect: bool = False,
        unixSocketPath: str | None = None,
        timeoutMs: int = 0,
        decoratorHandle: bool | None = None,
    ) -> None:
        self._handleCreated = False
        self._persistAfterDisconnect = persistAfterDisconnect
        self._fromDecorator = bool(decoratorHandle)
        if handle is not None:
            self.handle = handle
            return
        self._ipAddress = ipAddress
        if ipAddress is not None and unixSocketPath is not None:
            raise dcgm_structs.DCGMError(dcgm_structs.DCGM_ST_BADPARAM)

        dcgm_structs._dcgmInit()
        dcgm_agent.dcgmInit()

        if ipAddress is None and unixSocketPath is None:
            self.handle = dcgm_agent.dcgmStartEmbedded(opMode)
            self.isEmbedded = True
            self._handleCreated = True
            return

        connectParams = dcgm_structs.c_dcgmConnectV3Params_v1()
        connectParams.version = dcgm_structs.c_dcgmConnectV3Params_version
        connectParams.timeoutMs = timeoutMs
        connectParams.persistAfterDisconnect = 1 if self._persistAfterDisconnect else 0
        if ipAddress is not None:
            connectToAddress = "tcp://" + ipAddress
        else:
            connectToAddress = "unix://" + str(unixSocketPath)
        self.handle = dcgm_agent.dcgmConnect_v3(connectToAddress, connectParams)
        self.isEmbedded = False
        self._handleCreated = True

    def __del__(self) -> None:
        if getattr(self, "_handleCreated", False):
            self.Shutdown()

    def GetSystem(self) -> DcgmSystem:
        return DcgmSystem(self)

    def __StopDcgm__(self) -> None:
        if self.isEmbedded:
            dcgm_agent.dcgmStopEmbedded(self.handle)
        else:
            dcgm_agent.dcgmDisconnect(self.handle)

    def FromDecorator(self) -> bool:
        return self._fromDecorator

    def Shutdown(self) -> None:
        if not self._handleCreated:
            return
        with contextlib.suppress(AttributeError):
            self.__StopDcgm__()
        self._handleCreated = False
        self.handle = None

    def GetIpAddress(self) -> str | None:
        return self._ipAddress


class DcgmSystemDiscovery:
    def __init__(self, dcgmHandle: DcgmHandle) -> None:
        self._dcgmHandle = dcgmHandle

    def GetAllGpuIds(self) -> list[int]:
        return dcgm_agent.dcgmGetAllDevices(self._dcgmHandle.handle)

    def GetAllSupportedGpuIds(self) -> list[int]:
        return dcgm_agent.dcgmGetAllSupportedDevices(self._dcgmHandle.handle)

    def GetGpuAttributes(self, gpuId: int) -> Any:
        return dcgm_agent.dcgmGetDeviceAttributes(self._dcgmHandle.handle, gpuId)


class DcgmSystem:
    def __init__(self, dcgmHandle: DcgmHandle) -> None:
        self._dcgmHandle = dcgmHandle
        self.discovery = DcgmSystemDiscovery(self._dcgmHandle)

    def UpdateAllFields(self, waitForUpdate: int) -> None:
        ret = dcgm_agent.dcgmUpdateAllFields(self._dcgmHandle.handle, waitForUpdate)
        dcgm_structs._dcgmCheckReturn(ret)

    def GetDefaultGroup(self) -> DcgmGroup:
        return DcgmGroup(self._dcgmHandle, groupId=dcgm_structs.DCGM_GROUP_ALL_GPUS)

    def GetEmptyGroup(self, groupName: str) -> DcgmGroup:
        return DcgmGroup(self._dcgmHandle, groupName=groupName)

    def GetGroupWithGpuIds(self, groupName: str, gpuIds: list[int]) -> DcgmGroup:
        newGroup = DcgmGroup(self._dcgmHandle, groupName=groupName)
        for gpuId in gpuIds:
            newGroup.AddGpu(gpuId)
        return newGroup


class DcgmGroupSamples:
    def __init__(self, dcgmHandle: DcgmHandle, groupId: Any, dcgmGroup: DcgmGroup) -> None:
        self._dcgmHandle = dcgmHandle
        self._groupId = groupId
        self._dcgmGroup = dcgmGroup

    def WatchFields(
        self, fieldGroup: DcgmFieldGroup, updateFreq: int, maxKeepAge: float, maxKeepSamples: int
    ) -> None:
        ret = dcgm_agent.dcgmWatchFields(
            self._dcgmHandle.handle,
            self._groupId,
            fieldGroup.fieldGroupId,
            updateFreq,
            maxKeepAge,
            maxKeepSamples,
        )
        dcgm_structs._dcgmCheckReturn(ret)

    def UnwatchFields(self, fieldGroup: DcgmFieldGroup) -> None:
        ret = dcgm_agent.dcgmUnwatchFields(
            self._dcgmHandle.handle, self._groupId, fieldGroup.fieldGroupId
        )
        dcgm_structs._dcgmCheckReturn(ret)

    def GetLatest(self, fieldGroup: DcgmFieldGroup) -> dcgm_field_helpers.DcgmFieldValueCollection:
        dfvc = dcgm_field_helpers.DcgmFieldValueCollection(self._dcgmHandle.handle, self._groupId)
        dfvc.GetLatestValues(fieldGroup)
        return dfvc


class DcgmGroupHealth:
    def __init__(self, dcgmHandle: DcgmHandle, groupId: Any, dcgmGroup: DcgmGroup) -> None:
        self._dcgmHandle = dcgmHandle
        self._groupId = groupId
        self._dcgmGroup = dcgmGroup

    def Set(
        self, systems: int, updateInterval: int | None = None, maxKeepAge: float | None = None
    ) -> None:
        # The real one calls dcgmHealthSet_v2 when both optional arguments are given.
        ret = dcgm_agent.dcgmHealthSet(self._dcgmHandle.handle, self._groupId, systems)
        dcgm_structs._dcgmCheckReturn(ret)

    def Get(self) -> int:
        return dcgm_agent.dcgmHealthGet(self._dcgmHandle.handle, self._groupId)

    def Check(self, version: int = dcgm_structs.dcgmHealthResponse_version5) -> Any:
        return dcgm_agent.dcgmHealthCheck(self._dcgmHandle.handle, self._groupId, version)


class DcgmGroup:
    def __init__(
        self,
        dcgmHandle: DcgmHandle,
        groupId: Any = None,
        groupName: str | None = None,
        groupType: int = dcgm_structs.DCGM_GROUP_EMPTY,
    ) -> None:
        self._dcgmHandle = dcgmHandle
        if groupId is None and groupName is None:
            raise DcgmException("Either groupId or groupName is required")
        if groupId is not None:
            self._groupId = groupId
        else:
            self._groupId = dcgm_agent.dcgmGroupCreate(
                self._dcgmHandle.handle, groupType, groupName
            )
        self.name = groupName
        self.samples: DcgmGroupSamples | None = DcgmGroupSamples(
            self._dcgmHandle, self._groupId, self
        )
        self.health: DcgmGroupHealth | None = DcgmGroupHealth(self._dcgmHandle, self._groupId, self)

    def Delete(self) -> None:
        self.samples = None
        self.health = None
        if self._groupId is not None and not self._IsGroupIdStatic():
            ret = dcgm_agent.dcgmGroupDestroy(self._dcgmHandle.handle, self._groupId)
            dcgm_structs._dcgmCheckReturn(ret)
        self._groupId = None

    def _IsGroupIdStatic(self) -> bool:
        return self._groupId in (
            dcgm_structs.DCGM_GROUP_ALL_GPUS,
            dcgm_structs.DCGM_GROUP_ALL_NVSWITCHES,
        )

    def AddGpu(self, gpuId: int) -> None:
        if self._IsGroupIdStatic():
            raise DcgmException("Can't add a GPU to a static group")
        ret = dcgm_agent.dcgmGroupAddDevice(self._dcgmHandle.handle, self._groupId, gpuId)
        dcgm_structs._dcgmCheckReturn(ret)

    def GetGpuIds(self) -> list[int]:
        groupInfo = dcgm_agent.dcgmGroupGetInfo(self._dcgmHandle.handle, self._groupId)
        return [
            groupInfo.entityList[i].entityId
            for i in range(groupInfo.count)
            if groupInfo.entityList[i].entityGroupId == dcgm_fields.DCGM_FE_GPU
        ]

    def GetId(self) -> Any:
        return self._groupId


class DcgmFieldGroup:
    def __init__(
        self,
        dcgmHandle: DcgmHandle,
        name: str = "",
        fieldIds: list[int] | None = None,
        fieldGroupId: Any = None,
    ) -> None:
        fieldIds = fieldIds or []
        self.name = name
        self.fieldIds = fieldIds
        self._dcgmHandle: DcgmHandle | None = dcgmHandle
        self.wasCreated = False
        if fieldGroupId is not None:
            self.fieldGroupId = fieldGroupId
        else:
            self.fieldGroupId = None
            self.fieldGroupId = dcgm_agent.dcgmFieldGroupCreate(
                self._dcgmHandle.handle, fieldIds, name
            )
            self.wasCreated = True

    def Delete(self) -> None:
        if self._dcgmHandle is not None and self.wasCreated:
            dcgm_agent.dcgmFieldGroupDestroy(self._dcgmHandle.handle, self.fieldGroupId)
        self.fieldGroupId = None
        self._dcgmHandle = None

    def __del__(self) -> None:
        if getattr(self, "_dcgmHandle", None) is not None:
            # The connection or the group may already be gone.
            with contextlib.suppress(dcgm_structs.DCGMError):
                self.Delete()
