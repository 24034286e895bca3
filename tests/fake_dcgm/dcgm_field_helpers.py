"""Stand-in for DCGM's ``dcgm_field_helpers`` Python binding (tests only).

Same classes and value shapes as NVIDIA DCGM's ``testing/python3/dcgm_field_helpers.py``:
``GetLatest`` yields a ``DcgmFieldValueCollection`` whose
``values[gpuId][fieldId]`` is a time series (``len``, ``[-1]``) of ``DcgmFieldValue``
with ``.value``, ``.isBlank``, ``.ts`` (usec), ``.fieldId`` and ``.fieldType``. A value
whose status is not OK, or a double at or above ``DCGM_FP64_BLANK``, is blank.
"""

from __future__ import annotations

import ctypes
from typing import Any

import dcgm_agent
import dcgm_fields
import dcgm_structs
import dcgmvalue


class DcgmFieldValue:
    def __init__(self, rawValue: Any) -> None:
        if not isinstance(rawValue, dcgm_structs.c_dcgmFieldValue_v1):
            raise Exception(f"Unexpected rawValue type {type(rawValue)}")
        self.ts = rawValue.ts
        self.fieldId = rawValue.fieldId
        self.fieldType = chr(rawValue.fieldType)
        self.isBlank = False
        self.value: Any = None
        if rawValue.status != dcgm_structs.DCGM_ST_OK:
            self.isBlank = True
            return
        if self.fieldType == dcgm_fields.DCGM_FT_DOUBLE:
            self.value = float(rawValue.value.dbl)
            self.isBlank = dcgmvalue.DCGM_FP64_IS_BLANK(self.value)
        elif self.fieldType in (dcgm_fields.DCGM_FT_INT64, dcgm_fields.DCGM_FT_TIMESTAMP):
            self.value = int(rawValue.value.i64)
            self.isBlank = dcgmvalue.DCGM_INT64_IS_BLANK(self.value)
        elif self.fieldType == dcgm_fields.DCGM_FT_STRING:
            self.value = str(rawValue.value.str)
            self.isBlank = dcgmvalue.DCGM_STR_IS_BLANK(self.value)
        else:
            raise Exception(f"Unhandled fieldType: {self.fieldType}")


class DcgmFieldValueTimeSeries:
    def __init__(self) -> None:
        self.values: list[DcgmFieldValue] = []  # in timestamp order

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, key: int) -> DcgmFieldValue:
        return self.values[key]

    def InsertValue(self, value: DcgmFieldValue) -> None:
        if not self.values or value.ts >= self.values[-1].ts:
            self.values.append(value)
            return
        for i, existing in enumerate(self.values):
            if value.ts < existing.ts:
                self.values.insert(i, value)
                return


def py_helper_dcgm_field_values_since_callback(
    gpuId: int, values: Any, numValues: int, userData: int
) -> int:
    collection = ctypes.cast(userData, ctypes.py_object).value
    collection._ProcessValues(gpuId, values[0:numValues])
    return 0


helper_dcgm_field_values_since_callback = dcgm_agent.dcgmFieldValueEnumeration_f(
    py_helper_dcgm_field_values_since_callback
)


class DcgmFieldValueCollection:
    def __init__(self, handle: Any, groupId: Any) -> None:
        self.values: dict[int, dict[int, DcgmFieldValueTimeSeries]] = {}
        self.entityValues: dict[int, Any] = {}
        self._handle = handle
        self._groupId = groupId
        self._numValuesSeen = 0
        self._nextSinceTimestamp = 0

    def _ProcessValues(self, gpuId: int, values: list[Any]) -> None:
        self._numValuesSeen += len(values)
        per_gpu = self.values.setdefault(gpuId, {})
        for rawValue in values:
            value = DcgmFieldValue(rawValue)
            per_gpu.setdefault(value.fieldId, DcgmFieldValueTimeSeries()).InsertValue(value)

    def GetLatestValues(self, fieldGroup: Any) -> None:
        ret = dcgm_agent.dcgmGetLatestValues(
            self._handle,
            self._groupId,
            fieldGroup.fieldGroupId,
            helper_dcgm_field_values_since_callback,
            self,
        )
        dcgm_structs._dcgmCheckReturn(ret)

    def EmptyValues(self) -> None:
        self.values = {}
        self._numValuesSeen = 0
