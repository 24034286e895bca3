"""The cadence tiers under failure: a read that fails, or answers garbage, is unknown.

A slow-tier health fact whose read fails keeps the GPU's verdict (its series absent);
a field value that is not finite, answers another field, or is missing is that field
unknown and counted; an exception in one GPU's reads fails that GPU, never the sample.
Read through the real pynvml over the simulated libnvidia-ml, and end to end through
the real exporter on a simulated node (tests/harness.py) with the API stand-in.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pynvml
import pytest

from exporter.analysis.health import KnownFacts, with_known_facts
from exporter.model import GpuSample, RemappedRows
from exporter.sources import nvml_fields, nvml_links
from exporter.sources.nvml import NvmlSource
from tests.harness import simulated_exporter
from tests.kube_writes import status_of
from tests.test_kube_events import api, quiet, step, until_equal
from tests.test_nvml_cadence import Node

R580: dict[str, object] = {"driver_version": "580.65.06", "nvml_version": "13.580.65.06"}

# the fact, the scenario's GPU that shows it, the call that will fail, its series
FACTS = {
    "remap": ({"remapped_failure": True}, "nvmlDeviceGetRemappedRows", "gpu_row_remap_failed"),
    "ecc": ({"ecc_uncorrected": 3}, "nvmlDeviceGetTotalEccErrors", "gpu_ecc_errors_total"),
    "pages": ({"retired_pages_dbe": 70}, "nvmlDeviceGetRetiredPages", None),
}


# -- F1: a failed slow read keeps the verdict -------------------------------------------


def test_a_fact_not_read_is_judged_on_its_last_known_value_and_served_absent() -> None:
    failed = RemappedRows(0, 1, failure=True, pending=False)
    read = GpuSample(index=0, uuid="GPU-a", remapped_rows=failed, retired_pages=70)
    judged, known = with_known_facts((read,), {}, nvml_ok=True)
    assert judged == (read,)
    not_read = GpuSample(index=0, uuid="GPU-a")
    (judged_gpu,), carried = with_known_facts((not_read,), known, nvml_ok=True)
    assert (judged_gpu.remapped_rows, judged_gpu.retired_pages) == (failed, 70)
    assert carried == known
    # a fresh read replaces what was known; a GPU never read carries nothing
    fixed = GpuSample(index=0, uuid="GPU-a", remapped_rows=RemappedRows(0, 0, False, False))
    (judged_gpu,), carried = with_known_facts((fixed,), known, nvml_ok=True)
    assert judged_gpu.remapped_rows == RemappedRows(0, 0, False, False)
    assert judged_gpu.retired_pages == 70  # not read this cycle: still as last known
    assert with_known_facts((not_read,), {}, nvml_ok=True) == ((not_read,), {})


def test_known_facts_survive_nvml_down_and_a_lost_gpu_and_leave_with_the_gpu() -> None:
    known = {"GPU-a": KnownFacts(ecc_uncorrected_volatile=3)}
    assert with_known_facts((), known, nvml_ok=False) == ((), known)
    lost = GpuSample(index=0, uuid="GPU-a", error="GpuIsLost", lost=True)
    assert with_known_facts((lost,), known, nvml_ok=True) == ((lost,), known)
    other = GpuSample(index=0, uuid="GPU-b")
    assert with_known_facts((other,), known, nvml_ok=True) == ((other,), {})
    twins = (GpuSample(index=0, uuid="GPU-a"), GpuSample(index=1, uuid="GPU-a"))
    assert with_known_facts(twins, known, nvml_ok=True) == (twins, {})


@pytest.mark.parametrize("fact", sorted(FACTS))
async def test_a_failed_slow_read_of_a_health_fact_keeps_the_gpu_unhealthy(fact: str) -> None:
    """GPU 0 is unhealthy by ``fact``; the slow read at 30 s is refused (NoPermission).
    Until the next slow read at 60 s the fact's series is absent, yet the GPU stays
    unhealthy for the same reason: no GPUHealthy Event, no second GPUUnhealthy, the node
    condition True throughout."""
    gpu, call, family = FACTS[fact]
    scenario: dict[str, object] = {
        **R580,
        "node_name": f"sim-f1-{fact}",
        "gpus": [gpu, {}],
        "call_errors": [
            {"call": call, "error": "NO_PERMISSION", "gpu": 0, "from": 25, "until": 35}
        ],
    }
    argv = ["--interval", "1", "--slow-interval", "30", "--node-condition"]
    async with simulated_exporter(scenario, argv=argv) as h:
        reasons: set[str] = set()
        for _ in range(7):  # 10 s to 70 s: slow reads at 0, 30 (refused) and 60 s
            latest = await step(h)
            (gpu0,) = [g for g in latest.health if g.gpu == 0]
            assert not gpu0.healthy, f"GPU 0 healthy at {h.clock()} s"
            reasons.update(r.reason for r in gpu0.reasons)
            if 30 <= h.clock() < 60 and family is not None:
                assert not (await h.scrape()).find(family, gpu="0"), h.clock()
            await until_equal(lambda: status_of(h), ("True", "GPUUnhealthy"), "True")
        assert len(reasons) == 1
        await quiet(h)
        assert api(h).events("reason=GPUHealthy") == []
        assert len(api(h).events("reason=GPUUnhealthy")) == 1


@pytest.fixture
def sources() -> Iterator[list[NvmlSource]]:
    made: list[NvmlSource] = []
    yield made
    for source in made:
        source.close()


# -- F2/F3: field answers that are garbage, out of order or missing ---------------------


def _entry(fid: int, scope: int, value: float | int, value_type: int) -> Any:
    entry = pynvml.c_nvmlFieldValue_t()
    entry.fieldId, entry.scopeId, entry.nvmlReturn, entry.valueType = fid, scope, 0, value_type
    if value_type == pynvml.NVML_VALUE_TYPE_DOUBLE:
        entry.value.dVal = value
    else:
        entry.value.ullVal = int(value)
    return entry


def _read(entries: list[Any], keys: list[nvml_fields.FieldKey]) -> tuple[dict[Any, Any], list]:
    errors: list[tuple[str, str]] = []
    values = nvml_fields.read(
        lambda *_: entries, None, keys, lambda q, e: errors.append((q, e)), set()
    )
    return values, errors


ENERGY, REPLAY = nvml_fields.TOTAL_ENERGY, nvml_fields.PCIE_REPLAY_COUNTER
RECOVERY_L0 = nvml_fields.NVLINK_ERROR_FIELDS[(0, "recovery")]
ULL = pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_field_value_is_absent_and_counted(bad: float) -> None:
    double = pynvml.NVML_VALUE_TYPE_DOUBLE
    entries = [_entry(ENERGY, 0, bad, double), _entry(REPLAY, 0, 7, ULL)]
    values, errors = _read(entries, [(ENERGY, 0), (REPLAY, 0)])
    assert values == {(REPLAY, 0): 7}
    assert errors == [("energy", nvml_fields.INVALID_VALUE)]


def test_an_unknown_value_type_is_absent_and_counted() -> None:
    values, errors = _read([_entry(REPLAY, 0, 7, 99)], [(REPLAY, 0)])
    assert (values, errors) == ({}, [("pcie_replay", nvml_fields.INVALID_VALUE)])


def test_answers_are_matched_by_field_and_scope_never_by_position() -> None:
    keys = [(REPLAY, 0), (RECOVERY_L0, 0)]
    entries = [_entry(RECOVERY_L0, 0, 0, ULL), _entry(REPLAY, 0, 7, ULL)]  # reversed
    values, errors = _read(entries, keys)
    assert values == {(REPLAY, 0): 7, (RECOVERY_L0, 0): 0}
    assert errors == []


def test_a_field_not_answered_is_absent_and_counted() -> None:
    keys = [(REPLAY, 0), (RECOVERY_L0, 0)]
    values, errors = _read([_entry(REPLAY, 0, 7, ULL)], keys)  # fewer entries than asked
    assert values == {(REPLAY, 0): 7}
    assert errors == [("nvlink_errors", nvml_fields.NOT_ANSWERED)]
    values, errors = _read([_entry(REPLAY, 3, 7, ULL)], [(REPLAY, 0)])  # another scope
    assert (values, errors) == ({}, [("pcie_replay", nvml_fields.NOT_ANSWERED)])


def test_an_empty_answer_to_the_nvlink_count_is_unknown_and_counted() -> None:
    errors: list[tuple[str, str]] = []
    count = nvml_links.nvlink_count(lambda *_: [], None, lambda q, e: errors.append((q, e)))
    assert count is None
    assert errors == [("nvlink_count", nvml_fields.NOT_ANSWERED)]


GARBLED = {"nvlink_links": 2, "pcie_replay": 7, "nvlink_errors": {1: {"recovery": 3}}}


@pytest.mark.parametrize("mode", ["nan", "inf", "unknown_type"])
def test_a_driver_answering_garbage_fields_fails_those_fields_not_the_sample(
    mode: str, sources: list[NvmlSource]
) -> None:
    node = Node({"gpus": [{**GARBLED, "field_answers": mode}, GARBLED]}, sources)
    for t in (0.0, 1.0):
        bad, good = node.at(t)
        assert bad.error is None and good.error is None
        assert bad.energy_millijoules is None and bad.recovery_action is None
        assert good.energy_millijoules is not None and good.recovery_action == 0
        assert ("recovery_action", nvml_fields.INVALID_VALUE) in node.errors
        # energy is the slow tier's: failed at 0 s, absent (not re-read) until the next
        assert (("energy", nvml_fields.INVALID_VALUE) in node.errors) == (t == 0.0)
    assert bad.pcie_replay_count is None and good.pcie_replay_count == 7  # slow, read at 0


def test_fields_the_library_leaves_unwritten_are_unknown_not_zero(
    sources: list[NvmlSource],
) -> None:
    """The call succeeds and writes no entry: each field is counted as not answered and
    left out, never served as the successful 0 a zeroed entry would read as. The GPU
    beside it is read from the same requests, copied per call: what the library wrote
    for one GPU never shows through on the other."""
    node = Node({"gpus": [GARBLED, {**GARBLED, "field_answers": "unwritten"}]}, sources)
    plain, unwritten = node.at(0.0)
    assert unwritten.error is None
    assert plain.recovery_action == 0 and plain.pcie_replay_count == 7
    assert plain.energy_millijoules is not None
    assert unwritten.recovery_action is None
    assert unwritten.pcie_replay_count is None
    assert unwritten.energy_millijoules is None
    assert unwritten.memory_temperature_celsius is None
    assert ("recovery_action", nvml_fields.NOT_ANSWERED) in node.errors
    assert ("pcie_replay", nvml_fields.NOT_ANSWERED) in node.errors
    # nor is an unwritten link count "no NVLink": unknown, asked again next cycle
    assert ("nvlink_count", nvml_fields.NOT_ANSWERED) in node.errors
    assert plain.nvlinks and not unwritten.nvlinks


def test_fields_whose_return_code_alone_was_written_are_unknown_not_zero(
    sources: list[NvmlSource],
) -> None:
    """The library writes SUCCESS but not the type or the value: nothing is served from
    what was handed over (no 0 mW, no 0 C, no energy counter back to 0), each field is
    counted, and the PCIe byte counters are not taken for narrow ones and switched off."""
    gpu = {**GARBLED, "pcie_tx_bytes_per_s": 1e6, "memory_temperature": 70, "power_mw": 250_000}
    node = Node({"gpus": [gpu, {**gpu, "field_answers": "code_only"}]}, sources)
    plain, spoilt = node.at(0.0)
    assert plain.power_milliwatts and plain.memory_temperature_celsius == 70
    assert plain.energy_millijoules is not None and plain.recovery_action == 0
    assert spoilt.error is None
    assert spoilt.memory_temperature_celsius is None
    assert spoilt.energy_millijoules is None and spoilt.recovery_action is None
    assert spoilt.pcie_replay_count is None
    assert ("recovery_action", nvml_fields.NOT_ANSWERED) in node.errors
    assert ("memory_temperature", "ImplausibleValue") in node.errors
    assert ("nvlink_count", nvml_fields.NOT_ANSWERED) in node.errors
    device = sources[-1]._devices[1]
    assert device is not None and not device.narrow_fields


def test_a_negative_field_value_is_invalid() -> None:
    signed_int = 5  # NVML_VALUE_TYPE_SIGNED_INT
    entry = _entry(REPLAY, 0, 0, signed_int)
    entry.value.siVal = -1
    values, errors = _read([entry], [(REPLAY, 0)])
    assert (values, errors) == ({}, [("pcie_replay", nvml_fields.INVALID_VALUE)])


def test_an_nvlink_count_past_nvmls_maximum_is_invalid_not_a_size() -> None:
    errors: list[tuple[str, str]] = []
    count = _entry(pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0, 0, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT)
    count.value.uiVal = 2**32 - 1
    found = nvml_links.nvlink_count(lambda *_: [count], None, lambda q, e: errors.append((q, e)))
    assert found is None
    assert errors == [("nvlink_count", nvml_fields.INVALID_VALUE)]
    count.value.uiVal = pynvml.NVML_NVLINK_MAX_LINKS
    assert nvml_links.nvlink_count(lambda *_: [count], None, lambda q, e: None) == (
        pynvml.NVML_NVLINK_MAX_LINKS
    )


def test_an_entry_still_holding_the_unwritten_code_is_not_answered() -> None:
    entry = _entry(REPLAY, 0, 0, ULL)
    entry.nvmlReturn = nvml_fields.UNWRITTEN
    values, errors = _read([entry], [(REPLAY, 0)])
    assert (values, errors) == ({}, [("pcie_replay", nvml_fields.NOT_ANSWERED)])
    count = _entry(pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT, 0, 0, pynvml.NVML_VALUE_TYPE_UNSIGNED_INT)
    count.nvmlReturn = nvml_fields.UNWRITTEN
    errors.clear()
    found = nvml_links.nvlink_count(lambda *_: [count], None, lambda q, e: errors.append((q, e)))
    assert found is None  # not 0, "no NVLink"
    assert errors == [("nvlink_count", nvml_fields.NOT_ANSWERED)]


def test_the_request_is_handed_over_unwritten_and_built_once_per_list_of_fields() -> None:
    keys = ((REPLAY, 0), (ENERGY, 0))
    first = nvml_fields._request(keys)
    assert [(e.fieldId, e.scopeId, e.nvmlReturn) for e in first] == [
        (REPLAY, 0, nvml_fields.UNWRITTEN),
        (ENERGY, 0, nvml_fields.UNWRITTEN),
    ]
    assert nvml_fields._request(keys) is first  # built once per list of fields


def test_answers_in_another_order_serve_each_counter_as_itself(
    sources: list[NvmlSource],
) -> None:
    node = Node({"gpus": [{**GARBLED, "field_answers": "reversed"}, GARBLED]}, sources)
    reversed_gpu, plain = node.at(0.0)
    assert reversed_gpu.pcie_replay_count == plain.pcie_replay_count == 7
    assert reversed_gpu.nvlinks == plain.nvlinks
    assert [link.errors for link in plain.nvlinks][1] == (
        ("crc_flit", 0),
        ("crc_data", 0),
        ("replay", 0),
        ("recovery", 3),
    )
    assert reversed_gpu.energy_millijoules == plain.energy_millijoules
    assert node.errors == ()


def test_an_exception_in_one_gpus_reads_fails_that_gpu_only(
    sources: list[NvmlSource], caplog: pytest.LogCaptureFixture
) -> None:
    """GPU 0's board name is not UTF-8, so pynvml's decode of it raises
    UnicodeDecodeError: GPU 0 fails (counted every cycle, logged once), GPU 1 is read."""
    node = Node({"gpus": [{"name": "NVIDIA H100 \udcff"}, {}]}, sources)
    for t in (0.0, 1.0, 2.0):
        broken, fine = node.at(t)
        assert broken.error == "UnicodeDecodeError"
        assert fine.error is None and fine.memory_used_bytes is not None
        assert ("gpu", "UnicodeDecodeError") in node.errors
    logged = [r for r in caplog.records if "UnicodeDecodeError" in r.getMessage()]
    assert len(logged) == 1


# -- F4/F5: MIG layout changes and XIDs that change slow facts --------------------------

TWO_MIGS = [
    {"profile": "3g.40gb", "gpu_instance_id": 1, "memory_total": "40GiB"},
    {"profile": "3g.40gb", "gpu_instance_id": 2, "memory_total": "40GiB"},
]


def test_a_destroyed_mig_instance_is_read_again_at_the_next_cycle(
    sources: list[NvmlSource],
) -> None:
    """At 5 s one instance is destroyed (``nvidia-smi mig -dci -dgi``: no XID, same GPU
    handle); at 40 s another is created. The first read of the gone instance answers
    InvalidArgument, so the layout is read again at the next cycle, not at 30 s; a
    created instance shows at the next slow read (60 s)."""
    created = {"profile": "4g.40gb", "gpu_instance_id": 5, "uuid": "MIG-created"}
    node = Node(
        {
            "gpus": [{"mig": TWO_MIGS}],
            "timeline": [
                {"at": 5, "set": {"gpu": 0, "mig": TWO_MIGS[:1]}},
                {"at": 40, "set": {"gpu": 0, "mig": [TWO_MIGS[0], created]}},
            ],
        },
        sources,
    )
    assert len(node.at(0.0)[0].mig_instances) == 2
    (gpu,) = node.at(5.0)
    assert ("memory", "InvalidArgument") in node.errors  # the one cycle that finds out
    for t in (6.0, 7.0, 29.0, 30.0):
        (gpu,) = node.at(t)
        assert [m.gpu_instance_id for m in gpu.mig_instances] == [1], t
        assert node.errors == (), t
    for t in (41.0, 59.0):
        assert [m.gpu_instance_id for m in node.at(t)[0].mig_instances] == [1]
    (gpu,) = node.at(60.0)
    assert [(m.gpu_instance_id, m.uuid) for m in gpu.mig_instances] == [
        (1, gpu.mig_instances[0].uuid),
        (5, "MIG-created"),
    ]
    assert gpu.mig_instances[1].memory_total_bytes is not None
    assert node.errors == ()


async def test_an_xid_that_changes_a_slow_fact_reads_the_slow_tier_at_the_next_cycle() -> None:
    """XID 63 with a pending row remap on GPU 0 at 2 s, uncorrectable ECC without an XID
    on GPU 1: GPU 0 is unhealthy by row_remap_pending within two cycles of the XID, GPU 1
    only at its next slow read (15 s: GPU 1 of 2 reads at half the 30 s interval)."""
    scenario: dict[str, object] = {
        **R580,
        "node_name": "sim-f5",
        "gpus": [{}, {}],
        "timeline": [
            {"at": 2, "set": {"gpu": 0, "remapped_pending": True}},
            {"at": 2, "xid": {"gpu": 0, "code": 63}},
            {"at": 2, "set": {"gpu": 1, "ecc_uncorrected": 5}},
        ],
    }
    argv = ["--interval", "1", "--slow-interval", "30", "--kube-events", "off"]
    first: dict[tuple[int, str], float] = {}
    async with simulated_exporter(scenario, argv=argv) as h:
        while h.clock() < 31:
            await h.advance(1)
            assert h.agent.latest is not None
            for health in h.agent.latest.health:
                for reason in health.reasons:
                    first.setdefault((health.gpu, reason.reason), h.clock())
    assert first[(0, "row_remap_pending")] <= 4
    assert first[(1, "uncorrectable_ecc")] == 15
