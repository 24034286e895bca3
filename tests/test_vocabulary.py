"""The domain's shared words have one home (exporter/model/vocabulary.py): every layer
that spells them out agrees with it."""

from __future__ import annotations

import dataclasses

import pynvml

from exporter.exposition.metrics import _OCCUPANCY_FIELDS
from exporter.model import OCCUPANCY_FIELDS, Occupancy
from exporter.sim import nvml_library
from exporter.sim.scenario import GPM_METRICS
from exporter.sources.dcgm import PROFILING_FIELDS
from exporter.sources.nvml import _GPM_METRICS


def test_occupancy_fields_are_the_readings_fields_and_every_layers_keys() -> None:
    window = {"source", "window_end", "window_s"}  # where and when, not what was measured
    fields = tuple(f.name for f in dataclasses.fields(Occupancy) if f.name not in window)
    assert fields == OCCUPANCY_FIELDS
    assert tuple(_GPM_METRICS) == OCCUPANCY_FIELDS  # NVML GPM source
    assert tuple(PROFILING_FIELDS) == OCCUPANCY_FIELDS  # DCGM source
    assert tuple(_OCCUPANCY_FIELDS.values()) == OCCUPANCY_FIELDS  # exposition
    assert GPM_METRICS == OCCUPANCY_FIELDS  # scenario keys
    # the simulated library answers each GPM metric id under the same word
    assert {nvml_library._GPM_METRIC_KEYS[i] for i in _GPM_METRICS.values()} == set(
        OCCUPANCY_FIELDS
    )


def test_gpm_and_dcgm_map_each_field_to_its_own_metric() -> None:
    assert len(set(_GPM_METRICS.values())) == len(OCCUPANCY_FIELDS)
    assert len(set(PROFILING_FIELDS.values())) == len(OCCUPANCY_FIELDS)
    assert _GPM_METRICS["sm_active"] == pynvml.NVML_GPM_METRIC_SM_UTIL
    assert PROFILING_FIELDS["sm_active"] == 1002  # DCGM_FI_PROF_SM_ACTIVE


def test_served_occupancy_families_are_named_after_the_fields() -> None:
    assert set(_OCCUPANCY_FIELDS) == {f"gpu_{f}_ratio" for f in OCCUPANCY_FIELDS}
    assert "gpu_graphics_active_ratio" in _OCCUPANCY_FIELDS
