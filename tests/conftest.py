"""Shared fixtures."""

from __future__ import annotations

import sys
from collections.abc import Iterator

import pytest

# Modules of DCGM's Python bindings (here: the fake in tests/fake_dcgm). Python caches
# imports process-wide, so each test starts and ends without them, as a fresh process.
DCGM_BINDING_MODULES = (
    "pydcgm",
    "dcgm_structs",
    "dcgm_fields",
    "dcgm_agent",
    "dcgmvalue",
    "dcgm_field_helpers",
)


@pytest.fixture(autouse=True)
def isolated_dcgm_bindings() -> Iterator[None]:
    saved_path = list(sys.path)
    for name in DCGM_BINDING_MODULES:
        sys.modules.pop(name, None)
    yield
    sys.path[:] = saved_path
    for name in DCGM_BINDING_MODULES:
        sys.modules.pop(name, None)
