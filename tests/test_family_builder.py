"""FamilyBuilder (exporter/exposition/metrics.py): what becomes a sample, and what not."""

from __future__ import annotations

from exporter.exposition.metrics import FamilyBuilder
from exporter.exposition.render import Renderer
from tests.test_render import Families

GAUGE = "gpu_temperature_celsius"
COUNTER = "gpu_energy_joules"


def samples(builder: FamilyBuilder) -> dict[str, list[tuple[str, dict[str, str], float]]]:
    return {m.name: [(s.name, s.labels, s.value) for s in m.samples] for m in builder.families()}


def test_unknown_values_and_unserved_families_make_no_sample() -> None:
    builder = FamilyBuilder(families={GAUGE})
    builder.add(GAUGE, {"gpu": "0"}, None)
    builder.add(GAUGE, {"gpu": "1"}, 2**1100)  # past a float's range: no value
    builder.add(COUNTER, {"gpu": "0"}, 5)
    assert samples(builder) == {}


def test_empty_label_values_are_not_served_and_counters_are_named_total() -> None:
    builder = FamilyBuilder()
    builder.add(GAUGE, {"gpu": "0", "uuid": ""}, 40)
    builder.add(COUNTER, {"gpu": "0"}, 5)
    assert samples(builder) == {
        GAUGE: [(GAUGE, {"gpu": "0"}, 40.0)],
        COUNTER: [(f"{COUNTER}_total", {"gpu": "0"}, 5.0)],
    }


def test_a_callers_labels_are_copied() -> None:
    builder = FamilyBuilder()
    labels = {"gpu": "0"}
    builder.add(GAUGE, labels, 40)
    labels["gpu"] = "1"
    assert samples(builder)[GAUGE] == [(GAUGE, {"gpu": "0"}, 40.0)]


def test_negative_zero_is_served_as_zero_whatever_was_written_before() -> None:
    """The writer reuses an unchanged family's text and Python holds -0.0 == 0.0, so the
    builder serves -0.0 as 0.0: the text never depends on what came before."""
    renderer = Renderer()
    for value in (0.0, -0.0, 0.0):
        builder = FamilyBuilder()
        builder.add(GAUGE, {"gpu": "0"}, value)
        families = Families(builder.families())
        warm = renderer.text(families)  # type: ignore[arg-type]
        assert warm == Renderer().text(families)  # type: ignore[arg-type]
        assert b'gpu_temperature_celsius{gpu="0"} 0.0\n' in warm
