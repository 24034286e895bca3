"""Stand-in for DCGM's ``dcgm_fields`` Python binding (tests only).

Names and values mirror NVIDIA DCGM's ``testing/python3/dcgm_fields.py``
(https://github.com/NVIDIA/DCGM). DCGM 4.6 renamed the profiling fields
(``DCGM_FI_PROF_SM_ACTIVE`` -> ``DCGM_FI_PROF_SM_UTIL_RATIO``) and resolves the old
names through a deprecation alias; the numeric ids 1001-1008 are the same in 3.x, 4.x
and 4.6, which is why the exporter watches by number. Both spellings are defined here.
"""

from __future__ import annotations

# Field types (chr of c_dcgmFieldValue_v1.fieldType)
DCGM_FT_BINARY = "b"
DCGM_FT_DOUBLE = "d"
DCGM_FT_INT64 = "i"
DCGM_FT_STRING = "s"
DCGM_FT_TIMESTAMP = "t"

# Entity groups
DCGM_FE_NONE = 0
DCGM_FE_GPU = 1
DCGM_FE_VGPU = 2
DCGM_FE_SWITCH = 3
DCGM_FE_GPU_I = 4
DCGM_FE_GPU_CI = 5
DCGM_FE_LINK = 6
DCGM_FE_CPU = 7
DCGM_FE_CPU_CORE = 8

DCGM_FI_DEV_UUID = 54

# Profiling fields, DCGM 4.6 names
DCGM_FI_PROF_GR_ENGINE_UTIL_RATIO = 1001
DCGM_FI_PROF_SM_UTIL_RATIO = 1002
DCGM_FI_PROF_SM_OCCUPANCY_RATIO = 1003
DCGM_FI_PROF_TENSOR_UTIL_RATIO = 1004
DCGM_FI_PROF_DRAM_UTIL_RATIO = 1005
DCGM_FI_PROF_FP64_UTIL_RATIO = 1006
DCGM_FI_PROF_FP32_UTIL_RATIO = 1007
DCGM_FI_PROF_FP16_UTIL_RATIO = 1008

# Profiling fields, names up to DCGM 4.5
DCGM_FI_PROF_GR_ENGINE_ACTIVE = 1001
DCGM_FI_PROF_SM_ACTIVE = 1002
DCGM_FI_PROF_SM_OCCUPANCY = 1003
DCGM_FI_PROF_PIPE_TENSOR_ACTIVE = 1004
DCGM_FI_PROF_DRAM_ACTIVE = 1005
DCGM_FI_PROF_PIPE_FP64_ACTIVE = 1006
DCGM_FI_PROF_PIPE_FP32_ACTIVE = 1007
DCGM_FI_PROF_PIPE_FP16_ACTIVE = 1008
