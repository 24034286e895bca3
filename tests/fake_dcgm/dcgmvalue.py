"""Stand-in for DCGM's ``dcgmvalue`` Python binding: the blank sentinels (tests only).

Values mirror NVIDIA DCGM's ``testing/python3/dcgmvalue.py``: a value at or above the
``*_BLANK`` sentinel of its type means "no value" (blank, not found, not supported,
not permissioned).
"""

from __future__ import annotations

DCGM_INT32_BLANK = 0x7FFFFFF0
DCGM_INT64_BLANK = 0x7FFFFFFFFFFFFFF0
DCGM_FP64_BLANK = 140737488355328.0
DCGM_STR_BLANK = "<<<NULL>>>"

DCGM_INT64_NOT_FOUND = DCGM_INT64_BLANK + 1
DCGM_FP64_NOT_FOUND = DCGM_FP64_BLANK + 1.0
DCGM_INT64_NOT_SUPPORTED = DCGM_INT64_BLANK + 2
DCGM_FP64_NOT_SUPPORTED = DCGM_FP64_BLANK + 2.0
DCGM_INT64_NOT_PERMISSIONED = DCGM_INT64_BLANK + 3
DCGM_FP64_NOT_PERMISSIONED = DCGM_FP64_BLANK + 3.0


def DCGM_INT64_IS_BLANK(val: int) -> bool:
    return val >= DCGM_INT64_BLANK


def DCGM_FP64_IS_BLANK(val: float) -> bool:
    return val >= DCGM_FP64_BLANK


def DCGM_STR_IS_BLANK(val: str) -> bool:
    return val.find("<<<") == 0 and val.find(">>>") >= 0
