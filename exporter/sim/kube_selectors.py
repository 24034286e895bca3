"""Field selectors as the API server parses them, for every collection the stand-in serves.

The read side (sim/kube_api.py: pods, ResourceSlices) and the write side
(sim/kube_writes.py: Events) both select by ``fieldSelector``; the parser lives here, apart
from both, so that the read side can hold the write side without either importing the
other back (the layering test, tests/test_layering.py, forbids import cycles).
"""

from __future__ import annotations

from collections.abc import Mapping

FieldPath = tuple[str, ...]
Selector = tuple[tuple[FieldPath, str, bool], ...]  # (field path, value, equal)


class SelectorError(ValueError):
    """A field selector the fake (like the real server) refuses with 400."""


def parse_field_selector(text: str, fields: Mapping[str, FieldPath]) -> Selector:
    """Parse ``a=b,c!=d`` the way the API server does for the fields a collection
    supports (``fields``: selector name -> path in the object)."""
    terms: list[tuple[FieldPath, str, bool]] = []
    for raw in text.split(","):
        term = raw.strip()
        if not term:
            continue
        if "!=" in term:
            key, value = term.split("!=", 1)
            equal = False
        elif "==" in term:
            key, value = term.split("==", 1)
            equal = True
        elif "=" in term:
            key, value = term.split("=", 1)
            equal = True
        else:
            raise SelectorError(f"invalid field selector term {term!r}")
        key = key.strip()
        if key not in fields:
            raise SelectorError(f'field label not supported: "{key}"')
        terms.append((fields[key], value.strip(), equal))
    return tuple(terms)
